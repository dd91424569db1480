"""The Hugging Face transformers engine: the numerical reference (`HARVEST_ENGINE=hf`; `auto` on the CPU).

Prompts are sorted by length and run in right-padded batches, so padding only ever sits
after a prompt's real tokens: with a causal mask it cannot change them, and each prompt's
activations are sliced to its own length before anything else sees them. A batch holds at
most `batch_size` prompts (the request's hint) and never more padded tokens than
`HARVEST_ENGINE_BATCH_TOKENS`, nor more captured values than `HARVEST_ENGINE_PIECE_BYTES`
(a longer prompt runs alone): memory follows the settings, not the request. Each batch's
values go to the shard's sink (`harvest.engines.base.ValueSink`) before the next batch runs
(on a GPU: once the next batch is queued, so the two overlap; two batches' values at most). Forward hooks sit on
the requested blocks only, and the forward pass stops after the deepest of them. On the CPU
the model runs in float32; on a GPU in the checkpoint's dtype.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from harvest.capture import CaptureSpec, Landing, PromptReducer, ShardCapture, StopForward, block_hooks, check_capture
from harvest.engines.base import Engine, ValueSink, tokens_per_piece
from harvest.registry import ModelInfo
from harvest.settings import get_settings

__all__ = ["HFEngine", "load_hf_model", "right_padded"]


def load_hf_model(model: ModelInfo, device: torch.device | None = None):
    """Load the checkpoint with the standard HF code: float32 on CPU, its own dtype on GPU."""
    from transformers import AutoModelForCausalLM

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device.type == "cpu" else "auto"
    hf_model = AutoModelForCausalLM.from_pretrained(model.require_path(), dtype=dtype)
    return hf_model.to(device).eval()


def right_padded(prompts: list[list[int]], batch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask `[len(batch), longest]` for the prompts at `batch`, padded on the right."""
    width = max(len(prompts[i]) for i in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, index in enumerate(batch):
        input_ids[row, : len(prompts[index])] = torch.tensor(prompts[index])
        attention_mask[row, : len(prompts[index])] = 1
    return input_ids, attention_mask


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model: ModelInfo, device: torch.device | None = None):
        self.model = model
        self.hf_model = load_hf_model(model, device)
        self.device = next(self.hf_model.parameters()).device

    @property
    def blocks(self):
        return self.hf_model.model.layers

    def _batches(self, lengths: list[int], batch_size: int | None, max_tokens: int | None = None) -> list[list[int]]:
        """Prompt indices grouped by length (shortest first): at most `batch_size` prompts and
        `max_tokens` (default `HARVEST_ENGINE_BATCH_TOKENS`) padded tokens per batch; one
        prompt longer than that runs alone."""
        max_tokens = max_tokens or get_settings().engine_batch_tokens
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        batches: list[list[int]] = []
        current: list[int] = []
        for index in order:
            rows = len(current) + 1
            too_many = batch_size is not None and rows > batch_size
            too_big = current and rows * lengths[index] > max_tokens  # sorted: this one is the longest
            if too_many or too_big:
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
        return batches

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None,
                sink: ValueSink | None = None) -> ShardCapture:
        return self.capture_cobatch([prompts], spec, batch_size=batch_size, sinks=[sink])[0]

    @torch.inference_mode()
    def capture_cobatch(self, shards: list[list[list[int]]], spec: CaptureSpec, *, batch_size: int | None = None,
                        sinks: list[ValueSink | None] | None = None) -> list[ShardCapture]:
        """Every shard's prompts in one set of length-sorted batches; a reducer per shard."""
        started = time.perf_counter()
        sinks = sinks or [None] * len(shards)
        reducers = [PromptReducer(spec, self.model.hidden_size, self.device) for _ in shards]
        prompts = [p for shard in shards for p in shard]
        owner = [k for k, shard in enumerate(shards) for _ in shard]
        position = [p for shard in shards for p in range(len(shard))]
        values: list[torch.Tensor | None] = [None] * len(prompts)
        lengths = [len(p) for p in prompts]
        max_tokens = min(get_settings().engine_batch_tokens, tokens_per_piece(spec, self.model.hidden_size))

        def hand_out(batch_values: list[tuple[int, torch.Tensor]], landing: Landing) -> None:
            landing.wait()
            for index, value in batch_values:
                sink = sinks[owner[index]]
                if sink is None:
                    values[index] = value
                else:
                    sink(position[index], value)

        # On a GPU a batch's values are handed on after the next batch's forward pass is
        # queued, so the host's work (the sink's write) overlaps the device's; at most two
        # batches' values are held. On the CPU nothing runs in the background: at once.
        lag = 1 if self.device.type == "cuda" else 0
        pending: deque[tuple[list[tuple[int, torch.Tensor]], Landing]] = deque()
        for batch in self._batches(lengths, batch_size, max_tokens):
            input_ids, attention_mask = right_padded(prompts, batch)
            with block_hooks(self.blocks, spec.layers) as captured:
                try:
                    self.hf_model.model(
                        input_ids=input_ids.to(self.device),
                        attention_mask=attention_mask.to(self.device),
                        use_cache=False,
                    )
                except StopForward:
                    pass
            check_capture(captured, spec.layers, tuple(input_ids.shape))
            batch_values = []
            for row, index in enumerate(batch):
                # One prompt's layers at a time: never a second copy of the whole batch.
                acts = torch.stack([captured[layer][row, : lengths[index]] for layer in spec.layers])  # [L, seq, hidden]
                batch_values.append((index, reducers[owner[index]].reduce(acts)))
                del acts
            del captured
            pending.append((batch_values, Landing(self.device)))
            while len(pending) > lag:
                hand_out(*pending.popleft())
        while pending:
            hand_out(*pending.popleft())
        answers, first = [], 0
        for reducer, shard, sink in zip(reducers, shards, sinks, strict=True):
            answers.append(reducer.finish([] if sink is not None else values[first : first + len(shard)], started))
            first += len(shard)
        return answers

    def generate(self, prompts, sampling, layers):
        from harvest.engines.hf_generate import hf_generate  # batched decoding lives in its own module

        return hf_generate(self, prompts, sampling, layers)

    def versions(self) -> dict[str, str]:
        import transformers

        return {"engine": self.name, "torch": torch.__version__, "transformers": transformers.__version__}

    def close(self) -> None:
        del self.hf_model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
