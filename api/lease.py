"""A lease in the job store: exactly one API replica at a time holds a named duty.

The watcher's duty (following Prefect, charging ended jobs, restarting what died) must be done
by one replica, not by each: N watchers would cost N Prefect queries a tick and race each
other for every job. The replicas share nothing but the database, so the lease lives there:
one row per lease, `holder` and `expires_at`, taken or renewed in a transaction that locks the
row (`SELECT … FOR UPDATE`; SQLite's `BEGIN IMMEDIATE`).

The holder renews every tick; a replica that dies stops renewing, and another takes the lease
over once it has expired (`ttl_s`, a few seconds). A replica that stops cleanly gives it up
at once. Two holders can overlap for at most one tick (a holder stalled past its TTL); that
costs a duplicate Prefect read, never a double charge: every ending is a compare-and-set in
`api.store`.

Times are the database host's clock read by each replica (naive UTC); replicas are expected to
run NTP, and the TTL is far larger than any skew that matters.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from api.db import leases, locked, transaction, utcnow

__all__ = ["Lease", "replica_id"]


def replica_id() -> str:
    """This process's name in the lease table: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """The lease `name` as `holder` takes it, for `ttl_s` seconds a time, in the job store of
    `engine` (the one the replicas share)."""

    def __init__(self, name: str, holder: str, ttl_s: float, engine: Engine):
        self.name = name
        self.holder = holder
        self.ttl = timedelta(seconds=ttl_s)
        self.engine = engine
        self.held = False

    def acquire(self) -> bool:
        """Take the lease if it is free or expired, renew it if this holder has it; True if held."""
        now = utcnow()
        try:
            with transaction(self.engine) as conn:
                row = locked(conn, leases, leases.c.name == self.name)
                if row is None:
                    conn.execute(insert(leases).values(name=self.name, holder=self.holder, expires_at=now + self.ttl))
                elif row["holder"] == self.holder or row["expires_at"] <= now:
                    conn.execute(
                        update(leases).where(leases.c.name == self.name).values(holder=self.holder, expires_at=now + self.ttl)
                    )
                else:
                    self.held = False
                    return False
        except IntegrityError:  # another replica inserted the first row at the same moment
            self.held = False
            return False
        self.held = True
        return True

    def release(self) -> None:
        """Give the lease up now (a clean stop), so another replica takes over at its next tick."""
        with transaction(self.engine) as conn:
            conn.execute(
                update(leases).where(leases.c.name == self.name, leases.c.holder == self.holder).values(expires_at=utcnow())
            )
        self.held = False

    def current_holder(self) -> str | None:
        """Who holds the lease now (None when nobody does)."""
        with transaction(self.engine) as conn:
            row = conn.execute(select(leases).where(leases.c.name == self.name)).mappings().first()
        if row is None or row["expires_at"] <= utcnow():
            return None
        return row["holder"]
