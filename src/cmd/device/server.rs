//! Which server holds a ublk device (fdpblk's daemon, another server, or none) and whether
//! it is alive.

use crate::frontend::config::DeviceConfig;
use crate::frontend::{state, target};
use libublk::sys;
use std::path::PathBuf;

/// Whether process `pid` is exiting: its main thread is a zombie while other threads still
/// wait (in NVMe ioctls, say).
pub(crate) fn exiting(pid: u32) -> bool {
    state::state_letter(&format!("/proc/{pid}/stat")) == Some('Z')
}
/// Whether device `id` is stopped (neither live nor held for recovery).
pub(crate) fn ublk_stopped(id: i32) -> bool {
    target::ublk_ctrl(id).is_ok_and(|c| u32::from(c.dev_info().state) == sys::UBLK_S_DEV_DEAD)
}
/// The ids of every ublk device, from the driver's char devices in sysfs.
pub(super) fn ublk_ids() -> Vec<i32> {
    let mut ids: Vec<i32> = std::fs::read_dir("/sys/class/ublk-char")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
        .collect();
    ids.sort_unstable();
    ids
}
/// The daemon serving device `id`: its state file's, else an fdpblk process holding its
/// char device (`/run` cleared, or a recovered daemon that could not write its state file
/// yet) and, where the state file reads, that file's backing: a new add that took the id of
/// a stale file's deleted device holds the char device too.
pub(crate) fn serving_daemon(id: i32, read: &Result<(DeviceConfig, state::Daemon), String>) -> Option<state::Daemon> {
    if let Some(d) = read.as_ref().ok().map(|(_, d)| *d).filter(state::Daemon::alive) {
        return Some(d);
    }
    if !target::device_exists(id) {
        return None;
    }
    let ublkc = PathBuf::from(format!("/dev/ublkc{id}"));
    // A backing that cannot be looked up now (a file renamed, a namespace renumbered) is
    // still held by the daemon serving it: the char device alone tells then.
    let pid = match read {
        Ok((cfg, _)) if std::fs::metadata(&cfg.backing).is_ok() => state::fdpblk_holding(&[&ublkc, &cfg.backing]),
        _ => state::fdpblk_holding(&[&ublkc]),
    }?;
    Some(state::Daemon { pid, start: state::start_time(pid) })
}
/// Whose ublk device `id` is, for one that has no state file: its server's pid and name.
pub(super) fn ublk_owner(id: i32) -> String {
    match (ublk_server(id), maker(id)) {
        (Some((pid, c)), _) if c.starts_with("fdpblk") => format!("served by fdpblk (pid {pid}) but its state file is gone: `fdpblk del -n {id}` deletes it"),
        (Some((pid, c)), _) => format!("another ublk server's ({c}, pid {pid}): not fdpblk's to delete"),
        (None, Maker::Fdpblk) => format!("fdpblk's, its daemon is gone and so is its state file: `fdpblk del -n {id}` deletes it"),
        (None, Maker::Other) => "another ublk server's, whose server is gone: not fdpblk's to delete".to_string(),
        (None, Maker::Unknown) => format!("its server is gone and no state file says whose it was: if it was fdpblk's, `fdpblk del -n {id}` deletes it"),
    }
}
/// Who added a ublk device, by its `ublksrv_flags` ([`target::DEVICE_TAG`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Maker {
    Fdpblk,
    /// Another server that tags its devices.
    Other,
    /// Untagged: another server's, or one an fdpblk before the tag added.
    Unknown,
}
impl Maker {
    /// By the tag's first seven bytes (`fdpblk\0`): its last byte is a version, which a
    /// later fdpblk may raise.
    pub(super) fn of(ublksrv_flags: u64) -> Maker {
        const PREFIX: u64 = (1 << 56) - 1;
        match ublksrv_flags {
            0 => Maker::Unknown,
            f if f & PREFIX == target::DEVICE_TAG & PREFIX => Maker::Fdpblk,
            _ => Maker::Other,
        }
    }
}
/// The maker of device `id` (unknown where the driver does not answer).
fn maker(id: i32) -> Maker {
    target::ublk_ctrl(id).map_or(Maker::Unknown, |c| Maker::of(c.dev_info().ublksrv_flags))
}
/// The server of live ublk device `id`: its pid and process name (of a device that is not
/// live, the pid may be reused by now).
pub(super) fn ublk_server(id: i32) -> Option<(i32, String)> {
    live_server(&target::ublk_ctrl(id).ok()?.dev_info())
}
/// [`ublk_server`] of the device info read already.
pub(super) fn live_server(info: &sys::ublksrv_ctrl_dev_info) -> Option<(i32, String)> {
    let pid = Some(info.ublksrv_pid).filter(|&p| p > 0 && u32::from(info.state) == sys::UBLK_S_DEV_LIVE)?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some((pid, comm.trim().to_string()))
}
/// Whether device `id` is fdpblk's and its daemon died (`read`: its state file): no daemon
/// serves it ([`serving_daemon`]) and it is [`still_ours`].
pub(crate) fn orphaned(id: i32, read: &Result<(DeviceConfig, state::Daemon), String>) -> bool {
    serving_daemon(id, read).is_none() && still_ours(id, read)
}
/// Whether device `id`, which no daemon serves, is still the one its state file (`read`)
/// describes: it exists, and no other ublk server took its id.
pub(crate) fn still_ours(id: i32, read: &Result<(DeviceConfig, state::Daemon), String>) -> bool {
    read.as_ref().is_ok_and(|(_, ours)| target::device_exists(id) && foreign_server(id, ours).is_none())
}
/// The server of device `id` when it is not the fdpblk daemon `ours` (of `id`'s state
/// file): the driver reuses ids, so a state file left by a killed daemon whose device was
/// then deleted by other means names whatever device took the id next. A live device's is
/// told by its server's process; a dead one's only by another server's tag ([`Maker`]; an
/// untagged one may be an earlier fdpblk's, whose last server the driver may name otherwise
/// than its state file: a recovering daemon that died before it rewrote the file). Says
/// whose, as "ublk device N ...": "is served by NAME (pid P), not by fdpblk".
pub(crate) fn foreign_server(id: i32, ours: &state::Daemon) -> Option<String> {
    let info = target::ublk_ctrl(id).ok()?.dev_info();
    if u32::from(info.state) == sys::UBLK_S_DEV_LIVE {
        return live_server(&info).filter(|(pid, comm)| *pid as u32 != ours.pid && !comm.starts_with("fdpblk")).map(|(pid, comm)| format!("is served by {comm} (pid {pid}), not by fdpblk"));
    }
    (Maker::of(info.ublksrv_flags) == Maker::Other).then(|| "was served by another ublk server (tagged so; its server is gone), not by fdpblk".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Who added a device, by the tag in its `ublksrv_flags`: fdpblk's, of any version of the
    /// tag; another server's that sets the word; or untold.
    #[test]
    fn a_device_is_told_by_its_tag() {
        assert_eq!(&target::DEVICE_TAG.to_le_bytes(), b"fdpblk\x00\x01");
        assert_eq!(Maker::of(target::DEVICE_TAG), Maker::Fdpblk);
        assert_eq!(Maker::of(u64::from_le_bytes(*b"fdpblk\x00\x02")), Maker::Fdpblk, "a later version");
        assert_eq!(Maker::of(0), Maker::Unknown);
        for other in [1 << 1, u64::from_le_bytes(*b"fdpblkX\x01"), u64::MAX] {
            assert_eq!(Maker::of(other), Maker::Other, "{other:#x}");
        }
    }

    /// A process whose main thread is a zombie is exiting (a killed daemon whose threads
    /// still wait in NVMe commands looks so); a running one, or none, is not.
    #[test]
    fn a_zombie_is_exiting() {
        assert!(!exiting(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let mut zombie = false;
        for _ in 0..200 {
            zombie = exiting(child.id());
            if zombie {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(zombie, "an exited child not yet waited for is a zombie");
        child.wait().unwrap();
        assert!(!exiting(child.id()), "reaped: no such process");
    }
}
