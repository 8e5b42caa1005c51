#!/usr/bin/env bash
# Throughput of fdpblk's ublk device as ratios to the raw NVMe device (and to rublk's loop
# target when it is installed), all measured in one boot of the QEMU guest:
#   tests/vm/run.sh --timeout 1800 -- tools/bench/ublk-bench.sh
# Prints a markdown table: sequential 1 MiB writes (MiB/s) and 4 KiB random reads (IOPS).
# Absolute numbers mean little under TCG emulation; the ratios are the result, taken within
# each of ROUNDS rounds (default 3) and given as medians, next to the raw device's own spread.
#
# DESTROYS the data on the namespace: fio writes SIZE bytes to it raw, and fdpblk devices
# (ids 0, and 1 for rublk) are made and deleted on it. In the QEMU guest it runs as is; on
# any other host it refuses unless NS names the namespace to sacrifice (its /dev/ngXnY too).
set -euo pipefail
cd "$(dirname "$0")/../.."
FDPBLK=${FDPBLK:-target/release/fdpblk}
if [[ -z ${NS:-} && $(cat /proc/sys/kernel/hostname) != fdpblk-vm ]]; then
    echo "ublk-bench: this writes over the namespace it measures; outside the QEMU guest set NS=/dev/nvmeXnY to one whose data may go" >&2
    exit 1
fi
NS=${NS:-/dev/nvme0n1}
# The passthrough round's char device is NS's own, never another namespace's: as sysfs links
# them (the numbers before the n can differ).
[[ $(basename "$NS") =~ ^nvme[0-9]+n[0-9]+$ ]] || { echo "ublk-bench: NS=$NS: give an NVMe namespace block device (/dev/nvmeXnY)" >&2; exit 1; }
status=$("$FDPBLK" fdp status "$NS" --json) || { echo "ublk-bench: NS=$NS: no usable FDP configuration (see: $FDPBLK fdp status $NS)" >&2; exit 1; }
NG=$(python3 -c 'import json, sys; print(json.load(sys.stdin).get("generic_device") or "")' <<<"$status")
[[ -c $NG ]] || { echo "ublk-bench: NS=$NS: no generic node /dev/ngXnY found for it (fdpblk fdp status $NS --json: generic_device '$NG')" >&2; exit 1; }
# The peer: rublk's loop target, built by `tests/vm/setup.sh --peer`.
CACHE=${FDPBLK_VM_CACHE:-/var/cache/fdpblk-vm}
RUBLK=${RUBLK:-$(command -v rublk || { [[ -x $CACHE/rublk/bin/rublk ]] && echo "$CACHE/rublk/bin/rublk"; } || true)}
SIZE=${SIZE:-256M}
RUNTIME=${RUNTIME:-8}

seqw() { # DEV -> MiB/s
    fio --name=seqw --filename="$1" --rw=write --bs=1m --size="$SIZE" --direct=1 --ioengine=io_uring \
        --iodepth=16 --output-format=json | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["write"]["bw"]/1024,1))'
}
randr() { # DEV -> IOPS
    fio --name=randr --filename="$1" --rw=randread --bs=4k --size="$SIZE" --direct=1 --ioengine=io_uring \
        --iodepth=32 --time_based --runtime="$RUNTIME" --output-format=json |
        python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))'
}

# Rounds: every device is measured once per round, in the same order; a ratio is taken
# inside each round (the devices of one round ran minutes apart, the rounds further) and the
# table gives the median over the rounds, with the spread of the raw device's own figures.
ROUNDS=${ROUNDS:-3}
# Nothing of anyone else's: the namespace unmounted, not an fdpblk backing, ids 0 and 1 free.
[[ -z $(lsblk -nro MOUNTPOINT "$NS" 2>/dev/null | grep -v '^$' || true) ]] || { echo "ublk-bench: $NS (or a partition of it) is mounted" >&2; exit 1; }
for b in "$NS" "$NG"; do
    [[ -z $("$FDPBLK" list --json 2>/dev/null | grep -F "\"$b\"" || true) ]] || { echo "ublk-bench: $b backs a running fdpblk device (fdpblk list)" >&2; exit 1; }
