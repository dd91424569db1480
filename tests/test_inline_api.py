"""`POST /v1/completions` and `GET /v1/models` over real HTTP: a uvicorn server on loopback
running the real routes, real API keys in the real key store, and the session's HF engine.

The one seam: the app's factory is given an engine pool on the session's warm HF engine (so
the model is not loaded twice), instead of whatever `load_engine` would pick on this machine.
The app is served in a thread of the test process (`tests.api_fixtures.serve_in_thread`).
"""

from __future__ import annotations

import asyncio
import copy
import time

import httpx
import numpy as np
import pytest
import torch

from harvest.settings import get_settings
from testbed import http_calls
from tests.api_fixtures import serve_in_thread
from tests.test_inline_engine import assert_within_one_bf16_rounding, hf_reference
from tests.test_residual_codec import decode_residual_stream


def _session_engines(engine, **options):
    """An engine pool whose every model is `engine` (the session's, never closed by the pool)."""
    from api.inline_engines import InlineEngines

    return InlineEngines(factory=lambda _model: engine, close_engines=False, **options)


@pytest.fixture(scope="module")
def inline_app(hf_engine, job_store):
    from api.app import create_app

    return create_app(store=job_store, inline_engines=_session_engines(hf_engine, window_s=0.02))


@pytest.fixture(scope="module")
def base_url(inline_app):
    with serve_in_thread(inline_app) as root:
        yield f"{root}/v1"


@pytest.fixture(scope="module")
def key(job_store):
    from api.auth import create_key

    return create_key("inline-tests", engine=job_store.db)[0]


@pytest.fixture()
def client(base_url, key):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as session:
        yield session


def _complete(client, **fields):
    return client.post("/completions", json={"model": "llama-tiny", "prompt": "The capital of France is", **fields})


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    return error


def test_models_lists_capabilities(client, base_url, tiny):
    body = client.get("/models").json()
    assert body["object"] == "list"
    models = {m["id"]: m for m in body["data"]}
    assert {"llama-tiny", "llama-8b", "llama-405b", "trinity-truebase"} <= set(models)
    caps = models["llama-tiny"]["capabilities"]
    assert models["llama-tiny"]["object"] == "model"
    assert {k: caps[k] for k in ("n_layers", "hidden_size", "max_model_len", "max_activation_prompt_tokens", "harvest", "lane")} == {
        "n_layers": 8, "hidden_size": 256, "max_model_len": 2048, "max_activation_prompt_tokens": 512, "harvest": True, "lane": "small",
    }
    assert models["llama-8b"]["capabilities"]["n_layers"] == 32
    assert models["llama-405b"]["capabilities"]["lane"] == "large"
    _error(http_calls.get(f"{base_url}/models"), 401, "invalid_api_key")


def test_residual_stream_equals_hf_reference(client, hf_engine, tiny):
    """The docs' decode snippet on our response equals HF run on prompt + generated tokens."""
    answer = _complete(client, max_tokens=5, temperature=0, output_residual_stream=True)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    n_prompt = body["usage"]["prompt_tokens"]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
    stream = body["activations"]["residual_stream"]
    assert {k: stream[k] for k in ("dtype", "original_dtype", "compression")} == {
        "dtype": "int16", "original_dtype": "torch.bfloat16", "compression": "zstd",
    }
    x = decode_residual_stream(body)
    assert x.shape == (8, n_prompt + 4, 256)  # max_tokens 5 → prompt + 4 positions
    # The independent reference: HF's own greedy generate, then one forward over what ran.
    from harvest.tokenize import load_tokenizer

    tokenizer = load_tokenizer(tiny.path)
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    assert len(prompt_ids) == n_prompt
    with torch.inference_mode():
        out = hf_engine.hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=5, do_sample=False)
    generated = out[0, n_prompt:].tolist()
    assert body["choices"][0]["text"] == tokenizer.decode(generated, skip_special_tokens=True)
    reference, _ = hf_reference(hf_engine.hf_model, prompt_ids + generated[:-1], list(range(8)))
    assert_within_one_bf16_rounding(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16), reference)


