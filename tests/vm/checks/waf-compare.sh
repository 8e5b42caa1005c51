#!/usr/bin/env bash
# vm-kernel: new
# vm-fdp: on
# vm-args: --ru-size 64M
# vm-timeout: 480
# tools/waf-compare end to end on QEMU's FDP drive, with the commands of docs/guide.md
# ("Measure"): a row for every configuration (raw, fio-static, fdpblk with none, region,
# lmcache-fdp, key-aware) with non-zero byte counts; bytes on the workload device = classified
# bytes = the writer's own per-class bytes; bytes per placement ID on the drive (RUAMW, HBMW)
# = fdpblk's per-handle counters plus its own-state writes; fio's static placement puts the
# metadata on PID 1 and the slots on PID 2; the chart is a PNG. The assertions are checked on a
# tampered copy of the report too, where they must fail. (64 MiB reclaim units: RUAMW counts
# modulo the RU, and no placement ID gets 64 MiB here.)
. "$(dirname "$0")/../lib/check-lib.sh"
need_tool blktrace blkparse python3 jq nvme losetup

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
for b in fdpblk rawblock-writer; do
    [[ -x $ROOT/target/release/$b ]] || check_fatal "no target/release/$b: run 'cargo build --release --bins' on the host first"
done
FIO_FDP=${FDPBLK_VM_CACHE:-/var/cache/fdpblk-vm}/bin/fio-fdp
"$FIO_FDP" --cmdhelp=dp_scheme >/dev/null 2>&1 || check_fatal "no fio with FDP at $FIO_FDP: run tests/vm/setup.sh"
OUT=${FDPBLK_CHECK_OUT:-/tmp}/waf-compare
cd "$ROOT"

# ---- what it refuses before it touches the drive ---------------------------------------------
# refused DESC PATTERN ARGS...: tools/waf-compare exits 1 with PATTERN in its message, and the
# drive's first MiB (a marker written here) is still there.
refused() {
    local desc=$1 pat=$2 out rc
    shift 2
    out=$(tools/waf-compare --out /tmp/waf-refused --configs raw "$@" 2>&1) && rc=0 || rc=$?
    if ((rc == 0)) || ! grep -qE -- "$pat" <<<"$out"; then not_ok "$desc: exit $rc: $out"; return; fi
    if ! cmp -s -n 1048576 /dev/nvme0n1 /tmp/waf-marker; then not_ok "$desc: the drive was written"; return; fi
    ok "$desc: $out"
}
expect "a marker on the drive" bash -c "head -c 1M /dev/urandom >/tmp/waf-marker && dd if=/tmp/waf-marker of=/dev/nvme0n1 bs=1M oflag=direct status=none"
refused "no default drive" "give the drive to erase and measure: --drive /dev/nvmeXnY --erase"
refused "no --erase: refused, naming the drive" "this run erases all of /dev/nvme0n1 \\(.*serial .*GiB\\): add --erase to confirm" --drive /dev/nvme0n1
# hold NODE: a sleep holding NODE open, its pid in $holder once it runs as sleep with it open.
hold() {
    sleep 600 3<"$1" &
    holder=$!
    for _ in $(seq 100); do
        [[ $(cat /proc/$holder/comm 2>/dev/null) == sleep && -e /proc/$holder/fd/3 ]] && return 0
        sleep 0.05
    done
    check_fatal "the holder of $1 did not start"
}
hold /dev/ng0n1
refused "the char node held open (as LMCache's own FDP mode would)" "^waf-compare: /dev/nvme0n1 is open by: sleep \\(pid $holder, /dev/ng0n1\\); stop them first" --drive /dev/nvme0n1 --erase
kill "$holder" && wait "$holder" 2>/dev/null || true
hold /dev/nvme0n1
refused "the block node held open without O_EXCL" "is open by: sleep \\(pid $holder, /dev/nvme0n1\\); stop them first" --drive /dev/nvme0n1 --erase
kill "$holder" && wait "$holder" 2>/dev/null || true
# Under another name (a container's --device /dev/nvme0n1:/dev/kvcache): found by its number.
expect "a node of the namespace under another name" mknod /dev/kvcache-test b "$(cut -d: -f1 /sys/class/block/nvme0n1/dev)" "$(cut -d: -f2 /sys/class/block/nvme0n1/dev)"
hold /dev/kvcache-test
refused "the namespace held open under another name" "is open by: sleep \\(pid $holder, /dev/kvcache-test\\); stop them first" --drive /dev/nvme0n1 --erase
kill "$holder" && wait "$holder" 2>/dev/null || true
rm -f /dev/kvcache-test
# A loop device over it holds it without a descriptor any process has.
modprobe loop 2>/dev/null || true
loopdev=$(losetup -f --show /dev/nvme0n1) || check_fatal "losetup over /dev/nvme0n1"
refused "a loop device over the namespace" "is open by: $loopdev \\(a loop device over it\\); stop them first" --drive /dev/nvme0n1 --erase
losetup -d "$loopdev"
# Workloads that cannot give comparable rows: no --capacity-bytes (raw would take the whole
# namespace, fdpblk's device less its tail); --no-trace with buffered writes (the writer's
# counts are not what reaches the device).
printf '%s\n' "--slot-bytes 64K --meta-total-bytes 256K" "--engine posix --odirect --quiet" "put 4 checkpoint" >/tmp/waf-nocap.args
refused "a workload without --capacity-bytes" "/tmp/waf-nocap.args: needs --capacity-bytes" --drive /dev/nvme0n1 --erase --workload /tmp/waf-nocap.args
printf '%s\n' "--slot-bytes 64K --meta-total-bytes 256K --capacity-bytes 4352K" "--engine posix --quiet" "put 4 checkpoint" >/tmp/waf-buffered.args
refused "--no-trace with a buffered workload" "/tmp/waf-buffered.args: --no-trace needs a workload with --odirect" --drive /dev/nvme0n1 --erase --no-trace --workload /tmp/waf-buffered.args

