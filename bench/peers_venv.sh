#!/usr/bin/env bash
# Builds .venv-peers/ (git-ignored, at the repository root): the tools a researcher would pick
# instead of this service, installed the way their docs say, for bench/peer_arms.py.
#
#   bash bench/peers_venv.sh        # idempotent: a venv that already has everything is kept
#
# Pins: nnsight==0.8.1, transformer-lens==4.3.0, sae-lens==6.54.12, each of which resolves
# beside torch==2.13.0 (the CPU wheel on this machine's disk). torch is installed first, and
# every later resolver run is held to it by a constraints file: any other torch release is a
# multi-GB CUDA build.
#
# The three pins do not resolve together as published: sae-lens 6.54.12 (the newest sae-lens)
# declares `transformer-lens>=2.16.1,<4.0.0`, and rightly so: transformer-lens 4.0 removed the
# `transformer_lens.HookedTransformer` module that sae-lens imports at `import sae_lens`. The
# transformer_lens arm wants 4.3.0 (its TransformerBridge boots a local HF checkpoint), so the
# venv holds both, each where its user finds it:
#   - transformer-lens==4.3.0 in the venv itself (what `import transformer_lens` gets);
#   - sae-lens==6.54.12 in the venv with --no-deps, plus every other requirement it declares
#     (read from its own metadata, extras left out) under the same torch constraint;
#   - transformer-lens==3.9.0 (the newest release inside sae-lens' cap, the one
#     `pip install sae-lens` would pick) with --no-deps in .venv-peers/saelens-tl3/, plus
#     better-abc (the one requirement 3.9.0 has that 4.3.0 lacks). bench/peer_arms.py's
#     `saelens` arm puts that folder first on sys.path before importing sae_lens.
# `pip check` therefore reports sae-lens' cap; that is expected.
#
# The peers live in their own venv because their dependency trees (transformers 5.x, datasets,
# jaxtyping, wandb, ...) are not the project's, and .venv must stay as `make install` leaves it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-peers"
PY="${PEERS_PYTHON:-python3.11}"
TORCH_PIN="torch==2.13.0"
PEER_PINS=(nnsight==0.8.1 transformer-lens==4.3.0 sae-lens==6.54.12)
SAE_TL="$VENV/saelens-tl3"   # transformer-lens 3.9.0 for sae-lens only (see the top)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)

# The constraints file keeps every resolver run below from swapping torch out.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "$TORCH_PIN" >"$CONSTRAINTS"

# Prints sae-lens' declared requirements except transformer-lens and extras, one a line.
sae_lens_requirements() {
  "$VENV/bin/python" -c '
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("sae-lens") or []:
    req = Requirement(line)
    if req.marker is None and req.name.lower().replace("_", "-") != "transformer-lens":
        print(req)
'
}

# Fast path: a venv already holding torch 2.13.0+cpu, the three pins and sae-lens' TL is kept.
if [ -d "$SAE_TL/transformer_lens-3.9.0.dist-info" ] &&
  "$VENV/bin/python" - "${PEER_PINS[@]}" 2>/dev/null <<'EOF'; then
import sys
from importlib.metadata import version
import torch, safetensors, numpy, datasets  # noqa: F401  (present, importable)
assert torch.__version__ == "2.13.0+cpu", torch.__version__
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    assert version(name) == want, (name, version(name), want)
EOF
  echo "peers_venv: $VENV already complete"
else
  "${PIP[@]}" install --quiet --upgrade pip
  "${PIP[@]}" install --quiet "$TORCH_PIN"
  "${PIP[@]}" install --quiet -c "$CONSTRAINTS" nnsight==0.8.1 transformer-lens==4.3.0 \
    safetensors numpy packaging
  # sae-lens without its transformer-lens<4 cap (see the top), then the rest of what it needs.
  "${PIP[@]}" install --quiet --no-deps sae-lens==6.54.12
  mapfile -t SAE_REQS < <(sae_lens_requirements)
  "${PIP[@]}" install --quiet -c "$CONSTRAINTS" "${SAE_REQS[@]}" "better-abc>=0.0.3"
  # The transformer-lens sae-lens was built against, beside (not instead of) 4.3.0.
  rm -rf "$SAE_TL"
  "${PIP[@]}" install --quiet --no-deps --target "$SAE_TL" transformer-lens==3.9.0
fi

# The one check that matters: no other torch crept in.
got="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
if [ "$got" != "2.13.0+cpu" ]; then
  echo "peers_venv: torch in $VENV is $got, not 2.13.0+cpu" >&2
  exit 1
fi
"$VENV/bin/python" -c '
from importlib.metadata import version
for name in ("torch", "transformers", "nnsight", "transformer-lens", "sae-lens", "datasets",
             "safetensors", "numpy"):
    print(f"  {name}=={version(name)}")
'
# sae-lens must import against its own transformer-lens (and only there).
PYTHONPATH="$SAE_TL" "$VENV/bin/python" -c '
import transformer_lens, sae_lens
from importlib.metadata import version
tl = version("transformer-lens")
assert tl == "3.9.0", tl
print(f"  sae-lens imports with transformer-lens=={tl} from saelens-tl3/")
'
echo "peers_venv: ok ($VENV)"
