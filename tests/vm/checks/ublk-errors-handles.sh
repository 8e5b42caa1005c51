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
# tools/waf-compare checks every configuration's handles before its first erase, not when
# that configuration's turn comes after the others have run.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
printf '%s\n' "--slot-bytes 64K --meta-total-bytes 1M --capacity-bytes 8M" "--engine posix --odirect --quiet" "put 4 checkpoint" >/tmp/waf-handles.args
dd if=/dev/urandom of=/tmp/waf-marker bs=1M count=1 status=none
dd if=/tmp/waf-marker of="$NS_DEV" bs=1M oflag=direct status=none
out=$(cd "$ROOT" && tools/waf-compare --drive "$NS_DEV" --erase --out /tmp/waf-handles --configs "raw key-aware" --workload /tmp/waf-handles.args --no-trace 2>&1) && rc=0 || rc=$?
expect "waf-compare refused (exit $rc)" test "$rc" -eq 1
expect "waf-compare names the configuration and the limit: $out" grep -q "key-aware places on 3 handles but $NS_DEV has 2 write streams" <<<"$out"
expect "waf-compare erased nothing" cmp -s -n 1048576 "$NS_DEV" /tmp/waf-marker
check_done