# fio-static replays raw's queued writes through NVMe passthrough, which cannot split them:
# 1 MiB slots queue payload writes of about 1 MiB, past this drive's maximum transfer size.
FIO=$FIO_FDP
max_tx=$(target/release/fdpblk fdp status /dev/nvme0n1 --json | jq -r .max_transfer_bytes)
printf '%s\n' "--slot-bytes 1M --meta-total-bytes 256K --capacity-bytes 8448K" "--engine posix --odirect --quiet" "put 4 checkpoint" >/tmp/waf-big.args
if ((max_tx < 1 << 20)); then
    out=$(tools/waf-compare --drive /dev/nvme0n1 --erase --out /tmp/waf-big --configs "raw fio-static" --workload /tmp/waf-big.args --fio "$FIO" 2>&1) && rc=0 || rc=$?
    if ((rc == 1)) && grep -q "fio-static: the raw configuration queued writes of up to [0-9]* bytes, and NVMe passthrough cannot split them to /dev/nvme0n1's maximum transfer size ($max_tx bytes)" <<<"$out"; then
        ok "fio-static refused before its erase: raw's writes exceed the drive's maximum transfer size ($max_tx bytes)"
    else
        not_ok "fio-static with writes past the maximum transfer size: exit $rc: $(tail -5 <<<"$out")"
    fi
else
    not_ok "the drive's maximum transfer size is $max_tx bytes: this case needs it below 1 MiB"
fi

# ---- the guide's commands (docs/guide.md, "Measure") ------------------------------------------
t0=$SECONDS
if tools/waf-compare --drive /dev/nvme0n1 --erase --out "$OUT" --fio "$FIO" --ssd-ru-size 128K --ssd-op 0.28 >"$OUT.log" 2>&1; then
    ok "tools/waf-compare ran ($((SECONDS - t0)) s)"
else
    sed 's/^/    /' "$OUT.log" | tail -40
    check_fatal "tools/waf-compare failed"
fi
# ------------------------------------------------------------------------------------------------
sed -n '/^| configuration | workload/,/^$/p' "$OUT/report.md" | sed 's/^/    /'

