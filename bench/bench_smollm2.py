"""The real model `smollm2-135m` (30 blocks, hidden 576): what a harvest and an inline decode
cost on it, side by side with the bare model, with the shipped defaults.

Arms (one corpus of real sentences, length-sorted batches as the HF engine makes them):
1. `harvest run` as a user runs it, one whole process per engine (`HARVEST_ENGINE=hf|vllm`,
   quartile layers): wall seconds, and the forward seconds its manifest records.
2. Steady state in this process, engines loaded once: the bare HF forward of the same batches
   (`model.model`, no hooks, no copies), and the whole pipeline (`run_job`: capture, bf16
   copy, statistics, encode, write) on the HF and the vLLM engine, quartile layers and "all".
   Arms alternate each round; the median round is reported.
3. Inline decode: greedy completions of `--decode-tokens` tokens for `--decode-prompts`
   prompts in one batch, with every layer captured against no capture, per engine (tokens/s).
4. Bytes per token per layer, from the manifests (bf16: 2 × 576 = 1,152 plus file overhead).

Run: `.venv/bin/python bench/bench_smollm2.py [--prompts 64 --rounds 3]` (after `make install`;
the first use converts the GGUF into `$HARVEST_HOME/models/smollm2-135m/`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harvest.engines.base import SamplingSpec
from harvest.engines.hf import HFEngine
from harvest.engines.packing import packed_inputs
from harvest.pipeline import run_job
from harvest.registry import load_registry
from harvest.request import HarvestRequest, resolve_job
from harvest.storage import Storage
from harvest.tokenize import load_tokenizer, tokenize_prompts
from harvest.settings import get_settings

__all__ = ["corpus", "main"]

MODEL = "smollm2-135m"
SUBJECTS = ["The committee", "A young engineer", "My grandmother", "The city council", "Every morning the baker",
            "The old lighthouse keeper", "Our research group", "A migrating flock of geese"]
CLAUSES = ["decided after a long and careful discussion that", "wrote in a letter to the newspaper that",
           "remembered, while walking along the river at dusk, that", "explained to the visitors from abroad that",
           "was surprised to learn from the morning report that", "argued with some conviction that"]
ENDINGS = ["the bridge would need to be rebuilt before winter.", "nothing tastes better than fresh bread.",
           "the northern route was safer than the coastal one.", "the library should stay open late on Fridays.",
           "prime numbers become rarer as they grow larger.", "the festival had raised more money than ever."]


def corpus(n: int) -> list[str]:
    sentences = [f"{s} {c} {e}" for s in SUBJECTS for c in CLAUSES for e in ENDINGS]
    return sentences[:n]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def whole_process(engine: str, prompts_file: Path, home: Path) -> dict:
    """`harvest run` in a fresh process, as a user runs it; wall seconds and the manifest."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "HARVEST_ENGINE": engine, "HARVEST_HOME": str(home)}
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fleet.cli", "run", "--model", MODEL, "--prompts", str(prompts_file),
                        "--out", out], check=True, env=env, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        manifest = json.loads((Path(out) / "manifest.json").read_text())
    return {"wall_s": wall, "manifest": manifest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-prompts", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()

    registry = load_registry(get_settings())
    model = registry.get(MODEL)  # converts the GGUF on first use
    home = model.path.parent.parent
    texts = corpus(args.prompts)
    tokenizer = load_tokenizer(model.require_path())
    tokenized = tokenize_prompts(tokenizer, texts, add_special_tokens=True, max_len=model.max_model_len)
    ids = [t.ids for t in tokenized]
    n_tokens = sum(len(p) for p in ids)
    print(f"{MODEL}: {len(texts)} prompts, {n_tokens} tokens ({min(map(len, ids))}-{max(map(len, ids))} a prompt)")

    engines = ["hf"] + ([] if args.skip_vllm else ["vllm"])
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory() as work:
        prompts_file = Path(work) / "corpus.jsonl"
        prompts_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        processes = {name: whole_process(name, prompts_file, home) for name in engines}
    for name, result in processes.items():
        timings = result["manifest"]["timings"]
        rows.append((f"`harvest run`, whole process, {name} (quartiles)", result["wall_s"],
                     f"load {timings['load_s']:.1f} s, forward {timings['forward_s']:.2f} s"))

    hf = HFEngine(model)
    loaded = {"hf": hf}
    if not args.skip_vllm:
        from harvest.engines.vllm import VLLMEngine

        loaded["vllm"] = VLLMEngine(model)
    passes = hf.passes([len(p) for p in ids])

    @torch.inference_mode()
    def bare() -> float:
        started = time.perf_counter()
        for plan in passes:  # the engine's own packed passes, nothing captured
            input_ids, positions, _ = packed_inputs(ids, plan)
            hf.hf_model.model(input_ids=input_ids, position_ids=positions, use_cache=False)
        return time.perf_counter() - started

    manifests: dict[str, dict] = {}

    def pipeline(engine, layers) -> float:
        job = resolve_job(HarvestRequest(model=MODEL, prompts=texts, layers=layers), registry)
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            run_job(job, Storage(f"file://{out}"), engine, "bench", tokenized=tokenized)
            seconds = time.perf_counter() - started
            manifests[str(layers)] = json.loads((Path(out) / "manifest.json").read_text())
        return seconds

    arms = {"bare HF forward (`model.model`, same batches)": bare}
    for name, engine in loaded.items():
        arms[f"pipeline, {name}, quartile layers"] = lambda e=engine: pipeline(e, None)
        arms[f"pipeline, {name}, all 30 layers"] = lambda e=engine: pipeline(e, "all")
    for arm in arms.values():
        arm()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            times[name].append(arm())
    base = _median(times["bare HF forward (`model.model`, same batches)"])
    steady = [(name, _median(t), f"{n_tokens / _median(t):,.0f} tokens/s, {base / _median(t):.2f}× bare") for name, t in times.items()]

    decode_prompts = ids[: args.decode_prompts]
    sampling = [SamplingSpec(max_tokens=args.decode_tokens, temperature=0.0)] * len(decode_prompts)
    decode = []
    for name, engine in loaded.items():
        for label, layers in (("plain generation", None), ("every layer captured", list(range(model.n_layers)))):
            engine.generate(decode_prompts, sampling, layers)  # warm-up
            runs = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                out = engine.generate(decode_prompts, sampling, layers)
                runs.append((time.perf_counter() - started, sum(len(g.token_ids) for g in out)))
            seconds, generated = sorted(runs)[len(runs) // 2]
            decode.append((f"{name}, {label}", seconds, f"{generated / seconds:.1f} tokens/s"))

    print("\n| arm | seconds | note |\n|---|---:|---|")
    for name, seconds, note in rows + steady + decode:
        print(f"| {name} | {seconds:.2f} | {note} |")
    print("\n| layers | tokens | shard bytes | bytes / token / layer |\n|---|---:|---:|---:|")
    for layers, manifest in manifests.items():
        shard_bytes = sum(s["bytes"] for s in manifest["shards"])
        per = shard_bytes / manifest["tokens"] / len(manifest["layer_indices"])
        print(f"| {layers if layers != 'None' else 'quartiles'} {manifest['layer_indices'][:3]}… | {manifest['tokens']} | {shard_bytes:,} | {per:,.0f} |")
    for engine in loaded.values():
        engine.close()


if __name__ == "__main__":
    main()
