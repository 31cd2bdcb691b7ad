#!/usr/bin/env bash
# Changes the number of coordinators of a Cumulus cluster on Kubernetes, one member at a
# time, never losing a quorum and never deleting data a member still needs:
#
#   grow N -> M:   checks the certificates exist for the new ids, scales the StatefulSet,
#                  then for each new node: waits for its pod (it starts with --join),
#                  `cumulusctl cluster add-learner` with its gRPC, HTTP and Raft
#                  addresses (the ports of the StatefulSet's CUMULUS_*_PORT; returns
#                  once it caught up),
#                  `cumulusctl cluster promote`, waits until it is ready;
#   shrink N -> M: for each node from the highest id down: `cumulusctl cluster remove`
#                  (the StatefulSet removes the highest ordinals), then scales the
#                  StatefulSet; the removed nodes' volumes are kept unless
#                  --delete-volumes is given (a removed member's data is of no use to
#                  the cluster, and a later grow should start it empty);
#   both:          sets the PodDisruptionBudget to a majority of M (floor(M/2) + 1).
#
# usage: deploy/kubernetes/scale-coordinators.sh [-n NAMESPACE] [--delete-volumes] M
#
# Needs kubectl with access to the namespace, and python3 (to read cumulusctl's JSON).
# cumulusctl runs inside a ready coordinator pod (`kubectl exec`), with its token.
set -euo pipefail

ns="${CUMULUS_NAMESPACE:-cumulus}"
delete_volumes=0
target=""
sts=cumulus-coordinator
raft=cumulus-raft
while [ $# -gt 0 ]; do
  case "$1" in
    -n | --namespace) ns="$2"; shift 2 ;;
    --delete-volumes) delete_volumes=1; shift ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) target="$1"; shift ;;
  esac
done
case "$target" in
  '' | *[!0-9]* | 0) echo "usage: $0 [-n NAMESPACE] [--delete-volumes] M   (M >= 1 coordinators)" >&2; exit 2 ;;
esac

k() { kubectl -n "$ns" "$@"; }
say() { echo "[scale-coordinators] $*"; }

current="$(k get statefulset "$sts" -o jsonpath='{.spec.replicas}')"
say "namespace $ns: $current coordinators, want $target"

# A ready coordinator to run cumulusctl in (not one about to be removed).
ctl_pod() {
  local id
  for id in $(seq 1 "$current"); do
    [ "$id" -le "$target" ] || continue
    if [ "$(k get pod "$sts-$id" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]; then
      echo "$sts-$id"
      return 0
    fi
  done
  echo "no ready coordinator among 1..$target to run cumulusctl in" >&2
  return 1
}
ctl() { k exec "$(ctl_pod)" -c coordinator -- cumulusctl "$@"; }
voters() {
  ctl cluster status -o json | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(" ".join(str(m["node_id"]) for m in d.get("members", []) if m.get("voter")))'
}
set_pdb() {
  local majority=$(($1 / 2 + 1))
  k patch poddisruptionbudget "$sts" --type merge -p "{\"spec\":{\"minAvailable\":$majority}}" >/dev/null
  say "PodDisruptionBudget: at least $majority of $1 available"
}
# The ports coordinator-start.sh names in every node's --peer entry: the StatefulSet's.
port_of() {
  k get statefulset "$sts" -o jsonpath="{.spec.template.spec.containers[0].env[?(@.name==\"$1\")].value}"
}
grpc_port="$(port_of CUMULUS_GRPC_PORT)"
http_port="$(port_of CUMULUS_HTTP_PORT)"
raft_port="$(port_of CUMULUS_RAFT_PORT)"
for p in "$grpc_port" "$http_port" "$raft_port"; do
  case "$p" in
    '' | *[!0-9]*) echo "the StatefulSet $sts lacks CUMULUS_GRPC_PORT, CUMULUS_HTTP_PORT or CUMULUS_RAFT_PORT (got '$grpc_port' '$http_port' '$raft_port')" >&2; exit 1 ;;
  esac
done
# GRPC@HTTP@RAFT: peers reach the new node's Raft service on its raft port.
addr() { echo "$sts-$1.$raft:$grpc_port@$sts-$1.$raft:$http_port@$sts-$1.$raft:$raft_port"; }

if [ "$target" -gt "$current" ]; then
  initial="$(k get configmap "$sts" -o jsonpath='{.data.initial-members}')"
  [ "$initial" -le "$current" ] || {
    echo "initial-members ($initial) is above the current size ($current): the cluster has not formed as configured" >&2
    exit 1
  }
  for id in $(seq $((current + 1)) "$target"); do
    cert="$(k get secret "$sts-pki" -o jsonpath="{.data.coordinator-$id\\.pem}")"
    [ -n "$cert" ] || {
      echo "Secret $sts-pki has no certificate for node $id: the certs Job made them for fewer nodes (docs/deploy.md, Scaling)" >&2
      exit 1
    }
  done
  say "voters before: $(voters)"
  k scale statefulset "$sts" --replicas="$target" >/dev/null
  for id in $(seq $((current + 1)) "$target"); do
    say "node $id: waiting for its pod to start (it waits to be added: --join)"
    end=$(($(date +%s) + 600))
    until k get pod "$sts-$id" >/dev/null 2>&1; do
      [ "$(date +%s)" -lt "$end" ] || { echo "no pod $sts-$id after 600 s" >&2; exit 1; }
      sleep 2
    done
    k wait --for=jsonpath='{.status.containerStatuses[0].started}'=true "pod/$sts-$id" --timeout=600s >/dev/null
    say "node $id: add-learner (returns once it has caught up)"
    ctl cluster add-learner "$id" "$(addr "$id")" >/dev/null
    say "node $id: promote"
    ctl cluster promote "$id" >/dev/null
    k wait --for=condition=Ready "pod/$sts-$id" --timeout=600s >/dev/null
    say "node $id: a ready voter"
  done
  set_pdb "$target"
elif [ "$target" -lt "$current" ]; then
  # The budget first: with fewer members the old majority could not be met.
  set_pdb "$target"
  for id in $(seq "$current" -1 $((target + 1))); do
    say "node $id: remove from the membership"
    ctl cluster remove "$id" >/dev/null
  done
  k scale statefulset "$sts" --replicas="$target" >/dev/null
  for id in $(seq "$current" -1 $((target + 1))); do
    k wait --for=delete "pod/$sts-$id" --timeout=120s >/dev/null 2>&1 || true
    if [ "$delete_volumes" = 1 ]; then
      k delete pvc "data-$sts-$id" --wait=false >/dev/null
      say "node $id: stopped, its volume data-$sts-$id deleted"
    else
      say "node $id: stopped; its volume is kept: kubectl -n $ns delete pvc data-$sts-$id (before growing again)"
    fi
  done
fi
say "voters now: $(voters)"
