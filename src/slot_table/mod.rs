//! What fdpblk knows about each slot, shared by all queue threads and the state thread
//! without a lock.
//!
//! Per slot (32 bytes in four atomic words, plus a u16 of `orphans` and two bits: a header
//! with a stale tail completed, and written unseen; and a dirty bit per persistence page):
//! - `identity`: the identity of the slot's current header;
//! - `meta`: payload_len (32 bits) | handle the header was placed on (16) | header writes seen
//!   (16, wrapping, never 0 once a header was seen);
//! - `life`: the write stamp (the checkpoint epoch at the slot's last write, 24 bits), the
//!   state (unknown / live / evicted / trimmed), whether the current contents were confirmed
//!   by one of LMCache's checkpoints, whether a trim is in progress, whether the identity was
//!   seen before, puts into the slot (8 bits, saturating), loads of the current contents
//!   (8 bits, saturating) and the (model, cache_salt) tag of the contents (16 bits);
//! - `remaining`: payload sectors (512 bytes: 31 bits cover any payload the 32-bit
//!   `payload_len` of a record holds, up to 4 GiB) of the current header not yet written; or,
//!   with its top bit (`CREDIT`), payload sectors placed while no header expected any (ahead
//!   of their header, past the header wait), which the next header counts as written. The
//!   upper 32 bits hold the generation of the header that set the count, so that a trim
//!   clearing an old put's count can never take a new put's equal one, and above it a bit
//!   saying that header took a credit (`ABSORBED`).
//!
//! Beside the slots: a bounded history of identities that left their slot (overwritten or
//! evicted), with their tags, so that a key that returns after eviction is recognised
//! ([`IdentityHistory`], at most 3 bytes per slot); the tag names ([`TagTable`]); the
//! checkpoint epoch and the mailbox through which the data path tells the state thread about
//! checkpoint header writes ([`crate::watch`]); a bitmap of the persistence pages whose
//! records changed ([`crate::persist`]); and a bitmap of the slots whose header write
//! completed with a stale tail behind it (early tails, `src/watch/tails.rs`).
//!
//! The trim handshake (see [`crate::watch`] for why it is safe): the state thread sets
//! `TRIMMING` with a compare-and-swap on `life` that expects the slot confirmed and unchanged;
//! every write first updates `life` (new stamp, confirmation cleared), so it either makes that
//! CAS fail or sees `TRIMMING` and is held by the queue until the deallocation has completed.
//! (A write within the current payload leaves a stale tail's CAS able to succeed; it lies
//! outside that tail: claim C in [`crate::watch`].)

use crate::layout::slot_header::SlotHeader;
use crate::layout::checkpoint_header::CheckpointHeader;
use crate::place::Handle;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU16, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// What fdpblk believes a slot holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SlotState {
    /// Never seen in a checkpoint, or written since (a put in flight, or not yet checkpointed).
    #[default]
    Unknown,
    /// Its current contents are listed in LMCache's newest committed checkpoint.
    Live,
    /// Its confirmed contents left LMCache's index (absent from the newest checkpoint).
    Evicted,
    /// Deallocated on the drive by fdpblk.
    Trimmed,
}

impl SlotState {
    pub const ALL: [SlotState; 4] = [SlotState::Unknown, SlotState::Live, SlotState::Evicted, SlotState::Trimmed];
    pub fn name(self) -> &'static str {
        match self {
            SlotState::Unknown => "unknown",
            SlotState::Live => "live",
            SlotState::Evicted => "evicted",
            SlotState::Trimmed => "trimmed",
        }
    }
    pub fn bits(self) -> u64 {
        self as u64
    }
    pub fn from_bits(b: u64) -> Self {
        Self::ALL[(b & 3) as usize]
    }
}

/// A snapshot of one slot's record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotEntry {
    pub identity: u64,
    pub payload_len: u64,
    /// Header writes seen for this slot, wrapping and never 0 once a header was seen.
    pub generation: u16,
    pub handle: Handle,
    pub state: SlotState,
    /// The current contents were seen committed in an LMCache checkpoint (and not written since).
    pub confirmed: bool,
    /// Puts into this slot (header writes), saturating at 255.
    pub writes: u8,
    /// Loads of the current contents (reads from the payload start), saturating at 255.
    pub reads: u8,
    /// The identity had left a slot before (evicted or overwritten) and came back.
    pub seen_before: bool,
    /// (model, cache_salt) of the contents, from a checkpoint entry or the identity history;
    /// 0 = not known. Names: [`SlotTable::tag_name`].
    pub tag: u16,
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

fn meta_generation(meta: u64) -> u16 {
    (meta >> 48) as u16
}

fn unpack(identity: u64, meta: u64, life: u64) -> SlotEntry {
    SlotEntry {
        identity,
        payload_len: meta & 0xffff_ffff,
        handle: (meta >> 32) as u16,
        generation: meta_generation(meta),
        state: life::state(life),
        confirmed: life & life::CONFIRMED != 0,
        writes: (life >> life::WRITES_SHIFT) as u8,
        reads: (life >> life::READS_SHIFT) as u8,
        seen_before: life & life::SEEN_BEFORE != 0,
        tag: (life >> life::TAG_SHIFT) as u16,
    }
}

/// The `life` word: stamp (24 bits) | state (2) | confirmed | trimming | seen_before |
/// tail_done | stale_tail | header_done | writes (8) | reads (8) | tag (16).
pub mod life {
    use super::SlotState;
    pub const STAMP_MASK: u64 = (1 << 24) - 1;
    pub const STATE_SHIFT: u32 = 24;
    pub const STATE_MASK: u64 = 3 << STATE_SHIFT;
    pub const CONFIRMED: u64 = 1 << 26;
    pub const TRIMMING: u64 = 1 << 27;
    pub const SEEN_BEFORE: u64 = 1 << 28;
    /// Nothing stale lies past the current payload: its tail was deallocated, or nothing was
    /// there when the header was written (cleared by any write but the payload's).
    pub const TAIL_DONE: u64 = 1 << 29;
    /// The slot may hold earlier contents' bytes past the current payload (set by the header
    /// write when the table cannot rule it out), and nothing but the payload was written to
    /// the slot since that header was planned (cleared by any other write). Not persisted.
    pub const STALE_TAIL: u64 = 1 << 30;
    /// The current header's write completed, and nothing but its payload was written to the
    /// slot since (set by the queue that served it; cleared like `TAIL_DONE`). Not persisted.
    pub const HEADER_DONE: u64 = 1 << 31;
    pub const WRITES_SHIFT: u32 = 32;
    pub const READS_SHIFT: u32 = 40;
    pub const TAG_SHIFT: u32 = 48;
    pub const READS_MASK: u64 = 0xff << READS_SHIFT;
    pub const TAG_MASK: u64 = 0xffff << TAG_SHIFT;

