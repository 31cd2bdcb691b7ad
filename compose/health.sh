#!/bin/sh
# Health probe of a Cumulus server in this container: `cumulus-health PORT` asks
# 127.0.0.1:PORT/health over HTTPS, verifying the server against $CUMULUS_TLS_CA, when
# that is set, and over plain HTTP otherwise (a process started with --insecure).
set -eu
port="$1"
if [ -n "${CUMULUS_TLS_CA:-}" ]; then
  exec curl -fsS --cacert "$CUMULUS_TLS_CA" "https://127.0.0.1:$port/health"
fi
exec curl -fsS "http://127.0.0.1:$port/health"
