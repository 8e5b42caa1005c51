//! The identities that left their slot (overwritten or evicted), with their tags: how a key
//! that returns after eviction is recognised.

use super::*;

/// A bounded, lock-free set of identities that left their slot, each with its tag:
/// 8-way buckets of u64 entries `fingerprint (48 bits, never 0) << 16 | tag`. When a bucket
/// is full, the way one clock shared by all buckets points at is replaced: about random per
/// bucket, so the history keeps mostly recent departures (the one just before may go, with a
/// chance of one in 8), not strictly the newest. Races between threads can lose or duplicate
/// an entry; it is a hint.
#[derive(Debug)]
pub struct IdentityHistory {
    entries: Box<[AtomicU64]>,
    buckets: u64,
    used: AtomicU64,
    clock: AtomicU32,
    dirty: Box<[AtomicU64]>,
}

/// Identity entries per persistence page of the history.
pub const HISTORY_PER_PAGE: u64 = 507;
const WAYS: u64 = 8;

impl IdentityHistory {
    /// 3 entries per 8 slots (3 bytes per slot), at least one bucket.
    pub fn capacity_for(max_slots: u64) -> u64 {
        (max_slots * 3 / 8 / WAYS).max(1) * WAYS
    }

    pub fn new(capacity: u64) -> Self {
        let buckets = (capacity / WAYS).max(1);
        let n = buckets * WAYS;
        Self {
            entries: zeroed_u64(n as usize),
            buckets,
            used: AtomicU64::new(0),
            clock: AtomicU32::new(0),
            dirty: zeroed_u64(n.div_ceil(HISTORY_PER_PAGE).div_ceil(64) as usize),
        }
    }

    pub fn heap_bytes(&self) -> usize {
        self.entries.len() * 8 + self.dirty.len() * 8
    }
    pub fn capacity(&self) -> u64 {
        self.entries.len() as u64
    }
    /// Identities held.
    pub fn len(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn mix(identity: u64) -> u64 {
        // splitmix64 finaliser: identities of the legacy namespace are raw chunk hashes.
        let mut z = identity.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn slot_of(&self, identity: u64) -> (usize, u64) {
        let h = Self::mix(identity);
        let bucket = ((u128::from(h) * u128::from(self.buckets)) >> 64) as u64;
        let fp = match Self::mix(h) >> 16 {
            0 => 1,
            f => f,
        };
        ((bucket * WAYS) as usize, fp)
    }

    /// The tag of `identity` if it is in the history.
    pub fn lookup(&self, identity: u64) -> Option<u16> {
        let (base, fp) = self.slot_of(identity);
        self.entries[base..base + WAYS as usize].iter().map(|e| e.load(Ordering::Relaxed)).find(|&e| e >> 16 == fp).map(|e| e as u16)
    }

    /// Adds `identity` (or updates its tag when `tag` is known).
    pub fn insert(&self, identity: u64, tag: u16) {
        let (base, fp) = self.slot_of(identity);
        let want = fp << 16 | u64::from(tag);
        let ways = &self.entries[base..base + WAYS as usize];
        // An empty way is taken by a CAS: two queues (or the state thread's sweep) inserting
        // at once would otherwise both take it, losing one entry and counting it twice. A
        // lost CAS looks at the ways again (the winner may have inserted this identity).
        for _ in 0..WAYS {
            let mut empty = None;
            for (w, e) in ways.iter().enumerate() {
                let v = e.load(Ordering::Relaxed);
                if v >> 16 == fp {
                    if tag != 0 && v as u16 != tag {
                        e.store(want, Ordering::Relaxed);
                        self.mark_dirty(base + w);
                    }
                    return;
                }
                if v == 0 && empty.is_none() {
                    empty = Some(w);
                }
            }
            let Some(w) = empty else { break };
            if ways[w].compare_exchange(0, want, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                self.used.fetch_add(1, Ordering::Relaxed);
                self.mark_dirty(base + w);
                return;
            }
        }
        let w = (self.clock.fetch_add(1, Ordering::Relaxed) as u64 % WAYS) as usize;
        ways[w].store(want, Ordering::Relaxed);
        self.mark_dirty(base + w);
    }

    fn mark_dirty(&self, entry: usize) {
        let page = entry as u64 / HISTORY_PER_PAGE;
        if let Some(w) = self.dirty.get((page / 64) as usize) {
            // Release: see `SlotTable::mark_dirty`.
            w.fetch_or(1 << (page % 64), Ordering::Release);
        }
    }

    pub fn pages(&self) -> u64 {
        self.capacity().div_ceil(HISTORY_PER_PAGE)
    }

    pub fn take_dirty_pages(&self) -> Vec<u64> {
        take_bits(&self.dirty)
    }

    pub fn redirty_pages(&self, pages: &[u64]) {
        for &p in pages {
            self.mark_dirty((p * HISTORY_PER_PAGE) as usize);
        }
    }

    /// Raw entry `i` (persistence).
    pub fn raw(&self, i: u64) -> u64 {
        self.entries.get(i as usize).map_or(0, |e| e.load(Ordering::Relaxed))
    }

    /// Restores raw entry `i` (persistence).
    pub fn restore_raw(&self, i: u64, v: u64) {
        if let Some(e) = self.entries.get(i as usize) {
            if e.swap(v, Ordering::Relaxed) == 0 && v != 0 {
                self.used.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
