#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: off
# run.sh --fdp off gives a plain NVMe drive: no FDP capability, the RUH status
# query fails, no write streams, but the namespace reads and writes.
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool nvme dd cmp

expect "CTRATT bit 19 clear (no FDP)" test "$(ctratt_fdp)" -eq 0
expect "nvme fdp status fails" bash -c "! nvme fdp status $NS_DEV >/dev/null 2>&1"
q=/sys/block/nvme0n1/queue
expect_eq "$q/max_write_streams" "$(cat $q/max_write_streams 2>/dev/null || echo 0)" 0

head -c 1048576 /dev/urandom >/tmp/pattern
expect "O_DIRECT write" dd if=/tmp/pattern of="$NS_DEV" bs=1M count=1 oflag=direct status=none
expect "O_DIRECT read back matches" bash -c "dd if=$NS_DEV bs=1M count=1 iflag=direct status=none | cmp - /tmp/pattern"

check_done
