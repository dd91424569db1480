#!/bin/sh
# infra/compose.yaml's minio-init (one-shot, idempotent): the bucket, and one MinIO user per
# role, each with a policy of its own instead of MinIO's `readwrite` on every bucket:
#
#   user (compose.env)     policy           may
#   S3_API_ACCESS_KEY      harvest-api      list and read  <prefix>/jobs/*  (reads, presigned links:
#                                           a link is signed with these credentials, so it
#                                           opens only what they open); write only
#                                           <prefix>/jobs/*/request.json; never delete
#   S3_WORKER_ACCESS_KEY   harvest-worker   list and read the bucket (requests, corpus files);
#                                           write and delete <prefix>/jobs/* (shards, statistics,
#                                           manifests, the retention sweep) and <prefix>/corpus/*
#                                           (scheduled corpus refreshes)
#
# The policies are api.json and worker.json beside this file, with @BUCKET@ and @PREFIX@ put in
# (S3_BUCKET, S3_PREFIX: the roles' HARVEST_STORAGE_URL is s3://$S3_BUCKET/$S3_PREFIX). Only
# this one-shot holds MinIO's root credentials. Plain POSIX sh and `mc`: the mc image has no sed.
# What each user could reach if its holder were taken over: infra/RUNBOOK.md "Threat model".
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

: "${MINIO_URL:=http://minio:9000}"
: "${S3_BUCKET:?}" "${S3_PREFIX:?}"
: "${S3_API_ACCESS_KEY:?}" "${S3_API_SECRET_KEY:?}" "${S3_WORKER_ACCESS_KEY:?}" "${S3_WORKER_SECRET_KEY:?}"
if [ "$S3_API_ACCESS_KEY" = "$S3_WORKER_ACCESS_KEY" ]; then
  echo "S3_API_ACCESS_KEY and S3_WORKER_ACCESS_KEY must differ: one user per role" >&2
  exit 1
fi

# replace KEY VALUE: stdin to stdout with every KEY replaced by VALUE (no sed in the image).
replace() {
  while IFS= read -r line || [ -n "$line" ]; do
    out=""
    while :; do
      case $line in
        *"$1"*) out="$out${line%%"$1"*}$2"; line=${line#*"$1"} ;;
        *) break ;;
      esac
    done
    printf '%s\n' "$out$line"
  done
}

# policy NAME FILE USER SECRET: the policy (created or replaced), the user, and the one attached to the other.
policy() {
  replace @BUCKET@ "$S3_BUCKET" < "$HERE/$2" | replace @PREFIX@ "$S3_PREFIX" > "$WORK/$2"
  mc admin policy create fleet "$1" "$WORK/$2"
  mc admin user add fleet "$3" "$4"
  # Already attached on a second run: MinIO refuses the same attachment twice.
  mc admin policy attach fleet "$1" --user "$3" || true
}

mc alias set fleet "$MINIO_URL" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
mc mb --ignore-existing "fleet/$S3_BUCKET"
policy harvest-api api.json "$S3_API_ACCESS_KEY" "$S3_API_SECRET_KEY"
policy harvest-worker worker.json "$S3_WORKER_ACCESS_KEY" "$S3_WORKER_SECRET_KEY"
echo "bucket $S3_BUCKET ready: users $S3_API_ACCESS_KEY (harvest-api), $S3_WORKER_ACCESS_KEY (harvest-worker)"
