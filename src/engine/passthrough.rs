//! The `passthrough` engine: NVMe I/O commands on the namespace's generic character device
//! (`/dev/ngXnY`) through io_uring `URING_CMD` (Linux >= 5.19). Every write carries the Data
//! Placement directive (DTYPE 2) with the placement identifier of its handle (but under
//! `--policy none`, which places nothing), so placement works without block-layer write
//! streams and with any identifier the drive lists.
//!
//! Rings: libublk's queue ring has 64-byte SQEs and cannot carry NVMe commands, so each queue
//! thread owns a second ring (`SQE128 | CQE32`, default set-up flags: no DEFER_TASKRUN, whose
//! completions only show up when the ring itself is entered). An eventfd is registered on it;
//! the reaper task ([`PassthroughEngine::reap`]) keeps one `PollAdd` on that eventfd
//! outstanding on the *queue* ring, so the queue thread, which sleeps in the queue ring, wakes
//! for NVMe completions too. The reaper then drains the NVMe completion queue into a small
//! slab keyed by `user_data` and wakes the futures waiting there. One thread, no locks.
//!
//! Requests longer than one command may carry (the transfer limit, or 65536 blocks) are split
//! ([`split`]) and sent in windows of up to 64 commands ([`tag_window`]), each awaited whole before the next;
//! the first window with a failure fails the request, and the windows after it are not sent
//! (a failed request promises nothing about its range). Reads and writes use the ublk
//! tag's buffer directly (copy mode). Results follow ublk's rules: bytes for reads and
//! writes, 0 for the rest, a negative errno on failure; an NVMe status becomes the errno of
//! the block status the kernel's own NVMe driver gives it ([`errno_of`]; `-EIO` for most) and
//! is logged, at most once a second per queue.

use super::{eagain_backoff, sleep_for, EAGAIN_RETRIES};
use crate::device::ReadAt;
use crate::nvme::cmd::{self, DsmRange, PassthruCmd, MAX_DSM_RANGES, MAX_NLB};
use crate::nvme::ioctl::{self, Data, NVME_URING_CMD_IO};
use crate::nvme::reset;
use crate::nvme::fdp::{FdpConfig, RuhStatusDesc};
use crate::nvme::{FdpInfo, NvmeDevice, NvmeError};
use crate::place::Handle;
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use libublk::io::UblkQueue;
use std::cell::{Cell, RefCell};
use std::fs::File;
use std::future::Future;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Most commands of one request in flight at once (a request of more goes in windows); fewer
/// at a queue depth past 1024 ([`tag_window`]).
const WINDOW: usize = 64;

/// Commands one tag may have in flight: [`WINDOW`], or fewer where every tag's window would
/// not fit the completion queue of `cq` entries (at a depth past 1024, against the kernel's
/// 65536): past it completions go to the kernel's overflow list, whose atomic allocation may
/// fail under memory pressure and lose one, leaving its request hanging.
fn tag_window(depth: u16, cq: u32) -> usize {
    (cq as usize / usize::from(depth.max(1))).clamp(1, WINDOW)
}

/// The ring's submission and completion queue entries for a queue of `depth` tags: two
/// commands per tag (more are queued by submitting early when it is full), and a completion
/// for what every tag may have in flight, up to the kernel's 65536.
fn ring_entries(depth: u16) -> (u32, u32) {
    let entries = (u32::from(depth.max(1)) * 2).next_power_of_two().clamp(8, 4096);
    let cq = (u32::from(depth.max(1)) * WINDOW as u32).next_power_of_two().clamp(entries * 4, 65536);
    (entries, cq)
}
/// Waits one [`reset::TICK`] on the queue's ring; false when the queue is stopping.
async fn sleep_tick(q: &UblkQueue<'_>) -> bool {
    sleep_for(q, reset::TICK).await
}

/// Longest wait before one retry that the drive asks to delay (its CRDT fields allow 109
/// minutes; a request held that long looks hung to LMCache).
const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

/// How long to wait before sending a command again after result `res`, for its `retry`th time
/// (from 1): the drive's Command Retry Delay when its status asks for one (CRD 1..3 picks
/// CRDT1..3), as the kernel's NVMe driver waits (`nvme_retry_req`), at most
/// [`MAX_RETRY_DELAY`]; after the kernel's -EAGAIN (no room for it now), a wait growing with
/// each retry ([`eagain_backoff`]); otherwise none.
fn retry_delay(res: i32, crdt: &[Duration; 3], retry: usize) -> Duration {
    match res {
        r if r == -libc::EAGAIN => eagain_backoff(retry),
        r if r <= 0 => Duration::ZERO,
        r => match cmd::NvmeStatus(r as u16).crd() {
            0 => Duration::ZERO,
            n => crdt[usize::from(n) - 1].min(MAX_RETRY_DELAY),
        },
    }
}

/// Resubmissions of a command that failed in a way worth another try (as the kernel's own
/// block path retries, `nvme_max_retries`): passthrough requests are never retried by it.
const TRANSIENT_RETRIES: usize = 5;
/// How long one request's commands may spend being retried in all (the kernel's own I/O
/// timeout is 30 s per command): past it a transient failure fails the request. Time spent
/// retrying, not since the request began: a Write Zeroes of a terabyte runs for minutes.
const REQUEST_RETRY_TIME: Duration = Duration::from_secs(30);

/// A completion worth resubmitting: the kernel had no room now (-EAGAIN), the command was
/// cancelled by a controller reset (-EINTR), or the drive failed it without Do Not Retry.
fn transient(res: i32) -> bool {
    match res {
        r if r < 0 => r == -libc::EAGAIN || r == -libc::EINTR,
        0 => false,
        r => !cmd::NvmeStatus(r as u16).dnr(),
    }
}
/// A completion's result as the rest of the engine reads it: a status whose status code is
/// Successful Completion (only its More or other flag bits set) is a success, as the kernel's
/// own NVMe driver takes it (`nvme_error_status` looks at SCT/SC alone).
fn command_result(res: i32) -> i32 {
    if res > 0 && cmd::NvmeStatus(res as u16).succeeded() {
        0
    } else {
        res
    }
}

/// The errno a failed command's result becomes for ublk, which turns it into the block
/// status the kernel's own NVMe driver gives the same NVMe status (`nvme_error_status`, as
/// of Linux 6.x).
fn errno_of(res: i32) -> i32 {
    match res {
        0 => 0,
        // Still no room after the retries: an I/O error, not a "try again" the block
        // layer would hand to a caller that never asked for non-blocking I/O.
        // Likewise EBUSY, which the block layer would take for "device busy, retry".
        r if r == -libc::EAGAIN || r == -libc::EBUSY => -libc::EIO,
        r if r < 0 => r,
        r => match cmd::NvmeStatus(r as u16).code() {
            // Invalid Opcode, Invalid Field, Invalid Namespace, Conflicting Attributes,
            // Command Size Limit Exceeded (the kernel's ONCS_NOT_SUPPORTED): BLK_STS_NOTSUPP.
            0x01 | 0x02 | 0x0b | 0x180 | 0x183 => -libc::EOPNOTSUPP,
            // LBA Out of Range, Command Interrupted, Namespace Not Ready: BLK_STS_TARGET.
            0x80 | 0x21 | 0x82 => -libc::EREMOTEIO,
            0x81 => -libc::ENOSPC, // Capacity Exceeded: BLK_STS_NOSPC
            // Write fault, unrecovered read, compare failure, access denied, unwritten block,
            // write to a read-only range: BLK_STS_MEDIUM.
            0x280 | 0x281 | 0x285..=0x287 | 0x182 => -libc::ENODATA,
            // Guard, application or reference tag check, invalid PI: BLK_STS_PROTECTION.
            0x282..=0x284 | 0x181 => -libc::EILSEQ,
            0x83 => -libc::EBADE,   // Reservation Conflict: BLK_STS_RESV_CONFLICT
            0x370 => -libc::ENOLINK, // Host Path Error: BLK_STS_TRANSPORT
            _ => -libc::EIO,
        },
    }
}

/// At most one NVMe error line per this interval and queue.
const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// One command's share of a request: `nlb` blocks from `slba`, and the bytes of the
/// request's buffer it moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub slba: u64,
    pub nlb: u32,
    pub buf: Range<usize>,
}

/// Splits `len` bytes at byte `off` into commands of at most `max_transfer` bytes (rounded
/// down to whole blocks, at least one block) and at most 65536 blocks each. `off` and `len`
/// must be multiples of the block size (`1 << lba_shift`); `Err(-EINVAL)` otherwise.
pub fn split(off: u64, len: u64, lba_shift: u8, max_transfer: u32) -> Result<Splits, i32> {
    let lba_shift = u32::from(lba_shift);
    if lba_shift >= 32 {
        return Err(-libc::EINVAL);
    }
    let mask = (1u64 << lba_shift) - 1;
    if off & mask != 0 || len & mask != 0 || off.checked_add(len).is_none() {
        return Err(-libc::EINVAL);
    }
    let max_blocks = (u64::from(max_transfer) >> lba_shift).clamp(1, u64::from(MAX_NLB));
    Ok(Splits { slba: off >> lba_shift, blocks: len >> lba_shift, done: 0, max_blocks, lba_shift })
}

