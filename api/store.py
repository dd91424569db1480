"""The job store: admission under the caps, state transitions with charging, reads.

Admission is one transaction that locks the lane's row and the key's row (see `api.db`),
counts, checks every cap, and inserts the job, so 20 simultaneous submits against a limit of
3 admit exactly 3, on SQLite and on PostgreSQL alike.

Charging is a compare-and-set: a job leaves `pending`/`running` in one UPDATE guarded by its
current status, and the transaction that wins that UPDATE appends the job's row to
`charge_ledger` (UNIQUE job_id, append-only). Whoever wins charges; nobody else can, and a
second row for the job is refused by the database itself, so a job is charged exactly once
however many watchers, cancels or API restarts race for it. Monthly token use is the sum of
the ledger's `tokens_charged` this month plus the `reserved_tokens` of jobs still active;
`jobs.tokens` repeats the charge for the harvest object.

Storage is held, not spent: a key's bytes held (`bytes_held`) are the `output_bytes` of its
jobs whose files are still kept, and admission refuses a job whose admitted bytes would take
them past the key's storage quota, in the same locked transaction as the other caps. Every
byte of a job's folder counts, not its shards alone (a 45 MB prompt is kept in request.json and
again in the manifest):

- admitted (pending, running): the most the folder can hold, `harvest.cost.kept_bytes`
  (shards, request.json exactly, manifest, statistics, `_parts/` records, progress files);
- ended (done, failed, cancelled): what the folder holds, measured once nothing writes there
  any more (`JobFiles.bytes_kept`: every file, from a fresh listing; it matches `du -b` of the
  folder less its directory entries, and an S3 listing of the prefix) and recorded with
  `bytes_measured_at` (`settle_bytes`). A run that ended for good (Completed, Failed,
  Cancelled, Crashed) is measured when the watcher records its end (`apply_state`); a job the
  API cancels is measured as soon as its run reads Cancelled (`api.watcher.Watcher.settle`,
  at once for a run that had not started). A running job's cancel leaves its run Cancelling
  for a moment, during which a shard in flight can still land: until the run is over the job
  keeps counting its admitted bound, never less than it can leave, and the watcher's next
  ticks measure it. A job with no run (its start failed) is measured once its admitting
  replica is done with it (`orphan_after_s`).

Status lives in the database alone, so every API replica answers the same for a job, and it
only moves forward: pending → running → done | failed | cancelled. Every change is announced
(`api.db.job_changed`: PostgreSQL NOTIFY, or this process's listeners on SQLite), which is
what wakes long-poll waiters on any replica.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import and_, case, func, insert, or_, select, update
from sqlalchemy.engine import Engine

from api.auth import ApiKey, month_of
from api.db import (
    api_keys,
    charge_ledger,
    ensure_row,
    job_changed,
    jobs,
    lane_locks,
    locked,
    reading,
    service_flags,
    transaction,
    utcnow,
)
from api.errors import BudgetExceeded, CapacityExceeded, StorageQuotaExceeded, ConcurrencyExceeded, NotCancellable, NotFound, QuotaExceeded, SpendCapped
from api.runs import RunStatus
from harvest.errors import echo, safe_job_error
from harvest.lanes import Lane

__all__ = [
    "ACTIVE",
    "admit",
    "get_job",
    "list_jobs",
    "active_jobs",
    "active_page",
    "jobs_of_runs",
    "unstarted_jobs",
    "attach_run",
    "apply_state",
    "record_restart",
    "cancel_job",
    "fail_job",
    "runs_to_stop",
    "run_stopped",
    "set_progress",
    "set_spend_cap",
    "get_spend_cap",
    "tokens_used",
    "bytes_held",
    "key_usage",
    "run_over",
    "unsettled_jobs",
    "settle_bytes",
]

log = logging.getLogger("harvest.api.store")

ACTIVE = ("pending", "running")
ENDED = ("done", "failed", "cancelled")
STILL_STOPPING = ("Cancelling",)
"""Prefect state names of a run that reads as ended (`cancelled`) while its process may still be
writing: its worker has yet to stop it (`flows.run_status`)."""
SPEND_CAP = "spend_cap_retry_after"


def _month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _charged(conn, key_id: str, start: datetime) -> int:
    """Tokens charged to the key for jobs that ended since `start` (the ledger's sum)."""
    return int(conn.execute(
        select(func.coalesce(func.sum(charge_ledger.c.tokens_charged), 0)).where(
            charge_ledger.c.key_id == key_id, charge_ledger.c.created_at >= start
        )
    ).scalar_one())


def tokens_used(conn, key_id: str, now: datetime | None = None) -> int:
    """Tokens charged this month plus tokens held by active jobs."""
    charged = _charged(conn, key_id, _month_start(now or utcnow()))
    held = conn.execute(
        select(func.coalesce(func.sum(jobs.c.reserved_tokens), 0)).where(
            jobs.c.key_id == key_id, jobs.c.status.in_(ACTIVE)
        )
    ).scalar_one()
    return charged + int(held)


def bytes_held(conn, key_id: str, retention_days: float, now: datetime | None = None) -> int:
    """Bytes the key's job folders hold while they are kept (`flows.retention`), each job's
    `output_bytes` (see the module docstring):

    - active jobs: the most their folder can hold (`harvest.cost.kept_bytes`), as admitted;
    - ended jobs (done, failed, cancelled): every byte their folder holds, request.json,
      manifest and `_parts/` included, measured once their run is over (so a cancelled or
      failed job counts what it left); until then their admitted bound;
    - done jobs until `retention_days` after `completed_at` (the moment the sweep counts from:
      the manifest's `created_at`), failed and cancelled ones until `retention_days` after
      `created_at` (the sweep judges them by request.json, written at admission).
    A job admitted before migration 0007 counts 0 until the watcher has measured its folder.
    """
    cutoff = (now or utcnow()) - timedelta(days=retention_days)
    size = func.coalesce(jobs.c.output_bytes, 0)
    held = case(
        (jobs.c.status.in_(ACTIVE), size),
        (and_(jobs.c.status == "done", jobs.c.completed_at >= cutoff), size),
        (and_(jobs.c.status.in_(("failed", "cancelled")), jobs.c.created_at >= cutoff), size),
        else_=0,
    )
    return int(conn.execute(select(func.coalesce(func.sum(held), 0)).where(jobs.c.key_id == key_id)).scalar_one())


def key_usage(conn, key_id: str, now: datetime | None = None, *, retention_days: float) -> dict:
    """This month's usage of a key: tokens charged (ended jobs), jobs submitted, active jobs by
    lane; and the bytes its kept files hold now (`bytes_held`)."""
    start = _month_start(now or utcnow())
    charged = _charged(conn, key_id, start)
    submitted = conn.execute(
        select(func.count()).where(jobs.c.key_id == key_id, jobs.c.created_at >= start)
    ).scalar_one()
    active = conn.execute(
        select(jobs.c.lane, func.count()).where(jobs.c.key_id == key_id, jobs.c.status.in_(ACTIVE)).group_by(jobs.c.lane)
    ).all()
    return {"tokens_charged": charged, "jobs_this_month": int(submitted), "active": {lane: int(n) for lane, n in active},
            "bytes_held": bytes_held(conn, key_id, retention_days, now)}


def get_spend_cap(conn) -> int | None:
    """Retry-After seconds while new harvests are paused, else None."""
    value = conn.execute(select(service_flags.c.value).where(service_flags.c.name == SPEND_CAP)).scalar()
    return None if value is None else int(value)


def set_spend_cap(retry_after: int | None, engine: Engine) -> None:
    """Pause new harvests (answering 429 spend_cap with this Retry-After) or, with None, resume."""
    with transaction(engine) as conn:
        conn.execute(service_flags.delete().where(service_flags.c.name == SPEND_CAP))
        if retry_after is not None:
            conn.execute(insert(service_flags).values(name=SPEND_CAP, value=str(int(retry_after)), updated_at=utcnow()))


def admit(
    key: ApiKey, job: dict, *, declared: Lane, storage_quota: int | None = None, retention_days: float | None = None,
    engine: Engine,
) -> dict:
    """Insert the job if every cap allows it, atomically; else raise the cap's 429.

    `job` holds the columns that come from the request (id, model, lane, n_prompts, layers,
    shard_size, n_shards, add_special_tokens, contents, reserved_tokens, output_bytes: the most
    its folder can hold, `harvest.cost.kept_bytes`, request_url). `storage_quota`: the bytes
    the key's kept files may hold (None: unlimited), counted with `retention_days`
    (`bytes_held`; given with a quota: the service's setting). `declared`: the job's lane as
    declared (`harvest.lanes`): its capacity, and its cap per key for a key without its own.
    """
    lane, capacity = job["lane"], declared.capacity
    if declared.name != lane:
        raise ValueError(f"the job is on lane {lane!r}, not {declared.name!r}")
    now = utcnow()
    with transaction(engine) as conn:
        # Lock order is always lane, then key, so two admissions never deadlock. A lane added
        # to infra/lanes.toml gets its lock row on its first admission.
        ensure_row(conn, lane_locks, lane=lane)
        locked(conn, lane_locks, lane_locks.c.lane == lane)
        locked(conn, api_keys, api_keys.c.id == key.id)

        retry_after = get_spend_cap(conn)
        if retry_after is not None:
            raise SpendCapped(
                f"New harvests are paused to limit GPU spending. Try again in {retry_after} seconds.",
                retry_after=retry_after,
            )

        mine = conn.execute(
            select(func.count()).where(jobs.c.key_id == key.id, jobs.c.lane == lane, jobs.c.status.in_(ACTIVE))
        ).scalar_one()
        limit = key.lane_limit(declared)
        if limit == 0:
            raise ConcurrencyExceeded(
                f"Your key may not run harvests on {lane} models. Ask for a key with {lane}-lane harvests.",
            )
        if mine >= limit:
            raise ConcurrencyExceeded(
                f"You have {mine} harvest{'s' if mine != 1 else ''} on {lane} models queued or running, your most. "
                "Submit another when one ends, or cancel one.",
            )

        if key.monthly_jobs is not None:
            this_month = conn.execute(
                select(func.count()).where(jobs.c.key_id == key.id, jobs.c.created_at >= _month_start(now))
            ).scalar_one()
            if this_month >= key.monthly_jobs:
                raise QuotaExceeded(
                    f"You have submitted {this_month} harvests in {month_of(now)}, your monthly quota of "
                    f"{key.monthly_jobs}. The quota resets on the first day of next month (UTC).",
                )

        if key.token_budget is not None:
            used = tokens_used(conn, key.id, now)
            left = max(key.token_budget - used, 0)
            if job["reserved_tokens"] > left:
                raise BudgetExceeded(
                    f"These prompts come to {job['reserved_tokens']:,} tokens, and your key has {left:,} of its "
                    f"{key.token_budget:,} monthly harvest tokens left ({used:,} charged or held).",
                )

        if storage_quota is not None:
            # Under the key's lock, like the job caps: two submits cannot both fit in one gap.
            held = bytes_held(conn, key.id, retention_days, now)
            size = int(job.get("output_bytes") or 0)
            if held + size > storage_quota:
                raise StorageQuotaExceeded(
                    f"This harvest keeps up to {size:,} bytes (its shards, statistics, request and manifest, "
                    f"which holds the prompts' text), and your key's files already hold {held:,} of its "
                    f"{storage_quota:,}-byte storage quota. Bytes come free as your jobs' files pass their "
                    f"retention ({retention_days:g} days); keep fewer layers or prompts, or project onto directions.",
                )

        queued = conn.execute(
            select(func.count()).where(jobs.c.lane == lane, jobs.c.status.in_(ACTIVE))
        ).scalar_one()
        if queued >= capacity:
            raise CapacityExceeded(
                f"The {lane} lane is at its capacity of {capacity} harvests queued or running across the "
                "service. Submit again when one ends.",
            )

        row = {
            **job,
            "key_id": key.id,
            "status": "pending",
            "shards_done": 0,
            "tokens": None,
            "created_at": now,
            "started_at": None,
            "completed_at": None,
            "error": None,
            "flow_run_id": None,
            "restarts": 0,
            "result": None,
            "bytes_measured_at": None,  # output_bytes is the admitted bound until the folder is measured
        }
        conn.execute(insert(jobs).values(**row))
    return row


def _row(conn, job_id: str):
    if "\x00" in job_id:
        # No job's id holds a NUL, and PostgreSQL refuses one in any text (psycopg's
        # DataError): the answer is the one SQLite gives, no such job.
        return None
    return conn.execute(select(jobs).where(jobs.c.id == job_id)).mappings().first()


def get_job(job_id: str, key_id: str | None = None, *, engine: Engine) -> dict:
    """The job, if it exists and (given a key) belongs to that key; else 404."""
    with reading(engine) as conn:
        row = _row(conn, job_id)
    if row is None or (key_id is not None and row["key_id"] != key_id):
        # Same answer for another key's job as for no job: never reveal that it exists.
        raise NotFound(f"No harvest job with id {echo(job_id)}.", param="job_id")
    return dict(row)


def list_jobs(key_id: str, *, limit: int, after: str | None = None, engine: Engine) -> tuple[list[dict], bool]:
    """The key's jobs, newest first, `limit` of them after the job `after`; and whether more follow."""
    with reading(engine) as conn:
        query = select(jobs).where(jobs.c.key_id == key_id)
        if after is not None:
            cursor = _row(conn, after)
            if cursor is None or cursor["key_id"] != key_id:
                raise NotFound(f"No harvest job with id {echo(after)}.", param="after")
            query = query.where(
                or_(
                    jobs.c.created_at < cursor["created_at"],
                    and_(jobs.c.created_at == cursor["created_at"], jobs.c.id < cursor["id"]),
                )
            )
        rows = conn.execute(query.order_by(jobs.c.created_at.desc(), jobs.c.id.desc()).limit(limit + 1)).mappings().all()
    return [dict(r) for r in rows[:limit]], len(rows) > limit


def active_jobs(engine: Engine) -> list[dict]:
    with transaction(engine) as conn:
        return [dict(r) for r in conn.execute(select(jobs).where(jobs.c.status.in_(ACTIVE))).mappings().all()]


def active_page(after: str | None, limit: int, engine: Engine) -> list[dict]:
    """The next `limit` active jobs in id order after the job id `after` (None: from the first):
    the watcher's re-read of every active job, a page a tick. One range read of
    `ix_jobs_status_id` per active status, so a page costs what it holds, however many jobs
    there are; a job that moves from pending to running keeps its place in the order."""
    rows: list[dict] = []
    with reading(engine) as conn:
        for status in ACTIVE:
            query = select(jobs).where(jobs.c.status == status)
            if after is not None:
                query = query.where(jobs.c.id > after)
            rows += [dict(r) for r in conn.execute(query.order_by(jobs.c.id).limit(limit)).mappings().all()]
    return sorted(rows, key=lambda r: r["id"])[:limit]


def jobs_of_runs(run_ids: list[str], engine: Engine) -> list[dict]:
    """The jobs whose runs these are (`ix_jobs_flow_run`), whatever their status; a run that is
    no job's own (a scale-out helper, a corpus refresh) finds none."""
    if not run_ids:
        return []
    with reading(engine) as conn:
        query = select(jobs).where(jobs.c.flow_run_id.in_(sorted(set(run_ids))))
        return [dict(r) for r in conn.execute(query).mappings().all()]


def unstarted_jobs(older_than_s: float, engine: Engine, limit: int | None = None) -> list[dict]:
    """Active jobs with no run, admitted over `older_than_s` ago: their admitting replica died
    between admission and starting the run (a live one takes well under a second). The oldest
    first, at most `limit`."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    with transaction(engine) as conn:
        query = select(jobs).where(jobs.c.status.in_(ACTIVE), jobs.c.flow_run_id.is_(None), jobs.c.created_at < cutoff)
        return [dict(r) for r in conn.execute(query.order_by(jobs.c.created_at).limit(limit)).mappings().all()]


def attach_run(job_id: str, run_id: str, engine: Engine) -> None:
    with transaction(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(flow_run_id=run_id))


def _end(conn, job_id: str, *, status: str, tokens: int, error: str | None = None, result: dict | None = None, **extra) -> bool:
    """The one place a job ends and is charged: a compare-and-set from an active status."""
    now = utcnow()
    values = {"status": status, "tokens": tokens, "completed_at": now, "error": error, **extra}
    if result is not None:
        values["result"] = result
    ended = conn.execute(
        update(jobs).where(jobs.c.id == job_id, jobs.c.status.in_(ACTIVE)).values(**values).returning(jobs.c.key_id, jobs.c.lane)
    ).first()
    if ended is None:
        return False
    # The charge, in the same transaction: both commit or neither does. UNIQUE(job_id) makes a
    # second charge of the job an error in the database, whatever the code above let through.
    conn.execute(insert(charge_ledger).values(
        job_id=job_id, key_id=ended.key_id, lane=ended.lane, tokens_charged=tokens, outcome=status, created_at=now,
    ))
    job_changed(conn, job_id)
    return True


def apply_state(
    job_id: str, state: RunStatus, *, result: dict | None = None, kept_bytes: int | None = None, engine: Engine,
) -> bool:
    """Record what the run says; True when the job's status changed.

    done → charged the tokens that ran (`result["tokens"]`); failed → 0; cancelled outside the
    API (e.g. the Prefect UI) → the reserved tokens if its GPU run had started, else 0. A run
    that reads pending again (rescheduled after its host died) leaves a running job running.
    `kept_bytes`: an ending job's folder, measured after its run was over (`run_over`), which
    replaces its admitted bound in what the key holds; None (a run still stopping) leaves the
    bound until the watcher measures it (`settle_bytes`).
    """
    with transaction(engine) as conn:
        row = locked(conn, jobs, jobs.c.id == job_id)  # concurrent endings queue here
        if row is None or row["status"] not in ACTIVE:
            return False
        started = row["started_at"] or (state.started_at.replace(tzinfo=None) if state.started_at else None)
        measured = {} if kept_bytes is None else {"output_bytes": int(kept_bytes), "bytes_measured_at": utcnow()}
        if state.status == "running":
            if row["status"] != "pending":
                return False
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(status="running", started_at=started or utcnow()))
            job_changed(conn, job_id)
            return True
        if state.status == "done":
            if result is None:
                return _end(conn, job_id, status="failed", tokens=0, error="The run completed but wrote no manifest.",
                            **measured)
            return _end(
                conn, job_id, status="done", tokens=int(result["tokens"]), result=result,
                started_at=started or utcnow(), shards_done=result.get("n_shards", row["n_shards"]), **measured,
            )
        if state.status == "failed":
            return _end(conn, job_id, status="failed", tokens=0, error=_run_error(job_id, state.message), **measured)
        if state.status == "cancelled":
            return _end(conn, job_id, status="cancelled", tokens=row["reserved_tokens"] if started else 0, **measured)
        return False


def run_over(state: RunStatus | None) -> bool:
    """Whether nothing of this run writes in its job's folder any more: it ended for good, or
    its backend knows no such run (None). A run that reads cancelled while Prefect still says
    Cancelling is not over: its worker has yet to stop its process, which may land a shard."""
    if state is None:
        return True
    return state.status in ENDED and state.state_name not in STILL_STOPPING


def unsettled_jobs(limit: int, after: tuple[datetime, str] | None = None, *, engine: Engine) -> list[dict]:
    """Ended jobs whose folders are not measured yet (`bytes_measured_at` NULL) and whose runs
    no failed start still has to stop (`stop_run`), `limit` of them in order of
    (`completed_at`, id) after `after`: the watcher pages through them, so jobs whose runs are
    slow to stop never keep the others from their turn."""
    query = select(jobs).where(jobs.c.bytes_measured_at.is_(None), jobs.c.status.in_(ENDED), jobs.c.stop_run.is_(False))
    if after is not None:
        query = query.where(or_(
            jobs.c.completed_at > after[0], and_(jobs.c.completed_at == after[0], jobs.c.id > after[1]),
        ))
    with reading(engine) as conn:
        rows = conn.execute(query.order_by(jobs.c.completed_at, jobs.c.id).limit(limit)).mappings().all()
    return [dict(r) for r in rows]


def settle_bytes(job_id: str, kept_bytes: int, engine: Engine) -> bool:
    """Record an ended job's folder as measured (`JobFiles.bytes_kept`, taken once its run was
    over): its bytes replace the admitted bound in what its key holds. False when the job is
    active or was measured already (another replica's watcher came first)."""
    with transaction(engine) as conn:
        outcome = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status.in_(ENDED), jobs.c.bytes_measured_at.is_(None))
            .values(output_bytes=int(kept_bytes), bytes_measured_at=utcnow())
        )
        return outcome.rowcount == 1


