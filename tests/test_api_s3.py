"""The API on `s3://` storage against moto's S3 server: the request and the job's files are
written with s3fs, and the result's links are the store's own SigV4 presigned GETs, which
read with no credentials at all. moto does not enforce expiry, so the links' X-Amz-Expires is
checked instead (the HMAC file route's expiry is tested in test_api_jobs.py)."""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlparse

import pytest
from safetensors.torch import load as load_tensors

from testbed import http_calls
from tests.api_fixtures import ApiServer, finish_run, harvest_api_env
from tests.s3_fixtures import BUCKET, CREDENTIALS


@pytest.fixture(scope="module")
def s3_api(harvest_home, tiny, moto_s3):
    env = {
        **harvest_api_env(harvest_home),
        **CREDENTIALS,
        "HARVEST_STORAGE_URL": f"s3://{BUCKET}/service",
        "HARVEST_S3_ENDPOINT_URL": moto_s3.endpoint,
    }
    server = ApiServer(harvest_home, "s3", env).start()
    yield server
    server.stop()


def test_s3_storage_with_presigned_links(s3_api, moto_s3, hf_engine):
    import s3fs

    from harvest.storage import Storage

    key = s3_api.make_key(name="s3")
    auth = {"Authorization": f"Bearer {key}"}
    submitted = http_calls.post(f"{s3_api.base_url}/harvest", headers=auth, timeout=60,
                                json={"model": "llama-tiny", "prompts": ["The sky is", "Grass is"], "layers": [1, 3, 5]})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["job_id"]
    s3 = moto_s3.client
    s3.head_object(Bucket=BUCKET, Key=f"service/jobs/{job_id}/request.json")  # written by the API with s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": moto_s3.endpoint})
    finish_run(s3_api, job_id, hf_engine, storage=Storage(f"s3://{BUCKET}/service", fs, f"{BUCKET}/service"))

    deadline = time.monotonic() + 15
    while (job := http_calls.get(f"{s3_api.base_url}/harvest/{job_id}", headers=auth).json())["status"] != "done":
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    result = job["result"]
    url = urlparse(result["shard_urls"][0])
    query = parse_qs(url.query)
    assert f"{url.scheme}://{url.netloc}" == moto_s3.endpoint
    assert url.path == f"/{BUCKET}/service/jobs/{job_id}/shard_00000.safetensors"
    assert query["X-Amz-Algorithm"] == ["AWS4-HMAC-SHA256"]
    assert 7 * 24 * 3600 - 120 <= int(query["X-Amz-Expires"][0]) <= 7 * 24 * 3600

    # Plain HTTP, no key and no AWS credentials, as curl or a browser would.
    shard = load_tensors(http_calls.get(result["shard_urls"][0], timeout=30).content)
    assert str(shard["prompt_0"].dtype) == "torch.bfloat16" and shard["prompt_0"].shape[0] == 3
    assert shard["tokens_0"].shape[0] == shard["prompt_0"].shape[1]
    manifest = http_calls.get(result["manifest_url"], timeout=30).json()
    assert manifest["job_id"] == job_id and manifest["layer_indices"] == [1, 3, 5]
    assert job["tokens"] == manifest["tokens"]

    # A second read within the replica's reuse window hands back the same signed links
    # (api.links.LinkCache: signing 4,098 S3 links costs ~0.75 s of CPU per read); they
    # still work, and their expiry is the one the result states.
    again = http_calls.get(f"{s3_api.base_url}/harvest/{job_id}", headers=auth).json()
    assert again["result"]["shard_urls"] == result["shard_urls"] and again["urls_expire_at"] == job["urls_expire_at"]
    assert http_calls.get(again["result"]["shard_urls"][0], timeout=30).content == http_calls.get(result["shard_urls"][0], timeout=30).content


def test_s3_done_job_holds_what_the_bucket_lists(s3_api, moto_s3, hf_engine):
    """On S3 a done job's bytes held (its key's storage quota) are its objects' sizes as the
    bucket lists them: shards, statistics, manifest, request and `_parts/` records alike."""
    import s3fs
    from sqlalchemy import select

    from api.db import jobs
    from api.store import key_usage
    from harvest.storage import Storage

    key = s3_api.make_key(name="s3-held")
    auth = {"Authorization": f"Bearer {key}"}
    submitted = http_calls.post(f"{s3_api.base_url}/harvest", headers=auth, timeout=60, json={
        "model": "llama-tiny", "prompts": ["The sky is blue and the grass is green. " * 60, "Grass is"], "layers": [1, 3],
    })
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["job_id"]
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": moto_s3.endpoint})
    finish_run(s3_api, job_id, hf_engine, storage=Storage(f"s3://{BUCKET}/service", fs, f"{BUCKET}/service"))
    deadline = time.monotonic() + 15
    while http_calls.get(f"{s3_api.base_url}/harvest/{job_id}", headers=auth).json()["status"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.2)

    s3 = moto_s3.client
    objects = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"service/jobs/{job_id}/")
               for o in page.get("Contents", [])]
    listed = sum(o["Size"] for o in objects)
    assert any("/_parts/" in o["Key"] for o in objects) and any(o["Key"].endswith("/request.json") for o in objects)
    engine = s3_api.engine()
    try:
        with engine.connect() as conn:
            key_id = conn.execute(select(jobs.c.key_id).where(jobs.c.id == job_id)).scalar_one()
            held = key_usage(conn, key_id, retention_days=30)["bytes_held"]
    finally:
        engine.dispose()
    assert listed > 0 and abs(held - listed) <= listed // 100, (held, listed)
