//! Creating (or recovering) the ublk device and running its queues until it stops.

use std::path::{Path, PathBuf};
use super::config::{DeviceConfig, EngineKind};
use super::learn::{self, ExportedReader, Known, LayoutCell};
use super::queue::{io_task, QueueCtx, QueueStats};
use super::state;
use super::ublk_run_dir;
use crate::engine::passthrough::PassthroughEngine;
use crate::engine::queue::QueueEngine;
use crate::engine::uring::UringEngine;
use crate::persist::dev::{BlockDev, NvmeDev, StateWriter};
use crate::persist::{Persist, Region};
use crate::layout::Geometry;
use crate::pipeline::PipelineStats;
use crate::place::{policy_by_name, Policy, SharedPolicy, Target};
use crate::slot_table::SlotTable;
use crate::watch::{BufferedWrites, WatchConfig, Watcher, WritebackDelay};
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{UblkDev, UblkQueue};
use libublk::{sys, UblkError, UblkFlags};
use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// State shared by the queue threads and the stats writer (touched only at set-up and by the
/// once-a-second stats snapshot, never per request).
struct Shared {
    cfg: DeviceConfig,
    /// The layout, the slot table, the queues' pipelines and their one shared policy (what
    /// it learns from one queue's reads places the headers another queue writes).
    layout: Arc<LayoutCell>,
    /// The layout was learned from the device while it served (by this daemon, or by the one
    /// it recovered from) or found at a start that was given none; not given, nor found by
    /// `add` before the device existed.
    learned: AtomicBool,
    /// What the state thread publishes (checkpoint, slots, trims, own state), once it runs.
    watch: Mutex<Option<Arc<Mutex<crate::watch::Published>>>>,
    /// The passthrough engine of each queue, made before the queues start; each queue thread
    /// takes its own.
    engines: Mutex<Vec<Option<PassthroughEngine>>>,
    /// Why a queue could not start (the device start then fails with a bare EPERM).
    queue_failed: Mutex<Option<String>>,
    /// Each queue's counters.
    queues: Vec<Arc<QueueStats>>,
    /// Held while the state file is written: the device start and the learner both write it.
    state_file: Mutex<()>,
    /// The last write of the state file failed: the stats thread tries again each time it
    /// writes the stats (until then the file names the daemon that died, for a recovery, or
    /// no layout, for one learned).
    state_file_owed: AtomicBool,
}

impl Shared {
    /// Writes the device's state file (for `list`, `recover`) with the layout as known now,
    /// learned or not; the error says what it costs.
    fn write_state_file(&self) -> Result<(), String> {
        let _one_writer = self.state_file.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = self.cfg.clone();
        if c.geometry.is_none() {
            c.geometry = self.layout.known().map(|k| k.geometry);
        }
        let written = state::write_state(&c, std::process::id());
        self.state_file_owed.store(written.is_err(), Ordering::SeqCst);
        written.map_err(|e| {
            let fix = match e.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => "free space in /run".to_string(),
                Some(libc::EROFS) => "/run is read-only: mount it writable".to_string(),
                _ => format!("make {} writable by this user, with nothing in the way of the file", state::state_path(c.id).parent().map_or("/run/fdpblk".into(), |d| d.display().to_string())),
            };
            format!(
                "cannot write {}: {e}: without it a daemon that dies cannot be recovered, and `fdpblk add` could start a second device on the backing; {fix}",
                state::state_path(c.id).display()
            )
        })
    }

    /// A queue cannot start: remember why, and tell the device start, which waits until every
    /// queue registered its buffers, so that it fails instead of waiting forever.
    fn queue_cannot_start(&self, dev: &UblkDev, why: String) {
        tracing::error!("{why}");
        self.queue_failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(why);
        dev.notify_buffer_registration_complete(true);
    }

    fn stats(&self) -> PipelineStats {
        let mut total = PipelineStats::default();
        for c in self.layout.counters().iter() {
            total.add(&c.snapshot());
        }
        total
    }
}

/// The errno of a libublk error (0 where it has none).
fn errno_of(e: &UblkError) -> i32 {
    match e {
        UblkError::IOError(io) => io.raw_os_error().unwrap_or(0),
        UblkError::UringIOError(n) | UblkError::OtherError(n) => n.unsigned_abs() as i32,
        _ => 0,
    }
}

/// What fdpblk keeps in the `ublksrv_flags` of each device it adds: the driver stores that
/// word for the server (through recovery too) and never reads it, so it still tells an
/// fdpblk device from another ublk server's once its daemon died (a dead device names no
/// live server). 0 on devices of other servers that set nothing, and of fdpblk before it.
pub(crate) const DEVICE_TAG: u64 = u64::from_le_bytes(*b"fdpblk\x00\x01");

/// An exclusive lock on `/run/fdpblk/.add.lock`, taken by every add around its creation of
/// the device (and its clearing of what an earlier device of its id left), by the removal
/// of a stale state file ([`crate::cmd::up::remove_stale`]), and by a stopping daemon from
/// the deletion of its device to the removal of its files ([`finish_device`]).
pub(crate) fn add_lock() -> Result<std::fs::File, String> {
    let path = Path::new(state::RUN_DIR).join(".add.lock");
    let _ = std::fs::create_dir_all(state::RUN_DIR);
    let f = state::open_lock_file(&path).map_err(|e| format!("cannot open {} ({e}); make {} writable", path.display(), state::RUN_DIR))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(format!("cannot lock {}: {}", path.display(), std::io::Error::last_os_error()));
    }
    Ok(f)
}

/// Why device `id` may not take `name`: another device has it. `add` checks the name before
/// it starts a daemon, but two adds under one name can both pass that check; under the add
/// lock, from this check to the link, the first to link keeps the name.
fn name_taken(name: &str, id: i32) -> Option<String> {
    let other = name_holder(name).filter(|&other| other != id)?;
    Some(format!("--name {name} is taken by {}, added at the same time; pick another name", state::bdev_path(other)))
}

/// The device that `/dev/fdpblk/NAME` links to, when it exists and its state file names it so.
/// (fdpblk's link is absolute, udev's rule makes a relative one: `../ublkb3`.)
fn name_holder(name: &str) -> Option<i32> {
    let to = std::fs::read_link(state::name_path(name)).ok()?;
    let id = state::ublk_disk_id(to.file_name()?.to_str()?)?;
    let named = state::read_state(id).is_ok_and(|(cfg, _)| cfg.name.as_deref() == Some(name));
    (named && device_exists(id)).then_some(id)
}

/// The error for an add whose id a device has.
pub(crate) fn id_exists(id: i32) -> String {
    format!("ublk device {id} already exists; pick another -n or `fdpblk del -n {id}`")
}

/// The error for a device whose saved config names a policy this version lacks.
pub(crate) fn unknown_policy(cfg: &DeviceConfig) -> String {
    format!(
        "device {} was created with placement policy {:?}, which this version of fdpblk lacks ({}): recover it with the version that created it, or `fdpblk del -n {}` (its held I/O fails) and add it again",
        cfg.id,
        cfg.policy,
        crate::place::POLICY_NAMES.join(", "),
        cfg.id
    )
}

/// Whether id `id` belongs to a device that was deleted while still open: its nodes are gone,
/// and the driver still has it (a process holds it open: by a node of its own, as in a
/// container, or from another PID namespace), or a process is seen holding its deleted node.
fn id_held_by_deleted_device(id: i32) -> bool {
    !device_exists(id) && (driver_has_id(id) == Some(true) || !deleted_holders(id).is_empty())
}

/// Whether the ublk driver has a device of id `id`: GET_DEV_INFO on the control device,
/// asked here (libublk's handle prints a line for the missing JSON file of every id asked
/// about). A device deleted while held open keeps its id until its last user closes it, and
/// libublk answers an add of that id by deleting it, waiting for that user. None where the
/// driver cannot be asked.
fn driver_has_id(id: i32) -> Option<bool> {
    use io_uring::{opcode, squeue, types, IoUring};
    let dev_id = u32::try_from(id).ok()?;
    let ctl = std::fs::OpenOptions::new().read(true).write(true).open("/dev/ublk-control").ok()?;
    let mut ring = IoUring::<squeue::Entry128>::builder().build(2).ok()?;
    // On the heap, and leaked where a command's completion was not seen: the driver runs the
    // command from io_uring's worker, which may still write it after the ring is gone.
    let mut info = Box::new(sys::ublksrv_ctrl_dev_info::default());
    let mut ask = |op: u32| -> Option<i32> {
        let cmd = sys::ublksrv_ctrl_cmd {
            dev_id,
            queue_id: u16::MAX,
            len: std::mem::size_of::<sys::ublksrv_ctrl_dev_info>() as u16,
            addr: std::ptr::addr_of_mut!(*info) as u64,
            ..Default::default()
        };
        let mut area = [0u8; 80];
        // SAFETY: a plain C struct of 32 bytes, copied into the 80-byte command area.
        unsafe {
            std::ptr::copy_nonoverlapping(
                std::ptr::addr_of!(cmd).cast::<u8>(),
                area.as_mut_ptr(),
                std::mem::size_of::<sys::ublksrv_ctrl_cmd>(),
            )
        };
        let sqe = opcode::UringCmd80::new(types::Fd(ctl.as_raw_fd()), op).cmd(area).build();
        // SAFETY: `info`, the buffer the command names, lives until its completion is seen
        // (below), or for ever.
        unsafe { ring.submission().push(&sqe).ok()? };
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(_) => return None,
            }
            if let Some(c) = ring.completion().next() {
                return Some(c.result());
            }
        }
    };
    // The ioctl-encoded command, and the legacy one: drivers before 6.3 answer an op they do
    // not know with ENODEV, whatever the id; later ones may refuse legacy ops.
    let answers = [ask(sys::UBLK_U_CMD_GET_DEV_INFO), ask(sys::UBLK_CMD_GET_DEV_INFO)];
    if answers.contains(&None) {
        Box::leak(info);
    }
    if answers.iter().any(|a| a.is_some_and(|r| r >= 0)) {
        Some(true)
    } else if answers.iter().all(|&a| a == Some(-libc::ENODEV) || a == Some(-libc::EOPNOTSUPP) || a == Some(-libc::EINVAL))
        && answers.contains(&Some(-libc::ENODEV))
    {
        Some(false)
    } else {
        None
    }
}

/// The processes that still hold the deleted `/dev/ublkbN` (or its old daemon `/dev/ublkcN`)
/// open ("name (pid N)" each).
fn deleted_holders(id: i32) -> Vec<String> {
    let names = [format!("ublkb{id} (deleted)"), format!("ublkc{id} (deleted)")];
    state::openers_where(|t| t.file_name().is_some_and(|n| names.iter().any(|m| n == m.as_str())))
        .into_iter()
        .map(|(pid, comm)| format!("{comm} (pid {pid})"))
        .collect()
}

/// The ublk driver's control node: absent, the driver is not loaded.
pub(crate) const UBLK_CONTROL: &str = "/dev/ublk-control";

/// The control of ublk device `id`; without the driver, an error and nothing on stderr
/// (libublk prints a line of its own there, which `list` or `stats` would show per device).
pub(crate) fn ublk_ctrl(id: i32) -> Result<UblkCtrl, UblkError> {
    if !Path::new(UBLK_CONTROL).exists() {
        return Err(UblkError::OtherError(-libc::ENOENT));
    }
    // libublk reads the device's file in its run directory, following links, whole: one
    // planted there is removed first. (The directory itself is left to `add`: a stop, a
    // `del` must go ahead whatever it is.)
    let run_dir = Path::new(ublk_run_dir::RUN_DIR);
    if let Err(e) = ublk_run_dir::check_readable(run_dir, id) {
        tracing::warn!("ublk device {id}: {e}");
        return Err(UblkError::OtherError(-libc::EPERM));
    }
    UblkCtrl::new_simple(id)
}

/// libublk's error with its cause: its own text ("other IO failure") drops the errno.
pub(crate) fn ublk_error(e: &UblkError) -> String {
    let errno = errno_of(e);
    let text = match e {
        UblkError::IOError(io) => io.to_string(),
        _ if errno == 0 => e.to_string(),
        _ => format!("{e}: {}", std::io::Error::from_raw_os_error(errno)),
    };
    if errno == libc::EPERM || errno == libc::EACCES {
        format!("{text}; run as root (ublk's control device needs CAP_SYS_ADMIN)")
    } else {
        text
    }
}

/// Deletes this daemon's stopped device, its state file and its name link, unless the id is
/// another device's by now (this one deleted under it by other means, and the id given to a
/// new one): a live device served by another process, or a state file naming another live
/// daemon. (A stopped device, this one, reports no server.)
fn finish_device(ctrl: UblkCtrl, cfg: &DeviceConfig) {
    let me = std::process::id();
    let id = cfg.id;
    // Under the add lock from before the device goes until its files have: an add given the
    // freed id meanwhile would write its own state file, which this would remove. (Without
    // the lock, /run/fdpblk not writable, it goes on unlocked.)
    let _one = add_lock();
    let state_ours = match state::read_state(id) {
        Ok((_, d)) => d.pid == me || !d.alive(),
        Err(_) => true,
    };
    let info = ctrl.read_dev_info().ok().map(|_| ctrl.dev_info());
    let another_live = info.is_some_and(|i| u32::from(i.state) == sys::UBLK_S_DEV_LIVE && i.ublksrv_pid as u32 != me);
    if !device_exists(id) {
        ctrl.disown();
    } else if another_live || !state_ours {
        tracing::warn!("device {id} is another's now: left alone");
        ctrl.disown();
        return;
    } else if let Err(e) = delete_device(&ctrl) {
        tracing::warn!("{e}; delete it with `fdpblk del -n {id}`");
    }
    // The name link goes with the state file, if it still names this device.
    if state_ours {
        state::remove_state(cfg);
    }
}

