"""Where a warm small job's time goes, through `harvest up` as `make run` ships it.

Sequential 2-prompt `llama-tiny` jobs (three layers, as `bench_polling.py --submit`), each
submitted with `POST /v1/harvest` and long-polled to `done` as `harvest-client` does. After the
first (which loads the model into the host's engine server), each job's time is cut at marks
that other records give, not the code under test's own timers:

- `submit`, `seen done`: the client's clock;
- `created`: the job store's `created_at`;
- `pending`, `running`, `completed`: the flow run's state history in Prefect (the worker
  took the run; the engine started it; it finished);
- `flow body`: the first log line the flow itself writes (`placed on …` comes after the
  tokenized request; Prefect's log records carry their own timestamps);
- `manifest`: the manifest file's modification time on disk;
- `job done`: the job store's `completed_at` (the watcher recorded the run's end).

Each segment's median over the jobs is printed as a row; the sum is the submit-to-done median.
All on one machine, so the clocks agree.

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

MARKS = ["submit", "created", "pending", "running", "flow body", "manifest", "completed", "job done", "seen done"]
SEGMENTS = {
    ("submit", "created"): "the API admits the job (request.json, the job row)",
    ("created", "pending"): "the run waits in its queue for the worker's poll, which takes it",
    ("pending", "running"): "the worker launches the run (fork from the starter) and the engine sets Running",
    ("running", "flow body"): "the flow reads and tokenizes the request, its first log line",
    ("flow body", "manifest"): "placement, the warm engine, the forward pass, shards, statistics, manifest",
    ("manifest", "completed"): "the run's summary artifact and its Completed state",
    ("completed", "job done"): "the watcher hears of the end and records it",
    ("job done", "seen done"): "the long-poll wakes and answers",
}


def _ts(value) -> float:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def _marks(home: Path, api_url: str, auth: str, job_id: str, submit: float, seen: float) -> dict[str, float]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with sqlite3.connect(home / "harvest.db") as db:
        created, completed, flow_run_id = db.execute(
            "SELECT created_at, completed_at, flow_run_id FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
    marks = {"submit": submit, "created": _ts(created), "job done": _ts(completed), "seen done": seen}
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
        with get_client(sync_client=True) as client:
            for state in client.read_flow_run_states(flow_run_id):
                name = state.type.value.lower()
                if name in ("pending", "running", "completed"):
                    marks.setdefault(name, state.timestamp.timestamp())
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC)
    placed = [log.timestamp.timestamp() for log in logs if log.message.startswith(("placed on", "llama-tiny on"))]
    if placed:
        marks["flow body"] = placed[0]
    manifest = next((home / "storage" / "jobs" / job_id).glob("manifest.json"), None)
    if manifest is not None:
        marks["manifest"] = manifest.stat().st_mtime
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    args = parser.parse_args()

    import httpx

    from bench.load_api import _start_stack, _stop_stack

    home = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    proc, info = _start_stack(home, f"sqlite:///{home / 'harvest.db'}", None)
    rows: list[dict[str, float]] = []
    totals: list[float] = []
    try:
        base, key = info["ACS_API_BASE"], info["ACS_API_KEY"]
        api_url = json.loads((home / "stack.json").read_text())["prefect_api_url"]
        auth = (home / "prefect-auth").read_text().strip()
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
                label = "first (loads the model)" if n == 0 else f"job {n}"
                print(f"   {label}: {seen - submit:.2f} s", flush=True)
                if n == 0:
                    continue
                marks = _marks(home, api_url, auth, job["job_id"], submit, seen)
                rows.append(marks)
                totals.append(seen - submit)
                time.sleep(0.5)  # as a user's next job would come: not on the heels of the last one's answer
    finally:
        _stop_stack(proc)

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
