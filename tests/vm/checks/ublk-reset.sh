#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 300
# NVMe controller resets under load: fio verify=crc32c through /dev/ublkb0, and discards beside
# it, while the controller behind it resets three times, on the passthrough engine (the kernel fails the
# passthrough commands in flight, and refuses new ones with EINVAL while it rebuilds its
# queues: fdpblk holds them until the controller is live and sends them again, and says so
# in its log) and on the streams engine (the block layer holds them); then LMCache's I/O
# (rawblock-writer) on the passthrough engine across three resets, with the state thread
# busy. No I/O error, and every byte verifies.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio jq blkdiscard
CTRL_STATE=/sys/class/nvme/nvme0/state
[[ -e $CTRL_STATE ]] || check_fatal "no $CTRL_STATE"

# three_resets: one controller reset a second, each waited out, three times (a reset that
# cannot start shows in the count below, not as a silent exit).
three_resets() {
    for _ in 1 2 3; do
        sleep 1
        echo 1 >/sys/class/nvme/nvme0/reset_controller 2>/dev/null || true
        for _ in $(seq 200); do [[ $(cat $CTRL_STATE) == live ]] && break; sleep 0.05; done
    done
}
# discard_loop DEV: 1 MiB discards through DEV over [512 MiB, 768 MiB), away from fio's bytes,
# while /tmp/discarding exists; then "discards failed" into /tmp/discard-result. Each must
# wait out the reset, as the writes do. (The streams engine's resend of a discard the block
# layer refused at once, EAGAIN, from io_uring's worker is not reached here: with it taken
# out, this check passed too.)
discard_loop() {
    local n=0 failed=0
    while [[ -e /tmp/discarding ]]; do
        blkdiscard -o $(((512 + n % 256) << 20)) -l 1048576 "$1" 2>>/tmp/discard-errors || failed=$((failed + 1))
        n=$((n + 1))
    done
    echo "$n $failed" >/tmp/discard-result
}
# resets_so_far: controller (re)starts the kernel logged since boot.
resets_so_far() { dmesg | grep -c 'nvme nvme0: .* default/read/poll queues' || true; }

for eng in passthrough:"$NG_DEV" streams:"$NS_DEV"; do
    engine=${eng%%:*} backing=${eng#*:}
    [[ -e /run/fdpblk/daemon.log ]] && : >/run/fdpblk/daemon.log
    dev=$(fdpblk_add --backing "$backing" -n 0 --engine "$engine" --policy region --slot-bytes 64K --meta-total-bytes 1M -q 2 -d 32)
    expect_eq "$engine: device" "$dev" /dev/ublkb0
    # Three resets while fio writes (it runs for several seconds under emulation).
    before=$(resets_so_far)
    three_resets &
    resets=$!
    touch /tmp/discarding
    rm -f /tmp/discard-result /tmp/discard-errors
    discard_loop "$dev" &
    discards=$!
    # Written first, then verified: the resets counted below came while it wrote.
    fio_verify "reset-$engine" "$dev" --rw=randwrite --bs=64k --size=128M --iodepth=32 --do_verify=0
    during=$(($(resets_so_far) - before))
    fio_verify "reset-$engine-verify" "$dev" --rw=randwrite --bs=64k --size=128M --iodepth=32 --verify_only=1
    wait "$resets" || true
    rm -f /tmp/discarding
    wait "$discards" || true
    read -r dn dfailed </tmp/discard-result || check_fatal "the discard loop left no result"
    expect "$engine: $dn discards during the resets, none failed ($dfailed failed: $(head -c 200 /tmp/discard-errors 2>/dev/null))" \
        test "$dn" -gt 0 -a "$dfailed" -eq 0
    expect_eq "$engine: controller live again" "$(cat $CTRL_STATE)" live
    expect "$engine: resets came while fio wrote ($during)" test "$during" -ge 1
    expect_eq "$engine: three resets in all" "$(($(resets_so_far) - before))" 3
    if [[ $engine == passthrough ]]; then
        expect "passthrough: the log says commands were held for the reset" grep -q "controller is not live" /run/fdpblk/daemon.log
    fi
    expect "$engine: no I/O error logged by fdpblk" bash -c "test -s /run/fdpblk/daemon.log && ! grep -q ERROR /run/fdpblk/daemon.log"
    [[ $engine == passthrough ]] && grep -v "^$" /run/fdpblk/daemon.log | tail -5
    expect "$engine: del" "$FDPBLK" del -n 0
done
# LMCache's own I/O on the passthrough engine across resets, with the state thread busy:
# checkpoints read back, evicted slots deallocated, own state written every 50 ms, all through
# synchronous passthrough commands that wait out a reset the same way.
[[ -x $RBW ]] || check_fatal "no $RBW: run 'cargo build --release' on the host first"
: >/run/fdpblk/daemon.log
dev=$(fdpblk_add --backing "$NG_DEV" -n 0 --engine passthrough --policy key-aware --slot-bytes 64K --meta-total-bytes 1M --persist-interval-ms 50)
script=()
for _ in $(seq 60); do script+=(put 40 checkpoint delete 20 checkpoint); done
three_resets &
resets=$!
t0=$(date +%s.%N)
expect "rawblock-writer: puts, deletes and checkpoints across resets, then verify" \
    "$RBW" --device "$dev" --slot-bytes 64K --meta-total-bytes 1M --engine io_uring --odirect -q "${script[@]}" verify
echo "# rawblock-writer ran $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
wait "$resets" || true
expect_eq "lmcache: controller live again" "$(cat $CTRL_STATE)" live
for _ in $(seq 40); do [[ $(dev_stat trim.trims) -gt 0 ]] && break; sleep 0.25; done
trims=$(dev_stat trim.trims)
expect "lmcache: evicted slots were deallocated ($trims trims)" test "${trims:-0}" -gt 0
expect "lmcache: the resets came during LMCache's I/O (commands held)" grep -q "controller is not live" /run/fdpblk/daemon.log
expect "lmcache: no error logged by fdpblk" bash -c "test -s /run/fdpblk/daemon.log && ! grep -q ERROR /run/fdpblk/daemon.log"
grep -E "WARN|ERROR" /run/fdpblk/daemon.log | tail -5 || true
expect "lmcache: del" "$FDPBLK" del -n 0
check_done
