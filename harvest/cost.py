"""What a harvest request costs, known before it is paid for: tokens, bytes kept, bytes per shard.

The API's admission of a submit learns a request's cost in the order of the price of knowing it,
and refuses (400, naming the limit and the number) as soon as one is over:

1. `check_before_tokenizing`: from cheap facts only. No token of the model's vocabulary
   stands for more than `chars_per_token` characters (`harvest.tokenize.max_token_chars`),
   so a prompt of c characters runs at least `min(ceil(c / chars_per_token), max_model_len)`
   tokens (plus BOS when added). Summed, that bounds the job's tokens from below; with the
   layers kept, the hidden size (or the directions) and the stored dtype, it bounds the
   bytes of every prompt from below. Nothing is tokenized to refuse here.
2. `check_counts`: from each prompt's token count (`harvest.tokenize.count_tokens`, which
   stops counting once past MAX_TOKENS), the exact tokens, output bytes and bytes of every shard.

Limits: `MAX_TOKENS` per job and the lane's `max_shard_bytes` (infra/lanes.toml:
what a worker host's disk or one object of the store can hold). A shard always holds
shard_size prompts in the order of the prompts; a job whose shards would be too big is
refused naming the largest shard_size whose shards all fit, never cut some other way.

3. `kept_bytes`: the most bytes the job's folder (`harvest.jobfiles`) holds until its retention
   ends, file by file, which admission charges against the key's storage quota
   (`api.store.bytes_held`). Shards are only part of it: a 45 MB prompt of one layer of
   llama-tiny writes ~1 MB of shard but is kept twice more, in request.json and in the
   manifest's prompt list, so each job kept 91 MB while only its shards were counted. Here:

       shards      Σ_k (Σ_{i in k} (n_tokens_i × bytes_per_token + PROMPT_HEADER_BYTES) + SHARD_HEADER_BYTES)
       request     len(request.json), exact (`JobFiles.request_document_size`: what the API writes)
       manifest    Σ_i len(JSON string of prompt i) + n_prompts × MANIFEST_PROMPT_BYTES
                   + n_shards × MANIFEST_SHARD_BYTES + n_layers × MANIFEST_LAYER_BYTES
                   + len(JSON of the model's name and weights) + MANIFEST_FIXED_BYTES
       stats       n_layers × n_features × 8 (mean, std: float32) + n_layers × 4 + 8 + STATS_HEADER_BYTES
       _parts      n_shards × (n_layers × n_features × 16 + n_layers × 8 + 8 + PART_HEADER_BYTES)
                   + n_prompts × PART_PROMPT_BYTES   (float64 mean, m2; norm_sum; count; the record)
       progress    PROGRESS_BYTES + n_shards × TIMINGS_BYTES   (_progress.json, helpers' timings)

   A prompt that runs cut to the context is still stored whole (request.json holds the
   request as sent, the manifest the prompt as submitted with its `truncated` flag), and it is
   counted whole: its JSON string's exact bytes. The bounds are checked against a real job's
   files in tests/test_storage_quota.py (the admitted figure is never below the folder's
   size). A write in flight (a shard staged beside its name on local disk) is not counted: it
   lasts a moment, and what a killed run leaves of it is in the folder's measure once the job
   has ended (`api.store`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pydantic_core import to_json

from harvest.errors import InvalidRequest
from harvest.shard.layout import shard_ranges
from harvest.lanes import Lane
from harvest.request import MAX_TOKENS, ResolvedJob

__all__ = [
    "PROMPT_HEADER_BYTES",
    "Cost",
    "KeptBytes",
    "kept_bytes",
    "bytes_per_token",
    "least_tokens",
    "shard_bytes",
    "largest_fitting_shard_size",
    "check_before_tokenizing",
    "check_counts",
]

PROMPT_HEADER_BYTES = 256
"""At most what one prompt adds to its shard's safetensors header: two entries
(`prompt_<i>` and `tokens_<i>`, dtype, shape and offsets), each under 128 bytes of JSON."""
SHARD_HEADER_BYTES = 64
"""The header's length field, its metadata and its padding, at most."""

