"""The GPU half of `bench/gpu.sh`: vLLM-engine parity on the GPU, then throughput at 8B shapes.

`parity`: the embedded model (float32 checkpoint, so float32 on the GPU too) through the vLLM
engine against HF `hidden_states` run one prompt at a time, with the CPU tests' tolerances:
bf16 shards within one bf16 rounding plus 1e-4 of the layer's largest value, the float32
stream (projected onto the basis) and 8-direction projections within 1e-4 of it, statistics
against numpy float64, and a missed layer failing with CaptureFailed. Exit status 1 on any
failure.

`bench`: a random-weight checkpoint with Llama-3.1-8B's block shapes (hidden 4096, 32 layers,
32 heads, 8 KV heads, head_dim 128, MLP 14336; the embedding table is the embedded
tokenizer's, which changes nothing in the blocks), made on the GPU in bf16, no download.
Harvest tokens/s against plain prefill on the same `vllm.LLM` and prompts, at the quartile
layers, at "all" and with 8 directions at the quartiles; one table on stdout (and in
$OUT/gpu_table.md when OUT is set).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harvest.capture import CaptureSpec  # noqa: E402
from harvest.errors import CaptureFailed  # noqa: E402
from harvest.registry import ModelInfo  # noqa: E402
from harvest.tiny_model import build_tiny_model  # noqa: E402
from harvest.tokenize import load_tokenizer  # noqa: E402

__all__ = ["LLAMA_8B_SHAPES", "build_8b_shapes", "parity", "bench"]

LLAMA_8B_SHAPES = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
)
FP32_RTOL = 1e-4
SMOKE_SHAPES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
"""`--smoke`: the same code paths on a small model, to check the script on a CPU machine."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model_info(name: str, path: Path, n_layers: int, hidden: int, max_len: int) -> ModelInfo:
    return ModelInfo(name=name, weights=str(path), path=path, lane="small", harvest=True, inline=True,
                     n_layers=n_layers, hidden_size=hidden, max_model_len=max_len, max_activation_prompt_tokens=max_len, builtin=True)


