"""One harvest job, from resolved request to files: shards, statistics, manifest last.

The work is split so orchestration can spread it out: `run_shards` writes any range of shards
(`harvest.shard.writing`: skipping those already written and verified, each shard's write
behind the next shard's forward pass), and `finalize` merges the shards' statistics partials
and writes `stats.safetensors` then `manifest.json`, listing each shard as stored. `run_job`
does both in one process, which is what `harvest run` uses; the flow drives the same steps
with its Prefect tasks (`tasks.shards`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from safetensors.torch import save as save_tensors

from harvest.engines.base import Engine, EngineLoad
from harvest.jobfiles import JobFiles
from harvest.layers import RESIDUAL_STREAM_CONVENTION
from harvest.manifest import STATS, Manifest, ModelEntry, PromptEntry, statistics_sentence
from harvest.request import ResolvedJob, check_token_total
from harvest.shard.layout import shard_ranges
from harvest.shard.writing import run_shards, stored_records
from harvest.storage import Storage
from harvest.timings import Timings
from harvest.tokenize import TokenizedPrompt, added_bos_token_id, load_tokenizer, tokenize_prompts

__all__ = ["JobSummary", "tokenize_job", "finalize", "run_job"]

logger = logging.getLogger(__name__)


@dataclass
class JobSummary:
    n_shards: int
    tokens: int
    bytes_written: int
    timings: Timings = field(default_factory=Timings)
    shards_skipped: int = 0

    def as_dict(self) -> dict:
        return {
            "n_shards": self.n_shards,
            "tokens": self.tokens,
            "bytes_written": self.bytes_written,
            "timings": self.timings.as_dict(),
            "shards_skipped": self.shards_skipped,
        }


def tokenize_job(job: ResolvedJob) -> list[TokenizedPrompt]:
    tokenizer = load_tokenizer(job.model.require_path())
    tokenized = tokenize_prompts(
        tokenizer, job.request.prompts, add_special_tokens=job.request.add_special_tokens, max_len=job.model.max_model_len
    )
    check_token_total(sum(len(t.ids) for t in tokenized))
    return tokenized


def finalize(
    job: ResolvedJob,
    storage: Storage,
    engine_entry: dict[str, str],
    job_id: str,
    *,
    timings: Timings | None = None,
    tokenized: list[TokenizedPrompt] | None = None,
    writer: str | None = None,
) -> JobSummary:
    """Merge every shard's statistics, write stats.safetensors, then the manifest, last.

    The manifest lists each shard's sha256 as stored now, not as its record says
    (`stored_records`). `timings` (of the shard work, possibly summed over workers) go into
    the manifest with the time spent here added, so whoever reads the manifest has the whole
    job's summary. `writer` (the flow attempt's token) goes into the manifest, so a failing
    attempt removes only a manifest of its own (`JobFiles.discard_manifest`).
    """
    timings = timings or Timings()
    tokenized = tokenized or tokenize_job(job)
    started = time.perf_counter()
    records, stats = stored_records(job, storage, len(shard_ranges(len(tokenized), job.request.shard_size)))
    timings.save_s += time.perf_counter() - started

    started = time.perf_counter()
    stats_bytes = save_tensors(stats.export(job.layers))
    storage.write_bytes(STATS, stats_bytes)
    timings.upload_s += time.perf_counter() - started
    norms = stats.mean_token_norm.tolist()
    manifest = Manifest(
        job_id=job_id,
        model=ModelEntry(name=job.model.name, weights=job.model.weights,
                         **(job.model.architecture.describe() if job.model.architecture else {})),
        layer_indices=job.layers,
        residual_stream_convention=RESIDUAL_STREAM_CONVENTION,
        contents=job.contents,
        dtype="bfloat16" if job.directions is None else "float32",
        hidden_size=job.model.hidden_size,
        add_special_tokens=job.request.add_special_tokens,
        bos_token_id=added_bos_token_id(load_tokenizer(job.model.require_path())),
        max_model_len=job.model.max_model_len,
        shard_size=job.request.shard_size,
        shards=records,
        prompts=[
            PromptEntry(index=i, text=text, n_tokens=len(t.ids), truncated=t.truncated)
            for i, (text, t) in enumerate(zip(job.request.prompts, tokenized, strict=True))
        ],
        n_prompts=len(tokenized),
        tokens=sum(len(t.ids) for t in tokenized),
        statistics=statistics_sentence(job.contents),
        mean_token_norm={str(layer): norm for layer, norm in zip(job.layers, norms, strict=True)},
        projection=None if job.directions is None else job.directions.manifest_entry(),
        engine=engine_entry,
        timings=timings.as_dict(),
        bytes_written=sum(r.bytes for r in records) + len(stats_bytes),
        created_at=datetime.now(timezone.utc).isoformat(),
        writer=writer,
    )
    manifest_bytes = manifest.model_dump_json(indent=2).encode()
    JobFiles(storage).write_manifest(manifest_bytes)
    return JobSummary(
        n_shards=len(records),
        tokens=manifest.tokens,
        bytes_written=manifest.bytes_written + len(manifest_bytes),
        timings=timings,
    )


def run_job(
    job: ResolvedJob,
    storage: Storage,
    engine: Engine,
    job_id: str,
    *,
    load: EngineLoad | None = None,
    tokenized: list[TokenizedPrompt] | None = None,
    **kwargs,
) -> JobSummary:
    """Every shard, then the statistics and manifest, in this process. `load` says how the
    engine was obtained (default: handed over by the caller, no load time)."""
    load = load or EngineLoad(engine.name, "an engine the caller loaded", warm=True, load_s=0.0)
    tokenized = tokenized or tokenize_job(job)
    timings, skipped = run_shards(job, storage, engine, tokenized=tokenized, **kwargs)
    timings.load_s = load.load_s
    summary = finalize(job, storage, load.manifest_entry(engine.versions()), job_id, timings=timings, tokenized=tokenized)
    summary.shards_skipped = skipped
    return summary
