"""Each key's fair share of an API replica: its requests in flight bounded, its blocking work
served in turn with the other keys', and refusals that cost the replica no query.

The mechanism (`api.fairshare.FairShare`, `api.ratelimit.EmptyBuckets`) is tested on its own;
the HTTP tests serve the real app in the test process (`serve_in_thread`) on its real job
store, so the store's statements can be counted with an SQLAlchemy event (the reference for
"no query": what the store itself saw).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import event

from api.errors import RateLimited
from api.fairshare import FairShare
from api.ratelimit import EmptyBuckets, KeyOverRate
from tests.api_fixtures import serve_in_thread


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# --- the fair scheduler -----------------------------------------------------------------------

def test_a_key_with_many_calls_queued_delays_another_keys_call_by_one_call():
    """One place: A's first call holds it while A queues four more and B one. B's call runs
    after A's next one, in turn, not after all of A's (first come, first served: last)."""
    fair = FairShare(per_key=100, at_once=1)
    ran: list[str] = []
    gate = threading.Event()

    def call(name: str, wait: bool = False) -> None:
        if wait:
            assert gate.wait(10)
        ran.append(name)

    async def main() -> None:
        first = asyncio.create_task(fair.run("A", call, "A1", wait=True))
        await asyncio.sleep(0.05)
        tasks = [asyncio.create_task(fair.run("A", call, f"A{i}")) for i in range(2, 6)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(fair.run("B", call, "B1")))
        await asyncio.sleep(0.01)
        assert fair.running == 1 and fair.waiting("A") == 4 and fair.waiting("B") == 1
        gate.set()
        await asyncio.gather(first, *tasks)

    asyncio.run(main())
    assert ran == ["A1", "A2", "B1", "A3", "A4", "A5"]
    assert fair.running == 0 and fair.waiting() == 0


def test_a_call_cancelled_while_waiting_leaves_no_place_taken():
    fair = FairShare(per_key=100, at_once=1)
    gate = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        holder = asyncio.create_task(fair.run("A", gate.wait, 10))
        await asyncio.sleep(0.05)
        left = asyncio.create_task(fair.run("B", ran.append, "B"))  # its client goes away
        after = asyncio.create_task(fair.run("C", ran.append, "C"))
        await asyncio.sleep(0.01)
        left.cancel()
        gate.set()
        await holder
        await after
        with pytest.raises(asyncio.CancelledError):
            await left

    asyncio.run(main())
    assert ran == ["C"] and fair.running == 0 and fair.waiting() == 0


def test_a_key_has_at_most_its_reads_in_flight_and_waiting_long_polls_and_submits_do_not_count():
    fair = FairShare(per_key=2, at_once=4)
    first, second = fair.enter("A"), fair.enter("A")
    with pytest.raises(RateLimited) as refused:
        fair.enter("A")
    assert refused.value.headers["Retry-After"] == "1" and refused.value.status == 429
    assert refused.value.code == "rate_limit_exceeded" and "at most 2 of one key's reads" in str(refused.value)
    fair.enter("B").leave()  # another key is not refused
    with first.aside():  # a long-poll waiting: its place is free meanwhile
        third = fair.enter("A")
    assert fair.in_flight("A") == 3  # the waiter came back: counted again, never refused
    for share in (first, second, third, third):  # leaving twice counts once
        share.leave()
    assert fair.in_flight("A") == 0
    submit = fair.uncounted("A")  # a submit: its turns only
    with submit.aside():
        pass
    submit.leave()
    assert fair.in_flight("A") == 0 and fair.enter("A")


# --- buckets known empty ------------------------------------------------------------------------

def test_a_bucket_known_empty_is_refused_from_memory_until_its_token_is_back_and_not_after():
    empty = EmptyBuckets(max_entries=2)
    empty.remember("A", "read", KeyOverRate("read", 0.5, 2, wait=1.5), now=100.0)
    with pytest.raises(KeyOverRate) as refused:
        empty.check("A", "read", now=100.2)
    assert refused.value.headers["Retry-After"] == "2" and "at most 2 at once and 0.5 a second" in str(refused.value)
    with pytest.raises(KeyOverRate) as refused:
        empty.check("A", "read", now=101.0)
    assert refused.value.headers["Retry-After"] == "1"  # counted down
    empty.check("A", "submit", now=100.2)  # another kind: the store decides
    empty.check("B", "read", now=100.2)  # another key too
    empty.check("A", "read", now=101.5)  # the token is back: the store decides again
    for caller in "CDE":  # bounded: the least recently refused goes first
        empty.remember(caller, "read", KeyOverRate("read", 1.0, 1, wait=60), now=100.0)
    assert len(empty._until) == 2
    empty.check("C", "read", now=100.0)


# --- over HTTP, on the real app and job store ----------------------------------------------------

class _Statements:
    """The job store's statements of this process, those naming `marker` in their parameters
    counted apart, and those slowed by `delay_s` (a busy store, for one key only)."""

    def __init__(self, engine, marker: str = "", delay_s: float = 0.0):
        self.engine, self.marker, self.delay_s = engine, marker, delay_s
        self.all = 0
        self.marked = 0
        self._lock = threading.Lock()

    def __call__(self, conn, cursor, statement, parameters, context, executemany):
        marked = bool(self.marker) and self.marker in str(parameters)
        with self._lock:
            self.all += 1
            self.marked += marked
        if marked and self.delay_s:
            time.sleep(self.delay_s)

    def __enter__(self):
        event.listen(self.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *exc):
        event.remove(self.engine, "before_cursor_execute", self)


@pytest.fixture(scope="module")
def fair_app(job_store):
    """The app on the session's job store with one blocking call at a time on the replica and
    8 reads in flight a key."""
    from api.app import create_app

    app = create_app(store=job_store, fair_share=FairShare(per_key=8, at_once=1))
    with serve_in_thread(app) as root:
        yield f"{root}/v1", app


def test_a_key_over_its_rate_is_refused_from_memory_until_a_token_is_back(fair_app, job_store):
    """After the store says the bucket is empty, the key's reads are 429 without a statement;
    once the store's wait has passed, a read is served again."""
    from api.auth import create_key

    base, _ = fair_app
    key = create_key("fair-slow-reader", rate_read_per_s=1.0, rate_read_burst=1, engine=job_store.db)[0]
    with httpx.Client(base_url=base, headers=_auth(key), timeout=30) as client:
        assert client.get("/harvest").status_code == 200
        refused = client.get("/harvest")  # the store answers: empty for about a second
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        started = time.monotonic()
        with _Statements(job_store.db) as statements:
            again = [client.get("/harvest") for _ in range(10)] + [client.get("/models")]
        assert [r.status_code for r in again] == [429] * 11
        assert statements.all == 0, f"{statements.all} job-store statements for requests refused from memory"
        assert "at most 1 at once and 1 a second" in again[-1].json()["error"]["message"]
        assert again[-1].headers["Retry-After"] == "1"
        time.sleep(max(0.0, 1.05 - (time.monotonic() - started)))
        assert client.get("/harvest").status_code == 200  # never refused past the store's own answer


