"""`harvest run`'s pipeline against the bare forward pass of the same model, side by side.

Model: random weights, hidden 1024, 16 layers (big enough that the forward dominates), built
with the same builder as the embedded model. Each round times, over the same length-sorted
batches: (a) the bare HF forward (`model.model`, no hooks, no copies), (b) the whole harvest
pipeline (capture, bf16 copy, stats, safetensors encode, file write) at the quartile layers,
and (c) at "all". Rounds alternate so drift on a shared machine hits every arm alike; the
median round is reported. Run: `.venv/bin/python bench/bench_core.py [--prompts 48 --tokens 256]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harvest.engines.hf import HFEngine
from harvest.engines.packing import packed_inputs
from harvest.pipeline import run_job
from harvest.registry import ModelInfo
from harvest.request import HarvestRequest, ResolvedJob
from harvest.storage import Storage
from harvest.tiny_model import build_tiny_model
from harvest.tokenize import TokenizedPrompt

BENCH_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64)


def bench_model(home: Path) -> ModelInfo:
    path = home / "bench-1024x16"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, config_overrides=BENCH_CONFIG)
    return ModelInfo(name="bench-1024x16", weights=str(path), path=path, lane="small", harvest=True, inline=True,
                     n_layers=16, hidden_size=1024, max_model_len=2048, max_activation_prompt_tokens=512, builtin=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=256, help="longest prompt; lengths spread from half of it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--home", default=".harvest/bench")
    args = parser.parse_args()

    model = bench_model(Path(args.home))
    engine = HFEngine(model)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.tokens // 2, args.tokens + 1, (args.prompts,), generator=generator).tolist()
    vocab = engine.hf_model.config.vocab_size
    prompts = [[0] + torch.randint(2, vocab, (n - 1,), generator=generator).tolist() for n in lengths]
    tokenized = [TokenizedPrompt(ids=p, n_original=len(p)) for p in prompts]
    total = sum(lengths)
    passes = engine.passes(lengths)

    @torch.inference_mode()
    def bare() -> float:
        started = time.perf_counter()
        for plan in passes:  # the engine's own packed passes, nothing captured
            ids, positions, _ = packed_inputs(prompts, plan)
            engine.hf_model.model(input_ids=ids, position_ids=positions, use_cache=False)
        return time.perf_counter() - started

    def harvest(layers) -> float:
        request = HarvestRequest(model=model.name, prompts=["x"] * len(prompts), layers=layers, shard_size=16)
        job = ResolvedJob(request=request, model=model, layers=list(range(16)) if layers == "all" else [4, 8, 12], directions=None)
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            run_job(job, Storage(f"file://{out}"), engine, "bench", tokenized=tokenized)
            return time.perf_counter() - started

    arms = {"bare forward": bare, "harvest, quartile layers": lambda: harvest(None), "harvest, all layers": lambda: harvest("all")}
    bare()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            times[name].append(arm())
    base = statistics.median(times["bare forward"])
    print(f"model hidden 1024 x 16 layers (float32, CPU, {torch.get_num_threads()} threads); {args.prompts} prompts, {total} tokens; median of {args.rounds} rounds")
    print(f"{'arm':28s} {'seconds':>8s} {'tokens/s':>10s} {'vs bare':>8s}")
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"{name:28s} {seconds:8.2f} {total / seconds:10.0f} {base / seconds:8.2f}")


if __name__ == "__main__":
    main()
