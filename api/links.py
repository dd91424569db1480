"""Download links that need no API key: presigned, expiring, fresh enough on every read.

On `s3://` storage the store signs them itself (SigV4 presigned GET, `X-Amz-Expires`). On the
local file store the API signs `/v1/files/{job_id}/{name}?expires=…&signature=…` with HMAC-SHA256
over the job id, the file name and the expiry, and serves the file only when the signature
matches and the expiry has not passed (403 otherwise). Only a canonical job id and the job's
own result files can be named (`harvest.jobfiles.RESULT_FILE`), so no link reaches outside the
job's prefix, even one this API signed.

A done job's links are signed once and handed out again for a while (`LinkCache`): a job of
4,096 shards has 4,098 links, and signing them on S3 cost about 0.75 s of CPU on every read (a
client polling a job, or many downloading it, paid that again and again). A link a read hands
out was signed at most `REUSE_MAX_S` (5 minutes, or a tenth of `url_expiry_s` if that is less)
before it, so it works for at least `url_expiry_s` less that after the read (or, as a freshly
signed one would, to the end of the files' retention), and `urls_expire_at` is its own expiry:
each read's links are fresh to within minutes, which is what a client reading again for new
links needs.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import urlencode

from api.errors import LinkRefused
from api.settings import ApiSettings
from harvest.jobfiles import RESULT_FILE, JobFiles
from harvest.private_files import write_private
from harvest.storage import Storage

__all__ = ["LinkRefused", "signing_key", "LinkSigner", "JobLinks", "LinkCache", "Signed", "REUSE_MAX_S"]

REUSE_MAX_S = 300
"""The longest a replica hands a signed link out again (module docstring)."""


def signing_key(settings: ApiSettings) -> bytes:
    """HARVEST_SIGNING_SECRET, or a random secret kept in `<home>/signing.key` across restarts."""
    if settings.signing_secret:
        return settings.signing_secret.encode()
    path = settings.home / "signing.key"
    if not path.exists():
        # Whoever reads this key can forge links to every job's files: owner-only from birth.
        # Two processes starting together both try; the first file stays, and both read it.
        write_private(path, secrets.token_hex(32), replace=False)
    return path.read_text().strip().encode()


def _is_job_id(job_id: str) -> bool:
    """A job id as the API makes them (a canonical uuid): never `..` nor anything with a
    separator, so a signed link cannot name a path outside its job's folder."""
    try:
        return str(uuid.UUID(job_id)) == job_id
    except ValueError:
        return False


class LinkSigner:
    """Signs and checks one replica's download links: HMAC-SHA256 with `secret` for the file
    route of local storage, S3's own presigning (against `s3_endpoint_url`) for `s3://`."""

    def __init__(self, secret: bytes, s3_endpoint_url: str | None = None):
        self._secret = secret
        self.s3_endpoint_url = s3_endpoint_url

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> "LinkSigner":
        return cls(signing_key(settings), settings.s3_endpoint_url)

    def mac(self, job_id: str, name: str, expires: int) -> str:
        return hmac.new(self._secret, f"{job_id}/{name}:{expires}".encode(), hashlib.sha256).hexdigest()

    def sign(self, base_url: str, job_id: str, name: str, expires: int) -> str:
        """The file route's URL for this file, valid until `expires` (unix seconds)."""
        query = urlencode({"expires": expires, "signature": self.mac(job_id, name, expires)})
        return f"{base_url.rstrip('/')}/v1/files/{job_id}/{name}?{query}"

    def verify(self, job_id: str, name: str, expires: str | None, signature: str | None) -> None:
        """Raise 403 unless the link is intact, unexpired and names one of the job's files."""
        if not _is_job_id(job_id) or not RESULT_FILE.match(name) or expires is None or signature is None or not expires.isdigit():
            raise LinkRefused("This download link is not valid.")
        if not hmac.compare_digest(self.mac(job_id, name, int(expires)), signature):
            raise LinkRefused("This download link is not valid: its signature does not match.")
        if int(expires) < time.time():
            raise LinkRefused("This download link has expired. Read the harvest again for fresh links.")

    def presign(self, storage: Storage, job_id: str, name: str, expires: int, base_url: str) -> str:
        """A link to `jobs/<job_id>/<name>` that works without a key until `expires`."""
        if storage.is_local:
            return self.sign(base_url, job_id, name, expires)
        if storage.url.startswith("s3://"):
            bucket, _, key = JobFiles.for_job(job_id, storage).storage.path(name).partition("/")
            seconds = max(int(expires - time.time()), 1)
            return self._s3_client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=seconds
            )
        # Any other fsspec store that can sign (gcs, az) does it itself.
        return storage.fs.sign(JobFiles.for_job(job_id, storage).storage.path(name), expiration=int(expires - time.time()))

    @cached_property
    def _s3_client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.s3_endpoint_url, config=Config(signature_version="s3v4"))


Signed = tuple[int, dict]
"""A job's links as `render` signs them: their expiry (unix seconds) and the result's link fields."""


class LinkCache:
    """The links this replica signed for done jobs, reused for `reuse_s` after signing (the
    module docstring says what that promises), at most `max_links` links held, the least
    recently read job's dropped first. Its callers (`api.schemas.render`) ask it only for a
    done job that the reading key may see (its row read under that key), within retention and
    with its files still there, so a cancelled, failed, swept or foreign job never gets links
    from it. Used from worker threads, hence the lock; two first reads of a job at once both
    sign, and the later one is kept."""

    def __init__(self, reuse_s: float, max_links: int = 1 << 15):
        self.reuse_s = reuse_s
        self.max_links = max_links
        """~40 MB of presigned S3 links (about 600 characters each) at most."""
        self.held = 0
        self._entries: OrderedDict[tuple[str, str], tuple[float, Signed, int]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings) -> "LinkCache":
        return cls(reuse_s=min(REUSE_MAX_S, settings.url_expiry_s / 10))

    def links(self, job_id: str, base_url: str, sign: Callable[[], Signed], now: float | None = None) -> Signed:
        """The job's links signed less than `reuse_s` ago (and not yet expired), or `sign()`'s."""
        now = time.time() if now is None else now
        key = (job_id, base_url)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and now < entry[0] + self.reuse_s and now < entry[1][0]:
                self._entries.move_to_end(key)
                return entry[1]
        signed = sign()
        size = len(signed[1].get("shard_urls") or ()) + 2
        with self._lock:
            self._drop(key)
            if self.reuse_s > 0 and size <= self.max_links:
                self._entries[key] = (now, signed, size)
                self.held += size
                while self.held > self.max_links:
                    self._drop(next(iter(self._entries)))
        return signed

    def forget(self, job_id: str) -> None:
        """Drop the job's links (its files are gone, or its links expired)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == job_id]:
                self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.held -= entry[2]


@dataclass(frozen=True)
class JobLinks:
    """What a route needs to hand out a done job's links: where they point (`base_url`, per
    request: `api.deps.base_url`), who signs them, how long they last (`expiry_s`, and never
    past `retention_days` after the job ended), and the replica's links signed before."""

    base_url: str
    signer: LinkSigner
    expiry_s: int
    retention_days: int
    cache: LinkCache
