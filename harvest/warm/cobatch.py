"""Co-batching: one warm engine's forward passes shared by the jobs using it.

Each job asks for one shard at a time. While the engine runs one call, the shards that arrive
wait; when it comes free (and after at most `wait_s` for the other jobs holding the engine to
ask again), the oldest waiting shard goes next together with every other waiting shard of the
same capture (layers, directions, batch size), up to `max_shards`, in one
`Engine.capture_cobatch` call: their prompts share forward passes (vLLM schedules them as one
batch; HF sorts them into one set of batches), and each job gets its own values and statistics
back. The oldest waiting shard always goes next, so no job is passed over.

Turns: a shard of more than `turn_tokens` tokens (`HARVEST_ENGINE_TURN_TOKENS`) runs as
consecutive pieces of at most that many, each queued only once the one before it is done, so
the shards other jobs sent meanwhile go between them: a small job waits for one turn of a large
one, not its whole shard. The pieces' values reach the sink at their places in the shard, and
their statistics merge (Chan's formula, as shards and workers do) into the shard's.

A job that goes away while its shard waits (its run cancelled) is dropped before its shard
runs; one that goes while its shard runs only loses the answer. Each shard may bring a sink
(`harvest.engines.base.ValueSink`; in the server, its connection): its values go there batch
by batch, from whichever job's thread runs the call, while the shard's own asker waits.

`HARVEST_ENGINE_COBATCH_SHARDS` (`max_shards`) is 1 by default, each shard alone, on every
device: on the CPU 4 jobs co-batched measured 0.82x the throughput of each shard alone, and no
GPU measurement exists yet to say whether a GPU gains (`bench/gpu.sh` measures 1 and 4 side by
side, so the next GPU run decides).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harvest.capture import CaptureSpec, ShardCapture
from harvest.engines.base import Engine, ValueSink, hand_over

__all__ = ["CobatchedEngine", "Abandoned", "turns", "joined"]


class Abandoned(Exception):
    """The job left while its shard was waiting; the shard never ran."""


@dataclass
class _Shard:
    prompts: list[list[int]]
    spec: CaptureSpec
    batch_size: int | None
    sink: ValueSink | None = None
    answer: ShardCapture | None = None
    error: BaseException | None = None
    done: bool = False
    taken: bool = False

    def key(self) -> tuple:
        directions = self.spec.directions
        return (tuple(self.spec.layers), None if directions is None else (directions.shape, directions.tobytes()), self.batch_size)


class CobatchedEngine:
    """An engine and the shards waiting for it (the warm engine server's cache holds these)."""

    def __init__(self, engine: Engine, max_shards: int = 1, wait_s: float = 0.1, turn_tokens: int = 0):
        self.engine = engine
        self.max_shards = max(1, max_shards)
        self.wait_s = wait_s
        self.turn_tokens = turn_tokens  # 0: whole shards
        self.peers = 1
        self._waiting: list[_Shard] = []
        self._busy = False
        self._changed = threading.Condition()
        self.calls = 0
        self.shards = 0

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, batch_size: int | None,
                gone: Callable[[], bool] = lambda: False, peers: int = 1, sink: ValueSink | None = None) -> ShardCapture:
        """This shard's answer, run in turns with whatever else is waiting; `gone` says whether
        the asker left (checked while a turn waits); `peers`: the jobs now holding this engine;
        `sink` takes the shard's values as they come (the answer then holds none)."""
        parts: list[ShardCapture] = []
        start = 0
        for size in turns([len(p) for p in prompts], self.turn_tokens):
            shifted = None if sink is None else functools.partial(_shifted, sink, start)
            parts.append(self._turn(prompts[start : start + size], spec, batch_size, gone, peers, shifted))
            start += size
        return joined(parts)

    def _turn(self, prompts: list[list[int]], spec: CaptureSpec, batch_size: int | None,
              gone: Callable[[], bool], peers: int, sink: ValueSink | None) -> ShardCapture:
        shard = _Shard(prompts, spec, batch_size, sink)
        with self._changed:
            self.peers = peers
            self._waiting.append(shard)
            while not shard.done:
                if not self._busy:
                    self._busy = True
                    self._wait_for_peers()
                    group = self._take()
                    self._changed.release()
                    try:
                        self._run(group)
                    finally:
                        self._changed.acquire()
                        self._busy = False
                        self._changed.notify_all()
                    continue
                self._changed.wait(0.2)
                if not shard.taken and not shard.done and gone():
                    self._waiting.remove(shard)
                    raise Abandoned("the job left before its shard ran")
        if shard.error is not None:
            raise shard.error
        return shard.answer

    def _wait_for_peers(self) -> None:
        """Give the other jobs on this engine up to `wait_s` to ask (under the lock). Each job
        asks for its next shard right after its last answer, so without this wait two jobs
        would only ever alternate, one alone per call."""
        deadline = time.monotonic() + self.wait_s
        while len(self._waiting) < min(self.peers, self.max_shards) and (left := deadline - time.monotonic()) > 0:
            self._changed.wait(left)

    def _take(self) -> list[_Shard]:
        """The oldest waiting shard and the waiting shards of the same capture (under the lock)."""
        key = self._waiting[0].key()
        group = [s for s in self._waiting if s.key() == key][: self.max_shards]
        for shard in group:
            shard.taken = True
            self._waiting.remove(shard)
        return group

    def _run(self, group: list[_Shard]) -> None:
        first = group[0]
        try:
            answers = self.engine.capture_cobatch([s.prompts for s in group], first.spec, batch_size=first.batch_size,
                                                   sinks=[s.sink for s in group])
            for shard, answer in zip(group, answers, strict=True):
                shard.answer = hand_over(answer, shard.sink)
        except BaseException as exc:  # every shard of the call gets the error (the server sends it on)
            for shard in group:
                shard.error = exc
        finally:  # never left taken and not done: its asker would wait for ever
            for shard in group:
                shard.done = True
            self.calls += 1
            self.shards += len(group)

    def counters(self) -> dict:
        """Engine calls made and shards they answered (more shards than calls: shared passes)."""
        return {"calls": self.calls, "shards": self.shards}

    def close(self) -> None:
        self.engine.close()


def turns(lengths: list[int], turn_tokens: int) -> list[int]:
    """How many consecutive prompts each turn takes: at most `turn_tokens` tokens, at least one
    prompt (0: every prompt in one turn)."""
    if not turn_tokens:
        return [len(lengths)] if lengths else [0]
    sizes, count, tokens = [], 0, 0
    for length in lengths:
        if count and tokens + length > turn_tokens:
            sizes.append(count)
            count, tokens = 0, 0
        count += 1
        tokens += length
    sizes.append(count)
    return sizes


def _shifted(sink: ValueSink, start: int, position: int, value) -> None:
    sink(start + position, value)


@torch.inference_mode()  # the engines' statistics are inference tensors, updated in place here
def joined(parts: list[ShardCapture]) -> ShardCapture:
    """One shard's answer from its turns' answers, in order."""
    whole = parts[0]
    for part in parts[1:]:
        whole.values.extend(part.values)
        whole.stats.merge(part.stats)
        whole.forward_s += part.forward_s
        whole.extra.update(part.extra)
    return whole
