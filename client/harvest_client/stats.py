"""Merging the jobs' `stats.safetensors` into the statistics of the whole corpus (Chan et al.).

Each job's file holds its population mean and std over its counted positions (every token but
each prompt's first) and the count. With M2 = std² · count, two partials merge exactly:

    n = nₐ + n_b,  δ = mean_b − meanₐ,  mean = meanₐ + δ·n_b/n,  M2 = M2ₐ + M2_b + δ²·nₐ·n_b/n

done here in float64, so the result is the statistics of all the jobs' positions together,
whatever the order; merging the per-job means by simple averaging (as some readers do) is
wrong whenever jobs differ in size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Moments", "merge_moments"]


@dataclass(frozen=True)
class Moments:
    count: int
    mean: np.ndarray
    """float64 `[n_features]`."""
    std: np.ndarray
    """float64 `[n_features]`, population (divides by count)."""


def merge_moments(parts: list[Moments]) -> Moments:
    count = 0
    mean: np.ndarray | None = None
    m2: np.ndarray | None = None
    for part in parts:
        if part.count == 0:
            continue
        mean_b = np.asarray(part.mean, dtype=np.float64)
        m2_b = np.asarray(part.std, dtype=np.float64) ** 2 * part.count
        if mean is None:
            count, mean, m2 = part.count, mean_b.copy(), m2_b
            continue
        total = count + part.count
        delta = mean_b - mean
        mean = mean + delta * (part.count / total)
        m2 = m2 + m2_b + delta**2 * (count * part.count / total)
        count = total
    if mean is None:
        raise ValueError("No statistics to merge: every job counted zero positions.")
    return Moments(count, mean, np.sqrt(m2 / count))
