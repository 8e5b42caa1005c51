#!/usr/bin/env bash
# Set up the fdpblk VM harness on a Debian host (idempotent).
#
#   tests/vm/setup.sh [--refresh] [--no-packages] [--no-kernels] [--peer]
#
# 1. Host packages: QEMU >= 8.0 with FDP emulation (from <codename>-backports on
#    bookworm; the backports source is written from the mirror URI found in the
#    host's own apt configuration), busybox-static, nvme-cli, fio, blktrace, cpio, kmod,
#    zstd, xz-utils, gcc, g++ (libFuzzer, for `cargo fuzz`), libc6-dev, libclang-dev.
# 2. Guest kernels, downloaded with a private apt configuration and unpacked into
#    the cache (never installed):
#      new  newest generic amd64 kernel in trixie-backports (must be >= 6.16)
#      old  newest generic amd64 kernel < 6.16 in bookworm-backports (6.12 era)
# 3. The initramfs for each kernel and tools/wstream.c -> $CACHE/bin/wstream.
#    fio with FDP placement (>= 3.38; bookworm's 3.33 has none) -> $CACHE/bin/fio-fdp:
#    trixie's fio and the libraries it links, unpacked into $CACHE/fio-fdp and run through
#    their own dynamic loader (tools/waf-compare's static-placement baseline).
# 4. With --peer: rublk (the benchmark peer of tools/bench/ublk-bench.sh) into $CACHE/rublk.
#
# Cache: $FDPBLK_VM_CACHE (default /var/cache/fdpblk-vm). Once the cache is
# complete, a rerun does no network access at all; --refresh re-resolves the
# newest kernels (downloading only what changed).
set -euo pipefail

VM_LOG_PREFIX=setup
# shellcheck source=lib/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

REFRESH=0 PACKAGES=1 KERNELS=1 PEER=0
while (($#)); do
    case $1 in
        --refresh) REFRESH=1 ;;
        --no-packages) PACKAGES=0 ;;
        --no-kernels) KERNELS=0 ;;
        --peer) PEER=1 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) vm_die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || vm_die "run as root (or install sudo): apt-get and $VM_CACHE need it"
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

# shellcheck source=/dev/null
. /etc/os-release
CODENAME=${VERSION_CODENAME:-}
[[ ${ID:-} == debian && -n $CODENAME ]] || vm_die "this set-up expects a Debian host (found ${PRETTY_NAME:-unknown})"

# Print the Debian archive URI that the host's apt configuration uses for the
# suite $CODENAME (deb822 .sources first, then one-line .list files).
debian_mirror_uri() {
    local f uri
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        uri=$(awk -v suite="$CODENAME" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uris != "" && !found) {
                    split(uris, u, " "); print u[1]; found = 1
                }
                types = suites = uris = ""; enabled = 1
            }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]*#/ { next }
            tolower($1) == "types:" { $1 = ""; types = $0 }
            tolower($1) == "uris:" { $1 = ""; uris = $0; sub(/^ +/, "", uris) }
            tolower($1) == "suites:" { $1 = ""; suites = $0 }
            END { flush() }' "$f")
        if [[ -n $uri ]]; then
            printf '%s\n' "${uri%/}"
            return 0
        fi
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        uri=$(awk -v suite="$CODENAME" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }' "$f")
        if [[ -n $uri ]]; then
            printf '%s\n' "${uri%/}"
            return 0
        fi
    done
    return 1
}

MIRROR=
mirror() {
    if [[ -z $MIRROR ]]; then
        MIRROR=$(debian_mirror_uri) ||
            vm_die "no Debian mirror for '$CODENAME' in /etc/apt/sources.list{,.d}; add the host's Debian archive source first"
    fi
    printf '%s\n' "$MIRROR"
}

# apt_quiet CMD...: run an apt/dpkg command with its chatter in a log, shown on failure.
# A fresh machine may be running its daily apt jobs at boot: wait for their lock, not fail.
# A download that fails on the way (a mirror's hiccup) is tried again, not the end of CI.
LOCK_WAIT=(-o DPkg::Lock::Timeout=600 -o Acquire::Retries=3)

apt_quiet() {
    local log rc=0
    log=$(mktemp)
    "$@" >"$log" 2>&1 || rc=$?
    if ((rc)); then
        tail -n 40 "$log" >&2
    fi
    rm -f "$log"
    return "$rc"
}

