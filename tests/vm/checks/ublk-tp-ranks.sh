#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-args: --namespaces 2
# vm-timeout: 300
# LMCache non-MP with tensor parallelism 2 on one FDP drive: LMCache opens one raw_block
# device per rank (`rust_raw_block.per_tp_device_paths`), so fdpblk serves two devices at
# once, kv0 on namespace 1 (passthrough) and kv1 on namespace 2 (write streams), both on the
# drive's placement handles, each pinned to its namespace (--backing-id; a pin of the other
# namespace is refused). The two ranks (the non-MP plugin's keys, with their own world
# size and worker id) put, evict, checkpoint and put again at the same time. Each device keeps to its namespace:
# each rank's evicted slots are deallocated on its own namespace (they read zeroes there),
# every entry of both ranks verifies, both daemons keep their own state, `list` shows both
# names live; after one daemon is killed and recovered, its rank reopens and verifies every
# entry while the other rank's device serves on untouched.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
# The guest's init waits for the first namespace only; the kernel may scan the second later.
for _ in $(seq 150); do [[ -b /dev/nvme0n2 && -c /dev/ng0n2 ]] && break; sleep 0.1; done
[[ -b /dev/nvme0n2 && -c /dev/ng0n2 ]] || check_fatal "no second namespace after 15 s (run with --namespaces 2)"
OUT=${FDPBLK_CHECK_OUT:-/var/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
BACKING=("$NG_DEV" /dev/nvme0n2)
ENGINE=(passthrough streams)
NSBLK=("$NS_DEV" /dev/nvme0n2)
# fresh NS: fdpblk_fresh_drive on namespace NS (1 or 2).
fresh() { NS_DEV=${NSBLK[$1 - 1]} fdpblk_fresh_drive; }
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; "$FDPBLK" del -n 1 >/dev/null 2>&1 || true; fresh 1 || true; fresh 2 || true' EXIT
# kv_stat R PATH: a field of rank R's device stats.
kv_stat() { "$FDPBLK" stats -n "$1" --json 2>/dev/null | jq -c ".$2"; }

# rank R NAME ARGS...: rank R's LMCache (O_DIRECT posix) on /dev/fdpblk/kvR; prints ok or
# what failed; its stats go to $OUT/tp-rR-NAME.json.
rank() {
    local r=$1 base=$OUT/tp-r$1-$2
    shift 2
    # kv_rank: world_size 2, global rank r, local world size 2, local rank r (a legacy key
    # carries world size 2 and worker id r).
    if "$RBW" --device "/dev/fdpblk/kv$r" "${GEOM[@]}" --engine posix --odirect --namespace legacy --state "$OUT/tp-r$r.state" \
        --kv-rank "$(printf '0x02%02x02%02x' "$r" "$r")" --seed $((r + 1)) -q "$@" stats >"$base.json" 2>"$base.err"; then
        echo ok
    else
        sed 's/^/    /' "$base.err" >&2
        echo "failed: $*"
    fi
}
# both_ranks NAME ARGS...: `rank 0` and `rank 1` at once (like two LMCache processes, one per
# GPU); each one's result goes to $OUT/tp-rR.result.
both_ranks() {
    rank 0 "$@" >"$OUT/tp-r0.result" &
    local p0=$!
    rank 1 "$@" >"$OUT/tp-r1.result" &
    local p1=$!
    wait "$p0" "$p1" || true
}
# rfield R NAME PATH: a field of the stats of rank R's run NAME.
rfield() { jq -c ".$3" "$OUT/tp-r$1-$2.json"; }

# --backing-id pins a namespace by its identity: a kernel name that names the other one is
# refused, naming the node the pinned one has now; each add below pins its own. Which nsid
# a node has is asked, not assumed: the kernel names namespaces in the order its scan finds
# them, and /dev/ng0n1 is namespace 2 in some boots (the very reason for a pin).
serial=$("$FDPBLK" fdp status "$NG_DEV" --json | jq -r .serial)
nsid=("$("$FDPBLK" fdp status "$NG_DEV" --json | jq -r .nsid)" "$("$FDPBLK" fdp status /dev/ng0n2 --json | jq -r .nsid)")
expect "the two nodes are the two namespaces (${nsid[*]})" test "$(printf '%s\n' "${nsid[@]}" | sort | tr '\n' ' ')" = "1 2 "
expect "fdp status prints the identity a pin takes" \
    grep -qxF "identity:      model \"QEMU NVMe Ctrl\" serial \"$serial\" nsid ${nsid[1]} (fdpblk add --backing-id takes it, or its serial and nsid)" \
    <("$FDPBLK" fdp status /dev/ng0n2)
out=$("$FDPBLK" add -n 0 --backing "$NG_DEV" --backing-id "serial \"$serial\" nsid ${nsid[1]}" "${GEOM[@]}" 2>&1) && rc=0 || rc=$?
expect "add on $NG_DEV pinned to the other namespace is refused, naming /dev/ng0n2 ($out)" bash -c 'test "$1" -ne 0 && grep -qF "$2" <<<"$3"' _ "$rc" \
    "nsid ${nsid[0]}, not ${nsid[1]}. Nothing was written; the pinned namespace is /dev/ng0n2 now: set --backing to it" "$out"
expect "and no device was made" test ! -e /dev/ublkb0
# A config file (`fdpblk up`) whose backing is a kernel name and pins none gets the line to
# add (this add then stops at its engine: streams on a char device).
printf 'backing = "%s"\nslot_bytes = "64K"\nmeta_total_bytes = "1M"\n' "$NG_DEV" >/tmp/unpinned.toml
out=$("$FDPBLK" add --config /tmp/unpinned.toml --engine streams 2>&1) && rc=0 || rc=$?
expect "an unpinned kernel name in a config file is warned of, with the pin to add ($out)" bash -c 'test "$1" -ne 0 && grep -qF "$2" <<<"$3"' _ "$rc" \
    "pin the namespace: add \`backing_id = 'serial \"$serial\" nsid ${nsid[0]}'\` to /tmp/unpinned.toml" "$out"
rm -f /tmp/unpinned.toml
for r in 0 1; do
    fresh $((r + 1)) || check_fatal "blkdiscard of namespace $((r + 1))'s metadata region and reserved tail"
    rm -f "$OUT/tp-r$r.state"
    expect_eq "rank $r: fdpblk add kv$r on ${BACKING[$r]} (${ENGINE[$r]}), pinned to it" \
        "$(fdpblk_add -n "$r" --name "kv$r" --backing "${BACKING[$r]}" --backing-id "serial \"$serial\" nsid ${nsid[$r]}" --engine "${ENGINE[$r]}" "${GEOM[@]}")" "/dev/ublkb$r"
