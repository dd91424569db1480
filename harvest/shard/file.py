"""A shard file written as its values arrive, so no process ever holds a whole shard.

A shard's safetensors layout depends only on what is known before its forward pass: the
prompts' token counts, the layers kept, the features per position and the stored dtype. So
`shard_layout` works out the header and every tensor's byte range up front, exactly as
`safetensors.torch.save` would lay the same tensors out (tensors ordered by dtype then name,
the header JSON compact and padded with spaces to 8 bytes); a test holds the two to the same
bytes.

`StagedShard` is that file on local disk: the header and the token ids are written when it is
made, then each prompt's values at their own offset as the engine hands them over, in whatever
order the engine's batches produce them (`ShardFill`, the engine's sink). The sha256 is taken as
the values are written, from the same memory (`OrderedDigest`), so nobody reads the file back to
hash it. A run whose engine lives in the host's engine server hands the server the file itself
(its descriptor, over the Unix socket): the server writes the values and hashes them, and they
never cross the socket (`harvest.warm`). `seal` checks every prompt arrived; `Storage.publish_file`
then links the file into place (local disk) or uploads it as one multipart upload (S3),
create-once: if another write of the shard got there first, this file is dropped and the stored
one stands (`superseded`). A shard's memory is thus one engine batch (and the few values held
for the hash, below), whatever `shard_size` says.

A hash runs in file order, and the engine hands prompts over in its batches' order (longest
first, packed), not the file's (dtype, then name: `prompt_10` before `prompt_2`). So a value
that comes before its turn is held, up to `HOLD_BYTES`, and hashed when its turn comes; past
that, its bytes are read back from the file when their turn comes (`read_back_bytes` says how
many, for the benches).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save as save_tensors

__all__ = ["ShardLayout", "shard_layout", "OrderedDigest", "ShardFill", "FileDigest", "StagedShard", "HOLD_BYTES"]

HOLD_BYTES = 16 << 20
"""Values held in memory while they wait for their turn in the hash, per shard being filled: a
small share of a piece (`HARVEST_ENGINE_PIECE_BYTES`, 256 MiB), so the engine server's memory
stays the README's. Past it a value is read back from the page cache when its turn comes: a
copy, beside the hash that every byte costs anyway."""

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
        """Tensor name → `(start, end)` byte offsets in the file, in file order."""
        self.size = size
        """Total file size in bytes."""


def shard_layout(indices: range, token_counts: list[int], n_layers: int, n_features: int, dtype: torch.dtype) -> ShardLayout:
    """The layout of the shard holding prompts `indices`: `prompt_{i}` `[n_layers, n_tokens,
    n_features]` in `dtype` and `tokens_{i}` int32 `[n_tokens]` (`harvest.shard.record`)."""
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


_READ_BACK_CHUNK = 8 << 20


class OrderedDigest:
    """The sha256 of a file whose pieces (the layout's tensors and its header) are written in
    any order: each piece is hashed when its turn in file order comes, from the memory it was
    written from where it is still held (`HOLD_BYTES` at most), else read back from `fd`."""

    def __init__(self, fd: int, layout: ShardLayout, hold_bytes: int = HOLD_BYTES):
        self.fd = fd
        self.order = ["__header__", *layout.ranges]
        self.place = {name: i for i, name in enumerate(self.order)}
        self.ranges = {"__header__": (0, len(layout.header)), **layout.ranges}
        self.size = layout.size
        self.hold_bytes = hold_bytes
        self.read_back_bytes = 0
        self._sha = hashlib.sha256()
        self._next = 0  # index into `order` of the first piece not hashed yet
        self._written: set[str] = set()
        self._held: dict[str, memoryview] = {}
        self._held_bytes = 0

    def written(self, name: str, data=None) -> None:
        """Piece `name` is in the file now, its bytes `data` (valid during this call only), or
        without them: read back when its turn comes."""
        if self.place[name] < self._next:
            raise RuntimeError(f"{name} was written again after it was hashed")
        if name in self._held:  # written again before its turn: the later bytes stand
            self._held_bytes -= self._held.pop(name).nbytes
        self._written.add(name)
        if data is None:
            self._advance()
            return
        if self.order[self._next] == name:
            self._sha.update(data)
            self._next += 1
            self._advance()
            return
        view = memoryview(data).cast("B")
        if self._held_bytes + view.nbytes <= self.hold_bytes:
            # `data` may be a view of an engine buffer that is reused: hold a copy of our own.
            self._held[name] = memoryview(bytes(view))
            self._held_bytes += view.nbytes

    def _advance(self) -> None:
        """Hash every piece whose turn has come and which is in the file."""
        while self._next < len(self.order) and self.order[self._next] in self._written:
            name = self.order[self._next]
            held = self._held.pop(name, None)
            if held is not None:
                self._sha.update(held)
                self._held_bytes -= held.nbytes
            else:
                self._read_back(*self.ranges[name])
            self._next += 1

    def _read_back(self, start: int, end: int) -> None:
        while start < end:
            chunk = os.pread(self.fd, min(_READ_BACK_CHUNK, end - start), start)
            if not chunk:
                raise RuntimeError(f"the shard file ends at byte {start}, its layout at {end}")
            self._sha.update(chunk)
            self.read_back_bytes += len(chunk)
            start += len(chunk)

    def hexdigest(self) -> str:
        """The file's sha256; every piece must have been written."""
        missing = [name for name in self.order[self._next:] if name not in self._written]
        if missing:
            raise RuntimeError(f"the shard file is missing {missing[:5]}")
        self._advance()
        return self._sha.hexdigest()


@dataclass
class FileDigest:
    """A filled shard file's size and sha256, and the bytes its hash had to read back."""

    size: int
    sha256: str
    read_back_bytes: int = 0


class ShardFill:
    """The engine's sink into one shard file open as `fd` (its header and token ids already in
    it, `known` their bytes): `put(position, value)` writes prompt `position`'s values at
    their place and hashes them in turn (`OrderedDigest`); `finish()` checks every prompt came
    and gives the file's digest. The run fills its own staged file this way with an engine in
    its process; the engine server fills a file handed to it."""

    def __init__(self, fd: int, indices: range, token_counts: list[int], n_layers: int, n_features: int,
                 dtype: torch.dtype, known: dict[str, bytes] | None = None, hold_bytes: int = HOLD_BYTES):
        self.fd = fd
        self.indices = indices
        self.dtype = dtype
        self.shapes = [(n_layers, n, n_features) for n in token_counts]
        self.layout = shard_layout(indices, token_counts, n_layers, n_features, dtype)
        size = os.fstat(fd).st_size
        if size != self.layout.size:
            raise RuntimeError(f"the shard file holds {size} bytes, its layout {self.layout.size}: not this shard's file")
        self.digest = OrderedDigest(fd, self.layout, hold_bytes)
        known = known or {}
        for name in ["__header__", *(f"tokens_{i}" for i in indices)]:  # in the file already
            self.digest.written(name, known.get(name))
        self._missing = set(range(len(token_counts)))

    def put(self, position: int, value: torch.Tensor) -> None:
        if tuple(value.shape) != self.shapes[position] or value.dtype != self.dtype:
            raise RuntimeError(
                f"prompt {self.indices[position]}: the engine gave {tuple(value.shape)} {value.dtype}, "
                f"the shard holds {self.shapes[position]} {self.dtype}"
            )
        name = f"prompt_{self.indices[position]}"
        start, end = self.layout.ranges[name]
        data = value.detach().contiguous().view(torch.uint8).reshape(-1).numpy()  # the stored bytes, no copy
        assert data.nbytes == end - start
        _pwrite_all(self.fd, data, start)
        self.digest.written(name, data)
        self._missing.discard(position)

    __call__ = put  # a `harvest.engines.base.ValueSink`

    def finish(self) -> FileDigest:
        if self._missing:
            missing = sorted(self.indices[p] for p in self._missing)
            raise RuntimeError(f"the engine returned no values for prompt(s) {missing[:10]} of this shard")
        return FileDigest(self.layout.size, self.digest.hexdigest(), self.digest.read_back_bytes)


class StagedShard:
    """One shard file being filled on local disk at `path` (see the module docstring).

    It is the engine's sink (`put(position, value)`, or the object called): `position` is the
    prompt's place in the shard (0-based), `value` its host tensor `[n_layers, n_tokens,
    n_features]` in the stored dtype. A prompt written twice (an engine call asked again after
    its server died) is simply overwritten at the same offset. An engine server fills it
    instead through its descriptor (`fd`, `first_index`), and hands back the digest
    (`filled_elsewhere`).
    """

    def __init__(self, path: str, indices: range, tokens: list[list[int]], n_layers: int, n_features: int, dtype: torch.dtype,
                 *, hold_bytes: int = HOLD_BYTES):
        self.path = path
        self.indices = indices
        self.dtype = dtype
        self.n_tokens = sum(len(ids) for ids in tokens)
        self.layout = shard_layout(indices, [len(ids) for ids in tokens], n_layers, n_features, dtype)
        self.size: int | None = None
        self.sha256: str | None = None
        self.read_back_bytes = 0
        """Bytes the hash read back from the file (values that came too early to be held)."""
        self.published = False
        """The file has left local disk: its name on storage is settled (see `superseded`)."""
        self.superseded = False
        """Its name was taken by another write of the shard, whose file stands instead."""
        self._fd: int | None = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
        self._elsewhere: FileDigest | None = None
        try:
            os.ftruncate(self._fd, self.layout.size)  # sparse until the values land
            known = {"__header__": self.layout.header}
            _pwrite_all(self._fd, self.layout.header, 0)
            for i, ids in zip(indices, tokens, strict=True):
                known[f"tokens_{i}"] = token_bytes(ids)
                _pwrite_all(self._fd, known[f"tokens_{i}"], self.layout.ranges[f"tokens_{i}"][0])
            self._fill = ShardFill(self._fd, indices, [len(ids) for ids in tokens], n_layers, n_features, dtype, known,
                                   hold_bytes)
        except BaseException:
            self.discard()
            raise

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"shard file {self.path} is closed")
        return self._fd

    @property
    def first_index(self) -> int:
        return self.indices.start

    def put(self, position: int, value: torch.Tensor) -> None:
        """Write prompt `position`'s values at their place in the file."""
        if self._fd is None:
            raise RuntimeError(f"shard file {self.path} is closed")
        self._fill.put(position, value)

    __call__ = put

    def filled_elsewhere(self, digest: FileDigest) -> None:
        """An engine server filled the file through its descriptor; this is its digest."""
        if digest.size != self.layout.size:
            raise RuntimeError(f"the engine server filled {digest.size} bytes of shard file {self.path}, its layout {self.layout.size}")
        self._elsewhere = digest

    def seal(self) -> tuple[int, str]:
        """Close the file once every prompt is in; returns its size and sha256, taken as the
        values were written (nothing is read again but what `read_back_bytes` says)."""
        if self.sha256 is not None:
            return self.size, self.sha256
        digest = self._elsewhere or self._fill.finish()
        os.close(self._fd)
        self._fd = None
        self.size, self.sha256, self.read_back_bytes = digest.size, digest.sha256, digest.read_back_bytes
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


def token_bytes(ids: list[int]) -> bytes:
    """A prompt's `tokens_{i}` tensor as the file holds it: int32, little-endian."""
    return torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
