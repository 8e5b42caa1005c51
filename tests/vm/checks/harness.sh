#!/usr/bin/env bash
# vm-host: yes
# vm-timeout: 300
# run.sh itself: exit status, stdout/stderr, --env, working directory and
# --share come back from the guest; --timeout gives 124; a guest that never
# starts the command is retried once and gives 125.
set -euo pipefail
RUN=${FDPBLK_VM_RUN:-$(dirname "$0")/../run.sh}
fails=0
ok() { echo "ok - $*"; }
not_ok() { echo "not ok - $*"; fails=$((fails + 1)); }
expect() { local d=$1; shift; if "$@"; then ok "$d"; else not_ok "$d"; fi; }
expect_eq() { if [[ $2 == "$3" ]]; then ok "$1 = $3"; else not_ok "$1: got '$2', want '$3'"; fi; }

share=$(mktemp -d "${TMPDIR:-/tmp}/fdpblk-vm-harness.XXXXXX")
trap 'rm -rf "$share"' EXIT
export FDPBLK_HARNESS_HOSTVAR="from host"

rc=0
"$RUN" --env FOO=bar --env 'SPACED=a b  c' --env FDPBLK_HARNESS_HOSTVAR --share "$share" -- \
    bash -c 'echo "cwd=$PWD foo=$FOO spaced=$SPACED host=$FDPBLK_HARNESS_HOSTVAR vm=$FDPBLK_VM"
             echo "to stderr" >&2
             echo written-in-guest >"$1/file"
             mkdir -p /tmp/x && touch /usr/guest-only-file
             exit 3' _ "$share" >"$share/out" 2>"$share/err" || rc=$?
expect_eq "exit status of 'exit 3'" "$rc" 3
expect_eq "stdout" "$(cat "$share/out")" "cwd=$(pwd -P) foo=bar spaced=a b  c host=from host vm=1"
expect "stderr carries the command's stderr" grep -qx "to stderr" "$share/err"
expect_eq "file written to the --share directory" "$(cat "$share/file" 2>/dev/null)" written-in-guest
expect_eq "guest writes outside shares stay in the guest" "$(ls /usr/guest-only-file 2>/dev/null)" ""

rc=0
"$RUN" --timeout 2 -- sleep 60 >/dev/null 2>"$share/err" || rc=$?
expect_eq "exit status when --timeout expires" "$rc" 124

# fdpblk.hang makes the guest's init stop before the command: the watchdog must
# fire, retry once, and give up with 125.
rc=0
t0=$(date +%s)
FDPBLK_VM_APPEND=fdpblk.hang "$RUN" --boot-timeout 3 -- true >/dev/null 2>"$share/err" || rc=$?
expect_eq "exit status when the command never starts" "$rc" 125
expect_eq "boot watchdog fired on both attempts" "$(grep -c 'boot watchdog' "$share/err")" 2
expect "the guest console (tail, or that it is empty) was reported" \
    grep -Eq 'last lines of the guest console|guest console is empty' "$share/err"
echo "watchdog path took $(($(date +%s) - t0))s"

if ((fails)); then
    echo "harness: $fails failure(s)"
    exit 1
fi
echo "harness: all ok"
