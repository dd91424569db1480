"""Chat completions (`POST /v1/chat/completions`): messages rendered with the model's own chat
template on the server, then run exactly as a completion of those tokens.

Why render here: a client that renders the template itself and sends the text to
`/v1/completions` gets the tokenizer's BOS in front of the template's own, a silent second
BOS that shifts every position. The template writes every special token it wants, so its text
is tokenized with `add_special_tokens=False`: one BOS, never two (transformers'
`apply_chat_template(tokenize=True)` does the same). A model whose tokenizer has no chat
template is refused with a 400 that points to `/v1/completions`.

With `output_residual_stream`, `activations.residual_stream.message_spans` says where each
message's tokens lie among the returned positions (position p is prompt token p):
`[start, end)` covers what the template rendered for that message (its role markers
included; text the template adds before the first message, such as a default system prompt,
counts as the first message's), `[content_start, content_end)` the message's own text.
Positions from the last span's end up to `usage.prompt_tokens` are the template's generation
prompt (e.g. `<|im_start|>assistant\\n`); the generated tokens follow.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from harvest.completions import (
    MAX_LOGPROBS,
    CompletionBody,
    InlineRequest,
    PreparedCompletion,
    body_with_residual,
    check_prompt_length,
    fewest_tokens,
    plan_completion,
    requested_layers,
    usage_of,
    validate_request,
)
from harvest.engines.base import Generation
from harvest.errors import InvalidRequest
from harvest.registry import Registry
from harvest.request import WholeInt
from harvest.tokenize import load_tokenizer

__all__ = ["TextPart", "ChatMessage", "ChatRequest", "RenderedChat", "render_chat", "parse_chat_request",
           "prepare_chat", "chat_response", "chat_logprobs"]

MAX_MESSAGES = 256
"""Messages in one request. Their spans take one render of the template per message (a
conversation's prefixes), so the work grows with messages × text: this bounds it at 256
renders of a prompt that fits the context (checked before the spans are sought)."""


class TextPart(BaseModel):
    """One part of a message's content; only text parts are served."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    """"developer" is OpenAI's newer name for "system", and is rendered as one."""
    content: str | list[TextPart]
    """The text, or a list of text parts joined in order."""
    name: str | None = None
    """Accepted and not rendered (chat templates have no place for it)."""

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(InlineRequest):
    """An OpenAI-style chat completion, optionally with the residual stream."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (
        *InlineRequest.NULL_IS_DEFAULT, "max_completion_tokens", "logprobs", "top_logprobs")

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    """The conversation so far (1 to 256 messages), rendered with the model's chat template."""
    max_tokens: WholeInt | None = Field(default=None, ge=1)
    """Tokens to generate; default: what is left of the context window."""
    max_completion_tokens: WholeInt | None = Field(default=None, ge=1)
    """OpenAI's newer name for `max_tokens`; send one or the other."""
    logprobs: StrictBool = False
    """true: each sampled token's log-probability."""
    top_logprobs: WholeInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """With `logprobs`: this many most likely alternatives per token."""

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_length(cls, value: int | None, info) -> int | None:
        if value is not None and info.data.get("max_tokens") is not None:
            raise ValueError("send max_tokens or max_completion_tokens, not both")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_chat_request(body: Any) -> ChatRequest:
    """A decoded JSON body → the chat request, or a 400 naming the first bad field."""
    return validate_request(ChatRequest, body)


class RenderedChat(BaseModel):
    """The prompt's token ids and where each message lies among them."""

    ids: list[int]
    spans: list[dict]


def _token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """The first token that starts at or after character `char` (the count when none does)."""
    for index, (start, _) in enumerate(offsets):
        if start >= char:
            return index
    return len(offsets)


def render_chat(tokenizer, messages: list[ChatMessage], check_text: Callable[[str], None] | None = None) -> RenderedChat:
    """The template's text for `messages` (with the generation prompt), its ids, and each
    message's span (module docstring). `check_text` sees the text before it is tokenized (and
    may refuse it)."""
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    if check_text is not None:
        check_text(text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:2] == [bos, bos]:  # a template that itself writes BOS twice
        raise InvalidRequest("The model's chat template rendered two BOS tokens; send the tokens to /v1/completions.")
    spans, start = [], 0
    for index, message in enumerate(plain):
        through = tokenizer.apply_chat_template(plain[:index + 1], tokenize=False, add_generation_prompt=False)
        # Templates render a conversation's prefix as a prefix of its text; one that does not
        # (it treats the last message specially) gets no spans rather than wrong ones.
        if not text.startswith(through):
            return RenderedChat(ids=ids, spans=[])
        content_at = text.find(message["content"], start, len(through)) if message["content"] else -1
        content = (content_at, content_at + len(message["content"])) if content_at >= 0 else (len(through), len(through))
        spans.append({
            "index": index, "role": messages[index].role,
            "start": _token_at(offsets, start), "end": _token_at(offsets, len(through)),
            "content_start": _token_at(offsets, content[0]), "content_end": _token_at(offsets, content[1]),
        })
        start = len(through)
    return RenderedChat(ids=ids, spans=spans)


def prepare_chat(request: ChatRequest, registry: Registry) -> PreparedCompletion:
    """Check the request against its model, render its messages; the 400 a user must see, or the plan."""
    model = registry.get(request.model)
    layers = requested_layers(request, model)
    tokenizer = load_tokenizer(model.require_path())
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            f"{model.name} has no chat template: send the text to /v1/completions instead.", param="model")
    max_tokens = request.max_tokens_asked

    def fits(text: str) -> None:  # from the rendered text's length, before seconds of tokenizing
        # (the template's text, not the messages': a template may trim what they hold)
        check_prompt_length(model, layers, fewest_tokens(text, model), max_tokens or 1, at_least=True)

    rendered = render_chat(tokenizer, request.messages, fits)
    if max_tokens is None:  # what is left of the window (at least one, so that the window's own 400 is said)
        max_tokens = max(1, model.max_model_len - len(rendered.ids))
    extra = {"message_spans": rendered.spans} if layers is not None else {}
    return plan_completion(request, model, rendered.ids, layers, max_tokens, **extra)


def chat_logprobs(generation: Generation, tokenizer, first: int = 0, count: int | None = None) -> dict:
    """OpenAI's chat `logprobs` object for the sampled tokens [first, first + count)."""
    ids = generation.token_ids[first:None if count is None else first + count]
    content = []
    for offset, token_id in enumerate(ids, start=first):
        token = tokenizer.decode([token_id])
        top = (generation.top_logprobs or [{}] * len(generation.token_ids))[offset] or {}
        content.append({
            "token": token, "logprob": generation.token_logprobs[offset], "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top.items()],
        })
    return {"content": content}


def chat_response(prepared: PreparedCompletion, generation: Generation, *, zstd_threads: int = 0) -> CompletionBody:
    """The response body: OpenAI's chat.completion, plus `activations` when they were asked."""
    logprobs = None
    if prepared.sampling.logprobs is not None:
        logprobs = chat_logprobs(generation, load_tokenizer(prepared.model.require_path()))
    body = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": prepared.model.name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                     "logprobs": logprobs, "finish_reason": generation.finish_reason}],
        "usage": usage_of(generation),
    }
    return body_with_residual(body, prepared, generation, zstd_threads=zstd_threads)
