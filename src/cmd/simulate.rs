//! `fdpblk simulate`: runs an LMCache workload model through fdpblk's pipeline into the FDP
//! SSD model, for each policy, utilisation and trim setting, and reports the steady-state WAF.

use super::CmdResult;
use crate::cli::parse_size;
use crate::place::POLICY_NAMES;
use crate::sim::run::{run as run_one, sim_policy_names, is_bound, DriveSpec, RunResult, RunSpec};
use crate::sim::workload::{IoMode, WorkloadSpec};
use crate::sim::{HandleType, SsdConfig, Victim};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Workload file (JSON; see tools/workloads/).
    #[arg(long)]
    pub workload: PathBuf,
    /// Policy, a comma-separated list, or `all` (none, region, lmcache-fdp, key-aware);
    /// `clairvoyant` is a bound that knows each write's future lifetime, `popularity` one that
    /// knows how often each chunk is asked for (more than any history can tell).
    #[arg(long, default_value = "all")]
    pub policy: String,
    /// Share of the device LMCache uses, in percent (comma-separated list).
    #[arg(long, default_value = "50,80,90,100")]
    pub utilization: String,
    /// fdpblk deallocates what LMCache no longer references (see --trim-rules): on, off or both.
    #[arg(long, default_value = "both")]
    pub trim: String,
    /// Trim rules with --trim on, comma-separated: `slots` (evicted slots, issue #6's
    /// two-checkpoint rule), `tails` (a confirmed slot's bytes past its payload),
    /// `early-tails` (the same bytes once the slot's new header is durable and a checkpoint
    /// written after the put was read back) and
    /// `early-evictions` (with `slots`: an evicted slot once the newest checkpoint lacks it,
    /// the older container zeroed first) and `unwritten` (with `slots`: slots no checkpoint
    /// lists and LMCache has not written, which matter on a --precondition drive; not in the
    /// default, so that the published tables stay as they were measured).
    #[arg(long, default_value = "slots,tails,early-tails,early-evictions")]
    pub trim_rules: String,
    /// Seed of the workload model (every number is reproducible from it).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Logical capacity of the simulated drive (bytes, or K/M/G/T).
    #[arg(long, default_value = "1880000000000", value_parser = parse_size)]
    pub device_size: u64,
    /// Over-provisioning, as a fraction of physical space.
    #[arg(long, default_value_t = 0.07)]
    pub op: f64,
    /// Reclaim unit size; `auto` scales a 6 GB RU on a 1.88 TB drive to --device-size.
    #[arg(long, default_value = "auto")]
    pub ru_size: String,
    /// Mapping unit of the FTL model; `auto`: the largest power of two up to 1 MiB dividing both
    /// the slot size and meta_total_bytes.
    #[arg(long, default_value = "auto")]
    pub unit: String,
    /// Reclaim unit handles of the drive.
    #[arg(long, default_value_t = 8)]
    pub handles: u16,
    /// Handle type: ii (initially isolated) or pi (persistently isolated).
    #[arg(long, default_value = "ii")]
    pub handle_type: String,
    /// GC victim choice: greedy, cost-benefit or fifo.
    #[arg(long, default_value = "greedy")]
    pub gc: String,
    /// Start with the drive full (every block written once, as a drive in service holds
    /// data) instead of deallocated: LMCache never deallocates, so what it does not rewrite
    /// stays valid.
    #[arg(long)]
    pub precondition: bool,
    /// Every handle holds an open reclaim unit from the start, as on a drive whose handles
    /// always reference one: the handles a policy never writes keep theirs out of the spare.
    /// Off: a handle takes an RU at its first write.
    #[arg(long)]
    pub hold_open_rus: bool,
    /// How much of a write the drive takes in before it cleans for it (bytes, or K/M/G): GC
    /// never copies that part of the data the write overwrites. `whole` (the default): all
    /// of a write the RU takes, as the simulator merged it (adjacent writes on one handle, up
    /// to an RU); 512K: one request, a drive that cleans first beyond it.
    #[arg(long, default_value = "whole")]
    pub write_buffer: String,
    /// Warm-up: LMCache writes this many times its capacity before measuring (and the drive
    /// at least its physical capacity, so that it has had to collect).
    #[arg(long, default_value_t = 2.0)]
    pub warmup: f64,
    /// Measured window: this many device capacities of host writes.
    #[arg(long, default_value_t = 5.0)]
    pub measure: f64,
    /// Also measure data lifetimes by write class (first-time / returning, partial, read), show
    /// which streams' reclaim units garbage collection took, how full and how old they were
    /// (mean and percentiles), and what it relocated from them, and count the puts of a key
    /// into a slot a committed checkpoint still lists for it.
    #[arg(long)]
    pub explain: bool,
    /// Handles of the `clairvoyant` and `popularity` bounds, which split the data by lifetime
    /// or by popularity into equal shares on them (3 = `key-aware`'s budget).
    #[arg(long, default_value_t = 3)]
    pub clairvoyant_handles: u16,
    /// LMCache's I/O, overriding the workload's `io`: odirect (posix, O_DIRECT), buffered
    /// (posix, page cache) or io_uring (O_DIRECT batches of 64 keys, delivered out of order).
    #[arg(long)]
    pub io: Option<String>,
    /// io_uring: how many places back the kernel may deliver a request of a batch, overriding
    /// the workload's `uring_reorder_window` (default 64; 0 or 1: in order).
    #[arg(long)]
    pub uring_reorder_window: Option<u64>,
    /// Buffered I/O: how many puts' dirty pages the page cache writes back together (sorted
    /// by offset), overriding the workload's `writeback_puts` (default 64: a small page
    /// cache's; a server's kernel holds thousands, docs/waf.md's Limits).
    #[arg(long)]
    pub writeback_puts: Option<usize>,
    /// Buffered I/O: whether a checkpoint's pages reach the device after the dirty slot pages
    /// of the puts it lists (after-slots) or before them (before-slots), overriding the
    /// workload's `checkpoint_writeback` (default after_slots). The kernel's order lies
    /// between the two.
    #[arg(long)]
    pub checkpoint_writeback: Option<String>,
    /// Chance that a checkpoint tick finds LMCache idle (it skips busy ticks), overriding the
    /// workload's `checkpoint_idle_probability` (default 1: every tick checkpoints).
    #[arg(long)]
    pub checkpoint_idle: Option<f64>,
    /// MP: the server's L1 (CPU memory) as a share of the slots LMCache may use, overriding
    /// the workload's `l1_share` (default 0: none, every hit reads the device).
    #[arg(long)]
    pub l1_share: Option<f64>,
    /// Runs in parallel (one thread each).
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Print one JSON object, `{"runs": [...]}`: per run its WAF, host, media and own-state
    /// bytes, trims, per-handle usage, the drive and the run's speed.
    #[arg(long)]
    pub json: bool,
    /// Draw WAF vs utilisation per policy into this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

