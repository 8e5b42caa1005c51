#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-args: --nruh 2
# A policy that needs more placement handles than the drive has is refused with the fix.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
out=$("$FDPBLK" add --backing "$NS_DEV" --policy region --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
expect "refused (exit $rc)" test "$rc" -ne 0
expect "names the limit: $out" grep -q "needs 4 placement handles but $NS_DEV has 2" <<<"$out"
expect "nothing created" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
check_done
