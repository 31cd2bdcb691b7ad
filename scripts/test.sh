#!/usr/bin/env bash
# The project's test command: builds every binary (the end-to-end tests start the real
# coordinator, worker, trainer and cumulusctl processes), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
cargo test --workspace "$@"
