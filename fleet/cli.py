"""The `harvest` command (the console script): which module runs each subcommand.

Each subcommand lives with the layer it drives: `run` and `models check` with the core, the roles and
`up` here, the schedule and the sweep with the flows, API keys and the spend cap with the API.
Each module has `main(argv) -> int` taking the whole argv (subcommand first) and is imported
only when called, so `harvest run` starts without Prefect or FastAPI.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "run": "harvest.cli",
    "models": "harvest.parity",
    "up": "fleet.stack",
    "server": "fleet.roles",
    "api": "fleet.roles",
    "worker": "fleet.roles",
    "schedule": "flows.schedule",
    "sweep": "flows.retention",
    "keys": "api.admin",
    "spend-cap": "api.admin",
}
"""Subcommand → module with `main(argv) -> int`."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: harvest {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv)


if __name__ == "__main__":
    sys.exit(main())
