"""vLLM-engine parity on the device, with the CPU tests' tolerances (`tests/test_engine_vllm.py`).

The embedded model through `VLLMEngine` in float32 (asked for explicitly: vLLM's `dtype="auto"`
turns a float32 checkpoint into bf16 on a GPU, vllm/config/model.py `_resolve_auto_dtype`),
against HF `hidden_states` of each prompt run alone in float32 on the CPU: bf16 shards within
one bf16 rounding plus 1e-4 of the layer's largest value; the float32 stream (a projection
onto the basis) and 8-direction projections within 1e-4 of it; statistics against numpy
float64; a missed layer failing with `CaptureFailed`. On a GPU it asks for vLLM's
FlexAttention backend (FlashAttention takes only 16-bit dtypes, and the Triton one vLLM would
pick rounds float32 like TF32), so this also checks the capture's row map on a second
attention backend; the 8B-shaped bench runs the bf16 default one.
"""

from __future__ import annotations

import numpy as np
import torch

from harvest.capture_spec import CaptureSpec
from harvest.errors import CaptureFailed
from harvest.settings import get_settings

__all__ = ["parity"]

FP32_RTOL = 1e-4


def parity(on_gpu: bool) -> list[tuple[str, bool, str]]:
    """`(check, passed, detail)` for each check; an exception in one check fails only it."""
    from harvest.engines.hf import load_hf_model
    from harvest.engines.vllm import VLLMEngine
    from harvest.registry import load_registry
    from harvest.tokenize import load_tokenizer
    from testbed.reference import hf_reference_layers

    tiny = load_registry(get_settings()).get("llama-tiny")
    # FLEX_ATTENTION on a GPU: vLLM's default float32 backend there (TRITON_ATTN) rounds like
    # TF32 (5e-4 of a layer's largest value at block 0, 3.7e-3 at block 7, measured on an H200),
    # which would hide a capture error of that size; with FlexAttention: 1.3e-5.
    extra = dict(dtype="float32", gpu_memory_utilization=0.10, attention_backend="FLEX_ATTENTION") if on_gpu else {}
    engine = VLLMEngine(tiny, max_num_batched_tokens=64, max_num_seqs=8, **extra)
    hf_model = load_hf_model(tiny, torch.device("cpu"))  # the float32 reference, on the CPU
    tokenizer = load_tokenizer(tiny.path)
    texts = ["Hi", "The capital of France is Paris, and the capital of Italy is",
             "Once upon a time there was a small village by the sea where " * 30, "A",
             "Numbers: " + ", ".join(str(i) for i in range(40))]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    layers = [0, 3, 7]
    refs = [hf_reference_layers(hf_model, p, layers) for p in prompts]
    results: list[tuple[str, bool, str]] = []

    def scale(ref):
        return np.abs(ref).max(axis=(1, 2), keepdims=True)

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:300]
        results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    def bf16_shards():
        shard = engine.capture(prompts, CaptureSpec(layers=layers))
        worst = max(float((np.abs(v.float().numpy() - r) / (np.abs(r) * 2.0**-8 + FP32_RTOL * scale(r))).max()) for v, r in zip(shard.values, refs))
        return worst <= 1.0, f"worst error / tolerance {worst:.3f}"

    def fp32_stream():
        basis = np.eye(tiny.hidden_size, dtype=np.float32)
        shard = engine.capture(prompts, CaptureSpec(layers=layers, directions=basis))
        worst = max(float((np.abs(v.numpy() - r) / scale(r)).max()) for v, r in zip(shard.values, refs))
        return worst <= FP32_RTOL, f"worst error / layer max {worst:.2e}"

    def projections_and_stats():
        unit = np.random.default_rng(0).standard_normal((8, tiny.hidden_size)).astype(np.float32)
        unit /= np.linalg.norm(unit, axis=1, keepdims=True)
        shard = engine.capture(prompts, CaptureSpec(layers=layers, directions=unit))
        projected = [r @ unit.T for r in refs]
        worst = max(float((np.abs(v.numpy() - r) / scale(r)).max()) for v, r in zip(shard.values, projected))
        counted = np.concatenate([p[:, 1:] for p in projected], axis=1).astype(np.float64)
        top = np.abs(counted).max()
        mean_err = float(np.abs(shard.stats.mean.numpy() - counted.mean(axis=1)).max() / top)
        std_err = float(np.abs(shard.stats.std.numpy() - counted.std(axis=1)).max() / top)
        ok = worst <= FP32_RTOL and shard.stats.count == counted.shape[1] and max(mean_err, std_err) <= FP32_RTOL
        return ok, f"projections {worst:.2e}; stats count {shard.stats.count}, mean {mean_err:.2e}, std {std_err:.2e}"

    def missed_layer():
        import harvest.engines.vllm_worker as module

        real = module._layer_modules
        module._layer_modules = lambda worker: {k: m for k, m in real(worker).items() if k != 3}
        try:
            engine.capture(prompts, CaptureSpec(layers=layers))
            return False, "no error"
        except CaptureFailed as exc:
            return "missed layer" in str(exc), str(exc)
        finally:
            module._layer_modules = real

    check("bf16 shards vs HF float32", bf16_shards)
    check("float32 stream vs HF float32", fp32_stream)
    check("8-direction projections + statistics vs numpy float64", projections_and_stats)
    check("a missed layer fails the shard", missed_layer)
    engine.close()
    return results