/// Deletes ublk device `ctrl` without waiting for its users. The driver's plain delete unlinks
/// the device at once but answers only when the last opener of `/dev/ublkbN` has closed it
/// (LMCache may hold it for hours: `del`, `down` and a stopping daemon would hang); its
/// asynchronous delete answers at once, and the id stays taken until then. Where the driver
/// does not know that command (before Linux 6.9, and 6.9 and 6.10 without the stable fix),
/// the plain one runs on a thread left behind and this waits up to 10 s for the unlink.
/// Either way `ctrl` no longer deletes on drop (an added device's handle would, waiting, or
/// delete a device that took the id meanwhile).
pub(crate) fn delete_device(ctrl: &UblkCtrl) -> Result<(), String> {
    let id = ctrl.dev_info().dev_id as i32;
    let Err(e) = ctrl.del_dev_async() else { return Ok(()) };
    ctrl.disown();
    if !device_exists(id) {
        return Ok(());
    }
    // ENOTSUPP (524), the kernel's own "not supported", is what old drivers answer.
    if ![libc::EOPNOTSUPP, libc::EINVAL, 524].contains(&errno_of(&e)) {
        return Err(format!("ublk device {id} could not be deleted: {}", ublk_error(&e)));
    }
    tracing::debug!("device {id}: asynchronous delete unknown to the driver ({}); deleting on a thread", ublk_error(&e));
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_named("fdpblk-delete", move || {
        let _ = tx.send(ublk_ctrl(id).and_then(|c| c.del_dev()).map(drop).map_err(|e| ublk_error(&e)));
    })
    .map_err(|e| format!("ublk device {id} could not be deleted: {e}; `fdpblk del -n {id}` deletes it"))?;
    for _ in 0..200 {
        if !device_exists(id) {
            return Ok(());
        }
        if let Ok(Err(e)) = rx.try_recv() {
            return Err(format!("ublk device {id} could not be deleted: {e}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("ublk device {id} did not go within 10 s of its delete; is its daemon stuck? (kill it, then `fdpblk del -n {id}`)"))
}

/// Whether ublk device `id` exists (its char device, or its sysfs entry where no node is made).
pub(crate) fn device_exists(id: i32) -> bool {
    Path::new(&format!("/dev/ublkc{id}")).exists() || Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists()
}

/// How long a queue going down waits for its NVMe commands: past the kernel's NVMe I/O
/// timeout (30 s), after which the driver aborts or resets and completes them.
const PASSTHROUGH_DRAIN: Duration = Duration::from_secs(40);

thread_local! {
    /// Set on the queue threads: a panic there aborts the daemon ([`abort_on_queue_panic`]).
    static QUEUE_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A panic on a queue thread aborts the daemon, before unwinding could drop buffers the
/// kernel still uses or leave the device live with one queue gone (its I/O held, the daemon
/// alive, so nothing recovers it). Aborted, the driver holds the device's I/O for recovery
/// and the service manager restarts and recovers it. Other threads keep the default.
fn abort_on_queue_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if QUEUE_THREAD.with(std::cell::Cell::get) {
            tracing::error!("a queue thread panicked: aborting, so that the device can be recovered (`fdpblk recover`)");
            std::process::abort();
        }
    }));
}

fn queue_main(qid: u16, dev: &UblkDev, shared: &Shared) {
    QUEUE_THREAD.with(|q| q.set(true));
    let q = match UblkQueue::new(qid, dev) {
        Ok(q) => Rc::new(q),
        Err(e) => {
            shared.queue_cannot_start(dev, format!("queue {qid}: {}", ublk_error(&e)));
            return;
        }
    };
    // None while the layout is being learned: the queue switches at its first request after.
    let pipeline = shared.layout.pipeline();
    let engine = match shared.cfg.engine {
        super::config::EngineKind::Streams => QueueEngine::Uring(UringEngine::streams(shared.cfg.streams.clone(), dev.tgt.fds[1])),
        super::config::EngineKind::Passthrough => {
            let mut engines = shared.engines.lock().unwrap_or_else(|e| e.into_inner());
            match engines.get_mut(usize::from(qid)).and_then(Option::take) {
                Some(e) => QueueEngine::Passthrough(e),
                None => {
                    drop(engines);
                    shared.queue_cannot_start(dev, format!("queue {qid}: no passthrough engine made for it"));
                    return;
                }
            }
        }
        _ => QueueEngine::Uring(UringEngine::plain(dev.tgt.fds[1])),
    };
    let ctx = Rc::new(QueueCtx {
        pipeline: RefCell::new(pipeline),
        layout: shared.layout.clone(),
        engine,
        header_wait: Duration::from_micros(shared.cfg.header_wait_us),
        stats: shared.queues.get(usize::from(qid)).cloned().unwrap_or_default(),
        waiting: std::cell::Cell::new(0),
        max_waiting: super::queue::max_waiting(shared.cfg.depth, shared.cfg.queues),
    });
    let exe = Rc::new(smol::LocalExecutor::new());
    let mut tasks = Vec::new();
    for tag in q.tags() {
        let (q, ctx) = (q.clone(), ctx.clone());
        tasks.push(exe.spawn(async move {
            match io_task(&q, tag, &ctx).await {
                Err(UblkError::QueueIsDown) | Ok(()) => {}
                Err(e) => tracing::error!("queue {qid} tag {tag}: {}", ublk_error(&e)),
            }
        }));
    }
    // NVMe completions: not one of the tasks that decide when the queue is done.
    let reaper = matches!(ctx.engine, QueueEngine::Passthrough(_)).then(|| {
        let (q, ctx) = (q.clone(), ctx.clone());
        exe.spawn(async move {
            if let QueueEngine::Passthrough(e) = &ctx.engine {
                e.reap(&q).await;
            }
        })
    });
    let exe2 = exe.clone();
    let dev_id = dev.dev_info.dev_id;
    smol::block_on(exe.run(async move {
        let run_ops = || while exe2.try_tick() {};
        let done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) = libublk::wait_and_handle_io_events(&q, Some(20), run_ops, done).await {
            tracing::error!("queue {qid}: {}", ublk_error(&e));
        }
        // The io_uring engine's reads and writes go on the queue's own ring: a tag task still
        // waiting may have one in flight into its buffer. Forgetting the task handles would
        // not keep it: dropping the executor drops the tasks' futures, and their buffers,
        // anyway. Exiting leaves the pages to the kernel until the I/O ends, as the
        // passthrough drain below does. (libublk 0.4 returns Ok only once every task is
        // done; this does not lean on that.)
        if !matches!(ctx.engine, QueueEngine::Passthrough(_)) && !tasks.iter().all(|t| t.is_finished()) {
            tracing::error!("queue {qid}: tag tasks still had I/O in flight: aborting (`fdpblk recover -n {dev_id}` or `fdpblk del -n {dev_id}`)");
            std::process::abort();
        }
        drop(reaper);
        // A tag task owns the buffer its NVMe commands read into or write from: a queue that
        // went down with commands in flight waits for them (the drive's own timeout and reset
        // end any) before the tasks are dropped.
        if let QueueEngine::Passthrough(e) = &ctx.engine {
            if !e.drain(PASSTHROUGH_DRAIN) {
                // Dropping the tasks would free buffers the drive may still write or read;
                // keeping them keeps the queue's ring, so the device could never be deleted.
                // Exiting hands both to the kernel, which frees them when the commands end.
                tracing::error!("queue {qid}: {} NVMe commands did not complete within {PASSTHROUGH_DRAIN:?} of the queue going down: aborting (`fdpblk del -n {dev_id}`, or `fdpblk recover -n {dev_id}` once the drive answers)", e.inflight());
                std::process::abort();
            }
        }
    }));
}

/// The passthrough engine of one queue thread, on the backing char device `fd`.
fn passthrough_engine(fd: i32, cfg: &DeviceConfig) -> std::io::Result<PassthroughEngine> {
    // SAFETY: the backing file outlives the queue threads (`run` drops it after them).
    let nsid = crate::nvme::ioctl::namespace_id(&unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })?;
    // io_buf_bytes was capped at the namespace's largest transfer by `fdpblk add`; the limits
    // cap it again at what the namespace takes now.
    let limits = crate::engine::passthrough::CommandLimits::of(&cfg.backing);
    Ok(PassthroughEngine::new(fd, nsid, cfg.lba_shift, cfg.io_buf_bytes, cfg.pids.clone(), cfg.depth)?.with_limits(limits).with_controller_of(&cfg.backing))
}

