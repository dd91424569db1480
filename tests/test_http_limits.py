"""Bounded HTTP parsing (issue 44, item 3): the request line, each header line, the whole head
and the time to send it have limits; past one the replica answers 414, 431 or 408 with the API's
error body and closes the connection, before the app sees anything (`api.http_server`).

The size tests run against the session's replica (`api_server`: the real app in a uvicorn
process started by `fleet.roles.api_command`, as `harvest api` starts it) at the shipped
defaults: 8 KiB a line, 16 KiB a head. The time tests serve the app under the same server
options in a thread, with a 0.5 s head timeout. Measured before (uvicorn on httptools): a
64 MB header line was read whole (the replica grew by 64 MB), and a head sent a byte at a time
was waited for without end.
"""

from __future__ import annotations

import select
import socket
import time

import psutil
import pytest

from testbed import http_calls
from tests.api_fixtures import serve_in_thread

HEAD_TIMEOUT_S = 0.5


def _exchange(port: int, data: bytes, timeout: float = 10) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection; everything the server sends back, and whether it
    closed the connection (rather than leaving it open past `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return _read_to_close(sock, timeout)


def _read_to_close(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    sock.settimeout(timeout)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        return answer, False
    except ConnectionResetError:
        pass
    return answer, True


def _status_and_code(answer: bytes) -> tuple[int, str | None]:
    import json

    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower(), head
    return status, json.loads(body)["error"]["code"] if body else None


def _head(target: str = "/v1/models", **headers: str) -> bytes:
    lines = [f"GET {target} HTTP/1.1", "Host: 127.0.0.1", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# --- sizes, against the replica as shipped ---------------------------------------------------

@pytest.mark.parametrize(("head", "status", "code"), [
    (_head(X_Pad="a" * 8200), 431, "request_head_too_large"),                    # one header line over 8 KiB
    (_head(**{f"X-Pad-{i}": "a" * 6000 for i in range(3)}), 431, "request_head_too_large"),  # each line under, all over 16 KiB
    (_head("/v1/models?" + "q" * 8200), 414, "request_line_too_long"),          # the request line over 8 KiB
], ids=["header-line", "all-headers", "request-line"])
def test_a_head_over_a_limit_is_refused_and_the_connection_closed(api_server, head, status, code):
    answer, closed = _exchange(api_server.port, head)
    assert _status_and_code(answer) == (status, code), answer[:300]
    assert closed


def test_an_endless_header_line_is_cut_not_buffered(api_server):
    """A header line that never ends: the replica answers 431 and closes within the first read
    or two; the client cannot push more than what the sockets' buffers hold, and the replica
    does not grow by what was offered."""
    replica = psutil.Process(api_server.process.pid)
    before = replica.memory_info().rss
    offered, chunk = 64 << 20, b"a" * (64 << 10)
    sent, answered = 0, b""
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Flood: ")
        sock.setblocking(False)
        while sent < offered:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable:
                break  # an answer, or the close
            assert writable, "the replica stopped reading without answering"
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        answered, closed = _read_to_close(sock, 10)
    assert sent < 16 << 20, f"{sent} bytes of the header line were taken in"
    assert closed
    # The answer may be lost to the reset the close sends while the client's bytes are unread.
    assert not answered or _status_and_code(answered) == (431, "request_head_too_large"), answered[:300]
    assert replica.memory_info().rss - before < 16 << 20


def test_requests_within_the_limits_are_served(api_server, make_key):
    """A head just under each limit, a head sent in pieces, a head and a long body in one read,
    and a kept connection's next requests."""
    key = make_key()
    pads = {"Authorization": f"Bearer {key}", "X-Pad-1": "a" * 8000, "X-Pad-2": "b" * 7000}
    answer, _ = _exchange(api_server.port, _head(**pads, Connection="close"))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]

    with socket.create_connection(("127.0.0.1", api_server.port), timeout=10) as sock:
        whole = _head(Authorization=f"Bearer {key}", Connection="close")
        for piece in (whole[:10], whole[10:40], whole[40:]):
            sock.sendall(piece)
            time.sleep(0.05)
        answer, closed = _read_to_close(sock, 10)
    assert answer.startswith(b"HTTP/1.1 200 ") and closed, answer[:300]

    # A head followed by a body in the same read, longer together than a whole head: the head is
    # read as a head (the route answers: GET only), the body is not taken for one.
    body = b"x" * (64 << 10)
    post = (f"POST /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body
    answer, _ = _exchange(api_server.port, post)
    assert answer.startswith(b"HTTP/1.1 405 "), answer[:300]

    with http_calls.httpx.Client(base_url=api_server.base_url, verify=http_calls.TLS, timeout=30) as client:
        for _ in range(3):  # one connection, kept
            assert client.get("/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_the_head_limits_are_validated():
    from pydantic import ValidationError

    from api.settings import ApiSettings

    with pytest.raises(ValidationError, match="must not exceed http_head_bytes"):
        ApiSettings(http_line_bytes=32 << 10, http_head_bytes=16 << 10)
    with pytest.raises(ValidationError):
        ApiSettings(http_head_timeout_s=0)


# --- time: the app under the same server options, head timeout 0.5 s ----------------------

@pytest.fixture(scope="module")
def slow_head_server(job_store):
    from api.app import create_app
    from api.settings import ApiSettings

    with serve_in_thread(create_app(store=job_store), ApiSettings(http_head_timeout_s=HEAD_TIMEOUT_S)) as root:
        yield int(root.rsplit(":", 1)[1])


def _trickle(sock: socket.socket, started: float, limit_s: float) -> tuple[bytes, bool]:
    """Send a header byte every 0.1 s (a head that never ends) until the server answers or
    closes, or `limit_s` passes."""
    sock.setblocking(False)
    while time.monotonic() - started < limit_s:
        if select.select([sock], [], [], 0.1)[0]:
            break
        try:
            sock.send(b"x")
        except (BrokenPipeError, ConnectionResetError):
            break
    sock.setblocking(True)
    return _read_to_close(sock, 2)


def test_a_head_sent_too_slowly_is_408_and_the_connection_closed(slow_head_server):
    started = time.monotonic()  # before the connection: the server's clock starts when it accepts it
    with socket.create_connection(("127.0.0.1", slow_head_server), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        answer, closed = _trickle(sock, started, limit_s=5)
        elapsed = time.monotonic() - started
    assert _status_and_code(answer) == (408, "request_timeout"), answer[:300]
    assert closed and HEAD_TIMEOUT_S <= elapsed < HEAD_TIMEOUT_S + 1.5, elapsed


def test_a_connection_that_sends_nothing_is_closed(slow_head_server):
    started = time.monotonic()
    answer, closed = _exchange(slow_head_server, b"", timeout=5)
    assert closed and answer == b"" and time.monotonic() - started < HEAD_TIMEOUT_S + 1.5


def test_the_next_head_on_a_kept_connection_has_the_same_time(slow_head_server):
    """After a response the timer starts again: a kept connection cannot trickle its next head
    (any byte cancels uvicorn's own keep-alive timer)."""
    with socket.create_connection(("127.0.0.1", slow_head_server), timeout=10) as sock:
        sock.sendall(_head("/health"))
        first = b""
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first[:300]
        started = time.monotonic()
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nX-Slow: ")
        answer, closed = _trickle(sock, started, limit_s=5)
        elapsed = time.monotonic() - started
    assert _status_and_code(answer) == (408, "request_timeout"), answer[:300]
    assert closed and elapsed < HEAD_TIMEOUT_S + 1.5, elapsed
