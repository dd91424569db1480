"""One way of harvesting residual-stream activations, timed in a process of its own.

    python bench/peer_arms.py ARM --model-dir DIR --corpus IDS.json --layers 7,15,22 --out OUTDIR
    python bench/peer_arms.py compare OUTDIR_A OUTDIR_REF       # values of two arms, as JSON

Each arm is written the way a researcher using that tool would write it from the tool's own
docs, on an already-tokenized corpus (`{"prompts": [[ids], ...]}`; the ids go in as given,
nothing is re-tokenized and no BOS is added). Every arm batches the same way, because that is
what a careful researcher does on a CPU and because it keeps the arms comparable: prompts
sorted by length, batches of 8, right-padded with id 0, with an attention mask. With a causal
model and right padding, a real token never attends to a pad, so its values do not depend on
the batch it lands in beyond float rounding.

Arms (the run-time environment is in brackets):

* `bare` [.venv or .venv-peers]: `AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)`,
  then `model.model(input_ids, attention_mask)`: the decoder stack without the LM head and
  without capturing anything. The floor every other arm is measured against; writes nothing.
* `handwritten` [.venv or .venv-peers]: the loop people write first: the whole causal LM with
  `output_hidden_states=True`, `hidden_states[k + 1]` for block k, each prompt sliced to its own
  length, bf16, one `safetensors.torch.save_file` per batch. `hidden_states[-1]` is taken after
  the final norm, so this arm refuses the last block instead of returning a different quantity.
  `use_cache` is left at the model's default, as people leave it. It is the reference that
  `compare` holds the other arms to.
* `nnsight` [.venv-peers]: `nnsight.TransformersModel(DIR, task="text-generation")` (0.8's name;
  `LanguageModel` is the same class and warns that it is deprecated), then per batch
  `with lm.trace({"input_ids", "attention_mask"})` and `.save()` of
  `lm.model.layers[k].output` (a tensor in transformers 5; `[0]` of a tuple in 4.x). Each
  `.save()` is bound to its own name, a dict entry made before the trace: in 0.8 names that
  the traced block makes for itself (a list comprehension's list, a dict built inside) do not
  come back out of it.
* `transformer_lens` [.venv-peers]: TransformerLens 4's `TransformerBridge.boot_transformers(DIR)`
  (offline on a local checkpoint), `run_with_cache(ids, attention_mask=..., names_filter=...)`
  for `blocks.{k}.hook_resid_post`. The bridge forces HF's eager attention (so that its hooks
  can see attention patterns); the other arms run the model's default, SDPA.
* `saelens` [.venv-peers, with sae-lens' own transformer-lens 3.9.0 from
  `.venv-peers/saelens-tl3/`, see bench/peers_venv.sh]: SAELens' activation cache,
  `CacheActivationsRunner(CacheActivationsRunnerConfig(...), override_dataset=...)`, which
  writes a Hugging Face dataset (`Array2D` column per hook plus `token_ids`). On a local
  checkpoint it needs `model_class_name="AutoModelForCausalLM"` (its `HookedTransformer` path
  only takes TransformerLens' official model names, and resolves them on the Hub), and then
  hooks are HF module paths: block k is `model.layers.{k}`, the same quantity as
  `blocks.{k}.hook_resid_post`. The runner takes one hook per run and one fixed context size
  per dataset, and calls the model without an attention mask (harmless with right padding).
  So it runs once per layer, each run loading the model again, hooking every submodule (the
  runner does not narrow `HookedProxyLM`'s hooks) and stopping the forward after the hooked
  block; and every prompt is one row right-padded to the corpus' longest prompt, in length
  order, so that its batches of 8 hold the same prompts as the other arms' (the last batch is
  topped up by the runner from the start of the dataset; those rows are dropped). SAELens' own
  habit, packing a token stream into fixed windows, would give values that are not any
  prompt's own. The runner applies `torch.no_grad` itself. Its `load_s` and `corpus_s` are
  summed over the per-layer runs; turning its datasets into this script's files is reported
  apart as `export_s`, and is not in `whole_s`.

Output (every arm but `bare`): `OUTDIR/batch-XXXX.safetensors`, one file per batch, tensors
named `p{i}.l{k}` (i: the prompt's index in the corpus as given) of shape `[n_tokens_i, hidden]`
in bfloat16; `load_values(OUTDIR)` reads them back with torch and safetensors only.

Last line on stdout, one JSON object: `arm`, `import_s`, `load_s`, `corpus_s` (the loop over
all batches, writes included), `tokens` (real tokens), `padded_tokens` (tokens the forward
passes ran beyond the prompts' own: the padding), `whole_s` (from process start, or from `--started-at`, the
parent's `time.time()` at spawn, to the end of the arm's own work). Anything the tools print
goes to stderr.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before the heavy imports: `whole_s` counts them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

# No network: every tool must find the checkpoint on disk, and fail rather than fetch.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

__all__ = [
    "ARMS",
    "BATCH_SIZE",
    "PAD_ID",
    "Batch",
    "compare",
    "load_values",
    "main",
    "make_batches",
]

BATCH_SIZE = 8
PAD_ID = 0
# compare()'s bar, the one tests/test_smollm2.py holds the service's engines to.
MIN_COSINE = 0.9999
MAX_REL_RMS = 1e-2
# SAELens finds its own transformer-lens (3.9.0) here; see bench/peers_venv.sh.
SAELENS_TL_DIR = "saelens-tl3"


# -- corpus and batches ----------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One padded batch: `indices[r]` is the corpus index of row r, `lengths[r]` its tokens."""

    indices: list[int]
    lengths: list[int]
    input_ids: torch.Tensor  # [rows, width] int64, right-padded with PAD_ID
    attention_mask: torch.Tensor  # [rows, width] int64, 1 on real tokens