fn parse_list<T>(s: &str, what: &str, f: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| f(x).ok_or_else(|| format!("{what}: cannot read \"{x}\"")))
        .collect()
}

/// The largest workload file read (the shipped ones are about 1 KiB).
const MAX_WORKLOAD_BYTES: u64 = 1 << 20;

/// Builds the run specifications the arguments ask for, in table order.
pub fn plan(a: &SimulateArgs) -> Result<Vec<RunSpec>, String> {
    let what = format!("workload {}", a.workload.display());
    let text = std::fs::File::open(&a.workload)
        .map_err(|e| format!("cannot read {what}: {e}"))
        .and_then(|f| super::read_text_at_most(f, MAX_WORKLOAD_BYTES, &what))?;
    let mut workload =
        WorkloadSpec::from_json_str(&text).map_err(|e| format!("workload {}: {e}", a.workload.display()))?;
    if workload.name.is_empty() {
        workload.name = a.workload.file_stem().and_then(|s| s.to_str()).unwrap_or("workload").to_string();
    }
    if let Some(io) = &a.io {
        workload.io = match io.as_str() {
            "odirect" => IoMode::ODirect,
            "buffered" => IoMode::Buffered,
            "io_uring" => IoMode::IoUring,
            m => return Err(format!("--io {m}: use odirect, buffered or io_uring")),
        };
    }
    if let Some(w) = a.uring_reorder_window {
        if workload.io != IoMode::IoUring {
            return Err("--uring-reorder-window needs io_uring (--io io_uring or \"io\": \"io_uring\" in the workload)".into());
        }
        if w > 1 << 20 {
            return Err(format!("--uring-reorder-window {w}: at most 1048576 requests"));
        }
        workload.uring_reorder_window = w;
    }
    if let Some(n) = a.writeback_puts {
        if workload.io != IoMode::Buffered {
            return Err("--writeback-puts needs buffered I/O (--io buffered or \"io\": \"buffered\" in the workload)".into());
        }
        if !(1..=1 << 20).contains(&n) {
            return Err(format!("--writeback-puts {n}: 1 to 1048576 puts"));
        }
        workload.writeback_puts = n;
    }
    if let Some(o) = &a.checkpoint_writeback {
        workload.checkpoint_before_slots = match o.as_str() {
            "after-slots" => false,
            "before-slots" => true,
            o => return Err(format!("--checkpoint-writeback {o}: use after-slots or before-slots")),
        };
    }
    // Fields only one I/O mode reads, given for another (the file's or --io's): refused, not
    // ignored. (The text parsed above.)
    let given: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    for (field, io, name) in [
        ("uring_reorder_window", IoMode::IoUring, "io_uring"),
        ("ublk_queue_depth", IoMode::IoUring, "io_uring"),
        ("writeback_puts", IoMode::Buffered, "buffered"),
    ] {
        if given.get(field).is_some() && workload.io != io {
            return Err(format!(
                "workload {}: \"{field}\" is read only with {name} I/O (\"io\": \"{name}\" in the workload, or --io {name}): drop it",
                a.workload.display()
            ));
        }
    }
    if workload.checkpoint_before_slots && workload.io != IoMode::Buffered {
        return Err("checkpoint writeback before the slots needs buffered I/O (--io buffered or \"io\": \"buffered\" in the workload)".into());
    }
    if let Some(p) = a.checkpoint_idle {
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("--checkpoint-idle {p}: a probability, 0 to 1"));
        }
        workload.checkpoint_idle_probability = p;
    }
    if let Some(l) = a.l1_share {
        if let Some(rule) = crate::sim::workload::l1_share_rule(workload.mode, l) {
            return Err(format!("--l1-share {l} {rule}"));
        }
        workload.l1_share = l;
    }
    // The LRU lists lru_insert orders: the eviction controller's, and the L1's.
    if given.get("lru_insert").is_some() && workload.eviction.is_none() && workload.l1_share == 0.0 {
        return Err(format!(
            "workload {}: \"lru_insert\" orders the eviction controller's LRU and the L1's, and it has neither: drop it, or give an \"eviction\" or an L1 (\"l1_share\", --l1-share)",
            a.workload.display()
        ));
    }
    let policies: Vec<String> = if a.policy == "all" {
        POLICY_NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        parse_list(&a.policy, "--policy", |p| sim_policy_names().contains(&p).then(|| p.to_string()))
            .and_then(|l| if l.is_empty() { Err("--policy: none given".to_string()) } else { Ok(l) })
            .map_err(|e| format!("{e}; choose from {} or all", sim_policy_names().join(", ")))?
    };
    // Percent only: a fraction such as 0.5 would be ambiguous with 1 (1 % or 100 %?).
    let utils = parse_list(&a.utilization, "--utilization", |u| {
        let v: f64 = u.strip_suffix('%').unwrap_or(u).parse().ok()?;
        // Whole percents: the tables and the plot print them so.
        ((1.0..=100.0).contains(&v) && v.fract() == 0.0).then_some(v / 100.0)
    })
    .and_then(|l| if l.is_empty() { Err("--utilization: none given".to_string()) } else { Ok(l) })
    .map_err(|e| format!("{e} (percent of the device, a whole number from 1 to 100, e.g. 50,80,90,100)"))?;
    let trims: Vec<bool> = match a.trim.as_str() {
        "on" => vec![true],
        "off" => vec![false],
        "both" => vec![false, true],
        t => return Err(format!("--trim {t}: use on, off or both")),
    };
    const RULES: [&str; 5] = ["slots", "tails", "early-tails", "early-evictions", "unwritten"];
    let rules = parse_list(&a.trim_rules, "--trim-rules", |r| RULES.contains(&r).then(|| r.to_string()))
        .map_err(|e| format!("{e}; choose from {}", RULES.join(", ")))?;
    // 0 stands for auto in the drive's spec: an explicit size must be a real one.
    let size = |s: &str, what: &str| -> Result<u64, String> {
        if s == "auto" {
            return Ok(0);
        }
        match parse_size(s).map_err(|e| format!("{what}: {e}"))? {
            n if what == "--unit" && (n < 4096 || !n.is_power_of_two()) => Err(format!("--unit {s}: give auto or a power of two of at least 4K")),
            n if what != "--unit" && n < 64 << 10 => Err(format!("{what} {s}: give auto or at least 64K")),
            n => Ok(n),
        }
    };
    let drive = DriveSpec {
        logical_bytes: a.device_size,
        op: a.op,
        ru_bytes: size(&a.ru_size, "--ru-size")?,
        unit_bytes: size(&a.unit, "--unit")?,
        handles: a.handles,
        handle_type: match a.handle_type.as_str() {
            "ii" => HandleType::InitiallyIsolated,
            "pi" => HandleType::PersistentlyIsolated,
            t => return Err(format!("--handle-type {t}: use ii or pi")),
        },
        victim: match a.gc.as_str() {
            "greedy" => Victim::Greedy,
            "cost-benefit" => Victim::CostBenefit,
            "fifo" => Victim::Fifo,
            g => return Err(format!("--gc {g}: use greedy, cost-benefit or fifo")),
        },
        precondition: a.precondition,
        hold_open_rus: a.hold_open_rus,
        write_buffer_bytes: match a.write_buffer.as_str() {
            "whole" => 0,
            s => match parse_size(s) {
                Ok(n) if n > 0 => n,
                _ => return Err(format!("--write-buffer {s}: give whole or a size such as 512K")),
            },
        },
    };
    if policies.iter().any(|p| is_bound(p)) && !(2..=a.handles).contains(&a.clairvoyant_handles) {
        return Err(format!("--clairvoyant-handles {}: use 2 to --handles ({})", a.clairvoyant_handles, a.handles));
    }
    if !(a.warmup.is_finite() && (0.0..=100.0).contains(&a.warmup)) {
        return Err(format!("--warmup {}: give LMCache's capacities written before measuring, 0 to 100", a.warmup));
    }
    if !(a.measure.is_finite() && a.measure >= 0.1 && a.measure <= 100.0) {
        return Err(format!("--measure {}: give device capacities of host writes to measure, 0.1 to 100", a.measure));
    }
    if !(0.0..0.9).contains(&a.op) {
        return Err(format!("--op {}: give a fraction of physical space, e.g. 0.07", a.op));
    }
    let mut out = Vec::new();
    for p in &policies {
        for &t in &trims {
            // LMCache's own FDP mode writes to /dev/ng directly: there is no fdpblk to trim.
            if t && p == "lmcache-fdp" {
                continue;
            }
            for &u in &utils {
                out.push(RunSpec {
                    workload: workload.clone(),
                    drive: drive.clone(),
                    policy: p.clone(),
                    utilization: u,
                    trim: t,
                    trim_slots: rules.iter().any(|r| r == "slots"),
                    trim_tails: rules.iter().any(|r| r == "tails"),
                    early_tails: rules.iter().any(|r| r == "early-tails"),
                    early_evictions: rules.iter().any(|r| r == "early-evictions"),
                    unwritten: rules.iter().any(|r| r == "unwritten"),
                    seed: a.seed,
                    warmup: a.warmup,
                    measure: a.measure,
                    probe: a.explain,
                    clairvoyant_handles: a.clairvoyant_handles,
                });
            }
        }
    }
    if out.is_empty() {
        return Err("nothing to run: lmcache-fdp has no trim (LMCache's own FDP mode writes to /dev/ng, without fdpblk); use --trim off or both".into());
    }
    // Each utilisation's LMCache geometry before any run: a run that cannot start is not
    // found after the others have taken their time.
    let resolved = crate::sim::run::resolve_drive(&drive, &workload);
    for &u in &utils {
        let (lm_device, capacity) = crate::sim::run::lmcache_share(resolved.logical_bytes, u)?;
        workload.geometry(lm_device, capacity).map_err(|e| format!("at --utilization {}: {e}", (u * 1e4).round() / 100.0))?;
    }
    if let Some(p) = &a.plot {
        crate::sim::plot::check_writable(p)?;
    }
    Ok(out)
}

