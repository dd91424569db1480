"""Engines that take their time, for tests that act "mid-job" on real work.

A test picks one for its flow runs through their environment, `slow_shards(seconds)` or
`slow_load()`: `HARVEST_ENGINE=tests.slow_engine:<Class>` (the repository must be on the
runs' PYTHONPATH; the test fixtures' hosts have it). The numbers are the HF reference's, only
slower; nothing in the service knows about these engines. On a worker host the engine lives in
the host's warm engine server beside the plain one, as any other engine would.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from harvest.engines.hf import HFEngine
from harvest.settings import get_settings

__all__ = ["SlowShards", "SlowLoad", "GatedShards", "slow_shards", "slow_load", "gated_shards", "gate_file", "calls_file", "recorded_calls"]

GATE_WAIT_S = 300.0  # a gate nobody opens fails the run instead of holding its slot for ever


def calls_file(home: Path) -> Path:
    return Path(home) / "slow-engine-calls.jsonl"


def recorded_calls(home: Path) -> list[list[list[list[int]]]]:
    """Each `SlowShards` call made under `home`: the token ids of every shard it ran."""
    path = calls_file(home)
    return [json.loads(line)["shards"] for line in path.read_text().splitlines()] if path.exists() else []


class SlowShards(HFEngine):
    """Every engine call takes `shard_s` seconds more (class `ShardsTake<seconds>s`), and is
    recorded, one JSON line with the prompts of each shard it ran, in `calls_file(home)`."""

    shard_s = 1.0

    def capture_cobatch(self, shards, spec, *, batch_size=None, sinks=None):
        answers = super().capture_cobatch(shards, spec, batch_size=batch_size, sinks=sinks)
        time.sleep(self.shard_s)
        with open(calls_file(get_settings().home), "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "shards": shards}) + "\n")
        for capture in answers:
            capture.forward_s += self.shard_s
        return answers


class SlowLoad(HFEngine):
    """Loading takes 30 s more (a big checkpoint): long enough to cancel a run mid-load."""

    def __init__(self, model, device=None):
        time.sleep(30)
        super().__init__(model, device)


def gate_file(home: Path, gate: str) -> Path:
    return Path(home) / f"slow-engine-gate-{gate}"


class GatedShards(HFEngine):
    """Every engine call waits until the test opens its gate (class `ShardsWaitFor<gate>`,
    file `gate_file(home, gate)`): runs stay active for exactly as long as a test needs, however
    slowly a loaded box starts them."""

    gate = ""

    def capture_cobatch(self, shards, spec, *, batch_size=None, sinks=None):
        gate = gate_file(get_settings().home, self.gate)
        deadline = time.monotonic() + GATE_WAIT_S
        while not gate.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} was not opened within {GATE_WAIT_S:g} s")
            time.sleep(0.1)
        return super().capture_cobatch(shards, spec, batch_size=batch_size, sinks=sinks)


def __getattr__(name: str) -> type:
    """`ShardsTake1.5s` → a `SlowShards` of 1.5 s; `ShardsWaitForX` → a `GatedShards` on gate
    X; made when the engine server asks for them."""
    if match := re.fullmatch(r"ShardsTake([0-9.]+)s", name):
        return type(name, (SlowShards,), {"shard_s": float(match.group(1))})
    if match := re.fullmatch(r"ShardsWaitFor([a-z0-9]+)", name):
        return type(name, (GatedShards,), {"gate": match.group(1)})
    raise AttributeError(name)


def slow_shards(seconds: float) -> dict[str, str]:
    """Flow-run environment: each shard takes `seconds` more."""
    return {"HARVEST_ENGINE": f"tests.slow_engine:ShardsTake{seconds:g}s"}


def gated_shards(gate: str) -> dict[str, str]:
    """Flow-run environment: each shard waits until `gate_file(home, gate)` exists."""
    return {"HARVEST_ENGINE": f"tests.slow_engine:ShardsWaitFor{gate}"}


def slow_load() -> dict[str, str]:
    """Flow-run environment: the model takes 30 s more to load."""
    return {"HARVEST_ENGINE": "tests.slow_engine:SlowLoad"}
