//! How the state thread reaches the backing device beside the queues: reading checkpoints
//! and slot headers back, writing fdpblk's own state on its placement handle, and
//! deallocating evicted slots. One small trait, one implementation per engine family, and an
//! in-memory one for tests and benchmarks.
//!
//! - [`BlockDev`]: a block device or file (`plain` and `streams` engines). Its own descriptor
//!   (a `dup` of the backing's, so O_DIRECT); reads and writes go through an aligned bounce
//!   buffer; placement for `streams` is an io_uring write carrying `write_stream` (the same
//!   field the queue engine uses); deallocation is `BLKDISCARD` on a block device (Dataset
//!   Management deallocate on NVMe) and `fallocate(PUNCH_HOLE)` on a file.
//! - [`NvmeDev`]: an NVMe generic char device (`passthrough` engine), synchronous NVMe
//!   commands by ioctl: Read, Write with the Data Placement directive of the handle's
//!   placement identifier, Dataset Management deallocate, Flush.
//! - [`MemDev`]: a byte vector with a log of every write, flush and deallocation.

use crate::device::ReadAt;
use crate::place::Handle;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

/// The state thread's access to the backing device (byte offsets on the backing device,
/// which are the exported offsets: LBA identity).
pub trait StateWriter: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `off` (any alignment).
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes exactly `buf` at `off` on placement `handle`; `off` and the length must be whole
    /// blocks of [`StateWriter::block_bytes`] (an unaligned write is an error, never padded).
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()>;
    /// The smallest write the device takes (its logical block).
    fn block_bytes(&self) -> u64 {
        512
    }
    /// Deallocates the whole logical blocks inside `[off, off + len)` (never a byte outside
    /// it). What later reads return is the drive's choice (zeroes on most): nothing may rest
    /// on it; what must read as zeroes is written as zeroes (`Watcher::invalidate_container`).
    fn discard(&self, off: u64, len: u64) -> io::Result<()>;
    /// Makes the writes before it durable.
    fn flush(&self) -> io::Result<()>;
    /// Backing bytes.
    fn size(&self) -> u64;
}

/// A [`ReadAt`] view of a [`StateWriter`] (for the checkpoint readers).
pub struct DevReader<'a>(pub &'a dyn StateWriter);

impl ReadAt for DevReader<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let size = self.0.size();
        if offset >= size {
            return Ok(0);
        }
        let n = buf.len().min((size - offset).min(1 << 20) as usize);
        self.0.read_at(offset, &mut buf[..n])?;
        Ok(n)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.0.size())
    }
}

/// A heap buffer aligned to 4 KiB (O_DIRECT and NVMe transfers).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned memory.
unsafe impl Send for AlignedBuf {}

pub const ALIGN: usize = 4096;

impl AlignedBuf {
    pub fn zeroed(len: usize) -> Self {
        let len = len.max(ALIGN).checked_next_multiple_of(ALIGN).expect("a buffer size below usize::MAX");
        let layout = std::alloc::Layout::from_size_align(len, ALIGN).expect("aligned layout");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), std::alloc::Layout::from_size_align_unchecked(self.len, ALIGN)) }
    }
}

fn is_aligned(b: &[u8]) -> bool {
    (b.as_ptr() as usize).is_multiple_of(ALIGN) && b.len().is_multiple_of(ALIGN)
}

/// Largest single transfer of the block implementation.
const MAX_IO: usize = 1 << 20;

/// A block device or file (plain and streams engines).
pub struct BlockDev {
    file: File,
    size: u64,
    /// Logical handle -> write stream (1-based; 0 = none); `None`: plain writes.
    streams: Option<Vec<u8>>,
    /// The ring for stream writes; `None` inside once a write could not be submitted (plain
    /// writes from then on: a queued entry must never go out after its buffer is gone).
    ring: Option<Mutex<Option<io_uring::IoUring>>>,
    bdev: bool,
    /// Logical block size of a block device (1 for a file: holes are punched to the byte).
    block: u64,
}

