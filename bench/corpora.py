"""The corpora the engine benches run on: public text on every Debian machine, drawn seeded.

- `short`: the paragraphs of the GNU GPL version 3 (`/usr/share/common-licenses/GPL-3`, from
  Debian's base-files), 122 of them, 3 to 193 tokens of `smollm2-135m` (median 47): prose
  with the spread real prose has (a heading, a sentence, a long clause).
- `medium`: 96 paragraphs of over 200 characters, drawn seeded, each cut at 1,500 characters
  (about 40 to 330 tokens), from the GNU licenses (GPL-2 and -3, LGPL-2.1 and -3, GFDL-1.3):
  the GPL-3 alone has 74 such paragraphs, none over 193 tokens.
- `long_tail`: 96 chunks of the licenses in `/usr/share/common-licenses` run together, each of
  a length drawn log-uniform over 8 to 2,000 tokens, at a seeded place: a corpus of documents
  whose lengths span orders of magnitude, as scraped web text does.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

__all__ = ["CORPORA", "corpus", "paragraphs"]

LICENSES = Path("/usr/share/common-licenses")
GPL3 = LICENSES / "GPL-3"
SEED = 46
CORPORA = ("short", "medium", "long_tail")


def paragraphs(path: Path = GPL3) -> list[str]:
    """A text's paragraphs, whitespace inside each folded to single spaces."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", path.read_text()) if p.strip()]


GNU_LICENSES = ("GPL-3", "GPL-2", "LGPL-3", "LGPL-2.1", "GFDL-1.3")


def _medium() -> list[str]:
    long_ones = [p for name in GNU_LICENSES for p in paragraphs(LICENSES / name) if len(p) > 200]
    rng = random.Random(SEED)
    return [p[:1500] for p in rng.sample(long_ones, min(96, len(long_ones)))]


def _long_tail(tokenizer) -> list[str]:
    text = " ".join(" ".join(paragraphs(path)) for path in sorted(LICENSES.iterdir()) if path.is_file())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(SEED)
    chunks = []
    for _ in range(96):
        n = round(math.exp(rng.uniform(math.log(8), math.log(2000))))
        start = rng.randrange(len(ids) - n)
        chunks.append(tokenizer.decode(ids[start : start + n]).strip())
    return chunks


def corpus(name: str, tokenizer=None) -> list[str]:
    """Corpus `name` as texts (`long_tail` cuts its chunks with `tokenizer`, the model's)."""
    if name == "short":
        return paragraphs()
    if name == "medium":
        return _medium()
    if name == "long_tail":
        if tokenizer is None:
            raise ValueError("the long-tail corpus is cut in tokens: pass the model's tokenizer")
        return _long_tail(tokenizer)
    raise ValueError(f"unknown corpus {name!r}: one of {', '.join(CORPORA)}")
