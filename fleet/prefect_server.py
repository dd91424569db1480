"""The control plane's Prefect server: Prefect's own app, served as `prefect server start`
serves it in the foreground (one process, its services in the app's lifespan, or with
`--no-services` the API alone, for a scaled control plane: `fleet.control_plane`), with one
change: a 503 carries `Retry-After`.

Why: Prefect's server answers 503 when a database write collides with another (on SQLite,
the embedded default, a transaction that read before another writer committed fails with
`SQLITE_BUSY_SNAPSHOT` instead of waiting), and Prefect's clients (the API's submits, the
workers' claims, the runs' state and log writes) then sleep 2 s, then 4 s, unless the answer
says how long to wait. Such a collision clears in milliseconds; measured on `make run`, the
default back-off was a 2-8 s stall in one job of two or three. The clients honour the header
(with their own jitter), so a collision costs a fraction of a second instead.

Settings are Prefect's, read from the environment as `prefect server start` reads them
(PREFECT_HOME, PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_SERVER_API_AUTH_STRING…), but for
the fleet's: proxies (`fleet.proxies`) and the bounds on request heads (`HARVEST_HTTP_*`,
`api.http_server`), the same as an API replica's: a header flood must not grow the control
plane either.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

__all__ = ["RetryAfterOn503", "main"]


class RetryAfterOn503:
    """ASGI wrapper: a 503 response without `Retry-After` gets one.

    The wait is `base_s` while 503s are rare (a collision clears in milliseconds) and doubles
    for every `per_step` more 503s the server answered in the last `window_s`, up to `max_s`:
    a server truly overloaded is not asked again five times a second by every client, and a
    client's limited tries (PREFECT_CLIENT_MAX_RETRIES, 5) span seconds even when its own
    request is the only one refused (0.2 + 0.2 + 0.4 + 0.4 + 0.8 s), and up to the cap when
    many are: a run's state change is not given up in the first second of a collision storm.
    """

    def __init__(self, app, *, base_s: float = 0.2, max_s: float = 8.0, window_s: float = 10.0, per_step: int = 2):
        self.app = app
        self.base_s, self.max_s, self.window_s, self.per_step = base_s, max_s, window_s, per_step
        self._recent: deque[float] = deque()  # when the last 503s were answered

    def retry_after_s(self) -> float:
        """The wait to announce with a 503 answered now (counts it)."""
        now = time.monotonic()
        self._recent.append(now)
        while now - self._recent[0] > self.window_s:
            self._recent.popleft()
        return min(self.max_s, self.base_s * 2 ** ((len(self._recent) - 1) // self.per_step))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    wait = f"{self.retry_after_s():g}".encode()
                    message = {**message, "headers": [*headers, (b"retry-after", wait)]}
            await send(message)

        return await self.app(scope, receive, send_with_retry_after)


def _wait_for(url: str) -> None:
    """Until `url` answers 200 (no limit here: whoever started this process bounds its start)."""
    import httpx

    with httpx.Client(timeout=2) as client:
        while True:
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from prefect.logging.configuration import setup_logging
    from prefect.server.api.server import create_app
    from prefect.settings import get_current_settings

    parser = argparse.ArgumentParser(prog="python -m fleet.prefect_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4200)
    parser.add_argument("--no-services", action="store_true",
                        help="the API alone, as `prefect server start --no-services` (a scaled control plane, "
                             "`fleet.control_plane`, runs the services in a process of their own)")
    parser.add_argument("--after", metavar="URL",
                        help="serve only once URL (the health check of a scaled control plane's first server, which "
                             "migrates the database) answers 200: this process's imports overlap that migration")
    args = parser.parse_args(argv)
    if args.after:
        _wait_for(args.after)
    from api.http_server import http_options
    from fleet.proxies import uvicorn_proxy_options
    from fleet.settings import FleetSettings
    from harvest.settings import get_settings

    setup_logging()
    server = get_current_settings().server
    settings = get_settings(FleetSettings)
    uvicorn.run(
        RetryAfterOn503(create_app(final=True, webserver_only=args.no_services)),
        host=args.host,
        port=args.port,
        **uvicorn_proxy_options(settings.trusted_proxies),  # never uvicorn's loopback default
        **http_options(settings),  # heads bounded in size and time, as on the API replicas
        timeout_keep_alive=server.api.keepalive_timeout,
        ws_ping_interval=server.api.websocket_ping_interval,
        ws_ping_timeout=server.api.websocket_ping_timeout,
        log_level=server.logging_level.lower(),
    )


if __name__ == "__main__":
    main()
