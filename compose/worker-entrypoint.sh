#!/bin/sh
# Entry point of the cumulus-worker image: other containers reach this agent by its
# container host name (Docker's DNS resolves it on user-defined networks), so advertise
# that unless told otherwise, then run the agent with the given arguments.
set -eu
: "${CUMULUS_ADVERTISE_HOST:=${HOSTNAME:-$(cat /etc/hostname)}}"
export CUMULUS_ADVERTISE_HOST
# Ranks run as other users (CUMULUS_RUN_AS): the agent refuses a token file they could
# read. A compose secret is a bind mount with the host file's mode, so the agent reads
# a private copy.
if [ -n "${CUMULUS_RUN_AS:-}" ] && [ -n "${CUMULUS_TOKEN_FILE:-}" ]; then
  mkdir -p /run/cumulus
  (umask 077 && cp "$CUMULUS_TOKEN_FILE" /run/cumulus/cluster-token)
  CUMULUS_TOKEN_FILE=/run/cumulus/cluster-token
  export CUMULUS_TOKEN_FILE
fi
exec cumulus-worker "$@"
