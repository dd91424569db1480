"""Where a warm small job's time goes, through `harvest up` as `make run` ships it.

Sequential 2-prompt `llama-tiny` jobs (three layers, as `bench_polling.py --submit`), each
submitted with `POST /v1/harvest` and long-polled to `done` as `harvest-client` does. After the
first (which loads the model into the host's engine server), each job's time is cut at marks
that other records give, not the code under test's own timers:

- `submit`, `seen done`: the client's clock;
- `created`: the job store's `created_at`;
- `pending`, `submitting`, `running`, `completed`: the flow run's state history in Prefect
  (the worker took the run; it launched it; the engine started it; it finished);
- `forward`, `last task`: the run's first task (the forward pass) starting, its last task
  (statistics and the manifest) ending, from Prefect's task-run events;
- `job done`: the job store's `completed_at` (the watcher recorded the run's end).

Each segment's median over the jobs is printed as a row (medians: they need not add up to the
submit-to-done median, the last row). All on one machine, so the clocks agree.

Run: `.venv/bin/python bench/bench_latency.py [--jobs 10]`
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SEGMENTS = {
    ("submit", "created"): "the API admits the job (request.json, the job row) and creates its run",
    ("created", "pending"): "the worker hears of the run (Prefect's event) and takes it",
    ("pending", "submitting"): "the worker reads the run's configuration and labels it",
    ("submitting", "running"): "the launcher, the fork from the starter, Prefect's engine up to Running",
    ("running", "forward"): "the flow: request read and tokenized, a slot, the warm engine",
    ("forward", "last task"): "forward pass, shard write, statistics and manifest (Prefect tasks)",
    ("last task", "completed"): "the run's summary artifact and its Completed state",
    ("completed", "job done"): "the watcher hears of the end and records it",
    ("job done", "seen done"): "the long-poll wakes and answers",
}


def _ts(value) -> float:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def _marks(home: Path, client, job_id: str, submit: float, seen: float) -> dict[str, float]:
    with sqlite3.connect(home / "harvest.db") as db:
        created, completed, flow_run_id = db.execute(
            "SELECT created_at, completed_at, flow_run_id FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
    marks = {"submit": submit, "created": _ts(created), "job done": _ts(completed), "seen done": seen}
    for state in client.read_flow_run_states(flow_run_id):
        name = state.type.value.lower()
        if state.name == "Submitting":
            name = "submitting"
        marks.setdefault(name, state.timestamp.timestamp())
    events = client.request("POST", "/events/filter", json={
        "filter": {"any_resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}, "event": {"prefix": ["prefect.task-run."]},
                   "occurred": {"since": "2000-01-01T00:00:00Z"}},
        "limit": 50,
    }).json()["events"]
    started = sorted(_ts(e["occurred"]) for e in events if e["event"] == "prefect.task-run.Running")
    ended = sorted(_ts(e["occurred"]) for e in events if e["event"] == "prefect.task-run.Completed")
    if started and ended:
        marks["forward"], marks["last task"] = started[0], ended[-1]
    return marks


def _read_marks(home: Path, ran: list[tuple[str, float, float]]) -> list[dict[str, float]]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    api_url = json.loads((home / "stack.json").read_text())["prefect_api_url"]
    auth = (home / "prefect-auth").read_text().strip()
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
        with get_client(sync_client=True) as client:
            rows = [_marks(home, client, *job) for job in ran]
    if os.environ.get("BENCH_LATENCY_MARKS"):
        for marks in rows:
            print("     ", {k: round(v - marks["submit"], 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    args = parser.parse_args()

    import httpx

    from bench.load_api import _start_stack, _stop_stack

    home = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    proc, info = _start_stack(home, f"sqlite:///{home / 'harvest.db'}", None)
    ran: list[tuple[str, float, float]] = []
    try:
        base, key = info["ACS_API_BASE"], info["ACS_API_KEY"]
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
            for n in range(args.jobs + 1):
                body = {"model": "llama-tiny", "prompts": [f"The sky is {n}", "Grass is"], "layers": [2, 4, 6]}
                submit = time.time()
                job = http.post("/harvest", json=body).raise_for_status().json()
                while job["status"] not in ("done", "failed", "cancelled"):
                    job = http.get(f"/harvest/{job['job_id']}", params={"wait": 30}).raise_for_status().json()
                seen = time.time()
                if job["status"] != "done":
                    raise RuntimeError(f"job {job['job_id']} ended {job['status']}: {job.get('error')}")
                print(f"   {'first (loads the model)' if n == 0 else f'job {n}'}: {seen - submit:.2f} s", flush=True)
                if n:
                    ran.append((job["job_id"], submit, seen))
                time.sleep(0.5)  # as a user's next job would come: not on the heels of the last one's answer
        time.sleep(3.0)  # Prefect records events a moment after they happen
        rows = _read_marks(home, ran)
    finally:
        _stop_stack(proc)
    totals = [seen - submit for _, submit, seen in ran]

    load = os.getloadavg()[0]
    print(f"\n`harvest up` as shipped, {len(rows)} warm 2-prompt llama-tiny jobs, sequential; load avg 1 min {load:.1f}")
    print("| from | to | what happens | median s | min s | max s |")
    print("|---|---|---|---:|---:|---:|")
    for (start, end), what in SEGMENTS.items():
        spans = [r[end] - r[start] for r in rows if start in r and end in r]
        if spans:
            print(f"| {start} | {end} | {what} | {statistics.median(spans):.3f} | {min(spans):.3f} | {max(spans):.3f} |")
    print(f"| submit | seen done | **submit to done** | **{statistics.median(totals):.3f}** | {min(totals):.3f} | {max(totals):.3f} |")


if __name__ == "__main__":
    main()