def _run_error(job_id: str, message: str | None) -> str:
    """A failed run's message as the job's `error`: kept when the run made it from the error
    vocabulary (`harvest.errors.job_error`), else the vocabulary's sentence and a reference;
    the run's own text (which can name host paths, sockets, memory figures) goes to the log."""
    error, ref = safe_job_error(message)
    if ref is not None:
        log.error("job %s failed (ref %s): %s", job_id, ref, message or "the run gave no message")
    return error


def record_restart(job_id: str, max_restarts: int, engine: Engine) -> bool:
    """Count one more reschedule of the job's run after its host died; False (and the job
    failed, charged 0) once it has used `max_restarts`, so a run that crashes its host every
    time cannot loop for ever."""
    with transaction(engine) as conn:
        row = locked(conn, jobs, jobs.c.id == job_id)
        if row is None or row["status"] not in ACTIVE:
            return False
        if row["restarts"] >= max_restarts:
            _end(
                conn, job_id, status="failed", tokens=0,
                error=f"The hosts running this harvest died {row['restarts'] + 1} times; giving up.",
            )
            return False
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(restarts=row["restarts"] + 1))
        return True


def cancel_job(job_id: str, key_id: str, engine: Engine) -> tuple[dict, bool]:
    """Cancel a pending or running job; returns the row and whether this call cancelled it.

    Charged the reserved tokens when its GPU run started (status running), else 0; the route
    reads the run first (`Watcher.refresh`), so "started" is what Prefect says now. Its bytes
    stay the admitted bound until its run is over and its folder measured (the route's
    `Watcher.settle`, else the watcher's ticks).
    """
    with transaction(engine) as conn:
        row = locked(conn, jobs, jobs.c.id == job_id)  # concurrent endings queue here
        if row is None or row["key_id"] != key_id:
            raise NotFound(f"No harvest job with id {echo(job_id)}.", param="job_id")
        if row["status"] == "cancelled":
            return dict(row), False
        if row["status"] in ("done", "failed"):
            raise NotCancellable(
                f"The harvest {job_id} is {row['status']}; only pending or running harvests can be cancelled.",
                param="job_id",
            )
        running = row["status"] == "running"
        ended = _end(conn, job_id, status="cancelled", tokens=row["reserved_tokens"] if running else 0)
        return dict(_row(conn, job_id)), ended


def fail_job(job_id: str, message: str, *, stop_run: bool = False, engine: Engine) -> bool:
    """End the job failed, charged 0. `stop_run`: its start failed after the run may have been
    created, so the watcher cancels the job's runs (by their job tag) until that succeeds."""
    with transaction(engine) as conn:
        return _end(conn, job_id, status="failed", tokens=0, error=message, stop_run=stop_run)


def runs_to_stop(engine: Engine) -> list[str]:
    """Ids of jobs whose runs may still be going after a failed start."""
    with transaction(engine) as conn:
        return list(conn.execute(select(jobs.c.id).where(jobs.c.stop_run.is_(True))).scalars())


def run_stopped(job_id: str, engine: Engine) -> None:
    with transaction(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(stop_run=False))


def set_progress(job_id: str, shards_done: int, engine: Engine) -> bool:
    """Record an active job's shards written, as its run reported them; True when it rose.
    Progress only goes forward: a report read late (an older read of the run, or one of a run's
    two attempts) never lowers it."""
    with transaction(engine) as conn:
        outcome = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status.in_(ACTIVE), jobs.c.shards_done < shards_done)
            .values(shards_done=shards_done)
        )
        return outcome.rowcount == 1
