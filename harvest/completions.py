"""Inline activations: the `POST /v1/completions` request, its checks, and its response body;
what a chat completion shares with it (`InlineRequest`, `plan_completion`, `body_with_residual`,
used by `harvest.chat`), streamed or not (`harvest.inline_stream`).

The HTTP layer only parses JSON, authenticates and awaits the model's batcher; everything a user can be refused for is decided here, before any
engine work:

- unknown model → 400 `model_not_found`; a layer out of range → 400 naming the model's range;
- the activation prompt cap `floor(max_activation_prompt_tokens × n_layers ÷ len(layers))`,
  at most `max_model_len` → 400 `activation_prompt_too_long` stating that effective cap;
- prompt + max_tokens over `max_model_len` → 400 `context_length_exceeded`.

Both are checked from the prompt's length before it is tokenized (a text has at least
len ÷ the tokenizer's longest entry tokens), then exactly: tokenizing megabytes of a prompt that
can never run costs seconds of the API's CPU.

A text prompt is tokenized with the model's tokenizer, BOS included (as OpenAI-compatible
servers do); a token-id prompt runs verbatim. Fields are the OpenAI completions fields we
honour; any other field is refused naming it, so a client never silently gets something it
did not ask for. Parameters OpenAI has but we do not implement are accepted only at their
neutral values (n 1, echo false, penalties 0). `seed` is a signed 64-bit integer, stated in the
schema, so a larger one is a 400 naming it, never an engine's overflow in a shared batch.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from harvest.engines.base import Generation, SamplingSpec
from harvest.errors import (
    ActivationPromptTooLong,
    ActivationsUnsupported,
    CaptureFailed,
    ContextLengthExceeded,
    InvalidRequest,
    echo,
    invalid_from_pydantic,
)
from harvest.layers import resolve_layers
from harvest.registry import ModelInfo, Registry
from harvest.request import WholeInt
from harvest.residual_codec import encode_residual_chunks
from harvest.tokenize import load_tokenizer, max_token_chars

if TYPE_CHECKING:  # the residual streams come as tensors from the engines; the API imports this module without torch
    import torch

__all__ = [
    "StreamOptions",
    "InlineRequest",
    "CompletionRequest",
    "PreparedCompletion",
    "validate_request",
    "parse_completion_request",
    "activation_prompt_cap",
    "requested_layers",
    "check_prompt_length",
    "fewest_tokens",
    "plan_completion",
    "prepare_completion",
    "completion_response",
    "body_with_residual",
    "usage_of",
    "render_json",
    "CompletionBody",
]

MAX_STOP = 4
_UNION_HELP = {
    "prompt": "send a non-empty string or a list of token ids (integers)",
    "output_residual_stream": "send true, false, or a list of layer indices (integers)",
    "stop": f"send a string or a list of at most {MAX_STOP} strings",
    "messages.content": "send a string or a list of {\"type\": \"text\", \"text\": …} parts",
}
MAX_LOGPROBS = 5
SEED_RANGE = (-(2**63), 2**63 - 1)
"""A seed is a signed 64-bit integer (what the engines' generators take)."""


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    """One more event before `[DONE]`: no choices, the request's `usage`."""


class InlineRequest(BaseModel):
    """What a completion and a chat completion share: the model, sampling, streaming, and the
    residual stream. OpenAI fields we do not implement are accepted at their neutral values
    only, and any other field is refused naming it."""

    model_config = ConfigDict(extra="forbid")
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (
        "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "presence_penalty",
        "frequency_penalty", "output_residual_stream")
    """Fields an OpenAI client may send as null, meaning "the default"."""

    model: str
    """Served model name, as listed by `GET /v1/models`."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    seed: Annotated[WholeInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    """A signed 64-bit integer; the same seed on the same engine reproduces the same draw."""
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    """Up to 4 strings; the completion ends before the first of them and leaves it out."""
    output_residual_stream: StrictBool | list[WholeInt] = False
    """true: every decoder layer; a list: those layers (returned ascending, deduplicated)."""
    stream: StrictBool = False
    """true: server-sent events, one per generated token, then `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    """Only with `stream`."""
    # OpenAI fields accepted at their neutral values only.
    n: WholeInt = Field(default=1, json_schema_extra={"minimum": 1, "maximum": 1})
    presence_penalty: float = Field(default=0.0, json_schema_extra={"minimum": 0, "maximum": 0})
    frequency_penalty: float = Field(default=0.0, json_schema_extra={"minimum": 0, "maximum": 0})
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        return {k: v for k, v in body.items() if not (v is None and k in cls.NULL_IS_DEFAULT)}

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("n")
    @classmethod
    def _one(cls, value: int | None, info) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"{info.field_name} must be 1: each request returns one completion")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _zero(cls, value: float, info) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported; send 0 or leave it out")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per sampled token to return log-probabilities for, or None for none."""
        raise NotImplementedError

    def sampling(self, max_tokens: int) -> SamplingSpec:
        return SamplingSpec(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stops,
            logprobs=self.top_logprobs_asked(),
        )


class CompletionRequest(InlineRequest):
    """An OpenAI-style completion, optionally with the residual stream."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (*InlineRequest.NULL_IS_DEFAULT, "echo")

    prompt: str | list[WholeInt]
    """Text (tokenized with BOS) or token ids (run verbatim)."""
    max_tokens: WholeInt = Field(default=16, ge=1)
    """Tokens to generate; prompt + max_tokens must fit in max_model_len."""
    logprobs: WholeInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Log-probabilities of the sampled tokens plus this many most likely alternatives."""
    # OpenAI fields accepted at their neutral values only.
    echo: StrictBool = Field(default=False, json_schema_extra={"const": False})
    best_of: Annotated[WholeInt, Field(json_schema_extra={"minimum": 1, "maximum": 1})] | None = None

    @model_validator(mode="before")
    @classmethod
    def _batch_of_one(cls, body: Any) -> Any:
        """What OpenAI clients also send: a batch of one prompt."""
        if isinstance(body, dict):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                body = {**body, "prompt": prompt[0]}
        return body

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("best_of must be 1: each request returns one completion")
        return value

    @field_validator("echo")
    @classmethod
    def _false(cls, value: bool, info) -> bool:
        if value:
            raise ValueError(f"{info.field_name} is not supported; send false or leave it out")
        return value

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


def validate_request(model_class: type[InlineRequest], body: Any) -> InlineRequest:
    """A decoded JSON body → the request, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model_class.model_validate(body, strict=True)
    except ValidationError as exc:
        raise invalid_from_pydantic(exc.errors(), hints=_UNION_HELP) from None


def parse_completion_request(body: Any) -> CompletionRequest:
    """A decoded JSON body → the completion request, or a 400 naming the first bad field."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest(
            "prompt must be one text or one list of token ids: send one request per prompt "
            "(each response carries one prompt's activations).",
            param="prompt",
        )
    return validate_request(CompletionRequest, body)


def activation_prompt_cap(model: ModelInfo, n_layers_asked: int) -> int:
    """The longest prompt an inline capture of `n_layers_asked` layers takes.

    What is bounded is the response size, so the published cap (for every layer) scales up
    as fewer layers are asked, rounded down and clamped to the context the model runs.
    """
    return min(model.max_model_len, model.max_activation_prompt_tokens * model.n_layers // n_layers_asked)


@lru_cache(maxsize=16)
def _vocab_size(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


@dataclass(frozen=True)
class PreparedCompletion:
    """A request checked against its model: what the engine runs and what the response says."""

    request: InlineRequest
    model: ModelInfo
    prompt_ids: list[int]
    layers: list[int] | None
    """Blocks to capture, ascending; None when no activations were asked."""
    sampling: SamplingSpec
    extra_activations: dict = field(default_factory=dict)
    """Fields the route adds to `activations.residual_stream` (a chat's message spans)."""

    @property
    def max_positions(self) -> int:
        """Residual-stream positions the response holds at most (every max_tokens sampled)."""
        return len(self.prompt_ids) + self.sampling.max_tokens - 1

    @property
    def max_residual_bytes(self) -> int:
        """Bytes of the captured residual stream at most (bf16), 0 without activations: what
        the API holds for this response while it runs, encodes and sends it."""
        if self.layers is None:
            return 0
        return len(self.layers) * self.max_positions * self.model.hidden_size * 2


def _prompt_ids(request: CompletionRequest, model: ModelInfo) -> list[int]:
    path = model.require_path()
    if isinstance(request.prompt, str):
        if not request.prompt:
            raise InvalidRequest("The prompt is empty: send at least one character or token id.", param="prompt")
        return list(load_tokenizer(path)(request.prompt, add_special_tokens=True)["input_ids"])
    if not request.prompt:
        raise InvalidRequest("The prompt is empty: send at least one character or token id.", param="prompt")
    vocab = _vocab_size(path)
    bad = [t for t in request.prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"Token id {echo(bad[0])} is out of range: {model.name} has token ids 0 to {vocab - 1}.", param="prompt"
        )
    return list(request.prompt)


def requested_layers(request: InlineRequest, model: ModelInfo) -> list[int] | None:
    """The blocks `output_residual_stream` asks for, ascending, or None; a 400 for a model
    that serves no inline activations or a layer it lacks."""
    asked = request.output_residual_stream
    if asked is False:
        return None
    if not model.inline:
        raise ActivationsUnsupported(
            f"{model.name} does not serve inline activations; use a bulk harvest.", param="output_residual_stream",
        )
    if isinstance(asked, list) and not asked:
        raise InvalidRequest(
            "output_residual_stream must be true or a non-empty list of layers.", param="output_residual_stream"
        )
    return resolve_layers(model, asked, param="output_residual_stream")


def check_prompt_length(model: ModelInfo, layers: list[int] | None, n_prompt: int, max_tokens: int, *,
                        at_least: bool = False) -> None:
    """The activation prompt cap and the context window, for a prompt of `n_prompt` tokens
    (`at_least`: a lower bound, known before tokenizing, `fewest_tokens`)."""
    some = "at least " if at_least else ""
    if layers is not None:
        cap = activation_prompt_cap(model, len(layers))
        if n_prompt > cap:
            raise ActivationPromptTooLong(
                f"The prompt has {some}{n_prompt} tokens, over the activation prompt cap of {cap} tokens for "
                f"capturing {len(layers)} of {model.name}'s {model.n_layers} layers "
                f"(floor({model.max_activation_prompt_tokens} × {model.n_layers} ÷ {len(layers)}), at most "
                f"max_model_len {model.max_model_len}). Shorten the prompt, ask for fewer layers, or use a bulk harvest.",
                param="prompt",
            )
    if n_prompt + max_tokens > model.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
            # max_tokens is the client's number, of any length: echoed within `echo`'s bound.
            f"{some}{echo(n_prompt + max_tokens)} tokens ({some}{n_prompt} in the prompt, {echo(max_tokens)} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )


def fewest_tokens(text: str, model: ModelInfo) -> int:
    """The fewest tokens `text` can be (`harvest.tokenize.max_token_chars`): known from its
    length alone, so a prompt that cannot fit is refused before seconds of tokenizing."""
    return -(-len(text) // max_token_chars(model.require_path()))


def plan_completion(request: InlineRequest, model: ModelInfo, prompt_ids: list[int], layers: list[int] | None,
                    max_tokens: int, **extra_activations) -> PreparedCompletion:
    """The checks every inline request passes once its prompt is tokens: the activation prompt
    cap, and the context window."""
    check_prompt_length(model, layers, len(prompt_ids), max_tokens)
    return PreparedCompletion(request=request, model=model, prompt_ids=prompt_ids, layers=layers,
                              sampling=request.sampling(max_tokens), extra_activations=extra_activations)


def prepare_completion(request: CompletionRequest, registry: Registry) -> PreparedCompletion:
    """Check the request against its model; raise the 400 a user must see, or return the plan."""
    model = registry.get(request.model)
    layers = requested_layers(request, model)
    # From the prompt's length first: a list's is exact, a text's is a lower bound.
    text = isinstance(request.prompt, str)
    fewest = fewest_tokens(request.prompt, model) if text else len(request.prompt)
    check_prompt_length(model, layers, fewest, request.max_tokens, at_least=text)
    return plan_completion(request, model, _prompt_ids(request, model), layers, request.max_tokens)


def _logprobs_body(generation: Generation, tokenizer) -> dict:
    """The OpenAI completions `logprobs` object; text_offset counts from the completion's start."""
    tokens = [tokenizer.decode([t]) for t in generation.token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": generation.token_logprobs,
        "top_logprobs": generation.top_logprobs,
        "text_offset": offsets,
    }


_DATA_MARK = "\u0000residual-data\u0000"
"""Stands for the residual stream's `data` while the rest of the body is rendered: a JSON
string no engine output can hold (a NUL inside a key's value we set ourselves)."""


def render_json(body: dict) -> bytes:
    """JSON exactly as the API's JSONResponse renders it (Starlette's own settings)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


@dataclass
class CompletionBody:
    """A completion's response body, ready to stream: JSON bytes in pieces.

    Without activations it is one piece. With them, the body around the residual stream's
    `data` is rendered once, and `data` is encoded while it is sent (`encode_residual_chunks`),
    so the API never holds the whole payload as text; the bytes are those of the body's
    dict rendered by a JSONResponse. Iterating is blocking work (zstd): a streaming response
    runs it in worker threads, off the event loop. A stream of server-sent events is the same
    thing: `head` holds the events before the residual stream's, `tail` those after.
    """

    head: bytes
    tail: bytes = b""
    residual: torch.Tensor | None = None
    zstd_threads: int = 0
    positions: int = 0
    """Residual-stream positions in the body (`shape[1]`): what the activation quota counts."""

    def __iter__(self) -> Iterator[bytes]:
        yield self.head
        if self.residual is None:
            return
        yield from encode_residual_chunks(self.residual, threads=self.zstd_threads)
        self.residual = None  # the tensor's memory goes as soon as the last piece is out
        yield self.tail


def body_with_residual(body: dict, prepared: PreparedCompletion, generation: Generation, *, zstd_threads: int = 0,
                       before: bytes = b"", after: bytes = b"") -> CompletionBody:
    """`body` rendered, with `activations` added when they were asked (their `data` encoded as
    it is sent), between the bytes `before` and `after`."""
    if prepared.layers is None:
        return CompletionBody(head=before + render_json(body) + after)
    residual = generation.residual
    expected = [len(prepared.layers), len(generation.prompt_ids) + len(generation.token_ids) - 1, prepared.model.hidden_size]
    if residual is None or list(residual.shape) != expected:
        got = None if residual is None else list(residual.shape)
        raise CaptureFailed(f"The engine returned a residual stream of shape {got}, expected {expected}.")
    if str(residual.dtype) != "torch.bfloat16":
        raise CaptureFailed(f"The engine returned a residual stream of {residual.dtype}, not bfloat16.")
    body["activations"] = {"residual_stream": {
        "data": _DATA_MARK,
        "dtype": "int16",
        "original_dtype": "torch.bfloat16",
        "shape": expected,
        "compression": "zstd",
        "layers": list(prepared.layers),  # which blocks shape[0] holds, ascending
        **prepared.extra_activations,
    }}
    head, mark, tail = render_json(body).rpartition(json.dumps(_DATA_MARK, ensure_ascii=False).encode("utf-8")[1:-1])
    if not mark:
        raise AssertionError("the residual stream's place in the body was lost")
    return CompletionBody(head=before + head, tail=tail + after, residual=residual, zstd_threads=zstd_threads,
                          positions=expected[1])


def usage_of(generation: Generation) -> dict:
    n_prompt, n_generated = len(generation.prompt_ids), len(generation.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_generated, "total_tokens": n_prompt + n_generated}


def completion_response(prepared: PreparedCompletion, generation: Generation, *, zstd_threads: int = 0) -> CompletionBody:
    """The response body: OpenAI's text_completion, plus `activations` when they were asked."""
    logprobs = None
    if prepared.request.logprobs is not None:
        logprobs = _logprobs_body(generation, load_tokenizer(prepared.model.require_path()))
    body = {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": prepared.model.name,
        "choices": [{"index": 0, "text": generation.text, "logprobs": logprobs, "finish_reason": generation.finish_reason}],
        "usage": usage_of(generation),
    }
    return body_with_residual(body, prepared, generation, zstd_threads=zstd_threads)
