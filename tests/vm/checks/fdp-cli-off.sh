#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: off
# On a plain NVMe drive (no FDP) fdpblk fdp status and fdp stats fail with a non-zero exit
# and the "does not support FDP" message that names the way out, as nvme-cli also finds no
# FDP capability. Needs target/release/fdpblk (cargo build --release); FDPBLK_BIN overrides.
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool nvme

FDPBLK=${FDPBLK_BIN:-target/release/fdpblk}
[[ -x $FDPBLK ]] || check_fatal "$FDPBLK not found: run cargo build --release first"

expect "nvme-cli: CTRATT bit 19 clear (no FDP)" test "$(ctratt_fdp)" -eq 0

err_case() { # DESC WANT_IN_MESSAGE CMD...
    local desc=$1 want=$2 out rc=0
    shift 2
    out=$("$@" 2>&1) || rc=$?
    echo "  $desc: exit $rc: $out"
    if ((rc != 0)) && grep -qF -- "$want" <<<"$out"; then ok "$desc (exit $rc)"; else not_ok "$desc: exit $rc, output: $out"; fi
}
msg="does not support FDP; use --policy none or --engine plain"
err_case "fdpblk fdp status $NS_DEV" "$msg" "$FDPBLK" fdp status "$NS_DEV"
err_case "fdpblk fdp status $NG_DEV --json" "$msg" "$FDPBLK" fdp status "$NG_DEV" --json
err_case "fdpblk fdp stats $CTRL_DEV --json" "$msg" "$FDPBLK" fdp stats "$CTRL_DEV" --json

check_done
