//! Placement policies: which reclaim unit handle each piece of LMCache's layout goes to.
//!
//! A policy sees one placement question at a time and answers with a logical handle
//! (`0..handles()`); the engine maps logical handles to the drive's placement identifiers.
//! Slot payload bytes never ask: the pipeline sends them to the handle their header got.

use crate::layout::slot_header::SlotHeader;
use crate::slot_table::{SlotEntry, SlotTable};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Logical placement handle: an index into the drive's reclaim unit handle status list.
pub type Handle = u16;

/// The handle that writes without a placement directive land on.
pub const DEFAULT_HANDLE: Handle = 0;

/// What is being placed.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// A checkpoint container (header or JSON payload) of copy 0 or 1.
    Checkpoint { copy: u8 },
    /// A slot whose header is being written (`header` is the new one when it was parsed),
    /// with the slot's record from before this write.
    Slot { slot: u64, header: Option<&'a SlotHeader>, previous: Option<&'a SlotEntry> },
    /// Bytes outside LMCache's layout (the metadata gap, the tail, foreign writers).
    Outside,
    /// fdpblk's own persistent state.
    OwnState,
}

/// A live entry of a committed checkpoint, as fdpblk learns it from the checkpoint JSON: the
/// slot (from `offset`), the identity (recomputed from the key string) and the tenant tag (the
/// key's cache_salt, interned; 0 when the key has none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveEntry {
    pub slot: u64,
    pub identity: u64,
    pub tenant_tag: u32,
}

/// What a policy may learn besides the placement questions. The pipeline asks `place`; the
/// frontend, the checkpoint reader and the simulator report these through `observe`.
#[derive(Clone, Copy, Debug)]
pub enum Observation<'a> {
    /// A read of `len` bytes of a slot (LMCache's loads read the payload, never the header).
    Read { slot: u64, len: u64 },
    /// A committed checkpoint (`seq`) with every live entry.
    Checkpoint { seq: u64, entries: &'a [LiveEntry] },
    /// The placement id the writer itself chose for its next write to `slot`. Only LMCache's
    /// own FDP mode has one (the simulator's emulation of it passes it); a block device never
    /// sees it.
    WriterPlacement { slot: u64, pid: Handle },
    /// Wall-clock (or simulated) seconds since start.
    Time { now_s: f64 },
    /// At start, from fdpblk's own state: `slot` holds `identity`, whose current contents were
    /// loaded `reads` times (what the policy saw before a restart, as far as the slot table
    /// keeps it).
    Resident { slot: u64, identity: u64, reads: u8 },
}

pub trait Policy: Send {
    fn name(&self) -> &'static str;
    /// Number of logical handles the policy uses; the drive must offer at least this many.
    fn handles(&self) -> u16;
    fn place(&mut self, target: &Target<'_>) -> Handle;
    /// Side information (default: ignored).
    fn observe(&mut self, _event: &Observation<'_>) {}
    /// Whether the policy keeps a history of its own (key-aware's loads per identity). fdpblk's
    /// own state keeps only what the slot table holds: at start such a policy gets every
    /// resident slot as `Observation::Resident` ([`SharedPolicy::resume`]); loads of identities
    /// no slot holds any more are not kept and are learnt again.
    fn needs_state(&self) -> bool {
        false
    }
    /// Whether the policy wants `Observation::Checkpoint` (every live entry of each committed
    /// checkpoint: costs the state thread a key hash per entry).
    fn observes_checkpoints(&self) -> bool {
        false
    }
}

/// Everything on the default handle: what a drive sees without fdpblk.
#[derive(Debug, Default)]
pub struct NonePolicy;

impl Policy for NonePolicy {
    fn name(&self) -> &'static str {
        "none"
    }
    fn handles(&self) -> u16 {
        1
    }
    fn place(&mut self, _target: &Target<'_>) -> Handle {
        DEFAULT_HANDLE
    }
}

/// Separates by region: checkpoints (rewritten whole every minute) apart from slot data,
/// and fdpblk's own state apart from both.
#[derive(Debug, Default)]
pub struct RegionPolicy;

impl RegionPolicy {
    pub const OUTSIDE: Handle = 0;
    pub const CHECKPOINT: Handle = 1;
    pub const SLOTS: Handle = 2;
    pub const OWN_STATE: Handle = 3;
}

impl Policy for RegionPolicy {
    fn name(&self) -> &'static str {
        "region"
    }
    fn handles(&self) -> u16 {
        4
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        match target {
            Target::Checkpoint { .. } => Self::CHECKPOINT,
            Target::Slot { .. } => Self::SLOTS,
            Target::Outside => Self::OUTSIDE,
            Target::OwnState => Self::OWN_STATE,
        }
    }
}

