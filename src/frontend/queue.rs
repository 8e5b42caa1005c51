//! One ublk queue thread: an async task per tag that fetches a request, serves it through the
//! pipeline and the engine, and commits the result. The pipeline is per queue and the slot
//! table is shared through atomics; a placement decision takes the policy's mutex, shared by
//! the queues, and a checkpoint header write the slot table's mailbox mutex.

use crate::classify::Op;
use crate::engine::queue::QueueEngine;
use crate::pipeline::{HeaderWait, Pipeline, Request, Segment};
use crate::slot_table::{ContainerWrites, SlotTable};
use libublk::helpers::IoBuf;
use libublk::io::UblkQueue;
use libublk::{sys, BufDesc, UblkError};
use super::learn::LayoutCell;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a held payload looks for its header.
const HEADER_POLL: Duration = Duration::from_micros(200);

/// What every tag task of one queue shares (same thread, so `RefCell` is enough).
pub struct QueueCtx {
    /// `None` until the device's layout is known (see [`super::learn`]).
    pub pipeline: RefCell<Option<Pipeline>>,
    pub layout: Arc<LayoutCell>,
    pub engine: QueueEngine,
    pub header_wait: Duration,
    /// This queue's counters (for stats).
    pub stats: Arc<QueueStats>,
    /// Tags of this queue now holding a payload until its header arrives.
    pub waiting: Cell<u16>,
    /// The most tags that may do so at once: the others keep taking requests, among them
    /// the headers the waiting payloads need.
    pub max_waiting: u16,
}

/// How many of a queue's `depth` tags may hold payloads for their headers. When LMCache's
/// io_uring batches exhaust the tags, the kernel hands later writes to worker threads in any
/// order: a header can then queue behind payloads that wait for it on every tag, and each
/// wait would run out. Half the tags keep requests flowing. The one tag of a device with one
/// queue of depth 1 never waits: no header could reach it meanwhile, and each wait would run
/// its whole time.
pub fn max_waiting(depth: u16, queues: u16) -> u16 {
    if depth <= 1 && queues <= 1 {
        return 0;
    }
    (depth / 2).max(1)
}

/// One queue's counters, read by the stats thread.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Requests the queue took (all operations): how the kernel spread the load.
    pub requests: AtomicU64,
    /// The most tags that held payloads for their headers at once.
    pub header_wait_peak: AtomicU64,
    /// Requests failed back to the device's user (a drive error, a vanished namespace, a
    /// request fdpblk refused), and the errno of the last one.
    pub errors: AtomicU64,
    pub last_errno: AtomicU64,
    /// Requests held until fdpblk's deallocation of their slot, or its zeroing of their
    /// checkpoint container, landed; and the longest such hold (one still held included), in
    /// microseconds. A drive slow to deallocate shows here as LMCache's latency.
    pub held_for_trims: AtomicU64,
    pub held_longest_us: AtomicU64,
    /// When this queue last logged a failed request ([`since_start_ns`]): at most one line a
    /// second.
    logged_ns: AtomicU64,
}

impl QueueStats {
    pub fn to_json(&self) -> serde_json::Value {
        let last = self.last_errno.load(Ordering::Relaxed);
        serde_json::json!({
            "requests": self.requests.load(Ordering::Relaxed),
            "header_wait_peak": self.header_wait_peak.load(Ordering::Relaxed),
            "errors": self.errors.load(Ordering::Relaxed),
            "held_for_trims": self.held_for_trims.load(Ordering::Relaxed),
            "held_longest_us": self.held_longest_us.load(Ordering::Relaxed),
            "last_error": (last != 0).then(|| std::io::Error::from_raw_os_error(last as i32).to_string()),
        })
    }

