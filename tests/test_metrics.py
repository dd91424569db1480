"""Prometheus metrics: counts move by a real job's own figures, `/metrics` refuses without the
token, counts of ended processes survive their folding, and the dashboard and the scrape
configuration name only what the service exports.

The job runs on the session's stack (`client_api` on the real Prefect server and lane workers,
whose hosts serve `/metrics` as `harvest worker` does: `tests.prefect_fixtures.LaneWorkers`).
Expositions are parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testbed import http_calls

pytest_plugins = ["tests.client_fixtures"]

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "infra"
PROMPTS = ["The sky is", "Grass is green and", "A metric is a number", "Counters only go up",
           "Histograms have buckets", "Six prompts make three shards"]


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and want <= have)


def scrape(url: str, token: str) -> dict:
    response = http_calls.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


@pytest.fixture(scope="module")
def token(harvest_home: Path) -> str:
    """The metrics token as an operator reads it: the session home's generated file."""
    from harvest.metrics_export import metrics_token
    from harvest.settings import get_settings

    return metrics_token(get_settings())


def _refused(url: str, **headers: str) -> None:
    response = http_calls.get(url, headers=headers, timeout=30)
    assert response.status_code == 401, (response.status_code, response.text[:200])
    assert "harvest_" not in response.text


# --- the stack -----------------------------------------------------------------------------------


def test_metrics_refuse_without_the_token(client_api, lane_workers, token):
    api = f"{client_api.root}/metrics"
    key = client_api.make_key()
    _refused(api)
    _refused(api, Authorization=f"Bearer {key}")  # a researcher's API key does not open it
    _refused(api, Authorization=f"Bearer {token}x")
    _refused(api, Authorization=f"Basic {token}")
    assert http_calls.get(api, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200

    exporter = lane_workers.exporters[lane_workers.small]
    assert exporter.server.server_address[0] == "127.0.0.1"  # this host only, by default
    _refused(exporter.url)
    _refused(exporter.url, Authorization=f"Bearer {key}")
    assert http_calls.get(exporter.url, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
    # From another address of this host (what another machine reaches), nothing listens.
    outside = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
    assert outside, "this host has no address besides loopback to try"
    with pytest.raises(OSError):
        socket.create_connection((outside[0], exporter.port), timeout=5).close()


def test_counts_move_by_the_jobs_own_figures(client_api, lane_workers, token, tiny):
    from transformers import AutoTokenizer

    api_metrics = f"{client_api.root}/metrics"
    exporters = [e for worker, e in lane_workers.exporters.items() if worker.alive()]
    api_before = scrape(api_metrics, token)
    hosts_before = [scrape(e.url, token) for e in exporters]

    key = client_api.make_key()
    auth = {"Authorization": f"Bearer {key}"}
    made: Counter = Counter()
    with httpx.Client(base_url=client_api.base_url, headers=auth, timeout=90) as http:
        submitted = http.post("/harvest", json={"model": "llama-tiny", "prompts": PROMPTS, "layers": [1, 3], "shard_size": 2})
        made[("POST", "/v1/harvest", str(submitted.status_code))] += 1
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["job_id"]
        for _ in range(10):
            read = http.get(f"/harvest/{job_id}", params={"wait": 30})
            made[("GET", "/v1/harvest/{job_id}", str(read.status_code))] += 1
            assert read.status_code == 200, read.text
            if read.json()["status"] not in ("pending", "running"):
                break
        assert read.json()["status"] == "done", read.json()

    api_after = scrape(api_metrics, token)
    hosts_after = [scrape(e.url, token) for e in exporters]

    def host_delta(name: str, **labels: str) -> float:
        return sum(total(a, name, **labels) - total(b, name, **labels) for a, b in zip(hosts_after, hosts_before))

    # The job's own figures: its manifest, its files on disk, its prompts tokenized here.
    folder = client_api.home / "storage" / "jobs" / job_id
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = sum((folder / shard["file"]).stat().st_size for shard in manifest["shards"])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.require_path()))
    tokens = sum(len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS)
    assert manifest["tokens"] == manifest["timings"]["real_tokens"] == tokens

    assert host_delta("harvest_tokens_total", lane="small") == tokens
    assert host_delta("harvest_shard_bytes_written_total", lane="small") == on_disk == sum(s["bytes"] for s in manifest["shards"])
    assert host_delta("harvest_forward_seconds_total", lane="small") == pytest.approx(manifest["timings"]["forward_s"], abs=1e-3)
    assert host_delta("harvest_run_start_seconds_count", lane="small") == 1  # one run (3 shards: no scale-out)
    assert host_delta("harvest_tokens_total", lane="large") == 0
    loads = host_delta("harvest_engine_loads_total", model="llama-tiny")
    assert loads == (0 if manifest["engine"]["warm"] == "true" else 1), manifest["engine"]

    # The API: exactly the requests made, by route template and status, each timed once.
    for (method, route, status), n in made.items():
        labels = {"method": method, "route": route, "status": status}
        assert total(api_after, "harvest_http_requests_total", **labels) - total(api_before, "harvest_http_requests_total", **labels) == n
    for method, route in {(m, r) for m, r, _ in made}:
        timed = (total(api_after, "harvest_http_request_duration_seconds_count", method=method, route=route)
                 - total(api_before, "harvest_http_request_duration_seconds_count", method=method, route=route))
        assert timed == sum(n for (m, r, _), n in made.items() if (m, r) == (method, route))
    assert not any(name == "harvest_http_requests_total" and job_id in dict(labels).get("route", "")
                   for name, labels in api_after)  # never the raw path
    assert total(api_after, "harvest_jobs", lane="small", status="done") - total(api_before, "harvest_jobs", lane="small", status="done") == 1
    assert total(api_after, "harvest_queue_depth", lane="small") == 0

    # Memory by kind: the replica's own (near what the kernel says), the host's processes.
    rss = psutil.Process(client_api.process.pid).memory_info().rss
    assert 0.5 * rss < total(api_after, "harvest_process_resident_bytes", process="api") < 2 * rss
    small = hosts_after[exporters.index(lane_workers.exporters[lane_workers.small])]
    assert total(small, "harvest_processes", process="run_starter") == 1
    assert total(small, "harvest_processes", process="prefect_worker") == 1
    assert total(small, "harvest_processes", process="engine_server") >= 1
    assert total(small, "harvest_process_max_resident_bytes", process="engine_server") > 50 << 20  # a loaded model


