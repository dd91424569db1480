"""The service's error vocabulary: one exception tree, every error `code` one class. These are
the core's (a request the model cannot serve, an engine or storage failure); the API's own
refusals (keys, rates, quotas, links, routes) subclass `HarvestError` in `api.errors`.

    HarvestError                          500 internal_error (unexpected; the message names a request id)
    ├── InvalidRequest                    400 invalid_request (param names the field)
    │   ├── ModelNotFound                 400 model_not_found
    │   ├── HarvestUnsupported            400 harvest_unsupported
    │   ├── ActivationsUnsupported        400 activations_unsupported
    │   ├── ActivationPromptTooLong       400 activation_prompt_too_long
    │   └── ContextLengthExceeded         400 context_length_exceeded
    ├── ModelUnavailable                  503 harvest_unavailable (weights not present, runs or job store unreachable)
    ├── CaptureFailed                     500 capture_failed (a hook missed a layer)
    ├── EngineFailed                      500 engine_failed (a job's engine died or erred; details in the logs)
    └── StorageFailed                     500 storage_failed (a job's files could not be read or written)
        └── StorageFull                   500 storage_full (no space left for a job's files)

A job's `error` never carries an exception's own text (it can hold host paths, socket names,
memory figures): `job_error` turns any exception into a sentence of this vocabulary plus a
reference, and the caller logs the details under that reference.

Each class fixes its HTTP status, `type` and `code` (a raise site cannot invent a code), so
the API maps any of them to the error body `{"error": {message, type, param, code}}` in one
handler, and `tests/test_api_errors.py` checks that this tree and `api.errors`'s name every
class, and that no two classes share a code.

`invalid_from_pydantic` is the one translation of pydantic's validation errors into the 400
that names the offending field: the API's routes, the inline route and the CLI all use it.

`echo` is how any message repeats a value the request sent (a model name, a field name, a
compression): a short printable excerpt, never the value itself. A refusal is built after the
body's admission hold is released, so an echoed value would otherwise cost its size again
unbudgeted (a 48 MB name came back 2.8 times as long, escaped).
"""

from __future__ import annotations

import errno
import re
import reprlib
import secrets
from typing import Mapping

__all__ = [
    "HarvestError",
    "InvalidRequest",
    "ModelNotFound",
    "HarvestUnsupported",
    "ActivationsUnsupported",
    "ActivationPromptTooLong",
    "ContextLengthExceeded",
    "ModelUnavailable",
    "CaptureFailed",
    "invalid_from_pydantic",
    "validate_body",
    "echo",
    "ECHO_CHARS",
    "EngineFailed",
    "StorageFailed",
    "StorageFull",
    "JOB_ERROR",
    "new_reference",
    "job_error",
    "safe_job_error",
]


class HarvestError(Exception):
    """Something went wrong on our side; the message says what to show us (a request id)."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(HarvestError):
    """The request is malformed or asks for something that cannot be; `param` names the field."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFound(InvalidRequest):
    """No served model has this name."""

    code = "model_not_found"


class HarvestUnsupported(InvalidRequest):
    """The model is served, but not for bulk harvests, or not on the engine this host runs
    (vLLM refuses an architecture it cannot load: the message names the model, the engine and
    what to use instead)."""

    code = "harvest_unsupported"


class ActivationsUnsupported(InvalidRequest):
    """The model does not serve inline activations (`output_residual_stream`)."""

    code = "activations_unsupported"


class ActivationPromptTooLong(InvalidRequest):
    """An inline capture's prompt is over the model's effective activation cap."""

    code = "activation_prompt_too_long"


class ContextLengthExceeded(InvalidRequest):
    """prompt + max_tokens is over the model's context."""

    code = "context_length_exceeded"


class ModelUnavailable(HarvestError):
    """The model's weights are not here, or its runs cannot be started or the job store reached
    right now (then with Retry-After)."""

    status = 503
    type = "server_error"
    code = "harvest_unavailable"


class CaptureFailed(HarvestError):
    """A capture missed a layer: the request fails rather than return a short tensor."""

    status = 500
    type = "server_error"
    code = "capture_failed"


ECHO_CHARS = 64
"""The most characters of a request's value a message repeats (`echo`)."""

# Containers shown by their first few items, so a long list is never rendered whole first.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxtuple, _SHORT_REPR.maxdict = 2, 4, 4, 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxlong = _SHORT_REPR.maxother = ECHO_CHARS


def _printable(text: str, limit: int) -> tuple[str, bool]:
    """`text` with what is not printable escaped (`\\x00`, `\\u200b`), cut to `limit`
    characters of output; and whether anything was cut. Reads at most `limit` characters."""
    out, size = [], 0
    for char in text[:limit]:
        shown = char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        if size + len(shown) > limit:
            return "".join(out), True
        out.append(shown)
        size += len(shown)
    return "".join(out), len(text) > limit


def echo(value: object, *, quote: bool = True, limit: int = ECHO_CHARS) -> str:
    """A request's value as a message may repeat it: at most `limit` printable characters
    (quoted, as `repr` would, unless `quote` is false), and when it was longer, `…` and its
    length in characters. For a field's name in `param`, `quote=False`."""
    if not isinstance(value, str):
        shown, cut = _printable(_SHORT_REPR.repr(value), limit)
        return f"{shown}…" if cut else shown
    shown, cut = _printable(value, limit)
    if quote:
        shown = "'" + shown.replace("'", "\\'") + "'"
    return f"{shown}… ({len(value):,} characters)" if cut else shown


