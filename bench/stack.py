"""`harvest up` for a benchmark: the stack `make run` starts, in a home of the bench's own."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["harvest_up"]

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def harvest_up(home: Path, **env: str) -> Iterator[tuple[str, str]]:
    """`harvest up` in `home` on free ports, nothing else changed but `env`: yields (API base,
    key) once it prints them, and stops the whole stack (its process group) after."""
    from fleet.processes import free_port

    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HARVEST_", "ACS_"))}
    environment.update(HARVEST_HOME=str(home), PREFECT_HOME=str(home / "prefect"),
                       HARVEST_PORT=str(free_port()), HARVEST_PREFECT_PORT=str(free_port()), **env)
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "harvest"), "up"], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                            stderr=open(home / "up.log", "w"), text=True, start_new_session=True)
    ready: dict[str, str] = {}
    try:
        for line in proc.stdout:
            name, _, value = line.strip().partition("=")
            ready[name] = value
            if "PREFECT_UI" in ready:
                break
        if "ACS_API_KEY" not in ready:
            raise RuntimeError(f"harvest up did not start:\n{(home / 'up.log').read_text()[-2000:]}")
        yield ready["ACS_API_BASE"], ready["ACS_API_KEY"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
