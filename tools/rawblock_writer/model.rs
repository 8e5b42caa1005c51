//! The in-memory side of LMCache 0.5.6 `RawBlockCore`, reduced to what decides its I/O: the
//! key index in insertion order, the slot allocator (bump pointer, LIFO free set), the dirty
//! counter, checkpoint sequence numbers and the checkpoint JSON, the put and checkpoint write
//! shapes of both engines, and recovery from the newest valid checkpoint.
//!
//! Every byte format comes from the fdpblk library (`fdpblk::layout`), except the slot
//! identity of a key, worked out here ([`lmcache_identity`]) so that fdpblk's key parser is
//! checked, not copied. Facts:
//! `../shared/reference/lmcache-raw-block.md` §2–9, §12 and the fixtures' traces.

use crate::dev::{AlignedBuf, Device, Engine, WriteReq};
use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;
use fdpblk::device::ReadAt;
use fdpblk::layout::checkpoint::{newest_valid, read_copies, read_entries};
use fdpblk::layout::checkpoint_header::{CheckpointHeader, META_MAGIC, META_VERSION};
use fdpblk::layout::checkpoint_json::{CheckpointMeta, JsonLimits};
use fdpblk::layout::slot_header::SlotHeader;
use fdpblk::layout::{Geometry, GeometryConfig};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// LMCache's `_MAX_PUT_MANY_IO_URING_BATCH_KEYS`: one io_uring batch per chunk of this many keys.
pub const MAX_URING_BATCH_KEYS: usize = 64;

/// What one store task of [`Writer::put_concurrent`] got done: its first `done` keys were
/// written (`written`: their writes' shapes), then `err`.
#[derive(Default)]
struct PutResult {
    done: usize,
    written: Vec<(Class, u64, u64)>,
    err: Option<String>,
}

/// What a write is, for the byte counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    SlotHeader = 0,
    SlotPayload = 1,
    CheckpointHeader = 2,
    CheckpointPayload = 3,
}

pub const CLASS_NAMES: [&str; 4] = ["slot_header", "slot_payload", "checkpoint_header", "checkpoint_payload"];

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub puts: u64,
    /// Puts of a key already in the index: success without I/O.
    pub puts_noop: u64,
    pub deletes: u64,
    pub checkpoints_written: u64,
    /// Skipped because the JSON is larger than a container's payload capacity.
    pub checkpoints_skipped: u64,
    /// `checkpoint` while nothing was dirty: LMCache writes nothing.
    pub checkpoints_clean: u64,
    pub reopens: u64,
    pub recovered: u64,
    pub recovery_dropped: u64,
    pub verified: u64,
    /// Keys read back by `load` (payload only, as LMCache's loads) and found intact.
    pub loads: u64,
    pub syncs: u64,
    /// Per class: write calls (pwrite or io_uring entries), bytes in them, and the bytes
    /// rounded out to whole `block_align` blocks (what a block device receives once buffered
    /// pages are written back; equal to `bytes` with O_DIRECT).
    pub writes: [u64; 4],
    pub bytes: [u64; 4],
    pub device_bytes: [u64; 4],
}

fn class_obj(v: &[u64; 4]) -> Value {
    let mut m = serde_json::Map::new();
    for (i, n) in CLASS_NAMES.iter().enumerate() {
        m.insert((*n).into(), json!(v[i]));
    }
    Value::Object(m)
}

impl Counters {
    pub fn to_json(&self) -> Value {
        json!({
            "puts": self.puts, "puts_noop": self.puts_noop, "deletes": self.deletes,
            "checkpoints_written": self.checkpoints_written, "checkpoints_skipped": self.checkpoints_skipped,
            "checkpoints_clean": self.checkpoints_clean, "reopens": self.reopens, "recovered": self.recovered,
            "recovery_dropped": self.recovery_dropped, "verified": self.verified, "loads": self.loads, "syncs": self.syncs,
            "writes": class_obj(&self.writes), "bytes": class_obj(&self.bytes), "device_bytes": class_obj(&self.device_bytes),
        })
    }
    pub fn from_json(v: &Value) -> Counters {
        let u = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        let arr = |k: &str| {
            let mut a = [0u64; 4];
            for (i, n) in CLASS_NAMES.iter().enumerate() {
                a[i] = v.get(k).and_then(|o| o.get(*n)).and_then(Value::as_u64).unwrap_or(0);
            }
            a
        };
        Counters {
            puts: u("puts"),
            puts_noop: u("puts_noop"),
            deletes: u("deletes"),
            checkpoints_written: u("checkpoints_written"),
            checkpoints_skipped: u("checkpoints_skipped"),
            checkpoints_clean: u("checkpoints_clean"),
            reopens: u("reopens"),
            recovered: u("recovered"),
            recovery_dropped: u("recovery_dropped"),
            verified: u("verified"),
            loads: u("loads"),
            syncs: u("syncs"),
            writes: arr("writes"),
            bytes: arr("bytes"),
            device_bytes: arr("device_bytes"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// `bfloat16`, `KV_2LTD`, shape `[2, layers, tokens, hidden]`: payloads are whole tokens.
    Bf16,
    /// `uint8`, `BINARY`, shape `[len]`: any payload length.
    U8,
}

/// Which of LMCache's key namespaces the writer's new keys are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Namespace {
    /// The MP adapter's `ObjectKey` strings (identity: BLAKE2b-8 of the string).
    Object,
    /// The non-MP plugin's `CacheEngineKey` strings (identity: the chunk hash). With
    /// `key_layers` > 0 each chunk is stored as that many `LayerCacheEngineKey`s (`@<layer>`),
    /// which all carry the chunk's identity.
    Legacy { key_layers: u64 },
}

/// Settings that shape keys and payloads (not the geometry).
#[derive(Clone, Debug)]
pub struct Options {
    pub namespace: Namespace,
    pub seed: u64,
    /// The `device_path` string LMCache was configured with (written into every checkpoint).
    pub device_path: String,
    pub model: String,
    pub kv_rank: u32,
    pub object_group_id: u64,
    pub dtype: Dtype,
    pub layers: u64,
    pub hidden: u64,
    /// Every K-th new payload is partial (0: never).
    pub partial_every: u64,
    /// Full-chunk payload length; default the slot's payload capacity.
    pub payload_bytes: Option<u64>,
}

/// One index entry, with the metadata LMCache keeps for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: String,
    pub slot: u64,
    pub size: u64,
    pub shape: Value,
    pub dtype: Value,
    pub fmt: Value,
    pub cached_positions: Value,
    /// How many times the key was put before this content (payload pattern input); None
    /// when recovered from a device without a history for the key.
    pub gen: Option<u32>,
}

impl Entry {
    /// An entry whose metadata (`shape`, `dtype`, `fmt`, `cached_positions`) is taken as it is
    /// from a JSON object (a checkpoint entry or a saved state entry); absent fields are null.
    fn with_fields(key: String, slot: u64, size: u64, fields: Option<&Value>, gen: Option<u32>) -> Entry {
        let f = |n: &str| fields.and_then(|x| x.get(n)).cloned().unwrap_or(Value::Null);
        Entry { key, slot, size, shape: f("shape"), dtype: f("dtype"), fmt: f("fmt"), cached_positions: f("cached_positions"), gen }
    }
}

/// A key to put, with its payload length and metadata.
#[derive(Clone, Debug)]
pub struct PutItem {
    pub key: String,
    pub size: u64,
    pub shape: Value,
    pub dtype: Value,
    pub fmt: Value,
    pub cached_positions: Value,
}

/// What the store tasks got done, then what the checkpoint's writes beside them did.
type PutsBeside = (Result<(), String>, Result<(), String>);

/// A checkpoint snapshotted and encoded, to be written outside the index lock (LMCache's
/// `checkpoint_now()` writes while store workers may be writing their puts, reference §9).
pub struct PreparedCheckpoint {
    seq: u64,
    copy: u8,
    payload_len: u64,
    /// The index's change count at the snapshot.
    snapshot: u64,
    /// The container's offset.
    offset: u64,
    block_align: u64,
    pay: AlignedBuf,
    hdr: AlignedBuf,
}

impl PreparedCheckpoint {
    /// Payload, then header block.
    fn reqs(&self) -> [(Class, WriteReq<'_>); 2] {
        [
            (Class::CheckpointPayload, WriteReq { offset: self.offset + self.block_align, data: self.pay.as_slice() }),
            (Class::CheckpointHeader, WriteReq { offset: self.offset, data: self.hdr.as_slice() }),
        ]
    }

    /// Writes it on `dev`: posix, the payload then the header block; io_uring, one batch.
    pub fn write(&self, dev: &mut Device) -> Result<(), String> {
        dev.write_group(&self.reqs().map(|(_, r)| r))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointOutcome {
    Written { seq: u64, copy: u8, payload_len: u64 },
    Skipped { payload_len: u64, cap: u64 },
    Clean,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReopenReport {
    /// The seq of the checkpoint loaded, or None (started empty).
    pub seq: Option<u64>,
    pub recovered: u64,
    pub skipped: u64,
    pub dropped: u64,
    /// Why nothing was loaded.
    pub rejected: Option<String>,
    /// The recovered index holds exactly the (key, slot, size) the writer had before.
    pub matches_previous: bool,
}

pub fn round_up(n: u64, a: u64) -> u64 {
    n.div_ceil(a) * a
}

/// Bytes of `[off, off+len)` rounded out to whole blocks of `a`.
pub fn round_out(off: u64, len: u64, a: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    round_up(off + len, a) - off / a * a
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn blake(parts: &[&[u8]], out: &mut [u8]) {
    let mut h = Blake2bVar::new(out.len()).expect("digest sizes used here are 8 and 32");
    for p in parts {
        h.update(p);
    }
    h.finalize_variable(out).expect("buffer has the digest size");
}

/// The slot identity LMCache writes for `key` (reference `lmcache-raw-block.md` §6), worked
/// out here apart from fdpblk's key parser, so that a regression there shows in the checks
/// that run this tool instead of being copied into the headers it writes. Object keys
/// (`…@0x<kv_rank>@…`): BLAKE2b with an 8-byte digest of the string, read little-endian.
/// Legacy keys (`<model>@<world_size>@<worker_id>@<chunk hash hex>@<dtype>…`): the chunk hash's
/// low 64 bits, two's complement for a `-` hash.
pub fn lmcache_identity(key: &str) -> Result<u64, String> {
    let fields: Vec<&str> = key.split('@').collect();
    if fields.get(1).is_some_and(|f| f.starts_with("0x")) {
        let mut d = [0u8; 8];
        blake(&[key.as_bytes()], &mut d);
        return Ok(u64::from_le_bytes(d));
    }
    let hash = fields.get(3).filter(|_| fields.len() >= 5).ok_or_else(|| format!("key {key}: neither an object nor a legacy key"))?;
    let (neg, digits) = hash.strip_prefix('-').map_or((false, *hash), |d| (true, d));
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("key {key}: chunk hash {hash} is not hex"));
    }
    // Digits above the last 16 are multiples of 2^64.
    let low = u64::from_str_radix(&digits[digits.len().saturating_sub(16)..], 16).map_err(|e| format!("key {key}: {e}"))?;
    Ok(if neg { low.wrapping_neg() } else { low })
}

/// The payload of `key`'s `gen`-th put: a function of (seed, key, gen) only.
pub fn fill_payload(seed: u64, key: &str, gen: u32, out: &mut [u8]) {
    let mut s = [0u8; 8];
    blake(&[b"rawblock-writer payload", &seed.to_le_bytes(), &gen.to_le_bytes(), key.as_bytes()], &mut s);
    let mut st = u64::from_le_bytes(s);
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&splitmix(&mut st).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let w = splitmix(&mut st).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&w[..n]);
}

/// Python `urllib.parse.quote(s, safe="")`.
pub fn quote(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'~') {
            o.push(b as char);
        } else {
            let _ = write!(o, "%{b:02X}");
        }
    }
    o
}

/// A string as Python's `json.dumps(..., ensure_ascii=True)` writes it.
pub fn py_str(s: &str, o: &mut String) {
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            '\u{8}' => o.push_str("\\b"),
            '\u{c}' => o.push_str("\\f"),
            ' '..='~' => o.push(c),
            _ => {
                let mut b = [0u16; 2];
                for u in c.encode_utf16(&mut b) {
                    let _ = write!(o, "\\u{u:04x}");
                }
            }
        }
    }
    o.push('"');
}

