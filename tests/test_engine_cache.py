"""`harvest.warm.cache.EngineCache` on its own: counted against the loads its loader really did."""

from __future__ import annotations

import threading
import time

import pytest

from harvest.warm.cache import EngineCache


class Loader:
    """Records every load and close it is asked for; a load takes `seconds`."""

    def __init__(self, seconds: float = 0.2, fail: set | None = None):
        self.seconds = seconds
        self.fail = fail or set()
        self.loaded: list = []
        self.closed: list = []

    def load(self, key):
        time.sleep(self.seconds)
        if key in self.fail:
            raise RuntimeError(f"cannot load {key}")
        engine = object()
        self.loaded.append((key, engine))
        return engine

    def close(self, engine) -> None:
        self.closed.append(engine)


def _acquire_all(cache: EngineCache, keys: list) -> list:
    got = [None] * len(keys)

    def one(i: int) -> None:
        got[i] = cache.acquire(keys[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return got


class YieldingCondition(threading.Condition):
    """Gives the other threads a turn each time it is released: the scheduling under which a
    waiter woken at a load's end runs before the loader records what it loaded."""

    def __exit__(self, *exc):
        released = super().__exit__(*exc)
        time.sleep(0.01)
        return released


def test_clients_asking_at_once_for_one_model_share_one_load():
    loader = Loader(0.05)
    cache = EngineCache(1, loader.load, loader.close)
    cache._changed = YieldingCondition()
    got = _acquire_all(cache, ["m"] * 4)
    assert len(loader.loaded) == 1 and loader.closed == []
    engine = loader.loaded[0][1]
    assert all(entry.engine is engine for entry, _ in got)
    assert sorted(warm for _, warm in got) == [False, True, True, True]
    assert [d["users"] for d in cache.describe()] == [4]


def test_the_least_recently_used_idle_engine_goes_and_a_held_one_never_does():
    loader = Loader(0.01)
    cache = EngineCache(2, loader.load, loader.close)
    a, _ = cache.acquire("a")
    b, _ = cache.acquire("b")
    cache.release(b)
    cache.acquire("c")  # b is idle: it goes, though a is older
    assert [key for key, _ in loader.loaded] == ["a", "b", "c"] and loader.closed == [b.engine]

    waiting = threading.Thread(target=cache.acquire, args=("d",))
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and len(loader.loaded) == 3  # both held: d waits
    cache.release(a)
    waiting.join(5)
    assert not waiting.is_alive() and loader.closed == [b.engine, a.engine]
    assert (cache.loads, cache.evictions) == (4, 2)


def test_a_failed_load_counts_nothing_and_the_next_client_tries_again():
    loader = Loader(0.01, fail={"bad"})
    cache = EngineCache(1, loader.load, loader.close)
    with pytest.raises(RuntimeError, match="cannot load bad"):
        cache.acquire("bad")
    assert (cache.loads, cache.describe()) == (0, [])
    loader.fail.clear()
    entry, warm = cache.acquire("bad")
    assert not warm and loader.loaded == [("bad", entry.engine)]


def test_an_eviction_unloads_outside_the_lock_and_holds_its_slot_until_done():
    """While an evicted engine unloads (slow on a GPU), the cache answers its other clients;
    and the model that evicted it is loaded only once the unload is over."""
    unloading, finish = threading.Event(), threading.Event()
    loader = Loader(0.01)

    def slow_close(engine) -> None:
        unloading.set()
        finish.wait(30)
        loader.close(engine)

    cache = EngineCache(2, loader.load, slow_close)
    a, _ = cache.acquire("a")
    cache.release(a)
    b, _ = cache.acquire("b")  # held throughout
    evicting = threading.Thread(target=cache.acquire, args=("c",))
    evicting.start()
    assert unloading.wait(10)
    # The lock is free while the unload runs: a client of b is served, describe answers.
    served = []
    client = threading.Thread(target=lambda: served.append(cache.acquire("b")))
    client.start()
    client.join(10)  # a guard, not a timing: the unload goes on until `finish`
    assert served == [(b, True)] and not finish.is_set()
    assert [d["key"] for d in cache.describe()] == ["b"]
    assert [key for key, _ in loader.loaded] == ["a", "b"]  # c waits for a's memory
    finish.set()
    evicting.join(10)
    assert not evicting.is_alive() and loader.closed == [a.engine]
    assert [key for key, _ in loader.loaded] == ["a", "b", "c"] and (cache.loads, cache.evictions) == (3, 1)
