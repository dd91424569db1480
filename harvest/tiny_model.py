"""The embedded model `llama-tiny`: a small Llama checkpoint built deterministically.

No weights can be downloaded on a fresh machine, so the project makes its own checkpoint:
random weights from a fixed seed and a byte-level BPE tokenizer trained on a text corpus
shipped in `harvest/data/`. It is written in the standard Hugging Face layout and loaded by
the same `from_pretrained` code as any real checkpoint, so nothing downstream knows it is
special. head_dim is 64 because vLLM's CPU attention only supports some head sizes (≥ 32).
"""

from __future__ import annotations

import json
from pathlib import Path

from harvest.built_checkpoints import BUILT_BY, ensure_built, plain_tokenizer_config, write_atomically

__all__ = ["TINY_CONFIG", "BOS", "EOS", "train_tokenizer", "write_tiny_model", "build_tiny_model", "ensure_tiny_model"]

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
CORPUS = Path(__file__).with_name("data") / "tokenizer_corpus.txt"
SEED = 20261130
# A chat template in Llama 3's manner: it writes BOS itself, while the tokenizer also prepends
# BOS to plain text. Chat requests to the tiny model thus meet the trap a real Llama chat
# template sets (a client-side render sent as text carries two BOS); the server must not.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TINY_CONFIG = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    # Random weights at the default 0.02 scale make every block nearly the identity;
    # a larger scale gives layers that differ visibly, which the parity tests need.
    initializer_range=0.1,
)


def train_tokenizer(vocab_size: int, *, bos: str = BOS, eos: str = EOS, add_bos: bool = True):
    """A byte-level BPE tokenizer trained on the shipped corpus, with `bos` and `eos` as its
    special tokens; with `add_bos` it prepends `bos` when the caller asks for special tokens,
    as Llama 3's tokenizer does (GPT-2's and Pythia's add nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys([bos, eos])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    if add_bos:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def write_tiny_model(folder: Path, *, config_overrides: dict | None = None, vocab_size: int = 2048) -> None:
    """Write the deterministic random-weight Llama checkpoint into the empty `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    staging = Path(folder)
    tokenizer = train_tokenizer(vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(staging)
    plain_tokenizer_config(staging, TINY_CONFIG["max_position_embeddings"])

    params = {**TINY_CONFIG, **(config_overrides or {})}
    # Round the embedding table up to a multiple of 64, as real checkpoints do.
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    config = LlamaConfig(
        vocab_size=vocab,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        torch_dtype="float32",
        **params,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(staging, safe_serialization=True)
    (staging / BUILT_BY).write_text(json.dumps({"builder": "harvest.tiny_model", "seed": SEED}) + "\n")


def build_tiny_model(target: Path, *, config_overrides: dict | None = None, vocab_size: int = 2048) -> Path:
    """Write the checkpoint into `target` (replaced atomically), whether or not it is there."""
    return write_atomically(
        target, lambda folder: write_tiny_model(folder, config_overrides=config_overrides, vocab_size=vocab_size)
    )


def ensure_tiny_model(target: Path) -> Path:
    """Build the checkpoint the first time it is needed (once per host, under a lock:
    `harvest.built_checkpoints`); later calls only check it is there."""
    return ensure_built(target, write_tiny_model)