/// Runs the specs on `jobs` threads, results in spec order.
pub fn run_all(specs: &[RunSpec], jobs: usize) -> Result<Vec<RunResult>, String> {
    let jobs = jobs.clamp(1, specs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<RunResult, String>>>> =
        specs.iter().map(|_| Default::default()).collect();
    std::thread::scope(|sc| {
        for _ in 0..jobs {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                let r = run_one(spec);
                if let Ok(r) = &r {
                    eprintln!(
                        "simulate: {} {} trim {} at {:.0} %: WAF {:.3} ({:.1} s)",
                        r.workload,
                        r.policy,
                        if r.trim { "on" } else { "off" },
                        r.utilization * 100.0,
                        r.waf,
                        r.wall_s
                    );
                }
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
        }
    });
    results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| Err("run lost".into())))
        .collect()
}

fn label(r: &RunResult) -> String {
    r.label()
}

fn fmt_waf(r: &RunResult) -> String {
    if r.stalled && !r.waf.is_finite() {
        "stall".into()
    } else if r.waf.is_finite() {
        // Stalled inside the window: measured over less than the window asks for.
        format!("{:.3}{}", r.waf, if r.stalled { "*" } else { "" })
    } else {
        "-".into()
    }
}

/// The reclaim units the simulated drive's physical space holds (one reclaim group): what
/// is left over of an RU is never written.
fn whole_rus(d: &DriveSpec) -> u64 {
    SsdConfig::physical_for_op(d.logical_bytes, d.op) / d.ru_bytes.max(1)
}