impl BlockDev {
    /// `file` should be the backing descriptor (or a dup of it); `streams` the engine's
    /// handle -> write stream map for the streams engine.
    pub fn new(file: File, size: u64, streams: Option<Vec<u8>>) -> io::Result<Self> {
        let ring = match &streams {
            Some(s) if s.iter().any(|&x| x != 0) => Some(Mutex::new(Some(io_uring::IoUring::new(4)?))),
            _ => None,
        };
        use std::os::unix::fs::FileTypeExt;
        let bdev = file.metadata()?.file_type().is_block_device();
        let block = if bdev { crate::device::logical_block_bytes(&file) } else { 1 };
        Ok(Self { file, size, streams, ring, bdev, block })
    }

    fn pread_exact(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        FileExt::read_exact_at(&self.file, buf, off)
    }

    fn pwrite_all(&self, buf: &[u8], off: u64, stream: u8) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let Some(ring) = self.ring.as_ref().filter(|_| stream != 0) else {
            return self.file.write_all_at(buf, off);
        };
        let mut guard = ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = 0usize;
        while done < buf.len() {
            let Some(ring) = guard.as_mut() else { return self.file.write_all_at(&buf[done..], off + done as u64) };
            let rest = &buf[done..];
            let sqe = io_uring::opcode::Write::new(io_uring::types::Fd(self.file.as_raw_fd()), rest.as_ptr(), rest.len() as u32)
                .offset(off + done as u64)
                .write_stream(stream)
                .build();
            // SAFETY: the buffer outlives the write: this returns only once its completion came,
            // or with the ring dropped before the kernel ever took the entry. One write at a
            // time, so the completion is this write's.
            unsafe { ring.submission().push(&sqe).map_err(|_| io::Error::other("state ring full"))? };
            let result = loop {
                match ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => std::thread::sleep(std::time::Duration::from_millis(1)),
                    // Not submitted and cannot be: drop the ring so that it never is.
                    Err(e) if !ring.submission().is_empty() => {
                        *guard = None;
                        tracing::warn!("own-state writes go without a write stream from now on: the stream ring failed ({e})");
                        return Err(e);
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(1)), // submitted: its completion comes
                }
                if let Some(cqe) = ring.completion().next() {
                    break cqe.result();
                }
            };
            match result {
                r if r > 0 => done += r as usize,
                0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "state write returned 0")),
                r => return Err(io::Error::from_raw_os_error(-r)),
            }
        }
        Ok(())
    }
}

impl StateWriter for BlockDev {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let start = pos / ALIGN as u64 * ALIGN as u64;
            let lead = (pos - start) as usize;
            let want = (buf.len() - done).min(MAX_IO - lead);
            let span = (lead + want).div_ceil(ALIGN) * ALIGN;
            let span = span.min((self.size.saturating_sub(start)) as usize);
            if span <= lead {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the backing device"));
            }
            let mut b = AlignedBuf::zeroed(span);
            self.pread_exact(&mut b[..span], start)?;
            let n = want.min(span - lead);
            buf[done..done + n].copy_from_slice(&b[lead..lead + n]);
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()> {
        let stream = self.streams.as_ref().and_then(|s| s.get(usize::from(handle)).copied()).unwrap_or(0);
        // Padding to a larger block would overwrite the bytes after `buf` (LMCache's data).
        let block = self.block_bytes();
        if !off.is_multiple_of(block) || !(buf.len() as u64).is_multiple_of(block) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("state write of {} bytes at {off} is not in whole {block}-byte blocks", buf.len())));
        }
        if is_aligned(buf) {
            return self.pwrite_all(buf, off, stream);
        }
        // O_DIRECT needs aligned memory: copy, and write exactly the caller's bytes.
        let mut b = AlignedBuf::zeroed(buf.len());
        b[..buf.len()].copy_from_slice(buf);
        self.pwrite_all(&b[..buf.len()], off, stream)
    }

    fn block_bytes(&self) -> u64 {
        // A file takes O_DIRECT writes of whole sectors.
        self.block.max(512)
    }

    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        let Some((off, len)) = crate::device::whole_blocks_within(off, len, self.block) else { return Ok(()) };
        if self.bdev {
            // The drive's own way to drop the data; QEMU's `discard=unmap` and most drives read
            // zeroes after it.
            match crate::device::blkdiscard(self.file.as_raw_fd(), off, len) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() != Some(libc::EOPNOTSUPP) => return Err(e),
                Err(_) => {}
            }
        }
        // Files (and devices without discard): punch a hole; reads return zeroes.
        // SAFETY: fallocate on an owned descriptor.
        let rc = unsafe {
            libc::fallocate(self.file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off as libc::off_t, len as libc::off_t)
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn size(&self) -> u64 {
        self.size
    }
}

