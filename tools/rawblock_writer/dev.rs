//! Device I/O shaped like LMCache's native `RawBlockDevice`: positional writes issued one after
//! another (posix engine) or as one io_uring submission per batch (io_uring engine), on an fd
//! opened `O_RDWR` with or without `O_DIRECT`. Every result is checked; a short or failed
//! transfer is an error that names the offset.

use fdpblk::device::ReadAt;
use io_uring::{opcode, types, IoUring};
use std::alloc::{self, Layout};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

/// Ring size, as LMCache's default `iouring_queue_depth`; a put batch needs at most 2 x 64.
pub const RING_ENTRIES: u32 = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Posix,
    IoUring,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Posix => "posix",
            Engine::IoUring => "io_uring",
        }
    }
}

/// A zero-initialised buffer aligned for O_DIRECT.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(len: usize, align: usize) -> Result<AlignedBuf, String> {
        let layout = Layout::from_size_align(len.max(1), align.max(8))
            .map_err(|e| format!("cannot allocate {len} bytes aligned to {align}: {e}"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| format!("out of memory allocating {len} bytes"))?;
        Ok(AlignedBuf { ptr, len, layout })
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One write of a group: `data` goes to byte `offset` of the device.
pub struct WriteReq<'a> {
    pub offset: u64,
    pub data: &'a [u8],
}

/// A write as the device received it (kept only when logging is on, for tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedWrite {
    /// The io_uring submission it belonged to, and its index in it; None for a pwrite.
    pub batch: Option<(u64, usize)>,
    pub offset: u64,
    pub len: u64,
}

pub struct Device {
    file: File,
    pub size: u64,
    pub engine: Engine,
    pub odirect: bool,
    pub align: usize,
    ring: Option<IoUring>,
    batches: u64,
    pub log: Option<Vec<LoggedWrite>>,
}

/// A batch that cannot be completed (a refused submit, a full submission queue) leaves
/// buffers the kernel may still read or fill, whoever owns them: the process ends at once,
/// as nothing it would do next (free them, save its state) is safe.
fn ring_failed(why: &str) -> ! {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "rawblock-writer: {why}; aborting (buffers of the batch may still be in the kernel's hands)");
    std::process::abort()
}

