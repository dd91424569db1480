"""The checkpoint `bench/gpu.sh` measures: Llama-3.1-8B's shapes, random bf16 weights, no download.

The GPU machine has no network, so the 8B weights cannot be fetched; the blocks' cost depends
only on their shapes, not on the values. `build_checkpoint` makes the config and the weights
on the device (seconds, where a CPU would take minutes), saves them with `save_pretrained`
like any checkpoint, and hands back a `ModelInfo` resolved by the project's own `Registry`
(shapes read from the saved `config.json`), so both engines load it through their real code:
`HFEngine(model)` → `load_hf_model`, `VLLMEngine(model)` → `vllm.LLM(model=path)`.

Differences from the real checkpoint, none of which touches a decoder block: the embedding
table and LM head have the embedded tokenizer's vocabulary (2,048 rounded to 64, not 128,256:
2 GB less to write and read; the prompts are random ids), and RoPE has no llama3 scaling
(prompts here are far shorter than 8,192 positions, where it would start to matter).

Where: `/dev/shm` when it has room (the save and both loads then run at memory speed instead
of disk speed, ~15 GB each way), else under `HARVEST_HOME`. A checkpoint already there (same
shapes) is reused, so a rerun on a still-warm machine skips the build.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

__all__ = ["LLAMA_8B_SHAPES", "SMOKE_SHAPES", "build_checkpoint", "block_params"]

LLAMA_8B_SHAPES = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
)
"""Llama-3.1-8B's decoder blocks (its config.json)."""

SMOKE_SHAPES = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=32, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
)
"""`GPU_BENCH_SMOKE=1`: the same 32 blocks at a CPU's size, to run the script end to end here."""

MAX_POSITIONS = 131072  # Llama-3.1-8B's max_position_embeddings
MAX_MODEL_LEN = 8192  # the registry's llama-8b context (infra/models.toml)


def block_params(shapes: dict) -> int:
    """Parameters of all decoder blocks (the matmuls every forward position multiplies by)."""
    h, i, kv = shapes["hidden_size"], shapes["intermediate_size"], shapes["num_key_value_heads"]
    q = shapes["num_attention_heads"] * shapes["head_dim"]
    per_block = h * q + 2 * h * kv * shapes["head_dim"] + q * h + 3 * h * i + 2 * h
    return per_block * shapes["num_hidden_layers"]


def _where(home: Path, name: str, need_bytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        existing = shm / "harvest-bench" / name
        if (existing / "config.json").exists() or shutil.disk_usage(shm).free > 1.5 * need_bytes:
            return existing
    return home / "models" / name


def _tokenizer_files(home: Path, target: Path, max_len: int) -> int:
    """The embedded tokenizer (trained from the package's corpus, no download); its vocab size."""
    from harvest.tiny_model import build_tiny_model

    staging = home / "tokenizer-staging"
    if not (staging / "tokenizer.json").exists():
        build_tiny_model(staging, config_overrides=dict(num_hidden_layers=1))
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (staging / name).exists():
            shutil.copy(staging / name, target / name)
    config = json.loads((staging / "tokenizer_config.json").read_text())
    config["model_max_length"] = max_len
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return json.loads((staging / "config.json").read_text())["vocab_size"]


def build_checkpoint(home: Path, shapes: dict, *, name: str = "llama-8b-shapes"):
    """Build (or reuse) the checkpoint; returns `(ModelInfo, seconds building, where)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harvest.registry import Registry
    from harvest.settings import Settings

    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    need = 2 * (block_params(shapes) + 2 * 2112 * shapes["hidden_size"])
    path = _where(home, name, need)
    started = time.perf_counter()
    stamp = path / "BUILT_BY"
    wanted = {"builder": "bench/gpu_checkpoint.py", "shapes": shapes}
    if not (stamp.exists() and json.loads(stamp.read_text()) == wanted):
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        vocab = _tokenizer_files(home, path, MAX_MODEL_LEN)
        config = LlamaConfig(
            vocab_size=vocab, bos_token_id=0, eos_token_id=1, max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=False, torch_dtype="bfloat16", **shapes,
        )
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):  # made where it is fast: seconds on a GPU
            try:
                model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
            except TypeError:  # transformers before 4.56 names it torch_dtype
                model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
        model = model.to(torch.bfloat16)  # a no-op unless the dtype argument was ignored
        model.save_pretrained(path, max_shard_size="5GB")
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        stamp.write_text(json.dumps(wanted) + "\n")
    build_s = time.perf_counter() - started

    # Resolved by the project's registry, as a served model would be (shapes from config.json).
    settings = Settings(home=home)
    entry = {
        "weights": str(path), "lane": "small", "harvest": True, "inline": False,
        "max_model_len": MAX_MODEL_LEN, "max_activation_prompt_tokens": 512,
        "declared": {"n_layers": shapes["num_hidden_layers"], "hidden_size": shapes["hidden_size"], "max_position_embeddings": MAX_POSITIONS},
    }
    model_info = Registry({name: entry}, settings).get(name)
    return model_info, build_s, path
