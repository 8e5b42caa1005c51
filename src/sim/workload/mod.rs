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
//! Files: `spec` (the workload file), `keys` (LMCache's key strings and identities), `io` (the
//! `IoShaper`), `l1` (the MP server's CPU tier); the model itself is here.
//!
//! Facts: `../shared/reference/lmcache-raw-block.md` §2–9 (layout, allocator, I/O paths,
//! cadence), §11 (JSON entry sizes), §14 (built-in FDP); LMCache's eviction controller
//! (`storage_controllers/eviction_controller.py`: every second, usage ≥ watermark → evict
//! `eviction_ratio` of the tracked keys in LRU order; per-salt quotas with IsolatedLRU).
//!
//! Simplifications (stated in `docs/waf.md`): requests are served one at a time; simulated time
//! advances with the bytes written at `write_rate_mb_s`; an MP server's L1 (CPU) cache in front
//! of L2 is there only with `l1_share` (`l1`); without it every hit is an L2 load that
//! refreshes the key's LRU position.

use super::SplitMix64;
use crate::cli::parse_size;
use crate::layout::keys::{salt_bucket, salt_bucket_id};
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::layout::{Geometry, GeometryConfig};
use serde_json::Value;
use std::collections::HashMap;

const NONE: u32 = u32::MAX;

mod io;
mod keys;
mod l1;
mod spec;

pub use io::*;
pub use keys::*;
pub use spec::*;

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
    /// Of the hits, those L1 served (no device read).
    pub l1_hits: u64,
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
    /// Puts of a key into the very slot that a committed checkpoint in either container still
    /// lists for that key (the key was deleted and put again, and the allocator handed it the
    /// same slot): the precondition of the case the early-tail rule guards against.
    pub reputs_listed: u64,
    /// Of those, the ones where a put in between left the slot with a shorter payload than the
    /// listed one: a stale tail that fdpblk could have deallocated early lay under the key's
    /// listed payload (an upper bound: a longer put since may have covered that tail again).
    pub reputs_listed_over_tail: u64,
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
    /// A free stack longer than this is compacted (twice the slots and some).
    compact_over: usize,
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
    /// The server's CPU tier (MP, `l1_share` > 0), and one request's keys for it.
    l1: l1::L1,
    l1_keys: Vec<u64>,
    ops: Vec<LmOpOwned>,
    /// Per container (seq 1 in container 0), what its committed checkpoint lists in each slot,
    /// for `WorkloadStats::reputs_listed`.
    listed: [Vec<Listed>; 2],
}

/// A slot as a committed checkpoint lists it (`identity` 0: not listed), and whether a put
/// since left the slot with a shorter payload.
#[derive(Clone, Copy, Debug, Default)]
struct Listed {
    identity: u64,
    payload_len: u64,
    shorter_since: bool,
}

/// `LmOp` without the borrowed checkpoint list (queued inside `step`).
#[derive(Clone, Debug)]
enum LmOpOwned {
    Put { slot: u64, identity: u64, payload_len: u64, tenant: u32, pid: Option<u16>, popularity: f64 },
    Load { slot: u64, payload_len: u64 },
    Delete { slot: u64 },
    /// `snap`: this checkpoint's entries and JSON, where a later checkpoint of the same
    /// request took `entries` and `json` (a request writing for longer than a checkpoint
    /// interval); else they are still there.
    Checkpoint { seq: u64, json_bytes: u64, snap: Option<Box<(Vec<LiveEntry>, Vec<u8>)>> },
    Tick { now_s: f64 },
}

/// The most documents of all tenants together (popularity tables of 8 bytes each: 1 GiB).
const MAX_DOCS: u64 = 1 << 27;

