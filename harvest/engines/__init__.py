"""Forward-pass engines: the Hugging Face reference and vLLM, behind one interface."""

from harvest.engines.base import Engine, EngineLoad
from harvest.engines.choice import EngineChoice, choose_engine, load_engine, vllm_available

__all__ = ["Engine", "EngineChoice", "EngineLoad", "choose_engine", "load_engine", "vllm_available"]
