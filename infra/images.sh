#!/usr/bin/env bash
# Build every image of the deploy recipe with podman, on a machine that can reach Debian's
# archive and a Python package index but no container registry (RUNBOOK "Building the images
# without a registry"). From the repository root:
#
#   bash infra/images.sh            # debian base, api, control-plane, worker-cpu, postgres, s3, redis
#   bash infra/images.sh --gpu      # and worker-gpu (PyPI's CUDA torch + vLLM: ~10 GB, slow)
#   bash infra/images.sh --rebase   # make the Debian base again (else kept if present)
#
# 1. A Debian bookworm base: `debootstrap --variant=minbase` from the mirror this machine's apt
#    sources name, with Python 3.11 (Debian's), imported with `podman import`.
# 2. The roles from infra/Dockerfile with that base as PYTHON_IMAGE / CUDA_IMAGE (and, for the
#    GPU image, a `uv` image made from PyPI's uv wheel as UV_IMAGE).
# 3. The infrastructure images compose needs and no registry gives here (infra/images/):
#    PostgreSQL from Debian's package, and moto's S3 server for the smoke run.
#
# pip's CA bundle (the file PIP_CERT names) and pip's configuration go in as build secrets
# (`--secret`), mounted for the pip steps only; local wheel directories the configuration names
# are mounted read-only into the build. Nothing of either is in a layer.
# Prints each image's size and build time, also written to $HARVEST_IMAGES_LOG.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$REPO/infra/containers.conf}
PREFIX=${HARVEST_IMAGE_PREFIX:-harvest}
TAG=${HARVEST_TAG:-latest}
BASE=$PREFIX/debian:bookworm
STATE=${HARVEST_IMAGES_STATE:-/tmp/harvest-images}
LOG=${HARVEST_IMAGES_LOG:-$STATE/images.tsv}
GPU=0
REBASE=0
for arg in "$@"; do
  case $arg in
    --gpu) GPU=1 ;;
    --rebase) REBASE=1 ;;
    *) echo "usage: $0 [--gpu] [--rebase]" >&2; exit 2 ;;
  esac
done
mkdir -p "$STATE"
: > "$LOG"

say() { echo "images: $*" >&2; }

# --- tools ---------------------------------------------------------------------------------
need=()
for tool in podman runc debootstrap; do command -v "$tool" > /dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  say "installing ${need[*]} (Debian packages)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=300 podman buildah runc debootstrap > "$STATE/apt.log"
fi
PODMAN=(podman --runtime runc)

record() {  # name seconds: one line of the report, with the image's size
  local size
  size=$(podman image inspect --format '{{.Size}}' "$1")
  printf '%s\t%s\t%s\n' "$1" "$(numfmt --to=si --suffix=B "$size")" "$2" | tee -a "$LOG" >&2
}

# --- pip's access to the index, as build secrets --------------------------------------------
# This machine's pip configuration, as one file: `pip config list` (files, not environment),
# without the CA path and constraint files of this machine, with the CA as the secret mounted at
# /run/secrets/pip-ca. Local directories it names (find-links, file:// indexes) become
# read-only volumes of the build, at the same paths.
PIP_CONF=$STATE/pip.conf
PIP_CA=${PIP_CERT:-$(python3 -m pip config get global.cert 2> /dev/null || true)}
VOLUMES=()
python3 - "$PIP_CONF" > "$STATE/pip-dirs" <<'EOF'
import configparser, os, re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
conf = configparser.ConfigParser()
dirs = set()
for line in out.splitlines():
    m = re.match(r"^([a-z0-9_-]+)\.([a-z0-9_-]+)='(.*)'$", line)
    if not m or m.group(2) in ("cert", "constraint", "client-cert"):
        continue
    section, key, value = m.groups()
    conf.setdefault(section, {})
    conf[section][key] = value
    for word in value.split():
        path = word.removeprefix("file://")
        if path.startswith("/") and os.path.exists(path):
            dirs.add(path.rstrip("/").removesuffix("/simple"))
conf.setdefault("global", {})
conf["global"]["cert"] = "/run/secrets/pip-ca"
with open(sys.argv[1], "w") as f:
    conf.write(f)
print("\n".join(sorted(dirs)))
EOF
while read -r dir; do
  [ -n "$dir" ] && VOLUMES+=(-v "$dir:$dir:ro")
done < "$STATE/pip-dirs"
SECRETS=(--secret "id=pip.conf,src=$PIP_CONF")
if [ -n "$PIP_CA" ] && [ -f "$PIP_CA" ]; then
  SECRETS+=(--secret "id=pip-ca,src=$PIP_CA")
else
  sed -i '/^cert = /d' "$PIP_CONF"
