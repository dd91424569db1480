"""Secrets that still hold the example's placeholder are refused when a role starts.

`infra/compose.env.example` ships `change-me-…` values so that `compose config` runs on it as
is; a fleet brought up with them would run with passwords that anyone who has read this
repository knows (the job store's, S3's, the control plane's). So every role (`harvest
server|api|worker`) first reads the secrets it may be given and exits, naming each variable,
when one of them still holds the placeholder; nothing has started by then.

    placeholder_secrets(environ)          the secret variables that hold the placeholder
    refuse_placeholder_secrets(prog)      exit with the error when there are any
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["PLACEHOLDER", "SECRET_VARIABLES", "placeholder_secrets", "refuse_placeholder_secrets"]

PLACEHOLDER = "change-me"
"""What every secret of infra/compose.env.example starts with."""

SECRET_VARIABLES = (
    "PREFECT_API_AUTH_STRING",  # the control plane's password, as its clients send it
    "PREFECT_SERVER_API_AUTH_STRING",  # … and as the control plane checks it
    "AWS_SECRET_ACCESS_KEY",  # the bucket
    "HARVEST_DATABASE_URL",  # the job store's password, inside its URL
    "PREFECT_API_DATABASE_CONNECTION_URL",  # Prefect's database password, inside its URL
    "HARVEST_REDIS_URL",  # a scaled control plane's Redis password, inside its URL
    "HARVEST_SIGNING_SECRET",  # the download links' HMAC key
    "HARVEST_METRICS_TOKEN",  # every /metrics' bearer token
)
"""The variables a role reads secrets from (directly, or inside a URL)."""


def placeholder_secrets(environ: Mapping[str, str]) -> list[str]:
    """The secret variables of `environ` whose value still holds the placeholder."""
    return [name for name in SECRET_VARIABLES if PLACEHOLDER in environ.get(name, "").lower()]


def refuse_placeholder_secrets(prog: str, environ: Mapping[str, str] | None = None) -> None:
    """Exit (status 2, the error on stderr) when a secret still holds the placeholder."""
    names = placeholder_secrets(os.environ if environ is None else environ)
    if names:
        raise SystemExit(
            f"{prog}: {', '.join(names)} still hold{'s' if len(names) == 1 else ''} the example's placeholder "
            f"({PLACEHOLDER!r}): set real secrets in infra/compose.env (e.g. `openssl rand -hex 24`; letters and "
            "digits, they go into URLs) or in the role's environment, and start it again."
        )
