"""The model registry: which models the service serves, where their weights are, what they can do.

Shapes come from the checkpoint's own `config.json` whenever the weights are present; the
registry file only adds operational settings (lane, context the service runs, inline cap).
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harvest.architectures import Architecture, block_path, read_architecture, shapes_from_config
from harvest.built_checkpoints import Writer, ensure_built, is_built
from harvest.errors import HarvestUnsupported, ModelNotFound, ModelUnavailable, echo
from harvest.gguf_checkpoint import GGUFSource
from harvest.lanes import Lane, load_lanes
from harvest.settings import Settings
from harvest.tiny_families import FAMILIES, write_family_model
from harvest.tiny_model import write_tiny_model

log = logging.getLogger("harvest.registry")

__all__ = ["ModelInfo", "Registry", "load_registry", "builder_for", "ensure_builtin"]


@dataclass(frozen=True)
class ModelInfo:
    """One served model, with its shapes resolved."""

    name: str
    """Served name, as clients send it in `model`."""
    weights: str
    """Weights as written in the registry (repo id, relative path or URL)."""
    path: Path | None
    """Local checkpoint directory, or None when the weights are not on this machine."""
    lane: str
    harvest: bool
    inline: bool
    n_layers: int
    hidden_size: int
    max_model_len: int
    max_activation_prompt_tokens: int
    builtin: bool = False
    tensor_parallel_size: int = 1
    """GPUs one run of the model spreads it over; a worker host's slots must have this many
    (`harvest.placement.check_fits`)."""
    build_target: Path | None = None
    """For a project-built checkpoint not built yet: where `require_path` builds it."""
    build_entry: dict | None = field(default=None, compare=False)
    """Its registry entry (which builder, from what source); plain data, so ModelInfo pickles."""
    architecture: Architecture | None = None
    """transformers' class and where its blocks are, from its config (or the entry's
    `architecture` and `model_type` while the weights are absent); None when neither says."""
    searched: tuple[Path, ...] = field(default=(), compare=False)
    """Where the weights were looked for, when they are not on this machine (for the log)."""

    @property
    def display_name(self) -> str:
        """How messages name the checkpoint: its repo id, or the served name for local builds."""
        return self.name if self.builtin else self.weights

    @property
    def available(self) -> bool:
        return self.path is not None

    def require_path(self) -> Path:
        if self.path is None and self.build_target is not None:
            self._build()
        if self.path is None:
            # The message goes to users: it names the model, never where the server looked
            # (its directories are nobody's business outside it; operators have the log line).
            source = f" ({self.weights})" if _is_repo_id(self.weights) else ""
            log.warning("the weights of %s (%s) were not found; looked in %s", self.name, self.weights,
                        ", ".join(str(p) for p in self.searched))
            raise ModelUnavailable(
                f"The weights of {self.name}{source} are not on this machine: ask the operators to install them, "
                "or use another model from GET /v1/models."
            )
        return self.path

    def _build(self) -> None:
        """Build the checkpoint on first use of its weights (listing the model needs only its
        declared shapes), check them against its config, and hold its folder from then on."""
        path = ensure_builtin(self.build_target, self.name, self.build_entry or {})
        if path is None:
            return
        shapes = _shapes_from_config(path)
        if (shapes["n_layers"], shapes["hidden_size"]) != (self.n_layers, self.hidden_size):
            raise ValueError(f"models.toml: {self.name} declares {self.n_layers} layers of {self.hidden_size}, "
                             f"but its built config says {shapes['n_layers']} of {shapes['hidden_size']}")
        object.__setattr__(self, "path", path)  # frozen for callers; set once, as the registry would have
        object.__setattr__(self, "architecture", read_architecture(path))

    def capabilities(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "hidden_size": self.hidden_size,
            "max_model_len": self.max_model_len,
            "max_activation_prompt_tokens": self.max_activation_prompt_tokens,
            "harvest": self.harvest,
            "inline": self.inline,
            "lane": self.lane,
            **(self.architecture.describe() if self.architecture else {}),
        }


def builder_for(name: str, entry: dict) -> Writer | None:
    """The writer of a registry entry with `builtin = true`: from its `gguf` source when it
    names one (None when that package is not installed here), the tiny checkpoint of its
    `family` (`harvest.tiny_families`) when it names one, else the embedded tiny Llama."""
    family = entry.get("family")
    if family is not None:
        if family not in FAMILIES:
            raise ValueError(f"models.toml: {name} has family {family!r}; the families are {', '.join(FAMILIES)}")
        return lambda folder: write_family_model(folder, family)
    source = entry.get("gguf")
    if source is None:
        return write_tiny_model
    gguf = GGUFSource.parse(source, name)
    return gguf.writer() if gguf.present() else None


def ensure_builtin(target: Path, name: str, entry: dict) -> Path | None:
    """The folder of a `builtin = true` registry entry, built on first use; None when it is
    not built and its source is not on this host."""
    target = Path(target)
    if is_built(target):
        return target
    write = builder_for(name, entry)
    return None if write is None else ensure_built(target, write)


def _candidate_dirs(weights: str, settings: Settings) -> list[Path]:
    if weights.startswith("/"):
        return [Path(weights)]
    candidates = [settings.home / weights, settings.home / "models" / weights]
    if "/" in weights:
        hub = Path(os.environ.get("HF_HUB_CACHE", Path.home() / ".cache" / "huggingface" / "hub"))
        snapshots = hub / ("models--" + weights.replace("/", "--")) / "snapshots"
        if snapshots.is_dir():
            candidates.extend(sorted(snapshots.iterdir()))
        else:
            candidates.append(snapshots)
    return candidates


def _find_checkpoint(weights: str, settings: Settings) -> Path | None:
    for candidate in _candidate_dirs(weights, settings):
        if (candidate / "config.json").exists():
            return candidate
    return None


def _is_repo_id(weights: str) -> bool:
    """A Hugging Face repo id (`org/name`), not a server path or URL."""
    parts = weights.split("/")
    return len(parts) == 2 and all(parts) and "://" not in weights and not weights.startswith((".", "~"))


def _shapes_from_config(path: Path) -> dict:
    """The checkpoint's shapes, whatever its family calls them (`harvest.architectures`)."""
    return shapes_from_config(json.loads((path / "config.json").read_text()))


