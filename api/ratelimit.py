"""Per-key request rates: a token bucket per key and kind of request, kept in the job store.

Two kinds: `submit` (POST /v1/harvest, POST /v1/completions) and `read` (GET and DELETE of
harvests, GET /v1/models). Each key's bucket of a kind holds at most `burst` tokens and refills
at `per_s` tokens a second; a request takes one, or is answered 429 `rate_limit_exceeded` with
`Retry-After` (seconds until a token is back). Limits are `HARVEST_RATE_{SUBMIT,READ}_{PER_S,
BURST}`, or the key's own (`harvest keys create --read-per-s … --read-burst …`, migration
0005). A key only ever drains its own buckets, so one key cannot starve the others.

Why in SQL and not in each replica's memory: API replicas sit behind a load balancer, and a
per-replica bucket would let a key have N times its rate on N replicas (and a fresh bucket on
every restart). The bucket is one row, refilled and decremented by a single conditional
UPDATE (`tokens = min(burst, tokens + elapsed * rate) - 1 … WHERE that is ≥ 1`): PostgreSQL
row-locks it and re-evaluates the condition after a concurrent writer commits, SQLite
serialises writers (BEGIN IMMEDIATE), so concurrent requests on any replicas never take the
same token twice. It costs one short transaction per request. Time is each replica's wall
clock (unix seconds); a replica whose clock is behind never refills a bucket backwards.
"""

from __future__ import annotations

import math
import time

from fastapi import Depends
from sqlalchemy import Float, case, literal, select, update
from starlette.concurrency import run_in_threadpool

from api.auth import ApiKey, current_key
from api.db import ensure_row, rate_buckets, transaction
from harvest.errors import RateLimited
from harvest.settings import get_settings

__all__ = ["take", "limits", "enforce", "submit_key", "read_key"]


def take(key_id: str, kind: str, *, per_s: float, burst: int, now: float | None = None, engine=None) -> float:
    """Take one token from the key's bucket of `kind`: 0.0 when taken, else the seconds until
    one will be there."""
    now = time.time() if now is None else now
    moment = literal(now, Float)
    where = (rate_buckets.c.key_id == key_id, rate_buckets.c.kind == kind)
    elapsed = case((rate_buckets.c.updated_at < moment, moment - rate_buckets.c.updated_at), else_=literal(0.0, Float))
    grown = rate_buckets.c.tokens + elapsed * per_s
    level = case((grown > float(burst), literal(float(burst), Float)), else_=grown)
    with transaction(engine) as conn:
        ensure_row(conn, rate_buckets, key_id=key_id, kind=kind, tokens=float(burst), updated_at=now)
        taken = conn.execute(
            update(rate_buckets).where(*where, level >= 1.0).values(
                tokens=level - 1.0,
                updated_at=case((rate_buckets.c.updated_at < moment, moment), else_=rate_buckets.c.updated_at),
            )
        )
        if taken.rowcount == 1:
            return 0.0
        left = conn.execute(select(level).where(*where)).scalar_one()
    return max((1.0 - float(left)) / per_s, 0.0)


def limits(key: ApiKey, kind: str) -> tuple[float, int]:
    """(per_s, burst) of the key for `kind`: its own where it has them, else the settings'."""
    settings = get_settings()
    per_s = key.rates.get(f"rate_{kind}_per_s", getattr(settings, f"rate_{kind}_per_s"))
    burst = key.rates.get(f"rate_{kind}_burst", getattr(settings, f"rate_{kind}_burst"))
    return float(per_s), int(burst)


def enforce(key: ApiKey, kind: str) -> None:
    """Raise 429 when the key is over its `kind` rate."""
    per_s, burst = limits(key, kind)
    wait = take(key.id, kind, per_s=per_s, burst=burst)
    if wait > 0:
        retry_after = max(math.ceil(wait), 1)
        noun = "submits" if kind == "submit" else "reads"
        raise RateLimited(
            f"Too many {noun} from this key: at most {burst} at once and {per_s:g} a second after that. "
            f"Try again in {retry_after} second{'s' if retry_after != 1 else ''}.",
            retry_after=retry_after,
        )


async def submit_key(key: ApiKey = Depends(current_key)) -> ApiKey:
    """FastAPI dependency: the caller's key (401 otherwise), within its submit rate (429 otherwise)."""
    await run_in_threadpool(enforce, key, "submit")
    return key


async def read_key(key: ApiKey = Depends(current_key)) -> ApiKey:
    """FastAPI dependency: the caller's key (401 otherwise), within its read rate (429 otherwise)."""
    await run_in_threadpool(enforce, key, "read")
    return key
