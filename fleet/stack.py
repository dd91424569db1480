"""`harvest up` (what `make run` runs): the whole service on this machine, in the foreground.

The fleet's roles (`fleet.roles`) on one box, sharing one HARVEST_HOME, started in order and
each waited for:

1. the control plane: the Prefect server on 127.0.0.1:$HARVEST_PREFECT_PORT (default 4200),
   SQLite under `$HARVEST_HOME/prefect` (PREFECT_HOME), its API behind basic auth
   (`flows.prefect_auth`: PREFECT_API_AUTH_STRING, else `$HARVEST_HOME/prefect-auth`,
   generated on the first start), which every child is given — meanwhile the embedded model is built
   if needed and the dev API key created (first start only; kept in `$HARVEST_HOME/dev-key`);
   then pools, deployments and liveness automations (idempotent, limits re-applied);
2. one worker host per lane of infra/lanes.toml (`small`, `large`);
3. one API replica on 127.0.0.1:$HARVEST_PORT (default 8000).

Then prints, on stdout:

    ACS_API_BASE=http://127.0.0.1:<port>/v1
    ACS_API_KEY=<dev key>
    PREFECT_UI=http://127.0.0.1:<prefect port>

and `$HARVEST_HOME/stack.json` records the URLs (for `harvest schedule`). Ctrl-C or SIGTERM
stops every child, the workers' flow-run processes included, and leaves no process behind.
A child that dies on its own (an API OOM-killed) is restarted alone, on the same port, while
the others run on (`fleet.processes.Supervisor`, a bounded number of times; then the stack stops
and exits 1, saying which and where its log is).
Logs: `$HARVEST_HOME/logs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fleet.processes import serve, start_server
from fleet.roles import apply_control_plane, start_api_replica, start_worker_host
from fleet.settings import FleetSettings
from flows.prefect_auth import SERVER_ENV, server_auth, use_client_auth
from harvest.lanes import load_lanes
from harvest.placement import visible_gpus
from harvest.private_files import private_dirs, write_private
from harvest.settings import get_settings

__all__ = ["main", "dev_key"]


def _say(text: str) -> None:
    print(f"harvest up: {text}", file=sys.stderr, flush=True)


def dev_key(home: Path, env: dict[str, str]) -> str | None:
    """The dev API key: read from `home/dev-key`, or created once with `harvest keys create`."""
    path = home / "dev-key"
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    result = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "keys", "create", "--name", "dev"],
        env=env, cwd=home, capture_output=True, text=True, timeout=120,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        _say(f"could not create the dev key (exit {result.returncode}): {result.stderr.strip()[-500:]}")
        return None
    key = lines[-1].strip()
    write_private(path, key + "\n")
    return key


def _build_models() -> None:
    """Build the embedded model now, once, instead of in the first concurrent flow runs."""
    from harvest.registry import load_registry

    registry = load_registry(get_settings())
    for name in registry.names():
        try:
            registry.get(name)
        except Exception as exc:  # a registry entry whose weights are absent is not fatal here
            _say(f"model {name}: {exc}")


def _import_flows() -> None:
    import flows.corpus_refresh  # noqa: F401  (imports flows.harvest: torch, transformers)
    import flows.retention  # noqa: F401


def up(home: Path, port: int, prefect_port: int) -> dict[str, str]:
    """Start everything (children go to `Managed.started`); returns the ready lines."""
    started = time.monotonic()
    # One password for the server and every client on this box; set before anything imports
    # Prefect (its settings are read at import), so all children inherit it.
    auth = server_auth(home)
    use_client_auth(auth)
    env = {**os.environ, "HARVEST_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect_home = Path(os.environ.get("PREFECT_HOME") or home / "prefect")
    # Everything that does not need the server runs while it starts (~10 s): the dev key, the
    # embedded model, and importing the flows (torch, transformers) for the deploy.
    with ThreadPoolExecutor(8) as pool:
        server_f = pool.submit(start_server, prefect_home, prefect_port, {**env, SERVER_ENV: auth}, 90)
        key_f = pool.submit(dev_key, home, env)
        models_f = pool.submit(_build_models)
        imports_f = pool.submit(_import_flows)
        _, api_url = server_f.result()
        _say(f"prefect server ready at {api_url} ({time.monotonic() - started:.1f} s)")
        os.environ["PREFECT_API_URL"] = api_url
        models_f.result()
        # Workers and the API boot (seconds each) while the deployments are applied; a worker
        # that comes first creates its pool, and the deploy then sets its limit.
        # On a box without GPUs each lane's worker gets as many slots as its pool allows, so
        # `make run` runs jobs side by side as before, plus one: a run's process holds its slot
        # until it has exited, seconds after its run ended on a busy box, and the next job must
        # not wait for that (Prefect's pool limit still counts the runs). With GPUs, the GPUs
        # decide (`placement`): a GPU is free only once its process has exited.
        cpu_only = not visible_gpus()
        workers = [
            pool.submit(start_worker_host, home, lane.name, api_url, name=f"{lane.name}-{os.getpid()}",
                        slots=(lane.pool_limit or 1) + 1 if cpu_only else None,
                        metrics=("127.0.0.1", 0, True))  # each lane's /metrics on a free port (its stderr line says which)
            for lane in load_lanes(get_settings()).values()
        ]
        key = key_f.result()
        api_f = pool.submit(start_api_replica, home, "127.0.0.1", port, trusted_proxies=get_settings(FleetSettings).trusted_proxies)
        imports_f.result()
        names = apply_control_plane(api_url)
        _say(f"deployed {', '.join(names)} ({time.monotonic() - started:.1f} s)")
        for worker in workers:
            worker.result()
        _, api_base = api_f.result()
    _say(f"api ready ({time.monotonic() - started:.1f} s)")
    info = {"ACS_API_BASE": api_base, "ACS_API_KEY": key or "", "PREFECT_UI": api_url.removesuffix("/api")}
    # It holds the dev key: owner-only, like the key's own file.
    write_private(home / "stack.json", json.dumps({**info, "prefect_api_url": api_url, "pid": os.getpid()}, indent=2))
    return info


def main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(prog="harvest up", description="Start the whole harvest service on this machine.")
    parser.add_argument("--port", type=int, help="API port (default HARVEST_PORT, 8000)")
    parser.add_argument("--prefect-port", type=int, help="Prefect server port (default HARVEST_PREFECT_PORT, 4200)")
    args = parser.parse_args(argv[1:])
    settings = get_settings(FleetSettings)
    home = settings.home
    private_dirs(home / "logs")  # new folders 0700: logs are the service's alone
    stack_file = home / "stack.json"

    def start() -> dict[str, str]:
        return up(home, args.port or settings.port, args.prefect_port or settings.prefect_port)

    def stop() -> None:
        from harvest.warm.protocol import stop_engine_servers

        stop_engine_servers(home)  # the workers' warm engines (harvest.warm)
        stack_file.unlink(missing_ok=True)

    return serve("harvest up", start, on_stop=stop)