/// An NVMe namespace's generic char device (passthrough engine): synchronous NVMe commands.
pub struct NvmeDev {
    file: File,
    nsid: u32,
    lba: u64,
    size: u64,
    max: usize,
    /// Logical handle -> placement identifier (empty: no directive).
    pids: Vec<u16>,
    /// The state of the namespace's controller, for waiting out resets.
    ctrl_state: Option<crate::nvme::reset::ControllerState>,
    /// Blocks per deallocated range and ranges per command the drive takes (DMRSL, DMRL).
    dsm_max_blocks: u32,
    dsm_max_ranges: usize,
}

/// The range lists of the Dataset Management commands that deallocate the whole `lba`-byte
/// blocks within `off..off + len` (a partial block at either end is kept: it holds data
/// outside the range), split at the drive's limits.
fn dsm_commands(off: u64, len: u64, lba: u64, max_blocks: u32, max_ranges: usize) -> impl Iterator<Item = io::Result<Vec<u8>>> {
    let (slba, nlb) = crate::device::whole_blocks_within(off, len, lba).map_or((0, 0), |(off, len)| (off / lba, len / lba));
    crate::engine::passthrough::dsm_lists(slba, nlb, max_blocks, max_ranges)
        .map(|l| l.map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "deallocate ranges do not encode")))
}

impl NvmeDev {
    pub fn new(file: File, lba_size: u64, size: u64, max_transfer: u32, pids: Vec<u16>) -> io::Result<Self> {
        let nsid = crate::nvme::ioctl::namespace_id(&file)?;
        let lba = lba_size.max(512);
        let max = (u64::from(max_transfer).max(lba).min(MAX_IO as u64) / lba * lba) as usize;
        Ok(Self { file, nsid, lba, size, max, pids, ctrl_state: None, dsm_max_blocks: u32::MAX, dsm_max_ranges: crate::nvme::cmd::MAX_DSM_RANGES })
    }

    /// Splits transfers and deallocations at the drive's limits now, as the queues' engine does.
    pub fn with_limits(mut self, limits: crate::engine::passthrough::CommandLimits) -> Self {
        self.max = limits.cap_transfer(self.max as u64, self.lba) as usize;
        if let Some(b) = limits.discard_bytes.filter(|&b| b >= self.lba) {
            self.dsm_max_blocks = (b / self.lba).min(u64::from(u32::MAX)) as u32;
        }
        if let Some(n) = limits.discard_segments {
            self.dsm_max_ranges = (n as usize).clamp(1, crate::nvme::cmd::MAX_DSM_RANGES);
        }
        self
    }

    /// Waits out resets of the controller behind `ng` (see [`crate::nvme::reset`]).
    pub fn with_controller_of(mut self, ng: &std::path::Path) -> Self {
        self.ctrl_state = crate::nvme::reset::ControllerState::of(ng);
        self
    }

