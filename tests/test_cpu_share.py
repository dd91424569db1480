"""Bulk work's lower CPU priority (`harvest.cpu_share`), read back from the kernel's /proc."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from harvest.cpu_share import run_nice, with_passive_waits
from tests.proc_threads import autogroup_nice, slices_supported
from tests.test_flows_ops import _thread_nices

MiB = 1 << 20


def test_a_runs_nice_is_one_step_per_doubling_of_its_output_past_a_mebibyte():
    assert [run_nice(n) for n in (0, MiB, MiB + 1, 2 * MiB, 32 * MiB, 33 * MiB, 1 << 30, 8 << 30)] == [0, 0, 1, 1, 5, 6, 10, 13]
    assert run_nice(1 << 50) == 19  # the most Linux has


LOWERED = """
import sys, threading, time
from harvest.cpu_share import lower_priority
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread from before
print(lower_priority(int(sys.argv[1]), session=sys.argv[2] == "session"), flush=True)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # and one from after
time.sleep(60)
"""


def _lowered(nice: int, how: str) -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen([sys.executable, "-c", LOWERED, str(nice), how], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert child.stdout.readline().strip() == "True"
    time.sleep(0.2)
    group = autogroup_nice(child.pid)
    return child, None if group is None else str(group)


def test_lowered_process_every_thread_and_with_session_its_group():
    child, group = _lowered(7, "session")
    try:
        # "/autogroup-N nice 7"; on a kernel without autogroups (None) the threads are lowered all the same
        assert _thread_nices(child.pid) == [7] and group in ("7", None)
    finally:
        child.kill()
        child.wait()
    # A run shares its worker's session: only the process is lowered, never the group.
    child, group = _lowered(5, "process")
    try:
        assert _thread_nices(child.pid) == [5] and group in ("0", None)
    finally:
        child.kill()
        child.wait()


SPAWNING = """
import threading, time
from harvest.cpu_share import lower_priority

def spawn():  # starts threads without pause while the process is lowered
    for _ in range(300):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

spawners = [threading.Thread(target=spawn, daemon=True) for _ in range(6)]
for spawner in spawners:
    spawner.start()
time.sleep(0.005)  # the spawners under way
print(lower_priority(9), flush=True)
for spawner in spawners:
    spawner.join()
print("spawned", flush=True)
time.sleep(60)
"""


def test_threads_started_while_the_process_is_lowered_are_lowered_too():
    # A thread started by one not yet lowered, after the list of threads was read, kept the
    # default nice (about one try in three with a single reading of the list).
    child = subprocess.Popen([sys.executable, "-c", SPAWNING], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "True"
        assert child.stdout.readline().strip() == "spawned"
        assert _thread_nices(child.pid) == [9]
    finally:
        child.kill()
        child.wait()


def test_idle_openmp_threads_sleep_unless_the_operator_chose_otherwise():
    assert with_passive_waits({"PATH": "/bin"}) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert with_passive_waits({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}


SLICES = """
import json, os, threading, time
from api.responsiveness import respond_quickly
from harvest.cpu_share import lower_priority
from tests.proc_threads import thread_slices

def started():
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

started()  # a thread from before
default = set(thread_slices(os.getpid()).values())
quick = respond_quickly()
started()  # one started by a quick thread
short = set(thread_slices(os.getpid()).values())
lower_priority(3)
started()
print(json.dumps([sorted(default), quick, sorted(short), sorted(set(thread_slices(os.getpid()).values()))]), flush=True)
"""


def test_a_responsive_process_asks_every_thread_for_the_shortest_slice_and_bulk_work_goes_back_to_the_default():
    """`respond_quickly` (an API replica) gives every thread, and those started after, the
    kernel's shortest slice; `lower_priority` (bulk work, which may be a replica's child and
    so inherit it) puts every thread back to the default. Read from /proc/PID/task/TID/sched."""
    from api.responsiveness import RESPONSIVE_SLICE_NS

    out = subprocess.run([sys.executable, "-c", SLICES], capture_output=True, text=True, timeout=60, check=True,
                         start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent))
    default, quick, short, lowered = json.loads(out.stdout)
    if not slices_supported():  # before Linux 6.12 (the fallback): the call is harmless, there is nothing to read
        assert default == short == lowered == [] and isinstance(quick, bool)
        return
    assert quick is True
    assert len(default) == 1 and default[0] > RESPONSIVE_SLICE_NS
    assert short == [RESPONSIVE_SLICE_NS]
    assert lowered == default
