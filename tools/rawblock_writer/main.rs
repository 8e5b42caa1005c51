//! `rawblock-writer`: issues exactly the I/O pattern of LMCache 0.5.6's `raw_block` backend
//! (object key namespace) against a block device or a pre-sized file, from a small script of
//! commands, so that fdpblk can be driven without LMCache (whose torch import takes minutes in
//! a TCG guest).
//!
//! ```text
//! rawblock-writer --device /dev/ublkb0 --slot-bytes 64K --meta-total-bytes 1M \
//!     --engine io_uring --odirect --state /tmp/w.json \
//!     put 50 checkpoint delete 10 put 20 --partial-every 4 checkpoint verify stats
//! ```
//!
//! What is written, per command (reference: LMCache 0.5.6 `raw_block/core.py`):
//! - `put`: per key a slot from the allocator (bump pointer, freed slots LIFO), then the
//!   `header_bytes` header (`LMCBLK01`, identity, payload_len) and the payload at
//!   slot + header_bytes: exactly payload_len bytes buffered, rounded up and zero padded with
//!   O_DIRECT. posix: header pwrite, then payload pwrite(s), key by key. io_uring: one batch
//!   `[hdr0, payload0, hdr1, payload1, ...]` per chunk of up to 64 keys.
//! - `delete`: no I/O; the slot joins the free set.
//! - `checkpoint`: only if something changed: the JSON (zero padded to block_align) at
//!   container + block_align, then the 32-byte `LMCIDX01` header block at the container
//!   (seq n -> container (n-1) % 2); skipped with a warning when the JSON exceeds a container.

mod dev;
mod model;
#[cfg(test)]
mod tests;

use clap::Parser;
use dev::{Device, Engine};
use fdpblk::cli::parse_size;
use fdpblk::layout::GeometryConfig;
use model::{CheckpointOutcome, Dtype, Namespace, Options, Writer};
use std::path::{Path, PathBuf};

const SCRIPT_HELP: &str = "\
COMMANDS (any number, run in order):
  put N [--salt S] [--payload-bytes B] [--partial-every K] [--batch B] [--workers W] [--with-checkpoint]
        N new keys in put_many calls of B keys (default: one call of all N, or one per
        worker); with --workers, the calls run at once on W threads, as LMCache MP's
        store workers run store tasks (MP runs 2); with --with-checkpoint, a
        checkpoint_now() snapshotted before the puts (so without them) is written on a
        thread of its own while they are (LMCache writes outside its index lock)
  reput N [--live] [--payload-bytes B] [--partial-every K] [--batch B] [--workers W] [--with-checkpoint]
        put again the N most recently deleted keys, with new content; with --live,
        N indexed keys (LMCache acknowledges those without I/O)
  delete N [--random]   delete the N oldest keys (index order), or N random ones
  load N [--random] [--workers W]
        LMCache loads of the N oldest keys (or N random ones): payload reads only, checked;
        split over W threads, as MP's load workers (MP runs 4)
  checkpoint            LMCache checkpoint_now(): writes only if the index changed
  verify                read every live slot back and compare header and payload
  reopen                rebuild the index from the newest valid checkpoint on the device,
                        as LMCache's loader does (slot headers verified)
  sync                  fsync the device (not something LMCache does; for tests)
  stats                 print counters as JSON on stdout

The index starts empty, or from --state FILE, which is written back after the commands.
Payload bytes are a function of (seed, key, content generation), so verify is exact.";

