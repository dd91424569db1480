"""`POST /v1/completions`: OpenAI-style completions with inline residual-stream activations.

The route is thin: read, parse and check the request (`harvest.completions`) inside the replica's
admission budget and its key's share, as a submit's body (`admit_inline`), hold the response's bytes
in the replica's budget and its key's share of it (`ResponseBudget`: 503 `replica_busy` with
Retry-After over either; a client that reads nothing for `send_timeout_s` is cut and its bytes
freed: `api.send_timeout`), hold the activation quota, await the model's batcher
(`api.inline_engines`), and stream the response:
the body around the residual stream is rendered once, and the stream's `data` is compressed
and base64-encoded piece by piece in worker threads as it is sent, so a replica never holds
several whole copies of a payload (the bytes are what a JSONResponse of the same body would
be; the response has no Content-Length). Every refusal is a `harvest.errors` exception,
rendered by the app's one handler.

The warm engines live in an `InlineEngines` on `app.state.inline_engines`, given by the app's
factory (`api.app.create_app`) with no model loaded; they follow a worker
host's rules (`HARVEST_ENGINE_MODELS_PER_GROUP` models at once, the least recently used idle
one unloaded for another). `HARVEST_INLINE_PRELOAD` (comma-separated served names) loads those
engines in the background at start-up, so the first request does not wait for a model load.

Where the user docs are silent, this is what the endpoint does:
- A text prompt is tokenized with BOS; a token-id prompt runs verbatim. A one-element list
  of either is taken as that prompt; several prompts are refused (one response carries one
  prompt's activations).
- `usage.completion_tokens` and the positions count every sampled token, an EOS included
  (its text is not returned). With a stop string the text ends before it, and the tokens end
  with the one that completed it (it was sampled, the positions before it ran).
- `logprobs` are the model's own distribution, before temperature and top_p; `text_offset`
  counts from the start of the completion.
- `activations.residual_stream.layers` (an addition to the docs' fields) lists which blocks
  `shape[0]` holds, ascending.
- The activation quota counts residual-stream positions returned (`shape[1]`, prompt +
  generated − 1) of requests with `output_residual_stream`: the most a request may return
  (prompt + max_tokens − 1) is held before the engine runs (429 when that would pass the
  quota), and only what the response carries is kept once it is generated (nothing when the
  request fails). `GET /v1/models` needs a key, like every route.
- Fields OpenAI has and we do not implement are refused unless at their neutral value; any
  other unknown field is a 400 naming it in `param`.
- `stream: true` answers with server-sent events (`harvest.inline_stream`), sent once the
  completion is generated, the activations in the final chunk.

`serve_inline` is the one path of both inline routes (this one and `api.routes.chat`): the response
budget, the activation quota and the engines apply to a chat exactly as to a completion.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.admission import Admission, AdmissionBudget, declared_bytes, read_body_within
from api.auth import ApiKey, reserve_activations, settle_activations
from api.db import JobStore
from api.deps import INLINE_MAX_BODY_BYTES, Models, Store
from api.errors import ReplicaBusy
from api.inline_engines import InlineEngines
from api.openapi import errors, request_body
from api.ratelimit import SubmitKey
from harvest.completions import (
    CompletionBody,
    CompletionRequest,
    InlineRequest,
    PreparedCompletion,
    completion_response,
    parse_completion_request,
    prepare_completion,
)
from harvest.errors import InvalidRequest, echo
from harvest.inline_stream import completion_events
from harvest.registry import Registry

__all__ = ["router", "inline_engines", "registry_of", "ResponseBudget", "response_budget", "accepted_schema",
           "decode_json", "admit_inline", "serve_inline", "INLINE_RESPONSES"]

log = logging.getLogger(__name__)

# Responses over this many raw bytes are compressed with zstd worker threads.
_THREADED_ZSTD_BYTES = 8 << 20


def registry_of(app: FastAPI) -> Registry:
    """The app's registry (given by the app's factory, `api.app.create_app`)."""
    return app.state.registry


def inline_engines(app: FastAPI) -> InlineEngines:
    """The app's warm engines (given by its factory)."""
    return app.state.inline_engines


@asynccontextmanager
async def _lifespan(app: FastAPI):
    engines = inline_engines(app)
    preload = [name.strip() for name in (app.state.settings.inline_preload or "").split(",") if name.strip()]
    warming = [asyncio.ensure_future(_warm(engines, app, name)) for name in preload]
    try:
        yield
    finally:
        for task in warming:
            task.cancel()
        await engines.close()


async def _warm(engines: InlineEngines, app: FastAPI, name: str) -> None:
    try:
        model = await run_in_threadpool(registry_of(app).get, name)
        await engines.get(model)
        log.info("inline engine for %s is warm", name)
    except Exception:  # noqa: BLE001 - a failed preload leaves the model to load on first use
        log.exception("could not preload the inline engine for %s", name)


router = APIRouter(lifespan=_lifespan)


