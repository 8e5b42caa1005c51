//! Run-time state under `/run/fdpblk/`: one `<id>.json` per device (its config and daemon pid,
//! what `list`, `stats` and `recover` read) and `<id>.stats.json`, refreshed every half second.
//! Stable names: `/dev/fdpblk/<name>` links to `/dev/ublkb<id>`, since LMCache discards its
//! checkpoint when `device_path` changes.

use super::config::DeviceConfig;
use serde_json::{json, Value};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub const RUN_DIR: &str = "/run/fdpblk";
pub const NAME_DIR: &str = "/dev/fdpblk";

pub fn state_path(id: i32) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{id}.json"))
}
pub fn stats_path(id: i32) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{id}.stats.json"))
}
pub fn bdev_path(id: i32) -> String {
    format!("/dev/ublkb{id}")
}
/// The id of ublk disk `name` (`ublkb3` -> 3).
pub fn ublk_disk_id(name: &str) -> Option<i32> {
    name.strip_prefix("ublkb").filter(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))?.parse().ok()
}
pub fn name_path(name: &str) -> PathBuf {
    Path::new(NAME_DIR).join(name)
}

/// Opens (creating) a lock file under [`RUN_DIR`] that only root can open: `flock` needs no
/// write access, so a lock file others can read lets any user hold fdpblk's lock (every `add`,
/// a stopping daemon, the log's rotation waiting on them). A file an earlier fdpblk made
/// 0644 is made 0600.
pub fn open_lock_file(path: &Path) -> io::Result<fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(path)?;
    f.set_permissions(fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Writes a file atomically (temp file + rename), so readers never see half of it. The temp
/// file is this writer's own: the daemon, `fdpblk stats` and the metrics exporter may write
/// the same file at once, and a shared one could be renamed while another writes it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}.{n}", std::process::id()));
    write_through(&PathBuf::from(tmp), path, bytes)
}

/// [`write_atomic`] through the temp file `tmp`.
fn write_through(tmp: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    // A new file, never one found there: in a directory others can write (a textfile
    // collector's), a name planted beforehand as a link would have root write through it.
    let create = || {
        use std::os::unix::fs::OpenOptionsExt;
        fs::OpenOptions::new().write(true).create_new(true).mode(0o644).custom_flags(libc::O_NOFOLLOW).open(tmp)
    };
    let file = create().or_else(|e| match e.kind() {
        io::ErrorKind::AlreadyExists => fs::remove_file(tmp).and_then(|()| create()),
        _ => Err(e),
    });
    let written = file.and_then(|mut f| io::Write::write_all(&mut f, bytes)).and_then(|()| fs::rename(tmp, path));
    if written.is_err() {
        let _ = fs::remove_file(tmp);
    }
    written
}

/// Removes the temp files [`write_atomic`] left beside `path` when a writer was killed
/// between its write and its rename: those of processes that no longer run.
pub fn remove_stale_temps(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else { return };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let prefix = format!("{name}.tmp.");
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let pid = e.file_name().to_str().and_then(|n| n.strip_prefix(prefix.as_str())?.split('.').next()?.parse::<i32>().ok());
        // SAFETY: signal 0 only asks whether the process exists.
        if pid.is_some_and(|p| p > 0 && unsafe { libc::kill(p, 0) } != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)) {
            let _ = fs::remove_file(e.path());
        }
    }
}

pub fn write_state(cfg: &DeviceConfig, pid: u32) -> io::Result<()> {
    let v = json!({"config": cfg.to_json(), "pid": pid, "pid_start": start_time(pid), "device": bdev_path(cfg.id),
                   "name_path": cfg.name.as_deref().map(name_path)});
    write_atomic(&state_path(cfg.id), v.to_string().as_bytes())
}

/// The daemon a state file names: its pid and when that process started, so that another
/// process that got the pid later is not taken for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Daemon {
    pub pid: u32,
    /// `/proc/PID/stat` start time (clock ticks after boot); `None` in older state files.
    pub start: Option<u64>,
}

impl Daemon {
    pub fn from_state(v: &Value) -> Self {
        Daemon { pid: v["pid"].as_u64().and_then(|p| u32::try_from(p).ok()).unwrap_or(0), start: v["pid_start"].as_u64() }
    }

    /// The daemon still runs: its pid is alive and is the same process.
    pub fn alive(&self) -> bool {
        pid_alive(self.pid) && self.start.is_none_or(|s| start_time(self.pid) == Some(s))
    }
}

impl Daemon {
    /// Whether the stats JSON `v` is this daemon's: each daemon writes its pid and start into
    /// its stats, and a new daemon recovering the device serves before it wrote its own, while
    /// the file still holds the dead one's last figures. Stats without a pid are taken as its.
    pub fn wrote_stats(&self, v: &Value) -> bool {
        match v["pid"].as_u64() {
            None => true,
            Some(p) => p == u64::from(self.pid) && (v["pid_start"].as_u64().is_none() || self.start.is_none() || v["pid_start"].as_u64() == self.start),
        }
    }

    /// Seconds since the daemon started (from its start time and `/proc/uptime`).
    pub fn running_s(&self) -> Option<f64> {
        let start = self.start.or_else(|| start_time(self.pid))? as f64;
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        let uptime: f64 = fs::read_to_string("/proc/uptime").ok()?.split_whitespace().next()?.parse().ok()?;
        (ticks > 0).then(|| (uptime - start / ticks as f64).max(0.0).round())
    }
}

impl std::fmt::Display for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.pid.fmt(f)
    }
}

