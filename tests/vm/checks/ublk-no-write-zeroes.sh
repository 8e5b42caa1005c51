#!/usr/bin/env bash
# vm-kernel: new old
# vm-fdp: on
# A backing drive without Write Zeroes (null_blk, memory-backed, with discard): the plain
# engine's deallocation is a discard (fallocate(PUNCH_HOLE), which such a drive refuses,
# would complete doing nothing), and an unmapping Write Zeroes falls back to ZERO_RANGE.
# Both complete through /dev/ublkb0 and the range reads back as zeroes on the drive; the
# discard reaches it as a discard. Then the same drive without discard: deallocation is off,
# and `add`, the daemon's log and `stats` say why.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool dd cmp blkdiscard fallocate modprobe

NB=/dev/nullb0
# 1 GiB, memory-backed (discarded pages read back as zeroes), discard on; null_blk has no
# Write Zeroes.
modprobe null_blk nr_devices=1 gb=1 bs=4096 memory_backed=1 discard=1 ||
    check_fatal "modprobe null_blk (the guest kernel's module tree has it)"
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; rmmod null_blk 2>/dev/null || true' EXIT
for _ in $(seq 50); do [[ -b $NB ]] && break; sleep 0.1; done
expect_eq "null_blk: no Write Zeroes" "$(cat /sys/block/nullb0/queue/write_zeroes_max_bytes)" 0
expect "null_blk: discard" test "$(cat /sys/block/nullb0/queue/discard_max_bytes)" -gt 0

dev=$(fdpblk_add --backing "$NB" -n 0 --engine plain --policy none --slot-bytes 64K --meta-total-bytes 1M)
expect_eq "fdpblk add on $NB" "$dev" /dev/ublkb0

# discards: the 12th field of the drive's stat file (discard I/Os completed).
discards() { awk '{ print $12 }' /sys/block/nullb0/stat; }
zeroes_on_drive() {
    cmp -s <(dd if=$NB bs=1M skip=32 count=1 iflag=direct status=none) <(head -c 1048576 /dev/zero)
}
head -c 1048576 /dev/urandom >/tmp/pattern

# write_pattern: 1 MiB at 32 MiB through the ublk device, checked on the drive.
write_pattern() {
    expect "$1: write 1 MiB at 32 MiB through $dev" \
        dd if=/tmp/pattern of="$dev" bs=1M seek=32 count=1 oflag=direct status=none
    expect "$1: the drive holds it" \
        bash -c "dd if=$NB bs=1M skip=32 count=1 iflag=direct status=none | cmp - /tmp/pattern"
}

write_pattern discard
d0=$(discards)
expect "blkdiscard through $dev completes" blkdiscard -o $((32 << 20)) -l 1048576 "$dev"
expect "the discard reached the drive as a discard ($d0 -> $(discards))" test "$(discards)" -gt "$d0"
expect "the discard went as an io_uring command (not BLKDISCARD on a thread)" log_lacks "no io_uring discard"
expect "the discarded range reads back as zeroes on the drive" zeroes_on_drive

# fallocate(PUNCH_HOLE) on the ublk device is an unmapping Write Zeroes that the kernel must
# not carry out by writing zeroes itself (BLKDEV_ZERO_NOFALLBACK): it fails unless fdpblk
# falls back. (blkdiscard -z would pass either way: the kernel writes the zeroes then.)
write_pattern zeroes
expect "fallocate --punch-hole through $dev completes (ZERO_RANGE fallback)" \
    fallocate --punch-hole --offset $((32 << 20)) --length 1048576 "$dev"
expect "the zeroed range reads back as zeroes on the drive" zeroes_on_drive

expect "fdpblk del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone

# A drive that takes no deallocation (null_blk with discard off): `add` warns, and the daemon
# runs with deallocation off and says why, instead of failing a trim after every checkpoint.
rmmod null_blk || check_fatal "rmmod null_blk"
modprobe null_blk nr_devices=1 gb=1 bs=4096 memory_backed=1 discard=0 || check_fatal "modprobe null_blk discard=0"
for _ in $(seq 50); do [[ -b $NB ]] && break; sleep 0.1; done
expect_eq "null_blk: no discard" "$(cat /sys/block/nullb0/queue/discard_max_hw_bytes)" 0
"$FDPBLK" add --backing "$NB" -n 0 --engine plain --policy none --slot-bytes 64K --meta-total-bytes 1M >/tmp/add.out 2>/tmp/add.err ||
    { cat /tmp/add.out /tmp/add.err; check_fatal "fdpblk add on $NB without discard"; }
expect "add warns that $NB takes no deallocation" grep -q "$NB takes no deallocation.*runs with deallocation off" /tmp/add.err
wait_stat trim.enabled false
expect "stats: why deallocation is off" bash -c "$FDPBLK stats -n 0 --json | jq -r .trim.off_because | grep -q 'takes no deallocation'"
expect "stats text: DEALLOCATION OFF" bash -c "$FDPBLK stats -n 0 | grep -q '^DEALLOCATION OFF: $NB takes no deallocation'"
expect "the daemon logged it" log_has "device 0: $NB takes no deallocation.*: deallocation is off"
expect "fdpblk del" "$FDPBLK" del -n 0
check_done
