# shellcheck shell=bash
# Shared helpers for the fdpblk VM harness (sourced by setup.sh, run.sh, suite.sh).
#
# Cache layout ($FDPBLK_VM_CACHE, default /var/cache/fdpblk-vm):
#   apt/<suite>/          private apt state used only to download guest kernels
#   debs/                 downloaded kernel .debs (kept, so versions that leave the
#                         archive stay usable)
#   kernels/<flavor>      text file: the kernel release used for flavor new|old
#   kernels/<kver>/       root/ (unpacked .debs), vmlinux (for PVH boot), vmlinuz
#   initramfs/            <kver>-<hash>.cpio.gz, rebuilt when lib/init.sh changes
#   bin/wstream           tools/wstream.c built with the host gcc

VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VM_CACHE=${FDPBLK_VM_CACHE:-/var/cache/fdpblk-vm}

# The guest kernel modules the initramfs loads (dependencies are added from
# modules.dep; modules built into the kernel are skipped).
VM_MODULES="virtio_pci 9pnet_virtio 9p overlay nvme ublk_drv"

vm_log() { printf '%s\n' "${VM_LOG_PREFIX:-fdpblk-vm}: $*" >&2; }
vm_die() { printf '%s\n' "${VM_LOG_PREFIX:-fdpblk-vm}: error: $*" >&2; exit "${VM_DIE_RC:-1}"; }

# vm_kernel_release FLAVOR -> prints the kernel release set up for new|old.
vm_kernel_release() {
    local f="$VM_CACHE/kernels/$1"
    [[ -s $f ]] || return 1
    head -n1 "$f"
}

# vm_kernel_dir KVER -> the unpacked kernel's directory in the cache.
vm_kernel_dir() { printf '%s\n' "$VM_CACHE/kernels/$1"; }

# vm_moddir KVER -> the directory holding modules.dep for KVER.
vm_moddir() {
    local root
    root="$(vm_kernel_dir "$1")/root"
    if [[ -d $root/usr/lib/modules/$1 ]]; then
        printf '%s\n' "$root/usr/lib/modules/$1"
    else
        printf '%s\n' "$root/lib/modules/$1"
    fi
}

# vm_kernel_ready KVER: the kernel is unpacked, depmod'ed and bootable.
vm_kernel_ready() {
    local kd md
    kd=$(vm_kernel_dir "$1")
    md=$(vm_moddir "$1")
    [[ -f $kd/.complete && -s $md/modules.dep && -s $md/modules.builtin && -e $kd/vmlinuz ]]
}

