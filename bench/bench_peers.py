"""The service against the tools a researcher would pick instead, side by side on real text.

Corpus (`--corpus`, `bench/corpora.py`): `short` (the default), the GPL-3's 122 paragraphs,
6,919 tokens of `smollm2-135m`, 3 to 193 each (median 47): real prose with the spread of
lengths real prose has (a heading, a sentence, a long clause); `medium`, 96 longer paragraphs
of the GNU licenses cut at 1,500 characters; `long_tail`, 96 chunks of 8 to 2,000 tokens,
log-uniform. Quartile layers 7, 15, 22 unless `--layers` says otherwise; bf16 values written to
safetensors on local disk by every arm that captures.

Arms, each a process of its own, started in turn, `--rounds` times (the median is reported):
- `bare`, `handwritten`, `nnsight`, `transformer_lens`, `saelens`: `bench/peer_arms.py` (its
  docstring says how each is written; the peers run in `.venv-peers`, `bench/peers_venv.sh`),
  on the corpus tokenized once by the model's tokenizer, in length-sorted batches of 8;
- `harvest run`: the command as a user runs it, shipped defaults, on the corpus as text
  (`--prompts corpus.jsonl`; it tokenizes, loads, harvests, writes the manifest);
- `harvest run, all layers` against `bare` (every block runs either way);
- `harvest run, vLLM`: the same with `HARVEST_ENGINE=vllm`, for what `auto` should pick;
- `harvest run, rows N` (`--fixed-rows N,...`): the same with `HARVEST_ENGINE_ROW_TOKENS=N`,
  rows of one fixed length instead of planned for the corpus;
- `make run`: `harvest up` as `make run` starts it (a temporary `HARVEST_HOME`, nothing else
  changed), then `harvest_client.Client().harvest(...)` of the corpus, after one other job
  warmed the engine server; each round one job. Its corpus time is the job's, from its run's
  start to its manifest (`started_at` to the manifest's `created_at`); its whole time is the
  client's, submit to files downloaded and verified.

Also, in one process (`steady`): the HF and the vLLM engine loaded once each, as a warm engine
server holds them, the corpus captured in 32-prompt shards, rounds alternating: what a warm
server's choice of engine should rest on.

Corpus time: the arm's loop over the corpus, writes included (for `harvest run`, the time it
prints for the job: forward passes, files, statistics and manifest). Whole: from spawn to
exit (imports, load and tokenizing included for `harvest run`; the peer arms get the corpus
already tokenized, which spares them the tokenizer's load). Free: the corpus time a capture
would take if it cost only the blocks it runs, `bare` × blocks run ÷ blocks in the model (it
stops after the deepest requested block); "vs free" is that time over the arm's.

Values: every arm's, `make run`'s files included, against `handwritten` (`peer_arms.compare`:
per-token cosine ≥ 0.9999 and relative RMS ≤ 1 %, position 0 apart).

Rows: `--rows 64,128,...` adds, in the `steady` process, the HF engine's capture of the corpus
in 32-prompt shards at each `HARVEST_ENGINE_ROW_TOKENS` (what chose its default).

    .venv/bin/python bench/bench_peers.py [--rounds 3] [--skip make_run,saelens,...] [--json out.json]
        [--model gemma2-135m]   # another family at SmolLM2's size (bench/bench_models.py)

(the first run builds the peers' own venv, `.venv-peers`, with `bench/peers_venv.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_models import BENCH_MODELS, use  # noqa: E402
from corpora import CORPORA, corpus  # noqa: E402
from peer_arms import compare, load_values  # noqa: E402
from harvest.settings import get_settings  # noqa: E402
from stack import harvest_up  # noqa: E402

__all__ = ["main"]

MODEL = "smollm2-135m"
PEER_ARMS = ["bare", "handwritten", "nnsight", "transformer_lens", "saelens"]
PROJECT_PY = REPO / ".venv" / "bin" / "python"
PEERS_PY = REPO / ".venv-peers" / "bin" / "python"


def _tokenizer():
    from harvest.registry import load_registry
    from harvest.tokenize import load_tokenizer

    return load_tokenizer(load_registry(get_settings()).get(MODEL).require_path())


def _tokenized(texts: list[str]) -> list[list[int]]:
    from harvest.registry import load_registry
    from harvest.tokenize import tokenize_prompts

    return [t.ids for t in tokenize_prompts(_tokenizer(), texts, add_special_tokens=True, max_len=load_registry(get_settings()).get(MODEL).max_model_len)]


def _model_dir() -> Path:
    from harvest.registry import load_registry

    return load_registry(get_settings()).get(os.environ.get("BENCH_MODEL", MODEL)).require_path()


def peer_arm(arm: str, work: Path, layers: list[int], python: Path) -> dict:
    out = work / arm
    command = [str(python), str(REPO / "bench" / "peer_arms.py"), arm, "--model-dir", str(_model_dir()),
               "--corpus", str(work / "ids.json"), "--layers", ",".join(map(str, layers)), "--out", str(out),
               "--started-at", str(time.time())]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "out": str(out)}


WROTE = re.compile(r"wrote \d+ shard\(s\), (\d+) tokens, [\d,]+ bytes to \S+ in ([\d.]+) s")


def harvest_run(work: Path, name: str, layers: str, env: dict[str, str] | None = None) -> dict:
    """`harvest run` as a user types it, timed from spawn to exit."""
    out = work / name.replace(" ", "_").replace(",", "")
    shutil.rmtree(out, ignore_errors=True)
    command = [str(REPO / ".venv" / "bin" / "harvest"), "run", "--model", os.environ.get("BENCH_MODEL", MODEL), "--prompts", str(work / "corpus.jsonl"),
               "--out", str(out), "--layers", layers]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    whole = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    match = WROTE.search(done.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    return {"arm": name, "corpus_s": float(match[2]), "whole_s": whole, "load_s": manifest["timings"]["load_s"],
            "tokens": int(match[1]), "padded_tokens": manifest["timings"].get("padded_tokens"), "out": str(out),
            "engine": manifest["engine"]["engine"]}


def shard_values(folder: Path, layers: list[int]) -> dict[tuple[int, int], object]:
    """`{(prompt, layer): bf16 [n_tokens, hidden]}` from a job's shard files (any folder below)."""
    from safetensors.torch import load_file

    values = {}
    for path in sorted(folder.rglob("shard_*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if name.startswith("prompt_"):
                i = int(name.removeprefix("prompt_"))
                for row, layer in enumerate(layers):
                    values[(i, layer)] = tensor[row]
    return values


def make_run_jobs(work: Path, texts: list[str], layers: list[int], rounds: int, arms: list[str]) -> dict[str, list[dict]]:
    """Each round, each arm (`make run`: `layers`; `make run, all layers`): the corpus through
    `make run`'s stack, submit to verified files, on an engine server another job has already
    warmed."""
    from harvest_client import Client

    home = Path(tempfile.mkdtemp(prefix="bench-peers-up-"))
    results: dict[str, list[dict]] = {}
    try:
        with harvest_up(home) as (base, key):
            client = Client(api_base=base, api_key=key)
            model = os.environ.get("BENCH_MODEL", MODEL)
            client.harvest(model, texts[::-1][:16], out=str(work / "make_run_warmup"), layers=layers, progress=False)
            for r in range(rounds):
                for arm in arms:
                    out = work / f"{arm.replace(' ', '_').replace(',', '')}_{r}"
                    shutil.rmtree(out, ignore_errors=True)
                    # A corpus the stack has not seen (else the client's idempotency finds the
                    # first job): the same texts, the round's number in front of the first.
                    corpus = [f"{r}. {texts[0]}"] + texts[1:]
                    started = time.perf_counter()
                    summary = client.harvest(model, corpus, out=str(out), layers="all" if "all" in arm else layers, progress=False)
                    whole = time.perf_counter() - started
                    (job_id,) = summary.job_ids
                    results.setdefault(arm, []).append({
                        "arm": arm, "whole_s": whole, "corpus_s": _run_to_manifest_s(client.wait(job_id), out),
                        "tokens": summary.tokens, "out": str(out)})
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return results


def _run_to_manifest_s(harvest: dict, out: Path) -> float:
    """A job's corpus time as `harvest run`'s is: from its run's start (the job's `started_at`,
    its Prefect run's Running) to its manifest's `created_at`, both this machine's clock."""
    from datetime import datetime

    (manifest,) = out.rglob("manifest.json")
    written = datetime.fromisoformat(json.loads(manifest.read_text())["created_at"])
    return (written - datetime.fromisoformat(harvest["started_at"])).total_seconds()


def _shards(engine, ids: list[list[int]], spec) -> None:
    for start in range(0, len(ids), 32):
        engine.capture(ids[start : start + 32], spec)


def steady(ids_path: Path, layers: list[int], rounds: int, rows: list[int]) -> dict:
    """In this process: both engines loaded once; the corpus in 32-prompt shards, alternating;
    then the HF engine at each row size of `rows`."""
    from harvest.settings import get_settings

    from harvest.capture_spec import CaptureSpec
    from harvest.engines.hf import HFEngine
    from harvest.engines.limits import EngineLimits
    from harvest.engines.vllm import VLLMEngine
    from harvest.registry import load_registry

    ids = json.loads(ids_path.read_text())["prompts"]
    model = load_registry(get_settings()).get(os.environ.get("BENCH_MODEL", MODEL))
    engines = {"hf": HFEngine(model), "vllm": VLLMEngine(model)}
    spec = CaptureSpec(layers=layers)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.capture(ids[:8], spec)  # first-call allocations
    row_times: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(rounds):
        for name, engine in engines.items():
            started = time.perf_counter()
            _shards(engine, ids, spec)
            times[name].append(time.perf_counter() - started)
        for r in rows:
            engines["hf"].limits = EngineLimits(row_tokens=r)  # as `HARVEST_ENGINE_ROW_TOKENS=r` makes it
            started = time.perf_counter()
            _shards(engines["hf"], ids, spec)
            row_times[r].append(time.perf_counter() - started)
    tokens = sum(map(len, ids))
    answer = {name: {"corpus_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t)} for name, t in times.items()}
    answer["rows"] = {r: statistics.median(t) for r, t in row_times.items()}
    return answer


def _median_arm(runs: list[dict]) -> dict:
    """The arm's medians over the rounds (of two: their mean), each round's figures kept."""
    summary = dict(runs[0])
    for field in ("corpus_s", "whole_s"):
        summary[field] = statistics.median(r[field] for r in runs)
    summary["runs"] = [round(r["corpus_s"], 2) for r in runs]
    summary["whole_runs"] = [round(r["whole_s"], 2) for r in runs]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", default="7,15,22")
    parser.add_argument("--corpus", default="short", choices=CORPORA, help="bench/corpora.py")
    parser.add_argument("--skip", default="", help="comma-separated arms to leave out")
    parser.add_argument("--json", help="write every figure here too")
    parser.add_argument("--rows", default="", help="row sizes for the HF engine's rows sweep (steady process)")
    parser.add_argument("--fixed-rows", default="", help="arms `harvest run, rows N`: rows fixed at N, not planned")
    parser.add_argument("--model", default=MODEL, help=f"{MODEL} (default) or a bench model: {', '.join(BENCH_MODELS)}")
    parser.add_argument("--steady-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model != MODEL:
        use(args.model)  # the tokenizer is SmolLM2's: the corpus's tokens are the same
        os.environ["BENCH_MODEL"] = args.model
    layers = [int(x) for x in args.layers.split(",")]
    if args.steady_only:
        rows = [int(r) for r in args.rows.split(",") if r]
        print(json.dumps(steady(Path(args.work) / "ids.json", layers, args.rounds, rows)))
        return
    skip = set(filter(None, args.skip.split(",")))
    if not PEERS_PY.exists() and set(PEER_ARMS[2:]) - skip:
        subprocess.run(["bash", str(REPO / "bench" / "peers_venv.sh")], check=True)  # the peers' own venv, once
    texts = corpus(args.corpus, _tokenizer())
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    ids = _tokenized(texts)
    (work / "ids.json").write_text(json.dumps({"prompts": ids}))
    with open(work / "corpus.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    n_blocks = json.loads((_model_dir() / "config.json").read_text())["num_hidden_layers"]
    lengths = sorted(map(len, ids))
    print(f"model: {os.environ.get('BENCH_MODEL', MODEL)}; corpus {args.corpus}: {len(ids)} texts, {sum(lengths)} tokens, {lengths[0]}-{lengths[-1]} each "
          f"(median {lengths[len(lengths) // 2]}); layers {layers}; {args.rounds} round(s); work {work}", flush=True)

    runs: dict[str, list[dict]] = {}
    arms = [a for a in PEER_ARMS if a not in skip]
    for _ in range(args.rounds):
        for arm in arms:
            python = PROJECT_PY if arm in ("bare", "handwritten") else PEERS_PY
            runs.setdefault(arm, []).append(peer_arm(arm, work, layers, python))
            print(f"  {arm}: {runs[arm][-1]['corpus_s']:.2f} s", flush=True)
        fixed = [(f"harvest run, rows {r}", args.layers, {"HARVEST_ENGINE_ROW_TOKENS": r}) for r in filter(None, args.fixed_rows.split(","))]
        for name, layer_arg, env in [("harvest run", args.layers, None), ("harvest run, all layers", "all", None),
                                     ("harvest run, vLLM", args.layers, {"HARVEST_ENGINE": "vllm"}), *fixed]:
            if name in skip or ("vLLM" in name and "vllm" in skip) or ("all" in name and "all" in skip):
                continue
            runs.setdefault(name, []).append(harvest_run(work, name, layer_arg, env))
            print(f"  {name}: {runs[name][-1]['corpus_s']:.2f} s", flush=True)
    make_arms = [] if "make_run" in skip else ["make run"] + ([] if "all" in skip else ["make run, all layers"])
    if make_arms:
        runs.update(make_run_jobs(work, texts, layers, args.rounds, make_arms))
    results = {name: _median_arm(r) for name, r in runs.items()}
    if "steady" not in skip:
        done = subprocess.run([str(PROJECT_PY), __file__, "--steady-only", "--work", str(work), "--layers", args.layers,
                               "--rounds", str(args.rounds), "--rows", args.rows], capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"steady failed:\n{done.stderr[-3000:]}")
        results["steady"] = json.loads(done.stdout.strip().splitlines()[-1])

    # Values: every arm against the hand-written loop, make run against harvest run.
    reference = load_values(work / "handwritten") if "handwritten" in results else None
    checks = {}
    for name, result in results.items():
        if reference is None or name in ("bare", "handwritten", "steady", "harvest run, all layers", "make run, all layers"):
            continue
        got = load_values(result["out"]) if name in PEER_ARMS else shard_values(Path(result["out"]), layers)
        if name == "make run":
            got = {(i, k): v for (i, k), v in got.items() if i > 0}  # its first paragraph carries the round number
        check = compare(got, {key: v for key, v in reference.items() if key in got or name != "make run"})
        checks[name] = {k: check[k] for k in ("ok", "pairs", "min_cosine", "max_rel_rms")}

    bare = results.get("bare")
    deepest = max(layers) + 1
    print()
    print(f"| arm | corpus s | vs bare | vs free ({deepest}/{n_blocks} of bare) | whole process s | tokens beyond the prompts | values vs hand-written |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        if name == "steady":
            continue
        vs_bare = bare["corpus_s"] / r["corpus_s"] if bare else float("nan")
        blocks_run = n_blocks if name in ("bare", "harvest run, all layers", "make run, all layers") else deepest
        vs_free = vs_bare / (n_blocks / blocks_run)
        check = checks.get(name)
        values = "" if check is None else f"{'equal' if check['ok'] else 'DIFFER'} (cos ≥ {check['min_cosine']:.5f}, rel RMS ≤ {check['max_rel_rms']:.1e})"
        print(f"| {name} | {r['corpus_s']:.2f} ({', '.join(map(str, r['runs']))}) | {vs_bare:.2f} | {vs_free:.2f} | "
              f"{r['whole_s']:.2f} ({', '.join(map(str, r['whole_runs']))}) | {r.get('padded_tokens', '')} | {values} |")
    for shipped, alone in (("make run", "harvest run"), ("make run, all layers", "harvest run, all layers")):
        if shipped in results and alone in results:
            print(f"\n{alone} ÷ {shipped}, corpus time: {results[alone]['corpus_s'] / results[shipped]['corpus_s']:.3f}")
    if "steady" in results:
        s = results["steady"]
        print(f"\nsteady state, engines loaded once (32-prompt shards): HF {s['hf']['corpus_s']:.2f} s "
              f"({s['hf']['tokens_per_s']:.0f} tokens/s), vLLM {s['vllm']['corpus_s']:.2f} s ({s['vllm']['tokens_per_s']:.0f} tokens/s)")
        for r, seconds in s["rows"].items():
            print(f"  HF engine, rows of {r} tokens: {seconds:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "checks": checks}, indent=2, default=str))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
