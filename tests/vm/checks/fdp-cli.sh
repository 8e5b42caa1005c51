#!/usr/bin/env bash
# vm-kernel: new old
# vm-fdp: on
# fdpblk fdp status / fdp stats report what nvme-cli reports on the emulated FDP drive:
# configuration, FDP feature, identify fields, RUH status (through /dev/nvme0n1 and
# /dev/ng0n1) and statistics, before and after writes with placement; the error cases
# (a controller for status, a non-NVMe file, no root) fail with messages naming the fix.
# Needs target/release/fdpblk (cargo build --release); FDPBLK_BIN overrides.
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool nvme jq setpriv

FDPBLK=${FDPBLK_BIN:-target/release/fdpblk}
[[ -x $FDPBLK ]] || check_fatal "$FDPBLK not found: run cargo build --release first"

# jq_eq DESC JSON_A FILTER_A JSON_B FILTER_B: both filters give the same text.
jq_eq() {
    local a b
    a=$(jq -r "$3" <<<"$2") || a="(jq failed: $3)"
    b=$(jq -r "$5" <<<"$4") || b="(jq failed: $5)"
    # A field missing on both sides is no agreement.
    [[ $a == null ]] && a="(null: $3)"
    expect_eq "$1" "$a" "$b"
}

# compare_status TAG: fdpblk's status on both namespace nodes against nvme-cli's.
compare_status() {
    local tag=$1 st st_ng cli
    st=$("$FDPBLK" fdp status "$NS_DEV" --json) || check_fatal "fdpblk fdp status $NS_DEV --json failed"
    st_ng=$("$FDPBLK" fdp status "$NG_DEV" --json) || check_fatal "fdpblk fdp status $NG_DEV --json failed"
    cli=$(nvme fdp status "$NS_DEV" -o json) || check_fatal "nvme fdp status failed"
    local ruhs='[.ruhs[] | "\(.pid) \(.ruhid) \(.earutr) \(.ruamw)"] | join("; ")'
    local ruhss='[.ruhss[] | "\(.pid) \(.ruhid) \(.earutr) \(.ruamw)"] | join("; ")'
    jq_eq "$tag: nruhsd" "$st" .nruhsd "$cli" .nruhsd
    jq_eq "$tag: RUH status (pid ruhid earutr ruamw) via $NS_DEV" "$st" "$ruhs" "$cli" "$ruhss"
    jq_eq "$tag: RUH status via $NG_DEV" "$st_ng" "$ruhs" "$cli" "$ruhss"
    jq_eq "$tag: placement_ids" "$st" '.placement_ids | map(tostring) | join(" ")' "$cli" '[.ruhss[].pid] | map(tostring) | join(" ")'
    expect_eq "$tag: the namespace's nodes (block_device generic_device)" "$(jq -r '"\(.block_device) \(.generic_device)"' <<<"$st")" "$NS_DEV $NG_DEV"
    expect "$tag: $NG_DEV and $NS_DEV report the same (all fields but device)" \
        test "$(jq -c 'del(.device)' <<<"$st_ng")" == "$(jq -c 'del(.device)' <<<"$st")"
}

# ---- configuration, feature, identify -----------------------------------------------------
compare_status fresh
st=$("$FDPBLK" fdp status "$NS_DEV" --json) || check_fatal "fdpblk fdp status failed"
idx=$(jq -r .fdpcidx <<<"$st")

cfg=$(nvme fdp configs "$CTRL_DEV" -e 1 -o json) || check_fatal "nvme fdp configs failed"
for f in fdpa vss nrg nruh nnss runs erutl; do
    jq_eq "config $f (configuration $idx)" "$st" ".$f" "$cfg" ".configs[$idx].$f"
done
jq_eq "number of configurations" "$st" .num_configs "$cfg" '.n + 1'
cfg_txt=$(nvme fdp configs "$CTRL_DEV" -e 1) || check_fatal "nvme fdp configs (text) failed"
expect_eq "RUH types (1 = Initially Isolated, 2 = Persistently Isolated)" \
    "$(jq -r '.ruht | map(if . == 1 then "Initially Isolated" elif . == 2 then "Persistently Isolated" else "?" end) | join(",")' <<<"$st")" \
    "$(sed -n 's/^ *\[[0-9]*\]: //p' <<<"$cfg_txt" | paste -sd, -)"
expect_eq "values of the harness drive: nruh runs nrg" "$(jq -r '"\(.nruh) \(.runs) \(.nrg)"' <<<"$st")" "$NRUH $RU_SIZE 1"

