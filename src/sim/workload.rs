//! The LMCache workload model: deterministic from a seed, it plays LMCache 0.5.6 `raw_block`
//! (its index, slot allocator, eviction controller and checkpoint thread) under a stream of
//! inference requests, and emits what LMCache does to the device.
//!
//! Two layers:
//! - `Workload` decides *what* LMCache does: requests of prefix-chunk sequences from several
//!   tenants (Zipf or uniform popularity), lookups that load a cached prefix, puts of the missing
//!   chunks into slots (bump pointer, then LIFO reuse of freed slots, or the per-placement-id
//!   affinity of LMCache's FDP mode), the MP L2 eviction controller (global LRU, or per-cache_salt
//!   LRU with quotas), and checkpoints at LMCache's cadence with the JSON's real size. It reports
//!   them as `LmOp`s.
//! - `IoShaper` turns each `LmOp` into the block requests the device sees: posix O_DIRECT (header
//!   write, then the payload rounded to `block_align` and split at the queue's largest request),
//!   or buffered (page-cache writeback: dirty pages of a window of puts, sorted by offset, merged
//!   and split).
//!
//! Facts: `../shared/reference/lmcache-raw-block.md` §2–9 (layout, allocator, I/O paths,
//! cadence), §11 (JSON entry sizes), §14 (built-in FDP); LMCache's eviction controller
//! (`storage_controllers/eviction_controller.py`: every second, usage ≥ watermark → evict
//! `eviction_ratio` of the tracked keys in LRU order; per-salt quotas with IsolatedLRU).
//!
//! Simplifications (stated in `docs/waf.md`): requests are served one at a time; simulated time
//! advances with the bytes written at `write_rate_mb_s`; there is no L1 (CPU) cache in front of
//! L2, so every hit is an L2 load that refreshes the key's LRU position.

use super::SplitMix64;
use crate::cli::parse_size;
use crate::layout::keys::{salt_bucket, salt_bucket_id};
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::layout::{Geometry, GeometryConfig};
use serde_json::Value;
use std::collections::HashMap;

const NONE: u32 = u32::MAX;

/// LMCache's deployment mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// MP server with the `raw_block` L2 adapter (namespace `object`, O_DIRECT by default).
    Mp,
    /// The non-MP plugin (namespace `legacy`, buffered by default): no eviction, puts fail when
    /// the device is full; keys go away only by an explicit remove.
    NonMp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// posix `pwrite` with O_DIRECT: header, then payload rounded to `block_align`.
    ODirect,
    /// posix `pwrite` into the page cache; the device sees writeback.
    Buffered,
    /// LMCache's `io_uring` engine with O_DIRECT: a store's keys go in batches of
    /// [`URING_BATCH_KEYS`], each one `batched_write` whose header and payload requests are all
    /// in flight at once, with no order among them (reference §8.2). How the kernel delivers
    /// them to the ublk queue is modelled: in submission order, each request moved back by a
    /// seeded random 0 to `uring_reorder_window - 1` places (when a batch outruns the queue's
    /// tags, the rest is issued by io-uring's worker threads, which race).
    IoUring,
}

/// Keys per `batched_write` of LMCache's io_uring engine (`_MAX_PUT_MANY_IO_URING_BATCH_KEYS`).
pub const URING_BATCH_KEYS: usize = 64;

/// Default of `uring_reorder_window`, in requests: an assumption (half of a default ublk queue's
/// tags), not a measurement; docs/waf.md gives the WAF for several windows.
pub const DEFAULT_URING_REORDER_WINDOW: u32 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// One LRU list over all keys (`"LRU"`).
    Lru,
    /// One LRU list per cache_salt, evicted against the tenant's quota (`"IsolatedLRU"`).
    IsolatedLru,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EvictionSpec {
    pub policy: EvictionPolicy,
    pub trigger_watermark: f64,
    pub eviction_ratio: f64,
    /// Seconds between the controller's checks (LMCache: 1).
    pub interval_s: f64,
}

/// One tenant: a cache_salt, a share of the requests, and its prompts.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantSpec {
    pub name: String,
    /// The request's `cache_salt` (part of every key; LMCache's FDP mode buckets by the part
    /// before the first `:`). Empty: no salt.
    pub salt: String,
    /// Relative share of the requests.
    pub share: f64,
    /// Per-tenant quota as a fraction of LMCache's capacity (IsolatedLRU only).
    pub quota: Option<f64>,
    /// Zipf exponent of document popularity (0: uniform).
    pub zipf: f64,
    /// Distinct document chunks, as a multiple of the cache's slots.
    pub universe: f64,
    /// Shared system prompts (each doc uses one) and their length in chunks.
    pub system_prompts: u32,
    pub prefix_chunks: u32,
    /// Document length in chunks, uniform in [min, max].
    pub doc_chunks_min: u32,
    pub doc_chunks_max: u32,
    /// Fresh chunks at the end of every request (the user's own question: never seen again).
    pub unique_tail_chunks: u32,
    /// The last chunk of a request is partial (fewer tokens than a full chunk).
    pub partial_last: bool,
}

/// A workload file (`tools/workloads/*.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadSpec {
    pub name: String,
    pub description: String,
    pub mode: Mode,
    pub io: IoMode,
    pub block_align: u64,
    pub header_bytes: u64,
    pub slot_bytes: u64,
    /// Payload of a full chunk (default: the slot's payload capacity).
    pub chunk_bytes: u64,
    pub meta_total_bytes: u64,
    /// Largest request the block device accepts (ublk `io_buf_size`, 512 KiB by default).
    pub max_request_bytes: u64,
    /// Buffered I/O: puts whose dirty pages are written back together.
    pub writeback_puts: usize,
    /// io_uring: how far back (in requests) the kernel may deliver a request of a batch.
    pub uring_reorder_window: u64,
    /// io_uring: the ublk queue's depth (fdpblk's `-d`); half its tags may hold payloads
    /// waiting for their headers, as under `fdpblk add`.
    pub ublk_queue_depth: u16,
    pub eviction: Option<EvictionSpec>,
    /// Order new keys of one store enter the LRU list: reversed puts the request's last chunk
    /// nearest the LRU end (LMCache's prefix-match rationale), forward the other way round.
    pub lru_insert_reversed: bool,
    pub checkpoint_interval_s: f64,
    /// Chance that a checkpoint tick finds the device idle (LMCache skips busy ticks).
    pub checkpoint_idle_probability: f64,
    pub write_rate_mb_s: f64,
    /// Non-MP: a key is removed after it was loaded (`remove_after_retrieve`).
    pub remove_after_read: bool,
    /// For checkpoint JSON sizes: model name and chunk hash length (object namespace).
    pub model_name: String,
    pub chunk_hash_bytes: u32,
    pub tenants: Vec<TenantSpec>,
}

fn err<T>(s: impl Into<String>) -> Result<T, String> {
    Err(s.into())
}

fn get_size(v: &Value, k: &str, default: u64) -> Result<u64, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => {
            n.as_u64().ok_or_else(|| format!("\"{k}\" must be a non-negative integer or a size like \"16M\""))
        }
        Some(Value::String(s)) => parse_size(s).map_err(|e| format!("\"{k}\": {e}")),
        Some(_) => err(format!("\"{k}\" must be a number or a size string like \"16M\"")),
    }
}

fn get_f64(v: &Value, k: &str, default: f64) -> Result<f64, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x.as_f64().filter(|f| f.is_finite()).ok_or_else(|| format!("\"{k}\" must be a number")),
    }
}

fn get_u32(v: &Value, k: &str, default: u32) -> Result<u32, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("\"{k}\" must be a non-negative integer")),
    }
}

fn get_bool(v: &Value, k: &str, default: bool) -> Result<bool, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x.as_bool().ok_or_else(|| format!("\"{k}\" must be true or false")),
    }
}

fn get_str<'a>(v: &'a Value, k: &str, default: &'a str) -> Result<&'a str, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x.as_str().ok_or_else(|| format!("\"{k}\" must be a string")),
    }
}

fn check_keys(v: &Value, what: &str, allowed: &[&str]) -> Result<(), String> {
    if let Some(o) = v.as_object() {
        for k in o.keys() {
            if !allowed.contains(&k.as_str()) {
                return err(format!("{what}: unknown field \"{k}\"; known fields: {}", allowed.join(", ")));
            }
        }
        Ok(())
    } else {
        err(format!("{what} must be a JSON object"))
    }
}

/// Upper bounds of a workload's sizes: past them the model's tables would not fit in memory.
const MAX_UNIVERSE: f64 = 100.0;
const MAX_PROMPTS: u32 = 1_000_000;
const MAX_REQUEST_CHUNKS: u32 = 65_536;