def build_8b_shapes(path: Path, max_len: int) -> Path:
    """Tokenizer from the embedded builder; bf16 random weights of 8B's shapes made on the GPU."""
    if (path / "config.json").exists():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    staging = path.with_name(path.name + ".tok")
    build_tiny_model(staging, config_overrides=dict(num_hidden_layers=1))
    tokenizer = load_tokenizer(staging)
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=max_len, tie_word_embeddings=False, torch_dtype="bfloat16", **LLAMA_8B_SHAPES,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialised where it is fast
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (staging / name).exists():
            shutil.copy(staging / name, path / name)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def parity() -> int:
    from harvest.engines.hf import load_hf_model
    from harvest.engines.vllm import VLLMEngine
    from harvest.registry import load_registry
    from tests.reference import hf_reference_layers

    tiny = load_registry().get("llama-tiny")
    engine = VLLMEngine(tiny, max_num_batched_tokens=64, max_num_seqs=8, gpu_memory_utilization=0.05)
    hf_model = load_hf_model(tiny)
    tokenizer = load_tokenizer(tiny.path)
    texts = ["Hi", "The capital of France is Paris, and the capital of Italy is",
             "Once upon a time there was a small village by the sea where " * 30, "A",
             "Numbers: " + ", ".join(str(i) for i in range(40))]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    layers = [0, 3, 7]
    refs = [hf_reference_layers(hf_model, p, layers) for p in prompts]
    failures = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        if not ok:
            failures.append(name)

    def scale(ref):
        return np.abs(ref).max(axis=(1, 2), keepdims=True)

    shard = engine.capture(prompts, CaptureSpec(layers=layers))
    worst = max(float((np.abs(v.float().numpy() - r) / (np.abs(r) * 2.0**-8 + FP32_RTOL * scale(r))).max()) for v, r in zip(shard.values, refs))
    check("bf16 shards vs HF float32", worst <= 1.0, f"worst error / tolerance = {worst:.3f}")

    basis = np.eye(tiny.hidden_size, dtype=np.float32)
    shard = engine.capture(prompts, CaptureSpec(layers=layers, directions=basis))
    worst = max(float((np.abs(v.numpy() - r) / scale(r)).max()) for v, r in zip(shard.values, refs))
    check("float32 stream vs HF float32", worst <= FP32_RTOL, f"worst error / layer max = {worst:.2e}")

    rng = np.random.default_rng(0)
    unit = rng.standard_normal((8, tiny.hidden_size)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    shard = engine.capture(prompts, CaptureSpec(layers=layers, directions=unit))
    projected = [r @ unit.T for r in refs]
    worst = max(float((np.abs(v.numpy() - r) / scale(r)).max()) for v, r in zip(shard.values, projected))
    check("8-direction projections", worst <= FP32_RTOL, f"worst error / layer max = {worst:.2e}")
    counted = np.concatenate([p[:, 1:] for p in projected], axis=1).astype(np.float64)
    mean_err = float(np.abs(shard.stats.mean.numpy() - counted.mean(axis=1)).max() / np.abs(counted).max())
    std_err = float(np.abs(shard.stats.std.numpy() - counted.std(axis=1)).max() / np.abs(counted).max())
    check("statistics vs numpy float64", shard.stats.count == counted.shape[1] and max(mean_err, std_err) <= FP32_RTOL,
          f"count {shard.stats.count}, mean {mean_err:.2e}, std {std_err:.2e}")

    import harvest.engines.vllm_worker as module

    real = module._layer_modules
    module._layer_modules = lambda worker: {k: m for k, m in real(worker).items() if k != 3}
    try:
        engine.capture(prompts, CaptureSpec(layers=layers))
        check("missed layer fails", False, "no error")
    except CaptureFailed as exc:
        check("missed layer fails", "missed layer" in str(exc), str(exc))
    finally:
        module._layer_modules = real
    engine.close()
    return 1 if failures else 0


def bench(home: Path, n_prompts: int, min_len: int, max_len: int, rounds: int) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from harvest.engines.vllm import VLLMEngine

    started = time.perf_counter()
    path = build_8b_shapes(home / ("llama-8b-shapes" if LLAMA_8B_SHAPES["hidden_size"] == 4096 else "smoke-shapes"), max_len=8192)
    build_s = time.perf_counter() - started
    model = _model_info("llama-8b-shapes", path, 32, LLAMA_8B_SHAPES["hidden_size"], 8192)
    started = time.perf_counter()
    engine = VLLMEngine(model, gpu_memory_utilization=0.80)
    start_s = time.perf_counter() - started

    vocab = len(load_tokenizer(path))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_len, max_len + 1, (n_prompts,), generator=generator).tolist()
    prompts = [[0] + torch.randint(2, vocab, (n - 1,), generator=generator).tolist() for n in lengths]
    total = sum(lengths)
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((8, model.hidden_size)).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    quartiles = [8, 16, 24]

    def plain() -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    arms = {
        "plain vLLM prefill": plain,
        "harvest, quartiles [8,16,24]": lambda: engine.capture(prompts, CaptureSpec(layers=quartiles)),
        "harvest, all 32 layers": lambda: engine.capture(prompts, CaptureSpec(layers=list(range(32)))),
        "harvest, 8-dir proj, quartiles": lambda: engine.capture(prompts, CaptureSpec(layers=quartiles, directions=directions)),
    }
    for arm in arms.values():  # warm-up: kernels, pinned-memory pool
        arm()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            _sync()
            t0 = time.perf_counter()
            arm()
            _sync()
            times[name].append(time.perf_counter() - t0)
    engine.close()

    base = statistics.median(times["plain vLLM prefill"])
    lines = [
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; random bf16 weights, Llama-3.1-8B block shapes; {n_prompts} prompts of "
        f"{min_len}-{max_len} tokens, {total} tokens; median of {rounds} rounds after a warm-up; model build {build_s:.0f} s, "
        f"vLLM start {start_s:.0f} s; vLLM {engine.versions()['vllm']}, torch {torch.__version__}",
        "",
        "| arm | seconds | tokens/s | vs plain prefill |",
        "|---|---:|---:|---:|",
    ]
    for name, values in times.items():
        seconds = statistics.median(values)
        lines.append(f"| {name} | {seconds:.2f} | {total / seconds:,.0f} | {base / seconds:.3f} |")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_table.md").write_text(table + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["parity", "bench"])
    parser.add_argument("--home", default="/tmp/harvest-gpu")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="small model (CPU check of the script)")
    args = parser.parse_args()
    if args.smoke:
        LLAMA_8B_SHAPES.update(SMOKE_SHAPES)
    if args.what == "parity":
        return parity()
    return bench(Path(args.home), args.prompts, args.min_len, args.max_len, args.rounds)


if __name__ == "__main__":
    sys.exit(main())