    fn io(&self, cmd: Result<crate::nvme::cmd::PassthruCmd, crate::nvme::cmd::CmdError>, mut data: crate::nvme::ioctl::Data<'_>) -> io::Result<()> {
        use crate::nvme::ioctl::{Data, PassthruError};
        use crate::nvme::reset;
        let cmd = cmd.map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let mut hold = reset::Hold::default();
        loop {
            let again = match &mut data {
                Data::None => Data::None,
                Data::FromDevice(b) => Data::FromDevice(b),
                Data::ToDevice(b) => Data::ToDevice(b),
            };
            let err = match crate::nvme::ioctl::io(&self.file, cmd, again) {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            // The reset rules of `nvme::reset`: a reset's failures are sent again once it is
            // over (the engine also retries the drive's retryable statuses; this path, for
            // fdpblk's own state, leaves them to the next cycle).
            let refusal = matches!(&err, PassthruError::Os(e) if reset::kernel_refusal(-e.raw_os_error().unwrap_or(0)));
            let live = self.ctrl_state.as_ref().is_none_or(reset::ControllerState::live);
            if !hold.again(live, refusal) {
                return Err(match err {
                    PassthruError::Os(e) => e,
                    PassthruError::Status(s) => io::Error::other(s.to_string()),
                });
            }
            std::thread::sleep(reset::TICK);
        }
    }
}

impl StateWriter for NvmeDev {
    fn block_bytes(&self) -> u64 {
        self.lba
    }

    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        use crate::nvme::{cmd, ioctl::Data};
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let start = pos / self.lba * self.lba;
            let lead = (pos - start) as usize;
            let span = ((lead + buf.len() - done).div_ceil(self.lba as usize) * self.lba as usize).min(self.max);
            if span <= lead || start + span as u64 > self.size {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the namespace"));
            }
            let mut b = AlignedBuf::zeroed(span);
            self.io(cmd::read(self.nsid, start / self.lba, (span as u64 / self.lba) as u32), Data::FromDevice(&mut b[..span]))?;
            let n = (span - lead).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&b[lead..lead + n]);
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()> {
        use crate::nvme::{cmd, ioctl::Data};
        if !off.is_multiple_of(self.lba) || !(buf.len() as u64).is_multiple_of(self.lba) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "unaligned state write"));
        }
        let pid = self.pids.get(usize::from(handle)).copied();
        let mut b = AlignedBuf::zeroed(self.max);
        for (i, chunk) in buf.chunks(self.max).enumerate() {
            b[..chunk.len()].copy_from_slice(chunk);
            let at = off + (i * self.max) as u64;
            let c = cmd::write(self.nsid, at / self.lba, (chunk.len() as u64 / self.lba) as u32, pid, false);
            self.io(c, Data::ToDevice(&b[..chunk.len()]))?;
        }
        Ok(())
    }

    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        use crate::nvme::{cmd, ioctl::Data};
        for enc in dsm_commands(off, len, self.lba, self.dsm_max_blocks, self.dsm_max_ranges) {
            let enc = enc?;
            let mut b = AlignedBuf::zeroed(enc.len());
            b[..enc.len()].copy_from_slice(&enc);
            self.io(cmd::dsm_deallocate(self.nsid, enc.len() / cmd::DSM_RANGE_BYTES), Data::ToDevice(&b[..enc.len()]))?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.io(Ok(crate::nvme::cmd::flush(self.nsid)), crate::nvme::ioctl::Data::None)
    }

    fn size(&self) -> u64 {
        self.size
    }
}

/// One operation a [`MemDev`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemOp {
    Write { off: u64, len: u64, data: Vec<u8>, handle: Handle },
    Discard { off: u64, len: u64 },
    Flush,
}

/// An in-memory device: bytes, plus the log of every state write, deallocation and flush.
#[derive(Debug, Default)]
pub struct MemDev {
    inner: Mutex<MemInner>,
}

#[derive(Debug, Default)]
struct MemInner {
    bytes: Vec<u8>,
    log: Vec<MemOp>,
    /// Log writes' data (crash tests need it; benchmarks do not).
    keep_data: bool,
    fail_writes: bool,
    /// Reads that touch this byte range fail (a media error).
    fail_reads: Option<std::ops::Range<u64>>,
    /// Flushes that succeed before the rest fail (`None`: all succeed).
    fail_flushes_after: Option<u32>,
    /// The logical block it reports (512 unless set).
    block: u64,
    /// Bytes read inside this range, counted (tests of how much a reader reads).
    counted_reads: Option<(std::ops::Range<u64>, u64)>,
}