feat=$(nvme get-feature "$CTRL_DEV" -f 0x1d --cdw11=1) || check_fatal "nvme get-feature 0x1d failed"
dw0=$(sed -n 's/.*Current value: *\(0x[0-9a-fA-F]*\).*/\1/p' <<<"$feat")
expect_eq "FDPE (get-feature 0x1d bit 0)" "$(jq -r '.fdpe' <<<"$st")" "$( (((dw0 & 1) == 1)) && echo true || echo false)"
expect_eq "FDPCIDX (get-feature 0x1d bits 15:8)" "$(jq -r '.fdpcidx' <<<"$st")" "$(((dw0 >> 8) & 0xff))"

idc=$(nvme id-ctrl "$CTRL_DEV" -o json) || check_fatal "nvme id-ctrl failed"
idn=$(nvme id-ns "$NS_DEV" -o json) || check_fatal "nvme id-ns failed"
jq_eq "ctratt" "$st" .ctratt "$idc" .ctratt
jq_eq "mdts" "$st" .mdts "$idc" .mdts
jq_eq "nsze" "$st" .nsze "$idn" .nsze
jq_eq "endgid" "$st" .endgid "$idn" .endgid
jq_eq "lba_size (2^lbads of the format in use)" "$st" .lba_size "$idn" '(.flbas % 16) as $i | pow(2; .lbafs[$i].ds)'
expect_eq "lba_size = the queue's logical_block_size" "$(jq -r .lba_size <<<"$st")" "$(cat /sys/block/nvme0n1/queue/logical_block_size)"
expect_eq "max_hw_sectors_kb" "$(jq -r .max_hw_sectors_kb <<<"$st")" "$(cat /sys/block/nvme0n1/queue/max_hw_sectors_kb)"
# What one passthrough command takes: the smaller of max_hw_sectors_kb (MDTS 7 here: 512 KiB)
# and max_segments pages (each page of a buffer may be its own segment), in whole blocks.
q=/sys/block/nvme0n1/queue
want=$(($(cat $q/max_hw_sectors_kb) * 1024))
segs=$(($(cat $q/max_segments) * $(getconf PAGESIZE)))
((segs < want)) && want=$segs
want=$((want / $(cat $q/logical_block_size) * $(cat $q/logical_block_size)))
expect_eq "max_transfer_bytes = min(max_hw_sectors_kb KiB, max_segments pages) ($(cat $q/max_hw_sectors_kb) KiB, $(cat $q/max_segments) segments)" \
    "$(jq -r .max_transfer_bytes <<<"$st")" "$want"
mws=$(cat /sys/block/nvme0n1/queue/max_write_streams 2>/dev/null || echo null)
expect_eq "max_write_streams (sysfs, null before Linux 6.16)" "$(jq -r .max_write_streams <<<"$st")" "$mws"

# ---- statistics ----------------------------------------------------------------------------------
# compare_stats TAG: fdpblk's stats through the controller and the namespace nodes = nvme-cli's.
compare_stats() {
    local cli s dev
    cli=$(nvme fdp stats "$CTRL_DEV" -e 1 -o json) || check_fatal "nvme fdp stats failed"
    for dev in "$CTRL_DEV" "$NS_DEV" "$NG_DEV"; do
        s=$("$FDPBLK" fdp stats "$dev" --json) || { not_ok "$1: fdpblk fdp stats $dev --json failed"; continue; }
        jq_eq "$1: stats via $dev (hbmw mbmw mbe)" "$s" '"\(.hbmw) \(.mbmw) \(.mbe)"' "$cli" '"\(.hbmw) \(.mbmw) \(.mbe)"'
    done
}
compare_stats fresh
evc=$(nvme fdp events "$CTRL_DEV" -e 1 -E -o json) || check_fatal "nvme fdp events failed"
s=$("$FDPBLK" fdp stats "$CTRL_DEV" --json)
jq_eq "fresh: host events" "$s" .events.host.nevents "$evc" .n

