#!/usr/bin/env bash
# vm-fdp: on
# vm-args: --bad-sector 20496
# vm-timeout: 300
# A bad sector on the drive (QEMU blkdebug: every read and write touching 512-byte sector
# 20496, 10 MiB + 8 KiB, fails, and the controller reports a media error): through fdpblk,
# on the block device's engine and with NVMe passthrough, a read or write of the slot holding
# it fails with the drive's error (a media error: ENODATA), its neighbours are served, the daemon stays up and counts the failures
# per queue, and the device is deleted cleanly.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"

# The harness: the namespace itself fails there, with the kernel's error for a media error
# (ENODATA, "No data available"), which fdpblk must pass on as it is.
raw=$(dd if="$NS_DEV" of=/dev/null bs=512 skip=20496 count=1 iflag=direct status=none 2>&1) && rc=0 || rc=$?
expect "the raw namespace fails to read the bad sector ($raw)" bash -c 'test "$1" -ne 0 && grep -q "No data available" <<<"$2"' _ "$rc" "$raw"
expect "and reads the one before it" dd if="$NS_DEV" of=/dev/null bs=512 skip=20495 count=1 iflag=direct status=none

for engine in plain passthrough; do
    backing=$NS_DEV
    [[ $engine == passthrough ]] && backing=$NG_DEV
    dev=$(fdpblk_add --backing "$backing" --engine "$engine" -n 0 --policy none --slot-bytes 64K --meta-total-bytes 1M -q 1 -d 64)
    pid=$(daemon_pid 0)
    # Slot 144 spans [10 MiB, 10 MiB + 64 KiB): 64 KiB block 160 of the device.
    out=$(dd if="$dev" of=/dev/null bs=64k skip=160 count=1 iflag=direct 2>&1) && rc=0 || rc=$?
    expect "$engine: a read of the bad slot fails as the drive's ($out)" bash -c 'test "$1" -ne 0 && grep -q "No data available" <<<"$2"' _ "$rc" "$out"
    expect "$engine: the slot before it reads" dd if="$dev" of=/dev/null bs=64k skip=159 count=1 iflag=direct status=none
    head -c 65536 /dev/urandom >/tmp/bad.data
    out=$(dd if=/tmp/bad.data of="$dev" bs=64k seek=160 count=1 oflag=direct 2>&1) && rc=0 || rc=$?
    expect "$engine: a write of the bad slot fails as the drive's ($out)" bash -c 'test "$1" -ne 0 && grep -q "No data available" <<<"$2"' _ "$rc" "$out"
    expect "$engine: the slot after it is written" dd if=/tmp/bad.data of="$dev" bs=64k seek=161 count=1 oflag=direct status=none
    expect "$engine: and reads back" cmp <(dd if="$dev" bs=64k skip=161 count=1 iflag=direct status=none) /tmp/bad.data
    expect "$engine: the daemon is still up" kill -0 "$pid"
    expect "$engine: the device is live" bash -c "$FDPBLK list --json | jq -e '.[0].state == \"live\"' >/dev/null"
    errors=$("$FDPBLK" stats -n 0 --json | jq '[.queues[].errors] | add')
    expect "$engine: the queue counted the failed requests ($errors)" test "$errors" -ge 2
    expect "$engine: and names the last one" bash -c "$FDPBLK stats -n 0 --json | jq -e '.queues[0].last_error | length > 0' >/dev/null"
    expect "$engine: del" "$FDPBLK" del -n 0
    expect "$engine: the daemon is gone" daemons_gone
done
check_done
