"""The API replica's own refusals: keys, request rates, per-key caps and quotas, download
links, routes and bodies. Each subclasses the core's `harvest.errors.HarvestError`, so one
handler maps them all to the error body, and `tests/test_api_errors.py` checks that this tree
and the core's name every class, with no code used twice.

    HarvestError (harvest.errors)
    ├── Unauthorized                      401 invalid_api_key
    ├── LinkRefused                       403 link_invalid (expired, altered or foreign link)
    ├── NotFound                          404 harvest_job_not_found
    │   └── FileGone                      404 file_not_found (a valid link to a swept file)
    ├── RouteNotFound                     404 route_not_found (no such path)
    ├── MethodNotAllowed                  405 method_not_allowed (with Allow)
    ├── RequestTimeout                    408 request_timeout (a body or request head that did not arrive in time)
    ├── NotCancellable                    409 harvest_not_cancellable
    ├── IdempotencyConflict               409 idempotency_key_reused (same key, another body)
    ├── PayloadTooLarge                   413 request_too_large
    ├── RequestLineTooLong                414 request_line_too_long (`api.http_server`)
    ├── HeadTooLarge                      431 request_head_too_large (a header line, or the whole head; `api.http_server`)
    ├── RateLimited                       429 rate_limit_exceeded (per-key request rate; Retry-After)
    │   ├── SpendCapped                   429 spend_cap (Retry-After)
    │   ├── ConcurrencyExceeded           429 harvest_concurrency_exceeded
    │   ├── QuotaExceeded                 429 harvest_quota_exceeded
    │   ├── BudgetExceeded                429 budget_exceeded
    │   ├── CapacityExceeded              429 harvest_capacity_exceeded
    │   ├── ActivationQuotaExceeded       429 activation_quota_exceeded
    │   └── StorageQuotaExceeded          429 storage_quota_exceeded (the key's files would pass its bytes held)
    └── ReplicaBusy                       503 replica_busy (this API replica's budget is spent; Retry-After)
"""

from __future__ import annotations

from typing import Iterable

from harvest.errors import HarvestError

__all__ = [
    "Unauthorized",
    "LinkRefused",
    "NotFound",
    "FileGone",
    "RouteNotFound",
    "MethodNotAllowed",
    "RequestTimeout",
    "NotCancellable",
    "IdempotencyConflict",
    "PayloadTooLarge",
    "RequestLineTooLong",
    "HeadTooLarge",
    "RateLimited",
    "SpendCapped",
    "ConcurrencyExceeded",
    "QuotaExceeded",
    "BudgetExceeded",
    "CapacityExceeded",
    "ActivationQuotaExceeded",
    "StorageQuotaExceeded",
    "ReplicaBusy",
]


class Unauthorized(HarvestError):
    """No key, an unknown key, or a revoked key."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class LinkRefused(HarvestError):
    """A download link that expired, was altered, or names no file of the job."""

    status = 403
    type = "invalid_request_error"
    code = "link_invalid"


class NotFound(HarvestError):
    """No such job for this key (another key's job reads the same: never reveal it exists)."""

    status = 404
    type = "invalid_request_error"
    code = "harvest_job_not_found"


class FileGone(NotFound):
    """A validly signed link to a file that is not (or no longer) there."""

    code = "file_not_found"


class RouteNotFound(HarvestError):
    """No route has this path."""

    status = 404
    type = "invalid_request_error"
    code = "route_not_found"


class MethodNotAllowed(HarvestError):
    """The path exists, the method does not; `Allow` lists the methods it has."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: Iterable[str]):
        super().__init__(message)
        self.headers["Allow"] = ", ".join(allow)


class RequestTimeout(HarvestError):
    """The request's body did not arrive within its time (a place in the admission budget is
    held while it arrives, so a slow sender cannot keep it), or its head did not
    (`HARVEST_HTTP_HEAD_TIMEOUT_S`, `api.http_server`)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class NotCancellable(HarvestError):
    """Done or failed jobs cannot be cancelled."""

    status = 409
    type = "invalid_request_error"
    code = "harvest_not_cancellable"


class IdempotencyConflict(HarvestError):
    """An `Idempotency-Key` already used, within its window, for a submit with another body."""

    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class PayloadTooLarge(HarvestError):
    """The request body is over its route's cap."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestLineTooLong(HarvestError):
    """The request line is longer than `HARVEST_HTTP_LINE_BYTES` (answered by the HTTP server,
    before the app sees the request; the connection closes)."""

    status = 414
    type = "invalid_request_error"
    code = "request_line_too_long"


class HeadTooLarge(HarvestError):
    """A header line is longer than `HARVEST_HTTP_LINE_BYTES`, or the request head longer than
    `HARVEST_HTTP_HEAD_BYTES` (answered by the HTTP server; the connection closes)."""

    status = 431
    type = "invalid_request_error"
    code = "request_head_too_large"


class RateLimited(HarvestError):
    """Too many requests from this key in a short time (the per-key rate limit); the base of
    every 429. `retry_after` (seconds) becomes the Retry-After header."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int | None = None, param: str | None = None):
        super().__init__(message, param=param)
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)


class SpendCapped(RateLimited):
    """New harvests are paused service-wide (`harvest spend-cap on`)."""

    code = "spend_cap"


class ConcurrencyExceeded(RateLimited):
    """The key has its most jobs queued or running in this lane."""

    code = "harvest_concurrency_exceeded"


class QuotaExceeded(RateLimited):
    """The key used its monthly job quota."""

    code = "harvest_quota_exceeded"


class BudgetExceeded(RateLimited):
    """The job's tokens are over what is left of the key's monthly token budget."""

    code = "budget_exceeded"


class CapacityExceeded(RateLimited):
    """The lane has its most jobs queued or running across the service."""

    code = "harvest_capacity_exceeded"


class ActivationQuotaExceeded(RateLimited):
    """The key used its monthly inline-activation quota."""

    code = "activation_quota_exceeded"


class StorageQuotaExceeded(RateLimited):
    """The job's output bytes (its admitted cost) and the bytes the key's kept files already
    hold together pass the key's storage quota. No Retry-After: bytes come free when the key's
    files pass their retention, not after a fixed wait."""

    code = "storage_quota_exceeded"


class ReplicaBusy(HarvestError):
    """This API replica is spending its whole budget for this kind of work (submits being
    read and tokenized at once; inline response bytes in flight); `retry_after` (seconds)
    becomes the Retry-After header. Another replica, or this one a moment later, takes the request."""

    status = 503
    type = "server_error"
    code = "replica_busy"

    def __init__(self, message: str, *, retry_after: int):
        super().__init__(message)
        self.headers["Retry-After"] = str(retry_after)
