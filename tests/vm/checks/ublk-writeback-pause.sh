#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 300
# A kernel that may hold a dirty page back longer than LMCache's checkpoint interval (here
# vm.dirty_expire_centisecs 60 s against checkpoints about a second apart). With LMCache's
# writes buffered (its non-MP default), a checkpoint header could reach the drive after later
# slot writes, which fdpblk's deallocation assumes it does not: fdpblk sees the device's dirty
# pages and pauses deallocation, says why in `stats` and its log, and resumes once the delay is
# below the interval again; every entry still verifies. The pause is saved with fdpblk's
# state: a daemon killed while paused is recovered paused, before it has seen an interval of
# its own. With O_DIRECT writes (MP mode), which leave no dirty pages, the same settings pause
# nothing. A fresh daemon that has not yet seen the intervals it judges the risk by pauses
# where it sees buffered writes, from its start.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/tmp/ublk-writeback-pause.state
WRITER_PREFIX=wbpause
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
rm -f "$STATE"
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
trap 'exec 3<&- 2>/dev/null; writeback_restore; "$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT
writeback_set 6000 10

trims() { dev_stat trim.trims; }
# deallocated: evicted slots, stale tails and early tails, as one number.
deallocated() { "$FDPBLK" stats -n 0 --json | jq '.trim.trims + .trim.tail_trims + .trim.early_tail_trims'; }

# O_DIRECT: six checkpoints about a second apart, so the risk is flagged (the first interval
# after the start is not counted, then three are waited for).
dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough "${GEOM[@]}")
expect_eq "fdpblk add" "$dev" "$DEV"
for r in $(seq 6); do
    writer "direct-$r" put 3 checkpoint
    sleep 0.2
done
poll_eq "O_DIRECT: writeback_risk (delay $(dev_stat writeback_delay_s) s, interval $(dev_stat checkpoint_interval_s) s)" true dev_stat writeback_risk
sleep 2 # a few rounds that look at the page cache
wait_rounds 2
expect_eq "O_DIRECT: deallocation not paused" "$(dev_stat trim.paused_by)" null
# The oldest keys (confirmed by the later checkpoints) evicted under the risk still go.
t0=$(trims)
writer direct-evict delete 3 checkpoint
writer direct-after put 1 checkpoint
poll_eq "O_DIRECT: evicted slots deallocated under the risk" true bash -c "[[ \$($FDPBLK stats -n 0 --json | jq .trim.trims) -gt $t0 ]] && echo true || echo false"
expect "O_DIRECT: nothing said of a pause" log_lacks "deallocation paused"
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
rm -f "$STATE"

# Buffered, before fdpblk has seen the 3 checkpoint intervals it judges the risk by: a
# fresh daemon cannot tell LMCache's interval from the kernel's 60 s delay yet, so puts left
# dirty pause deallocation from the start (an expected state, logged as information).
dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough "${GEOM[@]}")
expect_eq "fdpblk add (buffered, not yet judged)" "$dev" "$DEV"
exec 3<>"$DEV"
bwriter early put 2 checkpoint
poll_eq "not yet judged: deallocation paused" true bash -c "$FDPBLK stats -n 0 --json | jq -c '(.trim.paused_by // \"\") | test(\"of the 3 checkpoint intervals\")'"
expect "the daemon logged why, as information" log_has "INFO.*deallocation paused: LMCache writes through the page cache, and fdpblk has seen 0 of the 3 checkpoint intervals"
exec 3<&-
sync
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
rm -f "$STATE"

# Buffered: LMCache holds the device open for its life (so a writer's close writes nothing
# back); a sync after each round lands its checkpoint. The rounds run under a delay below
# every interval (0.01 s + 0.01 s), so their checkpoints confirm their puts; then the 60 s
# delay, which the next checkpoint weighs.
writeback_set 1 1
dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough "${GEOM[@]}")
expect_eq "fdpblk add again" "$dev" "$DEV"
exec 3<>"$DEV"
for r in $(seq 6); do
    bwriter "buffered-$r" put 3 checkpoint
    sync
    sleep 0.2