    /// Counts a request that failed with `-res`; true when it is time for a log line.
    fn failed(&self, res: i32, now_ns: u64) -> bool {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.last_errno.store(u64::from(res.unsigned_abs()), Ordering::Relaxed);
        let last = self.logged_ns.load(Ordering::Relaxed);
        (last == 0 || now_ns.saturating_sub(last) >= 1_000_000_000) && self.logged_ns.compare_exchange(last, now_ns.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// Serves tag `tag` until the queue goes down.
pub async fn io_task(q: &UblkQueue<'_>, tag: u16, ctx: &QueueCtx) -> Result<(), UblkError> {
    let mut buf = IoBuf::<u8>::new(q.dev.dev_info.max_io_buf_bytes as usize);
    // libublk does not check its allocation (a memory limit, no overcommit): a null buffer
    // handed to the driver is undefined behaviour, so the daemon aborts as on a queue panic.
    if buf.as_ptr().is_null() {
        tracing::error!(
            "queue {}: no memory for a {}-byte I/O buffer of tag {tag}: aborting; free memory or lower -b/-d/-q, then add or recover the device again",
            q.get_qid(),
            q.dev.dev_info.max_io_buf_bytes
        );
        std::process::abort();
    }
    fetched(q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(&buf)).await?);
    let mut segments = Vec::with_capacity(8);
    loop {
        let res = serve(q, tag, buf.as_mut_slice(), ctx, &mut segments).await;
        if res < 0 && ctx.stats.failed(res, since_start_ns()) {
            let iod = q.get_iod(tag);
            // A flush has no range (its sector is -1).
            let what = match iod.op_flags & 0xff {
                sys::UBLK_IO_OP_FLUSH => "a flush".to_string(),
                op => format!("{} of {} bytes at byte {}", op_name(op), u64::from(iod.nr_sectors) << 9, iod.start_sector << 9),
            };
            tracing::warn!(
                "queue {}: a request failed ({what}): {}{} ({} failed so far on this queue; `fdpblk stats` counts them; the drive's side: `dmesg`, `nvme error-log`)",
                q.get_qid(),
                std::io::Error::from_raw_os_error(-res),
                if for_the_kernel(res) == res { "" } else { " (EIO to the device's user)" },
                ctx.stats.errors.load(Ordering::Relaxed)
            );
        }
        fetched(q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), for_the_kernel(res)).await?);
    }
}

/// The result committed for a request. The block layer gives the device's user a status per
/// errno (`errno_to_blk_status`): an engine's errno that means something else there (ENOMEM
/// "no resources, retry", EAGAIN "would block", EBUSY "device busy", ETIME a duration limit)
/// would tell LMCache a story about the ublk device that is not true, so it goes as EIO. The
/// errnos kept are those a drive's own failures give through the NVMe driver (a medium error
/// is ENODATA, a protection error EILSEQ, a gone namespace ENODEV), fdpblk's refusals (EINVAL,
/// EOPNOTSUPP) and a full device (ENOSPC); a kernel without a status of its own for EINVAL
/// (before Linux 6.11) or ENODEV reports EIO for it. The log and `fdpblk stats` keep the
/// engine's.
fn for_the_kernel(res: i32) -> i32 {
    const KEPT: [i32; 11] = [
        libc::EIO,
        libc::ENOSPC,
        libc::EOPNOTSUPP,
        libc::EINVAL,
        libc::ENODATA,
        libc::EILSEQ,
        libc::ENODEV,
        libc::ETIMEDOUT,
        libc::ENOLINK,
        libc::EREMOTEIO,
        libc::EBADE,
    ];
    if res >= 0 || KEPT.contains(&-res) {
        res
    } else {
        -libc::EIO
    }
}

/// A ublk operation's name, for the log.
fn op_name(op: u32) -> String {
    match op {
        sys::UBLK_IO_OP_READ => "a read".into(),
        sys::UBLK_IO_OP_WRITE => "a write".into(),
        sys::UBLK_IO_OP_FLUSH => "a flush".into(),
        sys::UBLK_IO_OP_DISCARD => "a discard".into(),
        sys::UBLK_IO_OP_WRITE_ZEROES => "a write zeroes".into(),
        op => format!("operation {op}"),
    }
}

/// The longest a request held behind a deallocation sleeps between looks: it starts at
/// [`HEADER_POLL`] and doubles, so that a drive stuck in a deallocation (until its NVMe
/// timeout, 30 s) does not have every held tag wake its queue thread 5000 times a second.
const HOLD_POLL_MAX: Duration = Duration::from_millis(5);

