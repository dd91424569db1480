"""The vLLM worker side of the harvest engine: hooks on the requested blocks, reduced on device.

`HarvestWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`). For one shard
the driver calls `harvest_begin(plan)`, runs `LLM.generate`, then `harvest_end()`. In between,
forward hooks on the requested blocks only take each step's rows of this session's requests
(told apart by `extra_args["harvest_index"]` and the step's `query_start_loc`), add the fused
(mlp_out, residual) pair into the stream, project it (float32, on the device) when asked,
fold the statistics partial (`RunningStats`, float64, on the device; each prompt's first
position left out), and copy the stored-dtype values to host memory. For a harvest (each
prompt's length known, `CapturePlan.keep`) every prompt's rows go straight to their place in
its own host tensor (pinned on a GPU, the copy queued, not waited for), so nothing is put
together on the host afterwards; for a generation (lengths unknown) each layer's rows of a
step go to host once and are joined at the end.

A hook never raises into vLLM (that would take its engine down for every later shard): it
records the error, and `harvest_end` reports it with every prompt's position count checked
per layer, so the driver raises `CaptureFailed` instead of returning a short tensor.
Tensor parallelism: rank 0 answers (every rank holds the whole stream). Pipeline parallelism is not
supported (a rank would hold only its own blocks).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harvest.capture import host_copy
from harvest.stats import RunningStats

__all__ = ["INDEX_KEY", "CapturePlan", "HarvestWorkerExtension", "in_process"]

INDEX_KEY = "harvest_index"
"""`SamplingParams.extra_args` key naming a request's prompt index within the session."""


