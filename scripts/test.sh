#!/usr/bin/env bash
# The project's test command. Installs what the tests need (scripts/setup.sh,
# idempotent), builds every binary (the end-to-end tests start the real coordinator,
# worker, trainer and cumulusctl processes), then runs every test, then the checkpoint
# failpoint tests, then the Python package's checks and tests, then the docker-compose test (compose/test.sh: real images and
# containers; it prints "COMPOSE TEST SKIPPED" and why when no Docker engine is
# reachable). Arguments go to `cargo test` (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo build --workspace --bins
cargo test --workspace "$@"
# Crash and disk-full tests of the checkpoint commit protocol: they need the ckpt crate's
# failpoints, compiled only here (the default build has none).
cargo test -p cumulus-ckpt --features failpoints --test failpoints
# The Python package: lints, types, unit tests and tests against real local clusters
# (they start target/debug's binaries).
python/.venv/bin/ruff check python
python/.venv/bin/ruff format --check python
python/.venv/bin/ruff check --config python/pyproject.toml --ignore TID251 examples/python
python/.venv/bin/ruff format --check examples/python
(cd python && .venv/bin/mypy src tests)
python/.venv/bin/pytest python/tests -q
if [ "${CUMULUS_COMPOSE_TEST:-1}" = 0 ]; then
  echo "COMPOSE TEST SKIPPED: CUMULUS_COMPOSE_TEST=0"
else
  ./compose/test.sh
fi
