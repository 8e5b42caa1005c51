//! Backing I/O on the ublk queue's own io_uring, for a block device or a file: the `streams`
//! engine (O_DIRECT writes carrying the io_uring `write_stream` field, Linux >= 6.16, stream N
//! = the drive's N-th placement identifier) and the `plain` engine (no placement).
//!
//! The backing fd is registered as fixed file 1 on every queue ring (`UblkTgt::fds`).
//! Results follow ublk's completion rules: bytes done for reads and writes, 0 for the rest,
//! a negative errno on failure.

use super::{eagain_backoff, sleep_for, EAGAIN_RETRIES};
use crate::place::Handle;
use io_uring::{opcode, squeue, types};
use libublk::io::UblkQueue;

/// Fixed-file index of the backing device on the queue ring.
const BACKING: types::Fixed = types::Fixed(1);

/// What the kernel is told of a failed BLKDISCARD: `None` where the backing takes no discard
/// (a file: ENOTTY; a device without it: EOPNOTSUPP), so that PUNCH_HOLE may do instead; else
/// the drive's error (EIO, a lost path), not "not supported", after which a caller may stop
/// discarding without a word. EBUSY, EAGAIN and EINTR would reach the block layer as "busy"
/// or "again", retries it never makes for a completed request: an I/O error, as elsewhere.
fn blkdiscard_result(e: &std::io::Error) -> Option<i32> {
    match e.raw_os_error() {
        Some(libc::ENOTTY | libc::EOPNOTSUPP) => None,
        Some(libc::EBUSY | libc::EAGAIN | libc::EINTR) => Some(-libc::EIO),
        Some(n) => Some(-n),
        None => Some(-libc::EIO),
    }
}

/// Whether `fd` is a block device (else a regular file).
fn is_block_device(fd: i32) -> bool {
    // SAFETY: fstat writes one `stat` through the pointer; a zeroed one is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut st) }) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFBLK
}

/// `BLOCK_URING_CMD_DISCARD` (`_IO(0x12, 0)`, Linux >= 6.12): a discard as an io_uring command
/// on the block device, as asynchronous as a write; the byte range in `addr` and `addr3`.
const BLOCK_URING_CMD_DISCARD: u32 = 0x12 << 8;

/// What the io_uring discard's result `res` means: `Some` is the request's result; `None`, that
/// BLKDISCARD must answer instead: the kernel has no block-device io_uring commands (Linux <
/// 6.12, EOPNOTSUPP; before URING_CMD, EINVAL), the device takes no discard (EOPNOTSUPP, which
/// BLKDISCARD tells apart), the range is one the kernel refuses (EINVAL, which BLKDISCARD
/// gives again), or no room even when sent from io_uring's worker (EAGAIN: BLKDISCARD waits).
fn uring_discard_result(res: i32) -> Option<i32> {
    match res {
        r if r == -libc::EOPNOTSUPP || r == -libc::EINVAL || r == -libc::ENOTTY || r == -libc::EAGAIN => None,
        // "Device busy" to the block layer, a retry it never makes for a completed request.
        r if r == -libc::EBUSY => Some(-libc::EIO),
        r => Some(r),
    }
}

