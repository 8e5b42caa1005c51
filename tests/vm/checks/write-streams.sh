#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# Block-layer write streams (Linux >= 6.16): the namespace advertises one stream
# per handle with the RU size as granularity, and an O_DIRECT io_uring write on
# stream N (SQE byte 44) lands on placement ID N-1; stream 0 carries no
# directive (PID 0 in QEMU); stream NRUH+1 is rejected with EINVAL.
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool nvme

q=/sys/block/nvme0n1/queue
expect_eq "$q/max_write_streams" "$(cat $q/max_write_streams 2>/dev/null || echo absent)" "$NRUH"
expect_eq "$q/write_stream_granularity" "$(cat $q/write_stream_granularity 2>/dev/null || echo absent)" "$RU_SIZE"

WSTREAM=${FDPBLK_VM_CACHE:-/var/cache/fdpblk-vm}/bin/wstream
[[ -x $WSTREAM ]] || check_fatal "$WSTREAM missing: run tests/vm/setup.sh (or tests/vm/suite.sh, which builds it)"

before=$(ruamw)
declare -A want
for ((p = 0; p < NRUH; p++)); do want[$p]=0; done
# Stream s writes s * 4 KiB, so each PID's consumption identifies its stream.
off=$((64 << 20))
for ((s = 1; s <= NRUH; s++)); do
    size=$((s * 4096))
    expect "io_uring write of $size bytes on stream $s" "$WSTREAM" -o "$off" -s "$size" "$NS_DEV" "$s"
    want[$((s - 1))]=$((want[$((s - 1))] + size / LBA))
    off=$((off + (1 << 20)))
done
expect "io_uring write of 4096 bytes on stream 0 (no stream)" "$WSTREAM" -o "$off" -s 4096 "$NS_DEV" 0
want[0]=$((want[0] + 4096 / LBA))
off=$((off + (1 << 20)))
expect "stream $((NRUH + 1)) is rejected with EINVAL" "$WSTREAM" -E 22 -o "$off" "$NS_DEV" $((NRUH + 1))

after=$(ruamw)
for ((p = 0; p < NRUH; p++)); do
    expect_eq "RUAMW consumed on placement ID $p (blocks)" "$(ruamw_used "$before" "$after" "$p")" "${want[$p]}"
done

check_done
