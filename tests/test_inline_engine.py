"""The HF engine's batched generate: values against an independent HF reference, sampling,
stop strings, logprobs, and a capture that misses a layer."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch

from harvest.engines.base import SamplingSpec
from harvest.errors import CaptureFailed
from harvest.tokenize import load_tokenizer

GREEDY = SamplingSpec(max_tokens=5, temperature=0)


@torch.inference_mode()
def hf_reference(hf_model, ids: list[int], layers: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """float32 `[len(layers), len(ids), hidden]` and the logits, for `ids` run alone and whole.

    Block k is `hidden_states[k + 1]`, except the last block, whose hidden_states entry has the
    final norm applied: it is read with a hook of this function's own.
    """
    last_block = hf_model.config.num_hidden_layers - 1
    seen = {}
    handle = hf_model.model.layers[last_block].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = hf_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    rows = [seen["last"][0] if k == last_block else out.hidden_states[k + 1][0] for k in layers]
    return torch.stack(rows).float().numpy(), out.logits[0].float()


def assert_within_one_bf16_rounding(ours: torch.Tensor, reference: np.ndarray) -> None:
    """bf16 keeps 8 significant bits: ours may sit one bf16 step (2^(e-7)) from the float32 value,
    plus float32 noise (a batched KV-cache run sums in another order than one whole run), which
    scales with the layer's largest values, not with the value itself: 2^-18 of that."""
    ours = ours.float().numpy()
    assert ours.shape == reference.shape
    exponent = np.floor(np.log2(np.maximum(np.abs(reference), 1e-30)))
    step = np.exp2(exponent - 7)
    noise = np.abs(reference).max(axis=(1, 2), keepdims=True) * 2.0**-18
    bad = np.abs(ours - reference) > step + noise
    assert not bad.any(), f"{bad.sum()} values off by more than one bf16 step, e.g. {ours[bad][:3]} vs {reference[bad][:3]}"


@pytest.fixture(scope="module")
def prompts(tiny):
    tokenizer = load_tokenizer(tiny.path)
    texts = ["The capital of France is", "Hi", "Once upon a time there was a small village by the sea where"]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_greedy_batch_matches_reference_at_every_position(hf_engine, prompts):
    layers = [0, 3, 7]  # 7 is the last block: the one HF's hidden_states gets wrong
    generations = hf_engine.generate(prompts, [GREEDY, SamplingSpec(max_tokens=1, temperature=0), GREEDY], layers)
    for prompt, spec, generation in zip(prompts, [5, 1, 5], generations):
        n_gen = len(generation.token_ids)
        assert generation.finish_reason == "length" and n_gen == spec
        ran = prompt + generation.token_ids[:-1]  # the last sampled token never ran
        assert generation.residual.dtype == torch.bfloat16
        assert tuple(generation.residual.shape) == (3, len(prompt) + n_gen - 1, 256)
        reference, logits = hf_reference(hf_engine.hf_model, ran, layers)
        assert_within_one_bf16_rounding(generation.residual, reference)
        # greedy: each generated token is the reference's argmax after the tokens before it
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == generation.token_ids
    assert generations[0].extra["forward_passes"] == 5  # one prefill + 4 decode steps, shared by all rows


def test_batched_equals_alone(hf_engine, prompts):
    together = hf_engine.generate(prompts, [GREEDY] * 3, [2])
    for prompt, batched in zip(prompts, together):
        alone = hf_engine.generate([prompt], [GREEDY], [2])[0]
        assert alone.token_ids == batched.token_ids
        assert_within_one_bf16_rounding(batched.residual, alone.residual.float().numpy())


def test_seeded_sampling_reproduces_and_top_p(hf_engine, prompts):
    spec = SamplingSpec(max_tokens=8, temperature=1.0, seed=1234)
    first = hf_engine.generate([prompts[0]], [spec], None)[0]
    # the same seed gives the same draw, also when other requests share the batch
    again = hf_engine.generate([prompts[2], prompts[0]], [GREEDY, spec], None)[1]
    assert again.token_ids == first.token_ids
    draws = {tuple(hf_engine.generate([prompts[0]], [SamplingSpec(max_tokens=8, temperature=1.0, seed=s)], None)[0].token_ids) for s in range(4)}
    assert len(draws) > 1  # seeds matter
    greedy = hf_engine.generate([prompts[0]], [SamplingSpec(max_tokens=8, temperature=0)], None)[0]
    nucleus = hf_engine.generate([prompts[0]], [SamplingSpec(max_tokens=8, temperature=1.0, top_p=1e-6, seed=7)], None)[0]
    assert nucleus.token_ids == greedy.token_ids  # a tiny nucleus holds only the most likely token
    assert first.residual is None


def test_stop_string_ends_the_text_before_it(hf_engine, prompts, tiny):
    tokenizer = load_tokenizer(tiny.path)
    full = hf_engine.generate([prompts[0]], [SamplingSpec(max_tokens=10, temperature=0)], None)[0]
    start = len(tokenizer.decode(full.token_ids[:3]))
    stop = full.text[start : start + 2]
    assert stop
    stopped = hf_engine.generate([prompts[0]], [SamplingSpec(max_tokens=10, temperature=0, stop=(stop,))], [1])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) < 10
    assert stopped.residual.shape[1] == len(prompts[0]) + len(stopped.token_ids) - 1


