"""Inline activations through the real app (`uvicorn --factory` in its own process), used
the way the user docs use it: `requests` with ACS_API_BASE/ACS_API_KEY, the docs' decode
snippet and their "always assert the shape" checks, compared with an HF reference."""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import requests
import torch

from tests.proc_threads import autogroup_nice
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


def _engine_process(server) -> psutil.Process:
    """The replica's inline engine: a child of its process running `api.inline_process`."""
    api = psutil.Process(server.process.pid)
    engines = [child for child in api.children(recursive=True) if "api.inline_process" in child.cmdline()]
    assert len(engines) == 1, [child.cmdline() for child in api.children(recursive=True)]
    return engines[0]


def _wait_until_dead(pid: int, timeout: float = 10) -> None:
    """Until `pid` has ended (every thread: a thread-group leader shows as a zombie while its
    other threads still exit, and only then may its parent collect it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                zombie = stat.read().rsplit(")", 1)[1].split()[0] == "Z"
            if zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1:
                return
        except FileNotFoundError:  # collected already
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} still running {timeout} s after SIGKILL")


def test_generation_runs_in_a_lower_priority_process_of_its_own(inline_server, hf_engine):
    """Decoding is not the replica's work: it runs in a child process, in a session of its own
    whose scheduling group is lowered (on a host without CUDA), so the replica's requests and
    the rest of the host go first; a child that dies is started again for the next request."""
    headers = {"Authorization": f"Bearer {inline_server.make_key()}"}
    body = {"model": "llama-tiny", "prompt": [7, 8, 9], "max_tokens": 64, "temperature": 0, "output_residual_stream": [0, 7]}
    first = requests.post(f"{inline_server.base_url}/completions", headers=headers, json=body, timeout=300)
    assert first.status_code == 200, first.text
    engine = _engine_process(inline_server)
    api = psutil.Process(inline_server.process.pid)
    assert os.getsid(engine.pid) == engine.pid != os.getsid(api.pid)  # a session (a scheduling group) of its own
    # its group lowered (without autogroups, the documented fallback: its threads' nice only)
    assert autogroup_nice(engine.pid) in (10, None)
    assert engine.nice() == max(10, api.nice())  # lowered, never raised
    assert engine.environ().get("OMP_WAIT_POLICY") == "PASSIVE"  # idle OpenMP threads sleep

    # The generation's CPU is the child's, not the replica's.
    api_before, engine_before = sum(api.cpu_times()[:2]), sum(engine.cpu_times()[:2])
    again = requests.post(f"{inline_server.base_url}/completions", headers=headers,
                          json={**body, "max_tokens": 512}, timeout=300)
    assert again.status_code == 200, again.text
    api_used, engine_used = sum(api.cpu_times()[:2]) - api_before, sum(engine.cpu_times()[:2]) - engine_before
    assert engine_used > 2 * api_used, (engine_used, api_used)

    # Killed between requests: the next request starts another and gets the same answer.
    engine.kill()
    _wait_until_dead(engine.pid)
    third = requests.post(f"{inline_server.base_url}/completions", headers=headers, json=body, timeout=300)
    assert third.status_code == 200, third.text
    assert _engine_process(inline_server).pid != engine.pid
    assert third.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    x = decode_residual_stream(third.json())
    assert np.array_equal(x, decode_residual_stream(first.json()))
    reference, _ = hf_reference(hf_engine.hf_model, [7, 8, 9], [0, 7])  # the prompt's positions
    assert_within_one_bf16_rounding(torch.from_numpy(x[:, :3].astype(np.float32)).to(torch.bfloat16), reference)


def test_an_engine_process_that_dies_mid_request_answers_503_and_charges_nothing(inline_server):
    import threading

    # Quota for exactly one such request: prompt 1 + max_tokens 1,500 - 1 positions.
    headers = {"Authorization": f"Bearer {inline_server.make_key(activation_quota=1500)}"}
    body = {"model": "llama-tiny", "prompt": [7], "max_tokens": 1500, "temperature": 0, "output_residual_stream": [3]}
    warm = requests.post(f"{inline_server.base_url}/completions", headers={"Authorization": f"Bearer {inline_server.make_key()}"},
                         json={**body, "max_tokens": 2}, timeout=300)
    assert warm.status_code == 200, warm.text
    engine = _engine_process(inline_server)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(
        requests.post(f"{inline_server.base_url}/completions", headers=headers, json=body, timeout=300)))
    asking.start()
    before = sum(engine.cpu_times()[:2])
    deadline = time.monotonic() + 60
    while sum(engine.cpu_times()[:2]) < before + 0.5 and time.monotonic() < deadline:
        time.sleep(0.05)  # until the child is decoding this request
    engine.kill()
    asking.join(300)
    (answer,) = answers
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "replica_busy", answer.text
    assert answer.headers["Retry-After"] == "5"
    # The quota held for it was given back: the same request fits the key's whole quota again.
    again = requests.post(f"{inline_server.base_url}/completions", headers=headers, json={**body, "max_tokens": 1500},
                          timeout=300)
    assert again.status_code == 200, again.text
    assert _engine_process(inline_server).pid != engine.pid
