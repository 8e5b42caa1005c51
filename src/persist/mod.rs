//! fdpblk's own persistent state, in the reserved tail of the backing device
//! ([`crate::frontend::config::reserved_tail_bytes`], never exported), written on the
//! policy's `OwnState` handle.
//!
//! What is kept: every slot's record (identity, payload_len, handle, generation, tag, state,
//! confirmation, returning flag, writes, reads), the identity history, the tag names, and
//! counters (trims per handle, evictions), and a deallocation pause. It is history only:
//! LMCache's data is addressed by LBA identity and never depends on it. Losing or corrupting
//! it costs fdpblk what it learnt (placement hints, pending deallocations), nothing else.
//!
//! ## Format (little-endian, 4096-byte blocks)
//!
//! ```text
//! region + 0      superblock copy 0
//! region + 4096   superblock copy 1
//! region + 8192   page area copy 0: logical pages 0..P, 4096 bytes each
//! ... + P*4096    page area copy 1: logical pages 0..P
//! ```
//! Logical pages: `R` pages of slot records (169 records of 24 bytes per page, slot order;
//! record layout in [`SlotTable::encode_record`]), then `H` pages of the identity history
//! (507 raw u64 entries per page), then [`TAG_PAGES`] pages of tag names (one byte stream:
//! u16 count, then per tag u8 length + model, u8 length + cache_salt).
//!
//! Every page: `magic "FDPBPG01"` (8) | instance u64 | seq u64 | logical index u32 | kind u32
//! (1 records, 2 history, 3 tags) | 4060 payload bytes | CRC-32 (zlib) of bytes 0..4092.
//!
//! Superblock: `magic "FDPBSB01"` | version u32 (1) | flags u32 (bit 0: written by a clean
//! shutdown; bit 1: the page digest is set; bit 2: the checkpoint headers are set) | seq u64 | instance u64 | block_align,
//! header_bytes, slot_bytes, meta_total_bytes, max_slots (u64 each) | R, H, T, history
//! capacity (u32 each) | trims, trim_bytes, evictions, persist cycles, own bytes written (u64
//! each) | handles u16, 6 zero bytes | trims per handle (u64 × handles, at most 64, from byte
//! 136) | at byte 648: the seq of LMCache's newest checkpoint fdpblk saw and when (u64 each;
//! Unix seconds, 0 = none; older superblocks hold zeros there) | at byte 664: the page digest
//! (u64: the wrapping sum, over every page with a committed version, of a 64-bit mix of its
//! index and that version's seq; older superblocks hold zero and flag bit 1 clear) | at byte
//! 672: a deallocation pause for the writeback delay in force when it was written (u32: the
//! checkpoint interval it was judged at, in milliseconds, 0 = none; u32 flags, bit 0: LMCache
//! was seen writing through the page cache) | at byte 680: since when LMCache had slot writes
//! that no checkpoint followed (u64 Unix seconds, 0 = none; older superblocks hold zero) |
//! at byte 688: the first 32 bytes of LMCache's checkpoint containers 0 and 1 as the clean
//! stop that wrote it read them (64 bytes; flag bit 2; a start trusts the confirmations only
//! where the containers still begin so) | zeros | CRC-32 of bytes 0..4092 at 4092. A later format keeps the region's place
//! ([`Region::tail`]), its two 4096-byte superblock copies first, the magic's first six bytes
//! (`FDPBSB`), the version at byte 8 and the CRC at 4092: this fdpblk then tells a newer
//! fdpblk's state from damage, and `add` (and `recover`) refuse it unless `add --force`
//! ([`newer_format`]).
//!
//! ## Persist cycle (incremental, crash-consistent)
//!
//! Cycle `n` writes only the pages that changed since cycle `n-1`, each into the copy that
//! does *not* hold the page's newest committed version, stamped with seq `n`; then a flush;
//! then superblock `n` into the superblock copy that does not hold the newest committed one
//! (not `n % 2`: a failed cycle skips its seq); then a flush. The superblock is the commit
//! record. A superblock whose flush failed but that reads back is taken as committed, and the
//! next cycle first flushes again before it writes anything, then reads it back once more: if
//! it is gone (the drive lost its cache), the superblock before it stands again, and that
//! cycle's pages are written again.
//!
//! Loading takes the valid superblock (magic, version, CRC, seq below 2^63) with the highest
//! seq `S` (of two with the same seq, the one not clean: see `mark_in_use`), and per
//! logical page the valid copy (magic, CRC, instance, index, kind) with the highest seq `<= S`;
//! a page without one is empty. Why that is the state of cycle `S` after a crash at any point:
//! the page copy holding a page's newest version committed at or before `S` is never written
//! by a later cycle (later cycles write the other copy), so it survives; copies written by
//! an unfinished cycle carry seq `> S` (or a bad CRC when torn) and are ignored; the flush
//! before the superblock means a durable superblock `n` implies durable pages of cycle `n`; a
//! torn superblock fails its CRC and the previous one is used. After loading, the next seq is
//! above every seq of a superblock or page copy that decodes (and, when the state starts
//! afresh, of a whole superblock of another version; a damaged copy's claim is not counted:
//! the copy is written again), and pages with a leftover copy above `S` are
//! rewritten by the first cycle, so an unfinished cycle's pages can never later pass as
//! committed.
//!
//! Nothing older than one persist interval is lost: a cycle runs every interval while
//! anything changed (with `--persist-interval-ms 0`, only at start and stop: a crash then
//! loses what changed since the start).
//!
//! Clean flag: the first cycle after loading (written before the device serves I/O) clears
//! it, or, while fdpblk still learns the layout, `mark_in_use` does before it serves; the last
//! cycle at shutdown sets it. Confirmations (that a slot's contents were seen
//! committed by LMCache) are trusted only from a clean state: after a crash the slot may have
//! been written after the last cycle. See [`crate::watch`].
//!
//! ## Unreadable and untrusted copies
//!
//! Each superblock carries a digest of the page versions it commits (index and seq of each):
//! a load whose chosen copies do not add up to it (a write the drive acknowledged and then
//! lost, or a copy rotted whole, header too, leaving an older copy that passes every check
//! of its own) does not trust the state; the next cycle commits what loaded.
//!
//! A page copy that does not read (a bad sector) may be the page's newest version or carry
//! an unknown seq: its other copy stands, the state is not trusted, and the first cycle
//! writes the unreadable copy again before any superblock with a new seq. Where neither copy
//! of a page reads, or more than eight copies do not (`MAX_UNREAD`), the state is dropped (a
//! new instance). A page that read in that pass and not when restored starts empty (which
//! only forgets); past eight such pages the rest are not tried. One superblock copy that does not read leaves the other standing,
//! untrusted; the next superblock goes into both copies. A state loaded untrusted that a
//! newer clean superblock might outrank (it was clean, or a superblock copy did not read or
//! decode) is marked in use ([`Persist::mark_in_use`], which marks a copy that does not read
//! too) before the first cycle overwrites any copy, and every record restored otherwise
//! than saved (a dropped confirmation) is saved again: neither a crash in that cycle nor a
//! later clean stop vouches for what this load did not trust. A fresh state's first cycle
//! marks an old superblock the same way: it writes pages over the old state's copies.
//!
//! Tag pages are written together, all with one seq; where the copies that load do not
//! share one (a page lost, or an older copy standing for one that did not read), the names
//! are cut at the first page that differs, and tags past the cut are cleared from the slot
//! records and the history: a tag interned later takes their numbers.

pub mod dev;

use crate::layout::checkpoint_header::CHECKPOINT_HEADER_LEN;
use crate::layout::Geometry;
use crate::place::Handle;
use crate::slot_table::{SlotTable, HISTORY_PER_PAGE, RECORDS_PER_PAGE, RECORD_BYTES};
use dev::{AlignedBuf, StateWriter};
use std::io;

pub const BLOCK: u64 = 4096;
const SB_MAGIC: &[u8; 8] = b"FDPBSB01";
/// What every format's superblock magic starts with: a later format keeps it, its version at
/// byte 8 and its CRC at [`CRC_AT`], so that an older fdpblk tells its state from damage
/// ([`newer_format`]) and never takes its device for one no fdpblk used.
const SB_MAGIC_PREFIX: &[u8; 6] = b"FDPBSB";
const PG_MAGIC: &[u8; 8] = b"FDPBPG01";
const VERSION: u32 = 1;
/// The own-state format this fdpblk reads and writes (the superblock's version).
pub const FORMAT: u32 = VERSION;
const PAGE_HEADER: usize = 32;
const CRC_AT: usize = 4092;
/// Payload bytes per page.
pub const PAGE_PAYLOAD: usize = CRC_AT - PAGE_HEADER;
/// Pages of tag names (`TagTable::MAX_BYTES` is what they hold).
pub const TAG_PAGES: u64 = 4;
/// Handles whose trim counts the superblock keeps.
pub const MAX_HANDLES: usize = 64;
/// Seqs from this one up are refused as corrupt: one cycle a millisecond would take 292
/// million years to get there, and the bound keeps `seq + 1` from overflowing. A cycle that
/// would write this seq fails instead, so a superblock is never written that a load refuses.
const MAX_SEQ: u64 = 1 << 63;
/// Where the superblock keeps the newest checkpoint seen: past the 64 handles' trim counts.
const CHECKPOINT_SEEN_AT: usize = 136 + 8 * MAX_HANDLES;
/// Where the superblock keeps the page digest ([`page_digest`]).
const DIGEST_AT: usize = CHECKPOINT_SEEN_AT + 16;
/// Where the superblock keeps a writeback pause ([`SavedPause`]).
const PAUSE_AT: usize = DIGEST_AT + 8;
/// Where the superblock keeps [`Counters::uncheckpointed_since`].
const UNCHECKPOINTED_AT: usize = PAUSE_AT + 8;
/// Where the superblock keeps [`Counters::checkpoint_headers`] (two 32-byte headers).
const CHECKPOINT_HEADERS_AT: usize = UNCHECKPOINTED_AT + 8;
/// Superblock flags: the state was saved by a clean stop; a page digest is kept; the
/// checkpoint headers are kept.
const FLAG_CLEAN: u32 = 1;
const FLAG_DIGEST: u32 = 2;
const FLAG_CHECKPOINT_HEADERS: u32 = 4;
/// Largest run of pages written in one request.
const MAX_RUN: usize = 256;
/// Page copies that may fail to read before a load gives the saved state up.
const MAX_UNREAD: usize = 8;

