"""Job-change announcements reaching this API process, whichever replica made the change.

Every status change is announced inside the transaction that makes it (`api.db.job_changed`).
On PostgreSQL that is a NOTIFY on `JOB_CHANNEL`, and this module LISTENs on its own
connection, in a thread: the server delivers each committed change to every replica, so a
long-poll waiter on replica B wakes when replica A's watcher (or a cancel through A) moves
its job, with no Prefect query and no table polling per waiter. On SQLite (one process) the
announcement is a callback after commit.

A LISTEN connection that drops is re-opened; a change made while it was down is not lost to a
waiter, which re-reads its job every few seconds anyway (`api.routes.harvest`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from sqlalchemy.engine import Engine

from api.db import JOB_CHANNEL, local_listeners

__all__ = ["JobChanges"]

log = logging.getLogger("harvest.api.notify")


class JobChanges:
    """Calls `callback(job_id)` for every committed job change in the job store of `engine`
    (from a thread on PostgreSQL)."""

    def __init__(self, callback: Callable[[str], None], engine: Engine):
        self.callback = callback
        self.engine = engine
        self.url = engine.url.render_as_string(hide_password=False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()
        """Set once the LISTEN is in place (tests wait on it before making changes)."""

    @property
    def postgres(self) -> bool:
        return self.url.startswith("postgresql")

    def start(self) -> None:
        if not self.postgres:
            local_listeners(self.engine).add(self.callback)
            self.listening.set()
            return
        self._thread = threading.Thread(target=self._listen, name="harvest-job-changes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if not self.postgres:
            local_listeners(self.engine).remove(self.callback)
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _conninfo(self) -> str:
        # SQLAlchemy's URL names the driver ("postgresql+psycopg://"); libpq wants it plain.
        scheme, _, rest = self.url.partition("://")
        return f"postgresql://{rest}"

    def _listen(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo(), autocommit=True) as conn:
                    conn.execute(f"LISTEN {JOB_CHANNEL}")
                    self.listening.set()
                    while not self._stop.is_set():
                        # Wakes at least once a second to notice `stop`.
                        for note in conn.notifies(timeout=1.0):
                            self.callback(note.payload)
            except Exception:
                self.listening.clear()
                if self._stop.is_set():
                    return
                log.exception("job-change listener lost its connection; reconnecting")
                self._stop.wait(1.0)
