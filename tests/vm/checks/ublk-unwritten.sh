#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 300
# A drive that held data before (a fill of its data region): fdpblk takes it for the first
# time, so it marks every slot no checkpoint lists, and once LMCache (tools/rawblock_writer)
# committed a checkpoint through it, deallocates the marked slots LMCache has not written:
# they read back as zeroes on the namespace, the written ones keep their data and every entry
# verifies. Nothing goes before that first checkpoint. A clean del + add keeps the state (the
# slots stay deallocated, no new marks); the writer's later puts land and verify. Then a
# lost write under the saved state (its pages put back as the first stop left them) is told
# by the page digest: the state loads untrusted, and inspect and stats say why.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq dd cmp blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/tmp/ublk-unwritten.state
WRITER_PREFIX=unwritten
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
FILLED=64
rm -f "$STATE"
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true; blkdiscard -o $((1 << 20)) -l $((FILLED << 16)) "$NS_DEV" || true' EXIT
# The fill: slots 0..FILLED-1 (at 1 MiB + s * 64 KiB) hold 0xa5 bytes.
head -c $((FILLED << 16)) /dev/zero | tr '\0' '\245' | dd of="$NS_DEV" bs=64K seek=16 oflag=direct status=none ||
    check_fatal "filling the data region"

# zero_slots FROM TO: how many of slots FROM..TO-1 read back as zeroes on the namespace.
zero_slots() {
    local s n=0
    for ((s = $1; s < $2; s++)); do
        cmp -s <(dd if="$NS_DEV" bs=64K skip=$((16 + s)) count=1 iflag=direct status=none) <(head -c 65536 /dev/zero) && n=$((n + 1))
    done
    echo "$n"
}

dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough --policy region "${GEOM[@]}")
expect_eq "add" "$dev" "$DEV"
wait_stat trim.reclaim_enabled true # the new daemon's first stats
writer fill put 8
sleep 2
wait_rounds 2
expect_eq "nothing goes before LMCache's first checkpoint" "$(dev_stat trim.reclaimed)" 0
expect_eq "the fill is still there" "$(zero_slots 8 $FILLED)" 0
writer ckpt checkpoint
wait_stat checkpoint_seq 1
for _ in $(seq 60); do [[ $(dev_stat trim.reclaimed) -gt 0 ]] && break; sleep 0.25; done
n=$(dev_stat trim.reclaimed)
expect "unwritten slots deallocated ($n)" test "$n" -ge $((FILLED - 8))
expect_eq "the fill's unwritten slots read back as zeroes" "$(zero_slots 8 $FILLED)" $((FILLED - 8))
expect_eq "the 8 written slots do not" "$(zero_slots 0 8)" 0
writer verify1 verify
expect_eq "every entry verifies" "$(wfield verify1 run.verified)" 8
expect "del" "$FDPBLK" del -n 0
# The saved state's pages as this clean stop left them (for the lost-write step at the end).
tail_at=$("$FDPBLK" inspect "$NS_DEV" "${GEOM[@]}" --json | jq -r .fdpblk_state.region_offset)
[[ $tail_at =~ ^[0-9]+$ ]] || check_fatal "inspect: no fdpblk_state.region_offset ($tail_at)"
pages_at=$((tail_at + 8192))
dd if="$NS_DEV" of=/tmp/unwritten-pages bs=1M skip="$pages_at" iflag=direct,skip_bytes status=none ||
    check_fatal "saving the state's pages"
dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough --policy region "${GEOM[@]}")
poll_eq "add again (the saved state loads clean)" true dev_stat own_state.loaded_clean
writer more reopen put 4 checkpoint verify
wait_stat checkpoint_seq 2
# The unwritten-slot pass runs in the rounds after a checkpoint (one a second): watch several.
reclaimed=0
for _ in $(seq 20); do
    reclaimed=$(dev_stat trim.reclaimed)
    ((reclaimed == 0)) || break
    sleep 0.25
done
if ((reclaimed == 0)); then
    wait_rounds 3
    reclaimed=$(dev_stat trim.reclaimed)
fi
expect_eq "the restarted daemon marked nothing new (over 5 s of rounds)" "$reclaimed" 0
expect_eq "every entry verifies after the restart" "$(wfield more run.verified)" 12
expect_eq "the 12 written slots hold data" "$(zero_slots 0 12)" 0
expect "del" "$FDPBLK" del -n 0
# A drive that loses the page writes of that run although it acknowledged their flushes: the
# pages are back as the first stop left them, under this stop's clean superblocks. The page
# digest tells: inspect and the next start say the state is not trusted, and why.
dd if=/tmp/unwritten-pages of="$NS_DEV" bs=1M seek="$pages_at" oflag=direct,seek_bytes status=none ||
    check_fatal "putting the older pages back"
state=$("$FDPBLK" inspect "$NS_DEV" "${GEOM[@]}" --json | jq -c '.fdpblk_state | [.clean, .trusted, (.note // "" | test("not the versions its superblock committed"))]')
expect_eq "inspect: a clean superblock, not trusted, saying why" "$state" '[true,false,true]'
dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough --policy region "${GEOM[@]}")
poll_eq "add again: the saved state loads untrusted" false dev_stat own_state.loaded_clean
expect "stats say why" bash -c "$FDPBLK stats -n 0 | grep -q 'loaded, its confirmations not trusted: the saved state.s pages are not the versions its superblock committed'"
expect "del" "$FDPBLK" del -n 0
check_done
