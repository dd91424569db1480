"""The control plane's password: Prefect's own basic auth for a self-hosted server.

Prefect's server, given `PREFECT_SERVER_API_AUTH_STRING` (`user:password`), answers 401 to
every API call without it, except `GET /api/health` and `/api/ready` (health checks); its
clients (workers, flow runs, the API replicas, our own deploy calls) send the string they find
in `PREFECT_API_AUTH_STRING`. Without it, anyone who reaches the Prefect API can start runs
with any parameters or job variables, i.e. run code on the workers.

Where each process finds the string:

    server   PREFECT_SERVER_API_AUTH_STRING, else PREFECT_API_AUTH_STRING (one value for a
             whole deployment), else the file `$HARVEST_HOME/prefect-auth`, generated owner-only
             (0600) on the first start and kept for the next ones
    clients  PREFECT_API_AUTH_STRING, else that same file when this host has it: the one-box
             stack (`harvest up`, or roles sharing one HARVEST_HOME)

A role puts the string it found in its own environment, so every child it starts (the
uvicorn API, the Prefect worker and its flow runs) sends it too.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from harvest.private_files import write_private

__all__ = ["SERVER_ENV", "CLIENT_ENV", "AUTH_FILE", "server_auth", "client_auth", "use_client_auth", "basic_header"]

SERVER_ENV = "PREFECT_SERVER_API_AUTH_STRING"
CLIENT_ENV = "PREFECT_API_AUTH_STRING"
AUTH_FILE = "prefect-auth"


def _checked(value: str, source: str) -> str:
    value = value.strip()
    user, sep, password = value.partition(":")
    if not (user and sep and password):
        raise SystemExit(f"{source} must be user:password (basic auth), e.g. harvest:<a long random secret>")
    return value


def server_auth(home: Path) -> str:
    """The string the server requires (generated into `home` when none is given)."""
    for name in (SERVER_ENV, CLIENT_ENV):
        if os.environ.get(name):
            return _checked(os.environ[name], name)
    path = Path(home) / AUTH_FILE
    write_private(path, f"harvest:{secrets.token_urlsafe(32)}\n", replace=False)  # the first start wins
    return _checked(path.read_text(), str(path))


def client_auth(home: Path) -> str | None:
    """The string a client sends, or None when neither the environment nor `home` has one."""
    if os.environ.get(CLIENT_ENV):
        return _checked(os.environ[CLIENT_ENV], CLIENT_ENV)
    path = Path(home) / AUTH_FILE
    return _checked(path.read_text(), str(path)) if path.exists() else None


def use_client_auth(auth: str) -> None:
    """Send `auth` from this process and from every process it starts from now on."""
    os.environ[CLIENT_ENV] = auth
    if "prefect.context" in sys.modules:  # Prefect read its settings at import: read them again
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def basic_header(auth: str) -> dict[str, str]:
    """The `Authorization` header of a plain HTTP call to the Prefect API."""
    import base64

    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
