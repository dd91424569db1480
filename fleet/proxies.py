"""Which peers' `X-Forwarded-*` headers uvicorn believes, for every uvicorn the fleet starts.

uvicorn's default believes them from loopback (`forwarded_allow_ips` "127.0.0.1,::1"), so on a
host where clients connect over loopback (`harvest up`, a local tunnel, a sidecar) any client
could name its own address in `X-Forwarded-For`, a fresh one per request, and the API's
per-address limit of requests without a valid key (`api.ratelimit.AddressLimiter`) would
never apply. Here headers are believed only from the proxies the operator names in
`HARVEST_TRUSTED_PROXIES` (`api.settings.ApiSettings.trusted_proxies`); with none named,
uvicorn reads no proxy header at all and the client address is the connection's peer.

    uvicorn_proxy_args(trusted)      uvicorn's flags (`python -m api.http_server` takes them too)
    uvicorn_proxy_options(trusted)   keyword arguments for `uvicorn.run` / `uvicorn.Config`
"""

from __future__ import annotations

__all__ = ["uvicorn_proxy_args", "uvicorn_proxy_options"]


def uvicorn_proxy_options(trusted: str) -> dict:
    """`proxy_headers` on, believed from `trusted` only (comma-separated addresses or networks),
    or off when `trusted` is empty."""
    if not trusted.strip():
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": trusted}


def uvicorn_proxy_args(trusted: str) -> list[str]:
    """The same as command-line flags (which also override a `FORWARDED_ALLOW_IPS` variable)."""
    options = uvicorn_proxy_options(trusted)
    if not options["proxy_headers"]:
        return ["--no-proxy-headers"]
    return ["--proxy-headers", "--forwarded-allow-ips", options["forwarded_allow_ips"]]
