"""The API replica answers reads quickly on a contended CPU: the shortest scheduling slice.

A lower priority for bulk work (`harvest.cpu_share`) decides how much of a contended CPU each
process gets, not how soon a request is looked at: a replica's read wakes up several times (the
event loop, a worker thread, again for the job store's answer), and each time the kernel (EEVDF,
Linux 6.6+) lets the task on the CPU finish its slice first, ~1.4 ms by default on two cores,
whatever its nice. So the replica asks for the shortest slice, 0.1 ms (Linux 6.12+): a task
whose slice is shorter than the running one's preempts it when it wakes. Its bulk children go
back to the default slice when they lower themselves (`harvest.cpu_share.lower_priority`).
Before Linux 6.12 the kernel ignores the slice, and the replica serves as before.
"""

from __future__ import annotations

from harvest.cpu_share import set_slices

__all__ = ["RESPONSIVE_SLICE_NS", "respond_quickly"]

RESPONSIVE_SLICE_NS = 100_000
"""The scheduling slice the replica asks for: the least the kernel grants."""


def respond_quickly() -> bool:
    """The shortest slice for every thread of this process, and so for the threads and
    processes they start; False where the kernel does not take it."""
    return set_slices(RESPONSIVE_SLICE_NS)