/// The saved config and daemon of device `id`.
pub fn read_state(id: i32) -> Result<(DeviceConfig, Daemon), String> {
    let p = state_path(id);
    let text = fs::read_to_string(&p).map_err(|e| format!("no fdpblk device {id} ({}: {e}); see `fdpblk list`", p.display()))?;
    // Written by rename, so a damaged file is not a crash's doing; the device itself can
    // still be deleted.
    let fix = |e: String| format!("{} is corrupt: {e}; `fdpblk del -n {id}` deletes the device (I/O it holds fails), then `fdpblk add` (or `fdpblk up NAME`) starts it again", p.display());
    let v: Value = serde_json::from_str(&text).map_err(|e| fix(e.to_string()))?;
    let cfg = DeviceConfig::from_json(&v["config"]).map_err(fix)?;
    if cfg.id != id {
        return Err(fix(format!("it names device {}", cfg.id)));
    }
    Ok((cfg, Daemon::from_state(&v)))
}

/// The ids of the state files in the run directory. Only names fdpblk writes count
/// (`N.json`, N as `{id}` prints it): a stray `-1.json` or `03.json` is no device's.
pub fn state_ids() -> Vec<i32> {
    let mut ids: Vec<i32> = fs::read_dir(RUN_DIR).into_iter().flatten().flatten().filter_map(|e| state_id(e.file_name().to_str()?)).collect();
    ids.sort_unstable();
    ids
}

/// The device id a state file's name gives, if it is one fdpblk writes.
fn state_id(file: &str) -> Option<i32> {
    let stem = file.strip_suffix(".json")?;
    stem.parse::<i32>().ok().filter(|&id| id >= 0 && id.to_string() == stem)
}

/// The drive's FDP statistics when the device was added: `fdpblk stats` reports deltas.
pub fn fdp_baseline_path(id: i32) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{id}.fdp-baseline.json"))
}

/// Records the backing drive's FDP counters once per `add` (a `recover` keeps the first).
pub fn record_fdp_baseline(cfg: &DeviceConfig) {
    let p = fdp_baseline_path(cfg.id);
    if p.exists() {
        return;
    }
    // Not an FDP NVMe drive (a file, a plain SSD): nothing to compare against.
    if let Ok(info) = crate::nvme::FdpInfo::discover(&cfg.backing) {
        let v = json!({"endgid": info.endgid, "hbmw": info.stats.hbmw.to_string(),
                       "mbmw": info.stats.mbmw.to_string(), "mbe": info.stats.mbe.to_string()});
        let _ = write_atomic(&p, v.to_string().as_bytes());
    }
}

/// How long a command waits for a drive's FDP statistics (`stats`, each pass of the metrics).
pub const DRIVE_READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// HBMW, MBMW and MBE written since `add`, read from the drive now.
pub fn fdp_deltas(cfg: &DeviceConfig) -> Option<Value> {
    let text = fs::read_to_string(fdp_baseline_path(cfg.id)).ok()?;
    let base: Value = serde_json::from_str(&text).ok()?;
    let (endgid, stats) = crate::nvme::FdpInfo::stats_now(&cfg.backing).ok()?;
    let (deltas, rebased) = deltas_since(&base, endgid, &stats)?;
    if let Some(b) = rebased {
        let _ = write_atomic(&fdp_baseline_path(cfg.id), b.to_string().as_bytes());
    }
    Some(deltas)
}

/// [`fdp_deltas`] read by a child process (`fdpblk drive-deltas ID`, hidden, named
/// [`DRIVE_CHILD_NAME`]), waited for up to `deadline`: an NVMe command to a hung or resetting
/// drive holds its caller in the kernel, uninterruptibly, until the driver's timeout and reset
/// (a minute or more), and a thread of this process would hold up its exit as long. A child
/// past the deadline is killed (it dies when the kernel lets go of it, so it cannot rewrite
/// the baseline late), and so is one whose waiting thread is gone (this process exited
/// first: `stats`, `metrics --once`). `Err` names why there is no answer.
pub fn fdp_deltas_within(cfg: &DeviceConfig, deadline: std::time::Duration) -> Result<Option<Value>, String> {
    // No baseline: not an FDP drive, nothing to ask it.
    if !fdp_baseline_path(cfg.id).exists() {
        return Ok(None);
    }
    let mut child = std::process::Command::new("/proc/self/exe");
    child.args(["drive-deltas", &cfg.id.to_string()]);
    json_from_child(child, deadline).map_err(|e| match e {
        ChildError::NoAnswer => format!(
            "the drive behind {} did not answer for its FDP statistics within {} s; a hung or resetting controller? see `dmesg`",
            cfg.backing.display(),
            deadline.as_secs_f64()
        ),
        ChildError::Start(e) => format!("cannot read the FDP statistics of the drive behind {}: {e}", cfg.backing.display()),
    })
}

/// The name the `drive-deltas` child gives itself (not `fdpblk…`, which [`fdpblk_holding`]
/// would take for a daemon, nor the `exe` of `/proc/self/exe`).
pub const DRIVE_CHILD_NAME: &str = "fdp-counters";

/// Why [`json_from_child`] has no answer.
#[derive(Debug, PartialEq)]
enum ChildError {
    /// Nothing whole within the deadline.
    NoAnswer,
    /// The child, or the thread reading it, could not be started, or its pipe failed.
    Start(String),
}

