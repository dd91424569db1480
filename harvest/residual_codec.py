"""The wire format of inline activations: bf16 → little-endian int16 bits → zstd → base64.

`encode_residual` turns a bf16 `[n_layers, n_tokens, hidden]` tensor into the
`activations.residual_stream` object of a completion response; `decode_residual` is its
inverse (the clients' numpy/ml_dtypes snippet in the user docs is another). The bits are
carried unchanged: a bf16 value and its int16 view are the same 16 bits, so decoding with
`.view(bfloat16)` gives back exactly what the model produced.

The zstd level is `ZSTD_LEVEL`, chosen from bench/bench_inline.py's measurement (see
bench/RESULTS.md): the whole gain (ratio ~1.28) is zstd's entropy coding of the predictable
sign/exponent byte; the mantissa byte is noise, so levels 1-9 give the same ratio and 15-19
add ~1% at 100× the time. Level 2 was the fastest of the equal-ratio levels; negative
(fast) levels skip the entropy stage and gain nothing.

`encode_residual_chunks` is the same `data` text in pieces, for a response that streams it:
it reads the tensor's memory in place and holds one piece at a time (never the raw bytes,
the compressed bytes and the base64 text of the whole stream at once). The zstd frame
records the content size, as a one-shot compression does, so `ZstdDecompressor().decompress`
(the user docs' snippet) reads it.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import zstandard

if TYPE_CHECKING:  # a tensor handed in means torch is loaded; the API imports this module without it
    import torch

__all__ = ["ZSTD_LEVEL", "encode_residual", "encode_residual_chunks", "decode_residual"]

ZSTD_LEVEL = 2
"""Measured in bench/bench_inline.py: see bench/RESULTS.md for ratio and speed per level."""

_ORIGINAL_DTYPE = "torch.bfloat16"


def _le_int16_bytes(residual: torch.Tensor) -> bytes:
    """The tensor's bf16 bits as little-endian int16 bytes, in C order."""
    import torch

    if residual.dtype != torch.bfloat16:
        raise TypeError(f"the residual stream must be bfloat16, not {residual.dtype}")
    bits = residual.detach().contiguous().cpu().view(torch.int16).numpy()
    if sys.byteorder != "little":  # the wire format is little-endian whatever the host is
        bits = bits.byteswap()
    return bits.tobytes()


def _le_int16_view(residual: torch.Tensor) -> memoryview:
    """The tensor's bf16 bits as little-endian int16 bytes, in C order, without a copy where
    the tensor is already contiguous on the host of a little-endian machine."""
    import torch

    if residual.dtype != torch.bfloat16:
        raise TypeError(f"the residual stream must be bfloat16, not {residual.dtype}")
    bits = residual.detach().contiguous().cpu().view(torch.int16).numpy()
    if sys.byteorder != "little":
        bits = bits.byteswap()
    return memoryview(bits).cast("B")


def encode_residual_chunks(
    residual: torch.Tensor, *, level: int = ZSTD_LEVEL, threads: int = 0, piece_bytes: int = 256 << 10
) -> Iterator[bytes]:
    """The base64 text of `encode_residual(residual)["data"]`, as ASCII bytes in pieces.

    Raw bytes go to zstd `piece_bytes` at a time; what comes out is base64-encoded in multiples
    of 3 bytes (the last piece carries the padding), so the pieces join into one base64 text of
    one zstd frame that records its content size. Single-threaded it is the one-shot text (seen
    on a `[8, 700, 256]` stream); with zstd threads the frame may be cut differently, and
    decodes to the same bits.
    """
    raw = _le_int16_view(residual)
    compressor = zstandard.ZstdCompressor(level=level, threads=threads)
    chunker = compressor.chunker(size=len(raw), chunk_size=piece_bytes)
    carry = b""

    def encoded(block: bytes) -> bytes | None:
        nonlocal carry
        if carry:
            block = carry + block
        cut = len(block) - len(block) % 3
        carry = block[cut:]
        return base64.b64encode(memoryview(block)[:cut]) if cut else None

    for start in range(0, len(raw), piece_bytes):
        for block in chunker.compress(raw[start : start + piece_bytes]):
            if (text := encoded(block)) is not None:
                yield text
    for block in chunker.finish():
        if (text := encoded(block)) is not None:
            yield text
    if carry:
        yield base64.b64encode(carry)


def encode_residual(residual: torch.Tensor, *, level: int = ZSTD_LEVEL, threads: int = 0) -> dict:
    """`residual` bf16 `[n_layers, n_tokens, hidden]` → the response's `residual_stream` object.

    `threads` > 0 lets zstd compress in that many worker threads (large payloads only gain).
    """
    raw = _le_int16_bytes(residual)
    compressor = zstandard.ZstdCompressor(level=level, threads=threads)
    return {
        "data": base64.b64encode(compressor.compress(raw)).decode("ascii"),
        "dtype": "int16",
        "original_dtype": _ORIGINAL_DTYPE,
        "shape": list(residual.shape),
        "compression": "zstd",
    }


def decode_residual(payload: dict) -> torch.Tensor:
    """The inverse of `encode_residual`: a `residual_stream` object → bf16 tensor of its shape."""
    raw = base64.b64decode(payload["data"])
    if payload.get("compression") == "zstd":
        raw = zstandard.ZstdDecompressor().decompress(raw)
    elif payload.get("compression") not in (None, "none"):
        raise ValueError(f"unknown compression {payload.get('compression')!r}")
    bits = np.frombuffer(raw, dtype="<i2").astype(np.int16, copy=True)  # native order for torch
    shape = tuple(payload["shape"])
    if bits.size != int(np.prod(shape)):
        raise ValueError(f"the payload holds {bits.size} values, not the {int(np.prod(shape))} of shape {list(shape)}")
    import torch

    return torch.from_numpy(bits).view(torch.bfloat16).reshape(shape)
