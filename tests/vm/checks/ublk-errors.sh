#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-boot: lifecycle
# Bad input to `fdpblk add/del/recover` is a one-line error naming the fix, a non-zero exit
# status, and creates nothing; so is a backing holding someone else's data.
. "$(dirname "$0")/../lib/check-lib.sh"
. "$(dirname "$0")/../lib/fdpblk-lib.sh"
FIXTURES=$(cd "$(dirname "$0")/../../.." && pwd)/../shared/fixtures/lmcache-0.5.6
GEO=(--slot-bytes 64K --meta-total-bytes 1M)

# refuse DESC PATTERN ARGS...: fdpblk ARGS fails with one line matching PATTERN, no device left.
refuse() {
    local desc=$1 pat=$2 out rc
    shift 2
    out=$("$FDPBLK" "$@" 2>&1) && rc=0 || rc=$?
    if ((rc == 0)); then not_ok "$desc: exit status 0"; return; fi
    if [[ $(wc -l <<<"$out") -ne 1 ]]; then not_ok "$desc: not one line: $out"; return; fi
    if ! grep -qE -- "$pat" <<<"$out"; then not_ok "$desc: '$out' lacks /$pat/"; return; fi
    if compgen -G "/dev/ublkb*" >/dev/null && ! [[ -e /dev/ublkb0 && ${KEEP0:-0} == 1 ]]; then
        not_ok "$desc: a ublk device was left behind: $(ls /dev/ublkb*)"; return
    fi
    ok "$desc: $out"
}

refuse "missing backing" "backing /dev/nope: .*pass an NVMe namespace" add --backing /dev/nope "${GEO[@]}"
truncate -s 4M /var/tmp/small.img
refuse "too small" "too small: fdpblk reserves" add --backing /var/tmp/small.img --engine plain --policy none "${GEO[@]}"
refuse "bad geometry" "slot_bytes 1000 .*--slot-bytes" add --backing "$NS_DEV" --slot-bytes 1000 --meta-total-bytes 1M
expect "a blank drive" dd if=/dev/zero of="$NS_DEV" bs=1M count=2 oflag=direct status=none
refuse "half a layout on a blank drive" "--slot-bytes is given but --meta-total-bytes is not, and $NS_DEV has no LMCache checkpoint" add --backing "$NS_DEV" --slot-bytes 64K
refuse "unknown policy" "unknown --policy" add --backing "$NS_DEV" --policy nope "${GEO[@]}"
refuse "unknown engine" "unknown --engine" add --backing "$NS_DEV" --engine nope "${GEO[@]}"
refuse "a directory" "neither a block device nor a file" add --backing /var/tmp "${GEO[@]}"
refuse "negative device id" "-n -5: give a device id" add --backing "$NS_DEV" -n -5 "${GEO[@]}"
refuse "header wait of minutes" "--header-wait-us 100000000: at most" add --backing "$NS_DEV" --header-wait-us 100000000 "${GEO[@]}"
refuse "own state written every millisecond" "--persist-interval-ms 1: 0 .only when the device starts and stops. or at least 50" add --backing "$NS_DEV" --persist-interval-ms 1 "${GEO[@]}"
refuse "I/O buffers past half the memory" "need [0-9.]+ GiB of I/O buffers .*more than half of this machine's .*lower --depth or --io-buf-size" add --backing "$NS_DEV" --engine plain --policy none -q 32 -d 4096 --io-buf-size 32M "${GEO[@]}"
refuse "streams on a file" "needs an NVMe block device" add --backing /var/tmp/small.img --engine streams "${GEO[@]}"
refuse "plain on the char device names its block device" "--engine plain needs a block device, and $NG_DEV is a char device: use $NS_DEV as --backing" add --backing "$NG_DEV" --engine plain --policy none "${GEO[@]}"
# From a config file: the error also names the key in the file behind the flag.
printf 'backing = "%s"\npolicy = "nope"\n' "$NS_DEV" >/var/tmp/bad-policy.toml
refuse "policy from a config file" "unknown --policy nope; .* \\(from .policy. in /var/tmp/bad-policy.toml\\)$" add --config /var/tmp/bad-policy.toml "${GEO[@]}"
printf 'backing = "%s"\nqueues = 0\n' "$NS_DEV" >/var/tmp/bad-queues.toml
refuse "queues from up's config file" "^fdpblk: /var/tmp/bad-queues.toml: .queues. must be a whole number from 1 to 32, e.g. queues = 1$" up bad --config /var/tmp/bad-queues.toml
printf 'backing = "%s"\npersist_interval_ms = 10\n' "$NS_DEV" >/var/tmp/bad-interval.toml
refuse "a value add refuses, from up's config file" "^fdpblk: --persist-interval-ms 10: .* \\(from .persist_interval_ms. in /var/tmp/bad-interval.toml\\)$" up bad --config /var/tmp/bad-interval.toml
refuse "del unknown id" "no ublk device 7" del -n 7
refuse "recover unknown id" "no fdpblk device 7" recover -n 7
refuse "stats unknown id" "no stats for device 7" stats -n 7

