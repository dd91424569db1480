"""Warm engines and overlapped writes, side by side in one run.

Sections (all by default; `--section latency|process|overlap` for one):

- latency: submit-to-done of sequential 2-prompt `llama-tiny` jobs through a real Prefect
  server and process workers, on two pools side by side: "cold", a worker whose runs start as
  fresh processes and load the model themselves (the path before warm engines), and "warm", a
  worker host as `harvest worker` runs one: its runs forked from its run starter
  (`fleet.run_starter`) and using its engine server. Jobs alternate between the pools; one warm-up job each, then `--jobs`;
  once per engine (`--engine hf|vllm`, default both: HF loads `llama-tiny` in a tenth of a
  second, vLLM in seconds, as a big model would on a GPU).
- process: `harvest run` as a whole process (imports, tokenizer, engine choice, files) against
  a bare HF forward script (imports, `from_pretrained`, the same batches, nothing written),
  192 prompts, alternating, `--rounds` each.
- cobatch: 4 jobs at once on one warm engine (`harvest.warm.cobatch.CobatchedEngine`, as in the
  engine server), each asking for its 6 shards one after another: every shard alone against
  the waiting shards run together, per engine.
- overlap: every layer of 96 prompts of ~200 tokens to moto's S3 server in one process: the
  pipeline with writes behind the forward passes, the same without, and the forward passes
  alone (no files), median of `--rounds`.

Run: `.venv/bin/python bench/bench_warm.py [--jobs 10] [--rounds 3] [--section …]`.
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
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _table(title: str, header: list[str], rows: list[list]) -> None:
    """A markdown table as bench/RESULTS.md holds them (first column left, numbers right)."""
    print(f"\n{title}")
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


# --- latency -------------------------------------------------------------------------------


def latency(jobs: int, engine: str) -> None:
    home = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    os.environ["HARVEST_HOME"] = str(home)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.flows import load_flow_from_entrypoint
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from fleet.processes import RUN_COMMAND, free_port, start_server, start_worker
    from flows.submit import read_harvest_run, start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest
    from harvest.settings import get_settings
    from harvest.storage import open_storage
    from harvest.warm.protocol import stop_engine_servers, unix_socket_path

    server, api_url = start_server(home / "prefect", free_port(), {"HARVEST_HOME": str(home)}, 120)
    workers = []
    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            flow = load_flow_from_entrypoint("flows.harvest.harvest")
            with get_client(sync_client=True) as client:
                for pool in ("cold", "warm"):
                    client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
                    client.create_deployment(
                        flow_id=client.create_flow_from_name(flow.name), name=f"harvest-{pool}", work_pool_name=pool,
                        entrypoint="flows.harvest.harvest", path=None, pull_steps=[],
                        parameter_openapi_schema=flow.parameters.model_dump(), enforce_parameter_schema=True,
                        job_variables={"command": RUN_COMMAND} if pool == "warm" else {},
                    )
            base_env = {"HARVEST_HOME": str(home), "HARVEST_ENGINE": engine}  # the shipped poll interval
            workers.append(start_worker("cold", api_url, home / "cold.log", base_env, name="cold"))
            workers.append(start_worker("warm", api_url, home / "warm.log", {**base_env, "HARVEST_SLOTS": "[[]]"}, name="warm",
                                        run_starter=unix_socket_path(home / "engines", "runs-warm")))

            def one(pool: str, n: int) -> tuple[float, float]:
                job_id = str(uuid.uuid4())
                files = JobFiles.for_job(job_id, open_storage(get_settings()))
                url = files.write_request(HarvestRequest(model="llama-tiny", prompts=[f"job {n} prompt a", f"job {n} prompt b"]))
                started = time.perf_counter()
                run_id = start_harvest_run(job_id, url, "llama-tiny", pool, "bench", workers=1)
                while (status := read_harvest_run(run_id)).status not in ("done", "failed", "cancelled"):
                    time.sleep(0.05)
                took = time.perf_counter() - started
                assert status.status == "done", status
                return took, files.read_result()["timings"]["load_s"]

            times: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
            for pool in ("cold", "warm"):
                one(pool, -1)  # warm-up: the first job of each pool (model build, first load)
            for n in range(jobs):
                for pool in ("cold", "warm"):
                    times[pool].append(one(pool, n))
    finally:
        for worker in workers:
            worker.stop()
        stop_engine_servers(home)
        server.stop()

    cold = _median([t for t, _ in times["cold"]])
    rows = []
    for pool in ("cold", "warm"):
        values = [t for t, _ in times[pool]]
        med = _median(values)
        rows.append([pool, f"{med:.2f}", f"{min(values):.2f}", f"{max(values):.2f}", f"{_median([l for _, l in times[pool]]):.3f}", f"{med / cold:.2f}"])
    _table(f"Submit-to-done on the {engine} engine, {jobs} sequential 2-prompt jobs per path, alternating (seconds):",
           ["path", "median s", "min s", "max s", "median load_s", "vs cold"], rows)


# --- process -------------------------------------------------------------------------------

BARE = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, corpus = sys.argv[1], sys.argv[2]
prompts = [line for line in open(corpus).read().splitlines() if line]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = [tok(p)["input_ids"] for p in prompts]
order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
with torch.inference_mode():
    for start in range(0, len(order), 32):  # the harvest default shard size, one batch each
        batch = [ids[i] for i in order[start:start + 32]]
        width = max(map(len, batch))
        x = torch.zeros(len(batch), width, dtype=torch.long); m = torch.zeros_like(x)
        for r, row in enumerate(batch):
            x[r, :len(row)] = torch.tensor(row); m[r, :len(row)] = 1
        model.model(input_ids=x, attention_mask=m, use_cache=False)
"""


