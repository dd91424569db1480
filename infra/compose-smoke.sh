#!/usr/bin/env bash
# The deploy recipe, run: infra/compose.yaml brought up with podman-compose from the images
# infra/images.sh built, then exercised and torn down. From the repository root:
#
#   bash infra/images.sh && bash infra/compose-smoke.sh
#
# 1. up: every service of compose.yaml (with infra/compose.smoke.yaml: moto's S3 in place of
#    MinIO, whose image cannot be pulled here), an env file made from compose.env.example with
#    fresh secrets; waits for each role's ready line, then runs each container's healthcheck.
# 2. a job submitted through api-1, long-polled, read and downloaded through api-2 (presigned
#    links), every shard's sha256 against the manifest; charged what the manifest says.
# 3. a worker container killed mid-job: the job ends done on the other worker, no shard written
#    before the kill is written again, charged once.
# 4. a Prefect API server container killed mid-job (and started again): the job ends done.
# 5. down (containers, network, volumes), the timings, and COMPOSE_SMOKE_OK last.
#
# The researcher's side runs in a container on the fleet's network (infra/compose_smoke_client.py
# in the api image), which resolves the services by name as the presigned links name them.
# Published ports bind 127.0.0.21 (SMOKE_PUBLISH_ADDR) so as not to meet other servers here.
# Logs of every container are kept in $STATE/logs.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$REPO/infra/containers.conf}
PROJECT=${SMOKE_PROJECT:-harvest-smoke}
STATE=${SMOKE_STATE:-/tmp/harvest-smoke}
PREFIX=${HARVEST_IMAGE_PREFIX:-harvest}
TAG=${HARVEST_TAG:-latest}
PUBLISH=${SMOKE_PUBLISH_ADDR:-127.0.0.21}
# Jobs of one-prompt shards, long enough to be caught mid-job (about 3.5 s a shard on a loaded
# 2-core machine; the lane splits a job between its two hosts).
KILL_PROMPTS=${SMOKE_KILL_PROMPTS:-40}
RESTART_PROMPTS=${SMOKE_RESTART_PROMPTS:-20}
T0=$SECONDS
TIMINGS=()

say() { echo "smoke [$((SECONDS - T0)) s]: $*" >&2; }
timing() { TIMINGS+=("$1=$2"); say "$1=$2"; }

rm -rf "$STATE" && mkdir -p "$STATE/logs" "$STATE/hf-hub"
chmod 755 "$STATE/hf-hub"

# --- podman-compose (PyPI's 1.6.0, in its own virtualenv) -------------------------------------
PC_VENV=${PODMAN_COMPOSE_VENV:-/tmp/harvest-images/compose-venv}
if [ ! -x "$PC_VENV/bin/podman-compose" ]; then
  say "installing podman-compose 1.6.0 into $PC_VENV"
  python3 -m venv "$PC_VENV"
  "$PC_VENV/bin/pip" install --quiet podman-compose==1.6.0
fi

# --- the env file: compose.env.example with fresh secrets and these images ------------------
secret() { python3 -c "import secrets; print(secrets.token_hex(12))"; }
ENV_FILE=$STATE/compose.env
sed -e "s|^POSTGRES_PASSWORD=.*|POSTGRES_PASSWORD=$(secret)|" \
    -e "s|^MINIO_ROOT_PASSWORD=.*|MINIO_ROOT_PASSWORD=$(secret)|" \
    -e "s|^JOBS_DB_PASSWORD=.*|JOBS_DB_PASSWORD=$(secret)|" \
    -e "s|^PREFECT_DB_PASSWORD=.*|PREFECT_DB_PASSWORD=$(secret)|" \
    -e "s|^S3_API_SECRET_KEY=.*|S3_API_SECRET_KEY=$(secret)|" \
    -e "s|^S3_WORKER_SECRET_KEY=.*|S3_WORKER_SECRET_KEY=$(secret)|" \
    -e "s|^PREFECT_AUTH_STRING=.*|PREFECT_AUTH_STRING=harvest:$(secret)|" \
    -e "s|^METRICS_TOKEN=.*|METRICS_TOKEN=$(secret)|" \
    -e "s|^REDIS_PASSWORD=.*|REDIS_PASSWORD=$(secret)|" \
    -e "s/^\(API_\|PREFECT_\|S3_\)PUBLISH_ADDR=.*/\1PUBLISH_ADDR=$PUBLISH/" \
    -e "s|^HARVEST_IMAGE_PREFIX=.*|HARVEST_IMAGE_PREFIX=$PREFIX|" \
    -e "s|^HARVEST_TAG=.*|HARVEST_TAG=$TAG|" \
    -e "s|^POSTGRES_IMAGE=.*|POSTGRES_IMAGE=$PREFIX/postgres:$TAG|" \
    -e "s|^REDIS_IMAGE=.*|REDIS_IMAGE=$PREFIX/redis:$TAG|" \
    -e "s|^HARVEST_HF_HUB_DIR=.*|HARVEST_HF_HUB_DIR=$STATE/hf-hub|" \
    infra/compose.env.example > "$ENV_FILE"