def test_logprobs_are_the_models_distribution(hf_engine, prompts):
    generation = hf_engine.generate([prompts[1]], [SamplingSpec(max_tokens=4, temperature=0.8, seed=3, logprobs=2)], None)[0]
    _, logits = hf_reference(hf_engine.hf_model, prompts[1] + generation.token_ids[:-1], [0])
    expected = torch.log_softmax(logits[len(prompts[1]) - 1 :], -1)
    got = [expected[i, t].item() for i, t in enumerate(generation.token_ids)]
    assert np.allclose(generation.token_logprobs, got, atol=1e-4)
    assert all(2 <= len(top) <= 3 for top in generation.top_logprobs)  # top 2, plus the sampled token


def test_a_capture_that_misses_a_layer_fails(hf_engine, prompts):
    # One seam: block 3's hook sits on a copy that never runs, as a broken capture would.
    blocks = list(hf_engine.blocks)
    blocks[3] = copy.deepcopy(blocks[3])
    broken = types.SimpleNamespace(hf_model=hf_engine.hf_model, device=hf_engine.device, model=hf_engine.model, blocks=blocks,
                                   passes=hf_engine.passes)
    from harvest.engines.hf_generate import hf_generate

    with pytest.raises(CaptureFailed, match=r"missed layer\(s\) \[3\]"):
        hf_generate(broken, [prompts[0]], [GREEDY], [2, 3])


def test_eos_ends_the_generation(hf_engine, prompts):
    # One seam: declare the token greedy decoding picks first to be the model's EOS.
    first = hf_engine.generate([prompts[0]], [SamplingSpec(max_tokens=1, temperature=0)], None)[0].token_ids[0]
    config = hf_engine.hf_model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [first]
    try:
        generation = hf_engine.generate([prompts[0], prompts[1]], [GREEDY, GREEDY], [0])
    finally:
        config.eos_token_id = saved
    assert generation[0].token_ids == [first] and generation[0].finish_reason == "stop"
    assert tuple(generation[0].residual.shape) == (1, len(prompts[0]), 256)  # the EOS never ran
    assert len(generation[1].token_ids) == 5 or generation[1].finish_reason == "stop"


def test_a_long_generation_matches_reference_across_cache_growth(hf_engine, prompts):
    # 150 and 70 tokens: the KV cache's storage grows past 64 and 128 positions while both
    # rows run, and again after the shorter row has left the batch.
    specs = [SamplingSpec(max_tokens=150, temperature=0), SamplingSpec(max_tokens=70, temperature=0)]
    layers = [0, 7]
    generations = hf_engine.generate([prompts[0], prompts[2]], specs, layers)
    for prompt, spec, generation in zip([prompts[0], prompts[2]], specs, generations):
        if generation.finish_reason == "length":
            assert len(generation.token_ids) == spec.max_tokens
        ran = prompt + generation.token_ids[:-1]
        reference, _ = hf_reference(hf_engine.hf_model, ran, layers)
        assert_within_one_bf16_rounding(generation.residual, reference)


def test_growing_kv_layer_holds_what_concatenation_would_and_reallocates_rarely():
    from harvest.engines.hf_generate import GrowingLayer

    torch.manual_seed(0)
    layer = GrowingLayer()
    keys, values = [torch.randn(3, 2, 5, 8)], [torch.randn(3, 2, 5, 8)]  # a 5-token prefill
    layer.update(keys[0], values[0])
    for _ in range(1000):
        keys.append(torch.randn(3, 2, 1, 8))
        values.append(torch.randn(3, 2, 1, 8))
        got_k, got_v = layer.update(keys[-1], values[-1])
    assert torch.equal(got_k, torch.cat(keys, dim=-2)) and torch.equal(got_v, torch.cat(values, dim=-2))
    assert layer.get_seq_length() == 1005
    assert layer.grown <= 6  # 64 → 128 → … → 1,024 → 2,048, not one copy per token
    layer.batch_select_indices(torch.tensor([0, 2]))
    step_k, step_v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    got_k, got_v = layer.update(step_k, step_v)
    assert torch.equal(got_k, torch.cat([torch.cat(keys, dim=-2)[[0, 2]], step_k], dim=-2))
    assert torch.equal(got_v, torch.cat([torch.cat(values, dim=-2)[[0, 2]], step_v], dim=-2))


def test_cpu_decoding_uses_one_thread_below_the_callers_priority(hf_engine, prompts):
    import os
    import threading

    from harvest.engines.hf_generate import DECODE_NICE

    seen = []
    handle = hf_engine.blocks[0].register_forward_hook(
        lambda *_: seen.append((torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    )
    threads_before = torch.get_num_threads()
    caller_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:
        # In a thread of its own, as an engine's worker thread calls it: the lower priority stays with that thread.
        worker = threading.Thread(target=hf_engine.generate, args=([prompts[0]], [GREEDY], None))
        worker.start()
        worker.join()
    finally:
        handle.remove()
    assert len(seen) == 5 and all(threads == 1 and nice >= DECODE_NICE for threads, nice in seen)
    assert torch.get_num_threads() == threads_before
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice  # the caller's own thread is untouched


def test_overlapping_cpu_decodes_keep_one_thread_until_the_last_ends():
    """torch's thread count is the process's: a decode that ends while another runs must not
    hand the other its threads back."""
    import threading

    from harvest.engines.hf_generate import _cpu_share

    before = torch.get_num_threads()
    counts = []

    def overlap():  # in a thread of its own: the lower priority stays with that thread
        first, second = _cpu_share(torch.device("cpu")), _cpu_share(torch.device("cpu"))
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)  # the first decode ends, the second goes on
        counts.append(torch.get_num_threads())
        second.__exit__(None, None, None)
        counts.append(torch.get_num_threads())

    worker = threading.Thread(target=overlap)
    worker.start()
    worker.join()
    assert counts == [1, before]
