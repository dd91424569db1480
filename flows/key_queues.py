"""Per-key work queues: a lane's slots shared between API keys by Prefect itself.

Every run of a key waits in a work queue of its lane's pool named after the key
(`key_queue_name`) whose concurrency limit is the lane's `key_run_limit`. Prefect's workers
(started without `--work-queue`, so they poll every queue of their pool, queues created after
they started included) take a Scheduled run only while both its pool and its queue have a
free slot (Pending, Running count against each). So a key's runs beyond its share wait,
Scheduled and then Late, in its own queue while another key's run takes the free slot; the
job stays `pending` meanwhile.

A queue is made on the key's first run in the lane (`KeyQueues.ensure`), before the run: a
run naming a queue that does not exist makes Prefect create it without a limit. Two API
replicas may make it at once; the loser finds it there and only checks its limit. `harvest
server` re-applies the lanes' limits to the queues that exist (`aapply_key_queue_limits`),
so an edit of `key_run_limit` reaches keys seen before.

Among keys waiting for the same freed slot, Prefect serves the queue of the higher priority
(the lower number; each new queue of a pool takes the next one), i.e. keys seen earlier
first; each key is still held to its own limit.
"""

from __future__ import annotations

import time

from prefect.exceptions import ObjectAlreadyExists

__all__ = ["KEY_QUEUE_PREFIX", "key_queue_name", "KeyQueues", "aapply_key_queue_limits"]

KEY_QUEUE_PREFIX = "key_"
"""Start of every key queue's name (and of every API key id)."""
RECHECK_S = 60.0
"""How long a replica trusts a queue it ensured; then its next start checks it again (a queue
deleted or re-created by hand gets its limit back), without a request per start meanwhile."""


def key_queue_name(key_id: str) -> str:
    """The work queue of this key's runs: the key's id (API key ids read `key_<hex>`, as in
    `harvest keys list`); any other id gets the prefix, so no key queue is the pool's
    `default` and an operator tells key queues apart in the Prefect UI."""
    return key_id if key_id.startswith(KEY_QUEUE_PREFIX) else f"{KEY_QUEUE_PREFIX}{key_id}"


async def _set_limit(client, pool: str, queue: str, limit: int | None) -> None:
    existing = await client.read_work_queue_by_name(queue, work_pool_name=pool)
    if existing.concurrency_limit != limit:
        await client.update_work_queue(existing.id, concurrency_limit=limit)


class KeyQueues:
    """The key queues one starter of runs (an API replica's run store) has made sure of, and
    when: a start within `RECHECK_S` of the last check of its queue asks Prefect nothing."""

    def __init__(self) -> None:
        self._ensured: dict[tuple, float] = {}

    async def ensure(self, client, pool: str, key_id: str, limit: int | None, *, enforce: bool = True) -> str:
        """Make the key's queue in `pool` with concurrency `limit` (None: no limit) unless this
        starter did within `RECHECK_S`; returns its name. Safe when several replicas race.

        enforce: a queue that exists gets `limit` too. False for a pool that is no declared
        lane (an operator's or a test's own): its key queues keep the limits they were given."""
        queue = key_queue_name(key_id)
        seen = (str(client.api_url), pool, queue, limit if enforce else "as found")
        if time.monotonic() - self._ensured.get(seen, float("-inf")) < RECHECK_S:
            return queue
        try:
            await client.create_work_queue(
                name=queue, work_pool_name=pool, concurrency_limit=limit,
                description=f"runs of API key {key_id} in lane {pool}, at most {limit if limit is not None else 'any number'} at once",
            )
        except ObjectAlreadyExists:
            if enforce:
                await _set_limit(client, pool, queue, limit)
        self._ensured[seen] = time.monotonic()
        return queue


async def aapply_key_queue_limits(client, pool: str, limit: int | None) -> int:
    """Set `limit` on every key queue of `pool` that exists; returns how many there are."""
    from prefect.client.schemas.filters import WorkQueueFilter, WorkQueueFilterName

    queues, offset = [], 0
    while True:
        page = await client.read_work_queues(
            work_pool_name=pool, work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(startswith_=[KEY_QUEUE_PREFIX])),
            limit=200, offset=offset,
        )
        queues += page
        if len(page) < 200:
            break
        offset += 200
    for queue in queues:
        if queue.concurrency_limit != limit:
            await client.update_work_queue(queue.id, concurrency_limit=limit)
    return len(queues)
