#!/usr/bin/env bash
# On the dev box: stage what bench/gpu.sh carries to the GPU machine, into the git-ignored
# .gpu-wheels/ (see bench/gpu.sh's header for the runs that carry it):
#   - vllm.tar.part00..03 + install-vllm-wheels.sh: the vLLM 0.26.0 + vllm-lens 1.2.1 wheel set,
#     made by ../shared/gpu/prepare-vllm-wheels.sh (229.7 MiB in 60 MiB parts);
#   - py/: the harvest core's small pure-Python needs the image may lack (pydantic-settings,
#     python-dotenv and what they import), at the same pins as the vLLM set, for CPython 3.12
#     on x86-64 (~2.5 MiB), so the HF part can run without the vLLM set.
#   bash bench/gpu_stage.sh            # both;  SKIP_VLLM_SET=1 for py/ only
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu-wheels
SHARED=${SHARED_GPU:-../shared/gpu}
mkdir -p "$OUT/py"
if [ "${SKIP_VLLM_SET:-0}" != 1 ]; then
    OUT=$OUT bash "$SHARED/prepare-vllm-wheels.sh"
fi
pins=$(grep -E '^(pydantic|pydantic-core|pydantic-settings|python-dotenv|typing-inspection|annotated-types)==' "$SHARED/vllm-0.26-wheels.txt")
plats=""; for g in 17 28 31 35; do plats="$plats --platform manylinux_2_${g}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none $plats --platform manylinux2014_x86_64 -d "$OUT/py" $pins
ls -l "$OUT" "$OUT/py"
