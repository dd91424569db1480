"""A whole job through the core pipeline: files, manifest, statistics, tokens, failures, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors

from harvest.errors import CaptureFailed
from harvest.jobfiles import MANIFEST, STATS
from harvest.shard.layout import shard_name
from harvest.pipeline import run_job
from harvest.request import HarvestRequest, resolve_job
from harvest.storage import Storage
from harvest.tokenize import load_tokenizer
from testbed.reference import hf_reference_layers

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "The sky is",
    "Attention lets each position look back at earlier positions and gather what it needs.",
    "Grass is green.",
    "Bread is made from flour, water, salt and yeast.",
]


class RecordingStorage(Storage):
    """Real in-memory storage that remembers the order files were written in."""

    def __init__(self, url: str):
        super().__init__(url)
        self.writes: list[str] = []

    def write_bytes(self, name: str, data: bytes) -> int:
        self.writes.append(name)
        return super().write_bytes(name, data)


def _fresh(name: str) -> RecordingStorage:
    storage = RecordingStorage(f"memory:///tests/{name}")
    storage.delete_all()
    return storage


def _job(registry, **fields):
    return resolve_job(HarvestRequest(model="llama-tiny", prompts=PROMPTS, **fields), registry)


def test_files_layout_and_manifest_written_last(registry, hf_engine, tiny):
    storage = _fresh("layout")
    summary = run_job(_job(registry, shard_size=2), storage, hf_engine, "job-layout")
    assert summary.n_shards == 3
    assert storage.writes[-1] == MANIFEST
    assert storage.writes.index(STATS) < storage.writes.index(MANIFEST)

    manifest = json.loads(storage.read_bytes(MANIFEST))
    assert manifest["version"] == 2 and manifest["contents"] == "activations" and manifest["dtype"] == "bfloat16"
    assert manifest["layer_indices"] == [2, 4, 6]  # quartiles of 8 blocks
    assert "before the model's final norm" in manifest["residual_stream_convention"]
    assert [s["prompt_range"] for s in manifest["shards"]] == [[0, 1], [2, 3], [4, 4]]
    assert manifest["bos_token_id"] == load_tokenizer(tiny.path).bos_token_id

    tokens = 0
    for shard in manifest["shards"]:
        tensors = load_tensors(storage.read_bytes(shard["file"]))
        assert shard["bytes"] == storage.size(shard["file"])
        for offset, i in enumerate(range(shard["prompt_range"][0], shard["prompt_range"][1] + 1)):
            assert tensors[f"prompt_{i}"].dtype == torch.bfloat16
            assert tensors[f"tokens_{i}"].dtype == torch.int32
            n = shard["token_counts"][offset]
            assert tuple(tensors[f"prompt_{i}"].shape) == (3, n, tiny.hidden_size)
            assert manifest["prompts"][i]["n_tokens"] == n and manifest["prompts"][i]["text"] == PROMPTS[i]
            tokens += n
    assert manifest["tokens"] == tokens == summary.tokens


def test_statistics_equal_numpy_over_the_same_positions(registry, hf_engine, tiny):
    storage = _fresh("stats")
    job = _job(registry, layers=[0, 7], shard_size=2)
    run_job(job, storage, hf_engine, "job-stats")
    stats = load_tensors(storage.read_bytes(STATS))
    tokenizer = load_tokenizer(tiny.path)
    # every position but the first of each prompt, from each prompt run alone in float32 and
    # rounded to bf16 as the files hold it (the statistics describe the stored values)
    rows = [hf_reference_layers(hf_engine.hf_model, tokenizer(p)["input_ids"], [0, 7])[:, 1:] for p in PROMPTS]
    data = torch.from_numpy(np.concatenate(rows, axis=1)).to(torch.bfloat16).double().numpy()
    assert int(stats["count"]) == data.shape[1]
    assert stats["layer_indices"].tolist() == [0, 7]
    # Against HF: a batched run may round a value to the neighbouring bf16 step (one flip in
    # hundreds of thousands moves a mean by ~1e-3 of one value / count).
    np.testing.assert_allclose(stats["mean"].numpy(), data.mean(axis=1), rtol=1e-3, atol=2e-3)
    np.testing.assert_allclose(stats["std"].numpy(), data.std(axis=1), rtol=1e-3, atol=2e-3)
    # Against the values the shards hold, read back with safetensors: exactly what they describe.
    manifest = json.loads(storage.read_bytes(MANIFEST))
    held = []
    for shard in manifest["shards"]:
        tensors = load_tensors(storage.read_bytes(shard["file"]))
        first, last = shard["prompt_range"]
        held += [tensors[f"prompt_{i}"][:, 1:].double().numpy() for i in range(first, last + 1)]
    stored = np.concatenate(held, axis=1)
    np.testing.assert_allclose(stats["mean"].numpy(), stored.mean(axis=1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stats["std"].numpy(), stored.std(axis=1), rtol=1e-6)
    np.testing.assert_allclose(
        [manifest["mean_token_norm"]["0"], manifest["mean_token_norm"]["7"]],
        np.linalg.norm(stored, axis=2).mean(axis=1),
        rtol=1e-9,
    )


def test_bos_handling_matches_the_docs(registry, hf_engine, tiny):
    """A prompt that already starts with BOS gets two with add_special_tokens, one without."""
    tokenizer = load_tokenizer(tiny.path)
    bos = tokenizer.bos_token_id
    prompts = [tokenizer.bos_token + "The sky is", "The sky is"]
    for add, expected in ((True, [[bos, bos], [bos]]), (False, [[bos], []])):
        storage = _fresh(f"bos-{add}")
        job = resolve_job(HarvestRequest(model="llama-tiny", prompts=prompts, add_special_tokens=add), registry)
        run_job(job, storage, hf_engine, f"job-bos-{add}")
        shard = load_tensors(storage.read_bytes(shard_name(0)))
        plain = tokenizer("The sky is", add_special_tokens=False)["input_ids"]
        for i, prefix in enumerate(expected):
            assert shard[f"tokens_{i}"].tolist() == prefix + plain
        assert json.loads(storage.read_bytes(MANIFEST))["add_special_tokens"] is add


def test_long_prompts_keep_their_first_tokens(registry, hf_engine, tiny):
    long_prompt = "The sky is blue and the grass is green. " * 400  # well over 2048 tokens
    storage = _fresh("truncated")
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=["Short one.", long_prompt], layers=[1]), registry)
    run_job(job, storage, hf_engine, "job-trunc")
    manifest = json.loads(storage.read_bytes(MANIFEST))
    assert [p["truncated"] for p in manifest["prompts"]] == [False, True]
    assert manifest["prompts"][1]["n_tokens"] == tiny.max_model_len
    shard = load_tensors(storage.read_bytes(shard_name(0)))
    full = load_tokenizer(tiny.path)(long_prompt)["input_ids"]
    assert shard["tokens_1"].tolist() == full[: tiny.max_model_len]
    assert shard["prompt_1"].shape[1] == tiny.max_model_len


def test_a_failing_run_leaves_no_manifest(registry, hf_engine, monkeypatch):
    storage = _fresh("failing")
    real_capture = hf_engine.capture
    calls = []

    def capture_failing_on_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise CaptureFailed("The capture missed layer(s) [4]: no activations came back for them.")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(hf_engine, "capture", capture_failing_on_second_shard)
    with pytest.raises(CaptureFailed):
        run_job(_job(registry, shard_size=2), storage, hf_engine, "job-fail")
    assert not storage.exists(MANIFEST) and not storage.exists(STATS)
    assert storage.exists(shard_name(0))  # the shard before the failure is kept for a retry


def test_rerun_skips_verified_shards_and_redoes_a_corrupt_one(registry, hf_engine):
    storage = _fresh("resume")
    job = _job(registry, shard_size=2)
    run_job(job, storage, hf_engine, "job-resume")
    first = {name: storage.read_bytes(name) for name in (shard_name(0), shard_name(1))}
    storage.write_bytes(shard_name(1), first[shard_name(1)][:-10])  # a torn file
    storage.delete(MANIFEST)
    storage.writes.clear()

    summary = run_job(job, storage, hf_engine, "job-resume")
    assert summary.shards_skipped == 2  # shards 0 and 2 verified; 1 recomputed
    assert shard_name(0) not in storage.writes and shard_name(1) in storage.writes
    assert storage.read_bytes(shard_name(1)) == first[shard_name(1)]  # same bytes again
    assert storage.writes[-1] == MANIFEST
