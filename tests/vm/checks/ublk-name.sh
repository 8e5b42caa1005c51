#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: lifecycle
# --name gives a path that stays the same when the device number changes (LMCache discards
# its checkpoint when device_path changes) and is never taken over by a second device;
# list/stats/features answer; SIGTERM stops cleanly. `down` finds the daemon that serves a
# device when its state file names a dead one, and a recovered daemon writes the state file
# it could not write at first. A dead fdpblk device whose state file is gone is listed as
# fdpblk's (by its tag), and an add is refused until it is deleted.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
GEO=(--slot-bytes 64K --meta-total-bytes 1M)

dev=$(fdpblk_add --backing "$NS_DEV" -n 3 --name kv0 "${GEO[@]}")
expect_eq "device" "$dev" /dev/ublkb3
expect_eq "/dev/fdpblk/kv0" "$(readlink /dev/fdpblk/kv0)" /dev/ublkb3
expect_eq "fdpblk name 3 (udev rule)" "$("$FDPBLK" name 3)" kv0
expect_eq "stats --name kv0 is device 3's" "$("$FDPBLK" stats --name kv0 --json | jq -c '[.id, .name]')" '[3,"kv0"]'
expect "stats --name kv0 --prometheus is device 3's" bash -c "$FDPBLK stats --name kv0 --prometheus | grep -q 'id=\"3\",name=\"kv0\"}'"
# deploy/99-fdpblk.rules as deploy/README.md installs it: udev's own dry run on the device
# names the same link (the guest runs no udevd; `udevadm test` applies the rules by itself).
if command -v udevadm >/dev/null; then
    repo=$(cd "$(dirname "$0")/../../.." && pwd)
    install -m 0755 "$FDPBLK" /usr/local/bin/fdpblk
    install -D -m 0644 "$repo/deploy/99-fdpblk.rules" /etc/udev/rules.d/99-fdpblk.rules
    links=$(udevadm test --action=add /sys/class/block/ublkb3 2>&1 | sed -n 's/^DEVLINKS=//p')
    expect "udevadm test: deploy/99-fdpblk.rules links /dev/fdpblk/kv0 (DEVLINKS=$links)" \
        grep -qw /dev/fdpblk/kv0 <<<"$links"
    # A partition of a ublk device (ublkb1p1) is not named: udev's %n would be its partition
    # number, 1, and so name it after device 1 (kv1).
    truncate -s 64M /var/tmp/kv1.img
    expect "device 1 named kv1" quiet fdpblk_add --backing /var/tmp/kv1.img --engine plain --policy none -n 1 --name kv1 "${GEO[@]}"
    lbs=$(blockdev --getss /dev/ublkb1)
    # An MBR with one partition at block 2048, 2048 blocks long.
    printf '\x00\x00\x00\x00\x83\x00\x00\x00\x00\x08\x00\x00\x00\x08\x00\x00' >/tmp/part
    { head -c 446 /dev/zero; cat /tmp/part; head -c 48 /dev/zero; printf '\x55\xaa'; head -c $((lbs - 512)) /dev/zero; } >/tmp/mbr
    expect "an MBR on ublkb1" dd if=/tmp/mbr of=/dev/ublkb1 bs="$lbs" count=1 oflag=direct status=none
    expect "the kernel reads its partition" blockdev --rereadpt /dev/ublkb1
    expect "ublkb1p1 exists" test -e /sys/class/block/ublkb1p1
    ptest=$(udevadm test --action=add /sys/class/block/ublkb1p1 2>&1)
    plinks=$(sed -n 's/^DEVLINKS=//p' <<<"$ptest")
    # (udevadm test ran the rules for the partition: it names the device it processed.)
    expect "udevadm test: no fdpblk link for the partition ublkb1p1 (DEVLINKS=$plinks)" bash -c "grep -q '^DEVNAME=/dev/ublkb1p1' <<<\"\$1\" && ! grep -q /dev/fdpblk/ <<<\"\$2\"" _ "$ptest" "$plinks"
    # By name, as an OnFailure= unit knows it (deploy/README.md).
    expect "del --name kv1 deletes device 1" "$FDPBLK" del --name kv1
    expect "device 1 is gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb1 ]] || exit 0; sleep 0.1; done; exit 1"
    expect "device 3 (kv0) still runs" test -b /dev/ublkb3
    out=$("$FDPBLK" del --name nosuch 2>&1) && rc=0 || rc=$?
    expect "del --name of no device fails naming it ($out)" bash -c "test $rc -ne 0 && grep -q 'no fdpblk device named nosuch' <<<'$out'"
    # fdpblk-release@ after a unit whose adds were all refused: no device, nothing to release.
    out=$("$FDPBLK" del --name nosuch --if-orphaned 2>&1) && rc=0 || rc=$?
    expect "del --name --if-orphaned of no device succeeds, saying so ($out)" bash -c "test $rc -eq 0 && grep -q 'no fdpblk device named nosuch: nothing to delete' <<<'$out'"
    # A daemon whose state file names a dead one (a recovery whose state file write failed)
    # still serves: `down` stops it, where it used to keep it "for recovery".
    truncate -s 64M /var/tmp/kv4.img
    expect "device 1 named kv4" quiet fdpblk_add --backing /var/tmp/kv4.img --engine plain --policy none -n 1 --name kv4 "${GEO[@]}"
    # Its state file unreadable: `down` cannot stop it by name, and says so (not "nothing to
    # stop"), by its name link; another name is not held up by it.
    cp /run/fdpblk/1.json /tmp/kv4-good.json && echo '{"torn' >/run/fdpblk/1.json
    out=$("$FDPBLK" down kv4 2>&1) && rc=0 || rc=$?
    expect "down kv4 with device 1's state file unreadable fails, naming it ($out)" bash -c "test $rc -eq 1 && grep -qF '/dev/fdpblk/kv4 leads to device 1, whose state file does not read' <<<\"\$1\"" _ "$out"
    out=$("$FDPBLK" down nosuch 2>&1) && rc=0 || rc=$?
    expect "down nosuch meanwhile: nothing to stop ($out)" bash -c "test $rc -eq 0 && grep -qF 'nothing to stop' <<<\"\$1\"" _ "$out"
    # The same for what fdpblk-release@ runs.
    out=$("$FDPBLK" del --name kv4 --if-orphaned 2>&1) && rc=0 || rc=$?
    expect "del --name kv4 --if-orphaned fails, naming device 1 ($out)" bash -c "test $rc -eq 1 && grep -qF 'leads to device 1, whose state file does not read' <<<\"\$1\"" _ "$out"
    out=$("$FDPBLK" del --name nosuch --if-orphaned 2>&1) && rc=0 || rc=$?
    expect "del --name nosuch --if-orphaned meanwhile: nothing to delete ($out)" bash -c "test $rc -eq 0 && grep -qF 'nothing to delete' <<<\"\$1\"" _ "$out"
    expect "device 1 still runs" test -b /dev/ublkb1
    cp /tmp/kv4-good.json /run/fdpblk/1.json
    jq -c '.pid_start = 0' /run/fdpblk/1.json >/tmp/kv4-state.json && cp /tmp/kv4-state.json /run/fdpblk/1.json
    out=$("$FDPBLK" down kv4 2>&1) && rc=0 || rc=$?
    expect "down kv4 stops the device its state file's daemon does not serve ($out)" bash -c "test $rc -eq 0 && grep -qF 'stopped /dev/ublkb1 (kv4)' <<<\"\$1\"" _ "$out"
    expect "device 1 is gone again" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb1 ]] || exit 0; sleep 0.1; done; exit 1"
    # A recovery whose state file cannot be written (/run/fdpblk full) serves under the dead
    # daemon's file, and writes its own once there is room.
    truncate -s 64M /var/tmp/kv5.img
    expect "device 1 named kv5" quiet fdpblk_add --backing /var/tmp/kv5.img --engine plain --policy none -n 1 --name kv5 "${GEO[@]}"
    old=$(daemon_pid 1)
    expect "kv5: SIGKILL daemon $old" kill -9 "$old"
    for _ in $(seq 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
    rm -rf /tmp/run-fdpblk && mkdir -p /tmp/run-fdpblk && cp -a /run/fdpblk/. /tmp/run-fdpblk/
    # (Else the fill below would fill /run itself.)
    mount -t tmpfs -o size=64m tmpfs /run/fdpblk && cp -a /tmp/run-fdpblk/. /run/fdpblk/ ||
        check_fatal "kv5: /run/fdpblk on a tmpfs of its own, its files copied"
    head -c 128M /dev/zero >/run/fdpblk/fill 2>/dev/null || true  # till it is full
    expect "kv5: recovered with /run/fdpblk full" quiet "$FDPBLK" recover -n 1
    expect_eq "kv5: its state file still names the dead daemon" "$(daemon_pid 1)" "$old"
    # Meanwhile list, stats and add know the new daemon by its hold on the device.
    expect "kv5: list names the new daemon's pid, not $old" bash -c "$FDPBLK list --json | jq -e '.[] | select(.id == 1) | .pid != null and .pid != $old' >/dev/null"
    expect_eq "kv5: stats --json: daemon_up" "$("$FDPBLK" stats -n 1 --json 2>/dev/null | jq -c .daemon_up)" true
    # The stats file still holds the dead daemon's figures: said so, and not exported as current.
    expect_eq "kv5: stats --json: the figures are not the serving daemon's" "$("$FDPBLK" stats -n 1 --json 2>/dev/null | jq -c .stats_of_serving_daemon)" false
    expect "kv5: stats names them the previous daemon's" bash -c "$FDPBLK stats -n 1 | grep -q \"^PREVIOUS DAEMON'S FIGURES (pid $old)\""
    prom=$("$FDPBLK" stats -n 1 --prometheus)
    expect "kv5: metrics: up, with an age, without the dead daemon's figures ($(grep -c . <<<"$prom") lines)" \
        bash -c 'grep -q "^fdpblk_daemon_up{.*} 1$" <<<"$1" && grep -q "^fdpblk_stats_age_seconds{" <<<"$1" && ! grep -q "^fdpblk_slots{\|^fdpblk_state_age_seconds{" <<<"$1"' _ "$prom"
    out=$("$FDPBLK" add --backing /var/tmp/kv5.img -n 2 --engine plain --policy none "${GEO[@]}" 2>&1) && rc=0 || rc=$?
    expect "kv5: a second add on its backing is refused as served, not as a dead daemon's ($out)" \
        bash -c 'test "$1" -ne 0 && grep -qE "is served by /dev/ublkb1 \(daemon pid [0-9]+\)" <<<"$2" && ! grep -q "pid $3)" <<<"$2"' _ "$rc" "$out" "$old"
    ((rc == 0)) && "$FDPBLK" del -n 2
    rm /run/fdpblk/fill
    expect "kv5: the new daemon writes its state file once there is room" \
        bash -c 'for i in $(seq 50); do p=$(sed -n "s/.*\"pid\":\([0-9]*\).*/\1/p" /run/fdpblk/1.json); [[ $p && $p != "$1" ]] && kill -0 "$p" && exit 0; sleep 0.1; done; exit 1' _ "$old"
    expect "kv5: and its own stats, then current" \
        bash -c 'for i in $(seq 50); do [[ $($1 stats -n 1 --json | jq -c .stats_of_serving_daemon) == true ]] && $1 stats -n 1 --prometheus | grep -q "^fdpblk_state_age_seconds{" && exit 0; sleep 0.1; done; exit 1' _ "$FDPBLK"
    expect "kv5: down" quiet "$FDPBLK" down kv5
    expect "kv5: device 1 is gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb1 ]] || exit 0; sleep 0.1; done; exit 1"
    # Back on /run's own directory, as the tmpfs left it (device 1's files went with `down`).
    rm -rf /tmp/run-fdpblk && mkdir -p /tmp/run-fdpblk && cp -a /run/fdpblk/. /tmp/run-fdpblk/
    umount -l /run/fdpblk && rm -f /run/fdpblk/1.json /run/fdpblk/1.stats.json && cp -a /tmp/run-fdpblk/. /run/fdpblk/
    expect "kv5: no state file of device 1 left" test ! -e /run/fdpblk/1.json
else
    not_ok "udevadm missing in the guest (tests/vm/setup.sh installs udev)"
fi
# What an earlier device 1 left (its state file and name link: a daemon killed, then its
# device deleted by another tool) is cleared when a new device gets id 1, before its block node
# appears: the new device is not named after the old one, so no two names lead to it.
truncate -s 64M /var/tmp/kv6.img /var/tmp/kv7.img
expect "device 1 named kv6" quiet fdpblk_add --backing /var/tmp/kv6.img --engine plain --policy none -n 1 --name kv6 "${GEO[@]}"
cp /run/fdpblk/1.json /tmp/kv6-state.json
# (The stats are written a moment after the add returns.)
for _ in $(seq 100); do [[ -e /run/fdpblk/1.stats.json ]] && break; sleep 0.1; done
cp /run/fdpblk/1.stats.json /tmp/kv6-stats.json || check_fatal "no stats file for device 1 after 10 s"
expect "kv6: del" quiet "$FDPBLK" del -n 1
expect "kv6: device 1 is gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb1 ]] || exit 0; sleep 0.1; done; exit 1"
cp /tmp/kv6-state.json /run/fdpblk/1.json && ln -sfn /dev/ublkb1 /dev/fdpblk/kv6
# The stats of a device that is gone (its files left over) name del, not recover.
cp /tmp/kv6-stats.json /run/fdpblk/1.stats.json
out=$("$FDPBLK" stats -n 1 2>&1) && rc=0 || rc=$?
expect "kv6 gone: stats fails naming del (exit $rc)" bash -c 'test "$1" -ne 0 && grep -q "device is gone (its state file is left over): .fdpblk del -n 1. removes it" <<<"$2"' _ "$rc" "$out"
rm -f /run/fdpblk/1.stats.json
expect "device 1 named kv7" quiet fdpblk_add --backing /var/tmp/kv7.img --engine plain --policy none -n 1 --name kv7 "${GEO[@]}"
expect "kv7: the earlier device's link /dev/fdpblk/kv6 is gone" test ! -L /dev/fdpblk/kv6
expect_eq "kv7: fdpblk name 1 (udev rule)" "$("$FDPBLK" name 1)" kv7
expect "kv7: the daemon logged it" log_has "removed the state file left by an earlier device 1 \\(named kv6\\)"
expect "kv7: del" quiet "$FDPBLK" del -n 1
# A stale state file that names the name being added (device 1 gone) is removed by that add,
# under the add lock, with its link; the new device gets the name.
expect "kv7: device 1 is gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb1 ]] || exit 0; sleep 0.1; done; exit 1"
jq -c '.config.name = "kv8"' /tmp/kv6-state.json >/run/fdpblk/1.json && ln -sfn /dev/ublkb1 /dev/fdpblk/kv8
expect "device 2 named kv8 over a stale file of device 1" quiet fdpblk_add --backing /var/tmp/kv7.img --engine plain --policy none -n 2 --name kv8 "${GEO[@]}"
expect "kv8: the stale state file of device 1 is gone" test ! -e /run/fdpblk/1.json
expect "kv8: /dev/fdpblk/kv8 leads to device 2" test "$(readlink /dev/fdpblk/kv8)" = /dev/ublkb2
expect "kv8: del" quiet "$FDPBLK" del --name kv8
# A name that cannot be linked (something else at /dev/fdpblk/NAME) fails the add, as a
# missing state file does: LMCache's device_path would not exist.
mkdir -p /dev/fdpblk/kv2
truncate -s 64M /var/tmp/kv2.img
out=$("$FDPBLK" add --backing /var/tmp/kv2.img --engine plain --policy none -n 1 --name kv2 "${GEO[@]}" 2>&1) && rc=0 || rc=$?
expect "add fails where its name cannot be linked ($out)" bash -c "test $rc -ne 0 && grep -q 'cannot link /dev/fdpblk/kv2 to it' <<<\"\$1\"" _ "$out"
# (Its daemon deletes the device, then its state file, after the add has answered.)
expect "and leaves no device nor state file" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb1 || -e /run/fdpblk/1.json ]] || exit 0; sleep 0.1; done; exit 1"
expect "nor a temporary link" bash -c "! compgen -G '/dev/fdpblk/.kv2.*'"
# In the foreground (as under systemd) the daemon is the command: it stops the device and
# exits non-zero, with the error.
out=$(timeout 60 "$FDPBLK" add --foreground --backing /var/tmp/kv2.img --engine plain --policy none -n 1 --name kv2 "${GEO[@]}" 2>&1) && rc=0 || rc=$?
expect "add --foreground exits 1 where its name cannot be linked (rc $rc: $out)" bash -c "test $rc -eq 1 && grep -q 'cannot link /dev/fdpblk/kv2 to it' <<<\"\$1\"" _ "$out"
expect "and leaves no device nor state file" bash -c "! [[ -e /dev/ublkb1 || -e /run/fdpblk/1.json ]]"
rmdir /dev/fdpblk/kv2
expect "list --json names it" bash -c "$FDPBLK list --json | grep -q '\"name\":\"kv0\"'"
head -c 1048576 /dev/urandom >/tmp/p
expect "write through the stable name" dd if=/tmp/p of=/dev/fdpblk/kv0 bs=1M seek=8 count=1 oflag=direct status=none
expect "features" quiet "$FDPBLK" features
expect "features --json reports write streams" bash -c "$FDPBLK features --json | grep -q '\"nvme0n1\":8'"
expect_written 3 1048576 "stats --json counts the write"
host=$("$FDPBLK" stats -n 3 --json | sed -n 's/.*"fdp":{[^}]*"host_bytes":\([0-9]*\).*/\1/p')
expect "stats: the drive's host bytes since add ($host) include the 1 MiB written" test "${host:-0}" -ge 1048576
expect "stats text shows the drive's counters" bash -c "$FDPBLK stats -n 3 | grep -q 'drive since add: host'"
# Read by a child process (`drive-deltas`), for the metrics too.
expect "metrics: the drive's host bytes since add" bash -c "$FDPBLK stats -n 3 --prometheus | grep -q '^fdpblk_drive_host_written_bytes_total{.*} [1-9]'"
expect "no drive-statistics child is left behind" bash -c "! pgrep -x fdp-counters"
expect "stats text shows fdpblk's own state" bash -c "$FDPBLK stats -n 3 | grep -q '^own state: saved in the reserved tail ([0-9]* cycles'"
expect_eq "no failed requests on a healthy device" "$("$FDPBLK" stats -n 3 --json | jq -c '[.queues[].errors] | add')" 0
# A request that fails (its backing file cut short under it: a read past its end is an I/O
# error) is counted per queue, named in stats and the metrics, and logged.
truncate -s 64M /var/tmp/fail.img
expect "device 9 on a file" quiet fdpblk_add --backing /var/tmp/fail.img --engine plain --policy none -n 9 "${GEO[@]}"
truncate -s 1M /var/tmp/fail.img
expect "a read past the cut fails" bash -c "! dd if=/dev/ublkb9 of=/dev/null bs=4k count=1 skip=4096 iflag=direct status=none"
# (The daemon rewrites its stats every second.)
expect "stats --json counts it" bash -c "for i in \$(seq 30); do $FDPBLK stats -n 9 --json | jq -e '([.queues[].errors] | add) >= 1 and ([.queues[].last_error] | any(. == \"Input/output error (os error 5)\"))' >/dev/null && exit 0; sleep 0.2; done; exit 1"
expect "stats text names it" bash -c "$FDPBLK stats -n 9 | grep -q '^FAILED REQUESTS per queue'"
expect "and its metric" bash -c "$FDPBLK stats -n 9 --prometheus | grep -q '^fdpblk_queue_errors_total{.*} [1-9]'"
expect "the daemon logged it" log_has "a request failed \\(a read of 4096 bytes at byte 16777216\\)"
# Its daemon killed, the cut backing is refused by recover before anything is written to it.
pid9=$(daemon_pid 9)
expect "SIGKILL device 9's daemon" kill -KILL "$pid9"
expect "it exits" bash -c "for i in \$(seq 100); do kill -0 $pid9 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
out=$("$FDPBLK" recover -n 9 2>&1) && rc=0 || rc=$?
expect "recover refuses a backing smaller than when added ($out)" test "$rc" -ne 0
expect "and names both sizes" grep -q "is 1048576 bytes now, smaller than the 67108864 it had when the device was added" <<<"$out"
expect_eq "the cut file was not written" "$(stat -c %s /var/tmp/fail.img)" 1048576
# Made again at its size (another file under the path): refused too, by its identity. (The
# old file is held open meanwhile, so that the new one cannot get its inode number.)
exec 4</var/tmp/fail.img
rm /var/tmp/fail.img
truncate -s 64M /var/tmp/fail.img
out=$("$FDPBLK" recover -n 9 2>&1) && rc=0 || rc=$?
expect "recover refuses another file under the saved path ($out)" \
    bash -c 'test "$1" -ne 0 && grep -Eq "backing /var/tmp/fail.img is now the file inode [0-9]+ on device [0-9]+:[0-9]+( made [0-9.]+)?, not the file inode" <<<"$2"' _ "$rc" "$out"
