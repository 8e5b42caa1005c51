//! The simulated engine: an in-memory FDP drive that records where every write landed.
//! It keeps no data, only accounting (host bytes per handle, per-op counts, deallocations).

use super::{Engine, Errno};
use crate::place::Handle;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Host bytes written per placement handle (HBMW split by handle).
    pub bytes_by_handle: BTreeMap<Handle, u64>,
    pub writes: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub discard_bytes: u64,
    pub write_zeroes: u64,
    pub write_zeroes_bytes: u64,
}

/// An FDP drive of `size` bytes with `handles` placement handles.
#[derive(Debug)]
pub struct SimEngine {
    size: u64,
    handles: u16,
    pub counters: SimCounters,
}

impl SimEngine {
    pub fn new(size: u64, handles: u16) -> Self {
        Self { size, handles, counters: SimCounters::default() }
    }
    fn check(&self, offset: u64, len: u64) -> Result<(), Errno> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Errno(libc::EINVAL)),
        }
    }
}

impl Engine for SimEngine {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn write(&mut self, offset: u64, len: u64, _data: &[u8], handle: Handle) -> Result<(), Errno> {
        self.check(offset, len)?;
        if handle >= self.handles {
            // Like an NVMe write with an invalid placement identifier.
            return Err(Errno(libc::EINVAL));
        }
        let b = self.counters.bytes_by_handle.entry(handle).or_default();
        *b = b.saturating_add(len);
        self.counters.writes += 1;
        Ok(())
    }
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.check(offset, buf.len() as u64)?;
        buf.fill(0);
        self.counters.reads += 1;
        self.counters.read_bytes = self.counters.read_bytes.saturating_add(buf.len() as u64);
        Ok(())
    }
    fn flush(&mut self) -> Result<(), Errno> {
        self.counters.flushes += 1;
        Ok(())
    }
    fn discard(&mut self, offset: u64, len: u64) -> Result<(), Errno> {
        self.check(offset, len)?;
        self.counters.discards += 1;
        self.counters.discard_bytes = self.counters.discard_bytes.saturating_add(len);
        Ok(())
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), Errno> {
        self.check(offset, len)?;
        self.counters.write_zeroes += 1;
        self.counters.write_zeroes_bytes = self.counters.write_zeroes_bytes.saturating_add(len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_rejects() {
        let mut e = SimEngine::new(1 << 20, 2);
        e.write(0, 4096, &[], 1).unwrap();
        e.write(4096, 4096, &[], 1).unwrap();
        assert_eq!(e.counters.bytes_by_handle[&1], 8192);
        assert_eq!(e.write(0, 4096, &[], 2), Err(Errno(libc::EINVAL)));
        assert_eq!(e.write((1 << 20) - 512, 4096, &[], 0), Err(Errno(libc::EINVAL)));
        assert_eq!(e.discard(u64::MAX, 2), Err(Errno(libc::EINVAL)));
    }
}