def read_corpus(path: str | Path) -> list[list[int]]:
    prompts = json.loads(Path(path).read_text())["prompts"]
    if not prompts or any(not p for p in prompts):
        raise SystemExit(f"{path}: need a non-empty list of non-empty prompts")
    return [[int(t) for t in p] for p in prompts]


def make_batches(prompts: list[list[int]], width: int | None = None) -> list[Batch]:
    """Length-sorted batches of BATCH_SIZE, right-padded to their longest (or to `width`)."""
    # Sorting keeps each batch's padding small; padding costs time in proportion on a CPU.
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    batches = []
    for start in range(0, len(order), BATCH_SIZE):
        rows = order[start : start + BATCH_SIZE]
        lengths = [len(prompts[i]) for i in rows]
        cols = width or max(lengths)
        ids = torch.full((len(rows), cols), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(rows), cols), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : lengths[r]] = torch.tensor(prompts[i])
            mask[r, : lengths[r]] = 1
        batches.append(Batch(rows, lengths, ids, mask))
    return batches


# -- output ---------------------------------------------------------------------------------

_NAME = re.compile(r"p(\d+)\.l(\d+)")


def batch_path(outdir: Path, b: int) -> Path:
    return outdir / f"batch-{b:04d}.safetensors"


def write_batch(outdir: Path, b: int, batch: Batch, by_layer: dict[int, torch.Tensor]) -> None:
    """Each prompt's own tokens at each layer, bf16, one safetensors file for the batch.

    `by_layer[k]` is `[rows, width, hidden]` in any float dtype, rows in `batch` order.
    """
    tensors = {}
    for k, values in by_layer.items():
        for r, (i, n) in enumerate(zip(batch.indices, batch.lengths)):
            # to() makes a fresh contiguous tensor: save_file refuses views of one storage.
            tensors[f"p{i}.l{k}"] = values[r, :n].to(torch.bfloat16).contiguous()
    save_file(tensors, str(batch_path(outdir, b)))


