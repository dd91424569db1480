"""Peak resident memory of a warm engine server and of a run while one large shard streams.

    .venv/bin/python bench/engine_memory.py --prompts 128 --chars 6000 --piece-mib 64 --batch-tokens 16384

Starts a real engine server (`python -m harvest.warm.server`, HF engine) in a scratch
HARVEST_HOME, harvests every layer of `--prompts` prompts as ONE shard into local storage
through it (this process is the run), and samples both processes' RSS with psutil every few
milliseconds. Prints the shard's size and each process's growth over its baseline and peak,
and what each process read and wrote (the kernel's `rchar`/`wchar`: sockets and the page cache
included) and its CPU seconds over the job: where the values' host passes go; checks the
manifest's sha256 against a fresh hash of the file. The CI-sized version is
tests/test_engine_memory.py; results in bench/RESULTS.md ("Engine memory").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--chars", type=int, default=6000, help="characters a prompt (6000: max_model_len tokens)")
    parser.add_argument("--piece-mib", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="engine-memory-"))
    os.environ.update({"HARVEST_HOME": str(home), "HARVEST_ENGINE": "hf",
                       "HARVEST_ENGINE_PIECE_BYTES": str(args.piece_mib * MiB), "HARVEST_ENGINE_BATCH_TOKENS": str(args.batch_tokens)})

    import psutil

    from harvest.jobfiles import MANIFEST
    from harvest.pipeline import run_job
    from harvest.registry import load_registry
    from harvest.request import HarvestRequest, resolve_job
    from harvest.settings import get_settings
    from harvest.storage import Storage
    from harvest.warm.client import open_engine
    from harvest.warm.protocol import GroupFiles

    settings = get_settings()
    registry = load_registry(settings)
    words = "the river runs past old stone walls toward a quiet harbour where boats wait".split()
    prompts = [(f"{k} " + " ".join(words[(k + j) % len(words)] for j in range(args.chars // 3)))[: args.chars] for k in range(args.prompts)]
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=prompts, layers="all", shard_size=4096), registry)
    engine, _ = open_engine(registry.get("llama-tiny"), {"devices": ""}, settings)
    server = GroupFiles(settings.home, "cpu").server_pid()
    engine.capture([list(range(1, 516))], job.spec, sink=lambda position, value: None)  # a warm server
    procs = {"engine server": psutil.Process(server), "run": psutil.Process()}
    base = {name: p.memory_info().rss for name, p in procs.items()}
    peak = dict(base)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for name, p in procs.items():
                peak[name] = max(peak[name], p.memory_info().rss)
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    storage = Storage(f"file://{home}/job")
    io_before = {name: _io_and_cpu(p) for name, p in procs.items()}
    started = time.perf_counter()
    try:
        run_job(job, storage, engine, "engine-memory")
        io_after = {name: _io_and_cpu(p) for name, p in procs.items()}
    finally:
        stop.set()
        sampler.join()
        engine.close()
        os.kill(server, 15)
    wall = time.perf_counter() - started
    (record,) = json.loads(storage.read_bytes(MANIFEST))["shards"]
    digest = hashlib.sha256()
    with open(storage.path(record["file"]), "rb") as handle:
        while chunk := handle.read(8 * MiB):
            digest.update(chunk)
    assert digest.hexdigest() == record["sha256"]
    print(f"shard {record['bytes'] / 1e9:.2f} GB ({sum(record['token_counts'])} tokens), piece {args.piece_mib} MiB, "
          f"batch tokens {args.batch_tokens}, {wall:.0f} s; sha256 checked")
    for name in procs:
        moved = {k: io_after[name][k] - io_before[name][k] for k in io_before[name]}
        print(f"  {name}: +{(peak[name] - base[name]) / MiB:.0f} MiB over its baseline, peak {peak[name] / MiB:.0f} MiB; "
              f"read {moved['rchar'] / MiB:.0f} MiB, wrote {moved['wchar'] / MiB:.0f} MiB, CPU {moved['cpu_s']:.1f} s")
    storage.delete_all()


def _io_and_cpu(process) -> dict[str, float]:
    io = process.io_counters()
    cpu = process.cpu_times()
    return {"rchar": io.read_chars, "wchar": io.write_chars, "cpu_s": cpu.user + cpu.system}


if __name__ == "__main__":
    main()
