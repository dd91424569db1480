"""`POST /v1/chat/completions`: OpenAI-style chat completions, rendered with the model's chat
template on the server (`harvest.chat`), then served exactly as a completion of those tokens:
the same engines, response budget and activation quota (`api.routes.completions.serve_inline`).
With `stream`, server-sent events (`harvest.inline_stream`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from api.admission import Admission
from api.deps import Models, Store
from api.openapi import request_body
from api.ratelimit import SubmitKey
from api.routes.completions import INLINE_RESPONSES, accepted_schema, admit_inline, decode_json, serve_inline
from harvest.chat import ChatRequest, chat_response, parse_chat_request, prepare_chat
from harvest.inline_stream import chat_events

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/chat/completions", responses=INLINE_RESPONSES,
             openapi_extra=request_body(ChatRequest, patch=accepted_schema(ChatRequest)))
async def create_chat_completion(request: Request, budget: Admission, registry: Models, store: Store,
                                 key: SubmitKey) -> StreamingResponse:
    """A chat completion; with `output_residual_stream`, the residual stream at every position
    that ran and where each message's tokens lie (`message_spans`)."""
    # Rendering and tokenizing (and, the first time, reading the model's files) is blocking
    # work, done inside the admission budget as a completion's is.
    prepared = await admit_inline(request, budget, key,
                                  lambda raw: prepare_chat(parse_chat_request(decode_json(raw)), registry))
    return await serve_inline(request, key, store, prepared, chat_events if prepared.request.stream else chat_response)
