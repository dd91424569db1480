"""What the routes share: the registry, the storage, the run backend, the watcher, the body
reader with its 50 MB cap, and the translation of pydantic's errors into the 400 body."""

from __future__ import annotations

from functools import lru_cache

from fastapi import Request
from pydantic import ValidationError

from api.runs import Runs, load_runs
from api.watcher import Watcher
from harvest.errors import InvalidRequest, PayloadTooLarge
from harvest.registry import Registry, load_registry
from harvest.settings import get_settings
from harvest.storage import Storage, open_storage

__all__ = [
    "MAX_BODY_BYTES",
    "INLINE_MAX_BODY_BYTES",
    "registry",
    "storage",
    "runs",
    "watcher",
    "base_url",
    "read_body",
    "invalid_from_errors",
]

MAX_BODY_BYTES = 50 * 1024 * 1024
INLINE_MAX_BODY_BYTES = 8 * 1024 * 1024
"""A completion's body: a prompt of 128k token ids is ~1 MB of JSON; 8 MB leaves room."""


@lru_cache(maxsize=1)
def registry() -> Registry:
    return load_registry()


@lru_cache(maxsize=1)
def storage() -> Storage:
    return open_storage()


def runs() -> Runs:
    return load_runs()


def watcher(request: Request) -> Watcher:
    return request.app.state.watcher


def base_url(request: Request) -> str:
    """Where links to the API's own file route point (HARVEST_PUBLIC_BASE_URL behind a proxy)."""
    return get_settings().public_base_url or str(request.base_url).rstrip("/")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, advice: str = "Split the prompts into several jobs.") -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` bytes (never
    read whole first: a huge body would hold the process's memory and time)."""
    declared = request.headers.get("content-length")
    too_large = PayloadTooLarge(f"The request body is over this route's limit of {limit // (1024 * 1024)} MB. {advice}")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _param(loc: tuple, kind: str) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    if not parts:
        return None
    if kind == "extra_forbidden":
        return ".".join(p for p in parts if not p.isdigit())
    return parts[0]


def invalid_from_errors(errors: list[dict]) -> InvalidRequest:
    """A 400 naming the first offending field (`param`) and saying what is wrong with it."""
    first = errors[0]
    kind = first.get("type", "")
    param = _param(tuple(first.get("loc", ())), kind)
    if param is None and kind == "model_type":
        return InvalidRequest("The request body must be a JSON object.", param=None)
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "json_invalid":
        return InvalidRequest(
            "We could not parse the JSON body of your request. Send a JSON object.", param=None
        )
    elif kind == "missing":
        message = f"Missing required parameter: {param!r}."
    else:
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        message = f"Invalid value for {where!r}: {first.get('msg', 'invalid')}."
    return InvalidRequest(message, param=param)


def parse(model, body: bytes):
    """Validate a JSON body into `model`, or raise the 400."""
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise invalid_from_errors(exc.errors()) from None