/// How long a held request says it is still held: a deallocation takes milliseconds, and one
/// that takes this long is a drive slow or stuck in it (the kernel's NVMe timeout and reset
/// end a hung command, and the request with it).
const HOLD_WARN: Duration = Duration::from_secs(10);

/// One request's hold behind fdpblk's deallocation or zeroing: counted once, its length kept
/// if the longest, and a warning for each [`HOLD_WARN`] it lasts.
struct Hold<'a> {
    queue: u16,
    stats: &'a QueueStats,
    offset: u64,
    since: Option<Instant>,
    warned: u32,
    /// The next sleep before looking again.
    next_poll: Duration,
}

impl<'a> Hold<'a> {
    fn new(queue: u16, stats: &'a QueueStats, offset: u64) -> Self {
        Self { queue, stats, offset, since: None, warned: 0, next_poll: HEADER_POLL }
    }

    /// How long to sleep before looking again: [`HEADER_POLL`], doubling up to [`HOLD_POLL_MAX`].
    fn poll(&mut self) -> Duration {
        let p = self.next_poll;
        self.next_poll = (p * 2).min(HOLD_POLL_MAX);
        p
    }

    /// The request is held (again) for `what`.
    fn tick(&mut self, what: impl FnOnce() -> String) {
        let since = *self.since.get_or_insert_with(|| {
            self.stats.held_for_trims.fetch_add(1, Ordering::Relaxed);
            Instant::now()
        });
        let held = since.elapsed();
        // A hold still going shows in the longest too, so a stuck one is seen while it lasts.
        self.stats.held_longest_us.fetch_max(held.as_micros().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
        if held >= HOLD_WARN * (self.warned + 1) {
            self.warned += 1;
            tracing::warn!(
                "queue {}: a request at byte {} has waited {} s for {what} (a drive slow to deallocate, or stuck: see `dmesg`); LMCache's request waits with it",
                self.queue,
                self.offset,
                held.as_secs(),
                what = what()
            );
        }
    }

    fn end(self) {
        if let Some(since) = self.since {
            let us = since.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
            self.stats.held_longest_us.fetch_max(us, Ordering::Relaxed);
            if self.warned > 0 {
                tracing::info!("queue {}: the request at byte {} went out after {} s held", self.queue, self.offset, us / 1_000_000);
            }
        }
    }
}

/// A fetch's result: a request came (0), or the driver refused the command. libublk maps only
/// the queue going down to an error; serving again on any other refusal would replay the
/// last request's descriptor (a write of old data) in a loop, and ending the tag would leave
/// the request it completed in flight, so that a stop waits for it forever. The daemon
/// aborts instead, as on a queue thread's panic: the driver holds the device's I/O and
/// re-issues it to the daemon that recovers it.
fn fetched(res: i32) {
    if res != sys::UBLK_IO_RES_OK as i32 {
        tracing::error!(
            "the ublk driver refused a queue's command ({}): aborting, so that the device can be recovered (`fdpblk recover`)",
            std::io::Error::from_raw_os_error(-res)
        );
        std::process::abort();
    }
}

/// Whether a request lies inside the exported device. The block layer already refuses I/O
/// past a device's end; checked again because fdpblk's own state lives right behind it, on
/// the same backing, where a stray request would overwrite the slot table.
fn in_exported_range(start_sector: u64, len: u64, exported: u64) -> bool {
    start_sector.checked_mul(512).and_then(|offset| offset.checked_add(len)).is_some_and(|end| end <= exported)
}

/// Nanoseconds on one clock for every queue of the process.
fn since_start_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Waits `d` on the queue's ring. A stopping ring cancels timeouts at once: a request held
/// there (behind a deallocation a stuck drive takes its 30 s over) then waits on the thread
/// instead of spinning it.
async fn sleep(q: &UblkQueue<'_>, d: Duration) {
    if !crate::engine::sleep_for(q, d).await {
        std::thread::sleep(d);
    }
}

/// What a request's planning leaves to do around its I/O, taken out of the pipeline (which
/// the next request on this queue plans with while this one waits).
struct SlotIo {
    slots: Arc<SlotTable>,
    /// Slots being deallocated: the request goes out after.
    trim_waits: Vec<u64>,
    /// Containers whose header block fdpblk is zeroing: the request goes out after.
    container_waits: Vec<u8>,
    /// Slot headers it carries, reported once it completed.
    headers: Vec<(u64, u16)>,
    /// What it changes of the checkpoint containers, reported once it completed or failed.
    containers: ContainerWrites,
}

async fn serve(q: &UblkQueue<'_>, tag: u16, buf: &mut [u8], ctx: &QueueCtx, segments: &mut Vec<Segment>) -> i32 {
    ctx.stats.requests.fetch_add(1, Ordering::Relaxed);
    let iod = q.get_iod(tag);
    let (op_flags, offset, len) = (iod.op_flags, iod.start_sector << 9, u64::from(iod.nr_sectors) << 9);
    let op = match op_flags & 0xff {
        sys::UBLK_IO_OP_READ => Op::Read,
        sys::UBLK_IO_OP_WRITE => Op::Write,
        sys::UBLK_IO_OP_FLUSH => Op::Flush,
        sys::UBLK_IO_OP_DISCARD => Op::Discard,
        sys::UBLK_IO_OP_WRITE_ZEROES => Op::WriteZeroes,
        _ => return -libc::EOPNOTSUPP,
    };
    if (op == Op::Read || op == Op::Write) && len as usize > buf.len() {
        return -libc::EINVAL;
    }
    // A flush has no range: the kernel leaves its sector at -1.
    if op != Op::Flush && !in_exported_range(iod.start_sector, len, q.dev.tgt.dev_size) {
        return -libc::EIO;
    }
    segments.clear();
    let data = (op == Op::Write).then(|| &buf[..len as usize]);
    let req = Request { op, offset, len, data };
    let mutating = matches!(op, Op::Write | Op::Discard | Op::WriteZeroes);
    let mut counted = false;
    if ctx.pipeline.borrow().is_none() {
        // Counted before the look, not after: a learner that set the layout between the two
        // would not wait for this request, served unclassified (`wait_learning_drained`).
        if mutating {
            ctx.layout.note_learning_started();
            counted = true;
        }
        *ctx.pipeline.borrow_mut() = ctx.layout.pipeline();
    }
    let learning = ctx.pipeline.borrow().is_none();
    if counted && !learning {
        ctx.layout.note_learning_done();
    }
    // Its counts, added once the engine served it.
    let mut tally = None;
    let slot_io = if !learning {
        let deadline = Instant::now() + ctx.header_wait;
        let mut waited = false;
        loop {
            let may_wait = Instant::now() < deadline && (waited || ctx.waiting.get() < ctx.max_waiting);
            let wait = if may_wait { HeaderWait::Allowed } else { HeaderWait::Expired };
            let planned = ctx.pipeline.borrow_mut().as_mut().is_some_and(|p| p.plan(&req, segments, wait).is_ok());
            if planned {
                break;
            }
            if !waited {
                if let Some(p) = ctx.pipeline.borrow().as_ref() {
                    p.note_header_wait();
                }
                waited = true;
                ctx.waiting.set(ctx.waiting.get() + 1);
                ctx.stats.header_wait_peak.fetch_max(u64::from(ctx.waiting.get()), Ordering::Relaxed);
            }
            sleep(q, HEADER_POLL).await;
        }
        if waited {
            ctx.waiting.set(ctx.waiting.get() - 1);
        }
        // A write to a slot fdpblk is deallocating goes out only after the deallocation;
        // the headers and containers it writes are reported once it completed.
        let p = ctx.pipeline.borrow();
        tally = p.as_ref().map(|p| p.tally());
        p.as_ref().and_then(|p| {
            (!p.trim_waits().is_empty() || !p.container_waits().is_empty() || !p.planned_headers().is_empty() || !p.planned_containers().is_empty())
                .then(|| SlotIo {
                    slots: p.slots().clone(),
                    trim_waits: p.trim_waits().to_vec(),
                    container_waits: p.container_waits().to_vec(),
                    headers: p.planned_headers().to_vec(),
                    containers: p.planned_containers(),
                })
        })
    } else {
        // Learning the layout: unclassified, on the handle for bytes outside it.
        if op == Op::Write {
            ctx.layout.note_learning_write(len);
            segments.push(Segment { offset, len, handle: ctx.layout.learning_handle });
        }
        None
    };
    if let Some(SlotIo { slots, trim_waits, container_waits, .. }) = &slot_io {
        let mut hold = Hold::new(q.get_qid(), &ctx.stats, offset);
        for &slot in trim_waits {
            while slots.trimming(slot) {
                hold.tick(|| format!("its slot {slot}'s deallocation"));
                sleep(q, hold.poll()).await;
            }
        }
        // A checkpoint header write waits for fdpblk's zeroing of the same block to land.
        for &copy in container_waits {
            while slots.container_zeroing(copy) {
                hold.tick(|| format!("the zeroing of checkpoint container {copy}"));
                sleep(q, hold.poll()).await;
            }
        }
        hold.end();
    }
    let res = match op {
        // A write is acknowledged once its pieces are: they must be the whole request.
        Op::Write if !crate::pipeline::segments_tile(segments, offset, len) => {
            tracing::error!("write at {offset} of {len} bytes: planned pieces {segments:?} do not cover it; failed with EIO (a bug: please report it)");
            if learning {
                ctx.layout.note_learning_done();
            }
            -libc::EIO
        }
        Op::Write => {
            let fua = op_flags & sys::UBLK_IO_F_FUA != 0;
            let mut res = len as i32;
            for s in segments.iter() {
                let rel = (s.offset - offset) as usize;
                res = ctx.engine.write(q, s.offset, &buf[rel..rel + s.len as usize], s.handle, fua).await;
                if res < 0 {
                    break;
                }
            }
            if learning {
                ctx.layout.note_learning_done();
            }
            if res >= 0 {
                if let Some(SlotIo { slots, headers, .. }) = &slot_io {
                    for &(slot, generation) in headers {
                        slots.header_completed(slot, generation);
                    }
                }
                res = len as i32;
            }
            res
        }
        Op::Read => ctx.engine.read(q, offset, &mut buf[..len as usize]).await,
        Op::Flush => ctx.engine.flush(q).await,
        Op::Discard => ctx.engine.discard(q, offset, len).await,
        Op::WriteZeroes => {
            let unmap = op_flags & sys::UBLK_IO_F_NOUNMAP == 0;
            ctx.engine.write_zeroes(q, offset, len, unmap, ctx.layout.learning_handle).await
        }
    };
    if let (Some(t), true) = (tally, res >= 0) {
        if let Some(p) = ctx.pipeline.borrow().as_ref() {
            p.counters().served(&t, if op == Op::Write { &segments[..] } else { &[] });
        }
    }
    // A discard or write-zeroes served while learning changes the device as a write does
    // (a half-written checkpoint copy zeroed): the learner looks again.
    if learning && matches!(op, Op::Discard | Op::WriteZeroes) {
        ctx.layout.note_learning_done();
    }
    // Failed too: part of it may have landed.
    if let Some(SlotIo { slots, containers, .. }) = &slot_io {
        slots.containers_written(*containers);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_request_is_counted_once_and_its_hold_kept_if_the_longest() {
        let stats = QueueStats::default();
        // Not held: nothing counted.
        Hold::new(0, &stats, 0).end();
        assert_eq!(stats.held_for_trims.load(Ordering::Relaxed), 0);
        // Held across several polls (slot, then container): one request, one hold.
        let mut h = Hold::new(0, &stats, 4096);
        h.tick(|| unreachable!("no warning within milliseconds"));
        std::thread::sleep(Duration::from_millis(3));
        h.tick(|| unreachable!());
        let while_held = stats.held_longest_us.load(Ordering::Relaxed);
        assert!(while_held >= 3_000, "a hold still going shows: {while_held} us");
        h.end();
        assert_eq!(stats.held_for_trims.load(Ordering::Relaxed), 1);
        let longest = stats.held_longest_us.load(Ordering::Relaxed);
        assert!(longest >= 3_000 && longest < HOLD_WARN.as_micros() as u64, "{longest} us");
        // A shorter hold later keeps the longest.
        let mut h = Hold::new(0, &stats, 8192);
        h.tick(|| unreachable!());
        h.end();
        assert_eq!(stats.held_for_trims.load(Ordering::Relaxed), 2);
        assert_eq!(stats.held_longest_us.load(Ordering::Relaxed), longest);
        let j = stats.to_json();
        assert_eq!((j["held_for_trims"].as_u64(), j["held_longest_us"].as_u64()), (Some(2), Some(longest)));
    }

    /// A held request looks again soon at first (a deallocation takes milliseconds), then
    /// ever less often, up to [`HOLD_POLL_MAX`] (a drive stuck in one).
    #[test]
    fn a_held_request_looks_less_often_the_longer_it_is_held() {
        let stats = QueueStats::default();
        let mut h = Hold::new(0, &stats, 0);
        let polls: Vec<u64> = (0..10).map(|_| h.poll().as_micros() as u64).collect();
        assert_eq!(polls, [200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000, 5000]);
    }

    #[test]
    fn a_lone_tag_never_waits_for_a_header() {
        assert_eq!(max_waiting(1, 1), 0);
        assert_eq!(max_waiting(1, 2), 1, "the header may come on the other queue");
        assert_eq!((max_waiting(2, 1), max_waiting(128, 1), max_waiting(4096, 4)), (1, 64, 2048));
    }

    #[test]
    fn requests_past_the_exported_end_are_refused() {
        let size = 1u64 << 30;
        let sector = |b: u64| b / 512;
        assert!(in_exported_range(0, size, size));
        assert!(in_exported_range(sector(size - 4096), 4096, size));
        assert!(in_exported_range(sector(size), 0, size));
        assert!(!in_exported_range(sector(size - 4096), 8192, size), "it would reach fdpblk's own state");
        assert!(!in_exported_range(sector(size), 512, size));
        assert!(!in_exported_range(u64::MAX, 0, size), "a flush's sector (-1)");
        assert!(!in_exported_range((1 << 55) + 8, 4096, size), "a sector whose byte offset wraps to 4096");
        assert!(!in_exported_range(sector(u64::MAX - 511), 1024, size), "no overflow");
    }

    #[test]
    fn only_errnos_that_say_what_happened_reach_the_kernel() {
        for e in [libc::EIO, libc::ENOSPC, libc::EOPNOTSUPP, libc::EINVAL, libc::ENODATA, libc::EILSEQ, libc::ENODEV] {
            assert_eq!(for_the_kernel(-e), -e, "errno {e} kept");
        }
        // The kernel failing to map a buffer, io_uring's cancellation, the engine's transient
        // errnos: the block layer would call them "no resources" or "busy", or nothing apt.
        for e in [libc::ENOMEM, libc::EAGAIN, libc::EBUSY, libc::EINTR, libc::ECANCELED, libc::EFAULT, libc::ETIME, libc::EOVERFLOW] {
            assert_eq!(for_the_kernel(-e), -libc::EIO, "errno {e} goes as EIO");
        }
        assert_eq!((for_the_kernel(0), for_the_kernel(4096)), (0, 4096));
    }

    #[test]
    fn failed_requests_are_counted_and_logged_at_most_once_a_second() {
        let s = QueueStats::default();
        assert_eq!(s.to_json()["last_error"], serde_json::Value::Null);
        assert!(s.failed(-libc::EIO, 5), "the first failure is logged");
        assert!(!s.failed(-libc::ENODEV, 500_000_000), "not again within the second");
        assert!(s.failed(-libc::ENODEV, 1_000_000_005));
        let v = s.to_json();
        assert_eq!(v["errors"], 3);
        assert_eq!(v["last_error"], std::io::Error::from_raw_os_error(libc::ENODEV).to_string());
    }
}
