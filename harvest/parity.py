"""Does an engine give transformers' own values for a model? `harvest models check NAME`.

An operator who serves a checkpoint (any local transformers folder, or a repo id in the HF
cache) runs this on the host's own weights before users harvest it. The reference is
transformers' forward pass of each prompt alone, in float32, with a hook on every decoder
block (layer k: block k's output before the final norm, `harvest.engines.hf_model`). The
engine then captures the same prompts twice: all together (packed into shared passes) and one
at a time. Prompts run from 1 token to `max_model_len`, and past the sliding window where the
family has one. A layer passes when every token's cosine to the reference is ≥ `MIN_COSINE`
and its relative RMS error is ≤ `MAX_RELATIVE_RMS` (the stored values are bf16: one rounding
is ~0.2 %).

The reference runs before the engine loads: vLLM's Transformers backend patches transformers'
classes in the process that loads it.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import torch

__all__ = ["MIN_COSINE", "MAX_RELATIVE_RMS", "LayerParity", "probe_lengths", "compare", "main"]

MIN_COSINE = 0.9999
MAX_RELATIVE_RMS = 0.01


@dataclass
class LayerParity:
    """The worst of one layer over every prompt of one way of running them."""

    layer: int
    cosine: float = 1.0
    relative_rms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.cosine >= MIN_COSINE and self.relative_rms <= MAX_RELATIVE_RMS


def probe_lengths(max_model_len: int, window: int | None) -> list[int]:
    """Prompt lengths from 1 to `max_model_len`, two of them past the sliding window if any."""
    lengths = {1, 2, 3, 7, 31, 100, max_model_len}
    if window:
        lengths |= {window - 1, window, window + 1, 3 * window + 5}
    return sorted(n for n in lengths if 1 <= n <= max_model_len)


def compare(values: list[torch.Tensor], references: list[torch.Tensor], layers: list[int]) -> list[LayerParity]:
    """Per layer, the worst per-token cosine and relative RMS error of `values` (per prompt
    `[layers, tokens, hidden]`) against `references`, in float64."""
    worst = [LayerParity(layer) for layer in layers]
    for got, ref in zip(values, references, strict=True):
        got, ref = got.double(), ref.double()
        for k, entry in enumerate(worst):
            cosine = torch.nn.functional.cosine_similarity(got[k], ref[k], dim=-1).min().item()
            rms = ((got[k] - ref[k]).pow(2).mean().sqrt() / ref[k].pow(2).mean().sqrt().clamp_min(1e-30)).item()
            entry.cosine = min(entry.cosine, cosine)
            entry.relative_rms = max(entry.relative_rms, rms)
    return worst


@torch.inference_mode()
def _references(model, prompts: list[list[int]], layers: list[int]) -> list[torch.Tensor]:
    from harvest.engines.hf import load_hf_model
    from harvest.engines.hf_model import decoder_blocks

    hf_model = load_hf_model(model, torch.device("cpu"))
    blocks = decoder_blocks(hf_model, model.name)
    references = []
    for prompt in prompts:
        seen: dict[int, torch.Tensor] = {}
        handles = [blocks[k].register_forward_hook(
            lambda _m, _a, out, k=k: seen.__setitem__(k, out[0] if isinstance(out, tuple) else out)) for k in layers]
        try:
            hf_model(input_ids=torch.tensor([prompt]), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        references.append(torch.stack([seen[k][0] for k in layers]).float())
    del hf_model
    return references


def main(argv: list[str]) -> int:
    """`harvest models check NAME [--engine hf|vllm]`: print the verdict; exit 0 when it passes."""
    parser = argparse.ArgumentParser(prog="harvest models check",
                                     description="Compare an engine's captures of a served model with transformers' own forward pass.")
    parser.add_argument("action", choices=["check"])
    parser.add_argument("model", help="served model name (GET /v1/models)")
    parser.add_argument("--engine", help="hf or vllm (default: what HARVEST_ENGINE picks on this host)")
    args = parser.parse_args(argv[1:])

    from harvest.capture_spec import CaptureSpec
    from harvest.engines.choice import choose_engine, load_engine
    from harvest.errors import HarvestError
    from harvest.engines.limits import EngineLimits
    from harvest.registry import load_registry
    from harvest.settings import get_settings

    settings = get_settings()
    try:
        model = load_registry(settings).get(args.model)
        model.require_path()
        choice = choose_engine(args.engine or settings.engine, warm=True)
    except HarvestError as exc:
        print(f"harvest models check: {exc.message}", file=sys.stderr)
        return 2
    import json

    config = json.loads((model.path / "config.json").read_text())
    window = config.get("sliding_window") if isinstance(config.get("sliding_window"), int) else None
    vocab = config.get("vocab_size") or 256
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in probe_lengths(model.max_model_len, window)]
    layers = list(range(model.n_layers))
    arch = model.architecture.describe() if model.architecture else {}
    print(f"{model.name}: {arch.get('architecture', '?')}, layer k = {arch.get('layer_module', '?')}; "
          f"{len(prompts)} prompts of {', '.join(str(len(p)) for p in prompts)} tokens")
    references = _references(model, prompts, layers)
    try:
        engine = load_engine(model, choice, EngineLimits.of(settings), warm=True)
    except HarvestError as exc:
        print(f"engine {choice.name}: refused: {exc.message}")
        print("verdict: REFUSED")
        return 1
    spec = CaptureSpec(layers=layers)
    packed = engine.capture(prompts, spec).values
    alone = [engine.capture([p], spec).values[0] for p in prompts]
    engine.close()
    verdict = True
    print(f"engine {choice.name} ({choice.reason})")
    print("layer  module                    packed: min cos  rel RMS   alone: min cos  rel RMS")
    for p, a in zip(compare(packed, references, layers), compare(alone, references, layers), strict=True):
        verdict &= p.ok and a.ok
        module = arch.get("layer_module", "?").replace("{k}", str(p.layer))
        print(f"{p.layer:5d}  {module:24s}  {p.cosine:15.6f}  {p.relative_rms:7.3%}   {a.cosine:14.6f}  {a.relative_rms:7.3%}"
              f"{'' if p.ok and a.ok else '  FAIL'}")
    print(f"verdict: {'PASS' if verdict else 'FAIL'} (every token's cosine >= {MIN_COSINE}, relative RMS <= {MAX_RELATIVE_RMS:.0%})")
    return 0 if verdict else 1
