"""The researcher's side of infra/compose-smoke.sh, run in a container on the fleet's network
(the api image: httpx, boto3, psycopg), so it reaches the replicas, S3 and the job store by
their compose names, as the presigned links name them.

    python compose_smoke_client.py roundtrip            submit via api-1; long-poll, read and
                                                        download via api-2; sha256 vs manifest
    python compose_smoke_client.py submit N             submit N prompts (one shard each) via
                                                        api-1; prints the job id
    python compose_smoke_client.py running JOB SHARDS   wait until the job has SHARDS shards in
                                                        S3; prints the hostname of its worker
    python compose_smoke_client.py survives JOB VICTIM N  right after VICTIM was killed: the job
                                                        (N prompts) ends done elsewhere, no
                                                        shard written again, charged once
    python compose_smoke_client.py done JOB             long-poll via api-2 until done

Environment: API_1, API_2 (…/v1), KEY, JOBS_DB (psycopg URL), S3_ENDPOINT, S3_BUCKET, S3_PREFIX,
AWS credentials, PREFECT_API_URL, PREFECT_API_AUTH_STRING. Lines starting `SMOKE ` are figures.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time

import boto3
import httpx
import psycopg

__all__ = ["main"]

API_1, API_2 = os.environ["API_1"], os.environ["API_2"]
AUTH = {"Authorization": f"Bearer {os.environ['KEY']}"}
BUCKET, PREFIX = os.environ["S3_BUCKET"], os.environ["S3_PREFIX"]
S3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT"])
TERMINAL = ("done", "failed", "cancelled")


def figure(name: str, value) -> None:
    print(f"SMOKE {name}={value}", flush=True)


def submit(prompts: list[str], shard_size: int = 1) -> dict:
    body = {"model": "llama-tiny", "prompts": prompts, "layers": [2, 5], "shard_size": shard_size}
    response = httpx.post(f"{API_1}/harvest", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 202, response.text
    return response.json()


def read(api: str, job_id: str, wait: float = 0) -> dict:
    response = httpx.get(f"{api}/harvest/{job_id}", params={"wait": wait} if wait else None, headers=AUTH, timeout=wait + 60)
    assert response.status_code == 200, response.text
    return response.json()


def until_terminal(job_id: str, timeout: float = 1500) -> dict:
    """Long-polls through the other replica (api-2) until the job ends."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            body = read(API_2, job_id, wait=30)
        except httpx.HTTPError:  # a replica restarting under us: ask again
            time.sleep(1)
            continue
        if body["status"] in TERMINAL:
            return body
        assert time.monotonic() < deadline, f"job {job_id} still {body['status']} after {timeout:.0f} s"


def objects(job_id: str) -> dict[str, str]:
    listing = S3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/jobs/{job_id}/")
    return {o["Key"].rsplit("/", 1)[-1]: o["LastModified"].isoformat() for o in listing.get("Contents", [])}


def charged(job_id: str) -> int:
    with psycopg.connect(os.environ["JOBS_DB"]) as conn:
        return conn.execute("SELECT tokens FROM jobs WHERE id = %s", (job_id,)).fetchone()[0]


def prefect(path: str) -> dict:
    token = base64.b64encode(os.environ["PREFECT_API_AUTH_STRING"].encode()).decode()
    response = httpx.get(f"{os.environ['PREFECT_API_URL']}{path}", headers={"Authorization": f"Basic {token}"}, timeout=30)
    response.raise_for_status()
    return response.json()


def run_host(run_id: str) -> str:
    """The hostname of the worker that took the run (workers are named <hostname>-<lane>-<pid>)."""
    worker = prefect(f"/flow_runs/{run_id}")["labels"].get("prefect.worker.name", "")
    return worker.rsplit("-", 2)[0]


def download_and_check(body: dict) -> int:
    """Every file through the presigned links: the shards' sha256 and sizes as the manifest says."""
    links = body["result"]
    manifest = httpx.get(links["manifest_url"], timeout=60)
    assert manifest.status_code == 200, manifest.text
    manifest = manifest.json()
    assert len(links["shard_urls"]) == len(manifest["shards"]), (len(links["shard_urls"]), len(manifest["shards"]))
    for url, shard in zip(links["shard_urls"], manifest["shards"]):
        data = httpx.get(url, timeout=60).content
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"], shard["file"]
    return len(manifest["shards"])


def roundtrip() -> None:
    started = time.monotonic()
    prompts = [f"The compose fleet harvests prompt number {i}." for i in range(4)]
    job = submit(prompts)
    body = until_terminal(job["job_id"])
    assert body["status"] == "done", body
    body = read(API_2, job["job_id"])  # a plain read through the other replica
    shards = download_and_check(body)
    manifest = json.loads(S3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/jobs/{job['job_id']}/manifest.json")["Body"].read())
    assert charged(job["job_id"]) == manifest["tokens"] > 0, (charged(job["job_id"]), manifest["tokens"])
    figure("roundtrip_s", f"{time.monotonic() - started:.1f}")
    figure("roundtrip_shards", shards)


def running(job_id: str, shards: int) -> None:
    deadline = time.monotonic() + 600
    while sum(1 for n in objects(job_id) if n.startswith("shard_")) < shards:
        assert time.monotonic() < deadline, f"{shards} shards were never written"
        body = read(API_1, job_id)
        assert body["status"] not in TERMINAL, f"job ended before {shards} shards: {body['status']}"
        time.sleep(0.3)
    print(run_host(read(API_1, job_id)["run_id"]), flush=True)


def survives(job_id: str, victim: str, prompts: int) -> None:
    killed = time.monotonic()
    before = {n: t for n, t in objects(job_id).items() if n.startswith("shard_")}
    body = until_terminal(job_id)
    assert body["status"] == "done", body
    figure("recovery_s", f"{time.monotonic() - killed:.1f}")
    after = objects(job_id)
    rewritten = [n for n, t in before.items() if after.get(n) != t]
    assert not rewritten, f"shards written again after the kill: {rewritten}"
    manifest = json.loads(S3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/jobs/{job_id}/manifest.json")["Body"].read())
    assert len(manifest["shards"]) == prompts, (len(manifest["shards"]), prompts)
    assert charged(job_id) == manifest["tokens"] > 0, (charged(job_id), manifest["tokens"])
    run_id = body["run_id"]
    run = prefect(f"/flow_runs/{run_id}")
    host = run_host(run_id)
    assert host != victim, f"the run ended on {host}, the killed host"
    assert run["run_count"] >= 2, run["run_count"]
    download_and_check(read(API_2, job_id))
    figure("kill_shards_before", len(before))
    figure("kill_shards_total", len(manifest["shards"]))
    figure("kill_run_count", run["run_count"])


def done(job_id: str) -> None:
    started = time.monotonic()
    body = until_terminal(job_id)
    assert body["status"] == "done", body
    download_and_check(read(API_2, job_id))
    figure("done_after_s", f"{time.monotonic() - started:.1f}")
    figure("done_run_count", prefect(f"/flow_runs/{body['run_id']}")["run_count"])


def main(argv: list[str]) -> int:
    command, args = argv[1], argv[2:]
    if command == "roundtrip":
        roundtrip()
    elif command == "submit":
        n = int(args[0])
        print(submit([f"A long compose smoke job, prompt {i} of {n}, to be interrupted." for i in range(n)])["job_id"], flush=True)
    elif command == "running":
        running(args[0], int(args[1]))
    elif command == "survives":
        survives(args[0], args[1], int(args[2]))
    elif command == "done":
        done(args[0])
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