expect_eq "nor was it written" "$(du -k /var/tmp/fail.img | cut -f1)" 0
exec 4<&-
# A writer killed between its write and its rename leaves its temp file: del takes it too.
: >/run/fdpblk/9.stats.json.tmp.99999.0
expect "del device 9" "$FDPBLK" del -n 9
expect "and a temp file of its stats" test ! -e /run/fdpblk/9.stats.json.tmp.99999.0
pid=$(daemon_pid 3)
expect "SIGTERM the daemon" kill -TERM "$pid"
expect "daemon exits" bash -c "for i in \$(seq 100); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
expect "device removed" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb3 ]] || exit 0; sleep 0.1; done; exit 1"
expect "state removed" test ! -e /run/fdpblk/3.json
expect "name link removed" test ! -e /dev/fdpblk/kv0

# Same name on another device number: the path LMCache uses does not change.
dev=$(fdpblk_add --backing "$NS_DEV" -n 5 --name kv0 "${GEO[@]}")
expect_eq "new number" "$dev" /dev/ublkb5
expect_eq "same stable path" "$(readlink /dev/fdpblk/kv0)" /dev/ublkb5
expect "data intact through the stable path (LBA identity)" \
    bash -c "dd if=/dev/fdpblk/kv0 bs=1M skip=8 count=1 iflag=direct status=none | cmp - /tmp/p"
