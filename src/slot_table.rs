//! What fdpblk knows about each slot: the identity and payload length of its current header,
//! the handle that header was placed on, and how much of its payload is still to come.
//!
//! Shared by all queue threads without a lock: each slot is two atomic words, so a header
//! written on one queue is seen by its payload on another. 16 bytes per slot.

use crate::layout::slot_header::SlotHeader;
use crate::place::Handle;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A snapshot of one slot's record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotEntry {
    pub identity: u64,
    pub payload_len: u64,
    /// Header writes seen for this slot, wrapping and never 0 once a header was seen.
    pub generation: u16,
    pub handle: Handle,
}

impl SlotEntry {
    pub fn has_header(&self) -> bool {
        self.generation > 0
    }
}

// meta word: payload_len (32 bits) | handle (16) | generation (16).
fn pack(payload_len: u64, handle: Handle, generation: u16) -> u64 {
    (payload_len.min(u32::MAX as u64)) | (u64::from(handle) << 32) | (u64::from(generation) << 48)
}

fn unpack(identity: u64, meta: u64) -> SlotEntry {
    SlotEntry {
        identity,
        payload_len: meta & 0xffff_ffff,
        handle: (meta >> 32) as u16,
        generation: (meta >> 48) as u16,
    }
}

/// Dense per-slot records, indexed by slot number.
#[derive(Debug, Default)]
pub struct SlotTable {
    identity: Box<[AtomicU64]>,
    meta: Box<[AtomicU64]>,
    /// Payload bytes of the current header not yet written; 0 = the put is complete, so a
    /// further payload write most likely belongs to a new put whose header is still to come.
    remaining: Box<[AtomicU64]>,
    /// Set by the first LMCache slot header: before it (or with a foreign writer such as fio)
    /// no payload waits for a header that will never come.
    headers_seen: AtomicBool,
}

impl SlotTable {
    pub fn new(max_slots: u64) -> Self {
        let n = max_slots as usize;
        let mk = || (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into_boxed_slice();
        Self { identity: mk(), meta: mk(), remaining: mk(), headers_seen: AtomicBool::new(false) }
    }

    pub fn get(&self, slot: u64) -> Option<SlotEntry> {
        let i = usize::try_from(slot).ok()?;
        let meta = self.meta.get(i)?.load(Ordering::Acquire);
        let e = unpack(self.identity[i].load(Ordering::Relaxed), meta);
        e.has_header().then_some(e)
    }

    /// Records a new header written to `slot` on `handle`.
    pub fn record_header(&self, slot: u64, header: &SlotHeader, handle: Handle) {
        let Some(i) = usize::try_from(slot).ok().filter(|&i| i < self.meta.len()) else { return };
        let old = unpack(0, self.meta[i].load(Ordering::Relaxed));
        let generation = match old.generation.wrapping_add(1) {
            0 => 1,
            g => g,
        };
        self.identity[i].store(header.identity, Ordering::Relaxed);
        self.remaining[i].store(header.payload_len, Ordering::Relaxed);
        self.meta[i].store(pack(header.payload_len, handle, generation), Ordering::Release);
        if !self.headers_seen.load(Ordering::Relaxed) {
            self.headers_seen.store(true, Ordering::Relaxed);
        }
    }

    /// True once any LMCache slot header was written through this table.
    pub fn headers_seen(&self) -> bool {
        self.headers_seen.load(Ordering::Relaxed)
    }

    /// Counts `bytes` of payload written for the slot's current header.
    pub fn payload_written(&self, slot: u64, bytes: u64) {
        if let Some(r) = usize::try_from(slot).ok().and_then(|i| self.remaining.get(i)) {
            let _ = r.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(bytes)));
        }
    }

    /// True when the slot's current header still expects payload bytes.
    pub fn expects_payload(&self, slot: u64) -> bool {
        usize::try_from(slot).ok().and_then(|i| self.remaining.get(i)).is_some_and(|r| r.load(Ordering::Relaxed) > 0)
    }

    pub fn len(&self) -> usize {
        self.meta.len()
    }
    pub fn is_empty(&self) -> bool {
        self.meta.is_empty()
    }
}

impl crate::classify::PayloadLens for SlotTable {
    fn payload_len(&self, slot: u64) -> Option<u64> {
        self.get(slot).map(|e| e.payload_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_and_generations() {
        let t = SlotTable::new(4);
        assert_eq!(t.get(1), None);
        let h = SlotHeader { identity: 99, payload_len: 8181 };
        t.record_header(1, &h, 3);
        let e = t.get(1).unwrap();
        assert_eq!((e.identity, e.payload_len, e.handle, e.generation), (99, 8181, 3, 1));
        assert!(t.expects_payload(1));
        t.payload_written(1, 8192);
        assert!(!t.expects_payload(1));
        t.record_header(1, &h, 2);
        assert_eq!(t.get(1).unwrap().generation, 2);
        t.record_header(9, &h, 2); // out of range: ignored
        assert_eq!(t.get(9), None);
        assert_eq!(std::mem::size_of::<AtomicU64>() * 3, 24);
    }
}
