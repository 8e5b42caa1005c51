//! `fdpblk metrics` and `fdpblk stats --prometheus`: the counters of `fdpblk stats` in
//! Prometheus' text exposition format (version 0.0.4).
//!
//! Every metric is named `fdpblk_…` with its unit in the name (`_bytes`, `_seconds`;
//! counters end in `_total`) and carries the labels `id` (the N of /dev/ublkbN) and `name`
//! (the stable name, empty without one), plus `class`, `op`, `handle` or `state` where the
//! stats have one. All devices go into one document: each metric family is written once, with
//! its `# HELP` and `# TYPE`, and all its samples together.
//!
//! `--textfile FILE` writes the document for node_exporter's textfile collector: to a
//! temporary file in the same directory, then renamed over FILE, so the collector never reads
//! half of it. A device whose daemon died shows only `fdpblk_device_info` and
//! `fdpblk_daemon_up 0` (its last counters are stale).

use super::CmdResult;
use crate::frontend::state;
use clap::Args;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct MetricsArgs {
    /// Write to FILE (atomically: a temporary file renamed over it) for node_exporter's
    /// textfile collector, every --interval seconds; without it, print once to stdout.
    #[arg(long)]
    pub textfile: Option<PathBuf>,
    /// Seconds between two writes of --textfile.
    #[arg(long, default_value_t = 15)]
    pub interval: u64,
    /// Write --textfile once and exit.
    #[arg(long)]
    pub once: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

struct Family {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    samples: Vec<(Vec<(&'static str, String)>, f64)>,
}

/// Metric families in first-use order, each with its samples.
#[derive(Default)]
pub struct Registry {
    families: Vec<Family>,
}

impl Registry {
    fn add(&mut self, name: &'static str, help: &'static str, kind: Kind, labels: Vec<(&'static str, String)>, value: f64) {
        let i = match self.families.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.families.push(Family { name, help, kind, samples: Vec::new() });
                self.families.len() - 1
            }
        };
        debug_assert_eq!(self.families[i].kind, kind, "{name}");
        self.families[i].samples.push((labels, value));
    }

    /// The text exposition document.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for f in &self.families {
            let _ = writeln!(out, "# HELP {} {}", f.name, f.help.replace('\\', "\\\\").replace('\n', "\\n"));
            let _ = writeln!(out, "# TYPE {} {}", f.name, if f.kind == Kind::Counter { "counter" } else { "gauge" });
            for (labels, v) in &f.samples {
                out.push_str(f.name);
                if !labels.is_empty() {
                    out.push('{');
                    for (i, (k, val)) in labels.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        let _ = write!(out, "{k}=\"{}\"", escape_label(val));
                    }
                    out.push('}');
                }
                let _ = writeln!(out, " {}", format_value(*v));
            }
        }
        out
    }

    /// Adds the metrics of one device: its saved config (`cfg`, from `/run/fdpblk/ID.json`),
    /// whether its daemon runs, its stats (`/run/fdpblk/ID.stats.json`) and their age in
    /// seconds, and the drive's FDP deltas since `add`.
    pub fn add_device(&mut self, id: i32, cfg: Option<&Value>, daemon_up: bool, stats: Option<&Value>, stats_age_s: Option<f64>, fdp: Option<&Value>) {
        use Kind::{Counter, Gauge};
        let name = cfg
            .and_then(|c| c["name"].as_str())
            .or_else(|| stats.and_then(|s| s["name"].as_str()))
            .unwrap_or("")
            .to_string();
        let base = || vec![("id", id.to_string()), ("name", name.clone())];
        let with = |k: &'static str, v: &str| {
            let mut l = base();
            l.push((k, v.to_string()));
            l
        };
        let s = |v: &Value, k: &str| v[k].as_str().unwrap_or("").to_string();
        let mut info = base();
        info.push(("device", state::bdev_path(id)));
        if let Some(c) = cfg {
            info.extend([("backing", s(c, "backing")), ("engine", s(c, "engine")), ("policy", s(c, "policy"))]);
        } else if let Some(st) = stats {
            info.extend([("backing", String::new()), ("engine", s(st, "engine")), ("policy", s(st, "policy"))]);
        }
        self.add("fdpblk_device_info", "An fdpblk device: its ublk block device, backing, engine and placement policy (always 1).", Gauge, info, 1.0);
        self.add(
            "fdpblk_daemon_up",
            "1 while the device's daemon runs; 0 when it died and the device waits for recovery (its systemd unit's restart, `fdpblk up` or `fdpblk recover`), or, where `fdpblk list` says gone, its state file outlived the device (`fdpblk del -n ID` removes it).",
            Gauge,
            base(),
            if daemon_up { 1.0 } else { 0.0 },
        );
        // Also without stats that parse: a daemon that stopped writing them is what the age
        // is there to alert on.
        if let Some(age) = stats_age_s.filter(|_| daemon_up) {
            self.add("fdpblk_stats_age_seconds", "Seconds since the daemon last wrote its stats, or since it started when it has written none (it writes them at least every second; more means it is stuck).", Gauge, base(), age);
        }
        let Some(st) = stats.filter(|_| daemon_up) else { return };
        let num = |v: &Value| v.as_f64();
        let g = &st["geometry"];
        for (metric, key, help) in [
            ("fdpblk_layout_slot_bytes", "slot_bytes", "LMCache's slot_bytes on this device."),
            ("fdpblk_layout_meta_total_bytes", "meta_total_bytes", "LMCache's meta_total_bytes on this device."),
            ("fdpblk_layout_capacity_bytes", "capacity_bytes", "LMCache's effective capacity on this device."),
            ("fdpblk_layout_slots", "max_slots", "Slots in LMCache's layout."),
        ] {
            if let Some(v) = num(&g[key]) {
                self.add(metric, help, Gauge, base(), v);
            }
        }
        let p = &st["pipeline"];
        if let Some(classes) = p["classes"].as_object() {
            for (class, c) in classes {
                if let Some(v) = num(&c["requests"]) {
                    self.add(
                        "fdpblk_class_requests_total",
                        "Requests (reads and writes) that touched each part of LMCache's layout (a request counts once per class it touches).",
                        Counter,
                        with("class", class),
                        v,
                    );
                }
            }
            for (class, c) in classes {
                if let Some(v) = num(&c["bytes"]) {
                    self.add("fdpblk_class_bytes_total", "Bytes read and written per part of LMCache's layout.", Counter, with("class", class), v);
                }
            }
        }
        if let Some(ops) = p["ops"].as_object() {
            for (op, c) in ops {
                if let Some(v) = num(&c["requests"]) {
                    self.add("fdpblk_io_requests_total", "Requests served per operation (counted once the drive completed them; failed ones are in fdpblk_queue_errors_total).", Counter, with("op", op), v);
                }
            }
            for (op, c) in ops {
                if let Some(v) = num(&c["bytes"]) {
                    self.add("fdpblk_io_bytes_total", "Bytes served per operation (flushes carry none).", Counter, with("op", op), v);
                }
            }
        }
        if let Some(q) = st["queues"].as_array() {
            for (i, n) in q.iter().enumerate() {
                if let Some(v) = num(&n["requests"]) {
                    self.add("fdpblk_queue_requests_total", "Requests each ublk queue took (all operations).", Counter, with("queue", &i.to_string()), v);
                }
            }
            for (i, n) in q.iter().enumerate() {
                if let Some(v) = num(&n["errors"]) {
                    self.add("fdpblk_queue_errors_total", "Requests each ublk queue failed back to the device's user (drive errors, a vanished namespace).", Counter, with("queue", &i.to_string()), v);
                }
            }
            for (i, n) in q.iter().enumerate() {
                if let Some(v) = num(&n["held_for_trims"]) {
                    self.add("fdpblk_queue_held_for_trims_total", "Requests each ublk queue held until fdpblk's deallocation of their slot (or zeroing of their checkpoint container) landed.", Counter, with("queue", &i.to_string()), v);
                }
            }
            for (i, n) in q.iter().enumerate() {
                if let Some(v) = num(&n["held_longest_us"]) {
                    self.add("fdpblk_queue_held_longest_seconds", "The longest any request of each ublk queue was held for a deallocation or zeroing, one still held included (a drive slow to deallocate shows here).", Gauge, with("queue", &i.to_string()), v / 1e6);
                }
            }
            for (i, n) in q.iter().enumerate() {
                if let Some(v) = num(&n["header_wait_peak"]) {
                    self.add("fdpblk_queue_header_wait_peak", "The most tags of each ublk queue that held payloads for their headers at once (at most half its depth).", Gauge, with("queue", &i.to_string()), v);
                }
            }
        }
        // Every handle of the policy has a series from 0 (the stats list the handles written),
        // so that rate() sees a handle's first bytes.
        let policy_handles = crate::place::policy_by_name(st["policy"].as_str().unwrap_or("")).map_or(0, |p| p.handles());
        let written = p["handles"].as_object();
        let handles: std::collections::BTreeSet<String> =
            written.into_iter().flat_map(|w| w.keys().cloned()).chain((0..policy_handles).map(|h| h.to_string())).collect();
        for handle in &handles {
            if let Some(v) = written.and_then(|w| w.get(handle)).map_or(Some(0.0), num) {
                self.add("fdpblk_handle_written_bytes_total", "Bytes written per placement handle (the policy's logical handle), counted once the drive completed their write.", Counter, with("handle", handle), v);
            }
        }
        if let Some(v) = num(&p["header_waits"]) {
            self.add("fdpblk_header_waits_total", "Slot payload writes held until their slot header arrived.", Counter, base(), v);
        }
        if let Some(v) = num(&p["payload_fallbacks"]) {
            self.add(
                "fdpblk_payload_fallbacks_total",
                "Slot payload writes placed without their header: after --header-wait-us, when half the queue's tags already held waiting payloads, and a longer put's bytes past the old payload ahead of its header.",
                Counter,
                base(),
                v,
            );
        }
        // The state thread: LMCache's checkpoints, slots, deallocation, own state.
        for (metric, key, help) in [
            (
                "fdpblk_state_age_seconds",
                "state_age_s",
                "Seconds since the daemon's state thread (checkpoints, deallocation, own state) last refreshed its figures; it does at least once a second, after a deallocation round of at most 1 s, so a few seconds more means it is held up (a drive slow to flush or deallocate) and the figures below are that old.",
            ),
            ("fdpblk_checkpoint_seq", "checkpoint_seq", "Sequence number of LMCache's newest checkpoint."),
            ("fdpblk_checkpoint_age_seconds", "checkpoint_age_s", "Seconds since fdpblk saw LMCache's newest checkpoint written (across daemon restarts, through its own state), or first found it on the device."),
            ("fdpblk_checkpoint_payload_bytes", "checkpoint_bytes", "JSON bytes of LMCache's newest checkpoint."),
            ("fdpblk_checkpoint_entries", "checkpoint_entries", "Entries in LMCache's newest checkpoint."),
            ("fdpblk_checkpoint_cap_bytes", "checkpoint_cap_bytes", "Largest checkpoint JSON LMCache writes; a larger one is skipped."),
            ("fdpblk_checkpoint_estimate_bytes", "checkpoint_estimate_bytes", "fdpblk's estimate of LMCache's next checkpoint."),
            (
                "fdpblk_checkpoint_needed_meta_total_bytes",
                "meta_total_bytes_needed",
                "The meta_total_bytes LMCache needs so that its checkpoint fits (present while the overflow risk is raised).",
            ),
        ] {
            if let Some(v) = num(&st[key]) {
                self.add(metric, help, Gauge, base(), v);
            }
        }
        let flag = |v: &Value| v.as_bool().map(|b| if b { 1.0 } else { 0.0 });
        if let Some(v) = flag(&st["overflow_risk"]) {
            self.add(
                "fdpblk_checkpoint_overflow_risk",
                "1 when LMCache's next checkpoint is about to exceed its container (it would be skipped).",
                Gauge,
                base(),
                v,
            );
        }
        if let Some(v) = flag(&st["checkpoint_stalled"]) {
            self.add("fdpblk_checkpoint_stalled", "1 when slot writes go on but LMCache's checkpoints stopped.", Gauge, base(), v);
        }
        if let Some(w) = st["backing_writers"].as_array() {
            self.add(
                "fdpblk_backing_foreign_writers",
                "Programs other than fdpblk holding the backing open for writing (LMCache pointed at the drive itself): their writes land over LMCache's slots and fdpblk's own state.",
                Gauge,
                base(),
                w.len() as f64,
            );
        }
        if let Some(v) = num(&st["lmcache_opens"]) {
            self.add(
                "fdpblk_lmcache_opens_total",
                "LMCache index loads this daemon saw (both checkpoint header blocks read in a row: a LMCache start, or another reader such as fdpblk inspect of the device).",
                Counter,
                base(),
                v,
            );
        }
        if let Some(v) = num(&st["lmcache_lost_puts"]) {
            self.add(
                "fdpblk_lmcache_lost_puts_total",
                "Puts a LMCache that opened the device again had made after the checkpoint it loaded: lost to it.",
                Counter,
                base(),
                v,
            );
        }
        if let Some(v) = flag(&st["writeback_risk"]) {
            self.add(
                "fdpblk_writeback_risk",
                "1 when the kernel may hold a dirty page back as long as LMCache's checkpoint interval (a concern for buffered writes).",
                Gauge,
                base(),
                v,
            );
        }
        let sl = &st["slots"];
        for state in ["unknown", "live", "evicted", "trimmed"] {
            if let Some(v) = num(&sl[state]) {
                self.add(
                    "fdpblk_slots",
                    "Slots with a header, by state (unknown: not yet in a checkpoint; live; evicted; trimmed).",
                    Gauge,
                    with("state", state),
                    v,
                );
            }
        }
        for (metric, key, help, kind) in [
            ("fdpblk_slots_with_header", "with_header", "Slots whose header fdpblk has seen.", Gauge),
            ("fdpblk_slots_confirmed", "confirmed", "Slots whose contents a checkpoint confirmed.", Gauge),
            ("fdpblk_identity_history_entries", "identity_history", "Identities in the history of keys that left their slot.", Gauge),
            ("fdpblk_identity_history_capacity", "identity_history_capacity", "Capacity of the identity history.", Gauge),
            ("fdpblk_returning_puts_total", "returning", "Puts of a key found in the identity history (a key that came back).", Counter),
        ] {
            if let Some(v) = num(&sl[key]) {
                self.add(metric, help, kind, base(), v);
            }
        }
        let t = &st["trim"];
        if let Some(v) = flag(&t["enabled"]) {
            self.add("fdpblk_trim_enabled", "1 when fdpblk deallocates the slots LMCache evicted (0 with --no-trim).", Gauge, base(), v);
        }
        if !t.is_null() {
            self.add(
                "fdpblk_trim_blocked",
                "1 while deallocation is off because LMCache's checkpoint disagrees with fdpblk's layout (`fdpblk stats` says why).",
                Gauge,
                base(),
                if t["blocked_by"].is_string() { 1.0 } else { 0.0 },
            );
            self.add(
                "fdpblk_trim_paused",
                "1 while deallocation is paused: LMCache writes through the page cache and the kernel may hold a dirty page back as long as its checkpoint interval (`fdpblk stats` says why).",
                Gauge,
                base(),
                if t["paused_by"].is_string() { 1.0 } else { 0.0 },
            );
        }
        if let Some(state) = st["layout"]["state"].as_str() {
            self.add(
                "fdpblk_layout_learning",
                "1 while fdpblk has no usable LMCache checkpoint to learn the layout from (writes are neither placed by key nor deallocated).",
                Gauge,
                base(),
                if state == "learning" { 1.0 } else { 0.0 },
            );
            self.add(
                "fdpblk_layout_half_written",
                "1 while the layout waits on an LMCache checkpoint copy that has been half-written for 2 min or more (LMCache crashed writing it; nothing is learned until its next checkpoint).",
                Gauge,
                base(),
                if st["layout"]["half_written"].is_object() { 1.0 } else { 0.0 },
            );
        }
        // Counters restart at 0 with each daemon (also after a recovery), as Prometheus
        // expects: the lifetime values `fdpblk stats` shows come back from the drive and can
        // go back by what a crash lost.
        let since = &st["since_start"];
        // Every handle has a series from 0, so that rate() sees its first trims.
        if let Some(h) = since["trim_handles"].as_object() {
            let handles: std::collections::BTreeSet<&String> = h.keys().chain(&handles).collect();
            for handle in handles {
                if let Some(v) = h.get(handle).map_or(Some(0.0), num) {
                    self.add("fdpblk_trims_total", "Slot deallocations per placement handle, since the daemon started.", Counter, with("handle", handle), v);
                }
            }
        }
        for (metric, key, help) in [
            ("fdpblk_trim_bytes_total", "trim_bytes", "Bytes of slots deallocated, since the daemon started."),
            ("fdpblk_evictions_total", "evictions", "Slots LMCache evicted, as its checkpoints show, since the daemon started."),
            ("fdpblk_own_state_written_bytes_total", "own_state_bytes", "Bytes fdpblk wrote for its own state in the reserved tail, since the daemon started."),
            ("fdpblk_own_state_cycles_total", "own_state_cycles", "Own-state write cycles, since the daemon started."),
        ] {
            if let Some(v) = num(&since[key]) {
                self.add(metric, help, Counter, base(), v);
            }
        }
        for (metric, key, help) in [
            ("fdpblk_tail_trims_total", "tail_trims", "Stale tails deallocated: bytes past a slot's payload that earlier, longer contents left."),
            ("fdpblk_early_tail_trims_total", "early_tail_trims", "Stale tails deallocated before a checkpoint confirmed the slot (once the new header was durable)."),
            ("fdpblk_tail_trim_bytes_total", "tail_trim_bytes", "Bytes of stale tails deallocated."),
            ("fdpblk_unwritten_slots_reclaimed_total", "reclaimed", "Slots deallocated that no run of fdpblk saw written and no checkpoint lists (data from before)."),
            ("fdpblk_early_evictions_total", "early_evictions", "Evicted slots deallocated once LMCache's newest checkpoint no longer listed them."),
            ("fdpblk_containers_invalidated_total", "containers_invalidated", "Older checkpoint copies whose header fdpblk zeroed to deallocate their slots or stale tails early."),
        ] {
            if let Some(v) = num(&t[key]) {
                self.add(metric, help, Counter, base(), v);
            }
        }
        if let Some(f) = fdp.filter(|f| f.is_object()) {
            for (metric, key, help) in [
                ("fdpblk_drive_host_written_bytes_total", "host_bytes", "The drive's host bytes with metadata written (FDP HBMW) since the device was added."),
                ("fdpblk_drive_media_written_bytes_total", "media_bytes", "The drive's media bytes with metadata written (FDP MBMW) since the device was added."),
                ("fdpblk_drive_media_erased_bytes_total", "erased_bytes", "The drive's media bytes erased (FDP MBE) since the device was added."),
            ] {
                if let Some(v) = num(&f[key]) {
                    self.add(metric, help, Counter, base(), v);
                }
            }
        }
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 9.007_199_254_740_992e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// One device, read from `/run/fdpblk` (no state file: an error that names `fdpblk list`).
fn collect(reg: &mut Registry, id: i32) -> Result<(), String> {
    let state_text = std::fs::read_to_string(state::state_path(id)).map_err(|e| {
        format!("no fdpblk device {id} ({}: {e}); see `fdpblk list`", state::state_path(id).display())
    })?;
    // A file that does not parse gets read_state's message, which names the fix.
    let saved: Value = serde_json::from_str(&state_text).map_err(|e| state::read_state(id).err().unwrap_or_else(|| format!("{} is corrupt: {e}", state::state_path(id).display())))?;
    let daemon = Some(state::Daemon::from_state(&saved)).filter(state::Daemon::alive).or_else(|| super::device::serving_daemon(id, &state::read_state(id)));
    let up = daemon.is_some();
    let stats: Option<Value> = std::fs::read_to_string(state::stats_path(id)).ok().and_then(|t| serde_json::from_str(&t).ok());
    // The stats file's age; before the daemon's first one, that of its state file (written at
    // its start, and again when it learns the layout or is recovered). Stats a dead daemon
    // left, before the one recovering its device wrote its own, are not shown as current:
    // their age is the serving daemon's since it started.
    let age_of = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok().map(|t| t.elapsed().map_or(0.0, |d| d.as_secs_f64().round()));
    let (stats, age) = current_stats(daemon.as_ref(), stats, || age_of(&state::stats_path(id)), || age_of(&state::state_path(id)));
    let fdp = match state::read_state(id) {
        // Through a child process: a thread of this one stuck in an NVMe command would hold
        // up its exit (`--once`, `stats --prometheus`) until the kernel gave up on the drive.
        Ok((cfg, _)) if up => drive_read_within(id, move || state::fdp_deltas_within(&cfg, DRIVE_CHILD_PATIENCE).ok().flatten(), state::DRIVE_READ_DEADLINE),
        _ => None,
    };
    reg.add_device(id, Some(&saved["config"]), up, stats.as_ref().filter(|s| s.is_object()), age, fdp.as_ref());
    Ok(())
}