# --- ended processes' counts ---------------------------------------------------------------------

_COUNTING = """
import sys
from harvest.metrics import RUN_START_SECONDS, count_forward, count_shard_written
from harvest.settings import get_settings
count_forward("small", int(sys.argv[1]), 0.25)
count_shard_written("small", int(sys.argv[2]))
RUN_START_SECONDS.labels("small").observe(float(sys.argv[3]))
if len(sys.argv) > 4:
    import time
    from harvest.engines.choice import load_engine
    from harvest.engines.limits import EngineLimits
    from harvest.registry import load_registry
    started = time.perf_counter()
    load_engine(load_registry(get_settings()).get("llama-tiny"), "hf", EngineLimits())
    print(time.perf_counter() - started)
"""


def _count_in_a_process(directory: Path, *args: str) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _COUNTING, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_counts_of_ended_processes_are_folded_not_lost(tmp_path: Path, tiny):
    from harvest.metrics_export import DirectoryCounts, exposition, fresh_directory, host_registry

    directory = fresh_directory(tmp_path / "counts")
    took = float(_count_in_a_process(directory, "100", "4096", "0.3", "load"))
    _count_in_a_process(directory, "23", "1000", "7")
    assert len(list(directory.glob("counter_*.db"))) == 2

    registry = host_registry(directory, lambda: [("test", psutil.Process())])
    first = parse(exposition(registry)[0].decode())
    assert sorted(p.name for p in directory.glob("*.db")) == ["counter_archive.db", "histogram_archive.db"]
    assert total(first, "harvest_tokens_total", lane="small") == 123
    assert total(first, "harvest_shard_bytes_written_total", lane="small") == 5096
    assert total(first, "harvest_forward_seconds_total", lane="small") == 0.5
    assert total(first, "harvest_run_start_seconds_count", lane="small") == 2
    assert total(first, "harvest_run_start_seconds_bucket", lane="small", le="0.5") == 1
    assert total(first, "harvest_run_start_seconds_bucket", lane="small", le="+Inf") == 2
    assert total(first, "harvest_engine_loads_total", model="llama-tiny", engine="hf", lane="small") == 1
    assert 0 < total(first, "harvest_engine_load_seconds_sum", model="llama-tiny") <= took
    assert total(first, "harvest_processes", process="test") == 1

    # A later process adds to the archive; folding again loses and doubles nothing.
    _count_in_a_process(directory, "7", "4", "0.1")
    again = parse(exposition(registry)[0].decode())
    assert total(again, "harvest_tokens_total", lane="small") == 130
    assert total(again, "harvest_shard_bytes_written_total", lane="small") == 5100
    assert total(again, "harvest_run_start_seconds_count", lane="small") == 3
    assert total(again, "harvest_engine_loads_total") == 1
    assert DirectoryCounts(directory).fold_dead() == 0

    def counts(samples: dict) -> dict:
        return {k: v for k, v in samples.items() if k[0].startswith("harvest_") and not k[0].startswith("harvest_process")}

    assert counts(parse(exposition(registry)[0].decode())) == counts(again)


