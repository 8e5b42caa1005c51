#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-args: --lba-ms 8
# The passthrough engine on a namespace formatted with 8 bytes of metadata per block (in a
# separate buffer), which its data-only commands cannot serve: refused with the fix, under a
# placement policy and under none, and nothing is created. The fix it names runs: the
# streams engine on the block device, where the kernel handles the metadata, with fio verify.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio
expect_eq "namespace format has metadata" "$FDPBLK_VM_LBA_MS" 8
for policy in region none; do
    out=$("$FDPBLK" add --backing "$NG_DEV" --engine passthrough --policy "$policy" --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
    expect "policy $policy: refused (exit $rc)" test "$rc" -ne 0
    expect "policy $policy: names the metadata and the fix: $out" grep -q "formatted with 8 bytes of metadata per block.*reformat it.*--engine streams or plain" <<<"$out"
    expect "policy $policy: one line" test "$(wc -l <<<"$out")" -eq 1
    expect "policy $policy: nothing created" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
done
dev=$(fdpblk_add --backing "$NS_DEV" -n 0 --engine streams --policy region --slot-bytes 64K --meta-total-bytes 1M)
expect_eq "streams on the block device: device" "$dev" /dev/ublkb0
fio_verify streams-metadata "$dev" --rw=randwrite --bs=64k --size=16M --iodepth=8
expect "del" "$FDPBLK" del -n 0
check_done
