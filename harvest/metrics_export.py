"""A host's `/metrics`: what its processes counted, their memory, and who may read it.

    fresh_directory(path)              a role's empty counts directory (PROMETHEUS_MULTIPROC_DIR)
    host_registry(directory, processes, extra)
                                       the registry a role exposes: the counts (summed over the
                                       directory's files, or this process's own without one),
                                       memory per process kind, and the role's own collectors
    exposition(registry)               the text format and its content type
    metrics_token(settings), authorized(header, token)
                                       the bearer token every `/metrics` requires

Why a token: `/metrics` tells whoever reads it which models run, how busy each lane is and
how much memory each process holds, and the API listens where researchers reach it, so
"bound to loopback" cannot protect it there. One operator secret (HARVEST_METRICS_TOKEN, else
one generated into `<home>/metrics-token`, owner-only) guards every exporter: researchers' API
keys never open it, and Prometheus sends it as `Authorization: Bearer …`. A worker host's
exporter also binds 127.0.0.1 unless told otherwise (`harvest worker --metrics-host`).

Counts of processes that ended stay counted: a counter file of a dead process is folded into one
archive file per type (`counter_archive.db`, `histogram_archive.db`) and removed, under the same
lock as the scrape, so a host that ran ten thousand jobs reads a handful of files per scrape,
not ten thousand (prometheus_client keeps one file per process id and never removes them).
"""

from __future__ import annotations

import glob
import hmac
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from harvest.metrics import PROCESS_MAX_RESIDENT_BYTES, PROCESS_RESIDENT_BYTES, PROCESSES
from harvest.private_files import write_private

__all__ = [
    "fresh_directory", "DirectoryCounts", "ProcessMemory", "process_tree", "host_registry", "exposition",
    "metrics_token", "authorized", "TOKEN_FILE",
]

TOKEN_FILE = "metrics-token"
"""Under HARVEST_HOME: the generated metrics token, when HARVEST_METRICS_TOKEN is not set."""
_FOLDED = ("counter", "histogram")  # the types whose dead files are folded (the service keeps no mmap gauges)


def fresh_directory(path: Path) -> Path:
    """`path`, created, with no counts in it: a role starting afresh starts its counters at 0
    (Prometheus reads a restart as a counter reset), never on a previous run's files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.db"):
        old.unlink(missing_ok=True)
    return path


class DirectoryCounts:
    """prometheus_client's `MultiProcessCollector` over `directory`, folding the files of
    processes that have ended into an archive first (module docstring)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()

    def collect(self):
        with self._lock:
            self.fold_dead()
            files = glob.glob(os.path.join(self.directory, "*.db"))
            return list(MultiProcessCollector.merge(files, accumulate=True))

    def fold_dead(self) -> int:
        """Fold the counter and histogram files of ended processes into the archives; returns
        how many files it removed."""
        removed = 0
        for kind in _FOLDED:
            dead = [path for path in self.directory.glob(f"{kind}_*.db") if _ended(path.stem.split("_", 1)[1])]
            if not dead:
                continue
            archive = self.directory / f"{kind}_archive.db"
            sources = [str(p) for p in dead] + ([str(archive)] if archive.exists() else [])
            merged = MultiProcessCollector.merge(sources, accumulate=False)
            staging = self.directory / f".{kind}_archive.tmp"  # not *.db: never read half-written
            staging.unlink(missing_ok=True)
            values = MmapedDict(str(staging))
            try:
                for metric in merged:
                    for sample in metric.samples:
                        key = mmap_key(metric.name, sample.name, list(sample.labels), list(sample.labels.values()), metric.documentation)
                        values.write_value(key, sample.value, sample.timestamp or 0.0)
            finally:
                values.close()
            os.replace(staging, archive)
            for path in dead:
                path.unlink(missing_ok=True)
            removed += len(dead)
        return removed


def _ended(pid: str) -> bool:
    """True when the process whose counts file this is has ended (a zombie has)."""
    if not pid.isdigit():
        return False  # the archive itself
    try:
        return psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


class ProcessMemory:
    """Resident memory per kind of process, read at scrape time: `processes()` names the
    host's processes of interest as (kind, psutil.Process) pairs."""

    def __init__(self, processes: Callable[[], Iterable[tuple[str, psutil.Process]]]):
        self.processes = processes

    def collect(self):
        total: dict[str, int] = defaultdict(int)
        largest: dict[str, int] = defaultdict(int)
        count: dict[str, int] = defaultdict(int)
        for kind, process in self.processes():
            try:
                rss = process.memory_info().rss
            except psutil.Error:
                continue  # ended between the listing and now
            total[kind] += rss
            largest[kind] = max(largest[kind], rss)
            count[kind] += 1
        families = (
            (PROCESS_RESIDENT_BYTES, "Resident memory of this host's processes of each kind, summed, bytes.", total),
            (PROCESS_MAX_RESIDENT_BYTES, "Resident memory of the largest process of each kind, bytes.", largest),
            (PROCESSES, "Processes of each kind running on this host.", count),
        )
        for name, documentation, values in families:
            family = GaugeMetricFamily(name, documentation, labels=["process"])
            for kind in sorted(values):
                family.add_metric([kind], values[kind])
            yield family


def process_tree(root: psutil.Process) -> list[psutil.Process]:
    """`root` and every process under it (none if it has ended)."""
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class _Default:
    """This process's own default registry, as one collector of another registry."""

    def collect(self):
        return REGISTRY.collect()


def host_registry(
    directory: Path | None,
    processes: Callable[[], Iterable[tuple[str, psutil.Process]]],
    extra: Iterable[object] = (),
) -> CollectorRegistry:
    """What a role's `/metrics` exposes: the counts of every process that wrote to
    `directory` (None: this process's own, from its default registry, which also has the
    standard `process_*` figures), the memory of `processes()` by kind, and `extra` collectors."""
    registry = CollectorRegistry(auto_describe=False)
    if directory is not None:
        registry.register(DirectoryCounts(directory))
        ProcessCollector(registry=registry)  # `process_*` of the exporting process itself
    else:
        registry.register(_Default())
    registry.register(ProcessMemory(processes))
    for collector in extra:
        registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus' text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def metrics_token(settings) -> str:
    """The bearer token of every `/metrics` of this host: HARVEST_METRICS_TOKEN, else one
    generated once into `<home>/metrics-token` (0600; the first process to write it wins)."""
    if settings.metrics_token:
        return settings.metrics_token
    import secrets

    path = Path(settings.home) / TOKEN_FILE
    write_private(path, secrets.token_urlsafe(32), replace=False)
    return path.read_text().strip()


def authorized(authorization: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries the metrics token (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
