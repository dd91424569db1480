"""Tokenizing prompts with the model's own tokenizer, cut to the context the service runs.

Two ways in: `tokenize_prompts` keeps every prompt's ids (a run needs them); `count_tokens`
keeps only how many ids each prompt runs (admission needs no more), tokenizing a slice of
the prompts at a time so its memory stays at one slice's ids however large the request.
`max_token_chars` is the cheap fact admission checks before either: no token covers more
characters than the longest entry of the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = [
    "TokenizedPrompt", "load_tokenizer", "tokenize_prompts", "count_tokens", "max_token_chars",
    "COUNT_SLICE_CHARS", "added_bos_token_id",
]

COUNT_SLICE_CHARS = 1 << 20
"""Characters `count_tokens` hands the tokenizer at once: its ids (Python ints in lists, ~36
bytes a token) stay in the tens of MB, and a batch this size still tokenizes at full speed."""


@dataclass(frozen=True)
class TokenizedPrompt:
    ids: list[int]
    """The ids that run, BOS included when added; at most max_model_len of them."""
    n_original: int
    """How many ids the full text had before it was cut."""

    @property
    def truncated(self) -> bool:
        return self.n_original > len(self.ids)


@lru_cache(maxsize=8)
def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenize_prompts(tokenizer, prompts: list[str], *, add_special_tokens: bool, max_len: int) -> list[TokenizedPrompt]:
    """Tokenize each prompt; a prompt over max_len keeps its first max_len tokens."""
    encoded = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]
    return [TokenizedPrompt(ids=list(ids[:max_len]), n_original=len(ids)) for ids in encoded]


def count_tokens(tokenizer, prompts: list[str], *, add_special_tokens: bool, max_len: int, chars_per_token: int,
                 slice_chars: int = COUNT_SLICE_CHARS) -> list[int]:
    """How many ids each prompt runs (at most max_len): the same numbers `tokenize_prompts`
    gives, keeping only the counts, about `slice_chars` characters tokenized at a time.

    A prompt is tokenized no further than its first `max_len * chars_per_token` characters
    (`max_token_chars`): that prefix already has at least max_len tokens whenever the whole
    text has, so the count is exact and a 50 MB prompt costs what a context's worth does.
    """
    reach = max_len * chars_per_token
    counts: list[int] = []
    start = 0
    while start < len(prompts):
        stop, chars = start, 0
        while stop < len(prompts) and (stop == start or chars + min(len(prompts[stop]), reach) <= slice_chars):
            chars += min(len(prompts[stop]), reach)
            stop += 1
        texts = [p[:reach] for p in prompts[start:stop]]
        encoded = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        counts.extend(min(len(ids), max_len) for ids in encoded)
        del encoded, texts
        start = stop
    return counts


@lru_cache(maxsize=8)
def max_token_chars(path: Path) -> int:
    """The most characters one token of this tokenizer can stand for: the longest entry of its
    vocabulary, added tokens included. A byte-level entry is written one character per byte
    and a character is at least one byte, a SentencePiece entry one character per character
    (`▁` for a space), so a prompt of c characters has at least ceil(c / this) tokens.
    (This holds for tokenizers whose normalizer never merges characters, as byte-level BPE
    and SentencePiece ones do not.)"""
    tokenizer = load_tokenizer(path)
    vocab = tokenizer.get_vocab()
    return max(1, max((len(entry) for entry in vocab), default=1))


def added_bos_token_id(tokenizer) -> int | None:
    """The id the tokenizer puts at position 0 with `add_special_tokens=True`, or None when it
    adds none there. Llama's tokenizers prepend BOS; SmolLM2's adds nothing, though it names a
    `bos_token`: `tokenizer.bos_token_id` alone would claim a BOS that never runs."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    verbatim = tokenizer("a", add_special_tokens=False)["input_ids"]
    if len(with_special) > len(verbatim) and with_special[0] != verbatim[0]:
        return with_special[0]
    return None
