"""The batcher in front of a warm engine (real HF engine, no HTTP): what shares a generate
call, what waits for the next one, and that one bad request cannot fail its batch."""

from __future__ import annotations

import asyncio
import threading

from api.inline_engines import InlineEngines
from harvest.engines.base import SamplingSpec

GREEDY = SamplingSpec(max_tokens=2, temperature=0)


def _run(hf_engine, tiny, requests, **options):
    """Send `requests` [(prompt, layers)] at once through a fresh pool; return (results, stats, threads)."""
    threads = set()

    def generate(*args):
        threads.add(threading.current_thread().name)
        return type(hf_engine).generate(hf_engine, *args)

    async def main():
        pool = InlineEngines(factory=lambda _m: hf_engine, close_engines=False, **options)
        batcher = await pool.get(tiny)
        batcher.engine = type("Counted", (), {"generate": staticmethod(generate), "model": tiny})()
        results = await asyncio.gather(*(batcher.generate(p, GREEDY, layers) for p, layers in requests), return_exceptions=True)
        await pool.close()
        return results, batcher.stats

    results, stats = asyncio.run(main())
    return results, stats, threads


def test_requests_sent_together_share_one_call_off_the_event_loop(hf_engine, tiny):
    results, stats, threads = _run(hf_engine, tiny, [([0, 5 + i, 9], [1]) for i in range(6)])
    assert stats.requests == 6 and stats.generate_calls == 1 and stats.largest_batch == 6
    assert all(r.residual.shape == (1, 4, 256) for r in results)
    assert threads and all(name.startswith("engine-llama-tiny") for name in threads)


def test_layer_sets_and_the_token_budget_split_batches(hf_engine, tiny):
    _, stats, _ = _run(hf_engine, tiny, [([0, 5], [1]), ([0, 6], [2, 3]), ([0, 7], [1]), ([0, 8], None)])
    assert stats.generate_calls == 3  # {[1]: 2 requests}, {[2, 3]}, {no capture}
    # rows × (prompt + max_tokens): 100 + 2 per row, budget 250 → two rows per call
    _, stats, _ = _run(hf_engine, tiny, [([0] + [5] * 99, [1])] * 5, max_batch_tokens=250)
    assert stats.generate_calls == 3 and stats.largest_batch == 2
    _, stats, _ = _run(hf_engine, tiny, [([0, 5], [1])] * 5, max_batch=2)
    assert stats.generate_calls == 3


def test_a_bad_request_fails_alone(hf_engine, tiny):
    vocab = hf_engine.hf_model.config.vocab_size
    requests = [([0, 5], [1]), ([0, vocab + 10], [1]), ([0, 6], [1])]  # an id past the embedding table
    results, stats, _ = _run(hf_engine, tiny, requests)
    assert isinstance(results[1], IndexError)
    assert results[0].token_ids and results[2].token_ids
    assert stats.generate_calls == 4  # the batch, then each request alone


def test_pool_loads_each_model_once(tiny):
    loads = []

    def factory(model):
        loads.append(threading.current_thread().name)
        from harvest.engines.hf import HFEngine

        return HFEngine(model)

    async def main():
        pool = InlineEngines(factory=factory)
        first, second = await asyncio.gather(pool.get(tiny), pool.get(tiny))
        assert first is second
        await pool.close()  # releases the engine it made
        assert not hasattr(first.engine, "hf_model")

    asyncio.run(main())
    assert len(loads) == 1 and loads[0].startswith("engine-llama-tiny")


def test_inline_engines_follow_the_worker_hosts_rules_one_model_evicts_another(tiny):
    """`HARVEST_ENGINE_MODELS_PER_GROUP=1`, as on a worker host: a second model loaded inline
    unloads the first (the cache's own counters, and the first engine really closed), and a
    model a request holds is never the one evicted."""
    import dataclasses

    from harvest.engines.hf import HFEngine

    second = dataclasses.replace(tiny, name="llama-tiny-b")  # the same weights under another served name
    made: list[HFEngine] = []

    def factory(model):
        made.append(HFEngine(model))
        return made[-1]

    async def main():
        engines = InlineEngines(factory=factory, capacity=1)  # as the app makes them from the setting
        assert engines.cache.capacity == 1
        first = await engines.generate(tiny, [0, 5, 9], GREEDY, [1])
        assert [d["key"] for d in engines.cache.describe()] == ["llama-tiny"]
        again = await engines.generate(second, [0, 5, 9], GREEDY, [1])
        assert [d["key"] for d in engines.cache.describe()] == ["llama-tiny-b"]
        assert (engines.cache.loads, engines.cache.evictions) == (2, 1)
        assert not hasattr(made[0], "hf_model")  # unloaded: HFEngine.close drops its model
        assert again.token_ids == first.token_ids  # same weights, greedy
        async with engines.hold(second):
            waiting = asyncio.ensure_future(engines.generate(tiny, [0, 6], GREEDY, None))
            await asyncio.sleep(0.5)
            assert not waiting.done() and [d["key"] for d in engines.cache.describe()] == ["llama-tiny-b"]
        await waiting
        assert [d["key"] for d in engines.cache.describe()] == ["llama-tiny"] and engines.cache.evictions == 2
        await engines.close()
        assert len(made) == 3 and not any(hasattr(engine, "hf_model") for engine in made)

    asyncio.run(main())
