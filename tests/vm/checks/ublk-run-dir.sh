#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 180
# libublk's run directory (/run/ublksrvd), where libublk writes and reads a JSON file per
# device as root, following links (and makes the directory 0777 where it creates it):
# fdpblk makes it root's 0755; one writable by others gets the sticky bit; a link planted at
# a device's file is removed, never written through (its target keeps its bytes and mode);
# a FIFO there does not hang `list` or `del`.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool mkfifo stat timeout
GEO=(--slot-bytes 64K --meta-total-bytes 1M)
echo keep >/tmp/victim
chmod 640 /tmp/victim

rm -rf /run/ublksrvd
dev=$(fdpblk_add --backing "$NS_DEV" -n 0 "${GEO[@]}")
expect_eq "device" "$dev" /dev/ublkb0
expect_eq "the run directory fdpblk made: root's, 755" "$(stat -c '%a %u' /run/ublksrvd)" "755 0"
expect "libublk wrote the device's file there" test -f /run/ublksrvd/0000.json
expect "del" "$FDPBLK" del -n 0

# As libublk leaves it where it made the directory (another server's add), with a link to a
# file of root's planted at device 0's file.
chmod 777 /run/ublksrvd
ln -sf /tmp/victim /run/ublksrvd/0000.json
dev=$(fdpblk_add --backing "$NS_DEV" -n 0 "${GEO[@]}")
expect_eq "device over a planted link" "$dev" /dev/ublkb0
expect_eq "the directory got the sticky bit" "$(stat -c %a /run/ublksrvd)" 1777
expect_eq "the link's target kept its bytes and mode" "$(cat /tmp/victim) $(stat -c %a /tmp/victim)" "keep 640"
expect "device 0's file is libublk's own now, not a link" bash -c 'test -f /run/ublksrvd/0000.json && ! test -L /run/ublksrvd/0000.json'
expect "the daemon log names the link it removed" log_has "removed /run/ublksrvd/0000.json"

# A FIFO in place of the running device's file: libublk would block reading it.
rm /run/ublksrvd/0000.json
mkfifo /run/ublksrvd/0000.json
expect "list with a FIFO at the device's file does not hang" timeout 30 "$FDPBLK" list
expect "the FIFO is gone" bash -c '! test -p /run/ublksrvd/0000.json'
mkfifo /run/ublksrvd/0000.json
expect "del with a FIFO at the device's file does not hang" timeout 60 "$FDPBLK" del -n 0
expect "no device left" bash -c '! test -e /dev/ublkb0'

# No room for libublk's file (a full /run): add refuses before the driver is asked, and a
# recovery before the device is taken over (it stays held), both naming the directory.
full=$(mktemp -d)
mount -t tmpfs -o size=4k tmpfs "$full" || check_fatal "mount a small tmpfs"
head -c 4096 /dev/zero >"$full/fill" 2>/dev/null
refused() { test "$1" -ne 0 && grep -qF 'libublk cannot write its device file in /run/ublksrvd' <<<"$2"; }
mount --bind "$full" /run/ublksrvd || check_fatal "bind the full tmpfs over /run/ublksrvd"
out=$("$FDPBLK" add --backing "$NS_DEV" -n 0 "${GEO[@]}" 2>&1) && rc=0 || rc=$?
expect "add with /run/ublksrvd full: refused, naming it" refused "$rc" "$out"
expect "no device made" bash -c '! test -e /dev/ublkb0'
umount /run/ublksrvd
dev=$(fdpblk_add --backing "$NS_DEV" -n 0 "${GEO[@]}")
expect_eq "device" "$dev" /dev/ublkb0
old=$(daemon_pid 0)
expect "SIGKILL the daemon ($old)" kill -9 "$old"
for _ in $(seq 40); do kill -0 "$old" 2>/dev/null || break; sleep 0.25; done
mount --bind "$full" /run/ublksrvd || check_fatal "bind the full tmpfs over /run/ublksrvd"
out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
expect "recover with /run/ublksrvd full: refused, naming it" refused "$rc" "$out"
umount /run/ublksrvd
expect "recover once there is room" "$FDPBLK" recover -n 0
expect "the device reads" dd if=/dev/ublkb0 of=/dev/null bs=4K count=16 iflag=direct status=none
expect "del" "$FDPBLK" del -n 0
umount "$full"
check_done
