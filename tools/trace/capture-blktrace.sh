#!/usr/bin/env bash
# capture-blktrace.sh: record a blktrace of one block device (a ublk device of fdpblk, or any
# other) and write it as blkparse's default text, the format `fdpblk replay` reads.
#
#   tools/trace/capture-blktrace.sh [options] DEVICE
#
#   DEVICE                 /dev/ublkbN, /dev/fdpblk/NAME (links are followed), /dev/nvme0n1, ...
#   -o, --output FILE      the blkparse text (default: NAME.blkparse.txt in the current directory)
#   -w, --duration SECS    stop after SECS seconds (default: run until Ctrl-C, SIGINT or SIGTERM)
#   -e, --events LIST      comma-separated event kinds to record: queue, issue, complete, or all
#                          (default: issue,complete)
#       --iolog FILE       also write the binary trace fio replays (read_iolog=FILE); records
#                          queue events too, the only ones fio replays
#       --keep DIR         keep blktrace's per-CPU binary files in DIR (default: a temporary
#                          directory, removed at the end)
#   -b, --buffer-kib N     blktrace sub-buffer size in KiB (default 1024)
#   -n, --buffers N        blktrace sub-buffers per CPU (default 8)
#   -h, --help             this text
#
# Then:
#   fdpblk replay --device DEVICE_OR_IMAGE FILE          # geometry from LMCache's checkpoint
#   fdpblk replay --slot-bytes S --meta-total-bytes M FILE --ssd
#
# Which events. blktrace's -a masks are categories, and the kernel keeps an event when it
# matches ANY of them (an OR, not an AND): `-a issue` keeps every D event, whether it is a
# read, a write, a discard, a flush or a FUA write; `-a write` would keep every event of a
# write (Q, G, I, D, C, merges) and no flush. So this script records by event kind only:
#   issue     (D) a request issued to the driver, after merging and splitting: on a ublk
#             device exactly what the ublk server (fdpblk) receives. replay takes D by default.
#   complete  (C) its completion, with the error code ([0] when it succeeded);
#             `replay --blk-event C` replays completed requests only.
#   queue     (Q) a bio as submitted, before merging; `replay --blk-event Q`, and fio's
#             read_iolog replays only Q events.
# Discards (RWBS D), flushes (FN, or a leading F for a pre-flush) and FUA writes (an F after
# the W) are D/Q/C events like the others; nothing extra is needed for them. Write-zeroes
# requests show as writes. `-e all` records every event kind (G, I, M, P, U, X...), for
# reading by eye; replay still takes one kind.
#
# Which fields. blkparse's default line: `maj,min cpu seq sec.nsec pid action RWBS sector +
# blocks [process]`, sectors and blocks in 512-byte units whatever the logical block size,
# a completion ends with `[error]`. No `-f` format is passed: replay reads this default.
# A blktrace carries no data: replay classifies by the geometry but cannot read slot headers
# (no identities; see `fdpblk replay`'s note).
#
# Trace the ublk device for what LMCache wrote. On the NVMe side, fdpblk's passthrough engine
# (/dev/ngXnY) issues NVMe commands that a blktrace of /dev/nvmeXnY shows only as PC events
# without a range; read `fdpblk stats` and `nvme fdp stats` there instead (tools/fio/README.md).
#
# Needs root, blktrace and blkparse (Debian: apt-get install blktrace; tests/vm/setup.sh
# installs it), debugfs mounted on /sys/kernel/debug, and a kernel with block I/O tracing
# (CONFIG_BLK_DEV_IO_TRACE). Exit status: 0 done; 1 an error (one line on stderr that names
# the fix); 2 bad usage; 3 the trace is written but blktrace dropped events (rerun with a
# larger -b/-n).
set -euo pipefail

