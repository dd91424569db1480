"""`harvest_client.saelens` against SAELens 6.54 itself, on real harvest files.

The harvest: two real jobs of `llama-tiny` written by the core pipeline (`run_job`, the
session's HF engine) into `part-0000/` and `part-0001/`, as `Client.harvest` leaves a folder.
The reference: every shard read with safetensors, normalised in numpy float64 over the
vectors themselves (not from the stats files, not with the client's merge). SAELens' own code
does the rest: its `ActivationsStore` reads the exported cache, its `SAETrainer` and
`MultiSAETrainer` consume the providers, its `SAE.load_from_disk` reads the saved SAE.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from harvest.pipeline import run_job
from harvest.request import HarvestRequest, resolve_job
from harvest.storage import Storage
from harvest_client import ActivationDataset
from harvest_client.saelens import (
    data_provider,
    export_activation_cache,
    fold_normalization,
    hook_name,
    multi_hook_data_provider,
    sae_metadata,
)

LAYERS = [1, 3, 5]
SHARD_SIZE = 8
# Prompts of about 8 to 20 tokens; the number first, so that most vectors are unique (a vector
# repeats only where two prompts share their prefix: the start token, "Item", a first digit).
PROMPTS = [f"Item {i}: " + "the residual stream " * (1 + i % 5) for i in range(120)]


@pytest.fixture(scope="module")
def harvest(registry, hf_engine, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saelens") / "harvest"
    for k, chunk in enumerate([PROMPTS[:70], PROMPTS[70:]]):  # two jobs of different sizes
        job = resolve_job(HarvestRequest(model="llama-tiny", prompts=chunk, layers=LAYERS, shard_size=SHARD_SIZE), registry)
        run_job(job, Storage(f"file://{out}/part-{k:04d}"), hf_engine, f"saelens-{k}")
    return out


def _reference(out: Path, layer: int) -> dict[str, np.ndarray]:
    """Every position of `layer` in corpus order, read with safetensors: vectors (float64),
    tokens, prompt index, position, shard (global index)."""
    vectors, tokens, prompts, positions, shards = [], [], [], [], []
    offset = shard_no = 0
    for part in sorted(out.glob("part-*")):
        manifest = json.loads((part / "manifest.json").read_text())
        row = manifest["layer_indices"].index(layer)
        for shard in manifest["shards"]:
            tensors = load_file(str(part / shard["file"]))
            for key in range(shard["prompt_range"][0], shard["prompt_range"][1] + 1):
                values = tensors[f"prompt_{key}"][row].float().numpy().astype(np.float64)
                vectors.append(values)
                tokens.append(tensors[f"tokens_{key}"].numpy())
                prompts.append(np.full(len(values), offset + key))
                positions.append(np.arange(len(values)))
                shards.append(np.full(len(values), shard_no))
            shard_no += 1
        offset += manifest["n_prompts"]
    ref = {"vectors": np.concatenate(vectors), "tokens": np.concatenate(tokens), "prompt": np.concatenate(prompts),
           "position": np.concatenate(positions), "shard": np.concatenate(shards)}
    counted = ref["position"] > 0
    x = ref["vectors"][counted]
    ref["normalized"] = (ref["vectors"] - x.mean(axis=0)) / x.std(axis=0)  # numpy float64 over the counted positions
    return ref


def _sorted_rows(x: np.ndarray) -> np.ndarray:
    return x[np.lexsort(x.T[::-1])]


def _where(ref: dict, rows: np.ndarray) -> list[set[int]]:
    """For each raw row, the reference positions (indices) holding exactly that vector."""
    index: dict[bytes, set[int]] = {}
    for i, v in enumerate(ref["vectors"].astype(np.float32)):
        index.setdefault(v.tobytes(), set()).add(i)
    return [index.get(np.asarray(r, dtype=np.float32).tobytes(), set()) for r in rows]


def test_provider_yields_each_counted_vector_once_normalised_without_the_first_position(harvest):
    ref = _reference(harvest, 3)
    counted = ref["position"] > 0
    ds = ActivationDataset(harvest, layer=3, normalize=True)
    batches = list(data_provider(ds, 100, buffer_size=300, epochs=1))
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 and b.device.type == "cpu" for b in batches)
    assert [len(b) for b in batches[:-1]] == [100] * (len(batches) - 1) and 0 < len(batches[-1]) <= 100
    got = torch.cat(batches).numpy()
    assert len(got) == counted.sum() == len(ref["vectors"]) - 120
    # The same multiset of vectors, normalised by the corpus's own mean/std (float64, numpy).
    np.testing.assert_allclose(_sorted_rows(got), _sorted_rows(ref["normalized"][counted]), rtol=1e-5, atol=1e-5)
    # Shuffled: the first batch is not the corpus's first 100 counted vectors.
    assert not np.allclose(got[:100], ref["normalized"][counted][:100], atol=1e-3)

    # Raw: exactly the stored values; the first position (the start token's vector, the same
    # in every prompt up to the rounding of the packed pass it ran in: a row's place in a
    # batched matmul can change its last bf16 bit) never comes out, and comes out once per
    # prompt with skip_bos=False.
    raw = torch.cat(list(data_provider(ActivationDataset(harvest, layer=3), 128, epochs=1))).numpy()
    assert np.array_equal(_sorted_rows(raw.astype(np.float64)), _sorted_rows(ref["vectors"][counted]))
    bos = ref["vectors"][ref["position"] == 0]
    np.testing.assert_allclose(bos, np.broadcast_to(bos[0], bos.shape), rtol=1e-2, atol=1e-2)
    starts = {v.astype(np.float32).tobytes() for v in bos}
    assert not any(row.tobytes() in starts for row in raw.astype(np.float32))
    assert np.all(ref["tokens"][ref["position"] == 0] == json.loads((harvest / "part-0000" / "manifest.json").read_text())["bos_token_id"])
    with_bos = torch.cat(list(data_provider(ActivationDataset(harvest, layer=3, skip_bos=False), 128, epochs=1))).numpy()
    assert sum(row.tobytes() in starts for row in with_bos.astype(np.float32)) == 120 and len(with_bos) == len(ref["vectors"])
    assert np.array_equal(_sorted_rows(with_bos.astype(np.float64)), _sorted_rows(ref["vectors"]))


def test_epochs_join_into_exact_batches_and_the_shuffle_buffer_bounds_what_is_read(harvest):
    ref = _reference(harvest, 3)
    ds = ActivationDataset(harvest, layer=3)
    n = len(ds)
    # Endless by default; every batch exactly batch_size rows, across epoch boundaries.
    stream = data_provider(ds, 128)
    sizes = [len(next(stream)) for _ in range(3 * n // 128 + 2)]
    assert set(sizes) == {128}
    two = torch.cat(list(data_provider(ds, 128, epochs=2))).numpy()
    assert len(two) == 2 * n and not np.array_equal(two[:n], two[n:])  # a new shuffle each epoch

    def shards_of_first_batch(buffer_size):
        first = next(data_provider(ds, 32, buffer_size=buffer_size, seed=3)).numpy()
        shards = [{int(ref["shard"][i]) for i in hits} for hits in _where(ref, first)]
        return set().union(*(s for s in shards if len(s) == 1))  # rows found in one shard only

    shards_per_job = [len(json.loads((p / "manifest.json").read_text())["shards"]) for p in sorted(harvest.glob("part-*"))]
    smallest_shard = min(np.bincount(ref["shard"][ref["position"] > 0]))
    # A buffer smaller than a shard: the first batch comes from the first shard read alone.
    assert len(shards_of_first_batch(smallest_shard)) == 1
    # A buffer holding the whole corpus: the same first batch mixes many shards.
    assert len(shards_of_first_batch(n)) >= 6 and sum(shards_per_job) >= 15


def test_multi_hook_provider_aligns_the_layers_on_the_same_token_positions(harvest):
    refs = {layer: _reference(harvest, layer) for layer in LAYERS}
    # Layer 1 raw (to locate each row exactly), layers 3 and 5 normalised.
    datasets = [ActivationDataset(harvest, layer=1)] + [ActivationDataset(harvest, layer=k, normalize=True) for k in (3, 5)]
    batches = list(multi_hook_data_provider(datasets, 64, buffer_size=200, seed=1, epochs=1))
    names = [hook_name(k) for k in LAYERS]
    assert all(list(b) == names for b in batches) and names[0] == "blocks.1.hook_resid_post"
    assert all(len(b[name]) == 64 for b in batches[:-1] for name in names)
    rows = {name: torch.cat([b[name] for b in batches]).numpy() for name in names}
    counted = refs[1]["position"] > 0
    assert np.array_equal(_sorted_rows(rows[names[0]].astype(np.float64)), _sorted_rows(refs[1]["vectors"][counted]))
    where = _where(refs[1], rows[names[0]])
    assert all(where) and not any(refs[1]["position"][i] == 0 for hits in where for i in hits)
    assert sum(len(hits) == 1 for hits in where) > 0.7 * len(where)  # most rows located exactly
    for layer, name in zip((3, 5), names[1:]):
        # Row i of this layer is the vector of row i's position in layer 1 (of one of them,
        # where prompts sharing a prefix give one layer-1 vector: their deeper vectors may
        # differ by a bf16 step, computed in different forward passes).
        normalized = refs[layer]["normalized"]
        expected = np.stack([normalized[min(hits, key=lambda i: np.abs(normalized[i] - row).max())]
                             for hits, row in zip(where, rows[name])])
        np.testing.assert_allclose(rows[name], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not one harvest"):
        multi_hook_data_provider([datasets[0], ActivationDataset(harvest, layer=3, skip_bos=False)], 64)


def test_saelens_activations_store_reads_the_exported_cache(harvest, tmp_path):
    from sae_lens.training.activations_store import ActivationsStore

    context = 16
    datasets = [ActivationDataset(harvest, layer=k) for k in LAYERS]
    export_activation_cache(datasets, tmp_path / "cache", context_size=context, rows_per_read=7)
    n_rows = len(datasets[0]) // context
    for layer in LAYERS:
        ref = _reference(harvest, layer)
        counted = ref["position"] > 0

        def store(batch_rows):
            return ActivationsStore(model=None, dataset=None, streaming=False, hook_name=hook_name(layer), hook_head_index=None,
                                    context_size=context, d_in=datasets[0].n_features, n_batches_in_buffer=4,
                                    total_training_tokens=10**6, store_batch_size_prompts=batch_rows,
                                    train_batch_size_tokens=64, prepend_bos=False, normalize_activations="none",
                                    device=torch.device("cpu"), dtype="float32", cached_activations_path=str(tmp_path / "cache"))

        reader, acts, tokens = store(1), [], []
        while True:
            try:
                a, t = reader.get_raw_llm_batch(raise_on_epoch_end=True)
            except StopIteration:
                break
            acts.append(a)
            tokens.append(t)
        acts, tokens = torch.cat(acts).numpy(), torch.cat(tokens).numpy()
        # Row by row the corpus order, the start tokens left out, the tail short of a row dropped.
        assert len(acts) == n_rows * context and len(ref["vectors"][counted]) - len(acts) < context
        assert np.array_equal(acts.astype(np.float64), ref["vectors"][counted][: len(acts)])
        assert np.array_equal(tokens, ref["tokens"][counted][: len(acts)])
        # And through SAELens' training path (its mixing buffer): batches of known vectors.
        batch = next(store(4)).numpy()
        assert batch.shape == (64, datasets[0].n_features) and all(_where(ref, batch))


@pytest.fixture
def one_torch_thread():
    """Small matrices on a shared 2-core box: torch's second thread only spins (a 60-step fit
    measured 11.4 s with 2 threads against 2.5 s with 1 under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sae_trainers_consume_the_providers_and_the_saved_sae_reads_raw_vectors(harvest, tmp_path, one_torch_thread):
    from sae_lens import SAE, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.multi_sae_trainer import MultiSAETrainer
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(0)
    ds = ActivationDataset(harvest, layer=3, normalize=True)
    d_in = ds.n_features
    consumed = []

    def counted(provider):  # a pass-through that records what the trainer took
        for batch in provider:
            consumed.append(len(batch))
            yield batch

    cfg = SAETrainerConfig(total_training_samples=128 * 60, train_batch_size_samples=128, lr=3e-3, lr_end=3e-4, device="cpu")
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=2 * d_in, l1_coefficient=1e-3,
                                                        metadata=SAEMetadata(**sae_metadata(ds))))
    x = ds[:]
    x_t = torch.from_numpy(x)
    with torch.no_grad():
        before = ((sae(x_t) - x_t) ** 2).sum(1).mean().item()
    trainer = SAETrainer(cfg, sae, counted(data_provider(ds, 128, buffer_size=512)))
    trainer.fit()
    assert sum(consumed) == trainer.n_training_samples == 128 * 60 and set(consumed) == {128}
    with torch.no_grad():
        normalised_out = sae(x_t).numpy()
    assert ((normalised_out - x) ** 2).sum(1).mean() < 0.5 * before

    # Folded, saved and loaded by SAELens: raw vectors in, raw reconstructions out.
    fold_normalization(sae, ds)
    sae.save_model(tmp_path / "sae")
    loaded = SAE.load_from_disk(tmp_path / "sae")
    assert loaded.cfg.metadata.hook_name == "blocks.3.hook_resid_post" and loaded.cfg.metadata.model_name == "llama-tiny"
    raw = ActivationDataset(harvest, layer=3)[:].astype(np.float64)
    with torch.no_grad():
        raw_out = loaded(torch.from_numpy(raw).float()).numpy().astype(np.float64)
    np.testing.assert_allclose(raw_out, normalised_out * ds.std + ds.mean, rtol=1e-3, atol=1e-3 * np.abs(raw).max())

    # Two SAEs in lockstep on the multi-hook stream.
    hooks = {f"sae{k}": hook_name(k) for k in (1, 5)}
    saes = {name: StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=d_in, l1_coefficient=1e-3)) for name in hooks}
    multi = MultiSAETrainer(SAETrainerConfig(total_training_samples=64 * 10, train_batch_size_samples=64, lr_end=3e-5),
                            saes, hooks, multi_hook_data_provider([ActivationDataset(harvest, layer=k, normalize=True) for k in (1, 5)], 64))
    multi.fit()
    assert multi.n_training_samples == 640 and all(t.n_training_samples == 640 for t in multi.trainers.values())


def test_harvest_client_imports_without_sae_lens_torch_or_datasets():
    code = ("import sys\n"
            "for name in ('sae_lens', 'torch', 'datasets'): sys.modules[name] = None  # as if not installed\n"
            "import harvest_client\n"
            "assert 'harvest_client.saelens' not in sys.modules\n"
            "assert harvest_client.ActivationDataset\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