/// The iterator [`split`] returns.
#[derive(Clone, Debug)]
pub struct Splits {
    slba: u64,
    blocks: u64,
    done: u64,
    max_blocks: u64,
    lba_shift: u32,
}

impl Iterator for Splits {
    type Item = Chunk;
    fn next(&mut self) -> Option<Chunk> {
        let left = self.blocks - self.done;
        if left == 0 {
            return None;
        }
        let n = left.min(self.max_blocks);
        let start = (self.done << self.lba_shift) as usize;
        let c =
            Chunk { slba: self.slba + self.done, nlb: n as u32, buf: start..start + ((n << self.lba_shift) as usize) };
        self.done += n;
        Some(c)
    }
}

fn page_size() -> usize {
    crate::device::page_size() as usize
}

/// What one request may spend on its commands, whatever the windows they go in: one wait
/// for a controller reset (its commands wait out the same reset together), and one retry
/// time (a window's commands are retried one after another, each up to TRANSIENT_RETRIES
/// times after the drive's delay, up to 5 s, which for 64 commands would keep LMCache's
/// request waiting for half an hour).
#[derive(Default)]
struct RequestBudget {
    hold: reset::Hold,
    spent: Duration,
}

/// State of one command in the slab.
enum Slot {
    Free {
        next: u32,
    },
    /// Submitted; the waker of the future waiting for it.
    Pending(Option<Waker>),
    /// Completed with this result; the future has not looked yet.
    Done(i32),
    /// Submitted, but its future is gone: freed when the completion arrives.
    Orphan,
}

const NO_SLOT: u32 = u32::MAX;

/// The commands of one queue thread, keyed by their `user_data`.
struct Slab {
    slots: Vec<Slot>,
    free: u32,
    /// Commands the kernel has not completed yet.
    inflight: usize,
}

impl Slab {
    fn new(cap: usize) -> Self {
        Slab { slots: Vec::with_capacity(cap), free: NO_SLOT, inflight: 0 }
    }

    fn alloc(&mut self) -> u32 {
        self.inflight += 1;
        if self.free != NO_SLOT {
            let key = self.free;
            if let Slot::Free { next } = self.slots[key as usize] {
                self.free = next;
            }
            self.slots[key as usize] = Slot::Pending(None);
            key
        } else {
            self.slots.push(Slot::Pending(None));
            (self.slots.len() - 1) as u32
        }
    }

    fn release(&mut self, key: u32) {
        if let Some(s) = self.slots.get_mut(key as usize) {
            *s = Slot::Free { next: self.free };
            self.free = key;
        }
    }

    /// A command that never reached the kernel.
    fn unsubmitted(&mut self, key: u32) {
        self.inflight = self.inflight.saturating_sub(1);
        self.release(key);
    }

    /// The kernel completed `key` with `res`.
    fn complete(&mut self, key: u64, res: i32) {
        let Some(slot) = usize::try_from(key).ok().and_then(|k| self.slots.get_mut(k)) else {
            tracing::warn!("passthrough: completion for unknown command {key:#x}");
            return;
        };
        match std::mem::replace(slot, Slot::Done(res)) {
            Slot::Pending(w) => {
                self.inflight = self.inflight.saturating_sub(1);
                if let Some(w) = w {
                    w.wake();
                }
            }
            Slot::Orphan => {
                self.inflight = self.inflight.saturating_sub(1);
                self.release(key as u32);
            }
            other => {
                *slot = other;
                tracing::warn!("passthrough: completion for idle command {key:#x}");
            }
        }
    }
}

/// The future of one submitted command: its completion result (0, NVMe status or -errno).
struct Op<'a> {
    slab: &'a RefCell<Slab>,
    key: u32,
    done: bool,
}

impl Future for Op<'_> {
    type Output = i32;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<i32> {
        let cell = self.slab;
        let mut slab = cell.borrow_mut();
        match slab.slots.get_mut(self.key as usize) {
            Some(Slot::Done(res)) => {
                let res = *res;
                slab.release(self.key);
                drop(slab);
                self.done = true;
                Poll::Ready(res)
            }
            Some(Slot::Pending(w)) => {
                if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *w = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            _ => {
                drop(slab);
                self.done = true;
                Poll::Ready(-libc::EIO)
            }
        }
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The kernel may still use the buffer; the slot lives on until the completion.
        if let Ok(mut slab) = self.slab.try_borrow_mut() {
            match slab.slots.get(self.key as usize) {
                Some(Slot::Done(_)) => slab.release(self.key),
                Some(Slot::Pending(_)) => slab.slots[self.key as usize] = Slot::Orphan,
                _ => {}
            }
        }
    }
}

/// NVMe passthrough for one ublk queue thread. Not `Send`: it lives on its queue's thread.
pub struct PassthroughEngine {
    ring: RefCell<IoUring<squeue::Entry128, cqueue::Entry32>>,
    slab: RefCell<Slab>,
    efd: OwnedFd,
    /// The namespace's generic char device (owned by the target; outlives the queues).
    fd: RawFd,
    nsid: u32,
    lba_shift: u8,
    max_transfer: u32,
    /// Bytes of one Write Zeroes command (besides the 65536-block field limit).
    write_zeroes_max: u32,
    /// Blocks of one deallocated range.
    dsm_max_blocks: u32,
    /// Ranges per Dataset Management command (the drive's DMRL, at most 256).
    dsm_max_ranges: usize,
    /// Logical handle -> placement identifier; empty = no directive (policy `none`).
    pids: Vec<u16>,
    page: usize,
    last_log: Cell<Option<Instant>>,
    unlogged: Cell<u64>,
    /// The state of the namespace's controller, for waiting out resets.
    ctrl_state: Option<reset::ControllerState>,
    last_reset_log: Cell<Option<Instant>>,
    /// The controller's Command Retry Delay Times (CRDT1..3).
    crdt: [Duration; 3],
    /// Whether an unmapping Write Zeroes carries DEAC (the namespace's DLFEAT allows it).
    deac: bool,
    /// Commands one request may have in flight ([`tag_window`]).
    window: usize,
}

/// A query of an opened NVMe device; the open's error or the query's, as text.
fn ask<T>(
    dev: &Result<crate::nvme::NvmeDevice, crate::nvme::NvmeError>,
    query: impl FnOnce(&crate::nvme::NvmeDevice) -> Result<T, crate::nvme::NvmeError>,
) -> Result<T, String> {
    dev.as_ref().map_err(|e| e.to_string()).and_then(|d| query(d).map_err(|e| e.to_string()))
}

impl PassthroughEngine {
    /// Watches the state of the controller behind `ng` (`/dev/ngXnY`), so that commands a
    /// controller reset failed are sent again once it is live.
    /// Also waits the controller's Command Retry Delay before retrying a command whose
    /// status asks for it.
    /// An unmapping Write Zeroes carries DEAC only where the namespace says it may (DLFEAT,
    /// as Linux decides for the block device); elsewhere the drive writes the zeroes.
    pub fn with_controller_of(mut self, ng: &Path) -> Self {
        self.ctrl_state = reset::ControllerState::of(ng);
        let dev = crate::nvme::NvmeDevice::open(ng);
        match ask(&dev, |d| d.identify_ctrl()) {
            Ok(id) => self.crdt = id.crdt.map(|t| Duration::from_millis(100 * u64::from(t))),
            Err(e) => tracing::warn!("passthrough: no Command Retry Delay Times ({e}): failed commands are retried at once"),
        }
        match ask(&dev, |d| d.identify_ns(self.nsid)) {
            Ok(ns) => self.deac = ns.write_zeroes_deallocates(),
            Err(e) => tracing::warn!("passthrough: no Deallocate Logical Block Features ({e}): Write Zeroes writes zeroes, never deallocates"),
        }
        self
    }

    /// Caps Write Zeroes at `limits.write_zeroes_bytes`, each deallocated range at
    /// `limits.discard_bytes` and the ranges per command at `limits.discard_segments` (the
    /// drive's WZSL, DMRSL and DMRL, as the kernel reports them for the namespace's block
    /// device).
    pub fn with_limits(mut self, limits: CommandLimits) -> Self {
        let block = 1u64 << self.lba_shift;
        self.max_transfer = limits.cap_transfer(u64::from(self.max_transfer), block) as u32;
        if let Some(b) = limits.write_zeroes_bytes.filter(|&b| b >= block) {
            self.write_zeroes_max = b.min(u64::from(u32::MAX)) as u32;
        }
        if let Some(b) = limits.discard_bytes.filter(|&b| b >= block) {
            self.dsm_max_blocks = (b >> self.lba_shift).min(u64::from(u32::MAX)) as u32;
        }
        if let Some(n) = limits.discard_segments {
            self.dsm_max_ranges = (n as usize).clamp(1, MAX_DSM_RANGES);
        }
        self
    }