done
for id in 0 1; do
    [[ ! -e /dev/ublkc$id ]] || { echo "ublk-bench: ublk device $id exists; the benchmark uses ids 0 and 1" >&2; exit 1; }
done
RES=$(mktemp)
# A failed run leaves no device or temp file behind: only the devices this run made.
MADE=()
trap 'rm -f "$RES"; for m in ${MADE[@]+"${MADE[@]}"}; do case $m in fdpblk) "$FDPBLK" del -n 0 >/dev/null 2>&1 || true ;; rublk) "$RUBLK" del -n 1 >/dev/null 2>&1 || true ;; esac; done' EXIT
measure() { # ROUND LABEL DEV
    # Assignments, not arguments: a failed fio run stops the script here (set -e).
    local w r
    w=$(seqw "$3")
    r=$(randr "$3")
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$w" "$r" >>"$RES"
}

for round in $(seq "$ROUNDS"); do
    measure "$round" "raw $NS" "$NS"
    for engine in streams passthrough plain; do
        policy=region backing=$NS
        [[ $engine == plain ]] && policy=none
        [[ $engine == passthrough ]] && backing=$NG
        MADE=(fdpblk)
        dev=$("$FDPBLK" add --backing "$backing" -n 0 --engine "$engine" --policy "$policy" \
            --slot-bytes 64K --meta-total-bytes 1M -q 2 -d 128)
        for _ in $(seq 50); do [[ -b $dev ]] && break; sleep 0.1; done
        # Else fio would create a regular file there and measure memory.
        [[ -b $dev ]] || { echo "ublk-bench: fdpblk's $dev did not appear (is udev running?)" >&2; exit 1; }
        measure "$round" "fdpblk $engine" "$dev"
        "$FDPBLK" del -n 0
        MADE=()
    done
    if [[ -n $RUBLK ]]; then
        MADE=(rublk)
        "$RUBLK" add loop -n 1 -f "$NS" -q 2 -d 128 >/dev/null
        for _ in $(seq 50); do [[ -b /dev/ublkb1 ]] && break; sleep 0.1; done
        # Else fio would create a regular file there and measure memory.
        [[ -b /dev/ublkb1 ]] || { echo "ublk-bench: rublk's /dev/ublkb1 did not appear" >&2; exit 1; }
        measure "$round" "rublk loop" /dev/ublkb1
        "$RUBLK" del -n 1
        MADE=()
    fi
done

python3 - "$RES" "raw $NS" <<'PY'
import statistics as st, sys
from collections import defaultdict
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
raw, peer = sys.argv[2], "rublk loop"
w, r, order = defaultdict(dict), defaultdict(dict), []
for rnd, label, mw, ri in rows:
    w[label][rnd], r[label][rnd] = float(mw), float(ri)
    if label not in order:
        order.append(label)
def ratio(m, a, b):  # median over the rounds of m[a] / m[b] within each round
    common = [k for k in m[a] if k in m[b]]
    return st.median(m[a][k] / m[b][k] for k in common)
def spread(v, d):
    v = list(v.values())
    return f"{st.median(v):.{d}f} ({min(v):.{d}f}-{max(v):.{d}f})"
n = len(w[raw])
print(f"{n} rounds; medians, with the range over the rounds")
print()
print("| device | seq 1 MiB write MiB/s | ratio to raw | 4 KiB rand read IOPS | ratio to raw |" + (" ratio to rublk (writes, reads) |" if peer in w else ""))
print("|---|---|---|---|---|" + ("---|" if peer in w else ""))
for k in order:
    line = f"| {k} | {spread(w[k], 1)} | {ratio(w, k, raw):.2f} | {spread(r[k], 0)} | {ratio(r, k, raw):.2f} |"
    if peer in w:
        line += f" {ratio(w, k, peer):.2f}, {ratio(r, k, peer):.2f} |"
    print(line)
rw, rr = list(w[raw].values()), list(r[raw].values())
print()
print(f"noise: the raw device's slowest round was {min(rw) / max(rw):.2f}x its fastest for writes, {min(rr) / max(rr):.2f}x for reads")
PY
rm -f "$RES"
