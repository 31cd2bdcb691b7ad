#!/bin/sh
# Starts one coordinator of the StatefulSet (coordinator-statefulset.yaml), with the
# flags of its `args` ("$@") and those that depend on the pod:
#
#   --node-id        the pod's ordinal (ordinals start at 1: cumulus-coordinator-1 is node 1)
#   --tls-cert/-key  the node's certificate, copied by the init container
#   --peer           the initial members, nodes 1 to `initial-members` (ConfigMap
#                    cumulus-coordinator), each GRPC@HTTP@RAFT (Raft on a port of its
#                    own: the args' --raft-listen); the lowest of them bootstraps a
#                    pristine cluster
#   --join           for a node above `initial-members`: it waits to be added
#                    (scale-coordinators.sh runs add-learner and promote)
#   --rejoin-empty   for a node listed in `rejoin-empty` (one id a line): its data dir
#                    was lost or damaged, and it was removed from the membership first
#                    (docs/deploy.md, "A coordinator lost its volume")
#
# Environment (from the pod spec): CUMULUS_STATEFULSET, CUMULUS_RAFT_SERVICE,
# CUMULUS_GRPC_PORT, CUMULUS_HTTP_PORT, CUMULUS_RAFT_PORT (the port of the args'
# --raft-listen), CUMULUS_CONFIG_DIR, CUMULUS_SECRETS_DIR; the node
# id is the ordinal ending HOSTNAME (the pod's name).
set -eu
host="${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}"
id="${host##*-}"
sts="${CUMULUS_STATEFULSET:?}"
raft="${CUMULUS_RAFT_SERVICE:?}"
grpc="${CUMULUS_GRPC_PORT:?}"
http="${CUMULUS_HTTP_PORT:?}"
raft_port="${CUMULUS_RAFT_PORT:?}"
config="${CUMULUS_CONFIG_DIR:?}"
secrets="${CUMULUS_SECRETS_DIR:?}"
initial="$(tr -d ' \n' <"$config/initial-members")"
case "$initial" in
  '' | *[!0-9]* | 0) echo "initial-members must be a number >= 1, not '$initial'" >&2; exit 2 ;;
esac
case "$id" in
  '' | *[!0-9]* | 0) echo "the host name $host must end in the pod's ordinal (>= 1), not '$id'" >&2; exit 2 ;;
esac

peer() { echo "--peer=$1=$sts-$1.$raft:$grpc@$sts-$1.$raft:$http@$sts-$1.$raft:$raft_port"; }

# The initial members, and this node when it is not one of them.
n=1
while [ "$n" -le "$initial" ]; do
  set -- "$@" "$(peer "$n")"
  n=$((n + 1))
done
if [ "$id" -gt "$initial" ]; then
  set -- "$@" "$(peer "$id")"
fi

if [ -f "$config/rejoin-empty" ] && grep -qx "$id" "$config/rejoin-empty"; then
  echo "node $id is listed in rejoin-empty: starting with --rejoin-empty" >&2
  set -- "$@" --rejoin-empty
elif [ "$id" -gt "$initial" ]; then
  set -- "$@" --join
fi

exec cumulus-coordinator --node-id="$id" \
  --tls-cert="$secrets/coordinator.pem" --tls-key="$secrets/coordinator-key.pem" "$@"
