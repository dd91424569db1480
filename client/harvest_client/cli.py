"""`harvest-client`: the client from a shell.

    harvest-client harvest --model M --prompts corpus.parquet --column text --out DIR [--layers 2,4,6|all]
                           [--shard-size N] [--no-special-tokens] [--project-onto dirs.npy]
                           [--max-prompts-per-job N] [--workers N]
    harvest-client download JOB_ID --out DIR

ACS_API_BASE and ACS_API_KEY say where and who (or --api-base / --api-key). Running the same
`harvest` command again resumes it.

Errors are one line on stderr, `harvest-client: error: <status> <code>: <message>` for the
service's answers (`harvest-client: error: <message>` otherwise), and a non-zero exit status:
2 for usage (a bad argument, no ACS_API_BASE or key), 1 for anything else, 130 for Ctrl-C.
`--debug` shows the Python traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import httpx

from harvest_client.errors import ApiError, HarvestClientError

__all__ = ["main"]


def _layers(text: str | None):
    if text is None:
        return None
    if text == "all":
        return "all"
    return [int(v) for v in text.split(",") if v.strip()]


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in the client's one-line form (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"harvest-client: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harvest-client", description="Harvest residual-stream activations of a corpus "
                                     "through the service, and download jobs, verified and resumable.")
    parser.add_argument("--api-base", help="default: $ACS_API_BASE")
    parser.add_argument("--api-key", help="default: $ACS_API_KEY")
    parser.add_argument("--debug", action="store_true", help="show a Python traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True)

    harvest = commands.add_parser("harvest", help="harvest a whole corpus into a dataset folder (resumable)")
    harvest.add_argument("--model", required=True, help="served model name, e.g. llama-tiny")
    harvest.add_argument("--prompts", required=True, help=".jsonl, .txt or .parquet; a path or any fsspec URL")
    harvest.add_argument("--column", default="text", help="the field/column holding the text (default: text)")
    harvest.add_argument("--out", required=True, help="the dataset folder")
    harvest.add_argument("--layers", help="comma-separated block indices, or 'all' (default: the quartile blocks)")
    harvest.add_argument("--shard-size", type=int, default=32, help="prompts per shard file (default 32)")
    harvest.add_argument("--no-special-tokens", action="store_true", help="tokenize verbatim, add no start token")
    harvest.add_argument("--project-onto", help="a .npy array [n_directions, hidden]: harvest projections onto it")
    harvest.add_argument("--max-prompts-per-job", type=int, default=4096, help="jobs of at most this many prompts")
    harvest.add_argument("--workers", type=int, default=8, help="parallel downloads (default 8)")
    harvest.add_argument("--quiet", action="store_true", help="no progress bar")

    download = commands.add_parser("download", help="download one job's files, verified (waits for it to end)")
    download.add_argument("job_id")
    download.add_argument("--out", required=True, help="the folder for its shards, stats and manifest")
    download.add_argument("--workers", type=int, default=8, help="parallel downloads (default 8)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse exits 2 itself on a usage error)."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # the folder was saved resumable; the message is already out
        return 130
    except Exception as exc:
        if args.debug:
            raise
        line, status = _describe(exc, args)
        print(f"harvest-client: error: {line}", file=sys.stderr)
        return status


def _describe(exc: Exception, args) -> tuple[str, int]:
    """One line and an exit status for an error (no traceback: `--debug` shows it)."""
    if isinstance(exc, ApiError):
        text = f"{exc.status} {exc.code}: {exc.message}"
    elif isinstance(exc, httpx.TransportError):
        text = f"cannot reach the service ({type(exc).__name__}: {exc}); check ACS_API_BASE or --api-base"
    elif isinstance(exc, (HarvestClientError, OSError, ValueError)):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc} (--debug shows where)"
    status = exc.exit_status if isinstance(exc, HarvestClientError) else 1
    return " ".join(text.split()), status


def _run(args) -> int:
    from harvest_client.client import Client

    with Client(args.api_base, args.api_key) as client:
        if args.command == "harvest":
            directions = None
            if args.project_onto:
                import numpy as np

                directions = np.load(args.project_onto)
            summary = client.harvest(
                args.model, args.prompts, args.out, layers=_layers(args.layers), project_onto=directions,
                add_special_tokens=not args.no_special_tokens, shard_size=args.shard_size, column=args.column,
                max_prompts_per_job=args.max_prompts_per_job, download_workers=args.workers, progress=not args.quiet,
            )
            print(json.dumps({**asdict(summary), "out": str(summary.out)}, indent=1))
        else:
            out = client.download(args.job_id, args.out, workers=args.workers)
            print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