/// A value as `json.dumps(v, separators=(",", ":"), ensure_ascii=True)` writes it.
pub fn py_value(v: &Value, o: &mut String) {
    match v {
        Value::Null => o.push_str("null"),
        Value::Bool(b) => o.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let _ = write!(o, "{n}");
        }
        Value::String(s) => py_str(s, o),
        Value::Array(a) => {
            o.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    o.push(',');
                }
                py_value(x, o);
            }
            o.push(']');
        }
        Value::Object(m) => {
            o.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    o.push(',');
                }
                py_str(k, o);
                o.push(':');
                py_value(x, o);
            }
            o.push('}');
        }
    }
}

/// Checks a cache salt the way LMCache's object key codec does.
pub fn check_salt(s: &str) -> Result<(), String> {
    if s.chars().count() > 128 {
        return Err(format!("cache salt {s:?} is longer than 128 characters"));
    }
    if s.contains(['@', '/', '\\', '\0']) {
        return Err(format!("cache salt {s:?} contains one of @ / \\ NUL, which LMCache rejects"));
    }
    Ok(())
}

#[derive(Debug)]
pub struct Writer {
    pub geom: Geometry,
    pub opts: Options,
    /// Index in insertion order: order number -> entry, and key -> order number.
    entries: BTreeMap<u64, Entry>,
    by_key: HashMap<String, u64>,
    next_order: u64,
    /// Free slots; the last one is handed out first (`dict.popitem()`).
    free: Vec<u64>,
    free_set: HashSet<u64>,
    pub next_slot: u64,
    pub seq: u64,
    dirty_total: u64,
    persisted: u64,
    next_key: u64,
    put_counter: u64,
    rng: u64,
    /// Generation of the last content put for every key ever put.
    history: HashMap<String, u32>,
    /// Deleted keys not put again, oldest deletion first.
    deleted: Vec<String>,
    pub total: Counters,
    pub run: Counters,
    pub last_reopen: Option<ReopenReport>,
}

impl Writer {
    pub fn new(geom: Geometry, opts: Options) -> Writer {
        let rng = opts.seed ^ 0x5eed_0f1a_c4e5;
        Writer {
            geom,
            opts,
            entries: BTreeMap::new(),
            by_key: HashMap::new(),
            next_order: 0,
            free: Vec::new(),
            free_set: HashSet::new(),
            next_slot: 0,
            seq: 0,
            dirty_total: 0,
            persisted: 0,
            next_key: 0,
            put_counter: 0,
            rng,
            history: HashMap::new(),
            deleted: Vec::new(),
            total: Counters::default(),
            run: Counters::default(),
            last_reopen: None,
        }
    }

    // ---- index and allocator ----------------------------------------------------------

