"""Warm engines: a model loaded once per worker host, not once per job.

A job's flow run is a fresh process (Prefect's process worker), so an engine loaded there dies
with the job. On a worker host (`harvest worker`, `harvest up`) the run instead asks an
*engine server* for its model: one long-lived process per GPU group of the host (a slot's
GPUs; a host without GPUs is one group), which keeps the models it loaded
(`HARVEST_ENGINE_MODELS_PER_GROUP`, default one; the least recently used idle one is evicted
when another is asked for) and runs every forward pass of every job on that group:

- `server`: the engine server (`python -m harvest.warm.server --group G`). It answers on a
  Unix socket under `$HARVEST_HOME/engines/` with an owner-only authentication key beside it,
  runs one engine call at a time per engine, the waiting shards of concurrent jobs together
  in shared forward passes (`batching`),
  and exits after `HARVEST_ENGINE_IDLE_S` without a client, or when its worker stops.
- `client`: what a run uses. `open_engine` connects to its group's server, starting it
  (detached, in its own session, so it outlives the run) when none answers, and returns an
  `Engine` whose `capture` is a call to the server; the shard's values stream back prompt by
  prompt as the engine makes them, straight into the run's staged shard file, so neither
  process holds a whole shard. A cancelled run's process ends, its
  connection closes, and the server drops its work without touching the other jobs. A server
  that dies mid-shard (killed, out of memory) is started again and the shard in flight asked
  again: a shard is one whole answer or none, so it is never skipped or written short.
- `cache`: the per-group LRU of loaded engines (pure, tested on its own).

Off a worker host (`harvest run`, a flow called in-process) the engine is loaded in the
process itself, as before.
"""
