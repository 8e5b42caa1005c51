//! The per-queue-thread engine the ublk frontend drives: one async interface over the engines
//! that run beside a ublk queue. Enum dispatch keeps the data path free of boxing.

use super::passthrough::PassthroughEngine;
use super::uring::UringEngine;
use crate::place::Handle;
use libublk::io::UblkQueue;

/// Results follow ublk's completion rules: bytes done for reads and writes, 0 for the other
/// operations, a negative errno on failure.
///
/// A read or write future must be awaited to its end, never dropped early (no `select!` or
/// timeout around one): the kernel or the drive holds the tag's buffer until the command
/// completes, and only the engine's slot outlives a dropped future, not the buffer.
#[allow(clippy::large_enum_variant)] // one per queue thread, never moved on the data path
pub enum QueueEngine {
    /// `plain` and `streams`: I/O on the ublk queue's own ring.
    Uring(UringEngine),
    /// `passthrough`: NVMe commands on a second ring of the queue thread.
    Passthrough(PassthroughEngine),
}

impl QueueEngine {
    pub fn name(&self) -> &'static str {
        match self {
            QueueEngine::Uring(e) => e.name(),
            QueueEngine::Passthrough(e) => e.name(),
        }
    }
    pub async fn write(&self, q: &UblkQueue<'_>, off: u64, buf: &[u8], handle: Handle, fua: bool) -> i32 {
        match self {
            QueueEngine::Uring(e) => e.write(q, off, buf, handle, fua).await,
            QueueEngine::Passthrough(e) => e.write(q, off, buf, handle, fua).await,
        }
    }
    pub async fn read(&self, q: &UblkQueue<'_>, off: u64, buf: &mut [u8]) -> i32 {
        match self {
            QueueEngine::Uring(e) => e.read(q, off, buf).await,
            QueueEngine::Passthrough(e) => e.read(q, off, buf).await,
        }
    }
    pub async fn flush(&self, q: &UblkQueue<'_>) -> i32 {
        match self {
            QueueEngine::Uring(e) => e.flush(q).await,
            QueueEngine::Passthrough(e) => e.flush(q).await,
        }
    }
    pub async fn discard(&self, q: &UblkQueue<'_>, off: u64, len: u64) -> i32 {
        match self {
            QueueEngine::Uring(e) => e.discard(q, off, len).await,
            QueueEngine::Passthrough(e) => e.discard(q, off, len).await,
        }
    }
    /// `handle` places the zeroes the drive writes (passthrough only: fallocate carries no
    /// write stream).
    pub async fn write_zeroes(&self, q: &UblkQueue<'_>, off: u64, len: u64, unmap: bool, handle: Handle) -> i32 {
        match self {
            QueueEngine::Uring(e) => e.write_zeroes(q, off, len, unmap).await,
            QueueEngine::Passthrough(e) => e.write_zeroes(q, off, len, unmap, handle).await,
        }
    }
}