#[derive(Parser, Debug)]
#[command(
    name = "rawblock-writer",
    about = "Write LMCache 0.5.6 raw_block's bytes in its write order to a block device or file (one thread; a run is not a whole LMCache process)",
    after_help = SCRIPT_HELP
)]
struct Args {
    /// Block device or pre-sized file (never created).
    #[arg(long)]
    device: PathBuf,
    /// LMCache slot_bytes.
    #[arg(long, value_parser = parse_size)]
    slot_bytes: u64,
    /// LMCache meta_total_bytes.
    #[arg(long, value_parser = parse_size)]
    meta_total_bytes: u64,
    /// LMCache header_bytes.
    #[arg(long, value_parser = parse_size, default_value = "4096")]
    header_bytes: u64,
    /// LMCache block_align.
    #[arg(long, value_parser = parse_size, default_value = "4096")]
    block_align: u64,
    /// LMCache capacity_bytes (0: the whole device).
    #[arg(long, value_parser = parse_size, default_value = "0")]
    capacity_bytes: u64,
    /// LMCache io_engine.
    #[arg(long, default_value = "posix", value_parser = ["posix", "io_uring"])]
    engine: String,
    /// LMCache use_odirect.
    #[arg(long)]
    odirect: bool,
    /// Seed for keys, payloads and random choices [default: 1, or the state file's].
    #[arg(long)]
    seed: Option<u64>,
    /// The device_path string LMCache is configured with [default: --device as given].
    #[arg(long)]
    device_path_string: Option<String>,
    /// Load the index from FILE if it exists, and write it back at the end.
    #[arg(long)]
    state: Option<PathBuf>,
    /// Model name in keys (percent-encoded as LMCache does).
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// kv_rank in keys (world_size<<24 | global_rank<<16 | local_world_size<<8 | local_rank).
    #[arg(long, default_value = "0x01000100", value_parser = parse_u32)]
    kv_rank: u32,
    /// object_group_id in keys.
    #[arg(long, default_value_t = 0)]
    object_group_id: u64,
    /// Key namespace: object (the MP adapter's keys) or legacy (the non-MP plugin's
    /// CacheEngineKey; world size and worker from --kv-rank).
    #[arg(long, default_value = "object", value_parser = ["object", "legacy"])]
    namespace: String,
    /// Legacy keys: store each chunk as this many LayerCacheEngineKeys (`@<layer>`), which
    /// share the chunk's identity (0: one key per chunk).
    #[arg(long, default_value_t = 0)]
    key_layers: u64,
    /// Payload type: bfloat16 (KV_2LTD [2,layers,T,hidden], whole tokens) or uint8 (BINARY, any length).
    #[arg(long, default_value = "bfloat16", value_parser = ["bfloat16", "uint8"])]
    dtype: String,
    /// Layers in a bfloat16 chunk's shape.
    #[arg(long, default_value_t = 4)]
    layers: u64,
    /// Hidden size in a bfloat16 chunk's shape.
    #[arg(long, default_value_t = 64)]
    hidden: u64,
    /// Make every K-th new payload partial, like the last chunk of a prompt (0: never).
    #[arg(long, default_value_t = 0)]
    partial_every: u64,
    /// Full-chunk payload bytes [default: the slot's payload capacity, in whole tokens].
    #[arg(long, value_parser = parse_size)]
    payload_bytes: Option<u64>,
    /// Print only warnings and errors on stderr.
    #[arg(short, long)]
    quiet: bool,
    /// The script: see COMMANDS below.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, num_args = 1..)]
    commands: Vec<String>,
}

fn workers_opt(word: &str, w: u64) -> Result<u64, String> {
    if w == 0 || w > MAX_WORKERS {
        return Err(format!("{word} --workers must be 1..={MAX_WORKERS} (LMCache MP runs 2 store and 4 load workers)"));
    }
    Ok(w)
}

fn parse_u32(s: &str) -> Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("'{s}' is not a 32-bit number (decimal or 0x hex)"))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cmd {
    Put {
        n: u64,
        salt: Option<String>,
        payload_bytes: Option<u64>,
        partial_every: Option<u64>,
        batch: Option<u64>,
        workers: u64,
        checkpoint: bool,
    },
    Reput { n: u64, live: bool, payload_bytes: Option<u64>, partial_every: Option<u64>, batch: Option<u64>, workers: u64, checkpoint: bool },
    Delete { n: u64, random: bool },
    Load { n: u64, random: bool, workers: u64 },
    Checkpoint,
    Verify,
    Reopen,
    Sync,
    Stats,
}

const USAGE_PUT: &str = "put N [--salt S] [--payload-bytes B] [--partial-every K] [--batch B] [--workers W] [--with-checkpoint]";
const USAGE_REPUT: &str = "reput N [--live] [--payload-bytes B] [--partial-every K] [--batch B] [--workers W] [--with-checkpoint]";
const USAGE_DELETE: &str = "delete N [--random]";
const USAGE_LOAD: &str = "load N [--random] [--workers W]";
/// More threads than this is not what LMCache runs, and only costs memory.
const MAX_WORKERS: u64 = 64;