/// `BLKDISCARD` blocks until the drive is done, which for gigabytes can take long: it runs on
/// a thread of its own, and the tag waits for it on the queue ring (an eventfd poll) while
/// the queue's other tags go on.
async fn blkdiscard_off_queue(q: &UblkQueue<'_>, fd: i32, off: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: eventfd returns a new fd or -1.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new fd owned here.
    let efd = std::sync::Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
    let (tx, rx) = std::sync::mpsc::channel();
    let done = efd.clone();
    /// Wakes the tag however the thread ends (a panic too: it wakes before the channel's
    /// sender goes, so the tag polls until it sees the channel closed): the kernel waits for
    /// this request before a stop completes, so a tag that never woke would hang the stop.
    struct Wake(std::sync::Arc<OwnedFd>);
    impl Drop for Wake {
        fn drop(&mut self) {
            let one = 1u64;
            // SAFETY: writes 8 bytes from `one` to the eventfd.
            unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
    // The backing fd outlives the queue threads, and this tag waits for the thread below.
    let spawned = std::thread::Builder::new().name("fdpblk-discard".into()).spawn(move || {
        let _wake = Wake(done);
        let _ = tx.send(crate::device::blkdiscard(fd, off, len));
    });
    if let Err(e) = spawned {
        // No thread to be had (a tasks limit): failed back rather than done here, which would
        // hold the queue, and the header writes its other tags' payloads wait for, for as
        // long as the drive takes (a discard is advice: failing it loses nothing). Said here:
        // the request's failure is logged by its errno, which would point at the drive.
        // Once: while the limit holds, every discard fails so.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!("a discard of {len} bytes at byte {off} failed: no thread to run it ({e}); raise the tasks limit (TasksMax= in the unit, ulimit -u); further discards that fail so are not logged again");
        }
        return Err(e);
    }
    loop {
        match rx.try_recv() {
            Ok(r) => return r,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return Err(std::io::Error::other("discard thread ended without a result")),
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        let poll = opcode::PollAdd::new(types::Fd(efd.as_raw_fd()), libc::POLLIN as u32).build();
        let res = q.ublk_submit_sqe(poll).await;
        if res < 0 && res != -libc::EINTR {
            // The ring cannot poll (the queue is stopping): wait for the thread here.
            return rx.recv().unwrap_or_else(|_| Err(std::io::Error::other("discard thread ended")));
        }
    }
}

/// One instance per queue thread; it holds no lock and no shared state.
#[derive(Clone, Debug)]
pub struct UringEngine {
    /// Logical handle -> write stream (1-based); `None` = the plain engine, no placement.
    streams: Option<Vec<u8>>,
    /// The backing fd (also fixed file 1), for BLKDISCARD.
    fd: i32,
    /// The backing is a block device: a discard is a discard (else a punched hole).
    block: bool,
    /// The kernel refused the io_uring discard once (EOPNOTSUPP): BLKDISCARD from then on.
    no_uring_discard: std::cell::Cell<bool>,
    /// The fallback to BLKDISCARD was logged (once per queue).
    discard_fallback_logged: std::cell::Cell<bool>,
}

impl UringEngine {
    fn new(streams: Option<Vec<u8>>, fd: i32) -> Self {
        Self { streams, fd, block: is_block_device(fd), no_uring_discard: Default::default(), discard_fallback_logged: Default::default() }
    }
    pub fn plain(fd: i32) -> Self {
        Self::new(None, fd)
    }
    /// `streams[h]` is the write stream for logical handle `h`.
    pub fn streams(streams: Vec<u8>, fd: i32) -> Self {
        Self::new(Some(streams), fd)
    }
    pub fn name(&self) -> &'static str {
        if self.streams.is_some() {
            "streams"
        } else {
            "plain"
        }
    }

    async fn submit(q: &UblkQueue<'_>, sqe: squeue::Entry) -> i32 {
        let mut retry = 0;
        loop {
            let res = q.ublk_submit_sqe(sqe.clone()).await;
            // EBUSY would reach the block layer as "device busy" (BLK_STS_DEV_RESOURCE), a
            // retry it never makes for a completed request: an I/O error, as passthrough has.
            if res == -libc::EBUSY {
                return -libc::EIO;
            }
            // EINTR (io-wq interrupted): the same request again, as passthrough does.
            if res != -libc::EAGAIN && res != -libc::EINTR {
                return res;
            }
            retry += 1;
            // Still no room (or the queue is stopping): an I/O error, not a "try again" for a
            // caller that never asked for non-blocking I/O.
            if retry > EAGAIN_RETRIES || !sleep_for(q, eagain_backoff(retry)).await {
                return -libc::EIO;
            }
        }
    }

    /// Writes all of `buf` at `off`; short writes are continued.
    pub async fn write(&self, q: &UblkQueue<'_>, off: u64, buf: &[u8], handle: Handle, fua: bool) -> i32 {
        let stream = self.streams.as_ref().and_then(|s| s.get(usize::from(handle)).copied()).unwrap_or(0);
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            let mut op = opcode::Write::new(BACKING, rest.as_ptr(), rest.len() as u32).offset(off + done as u64);
            if fua {
                op = op.rw_flags(libc::RWF_DSYNC);
            }
            if stream != 0 {
                op = op.write_stream(stream);
            }
            let res = Self::submit(q, op.build().flags(squeue::Flags::FIXED_FILE)).await;
            if res <= 0 {
                return if res == 0 { -libc::EIO } else { res };
            }
            done += res as usize;
        }
        done as i32
    }

    /// Fills all of `buf` from `off`; short reads are continued.
    pub async fn read(&self, q: &UblkQueue<'_>, off: u64, buf: &mut [u8]) -> i32 {
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &mut buf[done..];
            let op = opcode::Read::new(BACKING, rest.as_mut_ptr(), rest.len() as u32).offset(off + done as u64);
            let res = Self::submit(q, op.build().flags(squeue::Flags::FIXED_FILE)).await;
            if res <= 0 {
                return if res == 0 { -libc::EIO } else { res };
            }
            done += res as usize;
        }
        done as i32
    }

    pub async fn flush(&self, q: &UblkQueue<'_>) -> i32 {
        Self::submit(q, opcode::Fsync::new(BACKING).build().flags(squeue::Flags::FIXED_FILE)).await
    }

    /// Deallocates (a discard from the ublk device; LMCache issues none, fdpblk's own
    /// deallocation uses BLKDISCARD too). On a block device: a discard (the io_uring command,
    /// else BLKDISCARD on a thread), which is Dataset Management deallocate on an NVMe
    /// namespace, as the passthrough engine sends; not `fallocate(PUNCH_HOLE)`, which there is
    /// Write Zeroes, and a drive whose DLFEAT does not let it deallocate for one writes the
    /// zeroes (media writes, minutes for gigabytes). A device without discard gets PUNCH_HOLE
    /// instead (zeroes, as before), as a file always does: there it frees blocks, and reads
    /// return zeroes afterwards.
    pub async fn discard(&self, q: &UblkQueue<'_>, off: u64, len: u64) -> i32 {
        if self.block && !self.no_uring_discard.get() {
            let mut cmd = [0u8; 16];
            cmd[..8].copy_from_slice(&len.to_le_bytes()); // addr3
            let op = opcode::UringCmd16::new(BACKING, BLOCK_URING_CMD_DISCARD).addr(Some(off)).cmd(cmd).build();
            let mut res = q.ublk_submit_sqe(op.clone().flags(squeue::Flags::FIXED_FILE)).await;
            if res == -libc::EAGAIN {
                // Issued at once, the discard may not wait (REQ_NOWAIT): a block layer with no
                // free request now, or a queue frozen by a controller reset, fails it with
                // EAGAIN, which io_uring does not send again. Once more from io_uring's worker,
                // which waits as BLKDISCARD does.
                res = q.ublk_submit_sqe(op.flags(squeue::Flags::FIXED_FILE | squeue::Flags::ASYNC)).await;
            }
            if let Some(res) = uring_discard_result(res) {
                return res;
            }
            // A kernel without it says so for good; a range it refuses may be this one only;
            // EAGAIN even from the worker (no memory for the bios) is this request's.
            if res == -libc::EOPNOTSUPP {
                self.no_uring_discard.set(true);
            }
            if res != -libc::EAGAIN && !self.discard_fallback_logged.replace(true) {
                tracing::info!(
                    "queue {}: no io_uring discard ({}: Linux < 6.12, a device without discard, or a range it refuses): BLKDISCARD instead, on a thread of its own",
                    q.get_qid(),
                    std::io::Error::from_raw_os_error(-res)
                );
            }
        }
        if self.block {
            match blkdiscard_off_queue(q, self.fd, off, len).await.map_err(|e| blkdiscard_result(&e)) {
                Ok(()) => return 0,
                Err(Some(res)) => return res,
                Err(None) => {}
            }
        }
        self.fallocate(q, off, len, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE).await
    }

    /// Zeroes; `unmap` lets the device deallocate (the block layer's default), NOUNMAP not.
    /// Without Write Zeroes on the drive, unmapping falls back to ZERO_RANGE, which the
    /// kernel may carry out by writing zeroes.
    pub async fn write_zeroes(&self, q: &UblkQueue<'_>, off: u64, len: u64, unmap: bool) -> i32 {
        if unmap {
            let res = self.fallocate(q, off, len, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE).await;
            if res != -libc::EOPNOTSUPP {
                return res;
            }
        }
        self.fallocate(q, off, len, libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE).await
    }

    async fn fallocate(&self, q: &UblkQueue<'_>, off: u64, len: u64, mode: i32) -> i32 {
        let op = opcode::Fallocate::new(BACKING, len).offset(off).mode(mode);
        Self::submit(q, op.build().flags(squeue::Flags::FIXED_FILE)).await
    }
}

