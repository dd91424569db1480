"""The engine interface, and the choice between engines.

An engine loads one model once and runs forward passes for whole shards. Both engines give
the same answer (the vLLM engine is tested against the HF reference); vLLM is the default
wherever it is installed, and `HARVEST_USE_VLLM=0` selects the reference.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from functools import lru_cache

from harvest.capture import CaptureSpec, ShardCapture
from harvest.registry import ModelInfo
from harvest.settings import get_settings

__all__ = ["Engine", "load_engine", "vllm_available"]


class Engine(ABC):
    """One loaded model that turns token ids into captured activations."""

    name: str
    model: ModelInfo

    @abstractmethod
    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None) -> ShardCapture:
        """Run every prompt (token ids, as given) and return one shard's values in prompt order."""

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