done

# Both ranks at once: 40 puts (a third partial) and a checkpoint; one eviction and a second
# checkpoint, which confirms the other 39 (listed by a checkpoint after the one that followed
# their writes); 8 random evictions (each rank its own: seeds differ) and a checkpoint that
# lacks them, so fdpblk deallocates those 8 (the first eviction was never confirmed).
script=(put 40 --partial-every 3 checkpoint delete 1 checkpoint delete 8 --random checkpoint)
both_ranks evict "${script[@]}"
for r in 0 1; do
    expect_eq "rank $r: puts, evictions and checkpoints" "$(cat "$OUT/tp-r$r.result")" ok
    poll_eq "rank $r: kv$r follows its rank's checkpoint" "$(rfield "$r" evict index.seq)" kv_stat "$r" checkpoint_seq
    poll_eq "rank $r: kv$r deallocated its rank's 8 confirmed evicted slots" 8 kv_stat "$r" trim.trims
done

# Each rank's freed slots read zeroes on its own namespace (what fdpblk deallocated).
for r in 0 1; do
    z=0
    for s in $(jq -r '.free[]' "$OUT/tp-r$r.state"); do
        off=$((1048576 + s * 65536))
        if cmp -s -n 65536 <(dd if="${NSBLK[$r]}" bs=64K skip=$((off / 65536)) count=1 iflag=direct status=none) /dev/zero; then
            z=$((z + 1))
        fi
    done
    expect_eq "rank $r: its evicted slots read zeroes on namespace $((r + 1))" "$z" 8
done

# Again at once: re-puts into the freed slots, new puts, a checkpoint, then each verifies.
script=(reput 4 put 12 checkpoint verify)
both_ranks again "${script[@]}"
for r in 0 1; do
    expect_eq "rank $r: re-puts, puts and verify" "$(cat "$OUT/tp-r$r.result")" ok
    expect_eq "rank $r: every entry verifies" "$(rfield "$r" again run.verified)" 47
    expect_eq "rank $r: no payload placed without its header" "$(kv_stat "$r" pipeline.payload_fallbacks)" 0
    expect_eq "rank $r: kv$r's own state saved" "$(kv_stat "$r" own_state.persisted)" true
done
expect_eq "fdpblk list: kv0 and kv1 live" "$("$FDPBLK" list --json | jq -c '[.[] | [.name, .state]]')" '[["kv0","live"],["kv1","live"]]'

# Rank 1's daemon dies; recover it; rank 1 reopens from its device and verifies; rank 0 too.
pid=$(daemon_pid 1)
kill -9 "$pid"
for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
expect_eq "fdpblk recover -n 1" "$("$FDPBLK" recover -n 1 2>&1)" /dev/ublkb1
expect_eq "rank 1: reopen and verify after the recovery" "$(rank 1 reopen reopen verify)" ok
expect_eq "rank 1: entries recovered and verified" "$(rfield 1 reopen run.recovered) $(rfield 1 reopen run.verified)" "47 47"
expect_eq "rank 0: still verifies" "$(rank 0 verify verify)" ok
expect_eq "rank 0: entries verified" "$(rfield 0 verify run.verified)" 47
expect_eq "no error in fdpblk's log since the check began" "$(daemon_errors)" 0
expect "fdpblk del -n 0" "$FDPBLK" del -n 0
expect "fdpblk del -n 1" "$FDPBLK" del -n 1
check_done
