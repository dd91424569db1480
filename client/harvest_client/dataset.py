"""`ActivationDataset`: one layer's token vectors over every job of a harvest, for training.

It reads what the service writes and nothing else: a folder of finished jobs (`part-*/` with
their manifests, as `Client.harvest` leaves it or as a scheduled corpus refresh writes its
dated prefix `corpus/<name>/<YYYY-MM-DD>/part-0000/`), or a single job's folder; local or any
fsspec URL (`s3://…`). The manifests give every prompt's shard, key and token count, so the
corpus order, the vector count and each vector's place are known before any shard is opened.

- Vectors come in corpus order: prompt by prompt, token by token. `skip_bos=True` leaves out
  each prompt's first position (the start token, whose norms are outliers; the same positions
  the statistics leave out).
- `normalize=True` gives (x − mean) / std with the corpus's mean/std merged exactly from the
  jobs' stats files (`harvest_client.stats`), never re-computed by a pass over the data.
- Map-style (`ds[i]`, `ds[a:b]`, `len(ds)`, and `for v in ds`, which yields the same vectors
  as `ds[0]`, `ds[1]`, …) for a torch DataLoader, and `ds.batches(…)` for
  streaming: shards in a seeded random order into a shuffle buffer of `buffer_size` vectors,
  batches drawn from it at random — memory bounded by the buffer, not the corpus.
- Local shards are memory-mapped; nothing is loaded whole. Projections read the same way.
- Out: numpy float32 by default, torch tensors with `output="torch"` (when torch is installed).
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass

import fsspec
import numpy as np

from harvest_client.shardfile import RemoteCache, ShardFile
from harvest_client.stats import Moments, merge_moments

__all__ = ["ActivationDataset", "Batch", "find_parts"]

_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass
class Batch:
    vectors: object
    """float32 `[n, n_features]` (numpy, or torch with output="torch")."""
    token_ids: object
    """int32 `[n]`: the token each vector is the residual stream at."""
    prompt_index: object
    """int64 `[n]`: the vector's prompt, as a global index into the corpus."""


def find_parts(fs, root: str) -> list[str]:
    """The job folders under `root`, in corpus order (folder name order).

    `root` is one job's folder (it holds manifest.json), a folder of job folders, or a corpus
    refresh's `corpus/<name>` (its newest dated prefix is taken). A job folder without its
    manifest is unfinished: refused, since reading around it would shift the corpus order."""
    root = root.rstrip("/")
    if fs.exists(posixpath.join(root, "manifest.json")):
        return [root]
    folders = sorted(entry["name"].rstrip("/") for entry in fs.ls(root, detail=True) if entry["type"] == "directory")
    days = [f for f in folders if _DAY.match(posixpath.basename(f))]
    if days and len(days) == len(folders):
        return find_parts(fs, days[-1])
    parts = [f for f in folders if posixpath.basename(f).startswith("part-")]
    if not parts:
        raise FileNotFoundError(f"{root} holds no harvest: no manifest.json, no part-* folders, no dated prefixes.")
    unfinished = [posixpath.basename(p) for p in parts if not fs.exists(posixpath.join(p, "manifest.json"))]
    if unfinished:
        raise FileNotFoundError(f"{root}: {', '.join(unfinished)} not finished (no manifest.json yet). "
                                "Call Client.harvest again to complete it.")
    return parts