impl WorkloadSpec {
    pub fn from_json_str(text: &str) -> Result<WorkloadSpec, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        Self::from_json(&v)
    }

    pub fn from_json(v: &Value) -> Result<WorkloadSpec, String> {
        check_keys(
            v,
            "workload",
            &[
                "name",
                "description",
                "mode",
                "io",
                "block_align",
                "header_bytes",
                "slot_bytes",
                "chunk_bytes",
                "meta_total_bytes",
                "max_request_bytes",
                "writeback_puts",
                "uring_reorder_window",
                "ublk_queue_depth",
                "eviction",
                "lru_insert",
                "checkpoint_interval_s",
                "checkpoint_idle_probability",
                "write_rate_mb_s",
                "remove_after_read",
                "model_name",
                "chunk_hash_bytes",
                "tenants",
            ],
        )?;
        let mode = match get_str(v, "mode", "mp")? {
            "mp" => Mode::Mp,
            "non_mp" => Mode::NonMp,
            m => return err(format!("\"mode\": \"{m}\" is not mp or non_mp")),
        };
        let io = match get_str(v, "io", if mode == Mode::Mp { "odirect" } else { "buffered" })? {
            "odirect" => IoMode::ODirect,
            "buffered" => IoMode::Buffered,
            "io_uring" => IoMode::IoUring,
            m => return err(format!("\"io\": \"{m}\" is not odirect, buffered or io_uring")),
        };
        let block_align = get_size(v, "block_align", 4096)?;
        let header_bytes = get_size(v, "header_bytes", 4096)?;
        let slot_bytes = get_size(v, "slot_bytes", 16 << 20)?;
        let meta_total_bytes = get_size(v, "meta_total_bytes", if mode == Mode::Mp { 256 << 20 } else { 128 << 20 })?;
        if block_align < 512 || !block_align.is_power_of_two() {
            return err(format!("\"block_align\" {block_align} must be a power of two of at least 512"));
        }
        if slot_bytes <= header_bytes {
            return err(format!("\"slot_bytes\" {slot_bytes} must be larger than \"header_bytes\" {header_bytes}"));
        }
        let cap = slot_bytes.saturating_sub(header_bytes);
        let chunk_bytes = get_size(v, "chunk_bytes", cap)?;
        if chunk_bytes == 0 || chunk_bytes > cap {
            return err(format!("\"chunk_bytes\" {chunk_bytes} must be in 1..={cap} (slot_bytes - header_bytes)"));
        }
        let eviction = match v.get("eviction") {
            None | Some(Value::Null) => None,
            Some(e) => {
                check_keys(e, "eviction", &["policy", "trigger_watermark", "eviction_ratio", "interval_s"])?;
                let policy = match get_str(e, "policy", "LRU")? {
                    "LRU" => EvictionPolicy::Lru,
                    "IsolatedLRU" => EvictionPolicy::IsolatedLru,
                    p => return err(format!("eviction \"policy\": \"{p}\" is not LRU or IsolatedLRU")),
                };
                let s = EvictionSpec {
                    policy,
                    trigger_watermark: get_f64(e, "trigger_watermark", 0.8)?,
                    eviction_ratio: get_f64(e, "eviction_ratio", 0.2)?,
                    interval_s: get_f64(e, "interval_s", 1.0)?,
                };
                if !(s.trigger_watermark > 0.0 && s.trigger_watermark <= 1.0)
                    || !(s.eviction_ratio > 0.0 && s.eviction_ratio <= 1.0)
                {
                    return err("eviction: trigger_watermark and eviction_ratio must be in (0, 1]");
                }
                if s.interval_s <= 0.0 {
                    return err("eviction: interval_s must be > 0");
                }
                Some(s)
            }
        };
        if mode == Mode::NonMp && eviction.is_some() {
            return err("non_mp has no eviction controller: drop \"eviction\" (keys go only by remove_after_read)");
        }
        let lru_insert_reversed = match get_str(v, "lru_insert", "reversed")? {
            "reversed" => true,
            "forward" => false,
            s => return err(format!("\"lru_insert\": \"{s}\" is not reversed or forward")),
        };
        let tenants_v = v.get("tenants").and_then(Value::as_array).ok_or("\"tenants\" must be a non-empty list")?;
        if tenants_v.is_empty() {
            return err("\"tenants\" must be a non-empty list");
        }
        let mut tenants = Vec::new();
        for (i, t) in tenants_v.iter().enumerate() {
            let what = format!("tenants[{i}]");
            check_keys(
                t,
                &what,
                &[
                    "name",
                    "salt",
                    "share",
                    "quota",
                    "zipf",
                    "universe",
                    "system_prompts",
                    "prefix_chunks",
                    "doc_chunks",
                    "unique_tail_chunks",
                    "partial_last",
                ],
            )?;
            let (dmin, dmax) = match t.get("doc_chunks") {
                None => (1, 16),
                Some(Value::Array(a)) if a.len() == 2 => {
                    let g = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
                    match (g(&a[0]), g(&a[1])) {
                        (Some(a), Some(b)) if a <= b => (a, b),
                        _ => return err(format!("{what}: \"doc_chunks\" must be [min, max] with min <= max")),
                    }
                }
                Some(_) => return err(format!("{what}: \"doc_chunks\" must be [min, max]")),
            };
            let ts = TenantSpec {
                name: get_str(t, "name", "")?.to_string(),
                salt: get_str(t, "salt", "")?.to_string(),
                share: get_f64(t, "share", 1.0)?,
                quota: match t.get("quota") {
                    None | Some(Value::Null) => None,
                    Some(q) => Some(
                        q.as_f64()
                            .filter(|q| *q > 0.0)
                            .ok_or_else(|| format!("{what}: \"quota\" must be a fraction > 0"))?,
                    ),
                },
                zipf: get_f64(t, "zipf", 0.9)?,
                universe: get_f64(t, "universe", 4.0)?,
                system_prompts: get_u32(t, "system_prompts", 8)?.max(1),
                prefix_chunks: get_u32(t, "prefix_chunks", 1)?,
                doc_chunks_min: dmin,
                doc_chunks_max: dmax,
                unique_tail_chunks: get_u32(t, "unique_tail_chunks", 0)?,
                partial_last: get_bool(t, "partial_last", true)?,
            };
            if !(ts.share > 0.0 && ts.share.is_finite() && (0.0..=10.0).contains(&ts.zipf)) {
                return err(format!("{what}: share must be > 0, zipf 0 to 10"));
            }
            // Bounds keep the model's tables (documents, prompts) within memory.
            if !(ts.universe > 0.0 && ts.universe <= MAX_UNIVERSE) {
                return err(format!("{what}: \"universe\" must be > 0 and at most {MAX_UNIVERSE} (times the cache's slots)"));
            }
            if ts.system_prompts > MAX_PROMPTS {
                return err(format!("{what}: \"system_prompts\" must be at most {MAX_PROMPTS}"));
            }
            if [ts.prefix_chunks, ts.doc_chunks_max, ts.unique_tail_chunks].iter().any(|&n| n > MAX_REQUEST_CHUNKS) {
                return err(format!("{what}: \"prefix_chunks\", \"doc_chunks\" and \"unique_tail_chunks\" must be at most {MAX_REQUEST_CHUNKS}"));
            }
            if ts.doc_chunks_max == 0 && ts.unique_tail_chunks == 0 && ts.prefix_chunks == 0 {
                return err(format!("{what}: a request needs at least one chunk"));
            }
            tenants.push(ts);
        }
        if eviction.as_ref().is_some_and(|e| e.policy == EvictionPolicy::IsolatedLru)
            && tenants.iter().any(|t| t.quota.is_none())
        {
            return err("IsolatedLRU evicts against per-tenant quotas: give every tenant a \"quota\" (LMCache wipes salts without one)");
        }
        let spec = WorkloadSpec {
            name: get_str(v, "name", "")?.to_string(),
            description: get_str(v, "description", "")?.to_string(),
            mode,
            io,
            block_align,
            header_bytes,
            slot_bytes,
            chunk_bytes,
            meta_total_bytes,
            max_request_bytes: get_size(v, "max_request_bytes", 512 << 10)?,
            writeback_puts: get_u32(v, "writeback_puts", 64)?.max(1) as usize,
            uring_reorder_window: u64::from(get_u32(v, "uring_reorder_window", DEFAULT_URING_REORDER_WINDOW)?),
            ublk_queue_depth: match get_u32(v, "ublk_queue_depth", 128)? {
                d @ 1..=4096 => d as u16,
                d => return err(format!("\"ublk_queue_depth\" {d} must be 1 to 4096 (ublk's limit)")),
            },
            eviction,
            lru_insert_reversed,
            checkpoint_interval_s: get_f64(v, "checkpoint_interval_s", 60.0)?,
            checkpoint_idle_probability: get_f64(v, "checkpoint_idle_probability", 1.0)?,
            write_rate_mb_s: get_f64(v, "write_rate_mb_s", 2000.0)?,
            remove_after_read: get_bool(v, "remove_after_read", false)?,
            model_name: get_str(v, "model_name", "meta-llama/Llama-3.1-8B-Instruct")?.to_string(),
            chunk_hash_bytes: get_u32(v, "chunk_hash_bytes", if mode == Mode::Mp { 32 } else { 8 })?,
            tenants,
        };
        if spec.max_request_bytes < spec.block_align || !spec.max_request_bytes.is_multiple_of(spec.block_align) {
            return err("\"max_request_bytes\" must be a multiple of block_align");
        }
        if !(1.0..=1e6).contains(&spec.write_rate_mb_s) {
            return err("\"write_rate_mb_s\" must be 1 to 1000000");
        }
        if !(0.1..=86400.0).contains(&spec.checkpoint_interval_s) {
            return err("\"checkpoint_interval_s\" must be 0.1 to 86400");
        }
        if !(0.0..=1.0).contains(&spec.checkpoint_idle_probability) {
            return err("\"checkpoint_idle_probability\" must be 0 to 1");
        }
        if !(1..=64).contains(&spec.chunk_hash_bytes) {
            return err("\"chunk_hash_bytes\" must be 1 to 64");
        }
        if spec.max_request_bytes > 1 << 30 || spec.writeback_puts > 1 << 20 {
            return err("\"max_request_bytes\" must be at most 1G and \"writeback_puts\" at most 1048576");
        }
        if spec.uring_reorder_window > 1 << 20 {
            return err("\"uring_reorder_window\" must be at most 1048576 requests");
        }
        if spec.remove_after_read && mode == Mode::Mp {
            return err("\"remove_after_read\" is a non-MP option");
        }
        Ok(spec)
    }

    /// LMCache's geometry for a device of `device_bytes` of which it may use `capacity_bytes`.
    pub fn geometry(&self, device_bytes: u64, capacity_bytes: u64) -> Result<Geometry, String> {
        GeometryConfig {
            block_align: self.block_align,
            header_bytes: self.header_bytes,
            slot_bytes: self.slot_bytes,
            meta_total_bytes: self.meta_total_bytes,
            capacity_bytes,
        }
        .validate(device_bytes)
        .map_err(|e| e.to_string())
    }

    /// Bytes of one checkpoint JSON entry of tenant `t` (`"key":{...},`), for a slot at `offset`
    /// holding `size` payload bytes: the 0.5.6 compact encoding of §4 of the reference.
    pub fn entry_json_bytes(&self, key_len: u64, offset: u64, size: u64) -> u64 {
        // "KEY":{"offset":O,"size":S,"shape":[2,32,256,1024],"dtype":"bfloat16","fmt":"KV_2LTD","cached_positions":null},
        const FIXED: u64 = (r#""":{"offset":,"size":,"shape":[2,32,256,1024],"dtype":"bfloat16","fmt":"KV_2LTD","cached_positions":null},"#).len() as u64;
        FIXED + key_len + digits(offset) + digits(size)
    }

    /// Length of the encoded key string of tenant `t`.
    pub fn key_len(&self, t: usize) -> u64 {
        let salt = &self.tenants[t].salt;
        match self.mode {
            // <quote(model)>@<kv_rank:#010x>@<group:x>@<hash hex>[@salt]
            Mode::Mp => {
                quoted_len(&self.model_name)
                    + 1
                    + 10
                    + 1
                    + 1
                    + 1
                    + 2 * u64::from(self.chunk_hash_bytes)
                    + if salt.is_empty() { 0 } else { 1 + salt.len() as u64 }
            }
            // <model>@<world>@<worker>@<hash hex>@<dtype>
            Mode::NonMp => {
                self.model_name.len() as u64 + 5 + 2 * u64::from(self.chunk_hash_bytes) + 1 + "bfloat16".len() as u64
            }
        }
    }

    /// Bytes of the JSON before the entries and after them, for `device_path` "/dev/ublkb0".
    pub fn json_fixed_bytes(&self, g: &Geometry, next_slot: u64) -> u64 {
        json_head(g, next_slot).len() as u64 + "}}".len() as u64
    }
}

