"""The HF engine's shards against an independent reference: each prompt run alone through HF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.capture_spec import CaptureSpec
from harvest.errors import CaptureFailed
from harvest.tokenize import load_tokenizer
from testbed.reference import bf16_tolerance, hf_reference_layers

PROMPTS = [
    "The sky is",
    "Interpretability research reads the residual stream of a language model, one layer at a time.",
    "Grass is green because chlorophyll absorbs red and blue light.",
    "A",
    "Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 1024 and 4096 appear in text too, "
    "and a sparse autoencoder learns a dictionary of features from millions of activation vectors.",
]


@pytest.fixture(scope="module")
def token_ids(tiny):
    tokenizer = load_tokenizer(tiny.path)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.mark.parametrize("batch_size", [None, 2])
def test_shards_equal_hf_hidden_states(hf_engine, tiny, token_ids, batch_size):
    layers = [0, 3, tiny.n_layers - 1]  # first, middle and last block (last: before final norm)
    capture = hf_engine.capture(token_ids, CaptureSpec(layers), batch_size=batch_size)
    assert len({len(ids) for ids in token_ids}) == len(token_ids), "prompts must have mixed lengths"
    for ids, got in zip(token_ids, capture.values, strict=True):
        assert got.dtype == torch.bfloat16
        assert tuple(got.shape) == (len(layers), len(ids), tiny.hidden_size)
        reference = hf_reference_layers(hf_engine.hf_model, ids, layers)
        error = np.abs(got.float().numpy() - reference)
        assert (error <= bf16_tolerance(reference)).all(), error.max()


def test_last_layer_is_not_the_normed_output(hf_engine, tiny, token_ids):
    """HF's hidden_states[-1] has the final norm applied; the capture must not."""
    last = tiny.n_layers - 1
    capture = hf_engine.capture(token_ids[:1], CaptureSpec([last]))
    with torch.inference_mode():
        normed = hf_engine.hf_model(input_ids=torch.tensor(token_ids[:1]), output_hidden_states=True).hidden_states[-1][0]
    assert not torch.allclose(capture.values[0][0].float(), normed, atol=1e-2)


def test_only_requested_blocks_are_hooked(hf_engine, token_ids):
    """Hooks sit on the requested blocks only, and are all removed afterwards."""
    seen: list[int] = []
    blocks = hf_engine.blocks
    hooks_before = [dict(block._forward_hooks) for block in blocks]  # transformers keeps its own
    original = [block.register_forward_hook for block in blocks]
    for index, block in enumerate(blocks):
        def spy(fn, _index=index, _orig=original[index]):
            seen.append(_index)
            return _orig(fn)

        block.register_forward_hook = spy
    try:
        hf_engine.capture(token_ids[:2], CaptureSpec([1, 5]))
    finally:
        for block, orig in zip(blocks, original):
            block.register_forward_hook = orig
    assert seen == [1, 5]
    assert [dict(block._forward_hooks) for block in blocks] == hooks_before


def test_a_missed_layer_fails_the_shard(hf_engine, token_ids, monkeypatch):
    """A hook that never fires must fail loudly, not yield a short tensor."""
    import harvest.capture as capture_module

    real = capture_module.block_hooks

    def dropping_layer_3(blocks, layers, **kwargs):
        return real(blocks, [k for k in layers if k != 3], **kwargs)

    monkeypatch.setattr("harvest.engines.hf.block_hooks", dropping_layer_3)
    with pytest.raises(CaptureFailed, match=r"missed layer\(s\) \[3\]"):
        hf_engine.capture(token_ids[:2], CaptureSpec([1, 3]))