    pub fn stamp(l: u64) -> u32 {
        (l & STAMP_MASK) as u32
    }
    pub fn state(l: u64) -> SlotState {
        SlotState::from_bits(l >> STATE_SHIFT)
    }
    pub fn with_state(l: u64, s: SlotState) -> u64 {
        (l & !STATE_MASK) | (s.bits() << STATE_SHIFT)
    }
    pub fn with_stamp(l: u64, epoch: u32) -> u64 {
        (l & !STAMP_MASK) | (u64::from(epoch) & STAMP_MASK)
    }
    pub fn tag(l: u64) -> u16 {
        (l >> TAG_SHIFT) as u16
    }
    pub fn with_tag(l: u64, t: u16) -> u64 {
        (l & !TAG_MASK) | (u64::from(t) << TAG_SHIFT)
    }
    /// True when `a` and `b` differ at most in their load count (no write, state change or
    /// trim between them).
    pub fn same_but_loads(a: u64, b: u64) -> bool {
        (a ^ b) & !READS_MASK == 0
    }
    /// Checkpoint epochs between a write stamped `stamp` and epoch `epoch`, modulo 2^24. A
    /// stamp newer than `epoch` (a write after the caller read the epoch) reads as 0, not as a
    /// distance wrapped to nearly 2^24; so does one 2^23 or more epochs old. Too small is the
    /// conservative direction: a write counts as fresh only when it surely is.
    pub fn epochs_since(stamp: u32, epoch: u32) -> u32 {
        let d = epoch.wrapping_sub(stamp) & STAMP_MASK as u32;
        if d >= 1 << 23 {
            0
        } else {
            d
        }
    }
}

/// Slot records per persistence page (see [`crate::persist`]); the dirty bitmap has one bit each.
pub const RECORDS_PER_PAGE: u64 = 169;
/// Bytes of one persisted slot record.
pub const RECORD_BYTES: usize = 24;

/// Load counts at which a slot record is saved again (see [`SlotTable::note_read`]).
fn reads_worth_saving(n: u8) -> bool {
    n <= 4 || n.is_power_of_two() || n == u8::MAX
}

/// The top bit of a slot's `remaining` count: the rest counts payload sectors ahead of a header.
const CREDIT: u32 = 1 << 31;
/// The count half of a `remaining` word (the upper half is the header generation that set it).
const COUNT: u64 = u32::MAX as u64;
/// A bit of a `remaining` word above its generation: the header that set the count took bytes
/// placed ahead of it as its own (a credit). Were they not its payload (a re-sent piece of the
/// put before, after a restart), its own last bytes come once its count is done; credited to
/// the next header, they would end that one's count early in turn, at every later put. The
/// cost where the credit was right: the next put's own payload, should it too come ahead of
/// its header past the header wait, is not credited, and that put's count does not end (its
/// slot expects payload until the put after: a stale tail kept, never one deallocated).
const ABSORBED: u64 = 1 << 48;

/// The count of a `remaining` word.
fn count_of(word: u64) -> u32 {
    (word & COUNT) as u32
}

/// `word` with its count changed by `f` (None: unchanged), its generation kept.
fn with_count(word: u64, f: impl FnOnce(u32) -> Option<u32>) -> Option<u64> {
    f(count_of(word)).map(|c| (word & !COUNT) | u64::from(c))
}

/// `bytes` as a count of `remaining`: 512-byte sectors, rounded up. A payload's pieces meet
/// on sector boundaries (requests are whole sectors, and `add` takes no `block_align` below
/// the drive's block), so only the last one rounds.
fn sectors(bytes: u64) -> u32 {
    bytes.div_ceil(512).min(u64::from(CREDIT - 1)) as u32
}

fn zeroed_u64(n: usize) -> Box<[AtomicU64]> {
    const _: () = assert!(std::mem::align_of::<AtomicU64>() == std::mem::align_of::<u64>());
    const _: () = assert!(std::mem::size_of::<AtomicU64>() == std::mem::size_of::<u64>());
    // Zeroed allocation: pages are only touched when used (a 30 M-slot table costs nothing until
    // slots are written).
    let b = vec![0u64; n].into_boxed_slice();
    // SAFETY: AtomicU64 has the size, alignment and bit validity of u64 (asserted above).
    unsafe { Box::from_raw(Box::into_raw(b) as *mut [AtomicU64]) }
}

fn zeroed_u16(n: usize) -> Box<[AtomicU16]> {
    const _: () = assert!(std::mem::align_of::<AtomicU16>() == std::mem::align_of::<u16>());
    let b = vec![0u16; n].into_boxed_slice();
    // SAFETY: AtomicU16 has the size, alignment and bit validity of u16 (asserted above).
    unsafe { Box::from_raw(Box::into_raw(b) as *mut [AtomicU16]) }
}

/// A checkpoint container header block written through fdpblk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointEvent {
    pub copy: u8,
    /// The header LMCache wrote; `None` for any other write, discard or write-zeroes that
    /// touched the header block (the state thread reads the block back).
    pub header: Option<CheckpointHeader>,
    /// The checkpoint epoch this header write started (valid headers only).
    pub epoch: u32,
    /// Writes to this container's header block planned in this run, this one included
    /// (what [`SlotTable::begin_container_zeroing`] expects).
    pub writes: u64,
    /// [`SlotTable::checkpoint_reads`] when the write was planned: a read of a header block
    /// after it (a LMCache opening the device, perhaps with another geometry) is one the
    /// state thread cannot rule out, however soon it reads the checkpoint back.
    pub reads: u64,
}

/// What one request wrote of the checkpoint containers, reported with
/// [`SlotTable::containers_written`] once it ended (completed or failed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContainerWrites {
    /// Containers (bit `copy`) whose payload it changes.
    pub payloads: u8,
    /// Per container: its header block's writes it counted with [`SlotTable::checkpoint_header`].
    pub header_blocks: [u32; 2],
}

impl ContainerWrites {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Counts a write of container `copy`'s header block that [`SlotTable::checkpoint_header`]
    /// counted.
    pub fn header_block(&mut self, copy: u8) {
        let n = &mut self.header_blocks[usize::from(copy & 1)];
        *n = n.saturating_add(1);
    }
}

