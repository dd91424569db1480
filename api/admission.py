"""The admission budget of one API replica: the submits it reads, parses and tokenizes at once.

The inline routes' bodies (`api.routes.completions.admit_inline`) pass through the same budget, the
same way: their bytes held, a place in their key's share, parsed and tokenized on one of the
working places (on the budget's threads: the checks are quick once a prompt's length has
refused what cannot run, and what is kept is the prompt's ids), so a burst of them neither
fills the thread pool every key's reads need nor costs memory beside the submits' budget.

A submit's cost is known only once its body is read and its prompts counted (`harvest.cost`);
until then this budget is what bounds the replica's memory and CPU, whatever the requests
say. Three limits (settings `HARVEST_ADMISSION_*`):

- `admission_bytes` of bodies at once: a submit holds its body's bytes, counted at its
  Content-Length (at the route's cap when it declares none), from before it reads a byte of
  its body until it is answered (`hold`); one body over the whole budget is admitted only alone;
- `admission_key_share` submits of one key at once (`hold`), so a key's burst of large bodies
  queues behind itself while other keys' submits go by;
- `admission_concurrency` submits parsed and counted at once (`work`), each by one of as many
  child processes in a session of their own at a lower group priority (`assess`,
  `api.admission_process`), waited for on one of as many threads of the budget's own (`call`),
  so the event loop keeps serving everything else meanwhile, and on a contended host the
  counting takes the CPU the replica's requests leave (a session's share does not depend on
  its threads' nice). A body still arriving holds bytes, not one of these places, and must
  arrive within `admission_read_s` (408 otherwise).

A submit that finds no place waits (up to `admission_wait_s`, at most `admission_queue`
waiting), then is answered 503 `replica_busy` with Retry-After. Waiting costs little: uvicorn
stops reading a connection whose body the app has not asked for yet (its flow control), so an
unread body stays in the client's socket, not in this process. What one admitted submit holds
is its body and its parsed prompts in the replica, and its body, its parsed prompts and a slice
of token ids (`harvest.tokenize.count_tokens`) in its child: a few times its body, so the
replica's memory for submits, and its children's, stay within a few times `admission_bytes`
above their idle size (README, "Bounds"). A refused body's prompts never come back to the
replica.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, AsyncIterator, Callable, TypeVar

import anyio
from fastapi import Depends, Request

from api import deps
from api.admission_process import TOKENIZE_ON_CALLER, WORK_NICE, Assessors
from api.errors import ReplicaBusy, RequestTimeout
from api.settings import ApiSettings
from harvest.registry import Registry
from harvest.request import HarvestRequest

__all__ = ["AdmissionBudget", "Admission", "admission", "declared_bytes", "read_body_within", "RETRY_AFTER_S",
           "TOKENIZE_ON_CALLER", "WORK_NICE"]

RETRY_AFTER_S = 5
"""What a refused submit is told to wait: about one large submit's time here."""

T = TypeVar("T")


