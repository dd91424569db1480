"""The control plane's server list, as a client role uses it: several Prefect API servers (a
scaled control plane, `fleet.control_plane`), each role talking to one of them, and to the
next when that one is down.

Prefect's clients take one URL (PREFECT_API_URL), and a role's children inherit it: the API's
uvicorn, the worker, and every flow run the worker starts. So a role given several
(HARVEST_PREFECT_API_URLS) hands its children one: a forwarder on 127.0.0.1
(`ApiForwarder`), run by the role for as long as the role runs, that passes each new
connection byte for byte (HTTP calls and the event websockets alike) to the first server of
the role's own order that accepts it. A server that refuses is skipped for `DOWN_S`, then
tried again, so a role returns to its own server once that one is back. A connection open
when its server dies breaks; Prefect's clients retry a broken call (`httpx.ReadError`,
`RemoteProtocolError`) on a new connection, which goes to the next server.

The order is the role's own, by rendezvous hashing of its name with each URL
(`preference`): the roles of a fleet spread evenly over the servers, each starts on the same
one every time, and when one server goes only its roles move, each to its own next.

A load balancer in front of the servers does this for every client at once: give the roles
its one URL as PREFECT_API_URL instead (infra/RUNBOOK.md "A scaled control plane").
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import threading
import time
from urllib.parse import urlparse

__all__ = ["parse_api_urls", "preference", "ApiForwarder", "DOWN_S", "CONNECT_TIMEOUT_S"]

DOWN_S = 5.0
"""How long a server that refused a connection is skipped before it is tried first again."""
CONNECT_TIMEOUT_S = 3.0
"""How long one connection attempt may take (a host gone from the network answers nothing)."""


def parse_api_urls(value: str) -> list[str]:
    """`http://a:4200/api,http://b:4200/api` → the URLs; each an http(s) URL with a host, all
    with the same path (a forwarder serves one path for all). Raises ValueError saying which
    one is wrong."""
    urls = [item.strip().rstrip("/") for item in value.split(",") if item.strip()]
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL of a Prefect API (e.g. http://prefect-api-1:4200/api)")
    if len({urlparse(url).path for url in urls}) > 1:
        raise ValueError(f"the servers' URLs must share one path (e.g. /api): {urls}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a server is listed twice: {urls}")
    return urls


def preference(urls: list[str], name: str) -> list[str]:
    """`urls` in the order the role `name` tries them (rendezvous hashing: highest score of
    sha256(name, url) first). Stable across processes and hosts; removing a URL leaves the
    order of the others unchanged."""
    def score(url: str) -> bytes:
        return hashlib.sha256(f"{name}\0{url}".encode()).digest()

    return sorted(urls, key=score, reverse=True)


class ApiForwarder:
    """A TCP forwarder on 127.0.0.1 to the first server of `urls` (in that order) that accepts
    each new connection; a thread of its own, until `close()`.

    `url` is what the role's children get as PREFECT_API_URL (plain HTTP on loopback; an
    https server is reached over TLS from here)."""

    def __init__(self, urls: list[str], *, host: str = "127.0.0.1", down_s: float = DOWN_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        if not urls:
            raise ValueError("no Prefect API server to forward to")
        self.urls = list(urls)
        self.down_s, self.connect_timeout_s = down_s, connect_timeout_s
        self._down_until: dict[str, float] = {}
        self.chosen: dict[str, int] = {url: 0 for url in self.urls}
        """Connections passed to each server so far."""
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, host, 0))
            except BaseException as exc:  # reported to the constructor's caller
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="prefect-api-forwarder", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}{urlparse(self.urls[0]).path}"

    async def _connect(self):
        now = time.monotonic()
        # Servers marked down are tried last, not never: when all are down, one may be back.
        order = sorted(self.urls, key=lambda url: self._down_until.get(url, 0) > now)
        for url in order:
            parsed = urlparse(url)
            tls = parsed.scheme == "https"
            port = parsed.port or (443 if tls else 80)
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(parsed.hostname, port, ssl=ssl.create_default_context() if tls else None),
                    self.connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                self._down_until[url] = time.monotonic() + self.down_s
                continue
            self._down_until.pop(url, None)
            self.chosen[url] += 1
            return reader, writer
        return None

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:  # every server refused: the client sees a closed connection and retries
            client_writer.close()
            return
        server_reader, server_writer = upstream

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass

        # HTTP and websockets never half-close: when either side ends (a server that closed an
        # idle connection, or died), both connections close, so the client sees it at once.
        pipes = [asyncio.ensure_future(pipe(client_reader, server_writer)),
                 asyncio.ensure_future(pipe(server_reader, client_writer))]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            for writer in (client_writer, server_writer):
                writer.close()

    def close(self) -> None:
        """Stop listening and close every connection it holds (for a role that outlives it: tests)."""
        async def shutdown() -> None:
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