    pub fn live(&self) -> usize {
        self.entries.len()
    }
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }
    pub fn entry(&self, key: &str) -> Option<&Entry> {
        self.by_key.get(key).and_then(|o| self.entries.get(o))
    }
    /// Free slots in hand-out order reversed (the last is reused first), as Python lists them.
    pub fn free_slots(&self) -> &[u64] {
        &self.free
    }
    pub fn is_dirty(&self) -> bool {
        self.dirty_total != self.persisted
    }

    fn alloc_slot(&mut self) -> Option<u64> {
        if let Some(s) = self.free.pop() {
            self.free_set.remove(&s);
            return Some(s);
        }
        if self.next_slot < self.geom.max_slots {
            self.next_slot += 1;
            return Some(self.next_slot - 1);
        }
        None
    }

    /// Adds `slot` to the free set; like a dict assignment, an existing member keeps its place.
    fn free_slot(&mut self, slot: u64) {
        if self.free_set.insert(slot) {
            self.free.push(slot);
        }
    }

    fn insert_entry(&mut self, e: Entry) {
        let o = self.next_order;
        self.next_order += 1;
        self.by_key.insert(e.key.clone(), o);
        self.entries.insert(o, e);
    }

    fn remove_entry(&mut self, key: &str) -> Option<Entry> {
        let o = self.by_key.remove(key)?;
        self.entries.remove(&o)
    }

    fn clear_index(&mut self) {
        self.entries.clear();
        self.by_key.clear();
        self.free.clear();
        self.free_set.clear();
        self.next_slot = 0;
        self.seq = 0;
        self.dirty_total = 0;
        self.persisted = 0;
    }

    fn count_write(&mut self, class: Class, offset: u64, len: u64) {
        let a = self.geom.block_align;
        for c in [&mut self.total, &mut self.run] {
            c.writes[class as usize] += 1;
            c.bytes[class as usize] += len;
            c.device_bytes[class as usize] += round_out(offset, len, a);
        }
    }

    fn rand(&mut self) -> u64 {
        splitmix(&mut self.rng)
    }

    // ---- keys and payload sizes ----------------------------------------------------------

    /// A new key: in the object namespace
    /// `<quoted model>@<kv_rank:#010x>@<group:x>@<64 hex>[@salt]`; in the legacy one
    /// `<model>@<world_size>@<worker_id>@<chunk hash, signed hex>@<dtype>[@<layer>][@salt%S]`
    /// (world size and worker from `kv_rank`; the salt as an `lmcache.tag` item).
    pub fn new_key(&mut self, salt: Option<&str>) -> String {
        let n = self.next_key;
        self.next_key += 1;
        if let Namespace::Legacy { key_layers } = self.opts.namespace {
            return self.legacy_key(n, key_layers, salt);
        }
        let mut h = [0u8; 32];
        blake(&[b"rawblock-writer chunk", &self.opts.seed.to_le_bytes(), &n.to_le_bytes()], &mut h);
        let mut hex = String::with_capacity(64);
        for b in h {
            let _ = write!(hex, "{b:02x}");
        }
        let mut k =
            format!("{}@{:#010x}@{:x}@{hex}", quote(&self.opts.model), self.opts.kv_rank, self.opts.object_group_id);
        if let Some(s) = salt.filter(|s| !s.is_empty()) {
            k.push('@');
            k.push_str(s);
        }
        k
    }

    fn legacy_key(&self, n: u64, key_layers: u64, salt: Option<&str>) -> String {
        let (chunk, layer) = match n.checked_div(key_layers) {
            Some(chunk) => (chunk, Some(n % key_layers)),
            None => (n, None),
        };
        let mut h = [0u8; 8];
        blake(&[b"rawblock-writer legacy chunk", &self.opts.seed.to_le_bytes(), &chunk.to_le_bytes()], &mut h);
        // Python's builtin hash is a signed 64-bit value, printed `f"{h:x}"` (a leading `-`).
        let hash = i64::from_le_bytes(h);
        let hex = if hash < 0 { format!("-{:x}", hash.unsigned_abs()) } else { format!("{hash:x}") };
        let dtype = match self.opts.dtype {
            Dtype::Bf16 => "bfloat16",
            Dtype::U8 => "uint8",
        };
        let (world_size, worker_id) = ((self.opts.kv_rank >> 24).max(1), (self.opts.kv_rank >> 16) & 0xff);
        let mut k = format!("{}@{world_size}@{worker_id}@{hex}@{dtype}", self.opts.model);
        if let Some(l) = layer {
            let _ = write!(k, "@{l}");
        }
        if let Some(s) = salt.filter(|s| !s.is_empty()) {
            let _ = write!(k, "@salt%{s}");
        }
        k
    }

    fn token_bytes(&self) -> u64 {
        4 * self.opts.layers * self.opts.hidden
    }

    /// The full-chunk payload length for a put with optional `--payload-bytes`.
    pub fn full_size(&self, payload_bytes: Option<u64>) -> Result<u64, String> {
        let cap = self.geom.slot_payload_capacity();
        let full = payload_bytes.or(self.opts.payload_bytes).unwrap_or(cap);
        if full == 0 || full > cap {
            return Err(format!("payload of {full} bytes does not fit a slot's payload capacity of {cap} bytes (slot_bytes - header_bytes)"));
        }
        if self.opts.dtype == Dtype::Bf16 {
            let tb = self.token_bytes();
            let full = if payload_bytes.or(self.opts.payload_bytes).is_none() { cap / tb * tb } else { full };
            if full == 0 || full % tb != 0 {
                return Err(format!(
                    "payload of {full} bytes is not a whole number of tokens ({tb} bytes each for bfloat16 [2,{},T,{}]); pick a multiple, change --layers/--hidden, or use --dtype uint8",
                    self.opts.layers, self.opts.hidden
                ));
            }
            return Ok(full);
        }
        Ok(full)
    }

    /// The next new payload's length: full, or partial on every `partial_every`-th put.
    fn next_size(&mut self, full: u64, partial_every: u64) -> u64 {
        self.put_counter += 1;
        if partial_every == 0 || !self.put_counter.is_multiple_of(partial_every) {
            return full;
        }
        match self.opts.dtype {
            Dtype::Bf16 => {
                let tb = self.token_bytes();
                let t = full / tb;
                if t < 2 {
                    full
                } else {
                    (1 + self.rand() % (t - 1)) * tb
                }
            }
            Dtype::U8 => {
                if full < 2 {
                    full
                } else {
                    1 + self.rand() % (full - 1)
                }
            }
        }
    }

    fn item_for(&self, key: String, size: u64) -> PutItem {
        let (shape, dtype, fmt) = match self.opts.dtype {
            Dtype::Bf16 => (
                json!([2, self.opts.layers, size / self.token_bytes(), self.opts.hidden]),
                json!("bfloat16"),
                json!("KV_2LTD"),
            ),
            Dtype::U8 => (json!([size]), json!("uint8"), json!("BINARY")),
        };
        PutItem { key, size, shape, dtype, fmt, cached_positions: Value::Null }
    }

    /// `n` new keys with sizes by the put rules.
    pub fn plan_new(
        &mut self,
        n: u64,
        salt: Option<&str>,
        payload_bytes: Option<u64>,
        partial_every: Option<u64>,
    ) -> Result<Vec<PutItem>, String> {
        if let Some(s) = salt {
            check_salt(s)?;
        }
        let full = self.full_size(payload_bytes)?;
        let pe = partial_every.unwrap_or(self.opts.partial_every);
        let mut v = Vec::with_capacity(n.min(1 << 20) as usize);
        for _ in 0..n {
            let key = self.new_key(salt);
            let size = self.next_size(full, pe);
            v.push(self.item_for(key, size));
        }
        Ok(v)
    }

    /// Re-puts: the `n` most recently deleted keys (new content), or with `live` the `n`
    /// oldest indexed keys (which LMCache acknowledges without I/O).
    pub fn plan_reput(
        &mut self,
        n: u64,
        live: bool,
        payload_bytes: Option<u64>,
        partial_every: Option<u64>,
    ) -> Result<Vec<PutItem>, String> {
        let full = self.full_size(payload_bytes)?;
        let pe = partial_every.unwrap_or(self.opts.partial_every);
        let keys: Vec<String> = if live {
            if (self.live() as u64) < n {
                return Err(format!("reput {n} --live: only {} keys are indexed", self.live()));
            }
            self.entries.values().take(n as usize).map(|e| e.key.clone()).collect()
        } else {
            if (self.deleted.len() as u64) < n {
                return Err(format!("reput {n}: only {} deleted keys are left to put again", self.deleted.len()));
            }
            let at = self.deleted.len() - n as usize;
            self.deleted.split_off(at).into_iter().rev().collect()
        };
        let mut v = Vec::with_capacity(keys.len());
        for key in keys {
            let size = if live { self.entry(&key).map(|e| e.size).unwrap_or(full) } else { self.next_size(full, pe) };
            v.push(self.item_for(key, size));
        }
        Ok(v)
    }

    // ---- put ----------------------------------------------------------------------------

    fn slot_bufs(&self, item: &PutItem, gen: u32) -> Result<(AlignedBuf, AlignedBuf), String> {
        let g = &self.geom;
        let a = g.block_align as usize;
        let identity = lmcache_identity(&item.key)?;
        let mut hdr = AlignedBuf::zeroed(g.header_bytes as usize, a)?;
        hdr.as_mut_slice()
            .copy_from_slice(&SlotHeader { identity, payload_len: item.size }.encode(g.header_bytes as usize));
        let mut pay = AlignedBuf::zeroed(round_up(item.size, g.block_align) as usize, a)?;
        fill_payload(self.opts.seed, &item.key, gen, &mut pay.as_mut_slice()[..item.size as usize]);
        Ok((hdr, pay))
    }

    /// The writes of one put, in LMCache's order: header, then the payload (exact length when
    /// buffered; rounded up and zero padded with O_DIRECT, which the posix engine issues as
    /// the aligned prefix and then the padded last block).
    fn put_reqs<'a>(
        &self,
        slot: u64,
        size: u64,
        hdr: &'a AlignedBuf,
        pay: &'a AlignedBuf,
        dev: &Device,
        out: &mut Vec<(Class, WriteReq<'a>)>,
    ) {
        let g = &self.geom;
        let off = g.slot_offset(slot);
        let a = g.block_align;
        out.push((Class::SlotHeader, WriteReq { offset: off, data: hdr.as_slice() }));
        let poff = off + g.header_bytes;
        let p = pay.as_slice();
        if !dev.odirect {
            out.push((Class::SlotPayload, WriteReq { offset: poff, data: &p[..size as usize] }));
        } else if dev.engine == Engine::Posix && !size.is_multiple_of(a) {
            let pre = size / a * a;
            if pre > 0 {
                out.push((Class::SlotPayload, WriteReq { offset: poff, data: &p[..pre as usize] }));
            }
            out.push((Class::SlotPayload, WriteReq { offset: poff + pre, data: &p[pre as usize..(pre + a) as usize] }));
        } else {
            out.push((Class::SlotPayload, WriteReq { offset: poff, data: &p[..round_up(size, a) as usize] }));
        }
    }

    fn commit(&mut self, item: PutItem, slot: u64, gen: u32) {
        self.history.insert(item.key.clone(), gen);
        self.insert_entry(Entry {
            key: item.key,
            slot,
            size: item.size,
            shape: item.shape,
            dtype: item.dtype,
            fmt: item.fmt,
            cached_positions: item.cached_positions,
            gen: Some(gen),
        });
        self.dirty_total += 1;
        self.total.puts += 1;
        self.run.puts += 1;
    }

    fn issue(&mut self, dev: &mut Device, reqs: &[(Class, WriteReq<'_>)]) -> Result<(), String> {
        let plain: Vec<WriteReq<'_>> = reqs.iter().map(|(_, r)| WriteReq { offset: r.offset, data: r.data }).collect();
        dev.write_group(&plain)?;
        for (c, r) in reqs {
            self.count_write(*c, r.offset, r.data.len() as u64);
        }
        Ok(())
    }

    /// A put whose writes failed, its slots freed again: LMCache's rollback advances the
    /// dirty counter too (reference §9), so the next tick writes a checkpoint.
    fn rolled_back(&mut self) {
        self.dirty_total += 1;
    }

    fn noop(&mut self) {
        self.total.puts_noop += 1;
        self.run.puts_noop += 1;
    }

    fn check_size(&self, it: &PutItem) -> Result<(), String> {
        let cap = self.geom.slot_payload_capacity();
        if it.size == 0 || it.size > cap {
            return Err(format!("key {}: payload of {} bytes does not fit the slot payload capacity {cap}", it.key, it.size));
        }
        Ok(())
    }

    /// One `put_many` call: keys already indexed are acknowledged without I/O; posix writes
    /// each key's header then payload in turn; io_uring writes each chunk of up to 64 keys as
    /// one batch `[hdr0, payload0, hdr1, payload1, ...]`.
    pub fn put_many(&mut self, dev: &mut Device, items: Vec<PutItem>) -> Result<(), String> {
        for it in &items {
            self.check_size(it)?;
        }
        match dev.engine {
            Engine::Posix => {
                for item in items {
                    if self.by_key.contains_key(&item.key) {
                        self.noop();
                        continue;
                    }
                    let slot = self.alloc_slot().ok_or_else(|| self.full_error())?;
                    let gen = self.history.get(&item.key).map_or(0, |g| g + 1);
                    let (hdr, pay) = self.slot_bufs(&item, gen)?;
                    let mut reqs = Vec::with_capacity(3);
                    self.put_reqs(slot, item.size, &hdr, &pay, dev, &mut reqs);
                    if let Err(e) = self.issue(dev, &reqs) {
                        self.free_slot(slot);
                        self.rolled_back();
                        return Err(e);
                    }
                    drop(reqs);
                    self.commit(item, slot, gen);
                }
            }
            Engine::IoUring => {
                let mut seen = HashSet::new();
                let mut todo = Vec::with_capacity(items.len());
                for item in items {
                    if self.by_key.contains_key(&item.key) || !seen.insert(item.key.clone()) {
                        self.noop();
                    } else {
                        todo.push(item);
                    }
                }
                let mut it = todo.into_iter().peekable();
                while it.peek().is_some() {
                    let chunk: Vec<PutItem> = it.by_ref().take(MAX_URING_BATCH_KEYS).collect();
                    let mut slots = Vec::with_capacity(chunk.len());
                    for _ in &chunk {
                        match self.alloc_slot() {
                            Some(s) => slots.push(s),
                            None => {
                                for s in slots.into_iter().rev() {
                                    self.free_slot(s);
                                }
                                return Err(self.full_error());
                            }
                        }
                    }
                    let mut bufs = Vec::with_capacity(chunk.len());
                    let mut gens = Vec::with_capacity(chunk.len());
                    for item in &chunk {
                        let gen = self.history.get(&item.key).map_or(0, |g| g + 1);
                        bufs.push(self.slot_bufs(item, gen)?);
                        gens.push(gen);
                    }
                    let mut reqs = Vec::with_capacity(2 * chunk.len());
                    for (i, item) in chunk.iter().enumerate() {
                        self.put_reqs(slots[i], item.size, &bufs[i].0, &bufs[i].1, dev, &mut reqs);
                    }
                    if let Err(e) = self.issue(dev, &reqs) {
                        // LMCache rolls the whole chunk back: its slots are free again.
                        for s in slots {
                            self.free_slot(s);
                        }
                        self.rolled_back();
                        return Err(e);
                    }
                    drop(reqs);
                    for ((item, slot), gen) in chunk.into_iter().zip(slots).zip(gens) {
                        self.commit(item, slot, gen);
                    }
                }
            }
        }
        Ok(())
    }

    /// `put_many` calls at once on `workers` threads, as LMCache MP's store workers
    /// (`num_store_workers`, default 2) run store tasks. Each thread has its own fd on the
    /// device (a dup) and, with io_uring, its own ring (LMCache has one native ring thread;
    /// its batches from two tasks are in flight together too), and makes the buffers of one
    /// write group at a time. The calls take their slots from the allocator in turn, key by
    /// key, as allocations interleaved under LMCache's lock hand them out. A call that fails
    /// keeps the keys it wrote before the failure (posix: key by key; io_uring: whole chunks
    /// of up to 64 keys) and frees the others' slots; its thread stops.
    pub fn put_concurrent(&mut self, dev: &mut Device, calls: Vec<Vec<PutItem>>, workers: usize) -> Result<(), String> {
        self.put_beside(dev, calls, workers, None)?.0
    }

    /// [`Writer::put_concurrent`] with a `checkpoint_now()` on a thread of its own: snapshotted
    /// first (the puts are not in it), written while the store workers write. The outcome of
    /// the checkpoint, once the puts are booked; the puts' error first.
    pub fn put_concurrent_with_checkpoint(&mut self, dev: &mut Device, calls: Vec<Vec<PutItem>>, workers: usize) -> Result<CheckpointOutcome, String> {
        // A put LMCache would refuse outright writes nothing, the checkpoint included.
        for it in calls.iter().flatten() {
            self.check_size(it)?;
        }
        let p = match self.prepare_checkpoint()? {
            Ok(p) => p,
            Err(outcome) => return self.put_concurrent(dev, calls, workers).map(|()| outcome),
        };
        let (puts, written) = match self.put_beside(dev, calls, workers, Some(&p)) {
            Ok(r) => r,
            // No put started (the device full): LMCache's checkpoint thread writes all the same.
            Err(e) => (Err(e), p.write(dev)),
        };
        // Written is written, whatever became of the puts: the next seq follows it.
        let outcome = written.map(|()| self.checkpoint_written(p));
        puts?;
        outcome
    }

    /// The store tasks and, with `checkpoint`, its writes beside them: the puts' result, then
    /// the checkpoint writes'; `Err` where nothing was written.
    fn put_beside(&mut self, dev: &mut Device, calls: Vec<Vec<PutItem>>, workers: usize, checkpoint: Option<&PreparedCheckpoint>) -> Result<PutsBeside, String> {
        for it in calls.iter().flatten() {
            self.check_size(it)?;
        }
        let threads = workers.clamp(1, calls.len().max(1));
        // Before any slot is taken: a failure here leaves the allocator as it was.
        let mut devs = (0..threads).map(|_| dev.worker()).collect::<Result<Vec<_>, _>>()?;
        let mut ckpt_dev = checkpoint.map(|_| dev.worker()).transpose()?;
        let mut written = Ok(());
        // Keys already indexed, or in an earlier call or key of this one, need no I/O.
        let mut seen = HashSet::new();
        let mut noops = 0;
        let calls: Vec<Vec<PutItem>> = calls
            .into_iter()
            .map(|c| {
                c.into_iter()
                    .filter(|it| {
                        let fresh = !self.by_key.contains_key(&it.key) && seen.insert(it.key.clone());
                        noops += u64::from(!fresh);
                        fresh
                    })
                    .collect()
            })
            .collect();
        for _ in 0..noops {
            self.noop();
        }
        let mut slots: Vec<Vec<u64>> = calls.iter().map(|c| Vec::with_capacity(c.len())).collect();
        let longest = calls.iter().map(Vec::len).max().unwrap_or(0);
        let mut order = Vec::new();
        for k in 0..longest {
            for (ci, c) in calls.iter().enumerate() {
                if k < c.len() {
                    match self.alloc_slot() {
                        Some(s) => {
                            slots[ci].push(s);
                            order.push(s);
                        }
                        None => {
                            for s in order.into_iter().rev() {
                                self.free_slot(s);
                            }
                            return Err(self.full_error());
                        }
                    }
                }
            }
        }
        let gens: Vec<Vec<u32>> =
            calls.iter().map(|c| c.iter().map(|it| self.history.get(&it.key).map_or(0, |g| g + 1)).collect()).collect();
        // Each call's write groups: posix one key each, io_uring one chunk each.
        let per_group = if dev.engine == Engine::Posix { 1 } else { MAX_URING_BATCH_KEYS };
        let next = AtomicUsize::new(0);
        let results: Vec<Mutex<PutResult>> = calls.iter().map(|_| Mutex::new(PutResult::default())).collect();
        let this = &*self;
        std::thread::scope(|sc| {
            if let (Some(p), Some(d)) = (checkpoint, ckpt_dev.as_mut()) {
                // The buffers' bytes, not the buffers (whose pointers are not Sync).
                let (reqs, written) = (p.reqs().map(|(_, r)| r), &mut written);
                sc.spawn(move || *written = d.write_group(&reqs));
            }
            for d in devs.iter_mut() {
                let (calls, slots, gens, next, results) = (&calls, &slots, &gens, &next, &results);
                sc.spawn(move || loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = calls.get(j) else { break };
                    let mut r = PutResult::default();
                    for start in (0..c.len()).step_by(per_group) {
                        let keys = start..(start + per_group).min(c.len());
                        match this.write_group(d, &c[keys.clone()], &slots[j][keys.clone()], &gens[j][keys.clone()]) {
                            Ok(shapes) => {
                                r.done = keys.end;
                                r.written.extend(shapes);
                            }
                            Err(e) => {
                                r.err = Some(e);
                                break;
                            }
                        }
                    }
                    let failed = r.err.is_some();
                    *results[j].lock().unwrap_or_else(|p| p.into_inner()) = r;
                    if failed {
                        break; // its ring may still hold entries of the failed group
                    }
                });
            }
        });
        for d in devs.into_iter().chain(ckpt_dev) {
            dev.absorb_log(d);
        }
        let mut first_err = None;
        let n = results.len();
        for (j, ((c, s), g)) in calls.into_iter().zip(slots).zip(gens).enumerate() {
            let r = std::mem::take(&mut *results[j].lock().unwrap_or_else(|p| p.into_inner()));
            for (class, off, len) in r.written {
                self.count_write(class, off, len);
            }
            for (k, (item, (slot, gen))) in c.into_iter().zip(s.into_iter().zip(g)).enumerate() {
                if k < r.done {
                    self.commit(item, slot, gen);
                } else {
                    self.free_slot(slot);
                }
            }
            if let Some(e) = r.err {
                self.rolled_back();
                if first_err.is_none() {
                    first_err = Some(format!("store task {} of {n}: {e}", j + 1));
                }
            }
        }
        // A call no thread reached (every thread stopped at a failure) is freed above.
        Ok((first_err.map_or(Ok(()), Err), written))
    }

    /// Writes one group of keys (their headers and payloads) with one `write_group` call on
    /// `d`; the shapes written, for the byte counters. On a failed submission the group's
    /// buffers are leaked, not freed: the kernel may still read them.
    fn write_group(&self, d: &mut Device, items: &[PutItem], slots: &[u64], gens: &[u32]) -> Result<Vec<(Class, u64, u64)>, String> {
        let bufs = items.iter().zip(gens).map(|(it, g)| self.slot_bufs(it, *g)).collect::<Result<Vec<_>, _>>()?;
        let mut reqs = Vec::with_capacity(3 * items.len());
        for ((it, slot), (hdr, pay)) in items.iter().zip(slots).zip(&bufs) {
            self.put_reqs(*slot, it.size, hdr, pay, d, &mut reqs);
        }
        let shapes = reqs.iter().map(|(c, r)| (*c, r.offset, r.data.len() as u64)).collect();
        let plain: Vec<WriteReq<'_>> = reqs.iter().map(|(_, r)| WriteReq { offset: r.offset, data: r.data }).collect();
        let res = d.write_group(&plain);
        drop((plain, reqs));
        match res {
            Ok(()) => Ok(shapes),
            Err(e) => {
                std::mem::forget(bufs);
                Err(e)
            }
        }
    }

    fn full_error(&self) -> String {
        format!(
            "no free slot available: all {} slots are in use (LMCache fails the put); delete keys first or use a larger device",
            self.geom.max_slots
        )
    }

    // ---- delete -------------------------------------------------------------------------

    /// `delete_many`: index entries go, their slots join the free set; nothing is written.
    pub fn delete_keys(&mut self, keys: &[String]) -> u64 {
        let mut n = 0;
        for k in keys {
            if let Some(e) = self.remove_entry(k) {
                self.free_slot(e.slot);
                self.deleted.retain(|d| d != k);
                self.deleted.push(e.key);
                self.dirty_total += 1;
                n += 1;
            }
        }
        self.total.deletes += n;
        self.run.deletes += n;
        n
    }

    /// The `n` oldest keys in index order, or `n` keys chosen at random.
    pub fn pick_keys(&mut self, n: u64, random: bool) -> Result<Vec<String>, String> {
        let live = self.live() as u64;
        if n > live {
            return Err(format!("only {live} keys are indexed, {n} asked for"));
        }
        if !random {
            return Ok(self.entries.values().take(n as usize).map(|e| e.key.clone()).collect());
        }
        let mut all: Vec<String> = self.entries.values().map(|e| e.key.clone()).collect();
        for i in 0..n as usize {
            let j = i + (self.rand() % (all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(n as usize);
        Ok(all)
    }

    // ---- checkpoint ---------------------------------------------------------------------

    /// The checkpoint JSON (`_snapshot_state`), byte for byte as LMCache 0.5.6 encodes it.
    pub fn snapshot_json(&self) -> Vec<u8> {
        let g = &self.geom;
        let mut s = String::with_capacity(256 + self.entries.len() * 240);
        s.push_str("{\"version\":1,\"device_path\":");
        py_str(&self.opts.device_path, &mut s);
        let _ = write!(
            s,
            ",\"capacity_bytes\":{},\"block_align\":{},\"header_bytes\":{},\"slot_bytes\":{},\"meta_total_bytes\":{},\"meta_magic\":",
            g.capacity_bytes, g.block_align, g.header_bytes, g.slot_bytes, g.meta_total_bytes
        );
        py_str(std::str::from_utf8(META_MAGIC).unwrap_or("LMCIDX01"), &mut s);
        let _ = write!(
            s,
            ",\"meta_version\":{META_VERSION},\"data_base_offset\":{},\"next_slot\":{},\"entries\":{{",
            g.data_base_offset(),
            self.next_slot
        );
        for (i, e) in self.entries.values().enumerate() {
            if i > 0 {
                s.push(',');
            }
            py_str(&e.key, &mut s);
            let _ = write!(s, ":{{\"offset\":{},\"size\":{},\"shape\":", g.slot_offset(e.slot), e.size);
            py_value(&e.shape, &mut s);
            s.push_str(",\"dtype\":");
            py_value(&e.dtype, &mut s);
            s.push_str(",\"fmt\":");
            py_value(&e.fmt, &mut s);
            s.push_str(",\"cached_positions\":");
            py_value(&e.cached_positions, &mut s);
            s.push('}');
        }
        s.push_str("}}");
        s.into_bytes()
    }

    /// `checkpoint_now()`: nothing if nothing changed; skipped with a warning if the JSON
    /// exceeds a container; else the zero-padded payload at container + block_align, then the
    /// header block at the container (posix: two pwrites in that order; io_uring: one batch).
    pub fn checkpoint(&mut self, dev: &mut Device) -> Result<CheckpointOutcome, String> {
        let p = match self.prepare_checkpoint()? {
            Ok(p) => p,
            Err(outcome) => return Ok(outcome),
        };
        p.write(dev)?;
        Ok(self.checkpoint_written(p))
    }

    /// The snapshot and encoding of `checkpoint_now()`, which LMCache does under its index
    /// lock; `Err` with the outcome (counted) where nothing is to be written.
    pub fn prepare_checkpoint(&mut self) -> Result<Result<PreparedCheckpoint, CheckpointOutcome>, String> {
        if !self.is_dirty() {
            self.total.checkpoints_clean += 1;
            self.run.checkpoints_clean += 1;
            return Ok(Err(CheckpointOutcome::Clean));
        }
        let g = self.geom;
        let json = self.snapshot_json();
        let len = json.len() as u64;
        if len > g.payload_cap() {
            eprintln!(
                "rawblock-writer: warning: RawBlockCore metadata payload too large ({len} > {}), skipping checkpoint",
                g.payload_cap()
            );
            self.total.checkpoints_skipped += 1;
            self.run.checkpoints_skipped += 1;
            return Ok(Err(CheckpointOutcome::Skipped { payload_len: len, cap: g.payload_cap() }));
        }
        let seq = self.seq + 1;
        let copy = Geometry::copy_for_seq(seq);
        let a = g.block_align as usize;
        let mut pay = AlignedBuf::zeroed(round_up(len, g.block_align) as usize, a)?;
        pay.as_mut_slice()[..json.len()].copy_from_slice(&json);
        let mut hdr = AlignedBuf::zeroed(a, a)?;
        hdr.as_mut_slice().copy_from_slice(&CheckpointHeader::encode_for(seq, &json, a));
        Ok(Ok(PreparedCheckpoint { seq, copy, payload_len: len, snapshot: self.dirty_total, offset: g.container_offset(copy), block_align: g.block_align, pay, hdr }))
    }

    /// Books a prepared checkpoint once its writes completed: the seq is LMCache's from now
    /// on, and the changes its snapshot held are persisted.
    pub fn checkpoint_written(&mut self, p: PreparedCheckpoint) -> CheckpointOutcome {
        for (c, r) in p.reqs() {
            self.count_write(c, r.offset, r.data.len() as u64);
        }
        self.seq = p.seq;
        self.persisted = p.snapshot;
        self.total.checkpoints_written += 1;
        self.run.checkpoints_written += 1;
        CheckpointOutcome::Written { seq: p.seq, copy: p.copy, payload_len: p.payload_len }
    }

    // ---- verify -------------------------------------------------------------------------

    /// Reads every live slot back (header and payload) and compares it with what was put.
    /// Returns the number of entries checked and how many had their content generation
    /// inferred (recovered entries the history does not know).
    pub fn verify(&mut self, dev: &mut Device) -> Result<(u64, u64), String> {
        let g = self.geom;
        let a = g.block_align;
        let list: Vec<Entry> = self.entries.values().cloned().collect();
        let mut bad: Vec<String> = Vec::new();
        let mut nbad = 0u64;
        let mut inferred = 0u64;
        for chunk in list.chunks(MAX_URING_BATCH_KEYS) {
            let mut bufs = Vec::with_capacity(2 * chunk.len());
            for e in chunk {
                let off = g.slot_offset(e.slot);
                let plen = if dev.odirect { round_up(e.size, a) } else { e.size };
                bufs.push((off, AlignedBuf::zeroed(g.header_bytes as usize, a as usize)?));
                bufs.push((off + g.header_bytes, AlignedBuf::zeroed(plen as usize, a as usize)?));
            }
            {
                let mut reqs: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(o, b)| (*o, b.as_mut_slice())).collect();
                dev.read_group(&mut reqs)?;
            }
            for (i, e) in chunk.iter().enumerate() {
                let hdr = bufs[2 * i].1.as_slice();
                let pay = &bufs[2 * i + 1].1.as_slice()[..e.size as usize];
                let want_id = lmcache_identity(&e.key)?;
                let want_hdr = SlotHeader { identity: want_id, payload_len: e.size }.encode(g.header_bytes as usize);
                let problem = if hdr != want_hdr.as_slice() {
                    Some(match SlotHeader::parse(hdr) {
                        Err(_) => "slot header has no LMCBLK01 magic".to_string(),
                        Ok(h) if h.identity != want_id => {
                            format!("slot header identity {:#018x}, want {want_id:#018x}", h.identity)
                        }
                        Ok(h) if h.payload_len != e.size => {
                            format!("slot header payload_len {}, want {}", h.payload_len, e.size)
                        }
                        Ok(_) => "slot header has non-zero bytes after byte 24".to_string(),
                    })
                } else {
                    let (p, inf) = self.payload_problem(e, pay);
                    inferred += u64::from(inf);
                    p
                };
                if let Some(p) = problem {
                    nbad += 1;
                    if bad.len() < 5 {
                        bad.push(format!("slot {} key {}: {p}", e.slot, e.key));
                    }
                }
            }
        }
        let n = list.len() as u64;
        self.total.verified += n - nbad;
        self.run.verified += n - nbad;
        if nbad > 0 {
            return Err(format!("verify: {nbad} of {n} entries differ: {}", bad.join("; ")));
        }
        Ok((n, inferred))
    }

    /// Whether `pay` is the payload put for `e`: None when it is (and whether its content
    /// generation had to be inferred: a recovered entry the history does not know), else what
    /// differs.
    fn payload_problem(&self, e: &Entry, pay: &[u8]) -> (Option<String>, bool) {
        let mut want = vec![0u8; e.size as usize];
        let gens: Vec<u32> = match e.gen {
            Some(gn) => vec![gn],
            None => (0..16).collect(),
        };
        for gn in gens {
            fill_payload(self.opts.seed, &e.key, gn, &mut want);
            if want == pay {
                return (None, e.gen.is_none());
            }
        }
        let at = want.iter().zip(pay).position(|(x, y)| x != y).unwrap_or(0);
        let p = match e.gen {
            Some(gn) => format!("payload byte {at} of {} differs from content generation {gn}", e.size),
            None => format!("payload matches none of content generations 0..15 (first difference at byte {at} for generation 15)"),
        };
        (Some(p), false)
    }

    /// LMCache's `load_many_into` of `keys`: one read per key of its payload only
    /// (`payload_len` bytes at slot + header_bytes, rounded up to `block_align` with O_DIRECT;
    /// loads never read the header), checked against what was put. posix reads key by key,
    /// io_uring in batches of up to 64 keys. The keys are split into `workers` calls that run
    /// at once, as MP's load workers (`num_load_workers`, default 4) do. Returns the keys
    /// loaded.
    pub fn load(&mut self, dev: &mut Device, keys: &[String], workers: usize) -> Result<u64, String> {
        let list: Vec<Entry> = keys
            .iter()
            .map(|k| self.entry(k).cloned().ok_or_else(|| format!("load: key {k} is not indexed")))
            .collect::<Result<_, _>>()?;
        let threads = workers.clamp(1, list.len().max(1));
        let per = list.len().div_ceil(threads).max(1);
        let mut devs = (0..threads).map(|_| dev.worker()).collect::<Result<Vec<_>, _>>()?;
        let this = &*self;
        // Per thread: the problems found (at most 5 described), or the read error.
        let results: Vec<Result<(u64, Vec<String>), String>> = std::thread::scope(|sc| {
            let handles: Vec<_> = list
                .chunks(per)
                .zip(devs.iter_mut())
                .map(|(es, d)| sc.spawn(move || this.load_some(d, es)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a load worker panicked".into()))).collect()
        });
        let mut nbad = 0u64;
        let mut bad = Vec::new();
        for r in results {
            let (n, b) = r.map_err(|e| format!("load: {e}"))?;
            nbad += n;
            bad.extend(b);
        }
        bad.truncate(5);
        let n = list.len() as u64;
        self.total.loads += n - nbad;
        self.run.loads += n - nbad;
        if nbad > 0 {
            return Err(format!("load: {nbad} of {n} payloads differ: {}", bad.join("; ")));
        }
        Ok(n)
    }

    /// One load worker: reads and checks `list` on `d`, 64 keys at a time; the number of
    /// payloads that differ, and the first few described.
    fn load_some(&self, d: &mut Device, list: &[Entry]) -> Result<(u64, Vec<String>), String> {
        let g = self.geom;
        let a = g.block_align;
        let (mut nbad, mut bad) = (0u64, Vec::new());
        for chunk in list.chunks(MAX_URING_BATCH_KEYS) {
            let mut bufs: Vec<AlignedBuf> = chunk
                .iter()
                .map(|e| AlignedBuf::zeroed((if d.odirect { round_up(e.size, a) } else { e.size }) as usize, a as usize))
                .collect::<Result<_, _>>()?;
            let mut reqs: Vec<(u64, &mut [u8])> = bufs
                .iter_mut()
                .zip(chunk)
                .map(|(b, e)| (g.slot_offset(e.slot) + g.header_bytes, b.as_mut_slice()))
                .collect();
            d.read_group(&mut reqs)?;
            drop(reqs);
            for (e, b) in chunk.iter().zip(&bufs) {
                if let (Some(p), _) = self.payload_problem(e, &b.as_slice()[..e.size as usize]) {
                    nbad += 1;
                    if bad.len() < 5 {
                        bad.push(format!("slot {} key {}: {p}", e.slot, e.key));
                    }
                }
            }
        }
        Ok((nbad, bad))
    }

    // ---- recovery -----------------------------------------------------------------------

    fn reject_reason(&self, m: &CheckpointMeta) -> Option<String> {
        let g = &self.geom;
        if m.version != Some(1) {
            return Some(format!("checkpoint version {:?} is not 1", m.version));
        }
        if let Some(p) = &m.device_path {
            if *p != self.opts.device_path {
                return Some(format!(
                    "checkpoint device_path {p:?} differs from the configured {:?} (pass --device-path-string)",
                    self.opts.device_path
                ));
            }
        }
        for (name, got, want) in [
            ("block_align", m.block_align, g.block_align),
            ("header_bytes", m.header_bytes, g.header_bytes),
            ("slot_bytes", m.slot_bytes, g.slot_bytes),
            ("meta_total_bytes", m.meta_total_bytes, g.meta_total_bytes),
            ("meta_version", m.meta_version, u64::from(META_VERSION)),
        ] {
            if let Some(v) = got {
                if v != want {
                    return Some(format!("checkpoint {name} {v} differs from the configured {want}"));
                }
            }
        }
        if let Some(mm) = &m.meta_magic {
            if mm.as_bytes() != META_MAGIC {
                return Some(format!("checkpoint meta_magic {mm:?} is not LMCIDX01"));
            }
        }
        if let Some(n) = m.next_slot {
            if n > g.max_slots {
                return Some(format!("checkpoint next_slot {n} exceeds max_slots {}", g.max_slots));
            }
        }
        None
    }

    /// LMCache's loader: the newest valid checkpoint (seq, CRC), its JSON checked against the
    /// configuration, entries read as Python's dict holds them, filtered by position and size,
    /// every slot header verified (one that does not read drops its entry); the free set
    /// rebuilt ascending (highest hole reused first), dropped slots appended.
    pub fn reopen(&mut self, dev: &mut Device) -> Result<ReopenReport, String> {
        let before: Vec<(String, u64, u64)> = self.entries.values().map(|e| (e.key.clone(), e.slot, e.size)).collect();
        self.clear_index();
        self.total.reopens += 1;
        self.run.reopens += 1;
        let mut rep = ReopenReport::default();
        let g = self.geom;
        let copies = read_copies(&*dev, &g).map_err(|e| format!("reading the checkpoint containers: {e}"))?;
        let Some(newest) = newest_valid(&copies).cloned() else {
            rep.rejected = Some("no valid checkpoint on the device".into());
            rep.matches_previous = before.is_empty();
            self.last_reopen = Some(rep.clone());
            return Ok(rep);
        };
        // As Python's dict: a repeated key keeps its first position and takes its last value.
        let mut listed: Vec<(String, Option<u64>, Option<u64>)> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        let meta = match read_entries(&*dev, &g, &newest, &JsonLimits::default(), &mut |e| {
            match at.get(e.key) {
                Some(&i) => listed[i] = (e.key.to_string(), e.offset, e.size),
                None => {
                    at.insert(e.key.to_string(), listed.len());
                    listed.push((e.key.to_string(), e.offset, e.size));
                }
            }
            Ok(())
        }) {
            Ok(m) => m,
            Err(e) => {
                rep.rejected = Some(format!("checkpoint seq {:?}: {e}", newest.seq()));
                rep.matches_previous = before.is_empty();
                self.last_reopen = Some(rep.clone());
                return Ok(rep);
            }
        };
        if let Some(r) = self.reject_reason(&meta) {
            rep.rejected = Some(r);
            rep.matches_previous = before.is_empty();
            self.last_reopen = Some(rep.clone());
            return Ok(rep);
        }
        // The entries' other fields (shape, dtype, fmt, cached_positions), kept as loaded.
        let plen = newest.payload_len().unwrap_or(0);
        let mut raw = vec![0u8; plen as usize];
        dev.read_exact_at(&mut raw, newest.payload_offset(&g)).map_err(|e| format!("reading checkpoint JSON: {e}"))?;
        let doc: Value = serde_json::from_slice(&raw).map_err(|e| format!("checkpoint JSON: {e}"))?;
        let objs = doc.get("entries").and_then(Value::as_object);
        let next_slot = meta.next_slot.unwrap_or(0);
        let cap = g.slot_payload_capacity();
        let base = g.data_base_offset();
        let mut kept: Vec<(String, u64, u64)> = Vec::new();
        for (key, off, size) in listed {
            // Of two `entries` members Python keeps the last: a key only the first lists is gone.
            if objs.is_some_and(|m| !m.contains_key(&key)) {
                continue;
            }
            let (Some(off), Some(size)) = (off, size) else {
                rep.skipped += 1;
                continue;
            };
            if off < base
                || !(off - base).is_multiple_of(g.slot_bytes)
                || (off - base) / g.slot_bytes >= g.max_slots
                || size == 0
                || size > cap
            {
                rep.skipped += 1;
                continue;
            }
            kept.push((key, (off - base) / g.slot_bytes, size));
        }
        let used: HashSet<u64> = kept.iter().map(|k| k.1).collect();
        self.next_slot = next_slot;
        for s in 0..next_slot {
            if !used.contains(&s) {
                self.free_slot(s);
            }
        }
        // Header validation (meta_verify_on_load), in batches like the io_uring loader.
        let a = g.block_align as usize;
        let mut dropped_slots = Vec::new();
        let mut good = Vec::with_capacity(kept.len());
        for chunk in kept.chunks(crate::dev::RING_ENTRIES as usize) {
            let mut bufs = Vec::with_capacity(chunk.len());
            for k in chunk {
                bufs.push((g.slot_offset(k.1), AlignedBuf::zeroed(g.header_bytes as usize, a)?));
            }
            let read_ok = {
                let mut reqs: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(o, b)| (*o, b.as_mut_slice())).collect();
                dev.read_group(&mut reqs)
            };
            // A failed batch is read again one header at a time; an entry whose header does
            // not read is dropped, as LMCache drops it, and the reopen goes on.
            let mut unread = vec![false; bufs.len()];
            // (A failed group has all its completions reaped: a ring that cannot complete one
            // ends the process, `dev::ring_failed`.)
            if read_ok.is_err() {
                for ((o, b), u) in bufs.iter_mut().zip(&mut unread) {
                    *u = dev.read_group(&mut [(*o, b.as_mut_slice())]).is_err();
                }
            }
            for ((k, (_, b)), u) in chunk.iter().zip(&bufs).zip(unread) {
                let ok = !u && match (SlotHeader::parse(b.as_slice()), lmcache_identity(&k.0)) {
                    (Ok(h), Ok(id)) => h.identity == id && h.payload_len == k.2,
                    _ => false,
                };
                if ok {
                    good.push(k.clone());
                } else {
                    dropped_slots.push(k.1);
                }
            }
        }
        rep.dropped = dropped_slots.len() as u64;
        for s in dropped_slots {
            self.free_slot(s);
        }
        for (key, slot, size) in good {
            let fields = objs.and_then(|m| m.get(&key));
            let gen = self.history.get(&key).copied();
            self.insert_entry(Entry::with_fields(key, slot, size, fields, gen));
        }
        // Deleted-key bookkeeping follows the recovered index.
        let live: HashSet<String> = self.entries.values().map(|e| e.key.clone()).collect();
        self.deleted.retain(|k| !live.contains(k));
        self.seq = newest.seq().unwrap_or(0);
        if rep.dropped > 0 {
            self.dirty_total = 1;
        }
        rep.seq = Some(self.seq);
        rep.recovered = self.live() as u64;
        self.total.recovered += rep.recovered;
        self.run.recovered += rep.recovered;
        self.total.recovery_dropped += rep.dropped;
        self.run.recovery_dropped += rep.dropped;
        let after: Vec<(String, u64, u64)> = self.entries.values().map(|e| (e.key.clone(), e.slot, e.size)).collect();
        let mut b = before;
        let mut c = after;
        b.sort();
        c.sort();
        rep.matches_previous = b == c;
        self.last_reopen = Some(rep.clone());
        Ok(rep)
    }

    pub fn count_sync(&mut self) {
        self.total.syncs += 1;
        self.run.syncs += 1;
    }

    // ---- reports and state --------------------------------------------------------------

    pub fn stats_json(&self, engine: Engine, odirect: bool) -> Value {
        json!({
            "engine": engine.name(),
            "odirect": odirect,
            "index": {
                "live": self.live(), "next_slot": self.next_slot, "free_slots": self.free.len(),
                "max_slots": self.geom.max_slots, "seq": self.seq, "dirty": self.is_dirty(),
                "reopen_matches_previous": self.last_reopen.as_ref().map(|r| r.matches_previous),
            },
            "run": self.run.to_json(),
            "total": self.total.to_json(),
        })
    }

    pub fn to_state(&self) -> Value {
        let g = self.geom.config();
        json!({
            "format": "rawblock-writer-state",
            "version": 1,
            "geometry": {"block_align": g.block_align, "header_bytes": g.header_bytes, "slot_bytes": g.slot_bytes,
                         "meta_total_bytes": g.meta_total_bytes, "capacity_bytes": g.capacity_bytes},
            "seed": self.opts.seed,
            "device_path": self.opts.device_path,
            "next_key": self.next_key, "put_counter": self.put_counter, "rng": self.rng,
            "next_slot": self.next_slot, "seq": self.seq, "dirty_total": self.dirty_total, "persisted": self.persisted,
            "free": self.free,
            "entries": self.entries.values().map(|e| json!({
                "key": e.key, "slot": e.slot, "size": e.size, "shape": e.shape, "dtype": e.dtype,
                "fmt": e.fmt, "cached_positions": e.cached_positions, "gen": e.gen,
            })).collect::<Vec<_>>(),
            "history": self.history.iter().map(|(k, g)| (k.clone(), json!(g))).collect::<serde_json::Map<_, _>>(),
            "deleted": self.deleted,
            "totals": self.total.to_json(),
        })
    }

    /// Restores a writer from `to_state` output; the geometry and seed must match.
    pub fn from_state(v: &Value, geom: Geometry, opts: Options) -> Result<Writer, String> {
        if v.get("format").and_then(Value::as_str) != Some("rawblock-writer-state")
            || v.get("version").and_then(Value::as_u64) != Some(1)
        {
            return Err("not a rawblock-writer state file (format/version)".into());
        }
        let gv = v.get("geometry").ok_or("state has no geometry")?;
        let gc = GeometryConfig {
            block_align: gv.get("block_align").and_then(Value::as_u64).unwrap_or(0),
            header_bytes: gv.get("header_bytes").and_then(Value::as_u64).unwrap_or(0),
            slot_bytes: gv.get("slot_bytes").and_then(Value::as_u64).unwrap_or(0),
            meta_total_bytes: gv.get("meta_total_bytes").and_then(Value::as_u64).unwrap_or(0),
            capacity_bytes: gv.get("capacity_bytes").and_then(Value::as_u64).unwrap_or(0),
        };
        let mine = geom.config();
        if (gc.block_align, gc.header_bytes, gc.slot_bytes, gc.meta_total_bytes)
            != (mine.block_align, mine.header_bytes, mine.slot_bytes, mine.meta_total_bytes)
        {
            return Err(format!(
                "it was written for block_align {} header_bytes {} slot_bytes {} meta_total_bytes {}, not {} {} {} {}",
                gc.block_align,
                gc.header_bytes,
                gc.slot_bytes,
                gc.meta_total_bytes,
                mine.block_align,
                mine.header_bytes,
                mine.slot_bytes,
                mine.meta_total_bytes
            ));
        }
        let seed = v.get("seed").and_then(Value::as_u64).ok_or("state has no seed")?;
        if seed != opts.seed {
            return Err(format!("it was written with --seed {seed}, not {}", opts.seed));
        }
        let u = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| format!("state lacks \"{k}\""));
        let mut w = Writer::new(geom, opts);
        w.next_key = u("next_key")?;
        w.put_counter = u("put_counter")?;
        w.rng = u("rng")?;
        w.next_slot = u("next_slot")?;
        w.seq = u("seq")?;
        w.dirty_total = u("dirty_total")?;
        w.persisted = u("persisted")?;
        if w.next_slot > geom.max_slots {
            return Err(format!("its next_slot {} exceeds this device's {} slots", w.next_slot, geom.max_slots));
        }
        for s in v.get("free").and_then(Value::as_array).ok_or("state lacks \"free\"")? {
            let s = s.as_u64().filter(|&s| s < geom.max_slots).ok_or("state has a bad free slot")?;
            w.free_slot(s);
        }
        for e in v.get("entries").and_then(Value::as_array).ok_or("state lacks \"entries\"")? {
            let key = e.get("key").and_then(Value::as_str).ok_or("state entry without key")?.to_string();
            let slot = e
                .get("slot")
                .and_then(Value::as_u64)
                .filter(|&s| s < geom.max_slots)
                .ok_or("state entry with a bad slot")?;
            let size = e
                .get("size")
                .and_then(Value::as_u64)
                .filter(|&s| s > 0 && s <= geom.slot_payload_capacity())
                .ok_or("state entry with a bad size")?;
            let gen = e.get("gen").and_then(Value::as_u64).map(|g| g as u32);
            w.insert_entry(Entry::with_fields(key, slot, size, Some(e), gen));
        }
        if let Some(h) = v.get("history").and_then(Value::as_object) {
            for (k, g) in h {
                if let Some(g) = g.as_u64() {
                    w.history.insert(k.clone(), g as u32);
                }
            }
        }
        if let Some(d) = v.get("deleted").and_then(Value::as_array) {
            w.deleted = d.iter().filter_map(|k| k.as_str().map(String::from)).collect();
        }
        if let Some(t) = v.get("totals") {
            w.total = Counters::from_json(t);
        }
        Ok(w)
    }
}
