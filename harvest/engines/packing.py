"""How the HF engine lays prompts out in its forward passes: packed rows, no padding.

Real text varies in length (a corpus of paragraphs runs from 1 to a few hundred tokens), and
a batch padded to its longest prompt spends compute on tokens that belong to no prompt: on a
2-core CPU one padded batch per 32-prompt shard made `harvest run` of prose run at 0.61x a
bare forward of the same prompts in length-sorted batches (issue 34; what packing does
instead: bench/RESULTS.md, "Against the peers"). So prompts are *packed*:
a row holds several whole prompts one after another, each with its own positions counted
from 0, and transformers turns positions that restart into a block-diagonal causal mask
(`masking_utils.find_packed_sequence_indices`), so a prompt attends to itself only and its
values equal those of its own single-prompt forward pass (checked in tests/test_packing.py).

- Rows are filled best-fit, longest prompt first, up to `row_tokens`; a prompt longer than
  that is a row of its own. A row's attention is computed over the whole row (the mask only
  hides the other prompts), so a longer row spends more on attention that the mask discards;
  a shorter one leaves more prompts in rows of their own, of ragged widths, in more and
  smaller passes, each with its fixed cost. So the row length is planned for the prompts at
  hand (`plan_for`): of `ROW_CANDIDATES`, the one whose passes cost least by `PassCost`, the
  model's FLOPs at the device's rate plus a fixed cost per pass (fitted on the CPU:
  bench/RESULTS.md, "Rows planned per corpus"). `HARVEST_ENGINE_ROW_TOKENS` fixes it instead.
- A forward pass takes rows of the same width, by construction or within `PAD_BUDGET`: the
  rows are sorted by length and a row joins a pass only while the pass's filler (the tail of
  each row shorter than the longest) stays within the budget. A pass of one row has no filler
  at all.

Filler tokens carry positions of their own, so they form one more packed sequence that no
prompt attends to; they are counted, and every job reports them (`padded_tokens`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

__all__ = ["PAD_BUDGET", "ROW_CANDIDATES", "DEVICE_RATES", "Pass", "PassCost", "plan_passes", "plan_for", "packed_inputs", "segments"]

PAD_BUDGET = 1 / 64
"""The most filler a forward pass of several rows may hold, as a share of its tokens."""


@dataclass(frozen=True)
class Pass:
    """One forward pass: rows of prompt indices, each row's prompts back to back."""

    rows: tuple[tuple[int, ...], ...]
    width: int
    """Tokens per row: the longest row's."""
    real_tokens: int
    """Tokens that belong to prompts."""

    @property
    def padded_tokens(self) -> int:
        """Filler tokens run: rows shorter than `width` are filled up to it."""
        return len(self.rows) * self.width - self.real_tokens

    @property
    def prompts(self) -> list[int]:
        return [i for row in self.rows for i in row]


