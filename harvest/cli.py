"""`harvest run`: harvest a corpus in this process (the core pipeline, no server needed).

The `harvest` command hands its `run` subcommand to `main` here; its other subcommands drive
the layers above the core and live with those layers, so nothing here knows them.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

__all__ = ["main"]


def _parse_layers(text: str | None):
    if text is None:
        return None
    if text == "all":
        return "all"
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"harvest run: --layers must be comma-separated integers or 'all', not {text!r}") from None


def _directions_payload(path: str | None) -> dict | None:
    if path is None:
        return None
    import base64

    import numpy as np

    try:
        array = np.load(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"harvest run: cannot read {path} as a .npy array: {exc}") from None
    names = {np.dtype("float32"): "float32", np.dtype("float16"): "float16"}
    if array.dtype not in names:
        array = array.astype(np.float32)
    array = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<")))
    return {
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
        "dtype": names[np.dtype(array.dtype.name)],
        "shape": list(array.shape),
    }


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harvest run", description="Harvest a prompt corpus into safetensors shards.")
    parser.add_argument("--model", required=True, help="served model name, e.g. llama-tiny")
    parser.add_argument("--prompts", required=True, help=".jsonl (text field), .txt (one per line) or .parquet")
    parser.add_argument("--out", required=True, help="output folder or fsspec URL (file://, s3://, ...)")
    parser.add_argument("--layers", help="comma-separated block indices, or 'all' (default: quartiles)")
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, help="forward batch on the HF engine")
    parser.add_argument("--no-special-tokens", action="store_true", help="tokenize verbatim, add no BOS")
    parser.add_argument("--project-onto", help=".npy array of directions [n_directions, hidden]")
    parser.add_argument("--column", default="text", help="column (parquet) or field (jsonl) with the text")
    parser.add_argument("--job-id", help="job id for the manifest (default: a new uuid)")
    args = parser.parse_args(argv)

    from pydantic import ValidationError
    from tqdm import tqdm

    from harvest.corpus import read_prompts
    from harvest.errors import HarvestError, invalid_from_pydantic
    from harvest.jobfiles import MANIFEST, STATS
    from harvest.shard.layout import shard_name
    from harvest.pipeline import run_job, tokenize_job
    from harvest.registry import load_registry
    from harvest.request import HarvestRequest, resolve_job
    from harvest.settings import get_settings
    from harvest.storage import Storage, StorageOptions
    from harvest.warm.client import open_engine

    settings = get_settings()

    out = args.out if "://" in args.out else f"file://{Path(args.out).expanduser().resolve()}"
    try:
        request = HarvestRequest(
            model=args.model,
            prompts=read_prompts(args.prompts, column=args.column),
            layers=_parse_layers(args.layers),
            shard_size=args.shard_size,
            batch_size=args.batch_size,
            add_special_tokens=not args.no_special_tokens,
            project_onto=_directions_payload(args.project_onto),
        )
        job = resolve_job(request, load_registry(settings))
        tokenized = tokenize_job(job)
        engine, load = open_engine(job.model, None, settings)
    except ValidationError as exc:  # the same 400 the API answers, as a message
        print(f"harvest run: {invalid_from_pydantic(exc.errors()).message}", file=sys.stderr)
        return 2
    except HarvestError as exc:
        print(f"harvest run: {exc.message}", file=sys.stderr)
        return 2

    total_tokens = sum(len(t.ids) for t in tokenized)
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"{job.model.name} on {engine.name}", file=sys.stderr)

    def on_shard(record, skipped):
        bar.update(sum(record.token_counts))

    job_id = args.job_id or str(uuid.uuid4())
    started = time.perf_counter()
    summary = run_job(job, Storage(out, options=StorageOptions.of(settings)), engine, job_id, load=load, tokenized=tokenized, on_shard=on_shard)
    corpus_s = time.perf_counter() - started
    bar.close()
    print(f"wrote {summary.n_shards} shard(s), {summary.tokens} tokens, {summary.bytes_written:,} bytes to {out} "
          f"in {corpus_s:.2f} s ({summary.tokens / corpus_s:,.0f} tokens/s; engine loaded in {load.load_s:.2f} s)")
    print(f"  manifest:  {out}/{MANIFEST}")
    print(f"  stats:     {out}/{STATS}")
    print(f"  read with: from safetensors.torch import load_file; load_file('<out>/{shard_name(0)}')['prompt_0']")
    return 0


def main(argv: list[str]) -> int:
    """`harvest run …` (the command hands over the whole argv, `run` first)."""
    return _run(argv[1:])
