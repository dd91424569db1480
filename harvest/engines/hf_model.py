"""How the HF engine reaches into a transformers model of any family: its blocks, its decoder,
and the attention masks of its packed passes.

- **Blocks.** Layer k is the output of decoder block k before the final norm; the blocks are
  at the path `harvest.architectures.block_path` names (`model.layers`, GPT-2's `transformer.h`,
  GPT-NeoX's `gpt_neox.layers`). What is found there must be a list of `n_layers` modules, or
  the model is refused with what was found: a hook on the wrong module would give wrong values.
- **Decoder.** The module that holds the blocks (`model`, `transformer`, `gpt_neox`) runs a pass
  without the LM head, which a harvest never needs.
- **Masks.** Packed rows hold several prompts back to back, positions restarting at 0 for each
  (`harvest.engines.packing`). transformers turns restarting positions into a block-diagonal
  mask for some families only; for GPT-2, GPT-NeoX, Mistral and Gemma-2 a packed prompt saw the
  one before it (measured: DESIGN.md, "Architectures"). So the engine hands every family an
  explicit mask, which transformers takes as it is (a 4-D mask skips its own mask building):
  each token sees the earlier tokens of its own prompt, and, on a sliding-window layer, only
  the last `sliding_window` of them (transformers' own rule: key position > query position −
  window). Families whose layers mix sliding and global attention (Gemma-2 and -3, Qwen2/3,
  AFMoE: their config lists `layer_types`) take one mask per layer type; the others one mask,
  sliding when their config sets a window (Mistral). A pass whose rows each hold a single
  prompt needs no mask of ours: the model builds its own, as in a lone forward pass.
"""

from __future__ import annotations

import torch

from harvest.architectures import block_path
from harvest.engines.packing import segments
from harvest.errors import ModelUnavailable

__all__ = ["decoder_blocks", "decoder", "packed_attention_mask", "block_causal_mask", "final_logits"]


def _blocks_path(hf_model) -> str:
    return block_path(getattr(hf_model.config, "model_type", None))


def decoder_blocks(hf_model, name: str) -> torch.nn.ModuleList:
    """The decoder blocks of `hf_model` (checked: a list of `num_hidden_layers` modules)."""
    path = _blocks_path(hf_model)
    n_layers = hf_model.config.num_hidden_layers
    try:
        blocks = hf_model.get_submodule(path)
    except AttributeError:
        blocks = None
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) != n_layers:
        lists = [f"{n} ({len(m)})" for n, m in hf_model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        raise ModelUnavailable(
            f"Model {name!r} ({type(hf_model).__name__}): its {n_layers} decoder blocks are not at {path}; "
            f"module lists found: {', '.join(lists) or 'none'}. Name its family in harvest/architectures.py.")
    return blocks


def decoder(hf_model) -> torch.nn.Module:
    """The module that runs the embeddings and the blocks, without the LM head."""
    return hf_model.get_submodule(_blocks_path(hf_model).rpartition(".")[0])


def block_causal_mask(segment: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive mask `[rows, 1, width, width]` for tokens of packed sequences `segment`
    (`harvest.engines.packing.segments`): 0 where a token may attend (an earlier or the same
    token of its own sequence, and within the last `window` tokens when given), the dtype's
    lowest value elsewhere."""
    width = segment.shape[-1]
    query = torch.arange(width, device=segment.device)
    allowed = (segment[:, :, None] == segment[:, None, :]) & (query[None, :] <= query[:, None])[None]
    if window is not None:
        allowed &= (query[None, :] > query[:, None] - window)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def packed_attention_mask(config, positions: torch.Tensor, dtype: torch.dtype, *, always: bool = False):
    """What to pass as `attention_mask` for a packed pass of `positions` `[rows, width]`: None
    when every row is one prompt (the model's own mask is right) unless `always`, else one mask,
    or a dict of masks by layer type for families that mix sliding and global layers."""
    segment = segments(positions)  # once per pass, for every mask below
    if not always and not bool((segment != 0).any()):
        return None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        masks = {"full_attention": block_causal_mask(segment, dtype)}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = block_causal_mask(segment, dtype, window)
        return masks
    return block_causal_mask(segment, dtype, window)


def final_logits(hf_model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on final hidden states, as the model's own forward computes logits
    (Gemma's final softcapping included)."""
    logits = hf_model.get_output_embeddings()(hidden)
    cap = getattr(hf_model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