/// The stats to show for a device and their age in seconds: the stats file's (`file_age`) or,
/// before there is one, the state file's (`state_age`). Stats that the daemon serving the
/// device (`daemon`) did not write, a dead one's left while its successor starts, are not
/// shown, and their age is the serving daemon's since it started.
fn current_stats(daemon: Option<&state::Daemon>, stats: Option<Value>, file_age: impl Fn() -> Option<f64>, state_age: impl Fn() -> Option<f64>) -> (Option<Value>, Option<f64>) {
    match (daemon, stats) {
        (Some(d), Some(st)) if !d.wrote_stats(&st) => (None, d.running_s().or_else(state_age)),
        (_, st) => (st, file_age().or_else(state_age)),
    }
}

/// How long a pass's child reading a drive is given before it is killed: past the kernel's
/// NVMe timeouts and a controller reset. Later passes skip the drive meanwhile.
const DRIVE_CHILD_PATIENCE: Duration = Duration::from_secs(600);

/// Runs `read` (a drive's FDP statistics for device `id`) on a thread of its own and waits
/// up to `deadline`: a drive that hangs or resets (NVMe commands wait up to the kernel's
/// timeout, a minute) costs its device's drive series, not every device's metrics. While
/// such a read is still in flight, later passes leave that drive out without asking again.
fn drive_read_within<F>(id: i32, read: F, deadline: Duration) -> Option<Value>
where
    F: FnOnce() -> Option<Value> + Send + 'static,
{
    use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, TryRecvError};
    static IN_FLIGHT: std::sync::Mutex<Vec<(i32, Receiver<Option<Value>>)>> = std::sync::Mutex::new(Vec::new());
    let mut in_flight = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = in_flight.iter().position(|(d, _)| *d == id) {
        match in_flight[i].1.try_recv() {
            Err(TryRecvError::Empty) => return None,
            // Answered at last, an interval late: read afresh.
            _ => drop(in_flight.swap_remove(i)),
        }
    }
    let (tx, rx) = channel();
    let spawned = std::thread::Builder::new().name("fdpblk-drive".into()).spawn(move || {
        let _ = tx.send(read());
    });
    if spawned.is_err() {
        return None;
    }
    match rx.recv_timeout(deadline) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => {
            tracing::warn!(
                "device {id}: its drive did not answer for its FDP statistics within {} s (a hung or resetting controller? see `dmesg`); its fdpblk_drive_* series are left out until it does",
                deadline.as_secs()
            );
            in_flight.push((id, rx));
            None
        }
        Err(RecvTimeoutError::Disconnected) => None,
    }
}

