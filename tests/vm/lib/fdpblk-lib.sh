# shellcheck shell=bash
# Helpers for checks that run fdpblk's ublk device (source after check-lib.sh).
FDPBLK=${FDPBLK:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/target/release/fdpblk}
[[ -x $FDPBLK ]] || check_fatal "no $FDPBLK: run 'cargo build --release' on the host first"

# fdpblk_add ARGS...: add a device, print its path; fails the check on error.
fdpblk_add() {
    local out err
    err=$(mktemp)
    out=$("$FDPBLK" add "$@" 2>"$err") || {
        echo "not ok - fdpblk add $*: $out$(cat "$err")" >&2
        rm -f "$err"
        cat /run/fdpblk/daemon.log >&2 2>/dev/null
        check_fatal "fdpblk add $*"
    }
    # Warnings go to the check's log, not into the device path its caller takes.
    cat "$err" >&2
    rm -f "$err"
    echo "$out"
}

# daemon_log_since_start: what fdpblk's daemons logged since this check began (the log is
# shared by the checks of one boot; its inode and size are noted when this file is sourced).
# Past a rotation (daemon.log.1, at 16 MiB) the rest of the old file comes first; a log
# emptied by the check is new from its start. Fails, naming why on stderr, when the log is
# missing or was rotated twice: no check may read "no error" from a log it did not read.
DAEMON_LOG=/run/fdpblk/daemon.log
DAEMON_LOG_INODE=$(stat -c %i "$DAEMON_LOG" 2>/dev/null || echo none)
DAEMON_LOG_BYTES=$(stat -c %s "$DAEMON_LOG" 2>/dev/null || echo 0)
daemon_log_since_start() {
    local inode size
    inode=$(stat -c %i "$DAEMON_LOG" 2>/dev/null) || { echo "no $DAEMON_LOG (no background daemon logged)" >&2; return 1; }
    size=$(stat -c %s "$DAEMON_LOG")
    if [[ $inode == "$DAEMON_LOG_INODE" ]]; then
        if ((size >= DAEMON_LOG_BYTES)); then tail -c +$((DAEMON_LOG_BYTES + 1)) "$DAEMON_LOG"; else cat "$DAEMON_LOG"; fi
        return 0
    fi
    if [[ $DAEMON_LOG_INODE != none ]]; then
        [[ $(stat -c %i "$DAEMON_LOG.1" 2>/dev/null) == "$DAEMON_LOG_INODE" ]] || { echo "$DAEMON_LOG was rotated more than once during this check" >&2; return 1; }
        tail -c +$((DAEMON_LOG_BYTES + 1)) "$DAEMON_LOG.1"
    fi
    cat "$DAEMON_LOG"
}
# At a check's first failure: what the daemons warned of since it began, and device 0's
# deallocation and slot counts, so that a failure in CI can be read from its log alone.
declare -F check_lib_not_ok >/dev/null || eval "check_lib_$(declare -f not_ok)"
not_ok() {
    check_lib_not_ok "$@"
    ((CHECK_FAILS == 1)) || return 0
    local text
    if text=$(daemon_log_since_start 2>&1); then
        { grep -E ' (WARN|ERROR) ' <<<"$text" | tail -n 10 | sed 's/^/#   daemon: /'; } || true
    fi
    if [[ -e /run/fdpblk/0.stats.json ]]; then
        { "$FDPBLK" stats -n 0 --json 2>/dev/null | jq -c '{checkpoint_seq, trim, slots}' | sed 's/^/#   stats -n 0: /'; } || true
    fi
    return 0
}

# daemon_errors: the number of ERROR lines the daemons logged since this check began (or why
# the log could not be read).
daemon_errors() {
    local text
    text=$(daemon_log_since_start 2>&1) || { echo "unreadable log: $text"; return; }
    grep -c ' ERROR ' <<<"$text" || true
}
# daemons_gone: waits up to 5 s for every fdpblk daemon to exit (`del` returns once the device
# is gone; its daemon may still be closing the backing, which the next add opens exclusively).
daemons_gone() { for _ in $(seq 50); do pgrep -x fdpblk >/dev/null || return 0; sleep 0.1; done; return 1; }
# log_has PATTERN: whether the daemons logged a line matching PATTERN (grep -E) since this
# check began; log_lacks PATTERN: whether they did not, in a log that could be read.
log_has() { local text; text=$(daemon_log_since_start) && grep -qE -- "$1" <<<"$text"; }
log_lacks() { local text; text=$(daemon_log_since_start) && ! grep -qE -- "$1" <<<"$text"; }

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

# The LMCache raw_block writer (tools/rawblock_writer), built on the host with fdpblk.
# shellcheck disable=SC2034 # used by the checks that source this file
RBW=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/target/release/rawblock-writer
# A ublk server that is not fdpblk (examples/other_ublk_server.rs; `cargo test` builds it).
# shellcheck disable=SC2034 # used by the checks that source this file
OTHER_UBLK=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/target/release/examples/other_ublk_server

