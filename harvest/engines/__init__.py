"""Forward-pass engines: the Hugging Face reference and vLLM, behind one interface."""

from harvest.engines.base import Engine, load_engine, vllm_available

__all__ = ["Engine", "load_engine", "vllm_available"]
