"""Launchers of the run starter's protocol for tests/test_run_starter.py: forked children that
do what the run starter's `launch` does, with a SIGKILL of themselves at a chosen point, and
a storm of them killed at random points while whole jobs run.

Standard library only: the storm runs as `python -m tests.launchers SOCKET STARTER_PID SEED`,
a small process whose forks cost milliseconds (a fork of a process that has imported torch,
as the test session has, costs a hundred times more).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass

__all__ = ["KILL_POINTS", "launch_bytes", "read_to_end", "Launcher", "start_launcher", "storm"]

KILL_POINTS = ("connected", "half-header", "header", "half-payload", "payload", "forked", "running", "anytime")
"""Where a launcher dies: after connecting, after half its length, after its length and
descriptors, half its launch, all of it, after reading its run's pid, while its run goes, or
(`anytime`) killed from outside after a random few milliseconds."""


def launch_bytes(argv: list[str]) -> tuple[bytes, bytes]:
    """The length header and the launch of a run of `tests.trivial_starter`: SLEEP_S, CODE."""
    payload = json.dumps({"env": {}, "cwd": "/", "argv": argv}).encode()
    return struct.pack("!I", len(payload)), payload


def read_to_end(fd: int, deadline: float) -> tuple[bytes, bool]:
    """All a pipe gets until every process holding its write end has closed it or ended (True),
    or until the deadline (False: something holds it still)."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                os.close(fd)
                return b"".join(chunks), True
            chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks), False


@dataclass
class Launcher:
    """A launcher in a forked child; `report` gets the lines it was answered, `stdout` what its
    run wrote (the run holds it open as long as it lives)."""

    pid: int
    report: int
    stdout: int
    die_at: str | None

    def finish(self, deadline: float) -> dict:
        """Its exit status (None if it had to be killed at the deadline), the starter's answers
        to it, its run's lines, and whether every holder of its run's stdout has ended."""
        status = None
        while time.monotonic() < deadline:
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(raw)
                break
            time.sleep(0.005)
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        report, _ = read_to_end(self.report, deadline)
        lines, ended = read_to_end(self.stdout, deadline)
        return {"die_at": self.die_at, "status": status, "report": report.decode().splitlines(),
                "lines": lines.decode().splitlines(), "ended": ended}


def start_launcher(path: str, argv: list[str], die_at: str | None = None, running_s: float = 0.0) -> Launcher:
    header, payload = launch_bytes(argv)
    report_r, report_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # nothing but system calls, then _exit
        code = 1
        try:
            os.close(report_r)
            os.close(stdout_r)
            _exchange(path, header, payload, stdout_w, report_w, die_at, running_s)
            code = 0
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(stdout_w)
    return Launcher(pid, report_r, stdout_r, die_at)


def _exchange(path: str, header: bytes, payload: bytes, stdout_w: int, report_w: int, die_at: str | None, running_s: float) -> None:
    """What the launcher does, with a SIGKILL of itself at the point `die_at`."""

    def point(name: str) -> None:
        if die_at == name:
            os.kill(os.getpid(), signal.SIGKILL)

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    point("connected")
    if die_at == "half-header":
        sock.send(header[:2])
        point("half-header")
    null = os.open(os.devnull, os.O_RDWR)
    socket.send_fds(sock, [header], [null, stdout_w, null])
    os.close(stdout_w)  # only its run holds it from here
    point("header")
    sock.sendall(payload[: len(payload) // 2])
    point("half-payload")
    sock.sendall(payload[len(payload) // 2:])
    point("payload")
    answers = sock.makefile("rb")
    os.write(report_w, answers.readline())
    point("forked")
    time.sleep(running_s)
    point("running")
    os.write(report_w, answers.readline())


def storm(path: str, starter_pid: int, seed: int, batches: int = 6, kills: int = 20, jobs: int = 3) -> dict:
    """`batches` of `kills` launchers killed at random points (their runs sleep 300 s: only
    their starter can end them sooner) and `jobs` whole jobs, and one job through it all."""
    rng = random.Random(seed)
    along = start_launcher(path, ["2", "7"])
    killed, done = [], []
    for _ in range(batches):
        batch = []
        for _ in range(kills):
            die_at = rng.choice(KILL_POINTS)
            launcher = start_launcher(path, ["300", "0"], None if die_at == "anytime" else die_at, rng.uniform(0, 0.02))
            if die_at == "anytime":
                time.sleep(rng.uniform(0, 0.01))
                os.kill(launcher.pid, signal.SIGKILL)
                launcher.die_at = die_at
            batch.append(launcher)
        codes = rng.sample(range(20), jobs)
        whole = [start_launcher(path, [f"{rng.uniform(0, 0.2):.3f}", str(code)]) for code in codes]
        deadline = time.monotonic() + 60
        killed += [launcher.finish(deadline) for launcher in batch]
        done += [{**launcher.finish(deadline), "code": code} for launcher, code in zip(whole, codes)]
        try:
            os.kill(starter_pid, 0)
        except ProcessLookupError:
            break  # nothing more to learn from launching at no one
    done.append({**along.finish(time.monotonic() + 60), "code": 7})
    return {"killed": killed, "jobs": done}


if __name__ == "__main__":
    print(json.dumps(storm(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
