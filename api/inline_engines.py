"""Warm engines for inline completions, and the batcher that shares each one between requests.

`InlineEngines` keeps an API replica's engines in an `EngineCache`, under the same rules as a
worker host's engine server: a model is loaded the first time it is asked for and kept
(loading costs seconds to minutes; a request should not), at most
`HARVEST_ENGINE_MODELS_PER_GROUP` models at once, the least recently used idle one unloaded
when another is asked for, never one a request holds. Each engine gets an `EngineBatcher`
with ONE worker thread: every call into the engine (load, generate, close) runs there, so the
event loop never blocks on a forward pass and two batches never share hooks on one model. The
engine itself decodes in a child process of the replica, at a lower CPU priority
(`api.inline_process`); that thread only waits for its answers.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

from harvest.engines.base import Engine, Generation, SamplingSpec
from harvest.registry import ModelInfo
from harvest.settings import Settings
from harvest.warm.cache import EngineCache, Loaded

__all__ = ["BatcherStats", "EngineBatcher", "InlineEngines"]

DEFAULT_CAPACITY = Settings.model_fields["engine_models_per_group"].default
"""Models kept loaded unless the app says otherwise (`HARVEST_ENGINE_MODELS_PER_GROUP`'s default)."""

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

    def shut_down(self) -> None:
        """Stop the dispatcher and fail what still waits; safe from any thread (an eviction
        runs in the evicting request's), as the queue belongs to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._shut_down)
        except RuntimeError:  # the loop closed meanwhile: nothing runs on it any more
            pass

    def _shut_down(self) -> None:
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


class InlineEngines:
    """The replica's warm `EngineBatcher`s, one per loaded model, in an `EngineCache`."""

    @classmethod
    def in_children(cls, settings: Settings) -> "InlineEngines":
        """The app's: each model's engine chosen and bounded by `settings`, in a child process
        of its own (`ProcessEngine`), so that decoding never takes the replica's share of the
        CPU or its GIL; `settings.engine_models_per_group` of them kept loaded."""
        from api.inline_process import ProcessEngine

        return cls(partial(ProcessEngine, settings=settings), capacity=settings.engine_models_per_group, loads_here=False)

    def __init__(self, factory: Callable[[ModelInfo], Engine], *, capacity: int | None = None,
                 close_engines: bool = True, loads_here: bool = True, **batcher_options):
        """`factory` loads a model's engine: in this process (`loads_here`), or in a child
        (`in_children`). `capacity`: models kept loaded (default `DEFAULT_CAPACITY`).
        `close_engines=False` leaves engines the factory shares with others (a test session's
        engine) open when they are unloaded."""
        if loads_here:
            # Engines load in this process's threads. transformers resolves its top-level
            # names lazily on first access, and that is not thread-safe: a request tokenizing
            # in one thread while an engine loaded in another got "cannot import name
            # 'AutoTokenizer'". So they are resolved here, once, before any worker thread. (A
            # replica's own engines load in their child processes, and it imports none of this.)
            from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: F401
        self._factory = factory
        self._close_engines = close_engines
        self._options = batcher_options
        self._models: dict[str, ModelInfo] = {}
        self.cache = EngineCache(capacity or DEFAULT_CAPACITY, self._load, self._unload)
        # Requests that must wait for a load or a free slot wait here, not on the event loop.
        self._waiters = ThreadPoolExecutor(max_workers=16, thread_name_prefix="inline-acquire")

    def _load(self, name: str) -> EngineBatcher:
        """In the thread of the request that loads it: the engine, made in its own worker thread."""
        model = self._models[name]
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{model.name}")
        try:
            engine = executor.submit(self._factory, model).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return EngineBatcher(executor, engine, **self._options)

    def _unload(self, batcher: EngineBatcher) -> None:
        """Evicted (nobody holds it, so nothing is queued) or closing: outside the cache lock."""
        batcher.shut_down()
        if self._close_engines:
            batcher._executor.submit(batcher.engine.close).result()
        batcher._executor.shutdown(wait=False)

    @asynccontextmanager
    async def hold(self, model: ModelInfo) -> AsyncIterator[EngineBatcher]:
        """The model's batcher, loaded if need be and not evicted while held."""
        self._models.setdefault(model.name, model)
        entry = self.cache.try_acquire(model.name)
        if entry is None:
            entry = await self._acquire(model.name)
        try:
            yield entry.engine
        finally:
            self.cache.release(entry)

    async def _acquire(self, name: str) -> Loaded:
        waiting = asyncio.get_running_loop().run_in_executor(self._waiters, self.cache.acquire, name)
        try:
            # shield: the wait in its thread goes on whatever happens here (a load others may
            # wait for included), so its future must stay uncancelled to hand its result back.
            entry, _ = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            waiting.add_done_callback(self._hand_back)  # the wait goes on in its thread
            raise
        return entry

    def _hand_back(self, done: asyncio.Future) -> None:
        """What a request that went away got after all goes back at once."""
        if not done.cancelled() and done.exception() is None:
            self.cache.release(done.result()[0])

    async def generate(self, model: ModelInfo, prompt: list[int], sampling: SamplingSpec, layers: list[int] | None) -> Generation:
        """One completion, in the batch it runs in, its engine held throughout."""
        async with self.hold(model) as batcher:
            return await batcher.generate(prompt, sampling, layers)

    async def get(self, model: ModelInfo) -> EngineBatcher:
        """The model's batcher, loaded (a preload, a test); not held, so it may be evicted."""
        async with self.hold(model) as batcher:
            return batcher

    async def close(self) -> None:
        """Stop every dispatcher and release every engine (each in its own thread)."""
        await asyncio.get_running_loop().run_in_executor(self._waiters, self.cache.close)
        self._waiters.shutdown(wait=False)
