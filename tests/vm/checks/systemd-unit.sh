#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: lifecycle
# vm-timeout: 300
# deploy/'s units under a real systemd (PID 1 of a PID namespace in the guest):
# systemd-analyze verify is silent; fdpblk@demo starts /dev/fdpblk/demo from
# /etc/fdpblk/demo.toml (Type=notify); after kill -9 of its daemon systemd restarts the unit,
# `fdpblk up` recovers the same device and all data written before and during the crash
# reads back (with the OnFailure= drop-in installed: one crash is recovered, not released);
# fdpblk-metrics writes the textfile; systemctl stop deletes the device cleanly; a unit
# killed until it gives up has its device deleted by fdpblk-release@, and one whose starts
# fail on a device added by hand under its name leaves that device running; a unit whose
# backing appears only seconds after its start waits for it (no restart, no give-up) and runs.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool systemctl systemd-analyze unshare nsenter pgrep
repo=$(cd "$(dirname "$0")/../../.." && pwd)

# Install as deploy/README.md says (the guest's root is a throw-away overlay).
install -m 0755 "$FDPBLK" /usr/local/bin/fdpblk
install -m 0644 "$repo/deploy/fdpblk@.service" "$repo/deploy/fdpblk-metrics.service" /etc/systemd/system/
mkdir -p /etc/fdpblk /var/lib/prometheus/node-exporter
cat >/etc/fdpblk/demo.toml <<EOF
backing = "$NS_DEV"
slot_bytes = "64K"
meta_total_bytes = "1M"
EOF
verify=$(systemd-analyze verify fdpblk@demo.service fdpblk-metrics.service 2>&1)
expect_eq "systemd-analyze verify fdpblk@demo.service fdpblk-metrics.service (no warnings)" "$verify" ""
# The optional OnFailure= drop-in and its release unit. RestartMode= is unknown before
# systemd 254 (the guest's may be older): that warning alone is expected.
install -D -m 0644 "$repo/deploy/fdpblk@.service.d/on-failure.conf" /etc/systemd/system/fdpblk@.service.d/on-failure.conf
install -m 0644 "$repo/deploy/fdpblk-release@.service" /etc/systemd/system/
verify=$(systemd-analyze verify fdpblk@demo.service fdpblk-release@demo.service 2>&1 | grep -Ev "Unknown key (name )?'RestartMode'" || true)
expect_eq "systemd-analyze verify with the on-failure drop-in and fdpblk-release@demo.service" "$verify" ""

# systemd with only an empty target: what runs is what the units pull in.
printf '[Unit]\nDescription=fdpblk VM check\n' >/etc/systemd/system/fdpblk-vmcheck.target
unshare --pid --fork --mount-proc env -i container=fdpblk-vm PATH="$PATH" \
    /lib/systemd/systemd --system --unit=fdpblk-vmcheck.target --log-target=kmsg </dev/null >/dev/null 2>&1 &
ns_pid=$!
sd_pid=
for _ in $(seq 50); do
    sd_pid=$(pgrep -P "$ns_pid" -x systemd | head -1 || true)
    [[ -n $sd_pid ]] && break
    sleep 0.1
done
[[ -n $sd_pid ]] || check_fatal "systemd did not start in the guest"
# in_ns CMD...: CMD in systemd's namespaces (the daemon's pids are from there, and systemd
# refuses systemctl from outside); the guest runs checks in a chroot, hence IGNORE_CHROOT.
in_ns() { nsenter -t "$sd_pid" -p -m -r -w -- env SYSTEMD_IGNORE_CHROOT=1 "$@"; }
sc() { timeout 90 nsenter -t "$sd_pid" -p -m -r -w -- env SYSTEMD_IGNORE_CHROOT=1 systemctl "$@"; }
stop_systemd() {
    # Delete the device first: killing systemd kills the daemon and would leave it quiesced.
    sc stop fdpblk-metrics fdpblk@demo >/dev/null 2>&1 || true
    kill -KILL "$sd_pid" 2>/dev/null || true
    wait "$ns_pid" 2>/dev/null || true
}
up=
for _ in $(seq 300); do
    s=$(sc is-system-running 2>/dev/null || true)
    if [[ $s == running || $s == degraded ]]; then up=1 && break; fi
    sleep 0.2
done
[[ -n $up ]] || check_fatal "systemd did not come up in the guest ($(sc is-system-running 2>&1))"
ok "systemd runs (PID 1 of a PID namespace)"
trap stop_systemd EXIT

