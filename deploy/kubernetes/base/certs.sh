#!/bin/sh
# The certs Job (certs-job.yaml): makes, once per namespace, what a Cumulus cluster's
# processes trust and present, straight into the Kubernetes API (nothing on a disk that
# outlives the Job's memory-backed scratch dir):
#
#   Secret    cumulus-coordinator-pki  ca.pem, ca-key.pem, coordinator-N.pem and
#                                      coordinator-N-key.pem for every N of
#                                      CUMULUS_COORDINATOR_IDS (coordinators only)
#   Secret    cumulus-cluster-token    token: clients, workers, the administrator
#   Secret    cumulus-peer-token       token: the coordinators' Raft service only
#   Secret    cumulus-metrics-token    token: reads /metrics and nothing else (Prometheus)
#   ConfigMap cumulus-ca               ca.pem: the CA certificate alone (public)
#
# An object that exists is left as it is, so a re-run changes nothing; the CA ConfigMap
# is made from the existing Secret when only it is missing. Private keys go into the
# Secret only, never into a ConfigMap or an image.
#
# Environment (set by the Job): CUMULUS_COORDINATOR_IDS (comma-separated node ids),
# CUMULUS_STATEFULSET, CUMULUS_RAFT_SERVICE, CUMULUS_CLIENT_SERVICE, CUMULUS_CLUSTER_DOMAIN;
# CUMULUS_K8S_API (default https://kubernetes.default.svc) and CUMULUS_K8S_SA_DIR (default
# the mounted ServiceAccount) for tests.
set -eu

api="${CUMULUS_K8S_API:-https://kubernetes.default.svc}"
sa="${CUMULUS_K8S_SA_DIR:-/var/run/secrets/kubernetes.io/serviceaccount}"
ns="$(cat "$sa/namespace")"
ids="${CUMULUS_COORDINATOR_IDS:?}"
sts="${CUMULUS_STATEFULSET:?}"
raft="${CUMULUS_RAFT_SERVICE:?}"
client="${CUMULUS_CLIENT_SERVICE:?}"
domain="${CUMULUS_CLUSTER_DOMAIN:-cluster.local}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
umask 077

# kube METHOD PATH [BODY_FILE]: the HTTP status; the answer's body in $work/body.
kube() {
  set -- "$1" "$2" "${3:-}"
  if [ -n "$3" ]; then
    curl -sS -o "$work/body" -w '%{http_code}' --cacert "$sa/ca.crt" \
      -H "Authorization: Bearer $(cat "$sa/token")" -H 'Content-Type: application/json' \
      -X "$1" --data-binary "@$3" "$api$2"
  else
    curl -sS -o "$work/body" -w '%{http_code}' --cacert "$sa/ca.crt" \
      -H "Authorization: Bearer $(cat "$sa/token")" -X "$1" "$api$2"
  fi
}

# exists KIND NAME: 0 when it exists, 1 when not (404); fails on any other answer.
exists() {
  code="$(kube GET "/api/v1/namespaces/$ns/$1/$2")"
  case "$code" in
    200) return 0 ;;
    404) return 1 ;;
    *) echo "GET $1/$2: HTTP $code: $(cat "$work/body")" >&2; exit 1 ;;
  esac
}

# create KIND NAME FIELD ENTRIES_FILE: creates the object with FIELD (data, binaryData)
# holding ENTRIES_FILE's `key base64` lines; an object made meanwhile (409) is kept.
create() {
  {
    printf '{"apiVersion":"v1","kind":"%s","metadata":{"name":"%s","labels":{"app.kubernetes.io/name":"cumulus","app.kubernetes.io/managed-by":"cumulus-certs"}},' \
      "$([ "$1" = secrets ] && echo Secret || echo ConfigMap)" "$2"
    [ "$1" = secrets ] && printf '"type":"Opaque",'
    printf '"%s":{' "$3"
    sep=""
    while read -r key value; do
      printf '%s"%s":"%s"' "$sep" "$key" "$value"
      sep=","
    done <"$4"
    printf '}}\n'
  } >"$work/object.json"
  code="$(kube POST "/api/v1/namespaces/$ns/$1" "$work/object.json")"
  case "$code" in
    201) echo "created $1/$2" ;;
    409) echo "kept $1/$2 (made meanwhile)" ;;
    *) echo "POST $1/$2: HTTP $code: $(cat "$work/body")" >&2; exit 1 ;;
  esac
}

b64() { base64 <"$1" | tr -d '\n'; }
token() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$1"; }

for name in cumulus-cluster-token cumulus-peer-token cumulus-metrics-token; do
  if exists secrets "$name"; then
    echo "kept secrets/$name"
  else
    token "$work/token"
    echo "token $(b64 "$work/token")" >"$work/entries"
    create secrets "$name" data "$work/entries"
  fi
done

if exists secrets cumulus-coordinator-pki; then
  echo "kept secrets/cumulus-coordinator-pki"
  # The CA certificate, base64 as the API returns it.
  ca_b64="$(tr -d ' \n' <"$work/body" | grep -o '"ca\.pem":"[^"]*"' | head -n1 | cut -d'"' -f4)"
  [ -n "$ca_b64" ] || { echo "secrets/cumulus-coordinator-pki has no ca.pem" >&2; exit 1; }
else
  hosts="$client,$client.$ns.svc,$client.$ns.svc.$domain"
  for id in $(echo "$ids" | tr ',' ' '); do
    pod="$sts-$id.$raft"
    hosts="$hosts,$pod,$pod.$ns.svc,$pod.$ns.svc.$domain"
  done
  cumulusctl certs init --dir "$work/pki" --coordinators "$ids" --hosts "$hosts" >/dev/null
  : >"$work/entries"
  for f in "$work"/pki/ca.pem "$work"/pki/ca-key.pem "$work"/pki/coordinator-*.pem; do
    echo "$(basename "$f") $(b64 "$f")" >>"$work/entries"
  done
  create secrets cumulus-coordinator-pki data "$work/entries"
  ca_b64="$(b64 "$work/pki/ca.pem")"
fi

if exists configmaps cumulus-ca; then
  echo "kept configmaps/cumulus-ca"
else
  echo "ca.pem $ca_b64" >"$work/entries"
  create configmaps cumulus-ca binaryData "$work/entries"
fi
