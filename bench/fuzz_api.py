"""Fuzz the API with schemathesis `--checks all` against its own `/openapi.json`, on loopback.

    .venv/bin/python bench/fuzz_api.py [--examples 150] [--seed 1] [--min-cases 1000] [--min-per-route N]
                                       [--phases P,Q] [--method M ...] [--store sqlite|postgres]

Starts the real app under uvicorn (the test fixtures' `ApiServer`: SQLite job store, or with
`--store postgres` the PostgreSQL server at 127.0.0.1:5432 in a schema of its own; local
files, runs as files, the real tiny model for inline completions) in a fresh HARVEST_HOME,
makes a valid key, and runs schemathesis over every route with that key. Prints the cases
generated, the failures per check and the responses by status, and exits non-zero on any
failure, any 5xx response, or fewer than `--min-cases` cases. CI runs a smaller pass of the
same (`tests/test_openapi_fuzz.py`; ~450 cases, where 1,000 take minutes on a CI box).

Boundary values: schemathesis's coverage phase (run by default, with `--mode all`) sends, for
every documented range of every route, the values at its minimum and maximum and one past
each (min-1, max+1, and lengths likewise), valid and invalid, besides missing and wrongly
typed fields; the report counts the cases per route and phase (`by_phase`), and
`--min-per-route N` fails a run in which a route that takes input had fewer than N cases.

Two settings differ from schemathesis's defaults, and why:
- `use_after_free` is excluded: it expects a resource to be gone after its DELETE, but here
  DELETE cancels a harvest and the cancelled harvest stays readable.
- `positive_data_acceptance` also accepts 400 (and 503): a request the schema allows can
  still break a rule no JSON Schema can state (a layer beyond the chosen model's depth, a
  projection whose byte count does not match its shape and the model's hidden size, a
  zero-norm direction, a prompt plus max_tokens over the model's context, a model whose
  weights are not installed).
- `max_response_time` is 61 s, not 10 s: `?wait=` may hold a read for 60 s by design.
The server's request rates and lane caps are raised so the fuzzer exercises the routes rather
than the throttles, its models have a 64-token context, and its long-poll waiter limit is 0
(`fuzz_env`); throttles and long-polls have their own tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]
"""


FUZZ_MODELS = """
[models.llama-tiny]
weights = "models/llama-tiny"
builtin = true
lane = "small"
max_model_len = 64
max_activation_prompt_tokens = 32

[models.llama-tiny-large]
weights = "models/llama-tiny"
builtin = true
lane = "large"
max_model_len = 64
max_activation_prompt_tokens = 32

[models.llama-tiny-noharvest]
weights = "models/llama-tiny"
builtin = true
lane = "small"
harvest = false
max_model_len = 64
max_activation_prompt_tokens = 32
"""
"""Only models whose weights are here: a 503 for an absent model is the service's designed
answer, and leaving such models out keeps `not_a_server_error` strict (any 5xx fails).
A context of 64 tokens bounds each completion the fuzzer asks for (max_tokens ≤ 63), so a
case costs a fraction of a second on a CPU, not the seconds of 2,000 generated tokens."""


def fuzz_env(home: Path) -> dict[str, str]:
    """The API's settings for a fuzz run: generous rates and lane caps (module docstring)."""
    import re

    lanes, models = home / "fuzz-lanes.toml", home / "fuzz-models.toml"
    lanes.write_text(re.sub(r"capacity = \d+", "capacity = 1000000", (REPO / "infra" / "lanes.toml").read_text()))
    models.write_text(FUZZ_MODELS)
    return {
        "HARVEST_LANES_FILE": str(lanes),
        "HARVEST_MODELS_FILE": str(models),
        "HARVEST_RATE_READ_BURST": "1000000", "HARVEST_RATE_READ_PER_S": "1000000",
        "HARVEST_RATE_SUBMIT_BURST": "1000000", "HARVEST_RATE_SUBMIT_PER_S": "1000000",
        # Its auth checks send requests without a key from one address and expect 401 each.
        "HARVEST_RATE_ANONYMOUS_BURST": "1000000", "HARVEST_RATE_ANONYMOUS_PER_S": "1000000",
        "HARVEST_WATCH_INTERVAL_S": "0.5",
        # Every ?wait= is declined at once (X-Acs-Longpoll: declined, a documented answer):
        # fuzzed jobs never change status, so each long-poll would hold the run up to 60 s.
        "HARVEST_LONGPOLL_MAX_WAITERS": "0",
    }


@contextmanager
def fuzz_server(home: Path, store: str = "sqlite", name: str = "fuzz"):
    """A fuzz run's API (`fuzz_env`) under `home`, on SQLite or on PostgreSQL (a schema of its
    own, dropped after), and a key with room on every lane."""
    from testbed.api_server import ApiServer, drop_pg_schema, pg_schema_url

    env = fuzz_env(home)
    schema = f"harvest_{name}_{os.getpid()}_{int(time.time())}"
    if store == "postgres":
        env["HARVEST_DATABASE_URL"] = pg_schema_url(schema)
    server = ApiServer(home, name, env).start()
    try:
        yield server, server.make_key(name=name, small=1000000, large=1000000)
    finally:
        server.stop()
        if store == "postgres":
            drop_pg_schema(env["HARVEST_DATABASE_URL"], schema)


