#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: lifecycle
# vm-timeout: 480
# fdpblk deallocates the slots LMCache evicted. tools/rawblock_writer (LMCache 0.5.6
# raw_block's I/O) puts, deletes and checkpoints through /dev/ublkb0; once two committed
# checkpoints no longer list a slot, the slot reads back as zeroes (through /dev/ublkb0 and
# on the namespace), every live entry still verifies, and fdpblk stats counts the trims on
# the slots' handle; with the passthrough engine and the streams engine. fdpblk's own state
# goes to its own placement ID. fdpblk is killed
# (SIGKILL) and recovered, the writer restarts (reopens from the device): the slot table,
# the identity history and the counters come back, and later evictions are deallocated
# again. A clean del + add keeps them too. Stale tails behind partial payloads are
# deallocated before a checkpoint confirms the puts once their headers are durable and one
# checkpoint written after them was read back (early tails), after LMCache's first
# checkpoint through this fdpblk. With the
# passthrough engine evicted slots go once the newest checkpoint lacks them (early evictions:
# the older checkpoint container's header zeroed, then the slots deallocated); the streams
# engine runs with --no-early-evictions and waits for both containers. Last, LMCache crashes
# with puts after its last checkpoint: restarted, it forgets them and reuses their slots for
# other keys, and every entry still verifies and reopens; fdpblk warns that the restart lost them.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq nvme dd cmp blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/tmp/ublk-trim.state
WRITER_PREFIX=trim
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
rm -f "$STATE"
# Checks in one boot share the drive: start without LMCache checkpoints or saved fdpblk state,
# and leave none for the next check.
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT

# free_zero DEV: "Z/F": of the writer's F free slots (all written once), Z read back as zeroes
# (O_DIRECT reads: no page cache in between). Slot s is at 1 MiB + s * 64 KiB.
free_zero() {
    local s zero=0 n=0
    for s in $(jq -r '.free[]' "$STATE"); do
        n=$((n + 1))
        cmp -s <(dd if="$1" bs=64K skip=$((16 + s)) count=1 iflag=direct status=none) <(head -c 65536 /dev/zero) &&
            zero=$((zero + 1))
    done
    echo "$zero/$n"
}

add_device() {
    local dev
    dev=$(fdpblk_add -n 0 --policy region "$@")
    expect_eq "fdpblk add $*" "$dev" "$DEV"
    for _ in $(seq 100); do [[ -b $DEV && -e /run/fdpblk/0.stats.json ]] && return 0; sleep 0.1; done
    check_fatal "$DEV or its stats did not appear"
}

