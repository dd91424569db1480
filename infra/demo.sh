#!/usr/bin/env bash
# A demo harvest on the embedded model with `harvest run`, no servers needed.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .harvest
out=${1:-.harvest/demo}
printf '%s\n' "The quick brown fox jumps over the lazy dog." "Interpretability research reads the residual stream." > .harvest/demo-prompts.txt
.venv/bin/harvest run --model llama-tiny --prompts .harvest/demo-prompts.txt --out "$out"
