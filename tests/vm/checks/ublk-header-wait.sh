#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 240
# Payloads that wait for their headers never take all of a queue's tags. LMCache's io_uring
# engine from two store workers at once, with 2 MiB slots, on a device with 2 queues of 8
# tags: each batch is far more requests than there are tags, so the kernel hands writes to
# worker threads in any order and many payloads arrive before their headers. At most half
# of a queue's tags (4) hold payloads for headers at once (`queues[].header_wait_peak`), and
# the mark is reached; the other tags keep serving, so every put completes and every entry
# verifies and reopens. (Without the bound, all 8 tags could wait for headers that need a
# tag to arrive.)
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/var/tmp/ublk-header-wait.state
WRITER_PREFIX=header-wait
WRITER_ENGINE=io_uring
OUT=${FDPBLK_CHECK_OUT:-/var/tmp}
GEOM=(--slot-bytes 2M --meta-total-bytes 1M)
rm -f "$STATE"
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT

# A wait long enough that no header is given up on before it arrives (the guest is slow).
ADD=(-n 0 --backing "$NG_DEV" --engine passthrough --policy key-aware -q 2 -d 8 --header-wait-us 1000000 "${GEOM[@]}")
expect_eq "fdpblk add (2 queues of 8 tags)" "$(fdpblk_add "${ADD[@]}")" "$DEV"
writer put put 96 --workers 2 checkpoint verify
expect_eq "every entry verifies" "$(wfield put run.verified)" 96
sleep 1.2 # the stats are rewritten twice a second
peaks=$("$FDPBLK" stats -n 0 --json | jq -r '[.queues[].header_wait_peak] | join(" ")')
echo "    fdpblk: $("$FDPBLK" stats -n 0 --json | jq -c '{queues, header_waits: .pipeline.header_waits, payload_fallbacks: .pipeline.payload_fallbacks}')"
read -r p0 p1 <<<"$peaks"
expect "at most 4 of a queue's 8 tags waited for headers at once (peaks: $peaks)" test "$p0" -le 4 -a "$p1" -le 4
expect "payloads did wait for their headers, up to the bound (peaks: $peaks)" test "$p0" -eq 4 -o "$p1" -eq 4
expect_eq "no error in fdpblk's log since the check began" "$(daemon_errors)" 0
expect "fdpblk del" "$FDPBLK" del -n 0
expect_eq "fdpblk add again" "$(fdpblk_add "${ADD[@]}")" "$DEV"
writer reopen reopen verify
expect_eq "reopen: entries recovered and verified" "$(wfield reopen run.recovered) $(wfield reopen run.verified)" "96 96"
expect "fdpblk del" "$FDPBLK" del -n 0
check_done