/// Every device's metrics. Why a device could not be read (a corrupt state file) is logged
/// once while it stays the same, not at every pass of a long-running exporter.
pub fn all() -> Registry {
    static LAST_ERRORS: std::sync::Mutex<BTreeMap<i32, String>> = std::sync::Mutex::new(BTreeMap::new());
    let mut reg = Registry::default();
    let ids = state::state_ids();
    reg.add("fdpblk_devices", "fdpblk devices on this host (with a state file under /run/fdpblk).", Kind::Gauge, Vec::new(), ids.len() as f64);
    let mut last = LAST_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    last.retain(|id, _| ids.contains(id));
    for id in ids {
        let r = collect(&mut reg, id);
        if let (true, Err(e)) = (new_error(&mut last, id, r.as_ref().err()), r) {
            tracing::warn!("{e} (said once while it lasts)");
        }
    }
    reg
}

/// Notes device `id`'s outcome in `last`: whether `err` is an error not logged before (a
/// success forgets the device's last one).
fn new_error(last: &mut BTreeMap<i32, String>, id: i32, err: Option<&String>) -> bool {
    match err {
        None => {
            last.remove(&id);
            false
        }
        Some(e) => last.insert(id, e.clone()).as_ref() != Some(e),
    }
}

/// `fdpblk stats -n ID --prometheus`.
pub fn print_device(id: i32) -> CmdResult {
    let mut reg = Registry::default();
    collect(&mut reg, id)?;
    print!("{}", reg.render());
    Ok(())
}

