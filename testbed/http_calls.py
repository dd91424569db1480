"""The tests' HTTP calls: httpx's functions, each given one TLS context made once.

`httpx.get(...)` makes a client per call, and every client makes a TLS context, loading the
whole CA bundle (~20 ms of CPU), even for the plain http:// of loopback. Tests poll servers
many times a second (a replica coming up, long-polls, progress), and a profile of a full run
(py-spy) found those contexts taking a third of the test processes' CPU. Each call still
gets a client, and a connection, of its own, as before.
"""

from __future__ import annotations

import ssl

import certifi
import httpx

__all__ = ["get", "post", "delete", "request", "TLS"]

TLS = ssl.create_default_context(cafile=certifi.where())
"""What httpx makes for each client by default, made once."""


def request(method: str, url: str, **kwargs) -> httpx.Response:
    return httpx.request(method, url, verify=TLS, **kwargs)


def get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, verify=TLS, **kwargs)


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, verify=TLS, **kwargs)


def delete(url: str, **kwargs) -> httpx.Response:
    return httpx.delete(url, verify=TLS, **kwargs)
