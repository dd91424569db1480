"""Bulk work yields a shared CPU to small work: the priorities of the processes that do it.

On a host whose CPU is contended, Linux shares it between sessions (scheduling autogroups, the
default on most distributions) equally whatever their processes' nice values, and between the
processes of one session by their nice. Bulk work lowers itself:

- the processes that generate inline completions, and those that parse and count submits
  whose cost is not known yet, run in sessions of their own, whose groups they lower
  (`lower_priority(..., session=True)`, called by both): one key's long generations or
  large bodies then never take the share the API's requests and the control plane need;
- a flow run lowers itself by the size of its job (`run_nice`): runs forked by a worker
  host's run starter share its session, so a large job's run leaves the CPU to a small job's
  run and to the worker beside it, and a small job keeps its turnaround whatever else the
  host runs. (A session's group is never lowered from a run: it is the worker's.)

Within one process, work that may be large runs on threads of its own that lower themselves
(`lower_thread`): an inline engine's decode leaves its own process's requests theirs.

A lower priority only matters while something else wants the CPU; on a quiet host the work
runs as fast as before.

A lower priority decides how much of a contended CPU each gets, not how soon a request is
looked at: a latency-sensitive process asks for a short scheduling slice for every thread
(`set_slices`; the API's call is `api.responsiveness`), and bulk work (`lower_priority`) goes
back to the default slice, which children started by such a process would otherwise inherit.

Processes that do tensor work on the CPU (a host's engine server, an inline engine, a worker
host's runs) also start with OpenMP's idle threads sleeping
(`with_passive_waits`). torch's OpenMP (libgomp) otherwise spins a thread that has finished its
part of an operation, waiting for the next one: while another session wants the CPU, the
engine's share goes to a thread spinning for a peer that is not running. `bench/omp_wait.py`
(SmolLM2-135M, every layer, beside one busy process on the 2-core box): 66.8 s spinning
against 9.6 s sleeping for the same captures; on a quiet box 5.5 s against 5.3-6.4 s.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import struct
import threading
from collections.abc import Mapping

__all__ = ["BULK_FROM_BYTES", "MAX_NICE", "PASSIVE_WAITS", "run_nice", "lower_priority", "lower_thread", "set_slices",
           "with_passive_waits"]

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
    """Lower this process, every thread of it, to `nice` (never raise it: that needs privileges),
    with the default scheduling slice, and with `session` its session's scheduling group too
    (/proc/self/autogroup); False where nothing could be lowered (another kernel, or not allowed)."""
    done = False
    if session:
        try:
            with open("/proc/self/autogroup", "w") as group:
                group.write(str(nice))
            done = True
        except OSError:  # a kernel without autogroups
            pass

    def lower(thread: int) -> bool:
        if os.getpriority(os.PRIO_PROCESS, thread) < nice:
            os.setpriority(os.PRIO_PROCESS, thread, nice)
        try:
            _set_slice(thread, 0)
        except OSError:  # the slice only matters beside a responsive process's short one; the nice is done
            pass
        return True

    return _each_thread(lower) or done


def set_slices(slice_ns: int) -> bool:
    """Ask for a scheduling slice of `slice_ns` for every thread of this process, and so for the
    threads and processes they start; False where the kernel does not take it (not Linux 6.12+
    on x86-64 or arm64, or not allowed)."""
    return _each_thread(lambda thread: _set_slice(thread, slice_ns))


def _each_thread(change) -> bool:
    """`change(thread id)` for every thread of this process, each once; True if any took it.
    On Linux a thread's scheduling belongs to it, and threads started later inherit their
    starter's: a thread may start one while the list is walked, from a thread not yet changed,
    so the list is read again until it holds no thread not yet seen."""
    done = False
    seen: set[int] = set()
    while fresh := [thread for thread in _threads() if thread not in seen]:
        seen.update(fresh)
        for thread in fresh:
            try:
                done = change(thread) or done
            except (OSError, AttributeError):  # a thread that just ended; not a Unix
                pass
    return done


_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
"""The sched_setattr system call's number, where we know it."""


def _set_slice(thread: int, slice_ns: int) -> bool:
    """sched_setattr(2): `thread` stays SCHED_OTHER at its nice, asking for a slice of `slice_ns`
    (0: the kernel's default). Kernels before 6.12 ignore the slice; False where there is no call."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None:
        return False
    # struct sched_attr (56 bytes): size, policy, flags, nice, priority, runtime, deadline, period, util min/max
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQII", 56, 0, 0, os.getpriority(os.PRIO_PROCESS, thread), 0,
                                                   slice_ns, 0, 0, 0, 0), 56)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, thread, attr, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return True


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
