"""The retention sweep: delete job files past their retention period.

A job's files (`<storage>/jobs/<id>/`) are kept `HARVEST_RETENTION_DAYS` (default 30) after
the job ended, then deleted. "Ended" is the manifest's `created_at` (written as the job
completed; the API counts retention from its `completed_at`, the same moment, and answers
`urls_expired: true` once it has passed or once the manifest is gone). A folder with no
manifest (a failed or cancelled job) is judged by its request.json's modification time, so its
partial shards do not stay for ever.

Runs as the scheduled deployment `retention-sweep/retention-sweep` (daily, infra/prefect.yaml)
and as `harvest sweep [--days N] [--dry-run]`. The API's records are left alone: it already
reports such jobs as expired.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timedelta, timezone

from prefect import flow, get_run_logger

from harvest.jobfiles import JobFiles
from harvest.settings import get_settings
from harvest.storage import Storage, open_storage

__all__ = ["expired_jobs", "sweep", "retention_sweep", "main"]


def _modified(files: JobFiles, name: str) -> datetime | None:
    try:
        stamp = files.storage.fs.modified(files.storage.path(name))
    except (FileNotFoundError, NotImplementedError, OSError):
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)


def _ended_at(files: JobFiles) -> datetime | None:
    if files.has_manifest():
        try:
            created = datetime.fromisoformat(files.read_manifest()["created_at"])
            return created if created.tzinfo else created.replace(tzinfo=timezone.utc)
        except (KeyError, ValueError):
            return _modified(files, JobFiles.MANIFEST)
    return _modified(files, JobFiles.REQUEST)


def expired_jobs(storage: Storage, days: float, now: datetime | None = None) -> list[str]:
    """Ids of jobs under `storage/jobs/` that ended more than `days` ago."""
    now = now or datetime.now(timezone.utc)
    cutoff = now - timedelta(days=days)
    expired = []
    for job_id in JobFiles.job_ids(storage):
        ended = _ended_at(JobFiles.for_job(job_id, storage))
        if ended is not None and ended < cutoff:
            expired.append(job_id)
    return expired


def sweep(storage: Storage, days: float, *, dry_run: bool = False, now: datetime | None = None) -> list[str]:
    """Delete the folders of jobs under `storage/jobs/` that ended more than `days` ago;
    returns their ids."""
    expired = expired_jobs(storage, days, now)
    if not dry_run:
        for job_id in expired:
            JobFiles.for_job(job_id, storage).delete()
    return expired


@flow(name="retention-sweep", persist_result=False)
def retention_sweep(days: float | None = None, dry_run: bool = False) -> dict:
    """Delete job files older than the retention period (HARVEST_RETENTION_DAYS by default)."""
    settings = get_settings()  # in this flow run's process: its own environment
    deleted = sweep(open_storage(settings), settings.retention_days if days is None else days, dry_run=dry_run)
    get_run_logger().info("%s %d expired job folder(s)", "would delete" if dry_run else "deleted", len(deleted))
    return {"deleted": deleted, "dry_run": dry_run}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harvest sweep", description="Delete job files past their retention period.")
    parser.add_argument("--days", type=float, help="retention in days (default HARVEST_RETENTION_DAYS, 30)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    args = parser.parse_args(argv[1:])
    settings = get_settings()
    deleted = sweep(open_storage(settings), settings.retention_days if args.days is None else args.days, dry_run=args.dry_run)
    for job_id in deleted:
        print(job_id)
    print(f"{'would delete' if args.dry_run else 'deleted'} {len(deleted)} expired job folder(s)")
    return 0
