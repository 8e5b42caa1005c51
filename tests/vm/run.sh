#!/usr/bin/env bash
# Run one command as root in a throw-away QEMU guest with ublk_drv and an
# emulated (FDP) NVMe SSD; print its output and exit with its exit status.
#
#   tests/vm/run.sh [options] [--] COMMAND [ARGS...]
#   tests/vm/run.sh --shell [options] [-- COMMAND [ARGS...]]
#
# The guest's root is the host's root (read-only over 9p, tmpfs overlay on top),
# so host-built binaries (target/...), fio, nvme-cli and python3 run unchanged.
# The command runs in the caller's working directory with a clean environment
# (PATH, HOME, LANG, TERM, CI from the host, FDPBLK_VM_* and --env values),
# stdin /dev/null. Guest writes vanish at power-off except in --share dirs.
# The guest has its own /tmp, /run and /dev/shm (empty tmpfs).
#
# Options:
#   --kernel new|old     new: newest trixie-backports kernel (>= 6.16, block
#                        write streams); old: bookworm-backports 6.12 (none)
#                        [new; env FDPBLK_VM_KERNEL]
#   --fdp on|off         FDP-enabled NVMe subsystem, or a plain NVMe [on]
#   --nruh N             reclaim unit handles (placement IDs 0..N-1) [8]
#   --nrg N              reclaim groups (fdp.nrg); with N > 1 the namespace
#                        has a placement ID per (handle, group) [1]
#   --ru-size SIZE       reclaim unit size (fdp.runs) [4M]
#   --disk-size SIZE     size of the sparse namespace image [1G]
#   --disk FILE          keep the namespace image in FILE (created with
#                        --disk-size if missing) instead of a temporary one
#   --namespaces N       namespaces 1..N on the controller (2..N: temporary
#                        images of --disk-size; with FDP they share all RUHs) [1]
#   --lba-size 512|4096  logical block size of the namespace [512]
#   --lba-ms 0|8|16|64   metadata bytes per block, in a separate buffer [0]
#   --bad-sector N       I/O touching 512-byte sector N of namespace 1 fails (QEMU
#                        blkdebug: reads and writes as media errors; discards and
#                        Write Zeroes too, as internal errors); may be given more than once
#   --mem SIZE           guest memory [2G]
#   --cpus N             guest vCPUs [2]
#   --timeout SECS       limit on the command's run time; 0 = none [600]
#   --boot-timeout SECS  watchdog: no command started after SECS -> kill the
#                        guest and boot once more [60]
#   --env K=V, --env K   set K in the guest (K alone: copy the host's value)
#   --share DIR          mount host DIR writable at the same path (repeatable)
#   --shell              interactive: the console is on this terminal and a
#                        bash runs after COMMAND (if any); exit it to power off
#                        (QEMU escape: Ctrl-A X)
#   --console FILE       copy the guest's console log to FILE
#   --accel tcg|kvm      [tcg; env FDPBLK_VM_ACCEL]; kvm is untested
#   --tcg-threads single|multi
#                        TCG: one host thread for all vCPUs, or one each [multi;
#                        env FDPBLK_VM_TCG_THREADS]
#   -v, --verbose        stream the guest console to stderr, print timings
#   --timing             print "fdpblk-vm: boot ... command ..." to stderr
#
# Exit status: the command's; 124 when --timeout expired; 125 when the command
# never ran (bad options, harness not set up, no command started in two boots)
# or the guest died before it finished (the console tail is printed).
# Environment: FDPBLK_VM_CACHE (cache from setup.sh, default /var/cache/fdpblk-vm).
set -euo pipefail

VM_LOG_PREFIX=fdpblk-vm
VM_DIE_RC=125
# shellcheck source=lib/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

KERNEL=${FDPBLK_VM_KERNEL:-new}
FDP=on NRUH=8 NRG=1 RU_SIZE=4M DISK_SIZE=1G DISK='' NAMESPACES=1 LBA=512 LBA_MS=0 MEM=2G CPUS=2
TIMEOUT=600 BOOT_TIMEOUT=60 SHELL_MODE=0 CONSOLE_OUT='' VERBOSE=0 TIMING=0
ACCEL=${FDPBLK_VM_ACCEL:-tcg}
TCG_THREADS=${FDPBLK_VM_TCG_THREADS:-multi}
ENVS=() SHARES=() BAD_SECTORS=()