@contextmanager
def fresh_home():
    """A HARVEST_HOME of its own for a run from the command line, removed after."""
    home = Path(tempfile.mkdtemp(prefix="harvest-fuzz-"))
    os.environ["HARVEST_HOME"] = str(home)
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run_schemathesis(root: str, key: str, *, examples: int, seed: int, workdir: Path, timeout: float = 900,
                     phases: str | None = None, methods: list[str] | None = None) -> dict:
    """schemathesis run over every route; returns {"cases", "failures", "by_check", "checks", "operations" (cases
    per route), "output", "returncode", "seconds", "command"}."""
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    report = workdir / "report.ndjson"
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "run", f"{root}/openapi.json",
        "--checks", "all", "--exclude-checks", "use_after_free",
        "-H", f"Authorization: Bearer {key}",
        "--max-examples", str(examples), "--seed", str(seed), "--no-shrink",
        "--request-timeout", "70", "--max-response-time", "61", "--workers", "1",
        "--report", "ndjson", "--report-ndjson-path", str(report),
        *(["--phases", phases] if phases else []),
        *(option for method in methods or () for option in ("--include-method", method)),
    ]
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "NO_COLOR": "1"})
    elapsed = time.monotonic() - started
    return {**_count(report), "output": out.stdout + out.stderr, "returncode": out.returncode, "seconds": elapsed,
            "command": " ".join(command[1:]).replace(key, "$KEY")}


def _count(report: Path) -> dict:
    """Cases, failures per check, the checks that ran, the operations, and the responses by
    status (`server_errors`: how many were 5xx), from schemathesis's NDJSON event log (one
    ScenarioFinished per scenario, with each case's checks and its request and response)."""
    cases, by_check, checks, operations, statuses, by_phase = 0, {}, set(), {}, {}, {}
    for line in report.read_text().splitlines():
        event = json.loads(line)
        body = event.get("ScenarioFinished")
        if body is None:
            continue
        recorder = body.get("recorder") or {}
        cases += len(recorder.get("cases") or {})
        for interaction in (recorder.get("interactions") or {}).values():
            status = (interaction.get("response") or {}).get("status_code")
            if status is not None:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
        if recorder.get("cases"):
            operations[recorder["label"]] = operations.get(recorder["label"], 0) + len(recorder["cases"])
            phase = by_phase.setdefault(str(body.get("phase", "?")), {})
            phase[recorder["label"]] = phase.get(recorder["label"], 0) + len(recorder["cases"])
        for case_checks in (recorder.get("checks") or {}).values():
            for check in case_checks:
                checks.add(check["name"])
                if check["status"] == "failure":
                    by_check[check["name"]] = by_check.get(check["name"], 0) + 1
    return {"cases": cases, "failures": sum(by_check.values()), "by_check": by_check, "checks": sorted(checks),
            "operations": dict(sorted(operations.items())), "by_phase": {k: dict(sorted(v.items())) for k, v in by_phase.items()},
            "statuses": dict(sorted(statuses.items())),
            "server_errors": sum(n for status, n in statuses.items() if status.startswith("5"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150, help="schemathesis --max-examples (per operation and phase)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-cases", type=int, default=1000, help="fail when fewer cases were generated")
    parser.add_argument("--min-per-route", type=int, default=0, help="fail when a route that takes input (parameters "
                        "or a body) had fewer cases (GET /v1/models takes none: a handful of cases is all it has)")
    parser.add_argument("--phases", default=None, help="schemathesis --phases (default: all four)")
    parser.add_argument("--method", action="append", default=None,
                        help="only the routes of this HTTP method (schemathesis --include-method; repeatable)")
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite", help="the job store's database")
    args = parser.parse_args()
    with fresh_home() as home, fuzz_server(home, args.store) as (server, key):
        result = run_schemathesis(server.root, key, examples=args.examples, seed=args.seed, workdir=home,
                                  timeout=max(900, args.examples * 60), phases=args.phases, methods=args.method)
    print(result["output"][-4000:])
    print(json.dumps({k: result[k] for k in ("cases", "failures", "by_check", "checks", "operations", "by_phase", "statuses",
                                             "server_errors", "seconds", "returncode")}, indent=2))
    ok = result["failures"] == 0 and result["returncode"] == 0 and result["server_errors"] == 0
    short = {route: n for route, n in result["operations"].items()
             if route != "GET /v1/models" and route.split(" ")[0] in ("GET", "POST", "DELETE") and n < args.min_per_route}
    if short:
        print(f"routes under --min-per-route {args.min_per_route}: {short}")
    return 0 if ok and result["cases"] >= args.min_cases and not short else 1


if __name__ == "__main__":
    sys.exit(main())
