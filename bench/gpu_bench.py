"""The parts of `bench/gpu.sh`, one process each: `hf`, then `vllm` and `parity`; `table` prints.

`hf`: the HF engine on a checkpoint of Llama-3.1-8B's shapes (random bf16 weights built on
the device, saved, loaded by `HFEngine(model)` through `load_hf_model`; `bench/gpu_checkpoint.py`).
Arms, interleaved each round on the same prompts: a bare `model.model` forward over the same
packed passes the engine makes (the baseline), and harvest (`HFEngine.capture`, hooks +
`PromptReducer`: statistics and the copy to host) at the quartile blocks [8, 16, 24], at all
32, projected onto 8 directions at the quartiles, and at the quartiles into a shard file on
local disk as a run writes it (`StagedShard` as the sink); then the capture's values against
`output_hidden_states`, and a shard file written through the sink against the values
returned without one (also in the vLLM part). Then co-batching
(`HARVEST_ENGINE_COBATCH_SHARDS`, `harvest.warm.cobatch`): 4 jobs at once on the one engine,
each asking for its shards one after another, with 1 shard per engine call (each alone, the
default) against up to 4 (the waiting shards co-batched), interleaved: the ratio decides the
default on a GPU (it was measured only on the CPU, 0.82x).
`vllm`: the same arms on `VLLMEngine(model)` against plain vLLM prefill (`max_tokens=1`, no
capture session) of the same `vllm.LLM`, the same co-batching pair, plus one prompt's quartile values against the HF
part's (bf16 on both, so a loose figure, reported rather than judged). Without vLLM it only
records that it was skipped and why.
`parity`: `bench/gpu_parity.py` (llama-tiny in float32 against HF, the CPU tests' tolerances).

Sizes: default 48 prompts of 16-1,024 tokens, log-uniform as real text's lengths spread
(the packed passes are what that measures), 3 rounds; `--quick` (GPU_BENCH_QUICK=1) 16
prompts of 128-256, 1 round; `--smoke` (GPU_BENCH_SMOKE=1) the same code at a CPU's size.
`GPU_BENCH_DEADLINE` (epoch seconds, set by gpu.sh) cuts rounds short so a part always
records what it measured before its time runs out. Engines are constructed explicitly
(`HFEngine`, `VLLMEngine`), never through `HARVEST_ENGINE`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_checkpoint import LLAMA_8B_SHAPES, SMOKE_SHAPES, block_params, build_checkpoint  # noqa: E402
from gpu_results import Results  # noqa: E402

from harvest.capture_spec import CaptureSpec  # noqa: E402
from harvest.layers import default_layers  # noqa: E402
from harvest.shard.file import StagedShard  # noqa: E402

__all__ = ["main"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _deadline() -> float:
    return float(os.environ.get("GPU_BENCH_DEADLINE", "inf"))


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run)"


def _prompts(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    """Random token ids after a BOS (id 0), lengths log-uniform in [lo, hi] (many short, a few
    long, as paragraphs of real text are); the same for every part."""
    generator = torch.Generator().manual_seed(0)
    spread = torch.rand(n, generator=generator) * (np.log(hi) - np.log(lo)) + np.log(lo)
    lengths = [max(lo, min(hi, round(float(np.exp(x))))) for x in spread]
    return [[0] + torch.randint(2, vocab, (k - 1,), generator=generator).tolist() for k in lengths]


def _directions(hidden: int) -> np.ndarray:
    d = np.random.default_rng(0).standard_normal((8, hidden)).astype(np.float32)
    return d / np.linalg.norm(d, axis=1, keepdims=True)


def into_shard_file(engine, prompts: list[list[int]], layers: list[int], hidden: int, folder: Path) -> None:
    """One shard as a run writes it: the capture's sink is a `StagedShard` on local disk
    (each prompt's values at their offset as they come), discarded after."""
    staged = StagedShard(str(folder / "bench-shard.safetensors"), range(len(prompts)), prompts, len(layers), hidden, torch.bfloat16)
    try:
        engine.capture(prompts, CaptureSpec(layers=layers), sink=staged.put)
    finally:
        staged.discard()


def check_shard_file(engine, prompts: list[list[int]], layers: list[int], hidden: int, folder: Path, results: Results, label: str) -> None:
    """A shard written through the sink (hand-overs overlapping the next batch or group on a
    GPU), read back with safetensors, against the values the same capture returns without one."""
    from safetensors.torch import load_file

    path = folder / "check-shard.safetensors"
    staged = StagedShard(str(path), range(len(prompts)), prompts, len(layers), hidden, torch.bfloat16)
    try:
        engine.capture(prompts, CaptureSpec(layers=layers), sink=staged.put)
        staged.seal()
        written = load_file(str(path))
    finally:
        staged.discard()
        path.unlink(missing_ok=True)
    returned = engine.capture(prompts, CaptureSpec(layers=layers)).values
    differ = [i for i, value in enumerate(returned) if not torch.equal(written[f"prompt_{i}"], value)]
    results.note(f"{label} shard file check: {'PASS' if not differ else 'FAIL'}, {len(prompts)} prompts written through the sink "
                 f"and read back equal the values returned without one" + (f" except prompts {differ[:8]}" if differ else ""))


@torch.inference_mode()
def check_hf_capture(engine, prompts: list[list[int]], layers: list[int], results: Results) -> None:
    """The capture's values, one prompt per batch (so on a GPU each is handed on while the
    next runs), against the same prompt's own forward pass with `output_hidden_states`: the
    same kernels on the same shapes, so equal up to the stored bf16."""
    got = engine.capture(prompts, CaptureSpec(layers=layers), batch_size=1).values
    worst = 0.0
    for ids, value in zip(prompts, got, strict=True):
        out = engine.hf_model.model(input_ids=torch.tensor([ids], device=engine.device),
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=engine.device),
                                    use_cache=False, output_hidden_states=True)
        ref = torch.stack([out.hidden_states[layer + 1][0] for layer in layers]).to(torch.bfloat16).float().cpu()
        worst = max(worst, ((value.float() - ref).abs().amax() / ref.abs().amax()).item())
    verdict = "PASS" if worst <= 4e-3 else "FAIL"
    results.note(f"HF capture check: {verdict}, {len(prompts)} prompts one per batch, blocks {layers}, against each prompt's "
                 f"`output_hidden_states` pass: max |diff| / max = {worst:.1e} (bf16 rounding is up to 3.9e-3)")


