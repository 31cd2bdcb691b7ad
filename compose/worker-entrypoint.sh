#!/bin/sh
# Entry point of the cumulus-worker image: other containers reach this agent by its
# container host name (Docker's DNS resolves it on user-defined networks), so advertise
# that unless told otherwise, then run the agent with the given arguments.
set -eu
: "${CUMULUS_ADVERTISE_HOST:=${HOSTNAME:-$(cat /etc/hostname)}}"
export CUMULUS_ADVERTISE_HOST
exec cumulus-worker "$@"