fn set_params(dev: &mut UblkDev, cfg: &DeviceConfig, backing_fd: i32) {
    let tgt = &mut dev.tgt;
    tgt.fds[tgt.nr_fds as usize] = backing_fd;
    tgt.nr_fds += 1;
    if cfg.engine == super::config::EngineKind::Passthrough {
        // The completion poll is one more command than tags on the queue ring.
        tgt.cq_depth = tgt.cq_depth.saturating_mul(2);
    }
    tgt.dev_size = cfg.exported_bytes;
    let max_sectors = cfg.io_buf_bytes >> 9;
    // Passthrough bypasses the kernel's NVMe driver: offer only what it offers the namespace.
    let (max_discard_sectors, max_write_zeroes_sectors) = match cfg.engine {
        super::config::EngineKind::Passthrough => {
            let limits = crate::engine::passthrough::CommandLimits::of(&cfg.backing);
            (limits.ublk_discard_sectors(cfg.lba_shift), limits.ublk_write_zeroes_sectors(cfg.lba_shift))
        }
        _ => (super::config::max_request_sectors(cfg.lba_shift), super::config::max_request_sectors(cfg.lba_shift)),
    };
    tgt.params = sys::ublk_params {
        types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
        basic: sys::ublk_param_basic {
            attrs: sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA,
            logical_bs_shift: cfg.lba_shift,
            physical_bs_shift: cfg.lba_shift.max(12),
            io_opt_shift: 12,
            io_min_shift: cfg.lba_shift,
            max_sectors,
            dev_sectors: cfg.exported_bytes >> 9,
            ..Default::default()
        },
        discard: sys::ublk_param_discard {
            discard_granularity: 1 << cfg.lba_shift.max(12),
            max_discard_sectors,
            max_write_zeroes_sectors,
            max_discard_segments: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    dev.set_target_json(cfg.to_json());
}

/// The open backing device and, for a generic char device, the claim on its namespace.
pub struct Backing {
    pub file: std::fs::File,
    /// `/dev/nvmeXnY` opened with O_EXCL for the daemon's lifetime: a char device cannot be
    /// claimed, so this is what refuses a mounted namespace or a second fdpblk on the same one.
    _claim: Option<std::fs::File>,
    /// For a char device, a second open of it holding a lock that goes when this process
    /// does (nothing in flight references it): it tells a live daemon, which a new one must
    /// not wait for, from a dead one whose commands are still draining.
    _alive: Option<std::fs::File>,
}

fn in_use(what: &Path) -> String {
    format!(
        "backing {} is in use (mounted, or claimed by another fdpblk or device mapper; or the I/O of an fdpblk daemon that was killed is still in flight at the drive, until its timeout); free it first",
        what.display()
    )
}

/// Why fdpblk cannot serve LMCache's layout `g` on `backing` (logical blocks of `lba` bytes)
/// on this machine: its block_align, or the memory its slot table would take.
pub fn layout_error(g: &Geometry, lba: u64, backing: &Path) -> Option<String> {
    block_align_error(g, lba, backing).or_else(|| crate::device::mem_total_bytes().and_then(|m| slot_memory_error(g, m)))
}

/// Why the slot table of layout `g` is too much for a machine with `mem_total` bytes: slots of
/// kilobytes (LMCache allows any above its header) over a large device would take gigabytes,
/// touched whole by the state thread's sweeps, and the OOM killer would stop the daemon with
/// LMCache's I/O hung. Half the memory is the line, as for the I/O buffers. The table alone
/// is counted: `key-aware`'s load counts (about 21 bytes a slot more) and the I/O buffers are
/// not, so this refuses the layouts that cannot fit, not every one that will not.
fn slot_memory_error(g: &Geometry, mem_total: u64) -> Option<String> {
    let need = SlotTable::heap_bytes_for(g.max_slots);
    (need > mem_total / 2).then(|| {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        format!(
            "LMCache's layout makes {} slots of {} bytes in {} bytes: fdpblk's slot table would take {:.1} GiB, more than half of this machine's {:.1} GiB; fix: larger slots (LMCache's slot_bytes: one chunk of KV cache, megabytes) or less capacity (LMCache's capacity_bytes)",
            g.max_slots,
            g.slot_bytes,
            g.capacity_bytes,
            gib(need),
            gib(mem_total)
        )
    })
}

/// Why LMCache's layout `g` cannot be served on a backing of `lba`-byte logical blocks: the
/// ublk device has the drive's block size, so a `block_align` below it puts slot and
/// payload boundaries inside a block, which no engine can split (and LMCache's own O_DIRECT
/// I/O would fail on it).
fn block_align_error(g: &Geometry, lba: u64, backing: &Path) -> Option<String> {
    (g.block_align < lba).then(|| {
        format!(
            "LMCache's block_align {} is smaller than the {lba}-byte logical blocks of {}: set LMCache's block_align (and --block-align) to {lba} or a multiple",
            g.block_align,
            backing.display()
        )
    })
}

/// Opens the backing device: O_DIRECT (write streams need it; the page cache would only
/// double-buffer) and, for a block device, O_EXCL so that a device in use is refused. A
/// generic char device (`/dev/ngXnY`) is claimed through its namespace's block device.
/// Recovering, a claim still held is waited for: a killed daemon's writes still in flight at
/// the drive keep its open file, and with it the claim. That wait and the one for its NVMe
/// commands ([`lock_backing`]) share one deadline, 60 s after the first try.
pub fn open_backing(cfg: &DeviceConfig, recover: bool) -> Result<Backing, String> {
    let deadline = Instant::now() + EARLIER_COMMANDS_WAIT;
    // An `add` right after a `del`: the stopped daemon may still be closing the backing (the
    // kernel closes a process's files after its last thread has exited, a moment after `del`
    // saw it go), so a claim held elsewhere is tried again for a few seconds before it is
    // refused.
    let held_until = if recover { deadline } else { Instant::now() + ADD_HELD_WAIT };
    loop {
        match open_backing_once(cfg, recover, deadline) {
            Err((e, true)) if Instant::now() < held_until && (recover || !STOP_REQUESTED.load(Ordering::SeqCst)) => {
                tracing::debug!("{e}: waiting for the earlier holder to let go");
                std::thread::sleep(Duration::from_millis(200));
            }
            // The wait cut short by a stop: say so (the holder may have been about to let go).
            Err((e, true)) if !recover && Instant::now() < held_until => return Err(stopped_while_waiting(&e)),
            r => return r.map_err(|(e, _)| e),
        }
    }
}

/// What the backing is now, as `add` measured it.
struct BackingNow {
    bytes: u64,
    /// Of a namespace or block device: its logical block size and metadata bytes per block.
    blocks: Option<(u64, u16)>,
}

/// The backing's size and blocks now: a namespace's char device from Identify Namespace (it
/// has no BLKGETSIZE64), a block device or file as `add` measured them.
fn backing_now(path: &Path, file: &std::fs::File) -> Result<BackingNow, String> {
    use crate::device::ReadAt;
    use std::os::unix::fs::FileTypeExt;
    let kind = file.metadata().map(|m| m.file_type()).ok();
    let now = if kind.is_some_and(|t| t.is_char_device()) {
        (|| {
            let dev = crate::nvme::NvmeDevice::open(path).map_err(|e| e.to_string())?;
            let nsid = dev.nsid().ok_or_else(|| format!("{} is not an NVMe namespace", path.display()))?;
            let ns = dev.identify_ns(nsid).map_err(|e| e.to_string())?;
            let lba = ns.lba_size().map_err(|e| e.to_string())?;
            let bytes = ns.size_bytes().map_err(|e| e.to_string())?;
            Ok(BackingNow { bytes, blocks: Some((u64::from(lba), ns.format().map_or(0, |f| f.ms))) })
        })()
    } else {
        let blocks = kind.is_some_and(|t| t.is_block_device()).then(|| (crate::device::logical_block_bytes(file), 0));
        file.size().map(|bytes| BackingNow { bytes, blocks }).map_err(|e| e.to_string())
    };
    now.map_err(|e: String| format!("cannot read the size of backing {}: {e}", path.display()))
}

/// The backing's blocks must be those it had when the device was added: the passthrough engine
/// turns byte offsets into LBAs with the saved size (other blocks would put every command at
/// another place), the ublk device was made with it, and its commands carry no metadata. A
/// namespace formatted again (`nvme format --lbaf`) keeps its name, serial and size.
fn backing_blocks_unchanged(cfg: &DeviceConfig, blocks: Option<(u64, u16)>) -> Result<(), String> {
    let want = 1u64 << cfg.lba_shift;
    match blocks {
        None => Ok(()),
        Some((block, 0)) if block == want => Ok(()),
        Some((block, ms)) => {
            let meta = if ms > 0 { format!(" with {ms} bytes of metadata each") } else { String::new() };
            Err(format!(
                "device {}: backing {} now has {block}-byte blocks{meta}, not the {want}-byte blocks it had when the device was added: \
                 it was formatted again, which erased LMCache's data and fdpblk's state. Nothing was written. `fdpblk del -n {}` \
                 and add it again on this backing, which LMCache then fills from empty",
                cfg.id,
                cfg.backing.display(),
                cfg.id
            ))
        }
    }
}

/// The backing must still be as large as when the device was added: its reserved tail (fdpblk's
/// own state) and LMCache's slots lie where that size put them. Smaller, the path now names
/// a resized namespace, a truncated file or another device (NVMe names can change at boot),
/// and serving it would fail LMCache's I/O past the end or write into someone else's data.
/// Larger is fine: the bytes past the saved size are left alone.
fn backing_size_unchanged(cfg: &DeviceConfig, now_bytes: u64) -> Result<(), String> {
    if now_bytes >= cfg.backing_bytes {
        return Ok(());
    }
    Err(format!(
        "device {}: backing {} is {now_bytes} bytes now, smaller than the {} it had when the device was added: \
         the namespace was resized, the file truncated, or the path now names another device (NVMe names can change \
         at boot). Nothing was written. Give the device its backing back \
         (`fdpblk list` shows the saved config), or `fdpblk del -n {}` and add it again on this backing, \
         which LMCache then fills from empty",
        cfg.id,
        cfg.backing.display(),
        cfg.backing_bytes,
        cfg.id
    ))
}

/// Prefix of a saved NVMe namespace identity ([`backing_identity`]).
const NAMESPACE: &str = "NVMe namespace ";

/// How long a restarting daemon asks again a backing that does not answer Identify.
const IDENTIFY_WAIT: Duration = Duration::from_secs(30);

/// What names the backing whatever its path, saved by `add` and checked at every daemon
/// start (`None`: nothing to check, a block device sysfs tells nothing of): an NVMe
/// namespace's identity ([`crate::nvme::discover::namespace_identity`]), another block
/// device's ([`block_identity`]), or a file's inode and file system (a file deleted and made
/// again under the path is another). A file's and a disk sequence number hold within one
/// boot, as do the devices that check them (their state lives in /run). Saved strings are
/// compared whole: a change of this format must still accept the ones saved before.
pub fn backing_identity(path: &Path) -> Result<Option<String>, String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.file_type().is_file() {
        let mut id = format!("file inode {} on device {}:{}", meta.ino(), libc::major(meta.dev()), libc::minor(meta.dev()));
        // A freed inode number is soon handed out again; its birth time tells the two apart
        // where the file system keeps one.
        if let Ok(t) = meta.created().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).map_err(std::io::Error::other)) {
            id += &format!(" made {}.{:09}", t.as_secs(), t.subsec_nanos());
        }
        return Ok(Some(id));
    }
    match crate::nvme::discover::identity_of(path) {
        Ok(Some(id)) => Ok(Some(format!("{NAMESPACE}{id}"))),
        // Another kind of block device (a SCSI or virtio disk, device mapper, md, loop) or a
        // partition: what sysfs tells of its disk.
        Ok(None) if meta.file_type().is_block_device() => {
            Ok(crate::device::sysfs_block_dir(meta.rdev()).and_then(|dir| block_identity(&dir)))
        }
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Prefix of a saved identity of another kind of block device ([`block_identity`]).
const BLOCK_DEVICE: &str = "block device ";

/// What names a block device that is no NVMe namespace, from its sysfs directory `dir`: its
/// disk's world-wide id (SCSI, and an NVMe namespace under a partition), device-mapper or md
/// uuid, or (virtio) serial, else the disk's sequence number (Linux >= 5.15: new at every
/// attach, so a loop device set up again on another file, or a disk plugged in again under the
/// same name, is another; also after a removable disk's media change); a partition adds its
/// number and first sector. None where sysfs tells nothing of these.
fn block_identity(dir: &Path) -> Option<String> {
    let attr = |d: &Path, a: &str| std::fs::read_to_string(d.join(a)).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let (disk, part) = match attr(dir, "partition") {
        Some(n) => (dir.parent()?, Some(format!(" partition {n} from sector {}", attr(dir, "start")?))),
        None => (dir, None),
    };
    let id = if let Some(w) = attr(disk, "wwid").or_else(|| attr(disk, "device/wwid")) {
        format!("wwid {w}")
    } else if let Some(u) = attr(disk, "dm/uuid") {
        format!("device-mapper uuid {u}")
    } else if let Some(u) = attr(disk, "md/uuid").filter(|u| u.chars().any(|c| c.is_ascii_hexdigit() && c != '0')) {
        // (All zeros: an array of external metadata or built without a superblock.)
        format!("md uuid {u}")
    } else if let Some(v) = attr(disk, "serial") {
        // A virtio disk's serial, as the hypervisor gives it.
        format!("serial {v}")
    } else {
        format!("{} disk sequence number {}", disk.file_name()?.to_str()?, attr(disk, "diskseq")?)
    };
    Some(format!("{BLOCK_DEVICE}{id}{}", part.unwrap_or_default()))
}

/// The backing must still be what the device was added on: the same size proves nothing
/// (drives of one model are), and a node name can come to name another NVMe namespace
/// (when a controller is removed and another added while the device waits), one deleted
/// and made again, or a file made again; LMCache's index would then be served other bytes.
/// `find` looks for the node of a kind that has a saved namespace now, for the error.
fn backing_identity_unchanged(
    cfg: &DeviceConfig,
    saved: &str,
    now: Result<Option<String>, String>,
    find: impl FnOnce(&str, crate::nvme::path::DevKind) -> Option<PathBuf>,
) -> Result<(), String> {
    let now = match now {
        Ok(Some(now)) if now == saved => return Ok(()),
        Ok(Some(now)) => format!("is now the {now}"),
        Ok(None) => "is neither an NVMe namespace, nor a block device sysfs names, nor a file now".to_string(),
        Err(e) => {
            return Err(format!(
                "device {}: cannot tell whether backing {} is still the one it was added on ({saved}): {e}. \
                 Nothing was written; run `fdpblk recover -n {}` again once the drive answers",
                cfg.id,
                cfg.backing.display(),
                cfg.id
            ))
        }
    };
    let kind = if cfg.engine == EngineKind::Passthrough { crate::nvme::path::DevKind::Generic } else { crate::nvme::path::DevKind::Block };
    let went = match saved.strip_prefix(NAMESPACE).map(|ns| find(ns, kind)) {
        Some(Some(p)) => format!(
            "that namespace is {} now: `fdpblk del -n {}` and add the device again on it (`backing` in its config file, for `fdpblk up`; LMCache's checkpoint there is kept)",
            p.display(),
            cfg.id
        ),
        Some(None) => format!("no node names that namespace now: give the device its drive back, or `fdpblk del -n {}` and add it again", cfg.id),
        None if saved.starts_with(BLOCK_DEVICE) => format!(
            "give the device its disk back, or `fdpblk del -n {}` and add it again (a disk or loop device set up again counts as another even with the same bytes; LMCache's checkpoint on them is kept)",
            cfg.id
        ),
        None => format!("give the device its file back, or `fdpblk del -n {}` and add it again (LMCache then fills it from empty)", cfg.id),
    };
    Err(format!(
        "device {}: backing {} {now}, not the {saved} the device was added on. Nothing was written; {went}",
        cfg.id,
        cfg.backing.display()
    ))
}

/// A recovery's check that the placement identifiers saved at `add` are the drive's now
/// (`now`: what the drive lists for the policy's handles, read again). They change only with
/// the drive's FDP configuration, which a drive lets change only with its namespaces deleted
/// and made again: the bytes LMCache's index names are gone, and writes would carry
/// identifiers of another configuration. A drive that cannot be asked now is no reason to keep
/// LMCache waiting: the saved ones are used, with a warning.
fn placement_unchanged(cfg: &DeviceConfig, now: Result<Result<Vec<u16>, String>, String>) -> Result<(), String> {
    let now = match now {
        Ok(Ok(now)) if now == cfg.pids => return Ok(()),
        Ok(Ok(now)) => format!("now lists placement identifiers {now:?} for policy {}", cfg.policy),
        Ok(Err(why)) => format!("places no writes for policy {} now ({why})", cfg.policy),
        Err(e) => {
            tracing::warn!("device {}: cannot read the drive's placement identifiers again ({e}); recovering with those saved at add, {:?}", cfg.id, cfg.pids);
            return Ok(());
        }
    };
    Err(format!(
        "device {}: the drive {now}, not the placement identifiers {:?} the device was added with: its FDP configuration changed, \
         so its namespaces were made again and the bytes LMCache's index names are gone. Nothing was written; \
         `fdpblk del -n {}` and add the device again (LMCache then fills it from empty)",
        cfg.id, cfg.pids, cfg.id
    ))
}

/// A recovery's check, for the streams engine, that the namespace still has the write
/// streams the device was added with (`max_write_streams`: `now`, read again). Fewer means its
/// FDP configuration changed (only with its namespaces made again, as for
/// [`placement_unchanged`]); none, a kernel or driver without them. The kernel would fail
/// every write on a stream past the count. A namespace whose count cannot be read now keeps the saved streams, with a warning.
fn streams_unchanged(cfg: &DeviceConfig, now: Result<u64, String>) -> Result<(), String> {
    let Some(&most) = cfg.streams.iter().max() else { return Ok(()) };
    match now {
        Ok(n) if n >= u64::from(most) => Ok(()),
        // None at all: the kernel (before Linux 6.16) or its NVMe driver (FDP not set up on
        // the namespace) offers none; the drive's bytes are as they were.
        Ok(0) => Err(format!(
            "device {}: the kernel offers no write streams on backing {} now (max_write_streams 0 or absent), and policy {} writes on {most}: \
             the streams engine needs Linux >= 6.16 with the namespace's FDP set up by its NVMe driver. Nothing was written; \
             recover under such a kernel (`fdpblk recover -n {}`), or `fdpblk del -n {}` and add the device on /dev/ngXnY with --engine passthrough",
            cfg.id,
            cfg.backing.display(),
            cfg.policy,
            cfg.id,
            cfg.id
        )),
        Ok(n) => Err(format!(
            "device {}: backing {} now has {n} write streams (max_write_streams), fewer than the {most} policy {} was added with: \
             its FDP configuration changed, so its namespaces were made again and the bytes LMCache's index names are gone. \
             Nothing was written; `fdpblk del -n {}` and add the device again (LMCache then fills it from empty)",
            cfg.id,
            cfg.backing.display(),
            cfg.policy,
            cfg.id
        )),
        Err(e) => {
            tracing::warn!("device {}: cannot read the write streams of {} again ({e}); recovering with those saved at add, {:?}", cfg.id, cfg.backing.display(), cfg.streams);
            Ok(())
        }
    }
}

/// `max_write_streams` of block device `path` now (0 where the kernel has none: before 6.16).
fn max_write_streams(path: &Path) -> Result<u64, String> {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?.rdev();
    let dir = crate::device::sysfs_block_dir(rdev).ok_or_else(|| format!("no sysfs directory for {}", path.display()))?;
    match std::fs::read_to_string(dir.join("queue/max_write_streams")) {
        Ok(v) => v.trim().parse().map_err(|e| format!("max_write_streams {:?}: {e}", v.trim())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(format!("max_write_streams: {e}")),
    }
}

/// An add's wait for an earlier holder, ended by a stop signal before its time was up.
fn stopped_while_waiting(e: &str) -> String {
    format!("a stop signal came while it started, waiting for an earlier holder to let go ({e}); nothing was created")
}

/// How long `add` tries again a backing held elsewhere (see [`open_backing`]).
const ADD_HELD_WAIT: Duration = Duration::from_secs(5);

/// One try of [`open_backing`]: the error, and whether it was a claim held elsewhere. The
/// wait for an earlier daemon's commands ends at `deadline`, shared with the wait for its claim.
fn open_backing_once(cfg: &DeviceConfig, recover: bool, deadline: Instant) -> Result<Backing, (String, bool)> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let ft = std::fs::metadata(&cfg.backing).map(|m| m.file_type());
    let is_bdev = ft.as_ref().is_ok_and(|t| t.is_block_device());
    let is_chardev = ft.as_ref().is_ok_and(|t| t.is_char_device());
    let claim = if is_chardev { claim_namespace(&cfg.backing)? } else { None };
    // A block device is held with O_EXCL; a char device or a file has only this lock to keep a
    // second daemon (an `add` right after a `del` whose daemon still writes its state) off it.
    let is_file = ft.as_ref().is_ok_and(|t| t.is_file());
    let alive = if is_chardev || is_file { Some(hold_alive_lock(&cfg.backing)?) } else { None };
    let not_busy = |e: String| (e, false);
    let mut flags = libc::O_DIRECT;
    if is_bdev {
        flags |= libc::O_EXCL;
    }
    let open = |flags| std::fs::OpenOptions::new().read(true).write(true).custom_flags(flags).open(&cfg.backing);
    let file = match open(flags) {
        // tmpfs and some file systems refuse O_DIRECT on regular files; a file backing is for tests.
        Err(e) if !is_bdev && e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(
                "backing {}: its file system refuses O_DIRECT, so it is served through the page cache, where a failed flush may go unreported (a later one succeeds): fdpblk's own state and deallocations may rest on writes that never reached the disk; a file backing is for tests, serve a block device or an NVMe namespace",
                cfg.backing.display()
            );
            open(0)
        }
        r => r,
    };
    let file = file.map_err(|e| match e.raw_os_error() {
        Some(libc::EBUSY) => (in_use(&cfg.backing), true),
        Some(libc::EACCES | libc::EPERM) => (format!("cannot open backing {}: {e}; run as root", cfg.backing.display()), false),
        _ => (format!("cannot open backing {}: {e}", cfg.backing.display()), false),
    })?;
    // A recovery waits on through a stop (the device it holds is then started and stopped);
    // an add has made nothing yet and gives up.
    let stop = (!recover).then_some(&STOP_REQUESTED);
    // A file's I/O descriptor too: an earlier daemon's io_uring writes hold it past its exit,
    // and one landing after a reissued write would put old data back.
    if is_chardev || is_file {
        lock_backing(&file, &cfg.backing, deadline, stop).map_err(not_busy)?;
    }
    // A namespace served through its char device by a daemon that died: its NVMe commands
    // still in flight hold that node's lock (its claim on this block device went with it), so
    // a daemon on the block device waits for them as a passthrough one would.
    if is_bdev {
        if let Some(ng) = crate::nvme::path::namespace_other_node(&cfg.backing) {
            if let Ok(g) = std::fs::File::open(&ng) {
                // A live one (that could not claim the namespace) is not waited for.
                if alive_lock_held(&g) {
                    return Err((
                        format!(
                            "backing {} is served through {} by another running fdpblk daemon; `fdpblk list` shows it, `fdpblk del` stops it",
                            cfg.backing.display(),
                            ng.display()
                        ),
                        true,
                    ));
                }
                lock_backing(&g, &ng, deadline, stop).map_err(not_busy)?;
            }
        }
    }
    Ok(Backing { file, _claim: claim, _alive: alive })
}

