"""What a capture asks for, and the on-device reduction every engine applies to it.

An engine runs the forward passes and hands each prompt's `[n_layers_kept, n_tokens, hidden]`
activations, still on the device, to `PromptReducer.reduce`. The reducer projects onto the
unit directions (if any), converts to the stored dtype, folds the statistics partial of
exactly those stored values in float64, and only then copies to host memory, so projections
and statistics never need the raw stream on the host.

From a GPU that copy goes into pinned memory without waiting (`host_copy`), so an engine can
queue its next forward pass before the copies land and hand the previous batch's values on
while the device computes (`Landing`). The first GPU run (bench/RESULTS.md, "GPU") measured
blocking copies into fresh pageable memory at ~1.6 GB/s: the copy, not the hooks, was the cost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from harvest.capture_spec import CaptureSpec
from harvest.errors import CaptureFailed
from harvest.stats import RunningStats

__all__ = ["ShardCapture", "PromptReducer", "Landing", "host_copy", "StopForward", "block_hooks", "check_capture"]


@dataclass
class ShardCapture:
    """An engine's answer for one shard: host tensors in prompt order, plus a stats partial."""

    values: list[torch.Tensor]
    """Per prompt, `[n_layers_kept, n_tokens, n_features]` in the stored dtype, on the host."""
    stats: RunningStats
    forward_s: float = 0.0
    padded_tokens: int = 0
    """Filler tokens the forward passes ran beside these prompts (`harvest.engines.packing`)."""
    extra: dict = field(default_factory=dict)


def host_copy(value: torch.Tensor) -> torch.Tensor:
    """`value` in host memory. From a GPU, a pinned tensor whose copy is queued, not waited for:
    read it only after a `Landing` made later has been waited on. Pinned blocks come from torch's
    caching host allocator, which reuses a freed block once the copies into it are done."""
    if value.device.type != "cuda":
        return value.cpu()
    return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)


class Landing:
    """Marks every copy queued on the device so far; `wait()` returns once they are in host memory."""

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class PromptReducer:
    """Projection, statistics and the device → host copy, shared by every engine."""

    def __init__(self, spec: CaptureSpec, hidden_size: int, device: torch.device):
        self.spec = spec
        self.device = device
        self.directions = None if spec.directions is None else torch.from_numpy(spec.directions).to(device, torch.float32)
        self.stats = RunningStats(len(spec.layers), spec.n_features(hidden_size), device=device)

    @torch.inference_mode()
    def reduce(self, acts: torch.Tensor) -> torch.Tensor:
        """`acts` `[n_layers_kept, n_tokens, hidden]` on the device → the stored host tensor
        (from a GPU, still landing: see `host_copy`)."""
        values = acts if self.directions is None else acts.float() @ self.directions.T
        stored = values.to(self.spec.stored_dtype)
        # The statistics describe exactly the values the files hold (bf16 for the stream), so a
        # reader normalising what it reads gets mean 0 and std 1; a prompt's first position
        # never enters them.
        self.stats.update(stored[:, 1:])
        return host_copy(stored)

    def finish(self, values: list[torch.Tensor], started: float) -> ShardCapture:
        return ShardCapture(values=values, stats=self.stats.to("cpu"), forward_s=time.perf_counter() - started)


class StopForward(Exception):
    """Raised by the deepest wanted block's hook: nothing above it is needed."""


@contextmanager
def block_hooks(blocks: Sequence[torch.nn.Module], layers: Sequence[int], *, stop_after_last: bool = True) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks on the requested blocks only, removed in `finally`.

    Yields a dict that fills with layer → block output `[batch, seq, hidden]` during a forward
    pass. With `stop_after_last`, the hook on the deepest requested block ends the forward pass
    (the caller catches `StopForward`), since the blocks above it and the LM head are not needed.
    """
    captured: dict[int, torch.Tensor] = {}
    deepest = max(layers)

    def make_hook(layer: int):
        def hook(_module, _args, output):
            captured[layer] = output[0] if isinstance(output, tuple) else output
            if stop_after_last and layer == deepest:
                raise StopForward

        return hook

    handles = [blocks[layer].register_forward_hook(make_hook(layer)) for layer in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()



def check_capture(captured: dict[int, torch.Tensor], layers: Sequence[int], shape: tuple[int, int]) -> None:
    """Fail loudly when a hook missed a layer or returned a short tensor (never write partial data)."""
    missing = [layer for layer in layers if layer not in captured]
    if missing:
        raise CaptureFailed(f"The capture missed layer(s) {missing}: no activations came back for them.")
    for layer in layers:
        got = tuple(captured[layer].shape[:2])
        if got != shape:
            raise CaptureFailed(f"The capture of layer {layer} has shape {got} for a batch of shape {shape}.")
