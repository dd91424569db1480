"""A shard file written as its values arrive, so no process ever holds a whole shard.

A shard's safetensors layout depends only on what is known before its forward pass: the
prompts' token counts, the layers kept, the features per position and the stored dtype. So
`shard_layout` works out the header and every tensor's byte range up front, exactly as
`safetensors.torch.save` would lay the same tensors out (tensors ordered by dtype then name,
the header JSON compact and padded with spaces to 8 bytes); a test holds the two to the same
bytes.

`StagedShard` is that file on local disk: the header and the token ids are written when it is
made, then each prompt's values at their own offset as the engine hands them over (`put`, the
engine's sink), in whatever order the engine's batches produce them. Nothing of a prompt stays
in memory once written. `seal` checks every prompt arrived and hashes the file in one
sequential read (the prompts arrive out of file order, so the hash cannot be taken as they
come); `Storage.publish_file` then links it into place (local disk) or uploads it as one
multipart upload (S3), create-once: if another write of the shard got there first, this file is
dropped and the stored one stands (`superseded`). A shard's memory is thus one engine batch,
whatever `shard_size` says.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save as save_tensors

from harvest.storage import stream_digest

__all__ = ["ShardLayout", "shard_layout", "StagedShard"]

_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32"}


def _tensor_order(entries: dict[str, tuple[torch.dtype, int]]) -> list[str]:
    """The order safetensors puts these tensors in (dtype first, then name), asked of the
    library itself with one empty tensor per name, so a change of its rule cannot go unseen."""
    empty = {name: torch.empty((0,) * ndim, dtype=dtype) for name, (dtype, ndim) in entries.items()}
    raw = save_tensors(empty)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    offsets = {name: tuple(info["data_offsets"]) for name, info in header.items() if name != "__metadata__"}
    # Every empty tensor starts at 0: the JSON's order is the library's order.
    return list(offsets)


class ShardLayout:
    """Where each tensor of one shard file lies: the header bytes and absolute byte ranges."""

    def __init__(self, header: bytes, ranges: dict[str, tuple[int, int]], size: int):
        self.header = header
        """The file's first bytes: 8 bytes of JSON length, then the JSON (space-padded)."""
        self.ranges = ranges
        """Tensor name → `(start, end)` byte offsets in the file."""
        self.size = size
        """Total file size in bytes."""


def shard_layout(indices: range, token_counts: list[int], n_layers: int, n_features: int, dtype: torch.dtype) -> ShardLayout:
    """The layout of the shard holding prompts `indices`: `prompt_{i}` `[n_layers, n_tokens,
    n_features]` in `dtype` and `tokens_{i}` int32 `[n_tokens]` (`harvest.shards`)."""
    shapes: dict[str, tuple[torch.dtype, list[int]]] = {}
    for i, n in zip(indices, token_counts, strict=True):
        shapes[f"prompt_{i}"] = (dtype, [n_layers, n, n_features])
        shapes[f"tokens_{i}"] = (torch.int32, [n])
    order = _tensor_order({name: (dt, len(shape)) for name, (dt, shape) in shapes.items()})
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    relative: dict[str, tuple[int, int]] = {}
    offset = 0
    for name in order:
        dt, shape = shapes[name]
        n_bytes = torch.empty(0, dtype=dt).element_size() * _product(shape)
        entries[name] = {"dtype": _DTYPE_NAMES[dt], "shape": shape, "data_offsets": [offset, offset + n_bytes]}
        relative[name] = (offset, offset + n_bytes)
        offset += n_bytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    header = len(text).to_bytes(8, "little") + text
    base = len(header)
    return ShardLayout(header, {name: (base + a, base + b) for name, (a, b) in relative.items()}, base + offset)


def _product(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class StagedShard:
    """One shard file being filled on local disk at `path` (see the module docstring).

    `put(position, value)` is the engine's sink: `position` is the prompt's place in the shard
    (0-based), `value` its host tensor `[n_layers, n_tokens, n_features]` in the stored dtype.
    A prompt written twice (an engine call asked again after its server died) is simply
    overwritten at the same offset.
    """

    def __init__(self, path: str, indices: range, tokens: list[list[int]], n_layers: int, n_features: int, dtype: torch.dtype):
        self.path = path
        self.indices = indices
        self.dtype = dtype
        self.shapes = [(n_layers, len(ids), n_features) for ids in tokens]
        self.n_tokens = sum(len(ids) for ids in tokens)
        self.layout = shard_layout(indices, [len(ids) for ids in tokens], n_layers, n_features, dtype)
        self._missing = set(range(len(tokens)))
        self.size: int | None = None
        self.sha256: str | None = None
        self.published = False
        """The file has left local disk: its name on storage is settled (see `superseded`)."""
        self.superseded = False
        """Its name was taken by another write of the shard, whose file stands instead."""
        self._fd: int | None = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(self._fd, self.layout.size)  # sparse until the values land
            _pwrite_all(self._fd, self.layout.header, 0)
            for i, ids in zip(indices, tokens, strict=True):
                _pwrite_all(self._fd, torch.tensor(ids, dtype=torch.int32).numpy().tobytes(), self.layout.ranges[f"tokens_{i}"][0])
        except BaseException:
            self.discard()
            raise

    def put(self, position: int, value: torch.Tensor) -> None:
        """Write prompt `position`'s values at their place in the file."""
        if self._fd is None:
            raise RuntimeError(f"shard file {self.path} is closed")
        if tuple(value.shape) != self.shapes[position] or value.dtype != self.dtype:
            raise RuntimeError(
                f"prompt {self.indices[position]}: the engine gave {tuple(value.shape)} {value.dtype}, "
                f"the shard holds {self.shapes[position]} {self.dtype}"
            )
        start, end = self.layout.ranges[f"prompt_{self.indices[position]}"]
        data = value.detach().contiguous().view(torch.uint8).numpy()  # the stored bytes, no copy
        assert data.nbytes == end - start
        _pwrite_all(self._fd, data, start)
        self._missing.discard(position)

    def seal(self) -> tuple[int, str]:
        """Close the file once every prompt is in; returns its size and sha256 (one read)."""
        if self.sha256 is not None:
            return self.size, self.sha256
        if self._missing:
            missing = sorted(self.indices[p] for p in self._missing)
            raise RuntimeError(f"the engine returned no values for prompt(s) {missing[:10]} of this shard")
        os.close(self._fd)
        self._fd = None
        with open(self.path, "rb", buffering=0) as handle:
            size, sha256 = stream_digest(handle)
        if size != self.layout.size:
            raise RuntimeError(f"shard file {self.path} holds {size} bytes, its layout {self.layout.size}")
        self.size, self.sha256 = size, sha256
        return self.size, self.sha256

    def discard(self) -> None:
        """Remove the staged file (a failed or cancelled shard); nothing once it is published."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.published:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
