"""The corpus refresh: re-harvest a corpus file (parquet or JSONL, any fsspec URL) on a schedule.

Each run reads the corpus with pyarrow/fsspec (`harvest.corpus.read_prompts`), cuts it into
parts of at most 4096 prompts (a harvest request's limit), and harvests each part, as a job of
its own, into a dated prefix:

    <storage>/corpus/<name>/<YYYY-MM-DD>/part-0000/{request.json, shards, stats, manifest.json}

The parts spread over the lane's hosts the way a job's shards do (`flows.placement`): this run
does one part at a time itself, as a `harvest` subflow in its own process (it already holds a
slot of the lane, and a lane of one slot must still finish), and before each it hands as many
of the remaining parts as the lane has free slots to `harvest` flow runs of the lane's
deployment, which any host of the lane picks up. Each part, here or there, spreads its own
shards over whatever is still free (the harvest flow's automatic `workers`). A handed-out part
that does not start, or ends without finishing, is taken back and done here by the same rules
as a job's helpers (`flows.scale_out.HelperWatch`). Every part keeps the harvest flow's resume:
a re-run on the same day skips the shards already written. Scheduled copies of this flow's
deployment are made by `harvest schedule create` (flows/schedule.py) on the work pool of the
model's lane.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run as current_run

from flows.harvest import harvest
from flows.scale_out import POLL_S, HelperWatch
from flows.placement import lane_free_slots
from flows.submit import cancel_harvest_run
from harvest.corpus import read_prompts
from harvest.errors import InvalidRequest
from harvest.jobfiles import JobFiles
from harvest.lanes import deployment_name
from harvest.placement import COLLECT, WAIT
from harvest.registry import load_registry
from harvest.request import MAX_PROMPTS, HarvestRequest
from harvest.settings import Settings, get_settings
from harvest.storage import open_storage

__all__ = ["corpus_refresh", "refresh_prefix", "check_refresh_name", "REFRESH_NAME"]

PART_TAG = "corpus-part"

REFRESH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""A refresh's (a schedule's) name: one folder of the storage root's `corpus/`, so letters,
digits, `-` and `_` only (no `/`, no `..`: `--name ../../x` would write outside the root)."""


def check_refresh_name(name: str) -> str:
    """`name` when it is a safe refresh name (`REFRESH_NAME`), else 400 `invalid_request`."""
    if not isinstance(name, str) or not REFRESH_NAME.fullmatch(name):
        raise InvalidRequest(
            f"The name {name!r} cannot name a corpus refresh: use 1 to 64 letters, digits, '-' or '_', "
            "starting with a letter or digit (it becomes the folder corpus/<name>/ of the storage).",
            param="name",
        )
    return name


def refresh_prefix(name: str, day: datetime | None = None) -> str:
    day = day or datetime.now(timezone.utc)
    return f"corpus/{check_refresh_name(name)}/{day:%Y-%m-%d}"


@dataclass(frozen=True)
class _Part:
    index: int
    job_id: str
    files: JobFiles


def _harvest_here(part: _Part) -> None:
    state = harvest(job_id=part.job_id, request_url=part.files.request_url, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"part {part.index} ({part.job_id}) ended {state.name}: {state.message}")


def _hand_out(part: _Part, lane: str, tags: list[str]) -> UUID:
    """A `harvest` flow run of the lane's deployment for one part (idempotent per refresh run,
    so a rescheduled refresh re-attaches to the parts it handed out before)."""
    from prefect.deployments import run_deployment

    child = run_deployment(
        deployment_name(lane),
        parameters={"job_id": part.job_id, "request_url": part.files.request_url},
        timeout=0,
        as_subflow=True,
        idempotency_key=f"{current_run.get_id()}:{part.job_id}",
        flow_run_name=part.job_id,
        tags=tags,
    )
    return child.id