pkg_installed() {
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

APT_UPDATED=0
apt_update_once() {
    if ((!APT_UPDATED)); then
        vm_log "apt-get update"
        # The lists' lock (held by apt-daily at boot) is not one DPkg::Lock::Timeout waits for.
        local out tries=0
        until out=$("${SUDO[@]}" apt-get "${LOCK_WAIT[@]}" update 2>&1); do
            if grep -q "Could not get lock" <<<"$out" && ((++tries < 60)); then
                vm_log "apt-get update: apt's lock is held (daily apt jobs?); trying again in 10 s"
                sleep 10
                continue
            fi
            tail -n 40 <<<"$out" >&2
            vm_die "apt-get update failed (network or apt configuration problem)"
        done
        APT_UPDATED=1
    fi
}

qemu_version_ok() {
    local v
    v=$(qemu-system-x86_64 --version 2>/dev/null | sed -n '1s/.*version \([0-9][0-9.]*\).*/\1/p')
    [[ -n $v ]] && dpkg --compare-versions "$v" ge 8.0
}

install_packages() {
    local base=(busybox-static nvme-cli fio blktrace cpio kmod zstd xz-utils gcc g++ libc6-dev libclang-dev
        binutils debian-archive-keyring util-linux udev jq python3 procps systemd)
    local qemu=(qemu-system-x86 qemu-system-data qemu-utils)
    local missing=() p
    for p in "${base[@]}"; do pkg_installed "$p" || missing+=("$p"); done
    if ((${#missing[@]})); then
        apt_update_once
        vm_log "installing ${missing[*]}"
        apt_quiet "${SUDO[@]}" apt-get "${LOCK_WAIT[@]}" install -y --no-install-recommends "${missing[@]}" ||
            vm_die "apt-get install ${missing[*]} failed"
    fi

    local need_qemu=0
    for p in "${qemu[@]}"; do pkg_installed "$p" || need_qemu=1; done
    if ((!need_qemu)) && qemu_version_ok && vm_qemu_ok; then
        return 0
    fi
    local target=()
    if [[ $CODENAME == bookworm ]]; then
        # bookworm's QEMU 7.2 has no FDP emulation: take QEMU from bookworm-backports.
        local bp="$CODENAME-backports"
        if ! grep -qsE "(^|[[:space:]])$bp([[:space:]]|$)" /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
            /etc/apt/sources.list.d/*.sources; then
            local src=/etc/apt/sources.list.d/fdpblk-$bp.sources m
            m=$(mirror)
            vm_log "enabling $bp in $src"
            printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
                "$m" "$bp" "$KEYRING" | "${SUDO[@]}" tee "$src" >/dev/null
            APT_UPDATED=0
        fi
        apt_update_once
        target=(-t "$bp")
    else
        apt_update_once
    fi
    vm_log "installing ${qemu[*]} ${target[*]}"
    apt_quiet "${SUDO[@]}" apt-get "${LOCK_WAIT[@]}" install -y --no-install-recommends "${target[@]}" "${qemu[@]}" ||
        vm_die "apt-get install ${qemu[*]} failed"
    qemu_version_ok || vm_die "QEMU >= 8.0 is needed for FDP emulation; got: $(qemu-system-x86_64 --version | head -n1)"
    vm_qemu_ok || vm_die "qemu-system-x86_64 lacks the nvme-subsys fdp.* options (QEMU >= 8.0 needed)"
}

# ---- guest kernels -----------------------------------------------------------

ALT=()
alt_apt() { # alt_apt SUITE: set ALT to a private apt configuration for SUITE
    local suite=$1 a="$VM_CACHE/apt/$1" m
    m=$(mirror)
    mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$a/etc/preferences.d"
    printf 'deb [signed-by=%s] %s %s main\n' "$KEYRING" "$m" "$suite" >"$a/etc/sources.list"
    ALT=(-o "Dir::Etc::SourceList=$a/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a/cache" -o Dir::State::status=/dev/null
        -o Dir::Etc::Preferences=/dev/null -o "Dir::Etc::PreferencesParts=$a/etc/preferences.d"
        -o Debug::NoLocking=1 -o Acquire::Retries=3)
    # Downloads land in the root-owned cache: no point sandboxing them as _apt.
    [[ $(id -u) -ne 0 ]] || ALT+=(-o APT::Sandbox::User=root)
}

# pick_kernel OP LIMIT: print the newest generic amd64 kernel release in the
# private lists whose upstream version satisfies "OP LIMIT" (dpkg operators),
# together with the packages to download: "KVER PKG...".
pick_kernel() {
    local op=$1 limit=$2 avail name kver up pkgs dep ok
    avail=$(apt-cache "${ALT[@]}" dumpavail) || return 1
    while read -r name _; do
        kver=${name#linux-image-}
        up=${kver%%+*}
        up=${up%%-*}
        dpkg --compare-versions "$up" "$op" "$limit" || continue
        pkgs=("$name")
        ok=1
        # Debian >= 13 splits the kernel into linux-{binary,modules,base}-KVER.
        for dep in $(apt-cache "${ALT[@]}" show --no-all-versions "$name" 2>/dev/null |
            sed -n 's/^Depends: //p' | tr ',|' '\n\n' | awk '{print $1}' |
            grep -E "^linux-(binary|modules|base)-$(printf '%s' "$kver" | sed 's/[.+]/\\&/g')\$"); do
            if grep -qx "Package: $dep" <<<"$avail"; then pkgs+=("$dep"); else ok=0; fi
        done
        if ((ok)); then
            echo "$kver ${pkgs[*]}"
            return 0
        fi
    done < <(awk '/^Package: /{p=$2} /^Version: /{if (p != "") print p, $2; p=""}' <<<"$avail" |
        grep -E '^linux-image-[0-9]+\.[0-9]+[^ ]*\+[^ -]+-amd64 ' | sort -k2,2Vr -k1,1Vr)
    return 1
}

# extract_vmlinux VMLINUZ OUT: decompress the kernel ELF out of a bzImage.
extract_vmlinux() {
    local in=$1 out=$2 magic tool off
    for magic in 'zstd:\x28\xb5\x2f\xfd' 'xz:\xfd7zXZ\x00' 'gzip:\x1f\x8b\x08'; do
        tool=${magic%%:*}
        for off in $(LC_ALL=C grep -obUaP "${magic#*:}" "$in" | cut -d: -f1); do
            tail -c "+$((off + 1))" "$in" | "$tool" -dc >"$out" 2>/dev/null || true
            if readelf -h "$out" >/dev/null 2>&1; then
                return 0
            fi
        done
    done
    rm -f "$out"
    return 1
}

prepare_kernel() { # prepare_kernel FLAVOR SUITE OP LIMIT
    local flavor=$1 suite=$2 op=$3 limit=$4 kver pick pkgs p deb kd tmp md vmlinuz
    if ((!REFRESH)) && kver=$(vm_kernel_release "$flavor") && vm_kernel_ready "$kver"; then
        vm_log "kernel $flavor: $kver (cached)"
        return 0
    fi
    alt_apt "$suite"
    vm_log "kernel $flavor: resolving the newest kernel in $suite"
    apt_quiet apt-get "${ALT[@]}" update || vm_die "apt-get update for $suite failed (network, or the keyring lacks $suite's key: install debian-archive-keyring)"
    pick=$(pick_kernel "$op" "$limit") ||
        vm_die "no generic amd64 kernel with version $op $limit found in $suite"
    kver=${pick%% *}
    read -r -a pkgs <<<"${pick#* }"
    kd=$(vm_kernel_dir "$kver")
    if ! vm_kernel_ready "$kver"; then
        mkdir -p "$VM_CACHE/debs"
        for p in "${pkgs[@]}"; do
            if ! compgen -G "$VM_CACHE/debs/${p}_*.deb" >/dev/null; then
                vm_log "downloading $p"
                (cd "$VM_CACHE/debs" && apt_quiet apt-get "${ALT[@]}" download "$p") || vm_die "apt-get download $p failed"
            fi
        done
        tmp="$kd.tmp"
        rm -rf "$tmp" "$kd"
        mkdir -p "$tmp/root"
        for p in "${pkgs[@]}"; do
            for deb in "$VM_CACHE/debs/${p}"_*.deb; do
                vm_log "unpacking ${deb##*/}"
                dpkg-deb -x "$deb" "$tmp/root"
            done
        done
        if [[ -d $tmp/root/usr/lib/modules && ! -e $tmp/root/lib/modules ]]; then
            mkdir -p "$tmp/root/lib"
            ln -s ../usr/lib/modules "$tmp/root/lib/modules"
        fi
        [[ -s $tmp/root/lib/modules/$kver/modules.builtin ]] || vm_die "$kver: modules.builtin missing from the unpacked packages"
        depmod -b "$tmp/root" "$kver" || vm_die "depmod for $kver failed (install kmod)"
        md="$tmp/root/lib/modules/$kver"
        vmlinuz=
        for p in "$tmp/root/boot/vmlinuz-$kver" "$md/vmlinuz"; do
            if [[ -f $p ]]; then vmlinuz=$p; break; fi
        done
        [[ -n $vmlinuz ]] || vm_die "$kver: no vmlinuz in the unpacked packages"
        ln -s "root/${vmlinuz#"$tmp"/root/}" "$tmp/vmlinuz"
        # A PVH-capable ELF boots about 4 s faster than the bzImage under TCG.
        if extract_vmlinux "$vmlinuz" "$tmp/vmlinux"; then
            if ! grep -Eq 'Xen.*(0x00000012|PHYS32)' <<<"$(readelf -n "$tmp/vmlinux" 2>/dev/null)"; then
                vm_log "$kver: vmlinux has no PVH entry; run.sh will boot the bzImage"
                rm -f "$tmp/vmlinux"
            fi
        else
            vm_log "$kver: could not extract vmlinux; run.sh will boot the bzImage"
        fi
        touch "$tmp/.complete"
        mv "$tmp" "$kd"
    fi
    echo "$kver" >"$VM_CACHE/kernels/$flavor"
    vm_log "kernel $flavor: $kver"
}

if [[ ! -d $VM_CACHE || ! -w $VM_CACHE ]]; then
    "${SUDO[@]}" mkdir -p "$VM_CACHE/kernels"
    [[ -w $VM_CACHE ]] || "${SUDO[@]}" chown "$(id -u):$(id -g)" "$VM_CACHE"
fi
mkdir -p "$VM_CACHE/kernels"

((PACKAGES)) && install_packages
for p in busybox cpio depmod zstd xz gcc readelf qemu-system-x86_64 nvme fio blktrace blkparse; do
    command -v "$p" >/dev/null || vm_die "'$p' not found; run tests/vm/setup.sh without --no-packages"
done

if ((KERNELS)); then
    prepare_kernel new trixie-backports ge 6.16
    prepare_kernel old bookworm-backports lt 6.16
    for f in new old; do
        k=$(vm_kernel_release "$f")
        vm_log "initramfs $f: $(vm_initramfs "$k")"
    done
fi
vm_log "wstream: $(vm_build_wstream)"

# fio >= 3.38 (FDP with dp_scheme) for tools/waf-compare: trixie's fio binary with the
# libraries it needs, unpacked (never installed) and started through trixie's own loader, so
# the host's libc is not touched. Downloaded once; the cache keeps it.
prepare_fio_fdp() {
    local root="$VM_CACHE/fio-fdp" out="$VM_CACHE/bin/fio-fdp" pkgs tmp d
    if [[ -x $out ]] && "$out" --cmdhelp=dp_scheme >/dev/null 2>&1; then
        return 0
    fi
    alt_apt trixie
    apt_quiet apt-get "${ALT[@]}" update || vm_die "apt-get update (trixie, for fio) failed"
    # fio and its library closure (an empty dpkg status: everything it would pull in), less
    # the interpreters and tools fio does not link.
    pkgs=$(apt-get "${ALT[@]}" install --print-uris -y --no-install-recommends fio 2>/dev/null |
        sed -n "s/^'[^']*' \([^_]*\)_.*/\1/p" | grep -E '^(fio|lib|gcc-[0-9]+-base|zlib1g)' | grep -v '^libpython') ||
        vm_die "cannot resolve trixie's fio and its libraries"
    tmp=$(mktemp -d "$VM_CACHE/fio-fdp.XXXXXX")
    # shellcheck disable=SC2086 # a list of package names
    (cd "$tmp" && apt_quiet apt-get "${ALT[@]}" download $pkgs) || { rm -rf "$tmp"; vm_die "downloading fio's packages failed"; }
    mkdir "$tmp/root"
    for d in "$tmp"/*.deb; do dpkg-deb -x "$d" "$tmp/root"; done
    rm -rf "$root" && mv "$tmp/root" "$root" && rm -rf "$tmp"
    mkdir -p "$VM_CACHE/bin"
    local lib="$root/usr/lib/x86_64-linux-gnu"
    printf '#!/bin/sh\n# fio from trixie with its own libraries (tests/vm/setup.sh)\nexec %s --library-path %s:%s %s "$@"\n' \
        "$lib/ld-linux-x86-64.so.2" "$lib" "$lib/ceph" "$root/usr/bin/fio" >"$out"
    chmod +x "$out"
    "$out" --cmdhelp=dp_scheme >/dev/null 2>&1 || vm_die "$out does not run or has no dp_scheme option"
}
((KERNELS)) && prepare_fio_fdp
[[ -x $VM_CACHE/bin/fio-fdp ]] && vm_log "fio with FDP: $VM_CACHE/bin/fio-fdp ($("$VM_CACHE/bin/fio-fdp" --version))"
# The benchmark peer (tools/bench/ublk-bench.sh): rublk's loop target, from the crates
# registry, built once into the cache. Only with --peer: the tests do not need it.
if ((PEER)) && [[ ! -x $VM_CACHE/rublk/bin/rublk ]]; then
    command -v cargo >/dev/null || vm_die "--peer needs cargo to build rublk"
    vm_log "building rublk (benchmark peer) into $VM_CACHE/rublk"
    cargo install --locked --quiet rublk --root "$VM_CACHE/rublk"
fi
((PEER)) && vm_log "rublk: $VM_CACHE/rublk/bin/rublk"
vm_log "ready (cache: $VM_CACHE)"
