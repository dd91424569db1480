"""Inline activations through the real app (`uvicorn --factory` in its own process), used
the way the user docs use it: `requests` with ACS_API_BASE/ACS_API_KEY, the docs' decode
snippet and their "always assert the shape" checks, compared with an HF reference."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch

from tests.test_inline_engine import assert_within_one_bf16_rounding, hf_reference
from tests.test_residual_codec import decode_residual_stream


@pytest.fixture(scope="module")
def inline_server(harvest_home, tiny):
    from tests.api_fixtures import ApiServer

    # HF engine whatever is installed (the vLLM engine has its own parity tests); the model
    # is warmed in the background at start-up, as a served model would be.
    server = ApiServer(harvest_home, "inline", {"HARVEST_ENGINE": "hf", "HARVEST_INLINE_PRELOAD": "llama-tiny"}).start()
    try:
        yield server
    finally:
        server.stop()


def test_docs_example_against_the_real_app(inline_server, hf_engine, tiny):
    ACS_API_BASE, ACS_API_KEY = inline_server.base_url, inline_server.make_key()
    headers = {"Authorization": f"Bearer {ACS_API_KEY}"}
    models = requests.get(f"{ACS_API_BASE}/models", headers=headers, timeout=60).json()
    caps = {m["id"]: m["capabilities"] for m in models["data"]}["llama-tiny"]
    n_layers_for_model = caps["n_layers"]

    resp = requests.post(
        f"{ACS_API_BASE}/completions",
        headers=headers,
        json={"model": "llama-tiny", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "output_residual_stream": True},
        timeout=300,
    ).json()
    x = decode_residual_stream(resp)
    # the docs' checks, verbatim
    assert x.ndim == 3, x.shape
    assert x.shape[0] == n_layers_for_model, f"partial capture: {x.shape[0]} layers"
    assert np.isfinite(x.astype(np.float32)).all(), "non-finite — broken capture"

    from harvest.tokenize import load_tokenizer

    prompt_ids = load_tokenizer(tiny.path)("The capital of France is")["input_ids"]
    assert x.shape == (8, len(prompt_ids), caps["hidden_size"]) == (8, resp["usage"]["prompt_tokens"], 256)
    reference, _ = hf_reference(hf_engine.hf_model, prompt_ids, list(range(8)))
    assert_within_one_bf16_rounding(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16), reference)


def test_refusals_through_the_real_app(inline_server):
    base = inline_server.base_url
    over_quota = {"Authorization": f"Bearer {inline_server.make_key(activation_quota=0)}"}
    body = {"model": "llama-tiny", "prompt": "Hello", "max_tokens": 1, "output_residual_stream": [0]}
    answer = requests.post(f"{base}/completions", headers=over_quota, json=body, timeout=60)
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "activation_quota_exceeded"
    headers = {"Authorization": f"Bearer {inline_server.make_key()}"}
    answer = requests.post(f"{base}/completions", headers=headers, json={**body, "prompt": [5] * 600, "output_residual_stream": True}, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "activation_prompt_too_long" and "512" in answer.json()["error"]["message"]
    answer = requests.post(f"{base}/completions", headers=headers, json={**body, "model": "nope"}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "model_not_found"
