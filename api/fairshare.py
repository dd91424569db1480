"""A fair share of an API replica for each key: a bound on its reads in flight, and its
blocking work served in turn with every other key's.

Why: a replica used to serve each request as it came. One key sending at its full allowed
rate kept the worker threads, the job store's connections and the CPU busy with its own
requests, and another key's single read waited behind all of them. The request rates
(`api.ratelimit`) bound a key's requests per second over the whole service; this bounds what
one key holds of one replica at a given moment. Both parts live in this process's memory and
cost no query:

- `FairShare.enter(caller)`: a replica works on at most `per_key` reads of one caller at
  once; one more is answered 429 `rate_limit_exceeded` with Retry-After 1 straight away (no
  thread, no query). A long-poll steps aside while it waits (`KeyShare.aside`): waiting costs
  a socket, not work, and waiters have their own per-key share (`api.watcher`). Submits are
  not counted (`FairShare.uncounted`): they have per-key shares of their own (`api.admission`,
  the inline response budget), and a completion mostly waits for its engine.
- `FairShare.run(caller, fn, …)`: the routes' blocking work (job-store queries, rendering)
  runs in a worker thread, at most `at_once` such calls at a time on the replica; the others
  wait in a queue per caller, and each freed place goes to the next caller in turn
  (round-robin), so a key with twenty calls queued delays another key's one call by one
  call, not by twenty.

A caller is the SHA-256 of the key it presents (as the job store keeps it, and known before
the key is looked up), so each key is one caller however many connections it opens.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from starlette.concurrency import run_in_threadpool

from api.errors import RateLimited

__all__ = ["FairShare", "KeyShare", "default_at_once"]

T = TypeVar("T")


def default_at_once() -> int:
    """Blocking calls a replica runs at once when not configured: two per CPU core (each call
    is a short query or render that also waits on I/O), at least 4."""
    return max(4, 2 * (os.cpu_count() or 1))


class FairShare:
    """Per replica (one event loop): requests in flight per caller, and the worker-thread
    calls of every caller served in turn. Used from the event loop only, so it needs no lock."""

    def __init__(self, per_key: int, at_once: int):
        self.per_key = per_key
        self.at_once = at_once
        self.running = 0
        self._in_flight: dict[str, int] = {}
        # Callers with calls waiting, in the order of their turns; each one's calls in FIFO order.
        self._waiting: dict[str, deque[asyncio.Future]] = {}

    @classmethod
    def from_settings(cls, settings) -> "FairShare":
        return cls(settings.key_reads_in_flight, settings.replica_work_at_once or default_at_once())

    def in_flight(self, caller: str) -> int:
        return self._in_flight.get(caller, 0)

    def waiting(self, caller: str | None = None) -> int:
        """Calls waiting for a place (of `caller`, or of everyone)."""
        if caller is not None:
            return len(self._waiting.get(caller, ()))
        return sum(len(calls) for calls in self._waiting.values())

    def enter(self, caller: str) -> "KeyShare":
        """Count one more read of `caller` in flight (`KeyShare.leave` ends it), or refuse it
        with 429 when `per_key` already are."""
        held = self._in_flight.get(caller, 0)
        if held >= self.per_key:
            raise RateLimited(
                f"Too many reads from this key at once: this server works on at most {self.per_key} of one "
                "key's reads at a time. Wait for an answer before sending more, or try again in 1 second.",
                retry_after=1,
            )
        self._in_flight[caller] = held + 1
        return KeyShare(self, caller)

    def uncounted(self, caller: str) -> "KeyShare":
        """`caller`'s turns for a request not counted in flight."""
        return KeyShare(self, caller, counted=False)

    def _leave(self, caller: str) -> None:
        held = self._in_flight.get(caller, 0) - 1
        if held > 0:
            self._in_flight[caller] = held
        else:
            self._in_flight.pop(caller, None)

    async def run(self, caller: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a worker thread, when it is `caller`'s turn."""
        await self._turn(caller)
        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        finally:
            self._pass_on()

    async def _turn(self, caller: str) -> None:
        """Take a place: at once while one is free and nobody waits, else in `caller`'s queue."""
        if self.running < self.at_once and not self._waiting:
            self.running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(caller, deque()).append(turn)
        try:
            await turn
        except BaseException:  # the request was cancelled (its client left)
            if turn.done() and not turn.cancelled():
                self._pass_on()  # the place was handed over just before: give it to the next
            else:
                calls = self._waiting.get(caller)
                if calls is not None and turn in calls:
                    calls.remove(turn)
                    if not calls:
                        del self._waiting[caller]
            raise

    def _pass_on(self) -> None:
        """Free a place and hand free places to the waiting callers, one call each in turn."""
        self.running -= 1
        while self.running < self.at_once and self._waiting:
            caller = next(iter(self._waiting))
            calls = self._waiting.pop(caller)
            turn = calls.popleft()
            if calls:
                self._waiting[caller] = calls  # to the back of the line: every other caller goes first
            if turn.done():  # cancelled while waiting
                continue
            turn.set_result(None)
            self.running += 1


class KeyShare:
    """One request's place among its caller's requests in flight (`FairShare.enter`), and its
    turns for blocking calls."""

    def __init__(self, fair: FairShare, caller: str, *, counted: bool = True):
        self.fair = fair
        self.caller = caller
        self._counted = counted

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a worker thread, in this caller's turn."""
        return await self.fair.run(self.caller, fn, *args, **kwargs)

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Not counted in flight meanwhile: a long-poll while it waits for its job to change."""
        counted = self._counted
        self.leave()
        try:
            yield
        finally:
            if counted:  # counted again whatever the others did meanwhile: it is being served already
                self.fair._in_flight[self.caller] = self.fair._in_flight.get(self.caller, 0) + 1
                self._counted = True

    def leave(self) -> None:
        """The request is answered (idempotent)."""
        if self._counted:
            self._counted = False
            self.fair._leave(self.caller)
