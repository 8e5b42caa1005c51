#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: off
# The passthrough engine on a drive without FDP: a placement policy is refused with the fix;
# policy none runs and fio verify passes.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio
out=$("$FDPBLK" add --backing "$NG_DEV" --engine passthrough --policy region --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
expect "region refused (exit $rc)" test "$rc" -ne 0
expect "names the fix: $out" grep -q "does not support FDP.*use --policy none" <<<"$out"
expect "nothing created" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
dev=$(fdpblk_add --backing "$NG_DEV" -n 0 --policy none --slot-bytes 64K --meta-total-bytes 1M)
expect_eq "auto engine on /dev/ng0n1" "$("$FDPBLK" list --json | grep -o '"engine":"[a-z]*"')" '"engine":"passthrough"'
fio_verify pt-nofdp "$dev" --rw=randwrite --bs=64k --size=16M --iodepth=8
expect "del" "$FDPBLK" del -n 0
check_done
