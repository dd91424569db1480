"""`Idempotency-Key` on `POST /v1/harvest`: a repeated submit answers the job it made first.

A client that lost the answer to a submit (killed, timed out, a dropped connection) sends the
same request again with the same key; within the window (`HARVEST_IDEMPOTENCY_WINDOW_S`, default
`WINDOW_S`, a day as Stripe's) of the first, and for the same API key:

    same key, same request      → the same job (202 with its harvest object, as it is now)
    same key, another request   → 409 idempotency_key_reused
    same key, first still being admitted on another connection
                                → waits for it (up to `WAIT_S`), then that job; past the wait a
                                  503 with Retry-After (nothing made twice)
    no key                      → every submit makes a job, as before

"Same request" is the validated request, canonically serialised (`request_sha256`), not the
raw bytes, so a client that spaces its JSON differently still matches. The key is claimed in
the job store (`api.db.idempotency_keys`) before admission, so two replicas answering the same
key at once never both admit: the second finds the claim and waits. A submit that is refused
(400, 429) or whose run cannot be started (503, the job recorded failed and charged nothing)
releases its claim, so trying again with the same key makes the job then. A claim left unbound
for `ABANDONED_S` (its replica died mid-submit) is taken over by the next submit with that key.

Past the window a key is new again: its next submit makes a new job (whatever the request). Its
record is deleted then, with every other expired record of the same API key, and the watcher's
replica deletes all expired records every `PRUNE_EVERY_S` (`prune_expired`), so the table holds
about one window of submits whoever stops submitting.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import and_, delete, select, update
from sqlalchemy.engine import Engine

from api.db import idempotency_keys, transaction, utcnow
from api.errors import IdempotencyConflict
from api.store import get_job
from harvest.errors import InvalidRequest, ModelUnavailable
from harvest.request import HarvestRequest

__all__ = [
    "HEADER", "WINDOW_S", "WAIT_S", "ABANDONED_S", "PRUNE_EVERY_S", "MAX_LENGTH", "request_sha256", "submit_once",
    "prune_expired",
]

HEADER = "Idempotency-Key"
WINDOW_S = 24 * 3600
"""How long a key keeps answering its job by default (a day: longer than any client's resume);
`HARVEST_IDEMPOTENCY_WINDOW_S` sets it."""
PRUNE_EVERY_S = 600.0
"""How often the watcher deletes every expired record (`prune_expired`)."""
WAIT_S = 30.0
"""How long a repeat waits for the first submit of its key, still being admitted, to finish."""
ABANDONED_S = 300.0
"""An unbound claim older than this belongs to a submit that died with its replica."""
MAX_LENGTH = 255
_POLL_S = 0.1


def request_sha256(request: HarvestRequest) -> str:
    """The digest a repeat must match: the validated request, canonically serialised."""
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()


def _check(idempotency_key: str) -> str:
    if not 1 <= len(idempotency_key) <= MAX_LENGTH or not idempotency_key.isprintable():
        raise InvalidRequest(
            f"The {HEADER} header must be 1 to {MAX_LENGTH} printable characters; this one has {len(idempotency_key)}.",
            param=HEADER,
        )
    return idempotency_key


def _claim(key_id: str, idempotency_key: str, digest: str, window_s: float, engine: Engine) -> dict | None:
    """Claim the key for this submit: None when claimed now, else the row that holds it."""
    now = utcnow()
    mine = and_(idempotency_keys.c.key_id == key_id, idempotency_keys.c.idempotency_key == idempotency_key)
    with transaction(engine) as conn:
        # Every record of this API key past its window (the primary key's prefix: no scan),
        # and a claim of this key whose submit died unbound, are free again.
        conn.execute(delete(idempotency_keys).where(
            idempotency_keys.c.key_id == key_id, idempotency_keys.c.created_at < now - timedelta(seconds=window_s),
        ))
        conn.execute(delete(idempotency_keys).where(
            mine, idempotency_keys.c.job_id.is_(None), idempotency_keys.c.created_at < now - timedelta(seconds=ABANDONED_S),
        ))
        if conn.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        # RETURNING, not rowcount: what the driver reports for ON CONFLICT DO NOTHING varies.
        claimed = conn.execute(insert(idempotency_keys).values(
            key_id=key_id, idempotency_key=idempotency_key, request_sha256=digest, job_id=None, created_at=now,
        ).on_conflict_do_nothing().returning(idempotency_keys.c.key_id)).first()
        if claimed is None:  # held: by an earlier submit, or one on another replica now
            return dict(conn.execute(select(idempotency_keys).where(mine)).mappings().one())
    return None


def _finish(key_id: str, idempotency_key: str, job_id: str | None, engine: Engine) -> None:
    """Bind the claim to its job, or (job_id None) release it."""
    mine = and_(idempotency_keys.c.key_id == key_id, idempotency_keys.c.idempotency_key == idempotency_key,
                idempotency_keys.c.job_id.is_(None))
    with transaction(engine) as conn:
        if job_id is None:
            conn.execute(delete(idempotency_keys).where(mine))
        else:
            conn.execute(update(idempotency_keys).where(mine).values(job_id=job_id))


def prune_expired(window_s: float = WINDOW_S, *, engine: Engine) -> int:
    """Delete every record past the window, of any API key; returns how many."""
    with transaction(engine) as conn:
        return conn.execute(
            delete(idempotency_keys).where(idempotency_keys.c.created_at < utcnow() - timedelta(seconds=window_s))
        ).rowcount


def _window_words(window_s: float) -> str:
    hours = window_s / 3600
    if hours >= 1 and hours == int(hours):
        return f"{int(hours)} hour{'s' if hours != 1 else ''}"
    return f"{window_s:g} seconds"


def submit_once(
    key_id: str, idempotency_key: str | None, request: HarvestRequest, submit: Callable[[], dict], *, engine: Engine,
    window_s: float = WINDOW_S,
) -> dict:
    """`submit()` (admit the job and start its run; returns the job row), unless this key
    already made a job for the same request within `window_s`: then that job's row. See the
    module docstring."""
    if idempotency_key is None:
        return submit()
    _check(idempotency_key)
    digest = request_sha256(request)
    deadline = time.monotonic() + WAIT_S
    while (held := _claim(key_id, idempotency_key, digest, window_s, engine)) is not None:
        if held["request_sha256"] != digest:
            raise IdempotencyConflict(
                f"The {HEADER} {idempotency_key!r} was used for another request within the last "
                f"{_window_words(window_s)}. Use a new key for a new request.",
                param=HEADER,
            )
        if held["job_id"] is not None:
            return get_job(held["job_id"], key_id, engine=engine)
        if time.monotonic() > deadline:
            busy = ModelUnavailable(
                f"A submit with the {HEADER} {idempotency_key!r} is still being admitted. Try again shortly; "
                "the same key answers its job."
            )
            busy.headers["Retry-After"] = "2"
            raise busy
        time.sleep(_POLL_S)
    try:
        row = submit()
    except BaseException:
        _finish(key_id, idempotency_key, None, engine)  # refused or not started: the key is free again
        raise
    _finish(key_id, idempotency_key, row["id"], engine)
    return row
