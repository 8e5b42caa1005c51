//! The log of a daemon that `add` or `recover` started in the background (under systemd the
//! journal keeps it instead): `/run/fdpblk/daemon.log`, one file for every device's daemon.
//! `/run` is memory, so the file is kept near [`LOG_CAP`]: the daemon whose line finds it
//! past that renames it to `daemon.log.1` (the one before goes) and starts a new one, and
//! every other daemon moves to the new file at its next line.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Past this size the log is rotated (two files at most, so about twice this in all).
pub const LOG_CAP: u64 = 16 << 20;

/// Set once this process's stdout and stderr are the log file.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// When rotating last failed (seconds since the epoch; 0: it did not): tried again a minute
/// later, not at every line.
static FAILED_AT: AtomicU64 = AtomicU64::new(0);
/// One rotation at a time within the process; [`rotate_if_needed`] locks across processes.
static ROTATING: Mutex<()> = Mutex::new(());

pub fn path(run_dir: &Path) -> PathBuf {
    run_dir.join("daemon.log")
}

/// Points stdin at /dev/null and stdout and stderr at the log in `run_dir` (at /dev/null too
/// if it cannot be opened), and keeps them on it from then on.
pub fn redirect(run_dir: &Path) {
    let _ = std::fs::create_dir_all(run_dir);
    let log = open_log(&path(run_dir));
    // SAFETY: dup2 onto the standard descriptors of this (daemon) process.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
        }
        let out = log.as_ref().map_or(null, |f| f.as_raw_fd());
        if out >= 0 {
            libc::dup2(out, 1);
            libc::dup2(out, 2);
        }
        if null > 2 {
            libc::close(null);
        }
    }
    if log.is_ok() {
        ACTIVE.store(true, Ordering::Release);
        let _ = rotate_if_needed(&path(run_dir), &[1, 2], LOG_CAP);
    }
}

/// fdpblk's log: lines at `FDPBLK_LOG`'s level (default info) to `make_writer`. A line that
/// cannot be written (a daemon's log on a full /run) is dropped: tracing's default reports
/// that with `eprintln!`, which panics on the same full file and takes down the thread that
/// logged (a recovering daemon before it started, the state thread).
pub fn subscriber<W>(make_writer: W, ansi: bool) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FDPBLK_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(make_writer)
        .with_ansi(ansi)
        .log_internal_errors(false)
        .event_format(JournalPriority { inner: tracing_subscriber::fmt::format().with_ansi(ansi), on: journal_stderr })
        .finish()
}

/// Gives each line its syslog priority (`<3>` error, `<4>` warning, `<6>` information, `<7>`
/// debug) where `on` says the line goes to the journal: journald reads a line's priority only
/// from such a prefix, and takes every other line as information (`journalctl -p err` would
/// find none of fdpblk's errors).
struct JournalPriority<F> {
    inner: F,
    on: fn() -> bool,
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for JournalPriority<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        if (self.on)() {
            let p = match *event.metadata().level() {
                tracing::Level::ERROR => 3,
                tracing::Level::WARN => 4,
                tracing::Level::INFO => 6,
                _ => 7,
            };
            write!(writer, "<{p}>")?;
        }
        self.inner.format_event(ctx, writer, event)
    }
}

/// Whether standard error is the journal's stream (systemd's `JOURNAL_STREAM`, "DEV:INODE",
/// names it): a unit's daemon. Looked at per line: a daemon started by hand points its
/// standard error at its log file after its first lines.
fn journal_stderr() -> bool {
    static STREAM: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let Some((dev, ino)) = *STREAM.get_or_init(|| {
        let v = std::env::var("JOURNAL_STREAM").ok()?;
        let (d, i) = v.split_once(':')?;
        Some((d.parse().ok()?, i.parse().ok()?))
    }) else {
        return false;
    };
    // SAFETY: fstat of the standard error descriptor into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::fstat(2, &mut st) } == 0;
    ok && st.st_dev == dev && st.st_ino == ino
}

/// Called before each log line: rotates the log first where it has grown past [`LOG_CAP`] or
/// another daemon has rotated it. Nothing outside a daemon that [`redirect`] set up.
pub fn before_line(run_dir: &Path) {
    if !ACTIVE.load(Ordering::Acquire) {
        return;
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs().max(1));
    let failed = FAILED_AT.load(Ordering::Relaxed);
    if failed != 0 && now < failed.saturating_add(60) {
        return;
    }
    match rotate_if_needed(&path(run_dir), &[1, 2], LOG_CAP) {
        Ok(()) => FAILED_AT.store(0, Ordering::Relaxed),
        Err(e) => {
            // Said once a streak, into the log itself (a full /run, no descriptors left), and
            // not with `eprintln!`, which panics where the log cannot take the line either.
            if failed == 0 {
                use std::io::Write as _;
                let _ = writeln!(io::stderr(), "fdpblk: rotating {}: {e}; trying again once a minute", path(run_dir).display());
            }
            FAILED_AT.store(now, Ordering::Relaxed);
        }
    }
}

