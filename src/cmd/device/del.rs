//! `fdpblk del`: stop a device's daemon and delete the device, only the one it stopped.

use super::backing::holders;
use super::server::{foreign_server, serving_daemon};
use super::{say_err, say_out};
use crate::cmd::up::Found;
use crate::cmd::CmdResult;
use crate::cli::DelArgs;
use crate::frontend::{state, target};
use std::path::Path;

/// How long `del` (and `fdpblk down`, the systemd unit's ExecStop) waits for a stopping
/// daemon: its queues drain (passthrough commands a slow drive holds: up to 40 s) and its
/// state is written. Below the unit's TimeoutStopSec (300 s), so that a slow stop is not
/// counted as a failed one, which would run the unit's OnFailure=.
const STOP_WAIT_S: u64 = 160;
/// Waits up to `secs` for `cond`.
fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..secs * 20 {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    cond()
}
pub fn del(a: &DelArgs) -> CmdResult {
    let ids: Vec<i32> = match (a.number, a.all, &a.name) {
        (Some(n), false, None) => vec![n],
        (None, true, None) => state::state_ids(),
        (None, false, Some(name)) => match crate::cmd::up::find(name) {
            Found::Running { id, .. } | Found::Orphaned { id } => vec![id],
            Found::Stale { cfg } => vec![cfg.id],
            // What fdpblk-release@ runs after its unit gave up: a unit whose adds were all
            // refused left no device, and there is nothing to release. Not where the name's
            // link leads to a device whose state file does not read: that may be it, held
            // with LMCache's I/O.
            Found::None if a.if_orphaned && crate::cmd::up::linked_unreadable(name).is_none() => {
                say_out(format_args!("no fdpblk device named {name}: nothing to delete"));
                return Ok(());
            }
            Found::None => {
                return Err(match crate::cmd::up::linked_unreadable(name) {
                    Some(id) => format!(
                        "{} leads to device {id}, whose state file does not read, so it cannot be deleted by name: see `fdpblk list`; `fdpblk del -n {id}` deletes it",
                        state::name_path(name).display()
                    ),
                    None => format!("no fdpblk device named {name}; see `fdpblk list`"),
                }
                .into())
            }
        },
        _ => return Err("pass -n ID, --name NAME or --all".into()),
    };
    // --all goes on past a device it cannot delete, and reports them all at the end.
    let mut failed = Vec::new();
    for id in ids {
        if a.if_orphaned {
            if let Some(pid) = serving_daemon(id, &state::read_state(id)) {
                say_out(format_args!("{} is served by its daemon (pid {pid}): kept (--if-orphaned deletes only a device whose daemon died)", state::bdev_path(id)));
                continue;
            }
        }
        if let Err(e) = del_one(id) {
            if !a.all {
                return Err(e.into());
            }
            failed.push(e);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; ").into())
    }
}
fn del_one(id: i32) -> Result<(), String> {
    let read = state::read_state(id);
    if !target::device_exists(id) {
        // The device is gone already: its files go, under the add lock and only as read
        // here (an add may have been given the id since, and written its own).
        match (&read, state::state_path(id).exists()) {
            (Ok((c, d)), _) => {
                crate::cmd::up::remove_stale(c);
                // Kept where its daemon still runs (a device deleted by other means): it
                // removes its files when it stops.
                if state::read_state(id).is_ok_and(|(now, _)| now == *c) {
                    return Err(format!("ublk device {id} is gone, but its daemon (pid {}) still runs: it removes its state file when it stops (`kill {}`)", d.pid, d.pid));
                }
            }
            // A corrupt state file of a device that is gone: nothing else to clean.
            (Err(_), true) => {
                let _one = target::add_lock();
                if !target::device_exists(id) && state::read_state(id).is_err() {
                    state::remove_state_files(id);
                }
            }
            (Err(_), false) => return Err(format!("no ublk device {id}; see `fdpblk list`")),
        }
        return Ok(());
    }
    // Without a state file, or with one a killed daemon left behind, the device may be
    // another ublk server's: never fdpblk's to stop.
    let foreign = match &read {
        Ok((c, daemon)) => foreign_server(id, daemon).inspect(|_| state::remove_state(c)),
        // A corrupt state file tells nothing either: its id may have been taken since. (No
        // daemon of its own: pid 0 is no server's.)
        Err(_) => foreign_server(id, &state::Daemon { pid: 0, start: None }),
    };
    if let Some(whose) = foreign {
        return Err(format!("ublk device {id} {whose}: stop or delete it with its own server"));
    }
    let daemon = serving_daemon(id, &read);
    // The daemon itself opens the device now and then (its state thread drops cached pages).
    let users = holders(Path::new(&state::bdev_path(id)), daemon.map(|d| d.pid));
    if !users.is_empty() {
        tracing::warn!(
            "{} is open by {}: deleting it fails their I/O from now on, and its id stays taken until they close it (to replace fdpblk under a running LMCache, kill the daemon and recover instead: deploy/README.md)",
            state::bdev_path(id),
            users.join(", ")
        );
    }
    let ctrl = target::ublk_ctrl(id).map_err(|e| format!("ublk device {id}: {}", target::ublk_error(&e)))?;
    // Stopping makes the daemon drain its queues, delete the device and exit.
    if let Err(e) = ctrl.kill_dev() {
        // Not told to stop: waiting for the daemon would be waiting for nothing.
        if target::device_exists(id) {
            return Err(format!("ublk device {id}: cannot stop it: {}", target::ublk_error(&e)));
        }
    }
    if let Some(pid) = daemon {
        // It drains its queues (NVMe commands the drive is slow with: up to its 40 s limit)
        // and writes its state, which may be large; it then deletes the device itself.
        if !wait_for(10, || !pid.alive()) {
            say_err(format_args!(
                "fdpblk: device {id}: its daemon (pid {pid}) is still stopping (draining its queues, writing its state); waiting up to {} s more",
                STOP_WAIT_S - 10
            ));
            // Never deleted under a daemon still running: it deletes its device by id once
            // done, which by then could be another device's.
            if !wait_for(STOP_WAIT_S - 10, || !pid.alive()) {
                return Err(format!(
                    "device {id}: its daemon (pid {pid}) is still stopping after {STOP_WAIT_S} s; wait for it, or kill it (`kill -9 {pid}`: the device is stopped already; fdpblk's own state then counts as unclean at the next start, which only forgoes deallocations) and `fdpblk del -n {id}` again"
                ));
            }
        }
    }
    // A daemon that died (or one that stopped without deleting) leaves the device to us;
    // one that deleted it freed the id, which an add may have taken since.
    if target::device_exists(id) {
        let server = ctrl.read_dev_info().map_or(0, |_| ctrl.dev_info().ublksrv_pid);
        if !still_the_stopped_device(daemon.map(|d| d.pid), server) {
            // A server pid of none: a new add's device not started yet, or this one, its
            // daemon died before deleting it (the driver clears the pid at the stop). Which
            // cannot be told; neither is deleted here, and the second says so.
            if server <= 0 && state::read_state(id).ok().map(|(_, d)| d) == read.as_ref().ok().map(|(_, d)| *d) {
                return Err(format!("ublk device {id} is still there, stopped: its daemon exited without deleting it; `fdpblk del -n {id}` again deletes it"));
            }
            return Ok(());
        }
        target::delete_device(&ctrl)?;
    }
    drop(ctrl);
    if !wait_for(10, || !target::device_exists(id)) {
        return Err(format!("ublk device {id} did not go away; is its daemon stuck? (kill it, then `fdpblk del -n {id}`)"));
    }
    // The state file goes unless it is another device's by now (the id, free once the device
    // went, may have been taken by an add since). Under the add lock: a file read here as
    // the stopped device's is not yet cleared by an add of the id (`clear_stale`, under
    // the lock at its creation), so no add of the id has a file to lose.
    let _one = target::add_lock();
    match (&read, state::read_state(id)) {
        (Ok((_, before)), Ok((c, now))) if now == *before => state::remove_state(&c),
        (Err(_), Err(_)) => state::remove_state_files(id),
        _ => {}
    }
    Ok(())
}
/// Whether the device of the id `del` stopped, found again once the daemon waited for
/// (`waited`, its pid) is gone, is still the one stopped, by the server the driver names
/// (`server_pid`). A daemon that deleted its device freed the id, and an add may have taken
/// it at once: that device names its own daemon (from its add on). With no daemon to wait
/// for, nothing deleted the stopped device, so the id is still its.
fn still_the_stopped_device(waited: Option<u32>, server_pid: i32) -> bool {
    match waited {
        None => true,
        Some(pid) => u32::try_from(server_pid).is_ok_and(|s| s == pid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn del_deletes_only_the_device_it_stopped() {
        assert!(still_the_stopped_device(Some(10), 10), "its daemon stopped (or died) without deleting it: del deletes it");
        assert!(!still_the_stopped_device(Some(10), 11), "an add took the id: its daemon serves it");
        assert!(!still_the_stopped_device(Some(10), -1) && !still_the_stopped_device(Some(10), 0), "an add's device not started yet");
        assert!(still_the_stopped_device(None, 11) && still_the_stopped_device(None, -1), "no daemon to wait for: nothing freed the id");
    }
}