PROG=capture-blktrace.sh
die() { echo "$PROG: $*" >&2; exit 1; }
usage_die() { echo "$PROG: $*; see --help" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

OUT='' DURATION='' EVENTS=issue,complete IOLOG='' KEEP='' BUFKIB=1024 NBUF=8 DEV=''
# need_value OPT N: OPT was given its value (N arguments remain, the option's own included).
need_value() { (($2 >= 2)) || usage_die "$1 needs a value"; }
while (($#)); do
    case $1 in
        -o | --output | -w | --duration | -e | --events | --iolog | --keep | -b | --buffer-kib | -n | --buffers) need_value "$1" $# ;;&
        -o | --output) OUT=$2; shift ;;
        -w | --duration) DURATION=$2; shift ;;
        -e | --events) EVENTS=$2; shift ;;
        --iolog) IOLOG=$2; shift ;;
        --keep) KEEP=$2; shift ;;
        -b | --buffer-kib) BUFKIB=$2; shift ;;
        -n | --buffers) NBUF=$2; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) usage_die "unknown option '$1'" ;;
        *) [[ -z $DEV ]] || usage_die "one device only (got '$DEV' and '$1')"; DEV=$1 ;;
    esac
    shift
done
(($#)) && { [[ -z $DEV ]] || usage_die "one device only"; DEV=$1; shift; }
(($#)) && usage_die "one device only"
[[ -n $DEV ]] || usage_die "no device given"
[[ -z $DURATION || $DURATION =~ ^[1-9][0-9]*$ ]] || usage_die "--duration takes whole seconds > 0, not '$DURATION'"
[[ $BUFKIB =~ ^[1-9][0-9]*$ && $NBUF =~ ^[1-9][0-9]*$ ]] || usage_die "--buffer-kib and --buffers take numbers > 0"

# Event kinds -> blktrace -a masks.
MASKS=()
if [[ $EVENTS != all ]]; then
    IFS=, read -r -a kinds <<<"$EVENTS"
    ((${#kinds[@]})) || usage_die "--events is empty"
    [[ -n $IOLOG && " ${kinds[*]} " != *" queue "* ]] && kinds+=(queue)
    for k in "${kinds[@]}"; do
        case $k in
            queue | issue | complete) MASKS+=(-a "$k") ;;
            *) usage_die "unknown event kind '$k' in --events (queue, issue, complete, or all)" ;;
        esac
    done
fi

# Checks, each with the fix.
[[ -e $DEV ]] || die "$DEV does not exist (for fdpblk: fdpblk list shows the devices; /dev/fdpblk/NAME needs deploy/99-fdpblk.rules)"
REAL=$(readlink -f -- "$DEV")
[[ -b $REAL ]] || die "$DEV is not a block device"
NAME=$(basename -- "$REAL")
[[ $(id -u) -eq 0 ]] || die "blktrace needs root: run it with sudo"
for t in blktrace blkparse; do
    command -v "$t" >/dev/null || die "'$t' not found: install blktrace (Debian: apt-get install blktrace)"
done
grep -qs ' /sys/kernel/debug debugfs ' /proc/mounts ||
    die "debugfs is not mounted: mount -t debugfs debugfs /sys/kernel/debug"
SYSDEV=/sys/class/block/$NAME
# blktrace reports a partition's I/O in whole-disk sectors: replay subtracts its start.
PART_START=
if [[ -e $SYSDEV/partition ]]; then
    PART_START=$(cat "$SYSDEV/start")
    SYSDEV=$(readlink -f "$SYSDEV/..")
fi
[[ -d $SYSDEV/trace ]] || die "the kernel has no block I/O tracing for $NAME ($SYSDEV/trace missing; needs CONFIG_BLK_DEV_IO_TRACE)"
[[ -n $OUT ]] || OUT=$NAME.blkparse.txt
: >"$OUT" 2>/dev/null || die "cannot write $OUT"

if [[ -n $KEEP ]]; then
    mkdir -p "$KEEP" || die "cannot create $KEEP"
    DIR=$KEEP
    rm -f "$DIR/$NAME".blktrace.*
else
    DIR=$(mktemp -d "${TMPDIR:-/tmp}/capture-blktrace.XXXXXX")
fi
BT_PID=
cleanup() {
    [[ -n $BT_PID ]] && kill -INT "$BT_PID" 2>/dev/null && wait "$BT_PID" 2>/dev/null
    [[ -z $KEEP ]] && rm -rf "$DIR"
    return 0
}
trap cleanup EXIT

# blktrace writes DIR/NAME.blktrace.CPU; its log says how many events it dropped.
args=(-d "$REAL" -D "$DIR" -o "$NAME" -b "$BUFKIB" -n "$NBUF" "${MASKS[@]}")
[[ -n $DURATION ]] && args+=(-w "$DURATION")
blktrace "${args[@]}" >"$DIR/blktrace.log" 2>&1 &
BT_PID=$!
stop=0
trap 'stop=1' INT TERM
for ((i = 0; i < 100; i++)); do
    compgen -G "$DIR/$NAME.blktrace.*" >/dev/null && break
    kill -0 "$BT_PID" 2>/dev/null || break
    sleep 0.1
done
if ! kill -0 "$BT_PID" 2>/dev/null; then
    wait "$BT_PID" 2>/dev/null || true
    BT_PID=
    die "blktrace did not start: $(tr '\n' ' ' <"$DIR/blktrace.log")"
fi
if [[ -n $DURATION ]]; then
    echo "$PROG: tracing $REAL for $DURATION s (events: ${EVENTS})" >&2
else
    echo "$PROG: tracing $REAL until Ctrl-C or SIGTERM (events: ${EVENTS})" >&2
fi
# wait returns early on a trapped signal: pass it on, then wait for blktrace to flush.
# A signal that came before a wait began (during start-up, or between two waits) is passed on
# first, so that no wait blocks on a blktrace that was never told to stop.
# Its exit status comes from the wait that reaped it (one cut short by a signal returns
# above 128 and the loop waits again).
bt_rc=
while kill -0 "$BT_PID" 2>/dev/null; do
    if ((stop)); then
        kill -INT "$BT_PID" 2>/dev/null || true
        stop=0
    fi
    if wait "$BT_PID" 2>/dev/null; then bt_rc=0; else bt_rc=$?; fi
done
if [[ -z $bt_rc ]] || ((bt_rc > 128)); then
    # 127: reaped by an earlier wait whose status was lost to the signal; not known.
    if wait "$BT_PID" 2>/dev/null; then bt_rc=0; else rc=$?; if ((rc == 127)); then bt_rc=; else bt_rc=$rc; fi; fi
fi
BT_PID=
trap - INT TERM
# blktrace stops cleanly (status 0) on our SIGINT or at the end of -w.
if [[ -n $bt_rc && $bt_rc != 0 ]]; then
    die "blktrace failed (exit status $bt_rc), so the trace may be cut short: $(tr '\n' ' ' <"$DIR/blktrace.log")"
fi

# blktrace keeps running when it cannot map its output files, and records nothing.
if grep -qE 'setup_mmap|failed read' "$DIR/blktrace.log"; then
    die "blktrace could not write its files in $DIR ($(grep -m1 -E 'setup_mmap|failed read' "$DIR/blktrace.log")): it needs a file system with writable mmap; give --keep a local directory"
fi
parse=(-i "$NAME" -D "$DIR" -o "$OUT")
[[ -n $IOLOG ]] && parse+=(-d "$IOLOG")
blkparse "${parse[@]}" >/dev/null 2>"$DIR/blkparse.log" || die "blkparse failed: $(tr '\n' ' ' <"$DIR/blkparse.log")"
events=$(grep -c '^ *[0-9]*,[0-9]* ' "$OUT" || true)
echo "$PROG: $events events of $REAL in $OUT${IOLOG:+, fio replay log in $IOLOG}" >&2
if [[ -n $PART_START ]]; then
    echo "$PROG: $NAME is a partition starting at sector $PART_START and blktrace records whole-disk sectors: replay with --sector-offset $PART_START" >&2
fi
# blktrace ends with "Total: N events (dropped D), ..." per device.
dropped=$(sed -n 's/.*Total:.*(dropped \([0-9]*\)).*/\1/p' "$DIR/blktrace.log" | head -n1)
if [[ -n $dropped && $dropped != 0 ]]; then
    echo "$PROG: blktrace dropped $dropped events: the trace is incomplete; rerun with larger buffers (-b KIB, -n COUNT)" >&2
    exit 3
fi
