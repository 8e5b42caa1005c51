#!/usr/bin/env bash
# Throughput of fdpblk's ublk device as ratios to the raw NVMe device (and to rublk's loop
# target when it is installed), all measured in one boot of the QEMU guest:
#   tests/vm/run.sh --timeout 900 -- tools/bench/ublk-bench.sh
# Prints a markdown table: sequential 1 MiB writes (MiB/s) and 4 KiB random reads (IOPS).
# Absolute numbers mean little under TCG emulation; the ratios are the result. The raw device
# is measured first and last: the ratios are to the mean of the two, and their spread is the
# drift of the run (what a ratio closer than that does not tell apart).
set -euo pipefail
cd "$(dirname "$0")/../.."
FDPBLK=${FDPBLK:-target/release/fdpblk}
NS=${NS:-/dev/nvme0n1}
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

declare -A W R
order=()
measure() { # LABEL DEV
    order+=("$1")
    W[$1]=$(seqw "$2")
    R[$1]=$(randr "$2")
}

measure "raw $NS (first)" "$NS"
NG=${NG:-/dev/ng0n1}
for engine in streams passthrough plain; do
    policy=region backing=$NS
    [[ $engine == plain ]] && policy=none
    [[ $engine == passthrough ]] && backing=$NG
    dev=$("$FDPBLK" add --backing "$backing" -n 0 --engine "$engine" --policy "$policy" \
        --slot-bytes 64K --meta-total-bytes 1M -q 2 -d 128)
    measure "fdpblk $engine" "$dev"
    "$FDPBLK" del -n 0
done
if [[ -n $RUBLK ]]; then
    "$RUBLK" add loop -n 1 -f "$NS" -q 2 -d 128 >/dev/null
    for _ in $(seq 50); do [[ -b /dev/ublkb1 ]] && break; sleep 0.1; done
    measure "rublk loop" /dev/ublkb1
    "$RUBLK" del -n 1
fi
measure "raw $NS (last)" "$NS"

first="raw $NS (first)" last="raw $NS (last)"
rw=$(python3 -c "print((${W[$first]} + ${W[$last]}) / 2)")
rr=$(python3 -c "print((${R[$first]} + ${R[$last]}) / 2)")
echo "| device | seq 1 MiB write MiB/s | ratio to raw | 4 KiB rand read IOPS | ratio to raw |"
echo "|---|---|---|---|---|"
for k in "${order[@]}"; do
    printf '| %s | %s | %.2f | %s | %.2f |\n' "$k" "${W[$k]}" \
        "$(python3 -c "print(${W[$k]}/$rw)")" "${R[$k]}" "$(python3 -c "print(${R[$k]}/$rr)")"
done
python3 -c "print('raw drift over the run: writes %+.0f %%, reads %+.0f %% (last against first)' % (100 * (${W[$last]} / ${W[$first]} - 1), 100 * (${R[$last]} / ${R[$first]} - 1)))"
peer="rublk loop"
if [[ -n ${W[$peer]:-} ]]; then
    for engine in streams passthrough plain; do
        k="fdpblk $engine"
        python3 -c "print('$k against rublk loop: writes %.2fx, reads %.2fx' % (${W[$k]} / ${W[$peer]}, ${R[$k]} / ${R[$peer]}))"
    done
fi
