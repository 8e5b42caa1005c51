//! Backing I/O engines: where placed requests go. One small interface, several engines.
//!
//! Errors are negative errnos, the currency of ublk completions.

pub mod passthrough;
pub mod queue;
pub mod sim;
pub mod uring;

use crate::place::Handle;
use io_uring::{opcode, types};
use libublk::io::UblkQueue;
use std::time::Duration;

/// Resubmissions of an I/O the kernel completed with -EAGAIN (it had no room: no free
/// request, a full device queue) before it fails as EIO.
pub const EAGAIN_RETRIES: usize = 8;

/// How long to wait before the `n`th resubmission (from 1) of an I/O the kernel completed
/// with -EAGAIN: 1 ms, doubling, 255 ms over the [`EAGAIN_RETRIES`]. Sent again at once, it
/// mostly finds no room either, and eight tries within microseconds fail a request that a
/// brief burst of pressure would have let through.
pub fn eagain_backoff(n: usize) -> Duration {
    Duration::from_millis(1 << (n.clamp(1, EAGAIN_RETRIES) - 1))
}

/// Waits `d` on the queue's ring; false when the queue is stopping.
pub async fn sleep_for(q: &UblkQueue<'_>, d: Duration) -> bool {
    let ts = types::Timespec::new().sec(d.as_secs()).nsec(d.subsec_nanos());
    let res = q.ublk_submit_sqe(opcode::Timeout::new(&ts).build()).await;
    !(res == -libc::ECANCELED || q.is_stopping())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eagain_is_retried_after_a_growing_wait() {
        let waits: Vec<u64> = (1..=EAGAIN_RETRIES).map(|n| eagain_backoff(n).as_millis() as u64).collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 32, 64, 128]);
        assert_eq!(waits.iter().sum::<u64>(), 255);
        // Out of range: never zero, never past the last wait.
        assert_eq!(eagain_backoff(0), Duration::from_millis(1));
        assert_eq!(eagain_backoff(100), Duration::from_millis(128));
    }
}