def load_values(outdir: str | Path) -> dict[tuple[int, int], torch.Tensor]:
    """`{(prompt index, layer): bf16 [n_tokens, hidden]}` from an arm's OUTDIR."""
    values: dict[tuple[int, int], torch.Tensor] = {}
    for path in sorted(Path(outdir).glob("batch-*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            match = _NAME.fullmatch(name)
            if match:
                values[(int(match[1]), int(match[2]))] = tensor
    return values


def compare(
    a: dict[tuple[int, int], torch.Tensor], b: dict[tuple[int, int], torch.Tensor]
) -> dict:
    """How far `a` is from the reference `b`, per prompt and layer, position 0 left out.

    Position 0 is the attention sink (norm ~22,700 on SmolLM2-135M at the middle blocks
    against a few hundred elsewhere): counted in, it would swamp any relative error. Its own
    relative error is reported apart. `ok`: same keys and shapes, every per-token cosine
    >= MIN_COSINE and every (prompt, layer) relative RMS error <= MAX_REL_RMS.
    """
    missing = sorted(set(b) - set(a))
    extra = sorted(set(a) - set(b))
    bad_shape = sorted(key for key in set(a) & set(b) if a[key].shape != b[key].shape)
    per_layer: dict[int, dict[str, float]] = {}
    worst = {"min_cosine": (math.inf, None), "max_rel_rms": (-math.inf, None)}
    max_rel_pos0 = 0.0
    for key in sorted(set(a) & set(b)):
        if key in bad_shape:
            continue
        x, ref = a[key].float(), b[key].float()
        max_rel_pos0 = max(max_rel_pos0, _rel_rms(x[:1], ref[:1]))
        if x.shape[0] < 2:
            continue
        cosine = torch.nn.functional.cosine_similarity(x[1:], ref[1:], dim=-1).min().item()
        rel = _rel_rms(x[1:], ref[1:])
        layer = per_layer.setdefault(key[1], {"min_cosine": math.inf, "max_rel_rms": 0.0})
        layer["min_cosine"] = min(layer["min_cosine"], cosine)
        layer["max_rel_rms"] = max(layer["max_rel_rms"], rel)
        if cosine < worst["min_cosine"][0]:
            worst["min_cosine"] = (cosine, key)
        if rel > worst["max_rel_rms"][0]:
            worst["max_rel_rms"] = (rel, key)
    ok = (
        not missing
        and not extra
        and not bad_shape
        and bool(per_layer)
        and worst["min_cosine"][0] >= MIN_COSINE
        and worst["max_rel_rms"][0] <= MAX_REL_RMS
    )
    return {
        "ok": ok,
        "pairs": len(set(a) & set(b)) - len(bad_shape),
        "min_cosine": worst["min_cosine"][0],
        "min_cosine_at": worst["min_cosine"][1],
        "max_rel_rms": worst["max_rel_rms"][0],
        "max_rel_rms_at": worst["max_rel_rms"][1],
        "max_rel_rms_pos0": max_rel_pos0,
        "per_layer": per_layer,
        "missing": missing,
        "extra": extra,
        "bad_shape": bad_shape,
    }


def _rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# -- arms -------------------------------------------------------------------------------------
#
# Each arm returns (import_s, load_s, corpus_s, padded_tokens, extra fields). Heavy imports
# happen inside the arm, so `import_s` is what that tool costs to import (torch included, as it
# is imported above, after _T0).


@dataclass
class Job:
    model_dir: str
    prompts: list[list[int]]
    layers: list[int]
    out: Path


def _hf_model(auto_class, model_dir: str):
    return auto_class.from_pretrained(model_dir, dtype=torch.float32).eval()


def _padded(batches: list[Batch]) -> int:
    """Tokens the forward passes ran beyond the prompts' own: the padding."""
    return sum(b.input_ids.numel() - sum(b.lengths) for b in batches)


def arm_bare(job: Job) -> tuple:
    from transformers import AutoModelForCausalLM

    import_s = time.perf_counter() - _T0
    t = time.perf_counter()
    model = _hf_model(AutoModelForCausalLM, job.model_dir)
    load_s = time.perf_counter() - t
    batches = make_batches(job.prompts)
    t = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return import_s, load_s, time.perf_counter() - t, _padded(batches), {}


def arm_handwritten(job: Job) -> tuple:
    from transformers import AutoModelForCausalLM

    import_s = time.perf_counter() - _T0
    t = time.perf_counter()
    model = _hf_model(AutoModelForCausalLM, job.model_dir)
    load_s = time.perf_counter() - t
    last = model.config.num_hidden_layers - 1
    if last in job.layers:
        # hidden_states[-1] is the final norm's output, not block `last`'s: a different quantity.
        raise SystemExit(f"handwritten: block {last} is the last; hidden_states[-1] is normed")
    batches = make_batches(job.prompts)
    t = time.perf_counter()
    with torch.inference_mode():
        for b, batch in enumerate(batches):
            out = model(
                batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
            )
            write_batch(job.out, b, batch, {k: out.hidden_states[k + 1] for k in job.layers})
    return import_s, load_s, time.perf_counter() - t, _padded(batches), {}


def arm_nnsight(job: Job) -> tuple:
    import nnsight

    import_s = time.perf_counter() - _T0
    t = time.perf_counter()
    # dispatch=True loads the weights now; by default nnsight builds a meta model and loads on
    # the first trace, which would move the load into the corpus loop.
    lm = nnsight.TransformersModel(
        job.model_dir, task="text-generation", dtype=torch.float32, dispatch=True
    )
    load_s = time.perf_counter() - t
    batches = make_batches(job.prompts)
    t = time.perf_counter()
    with torch.inference_mode():
        for b, batch in enumerate(batches):
            saved: dict[int, object] = {}  # made out here so that it survives the trace
            with lm.trace({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}):
                for k in job.layers:
                    saved[k] = lm.model.layers[k].output.save()
            write_batch(job.out, b, batch, {k: _block_output(v) for k, v in saved.items()})
    return import_s, load_s, time.perf_counter() - t, _padded(batches), {}


def _block_output(value) -> torch.Tensor:
    # A decoder layer returns its hidden states in transformers 5, (hidden_states, ...) in 4.x.
    return value[0] if isinstance(value, tuple) else value


def arm_transformer_lens(job: Job) -> tuple:
    from transformer_lens.model_bridge import TransformerBridge

    import_s = time.perf_counter() - _T0
    t = time.perf_counter()
    bridge = TransformerBridge.boot_transformers(job.model_dir, device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - t
    names = {k: f"blocks.{k}.hook_resid_post" for k in job.layers}
    batches = make_batches(job.prompts)
    t = time.perf_counter()
    with torch.inference_mode():
        for b, batch in enumerate(batches):
            _, cache = bridge.run_with_cache(
                batch.input_ids,
                attention_mask=batch.attention_mask,
                names_filter=list(names.values()),
            )
            write_batch(job.out, b, batch, {k: cache[name] for k, name in names.items()})
    return import_s, load_s, time.perf_counter() - t, _padded(batches), {}


def arm_saelens(job: Job) -> tuple:
    # sae-lens 6.54 imports transformer_lens.HookedTransformer, gone from transformer-lens 4;
    # its own release (3.9.0) sits beside the venv's 4.3.0 (bench/peers_venv.sh).
    tl_dir = Path(sys.prefix) / SAELENS_TL_DIR
    if tl_dir.is_dir():
        sys.path.insert(0, str(tl_dir))
    try:
        from datasets import Dataset
        from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig
    except ImportError as exc:
        print(f"saelens: sae_lens does not import here ({exc}); run bench/peers_venv.sh, which "
              f"installs its transformer-lens in {tl_dir}", file=sys.stderr)
        raise SystemExit(3) from exc
    import_s = time.perf_counter() - _T0

    # One fixed context for the whole dataset: the longest prompt. Each prompt is its own row,
    # in length order, so that its batches of 8 hold the same prompts as the other arms'.
    width = max(len(p) for p in job.prompts)
    batches = make_batches(job.prompts, width=width)
    rows = torch.cat([b.input_ids for b in batches])
    order = [i for b in batches for i in b.indices]
    hidden = _hidden_size(job.model_dir)
    n_rows = len(batches) * BATCH_SIZE  # the last batch is topped up from the start (it wraps)
    bytes_per_token = hidden * 4  # float32, the runner's default dtype
    load_s = corpus_s = 0.0
    datasets_by_layer = {}
    for k in job.layers:
        t = time.perf_counter()
        cfg = CacheActivationsRunnerConfig(
            dataset_path=str(job.out / "tokens"),  # only named in logs: the dataset is passed in
            model_name=job.model_dir,
            model_class_name="AutoModelForCausalLM",
            model_from_pretrained_kwargs={"dtype": "float32"},
            hook_name=f"model.layers.{k}",
            d_in=hidden,
            context_size=width,
            model_batch_size=BATCH_SIZE,
            training_tokens=n_rows * width,
            # One buffer = one batch: one shard written per batch of 8, like the other arms.
            # (+half a token, so float rounding cannot leave the buffer a batch short.)
            buffer_size_gb=(BATCH_SIZE * width + 0.5) * bytes_per_token / 1e9,
            new_cached_activations_path=str(job.out / "saelens" / f"model.layers.{k}"),
            shuffle=False,
            prepend_bos=False,
            device="cpu",
            dtype="float32",
        )
        tokens = Dataset.from_dict({"input_ids": rows.tolist()})  # pre-tokenized: no tokenizer
        runner = CacheActivationsRunner(cfg, override_dataset=tokens)
        load_s += time.perf_counter() - t
        t = time.perf_counter()
        datasets_by_layer[k] = runner.run()
        corpus_s += time.perf_counter() - t
        del runner
    end = time.perf_counter()

    t = time.perf_counter()
    _export_saelens(job, batches, order, rows, datasets_by_layer)
    export_s = time.perf_counter() - t
    padding = n_rows * width - sum(len(p) for p in job.prompts)  # the rows the runner ran, beyond the prompts
    return import_s, load_s, corpus_s, padding, {"export_s": export_s, "_end": end}


def _hidden_size(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"])


def _export_saelens(job: Job, batches: list[Batch], order: list[int], rows: torch.Tensor,
                    datasets_by_layer: dict) -> None:
    """SAELens' datasets, row j = sorted prompt j, into this script's per-batch files."""
    for k, ds in datasets_by_layer.items():
        ds.set_format("torch")
        token_ids = ds[: len(order)]["token_ids"]
        # The dataset must be in the order it was given: shuffle=False keeps it so.
        if not torch.equal(token_ids.long(), rows):
            raise SystemExit(f"saelens: layer {k}'s dataset rows are not in corpus order")
    for b, batch in enumerate(batches):
        start = b * BATCH_SIZE
        stop = start + len(batch.indices)
        by_layer = {k: ds[start:stop][f"model.layers.{k}"] for k, ds in datasets_by_layer.items()}
        write_batch(job.out, b, batch, by_layer)


ARMS: dict[str, Callable[[Job], tuple]] = {
    "bare": arm_bare,
    "handwritten": arm_handwritten,
    "nnsight": arm_nnsight,
    "transformer_lens": arm_transformer_lens,
    "saelens": arm_saelens,
}


# -- command line -----------------------------------------------------------------------------


def run_arm(args: argparse.Namespace) -> dict:
    prompts = read_corpus(args.corpus)
    layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A rerun must not mix in old files (and SAELens' runner refuses a non-empty folder).
    for stale in out.glob("batch-*.safetensors"):
        stale.unlink()
    shutil.rmtree(out / "saelens", ignore_errors=True)
    job = Job(str(args.model_dir), prompts, layers, out)
    # The tools' own prints (progress, warnings) go to stderr: stdout is the JSON line.
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import_s, load_s, corpus_s, padded, extra = ARMS[args.arm](job)
    except ModuleNotFoundError as exc:
        # The usual cause: a peer arm started with the project's interpreter.
        print(f"{args.arm}: {exc} in {sys.executable}; the peer arms run in "
              ".venv-peers/bin/python (bench/peers_venv.sh builds it)", file=sys.stderr)
        raise SystemExit(2) from exc
    end = extra.pop("_end", time.perf_counter())
    if args.started_at is not None:
        whole_s = time.time() - (time.perf_counter() - end) - args.started_at
    else:
        whole_s = end - _T0
    return {
        "arm": args.arm,
        "import_s": round(import_s, 4),
        "load_s": round(load_s, 4),
        "corpus_s": round(corpus_s, 4),
        "tokens": sum(len(p) for p in prompts),
        "padded_tokens": padded,
        "whole_s": round(whole_s, 4),
        **{key: round(value, 4) for key, value in extra.items()},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        if len(argv) != 3:
            raise SystemExit("usage: peer_arms.py compare OUTDIR OUTDIR_REF")
        result = compare(load_values(argv[1]), load_values(argv[2]))
        print(json.dumps(result, default=str))
        return 0 if result["ok"] else 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arm", choices=sorted(ARMS))
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--corpus", required=True, help='JSON: {"prompts": [[ids], ...]}')
    parser.add_argument("--layers", default="7,15,22", help="0-based blocks, comma-separated")
    parser.add_argument("--out", required=True, help="folder for batch-XXXX.safetensors")
    parser.add_argument("--started-at", type=float, default=None,
                        help="the parent's time.time() at spawn; whole_s is counted from it")
    print(json.dumps(run_arm(parser.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
