#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 240
# fdpblk add with no layout flags on a blank drive: the device starts learning (writes go
# unclassified to placement ID 0, `list` and `stats` say so), LMCache's first checkpoint
# (tools/rawblock_writer) tells the layout, and from then on checkpoint bytes land on PID 1
# and slot bytes on PID 2 (RUAMW) while every entry verifies; fdpblk list shows the learned
# geometry. The same with the passthrough engine after a SIGKILL + recover while learning.
# Then: a clean state saved by an earlier run is marked in use before a learning daemon serves,
# and a daemon recovered after the learner missed LMCache's checkpoint counts its layout learned.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq nvme blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/var/tmp/ublk-learn.state
WRITER_PREFIX=learn
OUT=${FDPBLK_CHECK_OUT:-/var/tmp}
# The writer (LMCache) knows its geometry; fdpblk is not told.
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT

# learn ENGINE BACKING KILL: a blank drive, add without layout flags, LMCache's first puts and
# checkpoint, then placement by the learned layout. KILL=1: SIGKILL + recover while learning.
learn() {
    local e=$1 backing=$2 kill=$3 r0 r1 r2 pid
    fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
    rm -f "$STATE"
    expect_eq "$e: add without layout flags on a blank drive" \
        "$(fdpblk_add -n 0 --backing "$backing" --engine "$e" --policy region)" "$DEV"
    wait_stat layout.state '"learning"'
    expect_eq "$e: fdpblk list says learning" "$("$FDPBLK" list | grep -c 'slot_bytes learning')" 1
    expect "$e: fdpblk stats says learning" bash -c "'$FDPBLK' stats -n 0 | grep -q '^LAYOUT LEARNING: no LMCache checkpoint seen yet'"
    expect "$e: and its metric" bash -c "'$FDPBLK' stats -n 0 --prometheus | grep -q '^fdpblk_layout_learning{.*} 1\$'"
    if ((kill)); then
        pid=$(daemon_pid 0)
        kill -9 "$pid"
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        if "$FDPBLK" recover -n 0 >"$OUT/learn-recover.log" 2>&1; then ok "$e: recover while learning"; else
            cat "$OUT/learn-recover.log" /run/fdpblk/daemon.log
            check_fatal "$e: recover while learning"
        fi
        wait_stat layout.state '"learning"'
    fi
    r0=$(ruamw) || check_fatal "nvme fdp status failed"
    # Before LMCache's first checkpoint: nothing is classified; everything on PID 0.
    writer "$e-first" put 8
    r1=$(ruamw)
    expect "$e: first puts on PID 0 ($(ruamw_used "$r0" "$r1" 0) blocks)" test "$(ruamw_used "$r0" "$r1" 0)" -gt 0
    expect_eq "$e: and not on PIDs 1 and 2" "$(ruamw_used "$r0" "$r1" 1) $(ruamw_used "$r0" "$r1" 2)" "0 0"
    writer "$e-ckpt" checkpoint
    wait_stat layout.state '"learned"'
    expect "$e: learned: the metric is 0" bash -c "'$FDPBLK' stats -n 0 --prometheus | grep -q '^fdpblk_layout_learning{.*} 0\$'"
    expect "$e: learned: stats no longer says learning" bash -c "! '$FDPBLK' stats -n 0 | grep -q 'LAYOUT LEARNING'"
    wait_stat geometry.slot_bytes 65536
    wait_stat geometry.meta_total_bytes 1048576
    expect "$e: writes before the layout counted ($(dev_stat layout.writes_before_layout))" test "$(dev_stat layout.writes_before_layout)" -ge 9
    # The state file `list` reads is rewritten after the learned layout's first read-back.
    poll_eq "$e: fdpblk list shows the learned geometry" 65536 bash -c "'$FDPBLK' list --json | jq -c '.[0].geometry.slot_bytes'"
    # From now on: placed by the layout.
    r1=$(ruamw)
    writer "$e-placed" put 8 --partial-every 3 checkpoint verify
    r2=$(ruamw)
    expect "$e: checkpoint bytes on PID 1 ($(ruamw_used "$r1" "$r2" 1) blocks)" test "$(ruamw_used "$r1" "$r2" 1)" -gt 0
    expect "$e: slot bytes on PID 2 ($(ruamw_used "$r1" "$r2" 2) blocks)" test "$(ruamw_used "$r1" "$r2" 2)" -ge 8
    expect_eq "$e: no LMCache bytes unclassified (PID 0)" "$(ruamw_used "$r1" "$r2" 0)" 0
    expect_eq "$e: every entry verifies" "$(wfield "$e-placed" run.verified)" 16
    expect_eq "$e: payload placed without its header" "$(dev_stat pipeline.payload_fallbacks)" 0
    "$FDPBLK" del -n 0 >/dev/null 2>&1 || not_ok "$e: fdpblk del"
}

learn streams "$NS_DEV" 0
learn passthrough "$NG_DEV" 1

# A clean saved state from an earlier run, and no checkpoint on the drive (LMCache's metadata
# region erased): the learning daemon serves writes its state thread does not follow yet, so
# it marks that state in use before it serves (a crash while learning must not leave it
# trusted).
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
rm -f "$STATE"
expect_eq "add with layout flags" "$(fdpblk_add -n 0 --backing "$NS_DEV" --engine streams "${GEOM[@]}")" "$DEV"
writer saved put 4
wait_stat own_state.persisted true
"$FDPBLK" del -n 0 >/dev/null 2>&1 || not_ok "fdpblk del"
expect_eq "a clean state saved at del" "$("$FDPBLK" inspect "$NS_DEV" "${GEOM[@]}" --json | jq -c .fdpblk_state.clean)" true
blkdiscard -o 0 -l $((1 << 20)) "$NS_DEV" || check_fatal "blkdiscard of the metadata region"
rm -f "$STATE"
expect_eq "add without layout flags: learning" "$(fdpblk_add -n 0 --backing "$NS_DEV" --engine streams)" "$DEV"
wait_stat layout.state '"learning"'
expect_eq "the saved state is marked in use while learning" "$("$FDPBLK" inspect "$NS_DEV" "${GEOM[@]}" --json | jq -c .fdpblk_state.clean)" false
expect "the daemon says so" log_has "marked in use until the layout is learned"
# The learning daemon dies before it sees LMCache's first checkpoint (written here straight
# to the namespace, as if it completed just before the kill): the recovered daemon finds the
# layout at its start, and counts it as learned, not given (no saved confirmation trusted,
# every slot possibly written unseen), whatever the earlier daemon's mark.
pid=$(daemon_pid 0)
kill -9 "$pid"
for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
DEV=$NS_DEV STATE=/var/tmp/ublk-learn-direct.state writer direct put 2 checkpoint
rm -f /var/tmp/ublk-learn-direct.state
if "$FDPBLK" recover -n 0 >"$OUT/learn-recover2.log" 2>&1; then ok "recover after a checkpoint the learner missed"; else
    cat "$OUT/learn-recover2.log" /run/fdpblk/daemon.log
    check_fatal "recover after a checkpoint the learner missed"
fi
# (Polled: the stats file is the killed daemon's until the new one's first round.)
wait_stat geometry.slot_bytes 65536
expect_eq "the layout found at the recovery counts as learned" "$(dev_stat layout.state)" '"learned"'
"$FDPBLK" del -n 0 >/dev/null 2>&1 || not_ok "fdpblk del"

check_done