devices_before=$(ls /sys/class/ublk-char 2>/dev/null | wc -l)
expect "systemctl start fdpblk@demo" sc start fdpblk@demo
expect_eq "fdpblk@demo active" "$(sc is-active fdpblk@demo)" active
dev=$(readlink /dev/fdpblk/demo || true)
[[ $dev == /dev/ublkb* ]] || check_fatal "no /dev/fdpblk/demo after start ($(sc status fdpblk@demo --no-pager 2>&1 | tail -5))"
ok "/dev/fdpblk/demo -> $dev"
refuses_second_up() {
    local out
    ! out=$(in_ns /usr/local/bin/fdpblk up demo 2>&1) && grep -q "device demo already runs as $dev" <<<"$out"
}
expect "fdpblk up refuses a device that runs" refuses_second_up
head -c 4194304 /dev/urandom >/tmp/a
head -c 33554432 /dev/urandom >/tmp/b
expect "write 4 MiB through /dev/fdpblk/demo" dd if=/tmp/a of=/dev/fdpblk/demo bs=1M seek=2 oflag=direct status=none

# kill -9 while a write is in flight: it waits in the driver and completes after recovery.
# 8192 synchronous 4 KiB writes: still running 0.3 s later on any guest.
dd if=/tmp/b of=/dev/fdpblk/demo bs=4K seek=2048 oflag=direct status=none &
dd_pid=$!
sleep 0.3
expect "a write is in flight at the kill" kill -0 "$dd_pid"
expect "kill -9 the daemon" sc kill --kill-who=main --signal=SIGKILL fdpblk@demo
restarted=
for _ in $(seq 300); do
    if [[ $(sc show -p NRestarts --value fdpblk@demo) == 1 && $(sc is-active fdpblk@demo) == active ]]; then
        restarted=1 && break
    fi
    sleep 0.2
done
expect "systemd restarted fdpblk@demo (NRestarts 1, active)" test -n "$restarted"
expect "the write in flight during the crash finished" wait "$dd_pid"
expect_eq "same device after the crash" "$(readlink /dev/fdpblk/demo)" "$dev"
expect_eq "no second device: fdpblk up recovered the first" "$(ls /sys/class/ublk-char | wc -l)" "$((devices_before + 1))"
expect "data written before the crash reads back" \
    bash -c "dd if=/dev/fdpblk/demo bs=1M skip=2 count=4 iflag=direct status=none | cmp - /tmp/a"
expect "data written during the crash reads back" \
    bash -c "dd if=/dev/fdpblk/demo bs=1M skip=8 count=32 iflag=direct status=none | cmp - /tmp/b"