#[derive(Debug, Default)]
struct Mailbox {
    events: Vec<CheckpointEvent>,
    /// The last valid header written to each container, with its epoch.
    last: [Option<(CheckpointHeader, u32)>; 2],
    /// The overflow estimate crossed its threshold on the data path.
    alarm: bool,
    /// [`SlotTable::wake`] was called since the last wait: a wake that lands between the
    /// state thread's look at its stop flag and its wait is not lost.
    woken: bool,
}

/// Dense per-slot records, indexed by slot number.
#[derive(Debug)]
pub struct SlotTable {
    identity: Box<[AtomicU64]>,
    meta: Box<[AtomicU64]>,
    life: Box<[AtomicU64]>,
    /// Payload bytes of the current header not yet written (in the low half; the high half is
    /// the generation of the header that set it); 0 = the put is complete, so a further
    /// payload write most likely belongs to a new put whose header is still to come.
    remaining: Box<[AtomicU64]>,
    /// Set by the first LMCache slot header: before it (or with a foreign writer such as fio)
    /// no payload waits for a header that will never come.
    headers_seen: AtomicBool,
    history: IdentityHistory,
    tags: TagTable,
    /// Valid checkpoint header writes seen (SeqCst: the order against slot writes' stamps is
    /// what the deallocation rule relies on).
    epoch: AtomicU32,
    mailbox: Mutex<Mailbox>,
    wake: Condvar,
    /// Per container: a payload write planned since the state thread last looked.
    touched: [AtomicBool; 2],
    /// Per container: a payload write landed (or failed) since the state thread's reader of
    /// an incomplete checkpoint last looked.
    landed: [AtomicBool; 2],
    /// Per container: writes to its header block planned in this run, times two, plus one
    /// while the state thread zeroes that block (early evictions, `src/watch/evictions.rs`).
    container_guard: [AtomicU64; 2],
    /// Per container: writes to its header block counted in `container_guard` that have
    /// ended (completed or failed). A read-back may return a header whose write is still in
    /// flight, and a flush covers only completed commands: a checkpoint is read back only
    /// once its header write ended.
    header_ended: [AtomicU64; 2],
    /// One bit per persistence page of slot records.
    dirty: Box<[AtomicU64]>,
    header_writes: AtomicU64,
    returning: AtomicU64,
    /// `header_writes` value at which the overflow estimate reaches its threshold.
    alarm_at: AtomicU64,
    /// Reads of a checkpoint container's header block through the device: LMCache reads both
    /// when it opens the device (a restart, possibly with another geometry).
    checkpoint_reads: AtomicU64,
    /// Per container: `checkpoint_reads` after its header block's last read, and
    /// `header_writes` then (what LMCache had put when it read it).
    header_read: [(AtomicU64, AtomicU64); 2],
    /// One bit per slot: a header with a stale tail behind it completed since the state
    /// thread last looked (early stale-tail deallocation; no lock on the data path).
    completed: Box<[AtomicU64]>,
    /// Per slot: how far into the slot payload bytes reach that no known header expected (a
    /// put's payload placed before its header arrived, the header wait over, or bytes past the
    /// current payload), in the pipeline's orphan units (blocks, rounded up); 0 when there are
    /// none. They may be
    /// a later put's data, so no stale tail of the slot goes until a header whose payload
    /// reaches as far settles them (they are its own, or it overwrites them). A whole-slot
    /// deallocation does not: a write racing its end could lose its mark. Not persisted: they
    /// matter only while the LMCache process that wrote them can still send the header, i.e.
    /// across a ublk recovery, where `unseen` stands in for them.
    orphans: Box<[AtomicU16]>,
    /// One bit per slot: it may hold bytes written where this table did not see them (a
    /// recovered daemon's predecessor served writes after its last persist; a learned layout
    /// served writes unclassified), so a later put's payload may be there ahead of its
    /// header. Counts as orphan bytes to the slot's end, until a header whose payload reaches
    /// the slot's end, or a confirmation of the slot's contents by a checkpoint LMCache
    /// snapshotted after this run began ([`SlotTable::settle_unseen`]).
    unseen: Box<[AtomicU64]>,
}

impl Default for SlotTable {
    fn default() -> Self {
        Self::new(0)
    }
}

impl SlotTable {
    pub fn new(max_slots: u64) -> Self {
        let n = max_slots as usize;
        let pages = max_slots.div_ceil(RECORDS_PER_PAGE) as usize;
        Self {
            identity: zeroed_u64(n),
            meta: zeroed_u64(n),
            life: zeroed_u64(n),
            remaining: zeroed_u64(n),
            headers_seen: AtomicBool::new(false),
            history: IdentityHistory::new(IdentityHistory::capacity_for(max_slots)),
            tags: TagTable::default(),
            epoch: AtomicU32::new(0),
            mailbox: Mutex::new(Mailbox::default()),
            wake: Condvar::new(),
            touched: [AtomicBool::new(false), AtomicBool::new(false)],
            landed: [AtomicBool::new(false), AtomicBool::new(false)],
            container_guard: [AtomicU64::new(0), AtomicU64::new(0)],
            header_ended: [AtomicU64::new(0), AtomicU64::new(0)],
            dirty: zeroed_u64(pages.div_ceil(64)),
            header_writes: AtomicU64::new(0),
            returning: AtomicU64::new(0),
            alarm_at: AtomicU64::new(u64::MAX),
            checkpoint_reads: AtomicU64::new(0),
            header_read: [(AtomicU64::new(0), AtomicU64::new(0)), (AtomicU64::new(0), AtomicU64::new(0))],
            completed: zeroed_u64(n.div_ceil(64)),
            orphans: zeroed_u16(n),
            unseen: zeroed_u64(n.div_ceil(64)),
        }
    }

    /// [`Self::heap_bytes`] of a table of `max_slots` slots, before it is made: what a layout
    /// costs in memory (about 37 bytes a slot).
    pub fn heap_bytes_for(max_slots: u64) -> u64 {
        let history = IdentityHistory::capacity_for(max_slots);
        let history = history + history.div_ceil(history::HISTORY_PER_PAGE).div_ceil(64);
        let pages = max_slots.div_ceil(RECORDS_PER_PAGE);
        (4 * max_slots + history + pages.div_ceil(64) + 2 * max_slots.div_ceil(64)) * 8 + 2 * max_slots
    }

    /// Heap bytes this table holds (slot records, history, bitmaps; tag names excluded).
    pub fn heap_bytes(&self) -> usize {
        self.identity.len() * 8 + self.meta.len() * 8 + self.life.len() * 8 + self.remaining.len() * 8
            + self.history.heap_bytes()
            + self.dirty.len() * 8
            + self.completed.len() * 8
            + self.orphans.len() * 2
            + self.unseen.len() * 8
    }

