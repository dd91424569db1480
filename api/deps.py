"""What the routes share, as typed dependencies: the app's settings, the job store, the
registry, the storage, the run store, the watcher, the links a read hands out, and the body
reader with its cap (`api.guard`). A body is validated where it is assessed, in a child
process that imports none of this module's web and SQL stack (`harvest.errors.validate_body`).

The app's parts live on `app.state`, put there by its factory (`api.app.create_app`) and by
nothing else; a route names what it needs as a parameter (`runs: Runs`, `storage: Files`)
and never builds or looks one up itself.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.db import JobStore
from api.guard import INLINE_MAX_BODY_BYTES, MAX_HARVEST_BODY_BYTES, too_large
from api.links import JobLinks, LinkSigner
from api.runs import RunStore
from api.settings import ApiSettings
from api.watcher import Watcher
from harvest.registry import Registry
from harvest.storage import Storage

__all__ = [
    "MAX_BODY_BYTES",
    "INLINE_MAX_BODY_BYTES",
    "AppSettings",
    "Store",
    "Models",
    "Files",
    "Runs",
    "JobWatcher",
    "Links",
    "Signer",
    "settings",
    "store",
    "registry",
    "storage",
    "runs",
    "watcher",
    "base_url",
    "job_links",
    "read_body",
]

MAX_BODY_BYTES = MAX_HARVEST_BODY_BYTES


# async: a plain `def` dependency would cost each request a worker-thread hop to read an attribute.
async def settings(request: Request) -> ApiSettings:
    """The settings the app was made with (`api.app.create_app(settings=…)`)."""
    return request.app.state.settings


async def store(request: Request) -> JobStore:
    """The job store the app was made with (`api.app.create_app(store=…)`)."""
    return request.app.state.store


async def registry(request: Request) -> Registry:
    """The app's model registry."""
    return request.app.state.registry


async def storage(request: Request) -> Storage:
    """The app's storage root (job files)."""
    return request.app.state.storage


async def runs(request: Request) -> RunStore:
    """The app's run store (Prefect flow runs in production)."""
    return request.app.state.runs


async def watcher(request: Request) -> Watcher:
    """The app's one watcher (made by its lifespan)."""
    return request.app.state.watcher


async def link_signer(request: Request) -> LinkSigner:
    """Who signs and checks this replica's download links."""
    return request.app.state.link_signer


async def job_links(request: Request) -> JobLinks:
    """What this request hands out done jobs' links with: pointing at `base_url`, signed by
    the replica's signer, lasting the settings' expiry, reused from the replica's cache."""
    state = request.app.state
    return JobLinks(base_url(request, state.settings), state.link_signer, state.settings.url_expiry_s,
                    state.settings.retention_days, state.link_cache)


AppSettings = Annotated[ApiSettings, Depends(settings)]
Store = Annotated[JobStore, Depends(store)]
Models = Annotated[Registry, Depends(registry)]
Files = Annotated[Storage, Depends(storage)]
Runs = Annotated[RunStore, Depends(runs)]
JobWatcher = Annotated[Watcher, Depends(watcher)]
Links = Annotated[JobLinks, Depends(job_links)]
Signer = Annotated[LinkSigner, Depends(link_signer)]


def base_url(request: Request, settings: ApiSettings) -> str:
    """Where links to the API's own file route point.

    HARVEST_PUBLIC_BASE_URL when set (behind a proxy or load balancer); else the request's Host
    header only if HARVEST_TRUST_HOST_HEADER says a proxy in front sets it; else this replica's
    own address. Never the client's Host by default: a client could otherwise make the API hand
    out links (with valid signatures) that point at a host of its choosing.
    """
    if settings.public_base_url:
        return settings.public_base_url.rstrip("/")
    if settings.trust_host_header:
        return str(request.base_url).rstrip("/")
    from harvest.addresses import local_address

    host = local_address(settings.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, advice: str = "Split the prompts into several jobs.") -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` bytes (never
    read whole first: a huge body would hold the process's memory and time)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, advice)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit, advice)
        chunks.append(chunk)
    return b"".join(chunks)