const KIND_RECORDS: u32 = 1;
const KIND_HISTORY: u32 = 2;
const KIND_TAGS: u32 = 3;

/// Where the state lives on the backing device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub offset: u64,
    pub len: u64,
}

impl Region {
    /// The reserved tail of a backing device of `backing_bytes`, 4 KiB aligned.
    pub fn tail(backing_bytes: u64) -> Region {
        let start = backing_bytes.saturating_sub(crate::frontend::config::reserved_tail_bytes(backing_bytes));
        let offset = start.div_ceil(BLOCK) * BLOCK;
        Region { offset, len: (backing_bytes.saturating_sub(offset)) / BLOCK * BLOCK }
    }
}

/// Counters kept in the superblock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub trims: u64,
    pub trim_bytes: u64,
    pub evictions: u64,
    pub cycles: u64,
    pub own_bytes: u64,
    pub trims_by_handle: Vec<u64>,
    /// LMCache's newest checkpoint fdpblk saw (its seq) and when (Unix seconds): its age
    /// goes on across a daemon restart.
    pub checkpoint_seen: Option<(u64, u64)>,
    /// Deallocation was paused for the kernel's writeback delay: the next run pauses from its
    /// start until it has judged LMCache's interval itself (see `crate::watch`).
    pub writeback_pause: Option<SavedPause>,
    /// Since when (Unix seconds) LMCache had slot writes that no checkpoint after
    /// `checkpoint_seen` followed: a stalled checkpoint stays stalled across a daemon restart.
    pub uncheckpointed_since: Option<u64>,
    /// LMCache's two checkpoint headers (`LMCIDX01`, version, seq, length, CRC) as the last
    /// clean stop read them: a start trusts the saved confirmations only where the containers
    /// still hold these, so a program that wrote a checkpoint while fdpblk was stopped leaves
    /// none standing (slot writes without one are left to the per-slot header check). None
    /// where they could not be read, and while a run is under way (a clean stop records them).
    pub checkpoint_headers: Option<CheckpointHeaders>,
}

/// The first [`CHECKPOINT_HEADER_LEN`] of each of the two checkpoint containers.
pub type CheckpointHeaders = [[u8; CHECKPOINT_HEADER_LEN]; 2];

/// What the containers of `geom` on `dev` begin with now; None where one cannot be read.
pub fn read_checkpoint_headers(dev: &dyn StateWriter, geom: &Geometry) -> Option<CheckpointHeaders> {
    let mut out = [[0u8; CHECKPOINT_HEADER_LEN]; 2];
    let mut block = vec![0u8; (geom.block_align as usize).max(CHECKPOINT_HEADER_LEN)];
    for (copy, h) in out.iter_mut().enumerate() {
        dev.read_at(geom.container_offset(copy as u8), &mut block).ok()?;
        h.copy_from_slice(&block[..CHECKPOINT_HEADER_LEN]);
    }
    Some(out)
}

/// What a load compares a clean state's [`Counters::checkpoint_headers`] with.
#[derive(Clone, Copy, Debug)]
pub enum CheckpointsNow {
    /// What the containers hold now (None: they could not be read, so nothing is trusted).
    Read(Option<CheckpointHeaders>),
    /// Not compared: the state format's own tests, whose region lies where containers would.
    #[cfg(test)]
    NotCompared,
}

impl CheckpointsNow {
    /// What the containers of `geom` on `dev` begin with now.
    pub fn read(dev: &dyn StateWriter, geom: &Geometry) -> Self {
        CheckpointsNow::Read(read_checkpoint_headers(dev, geom))
    }
}

/// Why a clean state's confirmations do not hold for the checkpoints on the device now.
fn checkpoints_changed(saved: Option<&CheckpointHeaders>, now: CheckpointsNow) -> Option<String> {
    let now = match now {
        #[cfg(test)]
        CheckpointsNow::NotCompared => return None,
        CheckpointsNow::Read(None) => return Some("LMCache's checkpoint headers cannot be read to compare them with the clean stop's".into()),
        CheckpointsNow::Read(Some(h)) => h,
    };
    let Some(saved) = saved else {
        return Some("the clean stop did not record LMCache's checkpoint headers (an earlier fdpblk's state, or they could not be read then)".into());
    };
    // The seq LMCache's loader would see, or what else is there.
    let seq = |h: &[u8; CHECKPOINT_HEADER_LEN]| match crate::layout::checkpoint_header::CheckpointHeader::parse(h, u64::MAX) {
        Ok(c) => format!("seq {}", c.seq),
        Err(_) if h.iter().all(|&b| b == 0) => "zeroes".to_string(),
        Err(_) => "no checkpoint".to_string(),
    };
    let changed: Vec<String> = (0..2).filter(|&c| saved[c] != now[c]).map(|c| format!("container {c}: {} then, {} now", seq(&saved[c]), seq(&now[c]))).collect();
    (!changed.is_empty()).then(|| {
        format!(
            "LMCache's checkpoints changed while fdpblk was stopped ({}): a program wrote the backing device without fdpblk (run LMCache only on the ublk device, /dev/fdpblk/NAME)",
            changed.join("; ")
        )
    })
}

/// A deallocation pause for the writeback delay, as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedPause {
    /// The checkpoint interval it was judged at, in milliseconds (at least 1).
    pub interval_ms: u32,
    /// LMCache was seen writing through the page cache (not only "could not tell").
    pub buffered: bool,
}

impl SavedPause {
    /// The checkpoint interval it was judged at.
    pub fn interval(&self) -> std::time::Duration {
        std::time::Duration::from_millis(u64::from(self.interval_ms))
    }
}

impl Counters {
    pub fn count_trim(&mut self, handle: Handle, bytes: u64) {
        // Saturating: the counters come back from the device, where any value passes a CRC.
        self.trims = self.trims.saturating_add(1);
        self.trim_bytes = self.trim_bytes.saturating_add(bytes);
        let h = usize::from(handle).min(MAX_HANDLES - 1);
        if self.trims_by_handle.len() <= h {
            self.trims_by_handle.resize(h + 1, 0);
        }
        self.trims_by_handle[h] = self.trims_by_handle[h].saturating_add(1);
    }
}

/// The page layout for a slot table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub record_pages: u64,
    pub history_pages: u64,
    pub tag_pages: u64,
    pub history_capacity: u64,
}

impl Layout {
    pub fn of(slots: &SlotTable) -> Layout {
        Layout {
            record_pages: slots.record_pages(),
            history_pages: slots.history().pages(),
            tag_pages: TAG_PAGES,
            history_capacity: slots.history().capacity(),
        }
    }
    pub fn pages(&self) -> u64 {
        self.record_pages + self.history_pages + self.tag_pages
    }
    /// Bytes of region the layout needs.
    pub fn bytes(&self) -> u64 {
        2 * BLOCK + 2 * self.pages() * BLOCK
    }
}

/// A decoded superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub seq: u64,
    pub instance: u64,
    pub clean: bool,
    pub geometry: [u64; 5],
    pub layout: Layout,
    pub counters: Counters,
    /// The digest of the page versions it commits ([`page_digest`]); `None` in superblocks of
    /// fdpblk versions before it.
    pub digest: Option<u64>,
}

/// One page version's share of the digest: splitmix64 of its index and seq.
fn page_mix(index: u64, seq: u64) -> u64 {
    let mut z = (index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seq).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The digest of a state's page versions (`seqs[index]`, 0 = none): it tells a load whether
/// the copies it found are the versions the superblock committed. A copy the drive lost
/// after acknowledging its flush, or one rotted whole (header too), leaves an older version
/// that passes every other check.
fn page_digest(seqs: impl Iterator<Item = (u64, u64)>) -> u64 {
    seqs.filter(|&(_, q)| q > 0).fold(0u64, |d, (i, q)| d.wrapping_add(page_mix(i, q)))
}

fn geometry_key(g: &Geometry) -> [u64; 5] {
    [g.block_align, g.header_bytes, g.slot_bytes, g.meta_total_bytes, g.max_slots]
}

/// A [`geometry_key`] in words.
fn describe_geometry(key: [u64; 5]) -> String {
    let [block_align, header_bytes, slot_bytes, meta_total_bytes, max_slots] = key;
    format!("block_align {block_align}, header_bytes {header_bytes}, slot_bytes {slot_bytes}, meta_total_bytes {meta_total_bytes}, max_slots {max_slots}")
}

fn u32at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]))
}
fn u64at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]))
}

