//! `none`: every write on the default handle, what a drive sees without fdpblk.

use super::*;

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
