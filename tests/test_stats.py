"""Welford/Chan statistics against numpy float64 two-pass mean and std."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from harvest.stats import RunningStats


def _numpy_reference(chunks: list[np.ndarray]):
    data = np.concatenate(chunks, axis=1).astype(np.float64)  # [L, N, F]
    mean = data.mean(axis=1)
    std = np.sqrt(((data - mean[:, None, :]) ** 2).mean(axis=1))
    norms = np.linalg.norm(data, axis=2).mean(axis=1)
    return mean, std, norms


def _stats_of(chunks, n_layers, n_features):
    stats = RunningStats(n_layers, n_features)
    for chunk in chunks:
        stats.update(torch.from_numpy(chunk))
    return stats


def test_matches_two_pass_float64():
    rng = np.random.default_rng(1)
    chunks = [rng.normal(0.3, 2.0, size=(3, n, 16)).astype(np.float32) for n in (1, 7, 40, 3)]
    stats = _stats_of(chunks, 3, 16)
    mean, std, norms = _numpy_reference(chunks)
    np.testing.assert_allclose(stats.mean.numpy(), mean, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(stats.std.numpy(), std, rtol=1e-6)
    np.testing.assert_allclose(stats.mean_token_norm.numpy(), norms, rtol=1e-6)
    assert stats.count == 51


def test_large_mean_small_spread_keeps_its_digits():
    """Mean 1e4, std 1e-2: a naive sum of squares would lose every digit of the variance."""
    rng = np.random.default_rng(2)
    chunks = [1e4 + 1e-2 * rng.standard_normal(size=(2, n, 8)) for n in (500, 1, 333, 1000)]
    stats = _stats_of(chunks, 2, 8)
    mean, std, _ = _numpy_reference(chunks)
    np.testing.assert_allclose(stats.mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(stats.std.numpy(), std, rtol=1e-6)
    assert np.all(np.abs(std - 1e-2) < 2e-3)  # the reference itself is sane


def test_merge_in_any_order_gives_the_same_result():
    rng = np.random.default_rng(3)
    chunks = [rng.normal(5.0, 3.0, size=(2, n, 4)) for n in (3, 10, 1, 25)]
    partials = [_stats_of([c], 2, 4) for c in chunks]
    mean, std, _ = _numpy_reference(chunks)
    for order in itertools.permutations(range(len(partials))):
        merged = RunningStats(2, 4)
        for i in order:
            merged.merge(partials[i])
        np.testing.assert_allclose(merged.mean.numpy(), mean, rtol=1e-9)
        np.testing.assert_allclose(merged.std.numpy(), std, rtol=1e-9)
        assert merged.count == 39


def test_state_round_trip_is_exact():
    rng = np.random.default_rng(4)
    stats = _stats_of([rng.normal(size=(2, 9, 4))], 2, 4)
    again = RunningStats.from_state_dict(stats.state_dict())
    assert again.count == stats.count
    assert torch.equal(again.mean, stats.mean) and torch.equal(again.m2, stats.m2)
