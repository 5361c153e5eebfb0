#!/bin/sh
# Container entry point. With SWARM_BOOTSTRAP_FROM=<host>:<path to that node's node.json on a
# shared volume>, waits for the bootstrap node to write its node.json and joins it by DNS name:
#   SWARM_BOOTSTRAP_FROM=relay:/shared/relay/node.json
set -eu
if [ -n "${SWARM_BOOTSTRAP_FROM:-}" ]; then
  host=${SWARM_BOOTSTRAP_FROM%%:*}
  file=${SWARM_BOOTSTRAP_FROM#*:}
  i=0
  while [ ! -s "$file" ]; do
    i=$((i + 1)); [ "$i" -gt 120 ] && { echo "bootstrap node never wrote $file" >&2; exit 1; }
    sleep 1
  done
  peer=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["peer_id"])' "$file")
  set -- "$@" --bootstrap "/dns4/$host/tcp/4001/p2p/$peer"
fi
exec swarm-node "$@"
