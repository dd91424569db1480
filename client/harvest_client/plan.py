"""Cutting a corpus into jobs the service accepts, and the body of each job's request.

A job holds at most 4,096 prompts and its JSON body at most 50 MB; both are known
here exactly, so parts are cut greedily in corpus order. The third cap, 2,000,000 estimated
tokens, needs the model's tokenizer, which the client does not have: a part the service
refuses for too many tokens is split in two and each half submitted in its place
(`split_part`), as often as needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_PROMPTS", "MAX_BODY_BYTES", "JobSpec", "cut_parts", "encode_directions", "too_many_tokens"]

MAX_PROMPTS = 4096
MAX_BODY_BYTES = 50 * 1024 * 1024
# Room for the fields around the prompts and for JSON spacing differences between encoders.
_BODY_MARGIN = 64 * 1024


@dataclass(frozen=True)
class JobSpec:
    """Everything of a request but its prompts (the same for every job of a harvest)."""

    model: str
    layers: list[int] | str | None = None
    shard_size: int = 32
    add_special_tokens: bool = True
    project_onto: dict | None = None
    """The request's `project_onto` object (already base64-encoded; see `encode_directions`)."""

    def body(self, prompts: list[str]) -> dict:
        body: dict = {"model": self.model, "prompts": prompts, "shard_size": self.shard_size,
                      "add_special_tokens": self.add_special_tokens}
        if self.layers is not None:
            body["layers"] = self.layers
        if self.project_onto is not None:
            body["project_onto"] = self.project_onto
        return body

    def fingerprint(self, prompts: list[str]) -> str:
        """sha256 of the request fields and every prompt: a folder holds one harvest only."""
        digest = hashlib.sha256(json.dumps(self.body([]), sort_keys=True).encode())
        for text in prompts:
            encoded = text.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
        return digest.hexdigest()


def encode_directions(directions) -> dict:
    """`project_onto` from an array `[n_directions, hidden]` (float32/float16 kept, anything
    else sent as float32): raw little-endian bytes in base64, as the user docs show."""
    array = np.asarray(directions)
    if array.ndim != 2:
        raise ValueError(f"project_onto must be 2-D [n_directions, hidden], not shape {array.shape}.")
    dtype = {np.dtype("float16"): "<f2", np.dtype("float32"): "<f4"}.get(array.dtype, "<f4")
    array = np.ascontiguousarray(array.astype(dtype))
    return {
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
        "dtype": "float16" if dtype == "<f2" else "float32",
        "shape": list(array.shape),
        "compression": "none",
    }


def cut_parts(prompts: list[str], spec: JobSpec, *, max_prompts: int = MAX_PROMPTS,
              max_body_bytes: int = MAX_BODY_BYTES) -> list[tuple[int, int]]:
    """`[start, stop)` prompt ranges, in corpus order, each within the count and body caps."""
    if not 1 <= max_prompts <= MAX_PROMPTS:
        raise ValueError(f"max_prompts must be 1..{MAX_PROMPTS}, not {max_prompts}")
    room = max_body_bytes - len(json.dumps(spec.body([]))) - _BODY_MARGIN
    parts: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, text in enumerate(prompts):
        cost = len(json.dumps(text)) + 2  # the string as json.dumps writes it, and ", "
        if cost > room:
            raise ValueError(f"Prompt {i} alone is {cost:,} bytes of JSON, over a request's {max_body_bytes:,}.")
        if i > start and (i - start == max_prompts or size + cost > room):
            parts.append((start, i))
            start, size = i, 0
        size += cost
    parts.append((start, len(prompts)))
    return parts


_TOKENS = re.compile(r"come to ([\d,]+) tokens")


def too_many_tokens(status: int, param: str | None, message: str) -> bool:
    """Whether a refusal is the 2,000,000-token cap (400 on `prompts`)."""
    return status == 400 and param == "prompts" and (_TOKENS.search(message) is not None or "tokens" in message)