# ---- writes with placement move both tools' numbers alike ------------------------------------
b_st=$st
b_s=$s
head -c $((64 * LBA)) /dev/urandom >/tmp/fdp-cli-data
nw() { # DEV START NLB [PID]
    local dir=()
    [[ $# -lt 4 ]] || dir=(--dir-type=2 "--dir-spec=$4")
    # --data-size must be exactly NLB * LBA size (else 0x400f, yet QEMU still charges it).
    nvme write "$1" --start-block="$2" --block-count=$(($3 - 1)) --data-size=$(($3 * LBA)) \
        --data=/tmp/fdp-cli-data "${dir[@]}" >/dev/null
}
expect "nvme write 8 blocks with placement ID 3 on $NS_DEV" nw "$NS_DEV" 0 8 3
expect "nvme write 16 blocks with placement ID 5 on $NG_DEV" nw "$NG_DEV" 4096 16 5
expect "nvme write 4 blocks without directive" nw "$NS_DEV" 8192 4
# Host events on PH 1, then an RU Update of PID 1: QEMU logs "RU Not Fully Written".
expect "nvme fdp set-events (PH 1, host events)" quiet nvme fdp set-events "$NS_DEV" --placement-handle=1 --event-types=0 --enable
expect "nvme write 2 blocks with placement ID 1" nw "$NS_DEV" 12288 2 1
expect "nvme fdp update -p 1" quiet nvme fdp update "$NS_DEV" -p 1

compare_status written
a_st=$("$FDPBLK" fdp status "$NS_DEV" --json)
used() { jq -r --argjson p "$1" '.ruhs[] | select(.pid == $p) | .ruamw' <<<"$2"; }
expect_eq "fdpblk: RUAMW used on PID 3" $(($(used 3 "$b_st") - $(used 3 "$a_st"))) 8
expect_eq "fdpblk: RUAMW used on PID 5" $(($(used 5 "$b_st") - $(used 5 "$a_st"))) 16
expect_eq "fdpblk: RUAMW used on PID 0 (no directive)" $(($(used 0 "$b_st") - $(used 0 "$a_st"))) 4
expect_eq "fdpblk: RUAMW of PID 1 back to a full RU after the update" "$(used 1 "$a_st")" "$RU_BLOCKS"
compare_stats written
a_s=$("$FDPBLK" fdp stats "$CTRL_DEV" --json)
expect_eq "fdpblk: HBMW grew by the 30 blocks written" $(($(jq -r .hbmw <<<"$a_s") - $(jq -r .hbmw <<<"$b_s"))) $((30 * LBA))
expect_eq "fdpblk: MBMW grew by them plus the rest of PID 1's RU (QEMU pads at RU Update)" \
    $(($(jq -r .mbmw <<<"$a_s") - $(jq -r .mbmw <<<"$b_s"))) $((30 * LBA + RU_SIZE - 2 * LBA))
evc=$(nvme fdp events "$CTRL_DEV" -e 1 -E -o json) || check_fatal "nvme fdp events failed"
jq_eq "written: host events count" "$a_s" .events.host.nevents "$evc" .n
jq_eq "written: host events (type fdpef pid nsid)" \
    "$a_s" '.events.host.events[] | "\(.type) \(.fdpef) \(.pid) \(.nsid)"' \
    "$evc" '.events[] | "\(.type) \(.fdpef) \(.pid) \(.nsid)"'
expect_eq "written: the RU Update's event is 'RU Not Fully Written' on PID 1" \
    "$(jq -r '.events.host.events[-1] | "\(.name) \(.pid)"' <<<"$a_s")" "Reclaim Unit Not Fully Written 1"
jq_eq "stats ratio = mbmw / hbmw" "$a_s" '.media_host_ratio * 1000 | floor' "$a_s" '.mbmw / .hbmw * 1000 | floor'

# ---- text output and errors ------------------------------------------------------------------
txt=$("$FDPBLK" fdp status "$NS_DEV") || not_ok "fdpblk fdp status (text) failed"
expect "text status lists $NRUH placement identifiers" test "$(grep -cE '^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+$' <<<"$txt")" -eq "$NRUH"
expect "text stats prints HBMW" bash -c "'$FDPBLK' fdp stats $CTRL_DEV | grep -q '^HBMW'"

err_case() { # DESC WANT_IN_MESSAGE CMD...
    local desc=$1 want=$2 out rc=0
    shift 2
    out=$("$@" 2>&1) || rc=$?
    if ((rc != 0)) && grep -qF -- "$want" <<<"$out"; then ok "$desc (exit $rc)"; else not_ok "$desc: exit $rc, output: $out"; fi
}
err_case "status of a controller asks for a namespace" "give /dev/nvmeXnY or /dev/ngXnY" "$FDPBLK" fdp status "$CTRL_DEV"
err_case "status of a non-NVMe device" "is not an NVMe device" "$FDPBLK" fdp status /dev/null
err_case "status of a regular file" "is not an NVMe device" "$FDPBLK" fdp status /etc/hostname
err_case "status as an unprivileged user" "run as root" setpriv --reuid=65534 --regid=65534 --clear-groups "$FDPBLK" fdp status "$NS_DEV"
err_case "stats as an unprivileged user" "run as root" setpriv --reuid=65534 --regid=65534 --clear-groups "$FDPBLK" fdp stats "$CTRL_DEV"

check_done