class Registry:
    """Served models by name; builds the project's own checkpoints (`builtin = true`) the first
    time they are asked for (`harvest.built_checkpoints`)."""

    def __init__(self, entries: dict[str, dict], settings: Settings):
        self._entries = entries
        self._settings = settings
        self._cache: dict[str, ModelInfo] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> ModelInfo:
        if name not in self._entries:
            raise ModelNotFound(
                f"The model {echo(name)} does not exist. Served models: {', '.join(self._entries)}.", param="model"
            )
        if name not in self._cache:
            self._cache[name] = self._resolve(name, self._entries[name])
        return self._cache[name]

    def for_harvest(self, name: str) -> ModelInfo:
        info = self.get(name)
        if not info.harvest:
            raise HarvestUnsupported(f"The model {name} is served, but not for harvests.", param="model")
        return info

    def all(self) -> list[ModelInfo]:
        return [self.get(name) for name in self._entries]

    def lanes(self) -> dict[str, Lane]:
        """The lanes of the same settings as the models (`harvest.lanes`)."""
        return load_lanes(self._settings)

    def checkpoints_on_disk(self) -> dict[str, Path]:
        """The checkpoint folder of each model whose weights are on this host now. Unlike `get`,
        it builds and converts nothing: a caller that must stay single-threaded and keep torch
        unused (the run starter) may call it."""
        found = {}
        for name, entry in self._entries.items():
            if entry.get("builtin"):
                path = self._settings.home / entry["weights"]
                path = path if is_built(path) else None
            else:
                path = _find_checkpoint(entry["weights"], self._settings)
            if path is not None:
                found[name] = path
        return found

    def _resolve(self, name: str, entry: dict) -> ModelInfo:
        lane = entry.get("lane", "small")
        lanes = load_lanes(self._settings)
        if lane not in lanes:
            raise ValueError(f"models.toml: {name} has lane {lane!r}; the lanes are {', '.join(lanes)} ({self._settings.lanes_file})")
        weights = entry["weights"]
        build_target = None
        if entry.get("builtin") and "declared" in entry and not is_built(self._settings.home / weights):
            # Shapes are declared: list it now, build it when its weights are first needed.
            path, build_target = None, self._settings.home / weights
        elif entry.get("builtin"):
            path = ensure_builtin(self._settings.home / weights, name, entry)
        else:
            path = _find_checkpoint(weights, self._settings)
        declared = entry.get("declared", {})
        if path is not None:
            shapes = _shapes_from_config(path)
            for key, value in declared.items():
                if shapes.get(key) != value:
                    raise ValueError(f"models.toml: {name} declares {key}={value} but its config says {shapes.get(key)}")
        elif declared:
            shapes = declared
        else:
            raise ValueError(f"models.toml: {name} has no weights here and declares no shapes")
        if path is not None:
            architecture = read_architecture(path)
        elif "architecture" in entry and "model_type" in entry:
            architecture = Architecture(entry["architecture"], entry["model_type"], block_path(entry["model_type"]))
        else:
            architecture = None
        max_model_len = min(entry.get("max_model_len", shapes["max_position_embeddings"]), shapes["max_position_embeddings"])
        tensor_parallel_size = entry.get("tensor_parallel_size", 1)
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"models.toml: {name} has tensor_parallel_size {tensor_parallel_size!r}; it must be a positive integer")
        return ModelInfo(
            name=name,
            weights=weights,
            path=path,
            lane=lane,
            harvest=bool(entry.get("harvest", True)),
            inline=bool(entry.get("inline", True)),
            n_layers=shapes["n_layers"],
            hidden_size=shapes["hidden_size"],
            max_model_len=max_model_len,
            max_activation_prompt_tokens=int(entry.get("max_activation_prompt_tokens", max_model_len)),
            builtin=bool(entry.get("builtin", False)),
            tensor_parallel_size=tensor_parallel_size,
            build_target=build_target,
            build_entry=dict(entry) if build_target is not None else None,
            architecture=architecture,
            searched=tuple(_candidate_dirs(weights, self._settings)) if path is None and build_target is None else (),
        )


def load_registry(settings: Settings) -> Registry:
    """The models of `settings.models_file`, their weights looked for where `settings` say."""
    with open(settings.models_file, "rb") as handle:
        entries = tomllib.load(handle).get("models", {})
    return Registry(entries, settings)
