"""A process's threads as the kernel accounts for them: each one's nice, CPU seconds and scheduling
slice, and its session's scheduling group.

Two of these are kernel features a user's machine may lack: scheduling slices (`se.slice`,
Linux 6.12+) and autogroups (/proc/PID/autogroup; kernels built without them, or booted with
`noautogroup`). Where they are missing, `thread_slices` and `autogroup_nice` say so (an empty
dict, None), and the tests check the documented fallback instead (`harvest.cpu_share`: the
slice is ignored, a session's group is not lowered but its threads' nice is)."""

from __future__ import annotations

import os

__all__ = ["thread_stats", "thread_slices", "slices_supported", "autogroup_nice"]


def thread_stats(pid: int) -> dict[int, tuple[int, float]]:
    """Each thread of `pid`: (nice, CPU seconds so far), from /proc/PID/task/TID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        except FileNotFoundError:  # a thread that just ended
            continue
        # stat(5): utime and stime are fields 14 and 15, nice 19; `fields` starts at field 3.
        threads[int(tid)] = (int(fields[16]), (int(fields[11]) + int(fields[12])) / tick)
    return threads


def thread_slices(pid: int) -> dict[int, int]:
    """Each thread of `pid`: its scheduling slice in ns (`se.slice` of /proc/PID/task/TID/sched)."""
    slices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/sched") as sched:
                lines = sched.read().splitlines()
        except FileNotFoundError:  # a thread that just ended
            continue
        found = [int(line.split(":")[1]) for line in lines if line.split(":")[0].strip() == "se.slice"]
        if not found:  # a kernel before 6.12: no slices to read
            return {}
        slices[int(tid)] = found[0]
    return slices


def slices_supported() -> bool:
    """Whether this kernel has per-task scheduling slices (Linux 6.12+)."""
    return bool(thread_slices(os.getpid()))


def autogroup_nice(pid: int) -> int | None:
    """The nice of `pid`'s session's scheduling group ("/autogroup-151 nice 10"), or None on
    a kernel without autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as group:
            return int(group.read().split()[-1])
    except (FileNotFoundError, OSError):
        return None
