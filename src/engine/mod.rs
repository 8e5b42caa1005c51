//! Backing I/O engines: where placed requests go. One small interface, several engines.
//!
//! Errors are negative errnos, the currency of ublk completions.

pub mod passthrough;
pub mod queue;
pub mod sim;
pub mod uring;

use crate::place::Handle;

/// A failed backing operation, as a positive errno value (`libc::EIO`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

impl std::error::Error for Errno {}

/// A synchronous backing engine. Offsets and lengths are bytes on the backing device.
pub trait Engine {
    fn name(&self) -> &'static str;
    /// Writes `len` bytes at `offset` with placement `handle`. `data` holds those bytes; a
    /// trace replay may hold only a prefix of them, which engines that keep data reject.
    fn write(&mut self, offset: u64, len: u64, data: &[u8], handle: Handle) -> Result<(), Errno>;
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Errno>;
    fn flush(&mut self) -> Result<(), Errno>;
    /// Deallocates the range (TRIM); what later reads return is the device's choice (zeroes
    /// where the namespace says so, DLFEAT): nothing may rest on it.
    fn discard(&mut self, offset: u64, len: u64) -> Result<(), Errno>;
    fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), Errno>;
}
