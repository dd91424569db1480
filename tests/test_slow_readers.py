"""Slow readers (issue 44, item 4): a key's unread inline responses hold at most its share of
the replica's response budget, and a response not read for `send_timeout_s` is cut (the
connection reset) and its bytes released from the budget.

Real parts: the app from its factory on uvicorn on loopback, real keys in the session's job
store, the session's HF engine on the tiny model, raw sockets for the clients that do not read.
What slows things down is outside the app: the listening socket's small send buffer (accepted
connections inherit it), and the clients' small receive buffers, so a response of about a
megabyte fills what the kernel holds and the server waits on its client, as it does for a
bigger response on a real network.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

SEND_TIMEOUT_S = 2.0
TCP_CLOSE = 7  # Linux's TCP states (include/net/tcp_states.h): reset by the peer
TCP_CLOSE_WAIT = 8  # the peer closed its side


@contextmanager
def _serve_with_small_send_buffers(app, http: str):
    """`app` under uvicorn (its `http` parser) in a thread (as `tests.api_fixtures.serve_in_thread`),
    on a listening socket whose accepted connections have a 32 KiB kernel send buffer; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=http, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
            time.sleep(0.05)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _connect(port: int) -> socket.socket:
    """A client socket with a small receive buffer (set before connecting, so the window is small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    return sock


def _body(n_prompt: int) -> dict:
    """An all-layer completion of an `n_prompt`-token prompt and one sampled token: its residual
    stream is exactly `n_prompt` positions (the last sampled token never runs)."""
    return {"model": "llama-tiny", "prompt": [5 + i % 90 for i in range(n_prompt)], "max_tokens": 1, "temperature": 0,
            "output_residual_stream": True}


def _send_request(sock: socket.socket, key: str, body: dict) -> None:
    payload = json.dumps(body).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                 .encode() + payload)  # closed after its answer: a drained refusal ends at once


def _status(sock: socket.socket) -> int:
    """The response's status, peeked: nothing is taken from the socket."""
    line = b""
    while len(line) < 12:
        line = sock.recv(12, socket.MSG_PEEK)
        assert line, "the server closed the connection before answering"
    return int(line[9:12])


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def _drain(sock: socket.socket) -> bytes:
    """Everything the socket still gives, up to its end or its reset."""
    got = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