/// The workload model's tables: about 128 bytes per slot (its record, the two containers'
/// listings, the index), 8 per document and 48 per L1 entry (its node and map entry); and
/// `copies` of the checkpoint snapshot (the live entries, 24 bytes each, and the JSON, at most
/// 512 bytes an entry and never past `json_cap`, the container's payload: the one the model
/// builds, and one kept for each earlier checkpoint of the same request), against `budget`.
fn workload_fits(slots: u64, docs: u64, l1: u64, copies: u64, json_cap: u64, budget: Option<u64>) -> Result<(), String> {
    let snapshot = slots.saturating_mul(24).saturating_add(slots.saturating_mul(512).min(json_cap));
    let need = slots
        .saturating_mul(128)
        .saturating_add(docs.saturating_mul(8))
        .saturating_add(l1.saturating_mul(48))
        .saturating_add(copies.saturating_mul(snapshot));
    crate::sim::memory::check(
        &format!("the workload model of {slots} slots"),
        need,
        budget,
        "raise \"slot_bytes\" or simulate a smaller device (--device-size)",
    )
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
        // Each tenant's documents get a popularity table (8 bytes each): bounded before any
        // is built, so that a large universe over small slots is an error, not an abort.
        let docs_of = |t: &spec::TenantSpec| -> f64 {
            let mean_doc = f64::from(t.doc_chunks_min + t.doc_chunks_max) / 2.0;
            if t.doc_chunks_max == 0 { 1.0 } else { ((t.universe * slots_n as f64) / mean_doc.max(1.0)).ceil().max(1.0) }
        };
        let all_docs: f64 = spec.tenants.iter().map(docs_of).sum();
        if all_docs > MAX_DOCS as f64 {
            return err(format!(
                "the tenants' \"universe\" makes {all_docs:.0} documents over {slots_n} slots, more than the {MAX_DOCS} the model holds in memory; lower \"universe\", raise \"doc_chunks\" or \"slot_bytes\", or simulate a smaller device (--device-size)"
            ));
        }
        let l1_entries = (spec.l1_share * slots_n as f64).round() as u64;
        // A request's snapshots: one per checkpoint tick its writes span (the last is the
        // model's own), kept until it ends.
        let copies = spec.checkpoints_per_request_at_most();
        workload_fits(slots_n, all_docs as u64, l1_entries, copies, geometry.payload_cap(), crate::sim::memory::budget())?;
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
            let docs = docs_of(t) as u64;
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
            compact_over: 2 * slots_n as usize + 1024,
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
            l1: l1::L1::new(l1_entries as usize),
            l1_keys: Vec::new(),
            ops: Vec::new(),
            listed: [vec![Listed::default(); slots_n as usize], vec![Listed::default(); slots_n as usize]],
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

    /// Moves one request's keys (`new_keys`, in chunk order) to the MRU end with `push`, in
    /// the order of `lru_insert`.
    fn lru_push_request(&mut self, push: impl Fn(&mut Self, u32)) {
        let keys = std::mem::take(&mut self.new_keys);
        if self.spec.lru_insert_reversed {
            keys.iter().rev().for_each(|&s| push(self, s));
        } else {
            keys.iter().for_each(|&s| push(self, s));
        }
        self.new_keys = keys;
    }

    /// The same for the L1 keys of one request (`l1_keys`, in chunk order).
    fn l1_push_request(&mut self, push: impl Fn(&mut l1::L1, u64)) {
        if self.spec.lru_insert_reversed {
            self.l1_keys.iter().rev().for_each(|&k| push(&mut self.l1, k));
        } else {
            self.l1_keys.iter().for_each(|&k| push(&mut self.l1, k));
        }
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
        self.compact_free_stacks();
        self.dirty += 1;
        self.stats.deletes += 1;
        self.ops.push(LmOpOwned::Delete { slot: u64::from(s) });
    }

    /// Under pid_affinity a slot taken from one stack stays stale in the other (and one freed
    /// again is pushed again): drops what `alloc` would skip once a stack outgrows twice the
    /// slots, so the stacks stay bounded whatever the run's length. Allocation is unchanged:
    /// an entry below a newer one of its slot, or of a slot not free (or, per placement id,
    /// last written with another id), is never the one `alloc` takes.
    fn compact_free_stacks(&mut self) {
        let limit = self.compact_over;
        let (is_free, slots) = (&self.is_free, &self.slots);
        let mut seen = Vec::new();
        if self.free.len() > limit {
            compact_stack(&mut self.free, &mut seen, |s| is_free[s as usize]);
        }
        for (pid, stack) in self.free_by_pid.iter_mut().enumerate() {
            if stack.len() > limit {
                compact_stack(stack, &mut seen, |s| is_free[s as usize] && usize::from(slots[s as usize].pid) == pid);
            }
        }
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
        // The snapshot below reuses `entries` and `json`: a checkpoint of this request not yet
        // emitted keeps its own.
        if let Some(LmOpOwned::Checkpoint { snap: snap @ None, .. }) = self.ops.iter_mut().rev().find(|o| matches!(o, LmOpOwned::Checkpoint { .. })) {
            *snap = Some(Box::new((self.entries.clone(), self.json.clone())));
        }
        let json_bytes = self.snapshot(self.geometry.payload_cap());
        if json_bytes > self.geometry.payload_cap() {
            // LMCache logs "payload too large" and writes nothing; it stays dirty (§11).
            self.stats.checkpoints_overflow += 1;
            return;
        }
        self.seq += 1;
        let c = ((self.seq - 1) % 2) as usize;
        self.listed[c].fill(Listed::default());
        for e in &self.entries {
            let r = &self.slots[e.slot as usize];
            self.listed[c][e.slot as usize] = Listed { identity: r.identity, payload_len: r.payload_len, shorter_since: false };
        }
        self.persisted_dirty = self.dirty;
        self.stats.checkpoints += 1;
        self.stats.checkpoint_bytes += json_bytes;
        self.stats.checkpoint_max_bytes = self.stats.checkpoint_max_bytes.max(json_bytes);
        self.ops.push(LmOpOwned::Checkpoint { seq: self.seq, json_bytes, snap: None });
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
        // Lookup: the longest prefix cached in L1 or L2; L1 serves what it holds, the rest is
        // loaded from the device. The loads done, LMCache's LRU refreshes their keys in the
        // order it adds keys (`on_keys_touched`, `on_keys_created`); L1's hits refresh only L1.
        let mut i = 0;
        self.new_keys.clear();
        self.l1_keys.clear();
        while i < chunks.len() {
            let id = chunks[i].0;
            if self.l1.contains(id) {
                self.stats.hits += 1;
                self.stats.l1_hits += 1;
                self.l1_keys.push(id);
                i += 1;
                continue;
            }
            let Some(&s) = self.index.get(&id) else { break };
            let pl = self.slots[s as usize].payload_len;
            self.stats.hits += 1;
            self.stats.loads += 1;
            self.ops.push(LmOpOwned::Load { slot: u64::from(s), payload_len: pl });
            self.new_keys.push(s);
            i += 1;
        }
        self.lru_push_request(|w, s| w.touch(s));
        // L1's own LRU takes them in the same order.
        self.l1_push_request(|l1, k| l1.touch(k));
        if self.spec.remove_after_read {
            for c in &chunks[..i] {
                if let Some(&s) = self.index.get(&c.0) {
                    self.delete(s);
                }
            }
        }
        // Store the rest: present keys are no-ops (LMCache's `put_many` skips them without
        // telling its LRU), missing ones are put.
        let pid = self.pid_for(t);
        self.new_keys.clear();
        self.l1_keys.clear();
        let mut written = 0;
        for &(identity, payload_len, popularity) in &chunks[i..] {
            // A chunk L1 holds is not written again, so not copied to L2 either; where L1
            // is, every other chunk is written there first.
            if self.l1.contains(identity) {
                continue;
            }
            self.l1_keys.push(identity);
            if self.index.contains_key(&identity) {
                self.stats.puts_noop += 1;
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
            // Once per put, whether one container lists the key here or both do.
            let (mut listed, mut over_tail) = (false, false);
            for c in 0..2 {
                let l = &mut self.listed[c][s as usize];
                if l.identity != 0 && l.identity == identity {
                    listed = true;
                    over_tail |= l.shorter_since;
                }
                if self.geometry.payload_end(payload_len) < self.geometry.payload_end(l.payload_len) {
                    l.shorter_since = true;
                }
            }
            self.stats.reputs_listed += u64::from(listed);
            self.stats.reputs_listed_over_tail += u64::from(over_tail);
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
            self.lru_push_request(|w, s| w.lru_push_mru(s));
        }
        self.l1_push_request(|l1, k| {
            l1.insert(k);
        });
        self.chunk_buf = chunks;
        self.advance(written);
        // Emit, building the checkpoint list when one was committed.
        let ops = std::mem::take(&mut self.ops);
        for op in &ops {
            match op {
                &LmOpOwned::Put { slot, identity, payload_len, tenant, pid, popularity } => {
                    sink(&LmOp::Put { slot, identity, payload_len, tenant, pid, popularity })
                }
                &LmOpOwned::Load { slot, payload_len } => sink(&LmOp::Load { slot, payload_len }),
                &LmOpOwned::Delete { slot } => sink(&LmOp::Delete { slot }),
                &LmOpOwned::Tick { now_s } => sink(&LmOp::Tick { now_s }),
                LmOpOwned::Checkpoint { seq, json_bytes, snap } => {
                    let (entries, json) = match snap {
                        Some(s) => (&s.0, &s.1),
                        None => (&self.entries, &self.json),
                    };
                    let j = self.emit_json.then_some(&json[..]);
                    sink(&LmOp::Checkpoint { seq: *seq, json_bytes: *json_bytes, entries, json: j });
                }
            }
        }
        self.ops = ops;
    }

    /// The live entries (into `self.entries`) and the checkpoint JSON's size (exact: the
    /// compact encoding's length, predicted per entry); with `emit_json` and a JSON no larger
    /// than `cap`, the JSON itself (into `self.json`, compact like `json.dumps` with
    /// `separators=(",", ":")`). One past the cap is never built: LMCache writes nothing then,
    /// and a device's worth of entries would take hundreds of MB at every tick.
    fn snapshot(&mut self, cap: u64) -> u64 {
        use std::io::Write as _;
        self.entries.clear();
        let g = self.geometry;
        let mut bytes = self.spec.json_fixed_bytes(&g, self.next_slot);
        for (s, r) in self.slots.iter().enumerate() {
            if !r.live {
                continue;
            }
            let t = r.tenant as usize;
            let key_len = self.spec.key_len_of(self.tenants[t].key_len, r.id);
            bytes += self.spec.entry_json_bytes(key_len, g.slot_offset(s as u64), r.payload_len);
            self.entries.push(LiveEntry { slot: s as u64, identity: r.identity, salt_bucket: self.tenants[t].salt_bucket });
        }
        if !self.entries.is_empty() {
            bytes -= 1; // no comma after the last entry
        }
        let mut json = std::mem::take(&mut self.json);
        json.clear();
        if self.emit_json && bytes <= cap {
            json.extend_from_slice(json_head(&g, self.next_slot).as_bytes());
            let mut key = std::mem::take(&mut self.key_buf);
            for (n, e) in self.entries.iter().enumerate() {
                let r = &self.slots[e.slot as usize];
                let salt = &self.tenants[r.tenant as usize].spec.salt;
                key_string(self.spec.mode, &self.quoted_model, self.spec.chunk_hash_bytes, salt, r.id, &mut key);
                if n > 0 {
                    json.push(b',');
                }
                let _ = write!(
                    json,
                    r#""{key}":{{"offset":{},"size":{},"shape":[2,32,256,1024],"dtype":"bfloat16","fmt":"KV_2LTD","cached_positions":null}}"#,
                    g.slot_offset(e.slot),
                    r.payload_len
                );
            }
            self.key_buf = key;
            json.extend_from_slice(b"}}");
            debug_assert_eq!(json.len() as u64, bytes, "the predicted JSON size");
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


/// Keeps, in order, the topmost entry of each slot that `live` accepts (`seen`: scratch).
fn compact_stack(stack: &mut Vec<u32>, seen: &mut Vec<bool>, live: impl Fn(u32) -> bool) {
    let top = stack.iter().copied().max().map_or(0, |m| m as usize + 1);
    seen.clear();
    seen.resize(top, false);
    let mut kept: Vec<u32> = stack.iter().rev().copied().filter(|&s| live(s) && !std::mem::replace(&mut seen[s as usize], true)).collect();
    kept.reverse();
    *stack = kept;
}

#[cfg(test)]
mod tests;