# manifest.json (`harvest.manifest.Manifest`, `model_dump_json(indent=2)`): its prompts' texts
# are counted exactly; everything else is bounded here. Seen on llama-tiny: 1 prompt, 1 shard,
# 1 layer, 2,283 bytes, of which ~1,900 are the fixed part (an HF engine's entry; vLLM's names
# two libraries more).
MANIFEST_FIXED_BYTES = 4096
"""At most what the manifest holds besides the entries counted per layer, shard and prompt and
the model's name and weights: version, job id, the layer convention and statistics sentences
(~900 bytes together), dtype and sizes, the projection entry, the engine's library versions and
reason, timings, created_at, the writer's token, the braces and indentation."""
MANIFEST_LAYER_BYTES = 64
"""Per layer kept: its line in `layer_indices` and its `mean_token_norm` entry (a float's repr)."""
MANIFEST_SHARD_BYTES = 512
"""Per shard: its record in `shards` (file name, index, prompt range, bytes, sha256, indented
over ~14 lines: ~300 bytes), its token counts aside."""
MANIFEST_PROMPT_BYTES = 160
"""Per prompt, its text aside: its `prompts` entry (index, n_tokens, truncated, indented over 6
lines: ~110 bytes) and its token count's line in its shard's record (~20)."""
STATS_HEADER_BYTES = 512
"""stats.safetensors' header (four tensors' entries) and padding, at most."""
PART_HEADER_BYTES = 1024
"""One `_parts/` record's header: its four tensors' entries, and the shard's record (the
manifest's entry, as JSON escaped into the header's metadata) less its token counts."""
PART_PROMPT_BYTES = 16
"""Per prompt, its token count in its shard's `_parts/` record."""
PROGRESS_BYTES = 4096
"""_progress.json at its largest: a stage, counts, a rate and the run's placement (host name,
slot, devices)."""
TIMINGS_BYTES = 512
"""One scale-out helper's timings file (`_parts/timings-*.json`: six figures); a job has fewer
helpers than shards."""


@dataclass(frozen=True)
class Cost:
    """What a job writes, from its token counts."""

    tokens: int
    """Token positions that run (BOS included where added), every prompt cut to the context."""
    output_bytes: int
    """Bytes of every shard file together (headers counted at their most)."""
    largest_shard_bytes: int
    """Bytes of the job's biggest shard file (header counted at its most)."""


@dataclass(frozen=True)
class KeptBytes:
    """The most bytes a job's folder holds until its retention ends, file by file (see the
    module docstring for each bound): what admission charges an active job against its key's
    storage quota."""

    shards: int
    """Every shard file together (`Cost.output_bytes`)."""
    request: int
    """request.json: exactly the bytes the API writes."""
    manifest: int
    """manifest.json, at most: the prompts' texts exactly as it encodes them, the rest bounded."""
    stats: int
    """stats.safetensors, at most."""
    parts: int
    """The `_parts/` records (float64 statistics partial and record per shard), at most."""
    progress: int
    """_progress.json and scale-out helpers' timings files, at most."""

    @property
    def total(self) -> int:
        """Bytes of the whole folder, at most: the figure admission charges."""
        return self.shards + self.request + self.manifest + self.stats + self.parts + self.progress


def bytes_per_token(job: ResolvedJob) -> int:
    """Bytes one token position adds to its shard: a value per layer kept and feature (bf16
    activations, float32 projections) and its int32 id."""
    spec = job.spec
    return len(job.layers) * spec.n_features(job.model.hidden_size) * spec.stored_itemsize + 4