need() { [[ $# -ge 2 && -n $2 ]] || vm_die "option $1 needs a value (see --help)"; }
while (($#)); do
    case $1 in
        --kernel) need "$@"; KERNEL=$2; shift ;;
        --fdp) need "$@"; FDP=$2; shift ;;
        --nruh) need "$@"; NRUH=$2; shift ;;
        --nrg) need "$@"; NRG=$2; shift ;;
        --ru-size) need "$@"; RU_SIZE=$2; shift ;;
        --disk-size) need "$@"; DISK_SIZE=$2; shift ;;
        --disk) need "$@"; DISK=$2; shift ;;
        --namespaces) need "$@"; NAMESPACES=$2; shift ;;
        --lba-size) need "$@"; LBA=$2; shift ;;
        --lba-ms) need "$@"; LBA_MS=$2; shift ;;
        --bad-sector) need "$@"; BAD_SECTORS+=("$2"); shift ;;
        --mem) need "$@"; MEM=$2; shift ;;
        --cpus) need "$@"; CPUS=$2; shift ;;
        --timeout) need "$@"; TIMEOUT=$2; shift ;;
        --boot-timeout) need "$@"; BOOT_TIMEOUT=$2; shift ;;
        --env) need "$@"; ENVS+=("$2"); shift ;;
        --share) need "$@"; SHARES+=("$2"); shift ;;
        --shell) SHELL_MODE=1 ;;
        --console) need "$@"; CONSOLE_OUT=$2; shift ;;
        --accel) need "$@"; ACCEL=$2; shift ;;
        --tcg-threads) need "$@"; TCG_THREADS=$2; shift ;;
        -v | --verbose) VERBOSE=1 TIMING=1 ;;
        --timing) TIMING=1 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) vm_die "unknown option '$1' (see --help)" ;;
        *) break ;;
    esac
    shift
done
CMD=("$@")
((${#CMD[@]} || SHELL_MODE)) || vm_die "no command given (usage: run.sh [options] -- COMMAND [ARGS...]; see --help)"

# ---- validate ------------------------------------------------------------------
case $KERNEL in new | old) ;; *) vm_die "--kernel must be new or old, not '$KERNEL'" ;; esac
case $FDP in on | off) ;; *) vm_die "--fdp must be on or off, not '$FDP'" ;; esac
case $LBA in 512 | 4096) ;; *) vm_die "--lba-size must be 512 or 4096" ;; esac
case $LBA_MS in 0 | 8 | 16 | 64) ;; *) vm_die "--lba-ms must be 0, 8, 16 or 64" ;; esac
case $ACCEL in tcg | kvm) ;; *) vm_die "--accel must be tcg or kvm" ;; esac
case $TCG_THREADS in single | multi) ;; *) vm_die "--tcg-threads must be single or multi" ;; esac
for v in NRUH NRG NAMESPACES CPUS TIMEOUT BOOT_TIMEOUT; do
    [[ ${!v} =~ ^[0-9]+$ ]] || vm_die "--$(tr 'A-Z_' 'a-z-' <<<"$v") must be a whole number, not '${!v}'"
done
((NRUH >= 1 && NRUH <= 128)) || vm_die "--nruh must be 1..128"
((NRG >= 1 && NRG <= 8)) || vm_die "--nrg must be 1..8"
((NAMESPACES >= 1 && NAMESPACES <= 4)) || vm_die "--namespaces must be 1..4"
for b in ${BAD_SECTORS[@]+"${BAD_SECTORS[@]}"}; do
    [[ $b =~ ^[0-9]+$ ]] || vm_die "--bad-sector must be a 512-byte sector number, not '$b'"
done
((BOOT_TIMEOUT >= 1)) || vm_die "--boot-timeout must be at least 1"
bytes() { numfmt --from=iec "$1" 2>/dev/null || vm_die "bad size '$1' (use e.g. 4M, 1G)"; }
RU_BYTES=$(bytes "$RU_SIZE")
DISK_BYTES=$(bytes "$DISK_SIZE")
((RU_BYTES >= LBA && RU_BYTES % LBA == 0)) || vm_die "--ru-size must be a multiple of the LBA size"
((DISK_BYTES >= 1048576)) || vm_die "--disk-size must be at least 1M"
[[ $MEM =~ ^[0-9]+[MGmg]?$ ]] || vm_die "--mem takes e.g. 2G or 1536M"

vm_qemu_ok || vm_die "qemu-system-x86_64 with FDP emulation (QEMU >= 8.0) not found; run tests/vm/setup.sh"
if ! { KVER=$(vm_kernel_release "$KERNEL") && vm_kernel_ready "$KVER"; }; then
    vm_die "guest kernel '$KERNEL' is not set up in $VM_CACHE; run tests/vm/setup.sh"