    pub fn get(&self, slot: u64) -> Option<SlotEntry> {
        let i = usize::try_from(slot).ok()?;
        let meta = self.meta.get(i)?.load(Ordering::Acquire);
        let e = unpack(self.identity[i].load(Ordering::Relaxed), meta, self.life[i].load(Ordering::Acquire));
        e.has_header().then_some(e)
    }

    /// The generation of the slot's current header (one load, for the data path); None
    /// before any header.
    pub fn generation(&self, slot: u64) -> Option<u16> {
        let i = usize::try_from(slot).ok()?;
        Some(meta_generation(self.meta.get(i)?.load(Ordering::Acquire))).filter(|&g| g != 0)
    }

    /// The record whether or not a header was seen (for persistence and the state thread).
    pub fn entry(&self, slot: u64) -> Option<SlotEntry> {
        let i = usize::try_from(slot).ok()?;
        let identity = self.identity.get(i)?.load(Ordering::Acquire);
        let meta = self.meta[i].load(Ordering::Acquire);
        Some(unpack(identity, meta, self.life[i].load(Ordering::Acquire)))
    }

    fn index(&self, slot: u64) -> Option<usize> {
        usize::try_from(slot).ok().filter(|&i| i < self.meta.len())
    }

    /// The current checkpoint epoch (valid checkpoint header writes seen).
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// A read of container `copy`'s header block was served.
    pub fn note_checkpoint_read(&self, copy: u8) {
        let n = self.checkpoint_reads.fetch_add(1, Ordering::SeqCst) + 1;
        let (at, puts) = &self.header_read[usize::from(copy.min(1))];
        puts.store(self.header_writes(), Ordering::SeqCst);
        at.store(n, Ordering::SeqCst);
    }
    /// Both containers' header blocks were read after `checkpoint_reads` was `since`, one
    /// right after the other with no put between, as LMCache's loader reads them when it
    /// opens the device (a lone read of one, a probe at offset 0, never pairs with an old read
    /// of the other): `header_writes` then (puts before it are not in the index a restarted
    /// LMCache loaded).
    pub fn both_headers_read_since(&self, since: u64) -> Option<u64> {
        let [(a0, p0), (a1, p1)] = &self.header_read;
        let (at, puts) = ([a0, a1].map(|a| a.load(Ordering::SeqCst)), [p0, p1].map(|p| p.load(Ordering::SeqCst)));
        // Adjacent: at most one other header-block read in between (a retried read).
        (at[0] > since && at[1] > since && at[0].abs_diff(at[1]) <= 2 && puts[0] == puts[1]).then_some(puts[0])
    }
    /// Reads of checkpoint header blocks served so far.
    pub fn checkpoint_reads(&self) -> u64 {
        self.checkpoint_reads.load(Ordering::SeqCst)
    }

