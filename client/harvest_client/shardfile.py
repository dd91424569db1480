"""Reading one tensor's rows out of a safetensors shard without loading the shard.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the raw little-endian bytes. Knowing that, a local
shard is memory-mapped once and a layer's rows are a slice of it (the page cache does the
rest); a remote shard (`s3://…`) is fetched whole on first use and kept in a small cache,
since training reads a shard's prompts together. bf16 has no numpy dtype: its bits are the
top half of a float32's, so widening is a shift, exact.
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict

import numpy as np

__all__ = ["ShardFile", "RemoteCache"]

_NUMPY = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "I32": np.dtype("<i4"),
          "I64": np.dtype("<i8"), "F64": np.dtype("<f8")}


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32 (or the integer dtype) from the stored bits."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype in ("F16", "F64"):
        return raw.astype(np.float32)
    return raw


class RemoteCache:
    """The last few remote shards' bytes (whole files), shared by a dataset's shards."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._files: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fs, path: str) -> np.ndarray:
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
                return self._files[path]
        data = np.frombuffer(fs.cat_file(path), dtype=np.uint8)
        with self._lock:
            self._files[path] = data
            while len(self._files) > self.capacity:
                self._files.popitem(last=False)
        return data


class ShardFile:
    """One safetensors file, local (memory-mapped) or on any fsspec filesystem."""

    def __init__(self, fs, path: str, *, local: bool, cache: RemoteCache | None = None):
        self.fs = fs
        self.path = path
        self.local = local
        self.cache = cache or RemoteCache()
        self._bytes: np.ndarray | None = None
        self._header: dict | None = None
        self._data_start = 0

    def _all_bytes(self) -> np.ndarray:
        if self.local:
            if self._bytes is None:
                self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r")
            return self._bytes
        return self.cache.get(self.fs, self.path)

    @property
    def header(self) -> dict:
        if self._header is None:
            if self.local:
                with open(self.path, "rb") as handle:
                    (length,) = struct.unpack("<Q", handle.read(8))
                    header = handle.read(length)
            else:
                (length,) = struct.unpack("<Q", self.fs.cat_file(self.path, start=0, end=8))
                header = self.fs.cat_file(self.path, start=8, end=8 + length)
            self._header = json.loads(header)
            self._header.pop("__metadata__", None)
            self._data_start = 8 + length
        return self._header

    def shape(self, key: str) -> list[int]:
        return self.header[key]["shape"]

    def read(self, key: str, first: int = 0, count: int | None = None, row: int | None = None) -> np.ndarray:
        """Tensor `key` (float32, or its integer dtype); `row` picks index `row` of the first
        axis; `first`/`count` then slice the next axis (the tokens)."""
        entry = self.header[key]
        dtype, shape = entry["dtype"], list(entry["shape"])
        item = _NUMPY[dtype]
        begin, end = (self._data_start + o for o in entry["data_offsets"])
        if row is not None:  # [layers, tokens, features] → one layer's [tokens, features]
            step = int(np.prod(shape[1:], dtype=np.int64)) * item.itemsize
            begin, shape = begin + row * step, shape[1:]
            end = begin + step
        if count is None:
            count = shape[0] - first if shape else 0
        if shape:
            inner = int(np.prod(shape[1:], dtype=np.int64)) * item.itemsize
            begin, end = begin + first * inner, begin + (first + count) * inner
            shape = [count, *shape[1:]]
        raw = self._all_bytes()[begin:end].view(item).reshape(shape)
        return _widen(np.asarray(raw), dtype)
