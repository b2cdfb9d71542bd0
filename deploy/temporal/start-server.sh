#!/bin/sh
# Starts temporalio/server with the Postgres password read from its secret file (the server's
# configuration takes it from POSTGRES_PWD, which compose would otherwise have to hold in clear).
set -eu

: "${POSTGRES_PWD_FILE:?}"
POSTGRES_PWD="$(cat "$POSTGRES_PWD_FILE")"
export POSTGRES_PWD

if [ -x /etc/temporal/entrypoint.sh ]; then
  exec /etc/temporal/entrypoint.sh
fi
# An image whose entrypoint is the server itself: the broadcast address the entrypoint script
# would have derived from the container's name.
if [ "${BIND_ON_IP:-0.0.0.0}" = "0.0.0.0" ] && [ -z "${TEMPORAL_BROADCAST_ADDRESS:-}" ]; then
  TEMPORAL_BROADCAST_ADDRESS="$(getent hosts "$(hostname)" | awk '{print $1; exit}')"
  export TEMPORAL_BROADCAST_ADDRESS
fi
exec temporal-server start