    /// Every write to a slot (header, payload, padding, or a discard/write-zeroes over it):
    /// stamps it with the current epoch and drops its confirmation; unless `payload_only`
    /// (a write inside the current header's payload), it also drops `TAIL_DONE`,
    /// `STALE_TAIL` and `HEADER_DONE`. `put` (a header) also counts a put, resets the load
    /// count, sets state, tag and the returning flag, and sets `STALE_TAIL` or `TAIL_DONE`.
    /// Returns true when a trim of the slot is in progress: the caller must not submit its
    /// write before [`trimming`](Self::trimming) turns false.
    fn touch(&self, i: usize, put: Option<(u16, bool, u64)>, payload_only: bool) -> bool {
        let epoch = self.epoch.load(Ordering::SeqCst);
        let keep = if payload_only { !0 } else { !(life::TAIL_DONE | life::STALE_TAIL | life::HEADER_DONE) };
        let old = self.life[i]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
                let mut n = life::with_stamp(l, epoch) & !life::CONFIRMED & keep;
                if life::state(n) != SlotState::Unknown {
                    n = life::with_state(n, SlotState::Unknown);
                }
                if let Some((tag, seen, tail_bits)) = put {
                    let writes = ((l >> life::WRITES_SHIFT) as u8).saturating_add(1);
                    n = (n & !(0xff << life::WRITES_SHIFT) & !life::READS_MASK) | (u64::from(writes) << life::WRITES_SHIFT);
                    n = life::with_tag(n, tag);
                    n = if seen { n | life::SEEN_BEFORE } else { n & !life::SEEN_BEFORE };
                    n |= tail_bits;
                }
                Some(n)
            })
            .unwrap_or_else(|l| l);
        if life::state(old) != SlotState::Unknown || put.is_some() {
            self.mark_dirty(i as u64);
        }
        old & life::TRIMMING != 0
    }

    /// Records a new header written to `slot` on `handle`; returns its generation (for
    /// [`header_completed`](Self::header_completed)), 0 for a slot out of range.
    pub fn record_header(&self, slot: u64, header: &SlotHeader, handle: Handle) -> u16 {
        let Some(i) = self.index(slot) else { return 0 };
        let old_life = self.life[i].load(Ordering::Relaxed);
        let old = unpack(self.identity[i].load(Ordering::Acquire), self.meta[i].load(Ordering::Relaxed), old_life);
        let same = old.has_header() && old.identity == header.identity;
        // Bytes past the new payload may be stale unless the slot was deallocated whole, or
        // its last contents were no longer and had their own tail deallocated.
        let stale = old.state != SlotState::Trimmed
            && (!old.has_header() || old_life & life::TAIL_DONE == 0 || old.payload_len > header.payload_len);
        // Bytes no header expected lie in the slot: its tail is neither stale nor done.
        let tail_bits = if self.is_orphan(slot) {
            0
        } else if stale {
            life::STALE_TAIL
        } else {
            life::TAIL_DONE
        };
        if old.has_header() && !same && old.identity != 0 {
            self.history.insert(old.identity, old.tag);
        }
        // The same key put again into the slot it was evicted from returns too.
        let back = same && matches!(old.state, SlotState::Evicted | SlotState::Trimmed);
        let (seen, tag) = if same {
            (old.seen_before || back, old.tag)
        } else {
            match self.history.lookup(header.identity) {
                Some(tag) => (true, tag),
                None => (false, 0),
            }
        };
        if seen && (!same || back) {
            self.returning.fetch_add(1, Ordering::Relaxed);
        }
        let generation = match old.generation.wrapping_add(1) {
            0 => 1,
            g => g,
        };
        self.identity[i].store(header.identity, Ordering::Release);
        self.meta[i].store(pack(header.payload_len, handle, generation), Ordering::Release);
        // After the new identity is visible: a confirmation the state thread made from it
        // before this point is cleared here, and one made from the old identity is too.
        self.touch(i, Some((tag, seen, tail_bits)), false);
        // Last: a payload piece on another queue that sees the count also sees the new
        // header's handle, and a trim that ended before the touch cannot zero the count.
        // Bytes that came ahead of the header count as its own (if they were a later put's,
        // its count only ends early: the rest is placed as orphan bytes, which is safe, and is
        // no credit for the next header: `ABSORBED`).
        let prev = count_of(self.remaining[i].swap(u64::from(generation) << 32 | u64::from(sectors(header.payload_len)), Ordering::AcqRel));
        if prev & CREDIT != 0 {
            let ahead = prev & !CREDIT;
            let _ = self.remaining[i].fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                with_count(w, |v| (v & CREDIT == 0).then(|| v.saturating_sub(ahead))).map(|w| if ahead > 0 { w | ABSORBED } else { w })
            });
        }
        if !self.headers_seen.load(Ordering::Relaxed) {
            self.headers_seen.store(true, Ordering::Relaxed);
        }
        let n = self.header_writes.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.alarm_at.load(Ordering::Relaxed) {
            self.alarm_at.store(u64::MAX, Ordering::Relaxed);
            self.mailbox.lock().unwrap_or_else(|e| e.into_inner()).alarm = true;
            self.wake.notify_all();
        }
        generation
    }

    /// A write to `slot` that is not a valid header (payload, padding, a torn header) or a
    /// discard / write-zeroes over it. Returns true when the caller must wait for a trim.
    pub fn note_write(&self, slot: u64) -> bool {
        self.index(slot).is_some_and(|i| self.touch(i, None, false))
    }

    /// A write that stays inside the current header's payload (rounded up to `block_align`):
    /// like [`note_write`](Self::note_write), but a deallocated tail stays deallocated.
    pub fn note_payload_write(&self, slot: u64) -> bool {
        self.index(slot).is_some_and(|i| self.touch(i, None, true))
    }

    /// The write of header `generation` of `slot` completed: if it is still the slot's
    /// current header and may have a stale tail, the slot is marked `HEADER_DONE` and
    /// flagged for the state thread.
    pub fn header_completed(&self, slot: u64, generation: u16) {
        let Some(i) = self.index(slot) else { return };
        let current = |t: &Self| meta_generation(t.meta[i].load(Ordering::Acquire)) == generation;
        if !current(self) {
            return;
        }
        // Set only while STALE_TAIL is: a write past the payload in between clears it, and
        // must not be followed by a HEADER_DONE that would let the round cut that write.
        let set = self.life[i].fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| (l & life::STALE_TAIL != 0).then_some(l | life::HEADER_DONE));
        if set.is_err() {
            return;
        }
        // A newer header clears the bit after storing its generation; if that store came
        // first, the bit set here belongs to the old header: take it back.
        if !current(self) {
            self.life[i].fetch_and(!life::HEADER_DONE, Ordering::AcqRel);
            return;
        }
        self.completed[i / 64].fetch_or(1 << (i % 64), Ordering::AcqRel);
    }

    /// Payload bytes no known header expected were placed in `slot`, up to `end` (orphan
    /// units into the slot, rounded up, at least 1; see `orphans`).
    pub fn note_orphan(&self, slot: u64, end: u16) {
        if let Some(o) = self.index(slot).map(|i| &self.orphans[i]) {
            o.fetch_max(end.max(1), Ordering::AcqRel);
        }
    }
    /// A header whose payload reaches `covered` (orphan units, rounded down): the orphan bytes
    /// up to there are its own, or it overwrites them.
    /// `u16::MAX`: the payload reaches the slot's end, which settles unseen bytes too.
    pub fn settle_orphans(&self, slot: u64, covered: u16) {
        if let Some(o) = self.index(slot).map(|i| &self.orphans[i]) {
            let _ = o.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| (v != 0 && v <= covered).then_some(0));
        }
        if covered == u16::MAX {
            self.settle_unseen(slot);
        }
    }
    /// Every slot may hold bytes written unseen (see `unseen`).
    pub fn orphans_everywhere(&self) {
        for w in self.unseen.iter() {
            w.store(u64::MAX, Ordering::Release);
        }
    }
    /// The contents of `slot` were confirmed by a checkpoint that LMCache snapshotted after
    /// this run began: any put to the slot after those contents came after that snapshot,
    /// so its bytes came through this table. The unseen mark goes.
    pub fn settle_unseen(&self, slot: u64) {
        if let Some(i) = self.index(slot) {
            let w = &self.unseen[i / 64];
            if w.load(Ordering::Relaxed) & (1 << (i % 64)) != 0 {
                w.fetch_and(!(1 << (i % 64)), Ordering::AcqRel);
            }
        }
    }
    pub fn is_orphan(&self, slot: u64) -> bool {
        self.index(slot).is_some_and(|i| {
            self.orphans[i].load(Ordering::Acquire) != 0 || self.unseen[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0
        })
    }

    /// The slots flagged by [`header_completed`](Self::header_completed) since the last
    /// call, ascending.
    pub fn take_completed_headers(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (w, word) in self.completed.iter().enumerate() {
            let mut bits = if word.load(Ordering::Relaxed) == 0 { 0 } else { word.swap(0, Ordering::AcqRel) };
            while bits != 0 {
                out.push(w as u64 * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
        out
    }

    /// Clears every slot's `TRIMMING` and both containers' zeroing bits: the state thread
    /// that set them is gone (a panic), and the writes they hold must go on.
    pub fn release_holds(&self) {
        for l in self.life.iter() {
            if l.load(Ordering::Acquire) & life::TRIMMING != 0 {
                l.fetch_and(!life::TRIMMING, Ordering::AcqRel);
            }
        }
        for copy in 0..2 {
            self.end_container_zeroing(copy);
        }
    }

    /// True while the state thread deallocates `slot`.
    pub fn trimming(&self, slot: u64) -> bool {
        self.index(slot).is_some_and(|i| self.life[i].load(Ordering::Acquire) & life::TRIMMING != 0)
    }

    /// A load of the slot's contents (a read starting at the payload).
    ///
    /// The record's page is saved again when the count reaches 1, 2, 3, 4 or a power of two
    /// (or 255), so a restart brings back a slot's loads exactly up to 4 and within a factor of
    /// two above, as of the last persist: enough for placement by load classes, without a page
    /// write per load.
    /// Counts a load of the slot's current contents; returns the loads of them so far
    /// (saturating at 255; 0 for a slot outside the table).
    pub fn note_read(&self, slot: u64) -> u8 {
        let Some(i) = self.index(slot) else { return 0 };
        let counted = self.life[i].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
            let r = ((l & life::READS_MASK) >> life::READS_SHIFT) as u8;
            (r < u8::MAX).then(|| (l & !life::READS_MASK) | (u64::from(r + 1) << life::READS_SHIFT))
        });
        match counted {
            Ok(before) => {
                let n = ((before & life::READS_MASK) >> life::READS_SHIFT) as u8 + 1;
                if reads_worth_saving(n) {
                    self.mark_dirty(slot);
                }
                n
            }
            Err(_) => u8::MAX,
        }
    }

    /// True once any LMCache slot header was written through this table.
    pub fn headers_seen(&self) -> bool {
        self.headers_seen.load(Ordering::Relaxed)
    }

    /// Counts `bytes` of payload written for header `generation` (from [`Self::expected_payload`]):
    /// not if another queue's newer header has taken the count meanwhile, whose own payload
    /// it is not.
    pub fn payload_written(&self, slot: u64, bytes: u64, generation: u16) {
        if let Some(r) = usize::try_from(slot).ok().and_then(|i| self.remaining.get(i)) {
            let b = sectors(bytes);
            let _ = r.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                with_count(w, |v| (v & CREDIT == 0 && (w >> 32) as u16 == generation).then(|| v.saturating_sub(b)))
            });
        }
    }

    /// The generation of the slot's current header when it still expects payload bytes.
    pub fn expected_payload(&self, slot: u64) -> Option<u16> {
        let w = usize::try_from(slot).ok().and_then(|i| self.remaining.get(i))?.load(Ordering::Acquire);
        let v = count_of(w);
        (v > 0 && v & CREDIT == 0).then_some((w >> 32) as u16)
    }

    /// True when the slot's current header still expects payload bytes.
    pub fn expects_payload(&self, slot: u64) -> bool {
        self.expected_payload(slot).is_some()
    }

    /// True when the slot's current header expects no more payload and took bytes that came
    /// ahead of it as its own ([`ABSORBED`]): payload within it that comes now was counted
    /// early, and is not a credit for the next header.
    pub fn count_ended_on_a_credit(&self, slot: u64) -> bool {
        usize::try_from(slot).ok().and_then(|i| self.remaining.get(i)).is_some_and(|r| {
            let w = r.load(Ordering::Acquire);
            w & ABSORBED != 0 && count_of(w) == 0
        })
    }

    /// Counts `bytes` of payload placed in `slot` while no header expected any: the next
    /// header takes them as written (the usual case: its own payload, ahead of it).
    pub fn payload_ahead(&self, slot: u64, bytes: u64) {
        if let Some(r) = usize::try_from(slot).ok().and_then(|i| self.remaining.get(i)) {
            let b = sectors(bytes);
            let _ = r.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                with_count(w, |v| (v == 0 || v & CREDIT != 0).then(|| CREDIT | (v & !CREDIT).saturating_add(b).min(CREDIT - 1)))
            });
        }
    }

    pub fn len(&self) -> usize {
        self.meta.len()
    }
    pub fn is_empty(&self) -> bool {
        self.meta.is_empty()
    }

    // ---- checkpoint events (data path → state thread) ----

    /// A write (or discard) touched container `copy`'s header block; `header` is the valid
    /// LMCache header it carried. A valid header starts a new epoch before the write goes out.
    /// Returns true when the state thread is zeroing that block: the caller must not submit
    /// the write before [`SlotTable::container_zeroing`] is false.
    #[must_use]
    pub fn checkpoint_header(&self, copy: u8, header: Option<CheckpointHeader>) -> bool {
        let mut m = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        // Counted before the write goes out, so the state thread's zeroing CAS either fails
        // or is seen here (the same handshake as a slot's TRIMMING).
        let guard = self.container_guard[usize::from(copy & 1)].fetch_add(2, Ordering::SeqCst);
        let writes = (guard >> 1) + 1;
        // The same header written again (a re-issued or repeated write) is not a new
        // checkpoint: it must not start an epoch, or one checkpoint would count as two.
        // It keeps the epoch of its first write: its snapshot is no newer than that.
        let c = usize::from(copy & 1);
        let epoch = match (header, m.last[c]) {
            (Some(h), Some((last, e))) if last == h => e,
            (Some(h), _) => {
                let e = self.epoch.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
                m.last[c] = Some((h, e));
                e
            }
            (None, _) => self.epoch(),
        };
        // A newer write to a header block supersedes an older one not yet taken (the state
        // thread would drop it too), so the mailbox holds at most one event per container
        // even when nothing drains it (trace replay).
        m.events.retain(|e| e.copy != copy & 1);
        let reads = self.checkpoint_reads();
        m.events.push(CheckpointEvent { copy: copy & 1, header, epoch, writes, reads });
        drop(m);
        self.wake.notify_all();
        guard & 1 != 0
    }

    /// A write (or discard) to container `copy`'s header block that leaves the header's 32
    /// bytes alone: the page cache writing back the second page of an 8 KiB header block
    /// apart from the first. LMCache's loader reads only those bytes of the block, so the
    /// checkpoint there is unchanged: no event, which would supersede the header's own, and
    /// not counted as a write, which would refuse the state thread's zeroing of the block
    /// until LMCache's next header there (a zeroing racing it writes zeros over zeros).
    /// True while fdpblk zeroes the block: the write waits, as [`SlotTable::checkpoint_header`]'s.
    #[must_use]
    pub fn checkpoint_block_padding(&self, copy: u8) -> bool {
        self.container_zeroing(copy)
    }

    /// Starts zeroing container `copy`'s header block, if no write to it was planned since
    /// the state thread's view of it (`writes`, from its last event; 0 without one). Every
    /// later write is held by its queue until [`SlotTable::end_container_zeroing`].
    pub fn begin_container_zeroing(&self, copy: u8, writes: u64) -> bool {
        let g = &self.container_guard[usize::from(copy & 1)];
        g.compare_exchange(writes << 1, (writes << 1) | 1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Ends a zeroing begun by [`SlotTable::begin_container_zeroing`].
    pub fn end_container_zeroing(&self, copy: u8) {
        self.container_guard[usize::from(copy & 1)].fetch_and(!1, Ordering::SeqCst);
    }

    /// True while the state thread zeroes container `copy`'s header block.
    pub fn container_zeroing(&self, copy: u8) -> bool {
        self.container_guard[usize::from(copy & 1)].load(Ordering::SeqCst) & 1 != 0
    }

    /// A write to container `copy`'s payload is planned.
    pub fn container_touched(&self, copy: u8) {
        let t = &self.touched[usize::from(copy & 1)];
        if !t.load(Ordering::Relaxed) {
            t.store(true, Ordering::Relaxed);
        }
    }

    /// A request's writes to the checkpoint containers reached the device, or failed (part of
    /// one may have landed). The state thread reads a checkpoint whose payload did not match
    /// its CRC again only after a write to it, and one planned before that read may land after
    /// it: the landed flag brings the read that finds it. A header block's write counts as
    /// ended ([`SlotTable::header_writes_ended`]), and lands as a payload write does.
    pub fn containers_written(&self, w: ContainerWrites) {
        for copy in 0..2u8 {
            let c = usize::from(copy);
            let headers = u64::from(w.header_blocks[c]);
            if headers > 0 {
                // Release: the state thread that sees the count, then reads, comes after the
                // write's completion.
                self.header_ended[c].fetch_add(headers, Ordering::Release);
            }
            if w.payloads & (1 << copy) != 0 || headers > 0 {
                self.landed[c].store(true, Ordering::Release);
            }
        }
    }

    /// Writes (and discards) of container `copy`'s header block counted by
    /// [`SlotTable::checkpoint_header`] that have ended; a [`CheckpointEvent`]'s `writes`
    /// are all ended once this reaches them (it counts no more than were planned).
    pub fn header_writes_ended(&self, copy: u8) -> u64 {
        self.header_ended[usize::from(copy & 1)].load(Ordering::Acquire)
    }

    /// Takes and clears the payload-touched flag of container `copy` (a write planned).
    pub fn take_touched(&self, copy: u8) -> bool {
        self.touched[usize::from(copy & 1)].swap(false, Ordering::AcqRel)
    }

    /// Takes and clears the payload-landed flag of container `copy` (a write completed).
    pub fn take_landed(&self, copy: u8) -> bool {
        self.landed[usize::from(copy & 1)].swap(false, Ordering::AcqRel)
    }

    /// Takes the pending checkpoint events and the alarm flag.
    pub fn take_events(&self) -> (Vec<CheckpointEvent>, bool) {
        let mut m = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        (std::mem::take(&mut m.events), std::mem::take(&mut m.alarm))
    }

    /// True when checkpoint events wait in the mailbox.
    pub fn events_pending(&self) -> bool {
        !self.mailbox.lock().unwrap_or_else(|e| e.into_inner()).events.is_empty()
    }

    /// Waits up to `timeout` for a checkpoint event, an alarm or [`wake`](Self::wake).
    pub fn wait_events(&self, timeout: Duration) {
        let mut m = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        if m.events.is_empty() && !m.alarm && !m.woken {
            m = match self.wake.wait_timeout(m, timeout) {
                Ok((m, _)) => m,
                Err(e) => e.into_inner().0,
            };
        }
        m.woken = false;
    }

    /// Wakes the state thread (shutdown).
    pub fn wake(&self) {
        let mut m = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        m.woken = true;
        self.wake.notify_all();
    }

    /// Header writes (puts) seen since the table was created.
    pub fn header_writes(&self) -> u64 {
        self.header_writes.load(Ordering::Relaxed)
    }
    /// Puts of an identity found in the history (returning keys).
    pub fn returning(&self) -> u64 {
        self.returning.load(Ordering::Relaxed)
    }
    /// Raise the overflow alarm once `header_writes` reaches `at` (u64::MAX: never).
    pub fn set_alarm_at(&self, at: u64) {
        self.alarm_at.store(at, Ordering::Relaxed);
        if at <= self.header_writes() {
            self.alarm_at.store(u64::MAX, Ordering::Relaxed);
            self.mailbox.lock().unwrap_or_else(|e| e.into_inner()).alarm = true;
        }
    }

    // ---- state thread ----

    pub fn life(&self, slot: u64) -> u64 {
        self.index(slot).map_or(0, |i| self.life[i].load(Ordering::Acquire))
    }

    /// Replaces `life` if it still equals `expected` but for its load count, which the new
    /// word keeps; marks the record dirty. Loads change no contents, and the data path counts
    /// them without a CAS: a confirmation parsed while LMCache loaded the slot (its checkpoint
    /// load, or a lookup) would otherwise be lost until the next checkpoint. A `new` with
    /// another count than `expected` needs the exact word.
    pub fn cas_life(&self, slot: u64, expected: u64, new: u64) -> bool {
        let Some(i) = self.index(slot) else { return false };
        let keeps_count = (expected ^ new) & life::READS_MASK == 0;
        let ok = self.life[i]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| match cur ^ expected {
                0 => Some(new),
                _ if keeps_count && life::same_but_loads(cur, expected) => Some((new & !life::READS_MASK) | (cur & life::READS_MASK)),
                _ => None,
            })
            .is_ok();
        if ok && persisted_life(expected) != persisted_life(new) {
            self.mark_dirty(slot);
        }
        ok
    }

    /// Ends a trim begun by a CAS to `began` (which has `TRIMMING`): the slot becomes
    /// `Trimmed` unless it was written meanwhile; `TRIMMING` is cleared either way.
    pub fn end_trim(&self, slot: u64, began: u64, trimmed: bool) {
        let Some(i) = self.index(slot) else { return };
        // A payload count left by a put whose payload never all came (read before the CAS:
        // a new header stores its count only after its touch, which fails the CAS).
        let left = self.remaining[i].load(Ordering::Acquire);
        let done = life::with_state(began & !life::TRIMMING & !life::CONFIRMED, if trimmed { SlotState::Trimmed } else { life::state(began) });
        // A trimmed slot keeps its identity and the loads of its last contents: a restarted
        // daemon gives them back to `key-aware` (`place::resume`) for when the key returns.
        let done = if trimmed { done } else { done | (began & life::CONFIRMED) };
        // A load meanwhile (its read count) does not undo the trim; a write does.
        let unchanged = self.life[i]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                ((cur ^ began) & !life::READS_MASK == 0).then_some(if trimmed { (done & !life::READS_MASK) | (cur & life::READS_MASK) } else { cur & !life::TRIMMING })
            })
            .is_ok();
        if !unchanged {
            self.life[i].fetch_and(!life::TRIMMING, Ordering::AcqRel);
        }
        if trimmed && unchanged {
            self.clear_left_count(i, left);
        }
        self.mark_dirty(slot);
    }

    /// Clears the payload count `left` read before a trim, if the slot's `remaining` word is
    /// still that one: a put that came in after the trim ended keeps its own count, also one
    /// equal to the old (its header's generation is in the word).
    fn clear_left_count(&self, i: usize, left: u64) {
        if count_of(left) != 0 {
            let _ = self.remaining[i].compare_exchange(left, left & !(COUNT | ABSORBED), Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Ends a tail deallocation begun by a CAS to `began` (which has `TRIMMING`): `TRIMMING`
    /// is cleared, and when `done` the slot gets `TAIL_DONE` unless something but loads and
    /// the payload's own writes touched it meanwhile (a bit that made the deallocation safe,
    /// `CONFIRMED` or `HEADER_DONE`, is still set: either is cleared by any other write).
    pub fn end_tail_trim(&self, slot: u64, began: u64, done: bool) {
        let Some(i) = self.index(slot) else { return };
        let basis = began & (life::CONFIRMED | life::HEADER_DONE);
        let _ = self.life[i].fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
            let n = l & !life::TRIMMING;
            Some(if done && l & basis != 0 { (n & !life::STALE_TAIL) | life::TAIL_DONE } else { n })
        });
    }

    pub fn history(&self) -> &IdentityHistory {
        &self.history
    }
    pub fn tags(&self) -> &TagTable {
        &self.tags
    }
    /// (model, cache_salt) of a tag.
    pub fn tag_name(&self, tag: u16) -> Option<(String, String)> {
        self.tags.name(tag)
    }

    // ---- persistence ----

    /// Marks the record's page for the next persist. Always a release read-modify-write, even
    /// when the bit is set: the persist that takes the bit (acquire) must see the record as
    /// this thread left it, also on weakly ordered CPUs.
    pub fn mark_dirty(&self, slot: u64) {
        let page = slot / RECORDS_PER_PAGE;
        if let Some(w) = self.dirty.get((page / 64) as usize) {
            w.fetch_or(1u64 << (page % 64), Ordering::Release);
        }
    }

    /// Pages of slot records.
    pub fn record_pages(&self) -> u64 {
        (self.len() as u64).div_ceil(RECORDS_PER_PAGE)
    }

    /// Takes the dirty record pages (ascending), clearing their bits.
    pub fn take_dirty_pages(&self) -> Vec<u64> {
        take_bits(&self.dirty)
    }

    /// Marks record pages dirty again (a persist cycle that failed).
    pub fn redirty_pages(&self, pages: &[u64]) {
        for &p in pages {
            self.mark_dirty(p * RECORDS_PER_PAGE);
        }
    }

    /// The persisted form of a slot's record (24 bytes, little-endian): identity u64,
    /// payload_len u32, handle u16, generation u16, tag u16, flags u8 (state in bits 0-1,
    /// confirmed bit 2, seen_before bit 3), writes u8, reads u8, three zero bytes.
    pub fn encode_record(&self, slot: u64, out: &mut [u8]) {
        let e = self.entry(slot).unwrap_or_default();
        out[..RECORD_BYTES].fill(0);
        out[0..8].copy_from_slice(&e.identity.to_le_bytes());
        out[8..12].copy_from_slice(&(e.payload_len.min(u32::MAX as u64) as u32).to_le_bytes());
        out[12..14].copy_from_slice(&e.handle.to_le_bytes());
        out[14..16].copy_from_slice(&e.generation.to_le_bytes());
        out[16..18].copy_from_slice(&e.tag.to_le_bytes());
        out[18] = e.state as u8 | (u8::from(e.confirmed) << 2) | (u8::from(e.seen_before) << 3);
        out[19] = e.writes;
        out[20] = e.reads;
    }

    /// Restores a slot's record from its persisted form. Unless `trust_confirmed` (the state
    /// was saved by a clean shutdown), confirmations are dropped: the slot may have been
    /// written after the last persist. The write stamp becomes 0 (written before this run).
    pub fn restore_record(&self, slot: u64, rec: &[u8], trust_confirmed: bool) {
        let Some(i) = self.index(slot) else { return };
        let Some(rec) = rec.get(..RECORD_BYTES) else { return };
        let u16at = |o: usize| u16::from_le_bytes([rec[o], rec[o + 1]]);
        let identity = u64::from_le_bytes(rec[0..8].try_into().unwrap_or([0; 8]));
        let payload_len = u64::from(u32::from_le_bytes(rec[8..12].try_into().unwrap_or([0; 4])));
        let (handle, generation, tag) = (u16at(12), u16at(14), u16at(16));
        let flags = rec[18];
        let mut state = SlotState::from_bits(u64::from(flags));
        // Only live and evicted contents are confirmed (a record saying otherwise is corrupt,
        // and a later write would clear its flag without marking the page to be saved).
        let mut confirmed = flags & 4 != 0 && matches!(state, SlotState::Live | SlotState::Evicted);
        if !trust_confirmed {
            confirmed = false;
            // Without a trustworthy confirmation, live contents are only "once seen". (A slot
            // saved trimmed stays so: if it was written after that persist, the next shorter
            // put's tail is missed, which costs only the drive's copying of those bytes.)
            if state == SlotState::Live {
                state = SlotState::Unknown;
            }
        }
        let mut l = life::with_state(0, state) | (u64::from(rec[19]) << life::WRITES_SHIFT) | (u64::from(rec[20]) << life::READS_SHIFT);
        l = life::with_tag(l, tag);
        if confirmed {
            l |= life::CONFIRMED;
        }
        if flags & 8 != 0 {
            l |= life::SEEN_BEFORE;
        }
        self.life[i].store(l, Ordering::Release);
        self.identity[i].store(identity, Ordering::Release);
        self.meta[i].store(if generation == 0 { 0 } else { pack(payload_len, handle, generation) }, Ordering::Release);
        self.remaining[i].store(0, Ordering::Relaxed);
        if generation > 0 {
            self.headers_seen.store(true, Ordering::Relaxed);
        }
    }
}

/// The set bits of a bitmap (ascending), clearing them.
fn take_bits(words: &[AtomicU64]) -> Vec<u64> {
    let mut out = Vec::new();
    for (w, word) in words.iter().enumerate() {
        if word.load(Ordering::Relaxed) == 0 {
            continue;
        }
        let mut bits = word.swap(0, Ordering::AcqRel);
        while bits != 0 {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            out.push(w as u64 * 64 + u64::from(b));
        }
    }
    out
}

/// The bits of `life` whose change saves the record (the stamp and trimming are not
/// persisted; loads save it only at the counts [`SlotTable::note_read`] picks).
fn persisted_life(l: u64) -> u64 {
    l & (life::STATE_MASK | life::CONFIRMED | life::SEEN_BEFORE | (0xff << life::WRITES_SHIFT) | life::TAG_MASK)
}

impl crate::classify::PayloadLens for SlotTable {
    fn payload_len(&self, slot: u64) -> Option<u64> {
        self.get(slot).map(|e| e.payload_len)
    }
}

mod history;
mod tags;

pub use history::*;
pub use tags::*;

#[cfg(test)]
mod tests;
