"""No compute on padding: prompts of every length from 1 to `max_model_len`, packed into rows.

The planner is checked against the lengths it was given (every prompt once, rows and passes
within their bounds, filler within the budget); the engine against what the model itself ran
(a pre-hook counting the tokens of every forward pass) and against each prompt run alone
through HF (`hidden_states`), within one bf16 step either way (a packed pass's float32
rounding differs from a lone pass's, so a value near a rounding edge can land on the
neighbouring step, as in any batched run); a whole job against its manifest's token counts
and the tokenizer's.
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors

from harvest.capture_spec import CaptureSpec
from harvest.engines.packing import DEVICE_RATES, PAD_BUDGET, ROW_CANDIDATES, PassCost, packed_inputs, plan_for, plan_passes
from harvest.jobfiles import MANIFEST
from harvest.pipeline import run_job
from harvest.request import HarvestRequest, resolve_job
from harvest.storage import Storage
from harvest.tokenize import load_tokenizer
from testbed.reference import bf16_tolerance, hf_reference_layers

MAX_LEN = 2048  # llama-tiny's max_model_len


def _spread(n: int, seed: int) -> list[int]:
    """Lengths as real text has them, log-uniform over 1..MAX_LEN, with both ends present."""
    rng = random.Random(seed)
    return [1, MAX_LEN, 2, MAX_LEN - 1] + [max(1, min(MAX_LEN, round(2 ** rng.uniform(0, 11)))) for _ in range(n - 4)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("row_tokens, batch_tokens, max_prompts", [(512, 16384, None), (512, 512, None), (256, 4096, 8), (2048, 2048, 3)])
def test_every_prompt_runs_once_within_the_bounds(seed, row_tokens, batch_tokens, max_prompts):
    lengths = _spread(300, seed)
    passes = plan_passes(lengths, row_tokens=row_tokens, batch_tokens=batch_tokens, max_prompts=max_prompts)
    seen = sorted(i for plan in passes for i in plan.prompts)
    assert seen == list(range(len(lengths)))
    for plan in passes:
        widths = [sum(lengths[i] for i in row) for row in plan.rows]
        assert plan.width == max(widths) and plan.real_tokens == sum(widths)
        for row in plan.rows:
            assert len(row) == 1 or sum(lengths[i] for i in row) <= row_tokens
        if len(plan.rows) > 1:
            assert len(plan.rows) * plan.width <= batch_tokens
            assert plan.padded_tokens <= PAD_BUDGET * len(plan.rows) * plan.width
        if max_prompts is not None:
            assert len(plan.prompts) <= max_prompts
    # Packing leaves little unfilled: rows of short prompts are nearly full.
    assert sum(p.padded_tokens for p in passes) <= PAD_BUDGET * sum(lengths)


def test_one_row_a_pass_runs_no_filler_at_all():
    lengths = _spread(500, 9)
    passes = plan_passes(lengths, row_tokens=512, batch_tokens=512)
    assert sum(p.padded_tokens for p in passes) == 0
    # and the rows are packed: the prompts shorter than a row share rows
    assert len(passes) < len(lengths) / 2


def _corpus_lengths(kind: str, seed: int = 46) -> list[int]:
    """Lengths shaped like the benches' corpora: `short` prose paragraphs (3-193 tokens, most
    under 64), `medium` paragraphs (40-330), a `long_tail` (8-2,000, log-uniform)."""
    rng = random.Random(seed)
    if kind == "short":
        return [max(3, min(193, round(rng.lognormvariate(3.8, 0.8)))) for _ in range(122)]
    if kind == "medium":
        return [rng.randrange(40, 331) for _ in range(96)]
    return [round(2 ** rng.uniform(3, 11)) for _ in range(96)]


# smollm2-135m's shapes, by hand from its config: per block q and o (576 x 576), k and v
# (576 x 192), the MLP's three 576 x 1536; quartile layers run 23 of its 30 blocks.
SMOLLM2_BLOCK_PARAMS = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
SMOLLM2_HIDDEN, BLOCKS_RUN = 576, 23


@pytest.mark.parametrize("kind", ["short", "medium", "long_tail"])
def test_rows_are_planned_for_the_lengths_at_hand(kind):
    """Of the row lengths, the one whose passes cost least: each candidate's passes priced here
    in float64 from the shapes (2 FLOPs a parameter a token, 4 x hidden a query-key pair of a
    row, per block run) at the CPU's rate plus its cost a pass, the cheapest against the
    planner's choice; and shards of another kind of text get other rows."""
    lengths = _corpus_lengths(kind)[:32]  # one shard, as `shard_size` cuts them by default
    flops_per_s, pass_s = DEVICE_RATES["cpu"]
    cost = PassCost.of_model(SMOLLM2_BLOCK_PARAMS, SMOLLM2_HIDDEN, BLOCKS_RUN, "cpu")

    def priced(row_tokens: int) -> float:
        total = np.float64(0)
        for p in plan_passes(lengths, row_tokens=row_tokens, batch_tokens=16384):
            tokens = np.float64(len(p.rows) * p.width)
            flops = tokens * 2 * SMOLLM2_BLOCK_PARAMS * BLOCKS_RUN + tokens * p.width * 4 * SMOLLM2_HIDDEN * BLOCKS_RUN
            total += flops / flops_per_s + pass_s
        return float(total)

    cheapest = min(ROW_CANDIDATES, key=lambda r: (priced(r), r))
    chosen = plan_for(lengths, cost, batch_tokens=16384)
    assert chosen == plan_passes(lengths, row_tokens=cheapest, batch_tokens=16384)
    assert sorted(i for p in chosen for i in p.prompts) == list(range(len(lengths)))
    # A fixed row length is kept as given.
    assert plan_for(lengths, cost, batch_tokens=16384, row_tokens=128) == plan_passes(lengths, row_tokens=128, batch_tokens=16384)