done
expect_eq "judged below the delay: not paused" "$(dev_stat trim.paused_by)" null
writeback_set 6000 10
bwriter buffered-7 put 1 checkpoint
sync
poll_eq "buffered: writeback_risk" true dev_stat writeback_risk
# Puts left dirty in the page cache (for 60 s): the next look at it pauses deallocation.
bwriter dirty put 2
poll_eq "buffered: deallocation paused" true bash -c "$FDPBLK stats -n 0 --json | jq -c '(.trim.paused_by // \"\") | test(\"writes through the page cache\")'"
expect "the daemon logged why" log_has "deallocation paused: LMCache writes through the page cache"
expect "stats text: DEALLOCATION PAUSED" bash -c "$FDPBLK stats -n 0 | grep -q '^DEALLOCATION PAUSED: LMCache writes through the page cache'"
expect_eq "stats: allowed_now" "$(dev_stat trim.allowed_now)" false
# The oldest keys (confirmed before the pause: the risk is flagged at the eighth checkpoint,
# their puts were in the first round) are evicted, and a short put leaves a stale tail.
t0=$(trims) d0=$(deallocated)
# (Two runs apart: the risk weighs the shortest interval, and LMCache's are a tick apart.)
bwriter paused delete 3 checkpoint
sync
sleep 0.3
bwriter paused-put put 1 --partial-every 1 checkpoint
sync
wait_stat checkpoint_seq "$(wfield paused-put index.seq)"
sleep 2
wait_rounds 2
expect_eq "paused: nothing deallocated (LMCache evicted $(dev_stat slots.evicted))" "$(deallocated)" "$d0"
expect "paused: evicted slots wait" test "$(dev_stat slots.evicted)" -gt 0
# The delay below every interval again (0.01 s + 0.01 s; fdpblk times the intervals as it
# reads the checkpoints back, a little apart from LMCache's writes): the next checkpoint ends
# the pause.
writeback_set 1 1
bwriter resume put 1 checkpoint
sync
wait_stat checkpoint_seq "$(wfield resume index.seq)"
echo "    intervals: shortest $(dev_stat checkpoint_interval_shortest_s) s, average $(dev_stat checkpoint_interval_s) s, delay $(dev_stat writeback_delay_s) s, risk $(dev_stat writeback_risk)"
poll_eq "resumed: not paused" null dev_stat trim.paused_by
poll_eq "resumed: the evicted slots go" true bash -c "[[ \$($FDPBLK stats -n 0 --json | jq .trim.trims) -gt $t0 ]] && echo true || echo false"
expect "the daemon logged the resumption" log_has "deallocation resumes"
exec 3<&-
live=$(wfield resume index.live)
writer reopen reopen verify
expect_eq "reopen: entries recovered" "$(wfield reopen run.recovered)" "$live"
expect_eq "reopen: entries verified" "$(wfield reopen run.verified)" "$live"

# The risk again (buffered writes, once seen, pause at every risk of the run): paused, and
# the pause saved, as the superblock on the drive shows it (the cycle that saves it may come
# before any count of cycles read here could).
saved_pause() { "$FDPBLK" inspect "$NS_DEV" --json | jq -c '.fdpblk_state.writeback_pause.buffered'; }
poll_eq "resumed: no pause saved" null saved_pause
writeback_set 6000 10
exec 3<>"$DEV"
bwriter again put 1 checkpoint
sync
wait_stat checkpoint_seq "$(wfield again index.seq)"
poll_eq "the risk again: paused" true bash -c "$FDPBLK stats -n 0 --json | jq -c '(.trim.paused_by // \"\") | test(\"writes through the page cache\")'"
poll_eq "the pause saved on the drive" true saved_pause
# Killed: the daemon that recovers the device pauses from its start, although it has seen
# no checkpoint interval yet (it would otherwise deallocate for three of them).
t1=$(trims)
old=$(daemon_pid 0)
expect "SIGKILL the paused daemon $old" kill -9 "$old"
for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
expect "fdpblk recover" "$FDPBLK" recover -n 0
poll_eq "recovered: paused from its start" true bash -c "$FDPBLK stats -n 0 --json | jq -c '(.trim.paused_by // \"\") | test(\"as the previous run judged it\")'"
expect "the recovered daemon logged why" log_has "the previous run paused deallocation"
# Two checkpoints would confirm the entries saved before the crash (their saved confirmations
# are not trusted after it), the third drop two of them: without the carried pause, they
# would go then (this run judges the risk itself only at its third interval, the fourth
# checkpoint).
for r in 1 2; do
    bwriter "recovered-$r" put 1 checkpoint
    sync
done
bwriter recovered-evict delete 2 checkpoint
sync
bwriter recovered-put put 1 --partial-every 1
sync
wait_stat checkpoint_seq "$(wfield recovered-evict index.seq)"
sleep 2
wait_rounds 2
expect_eq "recovered: nothing deallocated (evicted or tails)" "$(deallocated)" "$t1"
bwriter recovered-last checkpoint
sync
exec 3<&-
live=$(wfield recovered-last index.live)
writer reopen2 reopen verify
expect_eq "reopen after recovery: entries verified" "$(wfield reopen2 run.verified)" "$live"
expect_eq "no error in fdpblk's log since the check began" "$(daemon_errors)" 0
expect "del" "$FDPBLK" del -n 0
check_done