/// A policy shared between the pipeline that asks it and an observer on another path (the
/// simulator; the checkpoint reader): both hold a clone.
#[derive(Clone)]
pub struct SharedPolicy {
    inner: Arc<Mutex<Box<dyn Policy>>>,
    name: &'static str,
    handles: u16,
    needs_state: bool,
    observes_checkpoints: bool,
}

impl SharedPolicy {
    pub fn new(p: Box<dyn Policy>) -> Self {
        let (name, handles, needs_state, observes_checkpoints) = (p.name(), p.handles(), p.needs_state(), p.observes_checkpoints());
        SharedPolicy { inner: Arc::new(Mutex::new(p)), name, handles, needs_state, observes_checkpoints }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Box<dyn Policy>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells a policy that keeps history (`needs_state`) what each slot of a slot table
    /// restored from fdpblk's own state holds, before the device serves I/O. Returns the
    /// slots reported.
    pub fn resume(&self, slots: &SlotTable) -> u64 {
        if !self.needs_state {
            return 0;
        }
        let mut p = self.lock();
        let mut n = 0;
        for slot in 0..slots.len() as u64 {
            if let Some(e) = slots.get(slot) {
                p.observe(&Observation::Resident { slot, identity: e.identity, reads: e.reads });
                n += 1;
            }
        }
        n
    }
}

impl Policy for SharedPolicy {
    fn name(&self) -> &'static str {
        self.name
    }
    fn handles(&self) -> u16 {
        self.handles
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        self.lock().place(target)
    }
    fn observe(&mut self, event: &Observation<'_>) {
        self.lock().observe(event)
    }
    fn needs_state(&self) -> bool {
        self.needs_state
    }
    fn observes_checkpoints(&self) -> bool {
        self.observes_checkpoints
    }
}

/// Tenant tags of the identities in the newest committed checkpoints (what fdpblk can know of
/// a key's tenant: only once a checkpoint listed it). Bounded by the live entries of the last
/// `keep` checkpoints' worth of identities; older ones are forgotten in bulk.
#[derive(Debug, Default)]
pub struct TenantBook {
    current: HashMap<u64, u32>,
    previous: HashMap<u64, u32>,
}

impl TenantBook {
    pub fn learn(&mut self, entries: &[LiveEntry]) {
        // Two generations: identities of the last two checkpoints are remembered, so a key
        // evicted after one checkpoint is still known when it returns.
        if self.current.len() > 2 * entries.len().max(1024) {
            self.previous = std::mem::take(&mut self.current);
        }
        for e in entries {
            if e.tenant_tag != 0 {
                self.current.insert(e.identity, e.tenant_tag);
            }
        }
    }
    pub fn tenant(&self, identity: u64) -> Option<u32> {
        self.current.get(&identity).or_else(|| self.previous.get(&identity)).copied()
    }
}

/// An emulation of LMCache 0.5.6's built-in FDP mode (`fdp_data_placement_policy =
/// cache_salt_prefix`, `meta_checkpoint_placement_id` set, `fdp_slot_reuse_policy =
/// pid_affinity`; reference §14), for comparison. Handle 0 is "no directive", handle 1 the
/// checkpoint id, handles 2.. the data ids that cache_salt buckets take first come, first
/// served; LMCache never deallocates.
///
/// LMCache knows each key's salt when it writes. In the simulator the workload model plays
/// LMCache in FDP mode (it also reuses slots with pid affinity) and passes each write's id as
/// `Observation::WriterPlacement`. Under `fdpblk add` no such id reaches the block device: the
/// emulation then places a returning identity by the tenant (model and cache_salt) a committed
/// checkpoint taught it (fdpblk's state thread passes each one on), and anything else on
/// handle 0.
#[derive(Debug)]
pub struct LmcacheFdpPolicy {
    pending: Option<(u64, Handle)>,
    tenants: TenantBook,
    bucket_handle: HashMap<u32, Handle>,
}

impl LmcacheFdpPolicy {
    pub const NO_DIRECTIVE: Handle = 0;
    pub const CHECKPOINT: Handle = 1;
    pub const FIRST_DATA: Handle = 2;
    pub const HANDLES: u16 = 8;

