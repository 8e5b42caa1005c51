//! A workload file (`tools/workloads/*.json`): its fields, their defaults and bounds.

use super::*;
use crate::layout::geometry::{GeometryError, MAX_SLOTS};

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
    /// LMCache's `io_uring` engine with O_DIRECT (the non-MP plugin's default is without it,
    /// through the page cache: [`IoMode::Buffered`]): a store's keys go in batches of
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
    /// Buffered I/O: a checkpoint's pages reach the device ahead of the dirty slot pages of
    /// the puts it lists (`"checkpoint_writeback": "before_slots"`: the kernel's writeback
    /// sweep reaches the metadata region at the device's start first), not after them
    /// (`"after_slots"`, the default). The kernel's order lies between the two: its
    /// writeback goes round the device from where it last stopped.
    pub checkpoint_before_slots: bool,
    /// io_uring: how far back (in requests) the kernel may deliver a request of a batch.
    pub uring_reorder_window: u64,
    /// io_uring: the ublk queue's depth (fdpblk's `-d`); half its tags may hold payloads
    /// waiting for their headers, as under `fdpblk add`.
    pub ublk_queue_depth: u16,
    pub eviction: Option<EvictionSpec>,
    /// Order LMCache's LRU takes one request's keys in, both when a store adds them
    /// (`on_keys_created`) and when a load refreshes them (`on_keys_touched`): reversed (0.5.6)
    /// puts the request's last chunk nearest the LRU end (its prefix-match rationale: "the
    /// later keys should be evicted first"), forward the other way round.
    pub lru_insert_reversed: bool,
    /// MP: the server's L1 (CPU memory) in chunks, as a share of the slots LMCache may use
    /// (0: none, every hit reads the device, as LMCache's `--l2-store-policy skip_l1`).
    pub l1_share: f64,
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

pub(super) fn err<T>(s: impl Into<String>) -> Result<T, String> {
    Err(s.into())
}

fn get_size(v: &Value, k: &str, default: u64) -> Result<u64, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => {
            n.as_u64().ok_or_else(|| format!("\"{k}\" must be a whole number of bytes from 0 to {} or a size like \"16M\"", u64::MAX))
        }
        Some(Value::String(s)) => parse_size(s).map_err(|e| format!("\"{k}\": {e}")),
        Some(_) => err(format!("\"{k}\" must be a number or a size string like \"16M\"")),
    }
}