def _rows(lengths: list[int], row_tokens: int, max_prompts: int | None) -> list[list[int]]:
    """Best-fit decreasing: each prompt, longest first, goes into the row it fills most
    closely (found by bisecting a sorted list of the rows' room: ~10 ms for 4,096 prompts)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row index), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        at = bisect.bisect_left(room, (length, -1))
        if at < len(room):
            left, row = room.pop(at)
            rows[row].append(index)
            if max_prompts is None or len(rows[row]) < max_prompts:
                bisect.insort(room, (left - length, row))
            continue
        rows.append([index])
        if length < row_tokens and (max_prompts is None or max_prompts > 1):
            bisect.insort(room, (row_tokens - length, len(rows) - 1))
    return rows


def plan_passes(lengths: list[int], *, row_tokens: int, batch_tokens: int, max_prompts: int | None = None) -> list[Pass]:
    """The forward passes that run every prompt once: packed rows of at most `row_tokens`
    (a longer prompt alone), at most `batch_tokens` tokens a pass counting filler (a longer
    row alone), at most `max_prompts` prompts a pass (a request's `batch_size`), and filler
    within `PAD_BUDGET` of a pass."""
    row_tokens = max(1, min(row_tokens, batch_tokens))
    rows = _rows(lengths, row_tokens, max_prompts)
    used = [sum(lengths[i] for i in row) for row in rows]
    passes: list[Pass] = []
    current: list[int] = []  # row indices, widest first
    real = n_prompts = 0

    def close() -> None:
        nonlocal current, real, n_prompts
        if current:
            passes.append(Pass(tuple(tuple(rows[r]) for r in current), used[current[0]], real))
        current, real, n_prompts = [], 0, 0

    for r in sorted(range(len(rows)), key=lambda r: (-used[r], r)):
        if current:
            width = used[current[0]]
            n_rows = len(current) + 1
            filler = n_rows * width - (real + used[r])
            if (n_rows * width > batch_tokens or filler > PAD_BUDGET * n_rows * width
                    or (max_prompts is not None and n_prompts + len(rows[r]) > max_prompts)):
                close()
        current.append(r)
        real += used[r]
        n_prompts += len(rows[r])
    close()
    return passes


ROW_CANDIDATES = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
"""Row lengths `plan_for` weighs."""


@dataclass(frozen=True)
class PassCost:
    """What one forward pass of packed rows costs, in seconds, on one model and device: its
    FLOPs at the device's rate, plus a fixed cost per pass (launching, masks, hooks)."""

    token_flops: float
    """Per token: the matrix products of the blocks run (2 × their parameters)."""
    pair_flops: float
    """Per query-key pair of a row, masked or not: scores and their weighted sum, 4 × hidden
    per block run."""
    flops_per_s: float
    pass_s: float

    @classmethod
    def of_model(cls, params_per_block: int, hidden: int, blocks_run: int, device: str) -> "PassCost":
        flops_per_s, pass_s = DEVICE_RATES.get(device, DEVICE_RATES["cpu"])
        return cls(2.0 * params_per_block * blocks_run, 4.0 * hidden * blocks_run, flops_per_s, pass_s)

    def seconds(self, plan: Pass) -> float:
        tokens = len(plan.rows) * plan.width
        return (tokens * self.token_flops + tokens * plan.width * self.pair_flops) / self.flops_per_s + self.pass_s


DEVICE_RATES: dict[str, tuple[float, float]] = {
    # Fitted by least squares to the HF engine's times on three corpora at five row lengths
    # (smollm2-135m, 2-core dev box): 1.05 ms a token, 69 ms a pass, and attention's share
    # within 15 % of the FLOPs' (bench/RESULTS.md, "Rows planned per corpus").
    "cpu": (155e9, 0.069),
    # Not measured yet (no GPU lent; issue 46 item 6): a bf16 H100's sustained rate and a
    # few milliseconds of kernel launches a pass.
    "cuda": (400e12, 0.004),
}
"""Per device type: sustained FLOPs a second, seconds of fixed cost per pass."""


def plan_for(lengths: list[int], cost: PassCost, *, batch_tokens: int, max_prompts: int | None = None,
             row_tokens: int | None = None) -> list[Pass]:
    """The passes for prompts of these lengths at the row length, of `ROW_CANDIDATES` (or
    `row_tokens` alone, when fixed), whose passes `cost` least; the shortest of equals."""
    best: tuple[float, list[Pass]] | None = None
    for candidate in (row_tokens,) if row_tokens else ROW_CANDIDATES:
        passes = plan_passes(lengths, row_tokens=candidate, batch_tokens=batch_tokens, max_prompts=max_prompts)
        seconds = sum(cost.seconds(p) for p in passes)
        if best is None or seconds < best[0]:
            best = (seconds, passes)
    return best[1] if best else []


def packed_inputs(prompts: list[list[int]], plan: Pass) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """Input ids and position ids `[rows, width]` for one pass, and where each prompt lies:
    (prompt index, row, first column). Each prompt's positions start at 0; a row's filler
    gets positions 0, 1, … of its own, so it is one more sequence no prompt attends to."""
    input_ids = torch.zeros(len(plan.rows), plan.width, dtype=torch.long)
    positions = torch.zeros(len(plan.rows), plan.width, dtype=torch.long)
    places = []
    for r, row in enumerate(plan.rows):
        column = 0
        for index in row:
            n = len(prompts[index])
            input_ids[r, column : column + n] = torch.tensor(prompts[index], dtype=torch.long)
            positions[r, column : column + n] = torch.arange(n)
            places.append((index, r, column))
            column += n
        positions[r, column:] = torch.arange(plan.width - column)
    return input_ids, positions, places


def segments(positions: torch.Tensor) -> torch.Tensor:
    """Which packed sequence each token of `[rows, width]` positions belongs to (0, 1, … per
    row): a sequence starts wherever the positions do not count up by one (`packed_inputs`
    restarts them at 0 for each prompt and for a row's filler), as transformers reads them."""
    return (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
