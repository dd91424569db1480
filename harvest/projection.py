"""Directions to project onto (`project_onto`): decoding, validation, normalisation.

Every rejection happens here, at submit time, before any model loads, and its message gives
the numbers needed to fix the payload.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from harvest.errors import InvalidRequest, echo
from harvest.capture_spec import MAX_DIRECTIONS

__all__ = ["MAX_DIRECTIONS", "DTYPES", "Directions", "decode_directions"]

DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
PARAM = "project_onto"


@dataclass(frozen=True)
class Directions:
    """Unit directions, float32 `[n_directions, hidden]`, with what the manifest records."""

    unit: np.ndarray
    input_dtype: str
    sha256: str

    @property
    def n_directions(self) -> int:
        return self.unit.shape[0]

    def manifest_entry(self) -> dict:
        return {"normalized": True, "n_directions": self.n_directions, "dtype": self.input_dtype, "sha256": self.sha256}


def _fail(message: str) -> InvalidRequest:
    return InvalidRequest(message, param=PARAM)


def decode_directions(data: str, dtype: str, shape: list[int], hidden_size: int, compression: str | None = "none") -> Directions:
    """Check a `project_onto` payload against the model and return unit directions."""
    if compression not in (None, "none"):
        raise _fail(f'project_onto.compression must be "none"; {echo(compression)} is not supported.')
    if dtype not in DTYPES:
        raise _fail(f"project_onto.dtype must be one of {', '.join(DTYPES)}; got {echo(dtype)}.")
    if len(shape) != 2 or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape):
        raise _fail(f"project_onto.shape must be [n_directions, hidden_size] with positive sizes; got {echo(shape)}.")
    n_directions, hidden = shape
    if hidden != hidden_size:
        raise _fail(f"project_onto.shape gives hidden size {hidden}, but the model's hidden_size is {hidden_size}.")
    if n_directions > MAX_DIRECTIONS:
        raise _fail(f"project_onto has {n_directions} directions; at most {MAX_DIRECTIONS} are allowed.")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _fail(f"project_onto.data is not valid base64: {exc}.") from None
    itemsize = DTYPES[dtype].itemsize
    expected = n_directions * hidden * itemsize
    if len(raw) != expected:
        raise _fail(
            f"project_onto.data holds {len(raw)} bytes, but shape {shape} in {dtype} needs "
            f"{n_directions} × {hidden} × {itemsize} = {expected} bytes."
        )
    array = np.frombuffer(raw, dtype=DTYPES[dtype]).reshape(n_directions, hidden).astype(np.float64)
    if not np.isfinite(array).all():
        bad = sorted({int(i) for i in np.argwhere(~np.isfinite(array))[:, 0]})
        raise _fail(f"project_onto has non-finite values (NaN or infinity) in direction(s) {bad}.")
    norms = np.linalg.norm(array, axis=1)
    if (norms == 0).any():
        raise _fail(f"project_onto has zero-norm direction(s) {np.flatnonzero(norms == 0).tolist()}; they have no direction.")
    unit = (array / norms[:, None]).astype(np.float32)
    return Directions(unit=unit, input_dtype=dtype, sha256=hashlib.sha256(raw).hexdigest())
