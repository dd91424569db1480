"""The one table of `bench/gpu.sh`, built up by its parts (HF, vLLM, parity), each its own process.

Each part adds its rows and notes to one JSON file and then prints the whole table so far (and
writes it to `$OUT/gpu_table.md` when OUT is set), so a part that runs out of time or crashes
leaves the table of the parts before it. `python bench/gpu_results.py RESULTS.json table` prints the final one (no torch import).

MFU = 2 · P · tokens / seconds / peak, with P the parameters of all decoder blocks (6.98e9
at 8B's shapes; the embedding lookup and the LM head, which no arm runs, are not counted, nor
is attention's own arithmetic), the same P for every arm of both engines, so MFU is
proportional to tokens/s; an arm that stops early (HF harvest at quartiles runs 25 of 32
blocks) shows its saving as a higher figure. Peak: the H200's dense bf16 989 TFLOP/s
(`GPU_BENCH_PEAK_TFLOPS` overrides; none on a CPU).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["Results", "H200_BF16_DENSE_TFLOPS"]

H200_BF16_DENSE_TFLOPS = 989.0


def _peak_tflops(device: str) -> float | None:
    if os.environ.get("GPU_BENCH_PEAK_TFLOPS"):
        return float(os.environ["GPU_BENCH_PEAK_TFLOPS"])
    if "H200" in device or "H100" in device:  # same SXM tensor cores, same dense bf16 peak
        return H200_BF16_DENSE_TFLOPS
    return None


class Results:
    """Rows and notes of every part so far, in one JSON file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"header": {}, "rows": [], "notes": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def header(self, **values) -> None:
        self.data["header"].update(values)
        self.save()

    def note(self, text: str) -> None:
        print(f"gpu_bench: {text}", flush=True)
        self.data["notes"].append(text)
        self.save()

    def row(self, engine: str, arm: str, baseline: bool, seconds: float | None, tokens: int, blocks: int, error: str | None = None) -> None:
        self.data["rows"] = [r for r in self.data["rows"] if (r["engine"], r["arm"]) != (engine, arm)]
        self.data["rows"].append(dict(engine=engine, arm=arm, baseline=baseline, seconds=seconds, tokens=tokens, blocks=blocks, error=error))
        self.save()

    def render(self) -> str:
        h = self.data["header"]
        device = h.get("device", "?")
        peak = _peak_tflops(device)
        params = h.get("block_params")
        lines = [
            f"**{device}**; {h.get('shapes', '?')}; random bf16 weights built on the device; "
            f"{h.get('n_prompts', '?')} prompts of {h.get('lengths', '?')} random token ids ({h.get('tokens', '?')} tokens); "
            f"median of {h.get('rounds', '?')} round(s) after a warm-up, arms interleaved; torch {h.get('torch', '?')}, "
            f"transformers {h.get('transformers', '?')}, vLLM {h.get('vllm', '-')}, vllm-lens {h.get('vllm_lens', '-')}.",
            "",
            "| engine | arm | blocks run | seconds | tokens/s | vs baseline | MFU |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        base = {r["engine"]: r["seconds"] for r in self.data["rows"] if r["baseline"] and r["seconds"]}
        for r in self.data["rows"]:
            if r["seconds"] is None:
                lines.append(f"| {r['engine']} | {r['arm']} | {r['blocks']} | failed | | | {r['error'] or ''} |")
                continue
            rate = r["tokens"] / r["seconds"]
            ratio = f"{base[r['engine']] / r['seconds']:.3f}" if r["engine"] in base else "-"
            mfu = f"{2 * params * rate / (peak * 1e12):.1%}" if peak and params else "-"
            lines.append(f"| {r['engine']} | {r['arm']} | {r['blocks']} | {r['seconds']:.3f} | {rate:,.0f} | {ratio} | {mfu} |")
        peak_text = f"{peak:g} TFLOP/s (H200 dense bf16)" if peak else "none on this device (MFU not computed)"
        lines += [
            "",
            f"MFU = 2 · P · tokens/s / peak; P = {params:,} decoder-block parameters for every arm; peak {peak_text}."
            if params else "MFU: no block parameter count recorded.",
            "vs baseline: the engine's own bare pass on the same prompts (HF: `model.model` forward, same batches; "
            "vLLM: plain prefill, `max_tokens=1`, no capture session).",
        ]
        if h.get("timings"):
            lines.append("Set-up seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in h["timings"].items()) + ".")
        lines += [f"- {n}" for n in self.data["notes"]]
        return "\n".join(lines)

    def publish(self) -> str:
        """Print the table so far and write it to `$OUT/gpu_table.md` when OUT is set."""
        table = self.render()
        print("\n" + table + "\n", flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_table.md").write_text(table + "\n")
        return table


if __name__ == "__main__":  # light (no torch): `python bench/gpu_results.py RESULTS.json table | note TEXT`
    import sys

    store = Results(Path(sys.argv[1]))
    if sys.argv[2] == "note":
        store.note(sys.argv[3])
    else:
        store.publish()