# Someone else's data (here a swap signature) and neither LMCache's checkpoint nor fdpblk's
# state: a typo in --backing. Refused, naming blkid, wipefs and --force, through the block and
# the char device; --force adds it, and once fdpblk's state is there no --force is needed,
# unless other data came since.
expect "blank tail" blkdiscard -z -o $(( $(blockdev --getsize64 "$NS_DEV") - (16 << 20) )) "$NS_DEV"
expect "a swap signature on the drive" quiet mkswap "$NS_DEV"
refuse "someone else's data" "holds a swap \(other\) signature \(blkid -p $NS_DEV\).*wipefs -a $NS_DEV\) or add it with --force" add --backing "$NS_DEV" "${GEO[@]}"
refuse "someone else's data, under --layout lmcache" "holds a swap" add --backing "$NS_DEV" --layout lmcache "${GEO[@]}"
refuse "someone else's data, by its char device" "backing $NG_DEV holds a swap .*blkid -p $NS_DEV" add --backing "$NG_DEV" --engine passthrough "${GEO[@]}"
expect "--force adds it" quiet fdpblk_add --backing "$NS_DEV" -n 0 --force "${GEO[@]}"
expect "and erased the signature (wipefs -a), so later starts do not stop at it" bash -c "blkid -p '$NS_DEV'; test \$? -eq 2"
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
# Through a link to the namespace (what /dev/disk/by-id/ holds; kernel names can change at
# reboot): the link is followed, and the device's backing is the namespace.
ln -sfn "$NS_DEV" /var/tmp/ns-link
expect "fdpblk's state is there: no --force needed (added through a link)" quiet fdpblk_add --backing /var/tmp/ns-link -n 0 "${GEO[@]}"
expect_eq "the link's namespace is the backing" "$("$FDPBLK" list --json | jq -r '.[0].backing')" "$NS_DEV"
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
# Given other data since (fdpblk's state stays at the end): that data is still refused.
expect "a swap signature over the device fdpblk used" quiet mkswap "$NS_DEV"
refuse "someone else's data over fdpblk's old state" "holds a swap .*no LMCache checkpoint \(only fdpblk's state from an earlier use\)" add --backing "$NS_DEV" "${GEO[@]}"
expect "wipefs" quiet wipefs -a "$NS_DEV"
# mkswap over an LMCache drive: copy 0's header (the first block) is gone, copy 1 still holds
# and does not vouch for the device.
expect "LMCache image on the drive, then mkswap over it" bash -c "dd if='$FIXTURES/object-evict/device.img' of='$NS_DEV' bs=1M oflag=direct status=none && mkswap '$NS_DEV' >/dev/null"
refuse "someone else's data over copy 1 of LMCache's checkpoint" "holds a swap .*only copy 1 of an LMCache checkpoint" add --backing "$NS_DEV" -n 0
expect "wipefs" quiet wipefs -a "$NS_DEV"

# A partition: FDP placement needs the whole namespace (write streams are the disk's).
mbr_with_one_partition() {
    # One Linux partition (type 0x83) at sector 2048, 262144 sectors long (little-endian).
    { head -c 446 /dev/zero; printf '\x00\x00\x00\x00\x83\x00\x00\x00\x00\x08\x00\x00\x00\x00\x04\x00'
        head -c 48 /dev/zero; printf '\x55\xaa'; } |
        dd of="$NS_DEV" bs=512 count=1 iflag=fullblock conv=notrunc,fsync status=none || return 1
    blockdev --rereadpt "$NS_DEV" && for _ in $(seq 50); do [[ -b ${NS_DEV}p1 ]] && return; sleep 0.1; done; return 1
}
expect "a partition table with one partition" mbr_with_one_partition
refuse "placement on a partition" "${NS_DEV}p1 is a partition of $NS_DEV, and FDP placement .* whole namespace only: .*--policy none, or --engine plain" add --backing "${NS_DEV}p1" "${GEO[@]}"
refuse "write streams on a partition" "${NS_DEV}p1 is a partition of $NS_DEV" add --backing "${NS_DEV}p1" --engine streams "${GEO[@]}"
refuse "the disk under it holds a partition table" "holds a dos partition table" add --backing "$NS_DEV" "${GEO[@]}"
expect "wipefs and drop the partition" bash -c "wipefs -a '$NS_DEV' >/dev/null && blockdev --rereadpt '$NS_DEV' && for i in \$(seq 50); do [[ -e ${NS_DEV}p1 ]] || exit 0; sleep 0.1; done; exit 1"

