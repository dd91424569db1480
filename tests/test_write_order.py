"""The manifest is the last write into a job's folder on the flow path: nothing, progress
included, is written after it, so a reader that finds the manifest finds every other file
complete and final. Here on local disk, one run and a job split over two runs (scale-out: the
helper run's shards, records and timings land before the parent's manifest); on S3, one run and
scale-out, in tests/test_storage_fresh.py.

The writes are seen by the kernel (inotify, `tests.write_log`), outside the flow runs' processes.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from harvest.jobfiles import MANIFEST, PARTS, PROGRESS, REQUEST, STATS, JobFiles
from harvest.shard.layout import part_name, shard_name
from harvest.storage import open_storage
from harvest.settings import get_settings
from tests.write_log import DiskWrites

N_SHARDS = 4
REQUEST_BODY = {"model": "llama-tiny", "prompts": [f"order prompt {i}" for i in range(N_SHARDS)], "shard_size": 1, "layers": [1, 5]}


@pytest.mark.parametrize("workers", [1, 2], ids=["one-run", "scale-out"])
def test_nothing_is_written_into_the_job_folder_after_the_manifest_on_local_disk(harvest_stack, workers):
    job_id = str(uuid.uuid4())
    folder = Path(JobFiles.for_job(job_id, open_storage(get_settings())).storage.root)
    (folder / PARTS).mkdir(parents=True)  # watched from the start: its records' order is exact
    with DiskWrites(folder) as writes:
        # A key of its own: its queue's two slots are the parent's and the helper's, whatever
        # another test's runs of the shared key "test" still hold.
        job = harvest_stack.submit(REQUEST_BODY, workers=workers, job_id=job_id, key_id=f"order{job_id[:8]}")
        status = harvest_stack.wait(job.flow_run_id, timeout=240)
        time.sleep(1.0)  # a write just after the run ended would show too
    assert status.status == "done", status
    renamed = [path for path, kind in writes.events if kind in ("rename", "link")]  # put in place
    assert renamed.count(MANIFEST) == 1 and not [e for e in writes.events if e[1] == "found"], writes.events
    after = writes.events[writes.events.index((MANIFEST, "rename")) + 1 :]
    assert after == [], f"written after the manifest: {after}"
    before = set(renamed[: renamed.index(MANIFEST)])
    shards = {shard_name(k) for k in range(N_SHARDS)} | {part_name(k) for k in range(N_SHARDS)}
    assert shards | {STATS, PROGRESS, REQUEST} <= before, renamed
    helper_timings = {p for p in before if p.startswith("_parts/timings-")}
    # The split itself, from the files: with two runs the helper reported its range's timings.
    assert len(helper_timings) == workers - 1, renamed
