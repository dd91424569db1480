"""Inline bodies (`/v1/completions`, `/v1/chat/completions`) are admitted as submits' are
(`api.admission`): their bytes held in the replica's budget and a place in their key's share
while they are read, parsed and tokenized, on the budget's own places and threads; and a prompt
that can never run is refused from its length, before it is tokenized.

The real app in the test process (`serve_in_thread`), so its own counters (`AdmissionBudget`)
can be read. Its registry is the real one, with a gate: while the gate is closed a look-up of
the model waits (the seconds a large body's parse and tokenizing take, held open), and the
registry counts who waits, so a test knows from events where each request is.
"""

from __future__ import annotations

import json
import math
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harvest.registry import Registry


class GatedRegistry(Registry):
    """The served models; a look-up waits while `gate` is closed (see the module docstring)."""

    def __init__(self, entries, settings):
        super().__init__(entries, settings)
        self.gate = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()

    def get(self, name):
        if not self.gate.is_set():
            with self._lock:
                self.waiting += 1
            try:
                assert self.gate.wait(120), "the test never opened the gate"
            finally:
                with self._lock:
                    self.waiting -= 1
        return super().get(name)


def _until(condition, timeout: float = 60.0, what: str = "") -> None:
    """Wait until `condition()` (state another thread changes), or fail."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.01)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _serve(tiny, admission, store):
    from api.app import create_app
    from api.fairshare import FairShare
    from api.lease import Lease
    from api.settings import ApiSettings
    from api.watcher import Watcher
    from harvest.settings import get_settings
    from tests.api_fixtures import serve_in_thread

    settings = get_settings(ApiSettings)
    with open(settings.models_file, "rb") as handle:
        registry = GatedRegistry(tomllib.load(handle)["models"], settings)
    app = create_app(store=store, registry=registry, admission=admission, fair_share=FairShare(per_key=8, at_once=4))
    # A watcher never started (served without the lifespan): no submit here gets as far as a run.
    app.state.watcher = Watcher(app.state.runs, app.state.storage, store, interval=1, max_waiters=1,
                                lease=Lease("watcher", "inline-admission-test", 10, store.db))
    return serve_in_thread(app), app, registry


def _ids_body(n_ids: int, **fields) -> bytes:
    """A completion of `n_ids` token ids (about 6 bytes of JSON each)."""
    return json.dumps({"model": "llama-tiny", "prompt": [12345] * n_ids, "max_tokens": 1, **fields}).encode()


def test_a_burst_of_one_keys_inline_bodies_waits_in_its_share_and_never_delays_another_keys_read(tiny, job_store):
    """Key A sends 45 completions of 350 KB each at once, their parse held open by the gate.
    Before: each took a thread of the pool every route's blocking work shares (40), so key B's
    one read waited for the burst to end. Now: one of A's is parsed (its key's share), the rest
    wait in the admission queue holding no thread, and B's read is answered meanwhile."""
    from api.admission import AdmissionBudget
    from api.auth import create_key

    budget = AdmissionBudget(concurrency=2, max_bytes=128 << 20, key_share=1, queue=64, wait_s=60)
    server, app, registry = _serve(tiny, budget, job_store)
    burst = create_key("inline-burst", rate_submit_per_s=100.0, rate_submit_burst=100, engine=job_store.db)[0]
    reader = create_key("inline-reader", engine=job_store.db)[0]
    body = _ids_body(50_000)
    assert len(body) > 300_000
    with server as root, httpx.Client(base_url=f"{root}/v1", timeout=120, limits=httpx.Limits(max_connections=64)) as client, \
            ThreadPoolExecutor(45) as pool:
        flood = [pool.submit(client.post, "/completions", content=body,
                             headers={**_auth(burst), "Content-Type": "application/json"}) for _ in range(45)]
        try:
            # Every one of A's requests is in: parsing (held at the gate) or waiting for a place.
            _until(lambda: registry.waiting + budget.waiting >= 40, what="the burst to arrive")
            started = time.monotonic()
            read = client.get("/harvest", headers=_auth(reader), timeout=20)
            took = time.monotonic() - started
            assert read.status_code == 200, read.text
            assert registry.waiting == 1, "one of the key's bodies parsed at a time (its share)"
            assert budget.submits == 1 and budget.bytes == len(body)  # the one held, at its bytes
        finally:
            registry.gate.set()
        answers = [f.result() for f in flood]
    assert took < 10, f"another key's read took {took:.1f} s behind the burst"
    for answer in answers:  # each refused from its length: 50,000 ids is over the context
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert (budget.submits, budget.bytes, budget.working, budget.waiting) == (0, 0, 0, 0)


