//! `key-aware`: fdpblk's own policy, by what a block device can know of a slot's identity (its
//! history of loads).

use super::*;

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
    pub(super) current: CountTable,
    previous: CountTable,
    pub(super) limit: usize,
    hasher: std::collections::hash_map::RandomState,
    /// Generations let go of since the owner last took them ([`Policy::take_retired`]).
    retired: Vec<CountTable>,
}

/// One generation of a [`ReadBook`]: words `tag | fresh << 16 | top << 8 | count`, 0 = empty;
/// no deletions (a generation is emptied whole), so a probe ends at the first empty word.
#[derive(Debug, Default)]
pub(super) struct CountTable {
    pub(super) words: Vec<u64>,
    pub(super) len: usize,
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
            // A handle restored from state another policy saved may lie past ours.
            Target::Slot { previous, .. } => previous.filter(|p| p.handle < Self::HANDLES).map_or(Self::YOUNG, |p| p.handle),
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
