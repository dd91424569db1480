"""Tokenizing prompts with the model's own tokenizer, cut to the context the service runs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["TokenizedPrompt", "load_tokenizer", "tokenize_prompts", "added_bos_token_id"]


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


def added_bos_token_id(tokenizer) -> int | None:
    """The id the tokenizer puts at position 0 with `add_special_tokens=True`, or None when it
    adds none there. Llama's tokenizers prepend BOS; SmolLM2's adds nothing, though it names a
    `bos_token`: `tokenizer.bos_token_id` alone would claim a BOS that never runs."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    verbatim = tokenizer("a", add_special_tokens=False)["input_ids"]
    if len(with_special) > len(verbatim) and with_special[0] != verbatim[0]:
        return with_special[0]
    return None
