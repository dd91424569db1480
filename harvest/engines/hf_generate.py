"""Batched generation on the HF reference engine, capturing the residual stream as it runs.

The prompts of a call are prefilled packed, not padded (`harvest.engines.hf_prefill`: rows of
whole prompts, each attending to itself), which leaves one left-padded row per prompt in the KV
cache; then one forward pass per generated token for the rows still generating (a finished row
leaves the batch and its KV cache, so one long request does not drag the short ones' rows
through every later step). Left padding keeps every row's newest token in the last column,
so each decode step feeds one column; `position_ids` are counted from each row's first real
token, so a row sees the same positions (and, up to float rounding, the same values) as it
would alone. (A decode step still attends over the cache's padding columns, masked: a few
products per row and step, against the prefill's whole blocks.)

Capture uses `block_hooks(..., stop_after_last=False)` on the requested blocks only, for the
prefill and every decode step: a row's residual stream is its prompt positions from the
prefill, then one position per generated token that was fed back. The last sampled token is
never run, so a row has `n_prompt + n_generated - 1` positions, and no forward pass is spent
on it. Layer k is block k's output, before the final norm.

Sampling follows the OpenAI completions semantics the API promises: temperature 0 is greedy
(argmax, lowest id on a tie); otherwise softmax(logits / T), restricted to the top-p nucleus,
drawn with a per-request `torch.Generator` seeded from `seed`, so the same seed on the same
engine gives the same draw whatever else is in the batch (up to float rounding of the
logits). Logprobs are those of the model's own distribution (before temperature and top-p),
as vLLM reports them. Generation stops at max_tokens ("length"), at an EOS token ("stop";
the EOS id is kept in `token_ids`, left out of the text) or at a stop string ("stop"; the
text ends before it, `token_ids` end with the token that completed it, since that token was
sampled and the positions before it ran).

Cost. The KV cache grows in place (`GrowingLayer`: storage doubled when full, each step's keys
written into it), so a step copies only its own keys: transformers' `DynamicCache` concatenates
the whole cache into a fresh tensor at every step of every layer, which made decoding quadratic
in the generated length (2,047 tokens of llama-tiny: ~33 of 71 s in `torch.cat` on a 2-core box
at load ~5). On the CPU the decode runs with ONE intra-op thread, at a lower priority (nice
`DECODE_NICE`) for its thread: a decode step is a few small matrix-vector products that a
second thread barely speeds up, and on a shared host every op's thread barrier waits for
whichever thread was descheduled (measured under load 10-17 on 2 cores: 384 tokens took 13-14 s
with one thread, 67-110 s with two). The lower priority keeps the API's event loop (the
control path: submits, reads, long-polls) ahead of a long generation on a contended CPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from harvest.capture import block_hooks, check_capture
from harvest.cpu_share import lower_thread
from harvest.engines.base import Generation, SamplingSpec
from harvest.engines.hf_prefill import packed_prefill
from harvest.errors import CaptureFailed, InvalidRequest
from harvest.tokenize import load_tokenizer

__all__ = ["hf_generate", "GrowingLayer", "growing_cache", "DECODE_NICE"]

DECODE_NICE = 10
"""Niceness of a thread decoding on the CPU: below the API's control path."""


class GrowingLayer(DynamicLayer):
    """One layer's KV cache in storage that doubles when full: `keys`/`values` are views of
    the filled part, so a step writes its own keys and copies nothing else (amortised O(1)
    per token instead of `DynamicLayer`'s whole-cache concatenation)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.filled = 0
        self.key_store = self.value_store = None
        self.grown = 0  # storage allocations so far (a test reads it)

    def _reserve(self, rows: int, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        capacity = 0 if self.key_store is None else self.key_store.shape[-2]
        if self.key_store is not None and needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, 64)
        keys = like_k.new_empty((rows, like_k.shape[1], capacity, like_k.shape[3]))
        values = like_v.new_empty((rows, like_v.shape[1], capacity, like_v.shape[3]))
        if self.filled:
            keys[..., : self.filled, :] = self.keys
            values[..., : self.filled, :] = self.values
        self.key_store, self.value_store = keys, values
        self.grown += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        self._reserve(key_states.shape[0], end, key_states, value_states)
        self.key_store[..., self.filled : end, :] = key_states
        self.value_store[..., self.filled : end, :] = value_states
        self.filled = end
        self.keys = self.key_store[..., :end, :]
        self.values = self.value_store[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows at `indices` (a finished row leaves): one copy of the filled part."""
        if self.get_seq_length() > 0:
            self.key_store = self.keys[indices].contiguous()
            self.value_store = self.values[indices].contiguous()
            self.keys, self.values = self.key_store, self.value_store
            self.grown += 1

    def crop(self, tokens_to_remove: int) -> None:  # never used by decoding; kept consistent
        super().crop(tokens_to_remove)
        self.filled = self.keys.shape[-2] if self.is_initialized and self.keys is not None else 0

    def reset(self) -> None:
        super().reset()
        self.filled = 0
        self.key_store = self.value_store = None


