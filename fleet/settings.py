"""The fleet's settings: the API's (`api.settings.ApiSettings`, which hold the core's) and
what only the roles and `harvest up` read, every field set as `HARVEST_<FIELD>`.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from api.settings import ApiSettings

__all__ = ["FleetSettings"]


class FleetSettings(ApiSettings):
    """The settings of `harvest up` and of the roles it starts: the API's (the replicas' address
    and proxies) and the fleet's own: its Prefect server, its supervision."""

    # --- the fleet's Prefect server ---
    prefect_host: str = "127.0.0.1"
    """Address the Prefect server of `harvest server` / `harvest up` binds and advertises."""

    prefect_port: int = Field(default=4200, ge=1, le=65535)
    """Port of the Prefect server of `harvest server` / `harvest up` (the first of a scaled
    control plane's; its others take the ports after it)."""

    prefect_api_servers: int = Field(default=1, ge=0)
    """Prefect API server processes `harvest server` runs (`--api-servers`). More than one (or
    none: the services alone) is a scaled control plane (`fleet.control_plane`): PostgreSQL and
    `redis_url` required."""

    redis_url: str = ""
    """Redis of a scaled control plane (`harvest server --redis-url`), e.g.
    redis://127.0.0.1:6379/0: Prefect's events, leases and docket (`fleet.control_plane`).
    Empty: one Prefect process, its services inside it."""

    prefect_api_urls: str = ""
    """Comma-separated Prefect API URLs of a scaled control plane's servers, for an API replica or
    a worker host (`harvest api|worker`) instead of PREFECT_API_URL: the role takes them in an
    order of its own (a stable hash of its name) and moves to the next when one is down
    (`fleet.prefect_endpoints`). Empty: PREFECT_API_URL (one server, or a load balancer)."""

    @field_validator("prefect_api_urls")
    @classmethod
    def _api_urls(cls, value: str) -> str:
        from fleet.prefect_endpoints import parse_api_urls

        return ",".join(parse_api_urls(value))

    # --- supervision: `harvest up` and the roles restart a child process that dies ---
    restart_limit: int = Field(default=5, ge=0)
    """Restarts of one child (an API replica, a worker, the Prefect server) within
    `restart_window_s`; one more death and the supervisor stops everything and exits 1 (a
    child that cannot stay up). 0: never restart, stop at the first death."""

    restart_window_s: float = Field(default=300.0, gt=0)
    """The window `restart_limit` counts restarts in, seconds."""