def accepted_schema(model: type[InlineRequest]) -> Callable[[dict], dict]:
    """The body a route accepts, which pydantic's schema of the model does not quite say:
    OpenAI clients send null for "the default" (and, to /v1/completions, a batch of exactly
    one prompt)."""

    def patch(schema: dict) -> dict:
        props = schema["properties"]
        for name in model.NULL_IS_DEFAULT:
            field = props[name]
            if not any(branch.get("type") == "null" for branch in field.get("anyOf", [])):
                props[name] = {"anyOf": [{k: v for k, v in field.items() if k not in ("default", "title")}, {"type": "null"}],
                               **{k: field[k] for k in ("default", "title") if k in field}}
        if "prompt" in props:
            prompt = props["prompt"]
            one = {"anyOf": [b for b in prompt["anyOf"]]}
            prompt["anyOf"] = [*prompt["anyOf"], {"type": "array", "items": one, "minItems": 1, "maxItems": 1}]
        return schema

    return patch


class ResponseBudget:
    """Bytes of inline residual streams this replica holds at once (`inline_response_budget_bytes`),
    and each key's share of them (`inline_response_key_share`).

    A response holds its largest size (`PreparedCompletion.max_residual_bytes`) from before the
    engine runs, down to its real size once generated, until its last byte is sent, its client
    left, or its client read nothing of it for `send_timeout_s` (`api.send_timeout` cuts the
    connection). A hold is refused with 503 `replica_busy` and Retry-After when it would pass
    the budget, or its key's share: the responses of one key hold at most `key_share` of the
    budget together, as the admission budget gives each key a share of its places
    (`api.admission`), so a key's unread responses leave the rest of the budget to the others.
    Two exceptions keep every legal request runnable: a response bigger than the key's share
    runs when its key holds nothing else, and one bigger than the whole budget (legal by the
    documented prompt cap) when nothing at all is held.
    """

    RETRY_AFTER_S = 2

    def __init__(self, limit: int, *, key_share: float = 0.5):
        self.limit = limit
        self.key_share = key_share
        self.in_flight = 0
        self.peak = 0
        self._per_key: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings) -> "ResponseBudget":
        return cls(settings.inline_response_budget_bytes, key_share=settings.inline_response_key_share)

    @property
    def key_limit(self) -> int:
        """Bytes one key's responses may hold together (its share of `limit`, at least 1)."""
        return max(1, int(self.limit * self.key_share))

    def held_by(self, key_id: str) -> int:
        """Bytes the responses of `key_id` hold."""
        return self._per_key.get(key_id, 0)

    def hold(self, key_id: str, size: int) -> "Hold":
        """`size` bytes for a response of `key_id`, or 503 `replica_busy` (class docstring)."""
        with self._lock:
            held = self._per_key.get(key_id, 0)
            if size and held and held + size > self.key_limit:
                raise ReplicaBusy(
                    f"This key's inline responses hold {held:,} bytes of this API replica, and one key's may hold "
                    f"{self.key_limit:,} at once; this response needs up to {size:,}. Read the responses already "
                    f"sent to you, or try again in {self.RETRY_AFTER_S} seconds.",
                    retry_after=self.RETRY_AFTER_S,
                )
            if size and self.in_flight and self.in_flight + size > self.limit:
                raise ReplicaBusy(
                    f"This API replica is sending its most inline activation bytes at once ({self.limit:,} bytes); "
                    f"this response needs up to {size:,}. Try again in {self.RETRY_AFTER_S} seconds.",
                    retry_after=self.RETRY_AFTER_S,
                )
            self._add(key_id, size)
            self.peak = max(self.peak, self.in_flight)
        return Hold(self, key_id, size)

    def _add(self, key_id: str, delta: int) -> None:
        """Under the lock: `delta` bytes more (or fewer) held, in all and by `key_id`."""
        self.in_flight += delta
        held = self._per_key.get(key_id, 0) + delta
        if held > 0:
            self._per_key[key_id] = held
        else:
            self._per_key.pop(key_id, None)

    def _change(self, key_id: str, delta: int) -> None:
        with self._lock:
            self._add(key_id, delta)


class Hold:
    """One response's share of the budget; `release` is idempotent."""

    def __init__(self, budget: ResponseBudget, key_id: str, size: int):
        self.budget = budget
        self.key_id = key_id
        self.size = size

    def shrink(self, size: int) -> None:
        if size < self.size:
            self.budget._change(self.key_id, size - self.size)
            self.size = size

    def release(self) -> None:
        self.shrink(0)


def response_budget(app: FastAPI) -> ResponseBudget:
    """The app's budget of inline response bytes (given by its factory)."""
    return app.state.inline_budget


class _HeldStream(StreamingResponse):
    """The completion's JSON (or its events), encoded piece by piece in worker threads while it
    is sent; its budget hold is released when the response ends, however it ends (a client
    that leaves mid-body included, and one cut for reading nothing: `api.send_timeout`)."""

    def __init__(self, body: CompletionBody, hold: Hold, media_type: str):
        super().__init__(iter(body), media_type=media_type)
        self._body = body
        self._hold = hold

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._body.residual = None
            self._hold.release()


