#!/bin/sh
# Adds this machine to a Cumulus cluster as a worker, in one command (docs/deploy.md,
# "Bare machines"):
#
#   sudo ./install-worker.sh --coordinators c1:7000,c2:7000,c3:7000 \
#       --ca ca.pem --token-file cluster-token [--binary ./cumulus-worker]
#
# It creates the service user and the data dir, installs the binary, the CA certificate,
# the token and the settings (/etc/cumulus-worker/worker.env), writes the systemd unit,
# starts the agent (which enrols: a key of its own, signed by a coordinator for this
# worker id with the cluster token) and waits until the agent answers with its enrolled
# certificate. Run again with the same arguments it changes nothing and says so; with
# changed settings it rewrites what changed and restarts the agent. It refuses to run
# over a worker of another cluster (another CA).
#
# Options:
#   --coordinators LIST   coordinators' gRPC addresses, host:port, comma-separated
#   --ca FILE             the cluster CA certificate (PEM)
#   --token-file FILE     the cluster token
#   --metrics-token-file FILE  the scrape token of /metrics (optional)
#   --binary FILE         the cumulus-worker to install (default: beside this script,
#                         else on PATH)
#   --worker-id ID        (default: the short host name)
#   --advertise-host H    how other machines reach this one (default: the first address
#                         of `hostname -I`, else the host name)
#   --listen ADDR         the agent API for coordinators (default 0.0.0.0:9000)
#   --slots N             rank slots (default: the number of CPUs)
#   --gpus SPEC           auto (NVML), none, indices (default auto)
#   --run-as RANGE|none   ranks run as a uid of this range, one per job, and the agent as
#                         root (default 60000-60999: rank isolation, SECURITY.md); `none`:
#                         the agent and its ranks run as the service user
#   --user NAME           the service user (default cumulus)
#   --env KEY=VALUE       one more agent setting (repeat), e.g. CUMULUS_S3_ENDPOINT=...
#   --data-dir DIR        (default /var/lib/cumulus-worker)
#   --config-dir DIR      (default /etc/cumulus-worker)
#   --prefix DIR          where the binary goes (default /usr/local/bin)
#   --unit-dir DIR        (default /etc/systemd/system)
#   --no-systemd          write the unit, but start the agent directly (in the background,
#                         pid in <config-dir>/agent.pid, log in <data-dir>/agent.log)
#                         instead of through systemctl: for machines and containers
#                         without systemd
#   --foreground          with --no-systemd: run the agent in the foreground (exec), with
#                         this process's environment plus worker.env (container entry
#                         points)
#   --wait-s N            how long to wait for the agent to answer (default 120)
#
# Needs root, a POSIX shell, and curl to check the agent (skipped without it).
set -eu

say() { echo "[install-worker] $*"; }
die() { echo "[install-worker] error: $*" >&2; exit 1; }

coordinators="" ca="" token_file="" metrics_token_file="" binary="" worker_id="" advertise="" listen="0.0.0.0:9000"
slots="" gpus="auto" run_as="60000-60999" user="cumulus" data_dir="/var/lib/cumulus-worker"
config_dir="/etc/cumulus-worker" prefix="/usr/local/bin" unit_dir="/etc/systemd/system"
systemd=1 foreground=0 wait_s=120 extra_env=""
need() { [ $# -ge 2 ] || die "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --coordinators) need "$@"; coordinators="$2"; shift 2 ;;
    --ca) need "$@"; ca="$2"; shift 2 ;;
    --token-file) need "$@"; token_file="$2"; shift 2 ;;
    --metrics-token-file) need "$@"; metrics_token_file="$2"; shift 2 ;;
    --binary) need "$@"; binary="$2"; shift 2 ;;
    --worker-id) need "$@"; worker_id="$2"; shift 2 ;;
    --advertise-host) need "$@"; advertise="$2"; shift 2 ;;
    --listen) need "$@"; listen="$2"; shift 2 ;;
    --slots) need "$@"; slots="$2"; shift 2 ;;
    --gpus) need "$@"; gpus="$2"; shift 2 ;;
    --run-as) need "$@"; run_as="$2"; shift 2 ;;
    --user) need "$@"; user="$2"; shift 2 ;;
    --env) need "$@"; extra_env="$extra_env$2
