#!/usr/bin/env bash
# Installs what the tests need beyond the Rust toolchain, idempotently (a second run
# checks in about a second and installs nothing):
#   - Debian packages: a C compiler, protoc and the protobuf includes (the benchmark's etcd
#     client; our own crates use a vendored protoc), etcd (the benchmark's write-path
#     comparison), debootstrap and binutils (the docker-compose test's offline base image),
#     chromium and chromium-driver (the dashboard's browser tests, over WebDriver);
#   - s3s-fs, a real S3-compatible server (the S3 checkpoint tests start it on loopback),
#     with `cargo install` (~3 min on 2 cores, once);
#   - cargo-deny, the dependency policy check of deny.toml (`cargo install`, ~3.5 min once);
#   - python/.venv: the Python package `cumulus` (python/) with its test tools and PyTorch.
# The README's first command (`cargo build --release`) needs none of this.
#
# As root it installs; otherwise it prints the exact commands to run and fails.
set -euo pipefail
cd "$(dirname "$0")/.."

S3S_FS_VERSION=0.14.1
CARGO_DENY_VERSION=0.20.2

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
command -v objcopy >/dev/null 2>&1 || need+=(binutils)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)

have_s3s=1
command -v s3s-fs >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/s3s-fs" ] || have_s3s=0

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing Debian packages: ${need[*]}" >&2
    echo "setup: run: sudo apt-get update && sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
    exit 1
  fi
  echo "== setup: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

if [ "$have_s3s" = 0 ]; then
  echo "== setup: installing s3s-fs $S3S_FS_VERSION (cargo install, ~3 min once)"
  cargo install "s3s-fs@$S3S_FS_VERSION" --locked --features binary
fi
if ! cargo deny --version 2>/dev/null | grep -qx "cargo-deny $CARGO_DENY_VERSION"; then
  echo "== setup: installing cargo-deny $CARGO_DENY_VERSION (cargo install, ~3.5 min once)"
  cargo install "cargo-deny@$CARGO_DENY_VERSION" --locked
fi
# The Python package's virtualenv (python/.venv): the package in editable mode with its
# test tools (pytest, ruff, mypy, httpx; scikit-learn, skops, XGBoost, LightGBM for the
# framework adapters; uv, with which the tests' worker agents build jobs' Python
# environments: their --uv) and PyTorch (the DDP exact-resume test; ~5 GB,
# ~2.5 min the first time). Reinstalled only when pyproject.toml changed.
venv=python/.venv
stamp="$venv/.cumulus-pyproject.sha256"
want="$(sha256sum python/pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "== setup: Python virtualenv $venv (pip install -e './python[test,torch]')"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -e './python[test,torch]'
  echo "$want" >"$stamp"
fi
echo "== setup: everything the tests need is installed"