class AdmissionBudget:
    """Places for submits on this replica (module docstring)."""

    def __init__(self, *, concurrency: int, max_bytes: int, key_share: int, queue: int, wait_s: float):
        self.concurrency, self.max_bytes, self.key_share = concurrency, max_bytes, key_share
        self.queue, self.wait_s = queue, wait_s
        self.submits = 0
        """Submits holding their bodies' bytes (reading, parsing, counting or being admitted)."""
        self.bytes = 0
        self.working = 0
        """Submits parsing or counting, in worker threads."""
        self.waiting = 0
        self._per_key: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        # At the default nice: they only hand bodies over and take answers back, holding the
        # GIL while they do; a thread at a lower nice would make the event loop wait for it.
        self._threads = ThreadPoolExecutor(concurrency, "admission")
        self._assessors: Assessors | None = None

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> "AdmissionBudget":
        return cls(
            concurrency=settings.admission_concurrency, max_bytes=settings.admission_bytes,
            key_share=settings.admission_key_share, queue=settings.admission_queue, wait_s=settings.admission_wait_s,
        )

    def _busy(self, why: str) -> ReplicaBusy:
        return ReplicaBusy(
            f"This API replica is busy admitting other harvests ({why}). Send the request again in "
            f"{RETRY_AFTER_S} seconds.",
            retry_after=RETRY_AFTER_S,
        )

    async def _wait(self, fits: Callable[[], bool]) -> None:
        """Return once `fits()` (the condition held), or refuse: the queue is full, or
        nothing came free in `wait_s`."""
        if fits():
            return
        if self.waiting >= self.queue:
            raise self._busy(f"{self.waiting} submits are already waiting")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._changed.wait_for(fits), self.wait_s)
        except asyncio.TimeoutError:
            raise self._busy(f"no place came free in {self.wait_s:g} s") from None
        finally:
            self.waiting -= 1

    @asynccontextmanager
    async def hold(self, key_id: str, size: int) -> AsyncIterator[None]:
        """The bytes of a submit of `key_id` whose body is `size` bytes, and a place in its
        key's share, from before its body is read until it is answered."""
        async with self._changed:
            await self._wait(lambda: self._per_key[key_id] < self.key_share
                             and (self.bytes + size <= self.max_bytes or self.submits == 0))
            self.submits += 1
            self.bytes += size
            self._per_key[key_id] += 1
        try:
            yield
        finally:
            async with self._changed:
                self.submits -= 1
                self.bytes -= size
                self._per_key[key_id] -= 1
                if not self._per_key[key_id]:
                    del self._per_key[key_id]
                self._changed.notify_all()

    @asynccontextmanager
    async def work(self) -> AsyncIterator[None]:
        """One of the `concurrency` places where a held submit is parsed and its prompts
        counted (`call`): a body still arriving slowly holds bytes, never one of these."""
        async with self._changed:
            await self._wait(lambda: self.working < self.concurrency)
            self.working += 1
        try:
            yield
        finally:
            async with self._changed:
                self.working -= 1
                self._changed.notify_all()

    def start(self) -> None:
        """Start the assessing children (in the background), so the first submits do not wait
        for their imports; `assess` starts them too if this was not called."""
        if self._assessors is None:
            self._assessors = Assessors(self.concurrency)

    def close(self) -> None:
        if self._assessors is not None:
            self._assessors.close()
            self._assessors = None

    async def assess(self, body: bytes, registry: Registry) -> tuple[HarvestRequest, dict]:
        """The body parsed, checked and counted by a child (`api.admission_process.assess`),
        from inside `work`: the request and its job's fields, or its 400."""
        self.start()
        return await self.call(self._assessors.assess, body, registry)

    async def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on one of the budget's threads (from inside `work`): an inline
        body's parse and checks, an assessing child's answer awaited. Awaited to
        its end even when the request is cancelled (its client hung up): the place it holds
        is given back only once its thread is free, so the threads never have more to do than
        the places allow."""
        context = contextvars.copy_context()
        done = asyncio.get_running_loop().run_in_executor(self._threads, lambda: context.run(fn, *args, **kwargs))
        with anyio.CancelScope(shield=True):
            return await done


async def admission(request: Request) -> AdmissionBudget:
    """The replica's budget (`app.state.admission`, given by the app's factory)."""
    return request.app.state.admission


Admission = Annotated[AdmissionBudget, Depends(admission)]


def declared_bytes(request: Request, cap: int) -> int:
    """What a body will hold, before it is read: its Content-Length, or the cap without one."""
    declared = request.headers.get("content-length", "")
    return min(int(declared), cap) if declared.isascii() and declared.isdigit() else cap


async def read_body_within(request: Request, seconds: float, *caps) -> bytes:
    """The body (capped as `api.deps.read_body` caps it, `caps` its limit and advice), or 408
    when it takes over `seconds`."""
    try:
        return await asyncio.wait_for(deps.read_body(request, *caps), seconds)
    except asyncio.TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {seconds:g} seconds. Send it again, or split the prompts "
            "into several smaller jobs."
        ) from None
