//! Placement policies: which reclaim unit handle each piece of LMCache's layout goes to.
//!
//! A policy sees one placement question at a time and answers with a logical handle
//! (`0..handles()`); the engine maps logical handles to the drive's placement identifiers.
//! Slot payload bytes never ask: the pipeline sends them to the handle their header got.

use crate::layout::slot_header::SlotHeader;
use crate::slot_table::{SlotEntry, SlotState, SlotTable};
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
/// slot (from `offset`), the identity (recomputed from the key string) and the bucket LMCache's
/// FDP mode files the key's cache_salt under ([`crate::layout::keys::salt_bucket_id`]; 0 for
/// none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveEntry {
    pub slot: u64,
    pub identity: u64,
    pub salt_bucket: u64,
}

/// What a policy may learn besides the placement questions. The pipeline asks `place`; the
/// frontend, the checkpoint reader and the simulator report these through `observe`.
#[derive(Clone, Copy, Debug)]
pub enum Observation<'a> {
    /// A load: a read of `len` bytes from the start of a slot's payload (LMCache's loads never
    /// read the header), and the identity of the slot's current header as the slot table knows
    /// it (None when no header was seen; after an unclean restart, a slot rewritten since the
    /// last persist names its previous identity until its next header: placement only).
    ///
    /// `slot_reads`: the loads of the slot's current contents so far, this one included (0
    /// when not known). Several slots can hold one identity at once (a legacy key's layers,
    /// or tags, share the chunk hash): one request loads each of them once.
    Read { slot: u64, identity: Option<u64>, len: u64, slot_reads: u8 },
    /// A committed checkpoint (`seq`) with every live entry.
    Checkpoint { seq: u64, entries: &'a [LiveEntry] },
    /// The placement id the writer itself chose for its next write to `slot`. Only LMCache's
    /// own FDP mode has one (the simulator's emulation of it passes it); a block device never
    /// sees it.
    WriterPlacement { slot: u64, pid: Handle },
    /// Wall-clock (or simulated) seconds since start.
    Time { now_s: f64 },
    /// The layout of the device the policy places for: LMCache's slot count (each pipeline
    /// reports it when it is made).
    Layout { max_slots: u64 },
    /// At start, from fdpblk's own state: `slot` holds `identity`, whose current contents were
    /// loaded `reads` times as of the slot's record on the device: exact up to 4, within a
    /// factor of two above (loads save a record at 1–4 and at powers of two), as of fdpblk's
    /// last persist.
    /// `listed`: not known to be evicted (an evicted copy's loads count for the identity,
    /// but a copy put again elsewhere starts its own slot count at 0).
    Resident { slot: u64, identity: u64, reads: u8, listed: bool },
}

pub trait Policy: Send {
    fn name(&self) -> &'static str;
    /// Number of logical handles the policy uses; the drive must offer at least this many.
    fn handles(&self) -> u16;
    fn place(&mut self, target: &Target<'_>) -> Handle;
    /// Side information (default: ignored).
    fn observe(&mut self, _event: &Observation<'_>) {}
    /// Whether the policy keeps a history of its own (key-aware's loads per identity). fdpblk's
    /// own state keeps only what the slot table's records hold: at start such a policy gets
    /// every resident slot as `Observation::Resident` ([`SharedPolicy::resume`]); loads of
    /// identities no slot holds any more are not kept and are learnt again.
    fn needs_state(&self) -> bool {
        false
    }
    /// Whether the policy wants `Observation::Checkpoint` (every live entry of each committed
    /// checkpoint: costs the state thread a key hash per entry).
    fn observes_checkpoints(&self) -> bool {
        false
    }
    /// Memory the last call let go of, to be freed by the caller ([`SharedPolicy`] frees it
    /// off its lock and off the I/O path: a read book generation can be hundreds of MB).
    fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        None
    }
    /// For a policy that learns from checkpoints: the work on a checkpoint's entries that
    /// needs no policy state. [`SharedPolicy`] runs it off its lock (a checkpoint can list
    /// hundreds of thousands of entries, and every queue takes the lock to place each write)
    /// and hands the result to [`Policy::learn`] under it.
    fn checkpoint_lesson(&self) -> Option<CheckpointLesson> {
        None
    }
    /// Takes what [`Policy::checkpoint_lesson`]'s function made of a checkpoint.
    fn learn(&mut self, _lesson: Box<dyn std::any::Any + Send>) {}
}

/// Works out, from a committed checkpoint's live entries, what a policy learns of them.
pub type CheckpointLesson = fn(&[LiveEntry]) -> Box<dyn std::any::Any + Send>;

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
    lesson: Option<CheckpointLesson>,
}

