#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 300
# Data written through each engine reads back bit-identical through every other path
# (the other engines and the raw namespace: LBA identity), and discard through each engine
# makes reads return zeroes. Through the streams and plain engines a discard reaches the
# namespace as a discard (the io_uring discard command on this kernel, not BLKDISCARD on a
# thread), not as a Write Zeroes, which a drive that cannot
# deallocate for one carries out by writing zeroes (the passthrough engine sends Dataset
# Management itself, which the block layer's counters do not see).
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio blkdiscard cmp
GEO=(--slot-bytes 64K --meta-total-bytes 1M)
head -c 1048576 /dev/urandom >/tmp/pattern

job() { # REGION DEV: fio arguments for region REGION (16 MiB at REGION*64 MiB) on DEV
    echo --name="r$1" --filename="$2" --direct=1 --ioengine=io_uring --rw=randwrite --bs=16k \
        --size=16M --offset=$(($1 * 64))M --iodepth=8 --verify=crc32c --randseed=$((100 + $1)) \
        --verify_fatal=1 --output-format=terse
}
# Sectors the namespace discarded (field 14 of its block stat file).
discarded() { awk '{ print $14 }' "/sys/block/$(basename "$NS_DEV")/stat"; }
add() { # ENGINE
    case $1 in
        streams) fdpblk_add --backing "$NS_DEV" -n 0 --engine streams --policy region "${GEO[@]}" ;;
        passthrough) fdpblk_add --backing "$NG_DEV" -n 0 --engine passthrough --policy region "${GEO[@]}" ;;
        plain) fdpblk_add --backing "$NS_DEV" -n 0 --engine plain --policy none "${GEO[@]}" ;;
    esac
}

engines=(streams passthrough plain)
for i in 0 1 2; do
    e=${engines[$i]}
    dev=$(add "$e")
    # shellcheck disable=SC2046
    expect "$e writes region $i" quiet fio $(job "$i" "$dev") --do_verify=0
    for j in $(seq 0 "$i"); do
        # shellcheck disable=SC2046
        expect "$e reads region $j (written by ${engines[$j]}) bit-identical" quiet fio $(job "$j" "$dev") --verify_only=1
    done
    # Discard a 1 MiB piece of this engine's region through the engine: zeroes after.
    off=$((i * 64 + 32))
    d0=$(discarded)
    expect "$e: blkdiscard 1 MiB" blkdiscard -o $((off << 20)) -l 1048576 "$dev"
    if [[ $e != passthrough ]]; then
        expect "$e: the namespace saw a discard of at least 1 MiB ($d0 -> $(discarded) sectors)" test $(($(discarded) - d0)) -ge 2048
        # On this kernel the discard is an io_uring command on the queue's ring, not a
        # BLKDISCARD on a thread of its own.
        expect "$e: the discard went as an io_uring command" log_lacks "no io_uring discard"
    fi
    expect "$e: discarded range reads zeroes through ublk" \
        bash -c "dd if=$dev bs=1M skip=$off count=1 iflag=direct status=none | cmp -s - <(head -c 1048576 /dev/zero)"
    expect "$e: and on the raw namespace" \
        bash -c "dd if=$NS_DEV bs=1M skip=$off count=1 iflag=direct status=none | cmp -s - <(head -c 1048576 /dev/zero)"
    # One discard request of 256 MiB (the ublk device takes up to 4 GiB in one; this
    # namespace up to 2 GiB per discard), its first and last MiB written before.
    big=512
    for m in $big $((big + 255)); do
        expect "$e: write 1 MiB at $m MiB" dd if=/tmp/pattern of="$dev" bs=1M seek=$m count=1 oflag=direct status=none
        expect "$e: the namespace holds it" bash -c "dd if=$NS_DEV bs=1M skip=$m count=1 iflag=direct status=none | cmp -s - /tmp/pattern"
    done
    d0=$(discarded)
    expect "$e: blkdiscard 256 MiB at $big MiB in one request" blkdiscard -o $((big << 20)) -l $((256 << 20)) "$dev"
    if [[ $e != passthrough ]]; then
        expect "$e: the namespace saw a discard of at least 256 MiB ($d0 -> $(discarded) sectors)" test $(($(discarded) - d0)) -ge $((256 << 11))
    fi
    for m in $big $((big + 255)); do
        expect "$e: $m MiB reads zeroes through ublk and on the namespace" bash -c \
            "for d in $dev $NS_DEV; do dd if=\$d bs=1M skip=$m count=1 iflag=direct status=none | cmp -s - <(head -c 1048576 /dev/zero) || exit 1; done"
    done
    expect "$e: del" "$FDPBLK" del -n 0
done
# And back: the engines that wrote first read the regions written after them.
for i in 0 1; do
    e=${engines[$i]}
    dev=$(add "$e")
    for j in $(seq $((i + 1)) 2); do
        # shellcheck disable=SC2046
        expect "$e reads region $j (written by ${engines[$j]}) bit-identical" quiet fio $(job "$j" "$dev") --verify_only=1
    done
    expect "$e: del" "$FDPBLK" del -n 0
done
for j in 0 1 2; do
    # shellcheck disable=SC2046
    expect "raw $NS_DEV reads region $j bit-identical (LBA identity)" quiet fio $(job "$j" "$NS_DEV") --verify_only=1 --offset=$((j * 64))M --size=16M
done
check_done
