"""The engine interface, and the choice between engines.

An engine loads one model once and runs forward passes for whole shards. Both engines give
the same answer (the vLLM engine is tested against the HF reference); vLLM is the default
wherever it is installed, and `HARVEST_USE_VLLM=0` selects the reference.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from harvest.capture import CaptureSpec, ShardCapture
from harvest.registry import ModelInfo
from harvest.settings import get_settings

__all__ = ["Engine", "SamplingSpec", "Generation", "load_engine", "vllm_available"]


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
    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None) -> ShardCapture:
        """Run every prompt (token ids, as given) and return one shard's values in prompt order."""

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


def load_engine(model: ModelInfo, *, use_vllm: bool | None = None) -> Engine:
    """Load `model` on the default engine: vLLM where installed unless HARVEST_USE_VLLM=0."""
    if use_vllm is None:
        use_vllm = get_settings().use_vllm
    if use_vllm is None:
        use_vllm = vllm_available()
    if use_vllm:
        from harvest.engines.vllm import VLLMEngine

        return VLLMEngine(model)
    from harvest.engines.hf import HFEngine

    return HFEngine(model)