# A checkpoint LMCache wrote says slot_bytes 65536: a different flag is a conflict.
expect "LMCache image on the drive" dd if="$FIXTURES/object-evict/device.img" of="$NS_DEV" bs=1M oflag=direct status=none
refuse "conflicting geometry" "--slot-bytes 131072 conflicts with the checkpoint .*slot_bytes 65536" add --backing "$NS_DEV" --slot-bytes 128K
# Another program's exclusive open (a mount, device mapper): the daemon's own exclusive open,
# or its claim of the namespace behind the char device, is refused; it waits a few seconds
# for a holder that lets go (a daemon `del` has just stopped) before it says so.
python3 -c 'import os, sys, time; os.open(sys.argv[1], os.O_RDONLY | os.O_EXCL); print("held", flush=True); time.sleep(120)' "$NS_DEV" >/var/tmp/excl.out &
excl=$!
# Never left holding the namespace for the checks after this one, whatever stops this one.
trap 'kill "$excl" 2>/dev/null || true' EXIT
expect "another program opens the namespace exclusively" bash -c 'for i in $(seq 600); do grep -q held /var/tmp/excl.out && exit 0; sleep 0.1; done; exit 1'
refuse "backing in use" "backing $NS_DEV is in use \(mounted, or claimed by another fdpblk or device mapper" add --backing "$NS_DEV" -n 1
refuse "passthrough on a namespace in use" "$NG_DEV is in use: its namespace $NS_DEV is mounted, or claimed" add --backing "$NG_DEV" -n 1 --engine passthrough
kill "$excl" 2>/dev/null || true
wait "$excl" 2>/dev/null || true
expect "the checkpoint's own geometry is accepted" quiet fdpblk_add --backing "$NS_DEV" -n 0
# A backing a live device serves: refused at once, naming the device and the command that stops it.
KEEP0=1 refuse "backing served" "backing $NS_DEV is served by /dev/ublkb0 \(daemon pid [0-9]+\); stop it first \(.fdpblk del -n 0.\)" add --backing "$NS_DEV" -n 1
KEEP0=1 refuse "its char device, served" "backing $NG_DEV is served by /dev/ublkb0" add --backing "$NG_DEV" -n 1 --engine passthrough
KEEP0=1 refuse "device id taken" "already exists" add --backing /var/tmp/small.img -n 0 --engine plain --policy none "${GEO[@]}"
# LMCache's device path given as a backing: a device on it would write over device 0's cache.
KEEP0=1 refuse "an fdpblk device as backing" "backing /dev/ublkb0 is fdpblk device 0, whose backing is $NS_DEV: .*device_path" add --backing /dev/ublkb0 -n 1 --engine plain --policy none
# --force by the namespace's other node while its state file is gone (/run emptied by hand):
# the daemon is found by the block node it holds, and nothing is erased (the exclusive open
# of wipefs would have failed only after the checks, naming no daemon).
expect "a swap signature written through it" quiet mkswap /dev/ublkb0
mv /run/fdpblk/0.json /var/tmp/0.json.aside
KEEP0=1 refuse "--force by the char node of a served namespace, no state file" "^fdpblk: --force: backing $NG_DEV is held open by fdpblk \(pid [0-9]+\), which no state file names.*nothing was erased$" \
    add --backing "$NG_DEV" -n 1 --engine passthrough --force
mv /var/tmp/0.json.aside /run/fdpblk/0.json
expect "the served data's swap signature is still there" bash -c "blkid -p '$NS_DEV' | grep -q 'TYPE=\"swap\"'"
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
expect "LMCache image on the drive again" bash -c "wipefs -a '$NS_DEV' >/dev/null && dd if='$FIXTURES/object-evict/device.img' of='$NS_DEV' bs=1M oflag=direct status=none"
# Another program holding the namespace open for writing (here this shell, through the block
# node: LMCache pointed at the drive itself) is refused after add's 5 s wait, named; the
# daemon's exclusive open would not see it. A reader (blktrace, a monitor) is no bar.
exec 4<>"$NS_DEV"
refuse "a namespace another program holds open for writing" "^fdpblk: backing $NG_DEV is open for writing by (bash \(pid [0-9]+\) on $NS_DEV, )*bash \(pid $$\) on $NS_DEV(, bash \(pid [0-9]+\) on $NS_DEV)*: .*stop it" \
    add --backing "$NG_DEV" -n 0 --engine passthrough