def test_inline_bodies_hold_their_bytes_and_their_keys_share_so_others_get_503_replica_busy(tiny, job_store):
    """An 8 MB completion held at its parse holds 8 MB of a 12 MB budget: a 5 MB submit and a
    5 MB completion of other keys are answered 503 `replica_busy` with Retry-After, as is a
    second completion of the same key (its share); once answered, it holds nothing."""
    from api.admission import AdmissionBudget
    from api.auth import create_key

    budget = AdmissionBudget(concurrency=2, max_bytes=12 << 20, key_share=1, queue=64, wait_s=0.5)
    server, app, registry = _serve(tiny, budget, job_store)
    big, other, submitter = (create_key(f"inline-budget-{name}", small=5, engine=job_store.db)[0]
                             for name in ("big", "other", "submitter"))
    large = _ids_body(1_150_000)
    assert 7 << 20 < len(large) <= 8 << 20
    five_mb = _ids_body(800_000)
    submit = json.dumps({"model": "llama-tiny", "prompts": ["x" * 5_000_000]}).encode()
    json_type = {"Content-Type": "application/json"}
    with server as root, httpx.Client(base_url=f"{root}/v1", timeout=120) as client, ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.post, "/completions", content=large, headers={**_auth(big), **json_type})
        try:
            _until(lambda: registry.waiting == 1, what="the large body to reach its parse")
            assert (budget.submits, budget.bytes) == (1, len(large))
            refusals = {
                "submit": client.post("/harvest", content=submit, headers={**_auth(submitter), **json_type}),
                "completion": client.post("/completions", content=five_mb, headers={**_auth(other), **json_type}),
                "chat": client.post("/chat/completions", headers=_auth(other), json={
                    "model": "llama-tiny", "messages": [{"role": "user", "content": "y" * 5_000_000}]}),
                "same key": client.post("/completions", headers=_auth(big), json={"model": "llama-tiny", "prompt": "Hi"}),
            }
            assert budget.bytes == len(large)
        finally:
            registry.gate.set()
        answer = held.result()
    for what, refusal in refusals.items():
        assert refusal.status_code == 503, (what, refusal.text)
        assert refusal.json()["error"]["code"] == "replica_busy" and int(refusal.headers["Retry-After"]) >= 1, what
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded", answer.text
    assert (budget.submits, budget.bytes, budget.working, budget.waiting) == (0, 0, 0, 0)


@pytest.fixture(scope="module")
def longest_entry(tiny) -> int:
    """The most characters one token of the tiny model stands for, from its vocabulary."""
    from transformers import AutoTokenizer

    return max(len(entry) for entry in AutoTokenizer.from_pretrained(tiny.path).get_vocab())


def test_a_prompt_that_can_never_fit_is_refused_from_its_length_before_it_is_tokenized(harvest_api, longest_entry):
    """4 MB of text (on both routes) has at least len ÷ the longest vocabulary entry tokens,
    far over max_model_len (2,048): refused saying so, with that lower bound, not the count a
    tokenizer would have taken seconds to give. A text that might fit is still counted exactly."""
    key = harvest_api.make_key(name="inline-length")
    text = "word " * 800_000
    fewest = math.ceil(len(text) / longest_entry)
    assert fewest > 2048
    with httpx.Client(base_url=harvest_api.base_url, headers=_auth(key), timeout=120) as client:
        completion = client.post("/completions", json={"model": "llama-tiny", "prompt": text, "max_tokens": 1})
        chat = client.post("/chat/completions", json={"model": "llama-tiny", "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": text}]})
        captured = client.post("/completions", json={"model": "llama-tiny", "prompt": text, "max_tokens": 1,
                                                     "output_residual_stream": [1]})
        exact = client.post("/completions", json={"model": "llama-tiny", "prompt": "word " * 3000, "max_tokens": 1})
    error = completion.json()["error"]
    assert completion.status_code == 400 and error["code"] == "context_length_exceeded", completion.text
    assert f"at least {fewest} in the prompt" in error["message"]
    error = chat.json()["error"]
    assert chat.status_code == 400 and error["code"] == "context_length_exceeded", chat.text
    assert "at least" in error["message"]  # the template's text, a little longer than the message
    error = captured.json()["error"]
    assert captured.status_code == 400 and error["code"] == "activation_prompt_too_long", captured.text
    assert f"The prompt has at least {fewest} tokens" in error["message"]
    assert exact.status_code == 400 and "at least" not in exact.json()["error"]["message"], exact.text