def growing_cache(config) -> DynamicCache:
    """A `DynamicCache` whose attention layers are `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class _DecodeThreads:
    """torch's intra-op thread count is the process's, not a thread's: one intra-op thread
    while any CPU decode of this process runs, the count it had back when the last one ends
    (each decode restoring its own would hand the others two threads mid-decode)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._before = 0

    @contextmanager
    def one(self):
        with self._lock:
            if self._running == 0:
                self._before = torch.get_num_threads()
                torch.set_num_threads(1)
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    torch.set_num_threads(self._before)


_DECODES = _DecodeThreads()


@contextmanager
def _cpu_share(device: torch.device):
    """On the CPU: one intra-op thread while the call runs (`_DecodeThreads`), and a lower
    priority for this thread (kept: the thread is an engine's, and raising it back needs
    privileges)."""
    if device.type != "cpu":
        yield
        return
    lower_thread(DECODE_NICE)  # where it cannot be lowered, the thread count still helps
    with _DECODES.one():
        yield


@dataclass
class _Row:
    """One prompt's generation state."""

    spec: SamplingSpec
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _eos_ids(hf_model) -> set[int]:
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = hf_model.config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _generator(spec: SamplingSpec) -> torch.Generator | None:
    if spec.temperature == 0:
        return None
    generator = torch.Generator(device="cpu")
    if spec.seed is None:
        generator.seed()  # a fresh non-deterministic seed
    else:
        generator.manual_seed(spec.seed)
    return generator


def _sample(logits: torch.Tensor, row: _Row) -> int:
    """Draw one token id from a row's float32 logits `[vocab]`."""
    spec = row.spec
    if spec.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / spec.temperature, dim=-1).cpu()
    if not bool(torch.isfinite(probs).all()):
        # A temperature so small (a legal 1e-320) that the division overflows: its limit, greedy.
        return int(torch.argmax(logits))
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays:
        # a top_p below float32's smallest value, 5e-324 say, compares as 0 and kept nothing).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < spec.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=row.generator))


def _record_logprobs(row: _Row, logits: torch.Tensor, token: int, tokenizer) -> None:
    logprobs = torch.log_softmax(logits, dim=-1)
    row.token_logprobs.append(float(logprobs[token]))
    top: dict[str, float] = {}
    if row.spec.logprobs:
        values, ids = torch.topk(logprobs, row.spec.logprobs)
        top = {tokenizer.decode([int(i)]): float(v) for v, i in zip(values, ids)}
    # The sampled token is always listed, as vLLM does, even when it is outside the top k.
    top.setdefault(tokenizer.decode([token]), float(logprobs[token]))
    row.top_logprobs.append(top)


def _advance(row: _Row, token: int, eos_ids: set[int], tokenizer) -> None:
    """Append a sampled token and decide whether the row is finished."""
    row.ids.append(token)
    if row.spec.stop:  # decoding every step is only needed to find stop strings
        row.text = tokenizer.decode(row.ids, skip_special_tokens=True)
        hits = [i for i in (row.text.find(s) for s in row.spec.stop if s) if i >= 0]
        if hits:
            row.text = row.text[: min(hits)]
            row.finish_reason = "stop"
            return
    if token in eos_ids:
        row.finish_reason = "stop"
    elif len(row.ids) >= row.spec.max_tokens:
        row.finish_reason = "length"
    if row.done and not row.spec.stop:
        row.text = tokenizer.decode(row.ids, skip_special_tokens=True)