exec 4<&-
exec 4<"$NS_DEV"
expect "device 0 again, while a reader holds the namespace" quiet fdpblk_add --backing "$NS_DEV" -n 0 4<&-
exec 4<&-
# A writer that comes after the add (LMCache started later with the drive as its device_path),
# through the other node: the running daemon finds it within its 10 s poll, logs it once as an
# error and lists it in its stats.
exec 4<>"$NG_DEV"
expect "the daemon lists a writer of the backing that came after the add" bash -c \
    "for i in \$(seq 60); do $FDPBLK stats -n 0 --json | jq -e --arg w 'bash (pid $$) on $NG_DEV' '.backing_writers | any(. == \$w)' >/dev/null && exit 0; sleep 0.5; done; exit 1" 4<&-
expect "and logs it as an error" log_has "ERROR.*bash \(pid $$\) on $NG_DEV holds the backing $NS_DEV open for writing" 4<&-
expect "and the text stats flag it" bash -c "$FDPBLK stats -n 0 | grep -q '^BACKING WRITTEN BY ANOTHER PROGRAM: .*bash (pid $$) on $NG_DEV'" 4<&-
exec 4<&-
expect "once it closed, the daemon lists none" bash -c \
    "for i in \$(seq 60); do $FDPBLK stats -n 0 --json | jq -e '.backing_writers == []' >/dev/null && exit 0; sleep 0.5; done; exit 1"
