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
        self._entries: dict[str, tuple] = {}

    def _all_bytes(self) -> np.ndarray:
        if self.local:
            if self._bytes is None:
                # a plain ndarray over the map (its base keeps the map open): np.memmap's own
                # slicing costs a Python call per slice, which thousands of small reads feel
                self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
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

    def _entry(self, key: str) -> tuple:
        """(safetensors dtype, numpy dtype, absolute first byte, shape) of `key`, parsed once:
        a reader asks for thousands of small tensors, so per-read work must stay tiny."""
        entry = self._entries.get(key)
        if entry is None:
            raw = self.header[key]
            entry = (raw["dtype"], _NUMPY[raw["dtype"]], self._data_start + raw["data_offsets"][0], tuple(raw["shape"]))
            self._entries[key] = entry
        return entry

    def read(self, key: str, first: int = 0, count: int | None = None, row: int | None = None) -> np.ndarray:
        """Tensor `key` (float32, or its integer dtype); `row` picks index `row` of the first
        axis; `first`/`count` then slice the next axis (the tokens)."""
        dtype, item, begin, shape = self._entry(key)
        if row is not None:  # [layers, tokens, features] → one layer's [tokens, features]
            shape = shape[1:]
            begin += row * _size(shape) * item.itemsize
        if not shape:
            return _widen(self._all_bytes()[begin : begin + item.itemsize].view(item).reshape(()), dtype)
        if count is None:
            count = shape[0] - first
        inner = _size(shape[1:]) * item.itemsize
        begin += first * inner
        raw = self._all_bytes()[begin : begin + count * inner].view(item).reshape((count, *shape[1:]))
        return _widen(raw, dtype)


def _size(shape: tuple) -> int:
    size = 1
    for n in shape:
        size *= n
    return size