# --- the dashboard and the scrape configuration --------------------------------------------------


def _exported() -> set[str]:
    """Every sample name the service's exporters can produce."""
    from prometheus_client import ProcessCollector

    import harvest.metrics as metrics
    from prometheus_client.metrics import MetricWrapperBase

    names = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                kind = family.type
                suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}[kind]
                names |= {family.name + suffix for suffix in suffixes}
    names |= {metrics.JOBS, metrics.QUEUE_DEPTH, metrics.LONGPOLL_WAITERS, metrics.LONGPOLL_SLOTS, metrics.PROCESS_RESIDENT_BYTES,
              metrics.PROCESS_MAX_RESIDENT_BYTES, metrics.PROCESSES}
    names |= {sample.name for family in ProcessCollector(registry=None).collect() for sample in family.samples}
    return names


_PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "without", "rate", "increase", "delta", "histogram_quantile", "le",
                 "on", "ignoring", "and", "or", "unless", "bool", "count"}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w not in _PROMQL_WORDS}


def test_the_dashboard_is_grafana_and_names_only_exported_metrics():
    import harvest.metrics as metrics

    dashboard = json.loads((INFRA / "grafana" / "harvest.json").read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and dashboard["uid"]
    exported = _exported()
    shown = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["type"] == "timeseries" and panel["title"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and target["expr"]
            names = _metric_names(target["expr"])
            assert names and names <= exported, (panel["title"], names - exported)
            shown |= names
    # Every metric of the service has a panel.
    families = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in shown}
    for value in vars(metrics).values():
        name = getattr(value, "_name", value if isinstance(value, str) and value.startswith("harvest_") else None)
        if name:
            assert name in families, f"no panel shows {name}"


def test_prometheus_scrapes_every_role_with_the_token():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]
    overlay = yaml.safe_load((INFRA / "compose.metrics.yaml").read_text())["services"]
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    targets = {}
    for job in config["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "/prometheus/metrics-token"}
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.split(":")
                targets[host] = int(port)
    for name, service in compose.items():
        command = [str(c) for c in service.get("command") or []]
        if command[:2] == ["harvest", "api"]:
            assert targets.get(name) == int(command[command.index("--port") + 1]), name
        elif command[:2] == ["harvest", "worker"]:
            assert command[command.index("--metrics-host") + 1] == "0.0.0.0"  # the compose network, never published
            assert targets.get(name) == int(command[command.index("--metrics-port") + 1]), name
            assert not any(str(targets[name]) in str(p) for p in service.get("ports") or [])
        else:
            continue
        assert "HARVEST_METRICS_TOKEN" in service["environment"], name
    prometheus = overlay["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "/prometheus/metrics-token" in prometheus["command"][0] and "METRICS_TOKEN" in prometheus["environment"]
    assert "./grafana/harvest.json:/var/lib/grafana/dashboards/harvest.json:ro" in overlay["grafana"]["volumes"]
    assert all(str(p).startswith("127.0.0.1:") for s in overlay.values() for p in s.get("ports", []))
