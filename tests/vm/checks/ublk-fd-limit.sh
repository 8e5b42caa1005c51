#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: lifecycle
# vm-timeout: 300
# A low open-files limit (ulimit -n 4 to 64, densest up to 8; start-up runs out below about 30 with 4
# queues; both NVMe engines). As root, fdpblk raises its limit to what the queues need, so
# `add` serves at every limit. Without CAP_SYS_RESOURCE it cannot pass the hard limit: then
# `add` either serves or fails with one line that names the open-files limit; it never hangs,
# and a failure leaves no device and no daemon behind.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
need_tool setpriv
GEO=(--slot-bytes 64K --meta-total-bytes 1M)

# try WRAP ENGINE N: `fdpblk add` under ulimit -n N (run through WRAP); prints "served",
# "refused: ERROR" or "hung: ...", and leaves nothing behind.
try() {
    local wrap=$1 engine=$2 n=$3 backing=$NS_DEV out rc
    [[ $engine == passthrough ]] && backing=$NG_DEV
    out=$(timeout 30 $wrap bash -c "ulimit -n $n; exec $FDPBLK add --backing $backing --engine $engine -n 0 -q 4 ${GEO[*]}" 2>&1) && rc=0 || rc=$?
    if ((rc == 124)); then
        echo "hung: $out $(tail -3 /run/fdpblk/daemon.log | tr '\n' ' ')"
        "$FDPBLK" del -n 0 >/dev/null 2>&1 || true
        pkill -9 -x fdpblk || true
    elif ((rc == 0)); then
        if ! dd if=/dev/ublkb0 of=/dev/null bs=64k count=1 iflag=direct status=none; then
            echo "served but a read failed"
        elif ! "$FDPBLK" del -n 0 >/dev/null; then
            echo "served but del failed"
        else
            echo served
        fi
    else
        for i in $(seq 50); do [[ -e /dev/ublkc0 ]] || break; sleep 0.1; done
        if [[ -e /dev/ublkc0 || -e /run/fdpblk/0.json ]]; then
            echo "left a device or state file: $out"
            "$FDPBLK" del -n 0 >/dev/null 2>&1 || true
        elif ! daemons_gone; then # a refusing daemon answers add before it exits
            echo "left a daemon: $out"
            pkill -9 -x fdpblk || true
        elif [[ $(wc -l <<<"$out") -ne 1 ]]; then
            echo "not one line: $out"
        else
            echo "refused: $out"
        fi
    fi
}

for engine in passthrough streams; do
    bad=()
    # fdpblk raises its limit before anything else, so the lowest limits and one in the middle
    # show it (the unprivileged sweep below walks every step of start-up).
    for n in 4 5 16; do
        r=$(try "" "$engine" "$n")
        [[ $r == served ]] || bad+=("ulimit -n $n: $r")
    done
    expect_eq "$engine as root: serves at every limit (fdpblk raises it)" "${bad[*]:-}" ""
done

noraise="setpriv --inh-caps -sys_resource --bounding-set -sys_resource"
# CAP_SYS_RESOURCE is capability 24.
expect "setpriv drops CAP_SYS_RESOURCE" $noraise bash -c 'c=$(sed -n "s/^CapEff:\t//p" /proc/self/status); (( (0x$c >> 24 & 1) == 0 ))'
served=0 hinted=0
for engine in passthrough streams; do
    # Every limit up to 8, then every second or fourth up to 32, where start-up runs out.
    for n in 4 5 6 7 8 10 12 14 16 20 24 28 32 64; do
        r=$(try "$noraise" "$engine" "$n")
        case $r in
        served) served=$((served + 1)) ;;
        "refused: "*"Too many open files (os error 24)"*)
            if [[ $r == *"; raise the open-files limit (ulimit -n; LimitNOFILE= in a systemd unit)" ]]; then
                hinted=$((hinted + 1))
            else
                not_ok "$engine, ulimit -n $n: out of descriptors, and the fix is not named: $r"
            fi ;;
        # libublk says EACCES for any failure to open the char device: the limit is named too.
        "refused: "*"could not open /dev/ublkc0"*"raise the open-files limit (ulimit -n; LimitNOFILE= in a systemd unit)") hinted=$((hinted + 1)) ;;
        *) not_ok "$engine without CAP_SYS_RESOURCE, ulimit -n $n: $r" ;;
        esac
    done
done
echo "    without CAP_SYS_RESOURCE: served $served times, $hinted refusals named the limit"
expect "some refusals named the open-files limit" test "$hinted" -gt 0
expect "the higher limits serve" test "$served" -gt 0
check_done
