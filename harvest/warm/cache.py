"""The models one GPU group keeps loaded: least recently used first out, never one in use.

Bulk jobs (the engine server) and inline completions (the API's inline engines) keep their
engines in one of these, so both follow the same rules: at most
`HARVEST_ENGINE_MODELS_PER_GROUP` models at once, the least recently used idle one unloaded
when another is asked for, and a client asking while every one is in use waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["Loaded", "EngineCache"]

log = logging.getLogger(__name__)


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

        Loads and unloads run outside the lock: a slow one (seconds to minutes for a large
        model) never stalls the clients of the engines already loaded. An evicted engine is
        unloaded by the client that evicted it, before its own load, in the slot it frees, so
        the group never holds more than `capacity` models' memory. A second client asking for a
        model being loaded waits for that load, not its own.
        """
        held, victim = self._hold_or_reserve(key)
        if held is not None:
            return held, True
        entry = None
        try:
            if victim is not None:
                self._unload(victim)
            started = time.perf_counter()
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

    def try_acquire(self, key: Hashable) -> Loaded | None:
        """The engine for `key`, held until `release`, when it is loaded; else None (never
        waits, never loads: an event loop's fast path)."""
        with self._changed:
            return self._hold(key)

    def _hold(self, key: Hashable) -> Loaded | None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.users += 1
            self._entries.move_to_end(key)
        return entry

    def _hold_or_reserve(self, key: Hashable) -> tuple[Loaded | None, Loaded | None]:
        """(the entry of `key`, now held) when it is loaded; else (None, the evicted entry to
        unload first or None) once a slot is reserved for `key`'s load. Waits while every slot
        is held or `key` is being loaded by another client."""
        with self._changed:
            while True:
                entry = self._hold(key)
                if entry is not None:
                    return entry, None
                if key not in self._loading:
                    if len(self._entries) + len(self._loading) < self.capacity:
                        self._loading.add(key)
                        return None, None
                    victim = self._take_idle()
                    if victim is not None:
                        self._loading.add(key)  # the victim's slot, now this load's
                        return None, victim
                self._changed.wait()

    def _unload(self, entry: Loaded) -> None:
        try:
            self._close(entry.engine)
        except Exception:  # it is out of the table either way; the next load says if memory is short
            log.exception("unloading %s failed", entry.key)

    def release(self, entry: Loaded) -> None:
        with self._changed:
            entry.users -= 1
            self._changed.notify_all()

    def _take_idle(self) -> Loaded | None:
        """The least recently used engine nobody holds, out of the table (under the lock)."""
        for key, entry in self._entries.items():
            if entry.users == 0:
                del self._entries[key]
                self.evictions += 1
                return entry
        return None

    def describe(self, extra: Callable[[Any], dict] = lambda engine: {}) -> list[dict]:
        """Each loaded engine: its key, users and load time, and `extra(engine)`."""
        with self._changed:
            return [
                {"key": list(k) if isinstance(k, tuple) else k, "users": e.users, "load_s": round(e.load_s, 3), **extra(e.engine)}
                for k, e in self._entries.items()
            ]

    def close(self) -> None:
        """Unload every engine (outside the lock, like an eviction)."""
        with self._changed:
            entries = list(self._entries.values())
            self._entries.clear()
            self._changed.notify_all()
        for entry in entries:
            self._unload(entry)