/// Runs `cmd` and returns the JSON it prints (`None` for nothing, or not JSON). A child past
/// `deadline` is killed, and reaped by a thread of its own once the kernel lets it go (the
/// metrics exporter runs for months: a hung drive would otherwise leave a zombie a pass). A
/// child whose waiting thread ends first (the process exits) is killed by the kernel.
fn json_from_child(mut cmd: std::process::Command, deadline: std::time::Duration) -> Result<Option<Value>, ChildError> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    // SAFETY: prctl is async-signal-safe; the closure touches nothing of the parent's.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().map_err(|e| ChildError::Start(format!("cannot start a child process: {e}")))?;
    let kill = |mut child: std::process::Child| {
        let _ = child.kill();
        let _ = std::thread::Builder::new().name("fdpblk-reap".into()).spawn(move || child.wait());
    };
    let mut out = child.stdout.take().ok_or_else(|| ChildError::Start("no pipe from the child".into()))?;
    let (tx, rx) = std::sync::mpsc::channel();
    // A reader blocked on the pipe does not hold up this process's exit, as the child would.
    let reader = std::thread::Builder::new().name("fdpblk-child".into()).spawn(move || {
        let mut got = Vec::new();
        let _ = tx.send(out.read_to_end(&mut got).map(|_| got));
    });
    if let Err(e) = reader {
        kill(child);
        return Err(ChildError::Start(format!("cannot start a thread: {e}")));
    }
    match rx.recv_timeout(deadline) {
        Ok(Ok(got)) => {
            let _ = child.wait();
            Ok(serde_json::from_slice(&got).ok())
        }
        Ok(Err(e)) => {
            kill(child);
            Err(ChildError::Start(format!("reading the child's answer: {e}")))
        }
        Err(_) => {
            kill(child);
            Err(ChildError::NoAnswer)
        }
    }
}

/// The deltas of the drive's counters `now` over baseline `base`, and a new baseline when
/// the drive reset its statistics (counters below the baseline, e.g. after an FDP
/// reconfiguration): from then on they count from that reset rather than pin at 0. `None`
/// for another endurance group than at `add` (the namespace moved) or a broken baseline.
pub(crate) fn deltas_since(base: &Value, endgid: u16, now: &crate::nvme::fdp::FdpStats) -> Option<(Value, Option<Value>)> {
    if base["endgid"].as_u64() != Some(u64::from(endgid)) {
        return None;
    }
    let b = |k: &str| base[k].as_str().and_then(|s| s.parse::<u128>().ok());
    let (mut h0, mut m0, mut e0) = (b("hbmw")?, b("mbmw")?, b("mbe")?);
    let mut reset = base["reset_seen"] == true;
    let mut rebased = None;
    if now.hbmw < h0 || now.mbmw < m0 || now.mbe < e0 {
        (h0, m0, e0, reset) = (0, 0, 0, true);
        rebased = Some(json!({"endgid": endgid, "hbmw": "0", "mbmw": "0", "mbe": "0", "reset_seen": true}));
    }
    let (host, media, erased) = (now.hbmw - h0, now.mbmw - m0, now.mbe - e0);
    let clamp = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
    let ratio = (host > 0).then(|| media as f64 / host as f64);
    let v = json!({"host_bytes": clamp(host), "media_bytes": clamp(media), "erased_bytes": clamp(erased),
                   "media_host_ratio": ratio, "drive_stats_reset": reset});
    Some((v, rebased))
}

/// Removes the run-time files of device `id` (not its name link, which needs its config).
pub fn remove_state_files(id: i32) {
    for f in [state_path(id), stats_path(id), fdp_baseline_path(id)] {
        // Also what a writer killed between its write and its rename left.
        remove_stale_temps(&f);
        let _ = fs::remove_file(f);
    }
}

pub fn remove_state(cfg: &DeviceConfig) {
    remove_state_files(cfg.id);
    if let Some(n) = &cfg.name {
        let link = name_path(n);
        // Only remove the link if it still points at this device.
        if fs::read_link(&link).ok().as_deref() == Some(Path::new(&bdev_path(cfg.id))) {
            let _ = fs::remove_file(link);
        }
    }
}

/// Clears what an earlier device of id `id` left behind: its state files, and its name link
/// where it points at `/dev/ublkb{id}`. For a new device the driver has just given `id`, before
/// its block node appears: that earlier device is gone (its id was free), and udev's rule and
/// the link would otherwise name the new device after it, so two names would lead to one
/// device. (A daemon killed while its device was then deleted by another tool, or one that
/// died between its device's delete and its state file's removal, leaves these.)
pub fn clear_stale(id: i32) {
    if !state_path(id).exists() {
        return;
    }
    match read_state(id) {
        Ok((c, _)) => {
            let name = c.name.as_deref().map_or(String::new(), |n| format!(" (named {n})"));
            tracing::warn!("device {id}: removed the state file left by an earlier device {id}{name}, which no longer exists");
            remove_state(&c);
        }
        Err(e) => {
            tracing::warn!("device {id}: removed the unreadable state file left by an earlier device {id} ({e})");
            remove_state_files(id);
        }
    }
}

/// A device name is a file name under `/dev/fdpblk`, a word in the udev rule's `SYMLINK+=`
/// (which splits on white space) and a systemd instance name: 1 to 128 of `A-Z a-z 0-9 _ - .`,
/// not starting with '.' (the link temporaries' names do).
pub fn check_name(n: &str) -> Result<(), String> {
    let plain = n.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if n.is_empty() || n.len() > 128 || n.starts_with('.') || !plain {
        return Err(format!("{n:?} must be 1 to 128 of the characters A-Z a-z 0-9 _ - . and not start with '.'"));
    }
    Ok(())
}

/// A name for a new device: [`check_name`]'s rules, and not starting with '-', which the
/// command line (and so every systemd unit's `fdpblk up NAME`) would take for an option.
/// (State files of devices named so before still read.)
pub fn check_new_name(n: &str) -> Result<(), String> {
    check_name(n)?;
    if n.starts_with('-') {
        return Err(format!("{n:?} must not start with '-' (fdpblk up {n} would read it as an option)"));
    }
    Ok(())
}

