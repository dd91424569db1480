"""A process's threads as the kernel accounts for them: each one's nice, CPU seconds and scheduling slice."""

from __future__ import annotations

import os

__all__ = ["thread_stats", "thread_slices"]


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
        slices[int(tid)] = next(int(line.split(":")[1]) for line in lines if line.split(":")[0].strip() == "se.slice")
    return slices
