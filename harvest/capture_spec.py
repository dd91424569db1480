"""What a capture asks for (`CaptureSpec`): which blocks, raw or projected, in which dtype.

Apart from `harvest.capture` (the reduction itself, on torch) so that what only reads a
request and weighs its cost (the API's assessing children, `harvest.cost`) imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_DIRECTIONS", "CaptureSpec"]

MAX_DIRECTIONS = 64
"""Most directions one projection may hold (the request's `project_onto.shape[0]`)."""


@dataclass(frozen=True)
class CaptureSpec:
    """What to keep from each forward pass."""

    layers: list[int]
    """Block indices to capture, ascending; layer k is block k's output before the final norm."""
    directions: np.ndarray | None = None
    """Unit directions, float32 `[n_directions, hidden]`; None keeps the raw residual stream."""

    @property
    def stored_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.directions is None else torch.float32

    @property
    def stored_itemsize(self) -> int:
        """Bytes per stored value: bfloat16 raw, float32 projected (`stored_dtype`)."""
        return 2 if self.directions is None else 4

    def n_features(self, hidden_size: int) -> int:
        return hidden_size if self.directions is None else self.directions.shape[0]
