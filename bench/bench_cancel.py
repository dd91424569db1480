"""How long a cancel takes when it lands as a host takes the run, through `harvest up`.

A run is started (`flows.submit.start_harvest_run`, as the API starts one) and cancelled by its
job's tag (`cancel_job_runs`, as the API cancels) after a delay of 0 to 0.7 s: the window in
which the host's worker takes the run (Pending, Submitting) and its process starts. The time
is the client's, from the cancel until Prefect records the run Cancelled; the state's message
says who finished it: Prefect's cancellation ("Flow run was cancelled successfully."), the
worker once the run's process ended (`fleet.pool_worker.finish_cancel`), or `flows.liveness`'s
automation after `CANCEL_AFTER_S`. `--busy N` keeps N processes spinning meanwhile, as a loaded
host would (the race shows most there).

Run: `.venv/bin/python bench/bench_cancel.py [--runs 24] [--busy 2]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.stack import harvest_up  # noqa: E402

DELAYS = [0.1 * k for k in range(8)]
SLOW_S = 10.0
GIVE_UP_S = 120.0


def cancel_once(client, delay: float) -> tuple[float, str]:
    """One run started and cancelled `delay` s later: (seconds to Cancelled, its message)."""
    from flows.submit import cancel_job_runs, start_harvest_run

    job_id = str(uuid.uuid4())
    run_id = uuid.UUID(start_harvest_run(job_id, "file:///nowhere/request.json", "llama-tiny", "small", "bench-cancel"))
    time.sleep(delay)
    sent = time.monotonic()
    cancel_job_runs(job_id)
    while (state := client.read_flow_run(run_id).state).type.value != "CANCELLED":
        if time.monotonic() - sent > GIVE_UP_S:
            return float("inf"), f"still {state.name}"
        time.sleep(0.1)
    return time.monotonic() - sent, state.message or "(no message: Prefect cancelled it before a host took it)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU meanwhile")
    args = parser.parse_args()

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with tempfile.TemporaryDirectory(prefix="bench-cancel-") as scratch:
        home = Path(scratch)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            with harvest_up(home, HARVEST_ENGINE="hf"):
                api_url = json.loads((home / "stack.json").read_text())["prefect_api_url"]
                auth = (home / "prefect-auth").read_text().strip()
                with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}), \
                        get_client(sync_client=True) as client:
                    results = []
                    for i in range(args.runs):
                        delay = DELAYS[i % len(DELAYS)]
                        took, message = cancel_once(client, delay)
                        results.append((delay, took, message))
                        print(f"  cancel {i + 1}: delay {delay:.1f} s, {took:.1f} s, {message!r}", flush=True)
        finally:
            for spinner in spinners:
                spinner.kill()

    times = [took for _, took, _ in results]
    by = {message: sum(m == message for *_, m in results) for message in sorted({m for *_, m in results})}
    print(f"\n{args.runs} cancels 0-0.7 s after the start, {args.busy} busy processes; "
          f"median {statistics.median(times):.1f} s, max {max(times):.1f} s, over {SLOW_S:g} s: "
          f"{sum(t > SLOW_S for t in times)}")
    for message, count in by.items():
        print(f"  {count} ended with {message!r}")


if __name__ == "__main__":
    main()