/// Parses the command script.
pub fn parse_script(tokens: &[String]) -> Result<Vec<Cmd>, String> {
    let mut out = Vec::new();
    let mut i = 0;
    let count = |i: &mut usize, word: &str, usage: &str| -> Result<u64, String> {
        let t = tokens.get(*i).ok_or_else(|| format!("{word} needs a count: {usage}"))?;
        *i += 1;
        t.parse::<u64>().map_err(|_| format!("{word}: '{t}' is not a count: {usage}"))
    };
    while i < tokens.len() {
        let word = tokens[i].as_str();
        i += 1;
        // Options of the current command: every following `--x` token.
        let mut opts: Vec<(String, Option<String>)> = Vec::new();
        let takes_value = |o: &str| matches!(o, "--salt" | "--payload-bytes" | "--partial-every" | "--batch" | "--workers");
        let parse_opts = |i: &mut usize, opts: &mut Vec<(String, Option<String>)>| -> Result<(), String> {
            while let Some(t) = tokens.get(*i).filter(|t| t.starts_with("--")) {
                *i += 1;
                let (name, inline) = match t.split_once('=') {
                    Some((n, v)) => (n.to_string(), Some(v.to_string())),
                    None => (t.clone(), None),
                };
                let val = if takes_value(&name) {
                    match inline {
                        Some(v) => Some(v),
                        None => {
                            let v = tokens.get(*i).ok_or_else(|| format!("{word}: {name} needs a value"))?;
                            *i += 1;
                            Some(v.clone())
                        }
                    }
                } else {
                    if inline.is_some() {
                        return Err(format!("{word}: {name} takes no value"));
                    }
                    None
                };
                opts.push((name, val));
            }
            Ok(())
        };
        let num = |word: &str, name: &str, v: &Option<String>| -> Result<u64, String> {
            let v = v.as_deref().unwrap_or("");
            if name == "--payload-bytes" {
                parse_size(v).map_err(|e| format!("{word} {name}: {e}"))
            } else {
                v.parse::<u64>().map_err(|_| format!("{word} {name}: '{v}' is not a number"))
            }
        };
        let cmd = match word {
            "put" | "reput" => {
                let usage = if word == "put" { USAGE_PUT } else { USAGE_REPUT };
                let n = count(&mut i, word, usage)?;
                parse_opts(&mut i, &mut opts)?;
                let (mut salt, mut pb, mut pe, mut batch, mut live, mut workers, mut checkpoint) = (None, None, None, None, false, 1, false);
                for (name, v) in &opts {
                    match (word, name.as_str()) {
                        ("put", "--salt") => salt = v.clone(),
                        (_, "--payload-bytes") => pb = Some(num(word, name, v)?),
                        (_, "--partial-every") => pe = Some(num(word, name, v)?),
                        (_, "--batch") => {
                            let b = num(word, name, v)?;
                            if b == 0 {
                                return Err(format!("{word} --batch must be at least 1"));
                            }
                            batch = Some(b)
                        }
                        (_, "--workers") => workers = workers_opt(word, num(word, name, v)?)?,
                        ("reput", "--live") => live = true,
                        (_, "--with-checkpoint") => checkpoint = true,
                        _ => return Err(format!("unknown option {name} for {word}: {usage}")),
                    }
                }
                if word == "put" {
                    Cmd::Put { n, salt, payload_bytes: pb, partial_every: pe, batch, workers, checkpoint }
                } else {
                    Cmd::Reput { n, live, payload_bytes: pb, partial_every: pe, batch, workers, checkpoint }
                }
            }
            "load" => {
                let n = count(&mut i, word, USAGE_LOAD)?;
                parse_opts(&mut i, &mut opts)?;
                let (mut random, mut workers) = (false, 1);
                for (name, v) in &opts {
                    match name.as_str() {
                        "--random" => random = true,
                        "--workers" => workers = workers_opt(word, num(word, name, v)?)?,
                        _ => return Err(format!("unknown option {name} for load: {USAGE_LOAD}")),
                    }
                }
                Cmd::Load { n, random, workers }
            }
            "delete" => {
                let n = count(&mut i, word, USAGE_DELETE)?;
                parse_opts(&mut i, &mut opts)?;
                let mut random = false;
                for (name, _) in &opts {
                    match name.as_str() {
                        "--random" => random = true,
                        _ => return Err(format!("unknown option {name} for delete: {USAGE_DELETE}")),
                    }
                }
                Cmd::Delete { n, random }
            }
            "checkpoint" | "verify" | "reopen" | "sync" | "stats" => {
                parse_opts(&mut i, &mut opts)?;
                if let Some((name, _)) = opts.first() {
                    return Err(format!("{word} takes no options (got {name})"));
                }
                match word {
                    "checkpoint" => Cmd::Checkpoint,
                    "verify" => Cmd::Verify,
                    "reopen" => Cmd::Reopen,
                    "sync" => Cmd::Sync,
                    _ => Cmd::Stats,
                }
            }
            w => return Err(format!("unknown command '{w}' (commands: put, reput, delete, load, checkpoint, verify, reopen, sync, stats; see --help)")),
        };
        out.push(cmd);
    }
    Ok(out)
}

