"""Tokenizing prompts with the model's own tokenizer, cut to the context the service runs.

Two ways in: `tokenize_prompts` keeps every prompt's ids (a run needs them); `count_tokens`
keeps only how many ids each prompt runs (admission needs no more), tokenizing a slice of
the prompts at a time so its memory stays at one slice's ids however large the request.
`max_token_chars` is the cheap fact admission checks before either: no token covers more
characters than the longest entry of the vocabulary. `load_counter` is the tokenizer admission
counts with: for a checkpoint this project built, the Rust `tokenizers` library that its
generic fast class wraps, without importing transformers.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = [
    "TokenizedPrompt", "load_tokenizer", "load_counter", "read_tokenizer", "tokenize_prompts", "count_tokens",
    "max_token_chars", "COUNT_SLICE_CHARS", "added_bos_token_id",
]

COUNT_SLICE_CHARS = 1 << 18
"""Characters `count_tokens` hands the tokenizer at once: their ids (Python ints in lists,
~36 bytes a token) stay around 10 MB, and a batch this size still tokenizes at full speed."""


@dataclass(frozen=True)
class TokenizedPrompt:
    ids: list[int]
    """The ids that run, BOS included when added; at most max_model_len of them."""
    n_original: int
    """How many ids the full text had before it was cut."""

    @property
    def truncated(self) -> bool:
        return self.n_original > len(self.ids)


_LOADING = threading.Lock()
"""Held while a tokenizer loads: transformers resolves its top-level names lazily, and not
thread-safely, so two threads of a server must not both be the first to ask."""


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer (`read_tokenizer`), read once per process."""
    with _LOADING:
        return _read_once(Path(path))


def read_tokenizer(path: Path):
    """The checkpoint's tokenizer, the one `AutoTokenizer` gives. A checkpoint this project
    built (`harvest.built_checkpoints`: its `BUILT_BY` file) names the generic fast class, and
    is loaded by that class itself: AutoTokenizer picks the same class, but only after importing
    every model family's mappings and torch, ~2.5 s of CPU in each process that tokenizes (the
    API's assessing children, runs, the CLI) where the class alone costs ~1 s."""
    path = Path(path)
    if _built_with_generic_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


_read_once = lru_cache(maxsize=8)(read_tokenizer)


class _RustTokenizer:
    """A built checkpoint's `tokenizer.json` in the Rust `tokenizers` library, called as the
    fast class is where counting calls it. `PreTrainedTokenizerFast` encodes through this same
    object (`encode_batch`, truncation and padding off), so the ids are the same ones; what the
    class adds is Python around them, ~2.2 CPU-s of transformers' imports in each process that
    loads it, where this library's import is ~0.03 s."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._tokenizer.no_truncation()  # as the fast class leaves it unless asked
        self._tokenizer.no_padding()

    def __call__(self, texts: list[str], *, add_special_tokens: bool, return_attention_mask: bool = False) -> dict:
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encoded]}

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)


def load_counter(path: Path):
    """The tokenizer admission counts a submit's tokens with (`count_tokens`, `max_token_chars`),
    read once per process: for a checkpoint this project built, its `tokenizer.json` through
    the Rust library (`_RustTokenizer`: the same ids as `load_tokenizer`'s, which
    tests/test_admission.py checks on real text); for any other, `load_tokenizer`'s own."""
    with _LOADING:
        return _counter_once(Path(path))


@lru_cache(maxsize=8)
def _counter_once(path: Path):
    """`load_counter`'s choice and tokenizer, made once per checkpoint: a submit reads no file
    to find it again."""
    return _RustTokenizer(path) if _built_with_generic_tokenizer(path) else _read_once(path)


def _built_with_generic_tokenizer(path: Path) -> bool:
    from harvest.built_checkpoints import BUILT_BY, GENERIC_TOKENIZER_CLASS

    config = path / "tokenizer_config.json"
    if not (path / BUILT_BY).is_file() or not config.is_file():
        return False
    return json.loads(config.read_text()).get("tokenizer_class") == GENERIC_TOKENIZER_CLASS


def tokenize_prompts(tokenizer, prompts: list[str], *, add_special_tokens: bool, max_len: int) -> list[TokenizedPrompt]:
    """Tokenize each prompt; a prompt over max_len keeps its first max_len tokens."""
    encoded = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]
    return [TokenizedPrompt(ids=list(ids[:max_len]), n_original=len(ids)) for ids in encoded]


def count_tokens(tokenizer, prompts: list[str], *, add_special_tokens: bool, max_len: int, chars_per_token: int,
                 stop_above: int | None = None, slice_chars: int = COUNT_SLICE_CHARS) -> list[int]:
    """How many ids each prompt runs (at most max_len): the same numbers `tokenize_prompts`
    gives, keeping only the counts, about `slice_chars` characters tokenized at a time.

    A prompt is tokenized no further than its first `max_len * chars_per_token` characters
    (`max_token_chars`): that prefix already has at least max_len tokens whenever the whole
    text has, so the count is exact and a 50 MB prompt costs what a context's worth does.
    With `stop_above`, counting stops after the slice whose counts pass it: the list is then
    shorter than the prompts (a job over a limit costs no more than the limit to refuse).
    """
    reach = max_len * chars_per_token
    counts: list[int] = []
    total, start = 0, 0
    while start < len(prompts) and (stop_above is None or total <= stop_above):
        stop, chars = start, 0
        while stop < len(prompts) and (stop == start or chars + min(len(prompts[stop]), reach) <= slice_chars):
            chars += min(len(prompts[stop]), reach)
            stop += 1
        texts = [p[:reach] for p in prompts[start:stop]]
        encoded = tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]
        new = [min(len(ids), max_len) for ids in encoded]
        counts.extend(new)
        total += sum(new)
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
    vocab = load_counter(path).get_vocab()
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
