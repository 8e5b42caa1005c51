#!/usr/bin/env bash
# Run the VM checks (tests/vm/checks/*.sh) and print one line per test:
#   PASS name@kernel (1.2s)   /   FAIL name@kernel
#
#   tests/vm/suite.sh [--list] [--keep] [-v] [-j N] [CHECK...]
#
# A check declares its needs in header comments (first 30 lines):
#   # vm-kernel: new old    guest kernels to run it on (each one) [new]
#   # vm-fdp: on|off        FDP drive or plain NVMe [on]
#   # vm-args: ...          extra run.sh options, e.g. --lba-size 4096 [none]
#   # vm-timeout: SECS      limit for the check [180]
#   # vm-host: yes          runs on the host (it calls run.sh itself, found in
#                           $FDPBLK_VM_RUN) instead of inside a guest
#   # vm-boot: NAME         a boot of its own among checks with the same kernel,
#                           fdp and args (to spread a long boot over the jobs) [none]
# Guest checks with the same kernel, fdp, args and boot name share one boot; every
# boot also yields "kernel-log@...", which fails on an oops/BUG/WARNING in dmesg.
# Boots (and host checks) run -j N at a time [2 where the host has 2 CPUs, 6 GiB
# available and bash >= 5.1, else 1; env FDPBLK_VM_JOBS], each then on one host
# thread (run.sh --tcg-threads single); each boot's lines are printed when it ends.
#
# CHECK names (file names without .sh) select checks; --list prints the plan;
# --keep keeps the results directory (logs, dmesg) even when all passed; -v
# prints every check's log. Exit: 0 all passed; 1 something failed or could
# not run; 77 the harness is not set up (only outside CI; with CI=true that is
# a failure, exit 1).
set -euo pipefail

VM_LOG_PREFIX=suite
# shellcheck source=lib/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

LIST=0 KEEP=0 VERBOSE=0 ONLY=()
JOBS=${FDPBLK_VM_JOBS:-}
while (($#)); do
    case $1 in
        --list) LIST=1 ;;
        --keep) KEEP=1 ;;
        -v | --verbose) VERBOSE=1 ;;
        -j | --jobs) (($# > 1)) || vm_die "$1 needs a number"; JOBS=$2; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) vm_die "unknown option '$1' (see --help)" ;;
        *) ONLY+=("${1%.sh}") ;;
    esac
    shift
done
case ${CI:-} in true | TRUE | True | 1 | yes) IN_CI=1 ;; *) IN_CI=0 ;; esac
if [[ -z $JOBS ]]; then
    # Two where two CPUs and the memory of two guests (2 GiB each, and QEMU's own) are there.
    JOBS=1
    mem_kb=$(awk '$1 == "MemAvailable:" { print $2 }' /proc/meminfo 2>/dev/null || true)
    (($(nproc) < 2 || ${mem_kb:-0} < 6 * 1024 * 1024)) || JOBS=2
fi
[[ $JOBS =~ ^[1-9][0-9]?$ ]] || vm_die "-j takes a number of boots at a time from 1 to 99, not '$JOBS'"
# Side by side needs `wait -n -p` (bash 5.1): an older bash runs one boot at a time.
((JOBS == 1 || BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)) || JOBS=1
# Boots side by side each get one host thread for their vCPUs: with one each, two guests'
# four vCPU threads on two cores spin on each other's locks (a check ran 1.7 to 3 times
# slower, against about 1.15 times for a single thread alone).
((JOBS == 1)) || export FDPBLK_VM_TCG_THREADS=${FDPBLK_VM_TCG_THREADS:-single}

header() { # header FILE KEY DEFAULT
    local v
    v=$(head -n 30 "$1" | sed -n "s/^# *$2: *//p" | head -n1 | sed 's/[[:space:]]*$//')
    printf '%s\n' "${v:-$3}"
}

