"""The control plane's Prefect server (`fleet.prefect_server`): its 503s tell Prefect's clients
how long to wait, in a form Prefect's own client reads; nothing else changes."""

from __future__ import annotations

import asyncio

import httpx

from fleet.prefect_server import RetryAfterOn503


def _app(status: int, headers: list[tuple[bytes, bytes]]):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def _get(app, times: int = 1) -> list[httpx.Response]:
    async def go():
        wrapped = app if isinstance(app, RetryAfterOn503) else RetryAfterOn503(app)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://t") as client:
            return [await client.get("/api/flow_runs") for _ in range(times)]

    return asyncio.run(go())


def test_a_503_gets_a_short_retry_after_that_prefects_client_reads():
    from prefect.client.base import _parse_retry_after

    [response] = _get(_app(503, [(b"content-type", b"application/json")]))
    assert response.status_code == 503 and response.headers["content-type"] == "application/json"
    # Prefect's client waits what it parses here (plus its jitter) instead of 2 s, then 4 s.
    assert _parse_retry_after(response.headers["Retry-After"]) == 0.2


def test_the_wait_doubles_while_503s_keep_coming_up_to_its_cap():
    waits = [float(r.headers["retry-after"]) for r in _get(RetryAfterOn503(_app(503, []), per_step=2, max_s=1.0), 9)]
    assert waits == [0.2, 0.2, 0.4, 0.4, 0.8, 0.8, 1.0, 1.0, 1.0]


def test_other_answers_and_a_503_that_says_its_own_wait_are_left_alone():
    assert "retry-after" not in _get(_app(200, []))[0].headers
    assert _get(_app(503, [(b"Retry-After", b"7")]))[0].headers.get_list("retry-after") == ["7"]