# shellcheck disable=SC1090
set -a && . "$ENV_FILE" && set +a

pc() { "$PC_VENV/bin/podman-compose" --in-pod false -p "$PROJECT" -f infra/compose.yaml -f infra/compose.smoke.yaml --env-file "$ENV_FILE" "$@"; }
ctr() {  # the container of a compose service
  podman ps -a --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -n1
}
SERVICES=(postgres minio minio-init redis prefect-api-1 prefect-api-2 prefect-services api-1 api-2 worker-small worker-small-2)

teardown() {
  local rc=$?
  set +e
  for s in "${SERVICES[@]}"; do
    c=$(ctr "$s")
    [ -n "$c" ] && podman logs "$c" > "$STATE/logs/$s.log" 2>&1
  done
  say "tearing down (logs in $STATE/logs)"
  local start=$SECONDS
  pc down -v -t 60 > "$STATE/logs/down.log" 2>&1
  podman volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman volume rm -f > /dev/null 2>&1
  timing down_s $((SECONDS - start))
  if [ $rc -ne 0 ]; then say "FAILED (rc=$rc)"; fi
  exit $rc
}
trap teardown EXIT

for image in "$PREFIX/api:$TAG" "$PREFIX/control-plane:$TAG" "$PREFIX/worker-cpu:$TAG" "$PREFIX/postgres:$TAG" "$PREFIX/s3:$TAG" "$PREFIX/redis:$TAG"; do
  podman image exists "$image" || { say "no image $image: run infra/images.sh first"; exit 1; }
done

# --- 1. up ---------------------------------------------------------------------------------
# In compose.yaml's dependency order, each stage once what it depends on is healthy, as
# `depends_on: condition: service_healthy` asks: podman 4.3 cannot wait on health (podman-compose
# skips those conditions there) and its `--requires` fails on chains of dependencies, so each
# stage is `up --no-deps` and its conditions are checked here, with the recipe's own healthchecks
# (run by hand: podman 4.3 runs them only from systemd timers, absent here).
healthy() {  # service [timeout s]: until its healthcheck passes
  local deadline=$((SECONDS + ${2:-300}))
  until podman healthcheck run "$(ctr "$1")" > /dev/null 2>&1; do
    ((SECONDS < deadline)) || { say "$1 never became healthy"; podman logs --tail 40 "$(ctr "$1")" >&2; return 1; }
    sleep 2
  done
}
ready() {  # service, the start of its ready line, occurrences wanted, timeout s
  local service=$1 line=$2 want=${3:-1} deadline=$((SECONDS + ${4:-600})) c
  while ((SECONDS < deadline)); do
    c=$(ctr "$service")
    if [ -n "$c" ] && [ "$(podman logs "$c" 2> /dev/null | grep -c "^$line")" -ge "$want" ]; then
      return 0
    fi
    sleep 1
  done
  say "$service printed no '$line' in time"; podman logs --tail 40 "$(ctr "$service")" >&2 || true
  return 1
}
up() { pc up -d --no-deps "$@" >> "$STATE/logs/up.log" 2>&1 || { tail -n 30 "$STATE/logs/up.log" >&2; return 1; }; }

start=$SECONDS
say "up: postgres, minio, redis"
up postgres minio redis
healthy postgres && timing healthy_postgres_s $((SECONDS - start))
healthy minio && timing healthy_s3_s $((SECONDS - start))
healthy redis && timing healthy_redis_s $((SECONDS - start))
say "up: minio-init, the control plane (prefect-api-1, prefect-api-2, prefect-services)"
up minio-init prefect-api-1
[ "$(podman wait "$(ctr minio-init)")" = 0 ] || { say "minio-init failed"; podman logs "$(ctr minio-init)" >&2; exit 1; }
ready prefect-api-1 "PREFECT_API_URL=" && healthy prefect-api-1
up prefect-api-2
ready prefect-api-2 "PREFECT_API_URL=" && healthy prefect-api-2
up prefect-services
ready prefect-services "PREFECT_SERVICES=" && timing ready_control_plane_s $((SECONDS - start))
healthy prefect-services
# One at a time: on a 2-core machine shared with other work, four roles importing torch and
# Prefect at once can each take over the 90 s a role gives its server to answer.
for s in api-1 api-2 worker-small worker-small-2; do
  say "up: $s"
  up "$s"
  case $s in
    api-*) ready "$s" "ACS_API_BASE=" ;;
    *) ready "$s" "WORKER_READY lane=small" ;;
  esac
  timing "ready_${s}_s" $((SECONDS - start))
