#!/usr/bin/env bash
# The docker-compose test: real images, real containers, real kills and partitions.
#
#   1. build the images offline (local debootstrap base, host-built binaries), `up`, wait
#      for a leader; every connection is TLS (the coordinators' HTTP refuses plaintext,
#      `cluster status` says TLS, each worker enrolled for a certificate of its own);
#      submit the example trainer with world size 4, the job succeeds and every rank
#      consumed every record of its shards exactly once;
#   2. during a second run: `docker kill` the leader's container, `docker network
#      disconnect` a coordinator and reconnect it later, `docker kill` a worker; the job
#      still succeeds, resumed from committed steps, LATEST names a verified step;
#   3. `down` + `up` with the same volumes: jobs and checkpoints come back;
#   4. `down -v` leaves no container, network or volume of the project behind.
# Along test 1, Prometheus (the `prometheus` service) scrapes every coordinator and
# worker, and its query of the jobs by state sees the job that succeeded.
#
# Run by scripts/test.sh. With no reachable Docker engine it prints that it was SKIPPED
# and why, and exits 0; anything else missing (debootstrap, s3s-fs, binaries) fails it.
#
# Environment:
#   CUMULUS_BIN_DIR         host-built binaries (default: target/debug)
#   CUMULUS_S3S_FS          the s3s-fs binary (default: `command -v s3s-fs` or ~/.cargo/bin)
#   CUMULUS_COMPOSE_CACHE   debootstrap cache (default: compose/.cache)
#   CUMULUS_COMPOSE_KEEP=1  leave the cluster up on failure (for a look)
#   CUMULUS_COMPOSE_CKPT    s3 (default: checkpoints in the bucket) or local (/ckpt volume)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$here"

say() { echo "[compose-test $(date -u +%T)] $*"; }
fail() {
  echo "COMPOSE TEST FAILED: $*" >&2
  exit 1
}
skip() {
  echo "=============================================================="
  echo "COMPOSE TEST SKIPPED: $*"
  echo "=============================================================="
  exit 0
}

# ---- preconditions --------------------------------------------------------------------
command -v docker >/dev/null 2>&1 || skip "no docker client on PATH"
if ! docker_info="$(docker info --format '{{.ServerVersion}}' 2>&1)"; then
  skip "no Docker engine reachable: ${docker_info//$'\n'/ }"
fi
if command -v docker-compose >/dev/null 2>&1; then
  DC=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
  DC=(docker compose)
else
  fail "Docker engine $docker_info is reachable but neither docker-compose nor 'docker compose' is installed"
fi
command -v python3 >/dev/null 2>&1 || fail "python3 is needed to read JSON"

bin_dir="${CUMULUS_BIN_DIR:-$root/target/debug}"
for b in cumulus-coordinator cumulus-worker cumulus-trainer cumulusctl; do
  [ -x "$bin_dir/$b" ] || fail "$bin_dir/$b is missing: build first (cargo build --workspace --bins)"
done
s3s="${CUMULUS_S3S_FS:-$(command -v s3s-fs || echo "$HOME/.cargo/bin/s3s-fs")}"
[ -x "$s3s" ] || fail "s3s-fs not found ($s3s): cargo install s3s-fs@0.14.1 --locked --features binary"

t_start=$(date +%s)
project="cumulus-test-$$"
work="$(mktemp -d "${TMPDIR:-/tmp}/cumulus-compose.XXXXXX")"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export CUMULUS_TAG="test-$$" # own tags: other checkouts may run this test at the same time
export CUMULUS_GRPC_PORT="$(free_port)" CUMULUS_HTTP_PORT="$(free_port)" CUMULUS_S3_PORT="$(free_port)"
export CUMULUS_TOKEN_SECRET_FILE="$work/cluster-token"
export CUMULUS_BASE_IMAGE="cumulus-base:bookworm" CUMULUS_BUILDER_IMAGE="cumulus-base:bookworm"
export CUMULUS_PREBUILT_DIR="compose/.bin" CUMULUS_S3S_FS_BIN=".s3s/s3s-fs"
export CUMULUS_WORKER_SLOTS=4
export CUMULUS_PEER_TOKEN_SECRET_FILE="$work/peer-token"
export CUMULUS_METRICS_TOKEN_SECRET_FILE="$work/metrics-token"
export CUMULUS_PROMETHEUS_PORT="$(free_port)"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CUMULUS_TOKEN_SECRET_FILE"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CUMULUS_PEER_TOKEN_SECRET_FILE"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CUMULUS_METRICS_TOKEN_SECRET_FILE"
chmod 0644 "$CUMULUS_TOKEN_SECRET_FILE" "$CUMULUS_PEER_TOKEN_SECRET_FILE" "$CUMULUS_METRICS_TOKEN_SECRET_FILE"
dc() { "${DC[@]}" -p "$project" -f docker-compose.yml -f docker-compose.s3s.yml "$@"; }