/// Takes the liveness lock of a char-device or file backing: an open file description lock on its
/// first byte, on a descriptor no I/O is ever submitted on, so that it is released the moment
/// its daemon exits. Held already, another daemon is running on the backing (the error is
/// marked "claimed elsewhere", so a recovering daemon waits for a dying one to go). Linux
/// keeps these locks apart from the `flock` of [`lock_backing`].
fn hold_alive_lock(path: &Path) -> Result<std::fs::File, (String, bool)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| (format!("cannot open backing {}: {e}", path.display()), false))?;
    let lock = first_byte_write_lock();
    // SAFETY: F_OFD_SETLK with a pointer to a live flock on a descriptor owned by `file`.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) } == 0 {
        return Ok(file);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Err((
            format!("backing {} is served by another running fdpblk daemon; `fdpblk list` shows it, `fdpblk del` stops it", path.display()),
            true,
        )),
        _ => Err((format!("cannot lock backing {}: {e}", path.display()), false)),
    }
}

/// The liveness lock's range and kind: a write lock on the first byte.
fn first_byte_write_lock() -> libc::flock {
    // SAFETY: an all-zero flock is a valid value; the fields that matter are set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as _;
    lock.l_whence = libc::SEEK_SET as _;
    lock.l_start = 0;
    lock.l_len = 1;
    lock
}

/// Whether a daemon holds the liveness lock ([`hold_alive_lock`]) of the backing `file` is
/// open on.
fn alive_lock_held(file: &std::fs::File) -> bool {
    let mut lock = first_byte_write_lock();
    // SAFETY: F_OFD_GETLK with a pointer to a live flock on a descriptor owned by `file`.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut lock) };
    rc == 0 && i32::from(lock.l_type) != libc::F_UNLCK
}

/// How long the learner sees a checkpoint copy half-written before it says so.
const HALF_WRITTEN_SAY_AFTER: Duration = Duration::from_secs(120);

/// How long a new daemon waits for an earlier one's NVMe commands to leave the drive (the
/// kernel's NVMe I/O timeout is 30 s, then the command is aborted).
const EARLIER_COMMANDS_WAIT: Duration = Duration::from_secs(60);

/// Locks a passthrough backing (`flock`, exclusive) for the daemon's life, on the open file
/// its engines submit on. Every NVMe command in flight holds a reference to that file, and
/// uring commands cannot be cancelled: a killed daemon's lock goes only when its last command
/// has completed at the drive, though the process is gone and its namespace claim with it.
/// Waiting for it keeps such a command (a write LMCache already re-sent through the new
/// daemon, and maybe overwrote since) from landing on the drive after newer data.
fn lock_backing(file: &std::fs::File, path: &Path, deadline: Instant, stop: Option<&AtomicBool>) -> Result<(), String> {
    let mut said = false;
    loop {
        if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Err(format!("stopped by a signal while waiting for backing {}; nothing was made", path.display()));
        }
        // SAFETY: flock on a descriptor owned by `file`.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(format!("cannot lock backing {}: {e}", path.display()));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "backing {}: commands of an earlier fdpblk daemon are still in flight at the drive after {} s (a hung controller?); check `dmesg` and `nvme list`, then try again",
                path.display(),
                EARLIER_COMMANDS_WAIT.as_secs() // the deadline is that long after the first try
            ));
        }
        if !said {
            tracing::info!("backing {}: waiting for an earlier daemon's commands to complete at the drive", path.display());
            said = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Claims the block device of the namespace behind a generic char device. A namespace the
/// kernel gives no block device (an LBA format it cannot use) has nothing to mount or claim.
fn claim_namespace(ng: &Path) -> Result<Option<std::fs::File>, (String, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let Some(bdev) = crate::nvme::path::namespace_block_device(ng) else { return Ok(None) };
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(&bdev) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Err((
            format!(
                "backing {} is in use: its namespace {} is mounted, or claimed by another fdpblk or device mapper; free it first",
                ng.display(),
                bdev.display()
            ),
            true,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!("{} has no {}: fdpblk cannot claim the namespace, so a mount of it is not refused", ng.display(), bdev.display());
            Ok(None)
        }
        Err(e) => Err((format!("cannot claim the namespace of {} ({}): {e}", ng.display(), bdev.display()), false)),
    }
}

/// Runs the device until it is stopped. `notify` is called once with the device id after the
/// device started, or with the error that prevented it.
pub fn run(cfg: DeviceConfig, recover: bool, notify: impl FnOnce(Result<i32, String>) + Send + 'static) -> Result<(), String> {
    let notify = Arc::new(Mutex::new(Some(notify)));
    let fail = |msg: String| -> String {
        if let Some(n) = notify.lock().ok().and_then(|mut n| n.take()) {
            n(Err(msg.clone()));
        }
        msg
    };
    if !std::path::Path::new(UBLK_CONTROL).exists() {
        return Err(fail("no ublk driver: /dev/ublk-control is missing; run `modprobe ublk_drv` (Linux >= 6.0 with CONFIG_BLK_DEV_UBLK)".into()));
    }
    // Before the backing: a recovery may wait there up to a minute for an earlier daemon's
    // commands, and a stop in that wait must stop the device once it started, not kill the
    // process and leave the device held.
    block_signals();
    if let Err(e) = spawn_signal_thread() {
        return Err(fail(e));
    }
    abort_on_queue_panic();
    // Before the device is touched (a state file of another version may name any policy).
    let Some(first_policy) = policy_by_name(&cfg.policy) else { return Err(fail(unknown_policy(&cfg))) };
    cfg.check_handle_map(first_policy.handles()).map_err(fail)?;
    // Before the backing is opened (where a node now naming a mounted namespace would be
    // waited for as "in use"). An add read it just now, from the same path.
    if let Some(saved) = cfg.backing_identity.as_deref().filter(|_| recover) {
        // A controller that is resetting answers no Identify for a while: asked again.
        let asked_until = Instant::now() + IDENTIFY_WAIT;
        let mut now = backing_identity(&cfg.backing);
        while now.is_err() && Instant::now() < asked_until && !STOP_REQUESTED.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_secs(1));
            now = backing_identity(&cfg.backing);
        }
        backing_identity_unchanged(&cfg, saved, now, crate::nvme::discover::find_namespace).map_err(fail)?;
    }
    if recover && cfg.engine == EngineKind::Passthrough && !cfg.pids.is_empty() {
        let now = crate::engine::passthrough::placement_ids(&cfg.backing, &cfg.policy, first_policy.handles());
        placement_unchanged(&cfg, now).map_err(fail)?;
    }
    if recover && cfg.engine == EngineKind::Streams {
        streams_unchanged(&cfg, max_write_streams(&cfg.backing)).map_err(fail)?;
    }
    let Backing { file: backing, _claim: claim, _alive: alive } = open_backing(&cfg, recover).map_err(fail)?;
    let now = backing_now(&cfg.backing, &backing).map_err(fail)?;
    backing_size_unchanged(&cfg, now.bytes).map_err(fail)?;
    backing_blocks_unchanged(&cfg, now.blocks).map_err(fail)?;
    let dev_flags = if recover { UblkFlags::UBLK_DEV_F_RECOVER_DEV } else { UblkFlags::UBLK_DEV_F_ADD_DEV };
    // One add at a time from the id check to the device's creation: libublk answers a refused
    // add by deleting the device of that id (waiting for its users), so the id must be free.
    // A deleted device keeps its id until its last user closes it (a probe after `del`, or
    // LMCache still holding it): an add with that id waits a moment, then names them.
    let one_add = if recover { None } else { Some(add_lock().map_err(fail)?) };
    if !recover && cfg.id >= 0 {
        let held_until = Instant::now() + ADD_HELD_WAIT;
        while id_held_by_deleted_device(cfg.id) {
            if Instant::now() >= held_until || STOP_REQUESTED.load(Ordering::SeqCst) {
                let who = deleted_holders(cfg.id);
                let who = if who.is_empty() {
                    " (by a process this one cannot name: one with a node of its own, as in a container, or in another PID namespace)".to_string()
                } else {
                    format!(" (by {})", who.join(", "))
                };
                let e = format!(
                    "ublk device id {} is still taken: the deleted /dev/ublkb{} is still open{who}; close it, or add without -n (another id)",
                    cfg.id, cfg.id
                );
                return Err(fail(if Instant::now() < held_until { stopped_while_waiting(&e) } else { e }));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        if device_exists(cfg.id) {
            return Err(fail(id_exists(cfg.id)));
        }
    }
    // libublk reads (recover) and writes its file of the device in its run directory as
    // root: the directory is made safe first, and a file planted at this id is removed.
    let run_dir = Path::new(ublk_run_dir::RUN_DIR);
    ublk_run_dir::secure(run_dir).map_err(fail)?;
    // Before the driver is asked for anything: a recovery that failed at libublk's write
    // would leave the device quiesced with LMCache's I/O held.
    let who = if cfg.id >= 0 { format!("device {}: ", cfg.id) } else { String::new() };
    ublk_run_dir::room_to_write(run_dir).map_err(|e| fail(format!("{who}{e}; then {}", start_again(&cfg, recover))))?;
    if cfg.id >= 0 {
        ublk_run_dir::clear_for_write(run_dir, cfg.id).map_err(fail)?;
    }
    let ctrl = UblkCtrlBuilder::default()
        .name("fdpblk")
        .id(cfg.id)
        .nr_queues(cfg.queues)
        .depth(cfg.depth)
        .io_buf_bytes(cfg.io_buf_bytes)
        .ctrl_flags(u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE))
        .ctrl_target_flags(DEVICE_TAG)
        .dev_flags(dev_flags)
        .build()
        .map_err(|e| fail(format!("creating ublk device {}: {}", cfg.id, ublk_error(&e))))?;
    let id = ctrl.dev_info().dev_id as i32;
    // Still under the add lock: `up::remove_stale`, which takes it too, then never sees an
    // earlier device's file at this id as stale once this device has the id.
    if !recover {
        state::clear_stale(id);
    }
    drop(one_add);
    // The id the driver chose: before libublk writes its file there.
    ublk_run_dir::clear_for_write(run_dir, id).map_err(fail)?;
    if !recover {
        // A driver without user recovery (Linux 6.0) drops the flag rather than refusing it.
        if ctrl.dev_info().flags & u64::from(sys::UBLK_F_USER_RECOVERY) == 0 {
            tracing::warn!("device {id}: the ublk driver has no user recovery (Linux >= 6.1 has): if this daemon dies, the device fails LMCache's I/O instead of holding it for `fdpblk recover`");
        }
    }
    let mut cfg = cfg;
    cfg.id = id;
    take_drivers_queues(&mut cfg, &ctrl.dev_info());
    let state_dev = open_state_dev(&cfg, &backing, recover).map_err(fail)?;
    // A newer fdpblk's own state (rolled back while its daemon ran, which then died): this
    // one would start afresh over it. `add` refuses it unless --force; a recovery has none.
    if let Some(v) = recover.then(|| crate::persist::newer_format_in(&*state_dev, Region::tail(cfg.backing_bytes))).flatten() {
        return Err(fail(format!(
            "device {id}: backing {} holds fdpblk's own state in format {v}, written by a newer fdpblk (this one reads format {}): recover it with that fdpblk; or `fdpblk del -n {id}` (which fails LMCache's held I/O) and add it again with --force, which starts that state afresh",
            cfg.backing.display(),
            crate::persist::FORMAT
        )));
    }
    // A device that was learning when its daemon died may have a checkpoint by now. Its layout
    // counts as learned: the earlier daemon served writes no state thread followed, so no
    // saved confirmation is trusted, whatever mark that daemon left on the saved state.
    let mut learned = false;
    if cfg.geometry.is_none() {
        if let Ok(Some(g)) = learn::look(&ExportedReader { dev: &*state_dev, size: cfg.exported_bytes }, &cfg.layout_flags) {
            // One the drive cannot serve is left to the learner, which refuses it.
            if layout_error(&g, 1u64 << cfg.lba_shift, &cfg.backing).is_none() {
                cfg.geometry = Some(g);
                learned = true;
            }
        }
    }
    let mut policy = SharedPolicy::new(first_policy);
    let outside = policy.place(&Target::Outside);
    let layout = Arc::new(LayoutCell::new(policy, outside));
    // Made here, before any queue runs: a failure (io_uring set-up, eventfd) is an error of
    // `add`, where in a queue thread it would leave the device start waiting for that queue.
    let engines = match cfg.engine {
        super::config::EngineKind::Passthrough => (0..cfg.queues)
            .map(|_| passthrough_engine(backing.as_raw_fd(), &cfg).map(Some))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| fail(format!("device {id}: NVMe passthrough on {}: {e}", cfg.backing.display())))?,
        _ => Vec::new(),
    };
    let shared = Arc::new(Shared {
        layout: layout.clone(),
        learned: AtomicBool::new(learned),
        cfg: cfg.clone(),
        watch: Mutex::new(None),
        engines: Mutex::new(engines),
        queue_failed: Mutex::new(None),
        queues: (0..cfg.queues).map(|_| Arc::default()).collect(),
        state_file: Mutex::new(()),
        state_file_owed: AtomicBool::new(false),
    });
    // The state thread: loads fdpblk's own state into the slot table before any I/O is served.
    let watcher = cfg.geometry.map(|g| {
        let slots = Arc::new(SlotTable::new(g.max_slots));
        let w = start_watcher(&cfg, g, state_dev.clone(), &slots, layout.policy(), learned, recover);
        layout.set(Known { geometry: g, slots });
        w
    });
    // A saved state that cannot be marked in use would be trusted after a crash although
    // LMCache's writes since made it stale: refuse to serve rather than risk deallocating
    // live slots in the next run.
    if let Some(e) = watcher.as_ref().and_then(|w| w.unclean_error()) {
        return Err(fail(format!(
            "device {id}: cannot write fdpblk's own state to the reserved tail of {} ({e}); check the drive (dmesg, `nvme error-log`) and {}",
            cfg.backing.display(),
            start_again(&cfg, recover)
        )));
    }
    // Learning: the device serves writes that no state thread follows until LMCache's first
    // checkpoint. A clean saved state from an earlier run would be trusted after a crash in
    // that time although those writes made it stale: mark it in use first, or refuse.
    if watcher.is_none() {
        let own = policy_by_name(&cfg.policy).map_or(0, |mut p| p.place(&Target::OwnState));
        match Persist::mark_in_use(&*state_dev, Region::tail(cfg.backing_bytes), own) {
            Ok(Some(_)) => tracing::info!("device {id}: the saved own state is marked in use until the layout is learned"),
            Ok(None) => {}
            Err(e) => {
                return Err(fail(format!(
                    "device {id}: cannot mark fdpblk's saved state in the reserved tail of {} in use ({e}); check the drive (dmesg, `nvme error-log`) and {}",
                    cfg.backing.display(),
                    start_again(&cfg, recover)
                )))
            }
        }
    }
    // Last before the threads and the char device: on some kernels (Linux 6.12) a recovery
    // started once cannot be started again until a daemon has served the device, so nothing
    // that can fail is left between (see `start_recovery` for a start that failed anyway).
    // (fdpblk's own state is marked in use by now: a start refused below only costs the
    // next run the deallocations it would have trusted.)
    let took_over = recover && start_recovery(&ctrl, id).map_err(fail)?;
    *shared.watch.lock().unwrap_or_else(|e| e.into_inner()) = watcher.as_ref().map(|w| w.published());
    let stop = Arc::new(AtomicBool::new(false));
    let watch_stop = Arc::new(AtomicBool::new(false));
    // False when the device failed to start: its queue threads may still serve.
    let clean_stop = Arc::new(AtomicBool::new(true));
    let state_thread = match watcher {
        Some(w) => {
            let (stop, clean, s) = (watch_stop.clone(), clean_stop.clone(), shared.clone());
            Some(spawn_named("fdpblk-state", move || state_thread_guarded(&s, || w.run(&stop, &clean))).map_err(|e| fail(format!("device {id}: {e}; then {}", start_again(&cfg, recover))))?)
        }
        None => {
            tracing::info!(
                "device {id}: no LMCache checkpoint yet: writes go unclassified to handle {outside} until LMCache's first checkpoint tells the layout"
            );
            let (stop, clean, s, g) = (watch_stop.clone(), clean_stop.clone(), shared.clone(), shared.clone());
            Some(spawn_named("fdpblk-state", move || state_thread_guarded(&g, || learn_then_watch(&s, state_dev, &stop, &clean))).map_err(|e| fail(format!("device {id}: {e}; then {}", start_again(&cfg, recover))))?)
        }
    };
    let (q_shared, d_shared, d_stop) = (shared.clone(), shared.clone(), stop.clone());
    let stats_thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::new(Mutex::new(None));
    let st = stats_thread.clone();
    let fd = backing.as_raw_fd();
    let notify2 = notify.clone();
    let res = ctrl.run_target(
        |dev: &mut UblkDev| {
            set_params(dev, &cfg, fd);
            Ok(())
        },
        move |qid, dev: &UblkDev| queue_main(qid, dev, &q_shared),
        move |_ctrl: &UblkCtrl| {
            let c = &d_shared.cfg;
            // A name another device took meanwhile (`name_taken`) is checked before the state
            // file is written, so that udev's rule (`fdpblk name N` reads it) never names this
            // device after it; under the add lock until the link is made.
            let name_lock = c.name.as_ref().map(|_| add_lock());
            let taken = match (c.name.as_deref(), &name_lock) {
                (Some(name), Some(Ok(_))) => name_taken(name, c.id),
                (_, Some(Err(e))) => Some(e.clone()),
                _ => None,
            };
            // No added device runs without its state file: stopped at once, the add fails. A
            // recovered one keeps serving the I/O the driver held (its old file stays, naming
            // the daemon that died, until the stats thread writes it).
            let saved = match (&taken, recover) {
                (Some(e), false) => Err(e.clone()),
                _ => d_shared.write_state_file(),
            };
            let saved = match saved {
                Err(e) if recover => {
                    tracing::error!("device {}: {e}; trying again at each stats round (about every half second)", c.id);
                    Ok(())
                }
                r => r,
            };
            // The name is LMCache's device_path: an added device without it fails, as
            // without its state file (`ready` would start LMCache on a missing path).
            let linked = match (c.name.as_ref().filter(|_| saved.is_ok()), taken) {
                (Some(_), Some(e)) => Err(e),
                (Some(name), None) => state::link_name(name, c.id)
                    .map_err(|e| format!("cannot link {} to it: {e}; remove what is there", state::name_path(name).display())),
                (None, _) => Ok(()),
            };
            drop(name_lock);
            // Not under the add lock: it asks the drive (admin commands a resetting drive may
            // hold up), and stopping daemons wait for that lock.
            state::record_fdp_baseline(c);
            let saved = match (saved, linked) {
                (Ok(()), Err(e)) if recover => {
                    tracing::error!("device {}: {e}", c.id);
                    Ok(())
                }
                (Ok(()), Err(e)) => Err(e),
                (saved, _) => saved,
            };
            // An added device without its state file stops: nothing to write later.
            if saved.is_err() {
                d_shared.state_file_owed.store(false, Ordering::SeqCst);
            }
            let s = d_shared.clone();
            // The device serves without it: only its figures (and a state file owed) wait.
            match spawn_named("fdpblk-stats", move || stats_loop(&s, &d_stop)) {
                Ok(t) => *st.lock().unwrap_or_else(|e| e.into_inner()) = Some(t),
                Err(e) => tracing::error!(
                    "device {}: {e}; it serves without stats (`fdpblk stats`, the metrics){}",
                    c.id,
                    if d_shared.state_file_owed.load(Ordering::SeqCst) { ", and its state file, not written above, is not tried again (restart the daemon once there is room)" } else { "" }
                ),
            }
            // From here the signal thread stops the device itself; a stop signal that came
            // while it started is seen here (the thread sets the flag before it reads the id).
            DEVICE_ID.store(c.id, Ordering::SeqCst);
            let stopping = STOP_REQUESTED.load(Ordering::SeqCst);
            if let Err(e) = &saved {
                tracing::error!("device {}: {e}; stopping it", c.id);
            }
            if let Some(n) = notify2.lock().ok().and_then(|mut n| n.take()) {
                n(match &saved {
                    Err(e) => Err(format!("device {}: {e}; stopped", c.id)),
                    Ok(()) if stopping => Err(format!("device {}: a stop signal came while it started; stopped", c.id)),
                    Ok(()) => Ok(c.id),
                });
            }
            if stopping || saved.is_err() {
                tracing::info!("device {}: a stop signal came while it started: stopping it", c.id);
                let _ = _ctrl.kill_dev();
            }
        },
    );
    // The queues are done: the state thread takes the last checkpoint events, then writes
    // the state as clean. Not after a failed start: libublk returns without joining the
    // queue threads, and a recovery's may be serving re-issued writes that a clean state
    // saved now would miss (the next run would trust it).
    FINISHING.store(true, Ordering::SeqCst);
    clean_stop.store(res.is_ok(), Ordering::SeqCst);
    // Release (in SeqCst): a state thread that sees the stop (Acquire) sees `clean_stop` too.
    watch_stop.store(true, Ordering::SeqCst);
    if let Some(k) = shared.layout.known() {
        k.slots.wake();
    }
    if let Some(t) = state_thread {
        let _ = t.join();
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = stats_thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = t.join();
    }
    match res {
        Ok(_) => {
            drop(backing);
            drop(claim);
            drop(alive);
            // Deleted before its state files go (an added one would also go with `ctrl`, a
            // recovered one not at all), without waiting for users that still hold it open
            // (their I/O fails; the id stays taken until they close it).
            // A signal from here on must not stop a device that takes this id next.
            DEVICE_ID.store(-1, Ordering::SeqCst);
            finish_device(ctrl, &shared.cfg);
            Ok(())
        }
        Err(e) => {
            // libublk returns a failed start without joining the queue threads, and a
            // recovery's may already be re-sending held writes: the backing's locks go with
            // the process (which exits on this error), not before its threads are gone, so
            // an `add` retried at once cannot write the backing beside them.
            std::mem::forget(backing);
            std::mem::forget(claim);
            std::mem::forget(alive);
            // A stop signal during a recovery's start leaves a stopped device that nothing
            // else would delete (an added one goes with `ctrl`).
            if recover && STOP_REQUESTED.load(Ordering::SeqCst) {
                finish_device(ctrl, &shared.cfg);
            }
            let why = shared.queue_failed.lock().unwrap_or_else(|e| e.into_inner()).take();
            // A start taken over from a daemon that died after it mapped the driver's buffers
            // cannot be finished by another process on such a kernel: each retry ends here.
            // libublk reports any failure to open the char device (after 3 s of tries) as
            // EACCES.
            let no_open = matches!(e, UblkError::OtherError(n) if n == -libc::EACCES);
            let no_node = no_open && !Path::new(&format!("/dev/ublkc{id}")).exists();
            let again = if took_over && !no_node {
                format!(
                    " (this daemon took over the start of an earlier recovery that failed; if the next `fdpblk recover -n {id}` fails the same way, \
                     the kernel cannot finish that recovery: `fdpblk del -n {id}` fails the I/O it holds, the data on the backing stays, and add the device again)"
                )
            } else {
                String::new()
            };
            let what = match why {
                Some(q) => format!("device {id}: {q}"),
                None if no_node => format!(
                    "device {id}: the daemon could not open /dev/ublkc{id}: there is no such node (the kernel's devtmpfs, or udev, makes it: is /dev a devtmpfs here?); once it is there, {}",
                    start_again(&shared.cfg, recover)
                ),
                // By now the descriptors it lacked may be free again.
                None if no_open => format!(
                    "device {id}: the daemon could not open /dev/ublkc{id} (libublk says EACCES whatever the cause; \
                     the usual one is running out of file descriptors): raise the open-files limit (ulimit -n; LimitNOFILE= in a systemd unit)"
                ),
                None => format!("device {id}: {}", ublk_error(&e)),
            };
            Err(fail(what + &again))
        }
    }
}