def process(rounds: int) -> None:
    from harvest.registry import load_registry
    from harvest.settings import get_settings

    tiny = load_registry(get_settings()).get("llama-tiny")
    tiny.require_path()
    work = Path(tempfile.mkdtemp(prefix="bench-process-"))
    corpus = work / "corpus.txt"
    words = "the river runs past old stone walls toward a quiet harbour where boats wait".split()
    corpus.write_text("\n".join(" ".join(words[(k + j) % len(words)] for j in range(20 + k % 40)) for k in range(192)) + "\n")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HARVEST_ENGINE", None)  # `auto`, as a user gets it

    def run(argv: list[str]) -> float:
        started = time.perf_counter()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - started

    arms = {
        "bare HF forward script": lambda r: run([PY, "-c", BARE, str(tiny.path), str(corpus)]),
        "harvest run (auto engine)": lambda r: run([PY, "-m", "fleet.cli", "run", "--model", "llama-tiny", "--prompts", str(corpus),
                                                    "--out", str(work / f"out-{r}")]),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, arm in arms.items():
            times[name].append(arm(r))
    engine = json.loads((work / "out-0" / "manifest.json").read_text())["engine"]
    bare = _median(times["bare HF forward script"])
    _table(f"Whole process, 192 prompts of llama-tiny, {rounds} rounds alternating (median); harvest's engine: "
           f"{engine['engine']} ({engine['reason']}):", ["arm", "median s", "bare / arm"],
           [[name, f"{_median(times[name]):.2f}", f"{bare / _median(times[name]):.2f}"] for name in arms])


# --- overlap -------------------------------------------------------------------------------


def overlap(rounds: int) -> None:
    import boto3

    from fleet.processes import free_port
    from harvest.engines.hf import HFEngine
    from harvest.pipeline import run_job, tokenize_job
    from harvest.shard.writing import capture_shard
    from harvest.registry import load_registry
    from harvest.request import HarvestRequest, resolve_job
    from harvest.settings import get_settings
    from harvest.shard.layout import shard_ranges
    from harvest.storage import Storage, StorageOptions

    port = free_port()
    moto = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    on_moto = StorageOptions(s3_endpoint_url=endpoint, s3_part_bytes=8 << 20)
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            s3.create_bucket(Bucket="bench")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    try:
        registry = load_registry(get_settings())
        engine = HFEngine(registry.get("llama-tiny"))
        words = "the river runs past old stone walls toward a quiet harbour where boats wait".split()
        prompts = [" ".join(words[(k + j) % len(words)] for j in range(100)) for k in range(96)]
        job = resolve_job(HarvestRequest(model="llama-tiny", prompts=prompts, layers="all", shard_size=16), registry)
        tokenized = tokenize_job(job)
        n_shards = len(shard_ranges(len(tokenized), job.request.shard_size))

        def forward_only(r: int) -> float:
            started = time.perf_counter()
            for k in range(n_shards):
                capture_shard(job, engine, tokenized, k, Storage("memory://bench-forward")).staged.discard()
            return time.perf_counter() - started

        def harvest(r: int, with_overlap: bool) -> float:
            started = time.perf_counter()
            run_job(job, Storage(f"s3://bench/round-{r}-{with_overlap}", options=on_moto), engine, "bench", tokenized=tokenized, overlap=with_overlap)
            return time.perf_counter() - started

        arms = {
            "forward only (no files)": forward_only,
            "harvest to S3, writes overlapped": lambda r: harvest(r, True),
            "harvest to S3, writes in line": lambda r: harvest(r, False),
        }
        forward_only(-1)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(rounds):
            for name, arm in arms.items():
                times[name].append(arm(r))
        size = s3.head_object(Bucket="bench", Key="round-0-True/shard_00000.safetensors")["ContentLength"]
    finally:
        moto.terminate()
    tokens = sum(len(t.ids) for t in tokenized)
    base = _median(times["forward only (no files)"])
    _table(f"Every layer of {len(prompts)} prompts ({tokens:,} tokens, {n_shards} shards of ~{size / 2**20:.1f} MiB) to moto S3, "
           f"{rounds} rounds (median):", ["arm", "median s", "tokens/s", "forward-only / arm"],
           [[name, f"{_median(times[name]):.2f}", f"{tokens / _median(times[name]):,.0f}", f"{base / _median(times[name]):.2f}"] for name in arms])


# --- cobatch -------------------------------------------------------------------------------


def cobatch(rounds: int, engine_name: str) -> None:
    import threading

    from harvest.capture_spec import CaptureSpec
    from harvest.engines.choice import load_engine
    from harvest.engines.limits import EngineLimits
    from harvest.registry import load_registry
    from harvest.settings import get_settings
    from harvest.tokenize import load_tokenizer
    from harvest.warm.cobatch import CobatchedEngine

    tiny = load_registry(get_settings()).get("llama-tiny")
    engine = load_engine(tiny, engine_name, EngineLimits.of(get_settings()))
    tokenizer = load_tokenizer(tiny.path)
    words = "the river runs past old stone walls toward a quiet harbour where boats wait".split()
    n_jobs, n_shards, per_shard = 4, 6, 8
    jobs = [[[tokenizer(" ".join(words[(j + k + p + i) % len(words)] for i in range(40 + 7 * p)))["input_ids"] for p in range(per_shard)]
             for k in range(n_shards)] for j in range(n_jobs)]
    tokens = sum(len(ids) for job in jobs for shard in job for ids in shard)
    spec = CaptureSpec(layers=[1, 3, 5])

    def run(max_shards: int) -> tuple[float, int]:
        cobatched = CobatchedEngine(engine, max_shards=max_shards)

        def one_job(shards):
            for prompts in shards:
                cobatched.capture(prompts, spec, None, peers=n_jobs)

        threads = [threading.Thread(target=one_job, args=(job,)) for job in jobs]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started, cobatched.calls

    arms = {"each shard alone (HARVEST_ENGINE_COBATCH_SHARDS=1)": 1, "waiting shards co-batched (=4)": 4}
    run(4)  # warm-up
    times: dict[str, list[tuple[float, int]]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, max_shards in arms.items():
            times[name].append(run(max_shards))
    alone = _median([t for t, _ in times[next(iter(arms))]])
    _table(f"{n_jobs} jobs at once on one warm {engine.name} engine, {n_shards} shards of {per_shard} prompts each ({tokens:,} tokens), "
           f"{rounds} rounds (median):", ["arm", "median s", "engine calls", "tokens/s", "alone / arm"],
           [[name, f"{_median([t for t, _ in times[name]]):.2f}", times[name][0][1], f"{tokens / _median([t for t, _ in times[name]]):,.0f}",
             f"{alone / _median([t for t, _ in times[name]]):.2f}"] for name in arms])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["latency", "process", "overlap", "cobatch"], action="append")
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", action="append", choices=["hf", "vllm"], help="latency, cobatch: engine(s) (default both)")
    args = parser.parse_args()
    sections = args.section or ["overlap", "process", "cobatch", "latency"]
    if "overlap" in sections:
        overlap(args.rounds)
    if "process" in sections:
        process(args.rounds)
    if "cobatch" in sections:
        for engine in args.engine or ["hf", "vllm"]:
            cobatch(args.rounds, engine)
    if "latency" in sections:
        for engine in args.engine or ["hf", "vllm"]:
            latency(args.jobs, engine)


if __name__ == "__main__":
    main()