def in_process() -> bool:
    """True when vLLM's engine core (and so this worker) runs in the driver's process."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"




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
    parts: list[int] | None = None
    """The shard each prompt belongs to, when several are captured together (concurrent jobs
    on one engine): statistics are kept per shard. None: one shard."""

    @property
    def n_parts(self) -> int:
        return 1 if self.parts is None else max(self.parts) + 1

    def part(self, index: int) -> int:
        return 0 if self.parts is None else self.parts[index]


def _layer_modules(worker: Any) -> dict[int, torch.nn.Module]:
    """Global block index → decoder-layer module on this worker (vllm-lens' discovery).

    vllm-lens 1.3 maps them from vLLM's layer registry (`_discover_layer_modules`); 1.2.x only
    has `_get_layers(model)`, the decoder's ModuleList, where blocks of other pipeline stages
    are `PPMissingLayer`s. The one seam the missing-layer test replaces.
    """
    from vllm_lens import _worker_ext as lens

    discover = getattr(lens, "_discover_layer_modules", None)
    if discover is not None:
        return discover(worker)
    from vllm.model_executor.models.utils import PPMissingLayer

    return {i: m for i, m in enumerate(lens._get_layers(worker.model_runner.model)) if not isinstance(m, PPMissingLayer)}


def _runner_problems(worker: Any) -> list[str]:
    """What this worker lacks of the V1 model-runner state the hooks read (empty when all is there)."""
    problems = []
    if getattr(worker, "use_v2_model_runner", False):
        problems.append("vLLM's V2 model runner is active (set VLLM_USE_V2_MODEL_RUNNER=0): the hooks read V1 runner state")
    runner = getattr(worker, "model_runner", None)
    batch = getattr(runner, "input_batch", None)
    for name, ok in (
        ("model_runner.model", getattr(runner, "model", None) is not None),
        ("model_runner.requests", isinstance(getattr(runner, "requests", None), dict)),
        ("model_runner.input_batch.req_ids", batch is not None and hasattr(batch, "req_ids")),
        ("model_runner.input_batch.num_reqs", batch is not None and hasattr(batch, "num_reqs")),
    ):
        if not ok:
            problems.append(f"the worker has no {name}")
    if not problems:
        try:
            if not _layer_modules(worker):
                problems.append("vllm-lens found no decoder layers on this worker")
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises
            problems.append(f"decoder-layer discovery failed: {type(exc).__name__}: {exc}")
    return problems


def _query_start_loc(metadata: dict, runner: Any, num_reqs: int) -> list[int]:
    """Row offsets of the step's requests: the attention metadata's, else the runner's own copy.

    FlashAttention and Triton metadata carry `query_start_loc`; FlashInfer's does not, and
    there the V1 runner's host buffer (`query_start_loc.np`, filled for this step before
    the forward pass) gives the same offsets.
    """
    query_start_loc = next((m.query_start_loc for m in metadata.values() if hasattr(m, "query_start_loc")), None)
    if query_start_loc is not None:
        return query_start_loc[: num_reqs + 1].tolist()
    host = getattr(getattr(runner, "query_start_loc", None), "np", None)
    if host is None:
        raise RuntimeError("no attention metadata with query_start_loc: cannot tell which rows belong to which request")
    return host[: num_reqs + 1].tolist()


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
    num_reqs = runner.input_batch.num_reqs
    bounds = _query_start_loc(metadata, runner, num_reqs)
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
        self.row_of_layer = {layer: k for k, layer in enumerate(plan.layers)}
        self.placed: dict[int, torch.Tensor] = {}  # prompt -> its [n_layers, keep, n_features] host tensor
        self.stats: dict[tuple[int, int], RunningStats] = {}  # (part, layer) -> partial
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
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            # vLLM's Transformers backend (GPT-NeoX, OLMo-2, …) runs transformers' own blocks
            # on one row holding the step's tokens: `[1, tokens, hidden]`.
            hidden = hidden[0]
        self._hidden_ptr = hidden.data_ptr()
        seen = self.seen[layer]
        pieces: list[tuple[int, int, int, int]] = []  # (prompt, first row, rows kept, positions it had)
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
            pieces.append((index, start, rows, seen[index]))
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
            rows_index = torch.cat([torch.arange(s, s + n) for _, s, n, _ in pieces]).to(hidden.device, non_blocking=True)
            values = hidden.index_select(0, rows_index)
        if self.directions is not None:
            values = values.float() @ self.directions.T  # projected on the device
        values = values.to(self.stored_dtype)  # the statistics describe the stored values
        if self.plan.stats:
            for part, rows in self._counted_rows(pieces, skip_first, offset).items():
                if rows is not None and rows.numel() == 0:
                    continue
                counted = values if rows is None else values.index_select(0, rows.to(values.device, non_blocking=True))
                if (part, layer) not in self.stats:
                    self.stats[(part, layer)] = RunningStats(1, values.shape[-1], device=values.device)
                self.stats[(part, layer)].update(counted[None])
        if self.plan.keep is not None:
            self._place(layer, pieces, values)
            return
        host = self._to_host(values)  # one copy per layer per step
        at = 0
        for index, _start, rows, _had in pieces:
            self.chunks[layer][index].append(host[at : at + rows])
            at += rows

    def _place(self, layer: int, pieces: list[tuple[int, int, int, int]], values: torch.Tensor) -> None:
        """Each prompt's rows of this step straight into its own host tensor, at this layer and
        the positions they are; from a GPU into pinned memory, queued (`result` syncs)."""
        pinned = values.device.type == "cuda"
        at = 0
        for index, _start, rows, had in pieces:
            out = self.placed.get(index)
            if out is None:
                shape = (len(self.plan.layers), self.plan.keep[index], values.shape[-1])
                out = self.placed[index] = torch.empty(shape, dtype=values.dtype, pin_memory=pinned)
            out[self.row_of_layer[layer], had : had + rows].copy_(values[at : at + rows], non_blocking=pinned)
            at += rows

    def _counted_rows(self, pieces: list[tuple[int, int, int, int]], skip_first: list[int], offset: int) -> dict[int, torch.Tensor | None]:
        """Per part, the rows of this step (host indices into the gathered values) its
        statistics count: every row but a prompt's first position. None: all `offset` rows."""
        parts = [self.plan.part(index) for index, _, _, _ in pieces]
        if len(set(parts)) == 1 and not skip_first:
            return {parts[0]: None}
        keep = torch.ones(offset, dtype=torch.bool)
        keep[skip_first] = False
        if len(set(parts)) == 1:
            return {parts[0]: keep.nonzero().squeeze(1)}
        owner = torch.repeat_interleave(torch.tensor(parts), torch.tensor([n for _, _, n, _ in pieces]))
        return {part: (keep & (owner == part)).nonzero().squeeze(1) for part in set(parts)}

    def _to_host(self, values: torch.Tensor) -> torch.Tensor:
        if values.device.type == "cuda":
            # Into pinned memory, without waiting: the forward pass goes on while the copy runs
            # (the caching allocator orders any reuse of `values` after it); `result` syncs.
            return host_copy(values)
        # On the CPU `values` may still be vLLM's own buffer (no projection, no dtype change).
        return values.clone() if values.data_ptr() == self._hidden_ptr else values

    def result(self, hidden_size: int) -> dict:
        """The reduced shard: per-prompt `[n_layers, n_tokens, n_features]` and a stats partial per part."""
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
                if plan.keep is not None:
                    values[index] = self.placed[index]
                else:
                    values[index] = torch.stack([torch.cat(self.chunks[layer][index]) for layer in plan.layers])
        stats_states = None
        if plan.stats and not errors:
            stats_states = [self._stacked_stats(part, hidden_size, errors) for part in range(plan.n_parts)]
        return {"values": values if not errors else None, "stats": stats_states if not errors else None, "errors": errors}

    def _stacked_stats(self, part: int, hidden_size: int, errors: list[str]) -> dict | None:
        """One part's per-layer partials as one `[n_layers, …]` partial's state."""
        n_features = self.n_features or hidden_size
        stacked = RunningStats(len(self.plan.layers), n_features)
        layers = [self.stats.get((part, layer)) or RunningStats(1, n_features) for layer in self.plan.layers]
        counts = {layer: partial.count for layer, partial in zip(self.plan.layers, layers)}
        if len(set(counts.values())) != 1:
            errors.append(f"The layers' statistics cover different numbers of positions: {counts}.")
            return None
        stacked.count = layers[0].count
        stacked.mean = torch.cat([p.mean.cpu() for p in layers])
        stacked.m2 = torch.cat([p.m2.cpu() for p in layers])
        stacked.norm_sum = torch.cat([p.norm_sum.cpu() for p in layers])
        return stacked.state_dict()


try:  # subclassing vllm-lens keeps its own features working on our engine (see harvest.engines.vllm)
    from vllm_lens._worker_ext import HiddenStatesExtension as _Base
except ImportError:  # pragma: no cover - only without vllm-lens
    _Base = object


class HarvestWorkerExtension(_Base):  # type: ignore[misc, valid-type]
    """Mixed into vLLM's worker (`worker_extension_cls`); its methods are `collective_rpc` targets."""

    _harvest_session: _Session | None = None

    def _harvest_should_capture(self) -> bool:
        # Every tensor-parallel rank holds the whole residual stream: rank 0 answers.
        tp = self.parallel_config.tensor_parallel_size
        return tp <= 1 or self.rank % tp == 0

    def harvest_check(self) -> list[str]:
        """Problems that would stop a capture on this worker (`VLLMEngine` raises on any)."""
        return _runner_problems(self)

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
        if in_process():
            return result  # same process as the driver: hand the tensors over as they are
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
