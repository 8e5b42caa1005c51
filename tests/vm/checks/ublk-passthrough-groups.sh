#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-args: --nrg 2
# An FDP configuration with two reclaim groups lists a placement ID per (handle, group), two
# per handle: a placement policy is refused with the fix on passthrough (taking the first IDs
# would put two logical handles on one reclaim unit handle), the kernel offers no write
# streams for it, and policy none runs with fio verify.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio
need_tool jq
cfg=$(nvme fdp configs "$CTRL_DEV" -e 1 -o json) || check_fatal "nvme fdp configs failed"
expect_eq "the drive has 2 reclaim groups" "$(jq '.configs[0].nrg' <<<"$cfg")" 2
pids=$("$FDPBLK" fdp status "$NS_DEV" --json | jq -c '.placement_ids')
expect "more placement IDs than handles: $pids" test "$(jq length <<<"$pids")" -gt "$FDPBLK_VM_NRUH"
out=$("$FDPBLK" add --backing "$NG_DEV" --engine passthrough --policy region --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
expect "region refused (exit $rc)" test "$rc" -ne 0
expect "names the fix: $out" grep -q "2 reclaim groups.*use --policy none" <<<"$out"
expect "nothing created" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
out=$("$FDPBLK" add --backing "$NS_DEV" --engine streams --policy region --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
expect "streams refused (exit $rc)" test "$rc" -ne 0
expect "streams: names the fix: $out" grep -q "no write streams.*one reclaim group" <<<"$out"
dev=$(fdpblk_add --backing "$NG_DEV" -n 0 --engine passthrough --policy none --slot-bytes 64K --meta-total-bytes 1M)
expect_eq "policy none: no placement IDs" "$("$FDPBLK" list --json | grep -o '"pids":\[[0-9,]*\]')" '"pids":[]'
fio_verify pt-groups "$dev" --rw=randwrite --bs=64k --size=16M --iodepth=8
expect "del" "$FDPBLK" del -n 0
check_done