/// Tells the driver a new daemon is taking over the held device (START_USER_RECOVERY). The
/// driver waits for the dead daemon to let go of `/dev/ublkcN` (libublk asks again for 30 s).
/// A driver that refuses a second start of one recovery (Linux 6.12: EINVAL while no queue
/// was served since the first) leaves a device whose earlier recovery failed before serving
/// held for good: with the device still quiesced, that start stands, and this daemon serves
/// the queues it readied.
fn start_recovery(ctrl: &UblkCtrl, id: i32) -> Result<bool, String> {
    let quiesced = || ctrl.read_dev_info().is_ok() && ctrl.dev_info().state == sys::UBLK_S_DEV_QUIESCED as u16;
    recovery_started(id, ctrl.start_user_recover(), quiesced)
}

/// What [`start_recovery`] makes of the driver's answer `res` (`quiesced`: whether the device
/// is still held for a recovery, asked only after a refusal): whether an earlier start is
/// taken over.
fn recovery_started(id: i32, res: Result<i32, UblkError>, quiesced: impl FnOnce() -> bool) -> Result<bool, String> {
    match res {
        Ok(r) if r >= 0 => Ok(false),
        // libublk answers EBUSY as a value once its 30 s of tries are up.
        Ok(_) => Err(format!(
            "device {id}: the driver did not let its recovery start within 30 s: /dev/ublkc{id} is still open (its dead daemon still exiting, \
             or another process: `fuser -v /dev/ublkc{id}`), or the device is no longer held for a recovery (`fdpblk list`); \
             once it is free, `fdpblk recover -n {id}` again"
        )),
        Err(e) if errno_of(&e) == libc::EINVAL && quiesced() => {
            tracing::warn!(
                "device {id}: the driver refuses to start its recovery again (a recovery before this one started it and failed before serving, \
                 and this kernel takes one start until a daemon serves); this daemon takes over that start"
            );
            Ok(true)
        }
        Err(e) => Err(format!("starting recovery of device {id}: {}", ublk_error(&e))),
    }
}

/// The driver's queues, depth and buffer size, which a daemon of its device must serve with:
/// it gives at most one queue per CPU and rounds the buffer down to whole pages, whatever
/// was asked. `cfg` takes them, so the state file says what runs.
pub fn take_drivers_queues(cfg: &mut DeviceConfig, info: &sys::ublksrv_ctrl_dev_info) {
    let (q, d, b) = (info.nr_hw_queues, info.queue_depth, info.max_io_buf_bytes);
    if q == 0 || d == 0 || b == 0 || (q, d, b) == (cfg.queues, cfg.depth, cfg.io_buf_bytes) {
        return;
    }
    tracing::info!(
        "device {}: the driver serves it with {q} queue(s) of depth {d} and {b}-byte buffers ({} of depth {} and {}-byte buffers asked; it gives at most one queue per CPU)",
        cfg.id,
        cfg.queues,
        cfg.depth,
        cfg.io_buf_bytes
    );
    (cfg.queues, cfg.depth, cfg.io_buf_bytes) = (q, d, b);
}

/// Whether the device the driver holds for a recovery is the one `cfg` (its state file)
/// describes: its size and block size are the layout fdpblk classifies every request by, and a
/// file that does not describe them (another device's under the same id, an edited one) would
/// misplace writes and deallocate by the wrong slots.
pub fn drivers_device_matches(cfg: &DeviceConfig, basic: &sys::ublk_param_basic) -> Result<(), String> {
    let (bytes, shift) = (basic.dev_sectors << 9, basic.logical_bs_shift);
    if bytes == cfg.exported_bytes && shift == cfg.lba_shift {
        return Ok(());
    }
    let file = state::state_path(cfg.id);
    Err(format!(
        "device {}: the driver holds it as {bytes} bytes of {}-byte blocks, but its state file {} says {} bytes of {}-byte blocks: the file is not this device's. \
         If fdpblk served this device, delete it (`fdpblk del -n {}`: the I/O it holds fails, the data on the backing stays) and add it again; \
         if another ublk server's device took the id since, the file is stale: remove it (`rm {}`) and recover that device with its own server",
        cfg.id,
        1u64 << shift.min(63),
        file.display(),
        cfg.exported_bytes,
        1u64 << cfg.lba_shift.min(63),
        cfg.id,
        file.display()
    ))
}

