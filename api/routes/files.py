"""The file route behind local-storage download links: `GET /v1/files/{job_id}/{name}`.

It needs no API key: the link's HMAC signature and expiry are the credential (`api.links`).
Expired, altered, foreign or malformed links get 403 (an expiry or signature that is not the
ASCII digits and hex this API writes is refused before anything reads it); a valid link to a
file the retention sweep removed gets 404.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from api.deps import Files, Signer
from api.errors import FileGone, LinkRefused
from api.openapi import errors
from harvest.jobfiles import JobFiles

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["files"])

# What `api.links.sign` writes: unix seconds and a hex HMAC-SHA256. Spelled [0-9], not `\d` nor
# str.isdigit(), which also take digits of other scripts (`²`, `٣`) that int() refuses.
EXPIRES = re.compile(r"[0-9]{1,12}")
SIGNATURE = re.compile(r"[0-9a-f]{64}")


_FILE = {
    200: {
        "description": "The file: safetensors (`application/octet-stream`) or the manifest (`application/json`).",
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "application/json": {"schema": {"type": "object"}},
        },
    },
}


@router.get("/files/{job_id}/{name}", response_class=FileResponse, responses={**_FILE, **errors(403, 404)})
def download(
    job_id: str, name: str, storage: Files, signer: Signer,
    expires: Annotated[str | None, Query()] = None, signature: Annotated[str | None, Query()] = None,
):
    """A job's result file, for a signed unexpired link."""
    if not (expires and EXPIRES.fullmatch(expires) and signature and SIGNATURE.fullmatch(signature)):
        raise LinkRefused("This download link is not valid.")
    signer.verify(job_id, name, expires, signature)
    files = JobFiles.for_job(job_id, storage).storage
    if not files.is_local:
        raise FileGone("This store serves its own presigned links.")
    if not files.exists(name):
        raise FileGone(f"The file {name} of harvest {job_id} no longer exists.")
    media = "application/json" if name.endswith(".json") else "application/octet-stream"
    return FileResponse(files.path(name), media_type=media, filename=name)
