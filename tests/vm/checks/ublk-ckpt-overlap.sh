#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 300
# LMCache writes a checkpoint outside its index lock, while its store workers write their puts
# (reference §9). rawblock-writer's `put --workers 2 --with-checkpoint` does the same: the
# checkpoint, snapshotted before the puts, is written on a thread of its own beside them,
# through a device with 2 ublk queues, so its header and the puts' headers and payloads reach
# fdpblk interleaved. Rounds of random deletes, then such puts into the freed slots (deleted
# keys put again first, partial chunks over the stale tails of longer earlier contents)
# beside the checkpoint that no longer lists those slots, run while fdpblk deallocates
# whatever it may. After every round LMCache's loader (a reopen from the device, which
# fdpblk also sees as LMCache's restart) takes every entry, each of which verifies, so no
# deallocation took bytes LMCache loads. Last, a delete and a checkpoint with no puts after
# them: fdpblk deallocates evicted slots (early: the older container still lists them) and
# stale tails, and every entry still loads and verifies. Both of LMCache's io_engines: posix
# and io_uring (whose batches have no order between a header and its payload).
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/tmp/ublk-ckpt-overlap.state
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT

# deallocated: fdpblk's evicted-slot and stale-tail deallocations so far.
deallocated() { "$FDPBLK" stats -n 0 --json | jq -r '"\(.trim.trims) \(.trim.tail_trims)"'; }
# settled: waits until fdpblk's deallocations stop: three reads 2 s apart agree (the state
# thread runs a round a second; at most 60 s).
settled() {
    local a b same=0
    b=$(deallocated)
    for _ in $(seq 30); do
        a=$b
        sleep 2
        b=$(deallocated)
        # Two numbers each time: a failed read would agree with itself.
        if [[ $a == "$b" && $b =~ ^[0-9]+\ [0-9]+$ ]]; then
            same=$((same + 1))
            ((same >= 2)) && return 0
        else
            same=0
        fi
    done
    return 1
}

# pass ENGINE: the rounds with LMCache's io_engine ENGINE (posix: each worker writes a header,
# then its payload; io_uring: a worker's batch has no order inside) on a fresh device.
pass() {
    local e=$1 r live reopened
    WRITER_ENGINE=$e WRITER_PREFIX=ckpt-overlap-$e
    reopened=ckpt-overlap-$e-reopen
    rm -f "$STATE"
    fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
    dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough -q 2 -d 64 "${GEOM[@]}")
    expect_eq "$e: fdpblk add (2 queues)" "$dev" "$DEV"
    for _ in $(seq 100); do [[ -b $DEV && -e /run/fdpblk/0.stats.json ]] && break; sleep 0.1; done

    writer fill put 48 --partial-every 3 --workers 2 checkpoint put 2 checkpoint
    for r in 1 2 3 4 5 6; do
        # The first checkpoint beside puts is the one that drops the deleted slots, while the
        # puts write into those slots (LIFO).
        writer "round$r" delete 16 --random \
            reput 8 --partial-every 2 --workers 2 --with-checkpoint \
            put 8 --partial-every 3 --workers 2 --with-checkpoint checkpoint
        live=$(wfield "round$r" index.live)
        # A restarted LMCache: the index from the newest checkpoint on the device, every slot
        # header checked, every payload verified.
        WRITER_PREFIX=$reopened writer "round$r" reopen verify
        expect_eq "$e: round $r: the loader takes all $live entries, each verified" \
            "$(WRITER_PREFIX=$reopened wfield "round$r" run.recovered)/$(WRITER_PREFIX=$reopened wfield "round$r" run.recovery_dropped)/$(WRITER_PREFIX=$reopened wfield "round$r" run.verified)" "$live/0/$live"
    done
    expect "$e: the puts' checkpoints were written beside them" test "$(wfield round6 index.seq)" -ge 20
    # Evictions with no puts after them: the newest checkpoint lacks 4 slots the older lists.
    expect "$e: fdpblk's deallocations settle" settled
    early=$(dev_stat trim.early_evictions)
    writer evict delete 4 --random checkpoint
    live=$(wfield evict index.live)
    expect "$e: fdpblk's deallocations settle again" settled
    expect "$e: evicted slots deallocated ($(dev_stat trim.trims))" test "$(dev_stat trim.trims)" -gt 0
    expect "$e: stale tails deallocated ($(dev_stat trim.tail_trims))" test "$(dev_stat trim.tail_trims)" -gt 0
    expect "$e: the 4 evicted last went early, once the newest checkpoint lacked them ($early -> $(dev_stat trim.early_evictions))" \
        test "$(dev_stat trim.early_evictions)" -ge $((early + 4))
    # With fdpblk's deallocations of the last round done, the loader still takes every entry.
    writer final reopen verify
    expect_eq "$e: after the deallocations: the loader takes all $live entries, each verified" \
        "$(wfield final run.recovered)/$(wfield final run.recovery_dropped)/$(wfield final run.verified)" "$live/0/$live"
    expect_eq "$e: no failed request" "$("$FDPBLK" stats -n 0 --json | jq -c '[.queues[].errors] | add')" 0
    # Puts into slots being deallocated wait for it (whether one did here is timing): the
    # counts are reported, and on a healthy drive no hold comes near the 10 s warning.
    held=$("$FDPBLK" stats -n 0 --json | jq -r '"\([.queues[].held_for_trims] | add) \([.queues[].held_longest_us] | max)"')
    expect "$e: requests held for deallocations reported, none for 10 s (held, longest us: $held)" \
        bash -c "read -r n us <<<'$held' && [[ \$n =~ ^[0-9]+\$ && \$us =~ ^[0-9]+\$ ]] && (( us < 10000000 ))"
    expect_eq "$e: no error in fdpblk's log since the check began" "$(daemon_errors)" 0
    expect "$e: fdpblk del" "$FDPBLK" del -n 0
    daemons_gone || true
}

pass posix
pass io_uring
check_done
