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
same token twice. It costs one short transaction per request, the key's lookup's, whose
commit does not wait for the disk (the store's `rates` engine, `api.db.JobStore`: a crash may
give keys back a few tokens). Time is each replica's wall clock (unix seconds); a replica
whose clock is behind never refills a bucket backwards.

Requests with no valid key (missing, unknown, revoked) have no key's bucket to drain, and
each unknown key costs a job-store lookup. They are limited per client address instead, in
the replica's memory (`AddressLimiter`, `HARVEST_RATE_ANONYMOUS_{PER_S,BURST}`); an address
with no token left gets 429 `rate_limit_exceeded` (Retry-After) without a lookup. Per replica
is enough here: what it protects is this replica's time and the store's, and no key's quota is
at stake. A request with a valid key is never charged to its address nor refused by it, so
keyless callers behind the same NAT, load balancer or loopback cannot lock a key out
(measured before: 100 keyless requests, then the address's valid key answered 429):

- The replica keeps the hashes of the keys the store holds (`KnownKeys`, read from the keys
  table). A key among them skips the address's bucket; the store still checks it, so a key
  revoked since is answered 401 and its address charged then.
- Any other request takes a token of its address before the store is asked; a key the store
  then accepts gives it back (and joins `KnownKeys`).
- An address with no token left: a request without a key, or with something not shaped like a
  key, is refused at once; one with a key-shaped value this replica does not know waits for a
  read of the keys table begun after it arrived (at most one per `KEY_LIST_EVERY_S`, shared by
  every request waiting), and passes if its key is there (a key made a moment ago on another
  host). A flood of made-up keys therefore costs one small read a second, never one per request.

The address is the connection's peer, unless the peer is a proxy named in
`HARVEST_TRUSTED_PROXIES`: then uvicorn takes it from `X-Forwarded-For` (`fleet.proxies`).
Believing the header from anyone would let a keyless client name a fresh address per request.

A refusal costs the replica almost nothing, so that a key sending far over its rate cannot
slow the others by being refused:

- The key is looked up and its bucket taken in one worker-thread call and one transaction
  (`authenticate_within_rate`), in the key's turn of the replica's fair share
  (`api.fairshare`), which also bounds the key's reads in flight.
- When the store answers that a key's bucket is empty until a token is back in w seconds, the
  replica remembers it (`EmptyBuckets`) and answers that key's requests of that kind 429 from
  memory, without the store, until then. This never refuses a request the store would have let
  through: only time refills a bucket (other replicas only take tokens), so none is there
  before w. (A key revoked, or given a higher rate, meanwhile is answered so for at most w.)
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, AsyncIterator

from fastapi import Depends, Request
from sqlalchemy import Float, case, literal, select, update
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from api.auth import ApiKey, bearer_hash, key_hashes, key_of, looks_like_key
from api.db import JobStore, ensure_row, rate_buckets, transaction
from api.errors import RateLimited, Unauthorized
from api.fairshare import KeyShare
from api.settings import ApiSettings

__all__ = [
    "take",
    "limits",
    "KeyOverRate",
    "authenticate_within_rate",
    "EmptyBuckets",
    "KnownKeys",
    "KEY_LIST_EVERY_S",
    "AddressLimiter",
    "read_share",
    "submit_share",
    "ReadShare",
    "submit_key",
    "read_key",
    "SubmitKey",
    "ReadKey",
    "key_or_none",
]


def take(key_id: str, kind: str, *, per_s: float, burst: int, now: float | None = None, engine: Engine) -> float:
    """Take one token from the key's bucket of `kind`: 0.0 when taken, else the seconds until
    one will be there."""
    with transaction(engine) as conn:
        return _take(conn, key_id, kind, per_s=per_s, burst=burst, now=now)


def _take(conn, key_id: str, kind: str, *, per_s: float, burst: int, now: float | None = None) -> float:
    """`take` inside the caller's transaction."""
    now = time.time() if now is None else now
    moment = literal(now, Float)
    where = (rate_buckets.c.key_id == key_id, rate_buckets.c.kind == kind)
    elapsed = case((rate_buckets.c.updated_at < moment, moment - rate_buckets.c.updated_at), else_=literal(0.0, Float))
    grown = rate_buckets.c.tokens + elapsed * per_s
    level = case((grown > float(burst), literal(float(burst), Float)), else_=grown)
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


def limits(key: ApiKey, kind: str, settings: ApiSettings) -> tuple[float, int]:
    """(per_s, burst) of the key for `kind`: its own where it has them, else `settings`'."""
    per_s = key.rates.get(f"rate_{kind}_per_s", getattr(settings, f"rate_{kind}_per_s"))
    burst = key.rates.get(f"rate_{kind}_burst", getattr(settings, f"rate_{kind}_burst"))
    return float(per_s), int(burst)


class KeyOverRate(RateLimited):
    """429: the key's bucket of `kind` is empty; a token is back in `wait` seconds."""

    def __init__(self, kind: str, per_s: float, burst: int, wait: float):
        retry_after = max(math.ceil(wait), 1)
        noun = "submits" if kind == "submit" else "reads"
        super().__init__(
            f"Too many {noun} from this key: at most {burst} at once and {per_s:g} a second after that. "
            f"Try again in {retry_after} second{'s' if retry_after != 1 else ''}.",
            retry_after=retry_after,
        )
        self.kind, self.per_s, self.burst, self.wait = kind, per_s, burst, wait


def authenticate_within_rate(authorization: str | None, kind: str, settings: ApiSettings, store: JobStore) -> ApiKey:
    """The caller's key (401 otherwise) with one token of its `kind` bucket taken (429
    otherwise): one worker-thread call and one transaction for both, on the store's rates
    engine (its commit does not wait for the disk: `api.db.JobStore`). Every request pays
    this, so its round trips to the store are kept few. `settings`: the rates of keys without
    their own."""
    with transaction(store.rates) as conn:
        key = key_of(conn, authorization)
        per_s, burst = limits(key, kind, settings)
        wait = _take(conn, key.id, kind, per_s=per_s, burst=burst)
    if wait > 0:
        raise KeyOverRate(kind, per_s, burst, wait)
    return key


class EmptyBuckets:
    """Buckets the job store answered empty, and when each has a token again, in this process
    (see the module docstring): `(caller, kind)` → (monotonic time, the refusal).

    At most `max_entries` are kept, least recently refused dropped first: a dropped one only
    costs that key's next request a query again.
    """

    def __init__(self, max_entries: int = 65536):
        self.max_entries = max_entries
        self._until: OrderedDict[tuple[str, str], tuple[float, KeyOverRate]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, caller: str, kind: str, refusal: KeyOverRate, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._until.pop((caller, kind), None)
            self._until[(caller, kind)] = (now + refusal.wait, refusal)
            while len(self._until) > self.max_entries:
                self._until.popitem(last=False)

    def check(self, caller: str, kind: str, now: float | None = None) -> None:
        """Raise 429, Retry-After counted down, while the caller's `kind` bucket is known empty."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._until.get((caller, kind))
            if entry is None:
                return
            until, refusal = entry
            if until <= now:
                del self._until[(caller, kind)]
                return
        raise KeyOverRate(kind, refusal.per_s, refusal.burst, until - now)


KEY_LIST_EVERY_S = 1.0
"""At most one read of the keys table per this many seconds, for requests whose address has no
token left (module docstring)."""


class KnownKeys:
    """The hashes of the keys the job store holds (not revoked), as this replica last read them
    or saw them accepted (see the module docstring). Used on the event loop only.

    `load(engine)` reads the whole list from a job store's engine (`api.auth.key_hashes`: a few
    bytes a key); `holds` reads it again at most once per `every_s`; `reads` counts those reads.
    """

    def __init__(self, load: Callable[[Engine], set[str]] = key_hashes, every_s: float = KEY_LIST_EVERY_S):
        self.load = load
        self.every_s = every_s
        self.reads = 0
        self._hashes: set[str] = set()
        self._read_started = -math.inf
        self._lock: asyncio.Lock | None = None

    def __contains__(self, caller: str) -> bool:
        return caller in self._hashes

    def add(self, caller: str) -> None:
        """A key the store has just accepted."""
        self._hashes.add(caller)

    def discard(self, caller: str) -> None:
        """A key the store has just refused (revoked since it was read)."""
        self._hashes.discard(caller)

    async def holds(self, caller: str, engine: Engine) -> bool:
        """Whether the store of `engine` (the app's) holds the key `caller`: at once when known,
        else after a read of the list begun after this call, waiting (not refusing) until the
        last read is `every_s` old; every caller waiting meanwhile shares that one read."""
        if caller in self._hashes:
            return True
        asked = time.monotonic()
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._read_started < asked:  # no read begun since this caller asked
                await asyncio.sleep(max(0.0, self._read_started + self.every_s - time.monotonic()))
                self._read_started = time.monotonic()  # before the read: a failing store is not asked again at once
                self.reads += 1
                self._hashes = set(await run_in_threadpool(self.load, engine))
        return caller in self._hashes


class AddressLimiter:
    """Token buckets per client address, in this process, for requests without a valid key;
    `known` says which keys are valid (see the module docstring).

    At most `max_addresses` buckets are kept, least recently used dropped first: a dropped
    bucket is a full one again, which only a flood from that many addresses at once could
    exploit, and memory stays bounded whatever the addresses.
    """

    def __init__(self, per_s: float, burst: int, max_addresses: int = 65536, known: KnownKeys | None = None):
        self.per_s = per_s
        self.burst = burst
        self.max_addresses = max_addresses
        self.known = known if known is not None else KnownKeys()
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # address → [tokens, at]
        self._lock = threading.Lock()

    def take(self, address: str, now: float | None = None) -> None:
        """Take one token of `address`, or raise 429 with the seconds until one is back."""
        now = time.monotonic() if now is None else now
        with self._lock:
            bucket = self._buckets.pop(address, None) or [float(self.burst), now]
            bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.per_s)
            bucket[1] = now
            self._buckets[address] = bucket
            while len(self._buckets) > self.max_addresses:
                self._buckets.popitem(last=False)
            if bucket[0] < 1.0:
                retry_after = max(math.ceil((1.0 - bucket[0]) / self.per_s), 1)
                raise RateLimited(
                    f"Too many requests without a valid API key from your address. Send your key in the "
                    f"Authorization header as 'Bearer YOUR_KEY'. Try again in {retry_after} "
                    f"second{'s' if retry_after != 1 else ''}.",
                    retry_after=retry_after,
                )
            bucket[0] -= 1.0

    def give_back(self, address: str) -> None:
        """Return the token a request with a valid key took."""
        with self._lock:
            bucket = self._buckets.get(address)
            if bucket is not None:
                bucket[0] = min(float(self.burst), bucket[0] + 1.0)

    def charge(self, address: str, now: float | None = None) -> None:
        """Take a token of `address` after the fact, refusing nothing (a key this replica knew
        that the store refused): the bucket empties, never goes below empty."""
        try:
            self.take(address, now)
        except RateLimited:
            pass


def _address(request: Request) -> str:
    """The client's address: the connection's peer, or what a trusted proxy forwarded (uvicorn
    rewrites the peer for HARVEST_TRUSTED_PROXIES only, `fleet.proxies`)."""
    return request.client.host if request.client is not None else ""


async def _caller(request: Request, store: JobStore) -> str:
    """The caller, as the hash of the key it presents. A key this replica knows the store holds
    pays nothing; any other request takes a token of its address before the store is asked
    (429 when none is left, 401 without a key: the token stays spent), unless its key, looked
    for in the store's list, is there after all (see the module docstring). The address whose
    token a request took is `request.state.address_token`, for `_give_back`."""
    limiter: AddressLimiter = request.app.state.anonymous_limiter
    authorization = request.headers.get("authorization")
    address = _address(request)
    request.state.address_token = None
    try:
        caller = bearer_hash(authorization)
    except Unauthorized:
        limiter.take(address)
        raise
    if caller in limiter.known:
        return caller
    try:
        limiter.take(address)
    except RateLimited:
        if looks_like_key(authorization) and await limiter.known.holds(caller, store.db):
            return caller
        raise
    request.state.address_token = address
    return caller


def _give_back(request: Request) -> None:
    """Return the address's token this request took, if it took one (its key proved valid, or
    the store was not asked)."""
    address = getattr(request.state, "address_token", None)
    if address is not None:
        request.state.address_token = None
        request.app.state.anonymous_limiter.give_back(address)


def _store(request: Request) -> JobStore:
    """The job store the app was made with (what `api.deps.Store` gives a route). Read here from
    the app, as the limiter and the settings are: this module does not import `api.deps`, whose
    parts (the watcher, the links) would load torch into `harvest keys`, which imports `limits`."""
    return request.app.state.store


async def read_share(request: Request) -> AsyncIterator[KeyShare]:
    """FastAPI dependency (function scope: it ends when the route answers): a read's place
    among its key's reads in flight on this replica; 429 at once when the key already has its
    share of them (the address's token given back: the store was not asked)."""
    caller = await _caller(request, _store(request))
    try:
        share = request.app.state.fair_share.enter(caller)
    except RateLimited:
        _give_back(request)
        raise
    try:
        yield share
    finally:
        share.leave()


async def submit_share(request: Request) -> KeyShare:
    """FastAPI dependency: a submit's turns on this replica, not counted in flight: submits
    have their own per-key shares (`api.admission`'s for harvests; the inline response budget
    and the engines' batches for completions), and a completion waits on its engine for long."""
    return request.app.state.fair_share.uncounted(await _caller(request, _store(request)))


ReadShare = Annotated[KeyShare, Depends(read_share, scope="function")]
"""A read's share of this replica (`api.fairshare`): routes run their blocking calls with
`share.run(fn, …)`, in the key's turn."""


async def _key_within_rate(request: Request, share: KeyShare, kind: str, store: JobStore) -> ApiKey:
    """The caller's key in the app's `store` with a token of its `kind` taken; 429 from memory
    while its bucket is known empty, else one worker-thread call in the key's turn."""
    limiter: AddressLimiter = request.app.state.anonymous_limiter
    empty: EmptyBuckets = request.app.state.empty_buckets
    try:
        empty.check(share.caller, kind)
    except RateLimited:
        _give_back(request)  # a key the store knew, refused without asking it
        raise
    try:
        key = await share.run(authenticate_within_rate, request.headers.get("authorization"), kind,
                              request.app.state.settings, store)
    except Unauthorized:
        limiter.known.discard(share.caller)
        if getattr(request.state, "address_token", None) is None:
            limiter.charge(_address(request))  # a key thought valid, revoked since: its address pays now
        raise  # the token stays spent
    except KeyOverRate as refused:
        limiter.known.add(share.caller)
        _give_back(request)
        empty.remember(share.caller, kind, refused)
        raise
    except BaseException:
        _give_back(request)  # the store failed, not the caller
        raise
    limiter.known.add(share.caller)
    _give_back(request)
    return key


async def submit_key(request: Request, share: Annotated[KeyShare, Depends(submit_share)]) -> ApiKey:
    """FastAPI dependency: the caller's key (401 otherwise), within its submit rate (429 otherwise)."""
    return await _key_within_rate(request, share, "submit", _store(request))


async def read_key(request: Request, share: ReadShare) -> ApiKey:
    """FastAPI dependency: the caller's key (401 otherwise), within its read rate and its share
    of the replica (429 otherwise)."""
    return await _key_within_rate(request, share, "read", _store(request))


async def key_or_none(request: Request, store: JobStore) -> ApiKey | None:
    """The caller's key in the app's `store` within its read rate, or None when it sends none
    or one that is refused (401, 429): for a route that answers everyone and tells a key more
    (`/health`)."""
    if request.headers.get("authorization") is None:
        return None
    try:
        share = request.app.state.fair_share.uncounted(await _caller(request, store))
        return await _key_within_rate(request, share, "read", store)
    except (Unauthorized, RateLimited):
        return None


SubmitKey = Annotated[ApiKey, Depends(submit_key)]
"""A submitting route's caller: its key, within its submit rate."""
ReadKey = Annotated[ApiKey, Depends(read_key)]
"""A reading route's caller: its key, within its read rate and its share of the replica."""
