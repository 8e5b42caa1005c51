//! `region`: checkpoints, slot data and fdpblk's own state each on a handle of their own.

use super::*;

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
