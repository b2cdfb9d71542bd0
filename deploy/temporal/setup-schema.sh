#!/bin/sh
# Temporal's schema in the stack's Postgres (run by temporalio/admin-tools before the server
# starts), as Temporal's own compose setup does: each database created and its schema set up once,
# then every newer schema version applied (a no-op when it is current). Stops at the first error:
# the server never starts on a schema it cannot use.
set -eu

: "${POSTGRES_SEEDS:?}" "${POSTGRES_USER:?}" "${POSTGRES_PWD_FILE:?}"
SQL_PASSWORD="$(cat "$POSTGRES_PWD_FILE")"
export SQL_PASSWORD
PORT="${DB_PORT:-5432}"
SCHEMA=/etc/temporal/schema/postgresql/v12

tool() {
  temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "$PORT" -u "$POSTGRES_USER" "$@"
}

for pair in temporal:temporal temporal_visibility:visibility; do
  db="${pair%%:*}"
  dir="${pair#*:}"
  if tool --db "$db" create >/tmp/create.log 2>&1; then
    echo "created database $db"
    tool --db "$db" setup-schema -v 0.0
  elif grep -q "already exists" /tmp/create.log; then
    echo "database $db exists"
  else
    cat /tmp/create.log >&2
    echo "cannot create database $db" >&2
    exit 1
  fi
  tool --db "$db" update-schema -d "$SCHEMA/$dir/versioned"
done
echo "Temporal schema is current"
