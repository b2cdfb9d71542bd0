#!/bin/sh
# The namespace ModelForge runs in, with its retention (TEMPORAL_RETENTION in compose, 24h by
# default; applied to a namespace that already exists too), and the search attributes operators
# filter by (modelforge/temporal.py). Run by temporalio/admin-tools once the server is healthy.
# Any failure stops it with a non-zero status, and the ModelForge workers, which wait for it to
# complete successfully, do not start: a missing search attribute would fail every request start.
set -eu

: "${TEMPORAL_ADDRESS:?}" "${NAMESPACE:?}" "${RETENTION:?}" "${SEARCH_ATTRIBUTES:?}"
export TEMPORAL_ADDRESS

attempt=1
until temporal operator cluster health >/dev/null 2>&1; do
  if [ "$attempt" -ge "${SETUP_ATTEMPTS:-60}" ]; then
    echo "Temporal at $TEMPORAL_ADDRESS did not become healthy" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  sleep 2
done

if temporal operator namespace describe --namespace "$NAMESPACE" >/dev/null 2>&1; then
  temporal operator namespace update --namespace "$NAMESPACE" --retention "$RETENTION"
  echo "namespace $NAMESPACE: retention $RETENTION"
else
  temporal operator namespace create --namespace "$NAMESPACE" --retention "$RETENTION"
  echo "namespace $NAMESPACE created, retention $RETENTION"
fi

# A namespace just created reaches every frontend within seconds: try for a minute, then fail.
attempt=1
while :; do
  missing=""
  if listed="$(temporal operator search-attribute list --namespace "$NAMESPACE" 2>/tmp/list.err)"; then
    for name in $SEARCH_ATTRIBUTES; do
      # Listed with its type (a system attribute of that name but another type does not count).
      printf '%s\n' "$listed" | grep -Eq "^[[:space:]]*$name[[:space:]]+Keyword[[:space:]]*\$" \
        || missing="$missing $name"
    done
    [ -z "$missing" ] && break
    for name in $missing; do
      temporal operator search-attribute create --namespace "$NAMESPACE" --name "$name" --type Keyword \
        || echo "creating search attribute $name failed (attempt $attempt)" >&2
    done
  else
    cat /tmp/list.err >&2
  fi
  if [ "$attempt" -ge "${SETUP_ATTEMPTS:-30}" ]; then
    echo "search attributes missing in namespace $NAMESPACE:${missing:- (cannot list them)}" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  sleep 2
done
echo "namespace $NAMESPACE ready: search attributes $SEARCH_ATTRIBUTES"
