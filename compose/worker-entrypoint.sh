#!/bin/sh
# Entry point of the cumulus-worker image: installs and starts the agent with
# scripts/install-worker.sh (as on a bare machine, but without systemd and in the
# foreground), from the container's variables:
#   CUMULUS_COORDINATORS, CUMULUS_TLS_CA, CUMULUS_TOKEN_FILE   the cluster (required)
#   CUMULUS_WORKER_ID        default: the container's host name
#   CUMULUS_ADVERTISE_HOST   default: the container's host name (Docker's DNS resolves it
#                            on user-defined networks)
#   CUMULUS_LISTEN, CUMULUS_SLOTS, CUMULUS_GPUS, CUMULUS_DATA_DIR
#   CUMULUS_RUN_AS           rank isolation's uid range (default 60000-60999), or none
#   CUMULUS_METRICS_TOKEN_FILE  the scrape token of /metrics (optional)
# Every other variable (S3 settings, RUST_LOG, ...) reaches the agent as it is. Arguments
# go to install-worker.sh. The token is copied to a file of the agent's alone (a compose
# secret keeps the host file's mode, which ranks could read).
#
# `docker exec -e CUMULUS_INSTALL_FOREGROUND=0 CONTAINER cumulus-worker-entrypoint` runs
# the install again beside the running agent: it changes nothing and says so (the
# compose test checks it).
set -eu
host="${HOSTNAME:-$(cat /etc/hostname)}"
[ "${CUMULUS_INSTALL_FOREGROUND:-1}" = 0 ] || set -- --foreground "$@"
# The scrape token of /metrics, when given: a private copy too.
[ -z "${CUMULUS_METRICS_TOKEN_FILE:-}" ] || set -- --metrics-token-file "$CUMULUS_METRICS_TOKEN_FILE" "$@"
exec cumulus-install-worker --no-systemd \
  --binary /usr/local/bin/cumulus-worker \
  --coordinators "${CUMULUS_COORDINATORS:?}" \
  --ca "${CUMULUS_TLS_CA:?}" \
  --token-file "${CUMULUS_TOKEN_FILE:?}" \
  --worker-id "${CUMULUS_WORKER_ID:-$host}" \
  --advertise-host "${CUMULUS_ADVERTISE_HOST:-$host}" \
  --listen "${CUMULUS_LISTEN:-0.0.0.0:9000}" \
  --slots "${CUMULUS_SLOTS:-4}" \
  --gpus "${CUMULUS_GPUS:-auto}" \
  --data-dir "${CUMULUS_DATA_DIR:-/var/lib/cumulus-worker}" \
  --run-as "${CUMULUS_RUN_AS:-60000-60999}" \
  "$@"