"; shift 2 ;;
    --data-dir) need "$@"; data_dir="$2"; shift 2 ;;
    --config-dir) need "$@"; config_dir="$2"; shift 2 ;;
    --prefix) need "$@"; prefix="$2"; shift 2 ;;
    --unit-dir) need "$@"; unit_dir="$2"; shift 2 ;;
    --no-systemd) systemd=0; shift ;;
    --foreground) foreground=1; shift ;;
    --wait-s) need "$@"; wait_s="$2"; shift 2 ;;
    -h | --help) sed -n '2,50p' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

# ---- checks, before anything is written ---------------------------------------------
[ "$(id -u)" = 0 ] || die "run as root (it creates a user, writes /etc and starts a service)"
[ -n "$coordinators" ] || die "--coordinators is required (host:port of each coordinator's gRPC, comma-separated)"
[ -n "$ca" ] && [ -s "$ca" ] || die "--ca must name the cluster CA certificate (PEM): '$ca'"
grep -q 'BEGIN CERTIFICATE' "$ca" || die "--ca $ca holds no PEM certificate"
[ -n "$token_file" ] && [ -s "$token_file" ] || die "--token-file must name the cluster token file: '$token_file'"
[ -z "$metrics_token_file" ] || [ -s "$metrics_token_file" ] || die "--metrics-token-file $metrics_token_file is empty or missing"
[ "$foreground" = 0 ] || [ "$systemd" = 0 ] || die "--foreground needs --no-systemd"
if [ -z "$binary" ]; then
  here="$(cd "$(dirname "$0")" && pwd)"
  if [ -x "$here/cumulus-worker" ]; then binary="$here/cumulus-worker"; else binary="$(command -v cumulus-worker || true)"; fi
fi
[ -n "$binary" ] && [ -x "$binary" ] || die "no cumulus-worker binary: give --binary"
[ -n "$slots" ] || slots="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 4)"
host_name="$(cat /proc/sys/kernel/hostname)"
[ -n "$worker_id" ] || worker_id="${host_name%%.*}"
if [ -z "$advertise" ]; then
  advertise="$(hostname -I 2>/dev/null | awk '{print $1}' || true)"
  [ -n "$advertise" ] || advertise="$host_name"