    pub fn new() -> Self {
        LmcacheFdpPolicy { pending: None, tenants: TenantBook::default(), bucket_handle: HashMap::new() }
    }

    /// The data placement ids LMCache's default list gives buckets, in order.
    pub fn data_handles() -> Vec<Handle> {
        (Self::FIRST_DATA..Self::HANDLES).collect()
    }
}

impl Default for LmcacheFdpPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy for LmcacheFdpPolicy {
    fn name(&self) -> &'static str {
        "lmcache-fdp"
    }
    fn handles(&self) -> u16 {
        Self::HANDLES
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        match target {
            Target::Checkpoint { .. } => Self::CHECKPOINT,
            Target::Slot { slot, header, previous } => {
                if let Some((s, pid)) = self.pending {
                    if s == *slot {
                        return pid;
                    }
                }
                if let Some(h) = header {
                    if let Some(t) = self.tenants.tenant(h.identity) {
                        let next = Self::FIRST_DATA + self.bucket_handle.len() as Handle;
                        let h = *self.bucket_handle.entry(t).or_insert(next);
                        return if h < Self::HANDLES { h } else { Self::NO_DIRECTIVE };
                    }
                    return Self::NO_DIRECTIVE;
                }
                previous.map_or(Self::NO_DIRECTIVE, |p| p.handle)
            }
            Target::Outside | Target::OwnState => Self::NO_DIRECTIVE,
        }
    }
    fn observes_checkpoints(&self) -> bool {
        true
    }
    fn observe(&mut self, event: &Observation<'_>) {
        match *event {
            Observation::WriterPlacement { slot, pid } => self.pending = Some((slot, pid)),
            Observation::Checkpoint { entries, .. } => self.tenants.learn(entries),
            _ => {}
        }
    }
}

/// Loads seen per identity, bounded: two generations of at most `limit` identities each; an
/// identity not read for a whole generation is forgotten.
#[derive(Debug, Default)]
pub struct ReadBook {
    current: HashMap<u64, u8>,
    previous: HashMap<u64, u8>,
    limit: usize,
}

impl ReadBook {
    pub fn new(limit: usize) -> Self {
        ReadBook { current: HashMap::new(), previous: HashMap::new(), limit: limit.max(1024) }
    }
    pub fn note_read(&mut self, identity: u64) {
        let n = self.current.remove(&identity).or_else(|| self.previous.remove(&identity)).unwrap_or(0);
        if self.current.len() >= self.limit {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(identity, n.saturating_add(1));
    }
    /// Sets `identity`'s count to at least `n` (state restored at start).
    pub fn note_reads(&mut self, identity: u64, n: u8) {
        if n > self.reads(identity) {
            self.previous.remove(&identity);
            if self.current.len() >= self.limit {
                self.previous = std::mem::take(&mut self.current);
            }
            self.current.insert(identity, n);
        }
    }
    pub fn reads(&self, identity: u64) -> u8 {
        self.current.get(&identity).or_else(|| self.previous.get(&identity)).copied().unwrap_or(0)
    }
}

/// fdpblk's own policy. It uses only what a block device sees: a slot header's identity, the
/// loads of that identity while it sat in a slot before (LMCache reads a key's payload when a
/// request hits it), and nothing of LMCache's internals.
///
/// Why (simulator evidence, `docs/waf.md`): under LMCache's LRU eviction with LIFO slot reuse a
/// key's data dies when its slot is reused after its eviction, one LRU residence time after its
/// last use. Keys that were never read die at that time after their write, in write order: a
/// FIFO stream whose reclaim units die whole. Keys that were read before (they came back after
/// an eviction because requests hit them) are the ones whose data outlives its neighbours; the
/// more reads, the longer. So:
/// - handle 0 (young): identities never read, plus checkpoints, fdpblk's own state and
///   anything outside the layout (small, short-lived streams: a handle of their own would
///   keep a mostly empty open reclaim unit, which costs more spare space than they pollute);
/// - handle 1 (read): identities read once or twice before;
/// - handle 2 (hot): identities read three times or more.
///
/// Splitting first-time from returning keys, by payload length (partial last chunks), by
/// checkpoint-learned tenant, or by how often the slot is rewritten measured no better, and
/// every extra handle keeps one more open reclaim unit (`docs/waf.md`, design evidence).
#[derive(Debug)]
pub struct KeyAwarePolicy {
    reads: ReadBook,
    /// Identity currently in each slot (loads carry no header).
    slot_identity: Vec<u64>,
}

impl KeyAwarePolicy {
    pub const YOUNG: Handle = 0;
    pub const READ: Handle = 1;
    pub const HOT: Handle = 2;
    pub const HANDLES: u16 = 3;
    /// Reads before a write that make an identity hot.
    pub const HOT_READS: u8 = 3;