# assert REPORT: one line per failed assertion on stdout; exit 1 if any.
assert_report() {
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
fails = []
def want(cond, what):
    if not cond:
        fails.append(what)
rows = {c["config"]: c for c in r["configs"]}
want(sorted(rows) == sorted(["raw", "fio-static", "none", "region", "lmcache-fdp", "key-aware"]), f"configurations: {sorted(rows)}")
raw = rows.get("raw")
for name, c in rows.items():
    cl, pid = c["classes"], {int(k): v for k, v in c["fdp"]["bytes_by_pid_index"].items()}
    ck = cl["checkpoint_header"] + cl["checkpoint_payload"]
    for k in ("workload_write_bytes", "drive_write_bytes"):
        want(c[k] > 0, f"{name}: {k} is {c[k]}")
    for k in ("checkpoint_header", "checkpoint_payload", "slot_header", "slot_payload"):
        want(cl[k] > 0, f"{name}: no {k} bytes")
    want(sum(cl.values()) == c["workload_write_bytes"], f"{name}: classified {sum(cl.values())} != on the workload device {c['workload_write_bytes']}")
    want(sum(pid.values()) == c["drive_write_bytes"], f"{name}: per-PID bytes {sum(pid.values())} != HBMW delta {c['drive_write_bytes']}")
    # The model's WAF is over the writes after the fill (one pass over the modelled drive).
    want(c["sim"]["host_bytes"] > 0 and c["sim"]["waf"] is not None and c["sim"]["waf"] >= 1.0, f"{name}: simulated drive {c['sim']}")
    want(0 < (c["sim"]["window_host_bytes"] or 0) < c["sim"]["host_bytes"] and c["sim"]["warmup_bytes"] > 0, f"{name}: simulated drive's window {c['sim']}")
    want(c["fdp"]["media_host_ratio"] is not None and c["fdp"]["media_host_ratio"] >= 1.0, f"{name}: media/host {c['fdp']['media_host_ratio']}")
    want(isinstance(c["fdp"]["erased_bytes"], int) and c["fdp"]["erased_bytes"] >= 0, f"{name}: erased (MBE) {c['fdp']['erased_bytes']}")
    if "writer_bytes" in c:
        w = c["writer_bytes"]
        want(ck == w["checkpoint_header"] + w["checkpoint_payload"], f"{name}: checkpoint bytes {ck} != the writer's")
        want(cl["slot_header"] + cl["slot_payload"] + cl["slot_padding"] == w["slot_header"] + w["slot_payload"], f"{name}: slot bytes != the writer's")
    if raw is not None:
        want(c["workload_write_bytes"] == raw["workload_write_bytes"], f"{name}: the same workload as raw ({c['workload_write_bytes']} != {raw['workload_write_bytes']})")
    f = c.get("fdpblk")
    if name in ("raw", "fio-static"):
        want(f is None and c["own_state_bytes"] == 0, f"{name}: fdpblk counters or own state")
        want(c["drive_write_bytes"] == c["workload_write_bytes"], f"{name}: drive bytes != workload bytes")
    if name == "raw":
        want(pid[0] == c["drive_write_bytes"], f"raw: not everything on PID 0: {pid}")
    if name == "fio-static":
        want(pid[1] == ck and pid[2] == c["workload_write_bytes"] - ck, f"fio-static: PID 1 {pid[1]} (want {ck}), PID 2 {pid[2]}")
    if f is not None:
        want(f["policy"] == name, f"{name}: fdpblk ran policy {f['policy']}")
        want(f["write_bytes"] == c["workload_write_bytes"], f"{name}: fdpblk write bytes {f['write_bytes']} != blktrace {c['workload_write_bytes']}")
        want(c["own_state_bytes"] > 0, f"{name}: no own-state writes on the drive")
        # fdpblk's own writes: its state past the exported capacity, and the older checkpoint
        # containers' header blocks it zeroed for early evictions (on the same handle).
        own = c["own_state_bytes"] + f["zeroed_container_bytes"]
        want(c["drive_write_bytes"] == c["workload_write_bytes"] + own, f"{name}: drive bytes != ublk bytes + own state + zeroed checkpoint headers")
        want(c["drive_write_bytes_blktrace"] == c["drive_write_bytes"], f"{name}: drive blktrace {c['drive_write_bytes_blktrace']} != HBMW {c['drive_write_bytes']}")
        for i, got in pid.items():
            exp = f["handles"].get(str(i), 0) + (own if i == f["own_state_handle"] else 0)
            want(got == exp, f"{name}: PID {i}: drive {got} != fdpblk handle {exp}")
        want(c["fdpblk_overhead"] > 1.0, f"{name}: overhead {c['fdpblk_overhead']}")
        # The workload ends by shrinking the cache: fdpblk deallocates the slots LMCache evicted
        # and did not reuse, and the drive sees it; not under lmcache-fdp, which stands for
        # LMCache's own FDP mode (--no-trim).
        if name == "lmcache-fdp":
            want(not f["trim_bytes"] and c["drive_discard_bytes"] == 0 and f["zeroed_container_bytes"] == 0, f"{name}: deallocated {f['trim_bytes']} bytes (zeroed {f['zeroed_container_bytes']}), the drive saw {c['drive_discard_bytes']} discarded")
        else:
            want((f["trim_bytes"] or 0) > 0 and c["drive_discard_bytes"] > 0, f"{name}: deallocated {f['trim_bytes']} bytes, the drive saw {c['drive_discard_bytes']} discarded")
        # In the simulated drive's event order (both traces on one clock) LMCache never reads
        # what fdpblk deallocated.
        # The drive's capture starts before `fdpblk add`, the workload's after it: on the
        # shared clock the workload's events come that much later than on its own.
        want((c["sim_clock_offset_s"] or 0) > 0.2, f"{name}: the two captures' clocks are {c['sim_clock_offset_s']} s apart")
        want(c["sim_reads_of_deallocated_bytes"] == 0, f"{name}: the simulated drive reads {c['sim_reads_of_deallocated_bytes']} deallocated bytes (clocks apart: {c.get('sim_reads_of_deallocated_bytes_clocks_apart')})")
want(len(r["checks"]) >= 6, f"only {len(r['checks'])} of waf-compare's own checks ran")
want(all(k["ok"] for k in r["checks"]), "waf-compare's own checks: " + "; ".join(k["what"] for k in r["checks"] if not k["ok"]))
# Here (64 MiB reclaim units, no metadata) every check is exact: none modulo the RU, none skipped.
want(not any(k.get("skipped") or "modulo" in k["what"] for k in r["checks"]), "waf-compare's checks not exact here: " + "; ".join(k["what"] for k in r["checks"] if k.get("skipped") or "modulo" in k["what"]))
# Placement differs where it should: region splits checkpoints from slots, none does not.
if "region" in rows and "none" in rows:
    want(rows["region"]["fdp"]["bytes_by_pid_index"]["1"] > 0 and rows["none"]["fdp"]["bytes_by_pid_index"]["1"] == 0, "region vs none: PID 1")
for x in fails:
    print(x)
sys.exit(1 if fails else 0)
PY
}