/// Points `/dev/fdpblk/<name>` at the device, replacing a stale link.
pub fn link_name(name: &str, id: i32) -> io::Result<()> {
    fs::create_dir_all(NAME_DIR)?;
    let link = name_path(name);
    // A name cannot start with '.': no other device's link or temporary shares this one.
    let tmp = Path::new(NAME_DIR).join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(bdev_path(id), &tmp)?;
    fs::rename(&tmp, &link).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// When process `pid` started (`/proc/PID/stat` field 22, clock ticks after boot).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name start at field 3 (the state letter).
    stat.rsplit_once(')')?.1.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// What an open descriptor must be to be `path`: a device node by its number and kind, a
/// file by its inode (a process in another mount namespace, such as fdpblk's daemon, shows
/// its path from its own mount's root, so the link's text would not match).
#[derive(Clone, Copy)]
enum Node {
    Device { rdev: u64, block: bool },
    File { dev: u64, ino: u64 },
}

impl Node {
    fn of(path: &Path) -> Option<Node> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let m = fs::metadata(path).ok()?;
        let t = m.file_type();
        if t.is_block_device() || t.is_char_device() {
            Some(Node::Device { rdev: m.rdev(), block: t.is_block_device() })
        } else if t.is_file() {
            Some(Node::File { dev: m.dev(), ino: m.ino() })
        } else {
            None
        }
    }

    /// Whether the descriptor `/proc/PID/fd/N` is this node.
    fn is(&self, fd: &Path) -> bool {
        let Some(f) = cached_stat(fd) else { return false };
        let kind = f.stx_mode as libc::mode_t & libc::S_IFMT;
        match *self {
            Node::Device { rdev, block } => {
                libc::makedev(f.stx_rdev_major, f.stx_rdev_minor) == rdev && kind == if block { libc::S_IFBLK } else { libc::S_IFCHR }
            }
            Node::File { dev, ino } => kind == libc::S_IFREG && libc::makedev(f.stx_dev_major, f.stx_dev_minor) == dev && f.stx_ino == ino,
        }
    }
}

/// The type, device numbers and inode of `path` as the kernel has them cached
/// (`AT_STATX_DONT_SYNC`): another process's descriptor of a file on a hung network mount
/// would block a plain stat, and `del` with it.
fn cached_stat(path: &Path) -> Option<libc::statx> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a zeroed statx is a valid buffer for the call to fill.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let mask = libc::STATX_TYPE | libc::STATX_INO;
    // SAFETY: `c` is a NUL-terminated path and `st` a buffer of the right type, both live
    // for the call.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), libc::AT_STATX_DONT_SYNC, mask, &mut st) };
    if rc == 0 {
        return Some(st);
    }
    // statx refused (a seccomp filter): a plain stat, as before.
    if !matches!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) {
        return None;
    }
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).ok()?;
    st.stx_mode = m.mode() as u16;
    (st.stx_rdev_major, st.stx_rdev_minor) = (libc::major(m.rdev()), libc::minor(m.rdev()));
    (st.stx_dev_major, st.stx_dev_minor) = (libc::major(m.dev()), libc::minor(m.dev()));
    st.stx_ino = m.ino();
    Some(st)
}

/// The processes other than this one that hold `path` open, with their names, matched as
/// [`Node`] says (a path that is neither a device nor a file: by the link's text).
pub fn openers(path: &Path) -> Vec<(u32, String)> {
    match Node::of(path) {
        Some(n) => openers_of(|fd| n.is(fd)),
        None => openers_where(|t| t == path),
    }
}

/// A process other than this one holding some of the asked paths open for writing
/// (read-write or write-only, by `/proc/PID/fdinfo/N`'s flags).
pub struct Writer {
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub comm: String,
    /// Which of the asked paths it writes, in the order they were asked.
    pub on: Vec<PathBuf>,
}

/// The processes other than this one that hold any of `paths` open for writing, found in one
/// walk of every process's descriptors. A path that is neither a device nor a file, or is
/// not there, is not looked for.
pub fn writers(paths: &[&Path]) -> Vec<Writer> {
    let nodes: Vec<(&Path, Node)> = paths.iter().filter_map(|&p| Node::of(p).map(|n| (p, n))).collect();
    if nodes.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (pid, dir) in other_processes() {
        // Per asked node, whether this process writes it (two may be one node: a link and
        // its target, both marked by one descriptor).
        let mut writes = vec![false; nodes.len()];
        for fd in fd_paths(&dir) {
            let is: Vec<usize> = (0..nodes.len()).filter(|&i| !writes[i] && nodes[i].1.is(&fd)).collect();
            if !is.is_empty() && opened_for_writing(&fd) {
                is.into_iter().for_each(|i| writes[i] = true);
            }
        }
        if !writes.contains(&true) {
            continue;
        }
        let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default().trim().to_string();
        let on = nodes.iter().zip(&writes).filter(|(_, &w)| w).map(|((p, _), _)| p.to_path_buf()).collect();
        out.push(Writer { pid, comm, on });
    }
    out
}

/// Programs other than fdpblk holding an NVMe namespace open for writing through either of
/// its nodes, as "COMM (pid N) on NODE": LMCache pointed at the drive itself, fio, a
/// passthrough tool. None for a file or a path that is not there (a file's writers are not
/// looked for).
pub fn foreign_writers(backing: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = fs::metadata(backing) else { return Vec::new() };
    if !meta.file_type().is_block_device() && !meta.file_type().is_char_device() {
        return Vec::new();
    }
    let other = crate::nvme::path::namespace_other_node(backing);
    let nodes: Vec<&Path> = std::iter::once(backing).chain(other.as_deref()).collect();
    writers(&nodes)
        .into_iter()
        .filter(|w| !w.comm.starts_with("fdpblk"))
        .flat_map(|w| w.on.iter().map(|p| format!("{} (pid {}) on {}", w.comm, w.pid, p.display())).collect::<Vec<_>>())
        .collect()
}

/// Whether descriptor `/proc/PID/fd/N` was opened for writing; false where that cannot be read.
fn opened_for_writing(fd: &Path) -> bool {
    let (Some(dir), Some(n)) = (fd.parent().and_then(Path::parent), fd.file_name()) else { return false };
    let Ok(info) = fs::read_to_string(dir.join("fdinfo").join(n)) else { return false };
    fdinfo_writes(&info)
}

