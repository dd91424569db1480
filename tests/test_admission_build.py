"""An assessing child never builds a checkpoint in its own process (`api.admission_process._checkpoint`).

A built-in model is built on its first submit. Built in the assessing child, the build's torch
and weights were the child's: 1,766 MiB of peak RSS for smollm2-135m's first submit and 695
MiB held after, where the README's table gives the child its imports, a tokenizer and one
body. Here a fresh home (nothing built), a first submit of a built-in model assessed as the
child assesses it: the checkpoint is built (by a process of its own, which has ended), the
count is right, and the assessing process never imported torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, resource, sys
from api.admission_process import assess
from harvest.errors import validate_body
from harvest.registry import load_registry
from harvest.request import HarvestRequest
from harvest.settings import get_settings
body = json.dumps({'model': 'gpt2-tiny', 'prompts': ['one prompt', 'and another']}).encode()
fields = assess(validate_body(HarvestRequest, body, strict=True), load_registry(get_settings()))
print(json.dumps({
    'tokens': fields['reserved_tokens'],
    'torch': 'torch' in sys.modules,
    # VmHWM, not ru_maxrss: this process's own peak since its exec (ru_maxrss keeps the
    # forking parent's RSS, pytest's, across the exec)
    'own_peak_mib': next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) // 1024,
    'builder_peak_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
}))
"""


def test_a_first_submit_builds_its_checkpoint_outside_the_assessing_process(tmp_path):
    from transformers import AutoTokenizer

    env = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    env["HARVEST_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    folder = tmp_path / "models" / "gpt2-tiny"
    assert (folder / "config.json").is_file()  # built, whole
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = sum(len(ids) for ids in tokenizer(["one prompt", "and another"])["input_ids"])
    assert answer["tokens"] == expected
    assert answer["torch"] is False, "the assessing process imported torch: it built the checkpoint itself"
    # The build's memory was another process's: the builder peaked above the assessor.
    assert answer["builder_peak_mib"] > answer["own_peak_mib"], answer