    pub fn new() -> Self {
        KeyAwarePolicy { reads: ReadBook::new(1 << 20), slot_identity: Vec::new() }
    }

    fn set_identity(&mut self, slot: u64, identity: u64) {
        let i = slot as usize;
        if i >= self.slot_identity.len() {
            self.slot_identity.resize(i + 1, 0);
            // Keep the read book around four times the slots seen.
            self.reads.limit = self.reads.limit.max(4 * self.slot_identity.len());
        }
        self.slot_identity[i] = identity;
    }

    /// The handle for a header write of `identity`.
    pub fn class_of(&self, identity: u64) -> Handle {
        match self.reads.reads(identity) {
            0 => Self::YOUNG,
            n if n < Self::HOT_READS => Self::READ,
            _ => Self::HOT,
        }
    }
}

impl Default for KeyAwarePolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy for KeyAwarePolicy {
    fn name(&self) -> &'static str {
        "key-aware"
    }
    fn handles(&self) -> u16 {
        Self::HANDLES
    }
    fn needs_state(&self) -> bool {
        true
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        match target {
            Target::Checkpoint { .. } | Target::OwnState | Target::Outside => Self::YOUNG,
            Target::Slot { slot, header: Some(h), .. } => {
                self.set_identity(*slot, h.identity);
                self.class_of(h.identity)
            }
            Target::Slot { previous, .. } => previous.map_or(Self::YOUNG, |p| p.handle),
        }
    }
    fn observe(&mut self, event: &Observation<'_>) {
        match *event {
            Observation::Read { slot, .. } => {
                if let Some(&id) = self.slot_identity.get(slot as usize) {
                    self.reads.note_read(id);
                }
            }
            // After a restart: loads of the slot count again at once, and its contents' loads
            // so far are not lost.
            Observation::Resident { slot, identity, reads } => {
                self.set_identity(slot, identity);
                self.reads.note_reads(identity, reads);
            }
            _ => {}
        }
    }
}

/// The policies selectable by name (the default first).
pub const POLICY_NAMES: &[&str] = &["none", "region", "lmcache-fdp", "key-aware"];

