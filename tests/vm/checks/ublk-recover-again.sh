#!/usr/bin/env bash
# vm-kernel: old new
# vm-fdp: on
# vm-timeout: 300
# A recovery that fails once the driver has started it (here: its char device node is gone,
# so the new daemon cannot open it) can be tried again: Linux 6.12 refuses a second start of
# a recovery no daemon has served (EINVAL), and the next `fdpblk recover` takes over the
# first start instead of leaving the device held for good. The write the driver held
# through both tries completes, with its data.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"

dev=$(fdpblk_add --backing "$NS_DEV" --engine plain -n 0 --policy none --slot-bytes 64K --meta-total-bytes 1M -q 1 -d 64)
expect_eq "device" "$dev" /dev/ublkb0
old=$(daemon_pid 0)
expect "SIGKILL daemon $old" kill -9 "$old"
for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
expect "list: quiesced" bash -c "for j in \$(seq 50); do $FDPBLK list --json | jq -e '.[0].state == \"quiesced\"' >/dev/null && exit 0; sleep 0.1; done; exit 1"
# A write the driver holds until a daemon serves the device.
head -c 65536 /dev/urandom >/tmp/again.data
dd if=/tmp/again.data of="$dev" bs=64k seek=10 oflag=direct status=none 2>/tmp/again-dd.err &
dd_pid=$!
sleep 1
expect "the write is held" kill -0 "$dd_pid"
mv /dev/ublkc0 /tmp/ublkc0.node
out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
expect "a recovery without the char device fails ($out)" bash -c 'test "$1" -ne 0 && grep -q "could not open /dev/ublkc0: there is no such node" <<<"$2" && grep -qF "recover it again" <<<"$2" && grep -qF "fdpblk recover -n 0" <<<"$2"' _ "$rc" "$out"
mv /tmp/ublkc0.node /dev/ublkc0
expect "the write is still held" kill -0 "$dd_pid"
out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
expect "recover again brings the device back ($out)" bash -c 'test "$1" -eq 0 && test "$2" = /dev/ublkb0' _ "$rc" "$out"
if [[ $FDPBLK_VM_KERNEL == old ]]; then
    # The old kernel is the one that refuses a second start: what this case is about.
    expect "the old kernel is a 6.12 ($(uname -r))" bash -c '[[ $(uname -r) == 6.12.* ]]'
    expect "6.12: the second start was refused and the first taken over" log_has "this daemon takes over that start"
fi
expect "list: live" bash -c "$FDPBLK list --json | jq -e '.[0].state == \"live\"' >/dev/null"
for _ in $(seq 200); do kill -0 "$dd_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$dd_pid" 2>/dev/null; then
    not_ok "the held write is still held 20 s after the recovery"
    "$FDPBLK" del -n 0 || true
fi
wait "$dd_pid" && rc=0 || rc=$?
expect "the held write completed ($(cat /tmp/again-dd.err))" test "$rc" -eq 0
expect "its data is on the device" cmp <(dd if="$dev" bs=64k skip=10 count=1 iflag=direct status=none) /tmp/again.data
expect "del" "$FDPBLK" del -n 0
# The node moved and put back is no longer the one devtmpfs made, so it outlives the device.
[[ -e /sys/class/ublk-char/ublkc0 ]] || rm -f /dev/ublkc0

# A backing that is no NVMe namespace (a loop device): add saves its disk's identity, and a
# recovery refuses the same name set up again on another file, writing nothing.
modprobe loop 2>/dev/null || true
truncate -s 64M /tmp/again-a.img /tmp/again-b.img
loopdev=$(losetup -f --show /tmp/again-a.img)
dev=$(fdpblk_add --backing "$loopdev" --engine plain -n 0 --policy none --slot-bytes 64K --meta-total-bytes 1M -q 1 -d 64)
saved=$(jq -r .config.backing_identity /run/fdpblk/0.json)
expect "add saved the loop device's disk sequence number ($saved)" grep -qE "^block device ${loopdev#/dev/} disk sequence number [0-9]+$" <<<"$saved"
old=$(daemon_pid 0)
expect "SIGKILL daemon $old (loop backing)" kill -9 "$old"
for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
expect "the loop device let go" losetup -d "$loopdev"
# Detached at its last close: the killed daemon's rings may still hold it a moment.
for _ in $(seq 100); do [[ -e /sys/block/${loopdev#/dev/}/loop/backing_file ]] || break; sleep 0.1; done
expect "set up again on another file" losetup "$loopdev" /tmp/again-b.img
out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
expect "recover refuses the loop device set up again ($out)" bash -c 'test "$1" -ne 0 && grep -qF "is now the block device ${2#/dev/} disk sequence number" <<<"$3" && grep -qF "not the $4 the device was added on. Nothing was written" <<<"$3"' _ "$rc" "$loopdev" "$out" "$saved"
expect "nothing was written to the other file" test -z "$(tr -d '\0' </tmp/again-b.img | head -c 1)"
expect "del" "$FDPBLK" del -n 0
losetup -d "$loopdev" || true
rm -f /tmp/again-a.img /tmp/again-b.img
check_done