impl SharedPolicy {
    pub fn new(p: Box<dyn Policy>) -> Self {
        let (name, handles, needs_state, observes_checkpoints) = (p.name(), p.handles(), p.needs_state(), p.observes_checkpoints());
        let lesson = p.checkpoint_lesson();
        SharedPolicy { inner: Arc::new(Mutex::new(p)), name, handles, needs_state, observes_checkpoints, lesson }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Box<dyn Policy>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`resume`] under the lock.
    pub fn resume(&self, slots: &SlotTable) -> u64 {
        if !self.needs_state {
            return 0;
        }
        resume(self.lock().as_mut(), slots)
    }
}

/// Frees what a policy let go of on a thread of its own: unmapping hundreds of MB takes tens
/// of ms, which every queue would wait through under the policy's lock, and one queue's
/// request without it. Where no thread can be started, here.
fn free_elsewhere(retired: Option<Box<dyn std::any::Any + Send>>) {
    if let Some(r) = retired {
        let _ = std::thread::Builder::new().name("fdpblk-free".into()).spawn(move || drop(r));
    }
}

/// Tells a policy that keeps history (`needs_state`) the layout and what each slot of a slot
/// table restored from fdpblk's own state holds, before the device serves I/O. Returns the
/// slots reported.
pub fn resume(p: &mut dyn Policy, slots: &SlotTable) -> u64 {
    // The layout first: a policy sizes its history by it, not by the slots it is told of.
    p.observe(&Observation::Layout { max_slots: slots.len() as u64 });
    let mut n = 0;
    for slot in 0..slots.len() as u64 {
        if let Some(e) = slots.get(slot) {
            let listed = !matches!(e.state, SlotState::Evicted | SlotState::Trimmed);
            p.observe(&Observation::Resident { slot, identity: e.identity, reads: e.reads, listed });
            n += 1;
        }
    }
    n
}

impl Policy for SharedPolicy {
    fn name(&self) -> &'static str {
        self.name
    }
    fn handles(&self) -> u16 {
        self.handles
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        let (h, retired) = {
            let mut p = self.lock();
            (p.place(target), p.take_retired())
        };
        free_elsewhere(retired);
        h
    }
    fn observe(&mut self, event: &Observation<'_>) {
        let lesson = match (event, self.lesson) {
            (Observation::Checkpoint { entries, .. }, Some(f)) => Some(f(entries)),
            _ => None,
        };
        let retired = {
            let mut p = self.lock();
            match lesson {
                Some(l) => p.learn(l),
                None => p.observe(event),
            }
            p.take_retired()
        };
        free_elsewhere(retired);
    }
    fn needs_state(&self) -> bool {
        self.needs_state
    }
    fn observes_checkpoints(&self) -> bool {
        self.observes_checkpoints
    }
}

/// The cache_salt buckets of the identities in the two newest committed checkpoints (what
/// fdpblk can know of a key's tenant: only once a checkpoint listed it), so a key evicted
/// after one checkpoint is still known when it returns. Bounded by two checkpoints' entries.
#[derive(Debug, Default)]
pub struct BucketBook {
    current: HashMap<u64, u64>,
    previous: HashMap<u64, u64>,
    retired: Option<HashMap<u64, u64>>,
}