/// The over-provisioning those whole RUs give, as a share of them.
fn whole_ru_op(d: &DriveSpec) -> f64 {
    let media = (whole_rus(d) * d.ru_bytes) as f64;
    if media > 0.0 { (media - d.logical_bytes as f64) / media } else { 0.0 }
}

fn print_text(rs: &[RunResult]) {
    let Some(first) = rs.first() else { return };
    let d = &first.drive;
    println!(
        "workload {}: drive {:.3} TB logical, OP {:.0} % ({:.2} % in {} whole RUs), RU {:.2} GB, {} handles ({}{}), unit {} KiB{}; {} slots of {} MiB at 100 %",
        first.workload,
        d.logical_bytes as f64 / 1e12,
        d.op * 100.0,
        whole_ru_op(d) * 100.0,
        whole_rus(d),
        d.ru_bytes as f64 / 1e9,
        d.handles,
        match d.handle_type {
            HandleType::InitiallyIsolated => "II",
            HandleType::PersistentlyIsolated => "PI",
        },
        if d.hold_open_rus { ", each holding an open RU" } else { "" },
        d.unit_bytes >> 10,
        if d.write_buffer_bytes > 0 { format!(", write buffer {} KiB", d.write_buffer_bytes >> 10) } else { String::new() },
        rs.iter().map(|r| r.max_slots).max().unwrap_or(0),
        first.slot_bytes >> 20,
    );
    let mut utils: Vec<f64> = rs.iter().map(|r| r.utilization).collect();
    utils.sort_by(|a, b| a.total_cmp(b));
    utils.dedup();
    let mut rows: Vec<String> = Vec::new();
    for r in rs {
        let l = label(r);
        if !rows.contains(&l) {
            rows.push(l);
        }
    }
    // Labels with trim rules can be longer than the usual column.
    let w = rows.iter().map(String::len).max().unwrap_or(0).max(24);
    print!("{:<w$}", "steady-state WAF");
    for u in &utils {
        print!(" {:>8}", format!("{:.0} %", u * 100.0));
    }
    println!();
    for row in &rows {
        print!("{row:<w$}");
        for u in &utils {
            let cell = rs.iter().find(|r| &label(r) == row && r.utilization == *u).map_or("".into(), fmt_waf);
            print!(" {cell:>8}");
        }
        println!();
    }
    if rs.iter().any(|r| r.stalled && r.waf.is_finite()) {
        println!("* LMCache stopped storing (every put failed) before the window's end: WAF over a shorter window");
    }
    println!();
    println!(
        "{:<w$} {:>5} {:>7} {:>8} {:>8} {:>9} {:>9} {:>7}  handles used (host bytes share)",
        "run", "util", "WAF", "slots", "tails", "own/LMC", "hit ratio", "wall s"
    );
    for r in rs {
        let host: u64 = r.handle_bytes.iter().sum();
        let handles: Vec<String> = r
            .handle_bytes
            .iter()
            .enumerate()
            .filter(|(_, b)| **b > 0)
            .map(|(h, b)| format!("{h}:{:.0}%", 100.0 * *b as f64 / host.max(1) as f64))
            .collect();
        println!(
            "{:<w$} {:>4.0}% {:>7} {:>8} {:>8} {:>9.2e} {:>9.3} {:>7.1}  {}",
            label(r),
            r.utilization * 100.0,
            fmt_waf(r),
            r.trimmed_slots,
            r.tail_trims,
            r.own_state_ratio(),
            r.lmcache.hits as f64 / r.lmcache.chunks.max(1) as f64,
            r.wall_s,
            handles.join(" ")
        );
    }
    if rs.iter().any(|r| r.header_order.hold_cap > 0) {
        println!();
        println!(
            "io_uring (reorder window {} requests): slot payload requests that came before their header, in the window",
            rs.iter().map(|r| r.header_order.reorder_window).max().unwrap_or(0)
        );
        println!("{:<w$} {:>5} {:>12} {:>10} {:>10} {:>10}", "run", "util", "payload reqs", "waited", "fallbacks", "held peak");
        for r in rs {
            let o = &r.header_order;
            let cap = if o.hold_cap == u64::MAX { "-".to_string() } else { o.hold_cap.to_string() };
            println!(
                "{:<w$} {:>4.0}% {:>12} {:>10} {:>10} {:>10}",
                label(r),
                r.utilization * 100.0,
                o.payload_requests,
                o.header_waits,
                o.payload_fallbacks,
                format!("{}/{cap}", o.held_peak)
            );
        }
    }
}

