# shellcheck shell=bash disable=SC2034 # variables for the checks that source this file
# Helpers for guest checks (tests/vm/checks/*.sh). Source it first:
#   . "$(dirname "$0")/../lib/check-lib.sh"
# A check prints "ok - ..." / "not ok - ..." lines and ends with check_done,
# which exits 1 if anything failed. A missing tool is a failure, never a skip.
set -euo pipefail

CHECK_NAME=$(basename "$0" .sh)
CHECK_FAILS=0
NS_DEV=/dev/nvme0n1
NG_DEV=/dev/ng0n1
CTRL_DEV=/dev/nvme0

# Each line ends with the seconds since the check started, to see where a slow one spends them.
ok() { echo "ok - $* [${SECONDS}s]"; }
not_ok() { echo "not ok - $* [${SECONDS}s]"; CHECK_FAILS=$((CHECK_FAILS + 1)); }
# expect DESC CMD...: ok when CMD succeeds.
expect() {
    local desc=$1
    shift
    if "$@"; then ok "$desc"; else not_ok "$desc"; fi
}
# quiet CMD...: CMD with its stdout discarded (for expect).
quiet() { "$@" >/dev/null; }
# expect_eq DESC GOT WANT
expect_eq() {
    if [[ $2 == "$3" ]]; then ok "$1 = $3"; else not_ok "$1: got '$2', want '$3'"; fi
}
# check_fatal MSG: stop the check now.
check_fatal() {
    not_ok "$*"
    echo "$CHECK_NAME: aborted"
    exit 1
}
check_done() {
    if ((CHECK_FAILS)); then
        echo "$CHECK_NAME: $CHECK_FAILS failure(s)"
        exit 1
    fi
    echo "$CHECK_NAME: all ok"
    exit 0
}

[[ ${FDPBLK_VM:-} == 1 ]] ||
    check_fatal "guest checks run inside the VM: tests/vm/run.sh -- bash $0 (or tests/vm/suite.sh)"

need_tool() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null || check_fatal "tool '$t' not found in the guest (install it on the host: tests/vm/setup.sh)"
    done
}

LBA=${FDPBLK_VM_LBA_SIZE:-512}
NRUH=${FDPBLK_VM_NRUH:-8}
RU_SIZE=${FDPBLK_VM_RU_SIZE:-4194304}
RU_BLOCKS=$((RU_SIZE / LBA))

# ctratt_fdp: CTRATT bit 19 (Flexible Data Placement) of the controller, 0 or 1; "unknown"
# (which no `test -eq` accepts) when nvme id-ctrl fails or prints no CTRATT.
ctratt_fdp() {
    local v
    v=$(nvme id-ctrl "$CTRL_DEV" | awk '$1 == "ctratt" { print $3 }')
    if [[ $v =~ ^(0x[0-9a-fA-F]+|[0-9]+)$ ]]; then echo $(((v >> 19) & 1)); else echo unknown; fi
}

# ruamw: "PID RUAMW" lines from the RUH Status of the namespace.
ruamw() {
    nvme fdp status "$NS_DEV" |
        awk '/^Placement Identifier/ { p = $3; sub(/;$/, "", p) } /\(RUAMW\)/ { print p, $NF }'
}

# ruamw_used BEFORE AFTER PID: logical blocks consumed on PID between two ruamw
# snapshots (modulo the RU size: a full RU restarts at RU_BLOCKS).
ruamw_used() {
    local b a
    b=$(awk -v p="$3" '$1 == p { print $2 }' <<<"$1")
    a=$(awk -v p="$3" '$1 == p { print $2 }' <<<"$2")
    [[ -n $b && -n $a ]] || { echo "missing"; return 0; }
    echo $(((b - a + RU_BLOCKS) % RU_BLOCKS))
}

# fdp_stat HBMW|MBMW|MBE: FDP statistics counter of endurance group 1, in bytes.
fdp_stat() {
    nvme fdp stats "$CTRL_DEV" -e 1 | awk -v k="($1):" 'index($0, k) { print $NF }'
}