if fails=$(assert_report "$OUT/report.json"); then
    ok "report.json: every assertion holds"
else
    echo "$fails" | sed 's/^/    /'
    not_ok "report.json: $(echo "$fails" | wc -l) assertion(s) failed"
fi
# The same assertions on a copy where fdpblk's handle 2 counter under region is 4 KiB high:
# they must catch it.
jq '(.configs[] | select(.config == "region") | .fdpblk.handles["2"]) += 4096' "$OUT/report.json" >"$OUT/tampered.json"
if assert_report "$OUT/tampered.json" >"$OUT/tampered.out"; then
    not_ok "the assertions pass a tampered report"
else
    expect "the assertions catch the tampered counter: $(head -n1 "$OUT/tampered.out")" grep -q '^region: PID 2: drive' "$OUT/tampered.out"
fi
expect_eq "report.md rows" "$(grep -cE '^\| (raw|fio-static|none|region|lmcache-fdp|key-aware) \| `' "$OUT/report.md")" 6
expect_eq "chart.png starts with PNG's signature" "$(head -c 4 "$OUT/chart.png" | od -An -tx1 | tr -d ' \n')" 89504e47

# --precondition --no-trace: each configuration on a full drive, its counters from after the
# fill, and no blktrace (what a run of terabytes needs). The report's own checks (per-PID bytes
# add up to HBMW, fdpblk's handle bytes on their placement IDs, fdpblk's write bytes = the
# writer's) hold only if the fill is left out (it lands on placement ID 0, where fdpblk's
# handle 0 has nothing); and fdpblk deallocates the slots LMCache never wrote, full of the fill
# (its `unwritten` rule). key-aware alone: each configuration fills the whole namespace, and
# raw's counts add nothing the per-PID checks do not (the suite's time).
PRE=${OUT}-precondition
if tools/waf-compare --drive /dev/nvme0n1 --erase --precondition --no-trace --configs key-aware --out "$PRE" --fio "$FIO" \
    --ssd-ru-size 128K --ssd-op 0.28 >"$PRE.log" 2>&1; then
    ok "tools/waf-compare --precondition --no-trace ran"
