#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-args: --nruh 2
# The passthrough engine on a namespace with 2 placement IDs: policy region (4 handles) is
# refused with the limit named; policy none runs (no directive) and fio verify passes.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio
out=$("$FDPBLK" add --backing "$NG_DEV" --engine passthrough --policy region --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
expect "region refused (exit $rc)" test "$rc" -ne 0
expect "names the limit: $out" grep -q "policy region needs 4 placement handles but $NG_DEV has 2" <<<"$out"
expect "nothing created" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
dev=$(fdpblk_add --backing "$NG_DEV" -n 0 --engine passthrough --policy none --slot-bytes 64K --meta-total-bytes 1M)
expect_eq "policy none: device" "$dev" /dev/ublkb0
expect_eq "policy none: no placement IDs" "$("$FDPBLK" list --json | grep -o '"pids":\[[0-9,]*\]')" '"pids":[]'
fio_verify pt-none "$dev" --rw=randwrite --bs=64k --size=16M --iodepth=8
expect "del" "$FDPBLK" del -n 0
check_done