_LOCATIONS = ("body", "query", "path", "header", "cookie")


def validate_body(model, body: bytes, *, strict: bool | None = None):
    """`body` (JSON) validated into the pydantic `model`, or the 400 (`invalid_from_pydantic`).
    Here, not among the API's dependencies, so that what validates a submit (an assessing child,
    `api.admission_process`) imports no web framework and no SQL to do it."""
    from pydantic import ValidationError

    try:
        return model.model_validate_json(body or b"null", strict=strict)
    except ValidationError as exc:
        raise invalid_from_pydantic(exc.errors()) from None


def invalid_from_pydantic(errors: list[dict], *, hints: Mapping[str, str] | None = None) -> InvalidRequest:
    """The 400 for pydantic's validation errors: the first offending field in `param`, and a
    message saying what is wrong with it.

    `hints`: a better sentence per field where pydantic's own would mislead (a union reports
    only its first branch's complaint).
    """
    if not errors:
        return InvalidRequest("The request is not valid.")
    first = errors[0]
    kind = first.get("type", "")
    # A location holds the body's own keys where a field is unknown: cut like any echoed value.
    loc = [echo(str(p), quote=False) for p in first.get("loc", ()) if p not in _LOCATIONS]
    if kind == "json_invalid":
        return InvalidRequest("We could not parse the JSON body of your request. Send a JSON object.")
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        return InvalidRequest("The request body must be a JSON object.")
    if kind == "extra_forbidden":
        param = ".".join(p for p in loc if not p.isdigit())
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    param = loc[0] if loc else None
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: {param!r}.", param=param)
    hinted = _hinted(loc, hints or {})
    if hinted is not None:
        where, hint = hinted
        return InvalidRequest(f"Invalid value for {where!r}: {hint}.", param=param)
    # A validator's own message may quote the value it refused.
    message = echo(str(first.get("msg", "invalid")).removeprefix("Value error, "), quote=False, limit=400)
    return InvalidRequest(f"Invalid value for {'.'.join(loc)!r}: {message}.", param=param)


def _hinted(loc: list[str], hints: Mapping[str, str]) -> tuple[str, str] | None:
    """The hint for the deepest field of `loc` that has one (a field's path without list
    indices, `messages.content`), and that field's place (`messages.0.content`)."""
    for depth in range(len(loc), 0, -1):
        where = loc[:depth]
        hint = hints.get(".".join(p for p in where if not p.isdigit()))
        if hint is not None:
            return ".".join(where), hint
    return None


# --- serving bounds and job errors: the API's byte budget, the vocabulary of job errors ---

class EngineFailed(HarvestError):
    """The engine running a job died or failed (out of memory, a lost engine server)."""

    code = "engine_failed"


class StorageFailed(HarvestError):
    """A job's files could not be read or written."""

    code = "storage_failed"


class StorageFull(StorageFailed):
    """The storage had no space left for a job's files."""

    code = "storage_full"


_SENTENCES = {
    StorageFull.code: "The storage had no space left for the harvest's files.",
    EngineFailed.code: "The engine running this harvest failed.",
    StorageFailed.code: "The harvest's files could not be read or written.",
    HarvestError.code: "The harvest failed on our side.",
}
JOB_ERROR = re.compile(r"^[a-z_]+: [^\n]{1,600} \(ref [0-9a-f]{12}\)$")
"""What every job `error` made by `job_error` looks like: `code: sentence (ref 0123456789ab)`."""


def new_reference() -> str:
    """A short random id that ties a job's `error` to the log lines holding its details."""
    return secrets.token_hex(6)


def _kind(exc: BaseException) -> type[HarvestError]:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StorageFull
    if isinstance(exc, OSError) and not isinstance(exc, (ConnectionError, TimeoutError)):
        return StorageFailed  # fsspec and s3fs raise OSError subclasses (FileNotFoundError, PermissionError)
    if isinstance(exc, (RuntimeError, MemoryError, ConnectionError, TimeoutError, EOFError)):
        return EngineFailed  # a lost or failed engine server, an out-of-memory torch error
    return HarvestError


def job_error(exc: BaseException) -> tuple[str, str]:
    """A job's `error` for the exception that failed it, and its reference.

    Our own refusals (a request the model cannot run, a capture that missed a layer) keep
    their message: we wrote it for the user. Anything else is the vocabulary's sentence for its
    kind; the caller logs the exception under the reference.
    """
    ref = new_reference()
    if isinstance(exc, HarvestError) and type(exc).code not in _SENTENCES:
        text = " ".join(exc.message.split())
        text = text if len(text) <= 500 else text[:497] + "..."
        return f"{exc.code}: {text} (ref {ref})", ref
    kind = type(exc) if isinstance(exc, HarvestError) else _kind(exc)
    return f"{kind.code}: {_SENTENCES[kind.code]} (ref {ref})", ref


def safe_job_error(message: str | None) -> tuple[str, str | None]:
    """A run's failure message as a job's `error`: kept when `job_error` made it, else replaced
    by the vocabulary's sentence and a new reference (returned, for the caller to log the
    original under)."""
    if message and JOB_ERROR.match(message):
        return message, None
    ref = new_reference()
    return f"{HarvestError.code}: {_SENTENCES[HarvestError.code]} (ref {ref})", ref