/// Whether an fdinfo text's `flags:` (octal) has write access.
fn fdinfo_writes(info: &str) -> bool {
    info.lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .and_then(|f| i32::from_str_radix(f.trim(), 8).ok())
        .is_some_and(|f| f & libc::O_ACCMODE != libc::O_RDONLY)
}

/// An fdpblk process other than this one that holds every one of `paths` open (a daemon
/// known by what it holds, not by a state file). Only fdpblk processes' descriptors are
/// looked at.
pub fn fdpblk_holding(paths: &[&Path]) -> Option<u32> {
    let nodes = paths.iter().map(|p| Node::of(p)).collect::<Option<Vec<_>>>()?;
    other_processes().find_map(|(pid, dir)| {
        if !fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.starts_with("fdpblk")) {
            return None;
        }
        let fds = fd_paths(&dir);
        nodes.iter().all(|n| fds.iter().any(|fd| n.is(fd))).then_some(pid)
    })
}

/// The processes other than this one with a descriptor whose link (`/proc/PID/fd/N`) passes
/// `is_it`. A deleted node's reads "PATH (deleted)"; seen from another mount namespace (the
/// daemon's own), a path outside it reads from its mount's root ("/ublkb0 (deleted)").
pub fn openers_where(is_it: impl Fn(&Path) -> bool) -> Vec<(u32, String)> {
    openers_of(|fd| fs::read_link(fd).is_ok_and(|t| is_it(&t)))
}

/// The processes other than this one with a descriptor (its `/proc/PID/fd/N`) that passes `is_it`.
fn openers_of(is_it: impl Fn(&Path) -> bool) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for (pid, dir) in other_processes() {
        if fd_paths(&dir).iter().any(|fd| is_it(fd)) {
            let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default();
            out.push((pid, comm.trim().to_string()));
        }
    }
    out
}

/// Every process but this one: its pid and `/proc/PID`.
fn other_processes() -> impl Iterator<Item = (u32, PathBuf)> {
    fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|p| {
        let pid = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()).filter(|&p| p != std::process::id())?;
        Some((pid, p.path()))
    })
}

/// The descriptors (`/proc/PID/fd/N`) of the process at `/proc/PID`. One whose main thread
/// exited (a daemon killed while its threads wait in NVMe commands) lists none there: its
/// other threads still hold them.
fn fd_paths(proc_dir: &Path) -> Vec<PathBuf> {
    let list = |dir: PathBuf| fs::read_dir(dir).map(|d| d.flatten().map(|fd| fd.path()).collect::<Vec<_>>()).unwrap_or_default();
    let fds = list(proc_dir.join("fd"));
    if !fds.is_empty() {
        return fds;
    }
    fs::read_dir(proc_dir.join("task")).into_iter().flatten().flatten().map(|t| list(t.path().join("fd"))).find(|f| !f.is_empty()).unwrap_or_default()
}

/// True if `pid` runs. A zombie (dead, not yet reaped) counts as dead, unless it is only the
/// main thread that exited: while other threads of the process still run (a daemon tearing
/// down after its main thread returned, or being killed), they still hold its files.
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match state_letter(&format!("/proc/{pid}/stat")) {
        Some('Z') => other_threads(pid),
        Some(c) => c != 'X',
        None => false,
    }
}

/// The state letter (`R`, `S`, `Z`, ...) of the process or thread whose stat file is `stat`
/// (`/proc/PID/stat`, `/proc/PID/task/TID/stat`); it follows the parenthesised command name.
pub fn state_letter(stat: &str) -> Option<char> {
    let text = fs::read_to_string(stat).ok()?;
    text.rsplit_once(')').and_then(|(_, r)| r.trim_start().chars().next())
}

/// Whether process `pid` has a thread other than its main one that has not exited.
fn other_threads(pid: u32) -> bool {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().any(|t| {
        t.file_name().to_str().and_then(|n| n.parse::<u32>().ok()).is_some_and(|tid| {
            tid != pid && state_letter(&format!("/proc/{pid}/task/{tid}/stat")).is_some_and(|c| c != 'Z' && c != 'X')
        })
    })
}

#[cfg(test)]
mod tests {
    /// A descriptor counts as a writer's by its open flags: read-write and write-only do, a
    /// reader's (blktrace's, a monitor's) does not.
    #[test]
    fn writers_are_told_by_their_open_flags() {
        use std::os::fd::AsRawFd;
        assert!(super::fdinfo_writes("pos:\t0\nflags:\t0100002\nmnt_id:\t25\n"));
        assert!(super::fdinfo_writes("flags:\t01\n"));
        assert!(!super::fdinfo_writes("pos:\t0\nflags:\t0104000\n"));
        assert!(!super::fdinfo_writes("pos:\t0\n"));
        let path = std::env::temp_dir().join(format!("fdpblk-writers-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let rw = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let ro = std::fs::File::open(&path).unwrap();
        let fd = |f: &std::fs::File| std::path::PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
        assert!(super::opened_for_writing(&fd(&rw)));
        assert!(!super::opened_for_writing(&fd(&ro)));
        // This process is not counted; another that writes is, with the paths it writes in
        // the asked order (it opened them the other way round), not the one it only reads.
        assert!(super::writers(&[&path]).is_empty());
        let (second, read) = (path.with_extension("second"), path.with_extension("read"));
        std::fs::write(&second, b"x").unwrap();
        std::fs::write(&read, b"x").unwrap();
        let script = "exec 3<>\"$1\" 4<>\"$0\" 5<\"$2\"; read -r _";
        let mut child = std::process::Command::new("sh").arg("-c").arg(script).args([&path, &second, &read]).stdin(std::process::Stdio::piped()).spawn().unwrap();
        let found = (0..1000).find_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            super::writers(&[&path, &read, &second]).into_iter().find(|w| w.pid == child.id() && w.on.len() == 2)
        });
        drop(child.stdin.take());
        child.wait().unwrap();
        for p in [&path, &second, &read] {
            std::fs::remove_file(p).unwrap();
        }
        let w = found.expect("a child holding two files read-write is a writer of both");
        assert_eq!(w.on, [path.clone(), second.clone()]);
        assert_eq!(w.comm, "sh");
    }

