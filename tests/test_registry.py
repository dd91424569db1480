"""The registry, the embedded model and layer resolution."""

from __future__ import annotations

import hashlib

import pytest

from harvest.errors import HarvestUnsupported, InvalidRequest, ModelNotFound, ModelUnavailable
from harvest.layers import default_layers, resolve_layers
from harvest.registry import Registry
from harvest.settings import get_settings
from harvest.tiny_model import build_tiny_model


def test_capabilities_come_from_the_checkpoint_config(tiny):
    import json

    config = json.loads((tiny.path / "config.json").read_text())
    assert tiny.n_layers == config["num_hidden_layers"] >= 8
    assert tiny.hidden_size == config["hidden_size"] >= 256
    assert config["head_dim"] >= 32 and config["max_position_embeddings"] == 2048
    assert tiny.capabilities()["lane"] == "small"


def test_the_embedded_model_is_deterministic(tmp_path, tiny):
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert hashlib.sha256((again / name).read_bytes()).hexdigest() == hashlib.sha256((tiny.path / name).read_bytes()).hexdigest()


def test_declared_models_without_weights(registry):
    big = registry.get("llama-8b")
    assert (big.n_layers, big.hidden_size, big.lane) == (32, 4096, "small")
    assert registry.get("llama-405b").lane == "large"
    with pytest.raises(ModelUnavailable, match="are not on this machine: ask the operators") as refused:
        big.require_path()
    # The message reaches API users: it names the model, never the server's directories.
    assert "looked in" not in refused.value.message and str(get_settings().home) not in refused.value.message


def test_unknown_and_unharvestable_models():
    registry = Registry(
        {"probe-only": {"weights": "x/y", "harvest": False, "declared": {"n_layers": 4, "hidden_size": 64, "max_position_embeddings": 128}}},
        get_settings(),
    )
    with pytest.raises(ModelNotFound):
        registry.get("missing")
    with pytest.raises(HarvestUnsupported):
        registry.for_harvest("probe-only")


def test_layer_resolution(registry):
    big = registry.get("llama-8b")
    assert default_layers(32) == [8, 16, 24] and default_layers(8) == [2, 4, 6]
    assert resolve_layers(big, None) == [8, 16, 24]
    assert resolve_layers(big, "all") == list(range(32))
    assert resolve_layers(big, [24, 8, 8, 0]) == [0, 8, 24]
    with pytest.raises(InvalidRequest, match=r"^meta-llama/Llama-3.1-8B has layers 0 to 31: it has no layer 40\.$") as info:
        resolve_layers(big, [8, 40])
    assert info.value.param == "layers"
    for bad in ("ALL", [], [1.5], [True], -1):
        with pytest.raises(InvalidRequest):
            resolve_layers(big, bad)


def test_checkpoints_on_disk_lists_what_is_there_and_builds_nothing(tmp_path, tiny):
    """What the run starter preloads from: a model not built yet stays unbuilt (building it
    would start threads in a process that must stay single-threaded)."""
    shapes = {"n_layers": 8, "hidden_size": 256, "max_position_embeddings": 2048}
    registry = Registry({
        "llama-tiny": {"weights": "models/llama-tiny", "builtin": True},
        "installed": {"weights": "org/installed", "declared": shapes},
        "absent": {"weights": "org/absent", "declared": shapes},
    }, get_settings().model_copy(update={"home": tmp_path}))
    assert registry.checkpoints_on_disk() == {}
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no staging folder, no lock file
    (tmp_path / "models" / "org").mkdir(parents=True)
    (tmp_path / "models" / "llama-tiny").symlink_to(tiny.path)
    (tmp_path / "models" / "org" / "installed").symlink_to(tiny.path)
    assert registry.checkpoints_on_disk() == {
        "llama-tiny": tmp_path / "models" / "llama-tiny", "installed": tmp_path / "models" / "org" / "installed",
    }


def test_the_embedded_model_is_built_once_when_first_requests_arrive_together(tmp_path):
    """A fresh replica's first submits come at once: all of them get a whole checkpoint."""
    import json
    import threading

    from harvest.tiny_model import ensure_tiny_model

    target = tmp_path / "models" / "llama-tiny"
    barrier, errors, configs = threading.Barrier(4), [], []

    def first_request():
        barrier.wait()
        try:
            path = ensure_tiny_model(target)
            configs.append(json.loads((path / "config.json").read_text())["num_hidden_layers"])
        except Exception as exc:  # noqa: BLE001 - collected and asserted on
            errors.append(exc)

    threads = [threading.Thread(target=first_request) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and configs == [8] * 4
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.startswith(".")) == ["llama-tiny"]  # no staging left


def test_secret_files_are_owner_only_from_creation_and_the_first_writer_wins(tmp_path):
    import os
    import stat

    from harvest.private_files import write_private

    old = os.umask(0)  # even with a permissive umask
    try:
        path = tmp_path / "secrets" / "signing.key"
        assert write_private(path, "first", replace=False)
        assert not write_private(path, "second", replace=False)
        assert path.read_text() == "first" and stat.S_IMODE(path.stat().st_mode) == 0o600
        write_private(path, "third")
        assert path.read_text() == "third" and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(p.name for p in path.parent.iterdir()) == ["signing.key"]  # no staging left
    finally:
        os.umask(old)
