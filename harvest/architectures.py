"""Model architectures: what a checkpoint's `config.json` calls its shapes, and which module's
output "layer k" is.

Every engine and every reader means the same thing by layer k: the output of decoder block k,
before the final norm. Where the blocks live differs by family: `model.layers` for Llama and
most families since, `transformer.h` for GPT-2, `gpt_neox.layers` for GPT-NeoX (Pythia). So do
the names of the shapes: GPT-2's config says `n_layer`, `n_embd` and `n_positions` where Llama's
says `num_hidden_layers`, `hidden_size` and `max_position_embeddings` (transformers maps them
with each config class's `attribute_map`; loading a config class costs torch's import, which
the API's processes that only count tokens and list models never pay, so the aliases are read
here from the JSON). This module reads files only: no torch, no transformers.

The engines find the blocks with `block_path` and check what they find there
(`harvest.engines.hf_model`); `GET /v1/models` and the manifest name the same path, so a
researcher can hook the same module in transformers, nnsight or TransformerLens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Architecture", "read_architecture", "block_path", "shapes_from_config", "attention_shapes", "SHAPE_ALIASES"]

SHAPE_ALIASES = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"),
}
"""Our name → the names configs give it, transformers' own first (its `attribute_map`s)."""

BLOCK_PATHS = {
    "gpt2": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "gptj": "transformer.h",
    "gpt_bigcode": "transformer.h",
    "bloom": "transformer.h",
    "falcon": "transformer.h",
}
"""Families whose decoder blocks are not at transformers' usual `model.layers`."""

DEFAULT_BLOCK_PATH = "model.layers"


def _text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal wrappers nest it)."""
    return config.get("text_config") or config


def block_path(model_type: str | None) -> str:
    """The module path of the decoder blocks of a `model_type` (`model.layers` unless listed)."""
    return BLOCK_PATHS.get(model_type or "", DEFAULT_BLOCK_PATH)


def shapes_from_config(config: dict) -> dict:
    """`n_layers`, `hidden_size` and `max_position_embeddings` of a parsed `config.json`,
    whatever the family calls them; a shape it lacks is an error naming the names looked for."""
    text = _text_config(config)
    shapes = {}
    for ours, names in SHAPE_ALIASES.items():
        value = next((text[name] for name in names if isinstance(text.get(name), int)), None)
        if value is None:
            raise ValueError(f"config.json ({text.get('model_type', 'unknown family')}) gives no {ours}: looked for {', '.join(names)}")
        shapes[ours] = value
    return shapes


def attention_shapes(config: dict) -> dict:
    """`heads`, `kv_heads` and `head_dim` of a parsed `config.json` (GPT-2 says `n_head`; a
    family without grouped queries has as many key/value heads as heads)."""
    text = _text_config(config)
    heads = text.get("num_attention_heads") or text.get("n_head")
    if not isinstance(heads, int):
        raise ValueError(f"config.json ({text.get('model_type', 'unknown family')}) gives no attention heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or shapes_from_config(config)["hidden_size"] // heads
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}


@dataclass(frozen=True)
class Architecture:
    """What a checkpoint is, as its `config.json` says."""

    name: str
    """transformers' class, e.g. `GPT2LMHeadModel`, `Gemma2ForCausalLM`."""
    model_type: str
    """transformers' family key, e.g. `gpt2`, `gemma2`."""
    blocks: str
    """Module path of the decoder blocks: layer k is the output of `{blocks}.{k}`."""

    def describe(self) -> dict:
        """As `GET /v1/models` and the manifest give it."""
        return {"architecture": self.name, "model_type": self.model_type, "layer_module": f"{self.blocks}.{{k}}"}


def read_architecture(path: Path) -> Architecture:
    """The architecture of the checkpoint folder at `path`."""
    config = json.loads((Path(path) / "config.json").read_text())
    text = _text_config(config)
    model_type = text.get("model_type") or config.get("model_type") or "unknown"
    names = config.get("architectures") or [model_type]
    return Architecture(name=names[0], model_type=model_type, blocks=block_path(model_type))
