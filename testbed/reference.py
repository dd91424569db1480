"""Independent references the tests compare against: HF `hidden_states` and numpy float64."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["hf_reference_layers", "bf16_tolerance", "decoder_blocks_of"]


def decoder_blocks_of(hf_model) -> tuple[str, torch.nn.ModuleList]:
    """The model's own decoder blocks, found without the service's code: the one module list
    of `num_hidden_layers` modules (`model.layers`, GPT-2's `transformer.h`, …), and its path."""
    n_layers = hf_model.config.num_hidden_layers
    found = [(name, m) for name, m in hf_model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers]
    assert len(found) == 1, [name for name, _ in found]
    return found[0]


@torch.inference_mode()
def hf_reference_layers(hf_model, ids: list[int], layers: list[int]) -> np.ndarray:
    """float32 `[len(layers), n_tokens, hidden]` for one prompt, run alone (no batching, no padding).

    Block k's output is `hidden_states[k + 1]`, except for the last block: HF applies the final
    norm to `hidden_states[-1]`, so the last block is read through a forward hook instead.
    """
    n_layers = hf_model.config.num_hidden_layers
    last: dict[str, torch.Tensor] = {}
    handle = decoder_blocks_of(hf_model)[1][n_layers - 1].register_forward_hook(
        lambda _m, _a, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = hf_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    rows = [last["h"][0] if k == n_layers - 1 else out.hidden_states[k + 1][0] for k in layers]
    return torch.stack(rows).float().numpy()


def bf16_tolerance(reference: np.ndarray) -> np.ndarray:
    """One bf16 rounding of each value: bf16 keeps 8 significant bits, so |error| ≤ 2^-8 |x|
    (plus a little slack for float32 differences between batched and single runs)."""
    return np.abs(reference) * 2.0**-8 + 1e-4
