"""Every error the client raises on purpose, under one base class.

    HarvestClientError                 catch this for "anything the client refused or met"
    ├── ConfigError (ValueError)       no API base or key; a bad argument (the CLI exits 2)
    ├── ApiError                       the service answered an error: .status, .code, .message,
    │   │                              .param, .retry_after (seconds, from Retry-After)
    │   └── ServiceUnavailable         a 503 (overloaded, or a model without weights) that was
    │                                  still 503 after honouring its Retry-After
    ├── HarvestFailed (RuntimeError)   jobs failed or were cancelled; the folder keeps the rest
    ├── FolderError (ValueError)       the dataset folder holds another harvest, or is not empty
    └── VerificationError              a downloaded file does not match its manifest, or the
        └── UnsafeManifest             manifest names a file outside the output folder

The command line (`harvest-client`) prints one line for any of them,
`harvest-client: error: <status> <code>: <message>` for an `ApiError`, and exits non-zero.
Errors of the libraries underneath (httpx's transport errors: the service unreachable) are
not wrapped; the command line reports those in one line too.
"""

from __future__ import annotations

import httpx

__all__ = [
    "HarvestClientError",
    "ConfigError",
    "ApiError",
    "ServiceUnavailable",
    "HarvestFailed",
    "FolderError",
    "VerificationError",
    "UnsafeManifest",
]


class HarvestClientError(Exception):
    """The base of every error the client raises on purpose."""

    exit_status = 1
    """The command line's exit status for this error."""


class ConfigError(HarvestClientError, ValueError):
    """The client is not told where or who: no API base or key (or a bad argument)."""

    exit_status = 2


class ApiError(HarvestClientError):
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
        except (ValueError, AttributeError):
            error = {}
        kind = ServiceUnavailable if response.status_code == 503 else cls
        return kind(
            response.status_code,
            error.get("code"),
            error.get("message") or response.text[:500],
            error.get("param"),
            retry_after(response),
        )


class ServiceUnavailable(ApiError):
    """503: the service is overloaded (or the model cannot run now); try again after `retry_after`."""


class HarvestFailed(HarvestClientError, RuntimeError):
    """Some jobs failed or were cancelled; the folder keeps every finished part."""


class FolderError(HarvestClientError, ValueError):
    """The dataset folder holds another harvest (other prompts or fields), or is not empty."""


class VerificationError(HarvestClientError):
    """A downloaded file does not match its manifest (after every retry)."""


class UnsafeManifest(VerificationError):
    """A manifest names a file that would land outside the output folder (`..`, an absolute
    path, a separator): refused before anything is written."""


def retry_after(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (a number of seconds), or None."""
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
