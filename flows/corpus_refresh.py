"""The corpus refresh: re-harvest a corpus file (parquet or JSONL, any fsspec URL) on a schedule.

Each run reads the corpus with pyarrow/fsspec (`harvest.corpus.read_prompts`), cuts it into
jobs of at most 4096 prompts (a harvest request's limit), and harvests each into a dated
prefix:

    <storage>/corpus/<name>/<YYYY-MM-DD>/part-0000/{request.json, shards, stats, manifest.json}

Each part runs the `harvest` flow as a subflow in this process, so the model is loaded once per
part and the parts get the same resume behaviour: a re-run on the same day skips the shards
already written. Scheduled copies of this flow's deployment are made by `harvest schedule
create` (flows/schedule.py) on the work pool of the model's lane, since the run uses its GPU.
"""

from __future__ import annotations

from datetime import datetime, timezone

from prefect import flow, get_run_logger

from harvest.corpus import read_prompts
from harvest.jobfiles import JobFiles
from harvest.request import MAX_PROMPTS, HarvestRequest
from harvest.storage import open_storage
from flows.harvest import harvest

__all__ = ["corpus_refresh", "refresh_prefix"]


def refresh_prefix(name: str, day: datetime | None = None) -> str:
    day = day or datetime.now(timezone.utc)
    return f"corpus/{name}/{day:%Y-%m-%d}"


@flow(name="corpus-refresh", persist_result=False)
def corpus_refresh(
    corpus_url: str,
    model: str,
    column: str = "text",
    layers: list[int] | str | None = None,
    shard_size: int = 32,
    name: str = "corpus",
) -> dict:
    """Harvest every prompt of `corpus_url` (column/field `column`) into a dated prefix.

    corpus_url: .parquet, .jsonl or .txt, any fsspec URL (file://, s3://…).
    layers: block indices, "all", or None for the quartile blocks.
    name: the corpus's name in the output prefix `corpus/<name>/<date>/`.
    """
    logger = get_run_logger()
    prompts = read_prompts(corpus_url, column=column)
    folder = open_storage().child(refresh_prefix(name))
    parts = []
    for i, start in enumerate(range(0, len(prompts), MAX_PROMPTS)):
        request = HarvestRequest(model=model, prompts=prompts[start : start + MAX_PROMPTS], layers=layers, shard_size=shard_size)
        part = JobFiles(folder.child(f"part-{i:04d}"))  # a job's layout, in a dated folder
        request_url = part.write_request(request)
        job_id = f"{name}-{folder.url.rsplit('/', 1)[-1]}-part-{i:04d}"
        state = harvest(job_id=job_id, request_url=request_url, return_state=True)
        if not state.is_completed():
            raise RuntimeError(f"part {i} of {corpus_url} ended {state.name}: {state.message}")
        parts.append(part.url)
        logger.info("harvested part %d (%d prompts) into %s", i, len(request.prompts), part.url)
    return {"corpus_url": corpus_url, "n_prompts": len(prompts), "parts": parts}
