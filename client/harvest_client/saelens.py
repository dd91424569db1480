"""A harvest as SAELens training data: its trainers' data providers and its activation cache.

SAELens 6 (`pip install "harvest-client[saelens]"`) trains from any iterator of activation
batches, `SAETrainer(cfg, sae, data_provider)`, and several SAEs in lockstep from an iterator
of `{hook name: batch}` dicts, `MultiSAETrainer(cfg, saes, hook_names, data_provider)`. What
the trainers expect, read from sae_lens 6.54's `training/sae_trainer.py` and
`training/multi_sae_trainer.py`, and what this module therefore yields:

- `next(data_provider)` is called until `total_training_samples` are consumed, and a
  `StopIteration` there is an error: the providers here repeat the corpus (a fresh shuffle
  each epoch) for ever unless `epochs` is given.
- `n_training_samples` grows by `batch.shape[0]`, but the feature-density counts add
  `train_batch_size_samples` per step: every batch has exactly `batch_size` rows (epochs run
  into each other; only a finite stream's last batch may be short).
- float32 `[batch_size, d_in]` on the CPU; the trainer moves it to the SAE's device and dtype.

The rows come from `ActivationDataset` (its shuffle buffer, so memory is bounded by
`buffer_size` vectors, not the corpus); what the dataset was opened with decides the rest:
`skip_bos=True` (its default) leaves each prompt's first position out, `normalize=True` gives
(x − mean)/std with the jobs' statistics merged exactly. `fold_normalization` then folds that
standardisation into a trained SAE, so the saved SAE reads raw residual-stream vectors.

A harvest keeps many layers in one pass; a layer k is SAELens' (TransformerLens')
`blocks.{k}.hook_resid_post`, the block's output before the final norm, which is what the
manifests' `residual_stream_convention` says the harvest holds. `multi_hook_data_provider`
yields every layer's rows of the same token positions (one shuffle buffer, one draw), and
`export_activation_cache` writes the Hugging Face dataset that SAELens' `CacheActivationsRunner`
writes and `ActivationsStore(cached_activations_path=…)` reads: one `Array2D(context_size,
d_in)` column per hook plus `token_ids`, with several hooks in one dataset rather than one
folder per hook.

`import harvest_client` does not import this module: torch, datasets and sae_lens are needed
only here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from harvest_client.dataset import ActivationDataset

__all__ = ["hook_name", "data_provider", "multi_hook_data_provider", "export_activation_cache", "fold_normalization",
           "sae_metadata"]


def hook_name(layer: int) -> str:
    """SAELens' (TransformerLens') name of block `layer`'s output: what a harvest's layer holds."""
    return f"blocks.{layer}.hook_resid_post"


def data_provider(dataset: ActivationDataset, batch_size: int, *, buffer_size: int = 65536, seed: int = 0,
                  epochs: int | None = None) -> Iterator[torch.Tensor]:
    """`SAETrainer`'s data_provider: float32 `[batch_size, d_in]` batches of `dataset`'s layer.

    Each epoch streams the shards in a new seeded order through a shuffle buffer of
    `buffer_size` vectors (`ActivationDataset.batches`); epochs follow each other without a
    short batch between them. `epochs=None` never ends (what `SAETrainer.fit` needs)."""
    _require_rows([dataset])
    epoch_batches = (_tensor(batch.vectors)
                     for epoch in _epochs(epochs)
                     for batch in dataset.batches(batch_size, shuffle=True, seed=_epoch_seed(seed, epoch),
                                                  buffer_size=buffer_size))
    return (columns[0] for columns in _exact_batches(((b,) for b in epoch_batches), batch_size))


def multi_hook_data_provider(datasets: Sequence[ActivationDataset], batch_size: int, *, buffer_size: int = 65536,
                             seed: int = 0, epochs: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """`MultiSAETrainer`'s data_provider: `{hook_name(layer): [batch_size, d_in]}`, the same token
    positions in every layer's batch (row i of each is the same token of the same prompt).

    `datasets`: one `ActivationDataset` per layer, opened on the same harvest with the same
    `skip_bos`. Rows of all layers travel through one shuffle buffer together, drawn by one
    random choice, so they stay aligned by construction."""
    _require_rows(datasets)
    _check_aligned(datasets)
    names = [hook_name(ds.layer) for ds in datasets]
    groups = _shard_prompts(datasets[0])
    epoch_columns = (tuple(_tensor(ds._finish(vectors)) for ds, vectors in zip(datasets, columns[:-1]))
                     for epoch in _epochs(epochs)
                     for columns in _shuffled_columns(datasets, groups, batch_size, buffer_size,
                                                      np.random.default_rng(_epoch_seed(seed, epoch))))
    return (dict(zip(names, columns)) for columns in _exact_batches(epoch_columns, batch_size))


def export_activation_cache(datasets: ActivationDataset | Sequence[ActivationDataset], path: str | os.PathLike, *,
                            context_size: int = 128, dtype: str = "float32", rows_per_read: int = 64):
    """Write the harvest as SAELens' cached-activations dataset at `path`; returns it (a
    `datasets.Dataset`, as `CacheActivationsRunner.run` does).

    The corpus-order token stream (each dataset's `skip_bos` and `normalize` apply) is cut into
    rows of `context_size` positions, as SAELens itself packs prompts into contexts; the last
    `len % context_size` vectors, too few for a row, are left out. One column per layer,
    `hook_name(layer)`: `Array2D((context_size, d_in), dtype)`, and `token_ids`: int32
    `[context_size]`. Train from it with `ActivationsStore(cached_activations_path=path,
    hook_name=…, context_size=context_size, d_in=…, …)` or a runner config's
    `use_cached_activations=True`. Memory: `rows_per_read` rows at a time."""
    from datasets import Array2D, Dataset, Features, Sequence as HFSequence, Value, load_from_disk

    datasets = [datasets] if isinstance(datasets, ActivationDataset) else list(datasets)
    _require_rows(datasets)
    _check_aligned(datasets)
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be 'float32' or 'float16' (what Arrow stores), not {dtype!r}")
    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; SAELens' cache runner refuses that too.")
    names = [hook_name(ds.layer) for ds in datasets]
    features = Features({**{name: Array2D(shape=(context_size, ds.n_features), dtype=dtype)
                            for name, ds in zip(names, datasets)},
                         "token_ids": HFSequence(Value("int32"), length=context_size)})
    out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".hf-cache-", dir=out.parent)
    try:
        # A fresh fingerprint: datasets would otherwise hash (pickle) the harvest to name its
        # cache. Tuples, not lists: datasets splits list arguments into shards of the generator.
        built = Dataset.from_generator(_cache_rows, features=features, cache_dir=scratch, fingerprint=uuid.uuid4().hex,
                                       gen_kwargs={"datasets": tuple(datasets), "names": tuple(names),
                                                   "context_size": context_size, "rows_per_read": rows_per_read})
        built.save_to_disk(str(out))  # the scratch copy, moved into SAELens' layout (written twice)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return load_from_disk(str(out))


def fold_normalization(sae, dataset: ActivationDataset) -> None:
    """Fold `dataset`'s standardisation (x − mean)/std into a SAE trained on its normalised
    rows, in place, with SAELens' own `fold_activation_whitening` (a diagonal whitening): the
    SAE then takes raw residual-stream vectors and gives raw reconstructions."""
    if not dataset.normalize:
        raise ValueError("The dataset was opened with normalize=False: there is nothing to fold.")
    std = np.where(dataset.std > 0, dataset.std, 1.0)  # as ActivationDataset divides
    sae.fold_activation_whitening(mean=torch.from_numpy(dataset.mean),
                                  whitening_matrix=torch.diag(torch.from_numpy(1.0 / std)),
                                  unwhitening_matrix=torch.diag(torch.from_numpy(std)))


def sae_metadata(dataset: ActivationDataset) -> dict:
    """What a SAE trained on `dataset` should carry in its `cfg.metadata` (JSON-safe)."""
    first = dataset.manifests[0]
    return {"model_name": first["model"]["name"], "hook_name": hook_name(dataset.layer), "hook_head_index": None,
            "prepend_bos": bool(first["add_special_tokens"]), "first_position_excluded": dataset.skip_bos,
            "harvest_job_ids": [m["job_id"] for m in dataset.manifests]}


# --- helpers -------------------------------------------------------------------------------
def _tensor(vectors) -> torch.Tensor:
    if isinstance(vectors, torch.Tensor):
        return vectors
    return torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))


def _epochs(epochs: int | None) -> Iterable[int]:
    epoch = 0
    while epochs is None or epoch < epochs:
        yield epoch
        epoch += 1


def _epoch_seed(seed: int, epoch: int) -> int:
    """A distinct stream per (seed, epoch): seed 0's second epoch is not seed 1's first."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _require_rows(datasets: Sequence[ActivationDataset]) -> None:
    if not datasets:
        raise ValueError("No dataset given.")
    if any(len(ds) == 0 for ds in datasets):
        raise ValueError("The harvest holds no vectors to train on (every prompt is a single start token?).")


def _check_aligned(datasets: Sequence[ActivationDataset]) -> None:
    """Several layers' datasets line up row for row only over the same jobs and positions."""
    first = datasets[0]
    for ds in datasets[1:]:
        if ds.parts != first.parts or ds.skip_bos != first.skip_bos or not np.array_equal(ds.n_tokens, first.n_tokens):
            raise ValueError("The datasets are not one harvest read the same way (same jobs, same skip_bos).")
    layers = [ds.layer for ds in datasets]
    if len(set(layers)) != len(layers):
        raise ValueError(f"A layer is given twice: {layers}")


def _shard_prompts(dataset: ActivationDataset) -> list[np.ndarray]:
    """The global prompt indices of each shard, in corpus order, from the manifests."""
    groups, offset = [], 0
    for manifest in dataset.manifests:
        for shard in manifest["shards"]:
            first, last = shard["prompt_range"]
            groups.append(np.arange(offset + first, offset + last + 1))
        offset += manifest["n_prompts"]
    return groups


def _shuffled_columns(datasets, groups, batch_size: int, buffer_size: int, rng: np.random.Generator):
    """One epoch of raw (un-normalised) `(layer₀ rows, layer₁ rows, …, prompt indices)` batches:
    shards in a random order through one shuffle buffer. The buffer is ActivationDataset's own
    (`_shuffled`, generic over column tuples), so single- and multi-layer reading shuffle alike."""
    def block(prompts):
        prompts = [int(p) for p in prompts if datasets[0]._counts[p]]
        if not prompts:
            return (*[np.zeros((0, ds.n_features), np.float32) for ds in datasets], np.zeros(0, np.int64))
        return (*[np.concatenate([ds._vectors_of(p) for p in prompts]) for ds in datasets],
                np.concatenate([np.full(int(datasets[0]._counts[p]), p, dtype=np.int64) for p in prompts]))

    blocks = (block(groups[s]) for s in rng.permutation(len(groups)))
    return ActivationDataset._shuffled(blocks, batch_size, max(buffer_size, batch_size), rng)


def _exact_batches(stream: Iterable[tuple[torch.Tensor, ...]], batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Re-cut a stream of column tuples (rows aligned across columns) into batches of exactly
    `batch_size` rows; only the end of a finite stream may give a shorter one."""
    pending: list[tuple[torch.Tensor, ...]] = []
    held = 0
    for columns in stream:
        if not len(columns[0]):
            continue
        pending.append(columns)
        held += len(columns[0])
        if held < batch_size:
            continue
        joined = [torch.cat(parts) for parts in zip(*pending)] if len(pending) > 1 else list(pending[0])
        whole = held // batch_size * batch_size
        for start in range(0, whole, batch_size):
            yield tuple(c[start : start + batch_size] for c in joined)
        rest = tuple(c[whole:] for c in joined)
        pending, held = ([rest], len(rest[0])) if len(rest[0]) else ([], 0)
    if held:
        yield tuple(torch.cat(parts) for parts in zip(*pending))


def _cache_rows(datasets, names, context_size: int, rows_per_read: int):
    """Rows of the activation cache, in corpus order: `context_size` positions each."""
    n_rows = len(datasets[0]) // context_size
    for first_row in range(0, n_rows, rows_per_read):
        rows = min(rows_per_read, n_rows - first_row)
        span = slice(first_row * context_size, (first_row + rows) * context_size)
        columns = {name: np.asarray(ds[span]).reshape(rows, context_size, ds.n_features)
                   for name, ds in zip(names, datasets)}
        tokens = datasets[0].token_ids[span].reshape(rows, context_size)
        for r in range(rows):
            yield {**{name: column[r] for name, column in columns.items()}, "token_ids": tokens[r]}