impl Superblock {
    pub fn encode(&self, b: &mut [u8]) {
        b[..BLOCK as usize].fill(0);
        b[0..8].copy_from_slice(SB_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        let c = &self.counters;
        let flags = if self.clean { FLAG_CLEAN } else { 0 }
            | if self.digest.is_some() { FLAG_DIGEST } else { 0 }
            | if c.checkpoint_headers.is_some() { FLAG_CHECKPOINT_HEADERS } else { 0 };
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        if let Some(d) = self.digest {
            b[DIGEST_AT..DIGEST_AT + 8].copy_from_slice(&d.to_le_bytes());
        }
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.instance.to_le_bytes());
        for (i, g) in self.geometry.iter().enumerate() {
            b[32 + 8 * i..40 + 8 * i].copy_from_slice(&g.to_le_bytes());
        }
        let l = &self.layout;
        for (i, v) in [l.record_pages, l.history_pages, l.tag_pages, l.history_capacity].iter().enumerate() {
            b[72 + 4 * i..76 + 4 * i].copy_from_slice(&(*v as u32).to_le_bytes());
        }
        for (i, v) in [c.trims, c.trim_bytes, c.evictions, c.cycles, c.own_bytes].iter().enumerate() {
            b[88 + 8 * i..96 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        let n = c.trims_by_handle.len().min(MAX_HANDLES);
        b[128..130].copy_from_slice(&(n as u16).to_le_bytes());
        for (i, v) in c.trims_by_handle.iter().take(n).enumerate() {
            b[136 + 8 * i..144 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        if let Some((seq, at)) = c.checkpoint_seen.filter(|&(_, at)| at > 0) {
            b[CHECKPOINT_SEEN_AT..CHECKPOINT_SEEN_AT + 8].copy_from_slice(&seq.to_le_bytes());
            b[CHECKPOINT_SEEN_AT + 8..CHECKPOINT_SEEN_AT + 16].copy_from_slice(&at.to_le_bytes());
        }
        if let Some(p) = c.writeback_pause {
            b[PAUSE_AT..PAUSE_AT + 4].copy_from_slice(&p.interval_ms.max(1).to_le_bytes());
            b[PAUSE_AT + 4..PAUSE_AT + 8].copy_from_slice(&u32::from(p.buffered).to_le_bytes());
        }
        if let Some(t) = c.uncheckpointed_since.filter(|&t| t > 0) {
            b[UNCHECKPOINTED_AT..UNCHECKPOINTED_AT + 8].copy_from_slice(&t.to_le_bytes());
        }
        if let Some(h) = &c.checkpoint_headers {
            b[CHECKPOINT_HEADERS_AT..CHECKPOINT_HEADERS_AT + CHECKPOINT_HEADER_LEN].copy_from_slice(&h[0]);
            b[CHECKPOINT_HEADERS_AT + CHECKPOINT_HEADER_LEN..CHECKPOINT_HEADERS_AT + 2 * CHECKPOINT_HEADER_LEN].copy_from_slice(&h[1]);
        }
        let crc = crc32fast::hash(&b[..CRC_AT]);
        b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes a superblock block; `None` unless magic, version and CRC are right.
    pub fn decode(b: &[u8]) -> Option<Superblock> {
        if b.len() < BLOCK as usize || &b[0..8] != SB_MAGIC || u32at(b, 8) != VERSION {
            return None;
        }
        if crc32fast::hash(&b[..CRC_AT]) != u32at(b, CRC_AT) || u64at(b, 16) >= MAX_SEQ {
            return None;
        }
        let n = usize::from(u16::from_le_bytes([b[128], b[129]])).min(MAX_HANDLES);
        let flags = u32at(b, 12);
        Some(Superblock {
            seq: u64at(b, 16),
            instance: u64at(b, 24),
            clean: flags & FLAG_CLEAN != 0,
            geometry: std::array::from_fn(|i| u64at(b, 32 + 8 * i)),
            layout: Layout {
                record_pages: u64::from(u32at(b, 72)),
                history_pages: u64::from(u32at(b, 76)),
                tag_pages: u64::from(u32at(b, 80)),
                history_capacity: u64::from(u32at(b, 84)),
            },
            counters: Counters {
                trims: u64at(b, 88),
                trim_bytes: u64at(b, 96),
                evictions: u64at(b, 104),
                cycles: u64at(b, 112),
                own_bytes: u64at(b, 120),
                trims_by_handle: (0..n).map(|i| u64at(b, 136 + 8 * i)).collect(),
                checkpoint_seen: Some((u64at(b, CHECKPOINT_SEEN_AT), u64at(b, CHECKPOINT_SEEN_AT + 8))).filter(|&(_, at)| at > 0),
                writeback_pause: (u32at(b, PAUSE_AT) > 0).then(|| SavedPause { interval_ms: u32at(b, PAUSE_AT), buffered: u32at(b, PAUSE_AT + 4) & 1 != 0 }),
                uncheckpointed_since: Some(u64at(b, UNCHECKPOINTED_AT)).filter(|&t| t > 0),
                checkpoint_headers: (flags & FLAG_CHECKPOINT_HEADERS != 0).then(|| {
                    let at = |c: usize| std::array::from_fn(|i| b[CHECKPOINT_HEADERS_AT + c * CHECKPOINT_HEADER_LEN + i]);
                    [at(0), at(1)]
                }),
            },
            digest: (flags & FLAG_DIGEST != 0).then(|| u64at(b, DIGEST_AT)),
        })
    }
}

/// A decoded page header, if the page is intact.
fn page_header(b: &[u8]) -> Option<(u64, u64, u32, u32)> {
    if b.len() < BLOCK as usize || &b[0..8] != PG_MAGIC || crc32fast::hash(&b[..CRC_AT]) != u32at(b, CRC_AT) || u64at(b, 16) >= MAX_SEQ {
        return None;
    }
    Some((u64at(b, 8), u64at(b, 16), u32at(b, 24), u32at(b, 28)))
}

/// The seq that `b`, which fails `page_header`, claims, where it still names page `index` of
/// state `instance` (unchecked: the checksum failed).
fn damaged_page_of(b: &[u8], instance: u64, index: u64) -> Option<u64> {
    let named = b.len() >= BLOCK as usize && &b[0..8] == PG_MAGIC && u64at(b, 8) == instance && u64::from(u32at(b, 24)) == index;
    named.then(|| u64at(b, 16))
}

fn seal_page(b: &mut [u8], instance: u64, seq: u64, index: u64, kind: u32) {
    b[0..8].copy_from_slice(PG_MAGIC);
    b[8..16].copy_from_slice(&instance.to_le_bytes());
    b[16..24].copy_from_slice(&seq.to_le_bytes());
    b[24..28].copy_from_slice(&(index as u32).to_le_bytes());
    b[28..32].copy_from_slice(&kind.to_le_bytes());
    let crc = crc32fast::hash(&b[..CRC_AT]);
    b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
}

/// What loading found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// A state of this geometry was found and restored.
    pub found: bool,
    /// It was saved by a clean shutdown (confirmations trusted).
    pub clean: bool,
    pub seq: u64,
    pub counters: Counters,
    /// Why an existing state was not used (geometry changed, region too small).
    pub note: Option<String>,
    /// The region was read and holds no fdpblk superblock at all: no run of fdpblk has saved
    /// a state for this device (or its tail was wiped).
    pub none_saved: bool,
}

/// One persist cycle's result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CycleReport {
    pub seq: u64,
    pub pages: u64,
    pub bytes: u64,
}

/// The persistence of one device's state.
pub struct Persist {
    region: Region,
    layout: Layout,
    geometry: [u64; 5],
    instance: u64,
    /// Last committed seq.
    seq: u64,
    /// Next seq to use (above everything seen on the device).
    next_seq: u64,
    /// Per logical page: the copy holding its newest committed version.
    current: Vec<u8>,
    /// Per logical page: the seq of its newest committed version (0: none), for the digest.
    seqs: Vec<u64>,
    /// Pages to rewrite in the next cycle regardless of changes (leftovers of a torn cycle).
    forced: Vec<u64>,
    /// The superblock copy holding the newest committed superblock: the next one goes to the
    /// other. (Not `seq % 2`: a failed cycle skips its seq, and the next superblock would then
    /// overwrite the newest committed one.)
    sb_copy: u8,
    /// The superblocks could not be read at load, or one is whole but of a form this version
    /// does not decode (a newer one's): the next superblock goes into both copies, so that no
    /// older one (another instance's, maybe clean) outranks this state.
    sb_both: bool,
    /// The last superblock was taken as committed because it read back, though its flush
    /// failed: it may sit only in the drive's volatile cache. The next cycle overwrites the
    /// copies the superblock before it vouches for, so it first needs a flush to succeed,
    /// and the superblock to read back after it ([`Owed`]).
    owed: Option<Owed>,
    handle: Handle,
    /// A clean state was loaded but not trusted (a page copy damaged or unreadable): before
    /// the first cycle overwrites a copy, the superblock is marked in use
    /// ([`Persist::mark_in_use`]), or a crash before that cycle's superblock would leave
    /// the clean one vouching for an older copy that now passes for the newest.
    unclean_first: bool,
}

/// What a cycle taken as committed despite its failed flush undoes if its superblock is gone
/// once a flush succeeds (the read-back came from a cache the drive then lost).
#[derive(Debug)]
struct Owed {
    /// The pages it wrote, whose current copy it flipped, with the seqs they had before.
    pages: Vec<u64>,
    prev_seqs: Vec<u64>,
    /// The seq of the superblock before it, again the newest committed one.
    prev_seq: u64,
}

/// The superblock that counts of the two copies, with its copy: the highest seq; of two with
/// one seq, the one not clean (a state marked in use, [`Persist::mark_in_use`]).
fn newest(copies: [Option<Superblock>; 2]) -> Option<(u8, Superblock)> {
    let [a, c] = copies;
    [(0u8, a), (1, c)].into_iter().filter_map(|(i, s)| Some((i, s?))).max_by_key(|(_, s)| (s.seq, !s.clean))
}

fn new_instance() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let x = t ^ (u64::from(std::process::id()) << 32) ^ 0x5eed_f00d_dead_beef;
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).max(1)
}

/// Both superblock copies of `region` in one buffer, and which of them read: where the read
/// of both fails, each copy is read alone (one bad sector costs one copy), and a copy that
/// does not read is left zero. The first error, if any.
fn read_superblock_copies(dev: &dyn StateWriter, region: Region) -> (AlignedBuf, [bool; 2], Option<io::Error>) {
    let mut b = AlignedBuf::zeroed(2 * BLOCK as usize);
    if dev.read_at(region.offset, &mut b[..2 * BLOCK as usize]).is_ok() {
        return (b, [true; 2], None);
    }
    let mut read = [false; 2];
    let mut first = None;
    for c in 0..2usize {
        let blk = &mut b[c * BLOCK as usize..(c + 1) * BLOCK as usize];
        match dev.read_at(region.offset + c as u64 * BLOCK, blk) {
            Ok(()) => read[c] = true,
            Err(e) => {
                blk.fill(0);
                first.get_or_insert(e);
            }
        }
    }
    (b, read, first)
}

/// A superblock block of some fdpblk format whose CRC holds (this version's or a later one's:
/// they keep the magic's prefix and the CRC's place).
fn whole_superblock(blk: &[u8]) -> bool {
    blk.len() >= BLOCK as usize && blk.starts_with(SB_MAGIC_PREFIX) && crc32fast::hash(&blk[..CRC_AT]) == u32at(blk, CRC_AT)
}

/// [`read_superblock_copies`], read again twice, 100 ms apart, while neither copy reads: what
/// is decided on a failure to read both (writing over them, taking the state for none) must
/// not be decided on a passing one (a controller reset).
fn read_superblock_copies_again(dev: &dyn StateWriter, region: Region) -> (AlignedBuf, [bool; 2], Option<io::Error>) {
    let mut r = read_superblock_copies(dev, region);
    for _ in 0..2 {
        if r.1 != [false, false] {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        r = read_superblock_copies(dev, region);
    }
    r
}

impl Persist {
    /// Reads both superblocks (for `fdpblk inspect`): the newest valid one.
    pub fn read_superblock(dev: &dyn StateWriter, region: Region) -> Option<Superblock> {
        Self::newest_superblock(region, || read_superblock_copies(dev, region))
    }

    /// [`Self::read_superblock`], read again where neither copy reads: a momentary failure
    /// must not be taken for a superblock lost.
    fn read_superblock_again(dev: &dyn StateWriter, region: Region) -> Option<Superblock> {
        Self::newest_superblock(region, || read_superblock_copies_again(dev, region))
    }

    fn newest_superblock(region: Region, read_copies: impl FnOnce() -> (AlignedBuf, [bool; 2], Option<io::Error>)) -> Option<Superblock> {
        if region.len < 2 * BLOCK {
            return None;
        }
        let (b, read, _) = read_copies();
        if read == [false; 2] {
            return None;
        }
        let a = Superblock::decode(&b[..BLOCK as usize]);
        let c = Superblock::decode(&b[BLOCK as usize..]);
        newest([a, c]).map(|(_, s)| s)
    }

    /// Marks a clean saved state in `region` as in use before a device serves writes that no
    /// state thread follows yet (a layout still to be learned): its superblock again, not
    /// clean, with the *same* seq, in the other copy, then a flush. Loading prefers the
    /// unclean one of two superblocks with one seq ([`newest`]), so a later load will not
    /// trust its confirmations, whatever layout it is for. A higher seq would vouch for page
    /// copies that an unfinished cycle left with that seq. A whole superblock this version
    /// cannot decode (another version's) first gets its CRC broken. A copy that does not read
    /// gets the mark whatever the other holds (it may be a newer clean one); where neither
    /// reads, both get a block that keeps only the magic. The copy that holds the mark, now
    /// the newest superblock; `None`: no mark written (no clean state this version reads, or
    /// none at all).
    pub fn mark_in_use(dev: &dyn StateWriter, region: Region, handle: Handle) -> io::Result<Option<u8>> {
        if region.len < 2 * BLOCK {
            return Ok(None);
        }
        let (mut b, read, err) = read_superblock_copies_again(dev, region);
        // Neither copy reads (bad sectors; a write often remaps them): each gets a block that
        // keeps only the magic, so that neither vouches for anything if it reads again later,
        // and the region is still not taken for one no fdpblk used. As where the layout is
        // known ([`Persist::load`]'s first superblock goes into both copies).
        if let (Some(e), [false, false]) = (&err, read) {
            let mut mark = AlignedBuf::zeroed(BLOCK as usize);
            mark[..8].copy_from_slice(SB_MAGIC);
            let not_written = |w: io::Error| io::Error::new(w.kind(), format!("neither superblock copy reads ({e}), nor could be written again: {w}"));
            for c in 0..2u64 {
                dev.write_at(region.offset + c * BLOCK, &mark[..BLOCK as usize], handle).map_err(not_written)?;
            }
            dev.flush().map_err(not_written)?;
            return Ok(None);
        }
        let decoded = [0u8, 1].map(|c| Superblock::decode(&b[c as usize * BLOCK as usize..(c as usize + 1) * BLOCK as usize]));
        // A whole superblock of a form this version does not decode (another version's, maybe
        // clean) cannot be marked in use: its CRC is broken, so that no run of that version
        // later trusts what it vouched for under writes it never saw. Its magic stays: a
        // region with none would pass for one no fdpblk ever used (`Loaded::none_saved`), whose
        // unlisted slots are taken for unwritten.
        let mut broken = false;
        for c in 0..2usize {
            let blk = &mut b[c * BLOCK as usize..(c + 1) * BLOCK as usize];
            if decoded[c].is_none() && whole_superblock(blk) {
                blk[CRC_AT] ^= 0xff;
                dev.write_at(region.offset + c as u64 * BLOCK, blk, handle)?;
                broken = true;
            }
        }
        if broken {
            dev.flush()?;
        }
        // A copy that does not read may be a newer clean superblock: it is overwritten with
        // the mark (the other copy's superblock, not clean), or, where the other copy holds
        // none this version reads, with a block that keeps only the magic, so that it
        // vouches for nothing if it reads again later. A clean copy that reads is marked
        // first: a torn write of the one that does not must not leave it standing alone.
        // (Which order is safe depends on which copy is newer, which cannot be known; the
        // older copy is the clean one only where a run stopped cleanly twice without a cycle
        // between, and a start's first cycle is never clean.)
        if let Some(u) = read.iter().position(|r| !r) {
            let r = 1 - u;
            let mut mark = AlignedBuf::zeroed(BLOCK as usize);
            match decoded[r].clone() {
                Some(mut sb) => {
                    let was_clean = sb.clean;
                    sb.clean = false;
                    sb.encode(&mut mark);
                    if was_clean {
                        dev.write_at(region.offset + r as u64 * BLOCK, &mark[..BLOCK as usize], handle)?;
                        dev.flush()?;
                    }
                }
                None => mark[..8].copy_from_slice(SB_MAGIC),
            }
            dev.write_at(region.offset + u as u64 * BLOCK, &mark[..BLOCK as usize], handle)?;
            dev.flush()?;
            return Ok(decoded[r].is_some().then_some(u as u8));
        }
        let Some((copy, mut sb)) = newest(decoded).filter(|(_, s)| s.clean) else { return Ok(None) };
        sb.clean = false;
        let other = 1 - usize::from(copy);
        sb.encode(&mut b[other * BLOCK as usize..(other + 1) * BLOCK as usize]);
        dev.write_at(region.offset + other as u64 * BLOCK, &b[other * BLOCK as usize..(other + 1) * BLOCK as usize], handle)?;
        dev.flush()?;
        Ok(Some(other as u8))
    }

    /// Whether the last superblock written is not yet known durable (its flush failed; the
    /// next cycle flushes first).
    pub fn flush_owed(&self) -> bool {
        self.owed.is_some()
    }

    fn page_off(&self, index: u64, copy: u8) -> u64 {
        self.region.offset + 2 * BLOCK + (u64::from(copy) * self.layout.pages() + index) * BLOCK
    }

    /// Loads the state in `region` into `slots` (a fresh table of `geom`'s size). Never fails:
    /// an unreadable, foreign or mismatching state yields a fresh one (reported in `Loaded`).
    /// `None` when the region cannot hold the state (persistence off).
    /// Without comparing the checkpoint headers: for the format's own tests only.
    #[cfg(test)]
    pub fn load(dev: &dyn StateWriter, region: Region, geom: &Geometry, slots: &SlotTable, handle: Handle) -> (Option<Persist>, Loaded) {
        Self::load_trusting(dev, region, geom, slots, handle, true, CheckpointsNow::NotCompared)
    }

    /// [`Persist::load`]; with `trust_clean` false even a clean state's confirmations are
    /// dropped (writes were served that the slot table did not see), and so they are where
    /// the checkpoint headers `checkpoints_now` are not those the clean stop recorded.
    pub fn load_trusting(
        dev: &dyn StateWriter,
        region: Region,
        geom: &Geometry,
        slots: &SlotTable,
        handle: Handle,
        trust_clean: bool,
        checkpoints_now: CheckpointsNow,
    ) -> (Option<Persist>, Loaded) {
        let layout = Layout::of(slots);
        let mut loaded = Loaded::default();
        if layout.bytes() > region.len {
            loaded.note = Some(format!(
                "the reserved region ({} bytes) cannot hold the state ({} bytes, about 55 per slot); it is kept in memory only, and a restart learns the slots again from LMCache's checkpoints (slots of about 220 KiB or more fit)",
                region.len,
                layout.bytes()
            ));
            return (None, loaded);
        }
        let mut p = Persist {
            region,
            layout,
            geometry: geometry_key(geom),
            instance: new_instance(),
            seq: 0,
            next_seq: 1,
            current: vec![0; layout.pages() as usize],
            seqs: vec![0; layout.pages() as usize],
            forced: Vec::new(),
            sb_copy: 1,
            sb_both: false,
            owed: None,
            handle,
            unclean_first: false,
        };
        let mut max_seq = 0u64;
        // The highest seq a superblock copy claims that has the magic but does not decode.
        let mut undecoded_seq = None;
        // One superblock copy that does not read: the other is taken, untrusted (the lost one
        // may be newer, or the mark that its state is in use), and the next superblock goes
        // into both copies, the unreadable one first.
        let mut sb_unread = None;
        let mut sb_any_read = false;
        let sb = {
            // Read again where neither copy reads: taking the state for unreadable writes
            // a new instance over both, and a momentary failure must not decide that.
            let (b, read, err) = read_superblock_copies_again(dev, region);
            match err {
                Some(e) if read == [false; 2] => {
                    loaded.note = Some(format!(
                        "cannot read the state superblocks ({e}); starting fresh (LMCache's data is not touched; if this comes back at every start, sectors of the reserved tail at the device's end cannot be read: see the drive's error log, `nvme error-log`)"
                    ));
                    p.sb_both = true;
                    None
                }
                err => {
                    sb_any_read = true;
                    if let Some(e) = err {
                        sb_unread = Some(e);
                        p.sb_both = true;
                    }
                    let a = Superblock::decode(&b[..BLOCK as usize]);
                    let c = Superblock::decode(&b[BLOCK as usize..]);
                    for s in [&a, &c].into_iter().flatten() {
                        max_seq = max_seq.max(s.seq);
                    }
                    // A superblock that is there but does not decode (another version, or
                    // both copies torn) is a state that could not be read, not "never used";
                    // nor is one copy that does not read.
                    let magic = |i: usize| b[i * BLOCK as usize..].starts_with(SB_MAGIC_PREFIX);
                    loaded.none_saved = a.is_none() && c.is_none() && !magic(0) && !magic(1) && read == [true; 2];
                    // Whole (its CRC holds) yet not decoding: another version's, or a seq
                    // past the bound. A torn one is an unfinished cycle's, which never
                    // committed (a start serves only once its first cycle did).
                    let whole = |i: usize| whole_superblock(&b[i * BLOCK as usize..(i + 1) * BLOCK as usize]);
                    undecoded_seq = [(0, a.is_none()), (1, c.is_none())]
                        .into_iter()
                        .filter(|&(i, none)| none && whole(i))
                        .map(|(i, _)| u64at(&b[i * BLOCK as usize..], 16))
                        .max();
                    if a.is_none() && c.is_none() && !loaded.none_saved {
                        // A version is worth naming only where the copy is whole.
                        let blk = |i: usize| &b[i * BLOCK as usize..(i + 1) * BLOCK as usize];
                        let copy = |i: usize| match (whole(i), u32at(blk(i), 8)) {
                            (true, v) if v > VERSION => format!("format {v}, a newer fdpblk's"),
                            (true, v) if v == VERSION && blk(i).starts_with(SB_MAGIC) => "a seq past the bound".to_string(),
                            (true, v) => format!("format {v}"),
                            // Written so where neither copy read ([`Persist::mark_in_use`]).
                            (false, _) if magic(i) && blk(i)[8..].iter().all(|&x| x == 0) => "emptied where it did not read".to_string(),
                            (false, _) => "damaged".to_string(),
                        };
                        loaded.note = Some(format!(
                            "the saved state's superblocks do not read (copy 0: {}; copy 1: {}; this fdpblk reads format {VERSION}): starting fresh, and slots no checkpoint lists are not taken for unwritten",
                            copy(0),
                            copy(1)
                        ));
                    }
                    newest([a, c]).map(|(copy, s)| {
                        p.sb_copy = copy;
                        s
                    })
                }
            }
        };
        let usable = match sb {
            Some(s) if s.geometry == p.geometry && s.layout == layout => Some(s),
            Some(s) => {
                loaded.note = Some(format!(
                    "the saved state is for another layout ({}, {} record pages; this run's: {}, {} record pages); starting fresh, and this run's state replaces it",
                    describe_geometry(s.geometry),
                    s.layout.record_pages,
                    describe_geometry(p.geometry),
                    layout.record_pages
                ));
                None
            }
            None => None,
        };
        // Read every page copy: to restore the chosen ones, and to find seqs above the commit.
        let pages = layout.pages();
        let mut tag_bytes = Vec::new();
        let mut rec = [0u8; RECORD_BYTES];
        let mut buf = AlignedBuf::zeroed(pages.min(MAX_RUN as u64) as usize * BLOCK as usize);
        let mut chosen: Vec<Option<(u8, u64)>> = vec![None; pages as usize];
        let mut unreadable = None;
        // Page copies that cannot be read: (page, copy).
        let mut unread: Vec<(u64, u8)> = Vec::new();
        // Copies of this state's pages that fail their checksum: (page, the seq they claim).
        let mut damaged: Vec<(u64, u64)> = Vec::new();
        // Set once a page has neither copy readable, or too many copies fail: the state is
        // not used, and no more reads are spent on it (each failing one can take the drive's
        // error recovery, seconds).
        let mut give_up = false;
        'copies: for copy in 0..2u8 {
            let mut i = 0;
            while i < pages {
                let n = (pages - i).min(MAX_RUN as u64);
                let b = &mut buf[..(n * BLOCK) as usize];
                // A run that fails is read again page by page: one bad sector costs its page
                // copy, not the run.
                let first = unread.len();
                if dev.read_at(p.page_off(i, copy), b).is_err() {
                    for k in 0..n {
                        let page = &mut b[(k * BLOCK) as usize..((k + 1) * BLOCK) as usize];
                        // Once more 100 ms later (a momentary failure): a page copy given up
                        // is a version lost.
                        let read = dev.read_at(p.page_off(i + k, copy), page).or_else(|_| {
                            std::thread::sleep(std::time::Duration::from_millis(100));
                            dev.read_at(p.page_off(i + k, copy), page)
                        });
                        if let Err(e) = read {
                            unreadable.get_or_insert(e);
                            give_up |= unread.len() >= MAX_UNREAD || unread.contains(&(i + k, 0));
                            unread.push((i + k, copy));
                            if give_up {
                                break 'copies;
                            }
                        }
                    }
                }
                for k in 0..n {
                    if unread[first..].iter().any(|&(idx, _)| idx == i + k) {
                        continue;
                    }
                    let pg = &b[(k * BLOCK) as usize..((k + 1) * BLOCK) as usize];
                    let Some((inst, seq, index, kind)) = page_header(pg) else {
                        if let Some(q) = usable.as_ref().and_then(|s| damaged_page_of(pg, s.instance, i + k)) {
                            damaged.push((i + k, q));
                        }
                        continue;
                    };
                    max_seq = max_seq.max(seq);
                    let Some(s) = &usable else { continue };
                    let idx = i + k;
                    if inst != s.instance || u64::from(index) != idx || kind != Self::kind_of(&layout, idx) {
                        continue;
                    }
                    if seq > s.seq {
                        p.forced.push(idx);
                        continue;
                    }
                    if chosen[idx as usize].is_none_or(|(_, q)| seq > q) {
                        chosen[idx as usize] = Some((copy, seq));
                    }
                }
                i += n;
            }
        }
        p.next_seq = max_seq + 1;
        // A copy that cannot be read may hold the newest version of its page, or an unfinished
        // cycle's seq that a later superblock would pass. Where the page's other copy reads,
        // that copy stands (the state is then not trusted), and the first cycle, before any
        // superblock with a new seq, writes the unreadable copy again (a cycle writes the copy
        // not current), so no unknown seq outlives it. Where both copies of a page fail,
        // nothing of the page is known: start fresh, under a new instance that no page on
        // the device carries.
        let usable = match (usable, &unreadable) {
            (Some(_), Some(e)) if give_up => {
                loaded.note = Some(format!(
                    "cannot read either copy of a page of the saved state, or more than {MAX_UNREAD} page copies ({e}); starting fresh (LMCache's data is not touched; if this comes back at every start, sectors of the reserved tail at the device's end cannot be read: see the drive's error log, `nvme error-log`)"
                ));
                None
            }
            (u, _) => u,
        };
        let Some(s) = usable else {
            p.seq = max_seq;
            // A whole superblock that does not decode (another version's) stays the newest
            // there for that version unless replaced: the first superblock goes into both
            // copies, above its seq, or it could later vouch for a clean stop this run undid.
            if let Some(q) = undecoded_seq {
                p.sb_both = true;
                if q < MAX_SEQ - 1 {
                    p.next_seq = p.next_seq.max(q + 1);
                }
            }
            // Leftovers of the old instance need no rewrite: no superblock of the new one
            // names them, and rewriting one could overwrite the old state's committed copy.
            p.forced.clear();
            // The first cycle writes pages over the old state's copies: a clean superblock of
            // it (this layout's, with pages that did not read) must not outlive a crash before
            // the new one. (Where neither copy reads, no mark could be written; the first
            // superblock goes into both copies.)
            p.unclean_first = sb_any_read;
            return (Some(p), loaded);
        };
        p.instance = s.instance;
        p.seq = s.seq;
        loaded.found = true;
        // A damaged copy that claims a committed seq above the copy chosen for its page may
        // have been that page's newest version (rotted since): the older copy would pass for
        // it, so the state is not trusted this time. (A torn write of an unfinished cycle
        // claims a seq above the commit.) Every damaged page is written again, so that a
        // later commit's seq does not pass a torn copy's claim and make it suspect.
        let mut suspect = 0u64;
        for &(idx, q) in &damaged {
            p.forced.push(idx);
            suspect += u64::from(q <= s.seq && chosen[idx as usize].is_none_or(|(_, c)| q > c));
        }
        // The other superblock copy, whole but not decoding, claims a seq at or above this
        // one: it may be the newest state (a run of another fdpblk version that crashed),
        // and the one taken does not vouch for a clean stop. The next superblock replaces
        // both copies, so that the claim does not outlive this start.
        let newer_undecoded = undecoded_seq.filter(|&q| q >= s.seq);
        p.sb_both |= newer_undecoded.is_some();
        for &(idx, copy) in &unread {
            p.forced.push(idx);
            // Set again below where the other copy is chosen; the same value.
            p.current[idx as usize] = 1 - copy;
        }
        // The versions found against those the superblock committed: a write lost after its
        // flush, or a copy rotted whole, leaves an older version that passes every other check.
        for (idx, c) in chosen.iter().enumerate() {
            p.seqs[idx] = c.map_or(0, |(_, q)| q);
        }
        let lost_versions = s.digest.is_some_and(|d| d != p.digest_with(&[], 0));
        let changed = checkpoints_changed(s.counters.checkpoint_headers.as_ref(), checkpoints_now);
        let trusted = s.clean && trust_clean && suspect == 0 && !lost_versions && unread.is_empty() && sb_unread.is_none() && newer_undecoded.is_none() && changed.is_none();
        if let Some(e) = &sb_unread {
            loaded.note = Some(format!(
                "cannot read one copy of the saved state's superblock ({e}); the other is used{} and both are written again now (if this comes back at every start, a sector of the reserved tail at the device's end cannot be read or written: see the drive's error log, `nvme error-log`)",
                if s.clean && trust_clean { ", its slot confirmations not trusted this time" } else { "" }
            ));
        } else if let Some(e) = unreadable.as_ref().filter(|_| !unread.is_empty()) {
            loaded.note = Some(format!(
                "cannot read {} page copy(ies) of the saved state ({e}); the other copy of each is used and the unreadable one is written again now{} (LMCache's data is not touched; if this comes back at every start, a sector of the reserved tail at the device's end cannot be read or written: see the drive's error log, `nvme error-log`)",
                unread.len(),
                if s.clean && trust_clean { "; its slot confirmations are not trusted this time" } else { "" }
            ));
        } else if s.clean && trust_clean && suspect > 0 {
            loaded.note = Some(format!(
                "{suspect} page(s) of the saved state may have a damaged newest copy (a copy fails its checksum): its slot confirmations are not trusted this time"
            ));
        } else if lost_versions && s.clean && trust_clean {
            loaded.note = Some(
                "the saved state's pages are not the versions its superblock committed (a write the drive acknowledged was lost, or a page rotted whole): its slot confirmations are not trusted this time"
                    .into(),
            );
        } else if let Some(q) = newer_undecoded.filter(|_| s.clean && trust_clean) {
            loaded.note = Some(format!(
                "the other copy of the saved state's superblock claims seq {q}, at or above the {} loaded, but does not read (another fdpblk version's): its slot confirmations are not trusted this time",
                s.seq
            ));
        } else if let Some(why) = changed.filter(|_| s.clean && trust_clean) {
            loaded.note = Some(format!("{why}: the saved state's slot confirmations are not trusted this time"));
        } else if s.clean && !trust_clean {
            loaded.note = Some(
                "the saved state is marked as a clean stop, but this start does not trust its slot confirmations (a recovery, whose dead daemon served writes after it, or a layout being learned)"
                    .into(),
            );
        }
        loaded.clean = trusted;
        // Also where the state loaded was not clean: a superblock copy that did not read, or
        // one of another version, may be a newer clean one, whose pages the first cycle
        // overwrites (they carry seqs above the one loaded).
        p.unclean_first = !trusted && (s.clean || sb_unread.is_some() || newer_undecoded.is_some());
        loaded.seq = s.seq;
        loaded.counters = s.counters.clone();
        let mut pg = AlignedBuf::zeroed(BLOCK as usize);
        let mut lost_pages = 0u64;
        let mut tag_seqs: Vec<Option<u64>> = vec![None; layout.tag_pages as usize];
        for idx in 0..pages {
            let Some((copy, seq)) = chosen[idx as usize] else { continue };
            p.current[idx as usize] = copy;
            // Read again to restore it: the page the first pass chose, or (a read that fails
            // now, twice) its records start empty, which only forgets: an empty record is
            // never deallocated.
            let page_is = |pg: &[u8]| page_header(pg).is_some_and(|(inst, q, i, _)| inst == s.instance && q == seq && u64::from(i) == idx);
            let mut read = || dev.read_at(p.page_off(idx, copy), &mut pg[..BLOCK as usize]).is_ok() && page_is(&pg);
            // Past MAX_UNREAD failures the rest are not tried (each may take the drive's error
            // recovery, seconds): they start empty too.
            if lost_pages >= MAX_UNREAD as u64 || (!read() && !read()) {
                // The first cycle commits it empty: its committed copy would otherwise come
                // back at the next load, records this run never held among them.
                lost_pages += 1;
                p.forced.push(idx);
                continue;
            }
            let payload = &pg[PAGE_HEADER..CRC_AT];
            if idx < layout.record_pages {
                let mut restored = [0u8; RECORD_BYTES];
                for r in 0..RECORDS_PER_PAGE {
                    let slot = idx * RECORDS_PER_PAGE + r;
                    if slot >= slots.len() as u64 {
                        break;
                    }
                    rec.copy_from_slice(&payload[r as usize * RECORD_BYTES..(r as usize + 1) * RECORD_BYTES]);
                    slots.restore_record(slot, &rec, trusted);
                    // A record restored otherwise than saved (an untrusted confirmation
                    // dropped) is saved again by the first cycle: a later clean stop must not
                    // vouch for the copy on the drive, which still carries it.
                    slots.encode_record(slot, &mut restored);
                    if restored != rec && p.forced.last() != Some(&idx) {
                        p.forced.push(idx);
                    }
                }
            } else if idx < layout.record_pages + layout.history_pages {
                let base = (idx - layout.record_pages) * HISTORY_PER_PAGE;
                for e in 0..HISTORY_PER_PAGE {
                    let i = base + e;
                    if i >= layout.history_capacity {
                        break;
                    }
                    slots.history().restore_raw(i, u64at(payload, e as usize * 8));
                }
            } else {
                let t = (idx - layout.record_pages - layout.history_pages) as usize;
                if tag_bytes.len() < (t + 1) * PAGE_PAYLOAD {
                    tag_bytes.resize((t + 1) * PAGE_PAYLOAD, 0);
                }
                tag_bytes[t * PAGE_PAYLOAD..(t + 1) * PAGE_PAYLOAD].copy_from_slice(payload);
                tag_seqs[t] = Some(seq);
            }
        }
        // Every cycle that saves tags writes all their pages with one seq. Pages that do not
        // share page 0's (one lost, or an older copy standing for one that did not read) are
        // not the same stream: it is cut at the first of them.
        let whole_tags = tag_seqs.iter().take_while(|&&q| q.is_some() && q == tag_seqs[0]).count();
        let tags_cut = whole_tags < tag_seqs.len() && tag_seqs.iter().any(Option::is_some);
        if tags_cut {
            tag_bytes.truncate(whole_tags * PAGE_PAYLOAD);
        }
        if lost_pages > 0 {
            loaded.note.get_or_insert(format!(
                "{lost_pages} page(s) of the saved state read once but not again; what they held (slot records, history, tags) starts empty"
            ));
        }
        if !tag_bytes.is_empty() {
            slots.tags().restore(&tag_bytes);
        }
        // Tags past the names read (pages cut, lost, or a stream that decodes short) are
        // cleared: a tag interned later would take their numbers.
        let forgotten = Self::forget_tags_past(&mut p, slots, slots.tags().len());
        if tags_cut || forgotten {
            p.forced.extend((0..layout.tag_pages).map(|t| layout.record_pages + layout.history_pages + t));
        }
        if tags_cut {
            loaded.note.get_or_insert_with(|| format!("the saved tag names did not all read ({whole_tags} of {} pages whole): the {} read are kept, slots of the others start untagged", layout.tag_pages, slots.tags().len()));
        } else if forgotten {
            loaded.note.get_or_insert_with(|| format!("saved slot records name tags past the {} tag names saved: those slots start untagged", slots.tags().len()));
        }
        // Restoring marked everything dirty; only real changes should be written.
        let _ = slots.take_dirty_pages();
        let _ = slots.history().take_dirty_pages();
        let _ = slots.tags().take_dirty();
        (Some(p), loaded)
    }

    /// Clears every tag above `known` in the slot records and the identity history (their
    /// names were lost: a tag interned later would take their numbers), and has the pages
    /// that held them written again. True when it cleared any.
    fn forget_tags_past(p: &mut Persist, slots: &SlotTable, known: usize) -> bool {
        use crate::slot_table::life;
        let l = p.layout;
        let known = u16::try_from(known).unwrap_or(u16::MAX);
        let mut cleared = false;
        for slot in 0..slots.len() as u64 {
            let v = slots.life(slot);
            // (Nothing else runs on the table while it loads: the swap cannot fail.)
            if life::tag(v) > known && slots.cas_life(slot, v, life::with_tag(v, 0)) {
                cleared = true;
                if p.forced.last() != Some(&(slot / RECORDS_PER_PAGE)) {
                    p.forced.push(slot / RECORDS_PER_PAGE);
                }
            }
        }
        let h = slots.history();
        for i in 0..l.history_capacity {
            let e = h.raw(i);
            if e != 0 && (e & 0xffff) as u16 > known {
                h.restore_raw(i, e & !0xffff);
                // Once per page: a history of tens of millions of entries is untagged here.
                let page = l.record_pages + i / HISTORY_PER_PAGE;
                if p.forced.last() != Some(&page) {
                    p.forced.push(page);
                }
                cleared = true;
            }
        }
        cleared
    }

    /// The page digest of the committed versions, with `pages` (sorted) at `seq` instead.
    fn digest_with(&self, pages: &[u64], seq: u64) -> u64 {
        page_digest(self.seqs.iter().enumerate().map(|(i, &q)| (i as u64, if pages.binary_search(&(i as u64)).is_ok() { seq } else { q })))
    }

    fn kind_of(l: &Layout, idx: u64) -> u32 {
        if idx < l.record_pages {
            KIND_RECORDS
        } else if idx < l.record_pages + l.history_pages {
            KIND_HISTORY
        } else {
            KIND_TAGS
        }
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }
    pub fn region(&self) -> Region {
        self.region
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// One persist cycle: the changed pages, then the superblock. With nothing changed and
    /// not `force`, writes nothing (`Ok(None)`). On an error the changes stay pending.
    pub fn cycle(&mut self, dev: &dyn StateWriter, slots: &SlotTable, counters: &Counters, clean: bool, force: bool) -> io::Result<Option<CycleReport>> {
        if self.owed.is_some() {
            dev.flush()?;
            let owed = self.owed.take().expect("checked above");
            // Durable now if it is still there. If not, the superblock before it is the newest
            // committed one again: its page copies are current again, and the pages written
            // since go out again (into the copies the lost superblock would have vouched for).
            if !Self::read_superblock_again(dev, self.region).is_some_and(|s| s.seq == self.seq && s.instance == self.instance) {
                tracing::warn!(
                    "own state: superblock {} no longer reads back after the flush it was owed; the superblock before it stands, and that cycle's pages are written again",
                    self.seq
                );
                for (&p, &q) in owed.pages.iter().zip(&owed.prev_seqs) {
                    self.current[p as usize] = 1 - self.current[p as usize];
                    self.seqs[p as usize] = q;
                }
                self.forced.extend(owed.pages);
                self.sb_copy = 1 - self.sb_copy;
                self.seq = owed.prev_seq;
            }
        }
        let l = self.layout;
        let recs = slots.take_dirty_pages();
        let hist = slots.history().take_dirty_pages();
        let tags = slots.tags().take_dirty();
        let mut pages: Vec<u64> = recs.iter().copied().filter(|&p| p < l.record_pages).collect();
        pages.extend(hist.iter().map(|&h| l.record_pages + h).filter(|&p| p < l.record_pages + l.history_pages));
        if tags.is_some() {
            pages.extend((0..l.tag_pages).map(|t| l.record_pages + l.history_pages + t));
        }
        pages.append(&mut self.forced);
        // Tag pages go together, all with one seq, however few were forced (a load cuts the
        // names where they do not share one).
        let tag_first = l.record_pages + l.history_pages;
        if pages.iter().any(|&p| p >= tag_first) {
            pages.extend(tag_first..tag_first + l.tag_pages);
        }
        pages.sort_unstable();
        pages.dedup();
        if pages.is_empty() && !force {
            return Ok(None);
        }
        // Keeps every change pending after a failed cycle.
        let keep_pending = |forced: &mut Vec<u64>, pages: Vec<u64>| {
            slots.redirty_pages(&recs);
            slots.history().redirty_pages(&hist);
            if tags.is_some() {
                slots.tags().redirty();
            }
            *forced = pages;
        };
        let mut marked = None;
        // What the mark writes counts as this cycle's (one block, or two or three).
        let counted = CountingWriter { dev, bytes: std::sync::atomic::AtomicU64::new(0) };
        if self.unclean_first {
            match Self::mark_in_use(&counted, self.region, self.handle) {
                // The mark is now the newest superblock: the next one goes into the other
                // copy first, so that a torn write of it leaves the mark standing.
                Ok(Some(copy)) => {
                    self.sb_copy = copy;
                    marked = Some(copy);
                }
                Ok(None) => {}
                Err(e) => {
                    keep_pending(&mut self.forced, pages);
                    return Err(e);
                }
            }
            self.unclean_first = false;
        }
        if self.sb_both {
            // The superblocks did not read (or decode) at load, so `next_seq` may come from the
            // pages alone.
            // A new superblock must number above both old ones: written into one copy before
            // a crash, one numbered below a clean superblock left in the other would lose the
            // next load to it, which would then trust that old state's confirmations. Each
            // copy that reads now counts; one that does not goes first (its seq is unknown).
            let mut b = AlignedBuf::zeroed(BLOCK as usize);
            for c in 0..2u64 {
                match dev.read_at(self.region.offset + c * BLOCK, &mut b[..BLOCK as usize]) {
                    Ok(()) => {
                        if let Some(s) = Superblock::decode(&b[..BLOCK as usize]) {
                            self.next_seq = self.next_seq.max(s.seq.saturating_add(1));
                        }
                    }
                    // (Not the mark just written, whatever a read says: it must be written last.)
                    Err(_) if marked != Some(c as u8) => self.sb_copy = 1 - c as u8, // `write_cycle` writes copy 1 - sb_copy first
                    Err(_) => {}
                }
            }
        }
        let seq = self.next_seq;
        if seq >= MAX_SEQ {
            // Only a forged or corrupt copy near the bound gets here; a load refuses this seq.
            keep_pending(&mut self.forced, pages);
            return Err(io::Error::other(format!(
                "own state: sequence number {seq} is at its limit (a corrupt copy in the reserved tail set it), so the state cannot be saved; stop the device and zero the tail (blkdiscard -z -o {} -l {} on the backing, or on its namespace /dev/nvmeXnY for a /dev/ngXnY backing; zeroes, not a deallocation, which a drive may not read back as zeroes) to start from an empty state",
                self.region.offset, self.region.len
            )));
        }
        // Tag pages forced by a leftover of an unfinished cycle are written with the table's
        // names too, changed or not (never as zeros).
        let tag_bytes = match &tags {
            Some(t) => t.clone(),
            None if pages.iter().any(|&p| p >= tag_first) => slots.tags().serialized(),
            None => Vec::new(),
        };
        let digest = self.digest_with(&pages, seq);
        let marked_bytes = counted.bytes.load(std::sync::atomic::Ordering::Relaxed);
        let res = match self.write_cycle(dev, slots, counters, &pages, &tag_bytes, seq, clean, digest, marked_bytes) {
            Ok(w) => Ok(w),
            // The superblock went out but its flush failed: it may be durable. Trust what the
            // device reads back, so that the copies of a committed cycle are never overwritten
            // as if they were free. (Its bytes count: the superblock that reads back says so.)
            Err((e, Some(w))) if Self::read_superblock(dev, self.region).is_some_and(|s| s.seq == seq && s.instance == self.instance) => {
                tracing::warn!("own state: flush after superblock {seq} failed ({e}); the superblock reads back, taking it as committed once a flush succeeds");
                let prev_seqs = pages.iter().map(|&p| self.seqs[p as usize]).collect();
                self.owed = Some(Owed { pages: pages.clone(), prev_seqs, prev_seq: self.seq });
                Ok(w)
            }
            Err((e, _)) => Err(e),
        };
        match res {
            Ok(written) => {
                for &p in &pages {
                    self.current[p as usize] = 1 - self.current[p as usize];
                    self.seqs[p as usize] = seq;
                }
                self.sb_copy = 1 - self.sb_copy;
                // Where the flush is owed, only one copy is known to read back: both are
                // written again next time.
                if self.owed.is_none() {
                    self.sb_both = false;
                }
                self.seq = seq;
                self.next_seq = seq + 1;
                Ok(Some(CycleReport { seq, pages: pages.len() as u64, bytes: written }))
            }
            Err(e) => {
                // Keep every change pending; pages already written carry `seq`, which is
                // skipped, and they are rewritten next time, so they never pass as committed.
                keep_pending(&mut self.forced, pages);
                self.next_seq = seq + 1;
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    /// Writes the pages and the superblock; returns the bytes written, `already` included,
    /// which the superblock adds to its `own_bytes`. The error carries them too once the
    /// superblock was written.
    fn write_cycle(
        &self,
        dev: &dyn StateWriter,
        slots: &SlotTable,
        counters: &Counters,
        pages: &[u64],
        tag_bytes: &[u8],
        seq: u64,
        clean: bool,
        digest: u64,
        already: u64,
    ) -> Result<u64, (io::Error, Option<u64>)> {
        let l = self.layout;
        // Bytes this cycle wrote before (the in-use mark), then its pages and superblocks.
        let mut written = already;
        // Runs of consecutive pages that go to the same copy become one write.
        let mut buf = AlignedBuf::zeroed(pages.len().clamp(1, MAX_RUN) * BLOCK as usize);
        let mut i = 0;
        while i < pages.len() {
            let copy = 1 - self.current[pages[i] as usize];
            let mut j = i + 1;
            while j < pages.len() && j - i < MAX_RUN && pages[j] == pages[j - 1] + 1 && 1 - self.current[pages[j] as usize] == copy {
                j += 1;
            }
            for (k, &idx) in pages[i..j].iter().enumerate() {
                let b = &mut buf[k * BLOCK as usize..(k + 1) * BLOCK as usize];
                b.fill(0);
                self.fill_page(idx, &mut b[PAGE_HEADER..CRC_AT], slots, tag_bytes);
                seal_page(b, self.instance, seq, idx, Self::kind_of(&l, idx));
            }
            let len = (j - i) * BLOCK as usize;
            dev.write_at(self.page_off(pages[i], copy), &buf[..len], self.handle).map_err(|e| (e, None))?;
            written += len as u64;
            i = j;
        }
        if !pages.is_empty() {
            dev.flush().map_err(|e| (e, None))?;
        }
        // Both superblock copies when both are written.
        written += if self.sb_both { 2 * BLOCK } else { BLOCK };
        let mut c = counters.clone();
        c.cycles = c.cycles.saturating_add(1);
        c.own_bytes = c.own_bytes.saturating_add(written);
        let sb = Superblock { seq, instance: self.instance, clean, geometry: self.geometry, layout: l, counters: c, digest: Some(digest) };
        let mut b = AlignedBuf::zeroed(BLOCK as usize);
        sb.encode(&mut b);
        let copy = u64::from(1 - self.sb_copy);
        dev.write_at(self.region.offset + copy * BLOCK, &b[..BLOCK as usize], self.handle).map_err(|e| (e, Some(written)))?;
        if self.sb_both {
            // The first copy durable before the second is written: a power loss while both
            // were in flight could tear both, and the state would start afresh.
            dev.flush().map_err(|e| (e, Some(written)))?;
            dev.write_at(self.region.offset + (1 - copy) * BLOCK, &b[..BLOCK as usize], self.handle).map_err(|e| (e, Some(written)))?;
        }
        dev.flush().map_err(|e| (e, Some(written)))?;
        Ok(written)
    }

    fn fill_page(&self, idx: u64, out: &mut [u8], slots: &SlotTable, tag_bytes: &[u8]) {
        let l = &self.layout;
        if idx < l.record_pages {
            for r in 0..RECORDS_PER_PAGE {
                let slot = idx * RECORDS_PER_PAGE + r;
                if slot >= slots.len() as u64 {
                    break;
                }
                slots.encode_record(slot, &mut out[r as usize * RECORD_BYTES..(r as usize + 1) * RECORD_BYTES]);
            }
        } else if idx < l.record_pages + l.history_pages {
            let base = (idx - l.record_pages) * HISTORY_PER_PAGE;
            for e in 0..HISTORY_PER_PAGE {
                if base + e >= l.history_capacity {
                    break;
                }
                out[e as usize * 8..e as usize * 8 + 8].copy_from_slice(&slots.history().raw(base + e).to_le_bytes());
            }
        } else {
            let t = (idx - l.record_pages - l.history_pages) as usize * PAGE_PAYLOAD;
            let total = (l.tag_pages as usize * PAGE_PAYLOAD).min(tag_bytes.len());
            if t < total {
                let src = &tag_bytes[t..total.min(t + PAGE_PAYLOAD)];
                out[..src.len()].copy_from_slice(src);
            }
        }
    }
}

/// A [`StateWriter`] that adds up the bytes written through it.
struct CountingWriter<'a> {
    dev: &'a dyn StateWriter,
    bytes: std::sync::atomic::AtomicU64,
}

impl StateWriter for CountingWriter<'_> {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.dev.read_at(off, buf)
    }
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()> {
        self.dev.write_at(off, buf, handle)?;
        self.bytes.fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn block_bytes(&self) -> u64 {
        self.dev.block_bytes()
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.dev.discard(off, len)
    }
    fn flush(&self) -> io::Result<()> {
        self.dev.flush()
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
}

/// A read-only [`StateWriter`] over any [`ReadAt`] (for `fdpblk inspect`).
pub struct ReadOnly<'a>(pub &'a (dyn crate::device::ReadAt + Sync));

impl StateWriter for ReadOnly<'_> {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read_exact_at(buf, off)
    }
    fn write_at(&self, _off: u64, _buf: &[u8], _handle: Handle) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::PermissionDenied, "read-only"))
    }
    fn discard(&self, _off: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::PermissionDenied, "read-only"))
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.0.size().unwrap_or(0)
    }
}

