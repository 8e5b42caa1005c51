#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 600
# fio with verify=crc32c passes on /dev/ublkbN over the streams and plain engines:
# sequential and random, 4 KiB to 32 MiB blocks, 1 and 2 queues, depth 1 and 64 (plain only
# with 2 queues of 64: it is streams' io_uring engine without the write stream).
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio

for engine in streams plain; do
    for qd in "1 1" "2 64"; do
        [[ $engine == plain && $qd == "1 1" ]] && continue
        read -r queues depth <<<"$qd"
        policy=region
        [[ $engine == plain ]] && policy=none
        dev=$(fdpblk_add --backing "$NS_DEV" -n 0 --engine "$engine" --policy "$policy" \
            --slot-bytes 64K --meta-total-bytes 1M -q "$queues" -d "$depth")
        expect_eq "device path ($engine q$queues d$depth)" "$dev" /dev/ublkb0
        iod=$depth
        tag="$engine-q$queues-d$depth"
        fio_verify "$tag-seq4k" "$dev" --rw=write --bs=4k --size=4M --iodepth="$iod"
        fio_verify "$tag-rand4k" "$dev" --rw=randwrite --bs=4k --size=4M --offset=64M --iodepth="$iod"
        fio_verify "$tag-seq1m" "$dev" --rw=write --bs=1m --size=16M --offset=128M --iodepth="$iod"
        fio_verify "$tag-rand1m" "$dev" --rw=randwrite --bs=1m --size=16M --offset=192M --iodepth="$iod"
        # 32 MiB blocks at depth 2: fio holds depth x bs of buffers in the 2 GiB guest.
        fio_verify "$tag-seq32m" "$dev" --rw=write --bs=32m --size=64M --offset=256M --iodepth=$((iod > 1 ? 2 : 1))
        # Bytes written through ublk equal the pipeline's write counter.
        expect_written 0 $(((4 + 4 + 16 + 16 + 64) << 20)) "$tag: bytes counted by fdpblk"
        expect "$tag: fdpblk del" "$FDPBLK" del -n 0
        expect "$tag: /dev/ublkb0 gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb0 ]] || exit 0; sleep 0.1; done; exit 1"
    done
done

check_done
