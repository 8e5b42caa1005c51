#!/usr/bin/env bash
# vm-kernel: old
# vm-fdp: on
# The 6.12-era kernel has FDP passthrough but no block-layer write streams:
# the queue attributes are absent even though the drive is an FDP drive.
. "$(dirname "$0")/../lib/check-lib.sh"

q=/sys/block/nvme0n1/queue
expect "$q/max_write_streams is absent" test ! -e $q/max_write_streams
expect "$q/write_stream_granularity is absent" test ! -e $q/write_stream_granularity
expect "the drive is still an FDP drive (CTRATT bit 19)" test "$(ctratt_fdp)" -eq 1

check_done