def test_short_and_long_prompts_get_rows_of_their_own_size():
    """Not one constant: short prose packs into rows longer than its prompts; prompts of a few
    hundred tokens get rows that hold several of them, not one each."""
    cost = PassCost.of_model(SMOLLM2_BLOCK_PARAMS, SMOLLM2_HIDDEN, BLOCKS_RUN, "cpu")

    def widest(lengths: list[int]) -> int:
        return max(p.width for p in plan_for(lengths, cost, batch_tokens=16384))

    short, medium = _corpus_lengths("short")[:32], _corpus_lengths("medium")[:32]
    assert widest(short) < widest(medium)
    assert len(plan_for(medium, cost, batch_tokens=16384)) < len(plan_passes(medium, row_tokens=128, batch_tokens=16384))


def test_packed_inputs_place_each_prompt_with_positions_from_zero():
    prompts = [[5] * n for n in (3, 1, 4, 2, 7)]
    plan = plan_passes([len(p) for p in prompts], row_tokens=8, batch_tokens=64)[0]
    ids, positions, places = packed_inputs(prompts, plan)
    assert sorted(i for i, _, _ in places) == sorted(plan.prompts)
    for index, row, column in places:
        n = len(prompts[index])
        assert positions[row, column : column + n].tolist() == list(range(n))
        assert ids[row, column : column + n].tolist() == prompts[index]


class TokensRun:
    """Every forward pass's `[rows, width]`, as the model received it (a pre-hook, removed on exit)."""

    def __init__(self, hf_model):
        self.shapes: list[tuple[int, int]] = []
        self.handle = hf_model.model.register_forward_pre_hook(
            lambda _m, _a, kwargs: self.shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)

    @property
    def total(self) -> int:
        return sum(rows * width for rows, width in self.shapes)

    def __enter__(self) -> "TokensRun":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


@contextmanager
def engine_bounds(engine, *, batch_tokens: int, row_tokens: int):
    """The (session's) engine with these token bounds, as its maker hands them, for one block."""
    from harvest.engines.limits import EngineLimits

    before = engine.limits
    engine.limits = EngineLimits(batch_tokens=batch_tokens, row_tokens=row_tokens)
    try:
        yield
    finally:
        engine.limits = before


def test_each_prompt_equals_its_own_forward_pass_from_1_to_max_model_len(hf_engine, tiny):
    assert tiny.max_model_len == MAX_LEN
    rng = random.Random(5)
    lengths = _spread(40, 1)
    prompts = [[rng.randrange(3, hf_engine.hf_model.config.vocab_size) for _ in range(n)] for n in lengths]
    layers = [0, 3, 7]
    with TokensRun(hf_engine.hf_model) as log:
        capture = hf_engine.capture(prompts, CaptureSpec(layers=layers))
    # The model ran the prompts' tokens and the reported filler, nothing else.
    assert log.total == sum(lengths) + capture.padded_tokens
    assert capture.padded_tokens <= PAD_BUDGET * sum(lengths)
    assert len(log.shapes) < len(prompts)  # prompts shared passes
    for ids, value in zip(prompts, capture.values, strict=True):
        reference = hf_reference_layers(hf_engine.hf_model, ids, layers)
        assert value.shape == reference.shape
        assert np.all(np.abs(value.float().numpy() - reference) <= 2 * bf16_tolerance(reference)), len(ids)


