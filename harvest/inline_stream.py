"""`stream: true`: a completion or a chat completion as server-sent events, the way OpenAI's
clients read them.

Each event is `data: <JSON chunk>` and a blank line; the stream ends with `data: [DONE]`.
There is one chunk per sampled token (its text, and its log-probabilities when asked), then a
final chunk with no text and the `finish_reason`, which also carries `activations` when they
were asked: the same object as the non-streaming response's (with a chat's message spans),
its `data` encoded while it is sent. With `stream_options.include_usage`, one more chunk with
no choices and the request's `usage` comes before `[DONE]`.

The events are sent once the completion is generated: the engine runs whole completions, in
batches shared with other requests, and hands them back whole. A failure is therefore still
an ordinary JSON error with its status, never an error in the middle of a stream.

A token's text is the growth of the decoded completion it adds; a token that ends inside a
multi-byte character adds nothing until the token that completes it. The pieces join to
exactly the completion's text (after a stop string is cut off).
"""

from __future__ import annotations

import time
import uuid

from harvest.chat import chat_logprobs
from harvest.completions import CompletionBody, PreparedCompletion, body_with_residual, render_json, usage_of
from harvest.engines.base import Generation
from harvest.tokenize import load_tokenizer

__all__ = ["token_pieces", "completion_events", "chat_events", "DONE"]

DONE = b"data: [DONE]\n\n"


def _event(chunk: dict) -> bytes:
    return b"data: " + render_json(chunk) + b"\n\n"


def token_pieces(tokenizer, token_ids: list[int], text: str) -> list[str]:
    """Each sampled token's share of `text` (the module docstring), one piece per token.

    Decoded incrementally, as detokenizers of serving engines do: only the tokens since the
    last clean cut are decoded again, the ones before them as context, so each token costs a
    short decode, and a piece is given out only once it no longer ends inside a character."""
    pieces: list[str] = []
    context, read = 0, 0  # tokens [context, read) decode to text already given out
    for i in range(len(token_ids)):
        before = tokenizer.decode(token_ids[context:read], skip_special_tokens=True)
        through = tokenizer.decode(token_ids[context:i + 1], skip_special_tokens=True)
        if len(through) > len(before) and not through.endswith("\ufffd"):
            pieces.append(through[len(before):])
            context, read = read, i + 1
        else:
            pieces.append("")
    # Cut to the completion's text: a stop string's tokens decode past where the text ends.
    out, at = [], 0
    for piece in pieces:
        keep = piece[:max(0, len(text) - at)]
        out.append(keep)
        at += len(keep)
    if "".join(out) != text:  # pieces that do not add up (a tokenizer we do not know): all at once
        return [text] + [""] * (len(token_ids) - 1)
    return out


def _frame(kind: str, prepared: PreparedCompletion) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": prepared.model.name}


def _finish(events: list[bytes], final: dict, usage_chunk: dict | None, prepared: PreparedCompletion,
            generation: Generation, zstd_threads: int) -> CompletionBody:
    """The events, then the final chunk (with the activations), the usage chunk and [DONE]."""
    after = (_event(usage_chunk) if usage_chunk is not None else b"") + DONE
    return body_with_residual(final, prepared, generation, zstd_threads=zstd_threads,
                              before=b"".join(events) + b"data: ", after=b"\n\n" + after)


def completion_events(prepared: PreparedCompletion, generation: Generation, *, zstd_threads: int = 0) -> CompletionBody:
    """A completion's events (object `text_completion`, as OpenAI streams them)."""
    tokenizer = load_tokenizer(prepared.model.require_path())
    frame = {**_frame("cmpl", prepared), "object": "text_completion"}
    pieces = token_pieces(tokenizer, generation.token_ids, generation.text)
    events, at = [], 0
    for i, piece in enumerate(pieces):
        logprobs = None
        if prepared.sampling.logprobs is not None:
            logprobs = {"tokens": [tokenizer.decode([generation.token_ids[i]])],
                        "token_logprobs": [generation.token_logprobs[i]],
                        "top_logprobs": [generation.top_logprobs[i]] if generation.top_logprobs else None,
                        "text_offset": [at]}
        events.append(_event({**frame, "choices": [{"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": None}]}))
        at += len(piece)
    final = {**frame, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": generation.finish_reason}]}
    usage = {**frame, "choices": [], "usage": usage_of(generation)} if prepared.request.include_usage else None
    return _finish(events, final, usage, prepared, generation, zstd_threads)


def chat_events(prepared: PreparedCompletion, generation: Generation, *, zstd_threads: int = 0) -> CompletionBody:
    """A chat completion's events (object `chat.completion.chunk`): the role first, then the
    content token by token."""
    tokenizer = load_tokenizer(prepared.model.require_path())
    frame = {**_frame("chatcmpl", prepared), "object": "chat.completion.chunk"}
    events = [_event({**frame, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})]
    for i, piece in enumerate(token_pieces(tokenizer, generation.token_ids, generation.text)):
        logprobs = chat_logprobs(generation, tokenizer, i, 1) if prepared.sampling.logprobs is not None else None
        events.append(_event({**frame, "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": logprobs,
                                                    "finish_reason": None}]}))
    final = {**frame, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": generation.finish_reason}]}
    usage = {**frame, "choices": [], "usage": usage_of(generation)} if prepared.request.include_usage else None
    return _finish(events, final, usage, prepared, generation, zstd_threads)
