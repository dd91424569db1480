"""The fleet, side by side in one run: tiny jobs per minute and long-poll wake latency with
1 vs 2 API replicas and 1 vs 2 worker hosts (the topology of tests/topology.py: control plane
and job store on PostgreSQL, S3 on moto's server, worker hosts in network namespaces).

Phases share one fleet: it starts with 2 replicas and 1 worker host; the second host joins for
the last two arms. "1 replica" sends every request to replica A; "2 replicas" alternates
A and B (a load balancer's round robin).

- jobs/min: `--jobs` one-prompt `llama-tiny` jobs submitted at once by as many clients, each
  long-polling its job to `done`; wall time from the first submit to the last `done`.
- wake latency: for each job, the moment its client's long-poll answered `done` minus the
  moment the watcher committed `done` (`completed_at` in the job store; same clock). On
  2 replicas half of the waiters sit on the replica that does not hold the watcher lease, so
  their wake-up crosses PostgreSQL's NOTIFY.

Run (needs root for the namespaces, PostgreSQL on 127.0.0.1:5432):

    .venv/bin/python bench/bench_fleet.py [--jobs 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.topology import Fleet  # noqa: E402


def _one_job(fleet: Fleet, submit_to, wait_on, n: int) -> dict:
    headers = {"Authorization": f"Bearer {fleet.key}"}
    body = {"model": "llama-tiny", "prompts": [f"bench prompt {n}"], "layers": [2]}
    submitted = httpx.post(f"{submit_to.base_url}/harvest", json=body, headers=headers, timeout=120)
    assert submitted.status_code == 202, (submitted.status_code, submitted.text)
    job = submitted.json()
    while True:
        answer = httpx.get(f"{wait_on.base_url}/harvest/{job['job_id']}", params={"wait": 60}, headers=headers, timeout=90)
        woke = datetime.now(timezone.utc)
        state = answer.json()
        if state["status"] in ("done", "failed", "cancelled"):
            return {"status": state["status"], "job_id": job["job_id"], "woke": woke,
                    "on_holder": wait_on.health()["watcher"]}


def _completed_at(fleet: Fleet, job_ids: list[str]) -> dict[str, datetime]:
    with psycopg.connect(fleet.jobs_url.replace("+psycopg", "")) as conn:
        rows = conn.execute("SELECT id, completed_at FROM jobs WHERE id = ANY(%s)", (job_ids,)).fetchall()
    return {job_id: at.replace(tzinfo=timezone.utc) for job_id, at in rows}


def arm(fleet: Fleet, replicas: int, jobs: int) -> dict:
    targets = fleet.replicas[:replicas]
    started = time.monotonic()
    with ThreadPoolExecutor(jobs) as pool:
        # Submit through one replica and wait on the next: with 2, every job crosses replicas.
        futures = [pool.submit(_one_job, fleet, targets[n % replicas], targets[(n + 1) % replicas], n) for n in range(jobs)]
        results = [f.result() for f in futures]
    wall = time.monotonic() - started
    failed = [r for r in results if r["status"] != "done"]
    assert not failed, failed
    done_at = _completed_at(fleet, [r["job_id"] for r in results])
    wakes = [(r["woke"] - done_at[r["job_id"]]).total_seconds() * 1000 for r in results]
    remote = [w for w, r in zip(wakes, results) if not r["on_holder"]]
    return {
        "jobs_per_min": jobs / wall * 60,
        "wall_s": wall,
        "wake_median_ms": statistics.median(wakes),
        "wake_max_ms": max(wakes),
        "wake_remote_median_ms": statistics.median(remote) if remote else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=12)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as root:
        with Fleet(Path(root), replicas_n=2, hosts_n=1, replica_env={"HARVEST_WATCH_INTERVAL_S": "0.5"}) as fleet:
            fleet.key = fleet.create_key("bench", small=args.jobs)
            print(f"fleet up in {fleet.timings['fleet_s']:.0f} s", flush=True)
            arm(fleet, 1, 3)  # warm-up: the host builds the embedded model once
            for hosts in (1, 2):
                if hosts == 2:
                    fleet.add_host()
                    arm(fleet, 1, 3)  # the new host builds its model too
                for replicas in (1, 2):
                    result = arm(fleet, replicas, args.jobs)
                    rows.append((replicas, hosts, result))
                    print(f"{replicas} replica(s), {hosts} host(s): {result}", flush=True)
    print()
    print("| API replicas | worker hosts | jobs/min | wall s | wake median ms | wake max ms | wake median ms, waiter off the lease holder |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for replicas, hosts, r in rows:
        remote = "–" if r["wake_remote_median_ms"] is None else f"{r['wake_remote_median_ms']:.0f}"
        print(f"| {replicas} | {hosts} | {r['jobs_per_min']:.1f} | {r['wall_s']:.1f} | {r['wake_median_ms']:.0f} | "
              f"{r['wake_max_ms']:.0f} | {remote} |")


if __name__ == "__main__":
    main()