# evictions ENGINE: puts, evictions and their deallocation on a freshly added device
# (passthrough: early evictions, the default; streams: --no-early-evictions).
evictions() {
    local e=$1 r0 used3 own host inspect
    r0=$(ruamw) || check_fatal "nvme fdp status failed"
    if [[ $e == passthrough ]]; then
        add_device --backing "$NG_DEV" --engine passthrough "${GEOM[@]}"
        expect_eq "$e: early evictions on by default" "$(dev_stat trim.early_evictions_enabled)" true
    else
        add_device --backing "$NS_DEV" --engine streams --no-early-evictions "${GEOM[@]}"
        expect_eq "$e: --no-early-evictions: off in the stats" "$(dev_stat trim.early_evictions_enabled)" false
    fi
    expect_eq "$e: deallocation on by default" "$(dev_stat trim.enabled)" true
    # 24 puts, then a second checkpoint: the 24 are confirmed (listed with their identity by a
    # checkpoint taken after a checkpoint that followed their writes).
    # Every third put is a partial last chunk: its slot has a stale tail past the payload.
    writer "$e-fill" put 24 --partial-every=3 checkpoint put 2 checkpoint
    wait_stat checkpoint_seq 2
    wait_stat slots.live 24
    # The partial slots' tails are deallocated (the live payloads verify below).
    for _ in $(seq 120); do [[ $(dev_stat trim.tail_trims) -gt 0 ]] && break; sleep 0.25; done
    expect "$e: stale tails of partial slots deallocated ($(dev_stat trim.tail_trims))" test "$(dev_stat trim.tail_trims)" -gt 0
    # Delete the 8 oldest: the next checkpoint (seq 3, container 0) lacks them but container 1
    # (seq 2) still lists them; after seq 4 (container 1) neither does.
    # A reader through the page cache (the device held open, so the cache outlives each
    # reader) has container 1's header (seq 2) cached: fdpblk's zeroing must drop it.
    local held=
    if [[ $e == passthrough ]]; then
        exec {held}<"$DEV"
        expect_eq "$e: container 1 (seq 2) read through the page cache" \
            "$(dd if="$DEV" bs=4K skip=128 count=1 status=none | head -c 8 | tr -d '\0')" LMCIDX01
    fi
    writer "$e-evict" delete 8 checkpoint
    wait_stat checkpoint_seq 3
    local gone=8
    if [[ $e == passthrough ]]; then
        # Early evictions: seq 3, the checkpoint written last, lacks them.
        wait_stat trim.early_evictions 8
        expect_eq "$e: early evictions once the newest checkpoint lacks the slots" "$(dev_stat trim.trims)" 8
        expect_eq "$e: container 1 zeroed, also through the page cache" \
            "$(dd if="$DEV" bs=4K skip=128 count=1 status=none | head -c 8 | tr -d '\0')" ""
        exec {held}<&-
        gone=9
    else
        wait_rounds 2
        expect_eq "$e: nothing deallocated while one container still lists the slots" "$(dev_stat trim.trims)" 0
    fi
    writer "$e-evict2" delete 1 checkpoint
    wait_stat checkpoint_seq 4
    wait_stat trim.trims $gone
    wait_stat trim.handles "{\"2\":$gone}"
    wait_stat slots.trimmed $gone
    wait_stat slots.evicted $((9 - gone))
    expect_eq "$e: evicted slots read zeroes through $DEV (zeroed/free)" "$(free_zero "$DEV")" "$gone/9"
    expect_eq "$e: and on $NS_DEV" "$(free_zero "$NS_DEV")" "$gone/9"
    # Containers of 512 KiB at 0 and 512 KiB: seq 4 is in container 1, seq 3 in container 0.
    local c0 c1
    c0=$(dd if="$DEV" bs=4K count=1 iflag=direct status=none | head -c 8 | tr -d '\0')
    c1=$(dd if="$DEV" bs=4K skip=128 count=1 iflag=direct status=none | head -c 8)
    expect_eq "$e: container 1 holds the newest checkpoint" "$c1" LMCIDX01
    if [[ $e == passthrough ]]; then
        expect_eq "$e: the older container was zeroed (after seq 3 and after seq 4)" "$(dev_stat trim.containers_invalidated)" 2
        expect_eq "$e: container 0 reads zeroes" "$c0" ""
    else
        expect_eq "$e: --no-early-evictions leaves the older container alone" "$(dev_stat trim.containers_invalidated)" 0
        expect_eq "$e: container 0 holds seq 3" "$c0" LMCIDX01
    fi
    # Own state: written within a persist interval (5 s) of the changes below (the verify's
    # loads are saved), on placement ID 3 (handle OwnState). The baseline comes first: a
    # persist between the verify and a later baseline would leave nothing to save.
    seq=$(dev_stat own_state.seq)
    writer "$e-verify" verify
    expect_eq "$e: every live entry verifies" "$(wfield "$e-verify" run.verified)" 17
    for _ in $(seq 40); do
        (($(dev_stat own_state.seq) > seq)) && break
        sleep 0.25
    done
    expect "$e: a persist cycle within 10 s (seq $seq -> $(dev_stat own_state.seq))" test "$(dev_stat own_state.seq)" -gt "$seq"
    used3=$(ruamw_used "$r0" "$(ruamw)" 3)
    expect "$e: own state on placement ID 3 ($used3 blocks)" test "$used3" -gt 0
    own=$(dev_stat own_state.bytes_written)
    host=$(dev_stat pipeline.ops.write.bytes)
    echo "    $e: own state: $own bytes written for $host host bytes"
    inspect=$("$FDPBLK" inspect "$NS_DEV" --json | jq -r '.fdpblk_state | "\(.slots.with_header) \(.slots.trimmed) \(.trims) \(.identity_history >= 9)"')
    expect_eq "$e: fdpblk inspect $NS_DEV: slots, trimmed, trims, history >= 9" "$inspect" "26 $gone $gone true"
}

# The passthrough engine (NVMe commands on $NG_DEV) first, then the streams engine, which
# goes on through a crash and a clean restart.
evictions passthrough
expect "fdpblk del" "$FDPBLK" del -n 0
fdpblk_fresh_drive || check_fatal "blkdiscard"
rm -f "$STATE"
evictions streams

# fdpblk crashes and is recovered; LMCache (the writer) restarts and reopens the device.
old=$(daemon_pid 0)
expect "SIGKILL fdpblk ($old)" kill -9 "$old"
if "$FDPBLK" recover -n 0 >"$OUT/trim-recover.log" 2>&1; then ok "fdpblk recover"; else
    cat "$OUT/trim-recover.log" /run/fdpblk/daemon.log
    not_ok "fdpblk recover"