fi
say "pip configuration for the build: $PIP_CONF (CA: ${PIP_CA:-none}; mounted: $(tr '\n' ' ' < "$STATE/pip-dirs"))"

# --- 1. the Debian base ---------------------------------------------------------------------
debian_mirror() {  # the first Debian archive this machine's apt sources name for bookworm
  local uri
  uri=$(grep -hs -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list \
        | grep -v security | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' | awk '{print $1}' | head -n1)
  echo "${uri:-http://deb.debian.org/debian}"
}

if ((REBASE)) || ! podman image exists "$BASE"; then
  mirror=$(debian_mirror)
  root=$STATE/rootfs
  rm -rf "$root"
  say "debootstrap bookworm from $mirror"
  start=$SECONDS
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" > "$STATE/debootstrap.log" 2>&1 || { tail -n 20 "$STATE/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar --numeric-owner -C "$root" -c . \
    | podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$BASE" > /dev/null
  rm -rf "$root"
  record "$BASE" $((SECONDS - start))
else
  record "$BASE" 0
fi

# --- 2. the roles -----------------------------------------------------------------------------
build() {  # target image [build args…]
  local target=$1 image=$2 start=$SECONDS
  shift 2
  say "building $image (target $target)"
  "${PODMAN[@]}" build --network host --layers -f infra/Dockerfile --target "$target" -t "$image" \
    "${SECRETS[@]}" "${VOLUMES[@]}" "$@" . > "$STATE/build-$target.log" 2>&1 \
    || { tail -n 40 "$STATE/build-$target.log" >&2; say "build of $target failed (log: $STATE/build-$target.log)"; exit 1; }
  record "$image" $((SECONDS - start))
}

# torch's `+cpu` wheel: PyTorch's CPU index when reachable, else PyPI's index completed by the
# local wheels pip's configuration names (the machine's own mirror of that wheel).
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
if ! curl -fsS -o /dev/null --max-time 10 "$TORCH_INDEX_URL/torch/" 2> /dev/null; then
  TORCH_INDEX_URL=https://pypi.org/simple
fi
CPU_ARGS=(--build-arg "PYTHON_IMAGE=$BASE" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
for target in api control-plane worker-cpu; do
  build "$target" "$PREFIX/$target:$TAG" "${CPU_ARGS[@]}"
done

if ((GPU)); then
  # uv from its PyPI wheel (the binary alone, at /uv, as in astral's image).
  UV_VERSION=$(sed -n 's/^ARG UV_IMAGE=.*:\([0-9.]*\)$/\1/p' infra/Dockerfile)
  if ! podman image exists "$PREFIX/uv:$UV_VERSION"; then
    rm -rf "$STATE/uv" && mkdir -p "$STATE/uv/root"
    python3 -m pip download --quiet --no-deps --only-binary :all: --platform manylinux_2_17_x86_64 \
      -d "$STATE/uv" "uv==$UV_VERSION"
    python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = next(n for n in z.namelist() if n.endswith('/scripts/uv')); open(sys.argv[2], 'wb').write(z.read(n))" \
      "$(ls "$STATE"/uv/uv-*.whl)" "$STATE/uv/root/uv"
    chmod 755 "$STATE/uv/root/uv"
    tar -C "$STATE/uv/root" -c uv | podman import - "$PREFIX/uv:$UV_VERSION" > /dev/null
  fi
  # The GPU image takes PyPI's CUDA torch: no local `+cpu` wheel may be offered to it.
  grep -v '^find-links' "$PIP_CONF" > "$STATE/pip-gpu.conf"
  SECRETS[1]="id=pip.conf,src=$STATE/pip-gpu.conf"
  build worker-gpu "$PREFIX/worker-gpu:$TAG" --build-arg "CUDA_IMAGE=$BASE" --build-arg "UV_IMAGE=$PREFIX/uv:$UV_VERSION"
  SECRETS[1]="id=pip.conf,src=$PIP_CONF"
fi

# --- 3. the infrastructure ------------------------------------------------------------------
for name in postgres s3 redis; do
  start=$SECONDS
  say "building $PREFIX/$name:$TAG"
  "${PODMAN[@]}" build --network host --layers -f "infra/images/$name.Containerfile" --build-arg "BASE=$BASE" \
    -t "$PREFIX/$name:$TAG" "${SECRETS[@]}" "${VOLUMES[@]}" infra/images > "$STATE/build-$name.log" 2>&1 \
    || { tail -n 40 "$STATE/build-$name.log" >&2; exit 1; }
  record "$PREFIX/$name:$TAG" $((SECONDS - start))
done

# Layers the rebuilds replaced.
podman image prune -f > /dev/null || true
echo "image	size	build s"
cat "$LOG"
