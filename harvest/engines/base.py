"""The engine interface: what every engine does, whichever runs (`harvest.engines.choice`).

An engine loads one model once and runs forward passes for whole shards. Both engines give
the same answer (the vLLM engine is tested against the HF reference).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harvest.capture_spec import CaptureSpec
from harvest.registry import ModelInfo
from harvest.engines.limits import EngineLimits

if TYPE_CHECKING:  # torch only for the engines themselves: the API imports this module, not torch
    import torch

    from harvest.capture import ShardCapture

__all__ = [
    "Engine", "EngineLoad", "SamplingSpec", "Generation", "ValueSink", "hand_over",
]

ValueSink = Callable[[int, "torch.Tensor"], None]
"""Takes one prompt's captured values as soon as the engine has them: the prompt's position in
its shard (0-based) and its host tensor `[n_layers_kept, n_tokens, n_features]` in the stored
dtype. A capture given a sink hands every prompt to it, batch by batch, and returns no values,
so a shard never has to be held whole (`harvest.shard.file`)."""


def hand_over(capture: ShardCapture, sink: ValueSink | None) -> ShardCapture:
    """Give `sink` the values an engine returned instead of streaming them (an engine of
    `HARVEST_ENGINE=module:Class` that ignores sinks); the capture then holds none."""
    if sink is not None and capture.values:
        for position, value in enumerate(capture.values):
            sink(position, value)
        capture.values = []
    return capture


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample one completion (OpenAI completions semantics)."""

    max_tokens: int = 16
    """Tokens to generate (at least 1)."""
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    seed: int | None = None
    """Same seed, same engine, same draw."""
    stop: tuple[str, ...] = ()
    """Generation ends before any of these strings; they are not returned."""
    logprobs: int | None = None
    """Top-k log-probabilities per generated token (0..5), or None."""


@dataclass
class Generation:
    """One completion, and the residual stream over every position that ran."""

    prompt_ids: list[int]
    token_ids: list[int]
    """Generated ids (after stop-string trimming)."""
    text: str
    finish_reason: str
    """"length" or "stop"."""
    token_logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None
    residual: torch.Tensor | None = None
    """bf16 `[n_layers_asked, n_prompt + n_generated - 1, hidden]` on the host, or None."""
    extra: dict = field(default_factory=dict)


class Engine(ABC):
    """One loaded model that turns token ids into captured activations."""

    name: str
    model: ModelInfo
    limits: EngineLimits = EngineLimits()
    """What one call may hold (`harvest.engines.limits`); given by whoever makes the engine."""

    @abstractmethod
    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None,
                sink: ValueSink | None = None) -> ShardCapture:
        """Run every prompt (token ids, as given) and return one shard's values in prompt order;
        with a `sink`, each prompt's values go to it as soon as they exist, and none are returned."""

    def capture_cobatch(self, shards: list[list[list[int]]], spec: CaptureSpec, *, batch_size: int | None = None,
                        sinks: list[ValueSink | None] | None = None) -> list[ShardCapture]:
        """Several shards of one spec (concurrent jobs on one warm engine) in shared forward
        passes: one answer per shard, each with statistics of its own prompts only, and its
        values handed to its sink (if any). An engine that cannot batch across shards runs
        them one after another."""
        sinks = sinks or [None] * len(shards)
        return [self.capture(prompts, spec, batch_size=batch_size, sink=sink) for prompts, sink in zip(shards, sinks, strict=True)]

    def generate(self, prompts: list[list[int]], sampling: list[SamplingSpec], layers: list[int] | None) -> list[Generation]:
        """Complete every prompt in one batch, capturing `layers` (None: no capture)."""
        raise NotImplementedError(f"the {self.name} engine does not generate")

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the libraries that computed the numbers, for the manifest."""

    def close(self) -> None:
        """Release the model's memory."""


@dataclass
class EngineLoad:
    """How a run got its engine, for its log, summary and manifest."""

    engine: str
    reason: str
    warm: bool
    load_s: float
    group: str | None = None

    def manifest_entry(self, versions: dict[str, str]) -> dict[str, str]:
        where = f"engine server {self.group}" if self.group else "in the run's process"
        return {**versions, "reason": self.reason, "warm": "true" if self.warm else "false", "loaded": where}
