"""The models one GPU group keeps loaded: least recently used first out, never one in use."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["Loaded", "EngineCache"]


@dataclass
class Loaded:
    """One loaded engine and who is using it."""

    key: Hashable
    engine: Any
    load_s: float
    users: int = 0


class EngineCache:
    """At most `capacity` engines; `acquire` loads what is missing, evicting the least
    recently used engine that nobody holds, and waits while every slot is held."""

    def __init__(self, capacity: int, load: Callable[[Hashable], Any], close: Callable[[Any], None] = lambda e: e.close()):
        self.capacity = capacity
        self._load = load
        self._close = close
        self._entries: OrderedDict[Hashable, Loaded] = OrderedDict()
        self._loading: set[Hashable] = set()
        self._changed = threading.Condition()
        self.loads = 0
        self.evictions = 0

    def acquire(self, key: Hashable) -> tuple[Loaded, bool]:
        """The engine for `key`, held until `release`; and whether it was loaded already.

        A load runs outside the lock, so a slow load never stalls the engines already loaded;
        a second client asking for a model being loaded waits for that load, not its own.
        """
        with self._changed:
            while True:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.users += 1
                    self._entries.move_to_end(key)
                    return entry, True
                if key not in self._loading and (len(self._entries) + len(self._loading) < self.capacity or self._evict_one()):
                    self._loading.add(key)
                    break
                self._changed.wait()
        started = time.perf_counter()
        entry = None
        try:
            entry = Loaded(key, self._load(key), time.perf_counter() - started, users=1)
        finally:
            # In one step with the end of the load, so a waiter woken now finds the engine
            # (it would otherwise load the same model again beside it).
            with self._changed:
                self._loading.discard(key)
                if entry is not None:
                    self._entries[key] = entry
                    self.loads += 1
                self._changed.notify_all()
        return entry, False

    def release(self, entry: Loaded) -> None:
        with self._changed:
            entry.users -= 1
            self._changed.notify_all()

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():  # least recently used first
            if entry.users == 0:
                del self._entries[key]
                self._close(entry.engine)
                self.evictions += 1
                return True
        return False

    def describe(self, extra: Callable[[Any], dict] = lambda engine: {}) -> list[dict]:
        """Each loaded engine: its key, users and load time, and `extra(engine)`."""
        with self._changed:
            return [
                {"key": list(k) if isinstance(k, tuple) else k, "users": e.users, "load_s": round(e.load_s, 3), **extra(e.engine)}
                for k, e in self._entries.items()
            ]

    def close(self) -> None:
        with self._changed:
            for entry in self._entries.values():
                self._close(entry.engine)
            self._entries.clear()