    /// `depth` is the ublk queue depth ([`ring_entries`], [`tag_window`]).
    pub fn new(fd: RawFd, nsid: u32, lba_shift: u8, max_transfer: u32, pids: Vec<u16>, depth: u16) -> io::Result<Self> {
        let (entries, cq) = ring_entries(depth);
        let ring = IoUring::<squeue::Entry128, cqueue::Entry32>::builder().setup_cqsize(cq).build(entries)?;
        // SAFETY: eventfd returns a new descriptor or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `efd` was just created and is owned here.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        Ok(Self {
            ring: RefCell::new(ring),
            slab: RefCell::new(Slab::new(entries as usize)),
            efd,
            fd,
            nsid,
            lba_shift,
            max_transfer: max_transfer.max(1 << lba_shift),
            write_zeroes_max: u32::MAX,
            dsm_max_blocks: u32::MAX,
            dsm_max_ranges: MAX_DSM_RANGES,
            pids,
            page: page_size(),
            last_log: Cell::new(None),
            unlogged: Cell::new(0),
            ctrl_state: None,
            last_reset_log: Cell::new(None),
            crdt: [Duration::ZERO; 3],
            deac: false,
            window: tag_window(depth, cq),
        })
    }

    pub fn name(&self) -> &'static str {
        "passthrough"
    }

    /// Largest command for a buffer at `ptr`: a buffer that does not start on a page spans
    /// one page more, so it gets a page less (the driver's segment limit counts pages).
    fn max_for(&self, ptr: *const u8) -> u32 {
        let m = self.max_transfer;
        if (ptr as usize).is_multiple_of(self.page) || (m as usize) <= self.page {
            return m;
        }
        m - self.page as u32
    }

    fn push(&self, c: &PassthruCmd) -> Result<Op<'_>, i32> {
        let mut bytes = [0u8; 80];
        bytes[..cmd::CMD_BYTES].copy_from_slice(&c.to_bytes());
        let key = self.slab.borrow_mut().alloc();
        let sqe =
            opcode::UringCmd80::new(types::Fd(self.fd), NVME_URING_CMD_IO).cmd(bytes).build().user_data(u64::from(key));
        let mut ring = self.ring.borrow_mut();
        for _ in 0..EAGAIN_RETRIES {
            // SAFETY: the command's buffers outlive its completion: the data buffer is the
            // tag's, and every caller awaits the returned Op to its end (never dropped early:
            // see `QueueEngine`; a dropped Op keeps only its slot, not the buffer), and the
            // queue drains before its tasks are dropped; DSM range lists are kept until then.
            if unsafe { ring.submission().push(&sqe) }.is_ok() {
                return Ok(Op { slab: &self.slab, key, done: false });
            }
            // Full: hand the queued commands to the kernel and try again.
            if let Err(e) = ring.submit() {
                if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                    break;
                }
            }
        }
        self.slab.borrow_mut().unsubmitted(key);
        Err(-libc::EAGAIN)
    }

    fn submit(&self) {
        let ring = self.ring.borrow();
        for _ in 0..EAGAIN_RETRIES {
            match ring.submit() {
                Ok(_) => return,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => continue,
                Err(e) => {
                    tracing::error!("passthrough: io_uring submit: {e}");
                    break;
                }
            }
        }
        // Left in the SQ (their buffers are the requests', so they cannot be failed back):
        // wake the reaper, which submits them again until the kernel takes them.
        self.kick();
    }

    /// Wakes the reaper as a completion would.
    fn kick(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from `one` to the eventfd.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Commands pushed to the SQ that the kernel has not taken yet.
    fn unsubmitted(&self) -> bool {
        !self.ring.borrow_mut().submission().is_empty()
    }

    /// Turns a command's completion into 0 or a negative errno, logging NVMe statuses.
    fn errno(&self, what: &str, c: &PassthruCmd, res: i32) -> i32 {
        if res == 0 {
            return 0;
        }
        let now = Instant::now();
        if self.last_log.get().is_none_or(|t| now.duration_since(t) >= LOG_INTERVAL) {
            let more = self.unlogged.replace(0);
            let why = if res > 0 {
                cmd::NvmeStatus(res as u16).to_string()
            } else {
                io::Error::from_raw_os_error(-res).to_string()
            };
            tracing::error!(
                "passthrough: {what} {}: {why}{}",
                describe(c),
                if more > 0 { format!(" ({more} more errors not logged)") } else { String::new() }
            );
            self.last_log.set(Some(now));
        } else {
            self.unlogged.set(self.unlogged.get() + 1);
        }
        errno_of(res)
    }

    /// `res`, or the result of sending `c` again while it failed in a transient way (after
    /// [`retry_delay`]), while the request's retry time (`spent` of
    /// [`REQUEST_RETRY_TIME`]) lasts.
    async fn retried(&self, q: &UblkQueue<'_>, c: &PassthruCmd, mut res: i32, spent: &mut Duration) -> i32 {
        // Counted apart: the kernel's -EAGAIN (no room now) and the drive's transient failures.
        let (mut eagains, mut tries) = (0, 0);
        while transient(res) && *spent < REQUEST_RETRY_TIME {
            let eagain = res == -libc::EAGAIN;
            let n = if eagain { &mut eagains } else { &mut tries };
            if *n >= if eagain { EAGAIN_RETRIES } else { TRANSIENT_RETRIES } {
                break;
            }
            *n += 1;
            let d = retry_delay(res, &self.crdt, *n);
            if !d.is_zero() && !sleep_for(q, d).await {
                break;
            }
            // The time the drive takes counts, not the host's own backoff: a burst of -EAGAIN
            // over a window of commands must not use up the retries a controller reset needs.
            let start = Instant::now();
            res = self.send(c).await;
            *spent += start.elapsed() + if eagain { Duration::ZERO } else { d };
        }
        res
    }

    /// Sends `c` once more and awaits it.
    async fn send(&self, c: &PassthruCmd) -> i32 {
        match self.push(c) {
            Ok(op) => {
                self.submit();
                op.await
            }
            Err(e) => e,
        }
    }

    /// Logs (at most once per `LOG_INTERVAL`) that failed commands wait for the controller.
    fn note_reset_hold(&self) {
        let now = Instant::now();
        if self.last_reset_log.get().is_none_or(|t| now.duration_since(t) >= LOG_INTERVAL) {
            self.last_reset_log.set(Some(now));
            tracing::warn!(
                "passthrough: the NVMe controller is not live (reset?): commands it failed are sent again once it is (up to {} s)",
                u64::from(reset::WAIT_TICKS) * reset::TICK.as_millis() as u64 / 1000
            );
        }
    }

    /// Whether the NVMe controller is serving I/O; true when its state is unknown.
    fn controller_live(&self) -> bool {
        self.ctrl_state.as_ref().is_none_or(reset::ControllerState::live)
    }

    /// Submits the commands, then awaits them: 0, or the first failure. They go out in
    /// windows of at most [`tag_window`] (fewer when the ring is full): a discard or Write Zeroes
    /// of gigabytes is thousands of commands, more than the ring holds at once.
    async fn run(&self, q: &UblkQueue<'_>, what: &str, cmds: impl Iterator<Item = Result<PassthruCmd, i32>>) -> i32 {
        self.run_within(q, what, cmds, &mut RequestBudget::default()).await
    }

    /// [`Self::run`] for part of a request, within the request's `budget`.
    async fn run_within(&self, q: &UblkQueue<'_>, what: &str, cmds: impl Iterator<Item = Result<PassthruCmd, i32>>, budget: &mut RequestBudget) -> i32 {
        let mut cmds = cmds.fuse();
        let mut err = 0;
        // A command the ring had no room for: the first of the next window.
        let mut waiting: Option<PassthruCmd> = None;
        let RequestBudget { hold, spent } = budget;
        // Waits for room in a full ring since the last command that found some.
        let mut full_waits = 0;
        loop {
            let mut ops: Vec<(PassthruCmd, Op<'_>)> = Vec::new();
            while err == 0 && ops.len() < self.window {
                let c = match waiting.take().map(Ok).or_else(|| cmds.next()) {
                    None => break,
                    Some(Err(e)) => {
                        err = e;
                        break;
                    }
                    Some(Ok(c)) => c,
                };
                match self.push(&c) {
                    Ok(op) => {
                        ops.push((c, op));
                        full_waits = 0;
                    }
                    // Full: the commands already pushed complete first.
                    Err(e) if e == -libc::EAGAIN && !ops.is_empty() => {
                        waiting = Some(c);
                        break;
                    }
                    // Full with none of this request's commands in it: other tags' commands
                    // fill the ring, or the kernel takes no more until its completions are
                    // reaped. The wait lets the reaper run and those commands end; retried at
                    // once, the push would mostly find the same ring.
                    Err(e) if e == -libc::EAGAIN && full_waits < EAGAIN_RETRIES => {
                        full_waits += 1;
                        if !sleep_for(q, eagain_backoff(full_waits)).await {
                            err = -libc::EIO;
                            break;
                        }
                        waiting = Some(c);
                    }
                    Err(e) => err = if e == -libc::EAGAIN { -libc::EIO } else { e },
                }
            }
            if ops.is_empty() {
                return err;
            }
            self.submit();
            for (c, op) in ops {
                let first = op.await;
                // The request has failed already: its other commands are only waited for
                // (their buffers must outlive them), not retried or sent again.
                if err != 0 {
                    continue;
                }
                let mut res = self.retried(q, &c, first, spent).await;
                // A controller reset fails the passthrough commands in flight (cancelled, or
                // refused with EINVAL or EFAULT while the kernel rebuilds the namespace, also
                // for a moment after the controller is live again) where the block path would
                // hold them back: wait until the controller is live, then send them again.
                while res != 0 {
                    let live = self.controller_live();
                    if !hold.again(live, reset::kernel_refusal(res)) {
                        break;
                    }
                    if !live {
                        self.note_reset_hold();
                    }
                    // A stopping queue ends the wait: the command fails as it is.
                    if !sleep_tick(q).await {
                        break;
                    }
                    if self.controller_live() {
                        res = self.retried(q, &c, self.send(&c).await, spent).await;
                    }
                }
                if err == 0 {
                    err = self.errno(what, &c, res);
                }
            }
            if err != 0 {
                return err;
            }
        }
    }

    fn pid(&self, handle: Handle) -> Option<u16> {
        self.pids.get(usize::from(handle)).copied()
    }

    /// Writes all of `buf` at `off` with the placement identifier of `handle`.
    pub async fn write(&self, q: &UblkQueue<'_>, off: u64, buf: &[u8], handle: Handle, fua: bool) -> i32 {
        let Ok(len) = i32::try_from(buf.len()) else { return -libc::EINVAL };
        let chunks = match split(off, buf.len() as u64, self.lba_shift, self.max_for(buf.as_ptr())) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let (nsid, pid) = (self.nsid, self.pid(handle));
        let base = buf.as_ptr() as u64;
        let cmds = chunks.map(|c| {
            cmd::write(nsid, c.slba, c.nlb, pid, fua)
                .map(|w| w.with_data(base + c.buf.start as u64, c.buf.len() as u32))
                .map_err(|_| -libc::EINVAL)
        });
        match self.run(q, "write", cmds).await {
            0 => len,
            e => e,
        }
    }

    /// Fills all of `buf` from `off`.
    pub async fn read(&self, q: &UblkQueue<'_>, off: u64, buf: &mut [u8]) -> i32 {
        let Ok(len) = i32::try_from(buf.len()) else { return -libc::EINVAL };
        let chunks = match split(off, buf.len() as u64, self.lba_shift, self.max_for(buf.as_ptr())) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let nsid = self.nsid;
        let base = buf.as_mut_ptr() as u64;
        let cmds = chunks.map(|c| {
            cmd::read(nsid, c.slba, c.nlb)
                .map(|r| r.with_data(base + c.buf.start as u64, c.buf.len() as u32))
                .map_err(|_| -libc::EINVAL)
        });
        match self.run(q, "read", cmds).await {
            0 => len,
            e => e,
        }
    }

    pub async fn flush(&self, q: &UblkQueue<'_>) -> i32 {
        self.run(q, "flush", std::iter::once(Ok(cmd::flush(self.nsid)))).await
    }

    /// Dataset Management with Deallocate over the range (up to the drive's ranges per command).
    pub async fn discard(&self, q: &UblkQueue<'_>, off: u64, len: u64) -> i32 {
        let mask = (1u64 << self.lba_shift) - 1;
        if off & mask != 0 || len & mask != 0 {
            return -libc::EINVAL;
        }
        if len == 0 {
            return 0;
        }
        let mut all = dsm_lists(off >> self.lba_shift, len >> self.lba_shift, self.dsm_max_blocks, self.dsm_max_ranges);
        // A window's lists at a time (`run_within` awaits each window before the next), each kept
        // here until every command of its window completed; one budget for them all.
        let mut budget = RequestBudget::default();
        loop {
            let bufs = match all.by_ref().take(self.window).collect::<Result<Vec<_>, i32>>() {
                Ok(b) if b.is_empty() => return 0,
                Ok(b) => b,
                Err(e) => return e,
            };
            let mut lists = RangeLists { bufs, completed: false };
            let nsid = self.nsid;
            let cmds = lists.bufs.iter().map(|b| {
                cmd::dsm_deallocate(nsid, b.len() / cmd::DSM_RANGE_BYTES)
                    .map(|c| c.with_data(b.as_ptr() as u64, b.len() as u32))
                    .map_err(|_| -libc::EINVAL)
            });
            let res = self.run_within(q, "deallocate", cmds, &mut budget).await;
            lists.completed = true;
            if res != 0 {
                return res;
            }
        }
    }

    /// Write Zeroes; with `unmap`, on a namespace that allows it, the drive may deallocate
    /// (DEAC), otherwise it writes zeroes; what it writes carries the placement identifier of
    /// `handle`.
    pub async fn write_zeroes(&self, q: &UblkQueue<'_>, off: u64, len: u64, unmap: bool, handle: Handle) -> i32 {
        let chunks = match split(off, len, self.lba_shift, self.write_zeroes_max) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let nsid = self.nsid;
        let nounmap = !(unmap && self.deac);
        // Placed even where the drive may deallocate: it may write zeroes all the same (a range
        // not aligned to what it deallocates).
        let pid = self.pid(handle);
        let cmds = chunks.map(|c| cmd::write_zeroes(nsid, c.slba, c.nlb, nounmap, pid).map_err(|_| -libc::EINVAL));
        self.run(q, "write zeroes", cmds).await
    }

    fn drain_eventfd(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v`; the eventfd is non-blocking.
        unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// Moves every NVMe completion into the slab and wakes its future; submits what is left
    /// in the SQ (and flushes an overflowed CQ).
    fn complete(&self) {
        let mut ring = self.ring.borrow_mut();
        let mut slab = self.slab.borrow_mut();
        for _ in 0..2 {
            for cqe in ring.completion() {
                slab.complete(cqe.user_data(), command_result(cqe.result()));
            }
            let pending = !ring.submission().is_empty();
            if !pending && !ring.submission().cq_overflow() {
                break;
            }
            let _ = ring.submit();
        }
    }

    /// Commands submitted and not completed yet.
    pub fn inflight(&self) -> usize {
        self.slab.borrow().inflight
    }

    /// Waits up to `limit` for every command in flight to complete, polling (the queue is
    /// going down: nothing else runs on its thread). False if some did not.
    pub fn drain(&self, limit: std::time::Duration) -> bool {
        let end = std::time::Instant::now() + limit;
        loop {
            self.complete();
            if self.inflight() == 0 {
                return true;
            }
            if std::time::Instant::now() >= end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// The completion task: run it on the queue's executor beside the tag tasks, keep it out
    /// of the set that decides when the queue is done, and drop it once the queue loop has
    /// returned (its armed poll goes away with the queue ring). It does not end by itself
    /// when the queue starts stopping: tag tasks finish the request they hold, and may start
    /// NVMe commands, before they see the abort. Only a cancelled poll of a stopping queue
    /// (the ring being torn down) ends it.
    pub async fn reap(&self, q: &UblkQueue<'_>) {
        let mut logged = false;
        loop {
            self.complete();
            if self.unsubmitted() {
                // Nothing in flight may complete to wake us: retry the submission by time.
                let ts = types::Timespec::new().nsec(1_000_000);
                let res = q.ublk_submit_sqe(opcode::Timeout::new(&ts).build()).await;
                if res == -libc::ECANCELED && q.is_stopping() {
                    break;
                }
                continue;
            }
            let poll = opcode::PollAdd::new(types::Fd(self.efd.as_raw_fd()), libc::POLLIN as u32).build();
            let res = q.ublk_submit_sqe(poll).await;
            self.drain_eventfd();
            if res >= 0 || res == -libc::EINTR {
                continue;
            }
            if res == -libc::ECANCELED && q.is_stopping() {
                break;
            }
            // Keep reaping, by time.
            if !logged {
                tracing::warn!("passthrough: poll on the completion eventfd failed ({res}); polling every 1 ms");
                logged = true;
            }
            let ts = types::Timespec::new().nsec(1_000_000);
            let _ = q.ublk_submit_sqe(opcode::Timeout::new(&ts).build()).await;
        }
        self.complete();
    }
}

/// What `fdpblk add` learns about a namespace for the passthrough engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NsProbe {
    pub nsid: u32,
    pub lba_size: u32,
    pub ns_bytes: u64,
    /// Largest transfer of one command, within the driver's segment limit.
    pub max_transfer: u32,
    /// Logical handle -> placement identifier; empty for a single-handle policy.
    pub pids: Vec<u16>,
}

/// Per-command limits of the drive as the kernel gives them now; `None` where unknown.
#[derive(Clone, Copy, Debug, Default)]
pub struct CommandLimits {
    /// The largest transfer of one command the kernel takes for the namespace now
    /// (`max_hw_sectors_kb`, `max_segments` pages). `add` sized the I/O buffers by it; a
    /// later start (another kernel, a controller that came back with a smaller MDTS) may
    /// find it smaller, and a passthrough command past it fails, so the engines split at it.
    pub transfer_bytes: Option<u64>,
    pub write_zeroes_bytes: Option<u64>,
    pub discard_bytes: Option<u64>,
    /// Ranges per deallocate command (`max_discard_segments`, from the drive's DMRL).
    pub discard_segments: Option<u64>,
    /// The namespace's block device reports no Write Zeroes: the drive lacks it (ONCS), or
    /// the kernel turned it off for a drive known to mishandle it (a quirk). Passthrough
    /// would bypass that, so the ublk device does not offer it either.
    pub write_zeroes_off: bool,
    /// The same for deallocation: the drive lacks Dataset Management (ONCS), or the kernel
    /// turned discard off for it.
    pub discard_off: bool,
}

impl CommandLimits {
    /// What the kernel derived from WZSL and DMRSL for the namespace behind `ng`
    /// (`write_zeroes_max_bytes`, `discard_max_hw_bytes`), or its queue's limits for any other
    /// block device `ng` names. 0 there means "not supported": not a limit, but the ublk
    /// device then offers none (`write_zeroes_off`, `discard_off`). A namespace without a
    /// block device has them off where its controller's ONCS lacks the command.
    pub fn of(ng: &Path) -> Self {
        let block = crate::nvme::path::namespace_block_device(ng).or_else(|| {
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            let m = std::fs::metadata(ng).ok().filter(|m| m.file_type().is_block_device())?;
            let dir = crate::device::sysfs_block_dir(m.rdev())?;
            // A partition has no queue of its own: its disk's.
            Some(if dir.join("partition").exists() { dir.parent()?.to_path_buf() } else { dir })
        });
        let name = block.as_deref().and_then(Path::file_name).and_then(|n| n.to_str());
        let get = |attr| sysfs_queue(name, attr).filter(|&b| b > 0);
        let queue = name.map(|n| crate::nvme::discover::QueueLimits::of(Some(n)));
        let limits = CommandLimits {
            transfer_bytes: queue.map(|q| u64::from(crate::nvme::discover::max_transfer(512, None, q, page_size() as u64))),
            write_zeroes_bytes: get("write_zeroes_max_bytes"),
            discard_bytes: get("discard_max_hw_bytes"),
            discard_segments: get("max_discard_segments"),
            write_zeroes_off: sysfs_queue(name, "write_zeroes_max_bytes") == Some(0),
            discard_off: sysfs_queue(name, "discard_max_hw_bytes") == Some(0),
        };
        if name.is_some() {
            return limits;
        }
        // No block device (the kernel made none for the namespace's format): the
        // controller's own word, where `ng` is an NVMe node that answers Identify.
        let ctrl = crate::nvme::NvmeDevice::open(ng).and_then(|d| d.identify_ctrl()).ok();
        limits.or_controller(ctrl.as_ref())
    }

    /// Where the kernel said nothing, what the controller's ONCS says: a command it lacks
    /// is not offered (passthrough would send it and fail every such request).
    fn or_controller(mut self, ctrl: Option<&crate::nvme::identify::IdCtrl>) -> Self {
        if let Some(c) = ctrl {
            self.discard_off |= !c.dsm_supported();
            self.write_zeroes_off |= !c.write_zeroes_supported();
        }
        self
    }

    /// `current`, the largest transfer an engine was given (`add`'s I/O buffer size), within
    /// [`Self::transfer_bytes`] in whole `block`s (and pages, from a page up: a piece of a
    /// split command starting inside a page spans a page more): never below one block.
    pub fn cap_transfer(&self, current: u64, block: u64) -> u64 {
        let page = crate::device::page_size();
        let whole = |t: u64| if t >= page { t / page * page } else { t };
        match self.transfer_bytes.map(|t| whole(t) / block * block) {
            Some(t) if t >= block => current.min(t),
            _ => current,
        }
    }

    /// Whether fdpblk's own deallocation can reach the drive: through passthrough only as
    /// Dataset Management; through the block device (plain, streams) as a discard, or where
    /// the kernel offers none, as a Write Zeroes that may unmap (`fallocate(PUNCH_HOLE)`,
    /// the state thread's fallback).
    pub fn deallocates(&self, passthrough: bool) -> bool {
        !self.discard_off || (!passthrough && !self.write_zeroes_off)
    }

    /// The ublk device's `max_discard_sectors`, as [`Self::ublk_write_zeroes_sectors`]: a
    /// discard the drive lacks would fail every request (Invalid Opcode) where the kernel's
    /// own driver offers none.
    pub fn ublk_discard_sectors(&self, lba_shift: u8) -> u32 {
        if self.discard_off {
            0
        } else {
            crate::frontend::config::max_request_sectors(lba_shift)
        }
    }

    /// The ublk device's `max_write_zeroes_sectors`: none where the kernel offers none for
    /// the namespace, else as much as a request can say in whole logical blocks (the engine
    /// splits at the drive's limit).
    pub fn ublk_write_zeroes_sectors(&self, lba_shift: u8) -> u32 {
        if self.write_zeroes_off {
            0
        } else {
            crate::frontend::config::max_request_sectors(lba_shift)
        }
    }
}

/// The placement identifiers of `handles` distinct reclaim unit handles, in RUH Status order.
///
/// With more than one reclaim group the drive lists a PID per (handle, group), and PIDs that
/// differ only in the group bits share a reclaim unit handle; placing by handle alone would
/// also fill one group's media while the others idle (why Linux turns write streams off for
/// such a drive). So only a valid one-group configuration places writes.
pub fn select_pids(config: &FdpConfig, ruhs: &[RuhStatusDesc], handles: u16, policy: &str, path: &Path) -> Result<Vec<u16>, String> {
    if !config.valid() {
        return Err(format!(
            "policy {policy} cannot place writes on {}: its active FDP configuration is marked not valid (FDPA bit 7); enable a valid configuration (nvme fdp configs lists them), or use --policy none",
            path.display()
        ));
    }
    if config.nrg > 1 {
        return Err(format!(
            "policy {policy} cannot place writes on {}: its active FDP configuration has {} reclaim groups, and fdpblk places writes only with one; enable a one-group configuration (nvme fdp configs lists them), or use --policy none",
            path.display(),
            config.nrg
        ));
    }
    let mut pids: Vec<u16> = Vec::with_capacity(usize::from(handles));
    let mut seen = std::collections::HashSet::new();
    for d in ruhs {
        if pids.len() == usize::from(handles) {
            break;
        }
        if seen.insert(d.ruhid) {
            pids.push(d.pid);
        }
    }
    if pids.len() < usize::from(handles) {
        return Err(format!(
            "policy {policy} needs {handles} placement handles but {} has {}; create the namespace with more placement handles, or use a policy of fewer ({})",
            path.display(),
            pids.len(),
            crate::place::handles_of_each()
        ));
    }
    Ok(pids)
}

fn sysfs_queue(block: Option<&str>, attr: &str) -> Option<u64> {
    crate::nvme::discover::sysfs_num(block?, attr)
}


/// The placement identifiers [`probe`] gives a policy of `handles` handles on `path`, read
/// from the drive now: `Ok(Ok(pids))`; `Ok(Err(why))` where the drive answered and places no
/// such writes now (FDP off or gone, a configuration not valid, more reclaim groups, fewer
/// handles); `Err` where it could not be asked (a command or its answer failed).
pub fn placement_ids(path: &Path, policy: &str, handles: u16) -> Result<Result<Vec<u16>, String>, String> {
    let info = match FdpInfo::discover(path) {
        Ok(i) => i,
        Err(e @ (NvmeError::NoFdp { .. } | NvmeError::FdpDisabled { .. } | NvmeError::NoConfig { .. })) => return Ok(Err(e.to_string())),
        Err(e) => return Err(e.to_string()),
    };
    Ok(select_pids(&info.config, &info.ruhs, handles, policy, path))
}

/// Queries `/dev/ngXnY` for a policy with `handles` placement handles: the drive must have
/// FDP enabled and at least that many placement identifiers when `handles > 1`.
pub fn probe(path: &Path, policy: &str, handles: u16) -> Result<NsProbe, String> {
    let (nsid, lba_size, ns_bytes, max_transfer, pids, ms) = if handles > 1 {
        let info = FdpInfo::discover(path).map_err(|e| match e {
            NvmeError::NoFdp { ctrl, model } => format!(
                "{} ({model}) does not support FDP (Identify Controller CTRATT bit 19 is clear): policy {policy} cannot place writes on {}; use --policy none",
                ctrl.display(),
                path.display()
            ),
            e => e.to_string(),
        })?;
        let pids = select_pids(&info.config, &info.ruhs, handles, policy, path)?;
        (info.nsid, info.lba_size, info.ns_bytes(), info.max_transfer_bytes, pids, info.lba_metadata)
    } else {
        let dev = NvmeDevice::open(path).map_err(|e| e.to_string())?;
        let nsid = dev.nsid().ok_or_else(|| format!("{} is not an NVMe namespace; give /dev/ngXnY", path.display()))?;
        let ctrl = dev.identify_ctrl().map_err(|e| e.to_string())?;
        let ns = dev.identify_ns(nsid).map_err(|e| e.to_string())?;
        let lba = ns.lba_size().map_err(|e| format!("identify namespace of {}: {e}", path.display()))?;
        let bytes = ns.size_bytes().map_err(|e| format!("identify namespace of {}: {e}", path.display()))?;
        let block = dev.paths.block_name.clone();
        let limits = crate::nvme::discover::QueueLimits::of(block.as_deref());
        let max = crate::nvme::discover::max_transfer(lba, ctrl.mdts_bytes(), limits, page_size() as u64);
        let ms = ns.format().map_or(0, |f| f.ms);
        (nsid, lba, bytes, max, Vec::new(), ms)
    };
    data_only(path, nsid, ms)?;
    if ns_bytes == 0 {
        return Err(format!("namespace {nsid} of {} has size 0", path.display()));
    }
    check_uring(path, nsid)?;
    Ok(NsProbe { nsid, lba_size, ns_bytes, max_transfer, pids })
}

/// The range lists of a deallocation's commands. The drive reads them when it runs a command:
/// if the deallocation's future is dropped first (its executor torn down at shutdown), a
/// freed list could be reused for other ranges meanwhile, so it is leaked instead (a few KiB,
/// once).
struct RangeLists {
    bufs: Vec<Vec<u8>>,
    completed: bool,
}

impl Drop for RangeLists {
    fn drop(&mut self) {
        if !self.completed {
            std::mem::forget(std::mem::take(&mut self.bufs));
        }
    }
}

/// The range lists of the Dataset Management commands that deallocate `nlb` blocks from
/// `slba`: ranges of at most `max_blocks` (the drive's DMRSL, as the kernel reports it), at
/// most `max_ranges` of them and at most `max_blocks` blocks in all per command. The total
/// cap is the kernel's own (its discard requests never exceed DMRSL), so no command asks more
/// than the drive's DMSL, the total per command that the kernel does not read either.
///
/// Made as they are taken: with a small DMRSL a discard of the whole device is tens of
/// millions of commands, whose lists all at once would be gigabytes.
pub(crate) fn dsm_lists(slba: u64, nlb: u64, max_blocks: u32, max_ranges: usize) -> impl Iterator<Item = Result<Vec<u8>, i32>> {
    let per = max_ranges.clamp(1, MAX_DSM_RANGES);
    let cap = u64::from(max_blocks.max(1));
    let mut ranges = DsmRange::split_at(slba, nlb, max_blocks).peekable();
    std::iter::from_fn(move || {
        let mut group: Vec<DsmRange> = Vec::with_capacity(per.min(16));
        let mut blocks = 0u64;
        while let Some(r) = ranges.next_if(|r| group.is_empty() || (group.len() < per && blocks + u64::from(r.nlb) <= cap)) {
            blocks += u64::from(r.nlb);
            group.push(r);
        }
        (!group.is_empty()).then(|| cmd::encode_dsm_ranges(&group).map_err(|_| -libc::EINVAL))
    })
}

/// The engine's commands carry data buffers only: on a format with metadata per block (an
/// extended LBA, a separate metadata buffer, protection information) the drive would move
/// more bytes than the buffer holds, take metadata through a pointer that was never set, or
/// fail every write.
fn data_only(path: &Path, nsid: u32, metadata_bytes: u16) -> Result<(), String> {
    if metadata_bytes == 0 {
        return Ok(());
    }
    Err(format!(
        "namespace {nsid} of {} is formatted with {metadata_bytes} bytes of metadata per block, which the passthrough engine does not send; reformat it to an LBA format without metadata (nvme id-ns -H lists them; nvme format erases the namespace), or use --engine streams or plain on its block device, where the kernel handles the metadata",
        path.display()
    ))
}

/// Sends one Flush through io_uring passthrough, as the engine will: proves that the kernel
/// has NVMe `URING_CMD` (Linux >= 5.19) and that the device opens for writing.
fn check_uring(path: &Path, nsid: u32) -> Result<(), String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {} for writing: {e}", path.display()))?;
    let need = "NVMe passthrough needs io_uring with 128-byte entries and URING_CMD (Linux >= 5.19); use --engine streams or plain on /dev/nvmeXnY";
    let mut ring = IoUring::<squeue::Entry128, cqueue::Entry32>::builder()
        .build(2)
        .map_err(|e| format!("io_uring set-up: {e}: {need}"))?;
    let mut bytes = [0u8; 80];
    bytes[..cmd::CMD_BYTES].copy_from_slice(&cmd::flush(nsid).to_bytes());
    let sqe = opcode::UringCmd80::new(types::Fd(f.as_raw_fd()), NVME_URING_CMD_IO).cmd(bytes).build().user_data(1);
    // SAFETY: a flush carries no buffer.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| "io_uring submission queue full".to_string())?;
    ring.submit_and_wait(1).map_err(|e| format!("io_uring passthrough on {}: {e}: {need}", path.display()))?;
    let res = ring.completion().next().map(|c| c.result()).unwrap_or(-libc::EIO);
    probe_result(res, path, need)
}

/// The probe flush's completion: an errno, or an NVMe status.
fn probe_result(res: i32, path: &Path, need: &str) -> Result<(), String> {
    match res {
        // Success with the More or Do Not Retry bit set too, as every other completion here.
        r if r >= 0 && cmd::NvmeStatus(r as u16).succeeded() => Ok(()),
        r if r < 0 => Err(format!(
            "io_uring passthrough flush on {}: {}: {need}",
            path.display(),
            io::Error::from_raw_os_error(-r)
        )),
        r => Err(format!("flush on {}: {}", path.display(), cmd::NvmeStatus(r as u16))),
    }
}

/// Positional reads of a namespace through synchronous passthrough Read commands, for
/// devices without `pread` (the generic char device): layout discovery reads checkpoints
/// with it.
pub struct NsReader {
    file: File,
    nsid: u32,
    lba: u64,
    size: u64,
    max: usize,
}

impl NsReader {
    /// `size` limits the readable bytes (the exported size).
    pub fn open(path: &Path, nsid: u32, lba_size: u32, size: u64, max_transfer: u32) -> io::Result<Self> {
        let file = File::open(path)?;
        let lba = u64::from(lba_size.max(512));
        let max = (u64::from(max_transfer).max(lba) / lba * lba) as usize;
        Ok(NsReader { file, nsid, lba, size, max })
    }
}

impl ReadAt for NsReader {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset >= self.size || buf.is_empty() {
            return Ok(0);
        }
        let start = offset / self.lba * self.lba;
        let lead = (offset - start) as usize;
        let want = (buf.len() as u64).min(self.size - offset);
        let end = (offset + want).div_ceil(self.lba) * self.lba;
        let span = ((end - start) as usize).min(self.max);
        let n = (span - lead).min(want as usize);
        if n == 0 {
            // A lead longer than one transfer cannot happen (max >= one block); be safe.
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read smaller than one block"));
        }
        // Page-aligned: the transfer limit counts one segment per page (`probe`), and a heap
        // buffer off a page boundary would span one page more than the limit allows.
        let mut bounce = crate::persist::dev::AlignedBuf::zeroed(span);
        let c = cmd::read(self.nsid, start / self.lba, (span as u64 / self.lba) as u32)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        ioctl::io(&self.file, c, Data::FromDevice(&mut bounce[..span])).map_err(|e| match e {
            ioctl::PassthruError::Os(e) => e,
            ioctl::PassthruError::Status(s) => io::Error::other(s.to_string()),
        })?;
        buf[..n].copy_from_slice(&bounce[lead..lead + n]);
        Ok(n)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.size)
    }
}

/// A failed I/O command for the log: where it went, in the fields its opcode has (a
/// deallocate's ranges are in its data buffer, CDW10/11 hold its range count and attribute).
fn describe(c: &PassthruCmd) -> String {
    use cmd::io_opc;
    let slba = u64::from(c.cdw10) | (u64::from(c.cdw11) << 32);
    match c.opcode {
        io_opc::WRITE | io_opc::READ | io_opc::WRITE_ZEROES => format!(
            "nsid {} slba {slba} blocks {} cdw12 {:#x} cdw13 {:#x}",
            c.nsid,
            u64::from(c.cdw12 & 0xffff) + 1,
            c.cdw12,
            c.cdw13
        ),
        io_opc::DSM => format!("nsid {} deallocate of {} ranges", c.nsid, (c.cdw10 & 0xff) + 1),
        io_opc::FLUSH => format!("nsid {} flush", c.nsid),
        op => format!("nsid {} opcode {op:#x} cdw10 {:#x} cdw11 {:#x} cdw12 {:#x} cdw13 {:#x}", c.nsid, c.cdw10, c.cdw11, c.cdw12, c.cdw13),
    }
}

#[cfg(test)]
mod tests {
    /// The probe flush at `add` succeeds whatever its completion's More or Do Not Retry bit
    /// says (a drive's quirk that refused `add` with "NVMe status 0x4000").
    #[test]
    fn the_probe_flush_takes_a_success_with_flag_bits() {
        let p = std::path::Path::new("/dev/ng0n1");
        assert!(super::probe_result(0, p, "").is_ok());
        assert!(super::probe_result(0x4000, p, "").is_ok(), "Do Not Retry set");
        assert!(super::probe_result(0x2000, p, "").is_ok(), "More set");
        assert!(super::probe_result(0x0002, p, "").unwrap_err().contains("Invalid Field in Command"));
        assert!(super::probe_result(-libc::EOPNOTSUPP, p, "need").unwrap_err().ends_with(": need"));
    }

    use super::*;

    #[test]
    fn a_failed_command_is_logged_by_what_its_fields_hold() {
        let w = cmd::write(1, 1 << 33, 16, Some(3), false).unwrap();
        let d = describe(&w);
        assert!(d.starts_with(&format!("nsid 1 slba {} blocks 16 ", 1u64 << 33)), "{d}");
        // A deallocate's CDW10/11 are its range count and attribute, not an LBA.
        let d = describe(&cmd::dsm_deallocate(1, 256).unwrap());
        assert_eq!(d, "nsid 1 deallocate of 256 ranges");
        assert_eq!(describe(&cmd::flush(2)), "nsid 2 flush");
    }

    #[test]
    fn write_zeroes_is_offered_only_where_the_kernel_offers_it_for_the_namespace() {
        assert_eq!(CommandLimits { write_zeroes_off: true, ..Default::default() }.ublk_write_zeroes_sectors(12), 0);
        // Unknown (no block device, no Identify answer): offered, the drive answers per command.
        assert_eq!(CommandLimits::default().ublk_write_zeroes_sectors(9), u32::MAX >> 9);
        // 4 KiB blocks: whole blocks, or kernels before 6.10 split a large request off them.
        assert_eq!(CommandLimits::default().ublk_write_zeroes_sectors(12), (u32::MAX >> 9) & !7);
        assert!(!CommandLimits::of(Path::new("/dev/ng-none")).write_zeroes_off);
    }

    #[test]
    fn discard_is_offered_only_where_the_kernel_offers_it_for_the_namespace() {
        assert_eq!(CommandLimits { discard_off: true, ..Default::default() }.ublk_discard_sectors(12), 0);
        assert_eq!(CommandLimits { write_zeroes_off: true, ..Default::default() }.ublk_discard_sectors(9), u32::MAX >> 9);
        assert_eq!(CommandLimits::default().ublk_discard_sectors(12), (u32::MAX >> 9) & !7);
        assert!(!CommandLimits::of(Path::new("/dev/ng-none")).discard_off);
    }

    #[test]
    fn without_a_block_device_the_controllers_oncs_decides() {
        let mut id = vec![0u8; 4096];
        let ctrl = |id: &[u8]| crate::nvme::identify::IdCtrl::parse(id).unwrap();
        // ONCS (bytes 520..522) without Dataset Management or Write Zeroes: neither offered.
        let none = CommandLimits::default().or_controller(Some(&ctrl(&id)));
        assert!(none.discard_off && none.write_zeroes_off);
        assert_eq!(none.ublk_discard_sectors(12), 0);
        assert_eq!(none.ublk_write_zeroes_sectors(12), 0);
        id[520] = 1 << 2 | 1 << 3;
        let both = CommandLimits::default().or_controller(Some(&ctrl(&id)));
        assert!(!both.discard_off && !both.write_zeroes_off);
        id[520] = 1 << 2;
        let dsm = CommandLimits::default().or_controller(Some(&ctrl(&id)));
        assert!(!dsm.discard_off && dsm.write_zeroes_off);
        // The kernel's "off" stands whatever the controller says; no answer changes nothing.
        let off = CommandLimits { discard_off: true, ..Default::default() };
        assert!(off.or_controller(Some(&ctrl(&id))).discard_off);
        assert!(!CommandLimits::default().or_controller(None).discard_off);
    }

    #[test]
    fn a_smaller_transfer_limit_at_start_caps_the_engines_commands_in_whole_blocks() {
        let now = |t| CommandLimits { transfer_bytes: t, ..Default::default() };
        // add sized 512 KiB; the kernel now takes 128 KiB: commands split at that.
        assert_eq!(now(Some(128 << 10)).cap_transfer(512 << 10, 4096), 128 << 10);
        // A larger limit now does not grow past the buffers add sized.
        assert_eq!(now(Some(2 << 20)).cap_transfer(512 << 10, 4096), 512 << 10);
        // Rounded down to whole blocks; a limit below one block, or none known, changes nothing.
        assert_eq!(now(Some((128 << 10) + 512)).cap_transfer(512 << 10, 4096), 128 << 10);
        assert_eq!(now(Some(2048)).cap_transfer(512 << 10, 4096), 512 << 10);
        assert_eq!(now(None).cap_transfer(512 << 10, 4096), 512 << 10);
        // Whole pages from a page up (127 KiB: a second piece would start inside a page).
        let page = crate::device::page_size();
        assert_eq!(now(Some(127 << 10)).cap_transfer(512 << 10, 512), (127 << 10) / page * page);
        assert_eq!(now(Some(2048)).cap_transfer(512 << 10, 512), 2048);
    }

    #[test]
    fn nvme_statuses_become_the_errnos_of_the_kernels_own_nvme_driver() {
        let dnr = 1 << 14;
        for (res, want) in [
            (0, 0),
            (-libc::EAGAIN, -libc::EIO),
            (-libc::EBUSY, -libc::EIO),
            (-libc::EINVAL, -libc::EINVAL),
            (0x01, -libc::EOPNOTSUPP),
            (0x81 | dnr, -libc::ENOSPC),
            (0x80, -libc::EREMOTEIO),
            (0x281 | dnr, -libc::ENODATA),
            (0x286, -libc::ENODATA),
            (0x282, -libc::EILSEQ),
            (0x181 | dnr, -libc::EILSEQ),
            (0x02 | dnr, -libc::EOPNOTSUPP), // Invalid Field
            (0x0b | dnr, -libc::EOPNOTSUPP),
            (0x180 | dnr, -libc::EOPNOTSUPP),
            (0x183 | dnr, -libc::EOPNOTSUPP),
            (0x82, -libc::EREMOTEIO), // Namespace Not Ready, after its retries
            (0x21, -libc::EREMOTEIO),
            (0x182 | dnr, -libc::ENODATA), // Write to a read-only range
            (0x83 | dnr, -libc::EBADE),
            (0x370, -libc::ENOLINK),
            (0x04, -libc::EIO), // Data Transfer Error
            (0x302, -libc::EIO), // path-related
        ] {
            assert_eq!(errno_of(res), want, "result {res:#x}");
        }
        // Successful Completion with only the More bit (13) or DNR set is a success; any
        // other status stays what it was.
        assert_eq!(command_result(1 << 13), 0);
        assert_eq!(command_result((1 << 13) | dnr), 0);
        assert_eq!(command_result(0x281 | (1 << 13)), 0x281 | (1 << 13));
        assert_eq!(command_result(-libc::EINTR), -libc::EINTR);
        assert_eq!(command_result(0), 0);
    }

    fn chunks(off: u64, len: u64, shift: u8, max: u32) -> Vec<(u64, u32, Range<usize>)> {
        split(off, len, shift, max).unwrap().map(|c| (c.slba, c.nlb, c.buf)).collect()
    }

    #[test]
    fn deallocation_respects_the_ranges_per_command() {
        let lens = |b: &[Vec<u8>]| b.iter().map(|b| b.len() / cmd::DSM_RANGE_BYTES).collect::<Vec<_>>();
        let total = |b: &[u8]| b.chunks(16).map(|r| u64::from(u32::from_le_bytes(r[4..8].try_into().unwrap()))).sum::<u64>();
        // 8000 blocks against an 8-block DMRSL: no command carries more than 8 blocks in all
        // (the kernel sends no more; a drive's DMSL may be that small), so one range each.
        let all = |slba, nlb, max_blocks, max_ranges| dsm_lists(slba, nlb, max_blocks, max_ranges).collect::<Result<Vec<_>, _>>().unwrap();
        let b = all(0, 8000, 8, MAX_DSM_RANGES);
        assert_eq!((b.len(), lens(&b).iter().max().copied()), (1000, Some(1)));
        assert!(b.iter().all(|c| total(c) == 8));
        // Without a range limit (u32::MAX blocks) one command covers it all.
        assert_eq!(lens(&all(0, 8000, u32::MAX, MAX_DSM_RANGES)), vec![1]);
        // Past u32::MAX blocks: ranges of u32::MAX blocks, each its own command.
        let big = 3 * u64::from(u32::MAX) + 5;
        let b = all(7, big, u32::MAX, MAX_DSM_RANGES);
        assert_eq!(lens(&b), vec![1; 4]);
        assert_eq!(b.iter().map(|c| total(c)).sum::<u64>(), big);
        assert_eq!(all(0, 8000, 8, 0).len(), 1000);
        // Ranges of the drive's size, many to a command, in order and covering it all.
        let b = all(100, 10_000, 1000, 4);
        assert_eq!(lens(&b), vec![1; 10], "the total per command is the range limit too");
        let b = all(100, 10_000, u32::MAX, 4);
        assert_eq!(lens(&b), vec![1]);
        // Made as taken: the first of 2^37 commands (a 2^40-block discard, 8 blocks a range)
        // comes at once, without the rest (which would be 2 TiB of lists).
        let mut lazy = dsm_lists(0, 1 << 40, 8, MAX_DSM_RANGES);
        let first = lazy.next().unwrap().unwrap();
        assert_eq!((lens(std::slice::from_ref(&first)), total(&first)), (vec![1], 8));
        assert_eq!(u64::from_le_bytes(lazy.next().unwrap().unwrap()[8..16].try_into().unwrap()), 8, "the second starts where the first ends");
    }

    #[test]
    fn transient_failures_are_the_ones_retried() {
        assert!(!transient(0));
        assert!(transient(-libc::EAGAIN) && transient(-libc::EINTR));
        assert!(!transient(-libc::EIO) && !transient(-libc::EINVAL));
        // Internal Error without DNR is retried; with DNR (bit 14) it is final.
        assert!(transient(0x06));
        assert!(!transient(0x06 | 1 << 14));
        // Invalid Field with DNR, as drives report a bad placement handle.
        assert!(!transient(0x02 | 1 << 14));
    }

    #[test]
    fn a_retry_waits_the_delay_the_drive_asks_for() {
        let crdt = [Duration::from_millis(100), Duration::from_millis(2500), Duration::from_secs(6000)];
        // Namespace Not Ready without DNR: CRD 0 retries at once, CRD 1..3 pick CRDT1..3.
        assert_eq!(retry_delay(0x82, &crdt, 1), Duration::ZERO);
        assert_eq!(retry_delay(0x82 | 1 << 11, &crdt, 1), Duration::from_millis(100));
        assert_eq!(retry_delay(0x82 | 2 << 11, &crdt, 1), Duration::from_millis(2500));
        // A drive's delay of 100 minutes is capped.
        assert_eq!(retry_delay(0x82 | 3 << 11, &crdt, 1), MAX_RETRY_DELAY);
        // More and DNR bits do not change the delay field; errnos have none.
        assert_eq!(retry_delay(0x82 | 1 << 11 | 1 << 13, &crdt, 1), Duration::from_millis(100));
        assert_eq!(retry_delay(-libc::EINTR, &crdt, 1), Duration::ZERO);
        // The kernel's -EAGAIN: a wait that grows with each retry.
        assert_eq!(retry_delay(-libc::EAGAIN, &crdt, 1), Duration::from_millis(1));
        assert_eq!(retry_delay(-libc::EAGAIN, &crdt, EAGAIN_RETRIES), Duration::from_millis(128));
        assert_eq!(retry_delay(0, &crdt, 1), Duration::ZERO);
        assert_eq!(cmd::NvmeStatus(0x82 | 2 << 11 | 1 << 14).crd(), 2);
    }

    #[test]
    fn a_format_with_metadata_is_refused_with_the_fix() {
        let p = Path::new("/dev/ng0n1");
        assert!(data_only(p, 1, 0).is_ok());
        let e = data_only(p, 1, 8).unwrap_err();
        assert!(e.contains("8 bytes of metadata per block") && e.contains("--engine streams or plain"), "{e}");
    }

    #[test]
    fn one_command_when_it_fits() {
        assert_eq!(chunks(4096, 4096, 9, 512 << 10), vec![(8, 8, 0..4096)]);
        assert_eq!(chunks(0, 512 << 10, 9, 512 << 10), vec![(0, 1024, 0..(512 << 10))]);
        assert_eq!(chunks(8192, 4096, 12, 512 << 10), vec![(2, 1, 0..4096)]);
        assert!(chunks(0, 0, 9, 4096).is_empty());
    }

    #[test]
    fn splits_at_the_transfer_limit() {
        let k = 1usize << 10;
        assert_eq!(
            chunks(1 << 20, 1300 * 1024, 9, 512 << 10),
            vec![(2048, 1024, 0..512 * k), (3072, 1024, 512 * k..1024 * k), (4096, 552, 1024 * k..1300 * k)]
        );
        // A limit that is not whole blocks is rounded down; below one block, one block.
        assert_eq!(
            chunks(0, 4096, 9, 1000),
            (0..8).map(|i| (i, 1, (i as usize * 512)..(i as usize + 1) * 512)).collect::<Vec<_>>()
        );
        assert_eq!(chunks(0, 8192, 12, 6000), vec![(0, 1, 0..4096), (1, 1, 4096..8192)]);
        assert_eq!(chunks(0, 1024, 9, 0), vec![(0, 1, 0..512), (1, 1, 512..1024)]);
    }

    #[test]
    fn splits_at_65536_blocks() {
        let all = chunks(512, (MAX_NLB as u64 * 2 + 3) * 512, 9, u32::MAX);
        assert_eq!(all.len(), 3);
        assert_eq!(all[0], (1, MAX_NLB, 0..(32 << 20)));
        assert_eq!(all[1], (1 + MAX_NLB as u64, MAX_NLB, (32 << 20)..(64 << 20)));
        assert_eq!(all[2], (1 + 2 * MAX_NLB as u64, 3, (64 << 20)..(64 << 20) + 1536));
        // 4 KiB blocks: 256 MiB per command.
        let all = chunks(0, 1 << 30, 12, u32::MAX);
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|c| c.1 == MAX_NLB));
    }

    #[test]
    fn pieces_cover_the_request_exactly() {
        for &(off, len, shift, max) in
            &[(0u64, 3u64 << 20, 9u8, 131072u32), (7 << 9, 999 << 9, 9, 4096 * 3), (1 << 12, 77 << 12, 12, 1 << 16)]
        {
            let v = chunks(off, len, shift, max);
            let mut at = 0usize;
            let mut lba = off >> shift;
            for (slba, nlb, r) in v {
                assert_eq!((slba, r.start), (lba, at));
                assert_eq!(r.len(), (nlb as usize) << shift);
                assert!(r.len() <= (max as usize).max(1 << shift));
                at = r.end;
                lba += u64::from(nlb);
            }
            assert_eq!(at as u64, len);
        }
    }

    #[test]
    fn misaligned_requests_are_refused() {
        assert_eq!(split(100, 512, 9, 4096).err(), Some(-libc::EINVAL));
        assert_eq!(split(512, 100, 9, 4096).err(), Some(-libc::EINVAL));
        assert_eq!(split(512, 4096, 12, 4096).err(), Some(-libc::EINVAL));
        assert_eq!(split(u64::MAX - 511, 1024, 9, 4096).err(), Some(-libc::EINVAL));
        assert_eq!(split(0, 512, 40, 4096).err(), Some(-libc::EINVAL));
    }

    #[test]
    fn every_tag_window_fits_the_completion_queue() {
        for depth in [1u16, 64, 128, 1024, 1025, 2048, 4096] {
            let (_, cq) = ring_entries(depth);
            let w = tag_window(depth, cq);
            assert!(usize::from(depth) * w <= cq as usize, "depth {depth}: {depth} x {w} commands > {cq} completions");
            assert!(w >= 1);
        }
        assert_eq!(tag_window(128, 8192), WINDOW, "a usual depth keeps the whole window");
        assert_eq!(tag_window(4096, 65536), 16);
    }

    #[test]
    fn slab_reuses_keys_and_tracks_inflight() {
        let slab = RefCell::new(Slab::new(4));
        let a = slab.borrow_mut().alloc();
        let b = slab.borrow_mut().alloc();
        assert_ne!(a, b);
        assert_eq!(slab.borrow().inflight, 2);
        slab.borrow_mut().complete(u64::from(a), 0);
        assert_eq!(slab.borrow().inflight, 1);
        // A dropped future of a completed command frees its slot; b's becomes an orphan.
        drop(Op { slab: &slab, key: a, done: false });
        drop(Op { slab: &slab, key: b, done: false });
        assert!(matches!(slab.borrow().slots[b as usize], Slot::Orphan));
        assert_eq!(slab.borrow_mut().alloc(), a);
        slab.borrow_mut().complete(u64::from(b), 5);
        assert_eq!(slab.borrow().inflight, 1);
        assert_eq!(slab.borrow_mut().alloc(), b);
        slab.borrow_mut().complete(99, 0); // unknown: ignored
        assert_eq!(slab.borrow().inflight, 2);
    }
}