pub fn policy_by_name(name: &str) -> Option<Box<dyn Policy>> {
    match name {
        "none" => Some(Box::new(NonePolicy)),
        "region" => Some(Box::new(RegionPolicy)),
        "lmcache-fdp" => Some(Box::new(LmcacheFdpPolicy::new())),
        "key-aware" => Some(Box::new(KeyAwarePolicy::new())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(identity: u64) -> SlotHeader {
        SlotHeader { identity, payload_len: 1000 }
    }

    fn put(p: &mut dyn Policy, slot: u64, identity: u64) -> Handle {
        let h = hdr(identity);
        p.place(&Target::Slot { slot, header: Some(&h), previous: None })
    }

    #[test]
    fn every_name_resolves_and_fits_the_drive() {
        for n in POLICY_NAMES {
            let p = policy_by_name(n).unwrap();
            assert_eq!(p.name(), *n);
            assert!(p.handles() <= 8);
        }
        assert!(policy_by_name("nope").is_none());
    }

    #[test]
    fn key_aware_places_by_the_reads_an_identity_had() {
        let mut p = KeyAwarePolicy::new();
        assert_eq!(p.place(&Target::Checkpoint { copy: 1 }), KeyAwarePolicy::YOUNG);
        assert_eq!(p.place(&Target::OwnState), KeyAwarePolicy::YOUNG);
        // Never read: young, written the first time or again.
        assert_eq!(put(&mut p, 0, 10), KeyAwarePolicy::YOUNG);
        assert_eq!(put(&mut p, 1, 11), KeyAwarePolicy::YOUNG);
        // Identity 10 is read twice while in slot 0, then evicted; slot 0 reused by 12.
        p.observe(&Observation::Read { slot: 0, len: 1000 });
        p.observe(&Observation::Read { slot: 0, len: 1000 });
        assert_eq!(put(&mut p, 0, 12), KeyAwarePolicy::YOUNG);
        // 10 comes back (in another slot): read before, on the read handle.
        assert_eq!(put(&mut p, 5, 10), KeyAwarePolicy::READ);
        p.observe(&Observation::Read { slot: 5, len: 1000 });
        assert_eq!(put(&mut p, 6, 10), KeyAwarePolicy::HOT);
        // A payload without its header follows the slot's record.
        let prev = SlotEntry { handle: 2, generation: 1, ..Default::default() };
        assert_eq!(p.place(&Target::Slot { slot: 6, header: None, previous: Some(&prev) }), 2);
        // A read of a slot never written is ignored.
        p.observe(&Observation::Read { slot: 999, len: 1 });
    }

    #[test]
    fn key_aware_resumes_from_a_restored_slot_table() {
        let slots = SlotTable::new(8);
        slots.record_header(2, &hdr(20), KeyAwarePolicy::HOT);
        slots.record_header(3, &hdr(30), KeyAwarePolicy::YOUNG);
        for _ in 0..3 {
            slots.note_read(2);
        }
        slots.note_read(3);
        // A restarted daemon: a fresh policy given the table fdpblk's own state restored.
        let shared = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
        assert_eq!(shared.resume(&slots), 2);
        let mut p = shared.clone();
        // Identity 20 had 3 loads, 30 one: returning, they keep their classes.
        assert_eq!(put(&mut p, 5, 20), KeyAwarePolicy::HOT);
        assert_eq!(put(&mut p, 6, 30), KeyAwarePolicy::READ);
        // Loads of slot 3 count for identity 30 before any new header is written to it.
        p.observe(&Observation::Read { slot: 3, len: 1000 });
        p.observe(&Observation::Read { slot: 3, len: 1000 });
        assert_eq!(put(&mut p, 7, 30), KeyAwarePolicy::HOT);
        // Policies without history take nothing.
        assert_eq!(SharedPolicy::new(Box::new(NonePolicy)).resume(&slots), 0);
    }

    #[test]
    fn read_book_forgets_whole_generations() {
        let mut b = ReadBook::new(1024);
        for i in 0..1024 {
            b.note_read(i);
        }
        b.note_read(5000); // rotates: 0..1024 become the previous generation
        assert_eq!((b.reads(3), b.reads(5000)), (1, 1));
        b.note_read(3); // moves to the current generation with its count
        assert_eq!(b.reads(3), 2);
        for i in 10_000..12_100 {
            b.note_read(i);
        }
        assert_eq!((b.reads(3), b.reads(4)), (0, 0), "forgotten after two rotations");
    }

    #[test]
    fn lmcache_fdp_emulation_follows_the_writer_then_checkpoint_tenants() {
        let mut p = LmcacheFdpPolicy::new();
        assert_eq!(p.place(&Target::Checkpoint { copy: 0 }), LmcacheFdpPolicy::CHECKPOINT);
        p.observe(&Observation::WriterPlacement { slot: 4, pid: 3 });
        assert_eq!(put(&mut p, 4, 77), 3);
        // Without a writer's id (under `fdpblk add`): the tenant a checkpoint taught, buckets
        // first come first served; unknown identities get no directive.
        assert_eq!(put(&mut p, 5, 88), LmcacheFdpPolicy::NO_DIRECTIVE);
        let entries =
            [LiveEntry { slot: 5, identity: 88, tenant_tag: 9 }, LiveEntry { slot: 6, identity: 99, tenant_tag: 4 }];
        p.observe(&Observation::Checkpoint { seq: 1, entries: &entries });
        assert_eq!(put(&mut p, 7, 99), LmcacheFdpPolicy::FIRST_DATA);
        assert_eq!(put(&mut p, 8, 88), LmcacheFdpPolicy::FIRST_DATA + 1);
        assert_eq!(put(&mut p, 9, 99), LmcacheFdpPolicy::FIRST_DATA);
    }

    #[test]
    fn shared_policy_is_one_policy() {
        let s = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
        let (mut a, mut b) = (s.clone(), s);
        assert_eq!((a.name(), a.handles(), a.needs_state()), ("key-aware", 3, true));
        assert_eq!(put(&mut a, 0, 1), KeyAwarePolicy::YOUNG);
        b.observe(&Observation::Read { slot: 0, len: 1 });
        assert_eq!(put(&mut a, 1, 1), KeyAwarePolicy::READ);
    }
}
