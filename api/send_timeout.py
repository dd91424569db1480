"""Slow readers: a response whose client reads nothing of it for `send_timeout_s` is cut.

Why: a response's bytes are held by the replica until its client takes them. An inline
completion holds its residual stream in the replica's response budget
(`api.routes.completions.ResponseBudget`) until its last byte is sent, so a client that opens
the largest activation responses and never reads them used to hold the budget for as long as
it kept its sockets open, and every other key was answered 503 `replica_busy`. Any other
response held its buffers and its connection the same way.

How: `SendTimeout` is a pure ASGI middleware, outermost of the app's own (`api.app`). Each
`send` of a response normally returns at once (the server queues the bytes); it waits only
while the server's write buffer is full, i.e. while the client is not reading. A send that has
waited `timeout_s` is looked at: if the bytes the client has not taken yet (the transport's
buffer plus the kernel's send queue) went down meanwhile, the client is reading, slowly, and the
send waits on; if not, the connection is cut: reset (SO_LINGER 0, then `abort`), so neither the
server's buffer nor the kernel's waits on a client that never reads. The app then sees what it
sees when a client leaves: its `send` returns without sending and the server says
`http.disconnect`, so a streaming response stops and releases what it holds in its `finally`
(the inline budget's hold: `api.routes.completions._HeldStream`). The waiting send is checked
every `timeout_s`, so a cut comes between one and two `timeout_s` after the client's last read.

ASGI gives an app no handle on its connection. uvicorn's `receive` is a method of its request
cycle, which holds the connection's transport: that is where the transport comes from, before
any middleware wraps `receive` (hence outermost). Under a server where it is not found, a send
that has waited `timeout_s` raises `SendTimedOut` instead, and the server closes the connection
of a response its app failed (ASGI), flushing what it had buffered first.

Not covered: the bytes of a response's last send wait in the server's buffer after the app is
done, until the client takes them or leaves; no send is waiting then, so nothing is timed. That
is at most one piece of an inline response (~350 KB of base64, no longer in the budget) or a
small response whole; bounding how many connections one client holds is the load balancer's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

from starlette.types import ASGIApp, Message, Receive, Scope, Send

try:  # Linux: the bytes in a socket's send queue, not yet acknowledged by the peer (SIOCOUTQ)
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _OUTQ = None

__all__ = ["SendTimeout", "SendTimedOut"]

log = logging.getLogger("harvest.api")


class SendTimedOut(OSError):
    """A response's client read nothing of it for the send timeout (where the connection could
    not be cut directly: see the module docstring)."""


class SendTimeout:
    """Pure ASGI middleware: cut the connection of a response its client stopped reading for
    `timeout_s` seconds (module docstring)."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        transport = _transport_of(receive)
        cut = False

        async def send_within(message: Message) -> None:
            nonlocal cut
            if cut:
                return  # as a server's send after its client left: the app learns it from `receive`
            if transport is not None and not transport.get_write_buffer_size():
                await send(message)  # nothing queued: the server does not wait for the client
                return
            sending = asyncio.ensure_future(send(message))
            try:
                unsent = _unsent(transport)
                while True:
                    done, _ = await asyncio.wait({sending}, timeout=self.timeout_s)
                    if done:
                        return sending.result()
                    now = _unsent(transport)
                    if now is not None and now < unsent:
                        unsent = now  # the client took some bytes: slow, not stalled
                        continue
                    break
            finally:
                if not sending.done():
                    sending.cancel()
            log.warning("%s %s: its client read nothing for %g s; the connection is cut",
                        scope["method"], scope["path"], self.timeout_s)
            if transport is None:
                raise SendTimedOut(f"the client read nothing for {self.timeout_s:g} s")
            cut = True
            _reset(transport)
            await asyncio.sleep(0)  # the server hears of the lost connection (scheduled by `abort`)

        await self.app(scope, receive, send_within)


def _transport_of(receive: Receive):
    """The connection's transport, where the server's `receive` is a method of an object that
    holds it (uvicorn's request cycle, h11 and httptools alike); else None."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    if all(hasattr(transport, name) for name in ("abort", "get_write_buffer_size", "get_extra_info")):
        return transport
    return None


def _unsent(transport) -> int | None:
    """Bytes written to the connection that its client has not taken yet: the transport's
    buffer, and the kernel's send queue where it can be read (Linux)."""
    if transport is None:
        return None
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and _OUTQ is not None:
        try:
            size += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # closed meanwhile
            pass
    return size


def _reset(transport) -> None:
    """Close the connection at once, dropping what is queued for it: with SO_LINGER 0 the
    kernel answers a reset instead of waiting to deliver its send queue."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