struct Run {
    w: Writer,
    dev: Device,
    quiet: bool,
}

impl Run {
    fn info(&self, msg: String) {
        if !self.quiet {
            eprintln!("rawblock-writer: {msg}");
        }
    }

    /// What a checkpoint did; `entries`: the index's size at its snapshot.
    fn checkpoint_said(&self, outcome: CheckpointOutcome, entries: usize) {
        self.info(match outcome {
            CheckpointOutcome::Written { seq, copy, payload_len } => {
                format!("checkpoint: seq {seq} -> container {copy}, {payload_len} bytes of JSON, {entries} entries")
            }
            CheckpointOutcome::Skipped { payload_len, cap } => format!("checkpoint: skipped ({payload_len} bytes > {cap}); seq stays {}", self.w.seq),
            CheckpointOutcome::Clean => "checkpoint: nothing changed since the last one; nothing written".into(),
        });
    }

    /// The items in put_many calls of `batch` keys (default: all in one, or one call per
    /// worker), one after another, or with `workers` > 1 on that many threads at once.
    /// With `checkpoint`, a checkpoint is written beside them (on a thread of its own).
    fn put_in_calls(&mut self, items: Vec<model::PutItem>, batch: Option<u64>, workers: u64, checkpoint: bool) -> Result<(), String> {
        let per = batch.map_or(items.len().div_ceil(workers as usize).max(1), |b| b as usize);
        let mut calls = Vec::new();
        let mut it = items.into_iter().peekable();
        while it.peek().is_some() {
            calls.push(it.by_ref().take(per).collect::<Vec<_>>());
        }
        if checkpoint {
            let live = self.w.live();
            let outcome = self.w.put_concurrent_with_checkpoint(&mut self.dev, calls, workers as usize)?;
            self.checkpoint_said(outcome, live);
            return Ok(());
        }
        if workers > 1 {
            return self.w.put_concurrent(&mut self.dev, calls, workers as usize);
        }
        for call in calls {
            self.w.put_many(&mut self.dev, call)?;
        }
        Ok(())
    }

    fn exec(&mut self, c: &Cmd) -> Result<(), String> {
        match c {
            Cmd::Put { n, salt, payload_bytes, partial_every, batch, workers, checkpoint } => {
                let (p0, s0) = (self.w.run.puts, self.w.next_slot);
                let items = self.w.plan_new(*n, salt.as_deref(), *payload_bytes, *partial_every)?;
                self.put_in_calls(items, *batch, *workers, *checkpoint)?;
                self.info(format!(
                    "put {n}: {} stored, next_slot {} (was {s0}), {} free",
                    self.w.run.puts - p0,
                    self.w.next_slot,
                    self.w.free_slots().len()
                ));
            }
            Cmd::Reput { n, live, payload_bytes, partial_every, batch, workers, checkpoint } => {
                let (p0, q0) = (self.w.run.puts, self.w.run.puts_noop);
                let items = self.w.plan_reput(*n, *live, *payload_bytes, *partial_every)?;
                self.put_in_calls(items, *batch, *workers, *checkpoint)?;
                self.info(format!(
                    "reput {n}: {} stored, {} already indexed (no I/O)",
                    self.w.run.puts - p0,
                    self.w.run.puts_noop - q0
                ));
            }
            Cmd::Delete { n, random } => {
                let keys = self.w.pick_keys(*n, *random).map_err(|e| format!("delete {n}: {e}"))?;
                let d = self.w.delete_keys(&keys);
                self.info(format!(
                    "delete {n}: {d} deleted, {} live, {} free",
                    self.w.live(),
                    self.w.free_slots().len()
                ));
            }
            Cmd::Load { n, random, workers } => {
                let keys = self.w.pick_keys(*n, *random).map_err(|e| format!("load {n}: {e}"))?;
                let got = self.w.load(&mut self.dev, &keys, *workers as usize)?;
                self.info(format!("load {n}: {got} payloads read and checked"));
            }
            Cmd::Checkpoint => {
                let outcome = self.w.checkpoint(&mut self.dev)?;
                self.checkpoint_said(outcome, self.w.live());
            }
            Cmd::Verify => {
                let (n, inferred) = self.w.verify(&mut self.dev)?;
                let extra = if inferred > 0 {
                    format!(" ({inferred} recovered without history: content generation inferred)")
                } else {
                    String::new()
                };
                self.info(format!("verify: {n} entries ok{extra}"));
            }
            Cmd::Reopen => {
                let r = self.w.reopen(&mut self.dev)?;
                match (&r.rejected, r.seq) {
                    (Some(why), _) => eprintln!("rawblock-writer: warning: reopen: {why}; starting with an empty index"),
                    (None, Some(seq)) => self.info(format!(
                        "reopen: checkpoint seq {seq}: {} entries recovered, {} skipped, {} dropped by header check, next_slot {}, {} free{}",
                        r.recovered,
                        r.skipped,
                        r.dropped,
                        self.w.next_slot,
                        self.w.free_slots().len(),
                        if r.matches_previous { ", same as the index before" } else { ", DIFFERENT from the index before" }
                    )),
                    (None, None) => {}
                }
            }
            Cmd::Sync => {
                self.dev.sync()?;
                self.w.count_sync();
            }
            Cmd::Stats => println!("{}", self.w.stats_json(self.dev.engine, self.dev.odirect)),
        }
        Ok(())
    }
}

