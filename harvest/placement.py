"""Placement: a worker host's slots, the claim a run takes on one, and how far a job spreads.

A *slot* is what one flow run on a host gets. On a GPU host it is a group of GPUs
(`harvest worker --gpus 0,1,2,3 --gpus-per-run 2` → slots `[0,1]` and `[2,3]`; by default all
visible GPUs, one slot per `gpus_per_run` of the lane); on a CPU host it is only a place
(`--slots N`). The host's Prefect worker runs with `--limit <number of slots>`, so Prefect never
hands it more concurrent runs than it has slots, and the slot table reaches the host's flow
runs through their inherited environment (`HARVEST_SLOTS`, `Settings.slots`).

Each run then claims one free slot with an exclusive, non-blocking `flock` on files under
`$HARVEST_HOME/slots/` (the host's own scratch): one file per GPU (`gpu-<id>.lock`: the GPU is
the resource, whichever lane's worker of the machine wants it) and one per CPU slot of a lane
(`<lane>-cpu-<k>.lock`). The kernel drops a flock when its process dies, SIGKILL included, so
there are no stale claims and no pid table. A claim lasts the process's life, because CUDA
reads `CUDA_VISIBLE_DEVICES` once, when it initialises: the run sets it to its slot's GPUs
before anything touches CUDA, and a second job in the same process (a corpus refresh's parts)
keeps the same GPUs.

Which slot first (`warm_first`): a slot whose GPU group's engine server already holds the job's
model (`harvest.warm`), so the job starts warm; `place_run` is a run's whole placement.

How far a job spreads (`auto_workers`): one run more per free slot of the lane, but never so
many that a run gets fewer than `min_shards` shards (each run loads the model once); its shards
cut into that many contiguous ranges (`split_ranges`), and what the run that keeps the first
does about each helper run on each look (`helper_action`). This module is core (no Prefect):
the flows read a lane's free slots and the helpers' states from Prefect and hand them here
(`flows.placement`, `flows.scale_out`: the Prefect side of placement, nothing decided there).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harvest.errors import ModelUnavailable
from harvest.registry import ModelInfo
from harvest.settings import Settings

__all__ = [
    "Claim",
    "visible_gpus",
    "parse_gpus",
    "host_slots",
    "describe_slots",
    "check_fits",
    "try_claim",
    "claim",
    "what_the_run_sees",
    "groups_holding",
    "warm_first",
    "place_run",
    "free_slots",
    "auto_workers",
    "split_ranges",
    "helper_action", "WAIT", "COLLECT", "RECOMPUTE", "TAKE_OVER",
]

# A claim is held until the process exits (see the module docstring); this is it.
_HELD: "Claim | None" = None


@dataclass(frozen=True)
class Claim:
    """The slot this process holds."""

    slot: int
    """Index of the slot in the host's table."""
    devices: tuple[str, ...]
    """Its GPUs (physical ids or UUIDs, as CUDA_VISIBLE_DEVICES takes them); empty on a CPU slot."""
    fds: tuple[int, ...]
    """The open, locked files: closing them (or exiting) releases the slot."""

    def as_dict(self) -> dict:
        """What the run got, for its summary and labels."""
        return {"slot": self.slot, "devices": ",".join(self.devices)}


def parse_gpus(text: str | None) -> list[str] | None:
    """`"0,1, 2"` → `["0", "1", "2"]`; None or "" → None (not given). `-1` alone means no GPU."""
    if text is None or not text.strip():
        return None
    ids = [part.strip() for part in text.split(",") if part.strip()]
    return [] if ids == ["-1"] else ids


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this host may use: CUDA_VISIBLE_DEVICES when set, else one per line of
    `nvidia-smi -L`, else none (a CPU host)."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return parse_gpus(environ["CUDA_VISIBLE_DEVICES"]) or []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def host_slots(gpus: list[str] | None, gpus_per_run: int = 1, slots: int | None = None) -> list[list[str]]:
    """A host's slot table.

    gpus: the host's GPUs (None: `visible_gpus()`). gpus_per_run: GPUs in one slot (the lane's).
    slots: a declared count of slots without devices (a CPU host); excludes `gpus`.
    GPUs left over after the last full group stay unused; a host with fewer GPUs than one group
    gets one slot of all of them, so a one-GPU box still serves every lane, and a model that
    needs more (`tensor_parallel_size`) fails clearly when it is placed (`check_fits`).
    """
    if slots is not None:
        if gpus:
            raise ValueError("give either GPUs or a slot count, not both")
        if slots < 1:
            raise ValueError(f"a host needs at least one slot, not {slots}")
        return [[] for _ in range(slots)]
    if gpus_per_run < 1:
        raise ValueError(f"gpus_per_run must be at least 1, not {gpus_per_run}")
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return [[]]
    if len(gpus) < gpus_per_run:
        return [list(gpus)]
    return [list(gpus[i : i + gpus_per_run]) for i in range(0, len(gpus) - gpus_per_run + 1, gpus_per_run)]


