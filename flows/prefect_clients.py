"""Prefect's clients in our processes share one TLS context (`share_tls_context`).

Prefect builds a new `ssl.SSLContext` for every client it makes, loading the whole CA bundle
(certifi's, or `PREFECT_API_SSL_CERT_FILE`) even for a plain http:// server: ~22 ms of CPU each
on the 2-core dev box. Processes make many clients:

- an API replica, one for each read of its watcher (several a second while runs change state)
  and for each run it starts or cancels: about a tenth of the replica's CPU under
  `bench/noisy_neighbour.py` (py-spy), on the path of every key's submits and reads;
- a flow run, about nine while it starts (its engine, its event and log workers, its
  observers): ~0.28 s of each run's CPU, a third of what its start costs.

Prefect uses a context it is given (`httpx_settings["verify"]`) as it is, so the constructors
of its two client classes are wrapped, once per process, to give each client that does not
choose its own a context made once per setting, the way Prefect makes it. Installed by an API
replica's run store (`api.runs.PrefectRuns`) and by a worker host's run starter before it forks
any run (`fleet.run_fork.preload`; the runs inherit the context made there).
"""

from __future__ import annotations

import functools
import ssl

import certifi
from prefect.client.orchestration import PrefectClient, SyncPrefectClient
from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

__all__ = ["share_tls_context", "tls_context"]


def share_tls_context() -> None:
    """Give every Prefect client made from now on in this process the shared context (idempotent)."""
    for client_class in (PrefectClient, SyncPrefectClient):
        if not getattr(client_class.__init__, "shares_tls_context", False):
            client_class.__init__ = _given_the_shared_context(client_class.__init__)


def tls_context() -> ssl.SSLContext:
    """The context Prefect would build for a client under the current settings, made once."""
    return _tls_context(bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value()),
                        PREFECT_API_SSL_CERT_FILE.value() or certifi.where())


@functools.lru_cache(maxsize=4)
def _tls_context(insecure: bool, ca_file: str) -> ssl.SSLContext:
    """What Prefect's clients build for these settings (prefect.client.orchestration)."""
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=ca_file)


def _given_the_shared_context(init):
    @functools.wraps(init)
    def wrapped(self, *args, httpx_settings=None, **kwargs):
        if "verify" not in (httpx_settings or {}):  # a caller's own choice is kept, as Prefect keeps it
            httpx_settings = {**(httpx_settings or {}), "verify": tls_context()}
        init(self, *args, httpx_settings=httpx_settings, **kwargs)

    wrapped.shares_tls_context = True
    return wrapped
