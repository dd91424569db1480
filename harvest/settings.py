"""The core's settings, read from `HARVEST_*` variables: what models, engines, storage and flows
need wherever they run (a worker host, a run, a notebook).

Each layer above owns a section of its own that extends this one, so every variable keeps its
one documented name: the API's (`api.settings.ApiSettings`) and the fleet's
(`fleet.settings.FleetSettings`). A process reads its layer's section once, with
`get_settings(section)`, and hands it to what it builds. Prefect keeps its own `PREFECT_*`
variables; nothing here shadows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]

Section = TypeVar("Section", bound="Settings")

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """The core's configuration; every field can be set as `HARVEST_<FIELD>`."""

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

    retention_days: float = Field(default=30, gt=0)
    """Days after completion that a job's files are kept; then links say urls_expired."""

    # --- metrics: `/metrics` of the API and of worker hosts (harvest/metrics_export.py) ---
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

    engine_row_tokens: int | None = Field(default=None, ge=1)
    """Tokens in one packed row of the HF engine: whole prompts back to back, each attending
    to itself only (`harvest.engines.packing`); a longer prompt is a row of its own. Unset (the
    default), each capture plans its rows for its prompts' lengths, its model and its device
    (`packing.plan_for`); a number fixes them (benches sweep it)."""

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

    def as_environment(self, leave_out: frozenset[str] = frozenset()) -> dict[str, str]:
        """The core's part of this configuration as the `HARVEST_*` variables that make it again
        in a child process (fields unset, and those in `leave_out`, left out): how a process
        hands its configuration to one it starts."""
        values = self.model_dump(mode="json", include=set(Settings.model_fields) - leave_out, exclude_none=True)
        return {f"HARVEST_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
                for name, value in values.items()}

def get_settings(section: type[Section] = Settings) -> Section:
    """The process's settings of one layer's `section` (the core's by default), read from its
    environment now: an entry point reads them once and hands them on (nothing caches them,
    so nothing has to be told the environment changed)."""
    return section()