class ActivationDataset:
    """Token vectors of one layer over every job under `source` (see the module docstring).

    layer: the block index (as in `layer_indices`); may be omitted when one layer was kept.
    storage_options: passed to fsspec (e.g. `{"client_kwargs": {"endpoint_url": …}}` for S3).
    """

    def __init__(self, source, layer: int | None = None, *, normalize: bool = False, skip_bos: bool = True,
                 output: str = "numpy", storage_options: dict | None = None):
        if output not in ("numpy", "torch"):
            raise ValueError(f"output must be 'numpy' or 'torch', not {output!r}")
        if output == "torch":
            import torch  # noqa: F401  (fail here, not in the middle of an epoch)
        self.output = output
        self.skip_bos = skip_bos
        self.normalize = normalize
        self.fs, root = fsspec.core.url_to_fs(str(source), **(storage_options or {}))
        local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.parts = find_parts(self.fs, root)
        self.manifests = [json.loads(self.fs.cat_file(posixpath.join(p, "manifest.json"))) for p in self.parts]
        self._check_compatible()
        first = self.manifests[0]
        self.layer_indices: list[int] = first["layer_indices"]
        self.contents: str = first["contents"]
        if layer is None:
            if len(self.layer_indices) != 1:
                raise ValueError(f"Pick a layer: the harvest kept {self.layer_indices}.")
            layer = self.layer_indices[0]
        if layer not in self.layer_indices:
            raise ValueError(f"Layer {layer} was not harvested; the files hold layers {self.layer_indices}.")
        self.layer = layer
        self._row = self.layer_indices.index(layer)
        cache = RemoteCache()
        self._shards: list[ShardFile] = []
        prompt_shard, prompt_key, n_tokens = [], [], []
        for part, manifest in zip(self.parts, self.manifests):
            for shard in manifest["shards"]:
                self._shards.append(ShardFile(self.fs, posixpath.join(part, shard["file"]), local=local, cache=cache))
                first_key, last_key = shard["prompt_range"]
                prompt_shard.extend([len(self._shards) - 1] * (last_key - first_key + 1))
                prompt_key.extend(range(first_key, last_key + 1))
                n_tokens.extend(shard["token_counts"])
        self._prompt_shard = np.asarray(prompt_shard, dtype=np.int64)
        self._prompt_key = np.asarray(prompt_key, dtype=np.int64)
        self.n_tokens = np.asarray(n_tokens, dtype=np.int64)
        """Tokens of each prompt of the corpus (start token included when it was added)."""
        self._skip = 1 if skip_bos else 0
        self._counts = np.maximum(self.n_tokens - self._skip, 0)
        self._ends = np.cumsum(self._counts)
        self._starts = self._ends - self._counts
        self._moments: Moments | None = None
        self._prompt_index: np.ndarray | None = None
        self._token_ids: np.ndarray | None = None

    def _check_compatible(self) -> None:
        first = self.manifests[0]
        for part, manifest in zip(self.parts, self.manifests):
            for field in ("layer_indices", "contents", "hidden_size", "projection"):
                if manifest.get(field) != first.get(field):
                    raise ValueError(f"{part} differs from {self.parts[0]} in {field}: "
                                     f"{manifest.get(field)!r} vs {first.get(field)!r}; it is not one harvest.")

    # --- shape ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def n_prompts(self) -> int:
        return len(self.n_tokens)

    @property
    def n_features(self) -> int:
        return self.moments.mean.shape[0]

    def __repr__(self) -> str:
        return (f"ActivationDataset({len(self):,} vectors of layer {self.layer} ({self.contents}), "
                f"{self.n_prompts:,} prompts in {len(self.parts)} jobs, normalize={self.normalize}, skip_bos={self.skip_bos})")

    # --- statistics -------------------------------------------------------------------------
    @property
    def moments(self) -> Moments:
        """The layer's count, mean and std over the whole corpus (float64), merged exactly
        from the jobs' stats files: every position but each prompt's first."""
        if self._moments is None:
            from safetensors.numpy import load

            parts = []
            for part in self.parts:
                stats = load(self.fs.cat_file(posixpath.join(part, "stats.safetensors")))
                parts.append(Moments(int(stats["count"]), stats["mean"][self._row].astype(np.float64),
                                     stats["std"][self._row].astype(np.float64)))
            self._moments = merge_moments(parts)
        return self._moments

    @property
    def mean(self) -> np.ndarray:
        return self.moments.mean

    @property
    def std(self) -> np.ndarray:
        return self.moments.std

    # --- per-vector metadata ----------------------------------------------------------------
    @property
    def prompt_index(self) -> np.ndarray:
        """int64 `[len]`: each vector's prompt (global index)."""
        if self._prompt_index is None:
            self._prompt_index = np.repeat(np.arange(self.n_prompts, dtype=np.int64), self._counts)
        return self._prompt_index

    @property
    def position(self) -> np.ndarray:
        """int64 `[len]`: each vector's token position in its prompt (0 is the start token)."""
        return np.arange(len(self), dtype=np.int64) - np.repeat(self._starts, self._counts) + self._skip

    @property
    def token_ids(self) -> np.ndarray:
        """int32 `[len]`: each vector's token id (reads every shard's small `tokens_i` tensors)."""
        if self._token_ids is None:
            self._token_ids = np.concatenate([self._tokens_of(p) for p in range(self.n_prompts)]) if self.n_prompts else np.zeros(0, np.int32)
        return self._token_ids

    def _tokens_of(self, p: int) -> np.ndarray:
        shard = self._shards[self._prompt_shard[p]]
        return shard.read(f"tokens_{self._prompt_key[p]}")[self._skip :].astype(np.int32)

    # --- reading ----------------------------------------------------------------------------
    def _vectors_of(self, p: int, first: int = 0, count: int | None = None) -> np.ndarray:
        """Prompt p's vectors `[count, features]` from its `first` counted position on."""
        count = int(self._counts[p]) - first if count is None else count
        shard = self._shards[self._prompt_shard[p]]
        return shard.read(f"prompt_{self._prompt_key[p]}", first=self._skip + first, count=count, row=self._row)

    def _finish(self, vectors: np.ndarray):
        if self.normalize:
            moments = self.moments
            std = np.where(moments.std > 0, moments.std, 1.0)
            vectors = ((vectors - moments.mean) / std).astype(np.float32)
        else:
            vectors = np.array(vectors, dtype=np.float32, copy=True)  # never hand out a read-only map
        return self._out(vectors)

    def _out(self, array: np.ndarray):
        if self.output == "torch":
            import torch

            return torch.from_numpy(array)
        return array

    def __getitem__(self, index):
        """`ds[i]` → one vector `[features]`; `ds[a:b]` or `ds[array]` → `[n, features]`."""
        if isinstance(index, slice):
            return self._gather(np.arange(*index.indices(len(self))))
        if np.ndim(index) > 0:
            return self._gather(np.asarray(index, dtype=np.int64))
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} vectors")
        p = int(np.searchsorted(self._ends, i, side="right"))
        return self._finish(self._vectors_of(p, i - int(self._starts[p]), 1)[0])

    def _gather(self, indices: np.ndarray) -> object:
        indices = np.where(indices < 0, indices + len(self), indices)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"indices out of range for {len(self)} vectors")
        order = np.argsort(indices, kind="stable")
        ordered = indices[order]
        prompts = np.searchsorted(self._ends, ordered, side="right")
        out = np.empty((len(indices), self.n_features), dtype=np.float32)
        cuts = np.flatnonzero(np.diff(prompts)) + 1
        for group in np.split(np.arange(len(ordered)), cuts) if len(ordered) else []:  # one read per prompt
            p = int(prompts[group[0]])
            out[order[group]] = self._vectors_of(p)[ordered[group] - self._starts[p]]
        return self._finish(out)

    def prompt(self, p: int) -> Batch:
        """Every vector of global prompt `p`, with its tokens."""
        return Batch(self._finish(self._vectors_of(p)), self._out(self._tokens_of(p)),
                     self._out(np.full(int(self._counts[p]), p, dtype=np.int64)))

    def batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0, buffer_size: int = 65536,
                drop_last: bool = False):
        """Batches of `batch_size` vectors with their token ids and prompt indices.

        shuffle=False: corpus order. shuffle=True: shards in a random order (from `seed`)
        stream into a buffer of `buffer_size` vectors and each batch is drawn from it at
        random, so an epoch is a permutation mixed across shards and jobs, in bounded memory.
        """
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(self._shards)) if shuffle else np.arange(len(self._shards))
        by_shard = np.split(np.arange(self.n_prompts), np.flatnonzero(np.diff(self._prompt_shard)) + 1) if self.n_prompts else []
        blocks = (self._block(by_shard[s]) for s in order)
        source = self._shuffled(blocks, batch_size, max(buffer_size, batch_size), rng) if shuffle else self._in_order(blocks, batch_size)
        for vectors, tokens, prompts in source:
            if drop_last and len(vectors) < batch_size:
                return
            yield Batch(self._finish(vectors), self._out(tokens), self._out(prompts))

    def __iter__(self):
        """`for v in ds` yields what `ds[i]` yields, one vector `[features]` at a time, in
        corpus order (read a shard at a time); use `ds.batches(...)` for batches."""
        for batch in self.batches(4096):
            yield from batch.vectors

    def _block(self, prompts: np.ndarray):
        """One shard's vectors, tokens and prompt indices, read prompt by prompt."""
        prompts = [int(p) for p in prompts if self._counts[p]]
        if not prompts:
            return (np.zeros((0, self.n_features), np.float32), np.zeros(0, np.int32), np.zeros(0, np.int64))
        return (np.concatenate([self._vectors_of(p) for p in prompts]),
                np.concatenate([self._tokens_of(p) for p in prompts]),
                np.concatenate([np.full(int(self._counts[p]), p, dtype=np.int64) for p in prompts]))

    @staticmethod
    def _in_order(blocks, batch_size: int):
        pending: list[tuple] = []
        held = 0
        for block in blocks:
            pending.append(block)
            held += len(block[0])
            while held >= batch_size:
                joined = [np.concatenate(column) for column in zip(*pending)]
                yield tuple(c[:batch_size] for c in joined)
                rest = tuple(c[batch_size:] for c in joined)
                pending, held = [rest], len(rest[0])
        if held:
            yield tuple(np.concatenate(column) for column in zip(*pending))

    @staticmethod
    def _shuffled(blocks, batch_size: int, buffer_size: int, rng: np.random.Generator):
        """A shuffle buffer of fixed size: once full, each batch takes `batch_size` random slots
        and the stream refills exactly those slots, so a batch costs O(batch), not O(buffer)."""
        stream = _Rows(blocks)
        buffer = stream.take(buffer_size)
        if buffer is None:
            return
        while True:
            take = rng.choice(len(buffer[0]), size=min(batch_size, len(buffer[0])), replace=False)
            yield tuple(column[take] for column in buffer)
            refill = stream.take(len(take))
            if refill is None or len(refill[0]) < len(take):  # the stream ran dry: drain the rest
                keep = np.ones(len(buffer[0]), dtype=bool)
                keep[take] = False
                rest = [column[keep] for column in buffer]
                if refill is not None:
                    rest = [np.concatenate(pair) for pair in zip(rest, refill)]
                order = rng.permutation(len(rest[0]))
                for start in range(0, len(order), batch_size):
                    yield tuple(column[order[start : start + batch_size]] for column in rest)
                return
            for column, new in zip(buffer, refill):
                column[take] = new


class _Rows:
    """Rows pulled `n` at a time from a stream of (vectors, tokens, prompts) blocks."""

    def __init__(self, blocks):
        self.blocks = iter(blocks)
        self.pending: list[tuple] = []
        self.held = 0

    def take(self, n: int) -> tuple | None:
        while self.held < n:
            block = next(self.blocks, None)
            if block is None:
                break
            if len(block[0]):
                self.pending.append(block)
                self.held += len(block[0])
        if not self.held:
            return None
        joined = [np.concatenate(column) for column in zip(*self.pending)] if len(self.pending) > 1 else list(self.pending[0])
        out = tuple(np.array(c[:n]) for c in joined)
        rest = tuple(c[n:] for c in joined)
        self.pending = [rest] if len(rest[0]) else []
        self.held = len(rest[0])
        return out