fn open_log(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// Rotates `path` when the file `fds` write to is past `cap`, and moves `fds` to the file now
/// at `path` when it is not theirs (another process rotated it, or it was removed).
pub fn rotate_if_needed(path: &Path, fds: &[RawFd], cap: u64) -> io::Result<()> {
    let Some(&fd) = fds.first() else { return Ok(()) };
    let ours = fd_id(fd)?;
    let current = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
    if current == Some((ours.0, ours.1)) && ours.2 < cap {
        return Ok(());
    }
    let _one = ROTATING.lock().unwrap_or_else(|e| e.into_inner());
    // Across processes: the check and the rename under one lock, so two daemons that find the
    // file full at once rotate it once.
    let lock = crate::frontend::state::open_lock_file(&path.with_extension("log.lock"))?;
    // SAFETY: flock on a descriptor owned by `lock`; released when it is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let meta = std::fs::metadata(path).ok();
    if let Some(m) = &meta {
        if (m.dev(), m.ino()) == (ours.0, ours.1) && m.len() >= cap {
            std::fs::rename(path, path.with_extension("log.1"))?;
        }
    }
    let fresh = open_log(path)?;
    for &to in fds {
        // SAFETY: dup2 of an open descriptor onto one this process writes its log to.
        if unsafe { libc::dup2(fresh.as_raw_fd(), to) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The device, inode and size of the file open on `fd`.
fn fd_id(fd: RawFd) -> io::Result<(u64, u64, u64)> {
    // SAFETY: an all-zero stat is a valid value for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat with a pointer to a live stat.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.st_dev, st.st_ino, st.st_size as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_fd(fd: RawFd, bytes: &[u8]) {
        // SAFETY: a plain write from a live buffer.
        assert_eq!(unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) }, bytes.len() as isize);
    }

    /// Lines for the journal carry their syslog priority; others (a terminal, the log file)
    /// do not.
    #[test]
    fn lines_for_the_journal_carry_their_priority() {
        #[derive(Clone, Default)]
        struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);
        impl io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        for on in [true, false] {
            let lines = Lines::default();
            let sink = lines.clone();
            let sub = tracing_subscriber::fmt()
                .with_env_filter("info")
                .with_writer(move || sink.clone())
                .with_ansi(false)
                .event_format(super::JournalPriority { inner: tracing_subscriber::fmt::format().with_ansi(false), on: if on { || true } else { || false } })
                .finish();
            let _g = tracing::subscriber::set_default(sub);
            tracing::error!("e");
            tracing::warn!("w");
            tracing::info!("i");
            let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
            let starts: Vec<&str> = text.lines().map(|l| l.get(..3).unwrap_or("")).collect();
            if on {
                assert_eq!(starts, ["<3>", "<4>", "<6>"], "{text}");
            } else {
                assert!(starts.len() == 3 && starts.iter().all(|s| !s.starts_with('<')), "{text}");
            }
        }
        // Not under systemd here (or not with this stderr): no prefix.
        if std::env::var_os("JOURNAL_STREAM").is_none() {
            assert!(!super::journal_stderr());
        }
    }

    /// A log that cannot take a line (stderr on a full device) loses the line, and the thread
    /// that logged goes on. Run in a child process of this test binary, whose stderr is
    /// /dev/full (every write fails with ENOSPC).
    #[test]
    fn a_full_log_drops_lines_without_a_panic() {
        if std::env::var_os("FDPBLK_TEST_FULL_STDERR").is_some() {
            let _g = tracing::subscriber::set_default(subscriber(io::stderr, false));
            tracing::warn!("a line the full log cannot take");
            tracing::error!("and another");
            println!("logged past a full log");
            return;
        }
        let Ok(full) = File::options().write(true).open("/dev/full") else {
            panic!("/dev/full is needed for this test");
        };
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "cmd::daemon_log::tests::a_full_log_drops_lines_without_a_panic", "--nocapture", "--test-threads=1"])
            .env("FDPBLK_TEST_FULL_STDERR", "1")
            .env("FDPBLK_LOG", "info")
            .stderr(full)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains("logged past a full log"), "{:?}\n{stdout}", out.status);
    }

    /// Two daemons share the log: the one that finds it full rotates it once, and the other
    /// follows to the new file at its next line; the old lines are in `.1`.
    #[test]
    fn a_full_log_is_rotated_once_and_every_writer_follows() {
        let dir = std::env::temp_dir().join(format!("fdpblk-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = path(&dir);
        let a = open_log(&log).unwrap();
        let b = open_log(&log).unwrap();
        rotate_if_needed(&log, &[a.as_raw_fd()], 100).unwrap();
        assert!(!log.with_extension("log.1").exists(), "not before the cap");
        write_fd(a.as_raw_fd(), &[b'a'; 100]);
        rotate_if_needed(&log, &[a.as_raw_fd()], 100).unwrap();
        write_fd(a.as_raw_fd(), b"A");
        rotate_if_needed(&log, &[b.as_raw_fd()], 100).unwrap();
        write_fd(b.as_raw_fd(), b"B");
        assert_eq!(std::fs::read(log.with_extension("log.1")).unwrap(), vec![b'a'; 100]);
        assert_eq!(std::fs::read(&log).unwrap(), b"AB", "both write to the new file");
        // A removed log is made again.
        std::fs::remove_file(&log).unwrap();
        rotate_if_needed(&log, &[a.as_raw_fd()], 100).unwrap();
        (&a).write_all(b"x").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"x");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
