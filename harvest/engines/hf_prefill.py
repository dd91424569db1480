"""The prefill of a batch of completions on the HF engine, packed instead of padded.

Inline requests come with prompts of any length; a prefill padded to the longest spends its
compute on filler. So the prompts run packed, as a harvest's do (`harvest.engines.packing`):
rows of whole prompts back to back, each with positions from 0. A prefill must also fill the
KV cache, and transformers only recognises packed positions without a cache, so the mask is
given explicitly: a 4-D additive mask that lets each token see the earlier tokens of its own
prompt only, and on a sliding layer only its window (`harvest.engines.hf_model`).
The keys and values each pass leaves in its own cache are then laid out left-padded, one row
per prompt, in the decode cache, which is exactly what a padded prefill would have left there
(keys carry their rotary positions, counted from each prompt's first token); decoding goes on
from there unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from harvest.capture import check_capture
from harvest.engines.hf_model import decoder, final_logits, packed_attention_mask
from harvest.engines.packing import Pass, packed_inputs

__all__ = ["Prefilled", "packed_prefill"]


@dataclass
class Prefilled:
    """What decoding starts from, one row per prompt (in the order given)."""

    logits: torch.Tensor
    """float32 `[batch, vocab]`: each prompt's last position."""
    residual: list[torch.Tensor] | None
    """Per prompt, bf16 `[n_layers, n_tokens, hidden]` of the captured layers (None: no capture)."""
    attention_mask: torch.Tensor
    """`[batch, width]`, 0 on the left padding of the decode cache."""
    position_ids: torch.Tensor
    """`[batch, 1]`: each prompt's last position."""
    passes: int
    padded_tokens: int
    """Filler tokens the packed passes ran."""


@torch.inference_mode()
def packed_prefill(hf_model, prompts: list[list[int]], plans: list[Pass], cache, captured: dict[int, torch.Tensor],
                   layers: list[int] | None) -> Prefilled:
    """Run every prompt's prefill in the packed passes `plans` (the engine's, `HFEngine.passes`),
    fill `cache` (empty, one row per prompt, left-padded) and collect `captured` (the hooks'
    dict) per prompt."""
    device, dtype = hf_model.device, hf_model.dtype
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    config = hf_model.config
    n_layers = config.num_hidden_layers
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    residual: list[torch.Tensor | None] = [None] * len(prompts)
    keys: list[torch.Tensor | None] = [None] * n_layers
    values: list[torch.Tensor | None] = [None] * n_layers
    for plan in plans:
        input_ids, positions, places = packed_inputs(prompts, plan)
        input_ids, positions = input_ids.to(device), positions.to(device)
        # A cache without the config's layer types keeps every key: a sliding layer's own
        # cache would keep only a row's last window, and the columns below would be lost.
        own = DynamicCache()
        captured.clear()
        mask = packed_attention_mask(config, positions, dtype, always=True)
        out = decoder(hf_model)(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=own, use_cache=True)
        if layers:
            check_capture(captured, layers, tuple(input_ids.shape))
        # Only each prompt's last position is sampled from: the LM head runs on those alone.
        last = out.last_hidden_state[[row for _, row, _ in places], [column + lengths[index] - 1 for index, _, column in places]]
        for (index, row, column), row_logits in zip(places, final_logits(hf_model, last).float(), strict=True):
            logits[index] = row_logits
            if layers:
                n = lengths[index]
                residual[index] = torch.stack([captured[layer][row, column : column + n] for layer in layers]).to(torch.bfloat16)
        for k, layer in enumerate(own.layers):
            if keys[k] is None:  # the decode cache's storage, left-padded, once the shapes are known
                keys[k] = layer.keys.new_zeros((len(prompts), layer.keys.shape[1], width, layer.keys.shape[3]))
                values[k] = layer.values.new_zeros((len(prompts), layer.values.shape[1], width, layer.values.shape[3]))
            for index, row, column in places:
                n = lengths[index]
                keys[k][index, :, width - n :] = layer.keys[row, :, column : column + n]
                values[k][index, :, width - n :] = layer.values[row, :, column : column + n]
        del own, out
    for k, layer in enumerate(cache.layers):
        layer.update(keys[k], values[k])
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for index, n in enumerate(lengths):
        attention_mask[index, width - n :] = 1
    return Prefilled(
        logits=torch.stack(logits),
        residual=residual if layers else None,
        attention_mask=attention_mask,
        position_ids=torch.tensor([[n - 1] for n in lengths], device=device),
        passes=len(plans),
        padded_tokens=sum(p.padded_tokens for p in plans),
    )
