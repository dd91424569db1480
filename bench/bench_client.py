"""The researcher client, side by side in one run, against a live stack:

- download: the same done job's shards fetched (a) by a sequential loop over the links, the
  user docs' snippet (`requests`-style streaming into files, one after the other), and (b) by
  the client's download pool (`--workers` threads, resumable `.partial` files, sha256 checked
  against the manifest), into fresh folders, rounds alternating; MB/s and the ratio.
- reading: the same vectors of one layer (every position but each prompt's first) (a) loaded
  shard by shard with `safetensors.torch.load_file` and sliced, the direct way, and (b)
  through `ActivationDataset` in order, (c) shuffled (seeded buffer), (d) normalised;
  vectors/s and the ratio to (a).

Uses the stack at ACS_API_BASE/ACS_API_KEY when set, else starts `harvest up` on free ports
in a temporary HARVEST_HOME (HF engine) and stops it at the end.

    .venv/bin/python bench/bench_client.py [--prompts 1024 --words 40 --shard-size 32 --workers 8 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from harvest_client import ActivationDataset, Client
from harvest_client.download import Downloader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import harvest_up  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LAYERS = [2, 5]


@contextmanager
def live_stack():
    """(api_base, api_key): the one in the environment, or a `harvest up` of our own."""
    if os.environ.get("ACS_API_BASE") and os.environ.get("ACS_API_KEY"):
        yield os.environ["ACS_API_BASE"], os.environ["ACS_API_KEY"]
        return
    home = Path(tempfile.mkdtemp(prefix="bench-client-"))
    try:
        with harvest_up(home, HARVEST_USE_VLLM="0") as stack:
            yield stack
    finally:
        shutil.rmtree(home, ignore_errors=True)


def sequential_download(job: dict, api_base: str, dest: Path) -> int:
    """The user docs' loop: each shard streamed into a file, one after the other."""
    dest.mkdir(parents=True)
    total = 0
    with httpx.Client(timeout=600) as http:
        for index, url in enumerate(job["result"]["shard_urls"]):
            with http.stream("GET", httpx.URL(api_base + "/").join(url)) as response:
                response.raise_for_status()
                with open(dest / f"shard_{index:05d}.safetensors", "wb") as handle:
                    for chunk in response.iter_bytes(1 << 20):
                        handle.write(chunk)
                        total += len(chunk)
    return total


def client_download(client: Client, job: dict, dest: Path, workers: int) -> int:
    downloader = Downloader(client.api.get, workers=workers, api_base=client.api.base)
    try:
        download = downloader.start(job, dest)
        download.finish()
    finally:
        downloader.close()
    return sum(f.stat().st_size for f in dest.iterdir() if f.name.startswith("shard_"))


def direct_read(part: Path, layer_row: int) -> int:
    """Every shard loaded whole with safetensors and sliced: the vectors a reader must yield."""
    import json

    from safetensors.torch import load_file

    manifest = json.loads((part / "manifest.json").read_text())
    count = 0
    for shard in manifest["shards"]:
        tensors = load_file(str(part / shard["file"]))
        first, last = shard["prompt_range"]
        block = np.concatenate([tensors[f"prompt_{i}"][layer_row, 1:].float().numpy() for i in range(first, last + 1)])
        count += len(block)
    return count


def timed(fn, *args) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--words", type=int, default=40, help="words per prompt (~1 token each)")
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    words = "the river carries light across seven quiet hills where old machines remember every answer".split()
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(words, size=args.words)) for _ in range(args.prompts)]
    scratch = Path(tempfile.mkdtemp(prefix="bench-client-data-"))
    try:
        with live_stack() as (api_base, api_key), Client(api_base, api_key) as client:
            started = time.perf_counter()
            summary = client.harvest("llama-tiny", corpus, scratch / "dataset", layers=LAYERS, shard_size=args.shard_size, progress=False)
            harvest_s = time.perf_counter() - started
            job = client.api.get(summary.job_ids[0])
            shard_bytes = sum(f.stat().st_size for f in (scratch / "dataset").glob("part-*/shard_*"))
            print(f"corpus: {args.prompts} prompts of {args.words} words, layers {LAYERS}, {summary.tokens:,} tokens, "
                  f"{job['result']['n_shards']} shards, {shard_bytes / 1e6:.1f} MB; client.harvest {harvest_s:.1f} s "
                  f"({summary.jobs} job)")

            # --- download -------------------------------------------------------------------
            times = {"sequential loop": [], f"client, {args.workers} workers + sha256": []}
            for r in range(args.rounds):
                arms = list(times)
                for name in (arms if r % 2 == 0 else arms[::-1]):
                    dest = scratch / f"dl-{r}-{len(times[name])}-{name.split()[0].strip(',')}"
                    fresh = client.api.get(summary.job_ids[0])  # fresh links for each arm
                    if name.startswith("sequential"):
                        seconds, fetched = timed(sequential_download, fresh, api_base, dest)
                    else:
                        seconds, fetched = timed(client_download, client, fresh, dest, args.workers)
                    assert fetched == shard_bytes, (name, fetched, shard_bytes)
                    times[name].append(seconds)
                    shutil.rmtree(dest)
            base = statistics.median(times["sequential loop"])
            print(f"\ndownload of the same {shard_bytes / 1e6:.1f} MB ({args.rounds} rounds, median):")
            print("| arm | seconds | MB/s | vs sequential |\n|---|---:|---:|---:|")
            for name, values in times.items():
                median = statistics.median(values)
                print(f"| {name} | {median:.2f} | {shard_bytes / 1e6 / median:.1f} | {base / median:.2f} |")

            # --- reading --------------------------------------------------------------------
            part = next((scratch / "dataset").glob("part-*"))
            layer = LAYERS[-1]
            reads = {"safetensors load_file, sliced": [], "ActivationDataset in order": [],
                     "ActivationDataset shuffled": [], "ActivationDataset normalised": []}
            expected = len(ActivationDataset(scratch / "dataset", layer=layer))

            def dataset_pass(**kwargs) -> int:
                shuffle = kwargs.pop("shuffle", False)
                ds = ActivationDataset(scratch / "dataset", layer=layer, **kwargs)
                return sum(len(b.vectors) for b in ds.batches(4096, shuffle=shuffle, seed=0, buffer_size=65536))

            for r in range(args.rounds):
                for name in reads:
                    if name.startswith("safetensors"):
                        seconds, count = timed(direct_read, part, LAYERS.index(layer))
                    elif name.endswith("in order"):
                        seconds, count = timed(dataset_pass)
                    elif name.endswith("shuffled"):
                        seconds, count = timed(lambda: dataset_pass(shuffle=True))
                    else:
                        seconds, count = timed(lambda: dataset_pass(normalize=True))
                    assert count == expected, (name, count, expected)
                    reads[name].append(seconds)
            base = statistics.median(reads["safetensors load_file, sliced"])
            print(f"\nreading layer {layer}: {expected:,} vectors of {ActivationDataset(scratch / 'dataset', layer=layer).n_features} "
                  f"features ({args.rounds} rounds, median; page cache warm):")
            print("| arm | seconds | vectors/s | vs safetensors |\n|---|---:|---:|---:|")
            for name, values in reads.items():
                median = statistics.median(values)
                print(f"| {name} | {median:.3f} | {expected / median:,.0f} | {base / median:.2f} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