done
for s in api-1 api-2 worker-small worker-small-2; do healthy "$s" 60; done
timing ready_all_s $((SECONDS - start))
say "every role ready, every healthcheck passes"

# --- the researcher -------------------------------------------------------------------------
KEY=$(podman exec "$(ctr api-1)" harvest keys create --name smoke --limit small=3 | tail -n1)
client() {
  podman run --rm --network "${PROJECT}_default" -v "$REPO/infra/compose_smoke_client.py:/smoke/client.py:ro" \
    -e API_1=http://api-1:8000/v1 -e API_2=http://api-2:8000/v1 -e "KEY=$KEY" \
    -e "JOBS_DB=postgresql://harvest:$POSTGRES_PASSWORD@postgres:5432/jobs" \
    -e "S3_ENDPOINT=$S3_ENDPOINT_URL" -e "S3_BUCKET=$S3_BUCKET" -e "S3_PREFIX=$S3_PREFIX" \
    -e "AWS_ACCESS_KEY_ID=$S3_API_ACCESS_KEY" -e "AWS_SECRET_ACCESS_KEY=$S3_API_SECRET_KEY" -e "AWS_DEFAULT_REGION=$S3_REGION" \
    -e PREFECT_API_URL=http://prefect-api-2:4200/api -e "PREFECT_API_AUTH_STRING=$PREFECT_AUTH_STRING" \
    "$PREFIX/api:$TAG" python /smoke/client.py "$@"
}
figures() { sed -n 's/^SMOKE //p' | while read -r kv; do echo "$kv"; done; }

# --- 2. across the replicas -------------------------------------------------------------------
say "a job through api-1, read and downloaded through api-2"
out=$(client roundtrip) || { echo "$out" >&2; exit 1; }
for kv in $(echo "$out" | figures); do timing "${kv%%=*}" "${kv#*=}"; done

# --- 3. a worker killed mid-job ---------------------------------------------------------------
say "a worker killed mid-job ($KILL_PROMPTS prompts)"
job=$(client submit "$KILL_PROMPTS" | tail -n1)
victim_host=$(client running "$job" 3 | tail -n1)
victim=""
for s in worker-small worker-small-2; do
  [ "$(podman inspect --format '{{.Config.Hostname}}' "$(ctr "$s")")" = "$victim_host" ] && victim=$s
done
[ -n "$victim" ] || { say "no worker container has hostname $victim_host"; exit 1; }
podman kill "$(ctr "$victim")" > /dev/null
# A host that died stays down here (its restart policy would bring it back): the job must end
# on the other one.
podman stop -t 0 "$(ctr "$victim")" > /dev/null 2>&1 || true
say "killed $victim ($victim_host), job $job"
out=$(client survives "$job" "$victim_host" "$KILL_PROMPTS") || { echo "$out" >&2; exit 1; }
for kv in $(echo "$out" | figures); do timing "${kv%%=*}" "${kv#*=}"; done
podman start "$(ctr "$victim")" > /dev/null
ready "$victim" "WORKER_READY lane=small" 2 && say "$victim back"

# --- 4. a Prefect API server killed mid-job -----------------------------------------------------
# The roles move to the other server (fleet/prefect_endpoints.py) while it is down.
say "a Prefect API server (prefect-api-1) killed mid-job ($RESTART_PROMPTS prompts)"
job=$(client submit "$RESTART_PROMPTS" | tail -n1)
client running "$job" 3 > /dev/null
start=$SECONDS
podman kill "$(ctr prefect-api-1)" > /dev/null
podman start "$(ctr prefect-api-1)" > /dev/null
ready prefect-api-1 "PREFECT_API_URL=" 2 && timing control_plane_restart_ready_s $((SECONDS - start))
out=$(client done "$job") || { echo "$out" >&2; exit 1; }
for kv in $(echo "$out" | figures); do timing "cp_restart_${kv%%=*}" "${kv#*=}"; done

# --- 5. down ----------------------------------------------------------------------------------
trap - EXIT
teardown_ok() {
  for s in "${SERVICES[@]}"; do podman logs "$(ctr "$s")" > "$STATE/logs/$s.log" 2>&1 || true; done
  local start=$SECONDS
  pc down -v -t 60 > "$STATE/logs/down.log" 2>&1
  podman volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman volume rm -f > /dev/null 2>&1 || true
  timing down_s $((SECONDS - start))
}
teardown_ok
left=$(podman ps -a --filter "label=com.docker.compose.project=$PROJECT" -q | wc -l)
[ "$left" = 0 ] || { say "$left containers left"; exit 1; }
timing total_s $((SECONDS - T0))
printf '%s\n' "${TIMINGS[@]}"
echo COMPOSE_SMOKE_OK
