"""The client's manners: a CLI's errors, an idempotent submit, a dataset that iterates vectors,
and manifests that cannot write outside the output folder.

- `harvest-client` against a real API (tests/api_fixtures.py): a wrong key, no base URL and an
  unknown model each print one line on stderr and exit non-zero (2 for usage).
- `POST /v1/harvest` with an `Idempotency-Key`: the same key and request answer the same job,
  another request 409; checked against the API's own list of the key's jobs.
- A harvest killed between the service's answer and saving the job id (the answer held by a
  proxy, `tests.fault_proxy`, while the client is SIGKILLed), then resumed: the service holds
  one job, and the dataset's `for v in ds` yields what `ds[i]` yields (read back with
  safetensors itself).
- A manifest naming `..` or an absolute path (served over real HTTP) is refused before a byte
  is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from harvest_client import ActivationDataset, Client, HarvestClientError, UnsafeManifest
from harvest_client.download import Downloader
from testbed import http_calls
from tests.fault_proxy import FaultProxy

pytest_plugins = ["tests.client_fixtures"]

PREFIX = "harvest-client: error: "


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harvest_client", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120)


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(PREFIX), lines[0]
    return lines[0][len(PREFIX):]


def test_cli_errors_are_one_line_and_a_non_zero_exit_status(api_server, make_key, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The sky is\n")
    bare = {k: v for k, v in os.environ.items() if not k.startswith("ACS_")}
    harvest = ["harvest", "--model", "llama-tiny", "--prompts", corpus, "--quiet"]

    no_base = _cli([*harvest, "--out", tmp_path / "a"], {**bare, "ACS_API_KEY": "sk-anything"})
    assert no_base.returncode == 2 and "ACS_API_BASE" in _one_line(no_base)

    wrong_key = _cli([*harvest, "--out", tmp_path / "b"], {**bare, "ACS_API_BASE": api_server.base_url, "ACS_API_KEY": "sk-wrong"})
    assert wrong_key.returncode == 1 and _one_line(wrong_key).startswith("401 invalid_api_key: ")

    key = make_key(name="cli-manners")
    unknown = _cli(["harvest", "--model", "no-such-model", "--prompts", corpus, "--quiet", "--out", tmp_path / "c"],
                   {**bare, "ACS_API_BASE": api_server.base_url, "ACS_API_KEY": key})
    assert unknown.returncode == 1 and _one_line(unknown).startswith("400 model_not_found: ")

    gone = _cli(["download", str(uuid.uuid4()), "--out", tmp_path / "d"], {**bare, "ACS_API_BASE": api_server.base_url, "ACS_API_KEY": key})
    assert gone.returncode == 1 and _one_line(gone).startswith("404 harvest_job_not_found: ")

    usage = _cli(["harvest", "--model", "llama-tiny"], {**bare, "ACS_API_BASE": api_server.base_url, "ACS_API_KEY": key})
    assert usage.returncode == 2 and "--prompts" in _one_line(usage)

    debug = _cli(["--debug", *harvest, "--out", tmp_path / "e"], {**bare, "ACS_API_BASE": api_server.base_url, "ACS_API_KEY": "sk-wrong"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "invalid_api_key" in debug.stderr


def test_the_same_idempotency_key_answers_the_same_job_and_another_request_409(api_server, make_key):
    key, other = make_key(name="idem-a"), make_key(name="idem-b")
    idem = f"test-{uuid.uuid4()}"
    body = {"model": "llama-tiny", "prompts": ["The sky is", "Grass is"], "layers": [1, 3]}

    def post(api_key: str, payload, **headers) -> httpx.Response:
        content = payload if isinstance(payload, str) else json.dumps(payload)
        return http_calls.post(f"{api_server.base_url}/harvest", content=content, timeout=60,
                               headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", **headers})

    first = post(key, body, **{"Idempotency-Key": idem})
    again = post(key, json.dumps(body, indent=3), **{"Idempotency-Key": idem})  # same request, spaced otherwise
    assert first.status_code == again.status_code == 202, (first.text, again.text)
    assert again.json()["job_id"] == first.json()["job_id"]

    conflict = post(key, {**body, "prompts": ["Another prompt"]}, **{"Idempotency-Key": idem})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_key_reused", conflict.text

    theirs = post(other, body, **{"Idempotency-Key": idem})  # keys are per API key
    assert theirs.status_code == 202 and theirs.json()["job_id"] != first.json()["job_id"]
    too_long = post(key, body, **{"Idempotency-Key": "k" * 300})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "Idempotency-Key"

    listed = http_calls.get(f"{api_server.base_url}/harvest", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert [job["job_id"] for job in listed] == [first.json()["job_id"]]  # one job, whatever was sent


def test_a_harvest_killed_before_saving_its_job_id_resumes_into_the_same_job(client_api, client_env, tmp_path):
    corpus = tmp_path / "corpus.txt"
    prompts = ["The sky is blue", "Grass is", "A third prompt here"]
    corpus.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "dataset"
    key = client_api.make_key(name="idem-resume")
    proxy = FaultProxy(client_api.root).start()
    try:
        held = proxy.add("POST", "/v1/harvest", "hold")
        env = {**client_env(key), "ACS_API_BASE": f"{proxy.url}/v1"}
        proc = subprocess.Popen([sys.executable, "-m", "harvest_client", "harvest", "--model", "llama-tiny", "--prompts",
                                 str(corpus), "--out", str(out), "--layers", "1,3", "--shard-size", "2", "--quiet"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            assert held.reached.wait(120), "the submit never reached the service"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the service made the job; the client never heard
            proc.wait(30)
        held.release()
    finally:
        proxy.stop()
    state = json.loads((out / "harvest.json").read_text())
    assert [part["job_id"] for part in state["parts"]] == [None]  # the id was never saved
    made = http_calls.get(f"{client_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert len(made) == 1

    with Client(client_api.base_url, key) as client:
        summary = client.harvest("llama-tiny", str(corpus), out, layers=[1, 3], shard_size=2, progress=False)
        jobs = client.jobs()
    assert [job["job_id"] for job in jobs] == [made[0]["job_id"]] == summary.job_ids  # no second job

    # `for v in ds` yields what `ds[i]` yields: vectors, in corpus order, as the shards hold them.
    ds = ActivationDataset(out, layer=3)
    vectors = list(ds)
    assert len(vectors) == len(ds) and all(v.shape == (ds.n_features,) for v in vectors)
    assert all(np.array_equal(v, ds[i]) for i, v in enumerate(vectors))
    direct = []
    manifest = json.loads((out / summary_part(out) / "manifest.json").read_text())
    for shard in manifest["shards"]:
        tensors = load_file(str(out / summary_part(out) / shard["file"]))
        first, last = shard["prompt_range"]
        for local in range(first, last + 1):
            rows = tensors[f"prompt_{local}"][manifest["layer_indices"].index(3)].float().numpy()
            direct.append(rows[1 if ds.skip_bos else 0 :])
    np.testing.assert_allclose(np.stack(vectors), np.concatenate(direct), rtol=0, atol=0)
    batch = next(iter(ds.batches(4)))
    assert batch.vectors.shape == (4, ds.n_features)


def summary_part(out: Path) -> str:
    (part,) = [p.name for p in out.glob("part-*")]
    return part


@pytest.fixture
def manifest_server(tmp_path):
    """A plain HTTP server over a folder: what a tampered or buggy service could hand out."""
    root = tmp_path / "served"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("name", ["../escaped.safetensors", "/tmp/escaped.safetensors", "sub/escaped.safetensors", ".."])
def test_manifest_file_names_that_leave_the_output_folder_are_refused(manifest_server, tmp_path, name):
    root, url = manifest_server
    (root / "escaped.safetensors").write_bytes(b"x" * 10)
    manifest = {"shards": [{"file": name, "bytes": 10, "sha256": "0" * 64, "token_counts": [2], "prompt_range": [0, 0]}],
                "bytes_written": 20, "layer_indices": [1]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    harvest = {"job_id": "j", "result": {"manifest_url": f"{url}/manifest.json", "shard_urls": [f"{url}/escaped.safetensors"],
                                         "stats_url": f"{url}/stats.safetensors"}}
    dest = tmp_path / "out" / "part-00000000"
    downloader = Downloader(lambda job_id: harvest, workers=1)
    try:
        with pytest.raises(UnsafeManifest) as refused:
            downloader.start(harvest, dest)
    finally:
        downloader.close(cancel=True)
    assert isinstance(refused.value, HarvestClientError)
    assert not (tmp_path / "out" / "escaped.safetensors").exists()
    assert list(dest.iterdir()) == []  # refused before a byte was written
