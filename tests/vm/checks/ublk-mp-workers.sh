#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 300
# LMCache MP's threads at once: two store workers and four load workers (rawblock-writer
# --workers, O_DIRECT as MP's default, with io_engine posix and then io_uring) on a device
# with 2 ublk queues and policy key-aware, so one put's writes and another's reach fdpblk
# through both queues together.
# Every put is placed by its key's load history as if it came alone: new keys on handle 0,
# keys loaded once or twice before their eviction on handle 1, three times or more on
# handle 2. fdpblk's bytes per handle equal what the writer put for each class, the drive's
# RUAMW agrees, no payload is placed without its header, and every entry loads and verifies;
# after the daemon is stopped and added again, a reopen recovers them all.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool jq nvme blkdiscard blockdev

[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
DEV=/dev/ublkb0
STATE=/var/tmp/ublk-mp-workers.state
OUT=${FDPBLK_CHECK_OUT:-/var/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true; fdpblk_fresh_drive || true' EXIT

# fdpblk's own state only at add and del, and no zeroing of LMCache's older checkpoint
# container (early evictions): between checkpoints, every byte on a handle is a put's.
ADD=(-n 0 --backing "$NG_DEV" --engine passthrough --policy key-aware -q 2 -d 64
    --persist-interval-ms 0 --no-early-evictions "${GEOM[@]}")

# handle_bytes: "H0 H1 H2": fdpblk's bytes written per logical handle, once its stats (rewritten
# twice a second, later on a loaded guest) have caught up: two reads 1.1 s apart agree.
handle_bytes() {
    local a b
    b=$("$FDPBLK" stats -n 0 --json | jq -r '[.pipeline.handles["0", "1", "2"] | . // 0] | join(" ")')
    for _ in $(seq 40); do
        a=$b
        sleep 1.1
        b=$("$FDPBLK" stats -n 0 --json | jq -r '[.pipeline.handles["0", "1", "2"] | . // 0] | join(" ")')
        [[ $a == "$b" ]] && break
    done
    echo "$b"
}
# queued: requests each ublk queue took, as fdpblk counts them.
queued() { "$FDPBLK" stats -n 0 --json | jq -r '[.queues[].requests] | join(" ")'; }
# both_queues "A0 A1" "B0 B1": whether each queue took at least 4 requests in between.
both_queues() {
    local -a a b
    read -ra a <<<"$1"
    read -ra b <<<"$2"
    ((b[0] - a[0] >= 4 && b[1] - a[1] >= 4))
}

# class_bytes KEYFILE...: the device bytes of the writer's entries whose keys are listed in
# the files (header plus payload rounded up to 4 KiB, as O_DIRECT writes them).
class_bytes() {
    jq -r --slurpfile k <(cat "$@" | jq -R . | jq -s .) \
        '[.entries[] | select(.key as $x | $k[0] | index($x)) | 4096 + ((.size + 4095) / 4096 | floor) * 4096] | add // 0' "$STATE"
}
# sub3 "A0 A1 A2" "B0 B1 B2": B - A per handle.
sub3() {
    local -a a b
    read -ra a <<<"$1"
    read -ra b <<<"$2"
    echo "$((b[0] - a[0])) $((b[1] - a[1])) $((b[2] - a[2]))"
}
# pid_blocks R0 R1: logical blocks the drive took on the PIDs of handles 0..2 (each phase
# puts less than a reclaim unit on each, so RUAMW does not wrap more than once).
pid_blocks() { echo "$(ruamw_used "$1" "$2" "${PIDS[0]}") $(ruamw_used "$1" "$2" "${PIDS[1]}") $(ruamw_used "$1" "$2" "${PIDS[2]}")"; }
blocks_of() {
    local -a b
    read -ra b <<<"$1"
    echo "$((b[0] / LBA)) $((b[1] / LBA)) $((b[2] / LBA))"
}

# round ENGINE: the whole sequence with LMCache's io_engine ENGINE (posix: each thread writes
# a header, then its payload; io_uring: each thread's batch has no order inside).
round() {
    local e=$1 h0 h1 h2 h3 r0 r1 r2 r3 q0 q1 q2 q3 all want
    WRITER_ENGINE=$e WRITER_PREFIX=mp-workers-$e
    rm -f "$STATE"
    fdpblk_fresh_drive || check_fatal "blkdiscard of the metadata region and the reserved tail"
    expect_eq "$e: fdpblk add (2 queues, key-aware)" "$(fdpblk_add "${ADD[@]}")" "$DEV"
    for _ in $(seq 100); do [[ -e /run/fdpblk/0.stats.json ]] && break; sleep 0.1; done
    mapfile -t PIDS < <("$FDPBLK" list --json | jq -r '.[0].pids[]')
    expect "$e: placement IDs of handles 0..2: ${PIDS[*]:0:3}" test "${#PIDS[@]}" -ge 3

    # 1. 48 new keys (a third with partial last chunks) from two store tasks at once: all on
    #    handle 0.
    h0=$(handle_bytes) r0=$(ruamw) q0=$(queued)
    writer put put 48 --partial-every 3 --workers 2
    h1=$(handle_bytes) r1=$(ruamw) q1=$(queued)
    expect "$e: new keys: both queues served the store workers (requests per queue: $q0 before, $q1 after)" both_queues "$q0" "$q1"
    all=$(jq -r '.entries[].key' "$STATE")
    head -n 16 <<<"$all" >"$OUT/mp-hot.keys"
    sed -n 17,32p <<<"$all" >"$OUT/mp-read.keys"
    sed -n 33,48p <<<"$all" >"$OUT/mp-new.keys"
    want=$(class_bytes "$OUT/mp-hot.keys" "$OUT/mp-read.keys" "$OUT/mp-new.keys")
    expect_eq "$e: new keys: fdpblk's bytes on handles 0..2" "$(sub3 "$h0" "$h1")" "$want 0 0"
    expect_eq "$e: new keys: blocks on the drive's PIDs of handles 0..2" "$(pid_blocks "$r0" "$r1")" "$(blocks_of "$want 0 0")"

    # 2. Loads on four threads: the first 16 keys four times, the next 16 once, the last never.
    #    Then LMCache evicts all 48 and checkpoints; fdpblk follows the checkpoint.
    writer load load 16 --workers 4 load 16 --workers 4 load 16 --workers 4 load 32 --workers 4 \
        checkpoint delete 48 checkpoint
    expect_eq "$e: loads checked by the writer" "$(wfield load run.loads)" 80
    wait_stat checkpoint_seq "$(wfield load index.seq)"

    # 3. The 48 keys put again by two store tasks at once, new content and sizes, classes mixed
    #    in both tasks: each key goes to its class's handle.
    h2=$(handle_bytes) r2=$(ruamw) q2=$(queued)
    writer reput reput 48 --partial-every 4 --workers 2
    h3=$(handle_bytes) r3=$(ruamw) q3=$(queued)
    expect "$e: returning keys: both queues served the store workers (requests per queue: $q2 before, $q3 after)" both_queues "$q2" "$q3"
    want="$(class_bytes "$OUT/mp-new.keys") $(class_bytes "$OUT/mp-read.keys") $(class_bytes "$OUT/mp-hot.keys")"
    expect_eq "$e: returning keys: fdpblk's bytes on handles 0..2 (never, 1x, 4x loaded)" "$(sub3 "$h2" "$h3")" "$want"
    expect_eq "$e: returning keys: blocks on the drive's PIDs of handles 0..2" "$(pid_blocks "$r2" "$r3")" "$(blocks_of "$want")"
    expect_eq "$e: no payload placed without its header" "$(dev_stat pipeline.payload_fallbacks)" 0
    echo "    fdpblk: $("$FDPBLK" stats -n 0 --json | jq -c '{header_waits: .pipeline.header_waits, trims: .trim.trims, tail_trims: .trim.tail_trims}')"

    # 4. LMCache's index checks out: loads on four threads, then header and payload of each slot.
    writer check checkpoint load 48 --random --workers 4 verify
    expect_eq "$e: every entry loads and verifies" "$(wfield check run.loads) $(wfield check run.verified)" "48 48"
    expect_eq "$e: no error in fdpblk's log since the check began" "$(daemon_errors)" 0

    # 5. A new daemon, and a new LMCache process that recovers its index from the drive.
    expect "$e: fdpblk del" "$FDPBLK" del -n 0
    expect_eq "$e: fdpblk add again" "$(fdpblk_add "${ADD[@]}")" "$DEV"
    writer reopen reopen verify
    expect_eq "$e: reopen: entries recovered and verified" "$(wfield reopen run.recovered) $(wfield reopen run.verified)" "48 48"
    expect_eq "$e: reopen: recovered index equals the writer's" "$(wfield reopen index.reopen_matches_previous)" true
    expect "$e: fdpblk del" "$FDPBLK" del -n 0
}

round posix
round io_uring
check_done
