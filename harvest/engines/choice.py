"""Which engine runs a model, and why: `HARVEST_ENGINE`, and what `auto` picks where.

`auto` decides per host and per kind of process, from what bench/ measured:
- with CUDA and vLLM installed: vLLM, in every process (the GPU runs, bench/RESULTS.md "GPU");
- on the CPU, a *one-off* process (`harvest run`, a flow run outside a worker host) loads its
  engine for one job, so start-up counts: `harvest run` of a 6,919-token corpus took 17.2 s
  as a whole process on vLLM against 9.5 s on the HF engine (its corpus time 5.8 s against
  5.0 s, the rest vLLM's imports and start-up): the HF engine;
- on the CPU, a *warm* process (an engine server, an inline engine process) pays start-up
  once, so only throughput counts: with both loaded once, the HF engine's packed passes ran
  that corpus at 1,459 tokens/s against vLLM's 1,237: the HF engine there too.

(bench/RESULTS.md, "Against the peers", `bench/bench_peers.py`.)

The choice and its reason go into every manifest.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from dataclasses import dataclass
from functools import lru_cache

from harvest.engines.base import Engine
from harvest.errors import ModelUnavailable
from harvest.metrics import observe_engine_load
from harvest.registry import ModelInfo
from harvest.engines.limits import EngineLimits

__all__ = ["EngineChoice", "choose_engine", "load_engine", "vllm_available"]

CPU_ONE_OFF = ("auto: no CUDA device, and a one-off run pays its engine's start-up every time: "
               "on the CPU the HF engine starts several seconds sooner than vLLM, and runs faster")
CPU_WARM = ("auto: no CUDA device; a warm process pays start-up once, and on the CPU the HF engine's "
            "packed passes outran vLLM on real text (bench/RESULTS.md, \"Against the peers\")")


@lru_cache(maxsize=1)
def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs a model, and why (the manifest records both)."""

    name: str
    """`vllm`, `hf`, or `module:Class`."""
    reason: str


def choose_engine(setting: str, *, warm: bool = False) -> EngineChoice:
    """Resolve `setting` (`HARVEST_ENGINE`'s value) on this machine, for a process that keeps
    its engine for many jobs (`warm`) or loads it for one."""
    setting = setting.strip()
    if setting == "auto":
        import torch  # here, not at the top: the API imports the engines' names, and torch only where an engine runs

        if not torch.cuda.is_available():
            return EngineChoice("hf", CPU_WARM if warm else CPU_ONE_OFF)
        if not vllm_available():
            return EngineChoice("hf", "auto: CUDA is present but vLLM is not installed")
        return EngineChoice("vllm", "auto: CUDA is present and vLLM is installed")
    if setting == "vllm" and not vllm_available():
        raise ModelUnavailable("HARVEST_ENGINE=vllm, but vLLM is not installed on this host.")
    return EngineChoice(setting, f"HARVEST_ENGINE={setting}")


def load_engine(model: ModelInfo, choice: EngineChoice | str, limits: EngineLimits, *, warm: bool = False) -> Engine:
    """Load `model` on the chosen engine (a setting is resolved by `choose_engine`), within
    `limits`; every load is counted with its seconds (`harvest.metrics`: engine servers, inline
    engines, one-off runs)."""
    if not isinstance(choice, EngineChoice):
        choice = choose_engine(choice, warm=warm)
    started = time.perf_counter()
    engine = _construct(model, choice, limits)
    observe_engine_load(model.lane, model.name, choice.name, time.perf_counter() - started)
    return engine


def _construct(model: ModelInfo, choice: EngineChoice, limits: EngineLimits) -> Engine:
    if choice.name == "vllm":
        from harvest.engines.vllm import VLLMEngine

        return VLLMEngine(model, limits)
    if choice.name == "hf":
        from harvest.engines.hf import HFEngine

        return HFEngine(model, limits=limits)
    module, _, cls = choice.name.partition(":")
    engine = getattr(importlib.import_module(module), cls)(model)  # an engine of its own takes the model only
    engine.limits = limits
    return engine