#[cfg(test)]
mod tests {
    use super::{blkdiscard_result, is_block_device};
    use std::io::Error;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_failed_blkdiscard_reports_the_drives_error_or_falls_back() {
        assert_eq!(blkdiscard_result(&Error::from_raw_os_error(libc::EIO)), Some(-libc::EIO));
        assert_eq!(blkdiscard_result(&Error::from_raw_os_error(libc::ENOLINK)), Some(-libc::ENOLINK));
        for busy in [libc::EBUSY, libc::EAGAIN, libc::EINTR] {
            assert_eq!(blkdiscard_result(&Error::from_raw_os_error(busy)), Some(-libc::EIO), "errno {busy}");
        }
        // The discard thread ended without a result: not known to be done.
        assert_eq!(blkdiscard_result(&Error::other("no errno")), Some(-libc::EIO));
        // A file, or a device without discard: PUNCH_HOLE instead.
        assert_eq!(blkdiscard_result(&Error::from_raw_os_error(libc::ENOTTY)), None);
        assert_eq!(blkdiscard_result(&Error::from_raw_os_error(libc::EOPNOTSUPP)), None);
    }

    #[test]
    fn an_io_uring_discard_the_kernel_cannot_do_goes_to_blkdiscard() {
        use super::uring_discard_result;
        assert_eq!(uring_discard_result(0), Some(0));
        // The drive's own failure is the request's.
        assert_eq!(uring_discard_result(-libc::EIO), Some(-libc::EIO));
        assert_eq!(uring_discard_result(-libc::ENOLINK), Some(-libc::ENOLINK));
        assert_eq!(uring_discard_result(-libc::EBUSY), Some(-libc::EIO));
        // No block-device io_uring commands, no discard on the device, a range refused, no
        // room even from io_uring's worker.
        for e in [libc::EOPNOTSUPP, libc::EINVAL, libc::ENOTTY, libc::EAGAIN] {
            assert_eq!(uring_discard_result(-e), None, "errno {e}");
        }
        assert_eq!(super::BLOCK_URING_CMD_DISCARD, 0x1200, "_IO(0x12, 0)");
    }

    #[test]
    fn a_file_is_not_a_block_device() {
        let f = std::fs::File::open("Cargo.toml").unwrap();
        assert!(!is_block_device(f.as_raw_fd()));
        assert!(!is_block_device(-1));
    }
}
