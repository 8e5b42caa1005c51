#!/usr/bin/env bash
# vm-kernel: new old
# vm-fdp: on
# The emulated SSD is an FDP drive with NRUH reclaim unit handles, and writes
# with a placement directive (nvme write --dir-type=2 --dir-spec=PID) consume
# exactly their blocks from that PID's reclaim unit (RUAMW) and move HBMW/MBMW.
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool nvme awk

expect "CTRATT bit 19: Flexible Data Placement supported" test "$(ctratt_fdp)" -eq 1
expect "Get Features 0x1d: FDP enabled" \
    bash -c "nvme get-feature $CTRL_DEV -f 0x1d --cdw11=1 -H | grep -q 'Placement Enable (FDPE).*: Yes'"

configs=$(nvme fdp configs "$CTRL_DEV" -e 1) || check_fatal "nvme fdp configs failed"
echo "$configs" | sed 's/^/  configs: /'
expect_eq "configs: reclaim unit handles" "$(awk -F': ' '/^Number of Reclaim Unit Handles/ { print $2 }' <<<"$configs")" "$NRUH"
expect_eq "configs: reclaim groups" "$(awk -F': ' '/^Number of Reclaim Groups/ { print $2 }' <<<"$configs")" 1
expect_eq "configs: reclaim unit size" "$(awk -F': ' '/^Reclaim Unit Nominal Size/ { print $2 }' <<<"$configs")" "$RU_SIZE"
expect_eq "configs: handle list entries" "$(grep -c '^ *\[[0-9]*\]:' <<<"$configs")" "$NRUH"

expect_eq "usage: handles" "$(nvme fdp usage "$CTRL_DEV" -e 1 | grep -c '^Reclaim Unit Handle [0-9]* Attributes')" "$NRUH"

before=$(ruamw) || check_fatal "nvme fdp status failed"
expect_eq "status: placement identifiers" "$(awk '{ print $1 }' <<<"$before" | tr '\n' ' ')" \
    "$(seq -s ' ' 0 $((NRUH - 1))) "
hbmw0=$(fdp_stat HBMW)
mbmw0=$(fdp_stat MBMW)
[[ $hbmw0 =~ ^[0-9]+$ && $mbmw0 =~ ^[0-9]+$ ]] || check_fatal "nvme fdp stats: HBMW '$hbmw0' MBMW '$mbmw0'"

# PID p gets 8*(p+1) blocks through the block device; the last PID 8 more through
# the passthrough node; a write without directive lands on PID 0 (8 blocks).
maxblk=$((8 * (NRUH + 1)))
head -c $((maxblk * LBA)) /dev/urandom >/tmp/fdp-data
declare -A want
total=0
nvme_write() { # DEV START NLB [PID]
    local dir=()
    [[ $# -lt 4 ]] || dir=(--dir-type=2 "--dir-spec=$4")
    # --data-size must be exactly NLB * LBA size, or the command fails (0x400f).
    nvme write "$1" --start-block="$2" --block-count=$(($3 - 1)) --data-size=$(($3 * LBA)) \
        --data=/tmp/fdp-data "${dir[@]}" >/dev/null
}
for ((p = 0; p < NRUH; p++)); do
    n=$((8 * (p + 1)))
    expect "nvme write $n blocks with placement ID $p" nvme_write "$NS_DEV" $((p * 4096)) "$n" "$p"
    want[$p]=$n
    total=$((total + n))
done
last=$((NRUH - 1))
expect "nvme write (passthrough $NG_DEV) 8 blocks with placement ID $last" nvme_write "$NG_DEV" $((NRUH * 4096)) 8 "$last"
want[$last]=$((want[$last] + 8))
expect "nvme write 8 blocks without directive" nvme_write "$NS_DEV" $(((NRUH + 1) * 4096)) 8
want[0]=$((want[0] + 8))
total=$((total + 16))

after=$(ruamw)
for ((p = 0; p < NRUH; p++)); do
    expect_eq "RUAMW consumed on placement ID $p (blocks)" "$(ruamw_used "$before" "$after" "$p")" "${want[$p]}"
done
hbmw1=$(fdp_stat HBMW)
mbmw1=$(fdp_stat MBMW)
expect_eq "HBMW increase (bytes)" $((hbmw1 - hbmw0)) $((total * LBA))
expect "MBMW increase $((mbmw1 - mbmw0)) >= HBMW increase" test $((mbmw1 - mbmw0)) -ge $((total * LBA))

check_done
