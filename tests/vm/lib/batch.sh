#!/usr/bin/env bash
# Guest side of suite.sh: run several checks in one boot.
#
#   batch.sh OUTDIR CHECK:TIMEOUT...
#
# For each check: OUTDIR/NAME.log (its output) and a line "NAME RC SECONDS" in
# OUTDIR/results. FDPBLK_CHECK_OUT=OUTDIR/NAME.d is a directory for the check's
# artefacts. Afterwards the pseudo-check "kernel-log" fails if the guest kernel
# logged an oops, BUG, WARNING or call trace (full dmesg in OUTDIR/dmesg.log).
set -uo pipefail

fdpblk=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/target/release/fdpblk
# leftovers NAME: a check that failed half-way (or was killed at its time limit) can leave a
# ublk device, a daemon or an unloaded driver behind; the next check would then fail and be
# blamed. Clean them up and say so in NAME's log.
leftovers() {
    local left=""
    [[ -c /dev/ublk-control ]] || { modprobe ublk_drv 2>/dev/null; left+=" ublk_drv-unloaded"; }
    compgen -G '/dev/ublkc*' >/dev/null && left+=" $(echo /dev/ublkc*)"
    pgrep -x fdpblk >/dev/null && left+=" fdpblk-pids:$(pgrep -x fdpblk | tr '\n' ,)"
    [[ -z $left ]] && return 0
    echo "batch: $1 left behind:$left; cleaning up before the next check" | tee -a "$out/$1.log"
    [[ -x $fdpblk ]] && timeout 60 "$fdpblk" del --all >/dev/null 2>&1
    timeout 30 systemctl stop 'fdpblk@*' 2>/dev/null # systemd-unit's: it would start them again
    pkill -9 -x fdpblk 2>/dev/null
    sleep 1
    [[ -x $fdpblk ]] && timeout 60 "$fdpblk" del --all >/dev/null 2>&1
    # Devices with no state file in /run/fdpblk (moved away, or renamed servers) too.
    local c
    for c in /dev/ublkc*; do
        [[ -e $c && -x $fdpblk ]] && timeout 60 "$fdpblk" del -n "${c#/dev/ublkc}" >/dev/null 2>&1
    done
    return 1
}

out=$1
shift
mkdir -p "$out"
: >"$out/results"
dmesg_failed=""
: >"$out/dmesg.log"
for spec in "$@"; do
    check=${spec%:*}
    limit=${spec##*:}
    name=$(basename "$check" .sh)
    export FDPBLK_CHECK_OUT="$out/$name.d"
    mkdir -p "$FDPBLK_CHECK_OUT"
    echo "batch: running $name (limit ${limit}s)"
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" bash "$check" </dev/null >"$out/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    ((rc != 124)) || echo "batch: $name timed out after ${limit}s" >>"$out/$name.log"
    # A pass is an exit 0 with at least one "ok - " and no "not ok - " (one recorded in a
    # subshell would not reach the exit status).
    if ((rc == 0)) && { ! grep -q '^ok - ' "$out/$name.log" || grep -q '^not ok - ' "$out/$name.log"; }; then
        rc=1
        echo "batch: $name exited 0 with no \"ok - \" line or with a \"not ok - \" line" >>"$out/$name.log"
    fi
    rmdir "$FDPBLK_CHECK_OUT" 2>/dev/null || true
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    # A check cleans up after itself: what it leaves would hide a del that does not delete.
    if ! leftovers "$name" && ((rc == 0)); then
        rc=1
        echo "not ok - left devices, daemons or an unloaded driver behind (see above)" >>"$out/$name.log"
    fi
    echo "$name $rc $secs" >>"$out/results"
    echo "batch: $name rc=$rc ${secs}s"
    # The kernel's log buffer is small: read and clear it after each check, so that an early
    # oops is not overwritten by a long boot's later messages.
    dmesg -c >>"$out/dmesg.log" 2>&1 || dmesg_failed+=" after $name"
done

dmesg -c >>"$out/dmesg.log" 2>&1 || dmesg_failed+=" at the end"
if [[ -n $dmesg_failed ]]; then
    # Unread, the kernel's log proves nothing.
    echo "dmesg -c failed$dmesg_failed: the kernel log was not read" >"$out/kernel-log.log"
    echo "kernel-log 1 0.0" >>"$out/results"
elif grep -nE 'Oops|BUG:|WARNING:|Call Trace|general protection|[Kk]ernel panic' "$out/dmesg.log" >"$out/kernel-log.log"; then
    echo "kernel-log 1 0.0" >>"$out/results"
else
    echo "no oops, BUG, WARNING or call trace in dmesg" >"$out/kernel-log.log"
    echo "kernel-log 0 0.0" >>"$out/results"
fi
sync
