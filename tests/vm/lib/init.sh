#!/bin/sh
# /init of the fdpblk VM guest (static busybox; packed by lib/common.sh).
#
# Root filesystem: the host's root, shared read-only over virtio-9p (tag
# "hostroot"), under a tmpfs overlay. The control share (tag "vmrun") brings
# config and cmd.sh from run.sh and takes back stdout, stderr, the exit status
# and timings. See tests/vm/README.md.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# What udev would add; bash process substitution needs /dev/fd.
ln -sf /proc/self/fd /dev/fd
ln -sf /proc/self/fd/0 /dev/stdin
ln -sf /proc/self/fd/1 /dev/stdout
ln -sf /proc/self/fd/2 /dev/stderr

say() { echo "fdpblk-vm: $*"; }
halt() {
    sync
    poweroff -f
    sleep 2
    reboot -f
}
fail() {
    say "FATAL: $*"
    [ -w /ctl ] && echo "$*" >>/ctl/error
    halt
}
uptime_s() { cut -d' ' -f1 /proc/uptime; }

for m in $(cat /modules.order); do
    insmod "/modules/$m" || say "insmod $m failed"
done

P9="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o "$P9,cache=none" vmrun /ctl || fail "cannot mount the control share"
[ -r /ctl/config ] || fail "no /ctl/config"
# shellcheck source=/dev/null
. /ctl/config

case " $(cat /proc/cmdline) " in
*" fdpblk.hang "*) say "fdpblk.hang given: not starting the command"; while :; do sleep 60; done ;;
esac

mount -t 9p -o "ro,$P9,cache=loose" hostroot /host || fail "cannot mount the host root"
mount -t tmpfs -o mode=755 tmpfs /rw || fail "cannot mount tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot ||
    fail "cannot mount the overlay root"

N=/newroot
mount -t proc proc $N/proc
mount -t sysfs sysfs $N/sys
mount -t devtmpfs devtmpfs $N/dev
mkdir -p $N/dev/pts $N/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $N/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $N/dev/shm
mount -t tmpfs -o mode=1777 tmpfs $N/tmp
mount -t tmpfs -o mode=755 tmpfs $N/run
mount -t debugfs debugfs $N/sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs $N/sys/kernel/tracing 2>/dev/null
mount -t configfs configfs $N/sys/kernel/config 2>/dev/null
mkdir -p $N/run/vmrun
mount --bind /ctl $N/run/vmrun
# The guest kernel's own module tree (from the harness cache), so modprobe works.
if [ -n "$VM_MODTREE" ] && [ -d "/host$VM_MODTREE" ]; then
    mkdir -p $N/usr/lib/modules
    mount --bind "/host$VM_MODTREE" $N/usr/lib/modules
fi
# Writable shares at their host paths: "tag path tag path ...".
# shellcheck disable=SC2086 # "tag path" pairs, paths without blanks (run.sh checks)
set -- $VM_SHARES
while [ $# -ge 2 ]; do
    mkdir -p "$N$2"
    mount -t 9p -o "$P9,cache=none" "$1" "$N$2" || fail "cannot mount share $2"
    shift 2
done
hostname fdpblk-vm

if [ "$VM_NVME" = 1 ]; then
    i=0
    while [ ! -b /dev/nvme0n1 ] && [ $i -lt 150 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    [ -b /dev/nvme0n1 ] || say "warning: /dev/nvme0n1 did not appear"
fi
[ -c /dev/ublk-control ] || say "warning: /dev/ublk-control is missing"

uptime_s >/ctl/started
if [ "$VM_MODE" = shell ]; then
    dmesg -n 1
    env -i /bin/setsid -c /bin/chroot $N /bin/bash --noprofile --norc /run/vmrun/cmd.sh \
        </dev/ttyS0 >/dev/ttyS0 2>&1
    rc=$?
else
    env -i /bin/chroot $N /bin/bash --noprofile --norc /run/vmrun/cmd.sh \
        </dev/null >>/ctl/stdout 2>>/ctl/stderr
    rc=$?
fi
uptime_s >/ctl/finished
echo $rc >/ctl/rc
halt