Respond = Callable[..., CompletionBody]
"""Renders a generation: `respond(prepared, generation, zstd_threads=…)`."""


def decode_json(raw: bytes) -> object:
    """An inline body's JSON, or the 400: a string holding a lone surrogate (`"\\ud800"`, which
    JSON's escapes can spell but no text is) is refused naming its top-level field, before a
    tokenizer or an encoder meets it."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: arrays nested too deep (`[[[[…`)
        raise InvalidRequest("The request body is not valid JSON.") from None
    field = _field_with_lone_surrogate(body)
    if field is not None:
        raise InvalidRequest("The request holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                             "text: send the character itself, or its escaped pair.", param=echo(field, quote=False))
    return body


def _field_with_lone_surrogate(body: object) -> str | None:
    """The top-level field (or `body`) of the first string or key that is not encodable text;
    walked without recursion, as the body may nest deep."""
    pending = list(body.items()) if isinstance(body, dict) else [("body", body)]
    for top, value in pending:
        stack = [top, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str) and not _encodable(item):
                return top if _encodable(top) else "body"
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


def _encodable(text: str) -> bool:
    """Whether `text` is text: Python strings can hold lone surrogates, UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def admit_inline(request: Request, budget: AdmissionBudget, key: ApiKey,
                       prepare: Callable[[bytes], PreparedCompletion]) -> PreparedCompletion:
    """An inline body read, parsed and checked (`prepare`, given its raw bytes) inside the
    replica's admission budget, as a submit's is (`api.admission`): its bytes held and a place in
    its key's share from before it is read until it is checked, the parse and tokenizing on one
    of the budget's working places and threads, never the shared pool every key's reads need.
    Over the budget: 503 `replica_busy` with Retry-After, as a submit. Only the checked request
    (its prompt's ids, at most the model's context) is kept past the hold."""
    async with budget.hold(key.id, declared_bytes(request, INLINE_MAX_BODY_BYTES)):
        raw = await read_body_within(request, request.app.state.settings.admission_read_s, INLINE_MAX_BODY_BYTES,
                                     "Send a shorter prompt, or several requests.")
        async with budget.work():
            return await budget.call(prepare, raw)


async def serve_inline(request: Request, key: SubmitKey, store: JobStore, prepared: PreparedCompletion,
                       respond: Respond) -> StreamingResponse:
    """Run a checked inline request under the replica's response budget and the key's
    activation quota (kept in the app's job `store`), and stream what `respond` renders: the one
    path of every inline route, so the budget and the quota apply to each exactly alike."""
    hold = response_budget(request.app).hold(key.id, prepared.max_residual_bytes)
    try:
        month = None
        if prepared.layers is not None:
            month = await run_in_threadpool(reserve_activations, key, prepared.max_positions, store.db)
        try:
            generation = await inline_engines(request.app).generate(prepared.model, prepared.prompt_ids, prepared.sampling,
                                                                    prepared.layers)
            raw_bytes = 0 if generation.residual is None else generation.residual.numel() * 2
            threads = -1 if raw_bytes > _THREADED_ZSTD_BYTES else 0  # -1: zstd uses every core
            answer = await run_in_threadpool(respond, prepared, generation, zstd_threads=threads)
        except BaseException:
            if month is not None:  # shielded: a client that left cancels the request, not this
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(settle_activations, key, month, prepared.max_positions, 0, store.db)
            raise
        if month is not None:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(settle_activations, key, month, prepared.max_positions, answer.positions,
                                        store.db)
        hold.shrink(raw_bytes)
    except BaseException:
        hold.release()
        raise
    media_type = "text/event-stream" if prepared.request.stream else "application/json"
    return _HeldStream(answer, hold, media_type)


INLINE_RESPONSES = {
    200: {"description": "The completion as JSON, or with `stream: true` as server-sent events (`data: <chunk>`, "
                         "then `data: [DONE]`).",
          "content": {
              "application/json": {"schema": {"type": "object"}},
              # each event: `data: <a chunk's JSON, or [DONE]>`
              "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}},
          }},
    **errors(400, 401, 408, 429, 503),  # 408: a body that did not arrive within the admission's time
}
"""The inline routes' answers: JSON, or events when streamed, and their refusals."""


@router.post("/v1/completions", responses=INLINE_RESPONSES,
             openapi_extra=request_body(CompletionRequest, patch=accepted_schema(CompletionRequest)))
async def create_completion(request: Request, budget: Admission, registry: Models, store: Store,
                            key: SubmitKey) -> StreamingResponse:
    """A completion; with `output_residual_stream`, the residual stream at every position that
    ran; with `stream`, server-sent events (`harvest.inline_stream`)."""
    # Tokenizing (and, the first time, reading the model's files) is blocking work.
    prepared = await admit_inline(request, budget, key,
                                  lambda raw: prepare_completion(parse_completion_request(decode_json(raw)), registry))
    stream = prepared.request.stream
    return await serve_inline(request, key, store, prepared, completion_events if stream else completion_response)
