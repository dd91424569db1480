"""Who wrote what, in what order, into a job's folder, seen from outside the writing process.

    DiskWrites(folder)   Linux inotify on a local folder and its sub-folders (created later too):
                         every file closed after writing, renamed or linked into place, in
                         the order the kernel saw them. The service's writes are a `.partial`
                         file renamed into place, so each shows as a close then a rename; a
                         shard's is linked (created once: `harvest.storage`), a close then a
                         link (a new name that is no `.partial`, with no write of its own). A
                         sub-folder is watched only once its creation is seen, so files that
                         land in it before that show as "found" at that point (create the
                         folders you care about beforehand for an exact order).
    s3_writes(proxy, prefix)
                         the PUT/POST/DELETE requests a `tests.fault_proxy.FaultProxy` forwarded
                         under a key prefix, in arrival order.

Used by the write-order tests: a flow run in another process writes, the test reads the order
from the kernel or the wire, never from the code under test.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from pathlib import Path

__all__ = ["DiskWrites", "s3_writes"]

_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")


class DiskWrites:
    """inotify on `folder` (and every sub-folder, as it appears); `.events` is the list of
    (relative path, "close" | "rename" | "link" | "found") in order. Use as a context manager."""

    def __init__(self, folder: Path):
        self.root = Path(folder)
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.folders: dict[int, Path] = {}
        self.events: list[tuple[str, str]] = []
        self.stop = threading.Event()
        self._watch(self.root)
        for sub in self.root.rglob("*"):
            if sub.is_dir():
                self._watch(sub)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="inotify")

    def _watch(self, folder: Path) -> None:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
        self.folders[wd] = folder

    def _loop(self) -> None:
        while not self.stop.is_set():
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                self._drain()
        self._drain()

    def _drain(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        offset = 0
        while offset < len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0").decode()
            offset += _EVENT.size + length
            folder = self.folders.get(wd)
            if folder is None:
                continue
            path = folder / name
            if mask & _IN_CREATE and mask & _IN_ISDIR:
                self._watch(path)
                # Made between the folder's creation and its watch: seen, not in order.
                for found in sorted(path.rglob("*")):
                    if found.is_dir():
                        self._watch(found)
                    elif not found.name.endswith(".partial"):
                        self.events.append((str(found.relative_to(self.root)), "found"))
            elif mask & _IN_CREATE and not mask & _IN_ISDIR and not name.endswith(".partial"):
                self.events.append((str(path.relative_to(self.root)), "link"))
            elif mask & (_IN_CLOSE_WRITE | _IN_MOVED_TO):
                self.events.append((str(path.relative_to(self.root)), "close" if mask & _IN_CLOSE_WRITE else "rename"))

    def __enter__(self) -> "DiskWrites":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        os.close(self.fd)


def s3_writes(proxy, prefix: str) -> list[tuple[str, str]]:
    """(method, path) of every write request the proxy saw under `prefix`, in arrival order."""
    with proxy.lock:
        seen = list(proxy.seen)
    return [(method, path) for method, path, _ in seen if method in ("PUT", "POST", "DELETE") and prefix in path]