pub fn run(a: &MetricsArgs) -> CmdResult {
    let Some(path) = &a.textfile else {
        print!("{}", all().render());
        return Ok(());
    };
    if path.extension().and_then(|e| e.to_str()) != Some("prom") {
        return Err(format!("--textfile {}: node_exporter's textfile collector reads only *.prom files; name it e.g. fdpblk.prom", path.display()).into());
    }
    if a.interval == 0 && !a.once {
        return Err("--interval must be at least 1 second (or pass --once)".into());
    }
    // The collector's directory exists where node_exporter runs: a missing one is a typo.
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(format!("--textfile {}: no directory {}; give node_exporter's --collector.textfile.directory", path.display(), dir.display()).into());
    }
    if path.is_dir() {
        return Err(format!("--textfile {} is a directory: give a file in it, e.g. {}", path.display(), path.join("fdpblk.prom").display()).into());
    }
    // What an exporter killed mid-write left there.
    state::remove_stale_temps(path);
    loop {
        // The temporary file is `fdpblk.prom.tmp.PID.N` beside `fdpblk.prom`: not a *.prom,
        // so the collector skips it.
        state::write_atomic(path, all().render().as_bytes()).map_err(|e| {
            format!("cannot write {}: {e}; check that directory's permissions and free space, or pick another --textfile", path.display())
        })?;
        if a.once {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(a.interval));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::{HashMap, HashSet};

    /// A sample's labels, name and value, in the order written.
    type Labels = Vec<(String, String)>;

    fn valid_metric_name(n: &str) -> bool {
        let mut c = n.chars();
        matches!(c.next(), Some(ch) if ch.is_ascii_alphabetic() || ch == '_' || ch == ':')
            && c.all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == ':')
    }

    fn valid_label_name(n: &str) -> bool {
        let mut c = n.chars();
        matches!(c.next(), Some(ch) if ch.is_ascii_alphabetic() || ch == '_')
            && c.all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
            && !n.starts_with("__")
    }

    #[test]
    fn a_device_error_is_logged_once_while_it_lasts() {
        let mut last = BTreeMap::new();
        let (a, b) = ("state file 3 is corrupt".to_string(), "state file 3 is corrupt: other".to_string());
        assert!(new_error(&mut last, 3, Some(&a)));
        assert!(!new_error(&mut last, 3, Some(&a)), "said again at the next pass");
        assert!(new_error(&mut last, 4, Some(&a)), "another device's");
        assert!(new_error(&mut last, 3, Some(&b)), "a changed error");
        assert!(!new_error(&mut last, 3, None));
        assert!(new_error(&mut last, 3, Some(&b)), "back after a success");
    }

    /// Parses `{a="x",b="y"}` (after the name); returns the labels and the rest of the line.
    fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
        let mut labels = Vec::new();
        let Some(mut rest) = s.strip_prefix('{') else { return Ok((labels, s)) };
        loop {
            if let Some(r) = rest.strip_prefix('}') {
                return Ok((labels, r));
            }
            let eq = rest.find('=').ok_or("label without =")?;
            let name = &rest[..eq];
            if !valid_label_name(name) {
                return Err(format!("bad label name {name:?}"));
            }
            rest = rest[eq + 1..].strip_prefix('"').ok_or("label value not quoted")?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next() {
                    None => return Err("unterminated label value".into()),
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        Some((_, 'n')) => value.push('\n'),
                        other => return Err(format!("bad escape {other:?} in a label value")),
                    },
                    Some((_, '\n')) => return Err("raw newline in a label value".into()),
                    Some((_, c)) => value.push(c),
                }
            };
            if labels.iter().any(|(n, _): &(String, String)| n == name) {
                return Err(format!("label {name} twice"));
            }
            labels.push((name.to_string(), value));
            rest = &rest[end + 1..];
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
            } else if !rest.starts_with('}') {
                return Err("labels not separated by ,".into());
            }
        }
    }

    fn parse_value(v: &str) -> Result<f64, String> {
        match v {
            "NaN" => Ok(f64::NAN),
            "+Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            _ => v.parse::<f64>().map_err(|_| format!("bad value {v:?}")),
        }
    }

    /// Checks a document against the text exposition format (0.0.4) and this project's
    /// conventions; returns the samples by `name{sorted labels}`.
    fn check_exposition(doc: &str) -> Result<HashMap<String, f64>, String> {
        if !doc.is_empty() && !doc.ends_with('\n') {
            return Err("the document must end with a newline".into());
        }
        let mut types: HashMap<String, String> = HashMap::new();
        let mut helps: HashSet<String> = HashSet::new();
        let mut done: HashSet<String> = HashSet::new(); // families whose block has ended
        let mut current: Option<String> = None;
        let mut samples = HashMap::new();
        for (n, line) in doc.lines().enumerate() {
            let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
            if line.is_empty() {
                return Err(at("empty line".into()));
            }
            let family = if let Some(c) = line.strip_prefix('#') {
                let mut parts = c.trim_start().splitn(3, ' ');
                let (kw, name, rest) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next());
                match kw {
                    "HELP" => {
                        let text = rest.unwrap_or("");
                        let mut it = text.chars();
                        while let Some(ch) = it.next() {
                            if ch == '\\' && !matches!(it.next(), Some('\\' | 'n')) {
                                return Err(at("bad escape in HELP".into()));
                            }
                        }
                        if !helps.insert(name.to_string()) {
                            return Err(at("second HELP".into()));
                        }
                        if text.trim().is_empty() {
                            return Err(at("empty HELP".into()));
                        }
                    }
                    "TYPE" => {
                        let t = rest.unwrap_or("");
                        if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&t) {
                            return Err(at(format!("unknown type {t:?}")));
                        }
                        if types.insert(name.to_string(), t.to_string()).is_some() {
                            return Err(at("second TYPE".into()));
                        }
                        if samples.keys().any(|k: &String| k.split('{').next() == Some(name)) {
                            return Err(at("TYPE after the family's samples".into()));
                        }
                    }
                    _ => continue, // a comment
                }
                if !valid_metric_name(name) {
                    return Err(at(format!("bad metric name {name:?}")));
                }
                name.to_string()
            } else {
                let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
                let name = &line[..name_end];
                if !valid_metric_name(name) {
                    return Err(at(format!("bad metric name {name:?}")));
                }
                let (mut labels, rest) = parse_labels(&line[name_end..]).map_err(at)?;
                let rest = rest.strip_prefix(' ').ok_or_else(|| at("no space before the value".into()))?;
                let mut fields = rest.split(' ');
                let value = parse_value(fields.next().unwrap_or("")).map_err(at)?;
                if let Some(ts) = fields.next() {
                    ts.parse::<i64>().map_err(|_| at(format!("bad timestamp {ts:?}")))?;
                }
                if fields.next().is_some() {
                    return Err(at("trailing fields".into()));
                }
                let Some(t) = types.get(name) else { return Err(at("sample before its TYPE".into())) };
                if t == "counter" && (value.is_nan() || value < 0.0) {
                    return Err(at("negative counter".into()));
                }
                labels.sort();
                let key = format!("{name}{{{}}}", labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect::<Vec<_>>().join(","));
                if samples.insert(key, value).is_some() {
                    return Err(at("duplicate series".into()));
                }
                name.to_string()
            };
            if current.as_deref() != Some(family.as_str()) {
                if done.contains(&family) {
                    return Err(at(format!("family {family} split in two blocks")));
                }
                if let Some(c) = current.take() {
                    done.insert(c);
                }
                current = Some(family.clone());
            }
            // This project's conventions.
            if !family.starts_with("fdpblk_") {
                return Err(at("metric not prefixed fdpblk_".into()));
            }
            if types.get(&family).map(String::as_str) == Some("counter") && !family.ends_with("_total") {
                return Err(at("counter not named *_total".into()));
            }
            if types.get(&family).map(String::as_str) == Some("gauge") && family.ends_with("_total") {
                return Err(at("gauge named *_total".into()));
            }
            if family.contains("byte") && !(family.ends_with("_bytes") || family.ends_with("_bytes_total")) {
                return Err(at("a byte metric must end in _bytes or _bytes_total".into()));
            }
        }
        for t in types.keys() {
            if !helps.contains(t) {
                return Err(format!("{t} has no HELP"));
            }
        }
        Ok(samples)
    }

    /// The stats file of a running device, shaped like the daemon's (`target::stats_loop`:
    /// config, geometry, pipeline counters, then the state thread's fields).
    fn stats_json() -> Value {
        use crate::layout::GeometryConfig;
        use crate::pipeline::PipelineStats;
        let g = GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate(64 << 20)
            .unwrap();
        let mut p = PipelineStats::default();
        p.classes[3].requests = 7;
        p.classes[3].bytes = 7 * 61440;
        p.ops[1].requests = 9;
        p.ops[1].bytes = 3 << 20;
        p.handle_bytes = vec![0, 8192, 1 << 20];
        p.header_waits = 2;
        json!({
            "id": 0, "name": "kv0", "engine": "passthrough", "policy": "key-aware",
            "geometry": g.to_json(), "pipeline": p.to_json(), "queues": [{"requests": 5, "header_wait_peak": 0, "errors": 0}, {"requests": 4, "header_wait_peak": 3, "errors": 2, "held_for_trims": 7, "held_longest_us": 2500000}],
            "state_age_s": 0.4, "checkpoint_seq": 12, "checkpoint_age_s": 3.5, "checkpoint_bytes": 1000, "checkpoint_entries": 4,
            "checkpoint_cap_bytes": g.payload_cap(), "checkpoint_estimate_bytes": 1200, "overflow_risk": false,
            "checkpoint_stalled": false, "meta_total_bytes_needed": null, "containers": [], "lmcache_opens": 2, "lmcache_lost_puts": 5,
            "backing_writers": ["python3 (pid 77) on /dev/nvme0n1"], "checkpoint_interval_s": 20.0, "writeback_delay_s": 35.0, "writeback_risk": true,
            "slots": {"max_slots": g.max_slots, "with_header": 5, "confirmed": 4, "unknown": 1, "live": 3, "evicted": 1,
                      "trimmed": 0, "identity_history": 2, "identity_history_capacity": 6, "returning": 1, "tags": 1},
            "trim": {"enabled": true, "allowed_now": true, "blocked_by": null, "trims": 3, "trim_bytes": 196608,
                     "handles": {"2": 3}, "evictions": 4, "reclaimed": 6, "early_evictions": 1, "containers_invalidated": 1},
            "layout": {"state": "given", "writes_before_layout": 0, "bytes_before_layout": 0, "refused": null},
            "own_state": {"persisted": true, "seq": 9, "cycles": 9, "bytes_written": 40960, "loaded": true,
                          "loaded_clean": true, "region_offset": 1, "region_bytes": 2},
            "since_start": {"trims": 1, "trim_bytes": 65536, "trim_handles": {"2": 1}, "evictions": 2,
                            "own_state_cycles": 2, "own_state_bytes": 8192},
        })
    }

    fn config_json(name: &str) -> Value {
        json!({"name": name, "backing": "/dev/ng0n1", "engine": "passthrough", "policy": "key-aware"})
    }

    #[test]
    fn a_blocked_deallocation_and_a_layout_being_learned_are_gauges() {
        let mut st = stats_json();
        st["trim"]["blocked_by"] = json!("LMCache's checkpoint says slot_bytes 131072");
        st["layout"]["state"] = json!("learning");
        let samples = |st: &Value| {
            let mut reg = Registry::default();
            reg.add_device(0, Some(&config_json("kv0")), true, Some(st), Some(1.0), None);
            let doc = reg.render();
            check_exposition(&doc).unwrap_or_else(|e| panic!("{e}\n{doc}"))
        };
        let s = samples(&st);
        assert_eq!(s[r#"fdpblk_trim_blocked{id="0",name="kv0"}"#], 1.0);
        assert_eq!(s[r#"fdpblk_trim_paused{id="0",name="kv0"}"#], 0.0);
        st["trim"]["paused_by"] = json!("LMCache writes through the page cache, and ...");
        assert_eq!(samples(&st)[r#"fdpblk_trim_paused{id="0",name="kv0"}"#], 1.0);
        assert_eq!(s[r#"fdpblk_layout_learning{id="0",name="kv0"}"#], 1.0);
        assert_eq!(s[r#"fdpblk_layout_half_written{id="0",name="kv0"}"#], 0.0);
        st["layout"]["half_written"] = json!({"copy": 0, "for_s": 130});
        assert_eq!(samples(&st)[r#"fdpblk_layout_half_written{id="0",name="kv0"}"#], 1.0);
    }

    #[test]
    fn device_metrics_follow_the_exposition_format() {
        let mut reg = Registry::default();
        let fdp = json!({"host_bytes": 3145728, "media_bytes": 3145728, "erased_bytes": 0, "media_host_ratio": 1.0});
        reg.add_device(0, Some(&config_json("kv0")), true, Some(&stats_json()), Some(1.0), Some(&fdp));
        let doc = reg.render();
        let s = check_exposition(&doc).unwrap_or_else(|e| panic!("{e}\n{doc}"));
        let get = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no {k} in\n{doc}"));
        assert_eq!(get(r#"fdpblk_handle_written_bytes_total{handle="1",id="0",name="kv0"}"#), 8192.0);
        assert_eq!(get(r#"fdpblk_handle_written_bytes_total{handle="2",id="0",name="kv0"}"#), 1048576.0);
        // key-aware's three handles from 0, handle 0 unwritten in the stats too.
        assert_eq!(get(r#"fdpblk_handle_written_bytes_total{handle="0",id="0",name="kv0"}"#), 0.0, "a handle not yet written starts at 0");
        assert!(!s.contains_key(r#"fdpblk_handle_written_bytes_total{handle="3",id="0",name="kv0"}"#), "key-aware has 3 handles");
        assert_eq!(get(r#"fdpblk_class_bytes_total{class="slot_payload",id="0",name="kv0"}"#), 430080.0);
        assert_eq!((get(r#"fdpblk_lmcache_opens_total{id="0",name="kv0"}"#), get(r#"fdpblk_lmcache_lost_puts_total{id="0",name="kv0"}"#)), (2.0, 5.0));
        assert_eq!(get(r#"fdpblk_backing_foreign_writers{id="0",name="kv0"}"#), 1.0);
        assert_eq!(get(r#"fdpblk_class_requests_total{class="slot_payload",id="0",name="kv0"}"#), 7.0);
        assert_eq!(get(r#"fdpblk_io_bytes_total{id="0",name="kv0",op="write"}"#), 3145728.0);
        assert_eq!(get(r#"fdpblk_header_waits_total{id="0",name="kv0"}"#), 2.0);
        assert_eq!(get(r#"fdpblk_queue_requests_total{id="0",name="kv0",queue="1"}"#), 4.0);
        assert_eq!(get(r#"fdpblk_queue_header_wait_peak{id="0",name="kv0",queue="1"}"#), 3.0);
        assert_eq!(get(r#"fdpblk_queue_errors_total{id="0",name="kv0",queue="1"}"#), 2.0);
        assert_eq!(get(r#"fdpblk_queue_held_for_trims_total{id="0",name="kv0",queue="1"}"#), 7.0);
        assert_eq!(get(r#"fdpblk_queue_held_longest_seconds{id="0",name="kv0",queue="1"}"#), 2.5);
        assert_eq!(get(r#"fdpblk_slots{id="0",name="kv0",state="live"}"#), 3.0);
        // Counters are this daemon's (the stats' lifetime values came back from the drive).
        assert_eq!(get(r#"fdpblk_trims_total{handle="2",id="0",name="kv0"}"#), 1.0);
        assert_eq!(get(r#"fdpblk_trims_total{handle="1",id="0",name="kv0"}"#), 0.0, "a handle written starts at 0");
        assert_eq!(get(r#"fdpblk_trims_total{handle="0",id="0",name="kv0"}"#), 0.0, "so does one not written");
        assert_eq!(get(r#"fdpblk_trim_bytes_total{id="0",name="kv0"}"#), 65536.0);
        assert_eq!(get(r#"fdpblk_evictions_total{id="0",name="kv0"}"#), 2.0);
        assert_eq!(get(r#"fdpblk_own_state_cycles_total{id="0",name="kv0"}"#), 2.0);
        assert_eq!(get(r#"fdpblk_checkpoint_age_seconds{id="0",name="kv0"}"#), 3.5);
        assert_eq!(get(r#"fdpblk_state_age_seconds{id="0",name="kv0"}"#), 0.4);
        assert_eq!(get(r#"fdpblk_checkpoint_cap_bytes{id="0",name="kv0"}"#), 520192.0);
        assert_eq!(get(r#"fdpblk_checkpoint_overflow_risk{id="0",name="kv0"}"#), 0.0);
        assert_eq!(get(r#"fdpblk_writeback_risk{id="0",name="kv0"}"#), 1.0);
        assert_eq!(get(r#"fdpblk_layout_slots{id="0",name="kv0"}"#), 1008.0);
        assert_eq!(get(r#"fdpblk_drive_media_written_bytes_total{id="0",name="kv0"}"#), 3145728.0);
        assert_eq!(get(r#"fdpblk_own_state_written_bytes_total{id="0",name="kv0"}"#), 8192.0);
        assert_eq!(
            get(r#"fdpblk_device_info{backing="/dev/ng0n1",device="/dev/ublkb0",engine="passthrough",id="0",name="kv0",policy="key-aware"}"#),
            1.0
        );
        assert_eq!(get(r#"fdpblk_daemon_up{id="0",name="kv0"}"#), 1.0);
        assert_eq!(get(r#"fdpblk_trim_blocked{id="0",name="kv0"}"#), 0.0);
        assert_eq!(get(r#"fdpblk_layout_learning{id="0",name="kv0"}"#), 0.0);
        assert_eq!(get(r#"fdpblk_stats_age_seconds{id="0",name="kv0"}"#), 1.0);
        assert_eq!(get(r#"fdpblk_unwritten_slots_reclaimed_total{id="0",name="kv0"}"#), 6.0);
        assert_eq!(get(r#"fdpblk_early_evictions_total{id="0",name="kv0"}"#), 1.0);
        assert!(!doc.contains("meta_total_bytes_needed"), "absent while no alarm");
    }

    /// deploy/README.md's table lists every metric family: a metric added here without a row
    /// there fails. A row may shorten a name that shares the row's first one's prefix
    /// (`fdpblk_checkpoint_seq`, `_age_seconds`).
    #[test]
    fn the_deploy_readme_lists_every_metric() {
        let readme = include_str!("../../deploy/README.md");
        let mut reg = Registry::default();
        let fdp = json!({"host_bytes": 3145728, "media_bytes": 3145728, "erased_bytes": 0, "media_host_ratio": 1.0});
        let mut st = stats_json();
        st["overflow_risk"] = json!(true);
        st["meta_total_bytes_needed"] = json!(1 << 30);
        reg.add("fdpblk_devices", "", Kind::Gauge, Vec::new(), 1.0);
        reg.add_device(0, Some(&config_json("kv0")), true, Some(&st), Some(1.0), Some(&fdp));
        let listed = |name: &str| {
            readme.contains(&format!("`{name}`")) || readme.contains(&format!("`{name}{{"))
                || readme.lines().any(|row| {
                    row.split('`').skip(1).step_by(2).filter(|c| c.starts_with('_')).any(|short| {
                        let short = short.split('{').next().unwrap_or(short);
                        name.strip_suffix(short).is_some_and(|prefix| row.contains(&format!("`{prefix}_")))
                    })
                })
        };
        assert!(reg.families.len() > 40, "the test's stats render most families");
        let missing: Vec<&str> = reg.families.iter().map(|f| f.name).filter(|n| !listed(n)).collect();
        assert!(missing.is_empty(), "deploy/README.md's metrics table lacks {missing:?}");
    }

    /// A running daemon whose stats are missing or do not parse still has an age: the alert
    /// on it is how a stuck daemon is noticed.
    #[test]
    fn a_running_daemon_without_stats_still_reports_their_age() {
        let mut reg = Registry::default();
        reg.add_device(0, Some(&config_json("kv0")), true, None, Some(42.0), None);
        reg.add_device(1, Some(&config_json("dead")), false, None, Some(42.0), None);
        let doc = reg.render();
        let s = check_exposition(&doc).unwrap_or_else(|e| panic!("{e}\n{doc}"));
        assert_eq!(s[r#"fdpblk_stats_age_seconds{id="0",name="kv0"}"#], 42.0);
        assert!(!s.contains_key(r#"fdpblk_stats_age_seconds{id="1",name="dead"}"#), "a dead daemon has fdpblk_daemon_up 0 instead");
        assert!(!doc.contains("fdpblk_slots"), "nothing else is made up");
    }

    /// A drive that does not answer costs its own drive series for as long as it hangs, and
    /// is not asked again meanwhile; once it answered, the next pass reads it afresh.
    #[test]
    fn a_hung_drive_read_is_waited_for_once() {
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let short = Duration::from_millis(50);
        let id = -7; // no real device's
        assert_eq!(drive_read_within(id, move || hung.recv().ok().map(|_| json!("late")), short), None);
        // Still hanging: not asked again (this read would answer at once).
        assert_eq!(drive_read_within(id, || Some(json!(1)), Duration::from_secs(5)), None);
        assert_eq!(drive_read_within(id - 1, || Some(json!(2)), Duration::from_secs(5)), Some(json!(2)), "other devices are read");
        release.send(()).unwrap();
        let mut got = None;
        for _ in 0..1000 {
            got = drive_read_within(id, || Some(json!(3)), Duration::from_secs(5));
            if got.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(got, Some(json!(3)), "answered: read afresh, the late answer dropped");
    }

    /// While a daemon recovering the device has not written its stats yet, the dead one's
    /// left in the file are not exported as current; their age counts from the new start.
    #[test]
    fn a_previous_daemons_stats_are_not_shown_as_current() {
        let me = std::process::id();
        let serving = state::Daemon { pid: me, start: state::start_time(me) };
        let ours = json!({"pid": me, "pid_start": serving.start, "slots": {}});
        let theirs = json!({"pid": me + 1, "pid_start": 1, "slots": {}});
        let (st, age) = current_stats(Some(&serving), Some(ours.clone()), || Some(1.0), || Some(50.0));
        assert_eq!((st, age), (Some(ours), Some(1.0)));
        // (Marker ages no process age can be.)
        let (st, age) = current_stats(Some(&serving), Some(theirs.clone()), || Some(-1.0), || Some(-2.0));
        assert_eq!(st, None);
        let age = age.unwrap();
        assert!((0.0..3600.0).contains(&age), "since this process started, not the file's: {age}");
        // The same pid started at another time is another daemon.
        let reused = json!({"pid": me, "pid_start": serving.start.unwrap() + 1});
        assert_eq!(current_stats(Some(&serving), Some(reused), || Some(1.0), || None).0, None);
        // Older stats without a pid, and a dead daemon's (shown as its last figures), stay.
        let (st, _) = current_stats(Some(&serving), Some(json!({"slots": {}})), || Some(1.0), || None);
        assert!(st.is_some());
        assert_eq!(current_stats(None, Some(theirs.clone()), || Some(7.0), || None), (Some(theirs), Some(7.0)));
        // No stats file yet: the state file's age.
        assert_eq!(current_stats(Some(&serving), None, || None, || Some(50.0)), (None, Some(50.0)));
    }

    #[test]
    fn several_devices_keep_each_family_in_one_block() {
        let mut reg = Registry::default();
        reg.add_device(0, Some(&config_json("kv0")), true, Some(&stats_json()), Some(1.0), None);
        reg.add_device(1, Some(&config_json("a\"b\\c")), true, Some(&stats_json()), Some(1.0), None);
        reg.add_device(2, Some(&config_json("dead")), false, Some(&stats_json()), Some(1.0), None);
        let doc = reg.render();
        let s = check_exposition(&doc).unwrap_or_else(|e| panic!("{e}\n{doc}"));
        assert_eq!(s[r#"fdpblk_slots{id="1",name="a\"b\\c",state="live"}"#], 3.0, "label values escaped and read back");
        assert_eq!(s[r#"fdpblk_daemon_up{id="2",name="dead"}"#], 0.0);
        assert!(!s.keys().any(|k| k.contains("id=\"2\"") && !k.starts_with("fdpblk_device_info") && !k.starts_with("fdpblk_daemon_up")));
        assert_eq!(doc.matches("# TYPE fdpblk_slots gauge").count(), 1);
    }

    #[test]
    fn the_checker_rejects_what_the_format_forbids() {
        let ok = "# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total{a=\"1\"} 2\n";
        check_exposition(ok).unwrap();
        for (bad, why) in [
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total{a=\"1\"} 2", "no final newline"),
            ("# HELP fdpblk_x_total x\nfdpblk_x_total 2\n# TYPE fdpblk_x_total counter\n", "TYPE after sample"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total -1\n", "negative counter"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total 1\nfdpblk_x_total 2\n", "duplicate series"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total{a=1} 1\n", "unquoted label"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total{a=\"\\t\"} 1\n", "bad escape"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total{a=\"1\",a=\"2\"} 1\n", "label twice"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total{__a=\"1\"} 1\n", "reserved label"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total counter\nfdpblk_x_total one\n", "bad value"),
            ("# HELP fdpblk_x_total x\n# TYPE fdpblk_x_total bogus\n", "bad type"),
            ("# HELP fdpblk-x x\n# TYPE fdpblk-x gauge\nfdpblk-x 1\n", "bad name"),
            ("# HELP fdpblk_x x\n# TYPE fdpblk_x counter\nfdpblk_x 1\n", "counter without _total"),
            ("# HELP fdpblk_x_bytes_total x\n# TYPE fdpblk_x_bytes_total gauge\nfdpblk_x_bytes_total 1\n", "gauge with _total"),
            ("# HELP fdpblk_bytes_x x\n# TYPE fdpblk_bytes_x gauge\nfdpblk_bytes_x 1\n", "unit not last"),
            ("# HELP x_total x\n# TYPE x_total counter\nx_total 1\n", "no prefix"),
            ("# TYPE fdpblk_x gauge\nfdpblk_x 1\n", "no HELP"),
            (
                "# HELP fdpblk_a a\n# TYPE fdpblk_a gauge\nfdpblk_a 1\n# HELP fdpblk_b b\n# TYPE fdpblk_b gauge\nfdpblk_b 1\nfdpblk_a{x=\"1\"} 1\n",
                "family split",
            ),
            ("# HELP fdpblk_a a\n# TYPE fdpblk_a gauge\n\nfdpblk_a 1\n", "empty line"),
            ("# HELP fdpblk_a a\n# TYPE fdpblk_a gauge\nfdpblk_a 1 2 3\n", "trailing field"),
        ] {
            assert!(check_exposition(bad).is_err(), "accepted ({why}):\n{bad}");
        }
    }

    #[test]
    fn values_are_written_exactly() {
        assert_eq!(format_value(1.0), "1");
        assert_eq!(format_value(18446744073709551615.0), "18446744073709552000");
        assert_eq!(format_value(3.25), "3.25");
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value((1u64 << 50) as f64), "1125899906842624");
    }
}
