"""Models the benchmarks build for themselves: another family at a real model's size.

`gemma2-135m`: Gemma-2 (sliding and global layers alternating, softcapping, scaled and tied
embeddings) at `smollm2-135m`'s shapes (30 blocks, hidden 576, 9 heads / 3 KV heads of 64,
MLP 1,536), random weights from a fixed seed, with SmolLM2's own tokenizer, so the same corpus
gives the same tokens. Gemma-2's own window (4,096) and softcaps (50, 30). It tells whether
what holds for Llama (bench/RESULTS.md, "Against the peers") holds where every pass carries
per-layer-type masks.

`use(name)` builds it once under `$HARVEST_HOME/models/` and points `HARVEST_MODELS_FILE` (for
this process and the ones it starts) at the shipped registry plus its entry.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

__all__ = ["BENCH_MODELS", "use"]

BENCH_MODELS = {
    "gemma2-135m": dict(
        model_type="gemma2", num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, query_pre_attn_scalar=64, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.02,
    ),
}
SEED = 20261206


def _build(name: str, folder: Path, tokenizer_from: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harvest.built_checkpoints import BUILT_BY, write_atomically

    shapes = dict(BENCH_MODELS[name])
    model_type = shapes.pop("model_type")

    def write(staging: Path) -> None:
        import json

        for part in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / part).exists():
                shutil.copy(tokenizer_from / part, staging / part)
        (staging / BUILT_BY).write_text(json.dumps({"builder": "bench.bench_models", "model": name, "seed": SEED}) + "\n")

        tokenizer = json.loads((tokenizer_from / "config.json").read_text())
        config = AutoConfig.for_model(model_type, **shapes, vocab_size=tokenizer["vocab_size"],
                                      bos_token_id=tokenizer.get("bos_token_id"), eos_token_id=tokenizer.get("eos_token_id"))
        torch.manual_seed(SEED)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(staging, safe_serialization=True)

    write_atomically(folder, write)


def use(name: str) -> None:
    """Serve the bench model `name` from here on (this process and its children)."""
    from harvest.registry import load_registry
    from harvest.settings import get_settings

    settings = get_settings()
    folder = settings.home / "models" / name
    if not (folder / "config.json").exists():
        _build(name, folder, load_registry(settings).get("smollm2-135m").require_path())
    models = settings.home / "bench-models.toml"
    models.write_text((REPO / "infra" / "models.toml").read_text() + f"""
[models.{name}]
weights = "{folder}"
lane = "small"
max_model_len = 2048
max_activation_prompt_tokens = 512
""")
    os.environ["HARVEST_MODELS_FILE"] = str(models)  # this process's later reads, and its children's