# A second device under a name in use is refused: the link keeps pointing at the first.
truncate -s 64M /var/tmp/name.img
out=$("$FDPBLK" add --backing /var/tmp/name.img --engine plain --policy none -n 6 --name kv0 "${GEO[@]}" 2>&1) && rc=0 || rc=$?
expect "add under a name in use fails ($out)" test "$rc" -ne 0
expect "the error names the device holding it" grep -q "kv0 is taken by /dev/ublkb5" <<<"$out"
expect "no second device" test ! -e /dev/ublkb6
expect_eq "link unchanged" "$(readlink /dev/fdpblk/kv0)" /dev/ublkb5
# Two adds under one new name at once both pass add's own check: the daemons settle it, so
# one device gets the name and the other add fails naming it. (Three rounds; the add lock is
# held while both start, so that both daemons get past add's check.)
truncate -s 64M /var/tmp/race1.img /var/tmp/race2.img
# lock_waiters N: waits (up to 5 s) until N processes wait for the add lock (flock entries
# marked "->" in /proc/locks for its inode), where a fixed sleep took 3 s a round.
lock_waiters() {
    local ino i
    ino=$(stat -c %i /run/fdpblk/.add.lock)
    for i in $(seq 50); do
        (($(grep -c -- "-> FLOCK .*:$ino " /proc/locks || true) >= $1)) && return 0
        sleep 0.1
    done
    return 1
}
raced=0
for round in 1 2 3; do
    exec 7>/run/fdpblk/.add.lock
    flock 7
    "$FDPBLK" add --backing /var/tmp/race1.img --engine plain --policy none -n 11 --name kvrace "${GEO[@]}" >/tmp/race1.out 2>&1 7>&- &
    p1=$!
    "$FDPBLK" add --backing /var/tmp/race2.img --engine plain --policy none -n 12 --name kvrace "${GEO[@]}" >/tmp/race2.out 2>&1 7>&- &
    p2=$!
    expect "round $round: both adds wait for the add lock" lock_waiters 2
    flock -u 7
    exec 7>&-
    r1=0 r2=0
    wait "$p1" || r1=$?
    wait "$p2" || r2=$?
    # (A refused daemon deletes its device, then its state file, after its add answered.)
    for _ in $(seq 50); do [[ ! -e /run/fdpblk/11.json || ! -e /run/fdpblk/12.json ]] && break; sleep 0.1; done
    outs="$(cat /tmp/race1.out /tmp/race2.out | tr '\n' ' ')"
    if ((r1 == 0 && r2 != 0)); then win=11 lose=12; elif ((r1 != 0 && r2 == 0)); then win=12 lose=11; else win='' lose=''; fi
    expect "round $round: one of two concurrent adds under one name succeeds (exits $r1 and $r2: $outs)" test -n "$win"
    [[ -n $win ]] || { "$FDPBLK" del -n 11 >/dev/null 2>&1; "$FDPBLK" del -n 12 >/dev/null 2>&1; continue; }
    expect "round $round: the other fails, naming the name taken" grep -q -- "--name kvrace is taken by /dev/ublkb$win" "/tmp/race$((lose - 10)).out"
    grep -q "added at the same time" "/tmp/race$((lose - 10)).out" && raced=$((raced + 1))
    expect_eq "round $round: the name links to the one added" "$(readlink /dev/fdpblk/kvrace)" "/dev/ublkb$win"
    expect "round $round: the other's device and state file are gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkb$lose || -e /run/fdpblk/$lose.json ]] || exit 0; sleep 0.1; done; exit 1"
    expect "round $round: del the one added" "$FDPBLK" del -n "$win"
    expect "round $round: the name is gone with it" bash -c "for i in \$(seq 50); do [[ -e /dev/fdpblk/kvrace ]] || exit 0; sleep 0.1; done; exit 1"
