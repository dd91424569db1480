"""The API's watcher: follows the runs of the active jobs, on one replica at a time.

Every API replica runs a `Watcher`; only the one holding the `watcher` lease (`api.lease`)
works, so the service follows Prefect once however many replicas and clients there are. The
lease is renewed on a clock of its own (`api.lease.LeaseKeeper`, a thread, every third of
`watcher_lease_s`), never between ticks, so a slow tick cannot let it lapse; a tick asks
`Lease.holds` before each write, so a tick that outlived a lost lease writes nothing more.

What a tick reads costs what changed, not how many jobs there are:

- **The runs the events named.** The run store's push (`RunStore.follow`: Prefect's event
  stream) names each run whose state changed, or whose job's progress it reported
  (`flows.run_status.PROGRESS_EVENT`); a submit names its own. A tick looks those runs' jobs
  up by run id (one indexed query) and reads those runs, and only those, in one call to the
  run store.
- **A slow paged re-read**, once per `watch_interval_s`: the next `watch_page` active jobs in id
  order (`api.store.active_page`), cycling through all of them, so a change whose event was
  missed (the stream down, this replica just taking the lease over) is still recorded within
  (ceil(active jobs / watch_page) + 1) intervals: with the shipped 1 s and 200, 6 s at 1,000
  active jobs, 51 s at 10,000. The page's runs go in the same read as the named ones.
- **No listing of job folders for progress.** A job's run reports how many of its shards are
  written on the run itself (the `harvest.shards_done` label, `flows.progress`), which the same
  read returns (`RunStatus.shards_done`); it reaches the job row when it rises
  (`api.store.set_progress`). Runs hold no job-store credentials, so Prefect carries it. A
  job's folder is read only when its run has ended (its manifest, the bytes it keeps).

So a tick costs at most one run-store call (the named runs plus one page) and a few indexed
queries, whether 100 or 10,000 jobs are active. Once per interval the holder also finishes
what others left:

- a run whose host died is marked Crashed by Prefect's heartbeat automation
  (`flows.liveness`); the watcher reschedules it onto another host of its lane, where it
  resumes from the verified shards, at most `max_restarts` times a job;
- a job whose admitting replica died before starting its run gets its run started here
  (idempotent per job id, so a run that did start is found, not doubled);
- a job whose start failed (`stop_run`) may still have a run its backend created before the
  failure: the watcher cancels the job's runs by their `job:<id>` tag until that succeeds,
  so no run goes on unfollowed and uncharged.
- `Idempotency-Key` records past their window are deleted every `PRUNE_EVERY_S`
  (`api.idempotency.prune_expired`).
- an ended job whose run was still stopping when it ended (Prefect's Cancelling, after a
  cancel) counts its admitted bytes until its run is over; then its folder is measured
  (`settle`, `api.store.settle_bytes`), `SETTLE_BATCH` such jobs a tick (and at once when an
  event names its run), their runs read in the tick's one call.

A `?wait=` reader never talks to Prefect: it sleeps on an asyncio event that is set when its
job changes status, announced by whichever replica changed it (`api.notify`). A replica holds at
most `longpoll_max_waiters` such readers, and one key at most its share of them
(`longpoll_key_share`, at least one); a reader over either is answered at once, as an
immediate read with `X-Acs-Longpoll: declined` and `Retry-After: 3` (the documented answer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta

from api.db import JobStore, utcnow
from api.idempotency import PRUNE_EVERY_S, WINDOW_S, prune_expired
from api.lease import Lease, LeaseKeeper
from api.notify import JobChanges
from api.runs import RunStatus, RunStore
from api.settings import ApiSettings
from api.store import (
    ACTIVE,
    active_page,
    apply_state,
    attach_run,
    fail_job,
    jobs_of_runs,
    record_restart,
    run_over,
    run_stopped,
    runs_to_stop,
    set_progress,
    settle_bytes,
    unsettled_jobs,
    unstarted_jobs,
)
from harvest.jobfiles import JobFiles
from harvest.metrics import WATCHER_TICK_SECONDS
from harvest.storage import Storage

__all__ = ["Watcher"]

log = logging.getLogger("harvest.api.watcher")

MIN_GAP_S = 0.05
"""The least pause between two ticks, however many kicks came."""
SETTLE_BATCH = 20
"""Ended, unmeasured jobs a tick looks at (`settle`): one listing of its folder each, once its
run is over. After an upgrade to migration 0008 every earlier job is one of them, once."""
WATCH_PAGE = 200
"""Active jobs re-read per interval, by default (`ApiSettings.watch_page`): one Prefect request."""
ORPHANS_PER_TICK = 20
"""Orphaned jobs (admitted, no run) a tick starts, the oldest first; more wait for the next
interval. Starting a run is a Prefect write (~60 ms): a replica that died with many submits in
flight must not make one tick long (900 at once took a tick 53 s in `bench/bench_scale.py`)."""
NAMED_PER_TICK = 1000
"""Runs named by events that one tick takes; more wait for the next tick (kicked at once), so a
burst of events never makes one tick long."""
MAX_NAMED = 20_000
"""Runs named and not yet read that a replica keeps (also while another holds the lease, so a
take-over reads what was named just before it): past it the oldest name is dropped, and the
paged re-read records its run's change."""
LEASE_MARGIN = 0.2
"""A tick writes only while the lease lasts at least this share of its TTL more (`Lease.holds`)."""


