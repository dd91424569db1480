"""`Client`: the researcher's entry point to the service (harvest a corpus, fetch one job)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from harvest_client.api import TERMINAL, HarvestApi
from harvest_client.corpus import read_corpus
from harvest_client.download import Downloader
from harvest_client.errors import HarvestFailed
from harvest_client.folder import MANIFEST
from harvest_client.harvest import HarvestRun, HarvestSummary
from harvest_client.plan import MAX_PROMPTS, JobSpec, encode_directions

__all__ = ["Client"]


class Client:
    """The service at `ACS_API_BASE` with the key `ACS_API_KEY` (or the arguments)."""

    def __init__(self, api_base: str | None = None, api_key: str | None = None, *, timeout: float = 120.0):
        self.api = HarvestApi(api_base, api_key, timeout=timeout)

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def harvest(
        self,
        model: str,
        prompts: str | os.PathLike | Iterable[str],
        out: str | os.PathLike,
        *,
        layers: list[int] | str | None = None,
        project_onto=None,
        add_special_tokens: bool = True,
        shard_size: int = 32,
        column: str = "text",
        max_prompts_per_job: int = MAX_PROMPTS,
        download_workers: int = 8,
        poll_s: float = 10.0,
        progress: bool = True,
    ) -> HarvestSummary:
        """Harvest every prompt of a corpus into the dataset folder `out`; returns a summary.

        prompts: a list or any iterable of strings, or a `.jsonl`/`.txt`/`.parquet` path or
            fsspec URL (`column`: the field or column holding the text).
        layers: block indices, "all", or None for the service's quartile default.
        project_onto: an array `[n_directions, hidden]` (or a ready `project_onto` object):
            the files then hold float32 projections onto the unit directions.
        max_prompts_per_job: cut the corpus into jobs of at most this many prompts (≤ 4096).
        download_workers: files downloaded at once.
        poll_s: long-poll window (`?wait=`) of each job's follower; a status change answers at
            once, and the bar's shard progress is refreshed at least this often.

        Calling again with the same arguments and folder resumes: nothing finished is
        submitted or downloaded again. Ctrl-C leaves the folder resumable.
        """
        texts = read_corpus(prompts, column=column)
        if project_onto is not None and not isinstance(project_onto, dict):
            project_onto = encode_directions(project_onto)
        spec = JobSpec(model, layers, shard_size, add_special_tokens, project_onto)
        run = HarvestRun(self.api, texts, spec, out, max_prompts=max_prompts_per_job,
                         download_workers=download_workers, poll_s=poll_s, progress=progress)
        return run.run()

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 30.0) -> dict:
        """Long-poll a job until it ends (or `timeout` seconds); returns the harvest object."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            answer = self.api.read(job_id, wait=poll_s)
            if answer.harvest["status"] in TERMINAL:
                return answer.harvest
            if deadline is not None and time.monotonic() > deadline:
                return answer.harvest
            if answer.declined_retry_after:
                time.sleep(answer.declined_retry_after)

    def download(self, job_id: str, out: str | os.PathLike, *, workers: int = 8) -> Path:
        """Fetch one job's files into `out` (waiting for it to end), verified; resumable.
        The manifest is written last, so `out` reads as a complete job only once it is."""
        out = Path(out)
        if (out / MANIFEST).exists():
            return out
        harvest = self.wait(job_id)
        if harvest["status"] != "done":
            raise HarvestFailed(f"Job {job_id} ended {harvest['status']}: {harvest.get('error')}")
        downloader = Downloader(self.api.get, workers=workers, api_base=self.api.base)
        try:
            downloader.start(harvest, out).finish()
        finally:
            downloader.close(cancel=True)
        return out

    def jobs(self) -> list[dict]:
        """This key's harvests, newest first."""
        return self.api.list()

    def cancel(self, job_id: str) -> dict:
        return self.api.cancel(job_id)