/// LMCache's checkpoint JSON up to the opening brace of `entries`, for `device_path`
/// "/dev/ublkb0" (the fields in LMCache's order).
fn json_head(g: &Geometry, next_slot: u64) -> String {
    format!(
        r#"{{"version":1,"device_path":"/dev/ublkb0","capacity_bytes":{},"block_align":{},"header_bytes":{},"slot_bytes":{},"meta_total_bytes":{},"meta_magic":"LMCIDX01","meta_version":1,"data_base_offset":{},"next_slot":{},"entries":{{"#,
        g.capacity_bytes, g.block_align, g.header_bytes, g.slot_bytes, g.meta_total_bytes, g.meta_total_bytes, next_slot
    )
}

fn digits(n: u64) -> u64 {
    n.checked_ilog10().map_or(1, |d| u64::from(d) + 1)
}

fn quoted_len(s: &str) -> u64 {
    // urllib.parse.quote(s, safe=""): unreserved characters stay, everything else is %XX.
    s.bytes().map(|b| if b.is_ascii_alphanumeric() || b"_.-~".contains(&b) { 1 } else { 3 }).sum()
}

/// A live index entry of a committed checkpoint.
pub use crate::place::LiveEntry;

/// What LMCache does, in order.
#[derive(Debug)]
pub enum LmOp<'a> {
    /// A put: header + payload written to `slot`. `pid` is the placement id LMCache's own FDP
    /// mode would attach (only when that mode is emulated; 0 = no directive). `popularity` is
    /// the chance that a request asks for this chunk again (its tenant's share × its
    /// document's Zipf mass; 0 for a chunk no request repeats): only the `popularity` bound
    /// reads it, since no block device can.
    Put { slot: u64, identity: u64, payload_len: u64, tenant: u32, pid: Option<u16>, popularity: f64 },
    /// A load of a slot's payload (loads never read the header).
    Load { slot: u64, payload_len: u64 },
    /// A key left the index (eviction or remove): nothing is written.
    Delete { slot: u64 },
    /// A committed checkpoint of `json_bytes` bytes with the live entries, and the JSON itself
    /// when the workload was asked for it (`Workload::emit_json`).
    Checkpoint { seq: u64, json_bytes: u64, entries: &'a [LiveEntry], json: Option<&'a [u8]> },
    /// Simulated time advanced to `now_s` (emitted at each eviction-controller tick).
    Tick { now_s: f64 },
}

/// LMCache's built-in FDP mode, emulated (reference §14): cache_salt_prefix buckets take the
/// data placement ids first come, first served; pid_affinity slot reuse.
#[derive(Clone, Debug)]
pub struct LmcacheFdpMode {
    /// Data placement ids (non-zero, the checkpoint id excluded), in the order buckets take them.
    pub data_pids: Vec<u16>,
}

/// Counters of what LMCache did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadStats {
    pub requests: u64,
    pub chunks: u64,
    pub hits: u64,
    pub puts: u64,
    pub puts_noop: u64,
    pub puts_failed: u64,
    pub loads: u64,
    pub deletes: u64,
    pub evictions: u64,
    pub checkpoints: u64,
    pub checkpoints_skipped_busy: u64,
    /// Checkpoints larger than a container: LMCache skips them (S2).
    pub checkpoints_overflow: u64,
    pub checkpoint_bytes: u64,
    /// The largest checkpoint JSON written.
    pub checkpoint_max_bytes: u64,
    pub put_payload_bytes: u64,
}

/// Zipf(s) over ranks 1..=n by inverse CDF (binary search); s = 0 is uniform.
#[derive(Clone, Debug)]
struct Popularity {
    cdf: Vec<f64>,
}

