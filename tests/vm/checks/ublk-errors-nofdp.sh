#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: off
# A non-FDP drive with a placement policy is refused with the fix; --policy none works.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
out=$("$FDPBLK" add --backing "$NS_DEV" --policy region --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
expect "refused (exit $rc)" test "$rc" -ne 0
expect "names the fix: $out" grep -q "offers no FDP placement.*use --policy none" <<<"$out"
expect "nothing created" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
expect "streams engine refused" bash -c "! $FDPBLK add --backing $NS_DEV --engine streams --policy none --slot-bytes 64K --meta-total-bytes 1M 2>/dev/null"
dev=$(fdpblk_add --backing "$NS_DEV" -n 0 --policy none --slot-bytes 64K --meta-total-bytes 1M)
expect_eq "policy none runs on the plain engine" "$("$FDPBLK" list --json | grep -o '"engine":"[a-z]*"')" '"engine":"plain"'
fio_verify nofdp "$dev" --rw=randwrite --bs=64k --size=16M --iodepth=8
expect "del" "$FDPBLK" del -n 0
check_done
