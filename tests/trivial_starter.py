"""The run starter with a trivial worker and trivial runs, so its protocol is tested in
milliseconds per run (tests/test_run_starter.py).

`python -m tests.trivial_starter SOCKET PRELOAD HANDSHAKE_S`: the starter's own loop, whose
worker is `sleep` and whose preload is nothing (`bare`), a thread that stays (`threaded`), or
the real tokenizer preload of `HARVEST_HOME`'s checkpoints (`tokenizers`, refreshed after each
run as the real starter's is). A forked run writes `run PID PPID PGID` on the stdout its
launcher handed over (and, given an ARGV[2] of `modules`, whether the `tokenizers` package is
imported in it), keeps it open, sleeps ARGV[0] seconds and exits with status ARGV[1]: a reader
of that stdout sees its end when every process holding it (the launcher, the run) has ended.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from fleet.run_fork import preload_tokenizers
from fleet.run_starter import RunStarter


def _thread_that_stays() -> None:
    threading.Thread(target=time.sleep, args=(3600,), name="stays", daemon=True).start()


PRELOADS = {"bare": lambda: None, "threaded": _thread_that_stays, "tokenizers": lambda: preload_tokenizers(set())}


def _run(payload: dict, fds: list[int]) -> None:
    os.write(fds[1], f"run {os.getpid()} {os.getppid()} {os.getpgid(0)}\n".encode())
    sleep_s, code, *asked = payload["argv"]
    if asked == ["modules"]:
        os.write(fds[1], f"tokenizers imported: {'tokenizers' in sys.modules}\n".encode())
    time.sleep(float(sleep_s))
    os._exit(int(code))


def main(path: str, preload: str, handshake_s: str) -> int:
    outcome = RunStarter(path, ["sleep", "3600"], preload=PRELOADS[preload], handshake_s=float(handshake_s)).serve()
    if isinstance(outcome, int):
        return outcome if outcome >= 0 else 128 - outcome
    _run(outcome.payload, outcome.fds)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
