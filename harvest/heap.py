"""Give the heap's free memory back to the kernel after a large piece of work.

glibc's malloc keeps what a process frees for its next allocations, in arenas per thread, and
returns it to the kernel only from the top of the main heap or for blocks above its mmap
threshold (which rises after each such block is freed, up to 32 MiB). torch's CPU tensors
are malloc'd, so after a forward pass of many float32 captures an engine server kept hundreds
of MiB it no longer used, differently from one shard to the next (its client threads each
get an arena). `malloc_trim(0)` hands every arena's free pages back: a few milliseconds
after a shard or a batch, the process's resident size then follows what it holds
(bench/memory_worst.py, README "Memory of each process"). A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["give_back_free_memory", "TrimEvery"]


def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def give_back_free_memory() -> bool:
    """Return the heap's free pages to the kernel; True when something was released."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class TrimEvery:
    """`give_back_free_memory` once per `every_bytes` of values passed through (`passed`): a
    long shard's buffers, freed between batches of different shapes, otherwise pile up in
    malloc's arenas until its end. One shard of 976 prompts at the 2,048-token context
    (2,000,000 tokens, the per-job cap) took an engine server from 978 to 3,185 MiB, all of
    it free memory: 589 MiB once the shard's end trimmed it (bench/memory_worst.py)."""

    def __init__(self, every_bytes: int):
        self.every_bytes = every_bytes
        self._since = 0

    def passed(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every_bytes:
            self._since = 0
            give_back_free_memory()
