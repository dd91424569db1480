"""Every refusal the service makes, as one exception tree.

    HarvestError                       500 internal_error
    ├── InvalidRequest                 400 invalid_request_error (param names the field)
    │   ├── ModelNotFound              400 model_not_found
    │   ├── HarvestUnsupported         400 harvest_unsupported
    │   ├── ActivationPromptTooLong    400 activation_prompt_too_long
    │   └── ContextLengthExceeded      400 context_length_exceeded
    ├── Unauthorized                   401 invalid_api_key
    ├── LinkRefused                    403 link_invalid (expired, altered or foreign link)
    ├── NotFound                       404 harvest_job_not_found
    ├── NotCancellable                 409 harvest_not_cancellable
    ├── PayloadTooLarge                413 request_too_large
    ├── RateLimited                    429 (code set per cap; may carry Retry-After)
    ├── ModelUnavailable               503 harvest_unavailable (weights not present)
    └── CaptureFailed                  500 capture_failed (a hook missed a layer)

Each error carries its HTTP status, `type`, `code` and `param`, so the API maps any of them
to the error body `{"error": {message, type, param, code}}` in one handler.
"""

from __future__ import annotations

__all__ = [
    "HarvestError",
    "InvalidRequest",
    "ModelNotFound",
    "HarvestUnsupported",
    "ActivationPromptTooLong",
    "ContextLengthExceeded",
    "Unauthorized",
    "LinkRefused",
    "NotFound",
    "NotCancellable",
    "PayloadTooLarge",
    "RateLimited",
    "ModelUnavailable",
    "CaptureFailed",
]


class HarvestError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(HarvestError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFound(InvalidRequest):
    code = "model_not_found"


class HarvestUnsupported(InvalidRequest):
    code = "harvest_unsupported"


class ActivationPromptTooLong(InvalidRequest):
    code = "activation_prompt_too_long"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(HarvestError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class LinkRefused(HarvestError):
    """A download link that expired, was altered, or names no file of the job."""

    status = 403
    type = "invalid_request_error"
    code = "link_invalid"


class NotFound(HarvestError):
    status = 404
    type = "invalid_request_error"
    code = "harvest_job_not_found"


class NotCancellable(HarvestError):
    status = 409
    type = "invalid_request_error"
    code = "harvest_not_cancellable"


class PayloadTooLarge(HarvestError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(HarvestError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, code: str, retry_after: int | None = None, param: str | None = None):
        super().__init__(message, param=param, code=code)
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)


class ModelUnavailable(HarvestError):
    status = 503
    type = "server_error"
    code = "harvest_unavailable"


class CaptureFailed(HarvestError):
    status = 500
    type = "server_error"
    code = "capture_failed"
