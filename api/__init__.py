"""The HTTP facade: bulk harvests and inline completions in one FastAPI app.

    app.py       `create_app(settings=, store=, runs=, storage=, ...)`: the app's parts, routers, the
                 one error handler, lifespan (migrate the store, start the watcher)
    deps.py      the parts (and the app's settings) as typed route dependencies, the capped body
                 reader and parser
    errors.py    the replica's own refusals (keys, rates, caps, links, routes), on the core's tree
    routes/      the route modules, one per resource:
      harvest.py     POST/GET/DELETE /v1/harvest[/{job_id}]: validate, admit, write request, start run
      files.py       GET /v1/files/{job_id}/{name}: the HMAC-signed download route (file:// storage)
      completions.py POST /v1/completions (and the path both inline routes share)
      chat.py        POST /v1/chat/completions
      models.py      GET /v1/models
    auth.py      API keys (SHA-256 at rest), Bearer authentication, the activation quota (positions)
    store.py     the job store: atomic admission under the caps, charging by compare-and-set
    db.py        tables, `JobStore` (a store's engines, SQLite/PostgreSQL: made by the app or the
                 command, handed in), transactions, Alembic migrations (api/migrations)
    runs.py      the run store (Prefect): start / cancel / read many runs at once
    watcher.py   the one background loop that follows all runs and wakes long-poll waiters
    links.py     presigned links: S3 SigV4 presigning, HMAC links for local files (`LinkSigner`)
    schemas.py   response shapes (OpenAPI) and the harvest object of a job row
    guard.py     every request: a request id, the body cap (413), the one 500 for unexpected errors
    ratelimit.py per-key request rates: a token bucket per key in the job store (429, Retry-After);
                 requests without a valid key: per client address, before the store
    fairshare.py each key's share of a replica: reads in flight per key, blocking calls in turn
    openapi.py   the published document: bodies, every refusal, resolving refs, keys declared
    admin.py     `harvest keys create|list|revoke`, `harvest spend-cap on|off|status`
    http_server.py  the replica's uvicorn: h11 with request heads bounded in size and time (414,
                 431, 408 before the app), `python -m api.http_server` (`fleet.roles.api_command`)

Choices where the spec is silent (documented here and in the routes' docstrings):

- Caps are checked after the request is valid (a 400 wins over a 429); among caps the order
  is spend_cap, concurrency, monthly job quota, token budget, storage quota, lane capacity. The per-key
  request rate comes before all of them, right after the key (401, then 429
  `rate_limit_exceeded`, then the body): a throttled key costs no parsing.
- Charges: one row per ended job in the append-only `charge_ledger`, written with the ending;
  usage and budgets are its sums (`api.store`).
- The monthly job quota, the token budget and the activation quota are per calendar month
  (UTC). The token budget counts tokens charged this month plus tokens held by active jobs.
  A cancelled or failed job still counts towards the monthly job quota.
- The storage quota (bytes held, not per month) counts a job's admitted output bytes
  (`harvest.cost`: shards only) while it is active, the bytes it wrote (shards, statistics,
  manifest) once done, and its files' share of them until its retention ends
  (`api.store.bytes_held`); over it is 429 `storage_quota_exceeded` without Retry-After.
- Links expire `HARVEST_URL_EXPIRY_S` (7 days) after the read that made them, and never after
  the files' retention (30 days after completion) ends. After retention, or once the sweep
  removed the files, a done job keeps its result numbers and says `urls_expired: true`.
- A run that cannot be started answers 503 `harvest_unavailable` naming the job id; the job
  is recorded failed, charged nothing.
- `GET /v1/harvest` pages with `limit` (1..100, default 20) and `after` (a job_id), and
  answers `{"object": "list", "data", "has_more", "first_id", "last_id"}`. Its harvest objects
  carry no download links (a done job's `result` keeps its numbers): `GET /v1/harvest/{job_id}`
  makes them.
- A failed job's `error` is `code: sentence (ref 0123456789ab)`: our own refusals keep their
  message, anything else is the vocabulary's sentence (`engine_failed`, `storage_failed`,
  `internal_error`); the details are in the run's or the API's log under the reference.
- The activation quota counts residual-stream positions returned (prompt + generated − 1 per
  response), held at their most while a request runs.
- The harvest object adds `object: "harvest"`, `lane` and `run_id` (the Prefect flow run).
"""