/// What to do once the cause of a failed start is mended: add the device again, or for a
/// recovery (whose device the driver still holds; `add` refuses its name and backing) recover
/// it again.
fn start_again(cfg: &DeviceConfig, recover: bool) -> String {
    match (&cfg.name, recover) {
        (_, false) => "add again".into(),
        (Some(n), true) => format!("recover it again (`fdpblk up {n}`, or `fdpblk recover -n {}`)", cfg.id),
        (None, true) => format!("recover it again (`fdpblk recover -n {}`)", cfg.id),
    }
}

/// The state thread's device access for the engine.
fn open_state_dev(cfg: &DeviceConfig, backing: &std::fs::File, recover: bool) -> Result<Arc<dyn StateWriter>, String> {
    use super::config::EngineKind;
    let dev: std::io::Result<Arc<dyn StateWriter>> = match cfg.engine {
        EngineKind::Passthrough => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&cfg.backing)
            .and_then(|f| NvmeDev::new(f, 1u64 << cfg.lba_shift, cfg.backing_bytes, cfg.io_buf_bytes, cfg.pids.clone()))
            .map(|d| d.with_controller_of(&cfg.backing).with_limits(crate::engine::passthrough::CommandLimits::of(&cfg.backing)))
            .map(|d| Arc::new(d) as Arc<dyn StateWriter>),
        EngineKind::Streams => backing
            .try_clone()
            .and_then(|f| BlockDev::new(f, cfg.backing_bytes, Some(cfg.streams.clone())))
            .map(|d| Arc::new(d) as Arc<dyn StateWriter>),
        EngineKind::Plain => backing.try_clone().and_then(|f| BlockDev::new(f, cfg.backing_bytes, None)).map(|d| Arc::new(d) as Arc<dyn StateWriter>),
    };
    // Fatal: serving without a state thread would leave a clean state saved by an earlier run
    // unmarked, to be trusted after a crash although LMCache's writes since made it stale.
    dev.map_err(|e| {
        format!(
            "device {}: cannot open {} for fdpblk's state thread ({e}); free file descriptors or memory (`ulimit -n`, dmesg) and {}",
            cfg.id,
            cfg.backing.display(),
            start_again(cfg, recover)
        )
    })
}

/// Runs the state thread's body. Should it panic, the queues must not wait on it for ever:
/// the slots it was deallocating and the container it was zeroing are released (its I/O
/// calls are synchronous, so none is still in flight), and data I/O goes on without
/// deallocation or saved state.
fn state_thread_guarded(shared: &Shared, body: impl FnOnce()) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        let why = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
        let id = shared.cfg.id;
        let unit = shared.cfg.name.as_deref().map_or(String::new(), |n| {
            format!("under systemd `systemctl kill --kill-who=main --signal=SIGKILL fdpblk@{n}`, whose restart recovers it; ")
        });
        tracing::error!(
            "device {id}: the state thread failed ({why}); data I/O goes on, without deallocation, checkpoint awareness or saved state: kill the daemon with SIGKILL ({unit}by hand `kill -9` its pid, then `fdpblk recover -n {id}`) to bring them back without failing LMCache's I/O"
        );
        if let Some(k) = shared.layout.known() {
            k.slots.release_holds();
        }
    }
    // Nothing looks for the layout any more: a wait shown in stats would never end.
    shared.layout.half_written(None);
}

/// The learner's record of a checkpoint copy found half-written (which, since when, whether
/// said) after a look that found `seen` half-written (or none), and whether to say it now: a
/// copy half-written for long means LMCache crashed writing it, or stopped, and nothing is
/// learned until its next checkpoint. Said once; another copy, or none, starts afresh.
fn half_written_after(prev: Option<(u8, Instant, bool)>, seen: Option<u8>, now: Instant) -> (Option<(u8, Instant, bool)>, bool) {
    match (prev, seen) {
        (Some((c, since, said)), Some(s)) if c == s => {
            let say = !said && now.saturating_duration_since(since) >= HALF_WRITTEN_SAY_AFTER;
            (Some((c, since, said || say)), say)
        }
        (_, seen) => (seen.map(|c| (c, now, false)), false),
    }
}

/// The longest the learner waits, once the layout is set, for writes served before it to
/// complete: past a controller reset's hold (30 s).
const LEARNING_DRAIN_WAIT: Duration = Duration::from_secs(40);

