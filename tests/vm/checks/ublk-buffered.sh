#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 300
# LMCache's non-MP default: buffered writes and no fsync, and the non-MP plugin's keys
# (CacheEngineKey; here each chunk as two layer keys, which share the chunk hash's identity). The kernel writes the page cache
# back when it likes and in its own order (here: pages dirty for 0.2 s, the flusher every
# 0.1 s), so slot headers, payloads, checkpoint JSON and checkpoint headers reach fdpblk
# reordered and interleaved with its state thread's work. With deallocation on (early tails
# and early evictions, the defaults), after LMCache's last checkpoint and a sync: fdpblk
# follows that checkpoint and deallocated evicted slots, a buffered read of the checkpoint
# header blocks reaches fdpblk although LMCache's writes cached them, and a reopen recovers
# every entry of LMCache's index and each one verifies (nothing live was deallocated).
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/tmp/ublk-buffered.state
WRITER_PREFIX=buffered
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
rm -f "$STATE"
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
trap 'writeback_restore; "$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT
writeback_set 20 10

dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough "${GEOM[@]}")
expect_eq "fdpblk add" "$dev" "$DEV"

# The non-MP plugin's keys, each chunk as two layer keys (`bwriter`'s runs).
BWRITER_ARGS=(--namespace legacy --key-layers 2)

# Eight rounds of puts (a third with partial last chunks), evictions, re-puts and a
# checkpoint; the writeback of one round overlaps the next. LMCache holds the device open
# for its whole life: held here too, the last close of each writer run does not write the
# page cache back (in offset order) and drop it, and writeback goes by the timers above.
exec 3<>"$DEV"
for r in $(seq 8); do
    bwriter "round-$r" put 10 --partial-every 3 delete 4 --random reput 2 checkpoint
    sleep 0.15
done
seq=$(wfield round-8 index.seq) live=$(wfield round-8 index.live)
expect "LMCache's index: $live entries, checkpoint seq $seq" test "$seq" -ge 8 -a "$live" -gt 0
before=$(written_bytes 0)
expect "the page cache was written back during the rounds ($before bytes before the sync)" test "${before:-0}" -gt 0
sync
wait_stat checkpoint_seq "$seq"
wait_stat checkpoint_stalled false
# This kernel's writeback delay as set above (0.2 s + 0.1 s), against LMCache's interval here
# (the rounds'); when they say the interval is within it, the log carries the warning.
wait_stat writeback_delay_s 0.3
if [[ $(dev_stat writeback_risk) == true ]]; then
    expect "writeback_risk: the warning is in fdpblk's log" log_has "may hold a dirty page back"
else
    # (stats rounds the interval to 0.1 s: one just above 0.3 s reads 0.3)
    expect "no writeback_risk: the interval ($(dev_stat checkpoint_interval_s) s) is above 0.3 s" \
        bash -c "\"$FDPBLK\" stats -n 0 --json | jq -e '.checkpoint_interval_s >= 0.3' >/dev/null"
fi
poll_eq "evicted slots deallocated" true bash -c "[[ \$($FDPBLK stats -n 0 --json | jq .trim.trims) -gt 0 ]] && echo true"
echo "    fdpblk: $("$FDPBLK" stats -n 0 --json | jq -c '{header_waits: .pipeline.header_waits, payload_fallbacks: .pipeline.payload_fallbacks, trims: .trim.trims, early_evictions: .trim.early_evictions, tail_trims: .trim.tail_trims, early_tail_trims: .trim.early_tail_trims}')"
expect_eq "no error in fdpblk's log since the check began" "$(daemon_errors)" 0
# Early evictions zero the older container's header and drop it from the page cache, which
# LMCache's buffered writes filled; a page left there (a large folio around it) stops them.
expect "early evictions happened ($(dev_stat trim.early_evictions))" test "$(dev_stat trim.early_evictions)" -gt 0
expect "no checkpoint header page stayed cached after a drop" log_lacks 'stayed cached'

# A LMCache opening the device reads the checkpoint header blocks, which its own buffered
# checkpoint writes left in the page cache (the device is still held open). fdpblk drops them
# from the cache once a second, so the read reaches it and early tails wait for LMCache's
# next checkpoint (a restarted LMCache may use another slot size). The newest container's:
# the older one's fdpblk zeroed (early evictions) and dropped from the cache anyway.
poll_eq "LMCache's checkpoint through fdpblk vouches for the layout" true dev_stat trim.layout_in_use
newest=$(dev_stat containers | jq '[.[] | select(.state == "valid")] | max_by(.seq) | .copy')
expect "the newest checkpoint's container: $newest" test "$newest" = 0 -o "$newest" = 1
# Containers are half the 1 MiB metadata region each; buffered, one 4 KiB header block. A read
# before the next drop is served by the cache, so it is repeated (without the drops every
# one is).
poll_eq "a buffered read of the newest checkpoint header reached fdpblk" false bash -c \
    "dd if='$DEV' of=/dev/null bs=4K count=1 skip=$((newest * 128)) status=none; '$FDPBLK' stats -n 0 --json | jq -c .trim.layout_in_use"

exec 3<&-

# A new LMCache process (O_DIRECT reads: what is on the drive) loads and verifies the index.
writer reopen reopen verify
expect_eq "reopen: entries recovered" "$(wfield reopen run.recovered)" "$live"
expect_eq "reopen: dropped by the slot header check" "$(wfield reopen run.recovery_dropped)" 0
expect_eq "reopen: recovered index equals the writer's" "$(wfield reopen index.reopen_matches_previous)" true
expect_eq "reopen: entries verified" "$(wfield reopen run.verified)" "$live"
expect "del" "$FDPBLK" del -n 0
# A stop removes the device's node before the state thread hears of it: a round in between
# finds it gone, which is no reason to warn (a debug line; the last round does not try).
daemons_gone || true
expect "no page-cache warning at the stop" log_lacks "from the page cache"
check_done
