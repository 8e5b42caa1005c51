#!/usr/bin/env bash
# vm-kernel: new old
# vm-fdp: on
# The guest is what we think: the expected kernel, ublk_drv loaded with
# /dev/ublk-control, the NVMe nodes, and the guest's own module tree.
. "$(dirname "$0")/../lib/check-lib.sh"

expect_eq "kernel release" "$(uname -r)" "$FDPBLK_VM_KVER"
up=$(uname -r | sed 's/^\([0-9]*\.[0-9]*\).*/\1/')
if [[ $FDPBLK_VM_KERNEL == new ]]; then
    expect "new kernel $up >= 6.16" awk -v v="$up" 'BEGIN { split(v, a, "."); exit !(a[1] > 6 || (a[1] == 6 && a[2] >= 16)) }'
else
    expect "old kernel $up < 6.16" awk -v v="$up" 'BEGIN { split(v, a, "."); exit !(a[1] < 6 || (a[1] == 6 && a[2] < 16)) }'
fi

expect "ublk_drv loaded" test -d /sys/module/ublk_drv
expect "/dev/ublk-control is a character device" test -c /dev/ublk-control
expect_eq "/dev/ublk-control major:minor" "$(stat -c '%Hr:%Lr' /dev/ublk-control)" \
    "$(cat /sys/class/misc/ublk-control/dev 2>/dev/null)"
expect "ublk_drv parameter ublks_max readable" test -r /sys/module/ublk_drv/parameters/ublks_max

expect "/dev/nvme0 is a character device" test -c /dev/nvme0
expect "/dev/nvme0n1 is a block device" test -b /dev/nvme0n1
expect "/dev/ng0n1 is a character device" test -c /dev/ng0n1
expect_eq "nvme0n1 logical block size" "$(cat /sys/block/nvme0n1/queue/logical_block_size)" "$LBA"

need_tool modprobe modinfo
expect "modinfo finds the guest kernel's ublk_drv" quiet modinfo -k "$(uname -r)" ublk_drv
expect "modprobe loads a module from the guest module tree (loop)" modprobe loop
expect "loop module now loaded" test -d /sys/module/loop

check_done