impl MemDev {
    pub fn new(size: u64) -> Self {
        Self { inner: Mutex::new(MemInner { bytes: vec![0; size as usize], log: Vec::new(), keep_data: true, fail_writes: false, fail_reads: None, fail_flushes_after: None, block: 512, counted_reads: None }) }
    }
    /// Counts the bytes read inside `range` from now on (`None`: stops counting).
    pub fn count_reads(&self, range: Option<std::ops::Range<u64>>) {
        self.lock().counted_reads = range.map(|r| (r, 0));
    }
    /// Bytes read inside the range given to [`Self::count_reads`] since.
    pub fn counted_reads(&self) -> u64 {
        self.lock().counted_reads.as_ref().map_or(0, |c| c.1)
    }
    /// Reports `bytes` as its logical block (a 4Kn drive, say).
    pub fn set_block_bytes(&self, bytes: u64) {
        self.lock().block = bytes;
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, MemInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Do not keep written data in the log (only offsets and lengths).
    pub fn without_data_log(self) -> Self {
        self.lock().keep_data = false;
        self
    }
    /// Make state writes fail (I/O error injection).
    /// Reads that touch `range` fail with EIO (`None`: none do).
    pub fn set_fail_reads(&self, range: Option<std::ops::Range<u64>>) {
        self.lock().fail_reads = range;
    }
    pub fn set_fail_writes(&self, fail: bool) {
        self.lock().fail_writes = fail;
    }
    /// Make flushes fail after `after` more successful ones (`None`: never). The writes
    /// before a failed flush stay, neither lost nor known durable.
    pub fn set_fail_flushes(&self, after: Option<u32>) {
        self.lock().fail_flushes_after = after;
    }
    /// Writes bytes directly (what a queue's engine would do).
    pub fn poke(&self, off: u64, data: &[u8]) {
        let mut g = self.lock();
        let end = (off as usize + data.len()).min(g.bytes.len());
        let n = end.saturating_sub(off as usize);
        g.bytes[off as usize..end].copy_from_slice(&data[..n]);
    }
    pub fn peek(&self, off: u64, len: usize) -> Vec<u8> {
        let g = self.lock();
        g.bytes[off as usize..off as usize + len].to_vec()
    }
    pub fn image(&self) -> Vec<u8> {
        self.lock().bytes.clone()
    }
    pub fn set_image(&self, img: Vec<u8>) {
        self.lock().bytes = img;
    }
    pub fn take_log(&self) -> Vec<MemOp> {
        std::mem::take(&mut self.lock().log)
    }
    /// Zeroes `[off, off+len)` without logging it (a deallocation by someone else).
    pub fn zero(&self, off: u64, len: u64) {
        let mut g = self.lock();
        let end = ((off + len) as usize).min(g.bytes.len());
        g.bytes[off as usize..end].fill(0);
    }
}

impl StateWriter for MemDev {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut g = self.lock();
        let end = off.checked_add(buf.len() as u64).filter(|&e| e <= g.bytes.len() as u64);
        let Some(end) = end else {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"));
        };
        if g.fail_reads.as_ref().is_some_and(|r| r.start < end && off < r.end) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        buf.copy_from_slice(&g.bytes[off as usize..end as usize]);
        if let Some((r, n)) = g.counted_reads.as_mut() {
            *n += end.min(r.end).saturating_sub(off.max(r.start));
        }
        Ok(())
    }
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()> {
        let mut g = self.lock();
        if g.fail_writes {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let end = off as usize + buf.len();
        if end > g.bytes.len() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        g.bytes[off as usize..end].copy_from_slice(buf);
        let data = if g.keep_data { buf.to_vec() } else { Vec::new() };
        g.log.push(MemOp::Write { off, len: buf.len() as u64, data, handle });
        Ok(())
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        let mut g = self.lock();
        let end = off.checked_add(len).filter(|&e| e <= g.bytes.len() as u64).ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        g.bytes[off as usize..end as usize].fill(0);
        g.log.push(MemOp::Discard { off, len });
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let mut g = self.lock();
        match &mut g.fail_flushes_after {
            Some(0) => return Err(io::Error::from_raw_os_error(libc::EIO)),
            Some(n) => *n -= 1,
            None => {}
        }
        g.log.push(MemOp::Flush);
        Ok(())
    }
    fn size(&self) -> u64 {
        self.lock().bytes.len() as u64
    }
    fn block_bytes(&self) -> u64 {
        self.lock().block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_deallocations_keep_to_the_drives_range_limits() {
        let range = |b: &[u8], i: usize| {
            let r = &b[i * 16..(i + 1) * 16];
            (u32::from_le_bytes(r[4..8].try_into().unwrap()), u64::from_le_bytes(r[8..16].try_into().unwrap()))
        };
        let dsm_commands = |off, len, lba, max_blocks, max_ranges| dsm_commands(off, len, lba, max_blocks, max_ranges).collect::<io::Result<Vec<_>>>();
        // A 256 MiB slot of 4 KiB blocks against a 4096-block DMRSL: 16 commands of one range
        // each, since no command may carry more than DMRSL blocks in all (as the kernel's).
        let cmds = dsm_commands(1 << 30, 256 << 20, 4096, 4096, 256).unwrap();
        assert_eq!(cmds.len(), 16);
        assert!(cmds.iter().all(|c| c.len() == 16));
        assert_eq!(range(&cmds[0], 0), (4096, (1 << 30) / 4096));
        assert_eq!(range(&cmds[15], 0), (4096, (1 << 30) / 4096 + 15 * 4096));
        // Without a range limit, one command.
        assert_eq!(dsm_commands(1 << 30, 256 << 20, 4096, u32::MAX, 4).unwrap().len(), 1);
        // Partial blocks at the ends stay.
        let c = dsm_commands(100, 3 * 4096, 4096, u32::MAX, 256).unwrap();
        assert_eq!(range(&c[0], 0), (2, 1));
        assert!(dsm_commands(100, 4000, 4096, u32::MAX, 256).unwrap().is_empty());
    }

    #[test]
    fn block_dev_reads_and_writes_unaligned_on_a_file() {
        let dir = std::env::temp_dir().join(format!("fdpblk-statedev-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 64 << 10]).unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&dir).unwrap();
        let d = BlockDev::new(f, 64 << 10, None).unwrap();
        d.write_at(8192, &[7u8; 4096], 3).unwrap();
        let mut b = [0u8; 10];
        d.read_at(8190, &mut b).unwrap();
        assert_eq!(b, [0, 0, 7, 7, 7, 7, 7, 7, 7, 7]);
        d.discard(8192, 4096).unwrap();
        d.read_at(8190, &mut b).unwrap();
        assert_eq!(b, [0; 10]);
        assert!(d.read_at((64 << 10) - 2, &mut b).is_err());
        // A write of one 512-byte block leaves the rest of its 4 KiB page alone (a zeroed
        // checkpoint header block of block_align 512 must not reach into the JSON after it).
        d.write_at(16384, &[9u8; 4096], 0).unwrap();
        d.write_at(16384, &[0u8; 512], 0).unwrap();
        let mut page = [0u8; 4096];
        d.read_at(16384, &mut page).unwrap();
        assert!(page[..512].iter().all(|&x| x == 0) && page[512..].iter().all(|&x| x == 9));
        // Less than a block is refused, not padded.
        assert_eq!(d.write_at(16384, &[0u8; 100], 0).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(d.write_at(16385, &[0u8; 512], 0).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        let _ = std::fs::remove_file(&dir);
    }

    #[test]
    fn mem_dev_logs() {
        let d = MemDev::new(16384);
        d.write_at(4096, &[1u8; 4096], 2).unwrap();
        d.flush().unwrap();
        d.discard(4096, 4096).unwrap();
        let log = d.take_log();
        assert_eq!(log.len(), 3);
        assert!(matches!(&log[0], MemOp::Write { off: 4096, handle: 2, data, len: 4096 } if data.len() == 4096));
        assert_eq!(d.peek(4096, 4), vec![0; 4]);
    }
}