    /// Only names fdpblk writes are state files: a stray `-1.json` would reach the driver
    /// with a negative id (libublk asserts), and `03.json` would list device 3 twice.
    #[test]
    fn only_canonical_state_file_names_are_devices() {
        for (name, id) in [("0.json", Some(0)), ("17.json", Some(17)), ("-1.json", None), ("+3.json", None), ("03.json", None), ("3.stats.json", None), ("3.json.tmp", None), ("x.json", None)] {
            assert_eq!(super::state_id(name), id, "{name}");
        }
    }

    /// A killed writer's temp file goes; a running one's (this process's) stays.
    #[test]
    fn stale_temps_of_dead_writers_are_removed() {
        let dir = std::env::temp_dir().join(format!("fdpblk-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fdpblk.prom");
        let dead = dir.join("fdpblk.prom.tmp.999999999.3");
        let live = dir.join(format!("fdpblk.prom.tmp.{}.0", std::process::id()));
        let other = dir.join("other.prom.tmp.999999999.3");
        for f in [&dead, &live, &other] {
            std::fs::write(f, b"x").unwrap();
        }
        super::remove_stale_temps(&path);
        assert!(!dead.exists() && live.exists() && other.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Writers of one file at once (the daemon, `stats`, the metrics exporter) never leave a
    /// reader half of one write, nor their temp files behind.
    #[test]
    fn concurrent_atomic_writes_leave_whole_files() {
        let dir = std::env::temp_dir().join(format!("fdpblk-atomic-{}", std::process::id()));
        let path = dir.join("0.stats.json");
        let contents: Vec<Vec<u8>> = (0..4u8).map(|i| vec![b'a' + i; 64 << 10]).collect();
        std::thread::scope(|s| {
            for c in &contents {
                let path = &path;
                s.spawn(move || (0..200).for_each(|_| super::write_atomic(path, c).unwrap()));
            }
            s.spawn(|| {
                for _ in 0..2000 {
                    if let Ok(got) = std::fs::read(&path) {
                        assert!(contents.contains(&got), "a torn file of {} bytes", got.len());
                    }
                }
            });
        });
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("0.stats.json")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn drive_deltas_count_from_add_and_from_a_reset_of_the_drive_statistics() {
        use crate::nvme::fdp::FdpStats;
        let base = serde_json::json!({"endgid": 1, "hbmw": "1000", "mbmw": "1500", "mbe": "0"});
        let st = |h: u128, m: u128| FdpStats { hbmw: h, mbmw: m, mbe: 0 };
        let (v, rebased) = super::deltas_since(&base, 1, &st(3000, 4500)).unwrap();
        assert_eq!((v["host_bytes"].as_u64(), v["media_bytes"].as_u64(), v["media_host_ratio"].as_f64()), (Some(2000), Some(3000), Some(1.5)));
        assert!(rebased.is_none() && v["drive_stats_reset"] == false);
        assert!(super::deltas_since(&base, 2, &st(3000, 4500)).is_none(), "another endurance group");
        let (v, _) = super::deltas_since(&base, 1, &st(1000, 1500)).unwrap();
        assert!(v["media_host_ratio"].is_null(), "no ratio without host bytes");
        // The drive's statistics were reset: count from the reset, and keep counting from it.
        let (v, rebased) = super::deltas_since(&base, 1, &st(200, 300)).unwrap();
        assert_eq!((v["host_bytes"].as_u64(), v["drive_stats_reset"].as_bool()), (Some(200), Some(true)));
        let rebased = rebased.expect("a new baseline");
        let (v, again) = super::deltas_since(&rebased, 1, &st(5000, 6000)).unwrap();
        assert_eq!((v["host_bytes"].as_u64(), v["media_bytes"].as_u64(), v["drive_stats_reset"].as_bool()), (Some(5000), Some(6000), Some(true)));
        assert!(again.is_none());
    }

    use super::*;

    #[test]
    fn a_daemon_is_its_pid_and_start_time() {
        let me = std::process::id();
        let start = start_time(me).expect("own start time");
        assert!(Daemon { pid: me, start: Some(start) }.alive());
        assert!(Daemon { pid: me, start: None }.alive(), "older state files name only the pid");
        // The same pid with another start time: a process that got the pid later.
        assert!(!Daemon { pid: me, start: Some(start + 1) }.alive());
        assert!(!Daemon { pid: 0, start: None }.alive());
        let v = serde_json::json!({"pid": me, "pid_start": start});
        assert_eq!(Daemon::from_state(&v), Daemon { pid: me, start: Some(start) });
    }

    /// Held by the tests that make processes named like fdpblk's (this binary's forks are
    /// too): one test's child must not be taken for another's.
    static FDPBLK_NAMED: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A forked child whose main thread alone exits (SYS_exit, not exit_group), leaving a
    /// zombie leader, while a thread waits for a byte on a pipe. The child keeps only stdio,
    /// the pipe and `hold` (as descriptor 4): a fork copies every descriptor of this process,
    /// and other tests' files and locks must not outlive them in it. It is named `name`.
    /// Returns its pid, the pipe end that lets the thread go (a byte, or closing it), and
    /// whether the leader became a zombie within 30 s.
    fn child_with_a_zombie_leader(name: &std::ffi::CStr, hold: Option<i32>) -> (libc::pid_t, i32, bool) {
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        let [rd, wr] = fds;
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork");
        if child == 0 {
            // Nothing in the child may unwind into the test harness's copy.
            let spawned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                libc::prctl(libc::PR_SET_NAME, name.as_ptr());
                // Out of the way of 3 and 4 first, then there, then the rest closed.
                let r = libc::fcntl(rd, libc::F_DUPFD, 100);
                let h = hold.map(|h| libc::fcntl(h, libc::F_DUPFD, 100));
                libc::dup2(r, 3);
                if let Some(h) = h {
                    libc::dup2(h, 4);
                }
                libc::syscall(libc::SYS_close_range, if h.is_some() { 5u32 } else { 4u32 }, u32::MAX, 0u32);
                std::thread::spawn(move || {
                    let mut b = [0u8; 1];
                    libc::read(3, b.as_mut_ptr().cast(), 1);
                    libc::_exit(0);
                })
            }));
            if spawned.is_err() {
                unsafe { libc::_exit(2) };
            }
            unsafe { libc::syscall(libc::SYS_exit, 0) };
            unsafe { libc::_exit(3) };
        }
        unsafe { libc::close(rd) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while state_letter(&format!("/proc/{child}/stat")) != Some('Z') && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        (child, wr, state_letter(&format!("/proc/{child}/stat")) == Some('Z'))
    }

    #[test]
    fn a_process_whose_main_thread_exited_is_alive_while_another_thread_runs() {
        let _alone = FDPBLK_NAMED.lock().unwrap_or_else(|e| e.into_inner());
        let (child, wr, leader_gone) = child_with_a_zombie_leader(c"zombie-leader", None);
        let pid = child as u32;
        let alive_then = pid_alive(pid);
        // Let the thread go whatever was seen, so a failure leaves no process behind.
        assert_eq!(unsafe { libc::write(wr, [1u8].as_ptr().cast(), 1) }, 1);
        unsafe { libc::close(wr) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while other_threads(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Before reaping: every thread exited, the process is a zombie.
        let alive_after = pid_alive(pid);
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(leader_gone, "the child's main thread never exited");
        assert!(alive_then, "the main thread exited, another still runs");
        assert!(!alive_after, "every thread exited: dead, though not reaped");
    }

    #[test]
    fn an_fdpblk_process_whose_main_thread_exited_is_found_by_what_its_threads_hold() {
        let _alone = FDPBLK_NAMED.lock().unwrap_or_else(|e| e.into_inner());
        let file = std::env::temp_dir().join(format!("fdpblk-holding-zombie-{}", std::process::id()));
        fs::write(&file, b"x").unwrap();
        let held = fs::File::open(&file).unwrap();
        // Named like the daemon (its thread inherits the name), holding `file`.
        let (child, wr, leader_gone) = child_with_a_zombie_leader(c"fdpblk-exiting", Some(std::os::fd::AsRawFd::as_raw_fd(&held)));
        drop(held);
        let found = fdpblk_holding(&[&file]);
        assert_eq!(unsafe { libc::write(wr, [1u8].as_ptr().cast(), 1) }, 1);
        unsafe { libc::close(wr) };
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        let _ = fs::remove_file(&file);
        assert!(leader_gone, "the child's main thread never exited");
        assert_eq!(found, Some(child as u32), "its remaining thread holds the file");
    }

    /// Whether a child holding `target` as its stdin is found by `openers` of another path
    /// to it (a link: what another mount namespace's path amounts to), and by the link's text.
    fn found_through_another_path(tag: &str, target: &Path, stdin: std::process::Stdio) -> (bool, bool) {
        let dir = std::env::temp_dir().join(format!("fdpblk-openers-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let other_path = dir.join("elsewhere");
        std::os::unix::fs::symlink(target, &other_path).unwrap();
        let mut child = std::process::Command::new("sleep").arg("30").stdin(stdin).spawn().unwrap();
        let pid = child.id();
        let found = openers(&other_path).iter().any(|&(p, _)| p == pid);
        let by_link_text = openers_where(|t| t == other_path.as_path()).iter().any(|&(p, _)| p == pid);
        let _ = child.kill();
        let _ = child.wait();
        fs::remove_dir_all(&dir).unwrap();
        (found, by_link_text)
    }

    #[test]
    fn openers_of_a_file_are_found_by_its_inode_whatever_the_path() {
        let file = std::env::temp_dir().join(format!("fdpblk-openers-backing-{}.img", std::process::id()));
        fs::write(&file, b"x").unwrap();
        let held = fs::File::open(&file).unwrap();
        let (found, by_link_text) = found_through_another_path("file", &file, held.into());
        let _ = fs::remove_file(&file);
        assert!(found, "the child holds the file open");
        assert!(!by_link_text, "its descriptor's link names the file, not the other path");
    }

    #[test]
    fn openers_of_a_device_node_are_found_by_its_device_number_whatever_the_path() {
        let (found, by_link_text) = found_through_another_path("null", Path::new("/dev/null"), std::process::Stdio::null());
        assert!(found, "the child holds /dev/null open");
        assert!(!by_link_text, "its descriptor's link names /dev/null, not the other path");
    }

    #[test]
    fn an_fdpblk_process_is_found_by_everything_it_holds_and_no_other_is() {
        let dir = std::env::temp_dir().join(format!("fdpblk-holding-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.img"), dir.join("b.img"));
        fs::write(&a, b"a").unwrap();
        fs::write(&b, b"b").unwrap();
        let _alone = FDPBLK_NAMED.lock().unwrap_or_else(|e| e.into_inner());
        // A process named like fdpblk's daemon (its comm is the name it was executed by: a
        // link, since a copied executable another test's fork still holds open cannot run),
        // and another.
        let daemon = dir.join("fdpblk-sleep");
        std::os::unix::fs::symlink("/bin/sleep", &daemon).unwrap();
        // argv[0] "sleep": a multi-call binary (BusyBox, uutils) picks its tool by it.
        let spawn = |exe: &Path| {
            use std::os::unix::process::CommandExt;
            let held = fs::File::open(&a).unwrap();
            std::process::Command::new(exe).arg0("sleep").arg("30").stdin(held).stdout(std::process::Stdio::null()).spawn().unwrap()
        };
        let mut other = spawn(Path::new("/bin/sleep"));
        let before = fdpblk_holding(&[&a]);
        let mut ours = spawn(&daemon);
        // Its comm is set at exec: wait for it.
        for _ in 0..100 {
            if fs::read_to_string(format!("/proc/{}/comm", ours.id())).is_ok_and(|c| c.starts_with("fdpblk")) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let both = fdpblk_holding(&[&a, Path::new("/dev/null")]);
        let not_b = fdpblk_holding(&[&a, &b]);
        for c in [&mut other, &mut ours] {
            let _ = c.kill();
            let _ = c.wait();
        }
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(before, None, "a process not named fdpblk is not taken for a daemon");
        assert_eq!(both, Some(ours.id()), "it holds a.img and /dev/null");
        assert_eq!(not_b, None, "it does not hold b.img");
    }

    #[test]
    fn names_are_plain_words() {
        for good in ["kv0", "llama.8b", "A_b-9"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", ".kv0", "a b", "a/b", "a\tb", "ü"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        // A new device's name must not read as an option; an old state file's still reads.
        assert!(check_name("-kv0").is_ok());
        assert!(check_new_name("-kv0").is_err_and(|e| e.contains("must not start with '-'")));
        assert!(check_new_name("kv-0").is_ok() && check_new_name(".kv0").is_err());
    }

    /// A link planted at the temp file's name is not written through; a lock file is root's
    /// alone (0600, made so where an earlier fdpblk left it 0644) and never a link.
    #[test]
    fn files_written_as_root_are_never_written_through_links() {
        use std::os::unix::fs::PermissionsExt;
        let dir = crate::test_fixtures::scratch("links");
        let victim = dir.join("victim");
        fs::write(&victim, b"keep").unwrap();
        fs::set_permissions(&victim, fs::Permissions::from_mode(0o640)).unwrap();
        let (tmp, path) = (dir.join("m.prom.tmp.1.0"), dir.join("m.prom"));
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        super::write_through(&tmp, &path, b"metrics").unwrap();
        assert_eq!((fs::read(&victim).unwrap(), fs::read(&path).unwrap()), (b"keep".to_vec(), b"metrics".to_vec()));
        assert!(fs::symlink_metadata(&tmp).is_err(), "the link was replaced, then renamed");
        let lock = dir.join("x.lock");
        fs::write(&lock, b"").unwrap();
        fs::set_permissions(&lock, fs::Permissions::from_mode(0o644)).unwrap();
        super::open_lock_file(&lock).unwrap();
        assert_eq!(fs::metadata(&lock).unwrap().permissions().mode() & 0o777, 0o600);
        let link = dir.join("l.lock");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(super::open_lock_file(&link).is_err(), "a link is not followed");
        assert_eq!(fs::metadata(&victim).unwrap().permissions().mode() & 0o777, 0o640, "nor is its target's mode changed");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A drive's statistics are read in a child: its answer comes back; a child that does not
    /// answer in time (a hung drive) is not waited for.
    #[test]
    fn drive_reads_in_a_child_are_bounded_by_their_deadline() {
        use std::time::{Duration, Instant};
        let sh = |script: &str| {
            let mut c = std::process::Command::new("sh");
            c.args(["-c", script]);
            c
        };
        let long = Duration::from_secs(5);
        assert_eq!(json_from_child(sh(r#"echo '{"host_bytes":7}'"#), long), Ok(Some(json!({"host_bytes": 7}))));
        assert_eq!(json_from_child(sh("true"), long), Ok(None));
        assert!(matches!(json_from_child(std::process::Command::new("/nonexistent/fdpblk"), long), Err(ChildError::Start(e)) if e.contains("cannot start")));
        let t = Instant::now();
        let hung = json_from_child(sh("sleep 30; echo 1"), Duration::from_millis(100));
        assert_eq!(hung, Err(ChildError::NoAnswer));
        // Far below the child's 30 s, far above a loaded machine's start of it.
        assert!(t.elapsed() < Duration::from_secs(10), "waited {:?} for a child past its deadline", t.elapsed());
        // Killed: a child that would have written something later does not.
        let mark = std::env::temp_dir().join(format!("fdpblk-child-late-{}", std::process::id()));
        let _ = fs::remove_file(&mark);
        let late = json_from_child(sh(&format!("sleep 0.5; touch {}", mark.display())), Duration::from_millis(100));
        assert_eq!(late, Err(ChildError::NoAnswer));
        std::thread::sleep(Duration::from_millis(1000));
        assert!(!mark.exists(), "the child outlived its deadline");
        // And reaped once dead: a long-running caller (the metrics exporter) keeps no zombie.
        let pid_file = std::env::temp_dir().join(format!("fdpblk-child-pid-{}", std::process::id()));
        // (Its deadline leaves a loaded machine time to start the shell and write its pid.)
        let hung = json_from_child(sh(&format!("echo $$ >{}; exec sleep 30", pid_file.display())), Duration::from_secs(3));
        assert_eq!(hung, Err(ChildError::NoAnswer));
        let pid = fs::read_to_string(&pid_file).unwrap().trim().to_string();
        let _ = fs::remove_file(&pid_file);
        let gone = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(20));
            !Path::new(&format!("/proc/{pid}")).exists()
        });
        assert!(gone, "the killed child {pid} is left a zombie ({:?})", fs::read_to_string(format!("/proc/{pid}/stat")).ok());
    }
}
