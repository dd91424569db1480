"""The service's HTTP API as the user docs describe it: `/v1/harvest` submit, read (long-poll),
list and cancel, with the error body turned into one exception.

Reads retry transport failures and 5xx answers (a few times, backing off) and wait out a 429
for the key's request rate (its Retry-After). Any other 4xx is the service's considered
answer, and the caller decides what it means (a 429 on submit is waited out by
`harvest_client.harvest`, a 400 for too many tokens splits the job).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx

__all__ = ["ApiError", "HarvestApi", "TERMINAL"]

TERMINAL = ("done", "failed", "cancelled")
_RETRIES = 4
_THROTTLED = 30


class ApiError(Exception):
    """An error answer: `status`, and the error body's `code`, `param` and `message`."""

    def __init__(self, status: int, code: str | None, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        """Seconds from the Retry-After header, when the answer had one."""

    @classmethod
    def from_response(cls, response: httpx.Response) -> "ApiError":
        try:
            error = response.json().get("error") or {}
        except ValueError:
            error = {}
        return cls(
            response.status_code,
            error.get("code"),
            error.get("message") or response.text[:500],
            error.get("param"),
            _retry_after(response),
        )


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


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
            raise ValueError("No API base: pass api_base= or set ACS_API_BASE (e.g. http://127.0.0.1:8000/v1).")
        if not key:
            raise ValueError("No API key: pass api_key= or set ACS_API_KEY.")
        self.http = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """A read: transport errors and 5xx retried with backoff; a 429 (the key's request
        rate, `rate_limit_exceeded`) waited out for its Retry-After, up to `_THROTTLED` times."""
        failures = throttled = 0
        while True:
            try:
                response = self.http.request(method, f"{self.base}{path}", **kwargs)
            except httpx.TransportError:
                failures += 1
                if failures > _RETRIES:
                    raise
                time.sleep(min(2**failures, 10))
                continue
            if response.status_code == 429 and throttled < _THROTTLED:
                throttled += 1
                time.sleep(_retry_after(response) or 1.0)
                continue
            if response.status_code >= 500 and failures < _RETRIES:
                failures += 1
                time.sleep(min(2**failures, 10))
                continue
            return response

    def _json(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        return response.json()

    def submit(self, body: dict) -> dict:
        """POST /harvest → the pending harvest object. Not retried on a transport error after
        the body was sent: a retry could admit the job twice."""
        response = self.http.post(f"{self.base}/harvest", json=body)
        return self._json(response)

    def read(self, job_id: str, wait: float = 0) -> LongPoll:
        """GET /harvest/{job_id}[?wait=]; long-polls hold the connection up to `wait` seconds."""
        params = {"wait": min(max(wait, 0), 60)} if wait else None
        response = self._request("GET", f"/harvest/{job_id}", params=params, timeout=(wait or 0) + 60)
        declined = response.headers.get("X-Acs-Longpoll") == "declined"
        return LongPoll(self._json(response), (_retry_after(response) or 3.0) if declined else None)

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
