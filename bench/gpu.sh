#!/usr/bin/env bash
# One prepared run for the GPU machine (one H200; torch 2.11.0+cu130, transformers, safetensors,
# numpy, pyarrow; no vLLM, no network; 15 minutes of device time in all, start included).
# Prints one markdown table (and writes $OUT/gpu_table.md, rewritten after every part, so a
# part that runs out of time still leaves the ones before it):
#   1. HF engine at Llama-3.1-8B's shapes (random bf16 weights built on the GPU): harvest vs a
#      bare forward at the quartile blocks, at all 32 and with 8 directions; tokens/s and MFU;
#      then co-batching, HARVEST_ENGINE_COBATCH_SHARDS=1 (the default) against 4, side by side
#      (4 jobs on one engine): the ratio decides the GPU default.
#   2. Where vLLM imports (the wheel set of ../shared/gpu/, staged below): the same against
#      plain vLLM prefill, and the same co-batching pair. Without it, the table says the part was skipped and why; the run
#      still succeeds.
#   3. Where vLLM imports: the vLLM-engine parity checks on the GPU (llama-tiny, float32).
#
#   bash bench/gpu.sh                        # from the repository root, on the GPU machine
#   GPU_BENCH_QUICK=1 bash bench/gpu.sh      # dry run: small sizes, one round (~2-3 min)
#   GPU_BENCH_SMOKE=1 PYTHON=.venv/bin/python bash bench/gpu.sh   # CPU check of the script
#   GPU_BENCH_SKIP_HF=1 bash bench/gpu.sh    # the vLLM parts only (a rerun after a vLLM change)
#
# Each part constructs its engine itself (`HFEngine(model)`, `VLLMEngine(model)`), so the
# service's engine choice (HARVEST_ENGINE=auto|vllm|hf) neither applies nor needs setting here.
#
# Staging the vLLM wheel set (229.7 MiB; at most 64 MiB travels with a run). On the dev box,
# once: `bash bench/gpu_stage.sh` (writes the git-ignored .gpu-wheels/: vllm.tar.part00..03,
# install-vllm-wheels.sh, and py/: the harvest core's small pure deps). Then back to back (the
# machine stays warm ~30 s between runs; /tmp survives while it is warm):
#   run 1  carry [.gpu-wheels/vllm.tar.part00]:  mkdir -p /tmp/vc && cp .gpu-wheels/vllm.tar.part00 /tmp/vc/
#   run 2  carry [.gpu-wheels/vllm.tar.part01]:  mkdir -p /tmp/vc && cp .gpu-wheels/vllm.tar.part01 /tmp/vc/
#   run 3  carry [.gpu-wheels/vllm.tar.part02]:  mkdir -p /tmp/vc && cp .gpu-wheels/vllm.tar.part02 /tmp/vc/
#   run 4  carry [.gpu-wheels/vllm.tar.part03, .gpu-wheels/install-vllm-wheels.sh, .gpu-wheels/py]:
#          bash bench/gpu.sh     # timeout_s ~480; copies what it carried to /tmp/vc, installs, measures
# (parts 00-02 are 60 MiB, part03 ~50 MiB, py/ ~2.5 MiB, the tree ~2.5 MiB: each run fits in 64 MiB.)
# The HF part alone: run 4 with carry [.gpu-wheels/py] only (py/ only matters if the image lacks
# pydantic-settings; the run says so and stops in seconds if it is needed and missing).
#
# Time plan (GPU_BENCH_BUDGET_S, default 420 s for everything below; measured on an H200 on
# 2026-12-04, bench/RESULTS.md: start + the three staging runs ~50 s of device time): wheel
# install 58 s; HF part ~2 min (import; 8B-shaped checkpoint built on the GPU and saved to /dev/shm, ~15 GB;
# loaded by HFEngine; 4 arms x (warm-up + 3 rounds) of ~24k tokens); vLLM part ~2.5 min
# (engine start on the same checkpoint; same arms); parity ~1 min. Each part gets a deadline
# (GPU_BENCH_DEADLINE) that cuts its rounds short, and a hard `timeout` past it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_WHEELS=${GPU_WHEELS:-.gpu-wheels}
VC=${GPU_BENCH_STAGE:-/tmp/vc}
PARTS=${GPU_WHEEL_PARTS:-4}
BUDGET=${GPU_BENCH_BUDGET_S:-420}
START=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HARVEST_HOME=${HARVEST_HOME:-/tmp/harvest-gpu}
export VLLM_USE_FLASHINFER_SAMPLER=0   # else FlashInfer JIT-compiles with nvcc, which is not there
mkdir -p "$HARVEST_HOME"
RESULTS=$HARVEST_HOME/gpu_results.json
rm -f "$RESULTS" "$HARVEST_HOME/hf_sample.pt"
note() { "$PY" bench/gpu_results.py "$RESULTS" note "$1"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

if [ "${GPU_BENCH_SMOKE:-0}" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "gpu.sh: no GPU here (GPU_BENCH_SMOKE=1 runs the CPU check)"; exit 2; }
fi

# 1. Staging: the parts this run carried join those earlier runs left in $VC; once all are
#    there and vLLM does not import yet, install them (../shared/gpu/install-vllm-wheels.sh).
mkdir -p "$VC"
[ "${GPU_BENCH_SMOKE:-0}" = 1 ] || cp -r "$GPU_WHEELS"/. "$VC"/ 2>/dev/null || true
vllm_imports() { "$PY" -c "import vllm, vllm_lens" >/dev/null 2>&1; }
VLLM_NOTE=""
if [ "${GPU_BENCH_SKIP_VLLM:-0}" = 1 ]; then
    VLLM_NOTE="vLLM part skipped: GPU_BENCH_SKIP_VLLM=1"
elif [ "${GPU_BENCH_SMOKE:-0}" != 1 ] && ! vllm_imports; then
    have=$(ls "$VC"/vllm.tar.part?? 2>/dev/null | wc -l)
    export GPU_BENCH_STAGING="$have of $PARTS wheel parts were in $VC"
    installer=$VC/install-vllm-wheels.sh
    [ -f "$installer" ] || installer=../shared/gpu/install-vllm-wheels.sh
    if [ "$have" -ge "$PARTS" ] && [ -f "$installer" ]; then
        echo "gpu.sh: installing the vLLM wheel set ($have parts in $VC)"
        t0=$(date +%s)
        timeout 240 bash "$installer" > "$HARVEST_HOME/install.log" 2>&1
        rc=$?
        tail -4 "$HARVEST_HOME/install.log"
        echo "gpu.sh: wheel install exit $rc after $(( $(date +%s) - t0 )) s"
        [ $rc -eq 0 ] || VLLM_NOTE="vLLM part skipped: the wheel install failed (exit $rc: $(tail -1 "$HARVEST_HOME/install.log" | cut -c1-200))"
    elif [ "$have" -gt 0 ]; then
        echo "gpu.sh: $have of $PARTS wheel parts in $VC; vLLM not installed this run"
    fi
fi

# The harvest core's small pure dependencies (pydantic, pydantic-settings, python-dotenv…): the
# image may lack them. From the staged wheels ($VC/py, or the unpacked vLLM set), into a
# private target, so nothing of the image's own packages moves.
if ! "$PY" -c "import pydantic_settings, dotenv" >/dev/null 2>&1; then
    wheels=$(ls "$VC"/py/*.whl 2>/dev/null || ls "$VC"/whl/pydantic*.whl "$VC"/whl/python_dotenv*.whl \
        "$VC"/whl/typing_inspection*.whl "$VC"/whl/annotated_types*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/harvest-site $wheels && export PYTHONPATH="$PYTHONPATH:/tmp/harvest-site"
    fi
    "$PY" -c "import pydantic_settings, dotenv" 2>/dev/null || { echo "gpu.sh: the harvest core needs pydantic-settings and python-dotenv: carry .gpu-wheels/py (bench/gpu_stage.sh)"; exit 2; }
fi
"$PY" -c "import torch, transformers; print(f'gpu.sh: torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}')"
[ -n "$VLLM_NOTE" ] && note "$VLLM_NOTE"

# 2. The parts, each with a deadline that leaves room for the ones after it.
part() {  # part NAME RESERVE_S: run gpu_bench.py NAME with (time left − RESERVE_S) seconds
    local name=$1 reserve=$2 give
    give=$(( $(left) - reserve ))
    if [ "$give" -lt 30 ]; then note "$name part skipped: the time budget (GPU_BENCH_BUDGET_S=$BUDGET) was spent"; return 1; fi
    echo "gpu.sh: part $name, ${give} s"
    GPU_BENCH_DEADLINE=$(( $(date +%s) + give )) timeout --kill-after=10 $(( give + 20 )) "$PY" bench/gpu_bench.py "$name"
    local rc=$?
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && note "$name part killed at its time limit (${give} s)"
    echo "gpu.sh: part $name exit $rc"
    return $rc
}
with_vllm=0
[ -z "$VLLM_NOTE" ] && vllm_imports && with_vllm=1
hf=0
if [ "${GPU_BENCH_SKIP_HF:-0}" = 1 ]; then
    note "HF part skipped: GPU_BENCH_SKIP_HF=1"
else
    part hf $(( with_vllm ? 190 : 5 )); hf=$?
fi
vl=0; par=0
if [ $with_vllm = 1 ]; then
    part vllm 70; vl=$?
    part parity 0; par=$?
elif [ -z "$VLLM_NOTE" ]; then
    "$PY" bench/gpu_bench.py vllm >/dev/null   # records why it was skipped
fi

echo "gpu.sh: done in $(( $(date +%s) - START )) s; exits: hf $hf, vllm $vl, parity $par"
"$PY" bench/gpu_results.py "$RESULTS" table
exit $(( hf || vl || par ))
