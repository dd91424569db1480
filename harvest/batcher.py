"""Warm engines for inline completions, and the batcher that shares each one between requests.

`EnginePool` loads one engine per model the first time it is asked for and keeps it (loading
a model costs seconds to minutes; a request should not). Each engine gets an `EngineBatcher`
with ONE worker thread: every call into the engine (load, generate, close) runs there, so the
event loop never blocks on a forward pass and two batches never share hooks on one model.

Batching: a request joins a queue; the dispatcher waits `window_s` after the first arrival so
that requests sent together are collected, then hands the queue to ONE `engine.generate`
call (up to `max_batch` prompts, grouped by the layers they capture, since a call captures
one layer set). Requests arriving while a batch runs wait and form the next batch, so under
load batches fill up with no extra delay. If a batch of several fails, each request is
retried alone, so one bad request cannot fail the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from harvest.engines.base import Engine, Generation, SamplingSpec
from harvest.registry import ModelInfo

__all__ = ["BatcherStats", "EngineBatcher", "EnginePool"]

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 0.01
DEFAULT_MAX_BATCH = 64
# Rows × (longest prompt + most tokens asked) per generate call. The HF engine pads every row
# to the longest, so one long prompt among many short ones would multiply the work; past
# this budget the rest wait for the next batch (a single request always fits).
DEFAULT_MAX_BATCH_TOKENS = 65536


@dataclass
class BatcherStats:
    """Counters that show the batching at work (read by tests and the benchmark)."""

    requests: int = 0
    generate_calls: int = 0
    largest_batch: int = 0


@dataclass
class _Pending:
    prompt: list[int]
    sampling: SamplingSpec
    layers: tuple[int, ...] | None
    future: asyncio.Future


class EngineBatcher:
    """One warm engine, its worker thread, and the queue of requests waiting for it."""

    def __init__(
        self,
        executor: ThreadPoolExecutor,
        engine: Engine,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    ):
        self.engine = engine
        self.window_s = window_s
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.stats = BatcherStats()
        self._executor = executor
        self._queue: list[_Pending] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def generate(self, prompt: list[int], sampling: SamplingSpec, layers: list[int] | None) -> Generation:
        """Queue one completion and wait for the batch it runs in."""
        loop = asyncio.get_running_loop()
        self._ensure_dispatcher(loop)
        pending = _Pending(prompt, sampling, tuple(layers) if layers else None, loop.create_future())
        self._queue.append(pending)
        self.stats.requests += 1
        self._wakeup.set()
        return await pending.future

    def _ensure_dispatcher(self, loop: asyncio.AbstractEventLoop) -> None:
        # The dispatcher lives on the loop of the server that uses it; a new loop (a restarted
        # server, another test client) gets a new one.
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._dispatch(), name=f"batcher-{self.engine.model.name}")

    def _take_batch(self) -> list[_Pending]:
        """The oldest request's layer group, in arrival order, within max_batch and the token budget."""
        key = self._queue[0].layers
        batch: list[_Pending] = []
        width = 0
        for pending in self._queue:
            if pending.layers != key:
                continue
            row = len(pending.prompt) + pending.sampling.max_tokens
            if batch and (len(batch) >= self.max_batch or (len(batch) + 1) * max(width, row) > self.max_batch_tokens):
                break
            batch.append(pending)
            width = max(width, row)
        taken = set(map(id, batch))
        self._queue = [p for p in self._queue if id(p) not in taken]
        return [p for p in batch if not p.future.done()]  # a cancelled request needs no work

    async def _dispatch(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            await asyncio.sleep(self.window_s)  # let the requests sent together arrive
            while self._queue:
                batch = self._take_batch()
                try:
                    if batch:
                        await self._run(batch)
                except Exception as exc:  # noqa: BLE001 - the dispatcher must outlive any batch
                    log.exception("the batcher failed a batch")
                    for pending in batch:
                        _settle(pending.future, exception=exc)

    async def _call(self, batch: list[_Pending]) -> list[Generation]:
        loop = asyncio.get_running_loop()
        self.stats.generate_calls += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        layers = list(batch[0].layers) if batch[0].layers else None
        return await loop.run_in_executor(
            self._executor, self.engine.generate, [p.prompt for p in batch], [p.sampling for p in batch], layers
        )

    async def _run(self, batch: list[_Pending]) -> None:
        try:
            generations = await self._call(batch)
            if len(generations) != len(batch):
                raise RuntimeError(f"the engine answered {len(generations)} of a batch of {len(batch)}")
        except Exception as exc:  # noqa: BLE001 - handed to the waiting requests, not swallowed
            if len(batch) == 1:
                _settle(batch[0].future, exception=exc)
                return
            log.warning("a batch of %d failed (%s); running its requests one by one", len(batch), exc)
            for pending in batch:
                await self._run([pending])
            return
        for pending, generation in zip(batch, generations):
            _settle(pending.future, result=generation)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for pending in self._queue:
            _settle(pending.future, exception=RuntimeError("the engine was shut down"))
        self._queue.clear()


def _settle(future: asyncio.Future, *, result=None, exception: BaseException | None = None) -> None:
    if future.done():  # the client went away
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)


class EnginePool:
    """One warm `EngineBatcher` per model, loaded on first use and kept until `close`."""

    def __init__(self, factory: Callable[[ModelInfo], Engine] | None = None, *, close_engines: bool = True, **batcher_options):
        """`factory` loads a model's engine (default `load_engine`: vLLM where installed, else HF).

        `close_engines=False` leaves engines the factory shares with others (a test session's
        engine) open at `close`.
        """
        if factory is None:
            from harvest.engines.base import load_engine

            factory = load_engine
        self._factory = factory
        self._close_engines = close_engines
        self._options = batcher_options
        self._batchers: dict[str, EngineBatcher] = {}
        self._loading: dict[str, asyncio.Future] = {}

    async def get(self, model: ModelInfo) -> EngineBatcher:
        """The model's batcher; the first call loads the engine in its own worker thread."""
        if model.name in self._batchers:
            return self._batchers[model.name]
        if model.name not in self._loading:
            self._loading[model.name] = asyncio.ensure_future(self._load(model))
        try:
            # shield: a request that goes away must not cancel a load that others wait for
            return await asyncio.shield(self._loading[model.name])
        finally:
            if self._loading.get(model.name) is not None and self._loading[model.name].done():
                self._loading.pop(model.name, None)

    async def _load(self, model: ModelInfo) -> EngineBatcher:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{model.name}")
        try:
            engine = await asyncio.get_running_loop().run_in_executor(executor, self._factory, model)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        batcher = EngineBatcher(executor, engine, **self._options)
        self._batchers[model.name] = batcher
        return batcher

    def loaded(self) -> dict[str, EngineBatcher]:
        return dict(self._batchers)

    async def close(self) -> None:
        """Stop every dispatcher and release every engine (in its own thread)."""
        for batcher in self._batchers.values():
            await batcher.close()
            if self._close_engines:
                await asyncio.get_running_loop().run_in_executor(batcher._executor, batcher.engine.close)
            batcher._executor.shutdown(wait=False)
        self._batchers.clear()
