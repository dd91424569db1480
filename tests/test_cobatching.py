"""Shards of concurrent jobs co-batched in shared forward passes (`harvest.warm.cobatch.CobatchedEngine` over
the HF engine), in one process.

Checked against what the model itself saw (a forward pre-hook recording the rows of every
forward pass), each prompt run alone through HF `hidden_states`, and numpy float64 statistics
over each shard's own stored values.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from harvest.capture_spec import CaptureSpec
from harvest.tokenize import load_tokenizer
from harvest.warm.cobatch import Abandoned, CobatchedEngine
from testbed.reference import bf16_tolerance, hf_reference_layers

LAYERS = [1, 4]


@pytest.fixture(scope="module")
def shards(tiny) -> list[list[list[int]]]:
    tokenizer = load_tokenizer(tiny.path)
    texts = [["job a, one", "job a, the second prompt is longer"], ["job b alone"], ["job c, one", "job c, two", "c3"]]
    return [[tokenizer(t)["input_ids"] for t in shard] for shard in texts]


class ForwardLog:
    """The prompts of every forward pass the HF model runs (a pre-hook on the decoder): the
    engine packs prompts into rows, each prompt's positions starting at 0, so a pass's prompts
    are its positions equal to 0. (A pass of rows of unequal lengths would add one filler
    sequence per shorter row; these prompts all pack into one row, with none.)"""

    def __init__(self, hf_model):
        self.rows: list[int] = []
        self.handle = hf_model.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        self.rows.append(int((kwargs["position_ids"] == 0).sum()))

    def close(self):
        self.handle.remove()


class Gate:
    """An engine wrapper whose first call waits for `open`: shards arriving meanwhile queue up."""

    def __init__(self, engine):
        self.engine = engine
        self.opened = threading.Event()
        self.first = True

    def capture_cobatch(self, shards, spec, *, batch_size=None, sinks=None):
        if self.first:
            self.first = False
            self.opened.wait(10)
        return self.engine.capture_cobatch(shards, spec, batch_size=batch_size, sinks=sinks)

    def close(self):
        pass


def _ask(cobatched, prompts, spec, results, key, gone):
    def run():
        try:
            results[key] = cobatched.capture(prompts, spec, None, gone=gone)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[key] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _stats_of(values: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """numpy float64 mean and population variance over every position but each prompt's first."""
    rows = np.concatenate([v.float().numpy()[:, 1:].astype(np.float64) for v in values], axis=1)
    return rows.mean(axis=1), rows.var(axis=1)


def _held_then_released(hf_engine, asks: list[tuple], before_release=lambda: None) -> tuple[dict, list[int], CobatchedEngine]:
    """`asks` [(key, prompts, spec, gone)] as concurrent jobs on one CobatchedEngine: the first
    holds the engine (at a gate) while the others arrive in order, then the gate opens.
    Returns the answers by key, the rows of every forward pass, and the CobatchedEngine."""
    gate = Gate(hf_engine)
    cobatched = CobatchedEngine(gate, max_shards=4)
    log = ForwardLog(hf_engine.hf_model)
    results: dict = {}
    try:
        threads = []
        for n, (key, prompts, spec, gone) in enumerate(asks):
            threads.append(_ask(cobatched, prompts, spec, results, key, gone))
            time.sleep(0.3 if n == 0 else 0.1)
        time.sleep(0.2)
        before_release()
        gate.opened.set()
        for thread in threads:
            thread.join(30)
    finally:
        log.close()
    return results, log.rows, cobatched


def _never_gone() -> bool:
    return False


