"""The inline request's checks, without HTTP: parsing, the activation prompt cap, refusals."""

from __future__ import annotations

import dataclasses

import pytest

from harvest.completions import activation_prompt_cap, parse_completion_request, prepare_completion
from harvest.errors import ActivationPromptTooLong, ContextLengthExceeded, InvalidRequest, ModelNotFound


def _body(**fields):
    return {"model": "llama-tiny", "prompt": "The capital of France is", **fields}


@pytest.mark.parametrize(
    ("n_layers", "published", "max_model_len", "asked", "cap"),
    [
        (32, 512, 8192, 32, 512),  # the published number is for every layer
        (32, 512, 8192, 4, 4096),  # the docs' worked example
        (32, 512, 8192, 1, 8192),  # 16384 clamped to the context window
        (8, 512, 2048, 3, 1365),  # floor(4096 / 3)
        (126, 128, 8192, 5, 3225),  # floor(16128 / 5)
        (60, 128, 8192, 7, 1097),  # floor(7680 / 7)
    ],
)
def test_cap_formula(tiny, n_layers, published, max_model_len, asked, cap):
    model = dataclasses.replace(tiny, n_layers=n_layers, max_activation_prompt_tokens=published, max_model_len=max_model_len)
    assert activation_prompt_cap(model, asked) == cap


def test_parse_accepts_text_ids_and_openai_neutral_fields():
    request = parse_completion_request(_body(n=1, stream=False, stop="\n", output_residual_stream=[3, 1, 3]))
    assert request.stops == ("\n",) and request.max_tokens == 16
    assert parse_completion_request(_body(prompt=[1, 2, 3])).prompt == [1, 2, 3]
    # OpenAI clients may send null for a default, and a batch of one prompt
    nulls = parse_completion_request(_body(max_tokens=None, temperature=None, prompt=[[4, 5]]))
    assert nulls.max_tokens == 16 and nulls.temperature == 1.0 and nulls.prompt == [4, 5]
    assert parse_completion_request(_body(prompt=["one text"])).prompt == "one text"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream
        ({"seed": 2**63}, "seed"),  # past a signed 64-bit integer: a 400, not the engine's overflow
        ({"echo": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"logprobs": 6}, "logprobs"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, "2"]}, "prompt"),
        ({"output_residual_stream": "all"}, "output_residual_stream"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_parse_refuses_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        parse_completion_request(_body(**fields))
    assert caught.value.param == param and caught.value.status == 400


def test_parse_refuses_a_missing_model():
    with pytest.raises(InvalidRequest, match="model"):
        parse_completion_request({"prompt": "x"})


def test_prepare_resolves_layers_and_tokenizes_with_bos(registry):
    prepared = prepare_completion(parse_completion_request(_body(output_residual_stream=[5, 0, 5])), registry)
    assert prepared.layers == [0, 5]
    assert prepared.prompt_ids[0] == 0  # BOS (<|begin_of_text|> is the tokenizer's first special token)
    everything = prepare_completion(parse_completion_request(_body(output_residual_stream=True)), registry)
    assert everything.layers == list(range(8))
    plain = prepare_completion(parse_completion_request(_body()), registry)
    assert plain.layers is None


def test_prepare_refusals(registry):
    def prepare(**fields):
        return prepare_completion(parse_completion_request(_body(**fields)), registry)

    with pytest.raises(ModelNotFound):
        prepare(model="gpt-9")
    with pytest.raises(InvalidRequest, match="llama-tiny has layers 0 to 7: it has no layer 8."):
        prepare(output_residual_stream=[1, 8])
    with pytest.raises(InvalidRequest, match="non-empty"):
        prepare(output_residual_stream=[])
    with pytest.raises(InvalidRequest, match="out of range"):
        prepare(prompt=[1, 99999])
    with pytest.raises(InvalidRequest, match="empty"):
        prepare(prompt="")
    with pytest.raises(ActivationPromptTooLong, match="cap of 512 tokens"):
        prepare(prompt=[5] * 513, output_residual_stream=True)
    with pytest.raises(ActivationPromptTooLong, match="cap of 1365 tokens"):
        prepare(prompt=[5] * 1366, output_residual_stream=[0, 1, 2])
    assert len(prepare(prompt=[5] * 1365, output_residual_stream=[0, 1, 2], max_tokens=1).prompt_ids) == 1365
    # The docs' case: one layer's cap is the whole window, so a prompt at exactly that cap
    # passes the cap and plus max_tokens 50 overflows the context instead.
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 2048 tokens"):
        prepare(prompt=[5] * 2048, output_residual_stream=[4], max_tokens=50)
    with pytest.raises(ContextLengthExceeded):
        prepare(prompt=[5] * 2048, max_tokens=1)  # without activations too
    assert len(prepare(prompt=[5] * 2047, max_tokens=1).prompt_ids) == 2047


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "user", "content": "a"}] * 257, "messages"),  # each message's span costs a render: bounded
        ([{"role": "tool", "content": "a"}], "messages.0.role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages.0.content"),
    ],
)
def test_chat_refuses_messages_naming_the_field(messages, param):
    from harvest.chat import parse_chat_request

    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request({"model": "llama-tiny", "messages": messages})
    assert caught.value.param == "messages" and f"'{param}'" in caught.value.message, caught.value
