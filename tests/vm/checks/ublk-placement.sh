#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 420
# LMCache raw_block's own I/O pattern (tools/rawblock_writer: posix and io_uring, O_DIRECT and
# buffered) through fdpblk on /dev/ublkb0 with policy region: checkpoint bytes land only on
# placement ID 1, slot bytes only on PID 2, nothing on the others (RUAMW, HBMW), and fdpblk's
# per-handle bytes equal the writer's; after fdpblk del + add (layout found on the device) the
# writer's reopen recovers the same index and every slot verifies.
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool nvme awk jq

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
FDPBLK=$ROOT/target/release/fdpblk
RBW=$ROOT/target/release/rawblock-writer
for b in "$FDPBLK" "$RBW"; do
    [[ -x $b ]] || check_fatal "no $b: run 'cargo build --release' on the host first"
done
DEV=/dev/ublkb0
STATE=/tmp/ublk-placement.state
OUT=${FDPBLK_CHECK_OUT:-/tmp}
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
((RU_SIZE % 4096 == 0)) || check_fatal "RU size $RU_SIZE is not a multiple of 4 KiB"
rm -f "$STATE"
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true' EXIT

add_device() { # add_device ARGS...: fdpblk add on the namespace as /dev/ublkb0, policy region
    local out
    # fdpblk's own state (placement ID 3) only at add and del, outside the measured phases; no
    # early evictions, whose zeroing of the older checkpoint container (also on placement ID
    # 3) follows a checkpoint by up to a second (ublk-trim and waf-compare account for it).
    out=$("$FDPBLK" add --backing "$NS_DEV" -n 0 --engine streams --policy region --persist-interval-ms 0 --no-early-evictions "$@" 2>&1) ||
        { echo "$out"; cat /run/fdpblk/daemon.log 2>/dev/null; check_fatal "fdpblk add $*"; }
    expect_eq "fdpblk add $*: device" "$out" "$DEV"
    for _ in $(seq 100); do [[ -b $DEV && -e /run/fdpblk/0.stats.json ]] && return 0; sleep 0.1; done
    check_fatal "$DEV or its stats did not appear"
}

del_device() {
    expect "fdpblk del -n 0" "$FDPBLK" del -n 0
    expect "$DEV gone" bash -c "for i in \$(seq 100); do [[ -e $DEV ]] || exit 0; sleep 0.1; done; exit 1"
}

