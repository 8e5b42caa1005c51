//! `fdpblk list | stats | name | drive-deltas | features`: what the devices are doing.

use super::server::{foreign_server, serving_daemon, ublk_ids, ublk_owner};
use crate::cmd::CmdResult;
use crate::cli::{IdArgs, ListArgs};
use crate::frontend::{state, target};
use libublk::ctrl::UblkCtrl;
use libublk::sys;
use serde_json::json;
use std::path::Path;

/// The driver's state of device `id` (one word) and what an operator can do about it.
fn dev_state(id: i32, name: Option<&str>) -> (&'static str, Option<String>) {
    match target::ublk_ctrl(id).map(|c| u32::from(c.dev_info().state)) {
        Ok(sys::UBLK_S_DEV_LIVE) => ("live", None),
        Ok(s @ (sys::UBLK_S_DEV_QUIESCED | sys::UBLK_S_DEV_FAIL_IO)) => (
            if s == sys::UBLK_S_DEV_QUIESCED { "quiesced" } else { "fail-io" },
            Some(format!(
                "its daemon died: `fdpblk recover -n {id}` brings it back (under systemd: `systemctl reset-failed fdpblk@{0}; systemctl start fdpblk@{0}`)",
                name.unwrap_or("NAME")
            )),
        ),
        Ok(_) => ("dead", Some(format!("stopped: `fdpblk del -n {id}` deletes it"))),
        Err(_) if !target::device_exists(id) => ("gone", None),
        Err(e) => ("unknown", Some(format!("the ublk driver does not answer ({e}); run as root"))),
    }
}
pub fn list(a: &ListArgs) -> CmdResult {
    let mut out = Vec::new();
    let known = state::state_ids();
    for &id in &known {
        let read = state::read_state(id);
        let (st, mut hint) = dev_state(id, read.as_ref().ok().and_then(|(c, _)| c.name.as_deref()));
        // Not "recover it" where the device is another server's by now.
        if let Some(whose) = read.as_ref().ok().and_then(|(_, d)| foreign_server(id, d)) {
            hint = Some(format!("ublk device {id} {whose}: this state file is left over; `fdpblk del -n {id}` removes it"));
        }
        // The daemon that serves it, which may not be the one its file names yet.
        let serving = read.as_ref().ok().and_then(|_| serving_daemon(id, &read));
        let (cfg, pid) = match read {
            Ok(s) => s,
            Err(e) => {
                // Listed, not hidden: its device may still run (or be deleted with `del`).
                out.push(json!({"id": id, "device": state::bdev_path(id), "state": st, "error": e, "hint": format!("`fdpblk del -n {id}` removes it")}));
                continue;
            }
        };
        let mut v = cfg.to_json();
        v["state"] = json!(st);
        v["hint"] = json!(hint);
        v["pid"] = json!(serving.unwrap_or(pid).pid);
        v["device"] = json!(state::bdev_path(id));
        out.push(v);
    }
    // A ublk device with no state file: another server's, or fdpblk's after its state went
    // (a cleared /run). Listed so that it is not invisible while it holds a device number.
    for id in ublk_ids().into_iter().filter(|id| !known.contains(id)) {
        out.push(json!({
            "id": id,
            "device": state::bdev_path(id),
            "state": dev_state(id, None).0,
            "error": format!("no state file in {}", state::RUN_DIR),
            "hint": ublk_owner(id),
        }));
    }
    if a.json {
        println!("{}", serde_json::Value::Array(out));
    } else if out.is_empty() {
        println!("no fdpblk devices");
    } else {
        for v in out {
            let hint = v["hint"].as_str().map(|h| format!("  ({h})")).unwrap_or_default();
            if let Some(e) = v["error"].as_str() {
                println!("{}  {}  {e}{hint}", v["device"].as_str().unwrap_or(""), v["state"].as_str().unwrap_or(""));
                continue;
            }
            println!(
                "{}  name {}  backing {}  engine {}  policy {}  slot_bytes {}  meta_total_bytes {}  {}{hint}",
                v["device"].as_str().unwrap_or(""),
                v["name"].as_str().unwrap_or("-"),
                v["backing"].as_str().unwrap_or(""),
                v["engine"].as_str().unwrap_or(""),
                v["policy"].as_str().unwrap_or(""),
                if v["geometry"].is_null() { "learning".into() } else { v["geometry"]["slot_bytes"].to_string() },
                if v["geometry"].is_null() { "learning".into() } else { v["geometry"]["meta_total_bytes"].to_string() },
                v["state"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}
/// The daemon's stats file, a JSON object (`stats` adds fields to it; indexing anything else
/// would panic).
fn parse_stats(p: &Path, text: &str) -> Result<serde_json::Value, String> {
    // The daemon rewrites it every half second (atomically): a corrupt one is not fdpblk's.
    let corrupt = |e: &dyn std::fmt::Display| format!("{} is corrupt ({e}); the daemon rewrites it within a second if it runs, see `fdpblk list`", p.display());
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(corrupt(&"not a JSON object")),
        Err(e) => Err(corrupt(&e)),
    }
}
/// The id `-n` gives, or the one of the device added with `--name` (as `del --name` finds it:
/// live, its daemon dead, or a state file left over).
pub fn id_of(number: Option<i32>, name: Option<&str>) -> Result<i32, Box<dyn std::error::Error>> {
    use crate::cmd::up::Found;
    match (number, name) {
        (Some(n), _) => Ok(n),
        (None, Some(name)) => match crate::cmd::up::find(name) {
            Found::Running { id, .. } | Found::Orphaned { id } => Ok(id),
            Found::Stale { cfg } => Ok(cfg.id),
            Found::None => Err(format!("no fdpblk device named {name}; see `fdpblk list`").into()),
        },
        (None, None) => Err("pass -n ID or --name NAME".into()),
    }
}

pub fn stats(a: &IdArgs, json_out: bool) -> CmdResult {
    let p = state::stats_path(a.number);
    let text = std::fs::read_to_string(&p).map_err(|e| format!("no stats for device {} ({}: {e}); is it running? see `fdpblk list`", a.number, p.display()))?;
    let mut v = parse_stats(&p, &text)?;
    let read = state::read_state(a.number);
    // A daemon that died leaves its last figures behind (they stay for `recover`): say so.
    let serving = read.as_ref().ok().and_then(|_| serving_daemon(a.number, &read));
    let daemon_up = serving.is_some();
    // The daemon recovering the device serves before it writes its own stats.
    let previous = serving.filter(|d| !d.wrote_stats(&v));
    let saved = read.ok();
    let name = saved.as_ref().and_then(|(cfg, _)| cfg.name.clone());
    v["daemon_up"] = json!(daemon_up);
    v["stats_of_serving_daemon"] = json!(daemon_up && previous.is_none());
    let age_s = std::fs::metadata(&p).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).map(|d| d.as_secs());
    v["stats_age_s"] = json!(age_s);
    // The drive's own counters since `add`: host vs media bytes (QEMU's drive has no GC).
    // In a child with a deadline: a hung drive must not hold the command (nor its figures).
    let (fdp, drive_error) = match saved.map(|(cfg, _)| state::fdp_deltas_within(&cfg, state::DRIVE_READ_DEADLINE)) {
        Some(Ok(f)) => (f, None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    v["fdp"] = fdp.clone().unwrap_or(serde_json::Value::Null);
    if let Some(e) = &drive_error {
        v["fdp_error"] = json!(e);
    }
    if json_out {
        println!("{v}");
        return Ok(());
    }
    if !daemon_up {
        println!(
            "DAEMON NOT RUNNING: these are its last figures, {} s old; `fdpblk list` shows the device's state",
            age_s.map_or_else(|| "-".to_string(), |a| a.to_string())
        );
    }
    if let Some(d) = previous {
        println!(
            "PREVIOUS DAEMON'S FIGURES (pid {}), {} s old: the daemon now serving the device (pid {d}) has not written its own yet; ask again in a second",
            v["pid"],
            age_s.map_or_else(|| "-".to_string(), |a| a.to_string())
        );
    }
    println!("device {}  engine {}  policy {}", state::bdev_path(a.number), v["engine"].as_str().unwrap_or(""), v["policy"].as_str().unwrap_or(""));
    if let Some(age) = v["state_age_s"].as_f64().filter(|&a| daemon_up && a >= STATE_AGE_HELD_UP_S) {
        println!("STATE THREAD HELD UP: its figures below (checkpoint, slots, deallocation) are {age:.0} s old; it refreshes them at least once a second");
    }
    if let Some(w) = v["backing_writers"].as_array().filter(|w| daemon_up && !w.is_empty()) {
        let w: Vec<&str> = w.iter().filter_map(|s| s.as_str()).collect();
        println!("BACKING WRITTEN BY ANOTHER PROGRAM: {} (stop it; LMCache's device_path must be this device, never the drive)", w.join(", "));
    }
    let l = &v["layout"];
    if let (Some(c), Some(s)) = (l["half_written"]["copy"].as_u64(), l["half_written"]["for_s"].as_u64()) {
        println!(
            "LAYOUT WAITING: LMCache's checkpoint copy {c} has been half-written (its JSON fails its CRC) for {s} s; the layout is learned from LMCache's next whole checkpoint, and {} writes ({} bytes) so far are neither placed by key nor deallocated",
            l["writes_before_layout"], l["bytes_before_layout"]
        );
    } else if l["state"] == "learning" && l["refused"].is_null() {
        println!(
            "LAYOUT LEARNING: no LMCache checkpoint seen yet; {} writes ({} bytes) so far are neither placed by key nor deallocated",
            l["writes_before_layout"], l["bytes_before_layout"]
        );
    }
    if let Some(r) = l["refused"].as_str() {
        println!("LAYOUT REFUSED: {r}");
    }
    let p = &v["pipeline"];
    println!("{:<20} {:>10} {:>16}", "class", "requests", "bytes");
    if let Some(c) = p["classes"].as_object() {
        for (k, n) in c {
            println!("{k:<20} {:>10} {:>16}", n["requests"].as_u64().unwrap_or(0), n["bytes"].as_u64().unwrap_or(0));
        }
    }
    println!("{:<20} {:>16}", "handle", "bytes written");
    if let Some(h) = p["handles"].as_object() {
        for (k, b) in h {
            println!("{k:<20} {:>16}", b.as_u64().unwrap_or(0));
        }
    }
    println!("header waits {}  payload fallbacks {}", p["header_waits"], p["payload_fallbacks"]);
    if let Some(q) = v["queues"].as_array() {
        let per = |k: &str| q.iter().map(|n| n[k].as_u64().unwrap_or(0).to_string()).collect::<Vec<_>>().join(" / ");
        println!("requests per queue {}  most tags waiting for headers at once {}", per("requests"), per("header_wait_peak"));
        let longest_ms = |n: &serde_json::Value| format!("{:.1}", n["held_longest_us"].as_u64().unwrap_or(0) as f64 / 1e3);
        println!(
            "requests held for deallocations per queue {} (longest ms {})",
            per("held_for_trims"),
            q.iter().map(longest_ms).collect::<Vec<_>>().join(" / ")
        );
        if q.iter().any(|n| n["errors"].as_u64().unwrap_or(0) > 0) {
            let last: Vec<&str> = q.iter().filter_map(|n| n["last_error"].as_str()).collect();
            println!("FAILED REQUESTS per queue {} (last: {}); the daemon's log has them", per("errors"), last.join(" / "));
        }
    }
    if let Some(e) = &drive_error {
        println!("DRIVE NOT ANSWERING: {e}");
    }
    if let Some(f) = fdp {
        println!(
            "drive since add{}: host {} bytes, media {} bytes (ratio {}), erased {} bytes",
            if f["drive_stats_reset"] == true { " (since its statistics were reset)" } else { "" },
            f["host_bytes"],
            f["media_bytes"],
            f["media_host_ratio"].as_f64().map_or_else(|| "-".to_string(), |r| format!("{r:.3}")),
            f["erased_bytes"]
        );
    }
    print_watch(&v);
    if !daemon_up {
        // A script that reads only the exit status must not take a dead device for a live one.
        if !target::device_exists(a.number) {
            return Err(format!(
                "the daemon of device {0} is not running and the device is gone (its state file is left over): `fdpblk del -n {0}` removes it",
                a.number
            )
            .into());
        }
        let how = match &name {
            Some(n) => format!(
                "under systemd `systemctl reset-failed fdpblk@{n}; systemctl start fdpblk@{n}` (its own restart does it unless the unit gave up), by hand fdpblk up {n} (or fdpblk recover -n {})",
                a.number
            ),
            None => format!("fdpblk recover -n {}", a.number),
        };
        return Err(format!(
            "the daemon of device {} is not running; recover the device: {how}",
            a.number
        )
        .into());
    }
    Ok(())
}
/// `stats` flags the state thread's figures as held up from this age (it refreshes them at
/// least once a second, after a deallocation round of at most 1 s).
const STATE_AGE_HELD_UP_S: f64 = 5.0;
/// The state thread's part of the stats: LMCache's checkpoints, slots, deallocation.
fn print_watch(v: &serde_json::Value) {
    if v.get("checkpoint_cap_bytes").is_none() {
        return;
    }
    let n = |x: &serde_json::Value| x.as_u64().map_or_else(|| "-".to_string(), |n| n.to_string());
    println!(
        "checkpoint seq {}  age {}s  {} of {} bytes ({} entries; next about {} bytes)",
        n(&v["checkpoint_seq"]),
        v["checkpoint_age_s"].as_f64().map_or_else(|| "-".to_string(), |a| format!("{a:.0}")),
        n(&v["checkpoint_bytes"]),
        n(&v["checkpoint_cap_bytes"]),
        n(&v["checkpoint_entries"]),
        n(&v["checkpoint_estimate_bytes"])
    );
    if let Some(opens) = v["lmcache_opens"].as_u64().filter(|&o| o > 0) {
        println!("LMCache loaded its index {opens} time(s) since this daemon started (restarts, or readers such as fdpblk inspect); {} put(s) made after the checkpoint it loaded were lost to it", n(&v["lmcache_lost_puts"]));
    }
    // A stall whose checkpoint still fits is LMCache's idle rule, also when it is close to the cap.
    let stalled = v["checkpoint_stalled"] == true;
    let past_cap = v["checkpoint_estimate_bytes"].as_u64().zip(v["checkpoint_cap_bytes"].as_u64()).is_some_and(|(e, c)| e >= c);
    if v["overflow_risk"] == true {
        println!(
            "OVERFLOW RISK: LMCache's checkpoint {}; set LMCache's meta_total_bytes to at least {} (a new layout: LMCache starts empty)",
            if stalled && past_cap { "stopped being written: it no longer fits its container" } else { "is close to its container's size" },
            n(&v["meta_total_bytes_needed"])
        );
    }
    if stalled && !past_cap {
        // With the overflow risk raised the estimate is near the cap: either may be the cause.
        let or_overflow = if v["overflow_risk"] == true {
            "; or its checkpoint no longer fits (the estimate is near the cap; LMCache's log then says the payload is too large): the overflow fix above"
        } else {
            ""
        };
        println!(
            "CHECKPOINT STALLED: LMCache writes slots but no checkpoint, and a restart would lose them; it checkpoints only when no I/O has been in flight for 100 ms at its tick: leave it idle moments, or lower meta_checkpoint_interval_sec{or_overflow}"
        );
    }
    if v["writeback_risk"] == true {
        println!(
            "WRITEBACK RISK: LMCache checkpoints about every {}s, but the kernel may hold a dirty page back {}; with buffered writes keep vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs well below LMCache's checkpoint interval",
            v["checkpoint_interval_s"].as_f64().map_or_else(|| "-".to_string(), |a| format!("{a:.1}")),
            v["writeback_delay_s"].as_f64().map_or_else(|| "indefinitely".to_string(), |d| format!("{d:.1}s"))
        );
    }
    let s = &v["slots"];
    println!(
        "slots {} with a header: {} live, {} evicted, {} trimmed, {} unknown; identity history {} of {}, {} returning",
        n(&s["with_header"]),
        n(&s["live"]),
        n(&s["evicted"]),
        n(&s["trimmed"]),
        n(&s["unknown"]),
        n(&s["identity_history"]),
        n(&s["identity_history_capacity"]),
        n(&s["returning"])
    );
    let t = &v["trim"];
    let per: Vec<String> = t["handles"].as_object().map(|h| h.iter().map(|(k, c)| format!("{k}:{c}")).collect()).unwrap_or_default();
    if let Some(why) = t["blocked_by"].as_str() {
        println!("DEALLOCATION BLOCKED: {why}");
    }
    if let Some(why) = t["paused_by"].as_str() {
        println!("DEALLOCATION PAUSED: {why}");
    }
    if let Some(why) = t["off_because"].as_str() {
        println!("DEALLOCATION OFF: {why}");
    }
    println!(
        "deallocation {}: {} trims, {} bytes (per handle {}), {} evictions seen; stale tails {} ({} early), {} bytes; unwritten slots {}, {} bytes",
        deallocation_state(t),
        n(&t["trims"]),
        n(&t["trim_bytes"]),
        if per.is_empty() { "-".to_string() } else { per.join(" ") },
        n(&t["evictions"]),
        n(&t["tail_trims"]),
        n(&t["early_tail_trims"]),
        n(&t["tail_trim_bytes"]),
        n(&t["reclaimed"]),
        n(&t["reclaimed_bytes"])
    );
    let o = &v["own_state"];
    println!(
        "own state: {} ({} cycles, {} bytes written){}",
        if o["persisted"] == true { "saved in the reserved tail" } else { "in memory only" },
        n(&o["cycles"]),
        n(&o["bytes_written"]),
        match (o["loaded"] == true, o["loaded_clean"] == true, o["loaded_note"].as_str()) {
            (true, true, None) => "; loaded from a clean stop".to_string(),
            (true, true, Some(note)) => format!("; loaded from a clean stop: {note}"),
            // Why a saved state was not trusted, or not used (a bad sector, a lost write).
            (true, false, Some(note)) => format!("; loaded, its confirmations not trusted: {note}"),
            (true, false, None) => "; loaded after an unclean stop".to_string(),
            (false, _, Some(note)) => format!("; started fresh: {note}"),
            (false, _, None) => String::new(),
        }
    );
}
/// `on`, `off` (--no-trim), `on but blocked` (LMCache's checkpoint disagrees with the layout)
/// or `on but paused` (buffered writes the kernel may hold back past a checkpoint interval).
fn deallocation_state(trim: &serde_json::Value) -> &'static str {
    match (trim["enabled"] == true, trim["blocked_by"].is_string(), trim["paused_by"].is_string()) {
        (false, _, _) => "off",
        (true, true, _) => "on but blocked",
        (true, false, true) => "on but paused",
        (true, false, false) => "on",
    }
}
/// For `stats`, in a child: the drive's FDP counters since `add` of device `id` as JSON, or
/// nothing where it has none.
pub fn drive_deltas(id: i32) -> CmdResult {
    // Its own name in `ps` and for fdpblk's own checks of who holds a backing.
    if let Ok(name) = std::ffi::CString::new(state::DRIVE_CHILD_NAME) {
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
        unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
    }
    let (cfg, _) = state::read_state(id)?;
    if let Some(v) = state::fdp_deltas(&cfg) {
        println!("{v}");
    }
    Ok(())
}
/// For udev: prints the stable name of device `id`, or fails if it has none.
pub fn name(id: i32) -> CmdResult {
    let (cfg, daemon) = state::read_state(id)?;
    if let Some(whose) = foreign_server(id, &daemon) {
        return Err(format!("ublk device {id} {whose}; its state file is left over").into());
    }
    match cfg.name {
        Some(n) => {
            println!("{n}");
            Ok(())
        }
        None => Err(format!("device {id} has no --name").into()),
    }
}
pub fn features(json_out: bool) -> CmdResult {
    const NAMES: [&str; 21] = [
        "ZERO_COPY", "URING_CMD_COMP_IN_TASK", "NEED_GET_DATA", "USER_RECOVERY", "USER_RECOVERY_REISSUE",
        "UNPRIVILEGED_DEV", "CMD_IOCTL_ENCODE", "USER_COPY", "ZONED", "USER_RECOVERY_FAIL_IO", "UPDATE_SIZE",
        "AUTO_BUF_REG", "QUIESCE", "PER_IO_DAEMON", "BUF_REG_OFF_DAEMON", "BATCH_IO", "INTEGRITY",
        "SAFE_STOP_DEV", "NO_AUTO_PART_SCAN", "SHMEM_ZC", "BIT20",
    ];
    const USED: [&str; 2] = ["USER_RECOVERY", "USER_RECOVERY_REISSUE"];
    if !Path::new("/dev/ublk-control").exists() {
        return Err("no ublk driver: /dev/ublk-control is missing; run `modprobe ublk_drv`".into());
    }
    // Not root: the control node does not open, which is not a driver without the command.
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/ublk-control") {
        return Err(format!("cannot open /dev/ublk-control ({e}); run as root").into());
    }
    // Linux < 6.5 has no GET_FEATURES: say so rather than print "no features".
    let f = UblkCtrl::get_features().ok_or("the ublk driver does not report its features; Linux >= 6.5 does")?;
    let names: Vec<&str> = (0..NAMES.len()).filter(|b| f & (1u64 << b) != 0).map(|b| NAMES[b]).collect();
    let mut streams = serde_json::Map::new();
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if let Ok(m) = std::fs::read_to_string(e.path().join("queue/max_write_streams")) {
            streams.insert(n, json!(m.trim().parse::<u64>().unwrap_or(0)));
        }
    }
    if json_out {
        println!("{}", json!({"ublk_features": f, "names": names, "used": USED, "write_streams": streams}));
    } else {
        println!("ublk driver features {f:#x}: {}", names.join(" "));
        println!("fdpblk uses: {}", USED.join(" "));
        if streams.is_empty() {
            println!("block write streams: not supported by this kernel (needs Linux >= 6.16)");
        } else {
            for (n, m) in streams {
                println!("block write streams: {n} max_write_streams {m}");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_deallocation_is_not_called_on() {
        assert_eq!(deallocation_state(&json!({"enabled": true, "blocked_by": null})), "on");
        assert_eq!(deallocation_state(&json!({"enabled": true, "blocked_by": "slot_bytes differs"})), "on but blocked");
        assert_eq!(deallocation_state(&json!({"enabled": false, "blocked_by": null})), "off");
        assert_eq!(deallocation_state(&json!({"enabled": true, "blocked_by": null, "paused_by": "buffered writes"})), "on but paused");
    }

    /// A stats file that is valid JSON but not an object is as corrupt as one that is not JSON.
    #[test]
    fn a_stats_file_that_is_not_an_object_is_corrupt_not_a_panic() {
        let p = Path::new("/run/fdpblk/0.stats.json");
        for text in ["[]", "3", "null", "\"x\"", "{", ""] {
            let e = parse_stats(p, text).unwrap_err();
            assert!(e.starts_with("/run/fdpblk/0.stats.json is corrupt (") && e.contains("see `fdpblk list`"), "{text}: {e}");
        }
        assert!(parse_stats(p, r#"{"io":{}}"#).unwrap()["io"].is_object());
    }
}