def test_max_tokens_one_gives_exactly_the_prompt_positions(client, hf_engine):
    ids = [0, 17, 200, 31, 999, 5, 64]
    answer = _complete(client, prompt=ids, max_tokens=1, temperature=0, output_residual_stream=[7, 0, 7])
    assert answer.status_code == 200, answer.text
    x = decode_residual_stream(answer.json())
    assert x.shape == (2, len(ids), 256)  # layers deduplicated and ascending, prompt positions only
    assert answer.json()["activations"]["residual_stream"]["layers"] == [0, 7]
    reference, _ = hf_reference(hf_engine.hf_model, ids, [0, 7])
    assert_within_one_bf16_rounding(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16), reference)


def test_plain_completion_sampling_and_logprobs(client):
    plain = _complete(client, max_tokens=6, seed=11, temperature=0.9, top_p=0.95).json()
    assert "activations" not in plain and plain["choices"][0]["finish_reason"] == "length"
    again = _complete(client, max_tokens=6, seed=11, temperature=0.9, top_p=0.95).json()
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]
    scored = _complete(client, max_tokens=3, temperature=0, logprobs=2).json()["choices"][0]["logprobs"]
    assert len(scored["tokens"]) == len(scored["token_logprobs"]) == len(scored["top_logprobs"]) == 3
    assert all(lp <= 0 for lp in scored["token_logprobs"])


