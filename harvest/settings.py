"""One validated settings object for the whole service, read from `HARVEST_*` variables.

Prefect keeps its own `PREFECT_*` variables; nothing here shadows them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Service configuration; every field can be set as `HARVEST_<FIELD>`."""

    model_config = SettingsConfigDict(env_prefix="HARVEST_", extra="ignore")

    home: Path = Field(default=Path(".harvest"))
    """Working directory for built models, the embedded database and local files."""

    models_file: Path = Field(default=REPO_ROOT / "infra" / "models.toml")
    """The model registry (served name → weights, lane, operational caps)."""

    lanes_file: Path = Field(default=REPO_ROOT / "infra" / "lanes.toml")
    """The GPU lanes (work pool, caps, GPUs per run), one table each (`harvest.lanes`)."""

    engine: str = "auto"
    """Engine: `auto` (vLLM where CUDA is present and vLLM installed, else the HF reference;
    `harvest.engines.choice` says why), `vllm`, `hf`, or `module:Class` (an
    `Engine` subclass taking the model, e.g. an instrumented one)."""

    storage_url: str | None = None
    """Where job files go (any fsspec URL); default `file://<home>/storage`."""

    s3_endpoint_url: str | None = None
    """Endpoint of an S3-compatible server (MinIO, moto) for `s3://` storage; None is AWS."""

    # --- API: job store, keys, links, long-poll, caps ---------------------------
    database_url: str | None = None
    """SQLAlchemy URL of the job store; default SQLite at `<home>/harvest.db` (PostgreSQL in production)."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the API (`harvest api` and `harvest up` bind <host>:<port>)."""

    host: str = "127.0.0.1"
    """Address the API binds (`0.0.0.0` behind a load balancer)."""

    prefect_host: str = "127.0.0.1"
    """Address the Prefect server of `harvest server` / `harvest up` binds and advertises."""

    prefect_port: int = Field(default=4200, ge=1, le=65535)
    """Port of the Prefect server of `harvest server` / `harvest up`."""

    signing_secret: str | None = None
    """HMAC secret of file-store download links; default a random one kept in `<home>/signing.key`."""

    url_expiry_s: int = Field(default=7 * 24 * 3600, ge=1, le=7 * 24 * 3600)
    """How long a download link works after it was issued (S3 SigV4 allows at most 7 days)."""

    retention_days: float = Field(default=30, gt=0)
    """Days after completion that a job's files are kept; then links say urls_expired."""

    storage_quota_bytes: int | None = Field(default=None, ge=0)
    """Per key: bytes its kept job files may hold (`api.store.bytes_held`), for a key without
    its own quota (`harvest keys create --storage-quota`). Unset: unlimited, so an upgrade
    refuses no existing key's harvests until the operator sizes it to the store's disk."""

    longpoll_max_waiters: int = Field(default=100, ge=0)
    """Concurrent `?wait=` reads held open; more are answered at once with X-Acs-Longpoll: declined."""

    watch_interval_s: float = Field(default=1.0, gt=0)
    """How often the API's one watcher reads the states of all active flow runs."""

    watcher_lease_s: float = Field(default=5.0, gt=0)
    """Lifetime of the watcher lease: another API replica takes over this long after its holder died."""

    max_restarts: int = Field(default=3, ge=0)
    """How often a job's run is rescheduled after its host died before the job fails."""

    orphan_after_s: float = Field(default=30.0, gt=0)
    """A job with no run this long after admission (its replica died mid-submit) is started by the watcher."""

    public_base_url: str | None = None
    """Base URL put in file download links (e.g. behind a proxy); default the request's own."""

    inline_preload: str | None = None
    """Comma-separated served names whose inline engines the API loads at start-up."""

    # --- metrics: `/metrics` of API replicas and worker hosts (harvest/metrics_export.py) ---
    metrics_token: str | None = None
    """Bearer token every `/metrics` requires (Prometheus' `authorization`); default a random
    one kept in `<home>/metrics-token`. Researchers' API keys never open `/metrics`."""

    metrics_host: str = "127.0.0.1"
    """Address a worker host's metrics exporter binds (`harvest worker --metrics-host`): this
    host only, unless a scraper elsewhere must reach it (the token is required either way)."""

    metrics_port: int = Field(default=9464, ge=0, le=65535)
    """Port of a worker host's metrics exporter (`harvest worker --metrics-port`); 0: none."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        value = value.strip()
        if value not in ("auto", "vllm", "hf") and ":" not in value:
            raise ValueError(f"HARVEST_ENGINE must be auto, vllm, hf or module:Class, not {value!r}")
        return value

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @property
    def resolved_storage_url(self) -> str:
        return self.storage_url or f"file://{self.home / 'storage'}"

    # --- flows: scale-out helpers, throttles (read by flows/ at call time) ---
    helper_grace_s: float = Field(default=30.0, ge=0)
    """Seconds a scale-out parent, its own range done, lets a helper run stay not-yet-running
    (Scheduled, Pending, Paused) before cancelling it and doing its shards itself. A worker
    needs a poll and a process start (10-20 s on a loaded CPU box) to pick a helper up."""

    helper_stall_s: float = Field(default=60.0, gt=0)
    """Seconds a helper may stay Crashed, Cancelling or in an unknown state, unchanged, before
    the parent takes its shards over (long enough for a reschedule to show)."""

    # --- warm engines (harvest/warm/): one engine server per GPU group of a worker host ---
    engine_idle_s: float = Field(default=900.0, gt=0)
    """An engine server with no client for this long releases its models and exits."""

    engine_models_per_group: int = Field(default=1, ge=1)
    """Models kept loaded per GPU group (a CPU host is one group); the least recently used
    idle one is evicted when another is asked for."""

    engine_cobatch_shards: int = Field(default=1, ge=1)
    """Co-batching: shards of concurrent jobs run together in one engine call (shared forward
    passes) when they capture the same layers and directions; 1 runs each shard alone, the
    default on every device: co-batching measured slower on the CPU and on an H200
    (`harvest.warm.cobatch`)."""

    engine_cobatch_wait_s: float = Field(default=0.1, ge=0)
    """How long an engine that comes free waits for the other jobs holding it to ask for their
    next shards, so they are co-batched instead of alternating (with co-batching on)."""

    engine_turn_tokens: int = Field(default=16384, ge=0)
    """Fair turns on a shared engine: a shard runs in turns of at most this many tokens (at
    least one prompt each), and the shards of other jobs waiting meanwhile go between its
    turns, so a small job's shard waits for one turn of a large one, never its whole shard
    (`harvest.warm.cobatch`). 0: every shard whole, in one turn."""

    engine_turn_s: float = Field(default=1.0, ge=0)
    """Fair turns sized by time too: at the speed the engine measured on its recent calls, a
    turn takes at most about this long (at least one prompt), so a small job waits about this
    long for a large one's turn on any device; on a GPU the token bound is usually the one that
    acts. 0: turns by tokens only (`harvest.warm.cobatch`)."""

    engine_start_timeout_s: float = Field(default=180.0, gt=0)
    """How long a run waits for its host's engine server to answer after starting it."""

    s3_part_bytes: int = Field(default=16 << 20, ge=5 << 20)
    """Part size of S3 multipart uploads: a file of at least two parts goes up as one."""

    # --- engine memory: forward passes bounded by tokens, shards streamed in pieces ---
    engine_batch_tokens: int = Field(default=16384, ge=1)
    """Tokens in one forward pass of the HF engine, filler included, whatever a request's
    `batch_size` says (a prompt longer than this still runs, alone). With `engine_piece_bytes`
    it bounds the memory a forward pass and its captured values take in the process running
    the engine."""

    engine_row_tokens: int = Field(default=128, ge=1)
    """Tokens in one packed row of the HF engine: whole prompts back to back, each attending
    to itself only (`harvest.engines.packing`); a longer prompt is a row of its own. A row's
    attention spans the whole row, so longer rows spend more on attention that the mask
    discards: on the CPU rows of 128 and 192 ran a real-text corpus fastest, 256 2 % and 512
    5-8 % slower, 64 12 % slower (too many small passes; bench/RESULTS.md, "Peers")."""

    engine_piece_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """Most bytes of captured values (as stored: tokens × layers kept × hidden or directions ×
    2 for bf16, 4 for projections) one engine batch holds and hands over at once: the HF
    engine makes its batches no bigger, the vLLM engine runs a shard in groups of prompts no
    bigger, and the engine server sends each batch's values to the run as they come, which
    writes them straight to the shard's file. A single prompt bigger than this is one piece."""

    staging_dir: Path | None = None
    """Local folder where a run builds the shards it uploads to a remote store (S3), room for
    two shard files per run; default `<home>/staging`. On local storage shards are built
    beside their final name instead, and renamed into place."""

    @property
    def resolved_staging_dir(self) -> Path:
        return self.staging_dir or self.home / "staging"

    # --- placement: a worker host's slots, automatic scale-out (harvest/placement.py) ---
    slots: list[list[str]] | None = None
    """This worker host's slot table, one list of GPU ids per slot (`[["0","1"],["2","3"]]`;
    `[[], []]`: two slots without devices), as JSON. Set by `harvest worker` for its flow runs,
    each of which claims one slot; None (not on a worker host) claims nothing."""

    scale_out_min_shards: int = Field(default=8, ge=1)
    """Automatic scale-out gives every run at least this many shards: a job is spread over more
    runs only when each would still do this much (every run loads the model once)."""

    # --- supervision: `harvest up` and the roles restart a child process that dies ---
    restart_limit: int = Field(default=5, ge=0)
    """Restarts of one child (an API replica, a worker, the Prefect server) within
    `restart_window_s`; one more death and the supervisor stops everything and exits 1 (a
    child that cannot stay up). 0: never restart, stop at the first death."""

    restart_window_s: float = Field(default=300.0, gt=0)
    """The window `restart_limit` counts restarts in, seconds."""


    # --- API hardening: links, request rates, request ids ---
    trust_host_header: bool = False
    """Build download links from the request's Host header (only behind a proxy that sets it
    itself). Off: links use `public_base_url`, else `http://<host>:<port>` of this replica, so
    a client cannot make the API hand out links to a host of its choosing."""

    rate_submit_per_s: float = Field(default=2.0, gt=0)
    """Per key: sustained submits (POST /v1/harvest, POST /v1/completions) per second, summed
    over every API replica (a token bucket in the job store)."""

    rate_submit_burst: int = Field(default=60, ge=1)
    """Per key: submits allowed at once before the sustained rate applies."""

    rate_read_per_s: float = Field(default=10.0, gt=0)
    """Per key: sustained reads (GET/DELETE /v1/harvest…, GET /v1/models) per second, all replicas.
    A researcher's client reads far less (the harvest client long-polls each job it follows,
    one read per 10 s window; the docs ask for one read a minute); 50 a second, the earlier
    default, was more than a 2-core replica serves for one key while answering the others."""

    rate_read_burst: int = Field(default=200, ge=1)
    """Per key: reads allowed at once before the sustained rate applies (a listing of 20,000
    jobs is 200 pages)."""

    key_reads_in_flight: int = Field(default=8, ge=1)
    """Per key, per replica: reads the replica works on at once (a long-poll that is waiting is
    not counted; submits have their own per-key shares); one more is answered 429
    `rate_limit_exceeded` with Retry-After 1 at once, without a query."""

    replica_work_at_once: int = Field(default=0, ge=0)
    """Per replica: the keyed routes' blocking calls (job-store queries, rendering) run in worker
    threads at once; more wait their key's turn, keys served round-robin.
    0: two per CPU core, at least 4."""

    # --- admission (per API replica): what a submit may cost before its cost is known ---
    admission_concurrency: int = Field(default=2, ge=1)
    """Submits (POST /v1/harvest) this replica parses and tokenizes at once, each by one of as
    many child processes (`api.admission_process`), off the event loop and out of the
    replica's CPU share; more wait their turn."""

    admission_bytes: int = Field(default=128 << 20, ge=1 << 20)
    """Request bodies, in bytes, that submits being admitted hold at once on this replica: a
    submit counts its Content-Length (the route's 50 MB cap when it sends none) from before
    its body is read until it is answered. One body bigger than this is admitted only alone."""

    admission_read_s: float = Field(default=60.0, gt=0)
    """How long a submit's body may take to arrive once its bytes are held; then 408
    `request_timeout` (a slow sender cannot keep its share of the budget)."""

    admission_key_share: int = Field(default=1, ge=1)
    """Submits of one key this replica admits at once: a key's burst of large bodies queues
    behind itself, and other keys' submits take the other places."""

    admission_queue: int = Field(default=64, ge=0)
    """Submits waiting for a place on this replica; one more is answered at once with 503
    `replica_busy` and Retry-After."""

    admission_wait_s: float = Field(default=20.0, gt=0)
    """How long a submit waits for a place before it is answered 503 `replica_busy` with
    Retry-After (its body still unread: the client sends it again later, or to another replica)."""

    # --- serving bounds of an API replica: inline bytes, long-poll shares, callers without a key ---
    inline_response_budget_bytes: int = Field(default=512 << 20, ge=1 << 20)
    """Per replica: bytes of inline residual streams in flight (captured, encoding or being
    sent), counted at their largest (layers × (prompt + max_tokens − 1) × hidden × 2) from
    before the engine runs until the response is sent. A request that would pass it is answered
    503 `replica_busy` with `Retry-After`; one bigger than the whole budget runs only alone."""

    longpoll_key_share: float = Field(default=0.25, gt=0, le=1)
    """Per key: the share of a replica's `longpoll_max_waiters` one key may hold (at least one
    slot); its further `?wait=` reads are answered at once, `X-Acs-Longpoll: declined`."""

    rate_anonymous_per_s: float = Field(default=2.0, gt=0)
    """Per client address, per replica: sustained requests that carry no valid key (a missing,
    unknown or revoked key) per second; over it 429 `rate_limit_exceeded` before the job store
    is asked. A request with a valid key never spends or waits on these. The address is the
    connection's peer, or what `trusted_proxies` forward."""

    rate_anonymous_burst: int = Field(default=100, ge=1)
    """Per client address, per replica: requests without a valid key allowed at once."""

    trusted_proxies: str = ""
    """Comma-separated addresses or networks (`10.0.0.5,10.1.0.0/16`) of the proxies or load
    balancers in front of the API whose `X-Forwarded-For` / `X-Forwarded-Proto` are believed
    (uvicorn's `forwarded_allow_ips`, set by every role that starts uvicorn: `fleet.proxies`).
    Empty (default): no header is believed, the client address is the connection's peer; else
    a client could name a fresh address per request and never be limited."""

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_addresses(cls, value: str) -> str:
        import ipaddress

        items = [item.strip() for item in value.split(",") if item.strip()]
        for item in items:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (e.g. 10.0.0.5 or 10.0.0.0/8)") from None
        return ",".join(items)

    idempotency_window_s: float = Field(default=24 * 3600, gt=0)
    """How long an `Idempotency-Key` of POST /v1/harvest keeps answering its job (a day, as
    Stripe's); after it the key is free for a new job, and its record is deleted."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