impl Popularity {
    fn new(n: u64, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(n as usize);
        let mut acc = 0.0;
        for r in 1..=n {
            acc += (r as f64).powf(-s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Popularity { cdf }
    }
    /// The chance of drawing rank index `r` (0-based, as `sample` returns).
    fn mass(&self, r: u64) -> f64 {
        let r = r as usize;
        let below = if r == 0 { 0.0 } else { self.cdf.get(r - 1).copied().unwrap_or(1.0) };
        self.cdf.get(r).copied().unwrap_or(1.0) - below
    }
    fn sample(&self, rng: &mut SplitMix64) -> u64 {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len() - 1) as u64
    }
}

/// A document's hash (its system prompt and length derive from it).
fn doc_hash(tenant_seed: u64, doc: u64) -> u64 {
    mix64(tenant_seed ^ mix64(doc.wrapping_add(0x5151)))
}

/// `urllib.parse.quote(s, safe="")`.
fn quote(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"_.-~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The encoded key string LMCache indexes for the model's key number `id` of a tenant whose
/// salt is `salt` (`object_key_to_string` in MP mode, `CacheEngineKey.to_string()` in non-MP),
/// written into `out`.
pub fn key_string(mode: Mode, quoted_model: &str, hash_bytes: u32, salt: &str, id: u64, out: &mut String) {
    use std::fmt::Write as _;
    out.clear();
    match mode {
        Mode::Mp => {
            let _ = write!(out, "{quoted_model}@0x01000100@0@");
            let mut i = 0u64;
            let mut left = hash_bytes as usize * 2;
            while left > 0 {
                let w = format!("{:016x}", mix64(id ^ i.wrapping_mul(0xa076_1d64_78bd_642f)));
                out.push_str(&w[..left.min(16)]);
                left -= left.min(16);
                i += 1;
            }
            if !salt.is_empty() {
                out.push('@');
                out.push_str(salt);
            }
        }
        // The model name is not escaped in legacy keys; the chunk hash is its low 64 bits.
        Mode::NonMp => {
            let _ = write!(out, "{}@1@0@{id:x}@bfloat16", percent_decode_model(quoted_model));
        }
    }
}

fn percent_decode_model(q: &str) -> String {
    crate::layout::keys::percent_decode(q)
}

/// The slot identity LMCache writes for the key (`slot_identity` in `key_codec.py`).
pub fn key_identity(mode: Mode, key: &str, id: u64) -> u64 {
    match mode {
        Mode::Mp => crate::layout::keys::object_identity(key),
        Mode::NonMp => id,
    }
}

/// A strong 64-bit mix (the SplitMix64 finaliser) for deterministic identities.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn ident(parts: &[u64]) -> u64 {
    let mut h = 0x6a09_e667_f3bc_c908u64;
    for &p in parts {
        h = mix64(h ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
    h
}

struct Tenant {
    spec: TenantSpec,
    seed: u64,
    pop: Popularity,
    /// Per system prompt, the chance that a request uses it (the mass of its documents).
    prompt_mass: Vec<f64>,
    key_len: u64,
    /// [`salt_bucket_id`] of the tenant's cache_salt, for the checkpoints' live entries.
    salt_bucket: u64,
    unique_counter: u64,
    /// Slots charged to this tenant (usage by cache_salt).
    used: u64,
    lru: Lru,
}

/// Intrusive doubly linked LRU list over slot numbers (head = least recently used).
#[derive(Clone, Debug)]
struct Lru {
    head: u32,
    tail: u32,
    len: u64,
}

impl Lru {
    fn new() -> Self {
        Lru { head: NONE, tail: NONE, len: 0 }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct SlotRec {
    /// The model's own key number (the index key); `identity` is what the header carries.
    id: u64,
    identity: u64,
    payload_len: u64,
    tenant: u32,
    live: bool,
    /// Placement id this slot was last written with (pid_affinity).
    pid: u16,
    prev: u32,
    next: u32,
}

/// LMCache under a request stream. Call `step` for one request.
pub struct Workload {
    pub spec: WorkloadSpec,
    pub geometry: Geometry,
    rng: SplitMix64,
    /// Whether a checkpoint tick finds LMCache idle: a stream of its own, so that the request
    /// stream is the same whatever `checkpoint_idle_probability` is (runs compare like with like).
    idle_rng: SplitMix64,
    tenants: Vec<Tenant>,
    tenant_cdf: Vec<f64>,
    index: HashMap<u64, u32>,
    slots: Vec<SlotRec>,
    /// Insertion order of the index (for nothing but determinism of iteration): not kept.
    free: Vec<u32>,
    /// Per placement id, freed slots last written with it (pid_affinity); entries may be stale.
    free_by_pid: Vec<Vec<u32>>,
    is_free: Vec<bool>,
    next_slot: u64,
    global_lru: Lru,
    fdp: Option<LmcacheFdpMode>,
    bucket_pid: HashMap<String, u16>,
    now_s: f64,
    next_tick_s: f64,
    next_checkpoint_s: f64,
    dirty: u64,
    persisted_dirty: u64,
    seq: u64,
    pub stats: WorkloadStats,
    entries: Vec<LiveEntry>,
    /// Build the checkpoint JSON text (for fdpblk's checkpoint reader), not only its size.
    emit_json: bool,
    json: Vec<u8>,
    quoted_model: String,
    key_buf: String,
    chunk_buf: Vec<(u64, u64, f64)>,
    new_keys: Vec<u32>,
    ops: Vec<LmOpOwned>,
}

/// `LmOp` without the borrowed checkpoint list (queued inside `step`).
#[derive(Clone, Copy, Debug)]
enum LmOpOwned {
    Put { slot: u64, identity: u64, payload_len: u64, tenant: u32, pid: Option<u16>, popularity: f64 },
    Load { slot: u64, payload_len: u64 },
    Delete { slot: u64 },
    Checkpoint { json_bytes: u64 },
    Tick { now_s: f64 },
}

impl Workload {
    /// LMCache on a device of `device_bytes`, allowed `capacity_bytes` of it (0 = all).
    /// `fdp`: emulate LMCache's built-in FDP mode (placement ids, pid_affinity reuse).
    pub fn new(
        spec: WorkloadSpec,
        device_bytes: u64,
        capacity_bytes: u64,
        seed: u64,
        fdp: Option<LmcacheFdpMode>,
    ) -> Result<Workload, String> {
        let geometry = spec.geometry(device_bytes, capacity_bytes)?;
        let slots_n = geometry.max_slots;
        if slots_n >= u64::from(NONE) {
            return err("too many slots for the model (2^32)");
        }
        let total_share: f64 = spec.tenants.iter().map(|t| t.share).sum();
        let mut acc = 0.0;
        let tenant_cdf = spec
            .tenants
            .iter()
            .map(|t| {
                acc += t.share / total_share;
                acc
            })
            .collect();
        let mut tenants = Vec::new();
        for (i, t) in spec.tenants.iter().enumerate() {
            let mean_doc = f64::from(t.doc_chunks_min + t.doc_chunks_max) / 2.0;
            let docs = if t.doc_chunks_max == 0 {
                1
            } else {
                ((t.universe * slots_n as f64) / mean_doc.max(1.0)).ceil().max(1.0) as u64
            };
            let tseed = mix64(seed ^ mix64(i as u64 + 1));
            let pop = Popularity::new(docs, t.zipf);
            let mut prompt_mass = vec![0.0; t.system_prompts.max(1) as usize];
            for doc in 0..docs {
                prompt_mass[(doc_hash(tseed, doc) % u64::from(t.system_prompts.max(1))) as usize] += pop.mass(doc);
            }
            tenants.push(Tenant {
                spec: t.clone(),
                seed: tseed,
                pop,
                prompt_mass,
                key_len: spec.key_len(i),
                salt_bucket: salt_bucket_id(&t.salt),
                unique_counter: 0,
                used: 0,
                lru: Lru::new(),
            });
        }
        let npid = fdp.as_ref().map_or(0, |f| f.data_pids.iter().copied().max().unwrap_or(0) as usize + 1);
        Ok(Workload {
            geometry,
            rng: SplitMix64(mix64(seed)),
            idle_rng: SplitMix64(mix64(seed ^ 0x1d1e_c4ec_4b01_7a55)),
            tenants,
            tenant_cdf,
            index: HashMap::with_capacity(slots_n as usize),
            slots: vec![SlotRec { prev: NONE, next: NONE, ..Default::default() }; slots_n as usize],
            free: Vec::new(),
            free_by_pid: vec![Vec::new(); npid],
            is_free: vec![false; slots_n as usize],
            next_slot: 0,
            global_lru: Lru::new(),
            fdp,
            bucket_pid: HashMap::new(),
            now_s: 0.0,
            next_tick_s: spec.eviction.as_ref().map_or(1.0, |e| e.interval_s),
            next_checkpoint_s: spec.checkpoint_interval_s,
            dirty: 0,
            persisted_dirty: 0,
            seq: 0,
            stats: WorkloadStats::default(),
            entries: Vec::new(),
            emit_json: false,
            json: Vec::new(),
            quoted_model: quote(&spec.model_name),
            key_buf: String::new(),
            chunk_buf: Vec::new(),
            new_keys: Vec::new(),
            ops: Vec::new(),
            spec,
        })
    }

    pub fn now_s(&self) -> f64 {
        self.now_s
    }

    /// Also build each checkpoint's JSON text (about 240 bytes per live entry).
    pub fn emit_json(&mut self, on: bool) {
        self.emit_json = on;
    }

    /// Slots in the index.
    pub fn live(&self) -> u64 {
        self.index.len() as u64
    }

    /// The slots in the index with their payload lengths: what LMCache can still load.
    pub fn live_slots(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots.iter().enumerate().filter(|(_, r)| r.live).map(|(s, r)| (s as u64, r.payload_len))
    }

    /// The bump pointer: slots ever handed out.
    pub fn next_slot(&self) -> u64 {
        self.next_slot
    }

    /// The placement id LMCache's FDP mode gives tenant `t`'s bucket (0 = no directive).
    fn pid_for(&mut self, t: usize) -> u16 {
        let Some(fdp) = &self.fdp else { return 0 };
        let salt = &self.tenants[t].spec.salt;
        let Some(bucket) = salt_bucket(salt) else { return 0 };
        if let Some(&p) = self.bucket_pid.get(&bucket) {
            return p;
        }
        let p = fdp.data_pids.get(self.bucket_pid.len()).copied().unwrap_or(0);
        self.bucket_pid.insert(bucket, p);
        p
    }

    fn lru_of(&mut self, tenant: u32) -> &mut Lru {
        match &self.spec.eviction {
            Some(e) if e.policy == EvictionPolicy::IsolatedLru => &mut self.tenants[tenant as usize].lru,
            _ => &mut self.global_lru,
        }
    }

    fn lru_unlink(&mut self, s: u32) {
        let (prev, next, tenant) = {
            let r = &self.slots[s as usize];
            (r.prev, r.next, r.tenant)
        };
        if prev != NONE {
            self.slots[prev as usize].next = next;
        }
        if next != NONE {
            self.slots[next as usize].prev = prev;
        }
        let l = self.lru_of(tenant);
        if l.head == s {
            l.head = next;
        }
        if l.tail == s {
            l.tail = prev;
        }
        l.len -= 1;
        let r = &mut self.slots[s as usize];
        r.prev = NONE;
        r.next = NONE;
    }

    fn lru_push_mru(&mut self, s: u32) {
        let tenant = self.slots[s as usize].tenant;
        let l = self.lru_of(tenant);
        let old_tail = l.tail;
        l.tail = s;
        if l.head == NONE {
            l.head = s;
        }
        l.len += 1;
        if old_tail != NONE {
            self.slots[old_tail as usize].next = s;
        }
        let r = &mut self.slots[s as usize];
        r.prev = old_tail;
        r.next = NONE;
    }

    fn touch(&mut self, s: u32) {
        if self.spec.eviction.is_some() {
            self.lru_unlink(s);
            self.lru_push_mru(s);
        }
    }

    fn alloc(&mut self, pid: u16) -> Option<u32> {
        if pid != 0 {
            if let Some(stack) = self.free_by_pid.get_mut(pid as usize) {
                while let Some(s) = stack.pop() {
                    if self.is_free[s as usize] && self.slots[s as usize].pid == pid {
                        self.is_free[s as usize] = false;
                        return Some(s);
                    }
                }
            }
        }
        while let Some(s) = self.free.pop() {
            if self.is_free[s as usize] {
                self.is_free[s as usize] = false;
                return Some(s);
            }
        }
        if self.next_slot < self.geometry.max_slots {
            self.next_slot += 1;
            return Some((self.next_slot - 1) as u32);
        }
        None
    }

    fn delete(&mut self, s: u32) {
        let r = self.slots[s as usize];
        debug_assert!(r.live);
        self.index.remove(&r.id);
        if self.spec.eviction.is_some() {
            self.lru_unlink(s);
        }
        self.slots[s as usize].live = false;
        self.tenants[r.tenant as usize].used -= 1;
        self.is_free[s as usize] = true;
        self.free.push(s);
        if self.fdp.is_some() && r.pid != 0 {
            self.free_by_pid[r.pid as usize].push(s);
        }
        self.dirty += 1;
        self.stats.deletes += 1;
        self.ops.push(LmOpOwned::Delete { slot: u64::from(s) });
    }

    /// The controller's check (every `interval_s`).
    fn evict_tick(&mut self) {
        let Some(e) = self.spec.eviction.clone() else { return };
        let cap = self.geometry.max_slots as f64;
        let mut victims: Vec<u32> = Vec::new();
        match e.policy {
            EvictionPolicy::Lru => {
                let used = self.index.len() as f64;
                if used / cap >= e.trigger_watermark && self.global_lru.len > 0 {
                    let n = ((self.global_lru.len as f64 * e.eviction_ratio) as u64).max(1);
                    let mut s = self.global_lru.head;
                    while s != NONE && (victims.len() as u64) < n {
                        victims.push(s);
                        s = self.slots[s as usize].next;
                    }
                }
            }
            EvictionPolicy::IsolatedLru => {
                for t in 0..self.tenants.len() {
                    let limit = self.tenants[t].spec.quota.unwrap_or(0.0) * cap;
                    let used = self.tenants[t].used as f64;
                    if used <= 0.0 || used < e.trigger_watermark * limit {
                        continue;
                    }
                    let ratio = if limit == 0.0 { 1.0 } else { e.eviction_ratio };
                    let l = &self.tenants[t].lru;
                    let n = ((l.len as f64 * ratio) as u64).max(1);
                    let mut s = l.head;
                    let start = victims.len();
                    while s != NONE && ((victims.len() - start) as u64) < n {
                        victims.push(s);
                        s = self.slots[s as usize].next;
                    }
                }
            }
        }
        self.stats.evictions += victims.len() as u64;
        for s in victims {
            self.delete(s);
        }
    }

    fn checkpoint_tick(&mut self) {
        if self.dirty == self.persisted_dirty {
            return;
        }
        if self.spec.checkpoint_idle_probability < 1.0 {
            let u = (self.idle_rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            if u >= self.spec.checkpoint_idle_probability {
                self.stats.checkpoints_skipped_busy += 1;
                return;
            }
        }
        let json_bytes = self.snapshot();
        if json_bytes > self.geometry.payload_cap() {
            // LMCache logs "payload too large" and writes nothing; it stays dirty (§11).
            self.stats.checkpoints_overflow += 1;
            return;
        }
        self.seq += 1;
        self.persisted_dirty = self.dirty;
        self.stats.checkpoints += 1;
        self.stats.checkpoint_bytes += json_bytes;
        self.stats.checkpoint_max_bytes = self.stats.checkpoint_max_bytes.max(json_bytes);
        self.ops.push(LmOpOwned::Checkpoint { json_bytes });
    }

    /// Advances simulated time by `bytes` written; runs due controller and checkpoint ticks.
    fn advance(&mut self, bytes: u64) {
        self.now_s += bytes as f64 / (self.spec.write_rate_mb_s * 1e6);
        let interval = self.spec.eviction.as_ref().map_or(1.0, |e| e.interval_s);
        while self.next_tick_s <= self.now_s || self.next_checkpoint_s <= self.now_s {
            if self.next_tick_s <= self.next_checkpoint_s {
                let t = self.next_tick_s;
                self.next_tick_s += interval;
                self.ops.push(LmOpOwned::Tick { now_s: t });
                self.evict_tick();
            } else {
                self.next_checkpoint_s += self.spec.checkpoint_interval_s;
                self.checkpoint_tick();
            }
        }
    }

    /// The chunk sequence of one request of tenant `t`: (identity, payload_len, popularity)
    /// in order (popularity as in `LmOp::Put`).
    fn request_chunks(&mut self, t: usize) -> Vec<(u64, u64, f64)> {
        let mut out = std::mem::take(&mut self.chunk_buf);
        out.clear();
        let full = self.spec.chunk_bytes;
        let tn = &mut self.tenants[t];
        let sp = &tn.spec;
        let doc = if sp.doc_chunks_max > 0 { tn.pop.sample(&mut self.rng) } else { 0 };
        let dh = doc_hash(tn.seed, doc);
        let prompt = dh % u64::from(sp.system_prompts);
        let share = self.tenant_cdf[t] - if t == 0 { 0.0 } else { self.tenant_cdf[t - 1] };
        let prompt_pop = share * tn.prompt_mass.get(prompt as usize).copied().unwrap_or(0.0);
        let doc_pop = share * tn.pop.mass(doc);
        for i in 0..sp.prefix_chunks {
            out.push((ident(&[tn.seed, 1, prompt, u64::from(i)]), full, prompt_pop));
        }
        if sp.doc_chunks_max > 0 {
            let len = sp.doc_chunks_min + (mix64(dh ^ 7) % u64::from(sp.doc_chunks_max - sp.doc_chunks_min + 1)) as u32;
            for i in 0..len {
                out.push((ident(&[tn.seed, 2, prompt, doc, u64::from(i)]), full, doc_pop));
            }
        }
        for _ in 0..sp.unique_tail_chunks {
            tn.unique_counter += 1;
            out.push((ident(&[tn.seed, 3, tn.unique_counter]), full, 0.0));
        }
        if sp.partial_last {
            if let Some(last) = out.last_mut() {
                // The request's last chunk holds 5–100 % of a chunk's tokens (deterministic per
                // key, so a repeated document repeats its partial chunk).
                let frac = 0.05 + 0.95 * ((mix64(last.0) >> 11) as f64 / (1u64 << 53) as f64);
                last.1 = ((full as f64 * frac) as u64).clamp(1, full);
            }
        }
        out
    }

    /// One request: look up and load the cached prefix, put the missing chunks. The resulting
    /// operations go to `sink` in order.
    pub fn step(&mut self, sink: &mut dyn FnMut(&LmOp<'_>)) {
        self.ops.clear();
        self.stats.requests += 1;
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let t = self.tenant_cdf.partition_point(|&c| c <= u).min(self.tenants.len() - 1);
        let chunks = self.request_chunks(t);
        self.stats.chunks += chunks.len() as u64;
        // Lookup: the longest cached prefix is loaded.
        let mut i = 0;
        while i < chunks.len() {
            let Some(&s) = self.index.get(&chunks[i].0) else { break };
            let pl = self.slots[s as usize].payload_len;
            self.stats.hits += 1;
            self.stats.loads += 1;
            self.ops.push(LmOpOwned::Load { slot: u64::from(s), payload_len: pl });
            self.touch(s);
            i += 1;
        }
        if self.spec.remove_after_read {
            for c in &chunks[..i] {
                if let Some(&s) = self.index.get(&c.0) {
                    self.delete(s);
                }
            }
        }
        // Store the rest: present keys are no-ops (refreshed), missing ones are put.
        let pid = self.pid_for(t);
        self.new_keys.clear();
        let mut written = 0;
        for &(identity, payload_len, popularity) in &chunks[i..] {
            if let Some(&s) = self.index.get(&identity) {
                self.stats.puts_noop += 1;
                self.touch(s);
                continue;
            }
            let Some(s) = self.alloc(pid) else {
                // The put fails ("no free slot"); the request's time passes all the same.
                self.stats.puts_failed += 1;
                written += self.spec.header_bytes + payload_len;
                continue;
            };
            let id = identity;
            let sp = &self.tenants[t].spec;
            key_string(self.spec.mode, &self.quoted_model, self.spec.chunk_hash_bytes, &sp.salt, id, &mut self.key_buf);
            let identity = key_identity(self.spec.mode, &self.key_buf, id);
            let r = &mut self.slots[s as usize];
            *r = SlotRec { id, identity, payload_len, tenant: t as u32, live: true, pid, prev: NONE, next: NONE };
            self.index.insert(id, s);
            self.tenants[t].used += 1;
            self.new_keys.push(s);
            self.dirty += 1;
            self.stats.puts += 1;
            self.stats.put_payload_bytes += payload_len;
            self.ops.push(LmOpOwned::Put {
                slot: u64::from(s),
                identity,
                payload_len,
                tenant: t as u32,
                pid: self.fdp.as_ref().map(|_| pid),
                popularity,
            });
            written += self.spec.header_bytes + payload_len;
        }
        if self.spec.eviction.is_some() {
            let keys = std::mem::take(&mut self.new_keys);
            if self.spec.lru_insert_reversed {
                keys.iter().rev().for_each(|&s| self.lru_push_mru(s));
            } else {
                keys.iter().for_each(|&s| self.lru_push_mru(s));
            }
            self.new_keys = keys;
        }
        self.chunk_buf = chunks;
        self.advance(written);
        // Emit, building the checkpoint list when one was committed.
        let ops = std::mem::take(&mut self.ops);
        for op in &ops {
            match *op {
                LmOpOwned::Put { slot, identity, payload_len, tenant, pid, popularity } => {
                    sink(&LmOp::Put { slot, identity, payload_len, tenant, pid, popularity })
                }
                LmOpOwned::Load { slot, payload_len } => sink(&LmOp::Load { slot, payload_len }),
                LmOpOwned::Delete { slot } => sink(&LmOp::Delete { slot }),
                LmOpOwned::Tick { now_s } => sink(&LmOp::Tick { now_s }),
                LmOpOwned::Checkpoint { json_bytes } => {
                    let entries = std::mem::take(&mut self.entries);
                    let json = std::mem::take(&mut self.json);
                    let j = self.emit_json.then_some(&json[..]);
                    sink(&LmOp::Checkpoint { seq: self.seq, json_bytes, entries: &entries, json: j });
                    self.json = json;
                    self.entries = entries;
                }
            }
        }
        self.ops = ops;
    }

    /// The live entries (into `self.entries`) and the checkpoint JSON's size; with
    /// `emit_json`, the JSON itself (into `self.json`, compact like `json.dumps` with
    /// `separators=(",", ":")`).
    fn snapshot(&mut self) -> u64 {
        use std::io::Write as _;
        self.entries.clear();
        let g = self.geometry;
        let head = json_head(&g, self.next_slot);
        let mut bytes = self.spec.json_fixed_bytes(&g, self.next_slot);
        let mut json = std::mem::take(&mut self.json);
        json.clear();
        if self.emit_json {
            json.extend_from_slice(head.as_bytes());
        }
        let mut first = true;
        let mut key = std::mem::take(&mut self.key_buf);
        for (s, r) in self.slots.iter().enumerate() {
            if !r.live {
                continue;
            }
            let t = r.tenant as usize;
            let off = g.slot_offset(s as u64);
            bytes += self.spec.entry_json_bytes(self.tenants[t].key_len, off, r.payload_len);
            let salt = &self.tenants[t].spec.salt;
            self.entries.push(LiveEntry { slot: s as u64, identity: r.identity, salt_bucket: self.tenants[t].salt_bucket });
            if self.emit_json {
                key_string(self.spec.mode, &self.quoted_model, self.spec.chunk_hash_bytes, salt, r.id, &mut key);
                if !first {
                    json.push(b',');
                }
                let _ = write!(
                    json,
                    r#""{key}":{{"offset":{off},"size":{},"shape":[2,32,256,1024],"dtype":"bfloat16","fmt":"KV_2LTD","cached_positions":null}}"#,
                    r.payload_len
                );
            }
            first = false;
        }
        self.key_buf = key;
        if self.emit_json {
            json.extend_from_slice(b"}}");
        }
        if !self.entries.is_empty() {
            bytes -= 1; // no comma after the last entry
        }
        if self.emit_json {
            bytes = json.len() as u64;
        }
        self.json = json;
        bytes
    }

    /// Checks the allocator and index against each other (O(slots)); for tests.
    pub fn audit(&self) -> Result<(), String> {
        let mut live = 0;
        for (s, r) in self.slots.iter().enumerate() {
            if r.live {
                live += 1;
                if self.index.get(&r.id) != Some(&(s as u32)) {
                    return err(format!("slot {s} live but its identity maps elsewhere"));
                }
                if self.is_free[s] {
                    return err(format!("slot {s} live and free"));
                }
            } else if (s as u64) < self.next_slot && !self.is_free[s] {
                return err(format!("slot {s} neither live nor free"));
            }
        }
        if live != self.index.len() {
            return err("index size differs from live slots");
        }
        let lru_total: u64 = match &self.spec.eviction {
            None => live as u64,
            Some(e) if e.policy == EvictionPolicy::IsolatedLru => self.tenants.iter().map(|t| t.lru.len).sum(),
            Some(_) => self.global_lru.len,
        };
        if lru_total != live as u64 {
            return err(format!("LRU lists hold {lru_total} keys, index {live}"));
        }
        Ok(())
    }
}

/// One block request the device receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIo {
    pub write: bool,
    pub offset: u64,
    pub len: u64,
    /// The slot header this write starts with, if it starts at one. (Buffered writeback can
    /// merge several slots into one request; the model cuts such a request at each header, so
    /// a header always starts a request. fdpblk classifies by position, so the placement is
    /// the same as for the merged request whose bytes carry the header.)
    pub header: Option<SlotHeader>,
    /// The 32-byte `LMCIDX01` header this write starts with (a checkpoint commit).
    pub checkpoint: Option<[u8; 32]>,
}

/// Turns LMCache's operations into block requests (see the module comment).
pub struct IoShaper {
    geom: Geometry,
    io: IoMode,
    max_req: u64,
    window: usize,
    /// Buffered: the latest dirty put per slot, in first-dirtied order, with the payload bytes
    /// dirty since the slot's last writeback: a shorter put leaves an earlier one's pages past
    /// its end dirty, and the kernel writes them back too.
    dirty: Vec<(u64, SlotHeader, u64)>,
    dirty_pos: HashMap<u64, usize>,
    runs: Vec<(u64, u64)>,
    /// io_uring: the puts of the batch being gathered, the batch's requests with their
    /// delivery rank, the reorder window and its generator.
    pending: Vec<(u64, SlotHeader)>,
    batch: Vec<(u64, BlockIo)>,
    reorder: u64,
    rng: SplitMix64,
}

impl IoShaper {
    /// `seed` drives io_uring's delivery order only (the other modes are deterministic).
    pub fn new(spec: &WorkloadSpec, geom: Geometry, seed: u64) -> Self {
        IoShaper {
            geom,
            io: spec.io,
            max_req: spec.max_request_bytes,
            window: spec.writeback_puts,
            dirty: Vec::new(),
            dirty_pos: HashMap::new(),
            runs: Vec::new(),
            pending: Vec::new(),
            batch: Vec::new(),
            reorder: spec.uring_reorder_window,
            rng: SplitMix64(mix64(seed ^ 0x1e0_0d1e_c7ed)),
        }
    }

    fn split(&self, offset: u64, len: u64, header: Option<SlotHeader>, write: bool, out: &mut dyn FnMut(&BlockIo)) {
        let mut pos = offset;
        let end = offset + len;
        let mut first = true;
        while pos < end {
            let n = (end - pos).min(self.max_req);
            let h = if first { header } else { None };
            out(&BlockIo { write, offset: pos, len: n, header: h, checkpoint: None });
            first = false;
            pos += n;
        }
    }

    fn round(&self, n: u64) -> u64 {
        n.div_ceil(self.geom.block_align) * self.geom.block_align
    }

    /// Emits the block requests of `op` (buffered puts may be held until writeback).
    pub fn shape(&mut self, op: &LmOp<'_>, out: &mut dyn FnMut(&BlockIo)) {
        let g = self.geom;
        match *op {
            LmOp::Put { slot, identity, payload_len, .. } => {
                let h = SlotHeader { identity, payload_len };
                match self.io {
                    IoMode::ODirect => {
                        let off = g.slot_offset(slot);
                        out(&BlockIo {
                            write: true,
                            offset: off,
                            len: g.header_bytes,
                            header: Some(h),
                            checkpoint: None,
                        });
                        self.split(off + g.header_bytes, self.round(payload_len), None, true, out);
                    }
                    IoMode::Buffered => {
                        match self.dirty_pos.get(&slot) {
                            Some(&i) => {
                                let d = &mut self.dirty[i];
                                d.1 = h;
                                d.2 = d.2.max(payload_len);
                            }
                            None => {
                                self.dirty_pos.insert(slot, self.dirty.len());
                                self.dirty.push((slot, h, payload_len));
                            }
                        }
                        if self.dirty.len() >= self.window {
                            self.flush(out);
                        }
                    }
                    IoMode::IoUring => {
                        self.pending.push((slot, h));
                        if self.pending.len() >= URING_BATCH_KEYS {
                            self.submit_batch(out);
                        }
                    }
                }
            }
            // Buffered: a slot whose put is still dirty is read from the page cache. (Clean
            // pages the cache still holds are read from the drive here: see docs/waf.md, Limits.)
            LmOp::Load { slot, .. } if self.io == IoMode::Buffered && self.dirty_pos.contains_key(&slot) => {}
            LmOp::Load { slot, payload_len } => {
                self.split(g.slot_offset(slot) + g.header_bytes, self.round(payload_len), None, false, out);
            }
            LmOp::Checkpoint { seq, json_bytes, json, .. } => {
                // Payload first, then the header block (posix order); dirty slot pages first.
                self.flush(out);
                let c = g.container_offset(Geometry::copy_for_seq(seq));
                self.split(c + g.block_align, self.round(json_bytes), None, true, out);
                let crc = json.map_or(0, crc32fast::hash);
                let mut hb = [0u8; 32];
                hb[..8].copy_from_slice(crate::layout::checkpoint_header::META_MAGIC);
                hb[8..12].copy_from_slice(&crate::layout::checkpoint_header::META_VERSION.to_le_bytes());
                hb[12..20].copy_from_slice(&seq.to_le_bytes());
                hb[20..28].copy_from_slice(&json_bytes.to_le_bytes());
                hb[28..32].copy_from_slice(&crc.to_le_bytes());
                out(&BlockIo { write: true, offset: c, len: g.block_align, header: None, checkpoint: Some(hb) });
            }
            LmOp::Delete { .. } | LmOp::Tick { .. } => {}
        }
    }

    /// The end of one store (LMCache's `put_many` of a request's keys): io_uring submits the
    /// keys gathered for the last batch.
    pub fn end_store(&mut self, out: &mut dyn FnMut(&BlockIo)) {
        if !self.pending.is_empty() {
            self.submit_batch(out);
        }
    }

    /// io_uring: one `batched_write` of the gathered puts (header, then payload rounded to
    /// `block_align`, per key), delivered in the modelled order: each request ranks at its
    /// submission index plus a random delay below the reorder window; ties keep their order.
    fn submit_batch(&mut self, out: &mut dyn FnMut(&BlockIo)) {
        let g = self.geom;
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        let mut n = 0u64;
        let mut push = |io: BlockIo, rng: &mut SplitMix64| {
            let delay = if self.reorder > 1 { rng.below(self.reorder) } else { 0 };
            batch.push((n + delay, io));
            n += 1;
        };
        for &(slot, h) in &self.pending {
            let off = g.slot_offset(slot);
            push(BlockIo { write: true, offset: off, len: g.header_bytes, header: Some(h), checkpoint: None }, &mut self.rng);
            let end = off + g.payload_end(h.payload_len);
            let mut pos = off + g.header_bytes;
            while pos < end {
                let len = (end - pos).min(self.max_req);
                push(BlockIo { write: true, offset: pos, len, header: None, checkpoint: None }, &mut self.rng);
                pos += len;
            }
        }
        self.pending.clear();
        batch.sort_by_key(|&(rank, _)| rank);
        for (_, io) in &batch {
            out(io);
        }
        self.batch = batch;
    }

    /// Writes out whatever is held: io_uring's gathered batch; buffered, every dirty page,
    /// sorted by offset, merged and split.
    pub fn flush(&mut self, out: &mut dyn FnMut(&BlockIo)) {
        self.end_store(out);
        if self.dirty.is_empty() {
            return;
        }
        let g = self.geom;
        let mut d = std::mem::take(&mut self.dirty);
        self.dirty_pos.clear();
        d.sort_unstable_by_key(|&(s, _, _)| s);
        // Contiguous runs of dirty pages: a slot's header and its payload pages are adjacent;
        // consecutive slots merge when the earlier one's payload fills its slot.
        self.runs.clear();
        for &(slot, _, dirty_len) in &d {
            let off = g.slot_offset(slot);
            let len = g.header_bytes + self.round(dirty_len);
            match self.runs.last_mut() {
                Some((o, l)) if *o + *l == off => *l += len,
                _ => self.runs.push((off, len)),
            }
        }
        // Headers inside merged runs: one request can carry several; each request reports the
        // header at its start (the classifier parses a header only from a request's bytes).
        let mut hi = 0;
        let runs = std::mem::take(&mut self.runs);
        for &(off, len) in &runs {
            let end = off + len;
            let mut pos = off;
            while pos < end {
                let n = (end - pos).min(self.max_req);
                // The dirty slot whose header sits at `pos`, if any.
                while hi < d.len() && g.slot_offset(d[hi].0) < pos {
                    hi += 1;
                }
                let header = match d.get(hi) {
                    Some(&(s, h, _)) if g.slot_offset(s) == pos => Some(h),
                    _ => None,
                };
                // A header in the middle of the request: cut the request there.
                let mut cut = n;
                if let Some(&(s, _, _)) = d.get(hi + usize::from(header.is_some())) {
                    let ho = g.slot_offset(s);
                    if ho > pos && ho < pos + n {
                        cut = ho - pos;
                    }
                }
                out(&BlockIo { write: true, offset: pos, len: cut, header, checkpoint: None });
                pos += cut;
            }
        }
        self.runs = runs;
    }

    /// The 24 header bytes LMCache writes, for a request's data.
    pub fn header_bytes(h: &SlotHeader) -> [u8; SLOT_HEADER_PREFIX] {
        let mut b = [0u8; SLOT_HEADER_PREFIX];
        b[..8].copy_from_slice(crate::layout::slot_header::SLOT_MAGIC);
        b[8..16].copy_from_slice(&h.identity.to_le_bytes());
        b[16..24].copy_from_slice(&h.payload_len.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::checkpoint_json::{parse_checkpoint_json, JsonLimits};
    use crate::layout::keys;

    fn spec(text: &str) -> WorkloadSpec {
        WorkloadSpec::from_json_str(text).unwrap()
    }

    fn small(eviction: &str, tenants: &str) -> WorkloadSpec {
        // One slot per eviction tick and a checkpoint every 60 slots, as on a large drive.
        spec(&format!(
            r#"{{"slot_bytes": "1M", "meta_total_bytes": "4M", "write_rate_mb_s": 1, {eviction} "tenants": [{tenants}]}}"#
        ))
    }

    const ONE: &str =
        r#"{"name": "a", "salt": "a:1", "zipf": 0.9, "universe": 4, "doc_chunks": [1, 8], "unique_tail_chunks": 1}"#;
    const LRU: &str = r#""eviction": {"policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2},"#;

    /// Runs `n` requests and returns every operation as a string (for determinism checks) and
    /// the workload.
    fn drive(mut w: Workload, n: usize) -> (Vec<String>, Workload) {
        let mut ops = Vec::new();
        for _ in 0..n {
            w.step(&mut |op| ops.push(format!("{op:?}")));
        }
        (ops, w)
    }

    #[test]
    fn shipped_workloads_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/workloads");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let s = WorkloadSpec::from_json_str(&std::fs::read_to_string(&p).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert!(!s.name.is_empty() && !s.description.is_empty(), "{}", p.display());
            n += 1;
        }
        assert!(n >= 4);
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (text, needle) in [
            (r#"{"tenants": []}"#, "non-empty"),
            (r#"{"tenant": [{}]}"#, "unknown field \"tenant\""),
            (r#"{"mode": "x", "tenants": [{}]}"#, "mode"),
            (r#"{"slot_bytes": "1Q", "tenants": [{}]}"#, "slot_bytes"),
            (r#"{"eviction": {"policy": "IsolatedLRU"}, "tenants": [{}]}"#, "quota"),
            (r#"{"mode": "non_mp", "eviction": {}, "tenants": [{}]}"#, "non_mp"),
            (r#"{"tenants": [{"doc_chunks": [3, 1]}]}"#, "doc_chunks"),
            (r#"{"chunk_bytes": "32M", "tenants": [{}]}"#, "chunk_bytes"),
            (r#"{"io": "aio", "tenants": [{}]}"#, "io_uring"),
            (r#"{"ublk_queue_depth": 5000, "tenants": [{}]}"#, "ublk_queue_depth"),
        ] {
            let e = WorkloadSpec::from_json_str(text).unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn zipf_masses_sum_to_one_and_fall_with_rank() {
        let p = Popularity::new(1000, 0.9);
        let sum: f64 = (0..1000).map(|r| p.mass(r)).sum();
        assert!((sum - 1.0).abs() < 1e-9, "{sum}");
        assert!(p.mass(0) > p.mass(1) && p.mass(1) > p.mass(999) && p.mass(999) > 0.0);
        assert_eq!(p.mass(1000), 0.0);
        // Rank 1 against rank 10 under Zipf 0.9: 10^0.9.
        assert!((p.mass(0) / p.mass(9) - 10f64.powf(0.9)).abs() < 1e-6);
    }

    #[test]
    fn puts_carry_how_often_their_chunk_is_asked_for() {
        let mut w = Workload::new(small(LRU, ONE), 64 << 20, 0, 3, None).unwrap();
        // identity → (puts, popularity)
        let mut seen: HashMap<u64, (u64, f64)> = HashMap::new();
        let mut mismatched = 0;
        for _ in 0..20_000 {
            w.step(&mut |op| {
                if let LmOp::Put { identity, popularity, .. } = *op {
                    assert!((0.0..=1.0).contains(&popularity), "{popularity}");
                    let e = seen.entry(identity).or_insert((0, popularity));
                    e.0 += 1;
                    if e.1 != popularity {
                        mismatched += 1;
                    }
                }
            });
        }
        assert_eq!(mismatched, 0, "a chunk's chance changed between its puts");
        // A request's unique tail (chance 0) is never put again; chunks put again and again
        // are the popular ones.
        assert!(seen.values().any(|&(_, p)| p == 0.0));
        assert!(seen.values().filter(|&&(_, p)| p == 0.0).all(|&(n, _)| n == 1));
        // The chance is how often requests ask for the chunk: count it over many requests.
        let n = 200_000;
        let mut asked: HashMap<u64, (u64, f64)> = HashMap::new();
        for _ in 0..n {
            for (id, _, p) in w.request_chunks(0) {
                asked.entry(id).or_insert((0, p)).0 += 1;
            }
        }
        let mut checked = 0;
        for (count, p) in asked.values().copied().filter(|&(_, p)| p > 0.01) {
            let f = count as f64 / n as f64;
            assert!((f - p).abs() < 0.1 * p, "asked for in {f} of the requests, chance {p}");
            checked += 1;
        }
        assert!(checked >= 10, "{checked}");
    }

    #[test]
    fn deterministic_from_the_seed() {
        let s = small(LRU, ONE);
        let a = drive(Workload::new(s.clone(), 64 << 20, 0, 7, None).unwrap(), 3000).0;
        let b = drive(Workload::new(s.clone(), 64 << 20, 0, 7, None).unwrap(), 3000).0;
        let c = drive(Workload::new(s, 64 << 20, 0, 8, None).unwrap(), 3000).0;
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn bump_pointer_then_lifo_reuse_and_lru_watermark() {
        let s = small(LRU, ONE);
        let mut w = Workload::new(s, 512 << 20, 0, 1, None).unwrap();
        let max = w.geometry.max_slots;
        let mut puts = Vec::new();
        let mut deletes: Vec<u64> = Vec::new();
        let mut reuse_checked = 0;
        for _ in 0..5000 {
            let mut step_puts = Vec::new();
            let mut step_deletes = Vec::new();
            w.step(&mut |op| match *op {
                LmOp::Put { slot, .. } => step_puts.push(slot),
                LmOp::Delete { slot } => step_deletes.push(slot),
                _ => {}
            });
            // A put after evictions takes the most recently freed slot first (LIFO).
            if !deletes.is_empty() && !step_puts.is_empty() {
                assert_eq!(step_puts[0], *deletes.last().unwrap());
                reuse_checked += 1;
            }
            for p in &step_puts {
                deletes.retain(|d| d != p);
            }
            deletes.extend(step_deletes);
            puts.extend(step_puts);
            assert!(w.live() as f64 <= 0.8 * max as f64 + 16.0, "live {} of {max}", w.live());
        }
        w.audit().unwrap();
        // A fresh device is filled 0, 1, 2, ...
        assert_eq!(&puts[..10], &(0..10).collect::<Vec<u64>>()[..]);
        // LMCache's default watermark leaves the top fifth of the slots unwritten.
        assert!(w.next_slot() < (0.85 * max as f64) as u64, "{} of {max}", w.next_slot());
        assert!(reuse_checked > 10 && w.stats.evictions > 0 && w.stats.hits > 0);
    }

    #[test]
    fn non_mp_fills_then_puts_fail() {
        let s = spec(
            r#"{"mode": "non_mp", "slot_bytes": "1M", "tenants": [{"zipf": 0.5, "universe": 4, "doc_chunks": [1, 4]}]}"#,
        );
        assert_eq!((s.io, s.meta_total_bytes), (IoMode::Buffered, 128 << 20));
        let (_, w) = drive(Workload::new(s, 192 << 20, 0, 3, None).unwrap(), 2000);
        assert_eq!(w.live(), w.geometry.max_slots);
        assert!(w.stats.puts_failed > 0 && w.stats.deletes == 0 && w.stats.evictions == 0);
        w.audit().unwrap();
    }

    #[test]
    fn quotas_bound_each_tenant() {
        let s = small(
            r#""eviction": {"policy": "IsolatedLRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2},"#,
            r#"{"name": "busy", "salt": "busy:1", "share": 0.8, "quota": 0.3, "universe": 2},
               {"name": "quiet", "salt": "quiet:1", "share": 0.2, "quota": 0.7, "universe": 2}"#,
        );
        let mut w = Workload::new(s, 128 << 20, 0, 5, None).unwrap();
        let max = w.geometry.max_slots as f64;
        for _ in 0..6000 {
            w.step(&mut |_| {});
            assert!((w.tenants[0].used as f64) < 0.3 * max * 0.8 + 12.0);
            assert!((w.tenants[1].used as f64) < 0.7 * max * 0.8 + 12.0);
        }
        assert!(w.tenants[1].used > w.tenants[0].used);
        w.audit().unwrap();
    }

    #[test]
    fn checkpoint_json_is_lmcaches_and_its_size_is_predicted() {
        let s = small(LRU, ONE);
        let mut sized = Workload::new(s.clone(), 64 << 20, 0, 2, None).unwrap();
        let mut w = Workload::new(s.clone(), 64 << 20, 0, 2, None).unwrap();
        w.emit_json(true);
        let mut got = Vec::new();
        let mut headers: HashMap<u64, u64> = HashMap::new();
        let mut seen = 0;
        for _ in 0..20000 {
            let mut predicted = Vec::new();
            sized.step(&mut |op| {
                if let LmOp::Checkpoint { json_bytes, .. } = op {
                    predicted.push(*json_bytes);
                }
            });
            w.step(&mut |op| match *op {
                LmOp::Put { slot, identity, .. } => {
                    headers.insert(slot, identity);
                }
                LmOp::Checkpoint { json: Some(j), entries, json_bytes, .. } => {
                    assert_eq!(j.len() as u64, json_bytes);
                    got.push(json_bytes);
                    // fdpblk's own parser reads it; every key's identity is the slot header's.
                    let mut n = 0;
                    let meta = parse_checkpoint_json(j, &JsonLimits::default(), &mut |e| {
                        let slot = (e.offset.unwrap() - s.meta_total_bytes) / s.slot_bytes;
                        assert_eq!(keys::identity(e.key).unwrap(), headers[&slot], "{}", e.key);
                        assert!(
                            e.key.ends_with("@a:1")
                                && e.key.starts_with("meta-llama%2FLlama-3.1-8B-Instruct@0x01000100@0@")
                        );
                        n += 1;
                        Ok(())
                    })
                    .unwrap();
                    assert_eq!((n, meta.entries), (entries.len() as u64, entries.len() as u64));
                    seen += 1;
                }
                _ => {}
            });
            if let Some(&p) = predicted.first() {
                // The size-only path predicts the JSON length exactly.
                assert_eq!(Some(&p), got.last());
            }
        }
        assert!(seen >= 2, "{seen} checkpoints");
        // About 240 bytes per entry (reference §11: 236 B for a 64-hex object key).
        let per = (got[seen - 1] as f64 - 330.0) / w.live() as f64;
        // (Slightly less here: offsets of 7 and 8 digits instead of 13.)
        assert!((220.0..260.0).contains(&per), "{per} bytes per entry");
    }

    #[test]
    fn odirect_and_buffered_shapes() {
        let s = small(LRU, ONE);
        let g = s.geometry(64 << 20, 0).unwrap();
        let mut sh = IoShaper::new(&s, g, 1);
        let mut out = Vec::new();
        sh.shape(&LmOp::Put { slot: 3, identity: 9, payload_len: 600_000, tenant: 0, pid: None, popularity: 0.0 }, &mut |io| {
            out.push(*io)
        });
        let base = g.slot_offset(3);
        let lens: Vec<(u64, u64, bool)> =
            out.iter().map(|io| (io.offset - base, io.len, io.header.is_some())).collect();
        // Header, then the payload rounded to 4 KiB and split at 512 KiB.
        assert_eq!(lens, vec![(0, 4096, true), (4096, 524288, false), (4096 + 524288, 602112 - 524288, false)]);
        let mut b = s.clone();
        b.io = IoMode::Buffered;
        b.writeback_puts = 4;
        let mut sh = IoShaper::new(&b, g, 1);
        let mut out = Vec::new();
        for (slot, len) in [(5, 1000u64), (4, g.slot_payload_capacity()), (9, 5000), (5, 2000)] {
            sh.shape(&LmOp::Put { slot, identity: slot, payload_len: len, tenant: 0, pid: None, popularity: 0.0 }, &mut |io| {
                out.push(*io)
            });
        }
        sh.flush(&mut |io| out.push(*io));
        // Writeback in offset order; slot 5 once, with its newest header; slots 4 and 5 are
        // adjacent but each request starts at most one header.
        let starts: Vec<(u64, Option<u64>)> =
            out.iter().map(|io| (io.offset, io.header.map(|h| h.payload_len))).collect();
        assert_eq!(starts[0], (g.slot_offset(4), Some(g.slot_payload_capacity())));
        assert!(starts.contains(&(g.slot_offset(5), Some(2000))));
        assert!(starts.contains(&(g.slot_offset(9), Some(5000))));
        assert!(starts.windows(2).all(|w| w[0].0 < w[1].0), "{starts:?}");
        let total: u64 = out.iter().map(|io| io.len).sum();
        assert_eq!(total, 3 * 4096 + g.slot_payload_capacity() + 4096 + 8192);
    }

    /// Buffered: a shorter put into a slot still dirty leaves the earlier put's pages past its
    /// end dirty, and writeback writes them; a load of a dirty slot comes from the page cache.
    #[test]
    fn buffered_keeps_a_longer_dirty_extent_and_reads_dirty_slots_from_the_cache() {
        let mut b = small(LRU, ONE);
        b.io = IoMode::Buffered;
        b.writeback_puts = 8;
        let g = b.geometry(64 << 20, 0).unwrap();
        let mut sh = IoShaper::new(&b, g, 1);
        let mut out = Vec::new();
        let put = |slot, payload_len| LmOp::Put { slot, identity: slot, payload_len, tenant: 0, pid: None, popularity: 0.0 };
        sh.shape(&put(5, 9000), &mut |io| out.push(*io));
        sh.shape(&put(5, 2000), &mut |io| out.push(*io));
        sh.shape(&LmOp::Load { slot: 5, payload_len: 2000 }, &mut |io| out.push(*io));
        assert!(out.is_empty(), "a dirty slot is read from the page cache: {out:?}");
        sh.shape(&LmOp::Load { slot: 7, payload_len: 2000 }, &mut |io| out.push(*io));
        assert_eq!(out.iter().map(|io| (io.write, io.offset)).collect::<Vec<_>>(), vec![(false, g.slot_offset(7) + g.header_bytes)]);
        out.clear();
        sh.flush(&mut |io| out.push(*io));
        assert_eq!(out.iter().map(|io| io.len).sum::<u64>(), 4096 + 12288, "the first put's third page is still dirty");
        assert_eq!(out[0].header.map(|h| h.payload_len), Some(2000), "with the newest header");
        // Written back: the next put starts a new extent.
        out.clear();
        sh.shape(&put(5, 2000), &mut |io| out.push(*io));
        sh.flush(&mut |io| out.push(*io));
        assert_eq!(out.iter().map(|io| io.len).sum::<u64>(), 4096 + 4096);
    }

    /// io_uring: a store's keys go out in batches of 64, every request once; with a window
    /// of 0 in submission order, with a larger one some payloads before their header but no
    /// request further back than the window.
    #[test]
    fn io_uring_batches_keys_and_reorders_within_the_window() {
        let mut s = small(LRU, ONE);
        s.io = IoMode::IoUring;
        let g = s.geometry(256 << 20, 0).unwrap();
        let put = |slot: u64| LmOp::Put { slot, identity: slot + 1, payload_len: 600_000, tenant: 0, pid: None, popularity: 0.0 };
        // Submission order: per key the header, then two payload pieces.
        let submitted = |keys: std::ops::Range<u64>| -> Vec<(u64, u64)> {
            keys.flat_map(|k| {
                let o = g.slot_offset(k);
                [(o, 4096), (o + 4096, 524288), (o + 4096 + 524288, 602112 - 524288)]
            })
            .collect()
        };
        for window in [0u64, 8] {
            s.uring_reorder_window = window;
            let mut sh = IoShaper::new(&s, g, 3);
            let mut out = Vec::new();
            for k in 0..70 {
                sh.shape(&put(k), &mut |io| out.push(*io));
            }
            // The first 64 keys went as one batch; the other 6 wait for the end of the store.
            assert_eq!(out.len(), 64 * 3);
            sh.end_store(&mut |io| out.push(*io));
            assert_eq!(out.len(), 70 * 3);
            let got: Vec<(u64, u64)> = out.iter().map(|io| (io.offset, io.len)).collect();
            let want = submitted(0..70);
            assert!(out.iter().all(|io| io.header.is_some() == (io.len == 4096)));
            if window == 0 {
                assert_eq!(got, want);
                continue;
            }
            let mut sorted = got.clone();
            sorted.sort_unstable();
            let mut w2 = want.clone();
            w2.sort_unstable();
            assert_eq!(sorted, w2, "every request exactly once");
            // Within its batch a request is delivered less than a window from where it was
            // submitted (it ranks at its index plus less than the window).
            let (first, second) = (&got[..64 * 3], &got[64 * 3..]);
            let pos = |r: &(u64, u64), v: &[(u64, u64)]| v.iter().position(|x| x == r).unwrap();
            for (i, r) in want[..64 * 3].iter().enumerate() {
                assert!(pos(r, first).abs_diff(i) < window as usize, "{r:?} submitted {i}, delivered {}", pos(r, first));
            }
            assert!(second.iter().all(|r| want[64 * 3..].contains(r)), "batches do not mix");
            let early = (0..70u64)
                .filter(|&k| pos(&(g.slot_offset(k) + 4096, 524288), &got) < pos(&(g.slot_offset(k), 4096), &got))
                .count();
            assert!(early > 0, "some payload came before its header");
        }
        // A checkpoint writes the gathered keys first.
        let mut sh = IoShaper::new(&s, g, 3);
        let mut out = Vec::new();
        sh.shape(&put(1), &mut |io| out.push(*io));
        assert!(out.is_empty());
        sh.shape(&LmOp::Checkpoint { seq: 1, json_bytes: 100, entries: &[], json: None }, &mut |io| out.push(*io));
        assert_eq!(out.len(), 3 + 2);
        assert!(out[3].offset < g.meta_total_bytes && out[4].checkpoint.is_some());
    }

    #[test]
    fn pid_affinity_reuses_a_buckets_own_slots() {
        let s = small(
            LRU,
            r#"{"name": "a", "salt": "a:1", "share": 0.5, "universe": 4, "doc_chunks": [1, 8]},
               {"name": "b", "salt": "B:2", "share": 0.5, "universe": 4, "doc_chunks": [1, 8]},
               {"name": "c", "salt": "nosalt", "share": 0.2, "universe": 1, "doc_chunks": [1, 2]}"#,
        );
        let fdp = LmcacheFdpMode { data_pids: vec![2, 3, 4] };
        let mut w = Workload::new(s, 64 << 20, 0, 4, Some(fdp)).unwrap();
        let mut last_pid: HashMap<u64, u16> = HashMap::new();
        let (mut same, mut other) = (0, 0);
        for _ in 0..8000 {
            w.step(&mut |op| {
                if let LmOp::Put { slot, tenant, pid: Some(pid), .. } = *op {
                    // Buckets by the salt's prefix, case-folded; a salt without ':' gets none.
                    assert_eq!(pid == 0, tenant == 2);
                    match last_pid.get(&slot) {
                        Some(&p) if p != 0 && pid != 0 => {
                            if p == pid {
                                same += 1
                            } else {
                                other += 1
                            }
                        }
                        _ => {}
                    }
                    last_pid.insert(slot, pid);
                }
            });
        }
        // Reuses between the two data ids keep the slot within its id far more often than
        // chance (half): the global pool is only the fallback when an id has no freed slot,
        // and the salt-less tenant draws from it too.
        assert!(2 * same > 3 * other, "same {same}, other {other}");
        w.audit().unwrap();
    }
}