/// Whether the reserved tail of a backing of `size` bytes holds an fdpblk superblock, valid
/// or not (its magic in either copy): some run of fdpblk has used this device.
pub fn state_present(dev: &(dyn crate::device::ReadAt + Sync), size: u64) -> bool {
    let region = Region::tail(size);
    if region.len < 2 * BLOCK {
        return false;
    }
    let (b, _, _) = read_superblock_copies(&ReadOnly(dev), region);
    b.starts_with(SB_MAGIC_PREFIX) || b[BLOCK as usize..].starts_with(SB_MAGIC_PREFIX)
}

/// The format of a whole superblock (magic and CRC right) in the reserved tail of a backing
/// of `size` bytes that is newer than the one this fdpblk reads: a newer fdpblk's state,
/// which this one could only start afresh over (`add` refuses it unless `--force`). The
/// newest such format of the two copies; `None` for none (also where they do not read).
pub fn newer_format(dev: &(dyn crate::device::ReadAt + Sync), size: u64) -> Option<u32> {
    newer_format_in(&ReadOnly(dev), Region::tail(size))
}

/// [`newer_format`] in `region` of a state device.
pub fn newer_format_in(dev: &dyn StateWriter, region: Region) -> Option<u32> {
    if region.len < 2 * BLOCK {
        return None;
    }
    let (b, read, _) = read_superblock_copies_again(dev, region);
    (0..2usize)
        .filter(|&c| read[c])
        .map(|c| &b[c * BLOCK as usize..(c + 1) * BLOCK as usize])
        .filter(|blk| whole_superblock(blk))
        .map(|blk| u32at(blk, 8))
        .filter(|&v| v > VERSION)
        .max()
}