/// `--explain`: data lifetimes by write class, in cache turnovers (puts / slots).
fn print_lifetimes(rs: &[RunResult]) {
    for r in rs {
        let Some(serde_json::Value::Array(rows)) = &r.probe else { continue };
        println!();
        println!("lifetimes, {} at {:.0} % (in cache turnovers: puts / slots)", r.label(), r.utilization * 100.0);
        println!("{:<10} {:<28} {:>7} {:>8} {:>6} {:>6} {:>6} {:>6}", "tenant", "class", "share", "deaths", "p10", "p50", "p90", "mean");
        let total: f64 = rows.iter().filter_map(|x| x["writes"].as_f64()).sum();
        for x in rows {
            let f = |k: &str| x[k].as_f64().unwrap_or(f64::NAN);
            println!(
                "{:<10} {:<28} {:>6.1}% {:>8} {:>6.2} {:>6.2} {:>6.2} {:>6.2}",
                x["tenant"].as_str().unwrap_or(""),
                x["class"].as_str().unwrap_or(""),
                100.0 * f("writes") / total.max(1.0),
                x["deaths"],
                f("p10"),
                f("p50"),
                f("p90"),
                f("mean")
            );
        }
    }
}

/// `--explain`: which streams' RUs garbage collection took, how full and how old they were
/// (mean and percentiles), and what it relocated from them.
fn print_gc(rs: &[RunResult]) {
    for r in rs {
        let rows = r.gc_by_stream();
        if rows.is_empty() {
            continue;
        }
        let total: u64 = rows.iter().map(|x| x.victims).sum();
        println!();
        println!("garbage collection, {} at {:.0} % (in the window): victims by the stream that filled them", r.label(), r.utilization * 100.0);
        println!(
            "{:<14} {:>8} {:>7} {:>17} {:>13} {:>22} {:>20} {:>20}",
            "stream", "victims", "share", "valid when taken", "relocated GB", "age when taken (drive)", "valid p10/p50/p90", "age p10/p50/p90"
        );
        let q = |x: [f64; 3], d: usize| format!("{:.d$}/{:.d$}/{:.d$}", x[0], x[1], x[2]);
        for g in rows {
            println!(
                "{:<14} {:>8} {:>6.1}% {:>17.3} {:>13.0} {:>22.3} {:>20} {:>20}",
                g.stream,
                g.victims,
                100.0 * g.victims as f64 / total as f64,
                g.valid_share,
                g.relocated_bytes as f64 / 1e9,
                g.age_drive_writes,
                q(g.valid_quantiles, 3),
                q(g.age_quantiles, 3)
            );
        }
    }
}

/// `--explain`: how often LMCache put a key into the very slot a loadable checkpoint still
/// listed for it, the case the early-tail rule guards against (docs/waf.md).
fn print_reputs(rs: &[RunResult]) {
    println!();
    println!("re-puts into a slot a committed checkpoint still lists for the same key (whole run)");
    for r in rs {
        let l = &r.lmcache;
        println!(
            "{} at {:.0} %: {} of {} puts, {} of them over a shorter put's stale tail",
            r.label(),
            r.utilization * 100.0,
            l.reputs_listed,
            l.puts,
            l.reputs_listed_over_tail
        );
    }
}

pub fn run(a: &SimulateArgs) -> CmdResult {
    let specs = plan(a)?;
    let results = run_all(&specs, a.jobs)?;
    if a.json {
        let v = json!({"runs": results.iter().map(RunResult::to_json).collect::<Vec<_>>()});
        println!("{v}");
    } else {
        print_text(&results);
        print_lifetimes(&results);
        if a.explain {
            print_gc(&results);
            print_reputs(&results);
        }
    }
    if let Some(p) = &a.plot {
        crate::sim::plot::waf_vs_utilization(&results, p)?;
    }
    Ok(())
}
