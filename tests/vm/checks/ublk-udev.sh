#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 240
# deploy/99-fdpblk.rules under a running udevd (the other checks run none): udev itself links
# /dev/fdpblk/NAME for an added device, and a restart that deletes a device and adds the name
# again at once (as `fdpblk up` does for a dead device, with the same or another number)
# leaves the link on the new device once udev has handled both events: the old device's
# removal, handled late, does not take the new link away. A recovered daemon (same device,
# no remove event) keeps it too. Data written through the link before a restart reads back
# through it after.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool udevadm pgrep
repo=$(cd "$(dirname "$0")/../../.." && pwd)
GEO=(--slot-bytes 64K --meta-total-bytes 1M)
UDEVD=/lib/systemd/systemd-udevd
[[ -x $UDEVD ]] || check_fatal "no $UDEVD in the guest (tests/vm/setup.sh installs udev)"

# Install as deploy/README.md says (the guest's root is a throw-away overlay).
install -m 0755 "$FDPBLK" /usr/local/bin/fdpblk
install -D -m 0644 "$repo/deploy/99-fdpblk.rules" /etc/udev/rules.d/99-fdpblk.rules
mkdir -p /run/udev
# The guest runs the checks in a chroot, where udevadm settle would otherwise do nothing.
export SYSTEMD_IGNORE_CHROOT=1
stop_udevd() {
    udevadm control --exit >/dev/null 2>&1 || pkill -x systemd-udevd || true
    rm -f /etc/udev/rules.d/99-fdpblk.rules
}
trap 'for i in 0 1; do "$FDPBLK" del -n $i >/dev/null 2>&1 || true; done; stop_udevd' EXIT
"$UDEVD" --daemon --resolve-names=never || check_fatal "systemd-udevd --daemon"
expect "udevd runs" quiet pgrep -x systemd-udevd
expect "udevadm settle waits for udevd (not ignored in the chroot)" bash -c "set -o pipefail; udevadm settle -t 30 2>&1 | (! grep -q 'ignoring request')"

# link_is DEV: /dev/fdpblk/kv0 resolves to DEV.
link_is() { [[ $(readlink -f /dev/fdpblk/kv0) == "$1" ]]; }
head -c 1048576 /dev/urandom >/tmp/udev-p

dev=$(fdpblk_add --backing "$NS_DEV" -n 0 --name kv0 "${GEO[@]}")
udevadm settle -t 30
expect "udev's own link: udevadm info $dev lists fdpblk/kv0" bash -c "udevadm info --query=symlink --name=$dev | tr ' ' '\n' | grep -qx fdpblk/kv0"
expect "/dev/fdpblk/kv0 -> $dev" link_is "$dev"
expect "write through the link" dd if=/tmp/udev-p of=/dev/fdpblk/kv0 bs=1M seek=4 count=1 oflag=direct status=none

# Restarts with no pause between the delete and the add: another number, the same one, and
# back. udev handles the removal of the old device while, or after, the new one appears.
id=0
for next in 1 1 0 0; do
    expect "del -n $id" "$FDPBLK" del -n "$id"
    dev=$(fdpblk_add --backing "$NS_DEV" -n "$next" --name kv0 "${GEO[@]}")
    udevadm settle -t 30
    expect "del -n $id, add -n $next at once: /dev/fdpblk/kv0 -> $dev after udev settled" link_is "$dev"
    expect "the data reads back through the link" \
        bash -c "dd if=/dev/fdpblk/kv0 bs=1M skip=4 count=1 iflag=direct status=none | cmp -s - /tmp/udev-p"
    id=$next
done

# A daemon killed and recovered: the same device, which udev may see change, keeps the link.
pid=$(daemon_pid "$id")
kill -9 "$pid"
expect "the killed daemon exits" bash -c "for i in \$(seq 100); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
expect "recover -n $id" quiet "$FDPBLK" recover -n "$id"
udevadm settle -t 30
expect "recovered: /dev/fdpblk/kv0 -> $dev" link_is "$dev"
expect "the data reads back through the link after the recovery" \
    bash -c "dd if=/dev/fdpblk/kv0 bs=1M skip=4 count=1 iflag=direct status=none | cmp -s - /tmp/udev-p"

expect "del -n $id" "$FDPBLK" del -n "$id"
udevadm settle -t 30
expect "no link once the device is gone" test ! -e /dev/fdpblk/kv0
expect_eq "no error in fdpblk's log since the check began" "$(daemon_errors)" 0
# The checks after this one in the same boot run without udevd, as before.
stop_udevd
expect "udevd stopped" bash -c "for i in \$(seq 50); do pgrep -x systemd-udevd >/dev/null || exit 0; sleep 0.1; done; exit 1"
check_done
