#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: io
# vm-timeout: 400
# Kill the daemon with SIGKILL during a verifying fio write, `fdpblk recover`, and fio's
# verify passes: 3 times on the block device's engine, twice with NVMe passthrough (whose
# recovered daemon first waits for the killed one's commands to leave the drive: its lock
# on the char device goes with the last of them). In-flight I/O is re-issued by the driver,
# nothing is lost. A recover that finds another namespace under the saved name (a saved
# identity that is not the drive's), the namespace formatted to other blocks, or (passthrough)
# placement identifiers the drive does not list for the policy, is refused before it writes
# anything, and so is a state file that does not describe the driver's device
# (another size), and a newer fdpblk's own state on the backing; the driver's queues are
# what a recovered daemon serves.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool fio

# rounds FIRST LAST ADD-ARGS...: rounds FIRST..LAST on a device added with ADD-ARGS.
rounds() {
local first=$1 last=$2 dev i job fio_pid old new w0 watchdog
shift 2
dev=$(fdpblk_add -n 0 --policy region --slot-bytes 64K --meta-total-bytes 1M -q 2 -d 64 "$@")
expect_eq "device ($*)" "$dev" /dev/ublkb0
for i in $(seq "$first" "$last"); do
    job=(--name="r$i" --filename="$dev" --direct=1 --ioengine=io_uring --rw=randwrite --bs=64k
        --size=32M --offset=$((i * 64))M --iodepth=16 --verify=crc32c --randseed="$i" --output-format=terse)
    # At most 8 MB/s: the 32 MiB write takes 4 s or more, so the kill lands in it.
    w0=$(written_bytes 0)
    fio "${job[@]}" --do_verify=0 --rate=8m >"/tmp/recover-w$i.log" 2>&1 &
    fio_pid=$!
    sleep 1
    # Writes were served before the kill (the stats lag by up to a second), not only started.
    for _ in $(seq 30); do [[ $(written_bytes 0) -gt ${w0:-0} ]] && break; sleep 0.1; done
    expect "round $i: writes served before the kill" test "$(written_bytes 0)" -gt "${w0:-0}"
    old=$(daemon_pid 0)
    expect "round $i: fio is still writing at the kill" kill -0 "$fio_pid"
    expect "round $i: SIGKILL daemon $old" kill -9 "$old"
    if ((i == 1)); then
        expect "list: quiesced, recover named" bash -c "for j in \$(seq 50); do $FDPBLK list --json | jq -e '.[0].state == \"quiesced\" and (.[0].hint | test(\"fdpblk recover -n 0\"))' >/dev/null && exit 0; sleep 0.1; done; exit 1"
        expect "stats: the dead daemon's figures are marked" bash -c "$FDPBLK stats -n 0 2>/dev/null | head -1 | grep -q '^DAEMON NOT RUNNING'"
        expect "stats: and it exits 1, naming recover" bash -c "! $FDPBLK stats -n 0 >/dev/null 2>/tmp/recover-stats.err && grep -q 'fdpblk recover -n 0' /tmp/recover-stats.err"
        expect_eq "stats --json: daemon_up while it is dead" "$("$FDPBLK" stats -n 0 --json | jq -c .daemon_up)" false
    fi
    if ((i == first)); then
        for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
        # Its writes wait in the driver for recovery: another device on the same namespace
        # (by either of its paths) would have them land over its own.
        for other in "$NS_DEV" "$NG_DEV"; do
            out=$("$FDPBLK" add --backing "$other" -n 1 --policy none --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
            expect "round $i: add on $other refused while device 0 waits for recovery ($out)" \
                bash -c "test $rc -ne 0 && grep -q 'belongs to /dev/ublkb0, whose daemon died' <<<\"\$1\"" _ "$out"
        done
        expect "round $i: no device 1 was made" test ! -e /dev/ublkb1
        # Another namespace under the saved name (NVMe names can change at boot or when a
        # controller comes back): told by a saved identity that is not this drive's.
        saved=$(jq -r .config.backing_identity /run/fdpblk/0.json)
        expect "round $i: add saved the namespace's identity ($saved)" grep -q '^NVMe namespace model "QEMU NVMe Ctrl" serial "[^"]*" nsid 1$' <<<"$saved"
        cp /run/fdpblk/0.json /tmp/recover-state.json
        fake='NVMe namespace model "QEMU NVMe Ctrl" serial "other" nsid 1'
        jq -c --arg fake "$fake" '.config.backing_identity = $fake' /tmp/recover-state.json >/run/fdpblk/0.json
        out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
        expect "round $i: recover refuses another namespace under the saved name ($out)" \
            bash -c 'test "$1" -ne 0 && grep -qF "$2" <<<"$3"' _ "$rc" "is now the $saved, not the $fake the device was added on" "$out"
        expect "round $i: and says nothing was written" grep -q "Nothing was written" <<<"$out"
        # Placement identifiers the drive does not list for the policy now (its FDP
        # configuration changed while the daemon was dead, which takes new namespaces):
        # refused, naming both.
        if [[ $(jq -r .config.engine /tmp/recover-state.json) == passthrough ]]; then
            pids=$(jq -c .config.pids /tmp/recover-state.json)
            expect "round $i: add saved placement identifiers ($pids)" test "$(jq '.config.pids | length' /tmp/recover-state.json)" -gt 1
            jq -c '.config.pids |= reverse' /tmp/recover-state.json >/run/fdpblk/0.json
            out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
            expect "round $i: recover refuses placement identifiers the drive does not list so ($out)" \
                bash -c 'test "$1" -ne 0 && grep -qF "lists placement identifiers ${2//,/, } for policy region, not the" <<<"$3"' _ "$rc" "$pids" "$out"
            checked_pids=1
        fi
        # A state file that does not read (another fdpblk version's, after an upgrade by
        # killing the daemon): its device may hold this backing's writes, so it is not free.
        echo '{' >/run/fdpblk/0.json
        out=$("$FDPBLK" add --backing "$NS_DEV" -n 1 --policy none --slot-bytes 64K --meta-total-bytes 1M 2>&1) && rc=0 || rc=$?
        expect "round $i: add refused while device 0's state file does not read ($out)" \
            bash -c 'test "$1" -ne 0 && grep -qF "/dev/ublkb0 has a state file that does not read" <<<"$2" && grep -qF "fdpblk del -n 0" <<<"$2"' _ "$rc" "$out"
        expect "round $i: still no device 1" test ! -e /dev/ublkb1
        # A newer fdpblk's own state in the backing's tail (a rollback while its daemon ran,
        # which then died): a recovery would start afresh over it, so it is refused, naming
        # that fdpblk and `add --force`; the copy put back, the recovery below goes ahead.
        cp /tmp/recover-state.json /run/fdpblk/0.json
        sb1=$(($(dev_stat own_state.region_offset) + 4096))
        # sb newer|back: copy 1 saved and replaced by a whole superblock of format 2 (magic,
        # version 2, zeros, the CRC-32 of its first 4092 bytes, which gzip's trailer holds);
        # or put back.
        sb() {
            if [[ $1 == newer ]]; then
                dd if="$NS_DEV" of=/tmp/recover-sb1 bs=4096 skip=$((sb1 / 4096)) count=1 iflag=direct status=none &&
                    { printf 'FDPBSB01\x02\x00\x00\x00'; head -c 4080 /dev/zero; } >/tmp/recover-sb2 &&
                    gzip -c /tmp/recover-sb2 | tail -c 8 | head -c 4 >>/tmp/recover-sb2 &&
                    dd if=/tmp/recover-sb2 of="$NS_DEV" bs=4096 seek=$((sb1 / 4096)) count=1 oflag=direct conv=notrunc status=none
            else
                dd if=/tmp/recover-sb1 of="$NS_DEV" bs=4096 seek=$((sb1 / 4096)) count=1 oflag=direct conv=notrunc status=none
            fi
        }
        expect "round $i: a format-2 superblock into copy 1 of the state at byte $sb1" sb newer
        out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
        expect "round $i: recover refuses a newer fdpblk's own state ($out)" \
            bash -c 'test "$1" -ne 0 && grep -qF "holds fdpblk'"'"'s own state in format 2, written by a newer fdpblk (this one reads format 1)" <<<"$2" && grep -qF "add it again with --force" <<<"$2"' _ "$rc" "$out"
        expect "round $i: copy 1 put back" sb back
        # A state file that is not this device's (smaller than the driver's device: the
        # backing check takes a larger backing for a grown namespace) is refused; one that
        # names fewer queues than the driver gave recovers with the driver's (libublk would
        # index past its queues).
        jq -c '.config.backing_bytes -= 8388608 | .config.exported_bytes -= 8388608' /tmp/recover-state.json >/run/fdpblk/0.json
        out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
        expect "round $i: recover refuses a state file of another size ($out)" \
            bash -c 'test "$1" -ne 0 && grep -qF "but its state file /run/fdpblk/0.json says" <<<"$2" && grep -qF "fdpblk del -n 0" <<<"$2"' _ "$rc" "$out"
        jq -c '.config.queues = 1' /tmp/recover-state.json >/run/fdpblk/0.json
        recovered_queues=1
    fi
    if "$FDPBLK" recover -n 0 >"/tmp/recover-$i.log" 2>&1; then
        ok "round $i: fdpblk recover"
    else
        cat "/tmp/recover-$i.log" /run/fdpblk/daemon.log
        not_ok "round $i: fdpblk recover"
    fi
    new=$(daemon_pid 0)
    expect "round $i: a new daemon ($new) serves the device" test "$new" != "$old"
    if [[ ${recovered_queues:-} ]]; then
        q=$(nproc); ((q > 2)) && q=2
        expect_eq "round $i: a state file of 1 queue recovered with the driver's $q" "$(jq .config.queues /run/fdpblk/0.json)" "$q"
        recovered_queues=
    fi
    if ((i == 1)); then
        expect_eq "stats --json: daemon_up once recovered" "$("$FDPBLK" stats -n 0 --json | jq -c .daemon_up)" true
    fi
    # If recovery failed, fio would wait forever on the quiesced device.
    ( sleep 60; kill -9 "$fio_pid" 2>/dev/null ) &
    watchdog=$!
    expect "round $i: fio write finished without error" wait "$fio_pid"
    kill "$watchdog" 2>/dev/null # else it kills whatever takes that pid later
    expect "round $i: fio verify of everything written" \
        quiet fio "${job[@]}" --verify_only=1 --verify_fatal=1
done
expect "fdpblk del" "$FDPBLK" del -n 0
}

rounds 1 2 --backing "$NS_DEV"
rounds 4 5 --backing "$NG_DEV" --engine passthrough
expect "the passthrough rounds checked a recovery's placement identifiers" test "${checked_pids:-}" = 1

# A namespace formatted to other blocks while its daemon was dead keeps its name, serial and
# size; a recovered passthrough daemon would put every command at another LBA.
dev=$(fdpblk_add -n 0 --backing "$NG_DEV" --engine passthrough --policy region --slot-bytes 64K --meta-total-bytes 1M -q 4)
expect_eq "format: device" "$dev" /dev/ublkb0
# The driver gives at most one queue per CPU: the state file says what runs.
q=$(nproc); ((q > 4)) && q=4
expect_eq "format: 4 queues asked, the driver's $q saved" "$(jq .config.queues /run/fdpblk/0.json)" "$q"
old=$(daemon_pid 0)
expect "format: SIGKILL daemon $old" kill -9 "$old"
for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
expect "format: the namespace to 4096-byte blocks (LBA format 4)" quiet nvme format /dev/nvme0 --namespace-id=1 --lbaf=4 --force
out=$("$FDPBLK" recover -n 0 2>&1) && rc=0 || rc=$?
expect "format: recover refuses the namespace's new blocks ($out)" \
    bash -c 'test "$1" -ne 0 && grep -qF "now has 4096-byte blocks, not the 512-byte blocks it had" <<<"$2"' _ "$rc" "$out"
expect "format: fdpblk del" "$FDPBLK" del -n 0
# Back as it was for the checks after this one, whatever happened above.
expect "format: the namespace back to 512-byte blocks" quiet nvme format /dev/nvme0 --namespace-id=1 --lbaf=0 --force
expect_eq "format: 512-byte blocks again" "$(cat /sys/block/nvme0n1/queue/logical_block_size)" 512
check_done
