"""OpenMP's idle threads spinning or sleeping (`OMP_WAIT_POLICY`), on a shared CPU.

What `harvest.cpu_share.with_passive_waits` ships: the processes that do tensor work on the
CPU start with `OMP_WAIT_POLICY=PASSIVE`. This measures what that setting changes, side by
side in one run: the real `smollm2-135m` through the HF engine (`HFEngine.capture`, every
layer, as a host's engine server runs a shard) in a process and session of its own, started
with OpenMP's default (spin, then sleep) and with `PASSIVE`, arms alternating each round.
Each arm runs quiet and beside a neighbour: a pure-Python loop in another session (an API
replica's or a Prefect server's kind of work), counting its iterations while the engine
works. Reported per arm (medians of the rounds): the engine's wall and CPU seconds, and the
neighbour's iterations a second (what CPU the engine left it).

Run: `.venv/bin/python bench/omp_wait.py [--rounds 3 --passes 6]` (after `make install`; the
first use converts SmolLM2's GGUF into `$HARVEST_HOME/models/smollm2-135m/`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["main"]

MODEL = "smollm2-135m"
PROMPTS, PROMPT_TOKENS = 4, 128

ENGINE = """
import json, sys, time
from harvest.capture_spec import CaptureSpec
from harvest.engines.hf import HFEngine
from harvest.registry import load_registry
from harvest.settings import get_settings

model = load_registry(get_settings()).get(sys.argv[1])
engine = HFEngine(model)
prompts = [[(7 * p + 13 * t) % 40000 + 100 for t in range(int(sys.argv[3]))] for p in range(int(sys.argv[2]))]
spec = CaptureSpec(layers=list(range(model.n_layers)))
engine.capture(prompts, spec)  # warm-up: first-call allocations
print("ready", flush=True)
sys.stdin.readline()  # the neighbour is running (or not): go
wall, cpu = time.monotonic(), time.process_time()
for _ in range(int(sys.argv[4])):
    engine.capture(prompts, spec)
print(json.dumps({"wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu}), flush=True)
"""

NEIGHBOUR = """
import select, sys, time
sys.stdin.readline()
count, started = 0, time.monotonic()
while not select.select([sys.stdin], [], [], 0)[0]:  # until told to stop
    for _ in range(100_000):
        count += 1
print(count / (time.monotonic() - started), flush=True)
"""


def _python(code: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    # A session of its own each: Linux shares a contended CPU between sessions (autogroups).
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


def one_arm(policy: str | None, with_neighbour: bool, passes: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    engine = _python(ENGINE, MODEL, str(PROMPTS), str(PROMPT_TOKENS), str(passes), env=env)
    assert engine.stdout.readline().strip() == "ready"
    neighbour = _python(NEIGHBOUR, env=os.environ.copy()) if with_neighbour else None
    if neighbour:
        neighbour.stdin.write("go\n")
        neighbour.stdin.flush()
        time.sleep(0.5)  # its loop running before the engine starts
    engine.stdin.write("go\n")
    engine.stdin.flush()
    result = json.loads(engine.stdout.readline())
    engine.wait()
    if neighbour:
        neighbour.stdin.write("stop\n")
        neighbour.stdin.flush()
        result["neighbour_per_s"] = float(neighbour.stdout.readline())
        neighbour.wait()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=6, help="captures per arm")
    args = parser.parse_args(argv)

    from harvest.registry import load_registry
    from harvest.settings import get_settings

    load_registry(get_settings()).get(MODEL).require_path()  # converted once, before any arm is timed
    arms = [(policy, neighbour) for neighbour in (False, True) for policy in (None, "PASSIVE")]
    results: dict[tuple, list[dict[str, float]]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in arms:
            results[arm].append(one_arm(*arm, args.passes))
            print(f"round {round_ + 1} {arm}: {results[arm][-1]}", file=sys.stderr, flush=True)

    print(f"{MODEL}, HF engine, every layer, {args.passes} captures of {PROMPTS} x {PROMPT_TOKENS} tokens; "
          f"median of {args.rounds} rounds; {os.cpu_count()} CPUs")
    print("| OMP_WAIT_POLICY | neighbour | engine wall s | engine CPU s | neighbour Mloops/s |")
    print("|---|---|---:|---:|---:|")
    for policy, neighbour in arms:
        rows = results[(policy, neighbour)]
        loops = f"{statistics.median(r['neighbour_per_s'] for r in rows) / 1e6:.1f}" if neighbour else "–"
        print(f"| {policy or 'unset (spin, then sleep)'} | {'busy' if neighbour else 'none'} "
              f"| {statistics.median(r['wall_s'] for r in rows):.2f} | {statistics.median(r['cpu_s'] for r in rows):.2f} "
              f"| {loops} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
