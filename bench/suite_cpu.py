"""Where a test run's CPU goes: every process's CPU seconds, summed by role.

The suite is CPU-bound on a 2-core machine (README, "Tests"), so its time comes back only as
CPU taken out, and this says from where. It runs a command (default: the README's `make
test`) and reads `/proc` every `--interval` seconds meanwhile: each process's user + system
time spent during the run (what it had spent before the run started is left out), the last
seen before it ended, under the role its command line names (`ROLES`: a
Prefect server, an assessing child, an engine server…). A forked process keeps its parent's
command line, so a run forked by a run starter counts as the starter. A process that lives
less than one interval is missed, and so is what a process spent after its last sample: the
sums are a lower bound. The machine's busy share over the run comes from `/proc/stat`.

Run: `.venv/bin/python bench/suite_cpu.py [--interval 2] [-- make test PYTEST_ARGS=...]`
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import Counter

ROLES = (
    ("pytest process (xdist)", "exec(eval(sys.stdin.readline()))"),
    ("Prefect server", "fleet.prefect_server"),
    ("Prefect services", "prefect server services"),
    ("assessing child", "api.admission_process"),
    ("inline engine", "api.inline_process"),
    ("engine server", "harvest.warm.server"),
    ("run starter (and its runs)", "fleet.run_starter"),
    ("flow run, not forked", "prefect.engine"),
    ("API replica", "api.http_server"),
    ("pool worker", "fleet.pool_worker"),
    ("harvest CLI", "fleet.cli"),
    ("vLLM's model inspection", "vllm.model_executor.models.registry"),
    ("schemathesis", "schemathesis"),
    ("notebook kernel", "ipykernel"),
    ("moto S3", "moto.server"),
    ("PostgreSQL", "postgres"),
    ("Redis", "redis-server"),
    ("pytest", "pytest"),  # last: other roles' command lines may name pytest's temporary folders
)
"""(role, what its command line contains), first match wins."""

TICKS = os.sysconf("SC_CLK_TCK")


def role_of(command: str) -> str:
    return next((role for role, mark in ROLES if mark in command), "other: " + command[:60])


def _sample(seen: dict[tuple[int, str], list]) -> None:
    """Each live process's CPU seconds so far, keyed by (pid, start time): a reused pid is
    another process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rfind(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICKS
            key = (int(entry), fields[19])
            if key in seen:
                seen[key][1] = cpu
            elif cpu > 0:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    seen[key] = [f.read().replace(b"\0", b" ").decode(errors="replace"), cpu]
        except (OSError, IndexError, ValueError):
            pass  # ended between the listing and the read


def _busy_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of the whole machine so far."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle and iowait
    return sum(values) - idle, sum(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two reads of /proc")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="the run to account for (after --)")
    args = parser.parse_args()
    seen: dict[tuple[int, str], list] = {}
    _sample(seen)
    before = {key: cpu for key, (_, cpu) in seen.items()}  # what the machine's processes had spent already
    done = threading.Event()

    def sample_until_done() -> None:
        while not done.wait(args.interval):
            _sample(seen)

    sampler = threading.Thread(target=sample_until_done, daemon=True)
    busy0, all0 = _busy_ticks()
    started = time.monotonic()
    sampler.start()
    code = subprocess.call(args.command)
    done.set()
    sampler.join()
    _sample(seen)
    busy1, all1 = _busy_ticks()
    wall = time.monotonic() - started

    by_role, count = Counter(), Counter()
    for key, (command, cpu) in seen.items():
        spent = cpu - before.get(key, 0.0)
        if spent > 0:
            role = role_of(command or "(no command line: a kernel thread or a process ending)")
            by_role[role] += spent
            count[role] += 1
    print(f"\n{' '.join(args.command)}: exit {code}, {wall:,.0f} s, the machine {100 * (busy1 - busy0) / (all1 - all0):.0f} % busy "
          f"({os.cpu_count()} cores); {sum(by_role.values()):,.0f} CPU-s seen in {sum(count.values())} processes")
    print(f"{'CPU-s':>8} {'procs':>6}  role")
    for role, cpu in by_role.most_common():
        if cpu >= 1:
            print(f"{cpu:8.1f} {count[role]:6d}  {role}")
    return code


if __name__ == "__main__":
    sys.exit(main())