fi
for _ in $(seq 40); do [[ $(daemon_pid 0) != "$old" ]] && break; sleep 0.25; done
wait_stat own_state.loaded true
wait_stat own_state.loaded_clean false
wait_stat slots.with_header 26
wait_stat trim.trims 8
wait_stat slots.trimmed 8
hist=$(dev_stat slots.identity_history)
expect "identity history back ($hist >= 9)" test "$hist" -ge 9
writer reopen reopen verify
expect_eq "reopen: entries recovered" "$(wfield reopen run.recovered)" 17
expect_eq "reopen: entries verified" "$(wfield reopen run.verified)" 17
# After an unclean stop, contents are confirmed again by the second checkpoint; evictions
# after that are deallocated (the eviction pending at the crash is forgotten: a missed trim,
# never a wrong one). One checkpoint at a time, as LMCache (at least 1 s apart): fdpblk reads
# each back before the next overwrites its container.
writer again1 delete 1 checkpoint
wait_stat checkpoint_seq 5
writer again2 delete 1 checkpoint
wait_stat checkpoint_seq 6
writer again3 delete 4 checkpoint
wait_stat checkpoint_seq 7
writer again delete 1 checkpoint verify
wait_stat checkpoint_seq 8
wait_stat trim.trims 12
expect_eq "evicted slots read zeroes (zeroed/free)" "$(free_zero "$DEV")" "12/16"
expect_eq "every live entry verifies" "$(wfield again run.verified)" 10

# A clean stop keeps everything, confirmations included.
expect "fdpblk del" "$FDPBLK" del -n 0
add_device --backing "$NS_DEV" --engine streams
wait_stat own_state.loaded_clean true
wait_stat trim.trims 12
wait_stat slots.with_header 26
writer clean reopen verify
expect_eq "after del + add: entries verified" "$(wfield clean run.verified)" 10
# Early tails start once LMCache has checkpointed through this fdpblk with its geometry (a
# LMCache restarted with another slot size would otherwise have its headers read with the old).
# (LMCache checkpoints only a changed index: one delete.)
writer clean-ckpt delete 1 checkpoint
wait_stat checkpoint_seq 9

# Early tails: with the index emptied (deletes do no I/O), 3 full chunks, deleted again and
# replaced by 3 partial last chunks, which reuse their slots (LIFO) and leave the full
# payloads' last blocks stale behind them. fdpblk deallocates those once each new header's
# write completed and the drive was flushed, and a checkpoint written after the puts was read
# back (LMCache snapshots before it writes: the one in flight could still list a slot's
# earlier key), before a second checkpoint confirms the puts. The older container, which
# lists the slots' earlier (longer) entries, goes by early evictions at that checkpoint.
seq0=$(dev_stat checkpoint_seq)
early0=$(dev_stat trim.early_tail_trims)
writer early-full delete 9 put 3
writer early-partial delete 3 put 3 --partial-every 1
# A partial payload has a tail when it ends before the slot's last 4 KiB block (the writer's
# partial lengths are random, from its fixed seed). Slot s is at 1 MiB + s * 64 KiB, its
# payload after a 4 KiB header.
tails=0
while read -r slot size; do
    [[ $((1 + (size + 4095) / 4096)) -lt 16 ]] && tails=$((tails + 1))
done < <(jq -r '.entries[-3:][] | "\(.slot) \(.size)"' "$STATE")
expect "early tails: the partial puts have tails ($tails of 3)" test "$tails" -ge 1
sleep 3 # three rounds of the state thread
wait_rounds 2 # however slow the guest
expect_eq "early tails: none before a checkpoint written after the puts" "$(dev_stat trim.early_tail_trims)" "$early0"
writer early-ckpt checkpoint
wait_stat checkpoint_seq $((seq0 + 1))
for _ in $(seq 120); do [[ $(dev_stat trim.early_tail_trims) -ge $((early0 + tails)) ]] && break; sleep 0.25; done
expect "early tails: $tails deallocated ($early0 -> $(dev_stat trim.early_tail_trims))" \
    test "$(dev_stat trim.early_tail_trims)" -ge $((early0 + tails))
expect_eq "early tails: before a second checkpoint" "$(dev_stat checkpoint_seq)" "$((seq0 + 1))"
# Each reads zeroes on the namespace from its payload's end (rounded up to the block) to the
# slot's end.
zeroed=0
while read -r slot size; do
    from=$((1 + (size + 4095) / 4096))
    [[ $from -lt 16 ]] || continue
    cmp -s <(dd if="$NS_DEV" bs=4K skip=$((256 + slot * 16 + from)) count=$((16 - from)) iflag=direct status=none) \
        <(head -c $(((16 - from) * 4096)) /dev/zero) && zeroed=$((zeroed + 1))
done < <(jq -r '.entries[-3:][] | "\(.slot) \(.size)"' "$STATE")
expect_eq "early tails: the stale blocks read zeroes on $NS_DEV" "$zeroed" "$tails"
writer early-verify verify
expect_eq "early tails: every live entry verifies" "$(wfield early-verify run.verified)" 3

