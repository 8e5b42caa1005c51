//! What fdpblk knows about each slot: the identity and payload length of its current header
//! and the handle that header was placed on, so the slot's payload follows its header.

use crate::layout::slot_header::SlotHeader;
use crate::place::Handle;

/// One slot's record. `payload_len == 0` means no header has been seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotEntry {
    pub identity: u64,
    pub payload_len: u64,
    /// Header writes seen for this slot (a new occupant each time).
    pub generation: u32,
    pub handle: Handle,
}

impl SlotEntry {
    pub fn has_header(&self) -> bool {
        self.generation > 0
    }
}

/// Dense per-slot records, indexed by slot number.
#[derive(Clone, Debug, Default)]
pub struct SlotTable {
    entries: Vec<SlotEntry>,
}

impl SlotTable {
    pub fn new(max_slots: u64) -> Self {
        Self { entries: vec![SlotEntry::default(); max_slots as usize] }
    }
    pub fn get(&self, slot: u64) -> Option<&SlotEntry> {
        self.entries.get(usize::try_from(slot).ok()?).filter(|e| e.has_header())
    }
    /// Records a new header written to `slot` on `handle`.
    pub fn record_header(&mut self, slot: u64, header: &SlotHeader, handle: Handle) {
        if let Some(e) = usize::try_from(slot).ok().and_then(|i| self.entries.get_mut(i)) {
            e.identity = header.identity;
            e.payload_len = header.payload_len;
            e.generation = e.generation.wrapping_add(1).max(1);
            e.handle = handle;
        }
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl crate::classify::PayloadLens for SlotTable {
    fn payload_len(&self, slot: u64) -> Option<u64> {
        self.get(slot).map(|e| e.payload_len)
    }
}
