"""The dataset folder a harvest writes, and the state that makes calling again a resume.

    <out>/harvest.json                   the plan: request fields, corpus fingerprint, and per part
                                         its prompt range, job id and status (rewritten atomically
                                         after every change, so a kill at any moment leaves it whole)
    <out>/part-00000000/                 one folder per job, named after its first prompt's index
                                         (so a job split late keeps every other name), holding the
                                         service's own layout:
        shard_00000.safetensors …        verified against the manifest's sha256 before being named
        shard_00001.safetensors.partial  a download under way (resumed with an HTTP Range)
        stats.safetensors
        manifest.json                    written LAST, after every other file verified: its
                                         presence means the part is complete (as on the service)
    <out>/index.parquet                  global prompt index → part, job id, shard file, key, n_tokens

A scheduled corpus refresh writes the same shape (`corpus/<name>/<date>/part-0000/`, one job
per folder): `ActivationDataset` reads either, taking the part folders in name order.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["STATE", "INDEX", "MANIFEST", "STATS", "PartState", "HarvestState", "DatasetFolder", "write_atomic", "write_index"]

STATE = "harvest.json"
INDEX = "index.parquet"
MANIFEST = "manifest.json"
STATS = "stats.safetensors"
PARTIAL = ".partial"


def write_atomic(path: Path, data: bytes) -> None:
    """Write then rename: a reader (or a resumed run) sees the old file or the new, never half."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)


@dataclass
class PartState:
    start: int
    stop: int
    """Prompts `[start, stop)` of the corpus."""
    job_id: str | None = None
    status: str = "planned"
    """planned → submitted → done (downloaded and verified); failed / cancelled jobs go back to
    planned on the next call, so they are submitted again."""
    error: str | None = None
    attempt: int = 0
    """How many jobs of this part ended badly before; part of its idempotency key, so a part
    submitted again after a failure makes a new job while a resumed submit finds the old one."""

    @property
    def n_prompts(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        """Its folder: `part-<first prompt index, 8 digits>`."""
        return f"part-{self.start:08d}"


@dataclass
class HarvestState:
    fingerprint: str
    n_prompts: int
    request: dict
    parts: list[PartState] = field(default_factory=list)
    version: int = 1

    @classmethod
    def from_json(cls, data: dict) -> "HarvestState":
        return cls(**{**data, "parts": [PartState(**p) for p in data["parts"]]})


class DatasetFolder:
    """Names and state of one harvest's output folder (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def part_dir(self, part: PartState) -> Path:
        return self.root / part.name

    def idempotency_key(self, state: "HarvestState", part: PartState) -> str:
        """The `Idempotency-Key` of the part's submit: from the plan alone (corpus fingerprint,
        prompt range, attempt), so a harvest killed between the service's answer and saving
        the job id submits again with the same key and gets the same job back."""
        return f"harvest-client-{state.fingerprint[:32]}-{part.start}-{part.stop}-{part.attempt}"

    @property
    def state_path(self) -> Path:
        return self.root / STATE

    @property
    def index_path(self) -> Path:
        return self.root / INDEX

    def load_state(self) -> HarvestState | None:
        if not self.state_path.exists():
            return None
        return HarvestState.from_json(json.loads(self.state_path.read_text()))

    def save_state(self, state: HarvestState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.state_path, json.dumps(asdict(state), indent=1).encode())

    def part_complete(self, part: PartState) -> bool:
        return (self.part_dir(part) / MANIFEST).exists()


def write_index(folder: DatasetFolder, state: HarvestState) -> Path:
    """`index.parquet`: one row per prompt of the corpus, read from the parts' manifests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, list] = {"prompt": [], "part": [], "job_id": [], "shard": [], "key": [], "n_tokens": []}
    for part in state.parts:
        manifest = json.loads((folder.part_dir(part) / MANIFEST).read_text())
        for shard in manifest["shards"]:
            first, last = shard["prompt_range"]
            for local, n_tokens in zip(range(first, last + 1), shard["token_counts"], strict=True):
                columns["prompt"].append(part.start + local)
                columns["part"].append(part.name)
                columns["job_id"].append(part.job_id)
                columns["shard"].append(shard["file"])
                columns["key"].append(f"prompt_{local}")
                columns["n_tokens"].append(n_tokens)
    table = pa.table({
        "prompt": pa.array(columns["prompt"], pa.int64()),
        "part": columns["part"],
        "job_id": columns["job_id"],
        "shard": columns["shard"],
        "key": columns["key"],
        "n_tokens": pa.array(columns["n_tokens"], pa.int32()),
    })
    staging = folder.index_path.with_name(INDEX + ".tmp")
    pq.write_table(table, staging)
    os.replace(staging, folder.index_path)
    return folder.index_path
