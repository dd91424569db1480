"""Prefect clients for a process that makes many of them (an API replica): one TLS context.

Prefect's `get_client` builds a new `ssl.SSLContext` for every client it makes, loading the
whole CA bundle (certifi's, or `PREFECT_API_SSL_CERT_FILE`) even for a plain http:// server:
~20 ms of CPU each time. An API replica makes a client for each read of its watcher (several a
second while runs change state) and for each run it starts or cancels; under
`bench/noisy_neighbour.py` the contexts were about a tenth of the replica's CPU (py-spy), on the
path of every key's submits and reads. Here the context is made once per setting, the way
Prefect makes it, and handed to each client (Prefect uses a given `SSLContext` as it is).
"""

from __future__ import annotations

import ssl
from functools import lru_cache

import certifi
from prefect.client.orchestration import get_client as _prefect_client
from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

__all__ = ["get_client"]


def get_client(*, sync_client: bool = False):
    """Prefect's `get_client`, its TLS context made once (the module docstring)."""
    context = _tls_context(bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value()),
                           PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
    return _prefect_client(httpx_settings={"verify": context}, sync_client=sync_client)


@lru_cache(maxsize=4)
def _tls_context(insecure: bool, ca_file: str) -> ssl.SSLContext:
    """What Prefect's client builds for these settings (prefect.client.orchestration)."""
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=ca_file)
