#!/bin/sh
# Form a Redis Cluster from $CLUSTER_NODES ("host:port host:port ..."), all masters.
# Idempotent: exits 0 at once when the first node already reports cluster_state:ok.
# `CLUSTER MEET` takes IP addresses only, so the service names are resolved here.
set -eu

first=${CLUSTER_NODES%% *}
host=${first%:*}
port=${first##*:}
if redis-cli -h "$host" -p "$port" cluster info | grep -q '^cluster_state:ok'; then
  echo "redis cluster already formed"
  exit 0
fi

addresses=""
for node in $CLUSTER_NODES; do
  name=${node%:*}
  ip=$(getent hosts "$name" | awk '{ print $1; exit }')
  if [ -z "$ip" ]; then
    echo "cannot resolve $name: is the service up on this network?" >&2
    exit 1
  fi
  addresses="$addresses $ip:${node##*:}"
done

# shellcheck disable=SC2086  # one argument per node
redis-cli --cluster create $addresses --cluster-replicas 0 --cluster-yes

for _ in $(seq 1 30); do
  if redis-cli -h "$host" -p "$port" cluster info | grep -q '^cluster_state:ok'; then
    echo "redis cluster formed:$addresses"
    exit 0
  fi
  sleep 1
done
echo "redis cluster did not reach cluster_state:ok in 30s" >&2
exit 1