done
expect "the daemons, not add's own check, refused the second add ($raced of 3 rounds)" test "$raced" -ge 1
# A stopping daemon deletes its device and then its files under the add lock: an add given
# the freed id in between would have its new state file removed by the stopping daemon.
dev=$(fdpblk_add --backing /var/tmp/race1.img --engine plain --policy none -n 11 "${GEO[@]}")
expect_eq "add a device to stop while the add lock is held" "$dev" /dev/ublkb11
exec 7>/run/fdpblk/.add.lock
flock 7
"$FDPBLK" del -n 11 >/tmp/del11.out 2>&1 7>&- &
pdel=$!
expect "the stopping daemon waits for the add lock" lock_waiters 1
expect "lock held: the stopping daemon keeps its device (/dev/ublkc11) and state file" test -e /dev/ublkc11 -a -e /run/fdpblk/11.json
flock -u 7
exec 7>&-
expect "lock free: del finishes ($(tr '\n' ' ' </tmp/del11.out))" wait "$pdel"
expect "device and state file gone" bash -c "[[ ! -e /dev/ublkc11 && ! -e /run/fdpblk/11.json ]]"
# A dead device without its state file: the tag fdpblk keeps in the driver's device info
# (ublksrv_flags) says it is fdpblk's, where no live server can.
dev=$(fdpblk_add --backing /var/tmp/race2.img --engine plain --policy none -n 12 "${GEO[@]}")
expect_eq "add a device to kill" "$dev" /dev/ublkb12
pid=$(daemon_pid 12)
mv /run/fdpblk/12.json /var/tmp/12.json
expect "SIGKILL its daemon" kill -9 "$pid"
expect "it exits" bash -c "for i in \$(seq 100); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
poll_eq "list --json: a dead device without a state file is fdpblk's, by its tag" true bash -c "$FDPBLK list --json | jq -c '[.[] | select(.id == 12) | .hint | test(\"fdpblk.s, its daemon is gone\")] == [true]'"
# Its writes, held by the driver, may be any backing's: an add is refused until it is deleted
# (once the driver holds them: it quiesces the device a moment after the daemon's exit).
poll_eq "list --json: it is quiesced" '"quiesced"' bash -c "$FDPBLK list --json | jq -c '.[] | select(.id == 12) | .state'"
before=$(ls /sys/class/ublk-char)
out=$("$FDPBLK" add --backing /var/tmp/race2.img --engine plain --policy none "${GEO[@]}" 2>&1) && rc=0 || rc=$?
expect "an add on its backing is refused ($out)" test "$rc" -ne 0
expect "naming the device and del" grep -q "/dev/ublkb12 is fdpblk's and its daemon died, but its state file in /run/fdpblk is gone .*; .fdpblk del -n 12. deletes it first" <<<"$out"
expect_eq "no device was made" "$(ls /sys/class/ublk-char)" "$before"
mv /var/tmp/12.json /run/fdpblk/12.json
expect "del with its state file back" "$FDPBLK" del -n 12
expect "device 12 gone" bash -c "for i in \$(seq 50); do [[ -e /dev/ublkc12 ]] || exit 0; sleep 0.1; done; exit 1"
# A device whose state file went (a cleared /run) is still listed, and `del` removes it.
pid=$(daemon_pid 5)
mv /run/fdpblk/5.json /var/tmp/5.json
expect "list shows the device without a state file, served by fdpblk" bash -c "$FDPBLK list | grep -q '^/dev/ublkb5  live  no state file in /run/fdpblk  (served by fdpblk (pid $pid) but its state file is gone: .fdpblk del -n 5. deletes it)$'"
expect_eq "list --json: its id, error and hint" "$("$FDPBLK" list --json | jq -c '[.[] | select(.id == 5) | (.state, (.error | test("no state file")), (.hint | test("served by fdpblk")))]')" '["live",true,true]'
expect "del without a state file" "$FDPBLK" del -n 5
expect "device gone" test ! -e /dev/ublkb5
expect "its daemon exits" bash -c "for i in \$(seq 100); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
expect "its daemon removed the name link" test ! -e /dev/fdpblk/kv0
expect_eq "list: nothing left" "$("$FDPBLK" list)" "no fdpblk devices"
# A ublk device of another server (here fdpblk's binary under another name) without a state
# file: `del` refuses it, as `list` calls it not fdpblk's to delete.
install -m 0755 "$FDPBLK" /var/tmp/otherublk
truncate -s 64M /var/tmp/other.img
expect "another server's device 7" quiet /var/tmp/otherublk add --backing /var/tmp/other.img --engine plain --policy none -n 7 "${GEO[@]}"
mv /run/fdpblk/7.json /var/tmp/7.json
out=$("$FDPBLK" del -n 7 2>&1) && rc=0 || rc=$?
expect "del refuses it ($out)" test "$rc" -ne 0
expect "the error names its server" grep -q "ublk device 7 is served by otherublk (pid [0-9]*), not by fdpblk" <<<"$out"
expect "device 7 still there" test -e /dev/ublkb7
mv /var/tmp/7.json /run/fdpblk/7.json
expect "del with its state file back" "$FDPBLK" del -n 7
expect "device 7 gone" test ! -e /dev/ublkb7
# A killed daemon's state file, its device deleted by other means and the id taken by a
# ublk server that is not fdpblk (it tags its devices as its own), which died too: the
# dead device is not fdpblk's to recover, list as recoverable or delete.
[[ -x $OTHER_UBLK ]] || check_fatal "no $OTHER_UBLK: run 'cargo build --release --examples' (cargo test builds it) on the host first"
dev=$(fdpblk_add --backing /var/tmp/race1.img --engine plain --policy none -n 9 "${GEO[@]}")
expect_eq "add device 9" "$dev" /dev/ublkb9
cp /run/fdpblk/9.json /var/tmp/9.json
pid=$(daemon_pid 9)
expect "SIGKILL its daemon" kill -9 "$pid"
expect "it exits" bash -c "for i in \$(seq 100); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.1; done; exit 1"
expect "its device deleted" "$FDPBLK" del -n 9
"$OTHER_UBLK" add 9 >/tmp/other9.out 2>&1 &
opid=$!
expect "another server takes id 9" bash -c "for i in \$(seq 100); do [[ -e /dev/ublkb9 ]] && exit 0; sleep 0.1; done; exit 1"
{ kill -9 "$opid"; wait "$opid"; } 2>/dev/null || true
cp /var/tmp/9.json /run/fdpblk/9.json
out=$("$FDPBLK" recover -n 9 2>&1) && rc=0 || rc=$?
expect "recover refuses it ($out)" test "$rc" -ne 0
expect "naming another server's tag" grep -q "ublk device 9 was served by another ublk server (tagged so; its server is gone), not by fdpblk: not fdpblk's to recover" <<<"$out"
expect_eq "list --json: its state file is left over" "$("$FDPBLK" list --json | jq -c '[.[] | select(.id == 9) | .hint | test("left over")]')" '[true]'
out=$("$FDPBLK" del -n 9 2>&1) && rc=0 || rc=$?
expect "del refuses it ($out)" test "$rc" -ne 0
expect "and removes the left-over state file" test ! -e /run/fdpblk/9.json
expect "the other server's device is still there" test -e /dev/ublkc9
expect "deleted by its own server" "$OTHER_UBLK" del 9
check_done
