//! fdpblk's own saved state (superblocks, record, history and tag pages) read from an
//! arbitrary reserved tail, as `inspect` and a daemon's start read it, with LMCache's two
//! checkpoint headers taken from the device's start.
#![no_main]
use fdpblk::device::ReadAt;
use libfuzzer_sys::fuzz_target;

/// A 16 MiB device of zeros whose reserved tail (its last 8 MiB) begins with the input.
struct TailImage<'a> {
    tail: &'a [u8],
}

const SIZE: u64 = 16 << 20;
const TAIL: u64 = 8 << 20;

impl ReadAt for TailImage<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let n = buf.len().min(SIZE.saturating_sub(offset) as usize);
        for (i, b) in buf[..n].iter_mut().enumerate() {
            let at = offset + i as u64;
            *b = at.checked_sub(TAIL).and_then(|t| self.tail.get(t as usize)).copied().unwrap_or(0);
        }
        Ok(n)
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(SIZE)
    }
}

fuzz_target!(|data: &[u8]| {
    let img = TailImage { tail: data };
    let _ = fdpblk::persist::summary(&img, SIZE);
});
