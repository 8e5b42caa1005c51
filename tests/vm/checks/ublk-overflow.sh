#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 420
# The checkpoint-overflow alarm. tools/rawblock_writer (LMCache 0.5.6 raw_block's I/O) keeps
# adding entries with a tiny metadata region (meta_total_bytes 64K: 28 KiB of JSON per
# checkpoint) until its checkpoint no longer fits and is skipped, as LMCache skips it. fdpblk
# raises the alarm before the first skipped checkpoint: `fdpblk stats --json` shows
# overflow_risk with the checkpoint fields, the daemon log names the cause and the
# meta_total_bytes that would fit, and `fdpblk stats` prints it.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/tmp/ublk-overflow.state
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 16K --meta-total-bytes 64K)
rm -f "$STATE"
# Checks in one boot share the drive: start without LMCache checkpoints or saved fdpblk state,
# and leave none for the next check.
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT

# skipped_by ARGS...: one rawblock-writer run; prints its checkpoints_skipped (this run).
skipped_by() {
    "$RBW" --device "$DEV" "${GEOM[@]}" --engine posix --odirect --state "$STATE" -q "$@" stats \
        2>>"$OUT/overflow-writer.err" | jq .run.checkpoints_skipped
}

# stats: overflow_risk, checkpoint_seq, checkpoint_bytes, checkpoint_cap_bytes,
# checkpoint_estimate_bytes, meta_total_bytes_needed of fdpblk stats --json.
stats() {
    "$FDPBLK" stats -n 0 --json |
        jq -r '"\(.overflow_risk) \(.checkpoint_seq) \(.checkpoint_bytes) \(.checkpoint_cap_bytes) \(.checkpoint_estimate_bytes) \(.meta_total_bytes_needed)"'
}

mkdir -p /run/fdpblk && : >/run/fdpblk/daemon.log
dev=$(fdpblk_add --backing "$NS_DEV" -n 0 --engine streams --policy region "${GEOM[@]}")
expect_eq "fdpblk add" "$dev" "$DEV"
for _ in $(seq 100); do [[ -e /run/fdpblk/0.stats.json ]] && break; sleep 0.1; done

# About 230 bytes per entry: 100 entries are 80 % of the 28 KiB a checkpoint may hold.
expect_eq "first checkpoint fits (skipped)" "$(skipped_by put 100 checkpoint)" 0
sleep 1.5
wait_rounds 2
read -r risk seq bytes cap est need <<<"$(stats)"
echo "    after 100 entries: checkpoint seq $seq, $bytes of $cap bytes, next about $est"
expect_eq "no alarm at 100 entries" "$risk" false
expect_eq "checkpoint_cap_bytes" "$cap" $((32768 - 4096))

alarm_round=
skip_round=
for round in $(seq 1 12); do
    skipped_by put 4 >/dev/null
    sleep 1.2 # fdpblk's stats refresh twice a second
    wait_rounds 1
    read -r risk seq bytes cap est need <<<"$(stats)"
    if [[ $risk == true && -z $alarm_round ]]; then
        alarm_round=$round
        echo "    round $round: alarm: checkpoint seq $seq, $bytes bytes, next about $est of $cap; meta_total_bytes_needed $need"
    fi
    # LMCache's checkpoint attempt comes after the alarm state was read.
    if [[ $(skipped_by checkpoint) != 0 ]]; then
        skip_round=$round
        echo "    round $round: the writer skipped its checkpoint (next about $est bytes)"
        break
    fi
done
expect "the writer's checkpoint overflowed within 12 rounds" test -n "$skip_round"
expect "fdpblk raised the alarm (round $alarm_round) before the first skipped checkpoint (round $skip_round)" \
    test -n "$alarm_round" -a "${alarm_round:-99}" -le "${skip_round:-0}"
read -r risk seq bytes cap est need <<<"$(stats)"
expect_eq "stats --json overflow_risk" "$risk" true
expect "checkpoint_estimate_bytes $est > checkpoint_cap_bytes $cap" test "$est" -gt "$cap"
expect "checkpoint_bytes $bytes <= cap" test "$bytes" -le "$cap"
expect "meta_total_bytes_needed $need > 65536" test "$need" -gt 65536
expect "the daemon log names the cause and the fix" grep -Eq "checkpoint overflow risk.*meta_total_bytes to at least [0-9]+" /run/fdpblk/daemon.log
grep -m1 "checkpoint overflow risk" /run/fdpblk/daemon.log | sed 's/^/    log: /' | cut -c1-400
expect "fdpblk stats prints it" bash -c "'$FDPBLK' stats -n 0 | grep -q 'OVERFLOW RISK'"
expect "the writer logged LMCache's skip warning" grep -q "metadata payload too large" "$OUT/overflow-writer.err"
expect "fdpblk del" "$FDPBLK" del -n 0
check_done
