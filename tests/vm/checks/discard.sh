#!/usr/bin/env bash
# vm-kernel: new old
# vm-fdp: on
# Deallocated ranges read back as zeroes (the drive's backing uses
# discard=unmap; without it QEMU keeps the old data).
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool dd cmp blkdiscard

expect "discard supported (discard_max_bytes > 0)" test "$(cat /sys/block/nvme0n1/queue/discard_max_bytes)" -gt 0
off=$((32 << 20))
head -c 1048576 /dev/urandom >/tmp/pattern
expect "write 1 MiB at 32 MiB" dd if=/tmp/pattern of="$NS_DEV" bs=1M seek=32 count=1 oflag=direct status=none
expect "read back matches" bash -c "dd if=$NS_DEV bs=1M skip=32 count=1 iflag=direct status=none | cmp - /tmp/pattern"
expect "blkdiscard 1 MiB at 32 MiB" blkdiscard -o "$off" -l 1048576 "$NS_DEV"
expect "deallocated range reads back as zeroes" \
    bash -c "dd if=$NS_DEV bs=1M skip=32 count=1 iflag=direct status=none | cmp - <(head -c 1048576 /dev/zero)"

check_done