# handles: "H0 .. H7 WRITE_BYTES" from fdpblk stats: bytes written per logical handle, and
# in all (plain bash: python3 starts slowly under TCG).
handles() {
    local j h i out=()
    j=$("$FDPBLK" stats -n 0 --json 2>/dev/null) || { echo none; return 0; }
    [[ $j =~ \"handles\":\{([^}]*)\} ]] || { echo none; return 0; }
    h=${BASH_REMATCH[1]}
    for i in 0 1 2 3 4 5 6 7; do
        if [[ $h =~ \"$i\":([0-9]+) ]]; then out+=("${BASH_REMATCH[1]}"); else out+=(0); fi
    done
    [[ $j =~ \"write\":\{\"bytes\":([0-9]+) ]] || { echo none; return 0; }
    echo "${out[*]} ${BASH_REMATCH[1]}"
}

# load_writer_stats FILE: the writer's stats JSON into W[...] (one jq run: python3 takes
# seconds to start under TCG).
declare -A W
load_writer_stats() {
    local k v
    W=()
    while IFS='=' read -r k v; do W[$k]=$v; done < <(jq -r '.run as $r | .index as $i | $r.device_bytes as $d | {
        ck: ($d.checkpoint_header + $d.checkpoint_payload), sl: ($d.slot_header + $d.slot_payload),
        puts: $r.puts, checkpoints: $r.checkpoints_written, slot_headers: $r.writes.slot_header,
        recovered: $r.recovered, dropped: $r.recovery_dropped, verified: $r.verified,
        live: $i.live, seq: $i.seq, dirty: $i.dirty, matches: $i.reopen_matches_previous
    } | to_entries[] | "\(.key)=\(.value)"' "$1")
}

# Handle bytes as of the end of the previous phase (fdpblk's stats refresh once a second).
PREV_HANDLES="0 0 0 0 0 0 0 0 0"

# phase NAME WRITER-ARGS...: runs the writer (index kept in $STATE), then checks that the
# drive got its checkpoint bytes on PID 1 and its slot bytes on PID 2, nothing elsewhere, and
# that fdpblk counted the same bytes on logical handles 1 and 2.
phase() {
    local name=$1
    local log=$OUT/rawblock-writer-$name
    shift
    local r0 r1 b0 b1 ck sl p want got cur i
    r0=$(ruamw) || check_fatal "nvme fdp status failed"
    b0=$(fdp_stat HBMW)
    if ! "$RBW" --device "$DEV" "${GEOM[@]}" --state "$STATE" "$@" stats >"$log.json" 2>"$log.err"; then
        sed 's/^/    /' "$log.err"
        not_ok "$name: rawblock-writer $*"
        return 0
    fi
    sed 's/^/    /' "$log.err"
    ok "$name: rawblock-writer $*"
    r1=$(ruamw)
    b1=$(fdp_stat HBMW)
    load_writer_stats "$log.json"
    ck=${W[ck]:-x} sl=${W[sl]:-x}
    [[ $ck =~ ^[0-9]+$ && $sl =~ ^[0-9]+$ ]] || { not_ok "$name: writer stats unreadable"; return 0; }
    echo "    $name: writer: $ck checkpoint bytes, $sl slot bytes (${W[puts]} puts, ${W[checkpoints]} checkpoints)"
    # Exact per-PID accounting needs each PID's share below one reclaim unit (RUAMW wraps).
    ((ck < RU_SIZE && sl < RU_SIZE)) || check_fatal "$name: workload too large for exact RUAMW accounting"
    for ((p = 0; p < NRUH; p++)); do
        want=0
        ((p == 1)) && want=$((ck / LBA))
        ((p == 2)) && want=$((sl / LBA))
        expect_eq "$name: blocks written on placement ID $p" "$(ruamw_used "$r0" "$r1" "$p")" "$want"
    done
    expect_eq "$name: HBMW increase (bytes)" $((b1 - b0)) $((ck + sl))
    read -ra prev <<<"$PREV_HANDLES"
    # fdpblk refreshes its stats once a second.
    for i in $(seq 40); do
        cur=$(handles)
        read -ra now <<<"$cur"
        [[ ${#now[@]} -eq 9 ]] && ((now[1] - prev[1] == ck && now[2] - prev[2] == sl)) && break
        sleep 0.25
    done
    read -ra now <<<"$cur"
    [[ ${#now[@]} -eq 9 ]] || { not_ok "$name: fdpblk stats unreadable ($cur)"; return 0; }
    for i in 0 1 2 3 4 5 6 7; do
        want=0
        ((i == 1)) && want=$ck
        ((i == 2)) && want=$sl
        got=$((now[i] - prev[i]))
        if ((i <= 3 || got != 0)); then
            expect_eq "$name: fdpblk bytes on handle $i" "$got" "$want"
        fi
    done
    expect_eq "$name: fdpblk write bytes" $((now[8] - prev[8])) $((ck + sl))
    PREV_HANDLES=$cur
}

r_add0=$(ruamw) || check_fatal "nvme fdp status failed"
h_add0=$(fdp_stat HBMW)
add_device "${GEOM[@]}"
echo "    $DEV: block size $(blockdev --getbsz "$DEV" 2>/dev/null), logical $(blockdev --getss "$DEV" 2>/dev/null)"

# posix + O_DIRECT (the MP adapter's default): header pwrite, payload pwrite(s), key by key.
phase posix-odirect --engine posix --odirect \
    put 24 --partial-every 5 checkpoint delete 8 reput 3 put 4 --salt tenantA:alice checkpoint \
    delete 2 --random checkpoint verify
expect_eq "posix-odirect: slot headers written" "${W[slot_headers]}" 31
# io_uring + O_DIRECT: one batch per 64 keys ([hdr, payload] pairs), checkpoints as 2-entry batches.
phase io_uring-odirect --engine io_uring --odirect \
    put 70 --payload-bytes 8K delete 10 --random reput 4 put 6 --partial-every 2 checkpoint verify
# io_uring and posix buffered (the non-MP default): the page cache writes back whole blocks;
# an fsync after each step keeps every block to one writeback, so the counts stay exact.
phase io_uring-buffered --engine io_uring \
    put 20 --partial-every 3 sync checkpoint sync delete 6 sync reput 2 put 3 sync checkpoint sync verify
phase posix-buffered --engine posix \
    put 20 --partial-every 4 sync checkpoint sync delete 5 --random sync reput 3 put 2 --salt tenantB:bob \
    sync checkpoint sync verify
live=${W[live]} seq=${W[seq]}
expect_eq "writer index clean after its last checkpoint: dirty" "${W[dirty]}" false

# The device again, with no layout flags: fdpblk learns the geometry from the checkpoint.
del_device
add_device
expect_eq "re-added device: layout from the checkpoint" \
    "$("$FDPBLK" list --json | jq -r '.[0].geometry | "\(.slot_bytes) \(.meta_total_bytes)"')" \
    "65536 1048576"
PREV_HANDLES="0 0 0 0 0 0 0 0 0"
phase reopen --engine posix --odirect reopen verify
expect_eq "reopen: entries recovered" "${W[recovered]}" "$live"
expect_eq "reopen: dropped by the slot header check" "${W[dropped]}" 0
expect_eq "reopen: recovered index equals the writer's" "${W[matches]}" true
expect_eq "reopen: checkpoint seq" "${W[seq]}" "$seq"
expect_eq "reopen: entries verified" "${W[verified]}" "$live"
phase after-reopen --engine io_uring --odirect put 8 delete 3 checkpoint verify
expect_eq "after-reopen: checkpoint seq" "${W[seq]}" $((seq + 1))
inspect=$("$FDPBLK" inspect "$DEV" --json | jq -r '.summary | "\(.live) \(.header_mismatch) \(.checkpoint_seq)"')
expect_eq "fdpblk inspect $DEV: live, header mismatches, seq" "$inspect" \
    "${W[live]} 0 $((seq + 1))"
del_device
r_end=$(ruamw)
echo "    whole check: HBMW +$(($(fdp_stat HBMW) - h_add0)) bytes; blocks per PID (modulo the RU): $(for ((p = 0; p < NRUH; p++)); do printf '%s:%s ' "$p" "$(ruamw_used "$r_add0" "$r_end" "$p")"; done)"

check_done