class LeaseLost(Exception):
    """The lease lapsed or passed to another replica during a tick: the tick stops writing."""


class Watcher:
    """One per API process (started by the app's lifespan), on the app's run store, storage and
    job store; `lease` is the `watcher` lease in that job store (None: a process that is the only
    watcher, e.g. a benchmark ticking it by hand). `page`: active jobs re-read per interval."""

    def __init__(
        self, runs: RunStore, storage: Storage, store: JobStore, *, interval: float, max_waiters: int, lease: Lease | None,
        max_restarts: int = 3, orphan_after_s: float = 30.0, per_key: int | None = None,
        idempotency_window_s: float = WINDOW_S, page: int = WATCH_PAGE,
    ):
        self.runs = runs
        self.storage = storage
        self.store = store
        self.interval = interval
        self.max_waiters = max_waiters
        self.lease = lease
        self.max_restarts = max_restarts
        self.orphan_after_s = orphan_after_s
        self.page = page
        self.waiting = 0
        self.per_key = max_waiters if per_key is None else per_key
        """Waiter slots one key may hold (`HARVEST_LONGPOLL_KEY_SHARE` of them: `from_settings`)."""
        self.idempotency_window_s = idempotency_window_s
        self._next_prune = 0.0  # monotonic time of the next `prune_expired`
        self._next_pass = 0.0  # monotonic time of the next interval's duties (re-read page, orphans…)
        self._page_after: str | None = None  # id of the last active job the re-read looked at
        self._unsettled_after: tuple | None = None  # (completed_at, id) of the last unmeasured job looked at
        self._named: dict[str, None] = {}  # runs named by events or submits, oldest first, not yet read
        self._named_lock = threading.Lock()  # named on the event loop, taken by ticks in a thread
        self._held: dict[str, int] = defaultdict(int)  # waiter slots held, by key id
        self.ticks = 0
        self.run_reads = 0
        """Calls to the run store's `read` made by ticks."""
        self.runs_read = 0
        """Runs those calls asked for, all together."""
        self.cycles = 0
        """Passes of the paged re-read through every active job."""
        self.names_dropped = 0
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._follow: asyncio.Task | None = None
        self._kick: asyncio.Event | None = None
        self._keeper: LeaseKeeper | None = None
        self._changes = JobChanges(self.notify_threadsafe, store.db)

    @classmethod
    def from_settings(cls, runs: RunStore, storage: Storage, store: JobStore, settings: ApiSettings, lease: Lease) -> "Watcher":
        """The replica's watcher as its settings say (`api.app`'s lifespan)."""
        return cls(
            runs, storage, store, interval=settings.watch_interval_s, max_waiters=settings.longpoll_max_waiters, lease=lease,
            max_restarts=settings.max_restarts, orphan_after_s=settings.orphan_after_s,
            # a share of the slots, at least one
            per_key=max(1, int(settings.longpoll_max_waiters * settings.longpoll_key_share)),
            idempotency_window_s=settings.idempotency_window_s, page=settings.watch_page,
        )

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._changes.start()
        if self.lease is not None:  # renewed on its own clock, whatever the ticks do
            period = self.lease.ttl.total_seconds() / 3
            self._keeper = LeaseKeeper(self.lease, period, on_gained=self.kick).start()
        self._task = asyncio.create_task(self._run(), name="harvest-watcher")
        self._follow = asyncio.create_task(self.runs.follow(self.run_changed), name="harvest-run-events")

    async def stop(self) -> None:
        for task in (self._follow, self._task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._changes.stop()
        if self._keeper is not None:
            await asyncio.to_thread(self._keeper.stop)  # no renewal after the release below
        if self.lease is not None and self.lease.held:
            try:
                await asyncio.to_thread(self.lease.release)  # hand over at once, not after the TTL
            except Exception:
                log.exception("could not release the watcher lease")

    def holding(self) -> bool:
        """Whether this replica may act as the watcher now (its lease lasts past the margin)."""
        return self.lease is None or self.lease.holds(LEASE_MARGIN * self.lease.ttl.total_seconds())

    def _guard(self) -> None:
        """Before each write of a tick: stop if the lease may be another's by the time it lands."""
        if not self.holding():
            raise LeaseLost("the watcher lease lapsed during the tick")

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            if self.holding():
                try:
                    await asyncio.to_thread(self.tick)
                except asyncio.CancelledError:
                    raise
                except LeaseLost:
                    log.warning("the watcher lease lapsed during a tick; the tick stopped before writing more")
                except Exception:  # Prefect or the database briefly away: try again next tick
                    log.exception("watcher tick failed")
            # A kick runs the next tick early, but never sooner than the last one took (at
            # least MIN_GAP_S, at most the interval): a stream of run events keeps the watcher
            # at most half busy while its ticks are shorter than the interval.
            busy = time.monotonic() - started
            await asyncio.sleep(max(MIN_GAP_S, min(busy, self.interval)))
            due = self._next_pass - time.monotonic() if self.holding() else self.interval
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=max(0.0, due))
            except asyncio.TimeoutError:
                pass
            self._kick.clear()

    def _name(self, run_id: str) -> None:
        with self._named_lock:
            self._named.setdefault(run_id, None)  # a run named again keeps its place in the queue
            if len(self._named) > MAX_NAMED:  # the oldest name goes (the re-read records its change)
                del self._named[next(iter(self._named))]
                self.names_dropped += 1

    def run_changed(self, run_id: str) -> None:
        """The run store's push (on the event loop): this run changed state or reported
        progress. Kept for the next tick, which runs now if this replica is the one that
        watches; every replica keeps the names, so one that takes the lease over reads them."""
        self._name(run_id)
        if self._kick is not None and self.holding():
            self._kick.set()

    def kick(self, run_id: str | None = None) -> None:
        """Run the next tick now, reading `run_id` (after a submit, so a fast run is seen
        quickly); from any thread."""
        if run_id:
            self._name(run_id)
        if self._loop is not None and self._kick is not None:
            self._loop.call_soon_threadsafe(self._kick.set)

    def _take_named(self) -> list[str]:
        with self._named_lock:
            taken = list(self._named)[:NAMED_PER_TICK]
            for run_id in taken:
                del self._named[run_id]
            more = bool(self._named)
        if more:
            self.kick()
        return taken

    # --- one tick (lease holder only) -----------------------------------------------------
    def tick(self) -> list[str]:
        """Read the runs named since the last tick and, once per interval, the next page of
        active jobs (and do the interval's duties); returns the jobs whose status or progress
        changed. Stops with `LeaseLost` before any write the lease no longer covers."""
        self.ticks += 1
        named = self._take_named()
        try:
            with WATCHER_TICK_SECONDS.time():
                return self._tick(named)
        except Exception:  # Prefect or the store away, or the lease lost: read them next time
            for run_id in named:
                self._name(run_id)
            raise

    def _tick(self, named: list[str]) -> list[str]:
        engine = self.store.db
        changed: list[str] = []
        page: list[dict] = []
        unsettled: list[dict] = []
        if time.monotonic() >= self._next_pass:
            self._next_pass = time.monotonic() + self.interval
            changed += self._interval_duties()
            page = self._next_page()
            unsettled = self._next_unsettled()
        following = {row["id"]: row for row in page if row["flow_run_id"]}
        for row in jobs_of_runs(named, engine):
            if row["status"] in ACTIVE:
                following[row["id"]] = row
            elif row["bytes_measured_at"] is None and not row["stop_run"] and all(u["id"] != row["id"] for u in unsettled):
                unsettled.append(row)  # ended, its folder unmeasured: measure it now its run has moved
        run_ids = sorted({row["flow_run_id"] for row in [*following.values(), *unsettled] if row["flow_run_id"]})
        if not run_ids and not unsettled:
            return changed
        states: dict[str, RunStatus] = {}
        if run_ids:  # every run of the tick in one read
            self.run_reads += 1
            self.runs_read += len(run_ids)
            states = self.runs.read(run_ids)
        self.settle(unsettled, states, guard=self._guard)
        for row in following.values():
            state = states.get(row["flow_run_id"])
            if state is None:
                continue
            self._guard()
            try:
                moved = self._follow_run(row, state)
            except LeaseLost:
                raise
            except Exception:  # storage briefly away: this job waits for the next tick, the others go on
                log.exception("could not follow job %s", row["id"])
                continue
            if moved:
                changed.append(row["id"])
        return changed

    def _interval_duties(self) -> list[str]:
        """Expired Idempotency-Keys (every PRUNE_EVERY_S), orphans to start, runs to stop."""
        engine = self.store.db
        changed: list[str] = []
        if time.monotonic() >= self._next_prune:
            self._guard()
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
            prune_expired(self.idempotency_window_s, engine=engine)
        for row in unstarted_jobs(self.orphan_after_s, engine, limit=ORPHANS_PER_TICK):
            self._guard()
            changed += self._start_orphan(row)
        for job_id in runs_to_stop(engine):
            self._guard()
            self._stop_runs(job_id)
        return changed

    def _follow_run(self, row: dict, state: RunStatus) -> bool:
        """Record what the run says of its job: its state, and its progress as it reported it."""
        if state.crashed:
            return self._restart_crashed(row, state)
        moved = self._apply(row, state)
        reported = state.shards_done
        # Written only when it rose: the run's word, never past the job's shard count.
        if state.status == "running" and reported is not None and reported > row["shards_done"]:
            self._guard()
            moved = set_progress(row["id"], min(reported, row["n_shards"]), self.store.db) or moved
        return moved

    def _next_page(self) -> list[dict]:
        """The re-read's next `page` active jobs, going on from the last tick's; after the last
        page it starts again from the first."""
        rows = active_page(self._page_after, self.page, self.store.db)
        self._page_after = rows[-1]["id"] if len(rows) == self.page else None
        if self._page_after is None:
            self.cycles += 1
        return rows

    def _next_unsettled(self) -> list[dict]:
        """The next `SETTLE_BATCH` ended, unmeasured jobs, paging on from the last tick's."""
        rows = unsettled_jobs(SETTLE_BATCH, self._unsettled_after, engine=self.store.db)
        last = rows[-1] if len(rows) == SETTLE_BATCH else None
        self._unsettled_after = None if last is None else (last["completed_at"], last["id"])
        return rows

    def settle(self, rows: list[dict], states: dict[str, RunStatus] | None = None, guard=None) -> None:
        """Measure the folders of these ended jobs whose runs write no more, into what their keys
        hold (`api.store.settle_bytes`): a run that is over (`api.store.run_over`), or no run
        and an admission older than `orphan_after_s` (its replica has written what it would).
        `states`: their runs as just read (else read here, in one call). Any replica may call
        it (the cancel route does); a job is measured once. `guard`: called before each write
        (a tick's lease check)."""
        if states is None:
            run_ids = [r["flow_run_id"] for r in rows if r["flow_run_id"]]
            states = self.runs.read(run_ids) if run_ids else {}
        admitted_before = utcnow() - timedelta(seconds=self.orphan_after_s)
        for row in rows:
            if row["flow_run_id"] is not None and not run_over(states.get(row["flow_run_id"])):
                continue  # still stopping: its admitted bytes count until a later tick
            if row["flow_run_id"] is None and row["created_at"] > admitted_before:
                continue
            if guard is not None:
                guard()
            try:
                settle_bytes(row["id"], JobFiles.for_job(row["id"], self.storage).bytes_kept(), self.store.db)
            except Exception:  # storage briefly away: a later tick measures it
                log.exception("could not measure the files of job %s", row["id"])

    def _restart_crashed(self, row: dict, state: RunStatus) -> bool:
        """Its host died (heartbeats stopped): reschedule the run onto the lane's other hosts,
        within the job's restart budget; past it the job fails, charged nothing."""
        if not record_restart(row["id"], self.max_restarts, self.store.db):
            return True  # failed, and its run stays Crashed: nothing is left to stop
        log.warning("job %s: its run %s crashed (%s); rescheduling it", row["id"], row["flow_run_id"], state.message)
        self.runs.reschedule(row["flow_run_id"])
        # A job that never reached `running` did run (it crashed): it is running again now.
        return apply_state(row["id"], RunStatus(status="running", started_at=state.started_at), engine=self.store.db)

    def _start_orphan(self, row: dict) -> list[str]:
        """A job admitted by an API replica that died before starting its run."""
        try:
            run_id = self.runs.start(row["id"], row["request_url"], row["model"], row["lane"], row["key_id"])
        except Exception:
            log.exception("could not start the run of job %s", row["id"])
            fail_job(row["id"], "The harvest could not be started; it was charged nothing. Submit it again.", stop_run=True,
                     engine=self.store.db)
            self._stop_runs(row["id"])
            return [row["id"]]
        attach_run(row["id"], run_id, self.store.db)
        self._name(run_id)  # read at the next tick, not when the re-read comes round
        return []

    def _stop_runs(self, job_id: str) -> None:
        """Cancel every run of a job whose start failed (found by the job's tag), once."""
        try:
            self.runs.cancel_job(job_id)
        except Exception:  # the backend is away: next tick
            log.warning("could not cancel the runs of job %s yet", job_id, exc_info=True)
            return
        run_stopped(job_id, self.store.db)

    def refresh(self, row: dict) -> bool:
        """Read one job's run now (before a cancel decides what to charge); any replica may."""
        if not row["flow_run_id"]:
            return False
        state: RunStatus | None = self.runs.read([row["flow_run_id"]]).get(row["flow_run_id"])
        if state is None or state.crashed:
            return False
        return self._apply(row, state)

    def _apply(self, row: dict, state: RunStatus) -> bool:
        """Record the run's state; a done run's result numbers come from its manifest, and an
        ended run's folder is measured now that nothing writes there (`api.store.run_over`),
        for what the key holds. A run still stopping (Cancelling) is measured later (`settle`)."""
        if state.status == "pending" or (state.status == "running" and row["status"] == "running"):
            return False  # nothing to record (`apply_state` would change nothing): no write transaction
        files = JobFiles.for_job(row["id"], self.storage)
        result = files.read_result() if state.status == "done" else None
        kept = files.bytes_kept() if state.status != "running" and run_over(state) else None
        return apply_state(row["id"], state, result=result, kept_bytes=kept, engine=self.store.db)

    # --- long-poll waiters ----------------------------------------------------------------
    def notify(self, job_id: str) -> None:
        """Wake the waiters of a job (call from the event loop)."""
        for event in self._events.get(job_id, ()):
            event.set()

    def notify_threadsafe(self, job_id: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.notify, job_id)

    def try_enter(self, key_id: str) -> bool:
        """Take a waiter slot for the key, or False when `max_waiters` are already held, or the
        key holds its share of them (`per_key`), so one key cannot keep the others' reads from
        waiting. The declined read is answered at once (`X-Acs-Longpoll: declined`)."""
        if self.waiting >= self.max_waiters or self._held.get(key_id, 0) >= self.per_key:
            return False
        self.waiting += 1
        self._held[key_id] += 1
        return True

    def leave(self, key_id: str) -> None:
        self.waiting -= 1
        self._held[key_id] -= 1
        if self._held[key_id] <= 0:
            del self._held[key_id]

    @contextmanager
    def subscription(self, job_id: str):
        """An event set whenever the job is notified; subscribe before reading the job, so a
        change between the read and the wait cannot be missed."""
        event = asyncio.Event()
        self._events[job_id].add(event)
        try:
            yield event
        finally:
            self._events[job_id].discard(event)
            if not self._events[job_id]:
                del self._events[job_id]