def test_waiting_shards_share_forward_passes_and_keep_their_own_values_and_statistics(hf_engine, shards):
    spec = CaptureSpec(layers=LAYERS)
    asks = [("first", [[1, 2, 3]], spec, _never_gone)] + [(k, shard, spec, _never_gone) for k, shard in enumerate(shards)]
    results, rows, cobatched = _held_then_released(hf_engine, asks)
    # The model ran two passes: the gated shard alone, then all three waiting shards at once.
    assert rows == [1, sum(len(s) for s in shards)], rows
    assert cobatched.counters() == {"calls": 2, "shards": 4}
    for k, shard in enumerate(shards):
        answer = results[k]
        assert len(answer.values) == len(shard)
        for ids, got in zip(shard, answer.values):
            reference = hf_reference_layers(hf_engine.hf_model, ids, LAYERS)
            assert got.shape == reference.shape
            assert (np.abs(got.float().numpy() - reference) <= 2 * bf16_tolerance(reference)).all()
        mean, var = _stats_of(answer.values)
        assert answer.stats.count == sum(len(ids) - 1 for ids in shard)
        np.testing.assert_allclose(answer.stats.mean.double().numpy(), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose((answer.stats.m2.double() / answer.stats.count).numpy(), var, rtol=1e-4, atol=1e-6)


def test_different_captures_do_not_share_a_call_and_the_oldest_goes_first(hf_engine, shards):
    results, rows, _ = _held_then_released(hf_engine, [
        ("first", [[1, 2]], CaptureSpec(layers=[0]), _never_gone),
        ("other layers", shards[0], CaptureSpec(layers=[2]), _never_gone),
        ("same as first", shards[1], CaptureSpec(layers=[0]), _never_gone),
    ])
    assert rows == [1, 2, 1]  # the other layers' shard was older than the matching one
    assert results["other layers"].values[0].shape[0] == 1 and results["same as first"].values[0].shape[0] == 1


def test_a_shard_whose_job_left_while_it_waited_never_runs(hf_engine, shards):
    spec = CaptureSpec(layers=LAYERS)
    left = threading.Event()

    def leave():
        left.set()
        time.sleep(0.5)  # the waiting shard notices within one 0.2 s wait

    results, rows, _ = _held_then_released(hf_engine, [
        ("first", [[1, 2, 3]], spec, _never_gone),
        ("cancelled", shards[2], spec, left.is_set),
        ("kept", shards[1], spec, _never_gone),
    ], before_release=leave)
    assert isinstance(results["cancelled"], Abandoned)
    assert rows == [1, len(shards[1])]  # the cancelled job's three prompts never ran
    assert len(results["kept"].values) == len(shards[1])


def test_an_engine_error_reaches_its_asker_and_the_engine_goes_on(hf_engine, shards):
    cobatched = CobatchedEngine(hf_engine)
    with pytest.raises(Exception, match="out of range|index"):
        cobatched.capture([[10**9]], CaptureSpec(layers=LAYERS), None)  # a token id past the vocabulary
    assert cobatched.capture(shards[1], CaptureSpec(layers=LAYERS), None).stats.count == len(shards[1][0]) - 1


def _partition(lengths: list[int], turn_tokens: int) -> list[int]:
    from harvest.warm.cobatch import next_turn

    sizes, start = [], 0
    while not sizes or start < len(lengths):
        sizes.append(next_turn(lengths, start, turn_tokens))
        start += sizes[-1]
    return sizes


def test_turns_cut_a_shard_by_tokens_at_least_one_prompt_each():
    assert _partition([5, 5, 5, 5], 10) == [2, 2]
    assert _partition([5, 6, 5], 10) == [1, 1, 1]
    assert _partition([5, 4, 5], 10) == [2, 1]
    assert _partition([30, 1, 1], 10) == [1, 2]  # a prompt longer than a turn runs alone
    assert _partition([5, 5, 5], 0) == [3]  # 0: the whole shard in one turn
    assert _partition([], 10) == [0]  # an empty shard: one empty turn
    assert sum(_partition(list(range(1, 50)), 64)) == 49


class Slow:
    """An engine wrapper whose calls take `per_token_s` a token more than the engine's own."""

    def __init__(self, engine, per_token_s: float):
        self.engine, self.per_token_s = engine, per_token_s
        self.turns: list[int] = []  # prompts of each call: a turn, whatever passes the engine makes of it

    def capture_cobatch(self, shards, spec, *, batch_size=None, sinks=None):
        self.turns.append(sum(len(shard) for shard in shards))
        time.sleep(self.per_token_s * sum(len(prompt) for shard in shards for prompt in shard))
        return self.engine.capture_cobatch(shards, spec, batch_size=batch_size, sinks=sinks)

    def close(self):
        pass


def test_a_turn_lasts_about_turn_s_at_the_engines_measured_speed(hf_engine):
    """An engine of at most ~1,000 tokens a second (1 ms a token over its real forward passes),
    turns of at most 600 tokens or 0.25 s, a shard of 12 prompts of 100 tokens: the first turn,
    before any measure, is 600 tokens (6 prompts); the speed measured on it (about 0.6 s) cuts
    every later one to what runs in 0.25 s: one or two prompts, never the 6 the tokens allow.
    The shard's statistics count all its tokens (each prompt's but its first position)."""
    prompts = [[100 + (i * 7 + j) % 500 for j in range(100)] for i in range(12)]
    slow = Slow(hf_engine, 0.001)
    cobatched = CobatchedEngine(slow, turn_tokens=600, turn_s=0.25)
    answer = cobatched.capture(prompts, CaptureSpec(layers=LAYERS), None)
    assert slow.turns[0] == 6 and sum(slow.turns) == 12, slow.turns
    assert all(1 <= prompts <= 2 for prompts in slow.turns[1:]), slow.turns
    assert cobatched.tokens_per_s is not None and cobatched.tokens_per_s < 1000
    assert answer.stats.count == 12 * 99


def test_a_small_shard_goes_between_the_turns_of_a_large_one(hf_engine, tiny):
    """A large job's shard in turns: a small job's shard that arrives during its first turn runs
    next, not after the whole shard; the large shard's values land at their places and its
    statistics are those of all its values (numpy float64), as if it had run whole."""
    tokenizer = load_tokenizer(tiny.path)
    large = [tokenizer(f"the large job's prompt number {i} goes on for a while")["input_ids"] for i in range(12)]
    small = [tokenizer("the small job")["input_ids"]]
    spec = CaptureSpec(layers=LAYERS)
    turn = 3 * max(len(ids) for ids in large)  # three prompts a turn at most: four turns or more
    gate = Gate(hf_engine)
    cobatched = CobatchedEngine(gate, turn_tokens=turn)
    log = ForwardLog(hf_engine.hf_model)
    results, placed = {}, {}
    try:
        def run_large():
            results["large"] = cobatched.capture(large, spec, None, sink=lambda position, value: placed.setdefault(position, value))

        large_thread = threading.Thread(target=run_large)
        large_thread.start()
        time.sleep(0.3)  # the large shard's first turn holds the engine (at the gate)
        small_thread = _ask(cobatched, small, spec, results, "small", _never_gone)
        time.sleep(0.2)
        gate.opened.set()
        large_thread.join(60)
        small_thread.join(60)
    finally:
        log.close()
    # Forward passes: the large shard's first turn, the small shard, then the large one's other turns.
    assert log.rows[:2] == [3, 1] and len(log.rows) >= 5, log.rows
    assert sum(log.rows) == len(large) + 1
    assert sorted(placed) == list(range(len(large))) and results["large"].values == []
    for position in (0, 5, 11):
        reference = hf_reference_layers(hf_engine.hf_model, large[position], LAYERS)
        assert (np.abs(placed[position].float().numpy() - reference) <= 2 * bf16_tolerance(reference)).all()
    mean, var = _stats_of([placed[p] for p in range(len(large))])
    stats = results["large"].stats
    assert stats.count == sum(len(ids) - 1 for ids in large)
    np.testing.assert_allclose(stats.mean.double().numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((stats.m2.double() / stats.count).numpy(), var, rtol=1e-4, atol=1e-6)
    assert results["small"].stats.count == len(small[0]) - 1