ctlbox=""
# Every volume a container of this run mounted (named or anonymous), noted before each
# `down`: test 4 checks that none of them outlives `down -v` (an anonymous volume carries
# no project label, so the label filter alone cannot see one left behind).
note_volumes() {
  local ids
  ids="$(docker ps -aq --filter "label=com.docker.compose.project=$project")"
  [ -z "$ids" ] && return 0
  # shellcheck disable=SC2086 # one argument per container id
  docker inspect --format '{{range .Mounts}}{{if eq .Type "volume"}}{{.Name}}{{"\n"}}{{end}}{{end}}' \
    $ids >>"$work/volumes" 2>/dev/null || true
}
cleanup() {
  rc=$?
  if [ "$rc" -ne 0 ]; then
    say "failure: last log lines of every container"
    dc logs --no-color --tail 40 2>&1 | tail -n 400 || true
  fi
  if [ "$rc" -ne 0 ] && [ "${CUMULUS_COMPOSE_KEEP:-0}" = 1 ]; then
    say "kept project $project (CUMULUS_COMPOSE_KEEP=1); remove with: cd compose && ${DC[*]} -p $project -f docker-compose.yml -f docker-compose.s3s.yml down -v"
  else
    [ -n "$ctlbox" ] && docker rm -f -v "$ctlbox" >/dev/null 2>&1
    dc down -v --remove-orphans >/dev/null 2>&1 || true
    for i in cumulus-coordinator cumulus-worker cumulusctl cumulus-s3s-fs cumulus-prometheus; do
      docker rmi "$i:$CUMULUS_TAG" >/dev/null 2>&1 || true
    done
    docker image prune -f --filter label=cumulus.stage=build >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# JSON field from stdin: jget 'expr over d' (python expression).
jget() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# Waits (polling every 0.5 s) until "$@" succeeds, at most $deadline_s seconds.
wait_until() {
  local what="$1" deadline_s="$2"
  shift 2
  local end=$(($(date +%s) + deadline_s))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || fail "timed out after ${deadline_s}s waiting for: $what"
    sleep 0.5
  done
}

# ---- 1. images --------------------------------------------------------------------------
say "engine $docker_info, ${DC[*]}, project $project"
t0=$(date +%s)
"$here/base-image.sh" cumulus-base:bookworm
t_base=$(($(date +%s) - t0))

rm -rf "$here/.bin" "$here/.s3s" && mkdir -p "$here/.bin" "$here/.s3s"
for b in cumulus-coordinator cumulus-worker cumulus-trainer cumulusctl; do
  # Debug info is most of a debug binary; the images do not need it.
  objcopy --strip-debug "$bin_dir/$b" "$here/.bin/$b" 2>/dev/null || cp "$bin_dir/$b" "$here/.bin/$b"
done
cp "$s3s" "$here/.s3s/s3s-fs"
t0=$(date +%s)
dc --profile tools build >"$work/build.log" 2>&1 || {
  tail -n 40 "$work/build.log"
  fail "image build"
}
t_build=$(($(date +%s) - t0))
say "images built in ${t_build}s (base image: ${t_base}s)"
for i in cumulus-base:bookworm cumulus-{coordinator,worker,s3s-fs}:$CUMULUS_TAG cumulusctl:$CUMULUS_TAG; do
  printf '    %-28s %s MB\n' "$i" "$(($(docker image inspect -f '{{.Size}}' "$i") / 1000000))"
done

# ---- up, leader -------------------------------------------------------------------------
# The cluster CA (made by the `certs` service at the first `up`): the host's curl verifies
# the coordinators against it.
ca_file="$work/ca.pem"
fetch_ca() {
  dc --profile tools run --rm --no-deps -T --entrypoint cat cumulusctl /pki-public/ca.pem >"$ca_file.tmp" &&
    [ -s "$ca_file.tmp" ] && mv "$ca_file.tmp" "$ca_file"
}
leader_id() {
  curl -fsS --cacert "$ca_file" "https://127.0.0.1:$CUMULUS_HTTP_PORT/health" | jget 'd["leader_id"] or ""'
}
has_leader() { [ -n "$(leader_id)" ]; }

up_and_wait() {
  local t0 t1
  t0=$(date +%s.%N)
  dc up -d --no-build >"$work/up.log" 2>&1 || {
    cat "$work/up.log"
    fail "up"
  }
  fetch_ca || fail "no CA certificate in the pki-public volume (the certs service: $(dc logs --no-color certs | tail -n 5))"
  wait_until "a leader" 120 has_leader
  t1=$(date +%s.%N)
  up_to_leader=$(python3 -c "print(f'{$t1-$t0:.1f}')")
  say "$1: leader ${up_to_leader}s after 'up' (node $(leader_id))"
}
up_and_wait "first up"
bucket_made() { [ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(dc ps -q s3-init)")" = "exited 0" ]; }
wait_until "s3-init made the bucket" 60 bucket_made
say "S3 server up, bucket made: $(dc logs --no-color s3-init | tail -n1)"

# A long-lived cumulusctl container on the cluster network runs every command.
ctlbox="$(dc --profile tools run -d --no-deps --entrypoint sleep cumulusctl infinity)"
ctl() { docker exec "$ctlbox" cumulusctl "$@"; }
workers_alive() {
  [ "$(ctl cluster status -o json | jget 'sum(1 for w in d.get("workers",[]) if w["state"]=="alive")')" -ge "$1" ]
}
wait_until "2 workers alive" 120 workers_alive 2

# TLS inside the cluster network: no plaintext answer, no coordinator says insecure, and
# each worker registered with a certificate it enrolled for (mutual TLS binds the worker
# id to it: without one, the coordinators refuse its registration).
if curl -fsS -m 5 "http://127.0.0.1:$CUMULUS_HTTP_PORT/health" >/dev/null 2>&1; then
  fail "a coordinator answered plain HTTP"
fi
[ "$(ctl cluster status -o json | jget 'd.get("insecure", False)')" = False ] || fail "cluster status says insecure"
enrolled="$(dc logs --no-color worker | grep -c 'enrolled: certificate signed by the cluster CA' || true)"
[ "$enrolled" -ge 2 ] || fail "$enrolled workers enrolled, want 2: $(dc logs --no-color worker | grep -i enrol | tail -n 5)"
say "TLS on every connection: plain HTTP refused, $enrolled workers enrolled for certificates"

# The workers were installed by scripts/install-worker.sh: the image's entry point runs it
# without systemd, in the foreground. Run again beside the running agent with the same
# settings it changes nothing and says so; given another cluster's CA it refuses, and
# changes nothing either. (The agent runs with the Kubernetes DaemonSet's capabilities
# only: cap_drop/cap_add in docker-compose.yml.)
# sed, not head: head exits after one line and, under pipefail, the SIGPIPE it leaves
# docker-compose fails the script whenever the second id is written after it.
wcid="$(dc ps -q worker | sed -n 1p)"
installed() {
  docker exec "$wcid" sh -c 'cd / && cat etc/cumulus-worker/agent.pid &&
    ls -l --time-style=+%s.%N etc/cumulus-worker etc/systemd/system/cumulus-worker.service \
      usr/local/bin/cumulus-worker var/lib/cumulus-worker/agent.json &&
    sha256sum etc/cumulus-worker/* etc/systemd/system/cumulus-worker.service && id cumulus'
}
before="$(installed)" || fail "the worker container holds no install-worker.sh install: $before"
again="$(docker exec -e CUMULUS_INSTALL_FOREGROUND=0 "$wcid" cumulus-worker-entrypoint 2>&1)" ||
  fail "install-worker.sh run again failed: $again"
[[ "$again" == *"nothing changed"* ]] || fail "install-worker.sh run again did not say 'nothing changed': $again"
[ "$(installed)" = "$before" ] || fail "install-worker.sh run again changed files: $(diff <(echo "$before") <(installed))"
if other="$(docker exec -e CUMULUS_INSTALL_FOREGROUND=0 -e CUMULUS_TLS_CA=/etc/ssl/certs/ca-certificates.crt \
  "$wcid" cumulus-worker-entrypoint 2>&1)"; then
  fail "install-worker.sh accepted another cluster's CA: $other"
fi
[[ "$other" == *"worker of another cluster"* ]] || fail "install-worker.sh with another CA: $other"
[ "$(installed)" = "$before" ] || fail "install-worker.sh with another CA changed files"
say "install-worker.sh: a second run changed nothing, another cluster's CA was refused"

ctl dataset split /usr/share/cumulus/digits/digits.csv.gz --shards 8 \
  --out /shared/data/shards --holdout-out /shared/data/holdout.csv >/dev/null
# The ranks run as their jobs' own users (CUMULUS_RUN_AS): they write results here.
docker exec "$ctlbox" sh -c 'mkdir -p /shared/out && chmod 1777 /shared/out'

# Checkpoints go to the S3 server (bucket `cumulus`, prefix `runs`; LATEST is read back
# from the bucket) by default, or to the shared /ckpt volume (local backend) with
# CUMULUS_COMPOSE_CKPT=local.
submit_help="$(ctl submit --help)"
if [ "${CUMULUS_COMPOSE_CKPT:-s3}" = s3 ]; then
  [[ "$submit_help" == *--ckpt-url* ]] || fail "CUMULUS_COMPOSE_CKPT=s3 but cumulusctl has no --ckpt-url"
  CKPT_MODE=s3
  ckpt_args=(--ckpt-url s3://cumulus/runs)
else
  CKPT_MODE=local
  ckpt_args=(--ckpt-dir /ckpt)
fi
say "checkpoint target: $CKPT_MODE (${ckpt_args[*]})"

EPOCHS=8
submit() { # name epochs step_sleep_ms
  ctl submit -o json --name "$1" --world-size 4 --dataset /shared/data/shards \
    "${ckpt_args[@]}" --max-restarts 10 --backoff-initial-ms 500 --backoff-max-ms 2000 \
    -- /usr/local/bin/cumulus-trainer train --test-file /shared/data/holdout.csv \
    --out "/shared/out/$1" --epochs "$2" --ckpt-every 20 --step-sleep-ms "$3" |
    jget 'd["job_id"]'
}
job_json() { ctl status -o json "$1"; }
job_state() { job_json "$1" | jget 'd.get("job",d)["state"]'; }
job_is() { [ "$(job_state "$1")" = "$2" ]; }
wait_job_done() {
  local end=$(($(date +%s) + $2)) s
  while :; do
    s="$(job_state "$1" 2>/dev/null || true)"
    case "$s" in
      succeeded) return 0 ;;
      failed | cancelled)
        job_json "$1" || true
        fail "job $1 ended $s"
        ;;
    esac
    [ "$(date +%s)" -lt "$end" ] || fail "job $1 not done after $2 s (state $s)"
    sleep 1
  done
}

# Every rank's result: the record digest of exactly-once consumption and the accuracy.
check_results() { # job name
  local name="$1" rank
  for rank in 0 1 2 3; do
    docker exec "$ctlbox" sh -c "ls /shared/data/shards | LC_ALL=C sort | awk -v r=$rank '(NR-1)%4==r {print \"/shared/data/shards/\" \$0}' > /tmp/rank-$rank.shards"
    want="$(docker exec "$ctlbox" cumulus-trainer digest --shards-file "/tmp/rank-$rank.shards" --epochs "$EPOCHS" | awk '{print $NF}' | tail -n1)"
    got="$(docker exec "$ctlbox" cat "/shared/out/$name/rank-$rank/result.json" | jget 'd["digest"]')"
    acc="$(docker exec "$ctlbox" cat "/shared/out/$name/rank-$rank/result.json" | jget 'd["accuracy"]')"
    [ "$got" = "$want" ] || fail "$name rank $rank: digest $got, want $want (a record lost or consumed twice)"
    python3 -c "import sys; sys.exit(0 if $acc >= 0.9 else 1)" || fail "$name rank $rank accuracy $acc < 0.9"
  done
  say "$name: 4 ranks, every record exactly once, accuracy >= 0.9"
}

# LATEST (on /ckpt, or in the bucket: a signed S3 GET) names a step that `ckpt ls`
# verified against its manifest (in S3 mode: with a verified copy in the bucket, L2).
check_latest() { # job
  local latest
  if [ "$CKPT_MODE" = s3 ]; then
    latest="$(docker exec "$(dc ps -q s3)" curl -fsS --aws-sigv4 aws:amz:us-east-1:s3 \
      -H 'x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855' \
      --user "${CUMULUS_S3_ACCESS_KEY:-cumulus}:${CUMULUS_S3_SECRET_KEY:-cumulus-secret}" \
      "http://127.0.0.1:9000/cumulus/runs/$1/LATEST" | tr -d '\n')"
  else
    latest="$(docker exec "$ctlbox" cat "/ckpt/$1/LATEST" | tr -d '\n')"
  fi
  [[ "$latest" =~ ^step-0*([0-9]+)$ ]] || fail "LATEST of $1 is '$latest'"
  ctl ckpt ls -o json "$1" >"$work/ckpt.json"
  python3 - "$work/ckpt.json" "${BASH_REMATCH[1]}" "$CKPT_MODE" <<'EOF' || fail "LATEST of $1 is not a verified step ($(cat "$work/ckpt.json"))"
import json, sys
d = json.load(open(sys.argv[1]))
steps = d.get("checkpoints", d if isinstance(d, list) else [])
need_l2 = sys.argv[3] == "s3"
ok = any(c["step"] == int(sys.argv[2]) and c.get("verified")
         and (not need_l2 or "L2" in c.get("tiers", [])) for c in steps)
sys.exit(0 if ok else 1)
EOF
  say "$1: LATEST = $latest ($CKPT_MODE), verified against its manifest"
}

# ---- 1. a job --------------------------------------------------------------------------
t0=$(date +%s)
job1="$(submit plain "$EPOCHS" 0)"
wait_job_done "$job1" 300
say "test 1: $job1 succeeded in $(($(date +%s) - t0))s"
check_results plain
check_latest "$job1"

# Prometheus (asked from inside its container) scrapes the 3 coordinators and 2 workers
# it discovered through /metrics/targets, with the scrape token, and sees the job.
prom() { docker exec "$(dc ps -q prometheus)" curl -fsS "http://127.0.0.1:9090/api/v1/$1"; }
prom_targets_up() {
  prom targets | python3 -c '
import json, sys
t = json.load(sys.stdin)["data"]["activeTargets"]
up = lambda role: sum(1 for x in t if x["labels"].get("cumulus_role") == role and x["health"] == "up")
sys.exit(0 if up("coordinator") >= 3 and up("worker") >= 2 else 1)'
}
wait_until "Prometheus scraping 3 coordinators and 2 workers" 120 prom_targets_up
prom_sees_job() {
  prom 'query?query=max(cumulus_jobs%7Bstate%3D%22succeeded%22%7D)' |
    python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; sys.exit(0 if r and float(r[0]["value"][1]) >= 1 else 1)'
}
wait_until "Prometheus to see the succeeded job" 60 prom_sees_job
say "test 1: Prometheus scrapes 3 coordinators and 2 workers; cumulus_jobs{state=\"succeeded\"} >= 1"

# ---- 2. faults during a run -------------------------------------------------------------
container_of() { dc ps -q "$1"; }
committed_step() { job_json "$1" | jget 'd.get("job",d).get("committed_step") or 0'; }
# Waits until the job commits a step past $2 while it still runs (a fault injected after
# the job finished would test nothing: that fails the test).
wait_step_past() { # job step what
  local end=$(($(date +%s) + 180)) j st c
  while :; do
    j="$(job_json "$1" 2>/dev/null || true)"
    st="$(echo "$j" | jget 'd.get("job",d)["state"]' 2>/dev/null || true)"
    c="$(echo "$j" | jget 'd.get("job",d).get("committed_step") or 0' 2>/dev/null || echo 0)"
    [ "$c" -gt "$2" ] && [ "$st" = running ] && return 0
    case "$st" in succeeded | failed | cancelled) fail "$1 ended ($st) before: $3 (make the job longer)" ;; esac
    [ "$(date +%s)" -lt "$end" ] || { echo "$j" >&2; fail "timed out waiting for: $3 (job state above)"; }
    sleep 0.5
  done
}

t0=$(date +%s)
job2="$(submit faults "$EPOCHS" 250)"
wait_step_past "$job2" 0 "a first committed checkpoint"
old="$(leader_id)"
say "test 2: killing the leader coord-$old (committed step $(committed_step "$job2"))"
docker kill "$(container_of "coord-$old")" >/dev/null
new_leader() {
  local l
  l="$(ctl cluster status -o json | jget 'd.get("leader_id") or ""')"
  [ -n "$l" ] && [ "$l" != "$old" ]
}
wait_until "a new leader after killing coord-$old" 60 new_leader
s="$(committed_step "$job2")"
wait_step_past "$job2" "$s" "a checkpoint after the leader kill"
docker start "$(container_of "coord-$old")" >/dev/null

lead="$(ctl cluster status -o json | jget 'd["leader_id"]')"
net="${project}_cluster"
cut="$(container_of "coord-$lead")"
say "test 2: disconnecting the leader coord-$lead from $net"
docker network disconnect "$net" "$cut"
other_leader() {
  local l
  l="$(ctl cluster status -o json | jget 'd.get("leader_id") or ""')"
  [ -n "$l" ] && [ "$l" != "$lead" ]
}
wait_until "a leader other than the cut-off coord-$lead" 60 other_leader
s="$(committed_step "$job2")"
wait_step_past "$job2" "$s" "a checkpoint while coord-$lead is cut off"
docker network connect --alias "coord-$lead" "$net" "$cut"
say "test 2: reconnected coord-$lead"

victim="$(job_json "$job2" | jget 'd.get("job",d)["ranks"][0]["worker_id"]')"
wcid="$(docker ps -q --filter "label=com.docker.compose.project=$project" --filter "label=com.docker.compose.service=worker" |
  while read -r c; do if [ "$(docker inspect -f '{{.Config.Hostname}}' "$c")" = "$victim" ]; then echo "$c"; fi; done)"
[ -n "$wcid" ] || fail "no worker container with host name $victim"
say "test 2: killing worker $victim (runs rank 0)"
docker kill "$wcid" >/dev/null
wait_job_done "$job2" 600
docker start "$wcid" >/dev/null 2>&1 || true
restarts="$(job_json "$job2" | jget 'd.get("job",d).get("restarts_used",0)')"
[ "$restarts" -ge 1 ] || fail "$job2: no restart recorded after the worker kill"
job_json "$job2" | python3 -c '
import json, sys
for r in json.load(sys.stdin)["job"].get("restarts", []):
    print("    restart %s: ranks %s, resume step %s: %s"
          % (r["number"], r.get("ranks"), r.get("resume_step"), r["cause"]))'
resumed="$(job_json "$job2" | jget 'sum(1 for r in d.get("job",d).get("restarts",[]) if (r.get("resume_step") or 0) > 0)')"
[ "$resumed" -ge 1 ] || fail "$job2: no restart resumed from a committed step"
ctl logs "$job2" >"$work/job2.log" 2>&1 || true
grep -q "resumed from step" "$work/job2.log" || fail "$job2: no rank says it resumed from a checkpoint (logs)"
say "test 2: $job2 succeeded in $(($(date +%s) - t0))s with $restarts restart(s), resumed from committed steps"
check_results faults
check_latest "$job2"

# ---- 3. down + up, same volumes ---------------------------------------------------------
note_volumes
docker rm -f -v "$ctlbox" >/dev/null
ctlbox=""
dc down >/dev/null 2>&1
up_and_wait "up again after down"
ctlbox="$(dc --profile tools run -d --no-deps --entrypoint sleep cumulusctl infinity)"
wait_until "$job1 back" 60 job_is "$job1" succeeded
wait_until "$job2 back" 60 job_is "$job2" succeeded
check_latest "$job1"
check_latest "$job2"
say "test 3: both jobs and their checkpoints came back"

# ---- 4. down -v ---------------------------------------------------------------------------
note_volumes
docker rm -f -v "$ctlbox" >/dev/null
ctlbox=""
dc down -v --remove-orphans >/dev/null 2>&1
left="$(docker ps -aq --filter "label=com.docker.compose.project=$project")
$(docker volume ls -q --filter "label=com.docker.compose.project=$project")
$(docker network ls -q --filter "label=com.docker.compose.project=$project")"
[ -z "${left//$'\n'/}" ] || fail "down -v left: $left"
mounted=0
leaked=""
while read -r volume; do
  [ -n "$volume" ] || continue
  mounted=$((mounted + 1))
  docker volume inspect "$volume" >/dev/null 2>&1 && leaked="$leaked $volume"
done < <(sort -u "$work/volumes")
[ "$mounted" -gt 0 ] || fail "no volume of this run was noted (the check would prove nothing)"
[ -z "$leaked" ] || fail "volumes mounted by this run's containers outlived down -v:$leaked"
say "test 4: down -v left no container, volume or network of $project ($mounted volumes mounted during the run, none left)"
say "compose test passed in $(($(date +%s) - t_start))s (first up to leader: see above)"