fn errno_text(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

impl Device {
    /// Opens an existing device or pre-sized file read-write, never creating it.
    pub fn open(path: &Path, engine: Engine, odirect: bool, align: usize) -> Result<Device, String> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true);
        if odirect {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o.open(path).map_err(|e| {
            if odirect && e.raw_os_error() == Some(libc::EINVAL) {
                format!(
                    "cannot open {} with O_DIRECT: {e} (the file system refuses direct I/O; drop --odirect)",
                    path.display()
                )
            } else {
                format!("cannot open device {}: {e}", path.display())
            }
        })?;
        let meta = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?;
        let size = if meta.file_type().is_block_device() {
            fdpblk::device::block_device_size(&file).map_err(|e| format!("size of {}: {e}", path.display()))?
        } else if meta.file_type().is_file() {
            meta.len()
        } else {
            return Err(format!("{} is neither a block device nor a regular file", path.display()));
        };
        let ring = match engine {
            Engine::Posix => None,
            Engine::IoUring => Some(
                IoUring::new(RING_ENTRIES)
                    .map_err(|e| format!("cannot set up io_uring ({RING_ENTRIES} entries): {e}"))?,
            ),
        };
        Ok(Device { file, size, engine, odirect, align, ring, batches: 0, log: None })
    }

    /// Another handle on the same open file (a dup, with the same flags) with a ring of its
    /// own: what a second LMCache thread issuing I/O looks like to the device. It logs when
    /// this one does; [`Device::absorb_log`] takes its log back.
    pub fn worker(&self) -> Result<Device, String> {
        let file = self.file.try_clone().map_err(|e| format!("cannot duplicate the device fd for a worker: {e}"))?;
        let ring = match self.engine {
            Engine::Posix => None,
            Engine::IoUring => Some(
                IoUring::new(RING_ENTRIES)
                    .map_err(|e| format!("cannot set up a worker's io_uring ({RING_ENTRIES} entries): {e}"))?,
            ),
        };
        Ok(Device {
            file,
            size: self.size,
            engine: self.engine,
            odirect: self.odirect,
            align: self.align,
            ring,
            batches: 0,
            log: self.log.as_ref().map(|_| Vec::new()),
        })
    }

    /// Test hook: the same file, opened read-only from here on, so that every write fails
    /// (EBADF) as a failing device's would.
    #[cfg(test)]
    pub fn refuse_writes(&mut self) {
        self.file = File::open(format!("/proc/self/fd/{}", self.file.as_raw_fd())).unwrap();
    }

    /// Appends a worker's logged writes, its batches numbered after this device's.
    pub fn absorb_log(&mut self, w: Device) {
        if let (Some(l), Some(wl)) = (&mut self.log, w.log) {
            let base = self.batches;
            l.extend(wl.into_iter().map(|x| LoggedWrite { batch: x.batch.map(|(b, i)| (base + b, i)), ..x }));
        }
        self.batches += w.batches;
    }

    /// Issues `reqs`: posix engine, one pwrite after another in order; io_uring engine, all in
    /// one submission with no ordering between them.
    pub fn write_group(&mut self, reqs: &[WriteReq<'_>]) -> Result<(), String> {
        if reqs.is_empty() {
            return Ok(());
        }
        match self.engine {
            Engine::Posix => {
                for r in reqs {
                    self.pwrite_all(r.data, r.offset)?;
                    if let Some(l) = &mut self.log {
                        l.push(LoggedWrite { batch: None, offset: r.offset, len: r.data.len() as u64 });
                    }
                }
                Ok(())
            }
            Engine::IoUring => {
                let mut ops = Vec::with_capacity(reqs.len());
                for r in reqs {
                    let len = u32::try_from(r.data.len())
                        .map_err(|_| format!("write of {} bytes is too large for one io_uring entry", r.data.len()))?;
                    ops.push(
                        opcode::Write::new(types::Fd(self.file.as_raw_fd()), r.data.as_ptr(), len)
                            .offset(r.offset)
                            .build(),
                    );
                }
                let lens: Vec<(u64, u64)> = reqs.iter().map(|r| (r.offset, r.data.len() as u64)).collect();
                // SAFETY: every buffer in `reqs` is borrowed for this call, which waits for all
                // completions before returning.
                unsafe { self.uring_run(ops, &lens, "write")? };
                self.batches += 1;
                if let Some(l) = &mut self.log {
                    for (i, (offset, len)) in lens.into_iter().enumerate() {
                        l.push(LoggedWrite { batch: Some((self.batches, i)), offset, len });
                    }
                }
                Ok(())
            }
        }
    }

    /// Reads each `(offset, buf)`: posix engine, preads in order; io_uring, one batch per ring.
    pub fn read_group(&mut self, reqs: &mut [(u64, &mut [u8])]) -> Result<(), String> {
        match self.engine {
            Engine::Posix => {
                for (off, buf) in reqs.iter_mut() {
                    self.pread_all(buf, *off)?;
                }
                Ok(())
            }
            Engine::IoUring => {
                for chunk in reqs.chunks_mut(RING_ENTRIES as usize) {
                    let mut ops = Vec::with_capacity(chunk.len());
                    let mut lens = Vec::with_capacity(chunk.len());
                    for (off, buf) in chunk.iter_mut() {
                        let len = u32::try_from(buf.len())
                            .map_err(|_| format!("read of {} bytes is too large for one io_uring entry", buf.len()))?;
                        ops.push(
                            opcode::Read::new(types::Fd(self.file.as_raw_fd()), buf.as_mut_ptr(), len)
                                .offset(*off)
                                .build(),
                        );
                        lens.push((*off, buf.len() as u64));
                    }
                    // SAFETY: the buffers are exclusively borrowed until all completions are reaped.
                    unsafe { self.uring_run(ops, &lens, "read")? };
                }
                Ok(())
            }
        }
    }

    /// Submits `ops` together and reaps every completion; each must transfer its full length.
    unsafe fn uring_run(
        &mut self,
        ops: Vec<io_uring::squeue::Entry>,
        lens: &[(u64, u64)],
        what: &str,
    ) -> Result<(), String> {
        let ring = self.ring.as_mut().ok_or("io_uring is not set up")?;
        if ops.len() > RING_ENTRIES as usize {
            return Err(format!("io_uring batch of {} entries exceeds the ring of {RING_ENTRIES}", ops.len()));
        }
        let n = ops.len();
        {
            let mut sq = ring.submission();
            for (i, e) in ops.into_iter().enumerate() {
                // SAFETY: the caller keeps the buffers alive until we return.
                if unsafe { sq.push(&e.user_data(i as u64)) }.is_err() {
                    ring_failed(&format!("io_uring {what}: the submission queue is full"));
                }
            }
        }
        let mut results: Vec<Option<i32>> = vec![None; n];
        let mut done = 0usize;
        while done < n {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => ring_failed(&format!("io_uring submit of a {what} batch: {e}")),
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                if i < n && results[i].is_none() {
                    results[i] = Some(cqe.result());
                    done += 1;
                }
            }
        }
        for (i, r) in results.iter().enumerate() {
            let (off, len) = lens[i];
            match r {
                Some(r) if *r < 0 => {
                    return Err(format!("io_uring {what} of {len} bytes at offset {off} failed: {}", errno_text(-r)))
                }
                Some(r) if *r as u64 != len => {
                    return Err(format!("io_uring {what} at offset {off}: short transfer, {r} of {len} bytes"))
                }
                Some(_) => {}
                None => return Err(format!("io_uring {what} at offset {off}: no completion")),
            }
        }
        Ok(())
    }

    fn pwrite_all(&self, mut data: &[u8], mut offset: u64) -> Result<(), String> {
        let want = data.len();
        while !data.is_empty() {
            match self.file.write_at(data, offset) {
                Ok(0) => {
                    return Err(format!(
                        "pwrite at offset {offset}: device accepted 0 bytes ({} of {want} left)",
                        data.len()
                    ))
                }
                Ok(n) => {
                    data = &data[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("pwrite of {} bytes at offset {offset} failed: {e}", data.len())),
            }
        }
        Ok(())
    }

    fn pread_all(&self, mut buf: &mut [u8], mut offset: u64) -> Result<(), String> {
        while !buf.is_empty() {
            match FileExt::read_at(&self.file, buf, offset) {
                Ok(0) => return Err(format!("pread at offset {offset}: end of device")),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("pread of {} bytes at offset {offset} failed: {e}", buf.len())),
            }
        }
        Ok(())
    }

    /// fsync: not something LMCache does; tests use it to push buffered writes to the device.
    pub fn sync(&self) -> Result<(), String> {
        self.file.sync_all().map_err(|e| format!("fsync: {e}"))
    }
}

/// Reads of any offset and length through aligned bounce buffers, so that the fdpblk layout
/// readers work on an O_DIRECT fd as well.
impl ReadAt for Device {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if buf.is_empty() || offset >= self.size {
            return Ok(0);
        }
        let a = self.align as u64;
        let start = offset / a * a;
        let want_end = (offset + buf.len() as u64).min(self.size);
        let end = (want_end.div_ceil(a) * a).min(start + (1 << 20)).max(start + a);
        let mut b = AlignedBuf::zeroed((end - start) as usize, self.align).map_err(std::io::Error::other)?;
        let got = loop {
            match FileExt::read_at(&self.file, b.as_mut_slice(), start) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        let skip = (offset - start) as usize;
        if got <= skip {
            return Ok(0);
        }
        let n = (got - skip).min(buf.len()).min((want_end - offset) as usize);
        buf[..n].copy_from_slice(&b.as_slice()[skip..skip + n]);
        Ok(n)
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.size)
    }
}
