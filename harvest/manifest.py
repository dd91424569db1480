"""`manifest.json`: the index of a finished harvest, written last (version 2 of the layout).

Its presence means every other file of the job is complete.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from harvest.jobfiles import MANIFEST, STATS
from harvest.shard.record import ShardRecord

__all__ = ["MANIFEST", "STATS", "PromptEntry", "Manifest", "statistics_sentence"]


class PromptEntry(BaseModel):
    index: int
    """Global prompt index i (the `prompt_{i}` key)."""
    text: str
    """The prompt as submitted."""
    n_tokens: int
    """Tokens that ran (BOS included when added)."""
    truncated: bool
    """True when the prompt was longer than max_model_len and only its first tokens ran."""


class ModelEntry(BaseModel):
    name: str
    """Served name."""
    weights: str
    """Checkpoint id (Hugging Face repo id or path)."""
    architecture: str | None = None
    """transformers' class of the checkpoint, e.g. `GPT2LMHeadModel`, `Gemma2ForCausalLM`."""
    model_type: str | None = None
    """transformers' family key, e.g. `gpt2`, `gemma2`."""
    layer_module: str | None = None
    """The module whose output layer k is, with `{k}` for the index: `transformer.h.{k}` for
    GPT-2, `gpt_neox.layers.{k}` for GPT-NeoX, `model.layers.{k}` for most families."""


class Manifest(BaseModel):
    version: Literal[2] = 2
    job_id: str
    model: ModelEntry
    layer_indices: list[int]
    """Blocks kept, ascending; the layer axis of every tensor follows this list."""
    residual_stream_convention: str
    contents: Literal["activations", "projections"]
    dtype: Literal["bfloat16", "float32"]
    """Dtype of every `prompt_{i}` tensor."""
    hidden_size: int
    add_special_tokens: bool
    bos_token_id: int | None
    """The BOS id the model's tokenizer puts at position 0 with `add_special_tokens`, or null
    when it adds none (SmolLM2's): then position 0 is the prompt's own first token."""
    max_model_len: int
    shard_size: int
    shards: list[ShardRecord]
    prompts: list[PromptEntry]
    n_prompts: int
    tokens: int
    """Token positions in the files, start tokens included."""
    statistics: str
    """What stats.safetensors describes."""
    mean_token_norm: dict[str, float]
    """Per layer index: mean L2 norm of the stored vectors over the statistics' positions."""
    projection: dict | None = None
    """For projections: normalized, n_directions, input dtype, sha256 of the directions."""
    engine: dict[str, str]
    """The engine and the library versions that computed the numbers."""
    timings: dict[str, int | float]
    """Seconds spent: load_s, forward_s, save_s, upload_s; and tokens the forward passes ran:
    real_tokens (the prompts') and padded_tokens (filler that belongs to no prompt), summed
    over workers (a shard skipped on a resume counts none)."""
    bytes_written: int
    """Bytes of the shards and stats.safetensors."""
    created_at: str
    writer: str | None = None
    """The attempt that wrote this manifest: an opaque token each run of the harvest flow mints
    for itself (a rescheduled flow run's attempts share the flow run's id, never this token).
    A failing attempt removes the manifest only if it holds its own token
    (`JobFiles.discard_manifest`), never a successor's. Null for a manifest written outside
    the flow (`harvest run`). Not in the SPEC's list: readers ignore it."""


def statistics_sentence(contents: str) -> str:
    what = "the projections onto the unit directions" if contents == "projections" else "the residual stream as stored (bf16)"
    return (
        f"stats.safetensors holds the per-layer mean and standard deviation (population, float32, "
        f"computed in float64 with Welford/Chan merging) of {what}, over every token position "
        f"except the first of each prompt; count is the number of positions. The first position is "
        f"left out because its vector is an outlier: the BOS token where the tokenizer adds one "
        f"(bos_token_id), else the prompt's first real token (bos_token_id null), an attention sink "
        f"either way, whose norm can be ~100x the others' (SmolLM2-135M: ~22,700 against 140-570)."
    )
