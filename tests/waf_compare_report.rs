//! `tools/waf-compare-report.py`'s consistency checks on a real drive's counts: a run that
//! wrote a whole reclaim unit or more per placement ID (RUAMW is known modulo the RU), and an
//! LBA format with metadata (HBMW counts it). The VM check `waf-compare` runs the exact case.

use std::process::Command;

/// Runs the report's `consistency()` on one fdpblk row built from `true_pid_bytes` (bytes
/// each placement ID really got) and `handles` (fdpblk's counters), and prints each check as
/// `ok|FAIL|skip what`.
fn checks(ru: u64, lba_metadata: u64, true_pid_bytes: [u64; 3], handles: [u64; 3]) -> Vec<String> {
    let script = r#"
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("report", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
ru, ms = int(sys.argv[2]), int(sys.argv[3])
pids, handles = json.loads(sys.argv[4]), json.loads(sys.argv[5])
own = 8192
host = sum(pids)
ublk = host - own
row = {
    "config": "region", "classified_bytes": ublk, "workload_write_bytes": ublk, "workload_source": "blktrace",
    "drive_write_bytes_blktrace": host, "drive_write_bytes": host, "own_state_bytes": own,
    "fdp": {"bytes_by_pid_index": {str(i): b % ru for i, b in enumerate(pids)}, "ru_bytes": ru,
            "pid_bytes_below_one_ru": host < ru, "lba_metadata": ms},
    "fdpblk": {"write_bytes": ublk, "own_state_bytes": own, "zeroed_container_bytes": 0,
               "handles": {str(i): b for i, b in enumerate(handles) if b}, "own_state_handle": 1},
}
for k in m.consistency([row]):
    print(("skip" if k.get("skipped") else "ok" if k["ok"] else "FAIL") + " " + k["what"])
"#;
    let tool = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/waf-compare-report.py");
    let out = Command::new("python3")
        .args(["-c", script, tool, &ru.to_string(), &lba_metadata.to_string()])
        .arg(format!("{true_pid_bytes:?}"))
        .arg(format!("{handles:?}"))
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
}

const MIB: u64 = 1 << 20;

#[test]
fn below_one_reclaim_unit_every_check_is_exact() {
    // Handle 1: checkpoints and fdpblk's 8 KiB of state; handle 2: slots.
    let c = checks(64 * MIB, 0, [0, MIB + 8192, 9 * MIB], [0, MIB, 9 * MIB]);
    assert!(c.len() >= 3 && c.iter().all(|l| l.starts_with("ok ") && !l.contains("modulo")), "{c:#?}");
    let c = checks(64 * MIB, 0, [0, MIB + 8192, 9 * MIB], [0, MIB, 9 * MIB + 4096]);
    assert!(c.iter().any(|l| l.starts_with("FAIL ") && l.contains("placement ID index 2")), "a counter 4 KiB high: {c:#?}");
}

#[test]
fn past_a_reclaim_unit_placement_ids_are_checked_modulo_the_unit() {
    // 10 MiB and 25 MiB on 4 MiB reclaim units: RUAMW shows 2 MiB and 1 MiB.
    let c = checks(4 * MIB, 0, [0, 10 * MIB + 8192, 25 * MIB], [0, 10 * MIB, 25 * MIB]);
    assert!(c.len() >= 3 && c.iter().all(|l| l.starts_with("ok ")), "{c:#?}");
    assert!(c.iter().any(|l| l.contains("placement ID index 2") && l.contains("modulo the RU")), "{c:#?}");
    // Off by 4 KiB is still caught modulo the unit.
    let c = checks(4 * MIB, 0, [0, 10 * MIB + 8192, 25 * MIB], [0, 10 * MIB, 25 * MIB + 4096]);
    assert!(c.iter().any(|l| l.starts_with("FAIL ") && l.contains("placement ID index 2")), "{c:#?}");
}

#[test]
fn with_metadata_the_hbmw_checks_do_not_apply() {
    let c = checks(64 * MIB, 8, [0, MIB + 8192, 9 * MIB], [0, MIB, 9 * MIB]);
    for what in ["blktrace vs HBMW", "per-PID bytes (RUAMW) add up to HBMW", "drive bytes = ublk bytes"] {
        assert!(c.iter().any(|l| l.starts_with("skip ") && l.contains(what)), "{what}: {c:#?}");
    }
    assert!(c.iter().any(|l| l.starts_with("ok ") && l.contains("placement ID index 2")), "{c:#?}");
}

#[test]
fn the_overhead_counts_data_bytes_only_where_blocks_carry_metadata() {
    let out = with_report(
        r#"
n = 1000
# 1000 blocks of 4096 + 64 bytes on the drive for 1000 blocks written: no overhead; 1010 of
# them: 1 %; with no metadata, HBMW is the data.
print(m.data_overhead({"host_bytes": n * 4160, "lba_size": 4096, "lba_metadata": 64}, n * 4096))
print(m.data_overhead({"host_bytes": (n + 10) * 4160, "lba_size": 4096, "lba_metadata": 64}, n * 4096))
print(m.data_overhead({"host_bytes": n * 4096, "lba_size": 4096, "lba_metadata": 0}, n * 4096))
print(m.data_overhead({"host_bytes": 4096, "lba_size": 4096, "lba_metadata": 0}, 0))
"#,
    );
    assert_eq!(out, "1.0\n1.01\n1.0\nNone\n");
}

/// Runs `script` with the report's module as `m` (and `random`), and returns what it printed.
fn with_report(script: &str) -> String {
    let preamble = "import importlib.util, random, sys\nspec = importlib.util.spec_from_file_location(\"report\", sys.argv[1])\nm = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n";
    let tool = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/waf-compare-report.py");
    let out = Command::new("python3").args(["-c", &format!("{preamble}{script}"), tool]).output().expect("python3 runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The deallocated-read count keeps runs of blocks, not a set of every block (a real drive's
/// deallocations cover hundreds of millions): on random events it counts what a per-block
/// set counts.
#[test]
fn reads_of_deallocated_blocks_are_counted_by_runs_as_by_blocks() {
    let out = with_report(
        r#"
def by_blocks(events, block=4096):
    gone, bad = set(), 0
    for _, o, off, n in events:
        blocks = range(off // block, (off + n + block - 1) // block)
        if o == "discard":
            gone.update(range(-(-off // block), (off + n) // block))
        elif o == "write":
            gone.difference_update(blocks)
        elif o == "read":
            bad += block * sum(1 for b in blocks if b in gone)
    return bad
rng = random.Random(7)
nonzero = 0
for run in range(300):
    ev = []
    for t in range(200):
        off = rng.randrange(0, 256) * 512
        ev.append((t, rng.choice(["discard", "discard", "write", "read", "read"]), off, rng.randrange(1, 64) * 512))
    want = by_blocks(ev)
    got = m.reads_of_deallocated(ev)
    assert got == want, (run, got, want)
    nonzero += want > 0
assert nonzero > 200, nonzero
print("ok")
"#,
    );
    assert_eq!(out, "ok\n");
}

/// A reclaim unit the drive changed itself (an FDP event new in the run's window) restarts
/// its handle's RUAMW: the per-placement-ID checks are skipped, naming the event, instead of
/// failing a long run; events already logged before the window, and other kinds, change
/// nothing.
#[test]
fn reclaim_units_the_drive_changed_itself_skip_the_per_pid_checks() {
    let out = with_report(
        r#"
import json, os, tempfile
d = tempfile.mkdtemp()
old = {"type": 1, "name": "Reclaim Unit Time Limit Exceeded", "pid": 1, "timestamp_ms": 5}
new = {"type": 129, "name": "Implicitly Modified Reclaim Unit Handle", "pid": 2, "timestamp_ms": 9}
other = {"type": 128, "name": "Media Reallocated", "pid": 0, "timestamp_ms": 9}
def put(w, host, ctrl):
    json.dump({"events": {"host": {"events": host}, "controller": {"events": ctrl}}}, open(os.path.join(d, f"fdp-stats-{w}.json"), "w"))
put("before", [old], [])
put("after", [old], [new, other])
print(m.ru_events(d))
put("after", [old], [other])
print(m.ru_events(d))
os.remove(os.path.join(d, "fdp-stats-before.json"))
print(m.ru_events(d))
row = {
    "config": "region", "classified_bytes": 100, "workload_write_bytes": 100, "workload_source": "blktrace",
    "drive_write_bytes_blktrace": 100, "drive_write_bytes": 100, "own_state_bytes": 0,
    "fdp": {"bytes_by_pid_index": {"0": 40}, "ru_bytes": 64, "pid_bytes_below_one_ru": False, "lba_metadata": 0},
    "ru_events": ["Implicitly Modified Reclaim Unit Handle"],
}
for k in m.consistency([row]):
    if "PID" in k["what"]:
        print(k.get("skipped", "checked"))
"#,
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "['Implicitly Modified Reclaim Unit Handle']", "{out}");
    assert_eq!(lines[1], "[]", "{out}");
    assert_eq!(lines[2], "[]", "a log not read: {out}");
    assert!(lines.len() > 3 && lines[3..].iter().all(|l| l.contains("changed reclaim units itself") && l.contains("Implicitly Modified")), "{out}");
}

/// An event that names its placement ID (PIV set) skips only that placement ID's checks and
/// the sum over all of them; the other placement IDs are still checked.
#[test]
fn an_event_on_one_placement_id_skips_only_its_checks() {
    let out = with_report(
        r#"
import json, os, tempfile
d = tempfile.mkdtemp()
def put(w, ctrl):
    json.dump({"events": {"host": {"events": []}, "controller": {"events": ctrl}}}, open(os.path.join(d, f"fdp-stats-{w}.json"), "w"))
put("before", [])
for pid in (2, 1):
    put("after", [{"type": 129, "name": "Implicitly Modified Reclaim Unit Handle", "fdpef": 1, "pid": pid, "timestamp_ms": 9}])
    ev = m.ru_events(d)
    print(ev)
    row = {
        "config": "raw", "classified_bytes": 100, "workload_write_bytes": 100, "workload_source": "blktrace",
        "drive_write_bytes_blktrace": 100, "drive_write_bytes": 100, "own_state_bytes": 0,
        "fdp": {"bytes_by_pid_index": {"0": 100, "1": 0}, "pid_by_index": {"0": 1, "1": 2}, "ru_bytes": 1 << 20,
                "pid_bytes_below_one_ru": True, "lba_metadata": 0},
        "ru_events": ev,
    }
    for k in m.consistency([row]):
        if "PID" in k["what"] or "placement ID" in k["what"]:
            print(k["what"], "|", "skipped" if "skipped" in k else ("ok" if k["ok"] else "bad"))
"#,
    );
    let want = "['Implicitly Modified Reclaim Unit Handle (placement ID 2)']
raw: per-PID bytes (RUAMW) add up to HBMW | skipped
raw: all bytes on placement ID 0 | ok
['Implicitly Modified Reclaim Unit Handle (placement ID 1)']
raw: per-PID bytes (RUAMW) add up to HBMW | skipped
raw: all bytes on placement ID 0 | skipped
";
    assert_eq!(out, want);
}

/// The drive's media bytes erased (MBE) over a configuration's window is reported, as is
/// none where a status lacks the counter.
#[test]
fn media_bytes_erased_are_the_mbe_delta() {
    let out = with_report(
        r#"
st = lambda hbmw, mbmw, mbe: {"lba_size": 4096, "ru_blocks": 256, "ruhs": [{"pid": 0, "ruamw": 256}], "hbmw": hbmw, "mbmw": mbmw, **({} if mbe is None else {"mbe": mbe})}
print(m.fdp_delta(st(0, 0, "18446744073709551616"), st(4096, 8192, "18446744073709555712"))["erased_bytes"])
print(m.fdp_delta(st(0, 0, None), st(4096, 8192, 1))["erased_bytes"])
"#,
    );
    assert_eq!(out, "4096\nNone\n");
}

/// A drive status without a reclaim unit size, or one that lost a placement ID between the
/// two snapshots, leaves the per-PID bytes unknown, said so, instead of failing the report.
#[test]
fn unknown_per_pid_bytes_are_said_not_fatal() {
    let out = with_report(
        r#"
st = lambda rub, pids: {"lba_size": 4096, "ru_blocks": rub, "ruhs": [{"pid": p, "ruamw": 256} for p in pids], "hbmw": "0", "mbmw": "0"}
for before, after in [(st(0, [0]), st(0, [0])), (st(256, [0, 1]), st(256, [0]))]:
    d = m.fdp_delta(before, after)
    print(d["bytes_by_pid_index"], d["pid_bytes_exact"], d["pid_bytes_unknown"])
"#,
    );
    assert_eq!(
        out,
        "{} False the drive reports no reclaim unit size (RUNS below one block)\n{} False placement ID 1 is not in the drive's status after the run (FDP reconfigured?)\n"
    );
}
