"""The file route behind local-storage download links: `GET /v1/files/{job_id}/{name}`.

It needs no API key: the link's HMAC signature and expiry are the credential (`api.links`).
Expired, altered or foreign links get 403; a valid link to a file the retention sweep removed
gets 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from api import deps
from api.links import verify
from harvest.errors import NotFound
from harvest.jobfiles import JobFiles

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["files"])


@router.get("/files/{job_id}/{name}", response_class=FileResponse)
def download(job_id: str, name: str, expires: str | None = Query(None), signature: str | None = Query(None)):
    """A job's result file, for a signed unexpired link."""
    verify(job_id, name, expires, signature)
    files = JobFiles.for_job(job_id, deps.storage()).storage
    if not files.is_local:
        raise NotFound("This store serves its own presigned links.", code="file_not_found")
    if not files.exists(name):
        raise NotFound(f"The file {name} of harvest {job_id} no longer exists.", code="file_not_found")
    media = "application/json" if name.endswith(".json") else "application/octet-stream"
    return FileResponse(files.path(name), media_type=media, filename=name)
