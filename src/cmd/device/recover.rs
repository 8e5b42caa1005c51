//! `fdpblk recover`: a new daemon for a device whose server died, over the same backing.

use super::add::{need_ublk_driver, raise_fd_limit, with_limit_fix};
use super::daemon::daemonize;
use super::server::{exiting, foreign_server, live_server, serving_daemon};
use crate::cmd::CmdResult;
use crate::cli::IdArgs;
use crate::frontend::{state, target};
use crate::place::policy_by_name;
use libublk::sys;

pub fn recover(a: &IdArgs) -> CmdResult {
    recover_device(a).map_err(|e| with_limit_fix(e.to_string()).into())
}
/// How long `recover` waits for the driver to hold a device whose daemon died: kernels before
/// about 6.8 notice a dead daemon only at a look every 5 s, and then wait for the requests in
/// flight.
const DRIVER_NOTICE_WAIT: std::time::Duration = std::time::Duration::from_secs(15);
fn recover_device(a: &IdArgs) -> CmdResult {
    need_ublk_driver()?;
    let read = state::read_state(a.number);
    let (cfg, pid) = read.clone()?;
    if policy_by_name(&cfg.policy).is_none() {
        return Err(target::unknown_policy(&cfg).into());
    }
    // The daemon to wait for: its state file's, or one that serves the device under that file
    // (a recovered daemon that could not write its own yet), killed too and still exiting.
    let pid = if pid.alive() { pid } else { serving_daemon(a.number, &read).unwrap_or(pid) };
    // A killed daemon may still be tearing down its rings for a moment; one whose threads
    // wait in NVMe commands (its leader a zombie) exits once the drive answers or the
    // kernel's I/O timeout (30 s) ends them.
    let mut waited = 0;
    while pid.alive() && (waited < 50 || (exiting(pid.pid) && waited < 500)) {
        if waited == 50 {
            // Not eprintln!: a full log must not end the recovery.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "fdpblk: device {}: its killed daemon (pid {pid}) is still exiting (NVMe commands in flight); waiting up to 45 s more", a.number);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        waited += 1;
    }
    if pid.alive() {
        return Err(match exiting(pid.pid) {
            true => format!("device {}: its killed daemon (pid {pid}) is still exiting (NVMe commands in flight); recover again once it is gone", a.number),
            false => format!("device {} is still served by pid {pid}; nothing to recover", a.number),
        }
        .into());
    }
    // The driver quiesces the device once it notices the daemon's exit: at once on recent
    // kernels, at its next look on those that look every 5 s, then after the requests in
    // flight. A live server that is not the dead daemon is not waited for.
    let mut st = sys::UBLK_S_DEV_LIVE;
    let mut ctrl = None;
    let mut server = None;
    for _ in 0..(DRIVER_NOTICE_WAIT.as_millis() / 100) {
        let c = target::ublk_ctrl(a.number).map_err(|e| match target::device_exists(a.number) {
            true => format!("ublk device {}: {}", a.number, target::ublk_error(&e)),
            false => format!("no ublk device {}: {}; see `fdpblk list`", a.number, target::ublk_error(&e)),
        })?;
        st = u32::from(c.dev_info().state);
        server = live_server(&c.dev_info()).filter(|&(p, _)| p as u32 != pid.pid);
        ctrl = Some(c);
        if st != sys::UBLK_S_DEV_LIVE || server.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    if st == sys::UBLK_S_DEV_LIVE {
        return Err(match server {
            Some((p, comm)) => format!("device {} is live, served by {comm} (pid {p}); nothing to recover", a.number),
            None => format!(
                "device {} is still live {} s after its daemon (pid {pid}) died: the driver has not noticed yet (a kernel under load, or I/O it still waits for); run `fdpblk recover -n {}` again, or `fdpblk del -n {}` (which fails LMCache's held I/O)",
                a.number,
                DRIVER_NOTICE_WAIT.as_secs(),
                a.number,
                a.number
            ),
        }
        .into());
    }
    // The id may have gone to another ublk server's device since (this one deleted by other
    // means), whose server died too: never serve this backing under its users.
    if let Some(whose) = read.as_ref().ok().and_then(|(_, ours)| foreign_server(a.number, ours)) {
        return Err(format!("ublk device {} {whose}: not fdpblk's to recover; its state file is left over (`fdpblk del -n {}` removes it and leaves the device)", a.number, a.number).into());
    }
    // Only a device the driver holds for a new daemon can be recovered; a stopped one (its
    // daemon died while stopping it) serves nothing and can only be deleted.
    if st != sys::UBLK_S_DEV_QUIESCED && st != sys::UBLK_S_DEV_FAIL_IO {
        return Err(format!(
            "device {} is stopped, not held for recovery (its daemon died while stopping it); delete it with `fdpblk del -n {}` and add it again (`fdpblk up NAME` does both)",
            a.number, a.number
        )
        .into());
    }
    // The new daemon serves the driver's queues, and only the layout its state file describes.
    let mut cfg = cfg;
    if let Some(c) = ctrl {
        let mut p = sys::ublk_params::default();
        c.get_params(&mut p).map_err(|e| format!("ublk device {}: reading its parameters: {}", a.number, target::ublk_error(&e)))?;
        target::drivers_device_matches(&cfg, &p.basic)?;
        target::take_drivers_queues(&mut cfg, &c.dev_info());
    }
    raise_fd_limit(cfg.queues);
    daemonize(a.foreground, move |notify| target::run(cfg, true, notify))
}
