"""The Hugging Face transformers engine: the numerical reference (`HARVEST_ENGINE=hf`; `auto` on the CPU).

Prompts are packed, never padded to each other: a forward pass runs rows of whole prompts
back to back, each prompt with its own positions and a mask that keeps it to itself, its
sliding window included (`harvest.engines.packing`, `harvest.engines.hf_model`), so no
compute goes to filler (a pass of several rows keeps its filler within `PAD_BUDGET`) and each
prompt's activations equal its own forward pass's, in every family. A pass
holds at most `batch_size` prompts (the request's hint), never more tokens than
`HARVEST_ENGINE_BATCH_TOKENS`, nor more captured values than `HARVEST_ENGINE_PIECE_BYTES`
(a longer prompt runs alone): memory follows the settings, not the request. Each pass's
values go to the shard's sink (`harvest.engines.base.ValueSink`) before the next pass runs
(on a GPU: once the next pass is queued, so the two overlap; two passes' values at most). Forward hooks sit on
the requested blocks only (wherever the family keeps them: `harvest.engines.hf_model`), and
the forward pass stops after the deepest of them. On the CPU the model runs in float32; on a
GPU in the checkpoint's dtype.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from harvest.capture import Landing, PromptReducer, ShardCapture, StopForward, block_hooks, check_capture
from harvest.capture_spec import CaptureSpec
from harvest.engines.base import Engine, ValueSink
from harvest.engines.limits import EngineLimits
from harvest.engines.hf_model import decoder, decoder_blocks, packed_attention_mask
from harvest.engines.packing import Pass, PassCost, packed_inputs, plan_for
from harvest.errors import ModelUnavailable
from harvest.registry import ModelInfo

__all__ = ["HFEngine", "load_hf_model", "check_packable"]


def load_hf_model(model: ModelInfo, device: torch.device | None = None):
    """Load the checkpoint with the standard HF code: float32 on CPU, its own dtype on GPU."""
    from transformers import AutoModelForCausalLM

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device.type == "cpu" else "auto"
    hf_model = AutoModelForCausalLM.from_pretrained(model.require_path(), dtype=dtype)
    return hf_model.to(device).eval()


def check_packable(hf_model, name: str) -> None:
    """Refuse an attention implementation that would not take the packed passes' 4-D masks
    (`harvest.engines.hf_model`): transformers' sdpa and eager do, on every family."""
    attention = getattr(hf_model.config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        raise ModelUnavailable(f"Model {name!r} loaded with attention {attention!r}, which the HF engine's packed passes "
                               "cannot mask; load it with sdpa or eager attention.")


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model: ModelInfo, device: torch.device | None = None, limits: EngineLimits = EngineLimits()):
        self.model = model
        self.limits = limits
        self.hf_model = load_hf_model(model, device)
        check_packable(self.hf_model, model.name)
        self.device = next(self.hf_model.parameters()).device
        self.blocks = decoder_blocks(self.hf_model, model.name)
        self.decoder = decoder(self.hf_model)
        # The mean over blocks: some families alternate dense and mixture-of-experts blocks.
        self.params_per_block = sum(p.numel() for p in self.blocks.parameters()) // len(self.blocks)

    def passes(self, lengths: list[int], batch_size: int | None = None, max_tokens: int | None = None,
               blocks_run: int | None = None) -> list[Pass]:
        """The packed forward passes for prompts of these lengths (`harvest.engines.packing`):
        rows planned for them, for this model on this device and the `blocks_run` a pass runs
        (default all), at most `batch_size` prompts and `max_tokens` (default
        `self.limits.batch_tokens`) tokens a pass."""
        cost = PassCost.of_model(self.params_per_block, self.model.hidden_size, blocks_run or len(self.blocks), self.device.type)
        return plan_for(lengths, cost, batch_tokens=max_tokens or self.limits.batch_tokens, max_prompts=batch_size,
                        row_tokens=self.limits.row_tokens)

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None,
                sink: ValueSink | None = None) -> ShardCapture:
        return self.capture_cobatch([prompts], spec, batch_size=batch_size, sinks=[sink])[0]

    @torch.inference_mode()
    def capture_cobatch(self, shards: list[list[list[int]]], spec: CaptureSpec, *, batch_size: int | None = None,
                        sinks: list[ValueSink | None] | None = None) -> list[ShardCapture]:
        """Every shard's prompts in one set of packed passes; a reducer per shard."""
        started = time.perf_counter()
        sinks = sinks or [None] * len(shards)
        reducers = [PromptReducer(spec, self.model.hidden_size, self.device) for _ in shards]
        prompts = [p for shard in shards for p in shard]
        owner = [k for k, shard in enumerate(shards) for _ in shard]
        position = [p for shard in shards for p in range(len(shard))]
        values: list[torch.Tensor | None] = [None] * len(prompts)
        lengths = [len(p) for p in prompts]
        max_tokens = min(self.limits.batch_tokens, self.limits.tokens_per_piece(spec, self.model.hidden_size))

        def hand_out(batch_values: list[tuple[int, torch.Tensor]], landing: Landing) -> None:
            landing.wait()
            for index, value in batch_values:
                sink = sinks[owner[index]]
                if sink is None:
                    values[index] = value
                else:
                    sink(position[index], value)

        # On a GPU a pass's values are handed on after the next forward pass is queued, so
        # the host's work (the sink's write) overlaps the device's; at most two passes'
        # values are held. On the CPU nothing runs in the background: at once.
        lag = 1 if self.device.type == "cuda" else 0
        pending: deque[tuple[list[tuple[int, torch.Tensor]], Landing]] = deque()
        padded = 0
        for plan in self.passes(lengths, batch_size, max_tokens, blocks_run=max(spec.layers) + 1):
            input_ids, positions, places = packed_inputs(prompts, plan)
            padded += plan.padded_tokens
            with block_hooks(self.blocks, spec.layers) as captured:
                positions = positions.to(self.device)
                mask = packed_attention_mask(self.hf_model.config, positions, self.hf_model.dtype)
                try:
                    self.decoder(input_ids=input_ids.to(self.device), attention_mask=mask, position_ids=positions, use_cache=False)
                except StopForward:
                    pass
            check_capture(captured, spec.layers, tuple(input_ids.shape))
            batch_values = []
            for index, row, column in places:
                # One prompt's layers at a time: never a second copy of the whole pass.
                acts = torch.stack([captured[layer][row, column : column + lengths[index]] for layer in spec.layers])  # [L, seq, hidden]
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
        # A co-batched pass's filler is shared by its shards, each charged its share of tokens
        # (the last the remainder, so the shares add up to the filler that ran).
        total, charged = sum(lengths) or 1, 0
        for answer, shard in zip(answers, shards, strict=True):
            answer.padded_tokens = round(padded * sum(len(p) for p in shard) / total)
            charged += answer.padded_tokens
        answers[-1].padded_tokens += padded - charged
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
