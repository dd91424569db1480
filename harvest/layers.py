"""Which decoder blocks to capture.

Layer k is the output of decoder block k (0-based), before the model's final norm: in
Hugging Face terms `hidden_states[k + 1]`, except that HF applies the final norm to its last
entry, so the last block is captured with a hook, never read from `hidden_states[-1]`.
"""

from __future__ import annotations

from collections.abc import Sequence

from harvest.errors import InvalidRequest, echo
from harvest.registry import ModelInfo

__all__ = ["RESIDUAL_STREAM_CONVENTION", "default_layers", "resolve_layers"]

RESIDUAL_STREAM_CONVENTION = (
    "Layer k is the output of decoder block k (0-based), before the model's final norm; "
    "in Hugging Face terms hidden_states[k + 1] for every block but the last, whose "
    "hidden_states entry has the final norm applied and is not what is stored here."
)


def default_layers(n_layers: int) -> list[int]:
    """Blocks at 25/50/75% depth: floor(n_layers * q), e.g. [8, 16, 24] for 32 layers."""
    return sorted({n_layers * q // 4 for q in (1, 2, 3)})


def resolve_layers(model: ModelInfo, layers: Sequence[int] | str | bool | None, *, param: str = "layers") -> list[int]:
    """Turn a request's layers into a sorted, deduplicated list of block indices.

    None → quartiles; "all" (exact, lowercase) or True → every block; a list → those blocks.
    """
    n = model.n_layers
    if layers is None:
        return default_layers(n)
    if layers is True or layers == "all":
        return list(range(n))
    if isinstance(layers, (str, bool)) or not isinstance(layers, Sequence):
        raise InvalidRequest(f'{param} must be a list of layer indices or "all", not {echo(layers)}.', param=param)
    if not layers:
        raise InvalidRequest(f"{param} must name at least one layer.", param=param)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise InvalidRequest(f"{param} must hold integers; got {echo(layer)}.", param=param)
        if not 0 <= layer < n:
            raise InvalidRequest(
                f"{model.display_name} has layers 0 to {n - 1}: it has no layer {echo(layer)}.", param=param
            )
    return sorted(set(layers))