def _spread(parts: list[_Part], lane: str, tags: list[str], settings: Settings) -> dict[int, str]:
    """Harvest every part, here and on the lane's free slots; returns where each part ran
    ("here", or the flow run id that did it)."""
    logger = get_run_logger()
    todo = list(parts)
    away: dict[UUID, _Part] = {}
    where: dict[int, str] = {}
    with get_client(sync_client=True) as client:
        watch = HelperWatch(client, settings)
        try:
            while todo or away:
                for child_id, part in list(away.items()):
                    action, kind = watch.look(child_id)
                    if action == WAIT:
                        continue
                    del away[child_id]
                    if action == COLLECT:
                        where[part.index] = str(child_id)
                    else:  # it did not start, or ended unfinished: its part comes back here, next
                        logger.info("part %d: its run %s %s (%s); doing it here", part.index, child_id, action, kind)
                        todo.insert(0, part)
                if len(todo) > 1:  # keep one for this run; hand out what the lane can take now
                    try:
                        free = lane_free_slots(client, lane).free
                    except Exception:
                        logger.warning("could not read lane %s; keeping the parts here", lane, exc_info=True)
                        free = 0
                    for part in todo[1 : 1 + free]:
                        away[_hand_out(part, lane, tags)] = part
                        logger.info("part %d handed to the lane", part.index)
                    todo = todo[:1] + todo[1 + free :]
                if todo:
                    part = todo.pop(0)
                    _harvest_here(part)
                    where[part.index] = "here"
                    if not todo:
                        watch.start_grace()  # nothing left to do here: wait, but not for ever
                else:
                    time.sleep(POLL_S)
        except BaseException:
            for child_id in away:  # a failed or cancelled refresh leaves no part running
                try:
                    cancel_harvest_run(child_id)
                except Exception:
                    logger.warning("could not cancel part run %s", child_id, exc_info=True)
            raise
    return where


@flow(name="corpus-refresh", persist_result=False)
def corpus_refresh(
    corpus_url: str,
    model: str,
    column: str = "text",
    layers: list[int] | str | None = None,
    shard_size: int = 32,
    name: str = "corpus",
    part_size: int = MAX_PROMPTS,
) -> dict:
    """Harvest every prompt of `corpus_url` (column/field `column`) into a dated prefix.

    corpus_url: .parquet, .jsonl or .txt, any fsspec URL (file://, s3://…).
    layers: block indices, "all", or None for the quartile blocks.
    name: the corpus's name in the output prefix `corpus/<name>/<date>/`.
    part_size: prompts per part (one harvest job each), at most 4096.
    """
    logger = get_run_logger()
    if not 1 <= part_size <= MAX_PROMPTS:
        raise ValueError(f"part_size must be 1..{MAX_PROMPTS}, not {part_size}")
    settings = get_settings()  # in this flow run's process: its own environment
    lane = load_registry(settings).for_harvest(model).lane
    prompts = read_prompts(corpus_url, column=column)
    folder = open_storage(settings).child(refresh_prefix(name))
    parts = []
    for i, start in enumerate(range(0, len(prompts), part_size)):
        request = HarvestRequest(model=model, prompts=prompts[start : start + part_size], layers=layers, shard_size=shard_size)
        files = JobFiles(folder.child(f"part-{i:04d}"))  # a job's layout, in a dated folder
        files.write_request(request)
        parts.append(_Part(i, f"{name}-{folder.url.rsplit('/', 1)[-1]}-part-{i:04d}", files))
    tags = [PART_TAG, f"model:{model}", f"lane:{lane}", f"corpus:{name}"]
    where = _spread(parts, lane, tags, settings)
    for part in parts:
        logger.info("harvested part %d into %s (%s)", part.index, part.files.url, where[part.index])
    return {
        "corpus_url": corpus_url,
        "n_prompts": len(prompts),
        "parts": [part.files.url for part in parts],
        "ran_on": [where[part.index] for part in parts],
    }