def test_a_key_with_many_requests_in_flight_cannot_keep_another_keys_read_waiting(fair_app, job_store):
    """Key A sends 12 reads at once, each of its lookups slowed to 0.3 s by a busy store: the
    replica works on 8 (its share), the other 4 are 429 at once without a statement; key B's
    one read, sent meanwhile, is served in turn (after about 3 of A's calls), not after A's 7 queued
    lookups (2.1 s and more)."""
    from api.auth import bearer_hash, create_key

    base, _ = fair_app
    greedy, other = create_key("fair-greedy", engine=job_store.db)[0], create_key("fair-other", engine=job_store.db)[0]
    delay = 0.3

    client = httpx.Client(base_url=base, timeout=60, limits=httpx.Limits(max_connections=20))

    def read(key: str) -> tuple[int, dict, float]:
        started = time.monotonic()
        response = client.get("/harvest", headers=_auth(key))
        return response.status_code, dict(response.headers), time.monotonic() - started

    with client, _Statements(job_store.db, marker=bearer_hash(f"Bearer {greedy}"), delay_s=delay) as statements, \
            ThreadPoolExecutor(13) as pool:
        flood = [pool.submit(read, greedy) for _ in range(12)]
        # A's share is taken once the replica has refused the 4 past it (at once, without a
        # statement): then 8 of A's reads are held, and B's is sent behind them.
        deadline = time.monotonic() + 30
        while sum(future.done() for future in flood) < 4:
            assert time.monotonic() < deadline, "the replica refused none of A's reads past its share"
            time.sleep(0.01)
        status, _, waited = pool.submit(read, other).result()
        answers = [f.result() for f in flood]
    assert status == 200
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    assert len(served) == 8 and len(refused) == 4, [a[0] for a in answers]
    slowest = max(took for _, _, took in served)
    assert all(headers["retry-after"] == "1" for _, headers, _ in refused)
    # Refused at once: before the first of A's served reads, which waited for their lookups.
    assert max(took for _, _, took in refused) < min(took for _, _, took in served), [(a[0], round(a[2], 2)) for a in answers]
    assert statements.marked == 8, "one lookup per request served, none for those refused"
    assert slowest >= 8 * delay * 0.9  # A's lookups did queue behind each other
    # First come, first served, B's lookup would wait for A's 7 queued ones, and B answer about
    # when A's last does; in turn, it waits for about 3 of A's calls.
    assert waited < 0.75 * slowest, f"B waited {waited:.2f} s; A's share took {slowest:.2f} s"
