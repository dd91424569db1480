#!/bin/bash
# The official postgres image's start, in short: initialise an empty PGDATA (superuser
# POSTGRES_USER with POSTGRES_PASSWORD, scram auth from anywhere), create POSTGRES_DB, run
# /docker-entrypoint-initdb.d/* once, then exec the server listening on every address.
set -euo pipefail
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
  initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 > /dev/null
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories=/var/run/postgresql" -w start > /dev/null
  psql=(psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password --host /var/run/postgresql)
  if [ "$POSTGRES_DB" != postgres ]; then "${psql[@]}" --dbname postgres -c "CREATE DATABASE \"$POSTGRES_DB\""; fi
  for f in /docker-entrypoint-initdb.d/*; do
    case $f in
      *.sql) echo "running $f"; "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
      *.sh) echo "running $f"; . "$f" ;;
    esac
  done
  pg_ctl -D "$PGDATA" -m fast -w stop > /dev/null
  echo "PostgreSQL init process complete"
fi
if [ "${1:-}" = postgres ]; then
  exec "$@" -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql
fi
exec "$@"
