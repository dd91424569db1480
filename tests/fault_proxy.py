"""A fault-injecting HTTP proxy for tests, in a thread of its own, in front of one real server
(moto's S3 server, Prefect's API): requests pass through unchanged until a rule says otherwise.

Rules match a method and a substring of the path and act on the next `count` matching
requests, then pass them through again:

- ``error``: answer 500 with an S3 error body (``InternalError``, message ``INJECTED_MESSAGE``)
  without forwarding, as a failing object store would;
- ``hang``: read the request, say nothing for `hold_s` seconds, then close the connection (a
  client's read timeout fires first);
- ``hold``: forward the request, then keep the answer (a success: an upstream 5xx passes
  through and the rule waits for the next) from the client until the rule is
  released (`Rule.reached` is set once the upstream has answered): the moment between "the
  server did it" and "the client heard it", where a test kills the client.

Every request is recorded in `seen` as ``(method, path, outcome)``. The client's Host header
is forwarded as is (moto does not check SigV4 signatures), bodies are read whole.
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

__all__ = ["FaultProxy", "Rule", "INJECTED_MESSAGE"]

INJECTED_MESSAGE = "Injected fault: the object store failed this write (test)"
_HOP_BY_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass
class Rule:
    method: str
    path_contains: str
    action: str  # error | hang | hold
    count: int
    hold_s: float = 3.0
    hits: int = 0
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class FaultProxy:
    def __init__(self, upstream: str):
        target = urlparse(upstream)
        self.upstream = (target.hostname, target.port)
        self.rules: list[Rule] = []
        self.seen: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                rule = proxy._take(self.command, self.path)
                action = rule.action if rule else "pass"
                with proxy.lock:
                    proxy.seen.append((self.command, self.path, action))
                if action == "error":
                    payload = (
                        "<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                        f"<Message>{INJECTED_MESSAGE}</Message></Error>"
                    ).encode()
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if action == "hang":
                    rule.released.wait(rule.hold_s)
                    self.close_connection = True
                    return
                try:
                    status, headers, payload = proxy._forward(self.command, self.path, dict(self.headers), body)
                except OSError:  # the upstream is down (a restart): what a load balancer answers
                    status, headers, payload = 502, [("Content-Type", "text/plain")], b"upstream unreachable"
                if action == "hold" and status >= 500:
                    with proxy.lock:  # the upstream refused it (busy): not the answer to hold
                        rule.hits -= 1
                elif action == "hold":
                    rule.reached.set()
                    rule.released.wait(600)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        self.send_header(name, value)
                if self.command == "HEAD":  # no body, but the length of the one a GET would get
                    length = next((v for n, v in headers if n.lower() == "content-length"), "0")
                else:
                    length = str(len(payload))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:  # a client gone mid-answer (killed): expected here
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def start(self) -> "FaultProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        for rule in self.rules:
            rule.release()
        self.server.shutdown()
        self.server.server_close()

    def add(self, method: str, path_contains: str, action: str, count: int = 1, hold_s: float = 3.0) -> Rule:
        rule = Rule(method, path_contains, action, count, hold_s)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            for rule in self.rules:
                rule.release()
            self.rules.clear()
            self.seen.clear()

    def count(self, method: str, path_contains: str) -> int:
        with self.lock:
            return sum(1 for m, p, _ in self.seen if m == method and path_contains in p)

    def _take(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.method == method and rule.path_contains in path and rule.hits < rule.count:
                    rule.hits += 1
                    return rule
        return None

    def _forward(self, method: str, path: str, headers: dict, body: bytes):
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or method in ("PUT", "POST", "PATCH"):
                sent["Content-Length"] = str(len(body))
            conn.request(method, path, body=body or None, headers=sent)
            answer = conn.getresponse()
            payload = answer.read()
            return answer.status, answer.getheaders(), payload
        finally:
            conn.close()
