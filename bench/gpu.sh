#!/usr/bin/env bash
# One prepared run for the GPU machine (one H200, no internet, 15 minutes of device time in
# all): install from wheels, check vLLM-engine parity on the GPU, then measure harvest against
# plain vLLM prefill at Llama-3.1-8B shapes. Prints one table (and writes $OUT/gpu_table.md).
#
#   bash bench/gpu.sh                      # from the repository root, on the GPU machine
#   WHEELS=/some/dir bash bench/gpu.sh     # where the wheels are (default: .whl in the repo)
#
# What the machine must have: python3 with a CUDA torch (the image has 2.11.0+cu130), and
# vLLM. The image has NO vLLM, and a CUDA vLLM wheel with the torch it was built against is
# several hundred MB, far over what a device call carries (64 MiB): put them on the machine
# (or a volume it mounts) and point WHEELS at them. The script checks this first and stops in
# seconds, with exit status 3, when vLLM cannot be imported, so a missing wheel costs only
# the machine's start. Small pure-Python needs of the harvest core (pydantic-settings,
# python-dotenv, zstandard, vllm-lens) can travel in .whl (carry: [".whl"]).
#
# Time plan (about 8 of the 15 minutes): start ~1-2 min; install <1 min; parity ~1 min
# (llama-tiny, float32 on the GPU); 8B-shaped bf16 checkpoint made on the GPU and saved
# (~16 GB, ~1 min); vLLM load ~1 min; 4 arms x (1 warm-up + 3 rounds) of ~49k tokens ~2 min.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=/tmp/harvest-site
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HARVEST_HOME=${HARVEST_HOME:-/tmp/harvest-gpu}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "gpu.sh: no GPU here"; exit 2; }

# 1. Install what is missing, from wheels only (nothing can be fetched there). Only wheels
#    whose distribution is absent are installed, so the image's own torch stays in charge.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    missing=()
    for wheel in "$WHEELS"/*.whl; do
        dist=$(basename "$wheel" | cut -d- -f1)
        "$PY" -m pip show -q "$dist" >/dev/null 2>&1 || missing+=("$wheel")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "gpu.sh: installing ${#missing[@]} wheel(s) from $WHEELS into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${missing[@]}" || exit 2
        export PYTHONPATH="$PYTHONPATH:$SITE"
    fi
fi
if ! "$PY" -c "import vllm, vllm_lens" 2>/tmp/gpu-import.log; then
    tail -3 /tmp/gpu-import.log
    echo "gpu.sh: vLLM (and vllm-lens) must be importable here; the image has no vLLM. Put a CUDA vLLM"
    echo "        wheel and its torch in \$WHEELS (now: $WHEELS) and run again. Nothing was measured."
    exit 3
fi
"$PY" - <<'EOF' || exit 2
import importlib.util
missing = [m for m in ("pydantic_settings", "safetensors", "tokenizers", "transformers", "ml_dtypes", "zstandard") if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"gpu.sh: missing Python packages {missing}: carry their wheels in .whl")
import torch, vllm
print(f"gpu.sh: torch {torch.__version__}, vLLM {vllm.__version__}, {torch.cuda.get_device_name()}")
EOF

# 2. Parity on the GPU (fails the run before the long part if the engine is wrong there).
"$PY" bench/gpu_bench.py parity
parity=$?

# 3. Throughput at Llama-3.1-8B shapes: harvest vs plain prefill on the same engine.
"$PY" bench/gpu_bench.py bench --home "$HARVEST_HOME"
bench=$?

echo "gpu.sh: parity exit $parity, bench exit $bench"
exit $(( parity || bench ))