@torch.inference_mode()
def hf_generate(engine, prompts: list[list[int]], sampling: list[SamplingSpec], layers: list[int] | None) -> list[Generation]:
    """Complete every prompt in one batch; capture `layers` over every position that ran."""
    if len(prompts) != len(sampling):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling specs")
    if not prompts:
        return []
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise InvalidRequest(f"Prompt {index} is empty: a completion needs at least one token.", param="prompt")
    for spec in sampling:
        if spec.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1.", param="max_tokens")
    hf_model = engine.hf_model
    device = engine.device
    tokenizer = load_tokenizer(engine.model.require_path())
    eos_ids = _eos_ids(hf_model)
    layers = sorted(set(layers)) if layers else None

    batch = len(prompts)
    cache = growing_cache(hf_model.config)
    rows = [_Row(spec=spec, generator=_generator(spec)) for spec in sampling]
    # Per decode step: [L, rows in that step, hidden] bf16, and each row's column in it.
    steps: list[tuple[torch.Tensor, dict[int, int]]] = []
    running = list(range(batch))  # the original row of each row of the current batch

    hooks = block_hooks(engine.blocks, layers, stop_after_last=False) if layers else nullcontext({})
    with _cpu_share(device), hooks as captured:
        prefilled = packed_prefill(hf_model, prompts, engine.passes([len(p) for p in prompts]), cache, captured, layers)
        attention_mask, position_ids = prefilled.attention_mask, prefilled.position_ids
        logits = prefilled.logits
        forward_passes = prefilled.passes
        while True:
            next_tokens = []
            for i, r in enumerate(running):
                row = rows[r]
                token = _sample(logits[i], row)
                if row.spec.logprobs is not None:
                    _record_logprobs(row, logits[i], token, tokenizer)
                _advance(row, token, eos_ids, tokenizer)
                next_tokens.append(token)
            keep = [i for i, r in enumerate(running) if not rows[r].done]
            if not keep:
                break  # the tokens just sampled never run: they have no residual stream
            if len(keep) < len(running):
                # Finished rows leave the batch (and the KV cache), so a long generation does
                # not drag the short ones' rows through every later step.
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention_mask, position_ids = attention_mask[index], position_ids[index]
                running = [running[i] for i in keep]
                next_tokens = [next_tokens[i] for i in keep]
            input_ids = torch.tensor(next_tokens, dtype=torch.long, device=device).view(-1, 1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
            captured.clear()
            out = hf_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the newest position's logits are ever read
            )
            forward_passes += 1
            if layers:
                check_capture(captured, layers, tuple(input_ids.shape))
                stacked = torch.stack([captured[layer].to(torch.bfloat16) for layer in layers])
                steps.append((stacked[:, :, 0], {r: i for i, r in enumerate(running)}))
            logits = out.logits[:, -1].float()

    generations = []
    for r, (prompt, row) in enumerate(zip(prompts, rows)):
        residual = None
        if layers:
            parts = [prefilled.residual[r]]
            # A row is in every decode step until it finishes: steps 0 .. n_generated - 2.
            parts += [step[:, columns[r] : columns[r] + 1] for step, columns in steps[: len(row.ids) - 1]]
            residual = torch.cat(parts, dim=1).cpu()
            expected = (len(layers), len(prompt) + len(row.ids) - 1, engine.model.hidden_size)
            if tuple(residual.shape) != expected:  # never hand back a short tensor
                raise CaptureFailed(f"The capture has shape {list(residual.shape)}, expected {list(expected)}.")
        generations.append(
            Generation(
                prompt_ids=list(prompt),
                token_ids=row.ids,
                text=row.text,
                finish_reason=row.finish_reason,
                token_logprobs=row.token_logprobs if row.spec.logprobs is not None else None,
                top_logprobs=row.top_logprobs if row.spec.logprobs is not None else None,
                residual=residual,
                extra={"forward_passes": forward_passes, "batch_size": batch, "prefill_padded_tokens": prefilled.padded_tokens},
            )
        )
    return generations
