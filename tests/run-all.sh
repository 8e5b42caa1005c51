#!/usr/bin/env bash
# The whole test suite: host set-up (idempotent), unit and integration tests, then the
# real-kernel tests in a QEMU guest (ublk_drv + an emulated FDP NVMe). This is the README's
# test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says how long the run has taken so far (CI has a budget).
step() { printf '\n== %s (at %d min %02d s)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }

command -v cargo >/dev/null || { echo "tests/run-all.sh: needs a Rust toolchain >= 1.88 (cargo; e.g. from rustup)" >&2; exit 1; }
[[ -d ../shared/fixtures/lmcache-0.5.6 ]] ||
    { echo "tests/run-all.sh: the LMCache fixtures are expected at ../shared/fixtures/lmcache-0.5.6 beside the repository" >&2; exit 1; }

step "host set-up (packages, guest kernels; cached after the first run)"
tests/vm/setup.sh

step "cargo test"
cargo test --release --locked
# The binaries the demo and the VM tests run: `cargo test` built them already (Cargo.toml
# names the features its dev-dependencies turn on), unless a dependency's update changed those.
cargo build --release --locked --bins 2>&1 | tee target/bins.log
! grep -q '^ *Compiling' target/bins.log ||
    echo "note: cargo build --release rebuilt what cargo test --release had built (a minute more): the dev-dependencies turn on features of shared dependencies that Cargo.toml's [dependencies] do not name; compare cargo tree -e features with and without dev edges"
# The benchmarks are not tests, but they must keep compiling with the code they measure; so
# must the fuzz targets (their own workspace, which `cargo test` does not build). Checked in
# the release build's target directory and profile, which have its build scripts and macros
# (bindgen's run among them), without libFuzzer's C++ (only a fuzzing run links it).
cargo build --release --locked --benches
cargo check --locked --release --manifest-path fuzz/Cargo.toml --target-dir target --no-default-features

step "the demo (the README's main command)"
# demo_fail WHY: the end of the demo's output, then WHY, and the run fails.
demo_fail() { tail -n 60 target/demo.log; echo "$1" >&2; exit 1; }
# The fixtures checked above, whatever FDPBLK_FIXTURES the caller exported.
env -u FDPBLK_FIXTURES tools/demo.sh >target/demo.log 2>&1 || demo_fail "tools/demo.sh failed"
# Its first two steps: the image's checkpoints and entries all read back, and every policy
# replays LMCache's capture without an error, `region` on its checkpoint and slot handles.
demo_check() { grep -Eq "$1" target/demo.log || demo_fail "demo: no line matching '$1' ($2)"; }
demo_check '^summary: [1-9][0-9]* live entries \(checkpoint seq [0-9]+\); 0 more listed that LMCache' "step 1: inspect reads every listed entry"
[[ $(grep -c '^  copy [01]  seq [0-9]*  payload_len [0-9]*  crc ok$' target/demo.log) == 2 ]] ||
    demo_fail "demo: step 1 did not find both checkpoint copies intact"
for p in none region key-aware; do
    demo_check "^policy $p: [1-9][0-9]* requests, 0 engine errors, 0 payload fallbacks$" "step 2: replay with policy $p"
done
[[ $(awk '/^-- policy region/ { r = 1 } /^-- policy key-aware/ { r = 0 } r && /^handle/ { h = 1; next } r && h && NF == 2 { print $1 }' target/demo.log | tr '\n' ' ') == "1 2 " ]] ||
    demo_fail "demo: step 2: policy region did not place on handles 1 (checkpoints) and 2 (slots)"
# Its last table: the drive without fdpblk, and with key-aware placement and deallocation.
none=$(awk '$1 == "none" && NF == 2 { print $2 }' target/demo.log)
ka=$(awk '$1 == "key-aware" && $2 == "+" && $3 == "trim" && NF == 4 { print $4 }' target/demo.log)
awk -v n="$none" -v k="$ka" 'BEGIN { exit !(n > 1 && k > 0 && k < n) }' ||
    demo_fail "demo: WAF none '$none', key-aware + trim '$ka': want key-aware + trim below none"
# The demo runs docs/waf.md's headline workload: its figures must be the ones published there.
want_none=$(sed -n 's/^| `none` (the drive without fdpblk) | \([0-9.]*\) |$/\1/p' docs/waf.md)
want_ka=$(sed -n 's/^| `key-aware` + trim | \*\*\([0-9.]*\)\*\* |$/\1/p' docs/waf.md)
[[ $none == "$want_none" && $ka == "$want_ka" ]] ||
    { echo "demo: WAF none $none, key-aware + trim $ka; docs/waf.md publishes $want_none and $want_ka: re-run and update the docs, or fix the change" >&2; exit 1; }
echo "demo: WAF $none without fdpblk, $ka with key-aware + trim"

# The demo's workload is O_DIRECT, whose header always comes before its payload; a change to
# how fdpblk waits for headers moves the buffered (non-MP) figures alone. One of them, checked
# against its table in docs/waf.md.
step "docs/waf.md: the buffered (non-MP) workload at 100 %"
./target/release/fdpblk simulate --workload tools/workloads/non-mp-pd.json --policy none,key-aware --utilization 100 --trim on --jobs 2 >target/non-mp-pd.log 2>&1 ||
    { tail -n 20 target/non-mp-pd.log; echo "fdpblk simulate of non-mp-pd failed" >&2; exit 1; }
for row in "none + trim" "key-aware + trim"; do
    got=$(awk -v r="$row" 'index($0, r " ") == 1 { print $NF; exit }' target/non-mp-pd.log)
    want=$(awk -v r="$row" '/^### non-mp-pd/ { s = 1 } s && index($0, r " ") == 1 { print $NF; exit }' docs/waf.md)
    [[ -n $got && $got == "$want" ]] ||
        { echo "non-mp-pd at 100 %: $row $got; docs/waf.md publishes '$want': re-run its non-mp-pd commands and update the docs, or fix the change" >&2; exit 1; }
    echo "non-mp-pd at 100 %: $row $got, as docs/waf.md publishes"
done

step "VM tests (QEMU guest)"
cargo build --release --locked --bins
tests/vm/suite.sh
step "done"