fi
KDIR=$(vm_kernel_dir "$KVER")
INITRD=$(vm_initramfs "$KVER")
MODTREE=$(dirname "$(vm_moddir "$KVER")")
MODTREE=$(realpath "$MODTREE")

safe_path() { [[ $1 =~ ^/[A-Za-z0-9._/+@=:-]*$ && $1 != *,* ]]; }
hidden_path() { # paths the guest covers with its own mounts
    case $1/ in /tmp/* | /run/* | /dev/* | /proc/* | /sys/*) return 0 ;; esac
    return 1
}
SHARE_PATHS=()
for s in "${SHARES[@]}"; do
    [[ -d $s ]] || vm_die "--share $s: not a directory"
    p=$(realpath "$s")
    safe_path "$p" || vm_die "--share $p: only [A-Za-z0-9._/+@=:-] allowed in share paths"
    [[ $p != / ]] || vm_die "--share /: the host root is already visible (read-only)"
    SHARE_PATHS+=("$p")
done
CWD=$(pwd -P)
if hidden_path "$CWD"; then
    covered=0
    for p in "${SHARE_PATHS[@]}"; do
        [[ $CWD/ == "$p"/* ]] && covered=1
    done
    ((covered)) || vm_die "the working directory $CWD is hidden in the guest (its /tmp, /run, /dev are its own); cd elsewhere or pass --share $CWD"
fi
for e in "${ENVS[@]}"; do
    k=${e%%=*}
    [[ $k =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || vm_die "--env $e: bad variable name"
    if [[ $e != *=* ]]; then
        [[ -n ${!k+x} ]] || vm_die "--env $k: not set on the host (use --env $k=VALUE)"
    fi
done

# ---- per-run directory -----------------------------------------------------------
R=$(mktemp -d "${TMPDIR:-/tmp}/fdpblk-vm.XXXXXX")
QPID=
cleanup() {
    if [[ -n $QPID ]] && kill -0 "$QPID" 2>/dev/null; then
        kill -9 "$QPID" 2>/dev/null || true
        { wait "$QPID"; } 2>/dev/null || true
    fi
    rm -rf "$R"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$R/ctl"

if [[ -n $DISK ]]; then
    if [[ ! -e $DISK ]]; then truncate -s "$DISK_BYTES" "$DISK" || vm_die "cannot create --disk $DISK"; fi
    IMG=$(realpath "$DISK")
    safe_path "$IMG" || vm_die "--disk $IMG: only [A-Za-z0-9._/+@=:-] allowed in the path"
else
    IMG=$R/nvm.img
    truncate -s "$DISK_BYTES" "$IMG"
fi
for ((n = 2; n <= NAMESPACES; n++)); do truncate -s "$DISK_BYTES" "$R/nvm$n.img"; done

q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
{
    echo "VM_MODE=$( ((SHELL_MODE)) && echo shell || echo run)"
    echo "VM_NVME=1"
    echo "VM_MODTREE=$(q "$MODTREE")"
    shares=
    for i in "${!SHARE_PATHS[@]}"; do shares+="share$i ${SHARE_PATHS[$i]} "; done
    echo "VM_SHARES=$(q "$shares")"
} >"$R/ctl/config"

{
    echo '# generated by tests/vm/run.sh'
    ex() { printf 'export %s=%q\n' "$1" "$2"; }
    ex PATH "${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"
    ex HOME "${HOME:-/root}"
    ex USER root
    ex LOGNAME root
    for k in LANG LC_ALL CI; do [[ -n ${!k:-} ]] && ex "$k" "${!k}"; done
    if ((SHELL_MODE)); then ex TERM "${TERM:-vt100}"; else ex TERM dumb; fi
    ex FDPBLK_VM 1
    ex FDPBLK_VM_KERNEL "$KERNEL"
    ex FDPBLK_VM_KVER "$KVER"
    ex FDPBLK_VM_FDP "$FDP"
    ex FDPBLK_VM_NRUH "$NRUH"
    ex FDPBLK_VM_NRG "$NRG"
    ex FDPBLK_VM_RU_SIZE "$RU_BYTES"
    ex FDPBLK_VM_LBA_SIZE "$LBA"
    ex FDPBLK_VM_LBA_MS "$LBA_MS"
    ex FDPBLK_VM_CACHE "$VM_CACHE"
    for e in "${ENVS[@]}"; do
        if [[ $e == *=* ]]; then ex "${e%%=*}" "${e#*=}"; else ex "$e" "${!e}"; fi
    done
    printf 'cd -- %q || { echo "fdpblk-vm: cannot cd to %q in the guest" >&2; exit 125; }\n' "$CWD" "$CWD"
    if ((SHELL_MODE)); then
        if size=$(stty size 2>/dev/null) && [[ $size =~ ^([0-9]+)\ ([0-9]+)$ ]]; then
            echo "stty rows ${BASH_REMATCH[1]} cols ${BASH_REMATCH[2]} 2>/dev/null"
        fi
        if ((${#CMD[@]})); then
            printf '%q ' "${CMD[@]}"
            echo
            echo 'echo "fdpblk-vm: command exited with $?; exit the shell to power off"'
        fi
        echo "export PS1='fdpblk-vm:\\w# '"
        echo 'exec /bin/bash --norc -i'
    else
        printf 'exec'
        printf ' %q' "${CMD[@]}"
        echo
    fi
} >"$R/ctl/cmd.sh"

# ---- QEMU command line -----------------------------------------------------------
QEMU=(qemu-system-x86_64 -nodefaults -no-user-config -no-reboot -display none)
if [[ $ACCEL == kvm ]]; then
    QEMU+=(-accel kvm -cpu host)
else
    QEMU+=(-accel "tcg,thread=$TCG_THREADS" -cpu max)
fi
QEMU+=(-m "$MEM" -smp "$CPUS")
APPEND="console=ttyS0 panic=-1 loglevel=5 sysctl.kernel.hung_task_timeout_secs=300 ${FDPBLK_VM_APPEND:-}"
if [[ -s $KDIR/vmlinux && -e /usr/share/qemu/qboot.rom ]]; then
    # PVH entry of the uncompressed kernel with qboot: ~4 s faster than SeaBIOS+bzImage.
    QEMU+=(-bios qboot.rom -kernel "$KDIR/vmlinux")
else
    QEMU+=(-kernel "$KDIR/vmlinuz")
fi
QEMU+=(-initrd "$INITRD" -append "$APPEND")
QEMU+=(-fsdev local,id=fsroot,path=/,security_model=none,readonly=on,multidevs=remap
    -device virtio-9p-pci,fsdev=fsroot,mount_tag=hostroot
    -fsdev "local,id=fsctl,path=$R/ctl,security_model=none"
    -device virtio-9p-pci,fsdev=fsctl,mount_tag=vmrun)
for i in "${!SHARE_PATHS[@]}"; do
    QEMU+=(-fsdev "local,id=fsshare$i,path=${SHARE_PATHS[$i]},security_model=none"
        -device "virtio-9p-pci,fsdev=fsshare$i,mount_tag=share$i")
done
# discard=unmap: deallocated ranges must read back as zeroes.
if ((${#BAD_SECTORS[@]})); then
    # blkdebug under the raw format: from the first read or write on, every request touching
    # a bad sector fails with EIO, which the NVMe controller reports as a media error for a
    # read or write (unrecovered read, write fault), as an internal error for the rest.
    for b in "${BAD_SECTORS[@]}"; do
        for ev in read_aio write_aio; do
            printf '[inject-error]\nevent = "%s"\nerrno = "5"\nsector = "%s"\nonce = "off"\n\n' "$ev" "$b"
        done
    done >"$R/blkdebug.conf"
    QEMU+=(-drive "driver=raw,file.driver=blkdebug,file.config=$R/blkdebug.conf,file.image.filename=$IMG,if=none,id=nvm,cache=unsafe,discard=unmap")
else
    QEMU+=(-drive "file=$IMG,if=none,id=nvm,format=raw,cache=unsafe,discard=unmap")
fi
NS="nvme-ns,drive=nvm,nsid=1,logical_block_size=$LBA,physical_block_size=$LBA"
((LBA_MS)) && NS+=",ms=$LBA_MS"
if [[ $FDP == on ]]; then
    QEMU+=(-device "nvme-subsys,id=subsys0,nqn=subsys0,fdp=on,fdp.runs=$RU_BYTES,fdp.nrg=$NRG,fdp.nruh=$NRUH"
        -device nvme,id=nvme0,serial=fdp0,subsys=subsys0
        -device "$NS,fdp.ruhs=0-$((NRUH - 1))")
else
    QEMU+=(-device nvme,id=nvme0,serial=nvme0 -device "$NS")
fi
# Namespaces 2..N: the same format; with FDP, the same reclaim unit handles.
for ((n = 2; n <= NAMESPACES; n++)); do
    QEMU+=(-drive "file=$R/nvm$n.img,if=none,id=nvm$n,format=raw,cache=unsafe,discard=unmap")
    ns="nvme-ns,drive=nvm$n,nsid=$n,logical_block_size=$LBA,physical_block_size=$LBA"
    ((LBA_MS)) && ns+=",ms=$LBA_MS"
    [[ $FDP == on ]] && ns+=",fdp.ruhs=0-$((NRUH - 1))"
    QEMU+=(-device "$ns")
done

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
console_tail() {
    if [[ -s $R/console.log ]]; then
        echo "fdpblk-vm: ---- last lines of the guest console ----" >&2
        tail -n "${1:-40}" "$R/console.log" | tr -d '\r' >&2
        echo "fdpblk-vm: ----" >&2
    else
        echo "fdpblk-vm: (the guest console is empty)" >&2
    fi
}
save_console() {
    [[ -z $CONSOLE_OUT || ! -e $R/console.log ]] || cp "$R/console.log" "$CONSOLE_OUT" || true
}

# ---- interactive ---------------------------------------------------------------------
if ((SHELL_MODE)); then
    [[ -t 0 ]] || vm_log "warning: --shell without a terminal on stdin"
    vm_log "booting $KVER (fdp $FDP); Ctrl-A X quits QEMU"
    "${QEMU[@]}" -serial mon:stdio || true
    rc=125
    [[ -s $R/ctl/rc ]] && rc=$(cat "$R/ctl/rc")
    exit "$rc"
fi

# ---- batch -------------------------------------------------------------------------------
TAILS=()
rc=
for attempt in 1 2; do
    rm -f "$R/ctl/started" "$R/ctl/finished" "$R/ctl/rc" "$R/ctl/error" "$R/console.log"
    : >"$R/ctl/stdout"
    : >"$R/ctl/stderr"
    : >"$R/console.log"
    t0=$(now)
    "${QEMU[@]}" -serial "file:$R/console.log" </dev/null >"$R/qemu.log" 2>&1 &
    QPID=$!
    tail -s 0.2 --pid="$QPID" -n +1 -F "$R/ctl/stdout" 2>/dev/null &
    TAILS=($!)
    tail -s 0.2 --pid="$QPID" -n +1 -F "$R/ctl/stderr" >&2 2>/dev/null &
    TAILS+=($!)
    if ((VERBOSE)); then
        tail -s 0.2 --pid="$QPID" -n +1 -F "$R/console.log" >&2 2>/dev/null &
        TAILS+=($!)
    fi
    started='' timed_out=0 watchdog=0
    while kill -0 "$QPID" 2>/dev/null; do
        t=$(now)
        if [[ -z $started ]]; then
            if [[ -e $R/ctl/started ]]; then
                started=$t
            elif awk -v a="$t0" -v b="$t" -v l="$BOOT_TIMEOUT" 'BEGIN { exit !(b - a > l) }'; then
                watchdog=1
                kill -9 "$QPID" 2>/dev/null || true
                break
            fi
        elif ((TIMEOUT > 0)) && awk -v a="$started" -v b="$t" -v l="$TIMEOUT" 'BEGIN { exit !(b - a > l) }'; then
            timed_out=1
            kill -9 "$QPID" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
    qrc=0
    { wait "$QPID"; } 2>/dev/null || qrc=$?
    QPID=
    wait "${TAILS[@]}" 2>/dev/null || true
    t1=$(now)
    [[ -z $started && -e $R/ctl/started ]] && started=$t1
    if [[ -n $started ]]; then break; fi
    if ((watchdog)); then
        vm_log "boot watchdog: no command started within ${BOOT_TIMEOUT}s (attempt $attempt)"
    else
        vm_log "the guest stopped before starting the command (attempt $attempt, qemu exit $qrc)"
        [[ -s $R/qemu.log ]] && sed 's/^/qemu: /' "$R/qemu.log" >&2
    fi
    # A QEMU that refuses its command line will not do better a second time.
    if ((!watchdog)) && [[ ! -s $R/console.log ]]; then break; fi
    if ((attempt == 1)); then vm_log "retrying the boot once"; fi
done
save_console

if [[ -z $started ]]; then
    console_tail
    vm_log "the guest never ran the command"
    exit 125
fi
if ((TIMING)); then
    boot=$(elapsed "$t0" "$started")
    vm_log "kernel $KVER fdp=$FDP: boot ${boot}s (guest uptime $(cat "$R/ctl/started")s), command $(elapsed "$started" "$t1")s, total $(elapsed "$t0" "$t1")s"
fi
if ((timed_out)); then
    vm_log "timeout: the command ran longer than ${TIMEOUT}s; guest killed"
    exit 124
fi
if [[ ! -s $R/ctl/rc ]]; then
    console_tail 60
    vm_log "the guest stopped before the command finished (kernel panic or crash?)"
    exit 125
fi
exit "$(cat "$R/ctl/rc")"