def measure(arms: dict, rounds: int, results: Results, engine: str, tokens: int, baseline: str, blocks: dict) -> dict[str, float | None]:
    """Warm each arm once, then `rounds` rounds with the arms interleaved; record medians and
    return them (None for an arm with no timed round)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    failed: dict[str, str] = {}
    for round_ in range(rounds + 1):  # round 0 is the warm-up
        if round_ > 1 and time.time() > _deadline() - 30:
            results.note(f"{engine}: stopped after {round_ - 1} of {rounds} rounds (time budget)")
            break
        for name, arm in arms.items():
            if name in failed:
                continue
            try:
                _sync()
                t0 = time.perf_counter()
                arm()
                _sync()
                elapsed = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - one failing arm (OOM, CaptureFailed) must not lose the others
                failed[name] = f"{type(exc).__name__}: {exc}"[:200]
                print(f"gpu_bench: {engine} {name} failed: {failed[name]}", flush=True)
                continue
            if round_ > 0:
                times[name].append(elapsed)
            print(f"gpu_bench: {engine} round {round_} {name}: {elapsed:.3f} s", flush=True)
    medians = {}
    for name in arms:
        seconds = medians[name] = statistics.median(times[name]) if times[name] else None
        results.row(engine, name, name == baseline, seconds, tokens, blocks[name], failed.get(name) or (None if seconds else "no timed round"))
    return medians


def measure_bandwidths(folder: Path, results: Results, nbytes: int) -> float:
    """What capturing every layer is held to (issue 34: at least half the lower of the two):
    the host link, a device → pinned host copy, and the local disk, a write fsynced; GB/s,
    median of 3 after a warm-up, noted. Returns the lower (the disk's alone without CUDA)."""

    def median_rate(step) -> float:
        rates = []
        for round_ in range(4):
            _sync()
            started = time.perf_counter()
            step()
            _sync()
            if round_:
                rates.append(nbytes / (time.perf_counter() - started) / 1e9)
        return statistics.median(rates)

    chunk = np.zeros(16 << 20, dtype=np.uint8)
    target = folder / "bandwidth.bin"

    def write_disk() -> None:
        with open(target, "wb") as f:
            for _ in range(max(1, nbytes // chunk.nbytes)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    try:
        disk = median_rate(write_disk)
    finally:
        target.unlink(missing_ok=True)
    rates = {"disk write": disk}
    if torch.cuda.is_available():
        on_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        rates["pinned device→host copy"] = median_rate(lambda: pinned.copy_(on_device, non_blocking=True))
        del on_device, pinned
    results.note("bandwidths: " + ", ".join(f"{name} {rate:.2f} GB/s" for name, rate in rates.items())
                 + f" ({nbytes / 1e9:.2f} GB each, median of 3)")
    return min(rates.values())


def note_all_layers(results: Results, label: str, seconds: float | None, tokens: int, n_layers: int, hidden: int, limit: float) -> None:
    """The all-layers arm's rate of stored values (bf16) against the lower bandwidth."""
    if seconds is None:
        return
    rate = tokens * n_layers * hidden * 2 / seconds / 1e9
    results.note(f"{label} all {n_layers} layers: values at {rate:.2f} GB/s, {rate / limit:.0%} of the lower bandwidth "
                 f"({limit:.2f} GB/s; issue 34's target: at least 50 %)")


COBATCH_JOBS, COBATCH_SHARDS, COBATCH_PROMPTS = 4, 3, 8
COBATCH_SETTINGS = (1, 4)


def measure_cobatch(engine, prompts: list[list[int]], layers: list[int], rounds: int, results: Results, engine_label: str) -> None:
    """4 jobs (threads) on one `CobatchedEngine`, each asking for its shards in turn, as jobs
    on an engine server do; one arm per `HARVEST_ENGINE_COBATCH_SHARDS` setting, the first
    (1: each shard alone) the baseline. Shards are cut from `prompts`, repeated as needed."""
    import threading

    from harvest.warm.cobatch import CobatchedEngine

    flat = [prompts[i % len(prompts)] for i in range(COBATCH_JOBS * COBATCH_SHARDS * COBATCH_PROMPTS)]
    jobs = [[flat[(j * COBATCH_SHARDS + k) * COBATCH_PROMPTS:(j * COBATCH_SHARDS + k + 1) * COBATCH_PROMPTS]
             for k in range(COBATCH_SHARDS)] for j in range(COBATCH_JOBS)]
    spec = CaptureSpec(layers=layers)
    calls: dict[str, int] = {}

    def arm(max_shards: int, name: str):
        def run() -> None:
            cobatched = CobatchedEngine(engine, max_shards=max_shards)
            errors: list[BaseException] = []

            def one_job(shards) -> None:
                try:
                    for shard in shards:
                        cobatched.capture(shard, spec, None, peers=COBATCH_JOBS)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the timing thread
                    errors.append(exc)

            threads = [threading.Thread(target=one_job, args=(job,)) for job in jobs]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            calls[name] = cobatched.calls
        return run

    names = {n: f"{COBATCH_JOBS} jobs x {COBATCH_SHARDS} shards of {COBATCH_PROMPTS}, COBATCH_SHARDS={n}" for n in COBATCH_SETTINGS}
    arms = {names[n]: arm(n, names[n]) for n in COBATCH_SETTINGS}
    tokens = sum(map(len, flat))
    label = f"{engine_label} co-batch"
    measure(arms, rounds, results, label, tokens, names[COBATCH_SETTINGS[0]], {name: max(layers) + 1 for name in arms})
    rows = {r["arm"]: r["seconds"] for r in results.data["rows"] if r["engine"] == label}
    alone, cobatched = rows.get(names[1]), rows.get(names[4])
    if alone and cobatched:
        results.note(f"{label}: engine calls {calls.get(names[1])} vs {calls.get(names[4])}; COBATCH_SHARDS=4 runs at "
                     f"{alone / cobatched:.2f}x the throughput of 1 on this device (above 1: co-batching gains here; the "
                     "default HARVEST_ENGINE_COBATCH_SHARDS stays 1 until such a figure says otherwise)")


def _timing(results: Results, name: str, seconds: float) -> None:
    results.data["header"].setdefault("timings", {})[name] = seconds
    results.save()


def run_hf(args, results: Results) -> int:
    import transformers

    from harvest.engines.hf import HFEngine
    from harvest.engines.packing import packed_inputs

    model, build_s, where = build_checkpoint(args.home, args.shapes, name=args.checkpoint_name)
    _timing(results, "checkpoint build+save (0 = reused)", build_s)
    started = time.perf_counter()
    engine = HFEngine(model)  # load_hf_model: from_pretrained, the checkpoint's bf16, onto the GPU
    _timing(results, "HF load", time.perf_counter() - started)
    vocab = engine.hf_model.config.vocab_size
    prompts = _prompts(args.prompts, args.min_len, args.max_len, vocab)
    tokens = sum(map(len, prompts))
    n_layers = model.n_layers
    quartiles = default_layers(n_layers)
    assert sum(p.numel() for p in engine.blocks.parameters()) == block_params(args.shapes)
    results.header(
        device=_device_name(), shapes=args.shapes_text, n_prompts=len(prompts), lengths=f"{args.min_len}-{args.max_len}",
        tokens=tokens, rounds=args.rounds, torch=torch.__version__, transformers=transformers.__version__,
        block_params=block_params(args.shapes), checkpoint=str(where),
    )
    lengths = [len(p) for p in prompts]
    passes = engine.passes(lengths)

    @torch.inference_mode()
    def bare() -> None:
        for plan in passes:  # the engine's own packed passes, nothing captured
            input_ids, positions, _ = packed_inputs(prompts, plan)
            engine.hf_model.model(input_ids=input_ids.to(engine.device), position_ids=positions.to(engine.device), use_cache=False)

    directions = _directions(model.hidden_size)
    q = ",".join(map(str, quartiles))
    arms = {
        "bare forward": bare,
        f"harvest, quartiles [{q}]": lambda: engine.capture(prompts, CaptureSpec(layers=quartiles)),
        f"harvest, all {n_layers}": lambda: engine.capture(prompts, CaptureSpec(layers=list(range(n_layers)))),
        "harvest, 8-dir proj, quartiles": lambda: engine.capture(prompts, CaptureSpec(layers=quartiles, directions=directions)),
        "harvest, quartiles, into a shard file": lambda: into_shard_file(engine, prompts, quartiles, model.hidden_size, args.home),
    }
    blocks = {name: n_layers for name in arms}
    for name in (f"harvest, quartiles [{q}]", "harvest, 8-dir proj, quartiles", "harvest, quartiles, into a shard file"):
        blocks[name] = max(quartiles) + 1  # stops after the deepest
    seconds = measure(arms, args.rounds, results, "HF", tokens, "bare forward", blocks)
    limit = measure_bandwidths(args.home, results, 64 << 20 if args.smoke else 1 << 30)
    note_all_layers(results, "HF", seconds.get(f"harvest, all {n_layers}"), tokens, n_layers, model.hidden_size, limit)
    check_hf_capture(engine, prompts[:8], quartiles, results)
    check_shard_file(engine, prompts, quartiles, model.hidden_size, args.home, results, "HF")
    measure_cobatch(engine, prompts, quartiles, args.rounds, results, "HF")
    # One prompt's quartile values, for the vLLM part to compare against.
    sample = engine.capture(prompts[:1], CaptureSpec(layers=quartiles)).values[0]
    torch.save(sample, args.results.with_name("hf_sample.pt"))
    engine.close()
    results.publish()
    return 0


def run_vllm(args, results: Results) -> int:
    try:
        import vllm  # noqa: F401
        import vllm_lens  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: no vLLM here
        staging = os.environ.get("GPU_BENCH_STAGING")
        results.note(f"vLLM part skipped: vLLM/vllm-lens cannot be imported here ({type(exc).__name__}: {exc})"
                     + (f"; {staging}" if staging else "") + "; stage the wheel set of ../shared/gpu/ (bench/gpu.sh header) to measure it")
        results.publish()
        return 0
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from harvest.engines.vllm import VLLMEngine

    model, build_s, _ = build_checkpoint(args.home, args.shapes, name=args.checkpoint_name)
    started = time.perf_counter()
    extra = dict(gpu_memory_utilization=0.85) if torch.cuda.is_available() else {}
    try:
        engine = VLLMEngine(model, max_num_batched_tokens=16384, **extra)
    except Exception as exc:  # noqa: BLE001 - recorded in the table, the run goes on to parity
        results.note(f"vLLM part failed at engine start: {type(exc).__name__}: {str(exc)[:400]}")
        results.publish()
        return 1
    _timing(results, "vLLM start", time.perf_counter() - started)
    versions = engine.versions()
    results.header(vllm=versions["vllm"], vllm_lens=versions["vllm-lens"])
    vocab = int(engine.llm.llm_engine.model_config.get_vocab_size())
    prompts = _prompts(args.prompts, args.min_len, args.max_len, vocab)
    tokens = sum(map(len, prompts))
    n_layers = model.n_layers
    quartiles = default_layers(n_layers)
    directions = _directions(model.hidden_size)
    plain_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def plain() -> None:
        engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], plain_params, use_tqdm=False)

    q = ",".join(map(str, quartiles))
    arms = {
        "plain prefill": plain,
        f"harvest, quartiles [{q}]": lambda: engine.capture(prompts, CaptureSpec(layers=quartiles)),
        f"harvest, all {n_layers}": lambda: engine.capture(prompts, CaptureSpec(layers=list(range(n_layers)))),
        "harvest, 8-dir proj, quartiles": lambda: engine.capture(prompts, CaptureSpec(layers=quartiles, directions=directions)),
        "harvest, quartiles, into a shard file": lambda: into_shard_file(engine, prompts, quartiles, model.hidden_size, args.home),
    }
    seconds = measure(arms, args.rounds, results, "vLLM", tokens, "plain prefill", {name: n_layers for name in arms})
    limit = measure_bandwidths(args.home, results, 64 << 20 if args.smoke else 1 << 30)
    note_all_layers(results, "vLLM", seconds.get(f"harvest, all {n_layers}"), tokens, n_layers, model.hidden_size, limit)
    check_shard_file(engine, prompts, quartiles, model.hidden_size, args.home, results, "vLLM")
    measure_cobatch(engine, prompts, quartiles, args.rounds, results, "vLLM")

    sample_path = args.results.with_name("hf_sample.pt")
    if sample_path.exists():
        try:
            ref = torch.load(sample_path).float()
            ours = engine.capture(prompts[:1], CaptureSpec(layers=quartiles)).values[0].float()
            scale = ref.abs().amax(dim=(1, 2))
            err = ((ours - ref).abs().amax(dim=(1, 2)) / scale).tolist()
            results.note(f"vLLM vs HF at these shapes, one prompt of {len(prompts[0])} tokens, blocks {quartiles} "
                         f"(each engine's own kernels, {'bf16' if torch.cuda.is_available() else 'float32'} compute, both stored "
                         f"as bf16, so up to ~4e-3 is rounding): max |diff| / layer max = {', '.join(f'{e:.1e}' for e in err)}")
        except Exception as exc:  # noqa: BLE001
            results.note(f"vLLM vs HF sample comparison failed: {type(exc).__name__}: {str(exc)[:300]}")
    engine.close()
    results.publish()
    return 0


def run_parity(args, results: Results) -> int:
    try:
        import vllm  # noqa: F401
        import vllm_lens  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        results.note(f"vLLM parity skipped: vLLM/vllm-lens cannot be imported ({type(exc).__name__})")
        return 0
    from gpu_parity import parity

    try:
        checks = parity(torch.cuda.is_available())
    except Exception as exc:  # noqa: BLE001
        results.note(f"vLLM parity could not run: {type(exc).__name__}: {str(exc)[:400]}")
        results.publish()
        return 1
    passed = sum(ok for _, ok, _ in checks)
    results.note(f"vLLM parity on this device (llama-tiny, float32, vs HF float32 on the CPU): {passed}/{len(checks)} passed — "
                 + "; ".join(f"{'PASS' if ok else 'FAIL'} {name} ({detail})" for name, ok, detail in checks))
    results.publish()
    return 0 if passed == len(checks) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["hf", "vllm", "parity", "table", "note"])
    parser.add_argument("text", nargs="?", default="", help="for `note`: the line to add")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("HARVEST_HOME", "/tmp/harvest-gpu")))
    parser.add_argument("--results", type=Path, default=None, help="the parts' JSON (default HOME/gpu_results.json)")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--min-len", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--quick", action="store_true", default=os.environ.get("GPU_BENCH_QUICK") == "1", help="dry run: small sizes, 1 round")
    parser.add_argument("--smoke", action="store_true", default=os.environ.get("GPU_BENCH_SMOKE") == "1", help="CPU-sized shapes (script check)")
    args = parser.parse_args(argv)
    sizes = (8, 16, 48, 1) if args.smoke else (16, 128, 256, 1) if args.quick else (48, 16, 1024, 3)
    for name, value in zip(("prompts", "min_len", "max_len", "rounds"), sizes):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.shapes = SMOKE_SHAPES if args.smoke else LLAMA_8B_SHAPES
    args.checkpoint_name = "smoke-shapes" if args.smoke else "llama-8b-shapes"
    args.shapes_text = ("smoke shapes (hidden 256, 32 blocks)" if args.smoke else
                        "Llama-3.1-8B block shapes (hidden 4096, 32 blocks, 32/8 heads, head_dim 128, MLP 14336)")
    args.results = args.results or args.home / "gpu_results.json"
    results = Results(args.results)
    if args.what == "note":
        results.note(args.text)
        return 0
    if args.what == "table":
        results.publish()
        return 0
    return {"hf": run_hf, "vllm": run_vllm, "parity": run_parity}[args.what](args, results)


if __name__ == "__main__":
    sys.exit(main())