def test_refusals(client, base_url):
    error = _error(_complete(client, model="gpt-9"), 400, "model_not_found")
    assert error["param"] == "model"
    error = _error(_complete(client, output_residual_stream=[3, 8]), 400, "invalid_request")
    assert error["message"] == "llama-tiny has layers 0 to 7: it has no layer 8."
    error = _error(_complete(client, prompt=[5] * 513, output_residual_stream=True), 400, "activation_prompt_too_long")
    assert "cap of 512 tokens" in error["message"]
    error = _error(_complete(client, prompt=[5] * 1366, output_residual_stream=[1, 2, 3]), 400, "activation_prompt_too_long")
    assert "cap of 1365 tokens" in error["message"]  # floor(512 × 8 ÷ 3)
    _error(_complete(client, prompt=[5] * 2048, output_residual_stream=[4], max_tokens=50), 400, "context_length_exceeded")
    _error(_complete(client, prompt=[5] * 2000, max_tokens=49), 400, "context_length_exceeded")
    assert _error(_complete(client, best_guess=True), 400, "invalid_request")["param"] == "best_guess"
    assert _error(_complete(client, prompt=["a", "b"]), 400, "invalid_request")["param"] == "prompt"
    _error(client.post("/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400, "invalid_request")
    _error(http_calls.post(f"{base_url}/completions", json={"model": "llama-tiny", "prompt": "x"}), 401, "invalid_api_key")


def test_activation_quota_counts_the_positions_returned(base_url, client, job_store):
    """The quota counts residual-stream positions that responses carried (the usage record
    against the returned shape), not requests nor what max_tokens asked for."""
    from api.auth import activations_used, create_key

    # A greedy run stopped early by a stop string from its own text returns fewer positions
    # than max_tokens asked for.
    free = _complete(client, prompt=[5, 17, 200, 31], max_tokens=12, temperature=0).json()["choices"][0]["text"]
    stop = next(free[i:i + 3] for i in range(2, len(free) - 3) if free[i:i + 3].strip() and free[i:i + 3] not in free[:i])
    key, record = create_key("inline-quota", activation_quota=40, engine=job_store.db)
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as limited:
        early = _complete(limited, prompt=[5, 17, 200, 31], max_tokens=12, temperature=0, stop=stop, output_residual_stream=[0])
        assert early.status_code == 200, early.text
        assert early.json()["choices"][0]["finish_reason"] == "stop"
        returned = decode_residual_stream(early.json()).shape[1]
        assert returned < 4 + 12 - 1
        assert activations_used(record.id, engine=job_store.db) == returned
        # What is left (40 - returned) is under what the next request may return: refused,
        # and nothing more counted.
        over = _complete(limited, prompt=[5, 17, 200, 31], max_tokens=40 - returned - 2, output_residual_stream=[0])
        _error(over, 429, "activation_quota_exceeded")
        assert activations_used(record.id, engine=job_store.db) == returned
        # plain completions are not activation requests
        assert _complete(limited, max_tokens=1).status_code == 200
        assert activations_used(record.id, engine=job_store.db) == returned


def test_a_large_response_streams_its_payload_in_pieces(client):
    """The body is streamed (no Content-Length), renders exactly as a JSONResponse of the same
    object would, and the docs' decoder reads it."""
    import json

    with client.stream("POST", "/completions", json={
        "model": "llama-tiny", "prompt": [7], "max_tokens": 200, "temperature": 0, "output_residual_stream": True,
    }) as answer:
        assert answer.status_code == 200
        assert "content-length" not in answer.headers and answer.headers["content-type"] == "application/json"
        pieces = list(answer.iter_raw())
    raw = b"".join(pieces)
    body = json.loads(raw)
    assert raw == json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    assert decode_residual_stream(body).shape == (8, 200, 256)


def test_encoding_a_response_holds_one_piece_at_a_time():
    """Before, the whole payload existed as compressed bytes, base64 bytes, a str and the
    JSON text at once (~4 copies of the raw size) on the event loop; the streamed body's
    Python allocations stay a fraction of the raw size, and its text is the one-shot text."""
    import tracemalloc

    from harvest.engines.base import Generation
    from harvest.completions import CompletionRequest, PreparedCompletion, completion_response
    from harvest.registry import load_registry
    from harvest.residual_codec import encode_residual

    model = load_registry(get_settings()).get("llama-tiny")
    n_tokens = 2000
    residual = torch.randn(8, n_tokens, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    raw_bytes = residual.numel() * 2  # 8 MiB
    request = CompletionRequest(model="llama-tiny", prompt=[1], max_tokens=n_tokens, output_residual_stream=True)
    prepared = PreparedCompletion(request, model, [1], list(range(8)), request.sampling(n_tokens))
    generation = Generation(prompt_ids=[1], token_ids=[2] * n_tokens, text="x", finish_reason="length", residual=residual)
    tracemalloc.start()
    try:
        sent = 0
        for piece in completion_response(prepared, generation):
            sent += len(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent > raw_bytes  # random bf16 barely compresses: the payload passed through whole
    assert peak < raw_bytes / 4, f"{peak / 2**20:.1f} MiB held to send {raw_bytes / 2**20:.0f} MiB"
    import json

    body = json.loads(b"".join(completion_response(prepared, generation)))
    assert body["activations"]["residual_stream"]["shape"] == [8, n_tokens, 256]
    assert torch.equal(torch.from_numpy(decode_residual_stream(body).view(np.int16).copy()), residual.view(torch.int16))
    one_shot = encode_residual(residual)
    assert decode_residual_stream({"activations": {"residual_stream": one_shot}}).tobytes() == decode_residual_stream(body).tobytes()


def _given_back(budget) -> None:
    """The server releases a hold once its last byte is sent, a moment after the client has it."""
    deadline = time.monotonic() + 10
    while budget.in_flight:
        assert time.monotonic() < deadline, f"{budget.in_flight} bytes still held"
        time.sleep(0.05)


def test_responses_over_the_replica_byte_budget_get_503_with_retry_after(key, hf_engine, job_store):
    """Two concurrent `[8, 150, 256]` responses that do not fit the budget together: one runs,
    the other is 503 replica_busy with Retry-After before any engine work or quota; one
    response bigger than the whole budget still runs alone; every hold is given back."""
    from api.app import create_app
    from api.auth import activations_used, create_key
    from api.routes.completions import ResponseBudget

    one = 8 * (1 + 150 - 1) * 256 * 2  # all layers, a 1-token prompt, 150 tokens: its most bytes
    budget = ResponseBudget(limit=one + one // 2)
    app = create_app(store=job_store, inline_engines=_session_engines(hf_engine, window_s=0.02), inline_budget=budget)
    quota_key, record = create_key("inline-budget", activation_quota=10_000, engine=job_store.db)
    body = {"model": "llama-tiny", "prompt": [7], "max_tokens": 150, "temperature": 0, "output_residual_stream": True}

    async def both():
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {quota_key}"}, timeout=120) as session:
            return await asyncio.gather(session.post("/completions", json=body), session.post("/completions", json=body))

    with serve_in_thread(app) as root:
        base_url = f"{root}/v1"
        answers = asyncio.run(both())
        assert sorted(a.status_code for a in answers) == [200, 503], [a.text[:200] for a in answers]
        busy = next(a for a in answers if a.status_code == 503)
        assert busy.json()["error"]["code"] == "replica_busy" and busy.headers["Retry-After"] == "2"
        assert activations_used(record.id, engine=job_store.db) == 150  # the refused one held no quota
        _given_back(budget)
        assert budget.peak <= budget.limit
        budget.limit = one // 2  # smaller than one response: it runs when alone
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as session:
            assert session.post("/completions", json=body).status_code == 200
        _given_back(budget)


def test_a_capture_that_misses_a_layer_fails_the_request(key, hf_engine, job_store):
    from api.app import create_app
    from harvest.engines.hf import HFEngine

    class MissingBlock(HFEngine):
        """The session engine with block 3's hook on a copy that never runs."""

        def __init__(self):
            self.__dict__.update(hf_engine.__dict__)
            self._blocks = list(hf_engine.blocks)
            self._blocks[3] = copy.deepcopy(self._blocks[3])

        @property
        def blocks(self):
            return self._blocks

    app = create_app(store=job_store, inline_engines=_session_engines(MissingBlock()))
    with serve_in_thread(app) as root, httpx.Client(
        base_url=f"{root}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=120
    ) as client:
        error = _error(_complete(client, max_tokens=2, output_residual_stream=[2, 3]), 500, "capture_failed")
        assert "[3]" in error["message"]


def test_sixteen_concurrent_requests_run_in_batches(base_url, key, inline_app, hf_engine):
    prompts = [f"Request number {i} says" + " more" * (i % 5) for i in range(16)]
    forwards = []
    handle = hf_engine.hf_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    stats = None

    async def run_all():
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as session:
            return await asyncio.gather(
                *(
                    session.post("/completions", json={"model": "llama-tiny", "prompt": p, "max_tokens": 4, "temperature": 0, "output_residual_stream": [1, 6]})
                    for p in prompts
                )
            )

    try:
        batcher = asyncio.run(_batcher(inline_app))
        before_calls, before_requests = batcher.stats.generate_calls, batcher.stats.requests
        answers = asyncio.run(run_all())
        stats = (batcher.stats.generate_calls - before_calls, batcher.stats.requests - before_requests)
    finally:
        handle.remove()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    calls, requests = stats
    print(f"16 concurrent requests: {calls} generate calls, {len(forwards)} forward passes")
    assert requests == 16
    assert calls < 16, f"{calls} generate calls for 16 requests: not batched"
    assert len(forwards) < 16 * 4, f"{len(forwards)} forward passes for 16 requests of 4 tokens"
    # Batching changes nothing a client sees: each answer equals its request run alone.
    from harvest.engines.base import SamplingSpec
    from harvest.tokenize import load_tokenizer

    tokenizer = load_tokenizer(hf_engine.model.path)
    for prompt, answer in zip(prompts, answers):
        alone = hf_engine.generate([tokenizer(prompt)["input_ids"]], [SamplingSpec(max_tokens=4, temperature=0)], [1, 6])[0]
        assert answer.json()["choices"][0]["text"] == alone.text
        x = decode_residual_stream(answer.json())
        assert_within_one_bf16_rounding(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16), alone.residual.float().numpy())


async def _batcher(app):
    from harvest.registry import load_registry

    return await app.state.inline_engines.get(load_registry(get_settings()).get("llama-tiny"))


def test_a_body_over_the_inline_cap_is_413_before_it_is_read_whole(client):
    """Before the cap, one 62 MB request kept the API busy for minutes at 4.4 GB of memory."""
    huge = b'{"model": "llama-tiny", "prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    started = time.monotonic()
    error = _error(client.post("/completions", content=huge, headers={"Content-Type": "application/json"}), 413, "request_too_large")
    assert "8 MB" in error["message"] and time.monotonic() - started < 10

    def chunks():  # no Content-Length: the cap holds on the stream too
        yield b'{"model": "llama-tiny", "prompt": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    _error(client.post("/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413, "request_too_large")
    assert _complete(client, max_tokens=1).status_code == 200  # and the next request is served


def test_access_log_lines_of_file_links_carry_no_signature():
    import logging

    from api.app import RedactLinkQueries

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/files/job/shard_00000.safetensors?expires=9&signature=abc", "1.1", 200), None)
    assert RedactLinkQueries().filter(record)
    assert "abc" not in record.getMessage() and "/v1/files/job/shard_00000.safetensors?<redacted>" in record.getMessage()
    other = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                              ("127.0.0.1:5", "GET", "/v1/harvest?limit=5", "1.1", 200), None)
    RedactLinkQueries().filter(other)
    assert "/v1/harvest?limit=5" in other.getMessage()
