"""API keys: creation (hashed at rest), Bearer authentication, and the activation quota.

A key is `acs_` + 32 random url-safe bytes. Only its SHA-256 is stored: the key is random with
~256 bits of entropy, so a slow password hash would add latency to every request and no
security (nothing to brute-force), which is why token services (GitHub, Stripe) do the same.

Routes learn the caller's key through `api.ratelimit`'s dependencies (`authenticate_within_rate`,
which also takes a token of the key's rate). For inline completions this module keeps the
activation quota in residual-stream positions per month:
`reserve_activations` holds the most a response may return (429 `activation_quota_exceeded`
over the quota) and `settle_activations` keeps what it did return.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from api.db import api_keys, aware, key_lane_limits, locked, reading, transaction, usage, utcnow
from api.errors import ActivationQuotaExceeded, Unauthorized
from harvest.lanes import Lane

__all__ = [
    "ApiKey",
    "create_key",
    "list_keys",
    "revoke_key",
    "bearer_hash",
    "looks_like_key",
    "key_hashes",
    "authenticate",
    "key_of",
    "reserve_activations",
    "settle_activations",
    "activations_used",
    "month_of",
]

@dataclass(frozen=True)
class ApiKey:
    """A key's record (never the key itself)."""

    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    limits: dict[str, int]
    """This key's own caps of jobs queued or running at once, by lane; a lane not named here
    has its `key_limit` from infra/lanes.toml."""
    monthly_jobs: int | None
    """Harvests per calendar month (UTC); None is unlimited."""
    token_budget: int | None
    """Harvest tokens per calendar month (UTC), charged plus held; None is unlimited."""
    activation_quota: int | None
    """Inline residual-stream positions returned per calendar month (UTC), summed over the
    key's activation responses (`shape[1]` of each: prompt + generated − 1); None is unlimited."""
    rates: dict[str, float | int] = field(default_factory=dict)
    """The key's own request rates (`rate_submit_per_s`, `rate_submit_burst`, `rate_read_per_s`,
    `rate_read_burst`); one not here is the service's `HARVEST_RATE_*` setting."""
    storage_quota: int | None = None
    """Bytes the key's kept job files may hold (`api.store.bytes_held`); None is the service's
    `HARVEST_STORAGE_QUOTA_BYTES` (unlimited unless set)."""

    def lane_limit(self, lane: Lane) -> int:
        """Jobs of this key queued or running at once in `lane`: its own cap, else the lane's."""
        return self.limits.get(lane.name, lane.key_limit)

    @classmethod
    def from_row(cls, row, limits: dict[str, int]) -> "ApiKey":
        return cls(
            id=row["id"],
            name=row["name"],
            prefix=row["prefix"],
            created_at=aware(row["created_at"]),
            revoked_at=aware(row["revoked_at"]),
            limits=dict(limits),
            monthly_jobs=row["monthly_jobs"],
            token_budget=row["token_budget"],
            activation_quota=row["activation_quota"],
            rates={name: row[name] for name in RATE_FIELDS if row.get(name) is not None},
            storage_quota=row.get("storage_quota"),
        )


RATE_FIELDS = ("rate_submit_per_s", "rate_submit_burst", "rate_read_per_s", "rate_read_burst")

KEY_PREFIX = "acs_"
KEY_LENGTH = len(KEY_PREFIX) + 43  # token_urlsafe(32): 43 characters


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def month_of(moment: datetime) -> str:
    return moment.strftime("%Y-%m")


def _limits(conn, key_ids: list[str]) -> dict[str, dict[str, int]]:
    rows = conn.execute(select(key_lane_limits).where(key_lane_limits.c.key_id.in_(key_ids))).mappings().all()
    out: dict[str, dict[str, int]] = {key_id: {} for key_id in key_ids}
    for row in rows:
        out[row["key_id"]][row["lane"]] = row["max_jobs"]
    return out


def create_key(
    name: str,
    *,
    monthly_jobs: int | None = None,
    token_budget: int | None = None,
    activation_quota: int | None = None,
    rate_submit_per_s: float | None = None,
    rate_submit_burst: int | None = None,
    rate_read_per_s: float | None = None,
    rate_read_burst: int | None = None,
    storage_quota: int | None = None,
    engine: Engine,
    **lane_limits: int,
) -> tuple[str, ApiKey]:
    """A new key with its limits; returns the key (shown once) and its record.

    lane_limits: concurrent jobs per lane by lane name (`small=3`, `xl=2`); a lane not given
    keeps its default `key_limit`, also when it changes in infra/lanes.toml later. The caller
    checks the names against its lanes (`harvest keys create` does).
    """
    for lane, value in lane_limits.items():
        if value < 0:
            raise ValueError(f"the {lane} limit must be 0 or more, not {value}")
    rates = {"rate_submit_per_s": rate_submit_per_s, "rate_submit_burst": rate_submit_burst,
             "rate_read_per_s": rate_read_per_s, "rate_read_burst": rate_read_burst}
    for field_name, value in rates.items():
        if value is not None and not value > 0:
            raise ValueError(f"{field_name.removeprefix('rate_').replace('_', ' ')} must be more than 0, not {value}")
    if storage_quota is not None and storage_quota < 0:
        raise ValueError(f"the storage quota must be 0 bytes or more, not {storage_quota}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = {
        "id": "key_" + uuid.uuid4().hex[:20],
        "name": name,
        "key_hash": _hash(key),
        "prefix": key[:10],
        "created_at": utcnow(),
        "revoked_at": None,
        "monthly_jobs": monthly_jobs,
        "token_budget": token_budget,
        "activation_quota": activation_quota,
        "storage_quota": storage_quota,
        **rates,
    }
    with transaction(engine) as conn:
        conn.execute(insert(api_keys).values(**row))
        for lane, value in lane_limits.items():
            conn.execute(insert(key_lane_limits).values(key_id=row["id"], lane=lane, max_jobs=value))
    return key, ApiKey.from_row(row, lane_limits)