# ---- plan ------------------------------------------------------------------------
declare -A GROUP_CHECKS=()
GROUPS_ORDER=() HOST_CHECKS=() KERNELS_NEEDED=()
declare -A TIMEOUT_OF=()
found=0
for f in "$VM_DIR"/checks/*.sh; do
    [[ -e $f ]] || continue
    name=$(basename "$f" .sh)
    if ((${#ONLY[@]})); then
        sel=0
        for o in "${ONLY[@]}"; do [[ $o == "$name" ]] && sel=1; done
        ((sel)) || continue
    fi
    found=1
    TIMEOUT_OF[$name]=$(header "$f" vm-timeout 180)
    [[ ${TIMEOUT_OF[$name]} =~ ^[0-9]+$ ]] || vm_die "$f: vm-timeout must be a number of seconds"
    if [[ $(header "$f" vm-host no) == yes ]]; then
        HOST_CHECKS+=("$name")
        KERNELS_NEEDED+=(new)
        continue
    fi
    fdp=$(header "$f" vm-fdp on)
    [[ $fdp == on || $fdp == off ]] || vm_die "$f: vm-fdp must be on or off"
    args=$(header "$f" vm-args "")
    boot=$(header "$f" vm-boot "")
    [[ $boot =~ ^[A-Za-z0-9_-]*$ ]] || vm_die "$f: vm-boot takes a name of letters, digits, - and _"
    for k in $(header "$f" vm-kernel new); do
        [[ $k == new || $k == old ]] || vm_die "$f: vm-kernel takes new and/or old, not '$k'"
        key="$k|$fdp|$args|$boot"
        if [[ -z ${GROUP_CHECKS[$key]+x} ]]; then
            GROUPS_ORDER+=("$key")
            GROUP_CHECKS[$key]=
        fi
        GROUP_CHECKS[$key]+=" $name"
        KERNELS_NEEDED+=("$k")
    done
done
((found)) || vm_die "no checks match: ${ONLY[*]:-(none in $VM_DIR/checks)}"

label() { # label KERNEL FDP ARGS BOOT -> @new / @new,fdp-off / @new,--lba-size-4096 / @new,io
    local s="@$1"
    [[ $2 == on ]] || s+=",fdp-off"
    [[ -z $3 ]] || s+=",$(tr ' ' '-' <<<"$3")"
    [[ -z ${4:-} ]] || s+=",$4"
    printf '%s\n' "$s"
}

if ((LIST)); then
    for key in "${GROUPS_ORDER[@]}"; do
        IFS='|' read -r k fdp args boot <<<"$key"
        echo "boot: --kernel $k --fdp $fdp${args:+ $args}${boot:+ (boot $boot)}"
        for c in ${GROUP_CHECKS[$key]} kernel-log; do echo "  $c$(label "$k" "$fdp" "$args" "$boot")"; done
    done
    for c in "${HOST_CHECKS[@]}"; do echo "host: $c@host"; done
    exit 0
fi

# ---- preflight: is the harness there? ---------------------------------------------
harness_missing() {
    if ((IN_CI)); then
        echo "FAIL vm-harness: $* (CI=true: a missing harness is a failure; run tests/vm/setup.sh)"
        exit 1
    fi
    echo "SKIP vm-harness: $* (run tests/vm/setup.sh)"
    exit 77
}
vm_qemu_ok || harness_missing "qemu-system-x86_64 with FDP emulation (QEMU >= 8.0) not found"
for k in $(printf '%s\n' "${KERNELS_NEEDED[@]}" | sort -u); do
    if ! { kver=$(vm_kernel_release "$k") && vm_kernel_ready "$kver"; }; then
        harness_missing "guest kernel '$k' not set up in $VM_CACHE"
    fi
done
for t in busybox nvme gcc cpio; do
    command -v "$t" >/dev/null || harness_missing "host tool '$t' not found"
done
if ! out=$(vm_build_wstream 2>&1); then
    harness_missing "cannot build tools/wstream.c: $out"
fi

REPO=$(cd "$VM_DIR/../.." && pwd -P)
case $REPO/ in
    /tmp/* | /run/* | /dev/*) vm_die "the repository at $REPO is hidden in the guest (its /tmp and /run are its own); move it elsewhere" ;;
esac
cd "$REPO"
RES=$(mktemp -d "${TMPDIR:-/tmp}/fdpblk-vm-suite.XXXXXX")
# Said first: a run that is killed keeps what it has so far there.
echo "vm suite: logs in $RES (removed at the end when every check passed, unless --keep)"
SUITE_T0=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
indent() { sed 's/^/    | /'; }
# The counts at the end are of these lines.
pass() { echo "PASS $1 ($2s)"; }
fail() { echo "FAIL $1${2:+ ($2)}"; }

# ---- guest checks, one boot per group ----------------------------------------------
# QEMU's TCG vCPUs are host threads: on a loaded host one can go unscheduled for tens of
# seconds, and the guest then logs an RCU stall while a check times out. Such a boot proves nothing either way, so its failed checks run once more
# in a fresh boot (all of its checks when kernel-log failed, since that covers the whole boot),
# and the second boot's result is the result. A failure without such a message, or with a
# kernel bug beside it (KERNEL_BUG), is final.
# (The clocksource watchdog's "remote CPU read timed out" is not enough: most boots here log it.)
STARVED='rcu: INFO: rcu_(preempt|sched) (detected stalls|self-detected stall)|rcu_(preempt|sched) kthread (starved|timer wakeup didn.t happen)'
starved() { # starved GDIR -> prints the first starvation message of that boot
    # Read whole first: a boot that died early has no dmesg.log, and grep -m1 stopping early
    # would fail the pipe; either must not hide a stall the console shows.
    local text
    text=$(cat "$1.console" "$1/dmesg.log" 2>/dev/null || true)
    grep -a -m1 -oE "$STARVED" <<<"${text//$'\r'/}"
}
# A kernel bug in a starved boot is still a kernel bug: a ublk or driver hang is what starves
# the guest, so such a boot's kernel-log failure stands (only what starvation itself logs,
# stall reports, soft and workqueue lockups with their call traces, is retried). A task hung
# for five minutes (run.sh raises the kernel's limit from 120 s, past what starvation
# explains) is a bug here (a ublk request never completed), starved guest or not.
KERNEL_BUG='Oops|general protection|[Kk]ernel panic|kernel BUG at|WARNING: CPU|INFO: task .* blocked for more than|BUG: (unable to handle|kernel NULL|KASAN|UBSAN|scheduling while atomic|sleeping function|Bad page|bad page|spinlock|using smp_processor_id)|refcount_t:|list_(add|del) corruption'
kernel_bug() { # kernel_bug GDIR -> prints the first kernel bug line of that boot
    # The console too: a boot that hung never wrote its last dmesg.log.
    local text
    text=$(cat "$1.console" "$1/dmesg.log" 2>/dev/null || true)
    grep -a -m1 -E "$KERNEL_BUG" <<<"${text//$'\r'/}"
}
boot_group() { # boot_group GDIR KERNEL FDP ARGS CHECK... -> GDIR/results, GDIR.out, GDIR.console
    local gdir=$1 k=$2 fdp=$3 args=$4 c rc=0 limit=60 t0 timing
    shift 4
    local specs=()
    for c in "$@"; do
        specs+=("$VM_DIR/checks/$c.sh:${TIMEOUT_OF[$c]}")
        limit=$((limit + TIMEOUT_OF[$c] + 5))
    done
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086 # $args is a list of run.sh options
    "$VM_DIR/run.sh" --timing --kernel "$k" --fdp "$fdp" $args --share "$RES" --timeout "$limit" \
        --console "$gdir.console" -- bash "$VM_DIR/lib/batch.sh" "$gdir" "${specs[@]}" \
        >"$gdir.out" 2>&1 || rc=$?
    echo "$rc" >"$gdir.rc"
    timing=$(sed -n 's/^fdpblk-vm: kernel .*: \(boot .*\)$/\1/p' "$gdir.out" | tail -n1)
    echo "-- ${gdir##*/}: --kernel $k --fdp $fdp $args: ${timing:-no timing (run.sh exit $rc)}, wall $(elapsed "$t0")s"
}
result_of() { # result_of GDIR CHECK -> "RC SECS", or nothing when it did not run
    awk -v n="$2" '$1 == n { print $2, $3 }' "$1/results" 2>/dev/null || true
}
report_group() { # report_group GDIR LABEL CHECK... (kernel-log included by the caller)
    local gdir=$1 lab=$2 c line crc secs
    shift 2
    for c in "$@"; do
        line=$(result_of "$gdir" "$c")
        if [[ -z $line ]]; then
            fail "$c$lab" "did not run: run.sh exit $(cat "$gdir.rc")"
            tail -n 30 "$gdir.out" | indent || true
            continue
        fi
        read -r crc secs <<<"$line"
        if ((crc == 0)); then
            pass "$c$lab" "$secs"
            ((!VERBOSE)) || indent <"$gdir/$c.log"
        else
            fail "$c$lab" "exit $crc after ${secs}s"
            { grep -v '^ok - ' "$gdir/$c.log" | tail -n 60 | indent; } || true
        fi
    done
}
run_group() { # run_group GDIR KEY: one boot's checks, and their retry after a starved boot
    local gdir=$1 k fdp args boot lab checks failed why bug again c line
    IFS='|' read -r k fdp args boot <<<"$2"
    lab=$(label "$k" "$fdp" "$args" "$boot")
    read -ra checks <<<"${GROUP_CHECKS[$2]}"
    boot_group "$gdir" "$k" "$fdp" "$args" "${checks[@]}"
    failed=()
    for c in "${checks[@]}" kernel-log; do
        line=$(result_of "$gdir" "$c")
        [[ ${line%% *} == 0 ]] || failed+=("$c")
    done
    why=""
    ((${#failed[@]} == 0)) || why=$(starved "$gdir") || why=""
    if [[ -n $why ]] && bug=$(kernel_bug "$gdir"); then
        echo "NO RETRY$lab: the guest was starved (\"$why\") but its kernel also logged \"$bug\""
        why=""
    fi
    if [[ -z $why ]]; then
        report_group "$gdir" "$lab" "${checks[@]}" kernel-log
        return 0
    fi
    # Starved: report what passed, then run the failed ones again.
    again=()
    for c in "${checks[@]}"; do
        if [[ " ${failed[*]} " == *" $c "* || " ${failed[*]} " == *" kernel-log "* ]]; then
            again+=("$c")
            echo "RETRY $c$lab (the guest was starved: \"$why\"; first try in $gdir)"
        else
            report_group "$gdir" "$lab" "$c"
        fi
    done
    boot_group "$gdir.retry" "$k" "$fdp" "$args" "${again[@]}"
    report_group "$gdir.retry" "$lab" "${again[@]}" kernel-log
    return 0
}

# ---- host checks ------------------------------------------------------------------------
export FDPBLK_VM_RUN="$VM_DIR/run.sh"
run_host_check() { # run_host_check CHECK
    local c=$1 t0 rc=0
    t0=$(date +%s.%N)
    timeout -k 10 "${TIMEOUT_OF[$c]}" bash "$VM_DIR/checks/$c.sh" </dev/null >"$RES/$c.log" 2>&1 || rc=$?
    # As in the guest (lib/batch.sh): an ok line and no not-ok line, or it did not pass.
    if ((rc == 0)) && { ! grep -q '^ok - ' "$RES/$c.log" || grep -q '^not ok - ' "$RES/$c.log"; }; then
        rc=1
        echo "exited 0 with no \"ok - \" line or with a \"not ok - \" line" >>"$RES/$c.log"
    fi
    if ((rc == 0)); then
        pass "$c@host" "$(elapsed "$t0")"
        ((!VERBOSE)) || indent <"$RES/$c.log"
    else
        fail "$c@host" "exit $rc after $(elapsed "$t0")s"
        { grep -v '^ok - ' "$RES/$c.log" | tail -n 60 | indent; } || true
    fi
}

# ---- JOBS at a time -----------------------------------------------------------------------
# Each boot or host check writes its lines to its own file, printed whole when it ends (lines
# of two boots never interleave); the counts come from those lines. Longest first, by the
# sum of their checks' limits, so that the last to start are short ones.
TASK_KIND=() TASK_OUT=() TASK_WHAT=() ORDER=()
task() { # task COST KIND OUT WHAT
    ORDER+=("$1 ${#TASK_KIND[@]}")
    TASK_KIND+=("$2") TASK_OUT+=("$3") TASK_WHAT+=("$4")
}
gi=0
for key in "${GROUPS_ORDER[@]}"; do
    gi=$((gi + 1))
    cost=0
    for c in ${GROUP_CHECKS[$key]}; do cost=$((cost + TIMEOUT_OF[$c])); done
    task "$cost" group "$RES/boot$gi" "$key"
done
for c in "${HOST_CHECKS[@]}"; do task "${TIMEOUT_OF[$c]}" host "$RES/$c" "$c"; done
# The initramfs of each kernel is built (and cached) once here, not by two boots at a time.
for k in $(printf '%s\n' "${KERNELS_NEEDED[@]}" | sort -u); do
    vm_initramfs "$(vm_kernel_release "$k")" >/dev/null
done
run_task() { # run_task T: task T's lines into its report; a task that ends early says so there
    local out=${TASK_OUT[$1]} rc
    # Not `|| rc=$?`, under which bash ignores errexit in the subshell too.
    set +e
    case ${TASK_KIND[$1]} in
        group) (set -e; run_group "$out" "${TASK_WHAT[$1]}") >"$out.report" 2>&1 ;;
        host) (set -e; run_host_check "${TASK_WHAT[$1]}") >"$out.report" 2>&1 ;;
    esac
    rc=$?
    set -e
    # Its later checks (kernel-log among them) have no line: the run fails.
    ((rc == 0)) || echo "FAIL ${out##*/}: the suite's own steps for it stopped (exit $rc) before all its checks were reported; see $out.*" >>"$out.report"
}
declare -A RUNNING=()
kill_tree() { # kill_tree PID: it and every process below it
    local c
    for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
    kill "$1" 2>/dev/null || true
}
# A suite stopped (Ctrl-C, CI's limit) stops its guests too.
trap 'for p in "${!RUNNING[@]}"; do kill_tree "$p"; done' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
ended() { # ended PID: prints the lines of the task that ran as PID, now ended
    cat "${RUNNING[$1]}"
    unset "RUNNING[$1]"
}
collect() { # waits for one task to end and prints its lines
    local pid=""
    wait -n -p pid "${!RUNNING[@]}" || true
    [[ -n $pid ]] || vm_die "lost track of a boot that was running"
    ended "$pid"
}
REPORTS=()
for t in $(printf '%s\n' "${ORDER[@]}" | sort -s -k1,1nr | cut -d' ' -f2); do
    REPORTS+=("${TASK_OUT[$t]}.report")
    while ((${#RUNNING[@]} >= JOBS)); do collect; done
    run_task "$t" &
    pid=$!
    RUNNING[$pid]=${TASK_OUT[$t]}.report
    if ((JOBS == 1)); then # (a plain wait: no `wait -n -p` before bash 5.1)
        wait "$pid" || true
        ended "$pid"
    fi
done
while ((${#RUNNING[@]})); do collect; done
PASSED=$(cat "${REPORTS[@]}" | grep -c '^PASS ' || true)
FAILED=$(cat "${REPORTS[@]}" | grep -c '^FAIL ' || true)
RETRIED=$(cat "${REPORTS[@]}" | grep -c '^RETRY ' || true)

retried=""
((RETRIED == 0)) || retried=" ($RETRIED run again after a starved boot)"
echo "vm suite: $PASSED passed, $FAILED failed in $(elapsed "$SUITE_T0")s$retried"
if ((FAILED || KEEP || RETRIED)); then
    echo "vm suite: logs in $RES"
else
    rm -rf "$RES"
fi
((FAILED == 0))
