"""Warm engines: a model loaded once and kept, for bulk jobs and inline completions alike.

Every warm engine lives in an `EngineCache` (`cache`): at most
`HARVEST_ENGINE_MODELS_PER_GROUP` models per GPU group (a host without GPUs is one group; so
is an API process), the least recently used idle one unloaded when another is asked for, never
one in use; loads and unloads run outside the cache's lock.

Bulk jobs. A job's flow run is a fresh process (Prefect's process worker), so an engine loaded
there dies with the job. On a worker host (`harvest worker`, `harvest up`) the run instead asks
an *engine server* for its model: one long-lived process per GPU group of the host, which runs
every forward pass of every job on that group:

- `server`: the engine server (`python -m harvest.warm.server --group G`). It answers on a
  Unix socket under `$HARVEST_HOME/engines/` with an owner-only authentication key beside it,
  runs one engine call at a time per engine, and exits after `HARVEST_ENGINE_IDLE_S` without a
  client, or when its worker stops (it is signalled only while its pid file's pid and start
  time are still its own: `protocol`).
- `cobatch`: co-batching, the waiting shards of concurrent jobs on one engine in shared
  forward passes (`HARVEST_ENGINE_COBATCH_SHARDS`, 1 by default: each shard alone).
- `client`: what a run uses. `open_engine` connects to its group's server, starting it
  (detached, in its own session, so it outlives the run) when none answers, and returns an
  `Engine` whose `capture` is a call to the server, handing it the run's staged shard file
  (its descriptor); the server writes each prompt's values into that file as the engine makes
  them and hashes them as it writes, so the values never cross the socket and neither process
  holds a whole shard. A cancelled run's process ends, its connection closes, and the
  server drops its work without touching the other jobs. A server that dies mid-shard (killed,
  out of memory) is started again and the shard in flight asked again: a shard is one whole
  answer or none, so it is never skipped or written short.

Off a worker host (`harvest run`, a flow called in-process) the engine is loaded in the
process itself. Which slot (and so which group) a run claims, warm ones first, is
`harvest.placement`.

Inline completions keep their engines in an `EngineCache` of their own too, in the API's
process (its `inline_engines`), one batcher each.
"""
