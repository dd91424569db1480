"""What a bind address means to the processes of this host.

A server bound to a wildcard (`0.0.0.0`, `::`, or empty) listens on every interface; this host
reaches it on loopback, while others need this host's name. Shared by the API (links to its own
file route) and the processes that start and wait for servers, so the two never disagree.
"""

from __future__ import annotations

import socket

__all__ = ["WILDCARDS", "local_address", "advertised"]

WILDCARDS = ("0.0.0.0", "::", "")
"""Bind addresses that mean "every interface of this host"."""


def local_address(host: str) -> str:
    """Where this host reaches a server it bound to `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in WILDCARDS else host


def advertised(host: str) -> str:
    """The address others use to reach a server bound to `host` (a wildcard means this host)."""
    return socket.getfqdn() if host in WILDCARDS else host