# fdpblk_fresh_drive: no LMCache checkpoint and no saved fdpblk state on $NS_DEV (the checks of
# one boot share the drive): discards the first MiB (the metadata region of the checks'
# geometries) and fdpblk's reserved tail, max(8 MiB, size / 4096 rounded up to 1 MiB).
fdpblk_fresh_drive() {
    local size tail_bytes
    size=$(blockdev --getsize64 "$NS_DEV") || return 1
    tail_bytes=$(((size / 4096 + (1 << 20) - 1) / (1 << 20) * (1 << 20)))
    ((tail_bytes < 8 << 20)) && tail_bytes=$((8 << 20))
    blkdiscard -o 0 -l $((1 << 20)) "$NS_DEV" && blkdiscard -o $((size - tail_bytes)) -l "$tail_bytes" "$NS_DEV"
}

# writeback_set EXPIRE EVERY: the kernel's vm.dirty_expire_centisecs and
# vm.dirty_writeback_centisecs (how long a dirty page may wait, and the flusher's period); the
# first call saves what they were, for writeback_restore (in the check's EXIT trap).
writeback_set() {
    local vm=/proc/sys/vm
    [[ ${WRITEBACK_SAVED:-} ]] || WRITEBACK_SAVED="$(cat $vm/dirty_expire_centisecs) $(cat $vm/dirty_writeback_centisecs)"
    echo "$1" >$vm/dirty_expire_centisecs
    echo "$2" >$vm/dirty_writeback_centisecs
}
writeback_restore() {
    [[ ${WRITEBACK_SAVED:-} ]] || return 0
    writeback_set "${WRITEBACK_SAVED% *}" "${WRITEBACK_SAVED#* }"
}

# rbw_run NAME LABEL OPTION... -- ARGS...: one rawblock-writer run (one LMCache process) on
# $DEV with the check's ${GEOM[@]}, the OPTIONs and its index in $STATE; its stats JSON goes
# to $OUT/$WRITER_PREFIX-NAME.json (WRITER_PREFIX: the check's name).
rbw_run() {
    local name=$1 label=$2 base mode=()
    shift 2
    while [[ $1 != -- ]]; do mode+=("$1"); shift; done
    shift
    base="$OUT/${WRITER_PREFIX:-writer}-$name"
    if "$RBW" --device "$DEV" "${GEOM[@]}" "${mode[@]}" --state "$STATE" -q "$@" stats >"$base.json" 2>"$base.err"; then
        ok "$name: rawblock-writer$label $*"
    else
        sed 's/^/    /' "$base.err"
        not_ok "$name: rawblock-writer$label $*"
    fi
}

# writer NAME ARGS...: O_DIRECT, io_engine $WRITER_ENGINE (posix unless set).
writer() {
    local name=$1
    shift
    rbw_run "$name" "" --engine "${WRITER_ENGINE:-posix}" --odirect -- "$@"
}

# bwriter NAME ARGS...: buffered (posix, page cache, no fsync: LMCache's non-MP default),
# with the check's BWRITER_ARGS (if set) before ARGS.
bwriter() {
    local name=$1
    shift
    rbw_run "$name" " (buffered)" --engine posix ${BWRITER_ARGS[@]+"${BWRITER_ARGS[@]}"} -- "$@"
}

# wfield NAME PATH: a field (jq path) of the stats of writer run NAME.
wfield() { jq -c ".$2" "$OUT/${WRITER_PREFIX:-writer}-$1.json"; }

# dev_stat PATH: a field of `fdpblk stats -n 0 --json` (jq path), compact JSON.
dev_stat() { "$FDPBLK" stats -n 0 --json 2>/dev/null | jq -c ".$1"; }

# poll_eq NAME WANT CMD...: until CMD prints WANT (20 s), then the check NAME. fdpblk rewrites
# its stats twice a second, so a single read can be one refresh behind on a slow guest.
poll_eq() {
    local name=$1 want=$2 got
    shift 2
    for _ in $(seq 80); do
        got=$("$@")
        [[ $got == "$want" ]] && break
        sleep 0.25
    done
    expect_eq "$name" "$got" "$want"
    if [[ $got != "$want" ]]; then
        echo "# checkpoint containers as fdpblk sees them: $("$FDPBLK" stats -n 0 --json 2>/dev/null | jq -c '.containers')"
    fi
    if [[ $got != "$want" && -e /run/fdpblk/daemon.log ]]; then
        echo "# the daemon's last log lines:"
        grep -v '^$' /run/fdpblk/daemon.log | tail -15 | sed 's/^/#   /'
    fi
}

# written_bytes ID: the bytes written through ublk device ID, as its stats count them.
written_bytes() { "$FDPBLK" stats -n "$1" --json 2>/dev/null | sed -n 's/.*"write":{"bytes":\([0-9]*\).*/\1/p'; }

# expect_written ID WANT NAME: until device ID's stats count WANT bytes written.
expect_written() { poll_eq "$3" "$2" written_bytes "$1"; }

# wait_stat PATH WANT: until device 0's stats show WANT.
wait_stat() { poll_eq "fdpblk stats $1" "$2" dev_stat "$1"; }

# wait_rounds N: until device 0's state thread has run N more rounds (30 s), so that a check
# that nothing happened is made after rounds that would have seen it happen, however slow the
# guest.
wait_rounds() {
    local r0 r
    r0=$(dev_stat state_rounds)
    for _ in $(seq 120); do
        r=$(dev_stat state_rounds)
        ((r >= r0 + $1)) && return 0
        sleep 0.25
    done
    not_ok "the state thread did not run $1 rounds in 30 s (at $r, from $r0)"
}
