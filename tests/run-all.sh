#!/usr/bin/env bash
# The whole test suite: host set-up (idempotent), unit and integration tests, then the
# real-kernel tests in a QEMU guest (ublk_drv + an emulated FDP NVMe). This is the README's
# test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "host set-up (packages, guest kernels; cached after the first run)"
tests/vm/setup.sh

step "cargo test"
cargo test --release --locked

step "VM tests (QEMU guest)"
cargo build --release --locked --bins
tests/vm/suite.sh
