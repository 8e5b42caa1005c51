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
    /// every slot with a header as `Observation::Resident` ([`SharedPolicy::resume`]; a
    /// deallocated slot still names its last identity and that identity's loads); loads of
    /// identities no slot names any more are not kept and are learnt again.
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

mod key_aware;
mod lmcache_fdp;
mod none;
mod region;
mod shared;

pub use key_aware::{KeyAwarePolicy, ReadBook};
pub use lmcache_fdp::{BucketBook, LmcacheFdpPolicy};
pub use none::NonePolicy;
pub use region::RegionPolicy;
pub use shared::{resume, SharedPolicy};

/// The policies selectable by name, in the order the simulator's tables list them (the drive
/// without fdpblk first); the default is `key-aware`.
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

/// Each policy with the placement handles it needs, for errors that name the choices
/// ("none 1, region 4, lmcache-fdp 8, key-aware 3").
pub fn handles_of_each() -> String {
    POLICY_NAMES.iter().filter_map(|n| policy_by_name(n).map(|p| format!("{n} {}", p.handles()))).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests;
