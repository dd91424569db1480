"""The manifest is the last write into a job's folder on the flow path (local disk here; S3 and
scale-out in tests/test_storage_fresh.py): nothing, progress included, is written after it,
so a reader that finds the manifest finds every other file complete and final.

The writes are seen by the kernel (inotify, `tests.write_log`), outside the flow run's process.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from harvest.jobfiles import MANIFEST, STATS, JobFiles, shard_name
from tests.write_log import DiskWrites

REQUEST = {"model": "llama-tiny", "prompts": [f"order prompt {i}" for i in range(4)], "shard_size": 2, "layers": [1, 5]}


def test_nothing_is_written_into_the_job_folder_after_the_manifest_on_local_disk(harvest_stack):
    job_id = str(uuid.uuid4())
    folder = Path(JobFiles.for_job(job_id).storage.root)
    folder.mkdir(parents=True)
    with DiskWrites(folder) as writes:
        job = harvest_stack.submit(REQUEST, workers=1, job_id=job_id)
        status = harvest_stack.wait(job.flow_run_id, timeout=180)
        time.sleep(1.0)  # a write just after the run ended would show too
    assert status.status == "done", status
    renamed = [path for path, kind in writes.events if kind == "rename"]
    assert renamed.count(MANIFEST) == 1, writes.events
    after = writes.events[writes.events.index((MANIFEST, "rename")) + 1 :]
    assert after == [], f"written after the manifest: {after}"
    before = set(renamed[: renamed.index(MANIFEST)])
    assert {shard_name(0), shard_name(1), STATS, "_progress.json", "request.json"} <= before, renamed
