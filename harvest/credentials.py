"""The service's secrets, as the environment variables that carry them, and the environment a
child process is handed: its parent's, less every secret the child does not use.

A child inherits its parent's whole environment unless it is handed one. A role holds secrets
for its own work (a worker host's metrics token, for the exporter it serves itself) that its
children never use, and a child that holds a secret opens to whoever takes it over what that
secret opens. So every start of a child hands it `handed(environ, needs)`: the environment
with each variable of `SECRETS` left out unless the child is named as needing it.

    variable                              opens
    PREFECT_SERVER_API_AUTH_STRING        the Prefect API (the password the server checks)
    PREFECT_API_AUTH_STRING               the Prefect API (the same password, as a client sends it)
    PREFECT_API_KEY                       the Prefect API (Prefect Cloud's key)
    PREFECT_API_DATABASE_CONNECTION_URL   Prefect's database (its password is in the URL; also
                                          PREFECT_SERVER_DATABASE_CONNECTION_URL, and a password
                                          given apart, PREFECT_{API,SERVER}_DATABASE_PASSWORD)
    PREFECT_REDIS_MESSAGING_URL           the Redis of a scaled control plane (`fleet.control_plane`):
                                          its events, leases and background tasks (password in the
                                          URL; also PREFECT_SERVER_DOCKET_URL, HARVEST_REDIS_URL,
                                          and a password given apart, PREFECT_REDIS_MESSAGING_PASSWORD)
    HARVEST_DATABASE_URL                  the job store: keys, jobs, charges (password in the URL)
    HARVEST_SIGNING_SECRET                download links of any job's files (the HMAC key)
    HARVEST_METRICS_TOKEN                 every /metrics of the fleet
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN
                                          the bucket, with the rights of that storage user

Which process holds which, and what each could reach if it were taken over: infra/RUNBOOK.md
"Threat model". Only the environment a child is handed is narrowed here: secrets kept in
files under HARVEST_HOME (a generated Prefect password or metrics token, on a host that was
given none) are readable by every process of that user, and so is another process's
environment (`/proc/PID/environ`). Against code that runs commands of its own, the boundary
is the user or the container (one per role in the recipe), not the process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["SECRETS", "PREFECT_CLIENT", "PREFECT_DATABASE", "PREFECT_REDIS", "STORAGE", "handed"]

SECRETS: dict[str, str] = {
    "PREFECT_SERVER_API_AUTH_STRING": "the Prefect API (the password the server checks)",
    "PREFECT_API_AUTH_STRING": "the Prefect API (the password a client sends)",
    "PREFECT_API_KEY": "the Prefect API (Prefect Cloud's key)",
    "PREFECT_API_DATABASE_CONNECTION_URL": "Prefect's database",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "Prefect's database (the setting's other name)",
    "PREFECT_API_DATABASE_PASSWORD": "Prefect's database (its password, given apart)",
    "PREFECT_SERVER_DATABASE_PASSWORD": "Prefect's database (its password, given apart)",
    "PREFECT_REDIS_MESSAGING_URL": "the control plane's Redis (events, leases, background tasks)",
    "PREFECT_REDIS_MESSAGING_PASSWORD": "the control plane's Redis (its password, given apart)",
    "PREFECT_SERVER_DOCKET_URL": "the control plane's Redis (the docket's URL)",
    "HARVEST_REDIS_URL": "the control plane's Redis (as `harvest server` is given it)",
    "HARVEST_DATABASE_URL": "the job store: keys, jobs, charges",
    "HARVEST_SIGNING_SECRET": "download links of any job's files",
    "HARVEST_METRICS_TOKEN": "every /metrics",
    "AWS_ACCESS_KEY_ID": "the bucket (the storage user's name)",
    "AWS_SECRET_ACCESS_KEY": "the bucket, with that storage user's rights",
    "AWS_SESSION_TOKEN": "the bucket, with that storage user's rights",
}
"""Every variable that carries a secret of the service → what it opens."""

PREFECT_CLIENT = ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY")
"""What a client of the Prefect API sends (one password for every client: Prefect's
self-hosted server checks a single string, so it cannot be narrowed per role)."""

PREFECT_DATABASE = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL",
                    "PREFECT_API_DATABASE_PASSWORD", "PREFECT_SERVER_DATABASE_PASSWORD")
"""Prefect's database, under each name Prefect reads it from: its server's alone."""

PREFECT_REDIS = ("PREFECT_REDIS_MESSAGING_URL", "PREFECT_REDIS_MESSAGING_PASSWORD", "PREFECT_SERVER_DOCKET_URL")
"""The Redis of a scaled control plane, under each name Prefect reads it from: its API servers'
and services' alone (`harvest server` turns HARVEST_REDIS_URL into these)."""

STORAGE = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
"""The storage user's credentials (its rights are the bucket policy's: infra/minio/)."""


def handed(environ: Mapping[str, str], needs: Iterable[str] = ()) -> dict[str, str]:
    """`environ` without the variables of `SECRETS` that are not in `needs`."""
    keep = set(needs)
    unknown = keep - set(SECRETS)
    if unknown:  # a misspelt need would silently hand nothing
        raise ValueError(f"not secrets of the service: {sorted(unknown)}")
    return {name: value for name, value in environ.items() if name not in SECRETS or name in keep}
