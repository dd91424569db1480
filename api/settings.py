"""The API's settings: the core's (`harvest.settings.Settings`) and the API replica's own
section, every field set as `HARVEST_<FIELD>` like the core's.

The factory (`api.app.create_app`) reads them once, unless handed its own, and the routes get
them as `api.deps.AppSettings`.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from harvest.settings import Settings

__all__ = ["ApiSettings"]


class ApiSettings(Settings):
    """The core's settings and the API replica's."""

    # --- job store, keys, links, long-poll, caps ---
    database_url: str | None = None
    """SQLAlchemy URL of the job store; default SQLite at `<home>/harvest.db` (PostgreSQL in production)."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the API (`harvest api` and `harvest up` bind <host>:<port>)."""

    host: str = "127.0.0.1"
    """Address the API binds (`0.0.0.0` behind a load balancer)."""

    signing_secret: str | None = None
    """HMAC secret of file-store download links; default a random one kept in `<home>/signing.key`."""

    url_expiry_s: int = Field(default=7 * 24 * 3600, ge=1, le=7 * 24 * 3600)
    """How long a download link works after it was issued (S3 SigV4 allows at most 7 days)."""

    storage_quota_bytes: int | None = Field(default=None, ge=0)
    """Per key: bytes its kept job files may hold (`api.store.bytes_held`), for a key without
    its own quota (`harvest keys create --storage-quota`). Unset: unlimited, so an upgrade
    refuses no existing key's harvests until the operator sizes it to the store's disk."""

    longpoll_max_waiters: int = Field(default=100, ge=0)
    """Concurrent `?wait=` reads held open; more are answered at once with X-Acs-Longpoll: declined."""

    watch_interval_s: float = Field(default=1.0, gt=0)
    """How often the API's one watcher re-reads a page of the active jobs' runs (`watch_page` of
    them, cycling through all), and looks for orphans and unmeasured folders; the runs Prefect's
    events name it reads at once (`api.watcher`)."""

    watch_page: int = Field(default=200, ge=1)
    """Active jobs whose runs the watcher re-reads every `watch_interval_s` (200: one Prefect
    request), cycling through all of them: a change whose event was missed is recorded within
    (ceil(active jobs / watch_page) + 1) intervals."""

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

    inline_response_key_share: float = Field(default=0.5, gt=0, le=1)
    """Per key: the share of `inline_response_budget_bytes` one key's inline responses may hold
    together; one more is answered 503 `replica_busy` with `Retry-After`. A response bigger
    than the share runs when its key holds no other."""

    send_timeout_s: float = Field(default=30.0, gt=0)
    """A response whose client reads none of it for this long is cut (the connection reset)
    and what it held freed, its inline budget bytes included (`api.send_timeout`)."""

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

    # --- HTTP parsing (`api.http_server`): what a request head may cost before the app sees it ---
    http_line_bytes: int = Field(default=8 << 10, ge=1 << 10, le=1 << 20)
    """Bytes of the request line (longer: 414 `request_line_too_long`) and of each header line
    (longer: 431 `request_head_too_large`), counted while the line arrives; the connection
    closes. 8 KiB, as nginx's and Apache's defaults: the longest line this API's clients send
    is a signed download link's request line, 178 bytes (measured)."""

    http_head_bytes: int = Field(default=16 << 10, ge=1 << 10, le=1 << 20)
    """Bytes of the whole request head (request line and header lines); more: 431
    `request_head_too_large`, the connection closed. 16 KiB (h11's and Node's default): the
    harvest client's head is 229 bytes, the OpenAI client's 498 (measured), and a proxy in
    front adds a few headers. A replica holds at most this per open connection for a head."""

    http_head_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """Seconds from a connection's start (or the end of its previous request) to the last byte
    of the request head; then 408 `request_timeout` and the connection closes (closed without
    an answer when nothing was sent). A client sends its head in one write, in milliseconds; a
    slow sender holding connections open is cut this soon."""

    @model_validator(mode="after")
    def _line_within_head(self) -> "ApiSettings":
        if self.http_line_bytes > self.http_head_bytes:
            raise ValueError(f"http_line_bytes ({self.http_line_bytes}) must not exceed http_head_bytes ({self.http_head_bytes})")
        return self

    idempotency_window_s: float = Field(default=24 * 3600, gt=0)
    """How long an `Idempotency-Key` of POST /v1/harvest keeps answering its job (a day, as
    Stripe's); after it the key is free for a new job, and its record is deleted."""