def list_keys(engine: Engine) -> list[ApiKey]:
    with transaction(engine) as conn:
        rows = conn.execute(select(api_keys).order_by(api_keys.c.created_at)).mappings().all()
        limits = _limits(conn, [r["id"] for r in rows])
    return [ApiKey.from_row(r, limits[r["id"]]) for r in rows]


def revoke_key(key_id_or_name: str, engine: Engine) -> int:
    """Revoke keys by id, name or shown prefix; returns how many were revoked."""
    with transaction(engine) as conn:
        result = conn.execute(
            update(api_keys)
            .where(api_keys.c.revoked_at.is_(None))
            .where(
                (api_keys.c.id == key_id_or_name)
                | (api_keys.c.name == key_id_or_name)
                | (api_keys.c.prefix == key_id_or_name)
            )
            .values(revoked_at=utcnow())
        )
        return result.rowcount


def looks_like_key(authorization: str | None) -> bool:
    """Whether the header holds something of a key's shape (`acs_` + 43 characters): only
    those are worth asking the store about."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    return scheme.lower() == "bearer" and key.startswith(KEY_PREFIX) and len(key) == KEY_LENGTH


def bearer_hash(authorization: str | None) -> str:
    """The SHA-256 of the key in an `Authorization: Bearer …` header (as the job store keeps
    it), without asking the store; 401 when there is no key."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized(
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY'."
        )
    return _hash(key.strip())


def key_hashes(engine: Engine) -> set[str]:
    """The hashes of every key not revoked: one read of the keys table, however many callers
    wait on it (`api.ratelimit.KnownKeys` keeps it, so a request with a key the store
    holds is never refused by its address's limit)."""
    with reading(engine) as conn:
        return set(conn.execute(select(api_keys.c.key_hash).where(api_keys.c.revoked_at.is_(None))).scalars())


def authenticate(authorization: str | None, engine: Engine) -> ApiKey:
    """The key of an `Authorization: Bearer …` header; 401 when missing, unknown or revoked."""
    with transaction(engine) as conn:
        return key_of(conn, authorization)


def key_of(conn, authorization: str | None) -> ApiKey:
    """`authenticate` inside the caller's transaction."""
    row = conn.execute(select(api_keys).where(api_keys.c.key_hash == bearer_hash(authorization))).mappings().first()
    if row is None or row["revoked_at"] is not None:
        raise Unauthorized("Incorrect API key provided.")
    return ApiKey.from_row(row, _limits(conn, [row["id"]])[row["id"]])


def reserve_activations(key: ApiKey, positions: int, engine: Engine) -> str:
    """Hold `positions` residual-stream positions of the key's activation quota this month (the
    most a response may return), or refuse with 429; returns the month held in.

    The count and the check happen under the key's row lock, so concurrent requests never
    pass the quota together. `settle_activations` then keeps only the positions returned.
    """
    month = month_of(utcnow())
    with transaction(engine) as conn:
        locked(conn, api_keys, api_keys.c.id == key.id)
        row = locked(conn, usage, usage.c.key_id == key.id, usage.c.month == month)
        used = 0 if row is None else row["activations"]
        if key.activation_quota is not None and used + positions > key.activation_quota:
            left = max(key.activation_quota - used, 0)
            raise ActivationQuotaExceeded(
                f"This request may return up to {positions:,} residual-stream positions (prompt + max_tokens - 1), "
                f"and your key has {left:,} of its {key.activation_quota:,} activation positions for {month} left. "
                "Ask for fewer tokens, or wait for the quota to reset on the first day of next month (UTC).",
            )
        if row is None:
            conn.execute(insert(usage).values(key_id=key.id, month=month, activations=positions))
        else:
            conn.execute(
                update(usage).where(usage.c.key_id == key.id, usage.c.month == month)
                .values(activations=usage.c.activations + positions)
            )
    return month


def settle_activations(key: ApiKey, month: str, held: int, returned: int, engine: Engine) -> None:
    """Keep `returned` of the `held` positions (0 when the request failed): the quota counts
    what responses carried, never what they asked for."""
    if held == returned:
        return
    with transaction(engine) as conn:
        conn.execute(
            update(usage).where(usage.c.key_id == key.id, usage.c.month == month)
            .values(activations=usage.c.activations - (held - returned))
        )


def activations_used(key_id: str, month: str | None = None, *, engine: Engine) -> int:
    """Positions counted against the key's activation quota in `month` (default this one)."""
    month = month or month_of(utcnow())
    with transaction(engine) as conn:
        value = conn.execute(select(usage.c.activations).where(usage.c.key_id == key_id, usage.c.month == month)).scalar()
    return int(value or 0)