def _wait_until(condition, seconds: float, what: str) -> float:
    """Poll `condition` until true; returns when (monotonic)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return time.monotonic()


def _app(hf_engine, job_store, budget, send_timeout_s: float):
    from api.app import create_app
    from api.inline_engines import InlineEngines
    from api.settings import ApiSettings

    return create_app(settings=ApiSettings(send_timeout_s=send_timeout_s), store=job_store, inline_budget=budget,
                      inline_engines=InlineEngines(factory=lambda _model: hf_engine, close_engines=False, window_s=0.02))


@pytest.fixture(scope="module")
def keys(job_store):
    from api.auth import create_key

    return {name: create_key(f"slow-readers-{name}", engine=job_store.db) for name in "ABCD"}


def test_a_keys_unread_responses_hold_its_share_and_are_cut_after_the_send_timeout(tiny, hf_engine, job_store, keys):
    """Key A opens four 1.5 MiB activation responses over raw sockets and never reads them: two
    fit its half of a budget of four, two are 503 `replica_busy`. Key B's response of the same
    size is then answered 200 in full while A's are held. Key C reads its response slowly, a few
    KB at a time, so the server waits on it for longer than the send timeout: it is not cut,
    since it keeps reading. About the send timeout after A's responses began, the server resets
    A's connections and the budget's held bytes go back to 0. Key D hangs up mid-body: its bytes
    are freed at once, not after the send timeout. On h11, the parser an API replica runs."""
    from api.routes.completions import ResponseBudget

    n_prompt = 384
    one = tiny.n_layers * n_prompt * tiny.hidden_size * 2  # a response's bytes (bf16): 1.5 MiB
    budget = ResponseBudget(limit=4 * one, key_share=0.5)
    app = _app(hf_engine, job_store, budget, SEND_TIMEOUT_S)
    (key_a, record_a), (key_b, record_b), (key_c, _), (key_d, _) = (keys[name] for name in "ABCD")

    with _serve_with_small_send_buffers(app, "h11") as port:
        # A: four requests at once, none read.
        a_socks = [_connect(port) for _ in range(4)]
        for sock in a_socks:
            _send_request(sock, key_a, _body(n_prompt))
        statuses = [_status(sock) for sock in a_socks]
        assert sorted(statuses) == [200, 200, 503, 503], statuses
        headers_seen = time.monotonic()
        for sock, status in zip(a_socks, statuses):
            if status == 503:  # the small refusals are read: it is the large answers that are not
                head, _, error = _drain(sock).partition(b"\r\n\r\n")
                assert json.loads(error)["error"]["code"] == "replica_busy" and b"retry-after: 2" in head.lower(), error
        held = [sock for sock, status in zip(a_socks, statuses) if status == 200]
        assert budget.held_by(record_a.id) == 2 * one == budget.in_flight

        # C reads slowly on its own thread meanwhile: 8 KB every 0.1 s.
        slow: dict = {}

        def read_slowly() -> None:
            try:
                _read_slowly()
            except Exception as exc:  # noqa: BLE001 - the main thread reports it
                slow["error"] = repr(exc)

        def _read_slowly() -> None:
            started = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port)
            conn.sock = _connect(port)
            conn.request("POST", "/v1/completions", body=json.dumps(_body(64)),
                         headers={"Authorization": f"Bearer {key_c}", "Content-Type": "application/json"})
            answer = conn.getresponse()
            body = bytearray()
            while piece := answer.read(8192):
                body += piece
                time.sleep(0.1)
            slow.update(status=answer.status, body=bytes(body), seconds=time.monotonic() - started)
            conn.close()

        reader = threading.Thread(target=read_slowly, daemon=True)
        reader.start()

        # B, while A holds its two: answered in full.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", headers={"Authorization": f"Bearer {key_b}"},
                          timeout=60) as client:
            answer = client.post("/completions", json=_body(n_prompt))
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["activations"]["residual_stream"]["shape"] == [tiny.n_layers, n_prompt, tiny.hidden_size]
        assert budget.peak >= 3 * one  # B's bytes were held beside A's two
        _wait_until(lambda: budget.held_by(record_b.id) == 0, 5, "B's bytes still held once it has them all")

        # A's two are cut after the send timeout: no bytes left held, connections reset.
        released = _wait_until(lambda: budget.held_by(record_a.id) == 0, 4 * SEND_TIMEOUT_S + 10,
                               f"A's {budget.held_by(record_a.id)} bytes are still held")
        assert released - headers_seen >= 0.8 * SEND_TIMEOUT_S, "cut before the send timeout"
        for sock in held:
            _wait_until(lambda: _tcp_state(sock) in (TCP_CLOSE, TCP_CLOSE_WAIT), 5, "A's connection is still open")
            received = _drain(sock)
            assert not received.endswith(b"0\r\n\r\n"), "A's response was sent whole"  # chunked: its end never came
            sock.close()

        # C read more slowly than the server sends, and was not cut.
        reader.join(60)
        assert slow.get("status") == 200, slow
        assert json.loads(slow["body"])["activations"]["residual_stream"]["shape"][1] == 64
        assert slow["seconds"] > 1.5 * SEND_TIMEOUT_S, slow["seconds"]  # the server waited on it that long
        _wait_until(lambda: budget.in_flight == 0, 5, f"{budget.in_flight} bytes still held")

        # D hangs up mid-body: freed at once, not after the send timeout.
        sock = _connect(port)
        _send_request(sock, key_d, _body(n_prompt))
        assert _status(sock) == 200
        assert budget.in_flight == one
        sock.close()
        left = time.monotonic()
        freed = _wait_until(lambda: budget.in_flight == 0, 5, f"{budget.in_flight} bytes still held after D left")
        assert freed - left < SEND_TIMEOUT_S / 2, freed - left
        assert budget.peak <= budget.limit


def test_a_response_bigger_than_the_keys_share_runs_when_its_key_holds_nothing_else():
    """The share never makes a legal request unrunnable: a key holding nothing gets one
    response of any size that fits the budget (and one bigger than the budget when nothing is
    held); a second of that key waits for the first. Another key's fits beside it."""
    from api.routes.completions import ResponseBudget
    from harvest.errors import HarvestError

    budget = ResponseBudget(limit=1000, key_share=0.25)
    big = budget.hold("a", 600)  # over a's share of 250, but a holds nothing else
    with pytest.raises(HarvestError) as refused:
        budget.hold("a", 10)
    assert (refused.value.status, refused.value.code) == (503, "replica_busy")
    assert "one key's may hold 250" in str(refused.value)
    other = budget.hold("b", 200)
    assert (budget.held_by("a"), budget.held_by("b"), budget.in_flight) == (600, 200, 800)
    with pytest.raises(HarvestError):
        budget.hold("c", 250)  # the budget's own limit still applies
    big.shrink(100)
    small = budget.hold("a", 100)  # a is back within its share
    for hold in (big, other, small, small):  # release is idempotent
        hold.release()
    assert budget.in_flight == 0 and budget.held_by("a") == 0
    alone = budget.hold("c", 5000)  # bigger than the whole budget: runs when nothing is held
    alone.release()
    assert budget.in_flight == 0


def test_an_unread_response_is_cut_on_httptools_too(tiny, hf_engine, job_store, keys):
    """uvicorn's other parser (its default where httptools is installed): the unread response
    is cut after the send timeout, its connection reset and its bytes freed."""
    from api.routes.completions import ResponseBudget

    budget = ResponseBudget(limit=64 << 20)
    key, record = keys["A"]
    with _serve_with_small_send_buffers(_app(hf_engine, job_store, budget, 1.0), "httptools") as port:
        sock = _connect(port)
        _send_request(sock, key, _body(384))
        assert _status(sock) == 200
        assert budget.held_by(record.id) == tiny.n_layers * 384 * tiny.hidden_size * 2
        _wait_until(lambda: budget.in_flight == 0, 10, f"{budget.in_flight} bytes still held")
        _wait_until(lambda: _tcp_state(sock) in (TCP_CLOSE, TCP_CLOSE_WAIT), 5, "the connection is still open")
        assert not _drain(sock).endswith(b"0\r\n\r\n")
        sock.close()
