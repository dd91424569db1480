"""Runs in a process of its own (`python -m tests.vllm_families OUT NAME...`): each model through
the vLLM engine, one engine start per model, in turn; writes each model's captures of the
prompts in OUT/<name>.in.json to OUT/<name>.safetensors, or its refusal to OUT/<name>.refused.

A process of its own because vLLM's Transformers backend patches transformers' classes in the
process that loads it: the test process keeps running transformers' own forward passes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from harvest.settings import get_settings


def main(out: Path, names: list[str]) -> None:
    from safetensors.torch import save_file

    from harvest.capture_spec import CaptureSpec
    from harvest.engines.base import SamplingSpec
    from harvest.engines.vllm import VLLMEngine
    from harvest.errors import HarvestUnsupported
    from harvest.registry import load_registry

    registry = load_registry(get_settings())
    for name in names:
        job = json.loads((out / f"{name}.in.json").read_text())
        try:
            engine = VLLMEngine(registry.get(name))
        except HarvestUnsupported as exc:
            (out / f"{name}.refused").write_text(exc.message)
            continue
        spec = CaptureSpec(layers=job["layers"])
        packed = engine.capture(job["prompts"], spec).values
        alone = [engine.capture([p], spec).values[0] for p in job["prompts"]]
        completions = engine.generate(job["inline"], [SamplingSpec(**s) for s in job["sampling"]], job["layers"])
        engine.close()
        tensors = {f"packed_{i}": v.contiguous() for i, v in enumerate(packed)}
        tensors |= {f"alone_{i}": v.contiguous() for i, v in enumerate(alone)}
        tensors |= {f"inline_{i}": g.residual.contiguous() for i, g in enumerate(completions)}
        save_file(tensors, str(out / f"{name}.safetensors"))
        (out / f"{name}.tokens.json").write_text(json.dumps([g.token_ids for g in completions]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
