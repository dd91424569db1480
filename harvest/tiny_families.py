"""Tiny checkpoints of every family researchers bring, built here from transformers' own configs.

Researchers harvest GPT-2 and Pythia (the classic SAE subjects), Gemma-2 and Gemma-3, Qwen,
Mistral, OLMo-2, Phi-3 and mixture-of-experts models such as Trinity (AFMoE), not only Llama.
Nothing can be downloaded on a fresh machine, so, as for `llama-tiny` (`harvest.tiny_model`),
the project builds one small checkpoint per family: random weights from a fixed seed, through
the family's own config class and `AutoModelForCausalLM.from_config`, saved in the standard
layout and loaded by the same code as any real checkpoint. Each has what makes its family
differ: GPT-2's absolute positions and `transformer.h`, GPT-NeoX's partial rotary and parallel
residual, Gemma's scaled and tied embeddings, softcapping and interleaved sliding and global layers,
Mistral's sliding window, the MoE routers, AFMoE's dense first layer, shared experts and the
router fields vLLM's `afmoe` reads (Trinity's own config has them; transformers' `AfmoeConfig`
does not).

Shapes: 4 blocks, hidden 128, head_dim 32 (vLLM's CPU attention needs ≥ 32), a sliding window
of 16 where the family has one (prompts longer than that cross it), 256 positions. Each
tokenizer is `llama-tiny`'s BPE trained on the shipped corpus, with its family's BOS rule:
GPT-2, Pythia, Qwen and OLMo-2 add no BOS; Gemma adds `<bos>`; Llama-style families add theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harvest.built_checkpoints import BUILT_BY, plain_tokenizer_config

__all__ = ["Family", "FAMILIES", "SEED", "SLIDING_WINDOW", "write_family_model"]

SEED = 20261206
SLIDING_WINDOW = 16
MAX_POSITIONS = 256
VOCAB = 2048

COMMON = dict(
    num_hidden_layers=4,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=MAX_POSITIONS,
    # Random weights at the default 0.02 scale make every block nearly the identity; a larger
    # scale gives layers that differ visibly, which the parity tests need (as llama-tiny).
    initializer_range=0.1,
    tie_word_embeddings=False,
)

# The layer-type pattern of Gemma-3 and Trinity: sliding layers with a global one every few.
SLIDING_THEN_GLOBAL = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]

GEMMA_CHAT = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """One family's tiny checkpoint: its config and its tokenizer's rules."""

    model_type: str
    """transformers' config key (`AutoConfig.for_model`)."""
    bos: str
    eos: str
    add_bos: bool
    """Whether the tokenizer puts `bos` at position 0 of every prompt."""
    config: dict = field(default_factory=dict)
    """Over `COMMON`: what makes the family what it is."""
    chat_template: str | None = None


FAMILIES: dict[str, Family] = {
    "mistral": Family("mistral", "<s>", "</s>", True, dict(sliding_window=SLIDING_WINDOW)),
    "qwen2": Family("qwen2", "<|endoftext|>", "<|endoftext|>", False, dict(attention_dropout=0.0), CHATML),
    "qwen3": Family("qwen3", "<|endoftext|>", "<|endoftext|>", False, chat_template=CHATML),
    "qwen3_moe": Family("qwen3_moe", "<|endoftext|>", "<|endoftext|>", False,
                        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)),
    "gemma2": Family("gemma2", "<bos>", "<eos>", True,
                     dict(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, tie_word_embeddings=True), GEMMA_CHAT),
    "gemma3_text": Family("gemma3_text", "<bos>", "<eos>", True,
                          dict(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32, layer_types=SLIDING_THEN_GLOBAL,
                               final_logit_softcapping=30.0, tie_word_embeddings=True), GEMMA_CHAT),
    "gpt2": Family("gpt2", "<|endoftext|>", "<|endoftext|>", False, dict(n_positions=MAX_POSITIONS)),
    "gpt_neox": Family("gpt_neox", "<|endoftext|>", "<|endoftext|>", False, dict(rotary_pct=0.25, use_parallel_residual=True)),
    "olmo2": Family("olmo2", "<|endoftext|>", "<|endoftext|>", False),
    "phi3": Family("phi3", "<s>", "<|endoftext|>", True),
    "afmoe": Family("afmoe", "<|begin_of_text|>", "<|end_of_text|>", True,
                    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, num_shared_experts=1,
                         num_dense_layers=1, sliding_window=SLIDING_WINDOW, global_attn_every_n_layers=4,
                         layer_types=SLIDING_THEN_GLOBAL, route_scale=2.5,
                         # vLLM's afmoe reads these; Trinity's config.json has them, transformers'
                         # AfmoeConfig does not (its router is sigmoid-scored and renormalised).
                         score_func="sigmoid", route_norm=True, n_group=1, topk_group=1)),
}
"""Served name stem (`<stem>-tiny` in infra/models.toml) → family."""


def write_family_model(folder: Path, family: str) -> None:
    """Write the tiny checkpoint of `family` (a key of `FAMILIES`) into the empty `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from harvest.tiny_model import train_tokenizer

    spec = FAMILIES[family]
    folder = Path(folder)
    tokenizer = train_tokenizer(VOCAB, bos=spec.bos, eos=spec.eos, add_bos=spec.add_bos)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=spec.bos, eos_token=spec.eos)
    if spec.chat_template:
        fast.chat_template = spec.chat_template
    fast.save_pretrained(folder)
    plain_tokenizer_config(folder, MAX_POSITIONS)

    bos_id, eos_id = tokenizer.token_to_id(spec.bos), tokenizer.token_to_id(spec.eos)
    config = AutoConfig.for_model(spec.model_type, **{**COMMON, **spec.config}, vocab_size=VOCAB, bos_token_id=bos_id,
                                  eos_token_id=eos_id, pad_token_id=eos_id)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    _keep_extra_fields(folder / "config.json", spec.config)
    (folder / BUILT_BY).write_text(json.dumps({"builder": "harvest.tiny_families", "family": family, "seed": SEED}) + "\n")


def _keep_extra_fields(path: Path, fields: dict) -> None:
    """Write into config.json the fields its config class does not keep (AFMoE's router
    fields), so every engine reads the checkpoint as the family's real ones are written."""
    config = json.loads(path.read_text())
    missing = {k: v for k, v in fields.items() if k not in config}
    if missing:
        config.update(missing)
        path.write_text(json.dumps(config, indent=2) + "\n")