else
    sed 's/^/    /' "$PRE.log" | tail -40
    check_fatal "tools/waf-compare --precondition --no-trace failed"
fi
sed -n '/^| configuration | workload/,/^$/p' "$PRE/report.md" | sed 's/^/    /'
expect "its report says the drive was full" grep -q '^Each configuration ran on a full drive' "$PRE/report.md"
expect "and how much of the fill fdpblk deallocated as never written" grep -q '^fdpblk with trim deallocates the fill in the slots LMCache never wrote.*: key-aware [1-9]' "$PRE/report.md"
expect "and that nothing was traced" bash -c "grep -q '^Run with --no-trace' '$PRE/report.md' && ! compgen -G '$PRE/*/trace-*' >/dev/null"
pre=$(python3 - "$PRE/report.json" "$PRE/key-aware/fdpblk-stats.json" "$(blockdev --getsize64 /dev/nvme0n1)" <<'PY'
import json, sys
p, st = (json.load(open(f)) for f in sys.argv[1:3])
ns = int(sys.argv[3])
rows = {c["config"]: c for c in p["configs"]}
fails = [k["what"] for k in p["checks"] if not k["ok"]]
if not p.get("preconditioned") or p.get("traced") is not False:
    fails.append(f"report.json: preconditioned {p.get('preconditioned')}, traced {p.get('traced')}")
if len(p["checks"]) < 6:
    fails.append(f"only {len(p['checks'])} checks ran")
# The fill wrote the whole namespace.
for name, r in rows.items():
    if not (r.get("fill_bytes") or 0) >= ns:
        fails.append(f"{name}: the fill wrote {r.get('fill_bytes')} bytes of the namespace's {ns}")
if not any(k["what"].startswith("key-aware: placement ID index 0:") and k["ok"] for k in p["checks"]):
    fails.append(f"key-aware: no check that placement ID 0 (the fill's) holds only fdpblk's handle 0 bytes: {p['checks']}")
# Exact, not modulo the RU: a counted fill (whole RUs here) would vanish modulo the RU.
inexact = [k["what"] for k in p["checks"] if k.get("skipped") or "modulo" in k["what"]]
if inexact:
    fails.append("checks not exact (the fill counted?): " + "; ".join(inexact))
ka = rows["key-aware"]
if not ka["drive_write_bytes"] < ns:
    fails.append(f"key-aware: drive bytes {ka['drive_write_bytes']} after the fill, not below the namespace's {ns} (the fill counted?)")
# The workload's last put leaves slots 48.. of 64 never written (the writer reuses freed slots first).
unwritten = st["trim"]["reclaimed_bytes"]
if not unwritten > 0:
    fails.append(f"key-aware: {unwritten} bytes of unwritten slots deallocated")
# The report says so: the deallocated column (fdpblk's own count, no trace) holds them.
if not (ka.get("drive_discard_bytes") or 0) >= unwritten:
    fails.append(f"key-aware: deallocated column {ka.get('drive_discard_bytes')} below the {unwritten} bytes of unwritten slots")
print("; ".join(fails) or f"ok: each fill wrote the whole namespace, {len(p['checks'])} checks hold; key-aware deallocated {unwritten} bytes of slots never written")
PY
)
expect "--precondition: $pre" test "${pre#ok:}" != "$pre"
check_done
