"""The admission budget of one API replica: the submits it reads, parses and tokenizes at once.

A submit's cost is known only once its body is read and its prompts counted (`harvest.cost`);
until then this budget is what bounds the replica's memory and CPU, whatever the requests
say. A submit takes a place before it reads a byte of its body and keeps it until it is
answered. Places are limited three ways (settings `HARVEST_ADMISSION_*`):

- `admission_concurrency` submits at once (their parsing and tokenizing run in worker
  threads, so the event loop keeps serving everything else meanwhile);
- `admission_bytes` of bodies at once, each counted at its Content-Length, or at the route's
  cap when it declares none (one body over the whole budget is admitted only alone);
- `admission_key_share` submits of one key at once, so a key's burst of large bodies queues
  behind itself while other keys' submits take the other places.

A submit that finds no place waits (up to `admission_wait_s`, at most `admission_queue`
waiting), then is answered 503 `replica_busy` with Retry-After. Waiting costs little: uvicorn
stops reading a connection whose body the app has not asked for yet (its flow control), so an
unread body stays in the client's socket, not in this process. What one admitted submit holds
is its body, its parsed prompts and a slice of token ids (`harvest.tokenize.count_tokens`):
a few times its body, so the replica's memory for submits stays within a few times
`admission_bytes` above its idle size (README, "Bounds").
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request

from harvest.errors import ReplicaBusy
from harvest.settings import Settings, get_settings

__all__ = ["AdmissionBudget", "admission", "declared_bytes", "RETRY_AFTER_S"]

RETRY_AFTER_S = 5
"""What a refused submit is told to wait: about one large submit's time here."""


class AdmissionBudget:
    """Places for submits on this replica (module docstring)."""

    def __init__(self, *, concurrency: int, max_bytes: int, key_share: int, queue: int, wait_s: float):
        self.concurrency, self.max_bytes, self.key_share = concurrency, max_bytes, key_share
        self.queue, self.wait_s = queue, wait_s
        self.active = 0
        self.bytes = 0
        self.waiting = 0
        self._per_key: Counter[str] = Counter()
        self._changed = asyncio.Condition()

    @classmethod
    def from_settings(cls, settings: Settings) -> "AdmissionBudget":
        return cls(
            concurrency=settings.admission_concurrency, max_bytes=settings.admission_bytes,
            key_share=settings.admission_key_share, queue=settings.admission_queue, wait_s=settings.admission_wait_s,
        )

    def _fits(self, key_id: str, size: int) -> bool:
        return (
            self.active < self.concurrency
            and self._per_key[key_id] < self.key_share
            and (self.bytes + size <= self.max_bytes or self.active == 0)
        )

    def _busy(self, why: str) -> ReplicaBusy:
        return ReplicaBusy(
            f"This API replica is busy admitting other harvests ({why}). Send the request again in "
            f"{RETRY_AFTER_S} seconds.",
            retry_after=RETRY_AFTER_S,
        )

    @asynccontextmanager
    async def hold(self, key_id: str, size: int) -> AsyncIterator[None]:
        """A place for one submit of `key_id` whose body is `size` bytes, for the block's time."""
        async with self._changed:
            if not self._fits(key_id, size):
                if self.waiting >= self.queue:
                    raise self._busy(f"{self.waiting} submits are already waiting")
                self.waiting += 1
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self._fits(key_id, size)), self.wait_s)
                except asyncio.TimeoutError:
                    raise self._busy(f"none came free in {self.wait_s:g} s") from None
                finally:
                    self.waiting -= 1
            self.active += 1
            self.bytes += size
            self._per_key[key_id] += 1
        try:
            yield
        finally:
            async with self._changed:
                self.active -= 1
                self.bytes -= size
                self._per_key[key_id] -= 1
                if not self._per_key[key_id]:
                    del self._per_key[key_id]
                self._changed.notify_all()


def admission(app: FastAPI) -> AdmissionBudget:
    """The replica's budget (`app.state.admission`), made from the settings on first use."""
    budget = getattr(app.state, "admission", None)
    if budget is None:
        budget = app.state.admission = AdmissionBudget.from_settings(get_settings())
    return budget


def declared_bytes(request: Request, cap: int) -> int:
    """What a body will hold, before it is read: its Content-Length, or the cap without one."""
    declared = request.headers.get("content-length", "")
    return min(int(declared), cap) if declared.isascii() and declared.isdigit() else cap
