//! LMCache MP's L1: the server's CPU-memory tier in front of L2 (the device).
//!
//! What the model keeps of it (LMCache 0.5.6, `lmcache/v1/distributed/`): every stored chunk
//! is written to L1 first and then copied to L2 (`DefaultStorePolicy`); a key already in L1
//! is not written again, so it is not copied to L2 again either (`reserve_write` refuses it);
//! a lookup serves a chunk from L1 where it is there (`plan_load` prefers L1) and refreshes
//! only L1's LRU, and loads the rest from L2 without keeping them in L1 (`plan_l1_retention`:
//! temporary); L1 evicts its least recently used chunks when full. Its size is counted in
//! chunks, a partial last chunk as a whole one.

use std::collections::HashMap;

const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// An LRU set of chunk keys of at most `cap` entries (head = least recently used).
#[derive(Debug)]
pub struct L1 {
    cap: usize,
    map: HashMap<u64, u32>,
    nodes: Vec<Node>,
    head: u32,
    tail: u32,
}

impl L1 {
    pub fn new(cap: usize) -> Self {
        L1 { cap, map: HashMap::with_capacity(cap), nodes: Vec::with_capacity(cap), head: NONE, tail: NONE }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NONE => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_mru(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = NONE;
        match self.tail {
            NONE => self.head = i,
            t => self.nodes[t as usize].next = i,
        }
        self.tail = i;
    }

    /// Moves `key` to the most recently used end, where it is in L1.
    pub fn touch(&mut self, key: u64) {
        if let Some(&i) = self.map.get(&key) {
            self.unlink(i);
            self.push_mru(i);
        }
    }

    /// Adds `key` as the most recently used, evicting the least recently used when full.
    /// False (nothing changed) where it is there already or L1 holds nothing.
    pub fn insert(&mut self, key: u64) -> bool {
        if self.cap == 0 || self.map.contains_key(&key) {
            return false;
        }
        let i = if self.map.len() < self.cap {
            self.nodes.push(Node { key, prev: NONE, next: NONE });
            (self.nodes.len() - 1) as u32
        } else {
            let lru = self.head;
            self.unlink(lru);
            self.map.remove(&self.nodes[lru as usize].key);
            self.nodes[lru as usize].key = key;
            lru
        };
        self.map.insert(key, i);
        self.push_mru(i);
        true
    }

    /// The keys from least to most recently used (for tests).
    #[cfg(test)]
    pub fn order(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut i = self.head;
        while i != NONE {
            out.push(self.nodes[i as usize].key);
            i = self.nodes[i as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_goes_first() {
        let mut l = L1::new(3);
        assert!(l.insert(1) && l.insert(2) && l.insert(3));
        assert!(!l.insert(2), "already there");
        l.touch(1);
        assert_eq!(l.order(), [2, 3, 1]);
        assert!(l.insert(4));
        assert_eq!((l.order(), l.len(), l.contains(2)), (vec![3, 1, 4], 3, false));
        l.touch(9); // not there: nothing
        assert_eq!(l.order(), [3, 1, 4]);
        let mut none = L1::new(0);
        assert!(!none.insert(1) && !none.contains(1));
    }
}
