#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-timeout: 300
# The daemon and its signals:
# - SIGTERM to a started foreground daemon: exit 0, no device left;
# - SIGTERM at any moment of the start (sent 0 to 0.6 s after `fdpblk add --foreground`, in
#   steps of 25 ms) ends with the daemon gone (killed by the signal before it took its signals,
#   or exiting with no error but the stop signal's) and no ublk device left behind, never a
#   device that started anyway with the signal lost;
# - SIGHUP (a closed terminal) is ignored: the device keeps serving;
# - a recovered daemon stopped by SIGTERM deletes its device and state files, as an added
#   one does;
# - SIGTERM to an `add` waiting for its daemon's start reaches the daemon: no device comes.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
GEO=(--slot-bytes 64K --meta-total-bytes 1M --policy region)
no_device() { ! compgen -G "/dev/ublkb*" >/dev/null && ! compgen -G "/sys/class/ublk-char/ublkc*" >/dev/null; }

# sig_stop_ok LABEL PID LOG: PID was sent SIGTERM; ok when it exits, by the signal before it
# took its signals (143), cleanly (0), or naming the stop signal (1: also when it cut short a
# wait for the previous daemon's backing or id), with no other error. Its status in SIG_RC.
sig_stop_ok() {
    local label=$1 pid=$2 log=$3 rc=0
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    expect "$label: the daemon exits" bash -c "! kill -0 $pid 2>/dev/null"
    wait "$pid" 2>/dev/null || rc=$?
    SIG_RC=$rc
    local other
    # (A daemon on the block device may wait for the lock a passthrough daemon of the check
    # before held: its io_uring rings keep the char device open a moment past its exit.)
    local stopped='a stop signal came while it started|stopped by a signal while waiting for backing'
    other=$(grep '^fdpblk: ' "$log" | grep -vE "$stopped" || true)
    if [[ -z $other ]] && { ((rc == 0 || rc == 143)) || { ((rc == 1)) && grep -qE "$stopped" "$log"; }; }; then
        ok "$label: exit status $rc, no other error"
    else
        cat "$log"
        not_ok "$label: exit status $rc, no other error"
    fi
}

# Control: a device that started, then SIGTERM: a clean exit and no device left.
t0=$(date +%s.%N)
"$FDPBLK" add --backing "$NS_DEV" -n 0 "${GEO[@]}" --foreground >/tmp/sig-started.log 2>&1 &
pid=$!
for _ in $(seq 300); do [[ -e /run/fdpblk/0.json && -e /dev/ublkb0 ]] && break; sleep 0.1; done
expect "a foreground add starts its device" test -e /dev/ublkb0
# The sweep below spans this start and 0.2 s past it, however long the guest takes.
start_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
step_s=$(awk -v s="$start_s" 'BEGIN { printf "%.3f", (s + 0.2) / 24 }')
expect "SIGTERM to the started daemon" kill -TERM "$pid"
sig_stop_ok "SIGTERM to the started daemon" "$pid" /tmp/sig-started.log
expect_eq "SIGTERM to the started daemon: its exit status" "$SIG_RC" 0
for _ in $(seq 50); do no_device && break; sleep 0.1; done
expect "SIGTERM to the started daemon: no device left" no_device

started=0
for delay in $(seq 0 "$step_s" "$(awk -v s="$step_s" 'BEGIN { printf "%.3f", s * 24 }')"); do
    "$FDPBLK" add --backing "$NS_DEV" -n 0 "${GEO[@]}" --foreground >/tmp/sig-$delay.log 2>&1 &
    pid=$!
    sleep "$delay"
    [[ -e /sys/class/ublk-char/ublkc0 ]] && started=$((started + 1))
    # The daemon must still be there to take it (one that exited by itself failed to start).
    expect "SIGTERM ${delay}s into the start: the daemon takes it" kill -TERM "$pid"
    sig_stop_ok "SIGTERM ${delay}s into the start" "$pid" "/tmp/sig-$delay.log"
    for _ in $(seq 50); do no_device && break; sleep 0.1; done
    if no_device; then
        ok "SIGTERM ${delay}s into the start: no device left"
    else
        cat /tmp/sig-$delay.log
        not_ok "SIGTERM ${delay}s into the start: no device left"
        "$FDPBLK" del --all >/dev/null 2>&1 || true
    fi
done
echo "# the device existed at the signal in $started of 25 starts (the control took ${start_s}s, a step ${step_s}s)"
expect "the sweep signalled some starts before the device existed and some after" test "$started" -gt 0 -a "$started" -lt 25

dev=$(fdpblk_add --backing "$NS_DEV" -n 0 "${GEO[@]}")
pid=$(daemon_pid 0)
expect "SIGHUP to daemon $pid" kill -HUP "$pid"
sleep 0.5
expect "after SIGHUP: the daemon runs" kill -0 "$pid"
expect "after SIGHUP: the device serves" dd if="$dev" of=/dev/null bs=4096 count=16 iflag=direct status=none