/// Why a table of `max_slots` is too much to read on a machine of `mem_total` bytes (more than
/// half of it, as `add` refuses).
pub(crate) fn table_memory_error(geometry: &str, max_slots: u64, mem_total: u64) -> Option<String> {
    let need = SlotTable::heap_bytes_for(max_slots);
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    (need > mem_total / 2).then(|| {
        format!("{geometry} needs a slot table of {:.1} GiB, more than half of this machine's {:.1} GiB; read it on a machine with more memory", gib(need), gib(mem_total))
    })
}

/// fdpblk's saved state on a backing device or image of `size` bytes, summarised as JSON
/// (`None` when its reserved tail holds none, `Err` saying why a superblock whose CRC holds
/// is not read): superblock, slot counts by state, identity history, tags, trims.
pub fn summary(dev: &(dyn crate::device::ReadAt + Sync), size: u64) -> Option<Result<serde_json::Value, String>> {
    use crate::slot_table::SlotState;
    let ro = ReadOnly(dev);
    let region = Region::tail(size);
    let sb = Persist::read_superblock(&ro, region)?;
    let [block_align, header_bytes, slot_bytes, meta_total_bytes, max_slots] = sb.geometry;
    // A superblock passes its CRC but may still be hostile: never size the table past what
    // fdpblk tracks, nor past what the region could hold (its record pages alone).
    let geometry = format!("its geometry ({})", describe_geometry(sb.geometry));
    if max_slots > crate::layout::geometry::MAX_SLOTS || slot_bytes == 0 || block_align == 0 {
        return Some(Err(format!("{geometry} is not one fdpblk serves")));
    }
    if 2 * BLOCK + 2 * max_slots.div_ceil(RECORDS_PER_PAGE) * BLOCK > region.len {
        return Some(Err(format!("{geometry} has more slots than the reserved tail ({} bytes) holds records of", region.len)));
    }
    // Nor past the slots of its own size the device holds: the table then takes memory in
    // proportion to the device, as the daemon's own does.
    let Some(exported) = crate::frontend::config::exported_bytes(size, 512) else {
        return Some(Err(format!("the device ({size} bytes) is no larger than fdpblk's reserved tail")));
    };
    let cfg = crate::layout::GeometryConfig { block_align, header_bytes, slot_bytes, meta_total_bytes, capacity_bytes: 0 };
    let Some(fits) = cfg.validate(exported).ok().filter(|v| v.max_slots >= max_slots) else {
        return Some(Err(format!("{geometry} does not fit the {exported} bytes this device exports")));
    };
    // Nor past half the memory, which `add` refuses too (a sparse image can claim 2^28 slots).
    if let Some(e) = crate::device::mem_total_bytes().and_then(|m| table_memory_error(&geometry, max_slots, m)) {
        return Some(Err(e));
    }
    // The saved table's slot count (the layout's own may be larger on this device).
    let g = Geometry { max_slots, ..fits };
    let slots = SlotTable::new(max_slots);
    let now = CheckpointsNow::read(&ro, &g);
    let (_, loaded) = Persist::load_trusting(&ro, region, &g, &slots, 0, true, now);
    let mut by_state = [0u64; 4];
    let (mut with_header, mut confirmed, mut returning) = (0u64, 0u64, 0u64);
    for s in 0..max_slots {
        if let Some(e) = slots.get(s) {
            with_header += 1;
            by_state[e.state as usize] += 1;
            confirmed += u64::from(e.confirmed);
            returning += u64::from(e.seen_before);
        }
    }
    let c = &sb.counters;
    let handles: serde_json::Map<String, serde_json::Value> =
        c.trims_by_handle.iter().enumerate().filter(|(_, &n)| n > 0).map(|(h, n)| (h.to_string(), serde_json::json!(n))).collect();
    let _ = SlotState::Unknown;
    Some(Ok(serde_json::json!({
        "found": loaded.found, "seq": sb.seq, "clean": sb.clean, "trusted": loaded.clean, "note": loaded.note,
        "region_offset": region.offset, "region_bytes": region.len,
        "geometry": {"block_align": block_align, "header_bytes": header_bytes, "slot_bytes": slot_bytes, "meta_total_bytes": meta_total_bytes, "max_slots": max_slots},
        "slots": {"with_header": with_header, "confirmed": confirmed, "unknown": by_state[0], "live": by_state[1], "evicted": by_state[2], "trimmed": by_state[3], "returning": returning},
        "identity_history": slots.history().len(), "identity_history_capacity": slots.history().capacity(), "tags": slots.tags().len(),
        "trims": c.trims, "trim_bytes": c.trim_bytes, "trims_by_handle": handles, "evictions": c.evictions,
        "persist_cycles": c.cycles, "own_bytes_written": c.own_bytes,
        "writeback_pause": c.writeback_pause.map(|p| serde_json::json!({"interval_s": f64::from(p.interval_ms) / 1000.0, "buffered": p.buffered})),
        "checkpoint_seen": c.checkpoint_seen.map(|(seq, at)| serde_json::json!({"seq": seq, "at_unix": at})),
        "uncheckpointed_since_unix": c.uncheckpointed_since,
        "checkpoint_headers_recorded": c.checkpoint_headers.is_some(),
    })))
}

#[cfg(test)]
mod tests;