# vm_resolve_modules MODDIR NAME... -> prints module paths (relative to MODDIR),
# dependencies first, each once. Built-in modules print nothing. Unknown -> error.
vm_resolve_modules() {
    local moddir=$1
    shift
    awk -v want="$*" '
        function norm(p,   b) { b = p; sub(/.*\//, "", b); sub(/\.ko(\.(xz|zst|gz))?$/, "", b); gsub(/-/, "_", b); return b }
        function visit(m,   i, n, d) {
            if (m in done) return
            done[m] = 1
            n = split(deps[m], d, " ")
            for (i = n; i >= 1; i--) visit(norm(d[i]))
            print path[m]
        }
        FILENAME ~ /modules\.builtin$/ { builtin[norm($1)] = 1; next }
        {
            p = $1; sub(/:$/, "", p)
            m = norm(p); path[m] = p
            $1 = ""; deps[m] = $0
        }
        END {
            n = split(want, w, " ")
            for (i = 1; i <= n; i++) {
                m = w[i]; gsub(/-/, "_", m)
                if (m in path) visit(m)
                else if (!(m in builtin)) { print "module not found: " w[i] > "/dev/stderr"; bad = 1 }
            }
            exit bad
        }' "$moddir/modules.builtin" "$moddir/modules.dep"
}

# vm_initramfs KVER -> path of the initramfs for KVER, built if missing or stale.
vm_initramfs() {
    local kver=$1 md hash out tmp busybox m base
    md=$(vm_moddir "$kver")
    busybox=$(command -v busybox || true)
    [[ -n $busybox ]] || vm_die "busybox not found; run tests/vm/setup.sh (installs busybox-static)"
    # Static busybox only: the initramfs has no libc.
    if ! LC_ALL=C file_is_static "$busybox"; then
        vm_die "$busybox is not statically linked; run tests/vm/setup.sh (installs busybox-static)"
    fi
    hash=$( { cat "$VM_DIR/lib/init.sh"; echo "$VM_MODULES"; cksum <"$busybox"; } | cksum | cut -d' ' -f1)
    out="$VM_CACHE/initramfs/$kver-$hash.cpio.gz"
    if [[ -s $out ]]; then
        printf '%s\n' "$out"
        return 0
    fi
    mkdir -p "$VM_CACHE/initramfs"
    tmp=$(mktemp -d "$VM_CACHE/initramfs/.build.XXXXXX")
    (
        set -euo pipefail
        trap 'rm -rf "$tmp"' EXIT
        cd "$tmp"
        mkdir -p root/bin root/dev root/proc root/sys root/modules root/host root/ctl root/newroot root/rw
        cp "$busybox" root/bin/busybox
        for a in $(root/bin/busybox --list); do
            [[ $a == busybox ]] || ln -s busybox "root/bin/$a"
        done
        : >root/modules.order
        # shellcheck disable=SC2086 # a list of module names
        vm_resolve_modules "$md" $VM_MODULES >mods.txt
        while read -r m; do
            base=${m##*/}
            base=${base%.xz}; base=${base%.zst}; base=${base%.gz}
            case $m in
                *.xz) xz -dc "$md/$m" >"root/modules/$base" ;;
                *.zst) zstd -q -dc "$md/$m" >"root/modules/$base" ;;
                *.gz) gzip -dc "$md/$m" >"root/modules/$base" ;;
                *) cp "$md/$m" "root/modules/$base" ;;
            esac
            echo "$base" >>root/modules.order
        done <mods.txt
        cp "$VM_DIR/lib/init.sh" root/init
        chmod 755 root/init
        (cd root && find . -print0 | LC_ALL=C sort -z | cpio --quiet -o -0 -H newc -R 0:0) | gzip -1 >initrd.cpio.gz
        mv initrd.cpio.gz "$out"
        # Drop stale images of this kernel.
        for old in "$VM_CACHE/initramfs/$kver"-*.cpio.gz; do
            [[ $old == "$out" ]] || rm -f "$old"
        done
    ) || vm_die "building the initramfs for $kver failed"
    printf '%s\n' "$out"
}

file_is_static() {
    # An ELF without a PT_INTERP program header is static.
    # grep on the whole output, not a pipe: `grep -q` exits at its match, and under
    # pipefail the writer's SIGPIPE would fail the test.
    ! grep -q 'Requesting program interpreter' <<<"$(readelf -l "$1" 2>/dev/null)" && readelf -h "$1" >/dev/null 2>&1
}

# vm_qemu_ok: QEMU is installed and emulates FDP.
vm_qemu_ok() {
    command -v qemu-system-x86_64 >/dev/null 2>&1 || return 1
    # Whole outputs, not pipes (see file_is_static).
    grep -q 'fdp.runs' <<<"$(qemu-system-x86_64 -device nvme-subsys,help 2>/dev/null)" || return 1
    grep -q 'fdp.ruhs' <<<"$(qemu-system-x86_64 -device nvme-ns,help 2>/dev/null)" || return 1
}

# vm_build_wstream -> path of bin/wstream, rebuilt when tools/wstream.c is newer.
vm_build_wstream() {
    local src="$VM_DIR/tools/wstream.c" out="$VM_CACHE/bin/wstream"
    if [[ ! -x $out || $src -nt $out ]]; then
        command -v gcc >/dev/null || vm_die "gcc not found; run tests/vm/setup.sh"
        mkdir -p "$VM_CACHE/bin"
        gcc -O2 -Wall -Wextra -Werror -static -o "$out.tmp" "$src" \
            || vm_die "building $src failed (needs gcc and libc6-dev; run tests/vm/setup.sh)"
        mv "$out.tmp" "$out"
    fi
    printf '%s\n' "$out"
}
