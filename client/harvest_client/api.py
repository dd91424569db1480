"""The service's HTTP API as the user docs describe it: `/v1/harvest` submit, read (long-poll),
list and cancel, with the error body turned into one exception.

Reads retry transport failures and 5xx answers (a few times, backing off; a 503's
Retry-After is honoured) and wait out a 429 for the key's request rate (its Retry-After). Any
other 4xx is the service's considered answer, and the caller decides what it means (a 429 on
submit is waited out by `harvest_client.harvest`, a 400 for too many tokens splits the job).

A submit carries an `Idempotency-Key` when the caller has one (`harvest_client.harvest` sends
one per planned job): the service answers the same job for the same key and body, so such a
submit is retried after a transport failure too. A 503 (the service overloaded; it made no
job) is waited out for its Retry-After, with or without a key.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx

from harvest_client.errors import ApiError, ConfigError, retry_after

__all__ = ["ApiError", "HarvestApi", "TERMINAL", "IDEMPOTENCY_HEADER"]

TERMINAL = ("done", "failed", "cancelled")
IDEMPOTENCY_HEADER = "Idempotency-Key"
_RETRIES = 4
_THROTTLED = 30
_UNAVAILABLE = 8
"""503 answers waited out (each for its Retry-After) before a call gives up with `ServiceUnavailable`."""
_RETRY_AFTER_CAP_S = 60.0


@dataclass
class LongPoll:
    """One read of a harvest: the harvest object, and how long to wait before the next read
    when the service declined to hold the request (`X-Acs-Longpoll: declined`)."""

    harvest: dict
    declined_retry_after: float | None = None


class HarvestApi:
    """`ACS_API_BASE` / `ACS_API_KEY` (or the arguments) and one pooled HTTP client."""

    def __init__(self, api_base: str | None = None, api_key: str | None = None, *, timeout: float = 120.0):
        self.base = (api_base or os.environ.get("ACS_API_BASE") or "").rstrip("/")
        key = api_key or os.environ.get("ACS_API_KEY")
        if not self.base:
            raise ConfigError("No API base: pass api_base= or set ACS_API_BASE (e.g. http://127.0.0.1:8000/v1).")
        if not key:
            raise ConfigError("No API key: pass api_key= or set ACS_API_KEY.")
        self.http = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """A read: transport errors and 5xx retried with backoff (a 503 after its Retry-After);
        a 429 (the key's request rate, `rate_limit_exceeded`) waited out for its Retry-After,
        up to `_THROTTLED` times."""
        return self._send(method, path, retry_failures=True, throttle=True, **kwargs)

    def _send(self, method: str, path: str, *, retry_failures: bool, throttle: bool, **kwargs) -> httpx.Response:
        failures = throttled = unavailable = 0
        while True:
            try:
                response = self.http.request(method, f"{self.base}{path}", **kwargs)
            except httpx.TransportError:
                failures += 1
                if not retry_failures or failures > _RETRIES:
                    raise
                time.sleep(min(2**failures, 10))
                continue
            wait = retry_after(response)
            if response.status_code == 429 and throttle and throttled < _THROTTLED:
                throttled += 1
                time.sleep(wait or 1.0)
                continue
            if response.status_code == 503 and wait is not None and unavailable < _UNAVAILABLE:
                # Overloaded, and it says when to come back: it made nothing, so ask again then.
                unavailable += 1
                time.sleep(min(wait, _RETRY_AFTER_CAP_S))
                continue
            if response.status_code >= 500 and retry_failures and failures < _RETRIES:
                failures += 1
                time.sleep(min(2**failures, 10))
                continue
            return response

    def _json(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        return response.json()

    def submit(self, body: dict, idempotency_key: str | None = None) -> dict:
        """POST /harvest → the pending harvest object.

        With `idempotency_key` the service answers the same job for a repeat of the same key and
        body, so transport failures are retried; without one they are not (a retry could admit
        the job twice). A 503 (no job made) is waited out for its Retry-After either way."""
        headers = {IDEMPOTENCY_HEADER: idempotency_key} if idempotency_key else None
        keyed = idempotency_key is not None
        response = self._send("POST", "/harvest", retry_failures=keyed, throttle=False, json=body, headers=headers)
        return self._json(response)

    def read(self, job_id: str, wait: float = 0) -> LongPoll:
        """GET /harvest/{job_id}[?wait=]; long-polls hold the connection up to `wait` seconds."""
        params = {"wait": min(max(wait, 0), 60)} if wait else None
        response = self._request("GET", f"/harvest/{job_id}", params=params, timeout=(wait or 0) + 60)
        declined = response.headers.get("X-Acs-Longpoll") == "declined"
        return LongPoll(self._json(response), (retry_after(response) or 3.0) if declined else None)

    def get(self, job_id: str) -> dict:
        return self.read(job_id).harvest

    def cancel(self, job_id: str) -> dict:
        return self._json(self._request("DELETE", f"/harvest/{job_id}"))

    def list(self, limit: int = 100) -> list[dict]:
        """Every harvest of this key, newest first (all pages)."""
        jobs: list[dict] = []
        after = None
        while True:
            params = {"limit": limit, **({"after": after} if after else {})}
            page = self._json(self._request("GET", "/harvest", params=params))
            jobs.extend(page["data"])
            if not page.get("has_more"):
                return jobs
            after = page["last_id"]

    def models(self) -> list[dict]:
        return self._json(self._request("GET", "/models"))["data"]