id=${dev#/dev/ublkb}
expect_eq "fdpblk list: live" "$(in_ns /usr/local/bin/fdpblk list --json | grep -o '"state":"[a-z]*' | head -1)" '"state":"live'

expect "systemctl start fdpblk-metrics" sc start fdpblk-metrics
prom=/var/lib/prometheus/node-exporter/fdpblk.prom
for _ in $(seq 100); do [[ -s $prom ]] && break; sleep 0.1; done
expect "textfile: daemon up" grep -qx "fdpblk_daemon_up{id=\"$id\",name=\"demo\"} 1" "$prom"
expect "textfile: handle bytes" grep -q "^fdpblk_handle_written_bytes_total{id=\"$id\",name=\"demo\",handle=\"[0-9]*\"} [1-9]" "$prom"
expect "textfile: the slot table's gauges" grep -q "^fdpblk_slots{id=\"$id\",name=\"demo\",state=\"live\"} " "$prom"
prom_has() { in_ns /usr/local/bin/fdpblk stats -n "$id" --prometheus | grep -q "$1"; }
expect "stats --prometheus counts the writes" prom_has "^fdpblk_io_bytes_total{id=\"$id\",name=\"demo\",op=\"write\"} [1-9]"
sc stop fdpblk-metrics

expect "systemctl stop fdpblk@demo" sc stop fdpblk@demo
expect_eq "fdpblk@demo inactive (not failed)" "$(sc is-active fdpblk@demo)" inactive
expect "device deleted" bash -c "for i in \$(seq 50); do [[ -e $dev ]] || exit 0; sleep 0.1; done; exit 1"
expect "stable name removed" test ! -e /dev/fdpblk/demo
expect "state removed" test ! -e "/run/fdpblk/$id.json"
expect_eq "fdpblk-release@demo did not run for a clean stop" "$(sc show -p ActiveEnterTimestampMonotonic --value fdpblk-release@demo)" 0

# A unit that gives up (StartLimitBurst=5 in 2750 s): the drop-in's OnFailure= runs
# fdpblk-release@demo, which deletes the held device, so LMCache's I/O fails, not hangs.
expect "start again" sc start fdpblk@demo
dev=$(readlink /dev/fdpblk/demo || true)
[[ $dev == /dev/ublkb* ]] || check_fatal "no /dev/fdpblk/demo after the second start"
gave_up=
for k in $(seq 8); do
    before=$(sc show -p NRestarts --value fdpblk@demo)
    sc kill --kill-who=main --signal=SIGKILL fdpblk@demo >/dev/null 2>&1 || true
    # Each kill waits for the restart it causes (a recovered, active unit) or the failure.
    for _ in $(seq 300); do
        st=$(sc is-active fdpblk@demo || true)
        [[ $st == failed ]] && gave_up=$k && break 2
        [[ $st == active && $(sc show -p NRestarts --value fdpblk@demo) -gt $before ]] && break
        sleep 0.2
    done
done
expect "fdpblk@demo gave up after repeated kills (at kill ${gave_up:-none})" test -n "$gave_up"
expect "fdpblk-release@demo deleted the device" bash -c "for i in \$(seq 150); do [[ -e $dev ]] || exit 0; sleep 0.2; done; exit 1"
expect_eq "fdpblk-release@demo succeeded" "$(sc show -p Result --value fdpblk-release@demo)" success
sc reset-failed fdpblk@demo fdpblk-release@demo >/dev/null 2>&1 || true

# A device added by hand under the unit's name makes the unit's starts fail (`up`: "already
# runs") until it gives up: fdpblk-release@demo then keeps that device, whose daemon runs.
expect "fdpblk add --config --name demo by hand" in_ns /usr/local/bin/fdpblk add --config /etc/fdpblk/demo.toml --name demo
dev=$(readlink /dev/fdpblk/demo || true)
[[ $dev == /dev/ublkb* ]] || check_fatal "no /dev/fdpblk/demo after the add by hand"
release_ran() { sc show -p ExecMainStartTimestampMonotonic --value fdpblk-release@demo; }
ran_before=$(release_ran)
sc start fdpblk@demo >/dev/null 2>&1 || true
released=
for _ in $(seq 300); do
    [[ $(sc is-active fdpblk@demo || true) == failed && $(release_ran) != "$ran_before" &&
        $(sc is-active fdpblk-release@demo || true) == inactive ]] && released=1 && break
    sleep 0.2
done
expect "fdpblk@demo gave up with the device added by hand, and fdpblk-release@demo ran" test -n "$released"
expect_eq "fdpblk-release@demo succeeded (kept the device)" "$(sc show -p Result --value fdpblk-release@demo)" success
expect_eq "the device added by hand is still live" "$(in_ns /usr/local/bin/fdpblk list --json | grep -o '"state":"[a-z]*' | head -1)" '"state":"live'
expect "and still serves I/O" dd if=/tmp/a of=/dev/fdpblk/demo bs=1M seek=2 oflag=direct status=none
expect "fdpblk del --name demo" in_ns /usr/local/bin/fdpblk del --name demo
sc reset-failed fdpblk@demo fdpblk-release@demo >/dev/null 2>&1 || true

# A backing that appears late (at boot: a controller still probing): the unit's five restarts
# would be spent in five seconds; `fdpblk up` waits for the path instead.
rm -f /var/tmp/late.img
printf 'backing = "/var/tmp/late.img"\nengine = "plain"\npolicy = "none"\nslot_bytes = "64K"\nmeta_total_bytes = "1M"\n' >/etc/fdpblk/late.toml
expect "systemctl start --no-block fdpblk@late (its backing does not exist yet)" sc start --no-block fdpblk@late
sleep 7
expect_eq "fdpblk@late waits for it: activating" "$(sc is-active fdpblk@late)" activating
expect_eq "fdpblk@late waits for it: not restarted" "$(sc show -p NRestarts --value fdpblk@late)" 0
expect "the backing appears" truncate -s 64M /var/tmp/late.img
late_active() { for _ in $(seq 100); do [[ $(sc is-active fdpblk@late) == active ]] && return 0; sleep 0.2; done; return 1; }
expect "fdpblk@late runs once it is there" late_active
expect "systemctl stop fdpblk@late" sc stop fdpblk@late
rm -f /var/tmp/late.img /etc/fdpblk/late.toml
stop_systemd
trap - EXIT
rm -rf /etc/systemd/system/fdpblk@.service /etc/systemd/system/fdpblk-metrics.service /etc/systemd/system/fdpblk-vmcheck.target \
    /etc/systemd/system/fdpblk@.service.d /etc/systemd/system/fdpblk-release@.service
check_done
