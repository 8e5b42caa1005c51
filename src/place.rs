//! Placement policies: which reclaim unit handle each piece of LMCache's layout goes to.
//!
//! A policy sees one placement question at a time and answers with a logical handle
//! (`0..handles()`); the engine maps logical handles to the drive's placement identifiers.
//! Slot payload bytes never ask: the pipeline sends them to the handle their header got.

use crate::layout::slot_header::SlotHeader;
use crate::slot_table::SlotEntry;

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

pub trait Policy: Send {
    fn name(&self) -> &'static str;
    /// Number of logical handles the policy uses; the drive must offer at least this many.
    fn handles(&self) -> u16;
    fn place(&mut self, target: &Target<'_>) -> Handle;
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

/// The policies selectable by name.
pub const POLICY_NAMES: &[&str] = &["none", "region"];

pub fn policy_by_name(name: &str) -> Option<Box<dyn Policy>> {
    match name {
        "none" => Some(Box::new(NonePolicy)),
        "region" => Some(Box::new(RegionPolicy)),
        _ => None,
    }
}
