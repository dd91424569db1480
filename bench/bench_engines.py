"""The vLLM engine against the HF engine, and harvest capture against plain vLLM prefill.

Model: random weights, hidden 1024, 16 layers (the forward dominates), built with the same
builder as the embedded model. One process holds one HF engine and one vLLM engine; plain
prefill runs on the SAME `vllm.LLM` with no capture session (`max_tokens=1`, so the only
decode-side work is one sampled token per prompt, in both arms). Arms run in rotation each
round so drift on a shared machine hits them alike; the median round is reported.

Run: `.venv/bin/python bench/bench_engines.py [--prompts 16 --tokens 128 --rounds 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from harvest.capture_spec import CaptureSpec
from harvest.registry import ModelInfo
from harvest.tiny_model import build_tiny_model
from harvest.tokenize import load_tokenizer

__all__ = ["BENCH_CONFIG", "bench_model", "main"]

BENCH_CONFIG = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64
)
QUARTILES = [4, 8, 12]


def bench_model(home: Path) -> ModelInfo:
    path = home / "engines-1024x16"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, config_overrides=BENCH_CONFIG)
    return ModelInfo(
        name="engines-1024x16", weights=str(path), path=path, lane="small", harvest=True, inline=True,
        n_layers=16, hidden_size=1024, max_model_len=2048, max_activation_prompt_tokens=512, builtin=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128, help="longest prompt; lengths spread from half of it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--home", default=".harvest/bench")
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from harvest.engines.hf import HFEngine
    from harvest.engines.vllm import VLLMEngine

    model = bench_model(Path(args.home))
    started = time.perf_counter()
    vllm_engine = VLLMEngine(model)
    vllm_start = time.perf_counter() - started
    hf_engine = HFEngine(model)

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.tokens // 2, args.tokens + 1, (args.prompts,), generator=generator).tolist()
    vocab = len(load_tokenizer(model.path))  # vLLM refuses ids its tokenizer does not know
    prompts = [[0] + torch.randint(2, vocab, (n - 1,), generator=generator).tolist() for n in lengths]
    total = sum(lengths)
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((8, 1024)).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)

    def plain_prefill() -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        vllm_engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    arms = {
        "plain vLLM prefill": plain_prefill,
        "vLLM harvest, quartiles": lambda: vllm_engine.capture(prompts, CaptureSpec(layers=QUARTILES)),
        "vLLM harvest, all": lambda: vllm_engine.capture(prompts, CaptureSpec(layers=list(range(16)))),
        "vLLM harvest, 8-dir proj": lambda: vllm_engine.capture(prompts, CaptureSpec(layers=QUARTILES, directions=directions)),
        "HF harvest, quartiles": lambda: hf_engine.capture(prompts, CaptureSpec(layers=QUARTILES)),
    }
    plain_prefill()  # warm-up, both engines
    hf_engine.capture(prompts[:2], CaptureSpec(layers=QUARTILES))
    # Wall time, and this process's CPU time: on a shared 2-core machine the CPU seconds
    # are the steadier measure (other people's jobs stretch wall time, not our CPU time).
    times: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            t0, c0 = time.perf_counter(), time.process_time()
            arm()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    median = {name: statistics.median(values) for name, values in times.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu.items()}
    plain = median["plain vLLM prefill"]
    hf = median["HF harvest, quartiles"]
    print(
        f"model hidden 1024 x 16 layers, float32 on CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads for both engines); "
        f"{args.prompts} prompts, {total} tokens; median of {args.rounds} rounds; vLLM start {vllm_start:.1f} s"
    )
    print(f"{'arm':26s} {'wall s':>7s} {'tokens/s':>9s} {'vs plain':>9s} {'vs HF':>6s} {'CPU s':>7s} {'CPU vs plain':>13s} {'CPU vs HF':>10s}")
    cpu_plain, cpu_hf = cpu_median["plain vLLM prefill"], cpu_median["HF harvest, quartiles"]
    for name, seconds in median.items():
        c = cpu_median[name]
        print(
            f"{name:26s} {seconds:7.2f} {total / seconds:9.0f} {plain / seconds:9.2f} {hf / seconds:6.2f}"
            f" {c:7.2f} {cpu_plain / c:13.2f} {cpu_hf / c:10.2f}"
        )
    vllm_engine.close()


if __name__ == "__main__":
    main()
