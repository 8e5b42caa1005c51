//! The daemon `add` and `recover` leave behind: the fork, the start it reports back, and
//! the stop signals held until the device is ours to stop.

use crate::cmd::CmdResult;
use crate::frontend::state;
use std::io::{Read, Write};
use std::path::Path;

/// The descriptors above stderr this process was started with, noted by `main` before it
/// opens anything.
static INHERITED_FDS: std::sync::OnceLock<Vec<i32>> = std::sync::OnceLock::new();
pub fn note_inherited_fds() {
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect::<Vec<i32>>()).unwrap_or_default();
    // The directory's own descriptor is among them, closed by now: kept out by checking each.
    // SAFETY: F_GETFD only reads a descriptor's flags.
    let open: Vec<i32> = fds.into_iter().filter(|&fd| fd > 2 && unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0).collect();
    let _ = INHERITED_FDS.set(open);
}
/// The daemon an `add` waits for, to which its stop signals go.
static STARTING_DAEMON: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward_to_daemon(sig: libc::c_int) {
    let pid = STARTING_DAEMON.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; errno is the interrupted code's, kept as it was.
        unsafe {
            let errno = *libc::__errno_location();
            libc::kill(pid, sig);
            *libc::__errno_location() = errno;
        }
    }
}
/// SIGINT and SIGTERM, blocked from before the fork until [`forward_stop_signals`] is in
/// place: one that comes in between waits instead of killing `add` (the parent) or the
/// daemon before its signal thread takes them (it inherits the mask; the pending signal
/// goes to that thread's sigwait). Returns the mask to restore.
fn hold_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset operations on local sets, and sigprocmask on this single-threaded process.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old);
        old
    }
}
/// Ctrl-C or SIGTERM to an `add` (or a `recover`) waiting for its daemon (in its own session, out of the
/// terminal's reach) goes on to the daemon, which stops its start cleanly and reports it
/// through the pipe: otherwise only the waiting process died and the device started anyway.
/// A SIGINT the caller ignores (a background job of a script) stays ignored. `held` is
/// [`hold_stop_signals`]'s mask, restored once the handlers are in place.
fn forward_stop_signals(daemon: libc::pid_t, held: &libc::sigset_t) {
    STARTING_DAEMON.store(daemon, std::sync::atomic::Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sigaction with a zeroed struct, a handler that only calls kill, and SA_RESTART
        // so the pipe's read goes on; `old` receives the previous disposition.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = forward_to_daemon as extern "C" fn(libc::c_int) as usize;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, &mut old);
            if sig == libc::SIGINT && old.sa_sigaction == libc::SIG_IGN {
                libc::sigaction(sig, &old, std::ptr::null_mut());
            }
        }
    }
    // SAFETY: restores this process's mask from before the fork; a held signal is handled now.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, held, std::ptr::null_mut()) };
}
/// Runs `body` in this process: `ready` gets the device id once it serves. A start that
/// failed is this command's error (main prints it, the exit status is 1) whether `body`
/// returns it or only reports it as its first word (a device stopped again at once, its state file
/// or name link not made, a stop signal during the start: `body` then returns `Ok`).
fn in_foreground(
    body: impl FnOnce(Box<dyn FnOnce(Result<i32, String>) + Send>) -> Result<(), String>,
    ready: impl FnOnce(i32) + Send + 'static,
) -> CmdResult {
    let failed: std::sync::Arc<std::sync::Mutex<Option<String>>> = Default::default();
    let said = failed.clone();
    let res = body(Box::new(move |r| match r {
        Ok(id) => ready(id),
        Err(e) => *said.lock().unwrap_or_else(|e| e.into_inner()) = Some(e),
    }));
    let failed = failed.lock().unwrap_or_else(|e| e.into_inner()).take();
    match (res, failed) {
        (Err(e), _) | (Ok(()), Some(e)) => Err(e.into()),
        (Ok(()), None) => Ok(()),
    }
}
/// Runs `body` as a daemon: fork, new session, its own mount namespace (a ublk server must
/// not share one with the device's users), stdio to /dev/null and a log file. The parent
/// waits for the child's first word — the device id or an error — and prints it.
pub(super) fn daemonize(foreground: bool, body: impl FnOnce(Box<dyn FnOnce(Result<i32, String>) + Send>) -> Result<(), String>) -> CmdResult {
    // Not println!: a foreground daemon's stdout may be a full file or a closed pipe, where
    // println! panics, on the daemon's main thread with its device live.
    let report = |r: &Result<i32, String>| {
        use std::io::Write as _;
        let _ = match r {
            Ok(id) => writeln!(std::io::stdout(), "{}", state::bdev_path(*id)),
            Err(e) => writeln!(std::io::stderr(), "fdpblk: {e}"),
        };
    };
    if foreground {
        // SAFETY: unshare only changes this process's namespaces.
        unsafe { libc::unshare(libc::CLONE_NEWNS) };
        return in_foreground(body, move |id| {
            report(&Ok(id));
            crate::cmd::up::notify_ready(id); // systemd Type=notify; nothing outside systemd
        });
    }
    let mut fds = [0i32; 2];
    // SAFETY: pipe writes two fds into the array.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(format!("cannot make the pipe to the daemon: {}", std::io::Error::last_os_error()).into());
    }
    let held = hold_stop_signals();
    // SAFETY: no threads exist yet (validation is single-threaded), so fork is safe.
    match unsafe { libc::fork() } {
        -1 => {
            let e = std::io::Error::last_os_error();
            // SAFETY: restores the mask hold_stop_signals changed.
            unsafe { libc::sigprocmask(libc::SIG_SETMASK, &held, std::ptr::null_mut()) };
            Err(format!("cannot start the daemon (fork): {e}").into())
        }
        0 => {
            // SAFETY: child side; these calls only change this process.
            unsafe {
                libc::close(fds[0]);
                libc::setsid();
                libc::unshare(libc::CLONE_NEWNS);
                // A SIGINT the caller ignores may have come while it was held: setting the
                // ignore again drops it, as the kernel would have without the hold.
                let mut int: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGINT, std::ptr::null(), &mut int) == 0 && int.sa_sigaction == libc::SIG_IGN {
                    libc::sigaction(libc::SIGINT, &int, std::ptr::null_mut());
                }
            }
            // Descriptors the caller left open (a shell's) would stay open as long as the
            // daemon runs: one on a ublk device would keep its id taken after its deletion.
            // Only those: this process's own (libublk's control ring) are still in use.
            for &fd in INHERITED_FDS.get().into_iter().flatten().filter(|&&fd| fd != fds[1]) {
                // SAFETY: a descriptor this process was started with and never used.
                unsafe { libc::close(fd) };
            }
            let _ = std::env::set_current_dir("/");
            crate::cmd::daemon_log::redirect(Path::new(state::RUN_DIR));
            use std::os::fd::FromRawFd;
            // SAFETY: fds[1] is the pipe's write end, owned here from now on.
            let mut pipe = unsafe { std::fs::File::from_raw_fd(fds[1]) };
            let rc = body(Box::new(move |r| {
                let line = match r {
                    Ok(id) => format!("ok {id}\n"),
                    Err(e) => format!("err {e}\n"),
                };
                let _ = pipe.write_all(line.as_bytes());
            }));
            if let Err(e) = rc {
                tracing::error!("{e}");
                std::process::exit(1);
            }
            std::process::exit(0);
        }
        child => {
            use std::os::fd::FromRawFd;
            forward_stop_signals(child, &held);
            // SAFETY: fds[0] is the pipe's read end; the write end is closed here.
            unsafe { libc::close(fds[1]) };
            let mut pipe = unsafe { std::fs::File::from_raw_fd(fds[0]) };
            let mut line = String::new();
            let _ = pipe.read_to_string(&mut line);
            // The daemon has answered: what it said stands, a later signal is not passed on.
            STARTING_DAEMON.store(0, std::sync::atomic::Ordering::SeqCst);
            let line = line.lines().next().unwrap_or("");
            if let Some(id) = line.strip_prefix("ok ") {
                let id: i32 = id.trim().parse().unwrap_or(-1);
                report(&Ok(id));
                Ok(())
            } else if let Some(e) = line.strip_prefix("err ") {
                Err(e.to_string().into())
            } else {
                Err("the fdpblk daemon exited before the device started; see /run/fdpblk/daemon.log".into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_foreground_start_that_failed_is_the_commands_error() {
        let ready = || {
            let got = std::sync::Arc::new(std::sync::Mutex::new(None));
            let g = got.clone();
            (got, move |id| *g.lock().unwrap() = Some(id))
        };
        // Served, then stopped cleanly: success, ready once.
        let (got, r) = ready();
        assert!(in_foreground(|n| { n(Ok(3)); Ok(()) }, r).is_ok());
        assert_eq!(*got.lock().unwrap(), Some(3));
        // Reported failed, then stopped without an error of its own (the name link not made).
        let (got, r) = ready();
        let e = in_foreground(|n| { n(Err("device 0: cannot link /dev/fdpblk/kv0; stopped".into())); Ok(()) }, r).unwrap_err();
        assert!(e.to_string().contains("cannot link"), "{e}");
        assert_eq!(*got.lock().unwrap(), None, "never ready");
        // Failed with an error of its own: that one.
        let (_, r) = ready();
        let e = in_foreground(|n| { n(Err("first word".into())); Err("the start failed".into()) }, r).unwrap_err();
        assert_eq!(e.to_string(), "the start failed");
        let (_, r) = ready();
        assert_eq!(in_foreground(|_| Err("no device".into()), r).unwrap_err().to_string(), "no device");
    }
}
