"""`harvest up` (what `make run` runs): the whole service on this machine, in the foreground.

Starts, in order, and waits for each to answer:

1. the Prefect server on 127.0.0.1:$HARVEST_PREFECT_PORT (default 4200), SQLite under
   `$HARVEST_HOME/prefect` (PREFECT_HOME) — meanwhile the embedded model is built if needed
   and the dev API key created (first start only; kept in `$HARVEST_HOME/dev-key`);
2. pools and deployments from infra/prefect.yaml (idempotent, limits re-applied);
3. one process worker per lane (`small`, `large`);
4. the API: `uvicorn api.app:app --host 127.0.0.1 --port $HARVEST_PORT` (default 8000);
5. the reaper (a thread here, every 5 s).

Then prints, on stdout:

    ACS_API_BASE=http://127.0.0.1:<port>/v1
    ACS_API_KEY=<dev key>
    PREFECT_UI=http://127.0.0.1:<prefect port>

and `$HARVEST_HOME/stack.json` records the URLs (for `harvest schedule`). Ctrl-C or SIGTERM
stops every child, the workers' flow-run processes included, and leaves no process behind.
If a child dies on its own, the stack stops and exits 1, saying which and where its log is.
Logs: `$HARVEST_HOME/logs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flows.processes import Managed, start_server, start_worker, wait_http

__all__ = ["main", "dev_key", "LANES"]

LANES = ("small", "large")
REPO = Path(__file__).resolve().parent.parent


def _say(text: str) -> None:
    print(f"harvest up: {text}", file=sys.stderr, flush=True)


def dev_key(home: Path, env: dict[str, str]) -> str | None:
    """The dev API key: read from `home/dev-key`, or created once with `harvest keys create`."""
    path = home / "dev-key"
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    result = subprocess.run(
        [sys.executable, "-m", "harvest.cli", "keys", "create", "--name", "dev"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        _say(f"could not create the dev key (exit {result.returncode}): {result.stderr.strip()[-500:]}")
        return None
    key = lines[-1].strip()
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def _build_models() -> None:
    """Build the embedded model now, once, instead of in the first concurrent flow runs."""
    from harvest.registry import load_registry

    registry = load_registry()
    for name in registry.names():
        try:
            registry.get(name)
        except Exception as exc:  # a registry entry whose weights are absent is not fatal here
            _say(f"model {name}: {exc}")


def _import_flows() -> None:
    import flows.corpus_refresh  # noqa: F401  (imports flows.harvest: torch, transformers)
    import flows.retention  # noqa: F401


class Stack:
    def __init__(self, home: Path, port: int, prefect_port: int):
        self.home = home
        self.port = port
        self.prefect_port = prefect_port
        self.children: list[Managed] = []
        self.stop_event = threading.Event()
        self.reaper: threading.Thread | None = None
        self.api_url: str | None = None

    def env(self, api_url: str | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            "HARVEST_HOME": str(self.home),
            "HARVEST_PORT": str(self.port),
            "PREFECT_HOME": os.environ.get("PREFECT_HOME") or str(self.home / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "HARVEST_REPO": str(REPO),
        }
        if api_url:
            env["PREFECT_API_URL"] = api_url
        return env

    def up(self) -> dict[str, str]:
        started = time.monotonic()
        logs = self.home / "logs"
        prefect_home = Path(self.env()["PREFECT_HOME"])
        # Everything that does not need the server runs while it starts (~10 s): the dev key,
        # the embedded model, and importing the flows (torch, transformers) for the deploy.
        with ThreadPoolExecutor(4) as pool:
            server_f = pool.submit(start_server, prefect_home, self.prefect_port, self.env(), 90)
            key_f = pool.submit(dev_key, self.home, self.env())
            models_f = pool.submit(_build_models)
            imports_f = pool.submit(_import_flows)
            server, api_url = server_f.result()
            self.children.append(server)
            _say(f"prefect server ready at {api_url} ({time.monotonic() - started:.1f} s)")
            os.environ["PREFECT_API_URL"] = api_url
            self.api_url = api_url
            models_f.result()
            # Workers and the API boot (seconds each) while the deployments are applied; a
            # worker that comes first creates its pool, and the deploy then sets its limit.
            for lane in LANES:
                self.children.append(start_worker(lane, api_url, logs / f"worker-{lane}.log", self.env(api_url), name=f"{lane}-{os.getpid()}"))
            key = key_f.result()
            api = Managed(
                "api",
                [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "127.0.0.1", "--port", str(self.port)],
                self.env(api_url), logs / "api.log", cwd=str(REPO),
            )
            self.children.append(api)
            imports_f.result()
            from prefect.settings import PREFECT_API_URL, temporary_settings

            from flows.deploy import apply_sync

            with temporary_settings({PREFECT_API_URL: api_url}):
                names = apply_sync()
            _say(f"deployed {', '.join(names)} ({time.monotonic() - started:.1f} s)")
        wait_http(f"http://127.0.0.1:{self.port}/openapi.json", 90, api)
        _say(f"api ready ({time.monotonic() - started:.1f} s)")

        from flows.reaper import run_forever

        self.reaper = threading.Thread(
            target=run_forever, args=(self.stop_event,), kwargs={"log": _say, "api_url": self.api_url}, daemon=True
        )
        self.reaper.start()
        info = {
            "ACS_API_BASE": f"http://127.0.0.1:{self.port}/v1",
            "ACS_API_KEY": key or "",
            "PREFECT_UI": f"http://127.0.0.1:{self.prefect_port}",
        }
        (self.home / "stack.json").write_text(
            json.dumps({**info, "prefect_api_url": api_url, "pid": os.getpid(), "children": [c.pid for c in self.children]}, indent=2)
        )
        return info

    def watch(self) -> int:
        """Block until a child dies (→ 1); a signal unwinds it with KeyboardInterrupt (→ 0 in `main`)."""
        while not self.stop_event.wait(1.0):
            for child in self.children:
                if not child.alive():
                    _say(f"{child.name} exited with {child.proc.returncode}; stopping (log: {child.log_path})")
                    return 1
        return 0

    def down(self) -> None:
        self.stop_event.set()
        # API first (no new jobs), then workers (and their flow runs), the server last;
        # `Managed.started` also holds a child whose start was interrupted before it answered.
        for child in sorted(Managed.started, key=lambda c: {"api": 0, "prefect-server": 2}.get(c.name, 1)):
            if child.alive():
                child.stop()
        if self.reaper is not None:
            self.reaper.join(timeout=10)
        stack_file = self.home / "stack.json"
        if stack_file.exists():
            stack_file.unlink()


def main(argv: list[str]) -> int:
    from harvest.settings import get_settings

    parser = argparse.ArgumentParser(prog="harvest up", description="Start the whole harvest service on this machine.")
    parser.add_argument("--port", type=int, help="API port (default HARVEST_PORT, 8000)")
    parser.add_argument("--prefect-port", type=int, help="Prefect server port (default HARVEST_PREFECT_PORT, 4200)")
    args = parser.parse_args(argv[1:])
    settings = get_settings()
    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    stack = Stack(home, args.port or settings.port, args.prefect_port or int(os.environ.get("HARVEST_PREFECT_PORT", 4200)))

    def on_signal(signum, frame):
        # Never take a lock here (no Event.set): the handler runs in the main thread, possibly
        # inside `stop_event.wait`, which holds the event's lock, and would deadlock. Ignore
        # any further signal (make forwards one, an impatient Ctrl-C) so nothing can cut the
        # stop short, then unwind `up` or `watch`; the `finally` below stops every child.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        info = stack.up()
        for name, value in info.items():
            print(f"{name}={value}", flush=True)
        code = stack.watch()
    except KeyboardInterrupt:
        code = 0
    except Exception as exc:
        _say(f"failed to start: {type(exc).__name__}: {exc}")
        code = 1
    finally:
        # Also when a child died (no signal): `down` is bounded (SIGKILL after a grace), so
        # let nothing interrupt it and orphan the children.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _say("stopping")
        stack.down()
        _say("stopped")
    return code