/// The learner, then the state thread: looks for LMCache's first checkpoint every second until
/// it tells the layout, sets it (the queues switch to classifying pipelines), records it in
/// the device's state file, and runs the state thread.
fn learn_then_watch(shared: &Shared, dev: Arc<dyn StateWriter>, stop: &AtomicBool, clean: &AtomicBool) {
    let cfg = &shared.cfg;
    // Why LMCache's checkpoint was refused, last said.
    let mut last_refusal: Option<String> = None;
    // A copy seen half-written: which, since when, and whether that was said.
    let mut half_written: Option<(u8, Instant, bool)> = None;
    // The learning writes completed by the last look that found nothing, and when: until
    // another one completes the device is as it was, and a look would read the same (a torn
    // checkpoint read whole, up to its 64 MiB, every second while LMCache is idle). Looked at
    // again after 30 s all the same, in case a read failed.
    let mut looked_at: Option<(u64, Instant)> = None;
    let g: Geometry = loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let done = shared.layout.learning_done();
        if looked_at.is_some_and(|(d, at)| d == done && at.elapsed() < Duration::from_secs(30)) && last_refusal.is_none() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let look = learn::look_why(&ExportedReader { dev: &*dev, size: cfg.exported_bytes }, &cfg.layout_flags).and_then(|l| match l {
            learn::Looked::Layout(g) => layout_error(&g, 1u64 << cfg.lba_shift, &cfg.backing).map_or(Ok(l), Err),
            _ => Ok(l),
        });
        match look {
            Ok(learn::Looked::Layout(g)) => break g,
            Ok(l) => {
                looked_at = Some((done, Instant::now()));
                // What refused the layout is gone (LMCache's checkpoint was erased or replaced):
                // learning goes on, looking once a second again.
                if last_refusal.take().is_some() {
                    shared.layout.clear_refusal();
                }
                let copy = if let learn::Looked::HalfWritten(c) = l { Some(c) } else { None };
                let say;
                (half_written, say) = half_written_after(half_written, copy, Instant::now());
                if let (true, Some((c, since, _))) = (say, half_written) {
                    tracing::warn!("device {}: LMCache's checkpoint copy {c} has been half-written (its JSON fails its CRC) for {} s; the layout is learned once LMCache's next checkpoint is whole, and writes stay unclassified until then", cfg.id, since.elapsed().as_secs());
                }
                shared.layout.half_written(half_written.filter(|h| h.2).map(|(c, since, _)| (c, since)));
            }
            // Said again when the reason changes (stats show the latest).
            Err(e) => {
                half_written = None;
                shared.layout.half_written(None);
                if last_refusal.as_deref() != Some(e.as_str()) {
                    tracing::error!("device {}: LMCache's checkpoint cannot be used: {e}; writes stay unclassified, and fdpblk looks again every 30 s (LMCache's next checkpoints may clear this; else stop LMCache, `fdpblk del -n {}` and add the device again: `add` then names what to erase or which flags to give)", cfg.id, cfg.id);
                    shared.layout.refuse(e.clone());
                    last_refusal = Some(e);
                }
            }
        }
        // Once a second; after a refusal every 30 s (each look reads the whole checkpoint).
        for _ in 0..if last_refusal.is_some() { 300 } else { 10 } {
            if stop.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let mut learned = cfg.clone();
    learned.geometry = Some(g);
    let slots = Arc::new(SlotTable::new(g.max_slots));
    let mut w = start_watcher(&learned, g, dev, &slots, shared.layout.policy(), true, false);
    if let Some(e) = w.unclean_error() {
        // The device already serves: keep retrying (the state thread does, every second).
        tracing::error!(
            "device {}: cannot write fdpblk's own state to the reserved tail ({e}); retrying every second. Until 'own state written' follows, a daemon crash would leave an older saved state that the next run trusts: check the drive (dmesg, `nvme error-log`)",
            cfg.id
        );
    }
    *shared.watch.lock().unwrap_or_else(|e| e.into_inner()) = Some(w.published());
    shared.learned.store(true, Ordering::Relaxed);
    shared.layout.set(Known { geometry: g, slots });
    // A checkpoint written between the watcher's first read and the switch came with no
    // event: read both containers again once the writes planned before the switch are done.
    // A queue that saw no layout just before the switch counts its write within moments; the
    // wait then covers a write held longer (a controller reset holds commands up to 30 s).
    std::thread::sleep(Duration::from_millis(200));
    if !shared.layout.wait_learning_drained(LEARNING_DRAIN_WAIT, stop) && !stop.load(Ordering::Acquire) {
        tracing::warn!(
            "device {}: a write served before the layout was learned has not completed after {} s; the checkpoint containers are read now, and again when LMCache next writes them",
            cfg.id,
            LEARNING_DRAIN_WAIT.as_secs()
        );
    }
    w.reread_containers();
    let c = g.config();
    tracing::info!(
        "device {}: layout learned from LMCache's checkpoint: slot_bytes {} meta_total_bytes {} block_align {} header_bytes {} ({} writes went unclassified before it)",
        cfg.id,
        c.slot_bytes,
        c.meta_total_bytes,
        c.block_align,
        c.header_bytes,
        shared.layout.learning_writes.load(Ordering::Relaxed)
    );
    // `list` and `recover` see the layout from now on (else a recovery learns it again).
    if let Err(e) = shared.write_state_file() {
        tracing::warn!("{e}");
    }
    w.run(stop, clean);
}

/// The watcher (state loaded, both checkpoint containers read).
/// `learned`: the layout was learned while serving, so writes went by unseen. `recovered`:
/// the device's earlier daemon died while LMCache kept it open, and served writes after its
/// last persist (and LMCache's page cache may still hold pages written before them).
fn start_watcher(cfg: &DeviceConfig, g: Geometry, dev: Arc<dyn StateWriter>, slots: &Arc<SlotTable>, policy: &SharedPolicy, learned: bool, recovered: bool) -> Watcher {
    let own = policy_by_name(&cfg.policy).map_or(0, |mut p| p.place(&Target::OwnState));
    let passthrough = cfg.engine == super::config::EngineKind::Passthrough;
    let wc = watch_config(cfg, learned, recovered, !crate::engine::passthrough::CommandLimits::of(&cfg.backing).deallocates(passthrough));
    if let Some(why) = &wc.trim_off_because {
        tracing::warn!("device {}: {why}: deallocation is off", cfg.id);
    }
    let trim = wc.trim;
    let mut w = Watcher::new(g, slots.clone(), dev, wc, Some(Region::tail(cfg.backing_bytes)), own);
    // A policy with history (key-aware's loads) takes back what the restored slot table holds;
    // one that learns tenants from LMCache's checkpoints (lmcache-fdp) gets each one.
    let resumed = w.attach(policy.clone());
    let l = w.loaded();
    tracing::info!(
        "device {}: own state {} (seq {}, {}), deallocation {}{}",
        cfg.id,
        if l.found { "loaded" } else { "new" },
        l.seq,
        if l.clean { "clean" } else { "unclean: pending deallocations forgotten" },
        if trim { "on" } else { "off" },
        if policy.needs_state() { format!(", policy {} resumed from {resumed} slots", policy.name()) } else { String::new() }
    );
    w
}

/// How the state thread of device `cfg` runs. `learned`, `recovered`: as for
/// [`start_watcher`]; `no_dealloc`: the backing takes no deallocation
/// ([`CommandLimits::deallocates`](crate::engine::passthrough::CommandLimits::deallocates)).
fn watch_config(cfg: &DeviceConfig, learned: bool, recovered: bool, no_dealloc: bool) -> WatchConfig {
    let persist_interval = match cfg.persist_interval_ms {
        0 => Duration::MAX,
        ms => Duration::from_millis(ms),
    };
    // A backing that takes no deallocation would fail the first trim after every checkpoint.
    let off_because = (cfg.trim && no_dealloc).then(|| no_deallocation(&cfg.backing));
    let trim = cfg.trim && off_because.is_none();
    WatchConfig {
        trim,
        trim_tails: trim,
        early_tails: trim && cfg.early_tails,
        early_evictions: trim && cfg.early_evictions,
        device: cfg.id,
        persist_interval,
        page_cache: (cfg.id >= 0).then(|| state::bdev_path(cfg.id).into()),
        // A recovery follows writes the dead daemon served after its last persist (a key
        // deleted and put back into its slot among them). Its saved state says so (marked in
        // use), unless that mark was lost (a rotted or dropped superblock write): then an
        // older clean state would vouch for confirmations those writes undid.
        trust_saved_confirmations: !learned && !recovered,
        writes_unseen: learned || recovered,
        writeback: WritebackDelay::Kernel,
        buffered: BufferedWrites::PageCache,
        trim_off_because: off_because,
        ..WatchConfig::default()
    }
}

/// Why a backing that takes no deallocation (its kernel queue offers no discard, nor, for the
/// block-device engines, an unmapping Write Zeroes) gets none from fdpblk: `add` warns with it,
/// and the daemon turns deallocation off.
pub fn no_deallocation(backing: &Path) -> String {
    format!(
        "{} takes no deallocation (the kernel offers no discard for it: an NVMe drive without Dataset Management, a device without discard, or one the kernel turned it off for): fdpblk places writes but cannot free evicted slots, most of its gain",
        backing.display()
    )
}

/// How often the daemon looks for other programs writing its backing.
const FOREIGN_WRITERS_EVERY: Duration = Duration::from_secs(10);

fn stats_loop(shared: &Shared, stop: &AtomicBool) {
    let (pid, pid_start) = (std::process::id(), state::start_time(std::process::id()));
    let writers = ForeignWriters::start(&shared.cfg);
    while !stop.load(Ordering::Acquire) {
        let c = &shared.cfg;
        let learned = shared.learned.load(Ordering::Relaxed);
        let mut v = daemon_stats(pid, pid_start, c, &shared.layout, learned, &shared.stats(), &shared.queues);
        v["backing_writers"] = serde_json::json!(writers.now());
        let watch = shared.watch.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|w| w.lock().unwrap_or_else(|e| e.into_inner()).now());
        if let (Some(o), Some(serde_json::Value::Object(w))) = (v.as_object_mut(), watch) {
            o.extend(w);
        }
        let _ = state::write_atomic(&state::stats_path(c.id), v.to_string().as_bytes());
        if shared.state_file_owed.load(Ordering::SeqCst) && shared.write_state_file().is_ok() {
            tracing::info!("device {}: {} written at last", c.id, state::state_path(c.id).display());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    writers.stop();
}

/// Other programs holding the backing open for writing while the device runs (`add` refuses
/// one already there, but LMCache started afterwards with the drive as its `device_path` is
/// not seen then): their writes land over LMCache's slots through fdpblk and over fdpblk's
/// own state, and bypass placement and deallocation. Looked for on a thread of its own (a
/// walk of every process's descriptors takes long on a host with many), each logged once
/// while it holds it; the stats list them.
struct ForeignWriters {
    now: Arc<Mutex<Vec<String>>>,
    done: Arc<AtomicBool>,
}

impl ForeignWriters {
    fn start(c: &DeviceConfig) -> Self {
        let (now, done) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        let (n, d, c) = (now.clone(), done.clone(), c.clone());
        let looked = spawn_named("fdpblk-writers", move || {
            let mut warned = std::collections::HashSet::new();
            while !d.load(Ordering::Acquire) {
                let found = state::foreign_writers(&c.backing);
                for w in &found {
                    if !warned.contains(w) {
                        tracing::error!(
                            "device {}: {w} holds the backing {} open for writing: stop it; if it is LMCache, point its device_path at fdpblk's device ({}), never at the drive (its writes land over LMCache's slots and fdpblk's own state)",
                            c.id,
                            c.backing.display(),
                            c.name.as_ref().map_or_else(|| state::bdev_path(c.id), |n| format!("/dev/fdpblk/{n}"))
                        );
                    }
                }
                // Only those still there: one that comes back is logged again.
                warned = found.iter().cloned().collect();
                *n.lock().unwrap_or_else(|e| e.into_inner()) = found;
                let next = Instant::now() + FOREIGN_WRITERS_EVERY;
                while Instant::now() < next && !d.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        });
        if let Err(e) = looked {
            tracing::warn!("device {}: {e}: other programs writing the backing are not looked for", c.id);
        }
        ForeignWriters { now, done }
    }

    fn now(&self) -> Vec<String> {
        self.now.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Ends the thread after its walk in progress, if any (not waited for).
    fn stop(&self) {
        self.done.store(true, Ordering::Release);
    }
}

/// The daemon's own part of its stats file; the state thread's fields join it.
fn daemon_stats(pid: u32, pid_start: Option<u64>, c: &DeviceConfig, layout: &LayoutCell, learned: bool, pipeline: &PipelineStats, queues: &[Arc<QueueStats>]) -> serde_json::Value {
    serde_json::json!({
        "pid": pid, "pid_start": pid_start,
        "id": c.id, "name": c.name, "engine": c.engine.name(), "policy": c.policy,
        "geometry": layout.known().map(|k| k.geometry.to_json()),
        "layout": layout.to_json(learned),
        "pipeline": pipeline.to_json(),
        "queues": queues.iter().map(|q| q.to_json()).collect::<Vec<_>>(),
    })
}

/// A stop signal came: the device is stopped as soon as it has started, if it had not yet.
static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);
/// The queues are done: the daemon saves its state, deletes its device and exits.
static FINISHING: AtomicBool = AtomicBool::new(false);
/// The device the signal thread stops: -1 until it has started (or been taken over).
static DEVICE_ID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

fn stop_signals() -> libc::sigset_t {
    // SAFETY: plain sigset manipulation on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// SIGTERM, SIGINT and SIGHUP are taken by one thread (all threads inherit the mask set
/// here): the first two stop the device cleanly (queues drain, the device is deleted, state
/// files removed); SIGHUP (a closed terminal) is ignored, so a foreground daemon outlives
/// the session that started it.
fn block_signals() {
    let set = stop_signals();
    // SAFETY: blocks the signals in this thread, and so in every thread spawned after.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Starts a thread named `name`: one that cannot be had (a unit's TasksMax, `ulimit -u`, no
/// memory for its stack) is an error naming the fix, not a panic.
fn spawn_named<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<std::thread::JoinHandle<T>, String> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| format!("cannot start the daemon's {name} thread ({e}): raise the service's TasksMax or `ulimit -u`, or free memory"))
}

fn spawn_signal_thread() -> Result<(), String> {
    spawn_named("fdpblk-signals", move || loop {
        let set = stop_signals();
        let mut sig = 0;
        // SAFETY: waits on the signals blocked by `block_signals`.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            continue;
        }
        if sig == libc::SIGHUP {
            tracing::info!("SIGHUP ignored: stop the device with SIGTERM or `fdpblk del`");
            continue;
        }
        // The flag first, then the id: either the start sees the flag or this sees the id.
        STOP_REQUESTED.store(true, Ordering::SeqCst);
        if FINISHING.load(Ordering::SeqCst) {
            tracing::info!("signal {sig}: the device is stopped already; saving the state, then exiting");
            continue;
        }
        let id = DEVICE_ID.load(Ordering::SeqCst);
        if id < 0 {
            // Not started yet: the start stops it (a held device is not stopped under the
            // recovery about to take it; an add still opening its backing makes nothing).
            tracing::info!("signal {sig}: the device is stopped as soon as it has started");
            continue;
        }
        tracing::info!("signal {sig}: stopping device {id}");
        // Tried twice: the control handle needs descriptors, which a daemon at its limit
        // may free a moment later.
        let stop = || ublk_ctrl(id).and_then(|c| c.kill_dev());
        if let Err(e) = stop().or_else(|_| {
            std::thread::sleep(Duration::from_millis(200));
            stop()
        }) {
            tracing::error!("signal {sig}: cannot stop device {id}: {}; stop it with `fdpblk del -n {id}`", ublk_error(&e));
        }
    })
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy half-written for 2 min is said once; another copy, none, or the copy made whole
    /// starts afresh, so a copy 1 that follows a copy 0 waits its own 2 min.
    #[test]
    fn a_half_written_copy_is_said_once_after_two_minutes_of_the_same_copy() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let (h, say) = half_written_after(None, Some(0), at(0));
        assert_eq!((h, say), (Some((0, at(0), false)), false));
        let (h, say) = half_written_after(h, Some(0), at(119));
        assert_eq!((h, say), (Some((0, at(0), false)), false), "not yet");
        let (h, say) = half_written_after(h, Some(0), at(120));
        assert_eq!((h, say), (Some((0, at(0), true)), true), "said at 2 min");
        let (h, say) = half_written_after(h, Some(0), at(500));
        assert_eq!((h, say), (Some((0, at(0), true)), false), "and only once");
        // LMCache moved on to the other copy, which is half-written now: its own 2 min.
        let (h, say) = half_written_after(h, Some(1), at(501));
        assert_eq!((h, say), (Some((1, at(501), false)), false));
        assert_eq!(half_written_after(h, Some(1), at(620)), (Some((1, at(501), false)), false));
        // A look that finds the copy whole (or nothing) ends it.
        assert_eq!(half_written_after(h, None, at(700)), (None, false));
    }

    #[test]
    fn a_block_align_below_the_drives_block_is_refused_with_the_fix() {
        let g = crate::layout::GeometryConfig { block_align: 512, header_bytes: 4096, slot_bytes: 1 << 20, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate(64 << 20)
            .unwrap();
        let e = block_align_error(&g, 4096, Path::new("/dev/ng0n1")).unwrap();
        assert!(e.contains("block_align 512") && e.contains("to 4096 or a multiple"), "{e}");
        assert!(block_align_error(&g, 512, Path::new("/dev/ng0n1")).is_none());
    }

    #[test]
    fn a_layout_whose_slot_table_takes_half_the_memory_is_refused_with_the_fix() {
        let gib = 1u64 << 30;
        let layout = |slot_bytes: u64, device: u64| {
            crate::layout::GeometryConfig { block_align: 512, header_bytes: 512, slot_bytes, meta_total_bytes: 1 << 20, capacity_bytes: 0 }.validate(device).unwrap()
        };
        // 32 MiB slots on 64 TiB: 2 M slots, 74 MiB of table.
        assert_eq!(slot_memory_error(&layout(32 << 20, 64 << 40), 8 * gib), None);
        // 1 KiB slots on 256 GiB: 2^28 slots, 9.3 GiB of table.
        let e = slot_memory_error(&layout(1024, (256 << 30) + (1 << 20)), 16 * gib).unwrap();
        assert!(e.contains("268435456 slots of 1024 bytes") && e.contains("9.3 GiB") && e.contains("16.0 GiB") && e.contains("larger slots"), "{e}");
        assert!(slot_memory_error(&layout(1024, (256 << 30) + (1 << 20)), 32 * gib).is_none(), "9.3 of 32 GiB fits");
        // The check `add` and the learner make includes it.
        let big = layout(1024, (256 << 30) + (1 << 20));
        let small_machine = crate::device::mem_total_bytes().is_some_and(|m| SlotTable::heap_bytes_for(big.max_slots) > m / 2);
        assert_eq!(layout_error(&big, 512, Path::new("/dev/ng0n1")).is_some(), small_machine);
    }

    #[test]
    fn a_backing_stays_locked_while_anything_holds_the_earlier_daemons_file() {
        let path = std::env::temp_dir().join(format!("fdpblk-lock-{}", std::process::id()));
        std::fs::write(&path, b"").unwrap();
        let open = || std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let earlier = open();
        lock_backing(&earlier, &path, Instant::now(), None).unwrap();
        // What an NVMe command in flight keeps: a reference to the same open file.
        let in_flight = earlier.try_clone().unwrap();
        drop(earlier);
        let new = open();
        let e = lock_backing(&new, &path, Instant::now() + Duration::from_millis(300), None).unwrap_err();
        assert!(e.contains("still in flight") && e.contains("try again"), "{e}");
        drop(in_flight);
        lock_backing(&new, &path, Instant::now(), None).unwrap();
        let _ = std::fs::remove_file(&path);
    }

    /// The daemon's stats fields (beside the state thread's, which a test in `watch` checks)
    /// are each named in README's `stats --json` paragraph, nested ones included.
    #[test]
    fn readme_lists_the_daemons_stats_fields() {
        let cell = LayoutCell::new(SharedPolicy::new(Box::new(crate::place::NonePolicy)), 0);
        let v = daemon_stats(1, Some(2), &file_backing(Path::new("/nonexistent")), &cell, false, &PipelineStats::default(), &[Arc::default()]);
        let (fdp, _) = state::deltas_since(&serde_json::json!({"endgid": 1, "hbmw": "0", "mbmw": "0", "mbe": "0"}), 1, &Default::default()).expect("same group");
        let mut missing = crate::test_fixtures::stats_fields_missing_from_readme(&serde_json::json!({"fdp": fdp}));
        missing.extend(crate::test_fixtures::stats_fields_missing_from_readme(&v));
        // The pipeline's classes and ops by name (its `handles` are keyed by handle number).
        for part in ["classes", "ops"] {
            let names = serde_json::Value::Object(v["pipeline"][part].as_object().expect(part).keys().map(|k| (k.clone(), serde_json::Value::Null)).collect());
            missing.extend(crate::test_fixtures::stats_fields_missing_from_readme(&names).into_iter().map(|k| format!("pipeline.{part}.{k}")));
        }
        assert!(missing.is_empty(), "README's `stats --json` paragraph lacks {missing:?}");
    }

    /// A device config on the 4 KiB file `path` (the backing checks only).
    fn file_backing(path: &Path) -> DeviceConfig {
        DeviceConfig {
            id: 0,
            name: None,
            backing: path.to_path_buf(),
            engine: crate::frontend::config::EngineKind::Plain,
            policy: "none".into(),
            queues: 1,
            depth: 1,
            io_buf_bytes: 4096,
            lba_shift: 9,
            backing_bytes: 4096,
            backing_identity: None,
            exported_bytes: 0,
            geometry: None,
            layout_flags: Default::default(),
            streams: Vec::new(),
            pids: Vec::new(),
            header_wait_us: 0,
            trim: false,
            early_tails: false,
            early_evictions: false,
            persist_interval_ms: 0,
        }
    }

    #[test]
    fn a_recovery_serves_the_drivers_queues_and_only_the_layout_its_state_file_describes() {
        let saved = DeviceConfig { queues: 4, depth: 128, io_buf_bytes: 512 << 10, exported_bytes: 1 << 30, ..file_backing(Path::new("/dev/ng0n1")) };
        let basic = |bytes: u64, shift: u8| sys::ublk_param_basic { dev_sectors: bytes >> 9, logical_bs_shift: shift, ..Default::default() };
        drivers_device_matches(&saved, &basic(1 << 30, 9)).unwrap();
        for (b, says) in [(basic(2 << 30, 9), "2147483648 bytes of 512-byte blocks"), (basic(1 << 30, 12), "1073741824 bytes of 4096-byte blocks")] {
            let e = drivers_device_matches(&saved, &b).unwrap_err();
            assert!(e.contains(says) && e.contains("says 1073741824 bytes of 512-byte blocks") && e.contains("fdpblk del -n 0") && e.contains("rm /run/fdpblk/0.json"), "{e}");
        }
        // The driver gave 2 queues on a 2-CPU machine where 4 were asked: the daemon serves 2.
        let info = |q: u16, d: u16, b: u32| sys::ublksrv_ctrl_dev_info { nr_hw_queues: q, queue_depth: d, max_io_buf_bytes: b, ..Default::default() };
        let mut cfg = saved.clone();
        take_drivers_queues(&mut cfg, &info(2, 128, 512 << 10));
        assert_eq!((cfg.queues, cfg.depth, cfg.io_buf_bytes), (2, 128, 512 << 10));
        take_drivers_queues(&mut cfg, &info(8, 64, 256 << 10));
        assert_eq!((cfg.queues, cfg.depth, cfg.io_buf_bytes), (8, 64, 256 << 10));
        // No answer (zeroes) changes nothing.
        take_drivers_queues(&mut cfg, &info(0, 0, 0));
        assert_eq!((cfg.queues, cfg.depth, cfg.io_buf_bytes), (8, 64, 256 << 10));
    }

    #[test]
    fn a_backing_formatted_to_other_blocks_is_refused() {
        let cfg = DeviceConfig { lba_shift: 12, ..file_backing(Path::new("/dev/ng0n1")) };
        backing_blocks_unchanged(&cfg, None).unwrap();
        backing_blocks_unchanged(&cfg, Some((4096, 0))).unwrap();
        for (blocks, says) in [((512, 0), "512-byte blocks, not the 4096"), ((4096, 8), "4096-byte blocks with 8 bytes of metadata each")] {
            let e = backing_blocks_unchanged(&cfg, Some(blocks)).unwrap_err();
            assert!(e.contains(says) && e.contains("Nothing was written") && e.contains("fdpblk del -n"), "{e}");
        }
    }

    #[test]
    fn a_backing_smaller_than_when_added_is_refused() {
        let path = std::env::temp_dir().join(format!("fdpblk-size-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let cfg = DeviceConfig { backing_bytes: 8192, ..file_backing(&path) };
        let f = std::fs::File::open(&path).unwrap();
        assert_eq!(backing_now(&path, &f).unwrap().bytes, 8192);
        backing_size_unchanged(&cfg, 8192).unwrap();
        backing_size_unchanged(&cfg, 1 << 20).unwrap();
        // Truncated (or another, smaller device under the same name).
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4096).unwrap();
        let e = backing_size_unchanged(&cfg, backing_now(&path, &f).unwrap().bytes).unwrap_err();
        assert!(e.contains("4096 bytes now, smaller than the 8192") && e.contains("Nothing was written"), "{e}");
        let _ = std::fs::remove_file(&path);
    }

    /// Placement identifiers other than those saved at add refuse the recovery, naming both
    /// and the fix; a drive that cannot be asked keeps the saved ones.
    #[test]
    fn a_recovery_refuses_placement_identifiers_the_drive_no_longer_lists() {
        let cfg = DeviceConfig { id: 2, backing: "/dev/ng0n1".into(), engine: EngineKind::Passthrough, pids: vec![0, 1, 2], ..file_backing(Path::new("/x")) };
        placement_unchanged(&cfg, Ok(Ok(vec![0, 1, 2]))).unwrap();
        let e = placement_unchanged(&cfg, Ok(Ok(vec![0, 2, 1]))).unwrap_err();
        assert!(e.contains("now lists placement identifiers [0, 2, 1] for policy") && e.contains("not the placement identifiers [0, 1, 2]"), "{e}");
        assert!(e.contains("Nothing was written; `fdpblk del -n 2`") && !e.contains("  "), "{e}");
        // A drive that answers and places nothing now (FDP turned off): refused too.
        let e = placement_unchanged(&cfg, Ok(Err("FDP is not enabled".into()))).unwrap_err();
        assert!(e.contains("places no writes for policy") && e.contains("(FDP is not enabled)"), "{e}");
        placement_unchanged(&cfg, Err("log page read failed".into())).unwrap();
    }

    /// Fewer write streams than the device was added with refuse the recovery, naming both
    /// and the fix; a count that cannot be read keeps the saved streams.
    #[test]
    fn a_recovery_refuses_a_namespace_with_fewer_write_streams() {
        let cfg = DeviceConfig { id: 3, backing: "/dev/nvme0n1".into(), engine: EngineKind::Streams, streams: vec![1, 2, 3], ..file_backing(Path::new("/x")) };
        streams_unchanged(&cfg, Ok(3)).unwrap();
        streams_unchanged(&cfg, Ok(8)).unwrap();
        let e = streams_unchanged(&cfg, Ok(2)).unwrap_err();
        assert!(e.contains("/dev/nvme0n1 now has 2 write streams") && e.contains("fewer than the 3 policy"), "{e}");
        assert!(e.contains("Nothing was written; `fdpblk del -n 3`") && !e.contains("  "), "{e}");
        // A kernel without write streams (the attribute absent) reads as 0: not a namespace
        // made again, a kernel to change.
        let e = streams_unchanged(&cfg, Ok(0)).unwrap_err();
        assert!(e.contains("offers no write streams") && e.contains("Linux >= 6.16") && e.contains("recover -n 3") && !e.contains("made again"), "{e}");
        streams_unchanged(&cfg, Err("no sysfs directory".into())).unwrap();
        // Another engine saves no streams: nothing to check.
        streams_unchanged(&DeviceConfig { streams: vec![], ..cfg }, Ok(0)).unwrap();
        assert_eq!(max_write_streams(Path::new("/nonexistent-fdpblk")).map_err(|e| e.contains("/nonexistent-fdpblk")), Err(true));
    }

    #[test]
    fn another_namespace_under_the_saved_name_is_refused() {
        use crate::nvme::path::DevKind;
        let saved = r#"NVMe namespace model "M" serial "A1" nsid 1"#;
        let cfg = DeviceConfig { id: 4, backing: "/dev/ng0n1".into(), engine: EngineKind::Passthrough, ..file_backing(Path::new("/x")) };
        let nowhere = |_: &str, _: DevKind| -> Option<PathBuf> { None };
        backing_identity_unchanged(&cfg, saved, Ok(Some(saved.into())), |_, _| panic!("no search when it matches")).unwrap();
        // Another drive of the same model under the name: where the saved one went is named.
        let e = backing_identity_unchanged(&cfg, saved, Ok(Some(r#"NVMe namespace model "M" serial "B2" nsid 1"#.into())), |ns, k| {
            assert_eq!((ns, k), (r#"model "M" serial "A1" nsid 1"#, DevKind::Generic), "passthrough looks for a char device");
            Some("/dev/ng1n1".into())
        })
        .unwrap_err();
        assert!(
            e.contains(r#"is now the NVMe namespace model "M" serial "B2" nsid 1, not the NVMe namespace model "M" serial "A1" nsid 1 the device was added on"#),
            "{e}"
        );
        assert!(e.contains("Nothing was written") && e.contains("/dev/ng1n1 now: `fdpblk del -n 4`"), "{e}");
        let e = backing_identity_unchanged(&cfg, saved, Ok(None), nowhere).unwrap_err();
        assert!(e.contains("is neither an NVMe namespace, nor a block device sysfs names, nor a file now") && e.contains("no node names that namespace now"), "{e}");
        let streams = DeviceConfig { engine: EngineKind::Streams, ..cfg.clone() };
        let _ = backing_identity_unchanged(&streams, saved, Ok(None), |_, k| {
            assert_eq!(k, DevKind::Block, "streams looks for a block device");
            None
        });
        // Unanswered, it is not taken as the same drive.
        let e = backing_identity_unchanged(&cfg, saved, Err("identify failed".into()), nowhere).unwrap_err();
        assert!(e.contains("cannot tell whether") && e.contains("identify failed") && e.contains("recover -n 4"), "{e}");
    }

    #[test]
    fn a_recovery_started_before_is_taken_over_while_the_device_is_held() {
        let asked = std::cell::Cell::new(false);
        let ask = |held: bool| {
            let a = &asked;
            move || {
                a.set(true);
                held
            }
        };
        assert!(!recovery_started(1, Ok(0), ask(true)).unwrap());
        assert!(!asked.get(), "a start that succeeds asks nothing");
        // Refused as a second start (Linux 6.12) while the device is still held: taken over.
        assert!(recovery_started(1, Err(UblkError::UringIOError(-libc::EINVAL)), ask(true)).unwrap());
        assert!(asked.get());
        // Not held any more (deleted, or served by another daemon): the refusal stands.
        let e = recovery_started(1, Err(UblkError::UringIOError(-libc::EINVAL)), ask(false)).unwrap_err();
        assert!(e.starts_with("starting recovery of device 1: ") && e.contains("Invalid argument"), "{e}");
        let e = recovery_started(1, Err(UblkError::UringIOError(-libc::EPERM)), || panic!("only EINVAL asks")).unwrap_err();
        assert!(e.contains("run as root"), "{e}");
        // libublk's EBUSY after 30 s comes as a value: not a start.
        let e = recovery_started(2, Ok(-libc::EBUSY), || panic!("not asked")).unwrap_err();
        assert!(e.contains("did not let its recovery start within 30 s") && e.contains("fuser -v /dev/ublkc2") && e.contains("fdpblk recover -n 2"), "{e}");
    }

    #[test]
    fn another_disk_under_the_saved_name_is_refused() {
        // Sysfs directories as the kernel lays them out: a partition's is under its disk's.
        let root = std::env::temp_dir().join(format!("fdpblk-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mk = |rel: &str, attrs: &[(&str, &str)]| {
            let d = root.join(rel);
            for (a, v) in attrs {
                std::fs::create_dir_all(d.join(a).parent().unwrap()).unwrap();
                std::fs::write(d.join(a), format!("{v}\n")).unwrap();
            }
            d
        };
        let sda = mk("sda", &[("device/wwid", "naa.5000c500a1b2c3d4"), ("diskseq", "3")]);
        let sda2 = mk("sda/sda2", &[("partition", "2"), ("start", "4096")]);
        let dm = mk("dm-0", &[("dm/uuid", "LVM-abc"), ("diskseq", "9")]);
        let dm_unnamed = mk("dm-1", &[("dm/uuid", ""), ("diskseq", "10")]);
        let md = mk("md0", &[("md/uuid", "0a1b:2c3d"), ("diskseq", "11")]);
        let md_external = mk("md127", &[("md/uuid", "00000000:00000000:00000000:00000000"), ("diskseq", "12")]);
        let vda = mk("vda", &[("serial", "disk-7"), ("diskseq", "2")]);
        let nvme_p1 = mk("nvme0n1/nvme0n1p1", &[("partition", "1"), ("start", "2048")]);
        mk("nvme0n1", &[("wwid", "eui.0011223344556677"), ("diskseq", "1")]);
        let loop0 = mk("loop0", &[("diskseq", "17")]);
        let bare = mk("ram0", &[("size", "1")]);
        assert_eq!(block_identity(&sda).as_deref(), Some("block device wwid naa.5000c500a1b2c3d4"));
        assert_eq!(block_identity(&sda2).as_deref(), Some("block device wwid naa.5000c500a1b2c3d4 partition 2 from sector 4096"));
        assert_eq!(block_identity(&dm).as_deref(), Some("block device device-mapper uuid LVM-abc"));
        assert_eq!(block_identity(&dm_unnamed).as_deref(), Some("block device dm-1 disk sequence number 10"), "an empty uuid names nothing");
        assert_eq!(block_identity(&md).as_deref(), Some("block device md uuid 0a1b:2c3d"));
        assert_eq!(block_identity(&md_external).as_deref(), Some("block device md127 disk sequence number 12"), "a zero uuid names nothing");
        assert_eq!(block_identity(&vda).as_deref(), Some("block device serial disk-7"));
        assert_eq!(block_identity(&nvme_p1).as_deref(), Some("block device wwid eui.0011223344556677 partition 1 from sector 2048"));
        assert_eq!(block_identity(&loop0).as_deref(), Some("block device loop0 disk sequence number 17"));
        assert_eq!(block_identity(&bare), None, "a kernel without diskseq tells nothing");
        // The loop device set up again (on another file): a new sequence number, refused.
        let saved = block_identity(&loop0).unwrap();
        mk("loop0", &[("diskseq", "18")]);
        let cfg = DeviceConfig { id: 3, backing: "/dev/loop0".into(), ..file_backing(Path::new("/x")) };
        let nowhere = |_: &str, _: crate::nvme::path::DevKind| -> Option<PathBuf> { panic!("only NVMe namespaces are looked for") };
        backing_identity_unchanged(&cfg, &saved, Ok(Some(saved.clone())), nowhere).unwrap();
        let e = backing_identity_unchanged(&cfg, &saved, Ok(block_identity(&loop0)), nowhere).unwrap_err();
        assert!(e.contains("is now the block device loop0 disk sequence number 18, not the block device loop0 disk sequence number 17"), "{e}");
        assert!(e.contains("Nothing was written") && e.contains("give the device its disk back, or `fdpblk del -n 3`"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_file_made_again_under_the_saved_path_is_refused() {
        let path = std::env::temp_dir().join(format!("fdpblk-ident-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let saved = backing_identity(&path).unwrap().unwrap();
        assert!(saved.starts_with("file inode "), "{saved}");
        let cfg = DeviceConfig { id: 2, ..file_backing(&path) };
        let nowhere = |_: &str, _: crate::nvme::path::DevKind| -> Option<PathBuf> { panic!("a file is not looked for") };
        backing_identity_unchanged(&cfg, &saved, backing_identity(&path), nowhere).unwrap();
        // Deleted and made again, the same size: another file (kept open, the old inode
        // cannot be handed out again).
        let _old = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let e = backing_identity_unchanged(&cfg, &saved, backing_identity(&path), nowhere).unwrap_err();
        assert!(e.contains("is now the file inode") && e.contains("give the device its file back, or `fdpblk del -n 2`"), "{e}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_second_daemon_on_a_file_backing_is_refused() {
        let path = std::env::temp_dir().join(format!("fdpblk-file-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let cfg = file_backing(&path);
        let first = open_backing_once(&cfg, false, Instant::now()).map_err(|e| e.0).unwrap();
        let (e, claimed) = open_backing_once(&cfg, false, Instant::now()).err().expect("a second daemon on the same file");
        assert!(claimed && e.contains("another running fdpblk daemon"), "{e}");
        drop(first);
        assert!(open_backing_once(&cfg, false, Instant::now()).is_ok());
        let _ = std::fs::remove_file(&path);
    }

    /// `add` right after `del`: the earlier daemon lets go of the backing a moment later.
    #[test]
    fn add_waits_a_moment_for_a_backing_whose_holder_lets_go() {
        let path = std::env::temp_dir().join(format!("fdpblk-held-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let cfg = file_backing(&path);
        let earlier = hold_alive_lock(&path).unwrap();
        let lets_go = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(600));
            drop(earlier);
        });
        let got = open_backing(&cfg, false);
        lets_go.join().unwrap();
        assert!(got.is_ok(), "{:?}", got.err());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_running_daemon_is_told_apart_from_a_dead_one_still_draining() {
        let path = std::env::temp_dir().join(format!("fdpblk-alive-{}", std::process::id()));
        std::fs::write(&path, b"").unwrap();
        let open = || std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        // A running daemon: its liveness lock and its I/O file's lock, both held.
        let alive = hold_alive_lock(&path).unwrap();
        let io = open();
        lock_backing(&io, &path, Instant::now(), None).unwrap();
        let (e, claimed) = hold_alive_lock(&path).unwrap_err();
        assert!(claimed && e.contains("another running fdpblk daemon") && e.contains("fdpblk del"), "{e}");
        // It dies with a command in flight: the liveness lock goes at once, the I/O lock stays.
        let in_flight = io.try_clone().unwrap();
        drop((alive, io));
        let _new_alive = hold_alive_lock(&path).unwrap();
        let new = open();
        assert!(lock_backing(&new, &path, Instant::now(), None).unwrap_err().contains("still in flight"));
        drop(in_flight);
        lock_backing(&new, &path, Instant::now(), None).unwrap();
        let _ = std::fs::remove_file(&path);
    }

    /// The state thread's configuration: saved confirmations are trusted only on a start that
    /// neither learns the layout nor recovers a device whose daemon died; a backing that takes
    /// no discard turns every deallocation off and says why; `--no-trim` is off without a why.
    #[test]
    fn the_state_thread_trusts_saved_confirmations_only_on_a_plain_start() {
        let cfg = DeviceConfig { trim: true, early_tails: true, early_evictions: true, ..file_backing(Path::new("/dev/nvme0n1")) };
        let trust = |learned, recovered| watch_config(&cfg, learned, recovered, false).trust_saved_confirmations;
        assert!(trust(false, false));
        assert!(!trust(true, false) && !trust(false, true) && !trust(true, true));
        let on = watch_config(&cfg, false, false, false);
        assert!(on.trim && on.trim_tails && on.early_tails && on.early_evictions && on.trim_off_because.is_none());
        let off = watch_config(&cfg, false, false, true);
        assert!(!off.trim && !off.trim_tails && !off.early_tails && !off.early_evictions);
        assert!(off.trim_off_because.as_deref().is_some_and(|w| w.starts_with("/dev/nvme0n1 takes no deallocation")), "{:?}", off.trim_off_because);
        let asked_off = watch_config(&DeviceConfig { trim: false, ..cfg.clone() }, false, false, true);
        assert!(!asked_off.trim && asked_off.trim_off_because.is_none());
    }
}