/// The rule an L1 share breaks, if any (for the workload file and `simulate --l1-share`).
pub fn l1_share_rule(mode: Mode, share: f64) -> Option<&'static str> {
    if !(0.0..=1.0).contains(&share) {
        Some("must be 0 to 1 (a share of the slots LMCache may use)")
    } else if share > 0.0 && mode == Mode::NonMp {
        Some("is an MP option: the model has no CPU tier for the non-MP plugin")
    } else {
        None
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
            .ok_or_else(|| format!("\"{k}\" must be a whole number from 0 to {}", u32::MAX)),
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
const MAX_SHARE: f64 = 1e9;
/// A request's writes are modelled at once, with a copy of LMCache's whole index for each
/// checkpoint taken while they last and an entry for each eviction check: a request may last
/// this many checkpoint intervals and eviction checks at most.
const MAX_CHECKPOINTS_PER_REQUEST: f64 = 16.0;
const MAX_TICKS_PER_REQUEST: f64 = 100_000.0;
pub(super) const MAX_TENANTS: usize = 4096;

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
                "checkpoint_writeback",
                "uring_reorder_window",
                "ublk_queue_depth",
                "eviction",
                "lru_insert",
                "l1_share",
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
                // Written as "in (0, 1]" so that a NaN fails it too.
                let in_unit = |x: f64| x > 0.0 && x <= 1.0;
                if !in_unit(s.trigger_watermark) || !in_unit(s.eviction_ratio) {
                    return err("eviction: trigger_watermark and eviction_ratio must be in (0, 1]");
                }
                // A check per interval, each evicting at least one key: a tiny interval would
                // queue billions of them per request (or stop advancing in floating point).
                if !(0.01..=86400.0).contains(&s.interval_s) {
                    return err("eviction: interval_s must be 0.01 to 86400 (LMCache checks every 1)");
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
        if tenants_v.len() > MAX_TENANTS {
            return err(format!("\"tenants\" lists {} tenants; the model takes at most {MAX_TENANTS}", tenants_v.len()));
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
                            .filter(|q| *q > 0.0 && *q <= 1.0)
                            .ok_or_else(|| format!("{what}: \"quota\" must be a fraction of the cache, in (0, 1]"))?,
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
            // Shares are weights: bounded so that their sum stays finite (two of 1e308 summed to
            // infinity and every request went to the last tenant).
            if !(ts.share > 0.0 && ts.share <= MAX_SHARE && (0.0..=10.0).contains(&ts.zipf)) {
                return err(format!("{what}: share must be > 0 and at most {MAX_SHARE:e}, zipf 0 to 10"));
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
        let isolated = eviction.as_ref().is_some_and(|e| e.policy == EvictionPolicy::IsolatedLru);
        if isolated && tenants.iter().any(|t| t.quota.is_none()) {
            return err("IsolatedLRU evicts against per-tenant quotas: give every tenant a \"quota\" (LMCache wipes salts without one)");
        }
        if let Some(t) = tenants.iter().find(|t| !isolated && t.quota.is_some()) {
            return err(format!("tenant {:?}: \"quota\" is read only by the IsolatedLRU eviction policy: drop it, or set \"eviction\": {{\"policy\": \"IsolatedLRU\"}}", t.name));
        }
        // LMCache keeps one LRU list and one quota per cache_salt: two tenants with one salt
        // are one tenant to it.
        if isolated {
            for (i, a) in tenants.iter().enumerate() {
                if let Some(b) = tenants[..i].iter().find(|b| b.salt == a.salt) {
                    return err(format!("tenants {:?} and {:?} share the cache_salt {:?}: IsolatedLRU keeps one LRU list and quota per salt, so give each its own salt", b.name, a.name, a.salt));
                }
            }
        }
        if v.get("chunk_hash_bytes").is_some() && mode == Mode::NonMp {
            return err("\"chunk_hash_bytes\" sets the MP adapter's key hashes: non_mp keys (namespace legacy) do not use it; drop it");
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
            checkpoint_before_slots: match get_str(v, "checkpoint_writeback", "after_slots")? {
                "after_slots" => false,
                "before_slots" => true,
                s => return err(format!("\"checkpoint_writeback\": \"{s}\" is not after_slots or before_slots")),
            },
            uring_reorder_window: u64::from(get_u32(v, "uring_reorder_window", DEFAULT_URING_REORDER_WINDOW)?),
            ublk_queue_depth: match get_u32(v, "ublk_queue_depth", 128)? {
                d @ 1..=4096 => d as u16,
                d => return err(format!("\"ublk_queue_depth\" {d} must be 1 to 4096 (ublk's limit)")),
            },
            eviction,
            lru_insert_reversed,
            l1_share: get_f64(v, "l1_share", 0.0)?,
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
        // LMCache's checkpoint thread wakes every max(1, meta_checkpoint_interval_sec) seconds.
        if !(1.0..=86400.0).contains(&spec.checkpoint_interval_s) {
            return err("\"checkpoint_interval_s\" must be 1 to 86400 (LMCache checkpoints at most once a second)");
        }
        if !(0.0..=1.0).contains(&spec.checkpoint_idle_probability) {
            return err("\"checkpoint_idle_probability\" must be 0 to 1");
        }
        // LMCache refuses an `@` in the model name, and a salt of more than 128 characters or
        // with `@ / \ NUL`. The simulator writes keys into its checkpoint JSON as they are,
        // where LMCache's `json.dumps` escapes: it takes printable ASCII without `"` or `\`.
        let printable = |t: &str| t.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\');
        if spec.model_name.is_empty() || spec.model_name.contains('@') || !printable(&spec.model_name) {
            return err("\"model_name\" must be non-empty printable ASCII without '@' (LMCache's rule), '\"' or '\\'");
        }
        for t in &spec.tenants {
            let salt = &t.salt;
            if salt.len() > 128 || salt.contains(['@', '/']) || !printable(salt) {
                return err(format!("tenant {:?}: \"salt\" must be at most 128 printable ASCII characters without '@', '/' or '\\' (LMCache's rule), or '\"'", t.name));
            }
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
        if let Some(rule) = l1_share_rule(mode, spec.l1_share) {
            return err(format!("\"l1_share\" {rule}"));
        }
        if spec.remove_after_read && mode == Mode::Mp {
            return err("\"remove_after_read\" is a non-MP option");
        }
        let tick_s = spec.eviction.as_ref().map_or(1.0, |e| e.interval_s);
        for t in &spec.tenants {
            let chunks = u64::from(t.prefix_chunks) + u64::from(t.doc_chunks_max) + u64::from(t.unique_tail_chunks);
            let secs = chunks as f64 * spec.chunk_bytes as f64 / (spec.write_rate_mb_s * 1e6);
            if secs > MAX_CHECKPOINTS_PER_REQUEST * spec.checkpoint_interval_s || secs > MAX_TICKS_PER_REQUEST * tick_s {
                return err(format!(
                    "tenant {:?}: a request of up to {chunks} chunks takes {secs:.0} s at \"write_rate_mb_s\" {}, more than {MAX_CHECKPOINTS_PER_REQUEST} checkpoint intervals ({} s each) or {MAX_TICKS_PER_REQUEST} eviction checks ({tick_s} s each); the model holds a request's writes until it ends: raise \"write_rate_mb_s\" or lower the request's chunks",
                    t.name, spec.write_rate_mb_s, spec.checkpoint_interval_s
                ));
            }
        }
        Ok(spec)
    }

    /// The most checkpoint ticks one request's writes may span (bounded at validation by
    /// `MAX_CHECKPOINTS_PER_REQUEST`): its longest request's time, in intervals, and one more
    /// for a tick it starts just before.
    pub fn checkpoints_per_request_at_most(&self) -> u64 {
        let longest = self
            .tenants
            .iter()
            .map(|t| (u64::from(t.prefix_chunks) + u64::from(t.doc_chunks_max) + u64::from(t.unique_tail_chunks)) as f64 * (self.chunk_bytes + self.header_bytes) as f64)
            .fold(0.0, f64::max);
        let secs = longest / (self.write_rate_mb_s * 1e6);
        (secs / self.checkpoint_interval_s).floor().min(MAX_CHECKPOINTS_PER_REQUEST) as u64 + 1
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
        .map_err(|e| match e {
            // What fits LMCache's share of the simulated drive is `simulate`'s flags' to change.
            GeometryError::DeviceTooSmall { meta_total_bytes, capacity, slot_bytes }
            | GeometryError::CapacityTooSmall { meta_total_bytes, capacity_bytes: capacity, slot_bytes } => format!(
                "LMCache's share of the simulated device ({capacity} bytes: --device-size less fdpblk's reserved tail, at the run's --utilization) holds no slot of {slot_bytes} bytes after the {meta_total_bytes}-byte metadata region; give a larger --device-size or a higher --utilization (LMCache needs more than {} bytes), or the workload a smaller \"slot_bytes\" or \"meta_total_bytes\"",
                meta_total_bytes.saturating_add(slot_bytes).saturating_sub(1)
            ),
            GeometryError::TooManySlots { max_slots, capacity, slot_bytes } => format!(
                "LMCache's share of the simulated device ({capacity} bytes) makes {max_slots} slots of {slot_bytes} bytes, more than the {MAX_SLOTS} fdpblk tracks; give a smaller --device-size or the workload a larger \"slot_bytes\""
            ),
            // The rule's text names `add`'s flags: here the values come from the workload file.
            e => ["block_align", "header_bytes", "slot_bytes", "meta_total_bytes"]
                .iter()
                .fold(e.to_string(), |s, f| s.replace(&format!("--{}", f.replace('_', "-")), &format!("the workload's \"{f}\""))),
        })
    }

    /// Bytes of one checkpoint JSON entry of tenant `t` (`"key":{...},`), for a slot at `offset`
    /// holding `size` payload bytes: the 0.5.6 compact encoding of §4 of the reference.
    pub fn entry_json_bytes(&self, key_len: u64, offset: u64, size: u64) -> u64 {
        // "KEY":{"offset":O,"size":S,"shape":[2,32,256,1024],"dtype":"bfloat16","fmt":"KV_2LTD","cached_positions":null},
        const FIXED: u64 = (r#""":{"offset":,"size":,"shape":[2,32,256,1024],"dtype":"bfloat16","fmt":"KV_2LTD","cached_positions":null},"#).len() as u64;
        FIXED + key_len + digits(offset) + digits(size)
    }

    /// Length of the encoded key string of tenant `t` (non-MP: less its chunk hash, see
    /// [`Self::key_len_of`]).
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
            // <model>@<world>@<worker>@<hash hex>@<dtype>, less the hash: Python's unpadded
            // `f"{chunk_hash:x}"`, whose length is each key's ([`Self::key_len_of`]).
            Mode::NonMp => self.model_name.len() as u64 + 5 + 1 + "bfloat16".len() as u64,
        }
    }

    /// Bytes of the key of chunk `id` of a tenant whose keys take `key_len` ([`Self::key_len`]).
    pub fn key_len_of(&self, key_len: u64, id: u64) -> u64 {
        match self.mode {
            Mode::Mp => key_len,
            Mode::NonMp => key_len + u64::from((64 - id.leading_zeros()).div_ceil(4).max(1)),
        }
    }

    /// Bytes of the JSON before the entries and after them, for `device_path` "/dev/ublkb0".
    pub fn json_fixed_bytes(&self, g: &Geometry, next_slot: u64) -> u64 {
        json_head(g, next_slot).len() as u64 + "}}".len() as u64
    }
}