fi
case "$wait_s" in '' | *[!0-9]*) die "--wait-s must be a number of seconds" ;; esac
for v in "$coordinators" "$worker_id" "$advertise" "$listen" "$slots" "$gpus" "$run_as" "$user" "$data_dir" "$config_dir" "$prefix" "$unit_dir"; do
  case "$v" in *[\ \"\'\$\`\\]* | '') die "values may not be empty or hold spaces, quotes, \$, \` or \\: '$v'" ;; esac
done
while IFS= read -r kv; do
  [ -n "$kv" ] || continue
  case "$kv" in
    CUMULUS_*=* | AWS_*=* | RUST_LOG=* | NCCL_*=* | NO_COLOR=*) ;;
    *) die "--env takes KEY=VALUE with KEY CUMULUS_*, AWS_*, NCCL_*, RUST_LOG or NO_COLOR: '$kv'" ;;
  esac
  case "$kv" in *[\ \"\'\$\`\\]*) die "--env values may not hold spaces, quotes, \$, \` or \\: '$kv'" ;; esac
done <<EOF
$extra_env
EOF

# The cluster this machine belongs to is its CA: a different one means another cluster.
fingerprint() { sha256sum "$1" | cut -d' ' -f1; }
if [ -s "$config_dir/ca.pem" ] && [ "$(fingerprint "$config_dir/ca.pem")" != "$(fingerprint "$ca")" ]; then
  die "this machine is already a worker of another cluster (its CA $config_dir/ca.pem differs from $ca).
  To move it: stop the agent (systemctl disable --now cumulus-worker, or kill the pid in
  $config_dir/agent.pid), then remove $config_dir and $data_dir/tls, and run this again."
fi

if [ "$run_as" = none ]; then agent_user="$user"; else agent_user=root; fi

# ---- files (each written only when it differs) -----------------------------------------
changed=0
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# put SRC DEST MODE OWNER: installs SRC at DEST unless DEST already has its bytes, mode
# and owner.
put() {
  if [ -f "$2" ] && cmp -s "$1" "$2" && [ "$(stat -c '%a %U' "$2")" = "$3 $4" ]; then
    say "unchanged $2"
    return 0
  fi
  mkdir -p "$(dirname "$2")"
  cp "$1" "$2.install-tmp"
  chmod "$3" "$2.install-tmp"
  chown "$4" "$2.install-tmp"
  mv -f "$2.install-tmp" "$2"
  say "wrote $2"
  changed=1
}

if ! id -u "$user" >/dev/null 2>&1; then
  useradd --system --user-group --no-create-home --home-dir "$data_dir" --shell /usr/sbin/nologin "$user" 2>/dev/null ||
    useradd -r -U -M -d "$data_dir" -s /sbin/nologin "$user"
  say "created the service user $user"
  changed=1
else
  say "unchanged user $user"
fi

# The data dir: others may search it (ranks reach the rank API's socket in it), the agent
# sets its final modes at start.
if [ ! -d "$data_dir" ]; then
  mkdir -p "$data_dir"
  say "created $data_dir"
  changed=1
fi
if [ "$(stat -c '%U' "$data_dir")" != "$agent_user" ]; then
  chown "$agent_user:" "$data_dir"
  say "chown $agent_user $data_dir"
  changed=1
fi
[ "$run_as" = none ] || chmod o+x "$data_dir"

cp "$binary" "$tmp/cumulus-worker"
put "$tmp/cumulus-worker" "$prefix/cumulus-worker" 755 root
mkdir -p "$config_dir"
chmod 755 "$config_dir"
cp "$ca" "$tmp/ca.pem"
put "$tmp/ca.pem" "$config_dir/ca.pem" 644 root
# The token: the agent's alone (never the ranks', which run as other users).
tr -d ' \t\r\n' <"$token_file" >"$tmp/cluster-token"
put "$tmp/cluster-token" "$config_dir/cluster-token" 600 "$agent_user"
if [ -n "$metrics_token_file" ]; then
  tr -d ' \t\r\n' <"$metrics_token_file" >"$tmp/metrics-token"
  put "$tmp/metrics-token" "$config_dir/metrics-token" 600 "$agent_user"
fi

# The agent's settings: every line is one of cumulus-worker's variables (its --help).
setting() { echo "$1=$2" >>"$tmp/worker.env"; }
: >"$tmp/worker.env"
echo "# Written by install-worker.sh; run it again to change these." >>"$tmp/worker.env"
setting CUMULUS_COORDINATORS "$coordinators"
setting CUMULUS_TOKEN_FILE "$config_dir/cluster-token"
[ -z "$metrics_token_file" ] || setting CUMULUS_METRICS_TOKEN_FILE "$config_dir/metrics-token"
setting CUMULUS_TLS_CA "$config_dir/ca.pem"
setting CUMULUS_TLS_ENROL true
setting CUMULUS_WORKER_ID "$worker_id"
setting CUMULUS_ADVERTISE_HOST "$advertise"
setting CUMULUS_LISTEN "$listen"
setting CUMULUS_DATA_DIR "$data_dir"
setting CUMULUS_SLOTS "$slots"
setting CUMULUS_GPUS "$gpus"
[ "$run_as" = none ] || setting CUMULUS_RUN_AS "$run_as"
printf '%s' "$extra_env" >>"$tmp/worker.env"
put "$tmp/worker.env" "$config_dir/worker.env" 600 root

# The unit (deploy/systemd/cumulus-worker.service, with this machine's paths and user).
if [ "$run_as" = none ]; then
  caps=""
else
  caps="CAP_CHOWN CAP_DAC_OVERRIDE CAP_FOWNER CAP_KILL CAP_SETGID CAP_SETUID"
fi
cat >"$tmp/unit" <<EOF
# Written by install-worker.sh (template: deploy/systemd/cumulus-worker.service).
[Unit]
Description=Cumulus worker agent
Documentation=https://github.com/cumulus/cumulus/blob/main/docs/deploy.md
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User=$agent_user
EnvironmentFile=$config_dir/worker.env
ExecStart=$prefix/cumulus-worker
Restart=always
RestartSec=2
# SIGTERM to the agent alone: it stops its ranks (SIGTERM, SIGKILL after the stop
# grace) and reports their exits; whatever is left gets SIGKILL after the timeout.
KillMode=mixed
TimeoutStopSec=60
LimitNOFILE=1048576
# Hardening. Ranks inherit all of it: they run training code, which needs the GPUs
# (/dev/nvidia*), writable home-less temp dirs and W+X memory (JITs), so no
# PrivateDevices, ProtectHome or MemoryDenyWriteExecute here.
NoNewPrivileges=yes
CapabilityBoundingSet=$caps
ProtectSystem=full
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
LockPersonality=yes
SystemCallArchitectures=native

[Install]
WantedBy=multi-user.target
EOF
put "$tmp/unit" "$unit_dir/cumulus-worker.service" 644 root

# ---- start ----------------------------------------------------------------------------
pidfile="$config_dir/agent.pid"
agent_pid() {
  [ -s "$pidfile" ] || return 1
  p="$(cat "$pidfile")"
  [ -r "/proc/$p/cmdline" ] && tr '\0' ' ' <"/proc/$p/cmdline" | grep -q "cumulus-worker" && echo "$p"
}

# Waits until the agent answers on its API with the certificate it enrolled for.
wait_enrolled() {
  end=$(($(date +%s) + wait_s))
  while :; do
    if [ -s "$data_dir/agent.json" ]; then
      port="$(sed -n 's/.*"listen_addr": *"[^"]*:\([0-9]*\)".*/\1/p' "$data_dir/agent.json")"
      if [ -n "$port" ] && ! command -v curl >/dev/null 2>&1; then
        say "the agent started (curl missing: its API is not checked)"
        return 0
      fi
      if [ -n "$port" ] && curl -fsS -m 5 --cacert "$config_dir/ca.pem" \
        "https://127.0.0.1:$port/health" >/dev/null 2>&1; then
        say "the agent answers on :$port with its enrolled certificate (worker $worker_id)"
        return 0
      fi
    fi
    [ "$(date +%s)" -lt "$end" ] || die "the agent did not answer within ${wait_s}s: see $1"
    sleep 1
  done
}

if [ "$foreground" = 1 ]; then
  say "starting the agent in the foreground (worker $worker_id)"
  echo "$$" >"$pidfile"
  set -a
  # shellcheck disable=SC1090 # written above
  . "$config_dir/worker.env"
  set +a
  rm -rf "$tmp"
  if [ "$agent_user" = root ]; then exec "$prefix/cumulus-worker"; fi
  exec setpriv --reuid="$agent_user" --regid="$agent_user" --init-groups "$prefix/cumulus-worker"
fi

if [ "$systemd" = 1 ]; then
  command -v systemctl >/dev/null 2>&1 || die "no systemctl: use --no-systemd"
  [ "$changed" = 0 ] || systemctl daemon-reload
  systemctl enable cumulus-worker.service >/dev/null 2>&1
  if [ "$changed" = 1 ]; then
    systemctl restart cumulus-worker.service
    say "(re)started cumulus-worker.service"
  elif ! systemctl is-active --quiet cumulus-worker.service; then
    systemctl start cumulus-worker.service
    changed=1
    say "started cumulus-worker.service"
  fi
  wait_enrolled "journalctl -u cumulus-worker"
else
  running="$(agent_pid || true)"
  if [ -n "$running" ] && [ "$changed" = 1 ]; then
    say "stopping the agent (pid $running) to apply the changes"
    kill -TERM "$running"
    end=$(($(date +%s) + 90))
    while [ -d "/proc/$running" ]; do
      [ "$(date +%s)" -lt "$end" ] || die "the agent (pid $running) did not stop within 90 s"
      sleep 1
    done
    running=""
  fi
  if [ -z "$running" ]; then
    # As systemd would: a clean environment with worker.env, in a session of its own.
    (
      cd /
      # shellcheck disable=SC2046 # one KEY=VALUE word per line of worker.env
      if [ "$agent_user" = root ]; then runner=""; else runner="setpriv --reuid=$agent_user --regid=$agent_user --init-groups"; fi
      exec setsid env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
        $(grep -v '^#' "$config_dir/worker.env") $runner "$prefix/cumulus-worker" \
        </dev/null >>"$data_dir/agent.log" 2>&1
    ) &
    echo "$!" >"$pidfile"
    changed=1
    say "started the agent (pid $!, log $data_dir/agent.log)"
  else
    say "the agent runs (pid $running)"
  fi
  wait_enrolled "$data_dir/agent.log"
fi

if [ "$changed" = 0 ]; then
  say "nothing changed: this machine is worker $worker_id of the cluster at $coordinators"
else
  say "done: this machine is worker $worker_id of the cluster at $coordinators"
fi
