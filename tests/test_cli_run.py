"""`harvest run` as a user runs it: a real subprocess on each corpus format, and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

PROMPTS = ["The sky is", "Grass is green.", "A shard is a file."]


def _harvest(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HARVEST_ENGINE": "hf", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", "run", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def corpora(tmp_path):
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"body": p}) + "\n" for p in PROMPTS))
    pq.write_table(pa.table({"body": PROMPTS}), tmp_path / "p.parquet")
    return tmp_path


@pytest.mark.parametrize("name,column", [("p.txt", None), ("p.jsonl", "body"), ("p.parquet", "body")])
def test_each_corpus_format_harvests(corpora, name, column, tiny):
    out = corpora / f"out-{name}"
    args = ["--model", "llama-tiny", "--prompts", str(corpora / name), "--out", str(out), "--layers", "0,7", "--shard-size", "2"]
    if column:
        args += ["--column", column]
    result = _harvest(*args)
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr  # the progress bar reports throughput
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["text"] for p in manifest["prompts"]] == PROMPTS
    assert manifest["layer_indices"] == [0, 7] and len(manifest["shards"]) == 2
    shard = load_file(out / "shard_00001.safetensors")
    assert tuple(shard["prompt_2"].shape)[::2] == (2, tiny.hidden_size)


def test_projection_and_no_special_tokens(corpora, tiny):
    directions = np.random.default_rng(0).standard_normal((3, tiny.hidden_size)).astype(np.float32)
    np.save(corpora / "d.npy", directions)
    out = corpora / "proj"
    result = _harvest("--model", "llama-tiny", "--prompts", str(corpora / "p.txt"), "--out", str(out),
                      "--project-onto", str(corpora / "d.npy"), "--no-special-tokens")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["contents"] == "projections" and manifest["dtype"] == "float32"
    assert manifest["projection"]["n_directions"] == 3 and manifest["add_special_tokens"] is False
    shard = load_file(out / "shard_00000.safetensors")
    assert shard["prompt_0"].shape[-1] == 3
    assert shard["tokens_0"][0].item() != manifest["bos_token_id"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "nope"], "does not exist"),
        (["--layers", "0,8"], "llama-tiny has layers 0 to 7: it has no layer 8."),
        (["--layers", "x"], "--layers must be comma-separated integers"),
        (["--shard-size", "0"], "shard_size"),
        (["--prompts", "/nonexistent/p.txt"], "does not exist"),
        (["--prompts", "CORPUS/p.csv"], "must be .jsonl, .txt or .parquet"),
        (["--prompts", "CORPUS/p.parquet", "--column", "missing"], "has no column 'missing'"),
        (["--model", "llama-8b"], "are not on this machine"),
    ],
)
def test_bad_input_gets_a_clear_message_and_nonzero_exit(corpora, args, message, capsys, monkeypatch):
    """In-process (the same `main` the console script calls), so each case costs no interpreter start."""
    from fleet.cli import main

    monkeypatch.setenv("HARVEST_ENGINE", "hf")
    (corpora / "p.csv").write_text("a,b\n")
    base = {"--model": "llama-tiny", "--prompts": str(corpora / "p.txt"), "--out": str(corpora / "never")}
    given = dict(zip(args[::2], [a.replace("CORPUS", str(corpora)) for a in args[1::2]]))
    merged = [x for k, v in {**base, **given}.items() for x in (k, v)]
    try:
        code = main(["run", *merged])
    except SystemExit as exit_:
        code = exit_.code
    assert code not in (0, None)
    stderr = capsys.readouterr().err + (code if isinstance(code, str) else "")
    assert message in stderr, stderr
    assert not (corpora / "never" / "manifest.json").exists()
