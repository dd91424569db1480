"""The official `openai` Python client against the production app on the live stack
(tests/client_fixtures.py), on the real instruct model `smollm2-135m`, as a user points it at
`make run`: plain and streamed completions, chat and streamed chat, chat with activations,
and the error mapping.

The references are independent of the code under test: the chat prompt's token ids come from
transformers' own `apply_chat_template(tokenize=True)` on the model's GGUF tokenizer
(tests/smollm2_fixtures.py), and the chat's activations are compared with those
`/v1/completions` returns for exactly those ids.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.smollm2_reference import MODEL
from tests.test_residual_codec import decode_residual_stream

pytest_plugins = ["tests.client_fixtures", "tests.smollm2_fixtures"]

MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
]
LAYERS = [3, 17]


@pytest.fixture(scope="module")
def client(client_api, smollm2):
    return openai.OpenAI(base_url=client_api.base_url, api_key=client_api.make_key(name="openai"), max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def chat_ids(gguf_reference) -> list[int]:
    """The chat prompt's ids as transformers renders and tokenizes them."""
    _, tokenizer = gguf_reference
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _residual(response) -> tuple[np.ndarray, dict]:
    activations = response.model_extra["activations"]
    return decode_residual_stream({"activations": activations}), activations["residual_stream"]


def test_completions_plain_and_streamed_agree(client):
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert plain.object == "text_completion" and plain.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == plain.choices[0].text
    assert len(texts) == 6 + 1  # one chunk per sampled token, then the final one
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_chat_renders_the_template_once_with_one_bos(client, chat_ids):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    # the prompt is exactly transformers' render: one BOS (SmolLM2's is <|im_start|>, id 1), never two
    assert chat.usage.prompt_tokens == len(chat_ids) and chat_ids[:2] != [chat_ids[0]] * 2
    # the same tokens sent to /v1/completions complete the same way (greedy, same engine)
    same = client.completions.create(model=MODEL, prompt=chat_ids, max_tokens=5, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text
    assert chat.usage.completion_tokens == same.usage.completion_tokens

    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                   stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_chat_activations_equal_those_of_the_same_tokens(client, chat_ids, gguf_reference):
    _, tokenizer = gguf_reference
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                          extra_body={"output_residual_stream": LAYERS})
    x, stream = _residual(chat)
    same = client.completions.create(model=MODEL, prompt=chat_ids, max_tokens=3, temperature=0,
                                     extra_body={"output_residual_stream": LAYERS})
    y, _ = _residual(same)
    n_positions = chat.usage.prompt_tokens + chat.usage.completion_tokens - 1
    assert x.shape == y.shape == (len(LAYERS), n_positions, 576)
    assert np.array_equal(x, y)
    assert stream["layers"] == LAYERS
    # each message's span holds its own text, in order, inside the prompt's positions
    spans = stream["message_spans"]
    assert [s["role"] for s in spans] == ["system", "user"]
    for span, message in zip(spans, MESSAGES):
        assert tokenizer.decode(chat_ids[span["content_start"]:span["content_end"]]) == message["content"]
        assert span["start"] < span["content_start"] <= span["content_end"] < span["end"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[-1]["end"] < len(chat_ids)

    # streamed: the final chunk carries the same activations
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, stream=True,
                                                 extra_body={"output_residual_stream": LAYERS}))
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    z, _ = _residual(final)
    assert np.array_equal(z, x)
    assert all("activations" not in (c.model_extra or {}) for c in chunks if c is not final)


def test_errors_map_to_the_clients_exceptions(client, client_api):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert caught.value.body["param"].startswith("messages")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client_api.base_url, api_key="acs_not-a-key", max_retries=0).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1)
    # the activation quota applies to chat exactly as to completions; a plain chat still runs
    spent = openai.OpenAI(base_url=client_api.base_url, api_key=client_api.make_key(name="spent", activation_quota=0),
                          max_retries=0, timeout=300)
    for call in (lambda **kw: spent.chat.completions.create(messages=MESSAGES, **kw),
                 lambda **kw: spent.completions.create(prompt="Hello", **kw)):
        with pytest.raises(openai.RateLimitError) as caught:
            call(model=MODEL, max_tokens=1, extra_body={"output_residual_stream": [0]})
        assert caught.value.code == "activation_quota_exceeded"
    assert spent.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.completion_tokens == 1