impl BucketBook {
    /// One checkpoint's buckets (needs no book: built off the policy's lock).
    pub fn generation(entries: &[LiveEntry]) -> HashMap<u64, u64> {
        entries.iter().filter(|e| e.salt_bucket != 0).map(|e| (e.identity, e.salt_bucket)).collect()
    }
    /// Makes `generation` the newest; the oldest is kept for [`BucketBook::take_retired`].
    pub fn push(&mut self, generation: HashMap<u64, u64>) {
        let oldest = std::mem::replace(&mut self.previous, std::mem::replace(&mut self.current, generation));
        self.retired = Some(oldest);
    }
    pub fn learn(&mut self, entries: &[LiveEntry]) {
        self.push(Self::generation(entries));
    }
    pub fn bucket(&self, identity: u64) -> Option<u64> {
        self.current.get(&identity).or_else(|| self.previous.get(&identity)).copied()
    }
    pub fn take_retired(&mut self) -> Option<HashMap<u64, u64>> {
        self.retired.take()
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
/// emulation then places a returning identity by the cache_salt bucket (the salt's part
/// before `:`, case-folded) a committed checkpoint listed it with (fdpblk's state thread
/// passes each one on), and anything else on handle 0.
#[derive(Debug)]
pub struct LmcacheFdpPolicy {
    /// Per slot, the id LMCache's last put into it was written with (the simulator's
    /// `WriterPlacement`): a batch (io_uring, page-cache writeback) delivers several puts'
    /// writes after all of their ids were chosen. At most one word pair per slot.
    writer_pid: HashMap<u64, Handle>,
    buckets: BucketBook,
    bucket_handle: HashMap<u64, Handle>,
}

impl LmcacheFdpPolicy {
    pub const NO_DIRECTIVE: Handle = 0;
    pub const CHECKPOINT: Handle = 1;
    pub const FIRST_DATA: Handle = 2;
    pub const HANDLES: u16 = 8;

    pub fn new() -> Self {
        LmcacheFdpPolicy { writer_pid: HashMap::new(), buckets: BucketBook::default(), bucket_handle: HashMap::new() }
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
                if let Some(&pid) = self.writer_pid.get(slot) {
                    return pid;
                }
                if let Some(h) = header {
                    if let Some(t) = self.buckets.bucket(h.identity) {
                        if let Some(&h) = self.bucket_handle.get(&t) {
                            return h;
                        }
                        // First come, first served while ids last (at most 6 buckets kept);
                        // later buckets get no directive, as in LMCache.
                        let next = Self::FIRST_DATA + self.bucket_handle.len() as Handle;
                        if next < Self::HANDLES {
                            self.bucket_handle.insert(t, next);
                            return next;
                        }
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
            Observation::WriterPlacement { slot, pid } => {
                self.writer_pid.insert(slot, pid);
            }
            Observation::Checkpoint { entries, .. } => self.buckets.learn(entries),
            _ => {}
        }
    }
    fn checkpoint_lesson(&self) -> Option<CheckpointLesson> {
        Some(|entries| Box::new(BucketBook::generation(entries)))
    }
    fn learn(&mut self, lesson: Box<dyn std::any::Any + Send>) {
        if let Ok(generation) = lesson.downcast::<HashMap<u64, u64>>() {
            self.buckets.push(*generation);
        }
    }
    fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        self.buckets.take_retired().filter(|m| m.capacity() > 0).map(|m| Box::new(m) as Box<dyn std::any::Any + Send>)
    }
}

/// Loads seen per identity, in bounded memory: two generations of at most `limit` identities
/// each; an identity neither read nor restored during a whole generation is forgotten.
///
/// Each generation is an open-addressing table of 8-byte words, a 47-bit tag of the identity,
/// a `fresh` bit, an 8-bit `top` and an 8-bit saturating count (two identities with one tag
/// share a count, about one pair in 2^47: it only steers placement), at most 3/4 full,
/// probed linearly from a keyed hash (a writer that chooses its identities cannot make the
/// probes long). So `limit` identities cost about 2 × 8 × 4/3 = 21 bytes each, both
/// generations allocated.
///
/// `top` is the most loads any one slot's current contents of the identity had. A load of a
/// slot whose contents have had `n` loads adds what `n` passes `top` by: one per load while the
/// identity sits in one slot, and one per request, not one per layer, when several slots hold
/// it (a legacy key's layers all carry the chunk hash). A header write of the identity starts
/// `top` again, as it starts that slot's count, and marks the entry `fresh`: the first load
/// after it adds at most one (another slot of the identity, not rewritten, still has its
/// loads, which were counted already).
#[derive(Debug)]
pub struct ReadBook {
    current: CountTable,
    previous: CountTable,
    limit: usize,
    hasher: std::collections::hash_map::RandomState,
    /// Generations let go of since the owner last took them ([`Policy::take_retired`]).
    retired: Vec<CountTable>,
}

/// One generation of a [`ReadBook`]: words `tag | fresh << 16 | top << 8 | count`, 0 = empty;
/// no deletions (a generation is emptied whole), so a probe ends at the first empty word.
#[derive(Debug, Default)]
struct CountTable {
    words: Vec<u64>,
    len: usize,
}

const COUNT_MASK: u64 = 0xff;
const TOP_SHIFT: u32 = 8;
const FRESH: u64 = 1 << 16;
const TAG_MASK: u64 = !0x1_ffff;

/// An identity's entry: its loads and the most loads one slot of it had.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Loads {
    count: u8,
    top: u8,
    fresh: bool,
}

impl CountTable {
    /// Room for `limit` identities at most 3/4 full (one empty word always remains; `limit`
    /// is at most [`ReadBook::MAX_LIMIT`]). The words come zeroed from the allocator, so a new
    /// table costs no pass over its memory.
    fn new(limit: usize) -> Self {
        CountTable { words: vec![0; limit + limit / 3 + 1], len: 0 }
    }
    /// The word holding `tag`, or the empty word where it would go.
    fn find(&self, tag: u64, hash: u64) -> usize {
        let n = self.words.len();
        let mut i = ((u128::from(hash) * n as u128) >> 64) as usize;
        loop {
            let w = self.words[i];
            if w == 0 || w & TAG_MASK == tag {
                return i;
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
    }
    /// `tag`'s entry; a count of 0 means none.
    fn get(&self, tag: u64, hash: u64) -> Loads {
        let w = self.words[self.find(tag, hash)];
        Loads { count: (w & COUNT_MASK) as u8, top: (w >> TOP_SHIFT & COUNT_MASK) as u8, fresh: w & FRESH != 0 }
    }
    /// Sets `tag`'s entry (count at least 1); a new tag needs room (`len` below the limit).
    fn set(&mut self, tag: u64, hash: u64, l: Loads) {
        let i = self.find(tag, hash);
        if self.words[i] == 0 {
            self.len += 1;
        }
        self.words[i] = tag | if l.fresh { FRESH } else { 0 } | u64::from(l.top) << TOP_SHIFT | u64::from(l.count.max(1));
    }
}

impl ReadBook {
    /// The smallest generation.
    pub const MIN_LIMIT: usize = 1024;
    /// The largest generation (2^36 identities; a slot table that large would not fit first).
    pub const MAX_LIMIT: usize = 1 << 36;

    pub fn new(limit: usize) -> Self {
        let limit = limit.clamp(Self::MIN_LIMIT, Self::MAX_LIMIT);
        ReadBook {
            current: CountTable::new(limit),
            previous: CountTable::new(limit),
            limit,
            hasher: Default::default(),
            retired: Vec::new(),
        }
    }

    /// The word's tag for `identity` and where its probe starts. The tag is 47 bits of a
    /// bijective mix of the identity, so identities that differ anywhere rarely share one.
    fn key(&self, identity: u64) -> (u64, u64) {
        let mut z = identity;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let tag = z & TAG_MASK;
        (tag, self.probe_start(tag))
    }
    fn probe_start(&self, tag: u64) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(tag)
    }

    /// Raises the generation size to at least `limit` (never lowers it); the tables are
    /// rebuilt, so callers grow in few large steps.
    pub fn grow_to(&mut self, limit: usize) {
        let limit = limit.min(Self::MAX_LIMIT);
        if limit <= self.limit {
            return;
        }
        let rebuilt = |from: &CountTable| {
            let mut t = CountTable::new(limit);
            for w in from.words.iter().copied().filter(|&w| w != 0) {
                let tag = w & TAG_MASK;
                let i = t.find(tag, self.probe_start(tag));
                t.words[i] = w;
                t.len += 1;
            }
            t
        };
        let (current, previous) = (rebuilt(&self.current), rebuilt(&self.previous));
        let old_current = std::mem::replace(&mut self.current, current);
        let old_previous = std::mem::replace(&mut self.previous, previous);
        self.retired.clear();
        self.retired.extend([old_current, old_previous]);
        self.limit = limit;
    }

    /// Keeps `t` for the owner to free ([`Self::take_retired`]). Only the last retirement's:
    /// an owner that never takes them (not shared: `replay`) frees the older ones here.
    fn retire(&mut self, t: CountTable) {
        self.retired.clear();
        self.retired.push(t);
    }

    /// The generations let go of since the last call.
    fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        (!self.retired.is_empty()).then(|| Box::new(std::mem::take(&mut self.retired)) as Box<dyn std::any::Any + Send>)
    }

