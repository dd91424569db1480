"""Sampling at the ends of its documented ranges (found by bench/fuzz_api.py's fuzzing: a chat
completion with `top_p` 5e-324 answered 500, `invalid multinomial distribution`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harvest.engines.hf_generate import _sample


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 5e-324), (1e-320, 1.0), (1e-320, 5e-324), (2.0, 1e-45)])
def test_the_smallest_legal_top_p_and_temperature_sample_the_most_likely_token(temperature, top_p):
    logits = torch.randn(1216, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    row = SimpleNamespace(spec=SimpleNamespace(temperature=temperature, top_p=top_p), generator=generator)
    assert _sample(logits, row) == int(torch.argmax(logits))