# --no-early-tails: tails wait for a checkpoint's confirmation.
expect "fdpblk del" "$FDPBLK" del -n 0
add_device --backing "$NS_DEV" --engine streams --no-early-tails
expect_eq "--no-early-tails: off in the stats" "$(dev_stat trim.early_tails_enabled)" false
writer late put 3 delete 6 put 3 --partial-every 1
tails=0
while read -r slot size; do
    [[ $((1 + (size + 4095) / 4096)) -lt 16 ]] && tails=$((tails + 1))
done < <(jq -r '.entries[-3:][] | "\(.slot) \(.size)"' "$STATE")
expect "--no-early-tails: the partial puts have tails ($tails of 3)" test "$tails" -ge 1
sleep 3
wait_rounds 2
expect_eq "--no-early-tails: no early tail" "$(dev_stat trim.early_tail_trims)" 0
# Confirmed by the second checkpoint this fdpblk sees (the puts preceded the first). One
# checkpoint at a time, as LMCache writes them (at least 1 s apart).
writer late-ckpt checkpoint
wait_stat checkpoint_seq $((seq0 + 2))
writer late-verify put 1 checkpoint verify
wait_stat checkpoint_seq $((seq0 + 3))
# Up to 30 s: the state thread runs at its own pace, slower on a loaded host (a 10 s bound
# failed once while the host also compiled).
for _ in $(seq 120); do [[ $(dev_stat trim.tail_trims) -ge $tails ]] && break; sleep 0.25; done
expect "--no-early-tails: the $tails tails go once confirmed ($(dev_stat trim.tail_trims))" \
    test "$(dev_stat trim.tail_trims)" -ge "$tails"
expect_eq "--no-early-tails: every live entry verifies" "$(wfield late-verify run.verified)" 4
# The newest checkpoint on the drive is whole: a restarted LMCache loads all 4 entries.
writer late-reopen reopen verify
expect_eq "--no-early-tails: a reopen recovers every entry" "$(wfield late-reopen run.recovered)" 4

# LMCache crashes with puts after its last checkpoint (early tails on again): the restarted
# process loads that checkpoint, forgets the later puts and hands their slots out again (its
# bump pointer rewinds) to other keys with shorter payloads, over slots fdpblk saw written
# with other identities. Nothing live may be deallocated on the way.
expect "fdpblk del" "$FDPBLK" del -n 0
add_device --backing "$NS_DEV" --engine streams
writer crash-ckpt delete 1 checkpoint
wait_stat checkpoint_seq $((seq0 + 4))
writer crash-lost put 4
writer crash-restart reopen put 4 --partial-every 1
expect_eq "crash: the restarted LMCache recovers only its checkpoint's entries" "$(wfield crash-restart run.recovered)" 3
# fdpblk saw the restart (both checkpoint header blocks read) and says the 4 puts are lost.
lost="LMCache opened the device again (it read both checkpoint copies) after it wrote 4 slots that no checkpoint lists"
for _ in $(seq 40); do daemon_log_since_start | grep -qF "$lost" && break; sleep 0.25; done
expect "crash: fdpblk warns of the 4 puts the restart lost" grep -qF "$lost" <(daemon_log_since_start)
poll_eq "crash: and its stats count them" 4 dev_stat lmcache_lost_puts
writer crash-verify checkpoint verify
wait_stat checkpoint_seq $((seq0 + 5))
expect_eq "crash: every live entry verifies" "$(wfield crash-verify run.verified)" 7
writer crash-reopen reopen verify
expect_eq "crash: a reopen recovers every entry" "$(wfield crash-reopen run.recovered)" 7
expect_eq "crash: none dropped by the header check" "$(wfield crash-reopen run.recovery_dropped)" 0
expect_eq "crash: and each verifies" "$(wfield crash-reopen run.verified)" 7
expect_eq "crash: no error in fdpblk's log" "$(daemon_errors)" 0

# A program writing the drive while fdpblk is stopped (LMCache pointed at it, a restore)
# changes a checkpoint container: the next start takes none of the saved confirmations.
expect "fdpblk del" "$FDPBLK" del -n 0
dd if="$NS_DEV" of=/tmp/ckpt0 bs=4K count=1 iflag=direct status=none
printf '\x5a\xa5' | dd of=/tmp/ckpt0 bs=1 seek=30 conv=notrunc status=none
expect "change container 0's header on $NS_DEV" dd if=/tmp/ckpt0 of="$NS_DEV" bs=4K count=1 oflag=direct conv=notrunc status=none
add_device --backing "$NS_DEV" --engine streams
wait_stat own_state.loaded_clean false
expect "the start says the checkpoints changed while it was stopped" \
    grep -qF "LMCache's checkpoints changed while fdpblk was stopped (container 0: " <(dev_stat own_state.loaded_note)
expect "fdpblk del" "$FDPBLK" del -n 0
check_done