def describe_slots(table: list[list[str]]) -> str:
    """`2 slots: GPUs 0,1 | GPUs 2,3` or `2 slots (no GPUs)`, for ready lines and logs."""
    if all(not devices for devices in table):
        return f"{len(table)} slot{'s' * (len(table) != 1)} (no GPUs)"
    return f"{len(table)} slot{'s' * (len(table) != 1)}: " + " | ".join("GPUs " + ",".join(d) for d in table)


def check_fits(model_name: str, tensor_parallel_size: int, table: list[list[str]]) -> None:
    """Refuse a model whose tensor-parallel size is more GPUs than any slot of this host has.

    CPU slots (no devices) take any model: there is no GPU to split it over.
    """
    sizes = [len(devices) for devices in table if devices]
    if sizes and tensor_parallel_size > max(sizes):
        raise ModelUnavailable(
            f"{model_name} runs on {tensor_parallel_size} GPUs (tensor_parallel_size) but this host's slots have "
            f"{max(sizes)} ({describe_slots(table)}): start the lane's hosts with --gpus-per-run {tensor_parallel_size}."
        )


def _lock_name(lane: str, slot: int, device: str | None) -> str:
    if device is None:
        return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', lane)}-cpu-{slot}.lock"
    return f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}.lock"


def _lock(path: Path) -> int | None:
    """The fd of `path` locked exclusively, or None when someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # Who holds it, for an operator looking at the folder (the lock, not this text, is the truth).
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {' '.join(sys.argv)[:200]}\n".encode())
    return fd


def try_claim(table: list[list[str]], lock_dir: Path, lane: str, order: list[int] | None = None) -> Claim | None:
    """Claim the first slot whose every lock is free, for the rest of this process's life;
    `order`: the slots to try, best first (default the table's order).

    Idempotent: a process that holds a slot gets the same one again. Returns None when every
    slot is taken (the caller waits and tries again). Never blocks, so it cannot deadlock.
    """
    global _HELD
    if _HELD is not None:
        return _HELD
    lock_dir.mkdir(parents=True, exist_ok=True)
    for k in order if order is not None else range(len(table)):
        devices = table[k]
        names = [_lock_name(lane, k, d) for d in devices] or [_lock_name(lane, k, None)]
        fds: list[int] = []
        for name in names:
            fd = _lock(lock_dir / name)
            if fd is None:
                break
            fds.append(fd)
        if len(fds) == len(names):
            _HELD = Claim(slot=k, devices=tuple(devices), fds=tuple(fds))
            return _HELD
        for fd in fds:  # part of the slot is busy: let go of the rest and try the next one
            os.close(fd)
    return None


def claim(table: list[list[str]], lock_dir: Path, lane: str, *, on_wait=None, poll_s: float = 1.0, order: list[int] | None = None) -> Claim:
    """Claim a slot (waiting while every one is taken) and point CUDA at its GPUs.

    A run normally finds a slot at once: its worker's `--limit` is the slot count. It waits
    only while a process that outlived its run (an orphan of a dead worker, another lane's run
    on the same GPUs) still holds one; a cancel's SIGTERM ends the wait like any other.
    `on_wait()` is called once, when the wait begins. `order`: as `try_claim`'s.
    """
    held = try_claim(table, lock_dir, lane, order)
    while held is None:
        if on_wait is not None:
            on_wait()
            on_wait = None
        time.sleep(poll_s)
        held = try_claim(table, lock_dir, lane, order)
    if held.devices:
        _point_cuda_at(held.devices)
    return held


def _point_cuda_at(devices: tuple[str, ...]) -> None:
    """CUDA_VISIBLE_DEVICES = the slot's GPUs, numbered as nvidia-smi numbers them."""
    wanted = ",".join(devices)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != wanted:
        # Too late: CUDA read the variable when it initialised, and would use other GPUs.
        raise RuntimeError(f"CUDA was initialised before this run claimed GPUs {wanted}")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # ids as nvidia-smi -L lists them
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted


def what_the_run_sees(held: Claim) -> dict:
    """The slot, and the devices as this process now sees them (CUDA_VISIBLE_DEVICES, and the
    number of GPUs torch finds), for the run's summary and labels."""
    seen = {**held.as_dict(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        import torch

        seen["gpus_seen"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver must not hide what the run was given
        seen["gpus_seen"] = None
    return seen


def groups_holding(home: Path, model_name: str, groups: set[str]) -> set[str]:
    """Which of `groups` has an engine server with `model_name` loaded now (asks each running
    server; starts nothing)."""
    # Imported here: the warm-engine client brings torch, which a host role reading its slot
    # table has no use for.
    from harvest.warm.client import engine_status

    holding = set()
    for group in groups:
        status = engine_status(home, group)
        if status is not None and any(entry["key"][0] == model_name for entry in status["loaded"]):
            holding.add(group)
    return holding


def warm_first(model: ModelInfo, settings: Settings) -> list[int]:
    """The host's slots, those whose GPU group's engine server holds `model` first (a free one
    of them starts the job warm), then the rest, each in table order."""
    from harvest.warm.protocol import group_name

    groups = [group_name(",".join(devices)) for devices in settings.slots]
    warm = groups_holding(settings.home, model.name, set(groups))
    return sorted(range(len(groups)), key=lambda k: groups[k] not in warm)


def place_run(model: ModelInfo, settings: Settings, on_wait: Callable[[], None] | None = None) -> dict | None:
    """Claim a slot of this host for the job's model (None off a slot-aware worker host, e.g. a
    run in a test process), warm slots first; returns what the run got and sees, which the flow
    writes to its labels, progress and summary."""
    if settings.slots is None:
        return None
    check_fits(model.name, model.tensor_parallel_size, settings.slots)
    held = claim(settings.slots, settings.home / "slots", model.lane, on_wait=on_wait, order=warm_first(model, settings))
    return {"host": socket.gethostname(), **what_the_run_sees(held)}


def free_slots(pool_limit: int | None, slots_per_host: list[int], busy: int) -> int:
    """Slots of a lane that nobody uses or waits for.

    pool_limit: the work pool's concurrency limit (None: none). slots_per_host: the slot count of
    each online host. busy: runs that hold a slot or wait for one (pending, running,
    cancelling, and scheduled runs already due), including the caller's own run.
    """
    capacity = sum(slots_per_host)
    if pool_limit is not None:
        capacity = min(capacity, pool_limit)
    return max(0, capacity - busy)


def auto_workers(n_shards: int, free: int, min_shards: int) -> int:
    """How many runs share a job: this one plus one per free slot, while each keeps at least
    `min_shards` shards (a job of 16 shards, 2 free slots, min 8 → 2 runs)."""
    return max(1, min(1 + max(0, free), n_shards // max(1, min_shards)))


# What the parent does about one helper on one look (`helper_action`).
WAIT = "wait"  # leave the range to the helper for now
COLLECT = "collect"  # it completed: add its timings
RECOMPUTE = "recompute"  # it ended without finishing: do (the rest of) its range here
TAKE_OVER = "take_over"  # cancel it (forcing where refused), then do its range here

_NOT_STARTED = ("SCHEDULED", "PENDING", "PAUSED")


def split_ranges(n_shards: int, workers: int) -> list[list[int]]:
    """`[start, stop)` shard ranges, contiguous, sizes differing by at most one."""
    workers = max(1, min(workers, n_shards))
    base, extra = divmod(n_shards, workers)
    ranges, start = [], 0
    for i in range(workers):
        stop = start + base + (1 if i < extra else 0)
        ranges.append([start, stop])
        start = stop
    return ranges


def helper_action(kind: str | None, since_grace_s: float, unchanged_s: float, *, stall_s: float) -> str:
    """What the parent does about a helper in state `kind` (Prefect's state type, `COMPLETED`
    and so on; None: unknown or unreadable).

    since_grace_s: seconds since the grace ended (negative while it lasts); the grace starts
    when the parent's own range is done. unchanged_s: seconds since the parent last saw this
    helper's state change. Every state but Running leads to an end within a bounded time.
    """
    if kind == "COMPLETED":
        return COLLECT
    if kind in ("FAILED", "CANCELLED"):
        return RECOMPUTE
    if kind == "RUNNING":
        # Waited for as long as it runs: a helper whose host died stops sending heartbeats and
        # Prefect's heartbeat automation (`flows.liveness`) marks it Crashed, the branch below.
        return WAIT
    if kind in _NOT_STARTED:
        # Not started (lane full, stuck Pending on a worker that never started it, Paused):
        # after the grace this run, its model loaded, is faster than any helper still to load.
        return TAKE_OVER if since_grace_s >= 0 else WAIT
    # Crashed (a reschedule may still show as Scheduled), Cancelling (whose worker may be
    # gone), or unknown: take over once nothing has changed for `stall_s`.
    return TAKE_OVER if unchanged_s >= stall_s else WAIT
