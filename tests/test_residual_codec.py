"""The inline activations wire format: bf16 bits as little-endian int16, zstd, base64.

Decoding is checked with the user docs' own numpy/ml_dtypes snippet, not only our decoder.
"""

from __future__ import annotations

import base64

import ml_dtypes
import numpy as np
import pytest
import torch
import zstandard as zstd

from harvest.residual_codec import ZSTD_LEVEL, decode_residual, encode_residual


def decode_residual_stream(resp):
    """Verbatim from the user docs' "Decode it" example."""
    d = resp["activations"]["residual_stream"]
    raw = base64.b64decode(d["data"])
    if d.get("compression") == "zstd":
        raw = zstd.ZstdDecompressor().decompress(raw)
    # reinterpret the 16 bits as bfloat16 with .view (an .astype would corrupt them)
    arr = np.frombuffer(raw, dtype=np.uint16).view(ml_dtypes.bfloat16)
    return arr.reshape(d["shape"])  # (n_layers, n_tokens, hidden)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy()


def test_round_trip_is_bit_exact_including_special_values():
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0)).mul(40).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40], dtype=torch.bfloat16)
    x[0, 0, 4] = float("nan")
    payload = encode_residual(x)
    assert payload["dtype"] == "int16" and payload["original_dtype"] == "torch.bfloat16"
    assert payload["compression"] == "zstd" and payload["shape"] == [3, 7, 64]
    assert np.array_equal(_bits(decode_residual(payload)), _bits(x))
    docs = decode_residual_stream({"activations": {"residual_stream": payload}})
    assert docs.shape == (3, 7, 64) and docs.dtype == ml_dtypes.bfloat16
    assert np.array_equal(docs.view(np.int16), _bits(x))


def test_wire_bytes_are_little_endian_bf16_bits():
    # bf16 1.0 is 0x3F80, -2.0 is 0xC000: little-endian puts the low byte first.
    x = torch.tensor([[[1.0, -2.0]]], dtype=torch.bfloat16)
    raw = zstd.ZstdDecompressor().decompress(base64.b64decode(encode_residual(x)["data"]))
    assert raw == bytes([0x80, 0x3F, 0x00, 0xC0])


def test_non_contiguous_input_and_threads():
    x = torch.randn(4, 9, 32).to(torch.bfloat16).transpose(0, 1)  # a view, not contiguous
    payload = encode_residual(x, threads=2)
    assert np.array_equal(_bits(decode_residual(payload)), _bits(x.contiguous()))


def test_refusals():
    with pytest.raises(TypeError):
        encode_residual(torch.zeros(1, 1, 4))  # float32 is not the wire dtype
    payload = encode_residual(torch.zeros(2, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16 values"):
        decode_residual({**payload, "shape": [2, 2, 5]})


def test_level_is_a_fast_one():
    # The level was picked by bench/bench_inline.py (bench/RESULTS.md); it must stay a fast one.
    assert 1 <= ZSTD_LEVEL <= 3
