"""Streaming per-layer normalisation statistics (Welford/Chan), in float64.

Each batch contributes (count, mean, M2) computed in float64 on the device that holds the
activations; partials merge with Chan's parallel formula, so shards and workers can be
combined in any order and give the same answer as one pass over all the data. Subtracting
the batch mean before squaring keeps the variance exact even when the mean is huge compared
with the spread (mean 1e4, std 1e-2), where a naive sum of squares loses every digit.

Statistics cover every token position except the first of each prompt (with
`add_special_tokens` that is the BOS token, whose outlier norms would skew them).
`norm_sum` adds up the L2 norm of each counted token vector, for `mean_token_norm`.
"""

from __future__ import annotations

import torch

__all__ = ["RunningStats"]


class RunningStats:
    """Per-layer feature mean and variance over token vectors, mergeable in any order."""

    def __init__(self, n_layers: int, n_features: int, device: torch.device | str = "cpu"):
        self.count = 0
        self.mean = torch.zeros(n_layers, n_features, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(n_layers, n_features, dtype=torch.float64, device=device)
        self.norm_sum = torch.zeros(n_layers, dtype=torch.float64, device=device)

    @torch.inference_mode()
    def update(self, values: torch.Tensor) -> None:
        """Add token vectors `values` `[n_layers, n_tokens, n_features]` (any float dtype)."""
        n = values.shape[1]
        if n == 0:
            return
        x = values.to(self.mean.device, torch.float64)
        batch_mean = x.mean(dim=1)
        batch_m2 = ((x - batch_mean[:, None, :]) ** 2).sum(dim=1)
        self._merge(n, batch_mean, batch_m2, torch.linalg.vector_norm(x, dim=2).sum(dim=1))

    def merge(self, other: "RunningStats") -> "RunningStats":
        """Fold another partial into this one (Chan et al.); returns self."""
        if other.count:
            device = self.mean.device
            self._merge(other.count, other.mean.to(device), other.m2.to(device), other.norm_sum.to(device))
        return self

    def _merge(self, n_b: int, mean_b: torch.Tensor, m2_b: torch.Tensor, norm_sum_b: torch.Tensor) -> None:
        n_a = self.count
        total = n_a + n_b
        delta = mean_b - self.mean
        self.mean += delta * (n_b / total)
        self.m2 += m2_b + delta**2 * (n_a * n_b / total)
        self.norm_sum += norm_sum_b
        self.count = total

    @property
    def std(self) -> torch.Tensor:
        """Population standard deviation (divides by count)."""
        return (self.m2 / max(self.count, 1)).sqrt()

    @property
    def mean_token_norm(self) -> torch.Tensor:
        return self.norm_sum / max(self.count, 1)

    def to(self, device: torch.device | str) -> "RunningStats":
        moved = RunningStats(0, 0)
        moved.count = self.count
        moved.mean, moved.m2, moved.norm_sum = self.mean.to(device), self.m2.to(device), self.norm_sum.to(device)
        return moved

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Exact float64 state, for storing a partial beside its shard."""
        return {
            "count": torch.tensor([self.count], dtype=torch.int64),
            "mean": self.mean.cpu().contiguous(),
            "m2": self.m2.cpu().contiguous(),
            "norm_sum": self.norm_sum.cpu().contiguous(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "RunningStats":
        stats = cls(0, 0)
        stats.count = int(state["count"][0])
        stats.mean, stats.m2, stats.norm_sum = state["mean"].double(), state["m2"].double(), state["norm_sum"].double()
        return stats

    def export(self, layer_indices: list[int]) -> dict[str, torch.Tensor]:
        """The tensors of `stats.safetensors`."""
        return {
            "mean": self.mean.float().cpu().contiguous(),
            "std": self.std.float().cpu().contiguous(),
            "layer_indices": torch.tensor(layer_indices, dtype=torch.int32),
            "count": torch.tensor(self.count, dtype=torch.int64),
        }
