#!/usr/bin/env bash
# The main job, runnable anywhere (no FDP drive, no ublk driver needed): read real LMCache
# raw_block images, then replay LMCache's own captured I/O through fdpblk's classifier and
# placement policies into the simulated FDP drive, and show where the bytes land.
#
#   tools/demo.sh [FIXTURES_DIR]     (default: the LMCache fixtures beside the repository)
#
# Then it simulates issue #7's default workload at full scale (a 1.88 TB drive; about a
# minute on two cores): the drive's WAF without fdpblk, and with fdpblk's key-aware placement
# and deallocation.
set -euo pipefail
fixtures=${1:-${FDPBLK_FIXTURES:-}}
# A directory given is taken from where the demo was started; the default is beside the repo.
if [[ -n $fixtures ]]; then
    fixtures=$(cd "$fixtures" 2>/dev/null && pwd) || { echo "demo: no directory ${1:-$FDPBLK_FIXTURES}" >&2; exit 1; }
fi
cd "$(dirname "$0")/.."
fixtures=${fixtures:-../shared/fixtures/lmcache-0.5.6}
[[ -d $fixtures ]] || { echo "demo: no LMCache fixtures at $fixtures (LMCache 0.5.6 device images and I/O captures, kept beside the repository, not in it); pass their directory as the first argument" >&2; exit 1; }
command -v python3 >/dev/null || { echo "demo: no python3 (the demo converts LMCache's capture with it): install python3, then run this again" >&2; exit 1; }
# --locked, as the tests build: the versions in Cargo.lock, never a rewritten lock file.
command -v cargo >/dev/null || { echo "demo: no cargo: install Rust 1.88 or later (rustup), then run this again" >&2; exit 1; }
# A distribution's packaged Rust is often older (Debian 12's is 1.63): name that, not the build.
rustc_v=$(rustc --version 2>/dev/null | awk '{ print $2 }' || true)
[[ -n $rustc_v ]] || { echo "demo: cargo is here but rustc does not run (rustup without a default toolchain? rustup default stable), then run this again" >&2; exit 1; }
if [[ $rustc_v =~ ^1\.([0-9]+) ]] && ((BASH_REMATCH[1] < 88)); then
    echo "demo: rustc $rustc_v is older than 1.88 (a distribution's packaged Rust often is): install Rust with rustup, then run this again" >&2
    exit 1
fi
[[ -x target/release/fdpblk ]] || echo "== building fdpblk (the first build takes a few minutes)"
cargo build --release --locked --quiet --bins ||
    { echo "demo: the build failed (above); it needs a C compiler and libclang (Debian: apt-get install gcc libc6-dev libclang-dev)" >&2; exit 1; }
bin=target/release/fdpblk
scen=$fixtures/object-evict

echo "== 1. What LMCache left on the device (fdpblk inspect)"
$bin inspect "$scen/device.img"

echo
echo "== 2. LMCache's captured I/O, classified and placed (fdpblk replay)"
trace=$(mktemp --suffix=.jsonl)
trap 'rm -f "$trace"' EXIT
# The capture's writes and reads, in the replay trace format (first 32 bytes as data).
python3 - "$scen/iotrace.jsonl" > "$trace" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["op"] in ("write", "read"):
        out = {"op": r["op"], "offset": r["offset"], "len": r["total_len"]}
        if r["op"] == "write":
            out["data_hex"] = r["head32_hex"]
        print(json.dumps(out))
PY
for policy in none region key-aware; do
    echo "-- policy $policy"
    $bin replay --device "$scen/device.img" --policy "$policy" "$trace"
done

echo
echo "== 3. The write amplification it saves (fdpblk simulate: LMCache's default workload on a"
echo "      simulated 1.88 TB FDP drive at 100 % use; docs/waf.md has every workload)"
$bin simulate --workload tools/workloads/zipf09.json --policy none,key-aware --utilization 100 --trim both --jobs 2
