"""Projection onto directions: every documented rejection, and the numbers against numpy."""

from __future__ import annotations

import base64

import ml_dtypes
import numpy as np
import pytest

from harvest.capture_spec import CaptureSpec
from harvest.errors import InvalidRequest
from harvest.projection import decode_directions
from harvest.tokenize import load_tokenizer
from testbed.reference import hf_reference_layers

HIDDEN = 256


def _payload(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def _refusal(**kwargs) -> str:
    with pytest.raises(InvalidRequest) as info:
        decode_directions(**kwargs)
    assert info.value.param == "project_onto"
    assert info.value.status == 400
    return info.value.message


def test_refuses_bad_base64():
    assert "not valid base64" in _refusal(data="@@not base64@@", dtype="float32", shape=[1, HIDDEN], hidden_size=HIDDEN)


def test_refuses_wrong_byte_count_giving_both_counts():
    data = _payload(np.ones((2, HIDDEN - 1), "<f4"))
    message = _refusal(data=data, dtype="float32", shape=[2, HIDDEN], hidden_size=HIDDEN)
    assert str(2 * (HIDDEN - 1) * 4) in message and str(2 * HIDDEN * 4) in message


def test_refuses_other_hidden_size():
    data = _payload(np.ones((2, 128), "<f4"))
    message = _refusal(data=data, dtype="float32", shape=[2, 128], hidden_size=HIDDEN)
    assert "128" in message and str(HIDDEN) in message


def test_refuses_more_than_64_directions():
    data = _payload(np.ones((65, HIDDEN), "<f4"))
    assert "65 directions" in _refusal(data=data, dtype="float32", shape=[65, HIDDEN], hidden_size=HIDDEN)


def test_refuses_zero_norm_direction():
    array = np.ones((3, HIDDEN), "<f4")
    array[1] = 0
    assert "zero-norm direction(s) [1]" in _refusal(data=_payload(array), dtype="float32", shape=[3, HIDDEN], hidden_size=HIDDEN)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_refuses_non_finite_direction(bad):
    array = np.ones((3, HIDDEN), "<f4")
    array[2, 5] = bad
    assert "non-finite" in _refusal(data=_payload(array), dtype="float32", shape=[3, HIDDEN], hidden_size=HIDDEN)


def test_refuses_compression():
    data = _payload(np.ones((1, HIDDEN), "<f4"))
    assert "compression" in _refusal(data=data, dtype="float32", shape=[1, HIDDEN], hidden_size=HIDDEN, compression="zstd")


@pytest.mark.parametrize("dtype,numpy_dtype", [("float32", "<f4"), ("float16", "<f2"), ("bfloat16", ml_dtypes.bfloat16)])
def test_decodes_each_dtype_to_unit_directions(dtype, numpy_dtype):
    array = np.random.default_rng(0).standard_normal((4, HIDDEN)).astype(numpy_dtype)
    directions = decode_directions(_payload(array), dtype, [4, HIDDEN], HIDDEN)
    assert directions.unit.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(directions.unit, axis=1), 1.0, rtol=1e-6)
    expected = array.astype(np.float64) / np.linalg.norm(array.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_allclose(directions.unit, expected, rtol=1e-6, atol=1e-7)
    assert directions.manifest_entry()["normalized"] is True


def test_projections_equal_acts_times_unit_directions(hf_engine, tiny):
    rng = np.random.default_rng(7)
    raw = (rng.standard_normal((8, HIDDEN)) * rng.uniform(0.1, 10, size=(8, 1))).astype("<f4")
    directions = decode_directions(_payload(raw), "float32", [8, HIDDEN], tiny.hidden_size)
    tokenizer = load_tokenizer(tiny.path)
    prompts = [tokenizer(p)["input_ids"] for p in ("The sky is", "A shard is a file that holds activations.")]
    layers = [0, tiny.n_layers - 1]
    capture = hf_engine.capture(prompts, CaptureSpec(layers, directions.unit))
    unit = raw.astype(np.float64) / np.linalg.norm(raw.astype(np.float64), axis=1, keepdims=True)
    for ids, got in zip(prompts, capture.values, strict=True):
        assert str(got.dtype) == "torch.float32"
        assert tuple(got.shape) == (len(layers), len(ids), 8)
        expected = hf_reference_layers(hf_engine.hf_model, ids, layers).astype(np.float64) @ unit.T
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-3)
    # statistics describe the projections: [n_layers, n_directions]
    assert tuple(capture.stats.mean.shape) == (len(layers), 8)