fn save_state(path: &Path, w: &Writer) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, w.to_state().to_string()).map_err(|e| format!("writing state {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("writing state {}: {e}", path.display()))
}

fn run(a: Args) -> Result<(), String> {
    let script = parse_script(&a.commands)?;
    if a.model.contains('@') {
        return Err(format!("--model {:?} contains '@', which LMCache's object keys forbid", a.model));
    }
    if a.layers == 0 || a.hidden == 0 {
        return Err("--layers and --hidden must be at least 1".into());
    }
    let engine = if a.engine == "io_uring" { Engine::IoUring } else { Engine::Posix };
    let cfg = GeometryConfig {
        block_align: a.block_align,
        header_bytes: a.header_bytes,
        slot_bytes: a.slot_bytes,
        meta_total_bytes: a.meta_total_bytes,
        capacity_bytes: a.capacity_bytes,
    };
    // Check the geometry's own rules before opening anything (device size comes later).
    match cfg.validate(u64::MAX) {
        // Only the device's size bounds the slot count: checked against it below.
        Ok(_) | Err(fdpblk::layout::GeometryError::TooManySlots { .. }) => {}
        Err(e) => return Err(e.to_string()),
    }
    let dev = Device::open(&a.device, engine, a.odirect, a.block_align as usize)?;
    let geom = cfg.validate(dev.size).map_err(|e| format!("{}: {e}", a.device.display()))?;
    let state_doc = match &a.state {
        Some(p) if p.exists() => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("reading state {}: {e}", p.display()))?;
            Some(
                serde_json::from_str::<serde_json::Value>(&text)
                    .map_err(|e| format!("state {}: not JSON: {e}", p.display()))?,
            )
        }
        _ => None,
    };
    let seed = match (a.seed, state_doc.as_ref().and_then(|s| s.get("seed")).and_then(|s| s.as_u64())) {
        (Some(s), _) => s,
        (None, Some(s)) => s,
        (None, None) => 1,
    };
    if a.key_layers > 0 && a.namespace != "legacy" {
        return Err("--key-layers needs --namespace legacy (layer keys are the non-MP plugin's)".into());
    }
    let opts = Options {
        namespace: if a.namespace == "legacy" { Namespace::Legacy { key_layers: a.key_layers } } else { Namespace::Object },
        seed,
        device_path: a.device_path_string.clone().unwrap_or_else(|| a.device.to_string_lossy().into_owned()),
        model: a.model.clone(),
        kv_rank: a.kv_rank,
        object_group_id: a.object_group_id,
        dtype: if a.dtype == "uint8" { Dtype::U8 } else { Dtype::Bf16 },
        layers: a.layers,
        hidden: a.hidden,
        partial_every: a.partial_every,
        payload_bytes: a.payload_bytes,
    };
    let w = match (&state_doc, &a.state) {
        (Some(doc), Some(p)) => {
            Writer::from_state(doc, geom, opts).map_err(|e| format!("state {}: {e}", p.display()))?
        }
        _ => Writer::new(geom, opts),
    };
    // Fail on bad payload sizes before any I/O.
    if script.iter().any(|c| matches!(c, Cmd::Put { .. } | Cmd::Reput { .. })) {
        w.full_size(None)?;
    }
    let mut r = Run { w, dev, quiet: a.quiet };
    let mut result = Ok(());
    for c in &script {
        if let Err(e) = r.exec(c) {
            result = Err(e);
            break;
        }
    }
    if let Some(p) = &a.state {
        save_state(p, &r.w)?;
    }
    result
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("rawblock-writer: {e}");
        std::process::exit(1);
    }
}
