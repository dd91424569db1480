"""A lease in the job store: exactly one API replica at a time holds a named duty.

The watcher's duty (following Prefect, charging ended jobs, restarting what died) must be done
by one replica, not by each: N watchers would cost N Prefect queries a tick and race each
other for every job. The replicas share nothing but the database, so the lease lives there:
one row per lease, `holder` and `expires_at`, taken or renewed in a transaction that locks the
row (`SELECT … FOR UPDATE`; SQLite's `BEGIN IMMEDIATE`).

The holder renews on a clock of its own (`LeaseKeeper`: a thread, every third of the TTL), not
between pieces of its work, so a slow piece of work (a tick of the watcher waiting on Prefect)
never lets the lease lapse while the replica is alive; a replica that dies stops renewing, and
another takes the lease over once it has expired (`ttl_s`, a few seconds). A replica that stops
cleanly gives it up at once.

The holder's own view of its lease is a deadline on its monotonic clock (`holds`): the TTL from
the moment it *sent* its last successful renewal, which is never later than the row's
`expires_at`. Work done under the lease asks `holds(margin)` before each write, so a holder
whose renewals failed (the database away, the thread starved) stops writing before another
replica can have taken over. Should the two still overlap (a write in flight across the
margin), it costs a duplicate Prefect read, never a double charge: every ending is a
compare-and-set in `api.store`.

Times are the database host's clock read by each replica (naive UTC); replicas are expected to
run NTP, and the TTL is far larger than any skew that matters.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Callable

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from api.db import leases, locked, transaction, utcnow

__all__ = ["Lease", "LeaseKeeper", "replica_id"]

log = logging.getLogger("harvest.api.lease")


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
        self.valid_until = 0.0
        """Monotonic time until which this holder's lease surely lasts (see the module docstring)."""
        self.renewals = 0
        """Successful takes and renewals, for the operator's and the tests' eyes."""

    def holds(self, margin_s: float = 0.0) -> bool:
        """Whether this holder still has the lease for at least `margin_s` more seconds, by its
        own clock: ask before each write made under the lease."""
        return self.held and time.monotonic() + margin_s < self.valid_until

    def acquire(self) -> bool:
        """Take the lease if it is free or expired, renew it if this holder has it; True if held."""
        sent = time.monotonic()  # before the row's `expires_at` is computed: never later than it
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
                    self.valid_until = 0.0
                    return False
        except IntegrityError:  # another replica inserted the first row at the same moment
            self.held = False
            return False
        self.held = True
        self.valid_until = sent + self.ttl.total_seconds()
        self.renewals += 1
        return True

    def release(self) -> None:
        """Give the lease up now (a clean stop), so another replica takes over at its next tick."""
        with transaction(self.engine) as conn:
            conn.execute(
                update(leases).where(leases.c.name == self.name, leases.c.holder == self.holder).values(expires_at=utcnow())
            )
        self.held = False
        self.valid_until = 0.0

    def current_holder(self) -> str | None:
        """Who holds the lease now (None when nobody does)."""
        with transaction(self.engine) as conn:
            row = conn.execute(select(leases).where(leases.c.name == self.name)).mappings().first()
        if row is None or row["expires_at"] <= utcnow():
            return None
        return row["holder"]


class LeaseKeeper:
    """Takes and renews `lease` every `period_s` on a thread of its own, whatever else the process
    is doing (its event loop busy, its thread pool full, the work under the lease stuck on a
    slow call); `on_gained()` is called (from that thread) each time the lease becomes held."""

    def __init__(self, lease: Lease, period_s: float, on_gained: Callable[[], None] | None = None):
        self.lease = lease
        self.period_s = period_s
        self.on_gained = on_gained
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LeaseKeeper":
        self._thread = threading.Thread(target=self._keep, name=f"harvest-lease-{self.lease.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (a clean stop then `Lease.release`s it; a renewal in flight ends first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _keep(self) -> None:
        from harvest.metrics import WATCHER_LEASE_RENEWALS

        while not self._stop.is_set():
            was_held = self.lease.held
            try:
                held = self.lease.acquire()
                gained = held and not was_held
                outcome = "held" if held else "lost" if was_held else "elsewhere"
            except Exception:  # the database briefly away: the lease lapses by `holds` if it lasts
                log.warning("could not renew the %s lease", self.lease.name, exc_info=True)
                gained, outcome = False, "error"
            WATCHER_LEASE_RENEWALS.labels(outcome).inc()
            if gained and self.on_gained is not None:
                self.on_gained()
            self._stop.wait(self.period_s)
