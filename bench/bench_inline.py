"""Inline activations: zstd level sweep, payload size, and latency/throughput over HTTP.

Three measurements in one run, printed side by side:

1. zstd levels on real captured activations (llama-tiny, all 8 layers of a 512-token prompt,
   bf16 bits as int16): compressed ratio, compress and decompress speed. This picks
   `harvest.residual_codec.ZSTD_LEVEL`.
2. Payload: bytes on the wire (base64 of zstd) against the raw bf16 tensor, per response.
3. Latency p50/p95 and throughput of `POST /v1/completions` with `output_residual_stream: true`
   through the real routes under uvicorn on loopback (HF engine, llama-tiny, CPU), at 1 and
   16 concurrent clients, with the batcher on (window 10 ms, up to 64 per batch) and off
   (max_batch 1: one engine call per request), so the batching gain is measured, not claimed.

Run: `.venv/bin/python bench/bench_inline.py [--requests 48 --prompt-tokens 64 --max-tokens 8 --rounds 2]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HARVEST_HOME", str(Path(tempfile.gettempdir()) / "harvest-bench-inline"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

from harvest.engines.base import SamplingSpec  # noqa: E402
from harvest.engines.hf import HFEngine  # noqa: E402
from harvest.registry import load_registry  # noqa: E402
from harvest.residual_codec import ZSTD_LEVEL, _le_int16_bytes  # noqa: E402
from harvest.settings import get_settings  # noqa: E402
from testbed.api_server import serve_in_thread  # noqa: E402


def zstd_sweep(engine: HFEngine, levels: list[int]) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    vocab = engine.hf_model.config.vocab_size
    prompt = [0] + torch.randint(2, vocab, (511,), generator=generator).tolist()
    residual = engine.generate([prompt], [SamplingSpec(max_tokens=1, temperature=0)], list(range(engine.model.n_layers)))[0].residual
    raw = _le_int16_bytes(residual)
    rows = []
    for level in levels:
        compressor = zstandard.ZstdCompressor(level=level)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            packed = compressor.compress(raw)
            times.append(time.perf_counter() - started)
        decompressor = zstandard.ZstdDecompressor()
        dtimes = []
        for _ in range(5):
            started = time.perf_counter()
            decompressor.decompress(packed)
            dtimes.append(time.perf_counter() - started)
        rows.append({
            "level": level,
            "ratio": len(raw) / len(packed),
            "compress_MBps": len(raw) / statistics.median(times) / 1e6,
            "decompress_MBps": len(raw) / statistics.median(dtimes) / 1e6,
        })
    return rows, len(raw)


def make_app(engine: HFEngine, max_batch: int, store):
    """The real app (its factory) on the bench's job `store`, its inline engines all `engine`
    with this batch cap."""
    from api.app import create_app
    from api.inline_engines import InlineEngines

    return create_app(store=store,
                      inline_engines=InlineEngines(factory=lambda _m: engine, close_engines=False, max_batch=max_batch))


async def load(base_url: str, key: str, bodies: list[dict], concurrency: int) -> dict:
    latencies: list[float] = []
    wire: list[int] = []
    queue = list(bodies)

    async def client(session):
        while queue:
            body = queue.pop()
            started = time.perf_counter()
            answer = await session.post("/completions", json=body)
            latencies.append(time.perf_counter() - started)
            answer.raise_for_status()
            wire.append(len(answer.json()["activations"]["residual_stream"]["data"]))

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as session:
        await session.post("/completions", json=bodies[0])  # warm-up: tokenizer, first batch
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "p50_ms": 1000 * statistics.median(latencies),
        "p95_ms": 1000 * latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        "req_per_s": len(bodies) / elapsed,
        "wire_bytes": statistics.mean(wire),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = load_registry(get_settings()).get("llama-tiny")
    engine = HFEngine(model)

    rows, raw_bytes = zstd_sweep(engine, [-1, 1, 2, 3, 6, 9, 15, 19])
    print(f"zstd on one all-layer capture of a 512-token prompt ({raw_bytes:,} raw bytes), chosen level {ZSTD_LEVEL}")
    print(f"{'level':>5} {'ratio':>6} {'compress MB/s':>14} {'decompress MB/s':>16}")
    for row in rows:
        print(f"{row['level']:>5} {row['ratio']:>6.3f} {row['compress_MBps']:>14.0f} {row['decompress_MBps']:>16.0f}")

    from api.auth import create_key
    from api.db import JobStore
    from api.settings import ApiSettings
    from harvest.settings import get_settings

    # Served without a lifespan (`serve_in_thread`): the store is migrated here.
    store = JobStore.from_settings(get_settings(ApiSettings)).migrate()
    key = create_key("bench-inline", engine=store.db)[0]
    generator = torch.Generator().manual_seed(1)
    vocab = engine.hf_model.config.vocab_size
    bodies = [
        {"model": "llama-tiny", "prompt": [0] + torch.randint(2, vocab, (args.prompt_tokens - 1,), generator=generator).tolist(),
         "max_tokens": args.max_tokens, "temperature": 0, "output_residual_stream": True}
        for _ in range(args.requests)
    ]
    n_tokens = args.prompt_tokens + args.max_tokens - 1
    raw_response = model.n_layers * n_tokens * model.hidden_size * 2
    print(f"\n{args.requests} requests: {args.prompt_tokens}-token prompt, max_tokens {args.max_tokens}, all {model.n_layers} layers "
          f"→ [{model.n_layers}, {n_tokens}, {model.hidden_size}] bf16 = {raw_response:,} raw bytes per response")
    print(f"{'round':>5} {'batcher':>8} {'clients':>7} {'p50 ms':>8} {'p95 ms':>8} {'req/s':>7} {'wire bytes':>11} {'wire/raw':>8}")
    # Both servers stay up and the arms alternate within each round, so load drift on a
    # shared machine hits every arm alike.
    with serve_in_thread(make_app(engine, 64, store)) as batched, serve_in_thread(make_app(engine, 1, store)) as unbatched:
        for round_ in range(args.rounds):
            for label, root in (("on", batched), ("off", unbatched)):
                base_url = f"{root}/v1"
                for concurrency in (1, 16):
                    result = asyncio.run(load(base_url, key, bodies, concurrency))
                    print(f"{round_:>5} {label:>8} {concurrency:>7} {result['p50_ms']:>8.0f} {result['p95_ms']:>8.0f} "
                          f"{result['req_per_s']:>7.1f} {result['wire_bytes']:>11,.0f} {result['wire_bytes'] / raw_response:>8.3f}")

if __name__ == "__main__":
    main()