def least_tokens(prompts: list[str], *, chars_per_token: int, max_len: int, add_special_tokens: bool) -> np.ndarray:
    """Per prompt, the fewest tokens it can run: its characters over the most any token
    stands for, cut to the context (one for BOS counted only where it is surely added)."""
    chars = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    least = -(-chars // chars_per_token) + (1 if add_special_tokens else 0)
    return np.minimum(least, max_len)


def shard_bytes(counts: np.ndarray, shard_size: int, per_token: int) -> np.ndarray:
    """Bytes of each shard file (shard k: prompts k*shard_size … (k+1)*shard_size − 1)."""
    per_prompt = np.asarray(counts, dtype=np.int64) * per_token + PROMPT_HEADER_BYTES
    starts = np.arange(0, len(per_prompt), shard_size)
    return np.add.reduceat(per_prompt, starts) + SHARD_HEADER_BYTES


def largest_fitting_shard_size(counts: np.ndarray, per_token: int, limit: int, below: int) -> int:
    """The largest shard_size under `below` whose every shard fits in `limit` bytes (0: none,
    a single prompt is already too big). Not monotonic in general (shards of 3 may fit where
    shards of 2 do not), so each size is tried, from the top: prefix sums make each try cost
    n / size, all of them n·log n."""
    per_prompt = np.asarray(counts, dtype=np.int64) * per_token + PROMPT_HEADER_BYTES
    prefix = np.concatenate([[0], np.cumsum(per_prompt)])
    n = len(per_prompt)
    for size in range(below - 1, 0, -1):
        edges = np.append(np.arange(0, n, size), n)
        if int(np.diff(prefix[edges]).max()) + SHARD_HEADER_BYTES <= limit:
            return size
    return 0


def kept_bytes(job: ResolvedJob, cost: Cost, *, request_bytes: int) -> KeptBytes:
    """The most bytes the job's folder holds (its files in `harvest.jobfiles`' layout), given
    its shards' bytes (`check_counts`) and request.json's exact size. Each prompt's text is
    encoded as the manifest encodes it (pydantic's JSON: UTF-8, control characters and quotes
    escaped), once: a 45 MB prompt costs ~0.1 s here (its request.json as much again)."""
    request = job.request
    n_prompts = len(request.prompts)
    n_shards = len(shard_ranges(n_prompts, request.shard_size))
    n_layers = len(job.layers)
    n_features = job.spec.n_features(job.model.hidden_size)
    texts = sum(len(to_json(prompt)) for prompt in request.prompts)
    names = len(to_json(job.model.name)) + len(to_json(job.model.weights))
    manifest = (
        texts + n_prompts * MANIFEST_PROMPT_BYTES + n_shards * MANIFEST_SHARD_BYTES + n_layers * MANIFEST_LAYER_BYTES
        + names + MANIFEST_FIXED_BYTES
    )
    stats = n_layers * n_features * 8 + n_layers * 4 + 8 + STATS_HEADER_BYTES
    parts = n_shards * (n_layers * n_features * 16 + n_layers * 8 + 8 + PART_HEADER_BYTES) + n_prompts * PART_PROMPT_BYTES
    progress = PROGRESS_BYTES + n_shards * TIMINGS_BYTES
    return KeptBytes(shards=cost.output_bytes, request=request_bytes, manifest=manifest, stats=stats, parts=parts,
                     progress=progress)


def _size(n: int) -> str:
    """Bytes for a message: exact, with a rounded figure in GiB or MiB alongside."""
    unit, scale = ("GiB", 1 << 30) if n >= 1 << 30 else ("MiB", 1 << 20)
    return f"{n:,} bytes ({n / scale:.1f} {unit})"


def check_before_tokenizing(job: ResolvedJob, lane: Lane, *, chars_per_token: int) -> None:
    """Refuse, from the prompts' characters alone, a job certainly over a limit."""
    request = job.request
    least = least_tokens(request.prompts, chars_per_token=chars_per_token, max_len=job.model.max_model_len,
                         add_special_tokens=request.add_special_tokens)
    total = int(least.sum())
    if total > MAX_TOKENS:
        chars = sum(len(p) for p in request.prompts)
        raise InvalidRequest(
            f"The prompts come to at least {total:,} tokens ({len(request.prompts):,} prompts, {chars:,} characters; "
            f"no token of {job.model.name} is longer than {chars_per_token} characters, and a prompt runs at most "
            f"{job.model.max_model_len:,} tokens); a harvest takes at most {MAX_TOKENS:,}. Split them into several jobs.",
            param="prompts",
        )
    if lane.max_shard_bytes is not None:
        per_token = bytes_per_token(job)
        biggest = int(least.argmax())
        alone = int(least[biggest]) * per_token  # its values alone, the header left out: a floor
        if alone > lane.max_shard_bytes:
            raise _too_big_alone(job, lane, biggest, alone, least=True)


def check_counts(job: ResolvedJob, counts: list[int], lane: Lane) -> Cost:
    """The job's cost from its token counts; refuse it when over a limit. `counts` may stop
    short of the prompts once past MAX_TOKENS (`count_tokens(stop_above=MAX_TOKENS)`)."""
    request = job.request
    counts_array = np.asarray(counts, dtype=np.int64)
    tokens = int(counts_array.sum())
    if tokens > MAX_TOKENS and len(counts) < len(request.prompts):  # counting stopped at the limit
        raise InvalidRequest(
            f"The first {len(counts):,} of the {len(request.prompts):,} prompts already come to {tokens:,} tokens; "
            f"a harvest takes at most {MAX_TOKENS:,}. Split them into several jobs.",
            param="prompts",
        )
    if tokens > MAX_TOKENS:
        raise InvalidRequest(
            f"The prompts come to {tokens:,} tokens; a harvest takes at most {MAX_TOKENS:,}. Split them into several jobs.",
            param="prompts",
        )
    per_token = bytes_per_token(job)
    shards = shard_bytes(counts_array, request.shard_size, per_token)
    biggest = int(shards.argmax())
    cost = Cost(tokens=tokens, output_bytes=int(shards.sum()), largest_shard_bytes=int(shards[biggest]))
    limit = lane.max_shard_bytes
    if limit is not None and cost.largest_shard_bytes > limit:
        fits = largest_fitting_shard_size(counts_array, per_token, limit, request.shard_size)
        if fits == 0:
            alone = int(counts_array.max()) * per_token + PROMPT_HEADER_BYTES + SHARD_HEADER_BYTES
            raise _too_big_alone(job, lane, int(counts_array.argmax()), alone, least=False)
        raise InvalidRequest(
            f"Shard {biggest} of this job would be {_size(cost.largest_shard_bytes)} "
            f"({request.shard_size} prompts of {len(job.layers)} layers); shards of the {lane.name} lane are at most "
            f"{_size(limit)} (max_shard_bytes). The largest shard_size whose shards all fit is {fits}.",
            param="shard_size",
        )
    return cost


def _too_big_alone(job: ResolvedJob, lane: Lane, index: int, size: int, *, least: bool) -> InvalidRequest:
    return InvalidRequest(
        f"Prompt {index} alone would make a shard of {'at least ' if least else ''}{_size(size)} with {len(job.layers)} layers; "
        f"shards of the {lane.name} lane are at most {_size(lane.max_shard_bytes)} (max_shard_bytes), so no shard_size fits. "
        "Keep fewer layers, project onto directions, or shorten the prompt.",
        param="prompts",
    )
