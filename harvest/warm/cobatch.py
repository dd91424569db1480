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

A turn is also sized by time (`turn_s`, `HARVEST_ENGINE_TURN_S`): at the speed the engine
measured on its recent calls (tokens a second, from calls of at least `MEASURED_FROM_TOKENS`,
so that a call's fixed costs do not pass for slowness), a turn takes at most about `turn_s`,
whatever the device. On a GPU, 16,384 tokens of an 8B model should take well under a second
(an estimate from the FLOPs at half an H200's bf16 peak, not yet measured) and the token bound
is the one that acts; on a CPU they are many seconds (under the noisy-neighbour
bench, a small job's one forward pass waited 2-4 s behind a large job's turn of 8,192 tokens),
and the time bound cuts the turn, down to one prompt.

A job that goes away while its shard waits (its run cancelled) is dropped before its shard
runs; one that goes while its shard runs only loses the answer. Each shard may bring a sink
(`harvest.engines.base.ValueSink`; in the server, its connection): its values go there batch
by batch, from whichever job's thread runs the call, while the shard's own asker waits.

`HARVEST_ENGINE_COBATCH_SHARDS` (`max_shards`) is 1 by default, each shard alone, on every
device: 4 jobs co-batched measured 0.82x the throughput of each shard alone on the CPU, and
0.89x (HF) and 0.81x (vLLM) on an H200 at Llama-3.1-8B shapes (`bench/gpu.sh`,
bench/RESULTS.md).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harvest.capture import ShardCapture
from harvest.capture_spec import CaptureSpec
from harvest.engines.base import Engine, ValueSink, hand_over

__all__ = ["CobatchedEngine", "Abandoned", "MEASURED_FROM_TOKENS", "next_turn", "joined"]


MEASURED_FROM_TOKENS = 512
"""A call of fewer tokens does not change the engine's measured speed (its fixed costs would)."""


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

    def __init__(self, engine: Engine, max_shards: int = 1, wait_s: float = 0.1, turn_tokens: int = 0,
                 turn_s: float = 0.0):
        self.engine = engine
        self.max_shards = max(1, max_shards)
        self.wait_s = wait_s
        self.turn_tokens = turn_tokens  # 0: whole shards
        self.turn_s = turn_s  # 0: turns by tokens only
        self.tokens_per_s: float | None = None
        """The engine's speed on its recent calls (module docstring); None until measured."""
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
        lengths = [len(p) for p in prompts]
        start = 0
        while not parts or start < len(prompts):  # an empty shard is one (empty) turn
            size = next_turn(lengths, start, self.turn_budget())
            shifted = None if sink is None else functools.partial(_shifted, sink, start)
            parts.append(self._turn(prompts[start : start + size], spec, batch_size, gone, peers, shifted))
            start += size
        return joined(parts)

    def turn_budget(self) -> int:
        """The tokens of the next turn: `turn_tokens`, fewer where the engine's measured speed
        would make such a turn last over `turn_s` (0: no bound)."""
        if not self.turn_s or self.tokens_per_s is None:
            return self.turn_tokens
        by_time = max(1, int(self.tokens_per_s * self.turn_s))
        return min(self.turn_tokens, by_time) if self.turn_tokens else by_time

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
        tokens, started = sum(len(p) for s in group for p in s.prompts), time.monotonic()
        try:
            answers = self.engine.capture_cobatch([s.prompts for s in group], first.spec, batch_size=first.batch_size,
                                                   sinks=[s.sink for s in group])
            self._measured(tokens, time.monotonic() - started)
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

    def _measured(self, tokens: int, seconds: float) -> None:
        """A call's speed, into the engine's (the mean of the last measure and this one's:
        the speed follows a host that gets busier or quieter within a few calls)."""
        if tokens < MEASURED_FROM_TOKENS or seconds <= 0:
            return
        speed = tokens / seconds
        self.tokens_per_s = speed if self.tokens_per_s is None else (self.tokens_per_s + speed) / 2

    def counters(self) -> dict:
        """Engine calls made and shards they answered (more shards than calls: shared passes)."""
        return {"calls": self.calls, "shards": self.shards}

    def close(self) -> None:
        self.engine.close()


def next_turn(lengths: list[int], start: int, turn_tokens: int) -> int:
    """How many consecutive prompts from `start` the next turn takes: at most `turn_tokens`
    tokens, at least one prompt (0: every prompt left)."""
    if not turn_tokens:
        return len(lengths) - start
    count, tokens = 0, 0
    for length in itertools.islice(lengths, start, None):
        if count and tokens + length > turn_tokens:
            break
        count += 1
        tokens += length
    return count


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
        whole.padded_tokens += part.padded_tokens
        whole.extra.update(part.extra)
    return whole