expect "SIGKILL daemon $pid" kill -9 "$pid"
expect "fdpblk recover" "$FDPBLK" recover -n 0
new=$(daemon_pid 0)
expect "a new daemon ($new) serves the device" test "$new" != "$pid"
expect "SIGTERM to the recovered daemon" kill -TERM "$new"
for _ in $(seq 100); do kill -0 "$new" 2>/dev/null || break; sleep 0.1; done
expect "the recovered daemon exits" bash -c "! kill -0 $new 2>/dev/null"
for _ in $(seq 50); do no_device && break; sleep 0.1; done
expect "its device is deleted (no /dev/ublkb0, no ublkc0)" no_device
expect "its state file is removed" test ! -e /run/fdpblk/0.json

# SIGTERM while a recovery waits for the killed daemon's commands to leave the drive (its
# lock on the char device; held here by flock): the stop waits for the start, then deletes the
# device. Killing the process there would leave the device held and LMCache hung.
dev=$(fdpblk_add --backing "$NG_DEV" --engine passthrough -n 0 "${GEO[@]}")
pid=$(daemon_pid 0)
expect "passthrough: SIGKILL daemon $pid" kill -9 "$pid"
for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
# Held by this shell (fd 9, which the recovery must not inherit) until the checks below are
# done, however slow the guest.
exec 9<"$NG_DEV"
flock -w 30 9 || check_fatal "the killed daemon's lock on $NG_DEV stayed for 30 s"
"$FDPBLK" recover -n 0 --foreground >/tmp/sig-recover.log 2>&1 9<&- &
rpid=$!
for _ in $(seq 50); do grep -q "waiting for an earlier daemon" /tmp/sig-recover.log && break; sleep 0.1; done
expect "recover waits for the lock" grep -q "waiting for an earlier daemon" /tmp/sig-recover.log
expect "SIGTERM to the waiting recovery" kill -TERM "$rpid"
sleep 0.5
expect "the recovery outlives the signal while it waits" kill -0 "$rpid"
exec 9<&-
for _ in $(seq 100); do kill -0 "$rpid" 2>/dev/null || break; sleep 0.1; done
expect "then it exits" bash -c "! kill -0 $rpid 2>/dev/null"
for _ in $(seq 50); do no_device && break; sleep 0.1; done
if no_device; then ok "the device is deleted, not left held"; else cat /tmp/sig-recover.log; not_ok "the device is deleted, not left held"; fi
expect "its state file is removed" test ! -e /run/fdpblk/0.json

# SIGTERM to an `add` (not --foreground) whose daemon waits for a backing another process
# has locked (as a killed daemon's NVMe commands hold it): the daemon runs in its own
# session, out of the signal's reach, so `add` passes the signal on; the start stops, `add`
# says so, and no device comes once the backing is free.
exec 9<"$NG_DEV"
flock -w 30 9 || check_fatal "cannot lock $NG_DEV"
waits_logged() {
    local n
    n=$(grep -c "waiting for an earlier daemon's commands to complete" /run/fdpblk/daemon.log 2>/dev/null) || true
    echo "${n:-0}"
}
waits0=$(waits_logged)
"$FDPBLK" add --backing "$NG_DEV" --engine passthrough -n 0 "${GEO[@]}" >/tmp/sig-add.log 2>&1 9<&- &
apid=$!
# Signalled once its daemon waits for the lock (the add's checks can take a while here).
for _ in $(seq 300); do (($(waits_logged) > waits0)) && break; sleep 0.1; done
expect "the daemon waits for the locked backing" test "$(waits_logged)" -gt "$waits0"
expect "SIGTERM to the waiting add" kill -TERM "$apid"
arc=0
wait "$apid" || arc=$?
exec 9<&-
expect_eq "the add exits 1 (not killed: 143)" "$arc" 1
expect "and says the start stopped" grep -q "^fdpblk: stopped by a signal while waiting for backing $NG_DEV; nothing was made" /tmp/sig-add.log
# Once no daemon is left (up to 10 s), none can start a device.
for _ in $(seq 100); do pgrep -x fdpblk >/dev/null || break; sleep 0.1; done
if no_device; then ok "no device started after the backing was let go"; else cat /tmp/sig-add.log; not_ok "no device started after the backing was let go"; "$FDPBLK" del --all >/dev/null 2>&1 || true; fi
expect "no daemon is left" bash -c "! pgrep -x fdpblk"

# A device on the namespace's block device after a passthrough daemon died with NVMe commands
# in flight (they hold its lock on the char device; held here by flock): the new daemon waits
# for them too, then starts.
exec 9<"$NG_DEV"
flock -w 30 9 || check_fatal "cannot lock $NG_DEV"
waits0=$(waits_logged)
"$FDPBLK" add --backing "$NS_DEV" -n 0 "${GEO[@]}" >/tmp/sig-add-bdev.log 2>&1 9<&- &
apid=$!
for _ in $(seq 300); do (($(waits_logged) > waits0)) && break; sleep 0.1; done
expect "a daemon on $NS_DEV waits for the lock on $NG_DEV" test "$(waits_logged)" -gt "$waits0"
expect "and has made no device meanwhile" no_device
exec 9<&-
arc=0
wait "$apid" || arc=$?
expect_eq "the add succeeds once it is let go ($(cat /tmp/sig-add-bdev.log))" "$arc" 0
expect "its device" test -b /dev/ublkb0
expect "del" quiet "$FDPBLK" del -n 0
expect "no daemon is left" daemons_gone
check_done
