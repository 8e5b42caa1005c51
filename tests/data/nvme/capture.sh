#!/usr/bin/env bash
# Captures the raw FDP data structures of the emulated FDP drive, with nvme-cli's text and
# JSON output beside them, as fixtures for the parsers in src/nvme/. Run it in the VM guest
# with the output directory shared, e.g.:
#   D=$PWD/tests/data/nvme/qemu-512; mkdir -p "$D"
#   tests/vm/run.sh --share "$D" -- bash tests/data/nvme/capture.sh "$D"
# It captures a fresh drive (prefix "fresh-"), then writes with placement and captures
# again (prefix "written-"). File names: <prefix><what>.{bin,txt,json}.
set -euo pipefail
D=${1:?usage: capture.sh OUTDIR}
NS=/dev/nvme0n1 CTRL=/dev/nvme0
LBA=$(cat /sys/block/nvme0n1/queue/logical_block_size)

nvme version >"$D/nvme-version.txt"
nvme id-ctrl $CTRL -b >"$D/id-ctrl.bin"
nvme id-ctrl $CTRL -H >"$D/id-ctrl.txt"
nvme id-ns $NS -b >"$D/id-ns.bin"
nvme id-ns $NS -H >"$D/id-ns.txt"
nvme get-feature $CTRL -f 0x1d --cdw11=1 -H >"$D/feature-1d.txt"
cat /sys/block/nvme0n1/queue/max_hw_sectors_kb >"$D/max_hw_sectors_kb.txt"

snap() { # PREFIX
    local p=$1 what
    for what in configs usage stats events; do
        nvme fdp $what $CTRL -e 1 -b >"$D/$p$what.bin"
        nvme fdp $what $CTRL -e 1 >"$D/$p$what.txt"
        nvme fdp $what $CTRL -e 1 -o json >"$D/$p$what.json"
    done
    nvme fdp events $CTRL -e 1 -E -b >"$D/${p}events-host.bin"
    nvme fdp events $CTRL -e 1 -E >"$D/${p}events-host.txt"
    nvme fdp events $CTRL -e 1 -E -o json >"$D/${p}events-host.json"
    # nvme-cli 2.3 reads the RUH status into a buffer 16 bytes short (NRUHSD x 32 bytes, no
    # room for the header), so its binary output ends in the middle of the last descriptor.
    # The whole structure comes from a raw I/O Management Receive (opcode 0x12, MO 1,
    # NUMD = 4096 / 4 - 1).
    nvme fdp status $NS -b >"$D/${p}status-nvmecli.bin"
    nvme io-passthru $NS --opcode=0x12 --namespace-id=1 --cdw10=1 --cdw11=1023 \
        --data-len=4096 --read -b >"$D/${p}ruhs-4096.bin"
    nvme fdp status $NS >"$D/${p}status.txt"
    nvme fdp status $NS -o json >"$D/${p}status.json"
    # The logs with an explicit length, whole: 0x20 (its SZE), 0x21, 0x22.
    nvme get-log $CTRL --log-id=0x20 --log-len=4096 --lsi=1 -b >"$D/${p}log20-4096.bin"
    nvme get-log $CTRL --log-id=0x21 --log-len=4096 --lsi=1 -b >"$D/${p}log21-4096.bin"
    nvme get-log $CTRL --log-id=0x22 --log-len=64 --lsi=1 -b >"$D/${p}log22.bin"
}

snap fresh-
# Enable host events on PH 0..7 (QEMU logs RU Not Fully Written on RU Update), write with
# placement, update two handles.
for ph in 0 1 2 3 4 5 6 7; do
    nvme fdp set-events $NS --placement-handle=$ph --event-types=0,1,2,3 --enable >/dev/null || true
done
head -c $((64 * LBA)) /dev/urandom >/tmp/data
nvme write $NS --start-block=0 --block-count=7 --data-size=$((8 * LBA)) --data=/tmp/data --dir-type=2 --dir-spec=3 >/dev/null
nvme write $NS --start-block=64 --block-count=15 --data-size=$((16 * LBA)) --data=/tmp/data --dir-type=2 --dir-spec=5 >/dev/null
nvme write $NS --start-block=128 --block-count=3 --data-size=$((4 * LBA)) --data=/tmp/data >/dev/null
nvme fdp update $NS -p 5 >/dev/null || true
nvme write $NS --start-block=256 --block-count=1 --data-size=$((2 * LBA)) --data=/tmp/data --dir-type=2 --dir-spec=5 >/dev/null
snap written-
ls -l "$D"
