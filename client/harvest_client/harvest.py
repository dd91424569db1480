"""A corpus of any size through the service: plan, submit as the caps allow, follow, download.

One `HarvestRun` drives one call of `Client.harvest`:

1. The plan (`harvest_client.plan.cut_parts`) is made once and kept in `<out>/harvest.json`
   with the corpus's fingerprint; a later call with the same arguments reads it back and
   picks up where the last one stopped (a different corpus or request into the same folder is
   refused rather than mixed in).
2. Parts are submitted in corpus order. A 429 is waited out: `Retry-After` when the answer has
   one, else until one of our jobs changes state (at most `_HOLD_S`); caps that no waiting can
   free (monthly job quota, token budget) end the call with the service's message. A 400 for
   too many tokens or a 413 splits the part in two. A job id is saved the moment the service
   answers, and each submit carries an `Idempotency-Key` made from the plan alone (corpus
   fingerprint, prompt range, attempt): a kill between the answer and the save submits again
   with the same key on the next call and gets the same job back, never a second one.
3. Each submitted job is followed by a thread that long-polls it (`?wait=`); its answers come
   to the main thread through one queue, which updates the single progress bar.
4. A done job's files go to the shared download pool (`harvest_client.download`); when all
   have verified, its manifest is written and the part is done. Failed or cancelled jobs are
   reported at the end and submitted again by the next call.

Ctrl-C stops the threads (downloads mid-chunk keep their `.partial` files), saves the state
and re-raises: calling again resumes. Jobs already submitted keep running on the service.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from harvest_client.api import TERMINAL, HarvestApi
from harvest_client.download import Downloader, JobDownload
from harvest_client.errors import ApiError, FolderError, HarvestFailed
from harvest_client.folder import MANIFEST, DatasetFolder, HarvestState, PartState, write_index
from harvest_client.plan import JobSpec, cut_parts, too_many_tokens

__all__ = ["HarvestSummary", "HarvestFailed", "HarvestRun"]

_HOLD_S = 5.0
"""Longest wait before submitting again after a 429 without Retry-After."""
_FATAL_429 = ("harvest_quota_exceeded", "budget_exceeded", "storage_quota_exceeded")
"""Caps that only a new month, the end of a job's retention (days) or an operator frees:
waiting would be for ever."""


@dataclass
class HarvestSummary:
    out: Path
    n_prompts: int
    jobs: int
    """Jobs the corpus took (all of them, this call or earlier ones)."""
    job_ids: list[str]
    tokens: int
    """Token positions in the files, start tokens included (the manifests' `tokens`)."""
    bytes: int
    """Bytes of the dataset's files on disk (shards, stats, manifests)."""
    seconds: float
    """Wall time of this call."""
    jobs_submitted: int = 0
    """Jobs this call submitted (0 when it only resumed finished work)."""
    files_downloaded: int = 0
    bytes_downloaded: int = 0
    """Fetched over the network by this call."""


@dataclass
class _Followed:
    part: PartState
    latest: dict
    stop: threading.Event = field(default_factory=threading.Event)


class HarvestRun:
    def __init__(self, api: HarvestApi, prompts: list[str], spec: JobSpec, out, *, max_prompts: int,
                 download_workers: int = 8, poll_s: float = 10.0, progress: bool = True):
        self.api = api
        self.prompts = prompts
        self.spec = spec
        self.folder = DatasetFolder(out)
        self.max_prompts = max_prompts
        self.poll_s = poll_s
        self.events: queue.Queue = queue.Queue()
        self.followed: dict[str, _Followed] = {}  # job id → its part and latest harvest object
        self.downloads: dict[str, tuple[PartState, JobDownload]] = {}
        self.failures: list[str] = []
        self.hold_until = 0.0
        self.submitted = 0
        self.files = 0
        self.fetched = 0
        self._bytes_lock = threading.Lock()
        self.downloader = Downloader(api.get, workers=download_workers, api_base=api.base, on_bytes=self._count_bytes)
        # Plain tqdm (not tqdm.auto): in a notebook without ipywidgets it prints the same text.
        self.bar = tqdm(total=len(prompts), unit="prompt", desc="harvest", disable=not progress, dynamic_ncols=True)
        self._shown: tuple | None = None

    # --- state ------------------------------------------------------------------------------
    def _load_or_plan(self) -> HarvestState:
        fingerprint = self.spec.fingerprint(self.prompts)
        state = self.folder.load_state()
        if state is not None:
            if state.fingerprint != fingerprint:
                raise FolderError(f"{self.folder.root} holds another harvest (other prompts or request fields); "
                                 "use a new folder, or the same arguments to resume that one.")
            return state
        if self.folder.root.exists() and any(self.folder.root.iterdir()):
            raise FolderError(f"{self.folder.root} is not empty and holds no harvest; use a new folder.")
        parts = [PartState(a, b) for a, b in cut_parts(self.prompts, self.spec, max_prompts=self.max_prompts)]
        state = HarvestState(fingerprint, len(self.prompts), self.spec.body([]), parts)
        self.folder.save_state(state)
        return state

    def _save(self) -> None:
        self.folder.save_state(self.state)

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> HarvestSummary:
        started = time.monotonic()
        self.state = self._load_or_plan()
        try:
            self._reattach()
            self._show_progress()
            while not all(p.status in ("done", "failed") for p in self.state.parts):
                self._submit_what_fits()
                self._take_events(self._wait_s())
                self._finish_downloads()
                self._show_progress()
        except BaseException:
            self._stop(cancel=True)
            self._save()
            if sys.exc_info()[0] is KeyboardInterrupt:
                print(f"\nInterrupted. {self.folder.root} is resumable: call again with the same arguments.", file=sys.stderr)
            raise
        self._show_progress()
        self._stop(cancel=False)
        if self.failures:
            for part in self.state.parts:
                if part.status == "failed":
                    part.status, part.job_id = "planned", None  # the next call submits it again
                    part.attempt += 1  # as a new job: a new idempotency key
            self._save()
            raise HarvestFailed("Some jobs did not finish (call again to submit them again):\n  " + "\n  ".join(self.failures))
        write_index(self.folder, self.state)
        return self._summary(time.monotonic() - started)

    def _stop(self, cancel: bool) -> None:
        for followed in self.followed.values():
            followed.stop.set()
        self.downloader.close(cancel=cancel)
        self.bar.close()

    def _wait_s(self) -> float:
        if self.downloads:
            return 0.2
        if self.hold_until > time.monotonic():
            return max(0.05, self.hold_until - time.monotonic())
        return 1.0

    # --- resuming ---------------------------------------------------------------------------
    def _reattach(self) -> None:
        """Parts of an earlier call: complete folders are done; submitted jobs are followed again."""
        for part in self.state.parts:
            if self.folder.part_complete(part):
                part.status = "done"
            elif part.status == "failed":  # its job ended badly: a new one
                part.status, part.job_id = "planned", None
                part.attempt += 1
            elif part.status == "done":  # marked done but its folder is not complete: fetch it again
                part.status = "submitted"
            if part.status == "submitted":
                self._follow(part, {"job_id": part.job_id, "status": "pending"})
        self._save()

    # --- submitting -------------------------------------------------------------------------
    def _next_planned(self) -> PartState | None:
        return next((p for p in self.state.parts if p.status == "planned"), None)

    def _submit_what_fits(self) -> None:
        while (part := self._next_planned()) is not None and time.monotonic() >= self.hold_until:
            body = self.spec.body(self.prompts[part.start : part.stop])
            try:
                harvest = self.api.submit(body, idempotency_key=self.folder.idempotency_key(self.state, part))
            except ApiError as error:
                if error.status == 429:
                    if error.code in _FATAL_429:
                        raise
                    self.hold_until = time.monotonic() + (error.retry_after if error.retry_after is not None else _HOLD_S)
                    return
                if error.status == 413 or too_many_tokens(error.status, error.param, error.message):
                    self._split(part, error)
                    continue
                raise
            part.job_id, part.status = harvest["job_id"], "submitted"
            self._save()  # the id is on disk before anything else happens
            self.submitted += 1
            self._follow(part, harvest)

    def _split(self, part: PartState, error: ApiError) -> None:
        if part.n_prompts == 1:
            raise error
        middle = part.start + part.n_prompts // 2
        at = self.state.parts.index(part)
        self.state.parts[at : at + 1] = [PartState(part.start, middle), PartState(middle, part.stop)]
        self._save()

    # --- following --------------------------------------------------------------------------
    def _follow(self, part: PartState, harvest: dict) -> None:
        followed = _Followed(part, harvest)
        self.followed[part.job_id] = followed
        threading.Thread(target=self._poll, args=(followed,), daemon=True, name=f"poll-{part.job_id[:8]}").start()

    def _poll(self, followed: _Followed) -> None:
        """Long-poll one job until it ends; every answer goes to the main thread."""
        job_id = followed.part.job_id
        try:
            while not followed.stop.is_set():
                answer = self.api.read(job_id, wait=self.poll_s)
                self.events.put((job_id, answer.harvest))
                if answer.harvest["status"] in TERMINAL:
                    return
                if answer.declined_retry_after:  # too many waiters on the service: come back later
                    followed.stop.wait(answer.declined_retry_after)
        except BaseException as exc:  # handed to the main thread, which decides
            self.events.put((job_id, exc))

    def _take_events(self, timeout: float) -> None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            job_id, harvest = event
            if isinstance(harvest, BaseException):
                raise harvest
            self._on_harvest(job_id, harvest)
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return

    def _on_harvest(self, job_id: str, harvest: dict) -> None:
        followed = self.followed.get(job_id)
        if followed is None:
            return
        followed.latest = harvest
        status = harvest["status"]
        if status in TERMINAL:
            self.hold_until = 0.0  # a slot of ours is free: try the next part now
            del self.followed[job_id]
        if status == "done":
            self.downloads[job_id] = (followed.part, self.downloader.start(harvest, self.folder.part_dir(followed.part)))
        elif status in ("failed", "cancelled"):
            followed.part.status = "failed"
            followed.part.error = f"{status}: {harvest.get('error')}"
            self.failures.append(f"{followed.part.name} (job {job_id}) {status}: {harvest.get('error')}")
            self._save()

    # --- downloading ------------------------------------------------------------------------
    def _count_bytes(self, n: int) -> None:
        with self._bytes_lock:
            self.fetched += n

    def _finish_downloads(self) -> None:
        for job_id, (part, download) in list(self.downloads.items()):
            if download.done():
                download.finish()  # raises a file's error; writes the manifest last
                self.files += len(download.futures)
                part.status = "done"
                self._save()
                del self.downloads[job_id]

    def _show_progress(self) -> None:
        shard_size = self.spec.shard_size
        harvested = 0
        for part in self.state.parts:
            if part.status == "done":
                harvested += part.n_prompts
        for followed in self.followed.values():
            shards_done = (followed.latest.get("progress") or {}).get("shards_done", 0)
            harvested += min(shards_done * shard_size, followed.part.n_prompts)
        for part, _ in self.downloads.values():
            harvested += part.n_prompts
        done = sum(p.status == "done" for p in self.state.parts)
        shown = (harvested, done, len(self.followed), len(self.downloads))
        if shown == self._shown:  # redraw on change only: a log or notebook gets a line per step
            return
        self._shown = shown
        self.bar.n = harvested
        self.bar.set_postfix_str(f"jobs {done}/{len(self.state.parts)} done, {len(self.followed)} running, "
                                 f"{len(self.downloads)} downloading", refresh=False)
        self.bar.refresh()

    def _summary(self, seconds: float) -> HarvestSummary:
        tokens, size = 0, 0
        for part in self.state.parts:
            folder = self.folder.part_dir(part)
            tokens += json.loads((folder / MANIFEST).read_text())["tokens"]
            size += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return HarvestSummary(
            out=self.folder.root, n_prompts=len(self.prompts), jobs=len(self.state.parts),
            job_ids=[p.job_id for p in self.state.parts], tokens=tokens, bytes=size, seconds=seconds,
            jobs_submitted=self.submitted, files_downloaded=self.files, bytes_downloaded=self.fetched,
        )
