"""Files that hold secrets on a host's disk: the link-signing key, the dev API key, the stack's
state file; and files that hold what researchers sent or got back, or who did what: job files on
local storage, logs, the SQLite job store. They are created readable by their owner only (0600)
from the first byte, never written first and chmodded after: in between any local user could
read them. Folders made for them are 0700.

    write_private(path, text)                  atomically create or replace `path`, mode 0600
    write_private(path, text, replace=False)   create it only if absent (the first writer wins)
    private_dir(path)                          a folder only we can enter (made 0700, or checked)
    private_dirs(path)                         `mkdir -p` whose new folders are 0700 (existing ones kept)
    open_private(path, flags)                  `os.open` creating the file 0600; one of ours is narrowed to 0600
    open_private_log(path)                     a log opened for appending, the same way

A folder in a place every user can write (`/tmp`) may have been made by someone else before
us: `private_dir` uses it only when it is a real folder (not a link), ours, and 0700.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

__all__ = ["write_private", "private_dir", "private_dirs", "open_private", "open_private_log", "NotPrivate"]


class NotPrivate(PermissionError):
    """A folder we were to keep private already exists and is not (another owner, a wider mode,
    a link). Never used, never repaired: whoever made it may already hold a way in."""


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


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can enter: created 0700 when absent, else used only
    when it is a folder (not a link), owned by us, mode 0700; `NotPrivate` otherwise."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700)  # the mode applies at creation (a umask can only narrow it)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotPrivate(f"{path} exists and is not a folder: refusing to use it; remove it")
    if info.st_uid != os.getuid():
        raise NotPrivate(f"{path} belongs to uid {info.st_uid}, not to us (uid {os.getuid()}): refusing to use it; remove it")
    if stat.S_IMODE(info.st_mode) != 0o700:
        raise NotPrivate(f"{path} has mode {stat.S_IMODE(info.st_mode):o}, not 700: refusing to use it; remove it")
    return path


def private_dirs(path: str | os.PathLike) -> None:
    """Make `path` and its missing parents, each new one 0700 (`os.makedirs` gives its mode to
    the last folder only); folders that exist are left as they are (the operator's)."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another writer
            pass


def open_private(path: str | os.PathLike, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """`os.open(path, flags)` with the file created 0600 and its missing folders 0700; an
    existing file of ours with a wider mode (written by an earlier version) is narrowed."""
    private_dirs(Path(path).parent)
    fd = os.open(path, flags, 0o600)
    try:
        info = os.fstat(fd)
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_log(path: str | os.PathLike, mode: str = "ab"):
    """A log file opened for appending (`"ab"` or `"a"`), owner-only (`open_private`)."""
    return os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), mode)