# Deleting a device someone holds open (here this shell) says who: their I/O fails from now on.
# Neither del nor the daemon waits for them to close it (LMCache may hold it for hours).
exec 3</dev/ublkb0
out=$(timeout 120 "$FDPBLK" del -n 0 2>&1) && rc=0 || rc=$?
expect_eq "del of an open device returns while it is open" "$rc" 0
expect "and it names who holds it open: $out" grep -q "/dev/ublkb0 is open by bash (pid $$)" <<<"$out"
if grep -q 'fdpblk (pid' <<<"$out"; then not_ok "del named itself: $out"; else ok "not del itself"; fi
expect "its daemon exits while the device is still open" daemons_gone
expect "the device is unlinked and listed no more" bash -c "[[ ! -e /dev/ublkb0 && ! -e /run/fdpblk/0.json ]] && $FDPBLK list --json | jq -e 'length == 0' >/dev/null"
# Its id stays taken while it is open: an add with it waits 5 s, then names who holds it.
refuse "id of a deleted device still open" "id 0 is still taken: the deleted /dev/ublkb0 is still open \\(by .*bash \\(pid $$\\).*close it, or add without -n" add --backing "$NS_DEV" -n 0
exec 3<&-
# The driver frees the id once its last user has closed the device (add waits for it).
readd() { fdpblk_add "$@"; }
expect "closed: the id is free again" readd --backing "$NS_DEV" -n 0
# The same held through a node of its own (as a container's /dev holds it): its descriptor's
# link names that node, not a deleted one, so the driver is asked. An add with the id is
# refused after its wait, not left in libublk's delete of the id, waiting for the holder with
# the add lock held (which blocked every later add).
read -r maj min < <(stat -c '%t %T' /dev/ublkb0)
rm -f /var/tmp/own-ublkb0 && mknod /var/tmp/own-ublkb0 b $((16#$maj)) $((16#$min))
exec 3</var/tmp/own-ublkb0
expect "del while held through a node of its own" quiet timeout 120 "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
out=$(timeout 60 "$FDPBLK" add --backing "$NS_DEV" -n 0 2>&1) && rc=0 || rc=$?
expect "id held through a node of its own: refused, not waiting (exit $rc): $out" \
    bash -c 'test "$1" -ne 0 && test "$1" -ne 124 && grep -q "id 0 is still taken: the deleted /dev/ublkb0 is still open (by a process this one cannot name.*close it, or add without -n" <<<"$2"' _ "$rc" "$out"
expect "no device left by the refused add" bash -c '! compgen -G "/dev/ublkb*" >/dev/null'
# A second add meanwhile is not blocked behind it (the add lock is free).
truncate -s 64M /var/tmp/other-id.img
expect "another add meanwhile" quiet timeout 60 "$FDPBLK" add --backing /var/tmp/other-id.img -n 1 --engine plain --policy none "${GEO[@]}"
expect "del it" quiet "$FDPBLK" del -n 1
exec 3<&-
rm -f /var/tmp/own-ublkb0
expect "closed: the id is free again" readd --backing "$NS_DEV" -n 0
# The same with a daemon that was killed: del deletes the device the driver held for
# recovery, without waiting for the user holding it open.
old=$(daemon_pid 0)
expect "SIGKILL daemon $old" kill -9 "$old"
expect "held for recovery" bash -c "for j in \$(seq 50); do $FDPBLK list --json | jq -e '.[0].state == \"quiesced\"' >/dev/null && exit 0; sleep 0.1; done; exit 1"
exec 3</dev/ublkb0
out=$(timeout 120 "$FDPBLK" del -n 0 2>&1) && rc=0 || rc=$?
expect_eq "del of a killed daemon's open device returns while it is open: $out" "$rc" 0
expect "it is unlinked and listed no more" bash -c "[[ ! -e /dev/ublkb0 && ! -e /run/fdpblk/0.json ]] && $FDPBLK list --json | jq -e 'length == 0' >/dev/null"
exec 3<&-
expect "closed: the id is free again" readd --backing "$NS_DEV" -n 0
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
# A passthrough device claims its namespace for its lifetime: neither the block device nor a
# second passthrough daemon can take it.
expect "passthrough device" quiet fdpblk_add --backing "$NG_DEV" -n 0 --engine passthrough
KEEP0=1 refuse "namespace of a passthrough device" "backing $NS_DEV is served by /dev/ublkb0" add --backing "$NS_DEV" -n 1
KEEP0=1 refuse "second passthrough daemon" "backing $NG_DEV is served by /dev/ublkb0" add --backing "$NG_DEV" -n 1 --engine passthrough
expect "the namespace is claimed: another program's exclusive open fails (EBUSY)" python3 -c 'import errno, os, sys
try:
    os.open(sys.argv[1], os.O_RDONLY | os.O_EXCL)
except OSError as e:
    sys.exit(0 if e.errno == errno.EBUSY else 1)
sys.exit(1)' "$NS_DEV"
expect "del passthrough" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
# --force on a file a daemon serves, whose served data holds a signature: refused before
# anything is erased (the daemon's lock would refuse it only after wipefs).
truncate -s 64M /var/tmp/served.img
expect "device on a file" quiet fdpblk_add --backing /var/tmp/served.img -n 0 --engine plain --policy none "${GEO[@]}"
expect "a swap signature written through it" quiet mkswap /dev/ublkb0
KEEP0=1 refuse "--force on a served backing" "^fdpblk: --force: backing /var/tmp/served.img is served by /dev/ublkb0 \(daemon pid [0-9]+\); stop it first \(.fdpblk del -n 0.\); nothing was erased$" \
    add --backing /var/tmp/served.img -n 1 --engine plain --policy none --force "${GEO[@]}"
expect "the served data's signature is still there" bash -c "blkid -p /var/tmp/served.img | grep -q 'TYPE=\"swap\"'"
expect "del the file's device" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
# LMCache reconfigured (fdpblk's overflow alarm asks for a larger meta_total_bytes): the
# conflict names the command that erases the old checkpoint, after which add takes the new one.
NEW=(--slot-bytes 64K --meta-total-bytes 2M)
out=$("$FDPBLK" add --backing "$NS_DEV" -n 0 "${NEW[@]}" 2>&1) && rc=0 || rc=$?
expect "new meta_total_bytes: refused while the old checkpoint is there" test "$rc" -ne 0
erase=${out##*erase its old checkpoint first: }
expect_eq "new meta_total_bytes: the erase command named" "$erase" "blkdiscard -z -l 1048576 $NS_DEV"
expect "run it" $erase
expect "add with the new geometry" quiet fdpblk_add --backing "$NS_DEV" -n 0 "${NEW[@]}"
expect "served with meta_total_bytes 2 MiB" bash -c "$FDPBLK list --json | grep -q '\"meta_total_bytes\":2097152'"
expect "del" "$FDPBLK" del -n 0
expect "its daemon exits" daemons_gone
# A state file that cannot be written (here a directory in its place; /run full alike): no
# device runs without one, since a daemon that dies could then be neither recovered nor
# kept from a second device on its backing.
mkdir -p /run/fdpblk/0.json
refuse "state file not written" "cannot write /run/fdpblk/0.json.*nothing in the way of the file" add --backing "$NS_DEV" -n 0
rmdir /run/fdpblk/0.json
expect "its daemon exits" daemons_gone

expect "rmmod ublk_drv" rmmod ublk_drv
refuse "no ublk driver" "modprobe ublk_drv" add --backing "$NS_DEV" "${GEO[@]}"
expect "modprobe ublk_drv" modprobe ublk_drv
check_done
