"""Files that hold secrets on a host's disk: the link-signing key, the dev API key, the stack's
state file. They are created readable by their owner only (0600) from the first byte, never
written first and chmodded after: in between any local user could read them.

    write_private(path, text)                  atomically create or replace `path`, mode 0600
    write_private(path, text, replace=False)   create it only if absent (the first writer wins)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_private"]


def write_private(path: Path, text: str, *, replace: bool = True) -> bool:
    """Write `path` owner-only; False when `replace` is off and it already existed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    # O_EXCL: never reuse (or follow a link planted at) an existing name; the mode applies at
    # creation (a umask can only narrow it).
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        if replace:
            os.replace(staging, path)
            return True
        try:
            os.link(staging, path)  # atomic, and refuses an existing name: one writer wins
            return True
        except FileExistsError:
            return False
    finally:
        staging.unlink(missing_ok=True)