    /// Before a tag new to the current generation: a full generation becomes the previous
    /// one, and the one before is forgotten. This runs under the data path's policy lock, so
    /// the new table is a fresh zeroed allocation rather than a pass over the old one, and the
    /// forgotten one is retired, not freed here.
    fn make_room(&mut self) {
        if self.current.len >= self.limit {
            let fresh = CountTable::new(self.limit);
            let old = std::mem::replace(&mut self.previous, std::mem::replace(&mut self.current, fresh));
            self.retire(old);
        }
    }

    /// Changes `identity`'s entry in the current generation (taking it from the previous
    /// one, or from nothing), which keeps it for another generation.
    fn update(&mut self, identity: u64, f: impl FnOnce(Loads) -> Loads) {
        let (tag, h) = self.key(identity);
        let l = self.current.get(tag, h);
        if l.count > 0 {
            self.current.set(tag, h, f(l));
            return;
        }
        let l = self.previous.get(tag, h);
        self.make_room();
        self.current.set(tag, h, f(l));
    }

    /// A load of `identity` whose slot is not known: one more.
    pub fn note_read(&mut self, identity: u64) {
        self.update(identity, |l| Loads { count: l.count.saturating_add(1), ..l });
    }
    /// A load of a slot holding `identity` whose current contents have now had `slot_reads`
    /// loads (0: not known, counted as one).
    pub fn note_load(&mut self, identity: u64, slot_reads: u8) {
        if slot_reads == 0 {
            return self.note_read(identity);
        }
        self.update(identity, |l| {
            let more = slot_reads.saturating_sub(l.top);
            Loads { count: l.count.saturating_add(if l.fresh { more.min(1) } else { more }), top: l.top.max(slot_reads), fresh: false }
        });
    }
    /// A header write of `identity`: that slot's loads start again, and so does `top`. Not a
    /// load: it neither creates an entry nor keeps one for another generation. Returns the
    /// identity's loads ([`Self::reads`]), found by the same probe.
    pub fn note_write(&mut self, identity: u64) -> u8 {
        let (tag, h) = self.key(identity);
        for t in [&mut self.current, &mut self.previous] {
            let l = t.get(tag, h);
            if l.count > 0 {
                t.set(tag, h, Loads { top: 0, fresh: true, ..l });
                return l.count;
            }
        }
        0
    }
    /// Sets `identity`'s count to at least `n`, a slot's loads restored at start, and, for a
    /// slot whose contents LMCache still lists (`listed`), its `top` too.
    pub fn note_reads(&mut self, identity: u64, n: u8, listed: bool) {
        if n == 0 {
            return;
        }
        self.update(identity, |l| Loads { count: l.count.max(n), top: if listed { l.top.max(n) } else { l.top }, ..l });
    }
    pub fn reads(&self, identity: u64) -> u8 {
        let (tag, h) = self.key(identity);
        match self.current.get(tag, h).count {
            0 => self.previous.get(tag, h).count,
            n => n,
        }
    }
    /// Identities remembered, both generations (one remembered in both counts twice).
    pub fn len(&self) -> usize {
        self.current.len + self.previous.len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Heap bytes of both generations' tables.
    pub fn heap_bytes(&self) -> usize {
        (self.current.words.capacity() + self.previous.words.capacity()) * 8
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
}

impl KeyAwarePolicy {
    pub const YOUNG: Handle = 0;
    pub const READ: Handle = 1;
    pub const HOT: Handle = 2;
    pub const HANDLES: u16 = 3;
    /// Reads before a write that make an identity hot.
    pub const HOT_READS: u8 = 3;

    pub fn new() -> Self {
        KeyAwarePolicy { reads: ReadBook::new(ReadBook::MIN_LIMIT) }
    }

    /// A generation of the read book holds as many identities as LMCache has slots (the
    /// layout's, or the slots seen when no layout was given), so its memory follows the device.
    /// Against a book of a million identities per generation (nine times the simulated slots),
    /// `key-aware`'s WAF in the tables of `docs/waf.md` moved by 0.008 at most, either way.
    fn saw_slot(&mut self, slot: u64) {
        let seen = usize::try_from(slot).unwrap_or(usize::MAX).saturating_add(1);
        if seen > self.reads.limit {
            // Without a layout, grow in doublings: every growth rebuilds the tables.
            self.reads.grow_to(seen.max(self.reads.limit.saturating_mul(2)));
        }
    }

    /// The loads per identity it remembers.
    pub fn read_book(&self) -> &ReadBook {
        &self.reads
    }

    /// The handle for a header write of an identity loaded `reads` times.
    fn class_for(reads: u8) -> Handle {
        match reads {
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
    fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        self.reads.take_retired()
    }
    fn needs_state(&self) -> bool {
        true
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        match target {
            Target::Checkpoint { .. } | Target::OwnState | Target::Outside => Self::YOUNG,
            Target::Slot { slot, header: Some(h), .. } => {
                self.saw_slot(*slot);
                // One probe of the read book per put: its loads so far, and `top` restarts.
                Self::class_for(self.reads.note_write(h.identity))
            }
            Target::Slot { previous, .. } => previous.map_or(Self::YOUNG, |p| p.handle),
        }
    }
    fn observe(&mut self, event: &Observation<'_>) {
        match *event {
            Observation::Read { slot, identity: Some(id), slot_reads, .. } => {
                self.saw_slot(slot);
                self.reads.note_load(id, slot_reads);
            }
            Observation::Layout { max_slots } => self.reads.grow_to(usize::try_from(max_slots).unwrap_or(usize::MAX)),
            // After a restart: the loads of each slot's contents so far are not lost.
            Observation::Resident { slot, identity, reads, listed } => {
                self.saw_slot(slot);
                self.reads.note_reads(identity, reads, listed);
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
        p.observe(&Observation::Read { slot: 0, identity: Some(10), len: 1000, slot_reads: 1 });
        p.observe(&Observation::Read { slot: 0, identity: Some(10), len: 1000, slot_reads: 2 });
        assert_eq!(put(&mut p, 0, 12), KeyAwarePolicy::YOUNG);
        // 10 comes back (in another slot): read before, on the read handle; the new slot's
        // loads count from 1 again, and add to the identity's.
        assert_eq!(put(&mut p, 5, 10), KeyAwarePolicy::READ);
        p.observe(&Observation::Read { slot: 5, identity: Some(10), len: 1000, slot_reads: 1 });
        assert_eq!(put(&mut p, 6, 10), KeyAwarePolicy::HOT);
        // A payload without its header follows the slot's record.
        let prev = SlotEntry { handle: 2, generation: 1, ..Default::default() };
        assert_eq!(p.place(&Target::Slot { slot: 6, header: None, previous: Some(&prev) }), 2);
        // A read of a slot without a header is ignored.
        p.observe(&Observation::Read { slot: 999, identity: None, len: 1, slot_reads: 0 });
        assert!(p.read_book().len() == 1 && p.read_book().reads(10) == 3);
    }

    /// A legacy key's layers share the chunk hash: one request loads every layer's slot once,
    /// and that is one load of the identity, not one per layer.
    #[test]
    fn key_aware_counts_a_request_over_layer_slots_once() {
        let mut p = KeyAwarePolicy::new();
        let layers = 10..42u64;
        for s in layers.clone() {
            assert_eq!(put(&mut p, s, 7), KeyAwarePolicy::YOUNG);
        }
        let load = |p: &mut KeyAwarePolicy, slot, n| p.observe(&Observation::Read { slot, identity: Some(7), len: 1000, slot_reads: n });
        for s in layers.clone() {
            load(&mut p, s, 1);
        }
        assert_eq!(p.read_book().reads(7), 1, "one request");
        // Layer-wise retrieval interleaves the layers of several chunks; still one per request.
        for s in layers.clone().rev() {
            load(&mut p, s, 2);
        }
        assert_eq!(p.read_book().reads(7), 2);
        assert_eq!(put(&mut p, 50, 7), KeyAwarePolicy::READ, "a layer stored again: read twice before");
        // The next request loads the other layers (their third load) and the new one (its
        // first): one more, not the other layers' whole count again.
        load(&mut p, 10, 3);
        load(&mut p, 50, 1);
        for s in layers.clone().skip(1) {
            load(&mut p, s, 3);
        }
        assert_eq!(p.read_book().reads(7), 3);
        // Two queues' loads of one slot may arrive out of order: both count.
        let mut q = KeyAwarePolicy::new();
        put(&mut q, 3, 9);
        for n in [1, 3, 2] {
            q.observe(&Observation::Read { slot: 3, identity: Some(9), len: 1, slot_reads: n });
        }
        assert_eq!(q.read_book().reads(9), 3);
        // A slot count not known (0) counts one.
        q.observe(&Observation::Read { slot: 3, identity: Some(9), len: 1, slot_reads: 0 });
        assert_eq!(q.read_book().reads(9), 4);
        // Restored at start: a slot's loads so far, then one more load counts one.
        let mut r = KeyAwarePolicy::new();
        for s in layers.clone() {
            r.observe(&Observation::Resident { slot: s, identity: 7, reads: 2, listed: true });
        }
        assert_eq!(r.read_book().reads(7), 2);
        load(&mut r, 10, 3);
        load(&mut r, 11, 3);
        assert_eq!(r.read_book().reads(7), 3);
        assert_eq!(put(&mut r, 60, 7), KeyAwarePolicy::HOT);
        // An evicted copy (not yet reused or deallocated at the restart) brings its loads back,
        // but the copy put again elsewhere counts its own loads from its first.
        let mut e = KeyAwarePolicy::new();
        e.observe(&Observation::Resident { slot: 1, identity: 8, reads: 2, listed: false });
        e.observe(&Observation::Resident { slot: 2, identity: 8, reads: 0, listed: true });
        assert_eq!(e.read_book().reads(8), 2);
        e.observe(&Observation::Read { slot: 2, identity: Some(8), len: 1, slot_reads: 1 });
        assert_eq!(e.read_book().reads(8), 3, "its first load counts");
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
        // Later loads add to them.
        p.observe(&Observation::Read { slot: 3, identity: Some(30), len: 1000, slot_reads: 0 });
        p.observe(&Observation::Read { slot: 3, identity: Some(30), len: 1000, slot_reads: 0 });
        assert_eq!(put(&mut p, 7, 30), KeyAwarePolicy::HOT);
        // Policies without history take nothing.
        assert_eq!(SharedPolicy::new(Box::new(NonePolicy)).resume(&slots), 0);
        // The history is sized by the layout, not by the highest slot it was told of.
        let big = SlotTable::new(5000);
        big.record_header(4000, &hdr(40), KeyAwarePolicy::YOUNG);
        let mut k = KeyAwarePolicy::new();
        assert_eq!(resume(&mut k, &big), 1);
        assert_eq!(k.read_book().limit, 5000);
    }

    /// What a policy lets go of (a read book generation, hundreds of MB on a large drive) is
/// freed on a thread of its own, off the lock every queue takes and off the I/O path.
#[test]
fn a_retired_generation_is_freed_off_the_lock() {
    struct Probe(std::sync::mpsc::Sender<Option<String>>);
    impl Drop for Probe {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().name().map(String::from));
        }
    }
    struct Retiring(Option<std::sync::mpsc::Sender<Option<String>>>);
    impl Policy for Retiring {
        fn name(&self) -> &'static str {
            "retiring"
        }
        fn handles(&self) -> u16 {
            1
        }
        fn place(&mut self, _: &Target<'_>) -> Handle {
            0
        }
        fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
            self.0.take().map(|tx| Box::new(Probe(tx)) as Box<dyn std::any::Any + Send>)
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let mut shared = SharedPolicy::new(Box::new(Retiring(Some(tx))));
    shared.observe(&Observation::Layout { max_slots: 1 });
    let by = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("freed");
    assert_eq!(by.as_deref(), Some("fdpblk-free"));
    // The key-aware policy hands over the generation its read book forgets.
    let mut k = KeyAwarePolicy::new();
    k.observe(&Observation::Layout { max_slots: ReadBook::MIN_LIMIT as u64 });
    assert!(k.take_retired().is_none());
    for i in 0..=ReadBook::MIN_LIMIT as u64 {
        k.observe(&Observation::Read { slot: 0, identity: Some(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)), len: 1, slot_reads: 0 });
    }
    assert!(k.take_retired().is_some(), "the forgotten generation");
    assert!(k.take_retired().is_none());
}

#[test]
    fn key_aware_read_book_follows_the_layout_or_the_slots_seen() {
        let mut p = KeyAwarePolicy::new();
        put(&mut p, 0, 1);
        assert_eq!(p.read_book().limit, ReadBook::MIN_LIMIT);
        p.observe(&Observation::Layout { max_slots: 60_000 });
        assert_eq!(p.read_book().limit, 60_000);
        let spread = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for i in 0..60_000 {
            p.observe(&Observation::Read { slot: 0, identity: Some(spread(i)), len: 1, slot_reads: 0 });
        }
        // The current generation is full; the next new identity starts another.
        assert_eq!(p.read_book().reads(spread(7)), 1);
        assert_eq!(p.read_book().reads(1), 0, "identity 1 was never read");
        p.observe(&Observation::Read { slot: 0, identity: Some(spread(60_000)), len: 1, slot_reads: 0 });
        assert_eq!(p.read_book().reads(spread(7)), 1, "the previous generation is still read");
        assert!(p.read_book().len() <= 2 * 60_000);
        assert_eq!(p.read_book().heap_bytes(), 2 * 8 * (60_000 * 4 / 3 + 1));
        // Without a layout, slots beyond the limit double it; counts survive the rebuild.
        let mut q = KeyAwarePolicy::new();
        q.observe(&Observation::Read { slot: 0, identity: Some(5), len: 1, slot_reads: 0 });
        put(&mut q, 1500, 9);
        assert_eq!(q.read_book().limit, 2048);
        assert_eq!((q.read_book().reads(5), q.read_book().reads(9)), (1, 0));
    }

    #[test]
    fn read_book_counts_saturate_and_bounds_hold() {
        let mut b = ReadBook::new(1024);
        for _ in 0..300 {
            b.note_read(42);
        }
        assert_eq!(b.reads(42), 255);
        // Restored counts only raise.
        b.note_reads(42, 3, true);
        b.note_reads(43, 7, true);
        assert_eq!((b.reads(42), b.reads(43)), (255, 7));
        assert_eq!(b.reads(44), 0);
        // Many more identities than the limit: never more than two generations, never a
        // full table (a probe always ends).
        for i in 0..100_000u64 {
            b.note_read(i << 8);
            assert!(b.current.len <= b.limit && b.current.len < b.current.words.len());
        }
        assert!(b.len() <= 2 * 1024);
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
            [LiveEntry { slot: 5, identity: 88, salt_bucket: 9 }, LiveEntry { slot: 6, identity: 99, salt_bucket: 4 }];
        p.observe(&Observation::Checkpoint { seq: 1, entries: &entries });
        assert_eq!(put(&mut p, 7, 99), LmcacheFdpPolicy::FIRST_DATA);
        assert_eq!(put(&mut p, 8, 88), LmcacheFdpPolicy::FIRST_DATA + 1);
        assert_eq!(put(&mut p, 9, 99), LmcacheFdpPolicy::FIRST_DATA);
        // A batch (io_uring, page-cache writeback): both ids were chosen before either put's
        // writes arrive; each write takes its own slot's.
        p.observe(&Observation::WriterPlacement { slot: 10, pid: 5 });
        p.observe(&Observation::WriterPlacement { slot: 11, pid: LmcacheFdpPolicy::NO_DIRECTIVE });
        assert_eq!((put(&mut p, 10, 99), put(&mut p, 11, 99)), (5, LmcacheFdpPolicy::NO_DIRECTIVE));
        // Ids run out after six buckets: later ones get no directive, and are not kept.
        let many: Vec<LiveEntry> = (0..100_000u64).map(|i| LiveEntry { slot: i, identity: 1000 + i, salt_bucket: 50 + i }).collect();
        p.observe(&Observation::Checkpoint { seq: 2, entries: &many });
        let got: Vec<Handle> = (0..100_000u64).map(|i| put(&mut p, 20, 1000 + i)).collect();
        assert_eq!(&got[..4], &[4, 5, 6, 7], "buckets 9 and 4 took ids 2 and 3");
        assert!(got[4..].iter().all(|&h| h == LmcacheFdpPolicy::NO_DIRECTIVE));
        assert_eq!(p.bucket_handle.len(), 6);
    }

    #[test]
    fn lmcache_fdp_remembers_the_two_newest_checkpoints_tenants_also_when_shared() {
        let s = SharedPolicy::new(Box::new(LmcacheFdpPolicy::new()));
        assert!(s.lesson.is_some(), "learns off the lock");
        let mut p = s.clone();
        let cp = |p: &mut SharedPolicy, seq, identity| {
            p.observe(&Observation::Checkpoint { seq, entries: &[LiveEntry { slot: 0, identity, salt_bucket: identity + 100 }] })
        };
        cp(&mut p, 1, 1);
        cp(&mut p, 2, 2);
        assert_eq!((put(&mut p, 9, 1), put(&mut p, 9, 2)), (LmcacheFdpPolicy::FIRST_DATA, LmcacheFdpPolicy::FIRST_DATA + 1));
        cp(&mut p, 3, 3);
        let got = (put(&mut p, 9, 1), put(&mut p, 9, 2), put(&mut p, 9, 3));
        assert_eq!(got, (LmcacheFdpPolicy::NO_DIRECTIVE, LmcacheFdpPolicy::FIRST_DATA + 1, LmcacheFdpPolicy::FIRST_DATA + 2));
    }

    #[test]
    fn shared_policy_is_one_policy() {
        let s = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
        let (mut a, mut b) = (s.clone(), s);
        assert_eq!((a.name(), a.handles(), a.needs_state()), ("key-aware", 3, true));
        assert_eq!(put(&mut a, 0, 1), KeyAwarePolicy::YOUNG);
        b.observe(&Observation::Read { slot: 0, identity: Some(1), len: 1, slot_reads: 0 });
        assert_eq!(put(&mut a, 1, 1), KeyAwarePolicy::READ);
    }
}
