#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 480
# tools/trace/capture-blktrace.sh and tools/fio/*.fio on QEMU's FDP drive:
# - a capture of /dev/ublkb0 while rawblock-writer issues LMCache's I/O: `fdpblk replay` of
#   it (D, Q and C events) counts the bytes per class and per handle fdpblk itself counted;
# - the capture script's one-line errors (no such device, debugfs not mounted, not root);
# - every job file parses (fio for the four that need no FDP, fio >= 3.38 for all six) and
#   runs: fdpblk.fio through fdpblk (policy region: checkpoints on handle 1, slots on 2),
#   baseline.fio (everything on placement ID 0), fdp-static.fio (checkpoints on PID 1, slots
#   on PID 2) and replay-fdp.fio of the captured trace (its checkpoint bytes on PID 1, its
#   slot bytes on PID 2, as fdpblk's region policy placed them), counted by RUAMW.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool blktrace blkparse fio jq nvme setpriv

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
RBW=$ROOT/target/release/rawblock-writer
CAP=$ROOT/tools/trace/capture-blktrace.sh
JOBS=$ROOT/tools/fio
[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
# fio with FDP (>= 3.38, dp_scheme): tests/vm/setup.sh unpacks one into the cache.
FIO_FDP=${FDPBLK_VM_CACHE:-/var/cache/fdpblk-vm}/bin/fio-fdp
"$FIO_FDP" --cmdhelp=dp_scheme >/dev/null 2>&1 || check_fatal "no fio with dp_scheme at $FIO_FDP: run tests/vm/setup.sh"
T=/tmp/trace-fio
rm -rf "$T" && mkdir -p "$T"
DEV=/dev/ublkb0
GEOM=(--slot-bytes 64K --meta-total-bytes 1M)
trap '"$FDPBLK" del -n 0 >/dev/null 2>&1 || true' EXIT

# stats_settled: fdpblk stats --json of device 0 once two reads agree. The stats are rewritten
# twice a second; reads 1.1 s apart span two rewrites, so one late rewrite on a slow guest
# cannot pass for settled.
stats_settled() {
    local prev='' cur i
    for ((i = 0; i < 30; i++)); do
        cur=$("$FDPBLK" stats -n 0 --json | jq -c '.pipeline')
        [[ $cur == "$prev" ]] && { echo "$cur"; return 0; }
        prev=$cur
        sleep 1.1
    done
    echo "$cur"
}
# delta A B JQ: B's value minus A's.
delta() { echo $(($(jq -r "$3 // 0" <<<"$2") - $(jq -r "$3 // 0" <<<"$1"))); }

# ---- capture while LMCache's I/O runs through fdpblk --------------------------------------------
out=$(fdpblk_add --backing "$NS_DEV" -n 0 --engine streams --policy region --persist-interval-ms 0 --no-trim "${GEOM[@]}")
expect_eq "fdpblk add: device" "$out" "$DEV"
for _ in $(seq 100); do [[ -b $DEV && -e /run/fdpblk/0.stats.json ]] && break; sleep 0.1; done
"$CAP" -o "$T/ublkb0.txt" --iolog "$T/ublkb0.iolog" --keep "$T/bin" "$DEV" 2>"$T/cap.err" &
cap=$!
for _ in $(seq 100); do grep -q tracing "$T/cap.err" && break; sleep 0.1; done
expect "capture-blktrace.sh is tracing" grep -q "tracing $DEV until Ctrl-C or SIGTERM (events: issue,complete)" "$T/cap.err"
s0=$(stats_settled)
expect "rawblock-writer: puts, checkpoints, deletes, verify" bash -c '"$@" >"$0"' "$T/writer-posix.out" "$RBW" --device "$DEV" "${GEOM[@]}" \
    --engine posix --odirect --state "$T/writer.state" \
    put 12 --partial-every 5 checkpoint delete 4 reput 2 put 3 checkpoint verify stats
expect "rawblock-writer: io_uring batch" bash -c '"$@" >"$0"' "$T/writer-uring.out" "$RBW" --device "$DEV" "${GEOM[@]}" \
    --engine io_uring --odirect --state "$T/writer.state" put 6 checkpoint stats
s1=$(stats_settled)
# What the writer itself wrote, per class (its own count, not fdpblk's classifier): the sum of
# both runs' last stats line.
writer_bytes() { # writer_bytes CLASS...
    local c n=0
    for f in "$T/writer-posix.out" "$T/writer-uring.out"; do
        for c in "$@"; do n=$((n + $(grep '^{' "$f" | tail -n1 | jq -r ".run.device_bytes.$c // 0"))); done
    done
    echo "$n"
}
for c in checkpoint_header checkpoint_payload slot_header slot_payload; do
    n=$(delta "$s0" "$s1" ".classes.$c.bytes")
    expect "fdpblk classified $c bytes ($n)" test "$n" -gt 0
done
# Written bytes by handle (`region`: checkpoints on 1, slot data on 2; the classes count reads too).
expect_eq "fdpblk's checkpoint writes (handle 1) = the writer's" "$(delta "$s0" "$s1" '.handles["1"]')" \
    "$(writer_bytes checkpoint_header checkpoint_payload)"
expect_eq "fdpblk's slot writes (handle 2) = the writer's" "$(delta "$s0" "$s1" '.handles["2"]')" \
    "$(writer_bytes slot_header slot_payload)"
kill -TERM "$cap"
rc=0
wait "$cap" || rc=$?
expect_eq "capture-blktrace.sh after SIGTERM: exit status" "$rc" 0
sed 's/^/    /' "$T/cap.err"
expect "the trace has D, C and Q events of $DEV" bash -c \
    "grep -qE '^ *[0-9]+,[0-9]+ .* D +W' '$T/ublkb0.txt' && grep -qE ' C +W' '$T/ublkb0.txt' && grep -qE ' Q +W' '$T/ublkb0.txt'"
expect "the fio replay log is there" test -s "$T/ublkb0.iolog"
size=$(blockdev --getsize64 "$DEV")
w=$(delta "$s0" "$s1" .ops.write.bytes)
echo "    fdpblk counted $w bytes written, $(delta "$s0" "$s1" .ops.read.bytes) read"
((w > 0)) || not_ok "fdpblk counted no writes"
for ev in D C Q; do
    r=$("$FDPBLK" replay --json --blk-event "$ev" --policy region --device-size "$size" "${GEOM[@]}" "$T/ublkb0.txt") ||
        { not_ok "fdpblk replay --blk-event $ev"; continue; }
    for c in checkpoint_header checkpoint_payload slot_header; do
        expect_eq "replay $ev: $c bytes = fdpblk's" "$(jq -r ".classes.$c.bytes" <<<"$r")" "$(delta "$s0" "$s1" ".classes.$c.bytes")"
    done
    # Without the headers' payload_len the replay cannot tell padding from payload.
    expect_eq "replay $ev: slot payload + padding bytes = fdpblk's" \
        "$(jq -r '.classes.slot_payload.bytes + .classes.slot_padding.bytes' <<<"$r")" \
        $(($(delta "$s0" "$s1" .classes.slot_payload.bytes) + $(delta "$s0" "$s1" .classes.slot_padding.bytes)))
    expect_eq "replay $ev: write bytes = fdpblk's" "$(jq -r .ops.write.bytes <<<"$r")" "$w"
    expect_eq "replay $ev: read bytes = fdpblk's" "$(jq -r .ops.read.bytes <<<"$r")" "$(delta "$s0" "$s1" .ops.read.bytes)"
    for h in 1 2; do
        expect_eq "replay $ev: handle $h bytes = fdpblk's" "$(jq -r ".handles[\"$h\"] // 0" <<<"$r")" "$(delta "$s0" "$s1" ".handles[\"$h\"]")"
    done
    expect_eq "replay $ev: identities known" "$(jq -r .trace.identities_known <<<"$r")" false
done
rep=$("$FDPBLK" replay --json --policy region --device-size "$size" "${GEOM[@]}" "$T/ublkb0.txt")
CK=$(jq -r '.handles["1"] // 0' <<<"$rep") SL=$(jq -r '.handles["2"] // 0' <<<"$rep")

# ---- the job files parse -------------------------------------------------------------------------
export NVME=$NS_DEV NG=$NG_DEV UBLK=$DEV SLOT_BYTES=65536 META_BYTES=1048576 IO_BYTES=16k SLOT_IOS=4 DATA_BYTES=2M \
    SLOT_WRITE_BYTES=2M META_WRITE_BYTES=1M META_PLI=1 SLOT_PLI=2 IOLOG=$T/ublkb0.iolog DP_SCHEME=$T/lmcache.dp_scheme
printf '0,%d,1\n%d,%d,2\n' "$META_BYTES" "$META_BYTES" "$(blockdev --getsize64 "$NS_DEV")" >"$DP_SCHEME"
for j in baseline fdpblk replay-baseline replay-fdpblk; do
    expect "fio --parse-only $j.fio" quiet fio --parse-only "$JOBS/$j.fio"
done
for j in baseline fdp-static fdpblk replay-baseline replay-fdp replay-fdpblk; do
    expect "fio-fdp --parse-only $j.fio" quiet "$FIO_FDP" --parse-only "$JOBS/$j.fio"
done
expect "an unset variable fails the parse" bash -c "! SLOT_BYTES= fio --parse-only '$JOBS/baseline.fio' >/dev/null 2>&1"

# ---- fdpblk.fio through fdpblk --------------------------------------------------------------------
s0=$(stats_settled)
expect "fio fdpblk.fio" quiet fio --output="$T/fdpblk.out" "$JOBS/fdpblk.fio"
s1=$(stats_settled)
expect_eq "fdpblk.fio: bytes on handle 1 (checkpoints)" "$(delta "$s0" "$s1" '.handles["1"]')" $((1 << 20))
expect_eq "fdpblk.fio: bytes on handle 2 (slots)" "$(delta "$s0" "$s1" '.handles["2"]')" $((2 << 20))
expect "fdpblk del -n 0" "$FDPBLK" del -n 0

# ---- on the raw namespace: placement IDs by RUAMW ---------------------------------------------------
# run_job DESC WANT0 WANT1 WANT2 FIO ARGS...: blocks used on PIDs 0, 1 and 2 by one fio run.
run_job() {
    local desc=$1 want=("$2" "$3" "$4") r0 r1 p
    shift 4
    r0=$(ruamw) || check_fatal "nvme fdp status failed"
    if "$@" >"$T/$desc.out" 2>&1; then ok "fio $desc"; else tail -5 "$T/$desc.out"; not_ok "fio $desc"; fi
    r1=$(ruamw)
    for p in 0 1 2; do
        expect_eq "$desc: blocks written on placement ID $p" "$(ruamw_used "$r0" "$r1" "$p")" "${want[p]}"
    done
}
run_job baseline $(((3 << 20) / LBA)) 0 0 fio "$JOBS/baseline.fio"
run_job fdp-static 0 $(((1 << 20) / LBA)) $(((2 << 20) / LBA)) "$FIO_FDP" "$JOBS/fdp-static.fio"
((CK + SL > 0 && CK < RU_SIZE && SL < RU_SIZE)) || check_fatal "captured writes ($CK + $SL bytes) do not fit one RU for exact accounting"
run_job replay-fdp 0 $((CK / LBA)) $((SL / LBA)) "$FIO_FDP" "$JOBS/replay-fdp.fio"

# ---- the capture script's errors ----------------------------------------------------------------
err_case() { # DESC WANT CMD...: exits 1 with one line on stderr that contains WANT
    local desc=$1 msg=$2 e rc=0
    shift 2
    e=$("$@" 2>&1 >/dev/null) || rc=$?
    if [[ $rc -eq 1 && $e == *"$msg"* && $(wc -l <<<"$e") -eq 1 ]]; then ok "$desc"; else not_ok "$desc: rc $rc, '$e'"; fi
}
err_case "capture: no such device" "does not exist" "$CAP" /dev/ublkb9
err_case "capture: not root" "needs root" setpriv --reuid=65534 --regid=65534 --clear-groups "$CAP" "$NS_DEV"
umount /sys/kernel/debug
err_case "capture: debugfs not mounted" "mount -t debugfs debugfs /sys/kernel/debug" "$CAP" "$NS_DEV"
mount -t debugfs debugfs /sys/kernel/debug
rc=0
"$CAP" -w 1 -o "$T/short.txt" "$NS_DEV" 2>/dev/null || rc=$?
expect_eq "capture -w 1 on an idle device: exit status" "$rc" 0

check_done
