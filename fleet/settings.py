"""The fleet's settings: the API's (`api.settings.ApiSettings`, which hold the core's) and
what only the roles and `harvest up` read, every field set as `HARVEST_<FIELD>`.
"""

from __future__ import annotations

from pydantic import Field

from api.settings import ApiSettings

__all__ = ["FleetSettings"]


class FleetSettings(ApiSettings):
    """The settings of `harvest up` and of the roles it starts: the API's (the replicas' address
    and proxies) and the fleet's own: its Prefect server, its supervision."""

    # --- the fleet's Prefect server ---
    prefect_host: str = "127.0.0.1"
    """Address the Prefect server of `harvest server` / `harvest up` binds and advertises."""

    prefect_port: int = Field(default=4200, ge=1, le=65535)
    """Port of the Prefect server of `harvest server` / `harvest up`."""

    # --- supervision: `harvest up` and the roles restart a child process that dies ---
    restart_limit: int = Field(default=5, ge=0)
    """Restarts of one child (an API replica, a worker, the Prefect server) within
    `restart_window_s`; one more death and the supervisor stops everything and exits 1 (a
    child that cannot stay up). 0: never restart, stop at the first death."""

    restart_window_s: float = Field(default=300.0, gt=0)
    """The window `restart_limit` counts restarts in, seconds."""
