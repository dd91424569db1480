"""Bulk work yields a shared CPU to small work: the priorities of the processes that do it.

On a host whose CPU is contended, Linux shares it between sessions (scheduling autogroups, the
default on most distributions) equally whatever their processes' nice values, and between the
processes of one session by their nice. Bulk work lowers itself:

- an API replica's inline engine, and its children that parse and count submits whose cost
  is not known yet, run in sessions of their own, whose groups they lower
  (`lower_priority(..., session=True)`, `harvest.warm.inline_process`,
  `api.admission_process`): one key's long generations or large bodies then never take the
  share the replica's requests and the control plane need;
- a flow run lowers itself by the size of its job (`run_nice`): runs forked by a worker
  host's run starter share its session, so a large job's run leaves the CPU to a small job's
  run and to the worker beside it, and a small job keeps its turnaround whatever else the
  host runs. (A session's group is never lowered from a run: it is the worker's.)

Within one process, work that may be large runs on threads of its own that lower themselves
(`lower_thread`): an inline engine's decode leaves its own process's requests theirs.

A lower priority only matters while something else wants the CPU; on a quiet host the work
runs as fast as before.

Processes that do tensor work on the CPU (a host's engine server, an API replica's inline
engine, a worker host's runs) also start with OpenMP's idle threads sleeping
(`with_passive_waits`). torch's OpenMP (libgomp) otherwise spins a thread that has finished its
part of an operation, waiting for the next one: while another session wants the CPU, the
engine's share goes to a thread spinning for a peer that is not running. `bench/omp_wait.py`
(SmolLM2-135M, every layer, beside one busy process on the 2-core box): 66.8 s spinning
against 9.6 s sleeping for the same captures; on a quiet box 5.5 s against 5.3-6.4 s.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping

__all__ = ["BULK_FROM_BYTES", "MAX_NICE", "PASSIVE_WAITS", "run_nice", "lower_priority", "lower_thread", "with_passive_waits"]

BULK_FROM_BYTES = 1 << 20
"""A job whose output is at most this many bytes runs at the default priority."""
MAX_NICE = 19
PASSIVE_WAITS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""The environment that makes OpenMP's idle threads sleep rather than spin (module docstring).
libgomp reads it once, when torch is first imported: it belongs in a process's environment
from its start."""


def with_passive_waits(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process that does tensor work on the CPU: OpenMP's idle threads sleeping,
    unless `env` chooses otherwise (an operator's `OMP_WAIT_POLICY` is kept)."""
    return {**PASSIVE_WAITS, **env}


def run_nice(output_bytes: int) -> int:
    """A run's nice: one step for each doubling of its job's output past `BULK_FROM_BYTES`
    (32 MiB: 5, 1 GiB: 10, 8 GiB: 13), at most `MAX_NICE`."""
    if output_bytes <= BULK_FROM_BYTES:
        return 0
    return min(MAX_NICE, math.ceil(math.log2(output_bytes / BULK_FROM_BYTES)))


def lower_priority(nice: int, *, session: bool = False) -> bool:
    """Lower this process, every thread of it, to `nice` (never raise it: that needs privileges), and with
    `session` its session's scheduling group too (/proc/self/autogroup); False where nothing
    could be lowered (another kernel, or not allowed)."""
    done = False
    if session:
        try:
            with open("/proc/self/autogroup", "w") as group:
                group.write(str(nice))
            done = True
        except OSError:  # a kernel without autogroups
            pass
    # On Linux a nice belongs to a thread (threads started later inherit their starter's):
    # every thread the process already has is lowered, each at most once. A thread may start
    # one while the list is walked, from a thread not yet lowered: the list is read again until
    # it holds no thread not yet seen, after which every new thread has a lowered starter.
    seen: set[int] = set()
    while fresh := [thread for thread in _threads() if thread not in seen]:
        seen.update(fresh)
        for thread in fresh:
            try:
                if os.getpriority(os.PRIO_PROCESS, thread) < nice:
                    os.setpriority(os.PRIO_PROCESS, thread, nice)
                done = True
            except (OSError, AttributeError):  # a thread that just ended; not a Unix
                pass
    return done


def lower_thread(nice: int) -> bool:
    """Lower the calling thread only to `nice` (Linux: a nice belongs to a thread; threads it
    starts later inherit it). Kept for the thread's life: raising it back needs privileges, so
    only a thread that does nothing else is lowered. False where it could not be."""
    try:
        thread = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, thread) < nice:
            os.setpriority(os.PRIO_PROCESS, thread, nice)
        return True
    except (OSError, AttributeError):  # not Linux, or not allowed
        return False


def _threads() -> list[int]:
    """This process's thread ids (Linux), else 0: the calling process."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
