# shellcheck shell=bash
# Helpers for checks that run fdpblk's ublk device (source after check-lib.sh).
FDPBLK=${FDPBLK:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/target/release/fdpblk}
[[ -x $FDPBLK ]] || check_fatal "no $FDPBLK: run 'cargo build --release' on the host first"

# fdpblk_add ARGS...: add a device, print its path; fails the check on error.
fdpblk_add() {
    local out
    out=$("$FDPBLK" add "$@" 2>&1) || {
        echo "not ok - fdpblk add $*: $out" >&2
        cat /run/fdpblk/daemon.log >&2 2>/dev/null
        check_fatal "fdpblk add $*"
    }
    echo "$out"
}

# daemon_pid ID: the pid serving device ID.
daemon_pid() { sed -n 's/.*"pid":\([0-9]*\).*/\1/p' "/run/fdpblk/$1.json"; }

# fio_verify NAME DEV ARGS...: a verifying fio job; ok when fio reports no error.
fio_verify() {
    local name=$1 dev=$2
    shift 2
    if fio --name="$name" --filename="$dev" --direct=1 --ioengine=io_uring --verify=crc32c \
        --do_verify=1 --verify_fatal=1 --randrepeat=1 --output-format=terse "$@" >"/tmp/fio-$name.log" 2>&1; then
        ok "fio $name ($*)"
    else
        tail -5 "/tmp/fio-$name.log"
        not_ok "fio $name ($*)"
    fi
}
