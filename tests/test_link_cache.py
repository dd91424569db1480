"""A done job's links are signed once per replica and handed out again while fresh enough
(`api.links.LinkCache`), never to a key that may not read the job, never for a job whose files
are gone.

The real app in the test process (`serve_in_thread`), on its real job store, with a storage
whose filesystem signs its own links (as gcs and az do through fsspec's `sign`): each signature
carries a serial number, so the links a read hands out say how many signings there were,
independently of the code under test.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from datetime import datetime
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from sqlalchemy import update

from testbed import http_calls

N_SHARDS = 4096


class SigningMemoryFS(MemoryFileSystem):
    """fsspec's in-memory store, with `sign` as a store that presigns has it: a link names its
    expiry and a serial number of its own."""

    cachable = False  # an instance of its own, never the process's shared memory store

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store, self.pseudo_dirs = {}, [""]
        self._serial = itertools.count(1)

    def sign(self, path, expiration=100, **kwargs):
        return f"https://store.test/{path.lstrip('/')}?expires-in={expiration}&signature={next(self._serial)}"


def _serials(result: dict) -> set[int]:
    urls = [*result["shard_urls"], result["manifest_url"], result["stats_url"]]
    return {int(parse_qs(urlsplit(url).query)["signature"][0]) for url in urls}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app on a job store of its own, its storage, and its link cache (links reused for 2 s)."""
    from api.app import create_app
    from api.db import JobStore
    from api.lease import Lease
    from api.links import LinkCache
    from api.watcher import Watcher
    from harvest.storage import Storage
    from tests.api_fixtures import FileRuns, serve_in_thread

    store = JobStore.from_url(f"sqlite:///{tmp_path_factory.mktemp('links-store') / 'harvest.db'}").migrate()
    storage = Storage("memory://links-test", fs=SigningMemoryFS(), root="/links-test")
    cache = LinkCache(reuse_s=2.0)
    app = create_app(store=store, storage=storage, runs=FileRuns(tmp_path_factory.mktemp("runs")), link_cache=cache)
    # A watcher that is never started: these reads never wait for a job to change.
    app.state.watcher = Watcher(app.state.runs, storage, store, interval=1, max_waiters=1,
                                lease=Lease("watcher", "links-test", 10, store.db))
    try:
        with serve_in_thread(app) as root:
            yield f"{root}/v1", storage, cache, store
    finally:
        store.dispose()


def _job(owner, storage, status: str, engine) -> str:
    """A job of `N_SHARDS` shards in the job store of `engine`, ended with `status` (done: its manifest written)."""
    from api.db import jobs, transaction, utcnow
    from api.store import admit
    from harvest.jobfiles import JobFiles
    from harvest.lanes import load_lanes
    from harvest.settings import Settings

    job_id = str(uuid.uuid4())
    files = JobFiles.for_job(job_id, storage)
    admit(owner, {"id": job_id, "model": "llama-tiny", "lane": "small", "n_prompts": N_SHARDS, "layers": [1],
                  "shard_size": 1, "n_shards": N_SHARDS, "add_special_tokens": True, "contents": "activations",
                  "reserved_tokens": N_SHARDS, "request_url": files.request_url}, declared=load_lanes(Settings())["small"], engine=engine)
    result = {"n_shards": N_SHARDS, "layer_indices": [1], "contents": "activations", "tokens": N_SHARDS,
              "bytes_written": 1, "timings": {}}
    with transaction(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(
            status=status, completed_at=utcnow(), tokens=0, result=result if status == "done" else None))
    if status == "done":
        files.storage.write_bytes(files.MANIFEST, json.dumps({"n_shards": N_SHARDS}).encode())
    return job_id


def test_reads_of_a_done_job_sign_its_links_once_until_they_near_expiry_and_only_for_its_key(served):
    from api.auth import create_key
    from api.settings import ApiSettings
    from harvest.jobfiles import JobFiles
    from harvest.settings import get_settings

    base, storage, cache, store = served
    key, owner = create_key("links-owner", small=10, engine=store.db)
    stranger = create_key("links-stranger", engine=store.db)[0]
    done, cancelled = _job(owner, storage, "done", store.db), _job(owner, storage, "cancelled", store.db)

    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        first_at = time.time()
        first = client.get(f"/harvest/{done}").json()
        first_answered_at = time.time()  # its links were signed, and kept, before it answered
        second = client.get(f"/harvest/{done}").json()
        assert len(first["result"]["shard_urls"]) == N_SHARDS
        signed = _serials(first["result"])
        assert len(signed) == N_SHARDS + 2  # one signing per link
        assert second["result"] == first["result"] and second["urls_expire_at"] == first["urls_expire_at"]
        # What the client is told is the links' own expiry, a full lifetime from their signing.
        expires = datetime.fromisoformat(first["urls_expire_at"]).timestamp()
        assert abs(expires - (first_at + get_settings(ApiSettings).url_expiry_s)) <= 2

        # Another key: 404, no links, nothing signed for it; a cancelled job: no links.
        foreign = http_calls.get(f"{base}/harvest/{done}", headers={"Authorization": f"Bearer {stranger}"}, timeout=60)
        assert foreign.status_code == 404 and "shard_urls" not in foreign.text
        assert client.get(f"/harvest/{cancelled}").json().get("result") is None
        assert cache.held == N_SHARDS + 2  # the done job's links only

        # Past the reuse window (the links still have all but 2 s of a week): signed again. Counted
        # from the first answer, not its request: signing 4,098 links on a loaded machine takes a while.
        time.sleep(max(0.0, first_answered_at + cache.reuse_s - time.time()) + 0.1)
        later_at = time.time()
        third = client.get(f"/harvest/{done}").json()
        assert _serials(third["result"]).isdisjoint(signed) and len(_serials(third["result"])) == N_SHARDS + 2
        assert datetime.fromisoformat(third["urls_expire_at"]).timestamp() >= later_at + get_settings(ApiSettings).url_expiry_s - 2

        # The files swept: no links, and none kept.
        files = JobFiles.for_job(done, storage)
        files.storage.delete(files.MANIFEST)
        gone = client.get(f"/harvest/{done}").json()
        assert gone["urls_expired"] is True and "shard_urls" not in gone["result"]
        assert cache.held == 0


def test_the_cache_holds_at_most_its_links_dropping_the_least_recently_read_job():
    from api.links import LinkCache

    cache = LinkCache(reuse_s=60, max_links=10)
    signings = itertools.count()

    def sign(n):
        return lambda: (10**10, {"shard_urls": [f"u{next(signings)}" for _ in range(n)]})

    a = cache.links("a", "", sign(3), now=0)  # 5 links held
    cache.links("b", "", sign(3), now=0)  # 10
    assert cache.links("a", "", sign(3), now=1) is a  # read again: now the most recently read
    cache.links("c", "", sign(3), now=1)  # 15 > 10: b goes
    assert cache.held == 10 and cache.links("a", "", sign(3), now=2) is a
    assert cache.links("b", "", sign(3), now=2) is not a and cache.held == 10  # b signed again, c went
    cache.links("huge", "", sign(20), now=2)  # more than the whole cache: served, never kept
    assert cache.held == 10
    assert cache.links("a", "", sign(3), now=61) is not a  # past its reuse window: signed again