def test_a_job_reports_real_and_padded_tokens_and_its_files_hold_each_prompt_alone(registry, hf_engine, tiny):
    rng = random.Random(11)
    words = "the of and a to in is you that it he was for on are as with his they at be this".split()
    # From one word to past max_model_len (truncated to it), as paragraphs of prose vary.
    texts = [" ".join(rng.choice(words) for _ in range(n)) for n in (1, 2, 3, 5, 9, 30, 80, 200, 511, 700, 1500, 3000)]
    rng.shuffle(texts)
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=texts, layers=[1, 6], shard_size=5, add_special_tokens=False), registry)
    storage = Storage("memory:///tests/packing-job")
    storage.delete_all()
    with TokensRun(hf_engine.hf_model) as log:
        run_job(job, storage, hf_engine, "job-packing")
    manifest = json.loads(storage.read_bytes(MANIFEST))
    tokenizer = load_tokenizer(tiny.path)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:MAX_LEN] for t in texts]
    assert min(map(len, ids)) == 1 and max(map(len, ids)) == MAX_LEN
    timings = manifest["timings"]
    assert timings["real_tokens"] == sum(map(len, ids))
    assert timings["real_tokens"] + timings["padded_tokens"] == log.total
    assert timings["padded_tokens"] <= PAD_BUDGET * timings["real_tokens"]
    for shard in manifest["shards"]:
        tensors = load_tensors(storage.read_bytes(shard["file"]))
        first, last = shard["prompt_range"]
        for i in range(first, last + 1):
            reference = hf_reference_layers(hf_engine.hf_model, ids[i], [1, 6])
            got = tensors[f"prompt_{i}"].float().numpy()
            assert got.shape == reference.shape
            assert np.all(np.abs(got - reference) <= 2 * bf16_tolerance(reference))


def test_a_forward_pass_stays_within_batch_tokens_with_rows_of_many_prompts(hf_engine, tiny, monkeypatch):
    lengths = [1, 7, 30, 99, 100, 150, 299, 301, 12, 45, 60, 2]
    prompts = [[4 + (i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]
    with engine_bounds(hf_engine, batch_tokens=300, row_tokens=100), TokensRun(hf_engine.hf_model) as log:
        capture = hf_engine.capture(prompts, CaptureSpec(layers=[2]))
    # Only a prompt longer than the bound runs a longer pass, alone; the short ones share rows.
    assert all(rows * width <= 300 or (rows == 1 and width == 301) for rows, width in log.shapes), log.shapes
    assert sum(rows for rows, _ in log.shapes) < len(prompts)
    assert sum(rows * width for rows, width in log.shapes) == sum(lengths) + capture.padded_tokens
    assert max(width for _, width in log.shapes) == 301
    for ids, value in zip(prompts, capture.values, strict=True):
        reference = hf_reference_layers(hf_engine.hf_model, ids, [2])
        assert np.all(np.abs(value.float().numpy() - reference) <= 2 * bf16_tolerance(reference))
    assert torch.is_tensor(capture.values[0])


def test_inline_prefill_runs_packed_and_each_completion_is_the_prompts_own(hf_engine, tiny):
    from harvest.engines.base import SamplingSpec

    rng = random.Random(8)
    vocab = hf_engine.hf_model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 3, 40, 300, 700, 9)]
    greedy = [SamplingSpec(max_tokens=4, temperature=0)] * len(prompts)
    with TokensRun(hf_engine.hf_model) as log:
        together = hf_engine.generate(prompts, greedy, [0, 7])
    prefill = [shape for shape in log.shapes if shape[1] > 1]
    padded = together[0].extra["prefill_padded_tokens"]
    # The prefill ran the prompts' tokens (and the reported filler), never rows padded to 700.
    assert sum(rows * width for rows, width in prefill) == sum(map(len, prompts)) + padded
    assert padded <= PAD_BUDGET * sum(map(len, prompts))
    for prompt, got in zip(prompts, together, strict=True):
        alone = hf_engine.generate([prompt], greedy[:1], [0, 7])[0]
        assert got.token_ids == alone.token_ids
        ran = prompt + got.token_ids[:-1]
        reference = hf_reference_layers(hf_engine.hf_model, ran, [0, 7])
        assert got.residual.shape == reference.shape
        assert np.all(np.abs(got.residual.float().numpy() - reference) <= 2 * bf16_tolerance(reference)), len(prompt)


def test_co_batched_shards_share_the_filler_that_ran(hf_engine, monkeypatch):
    rng = random.Random(4)
    shards = [[[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
              for lengths in ([99, 97, 3, 60, 41], [98, 95, 2, 57, 30, 12])]
    with engine_bounds(hf_engine, batch_tokens=400, row_tokens=100), TokensRun(hf_engine.hf_model) as log:
        answers = hf_engine.capture_cobatch(shards, CaptureSpec(layers=[1]))
    real = sum(len(p) for shard in shards for p in shard)
    assert sum(a.padded_tokens for a in answers) == log.total - real
    assert all(a.padded_tokens >= 0 for a in answers)
