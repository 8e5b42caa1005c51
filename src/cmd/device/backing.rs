//! What the backing is and who else holds it: its block size and queue limits, the signatures
//! blkid finds, its partition, the ublk device it may itself be, other writers, its pin.

use super::server::{exiting, orphaned, serving_daemon, ublk_ids, ublk_server, ublk_stopped, Maker};
use crate::cli::AddArgs;
use crate::frontend::{state, target};
use crate::nvme::discover::NamespaceIdentity;
use crate::nvme::path::DevKind;
use crate::nvme::pin::{suggested, BackingPin};
use libublk::sys;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

pub(super) fn lba_bytes(f: &std::fs::File) -> u64 {
    crate::device::logical_block_bytes(f)
}
pub(super) fn sysfs_queue_attr(dev: &Path, attr: &str) -> Option<u64> {
    let name = std::fs::canonicalize(dev).ok()?.file_name()?.to_str()?.to_string();
    std::fs::read_to_string(format!("/sys/block/{name}/queue/{attr}")).ok()?.trim().parse().ok()
}
/// A util-linux tool by its full path (a daemon's or a user's PATH may lack the sbin
/// directories), else by name.
pub(super) fn sbin_tool(name: &str) -> String {
    // util-linux's own places (some distributions keep these in /usr/bin) before root's PATH.
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"].iter().map(|d| format!("{d}/{name}")).find(|p| Path::new(p).exists()).unwrap_or_else(|| name.to_string())
}
/// `wipefs -a PATH`: erases the signatures blkid finds.
fn wipe_signatures(path: &Path) -> Result<(), String> {
    let wipefs = sbin_tool("wipefs");
    let out = std::process::Command::new(&wipefs)
        .args(["-a", "--"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("--force: cannot run {wipefs} to erase the signatures on {}: {e}", path.display()))?;
    if !out.status.success() {
        return Err(format!("--force: wipefs -a {} failed: {}", path.display(), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}
/// What `blkid -p` (low-level probe, no cache) finds on `path`: `None` for nothing.
pub(super) fn foreign_signature(path: &Path) -> Result<Option<String>, String> {
    // blkid says nothing, exit 2, also for a path it cannot read: read it first.
    let mut first = [0u8; 512];
    let n = std::fs::File::open(path)
        .and_then(|f| std::os::unix::fs::FileExt::read_at(&f, &mut first, 0))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // Nothing to hold one (the block device of a namespace in a format the kernel cannot
    // use has size 0, and blkid fails on it).
    if n == 0 {
        return Ok(None);
    }
    let blkid = sbin_tool("blkid");
    let out = std::process::Command::new(&blkid)
        .args(["-p", "-o", "export", "--"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("{blkid}: {e}"))?;
    // 2: nothing found (or the device could not be probed: then it says why); 8: several
    // signatures, blkid cannot tell which (still someone's).
    match out.status.code() {
        Some(2) if out.stderr.is_empty() => return Ok(None),
        Some(0 | 8) => {}
        _ => return Err(format!("blkid -p: {}", String::from_utf8_lossy(&out.stderr).trim())),
    }
    Ok(Some(describe_signature(&String::from_utf8_lossy(&out.stdout), out.status.code() == Some(8))))
}
/// A short description of `blkid -o export` output: "an ext4 file system", "a gpt partition
/// table", "a LVM2_member (raid) signature".
fn describe_signature(export: &str, ambivalent: bool) -> String {
    let get = |k: &str| export.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix('=')).map(str::to_string);
    if ambivalent {
        return "several signatures".into();
    }
    match (get("TYPE"), get("USAGE"), get("PTTYPE")) {
        (Some(t), Some(u), _) if u == "filesystem" => format!("an {t} file system"),
        (Some(t), Some(u), _) => format!("a {t} ({u}) signature"),
        (Some(t), None, _) => format!("a {t} signature"),
        (None, _, Some(pt)) => format!("a {pt} partition table"),
        _ => "a signature".into(),
    }
}
/// `--backing-id`: the backing must be the namespace it names ([`crate::nvme::pin`]); an
/// error names where that namespace is now, if any node has it. `identify` and `find` are
/// [`crate::nvme::discover::identity_of`] and [`crate::nvme::discover::find_namespace_where`]
/// (a test's stand-ins otherwise); `kind` is the backing's (`/dev/ngXnY`: generic), whose
/// nodes are searched first.
pub(super) fn check_backing_pin<E: std::fmt::Display>(
    a: &AddArgs,
    kind: DevKind,
    identify: impl Fn(&Path) -> Result<Option<NamespaceIdentity>, E>,
    find: impl Fn(&dyn Fn(&NamespaceIdentity) -> bool, DevKind) -> Option<PathBuf>,
) -> Result<(), String> {
    let backing = a.backing.display();
    let Some(text) = &a.backing_id else {
        if let Some(w) = unpinned_warning(a, identify) {
            tracing::warn!("{w}");
        }
        return Ok(());
    };
    let pin = BackingPin::parse(text)?;
    let id = match identify(&a.backing) {
        Ok(Some(id)) => id,
        Ok(None) => {
            return Err(format!(
                "--backing-id names an NVMe namespace, and backing {backing} is not one (a file, a partition or another kind of device): give the namespace, or leave --backing-id out"
            ))
        }
        Err(e) => return Err(format!("--backing-id: cannot read the identity of backing {backing}: {e}")),
    };
    let Some(differs) = pin.mismatch(&id) else { return Ok(()) };
    let now = match pinned_node(&pin, kind, &find) {
        Some(p) => format!("the pinned namespace is {} now: set --backing to it", p.display()),
        None => "no node names the pinned namespace now: check that its drive is in, or if it was replaced on purpose set --backing-id to this one's".into(),
    };
    Err(format!(
        "backing {backing} is the NVMe namespace {id}, not the one --backing-id pins ({pin}): {differs}. Nothing was written; {now}"
    ))
}
/// The node of the namespace `pin` names: of `kind` first, else of the other kind (a
/// namespace without a block device has only its generic node).
fn pinned_node(pin: &BackingPin, kind: DevKind, find: &impl Fn(&dyn Fn(&NamespaceIdentity) -> bool, DevKind) -> Option<PathBuf>) -> Option<PathBuf> {
    let other = if kind == DevKind::Generic { DevKind::Block } else { DevKind::Generic };
    find(&|n| pin.mismatch(n).is_none(), kind).or_else(|| find(&|n| pin.mismatch(n).is_none(), other))
}
/// The error for a backing path that cannot be looked at (`e`): with a pin, where the pinned
/// namespace is now (a renumbering after a reboot can leave `/dev/ng0n1` unused).
pub(super) fn missing_backing_error(a: &AddArgs, e: &std::io::Error, find: impl Fn(&dyn Fn(&NamespaceIdentity) -> bool, DevKind) -> Option<PathBuf>) -> String {
    let backing = a.backing.display();
    let Some(pin) = a.backing_id.as_deref().and_then(|t| BackingPin::parse(t).ok()) else {
        return format!("backing {backing}: {e}; pass an NVMe namespace (/dev/nvmeXnY, /dev/ngXnY) or a file");
    };
    let generic = a.backing.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("ng"));
    match pinned_node(&pin, if generic { DevKind::Generic } else { DevKind::Block }, &find) {
        Some(p) => format!("backing {backing}: {e}; the namespace --backing-id pins ({pin}) is {} now: set --backing to it", p.display()),
        None => format!("backing {backing}: {e}; no node names the namespace --backing-id pins ({pin}) now: check that its drive is in"),
    }
}
/// The warning for a config file (`fdpblk up`, at every boot) whose backing is a kernel name
/// (not a link such as /dev/disk/by-id/…) of an NVMe namespace and pins none: that name can
/// come to name another drive. It gives the line to add (not for a backing typed on the
/// command line, which the file's line would not be about).
pub(super) fn unpinned_warning<E>(a: &AddArgs, identify: impl Fn(&Path) -> Result<Option<NamespaceIdentity>, E>) -> Option<String> {
    let file = a.config.as_ref().filter(|_| a.backing_id.is_none() && a.from_config.contains(&"backing"))?;
    if std::fs::symlink_metadata(&a.backing).is_ok_and(|m| m.file_type().is_symlink()) {
        return None;
    }
    let id = identify(&a.backing).ok()??;
    Some(format!(
        "backing {} is a kernel name, which can name another drive after a reboot; pin the namespace: add `{}` to {}",
        a.backing.display(),
        crate::cmd::config_file::toml_line("backing_id", &suggested(&id).to_string()),
        file.display()
    ))
}
/// What `--force` erases, once nothing else can refuse the device (the ublk driver too).
pub(super) fn erase_signatures(to_wipe: Option<PathBuf>) -> Result<(), String> {
    match to_wipe {
        Some(target) => {
            tracing::warn!("--force: erasing the signatures on {} (wipefs -a)", target.display());
            wipe_signatures(&target)
        }
        None => Ok(()),
    }
}
/// Block device `rdev`'s sysfs directory, and whether it is a partition (listed under its disk).
fn sysfs_block(rdev: u64) -> Option<(PathBuf, bool)> {
    let dir = crate::device::sysfs_block_dir(rdev)?;
    let partition = dir.join("partition").exists();
    Some((dir, partition))
}
/// The disk a partition is on (`nvme0n1` for `nvme0n1p2`); None for a whole disk.
pub(super) fn partition_of(rdev: u64) -> Option<String> {
    let (dir, true) = sysfs_block(rdev)? else { return None };
    dir.parent()?.file_name()?.to_str().map(str::to_string)
}
/// FDP placement on a partition: write streams are the whole disk's, and passthrough
/// addresses the namespace's LBAs, so neither reaches a partition.
pub(super) fn partition_error(backing: &Path, disk: &str) -> String {
    format!(
        "{} is a partition of /dev/{disk}, and FDP placement (write streams, NVMe passthrough) works on a whole namespace only: give fdpblk the whole namespace (/dev/{disk}, or its char device for passthrough; its partition table and every partition then go to fdpblk), or run on the partition without placement (--policy none, or --engine plain)",
        backing.display()
    )
}
/// The ublk device (`/dev/ublkbN`) block device `rdev` is, or is a partition of.
pub(super) fn ublk_disk_of(rdev: u64) -> Option<i32> {
    let (dir, partition) = sysfs_block(rdev)?;
    let disk = if partition { dir.parent()? } else { &dir };
    state::ublk_disk_id(disk.file_name()?.to_str()?)
}
/// A ublk device as a backing: an fdpblk device's is the path LMCache writes to, and a new
/// device on it would put its own state and deallocations over that device's cache.
pub(super) fn ublk_backing_error(backing: &Path, id: i32, under: Option<PathBuf>) -> String {
    let what = match under {
        Some(b) => format!("fdpblk device {id}, whose backing is {}", b.display()),
        None => format!("ublk device {id}"),
    };
    format!(
        "backing {} is {what}: that is a path for LMCache's device_path, not a backing; give the NVMe namespace or file itself (`fdpblk list` shows each device's backing)",
        backing.display()
    )
}
/// What identifies the storage behind a backing path: the namespace's block device for an
/// NVMe block or char device (`/dev/ng0n1` and `/dev/nvme0n1` are one), the inode for a file.
fn storage_key(p: &Path) -> Option<(u64, u64)> {
    let meta = std::fs::metadata(p).ok()?;
    let kind = meta.file_type();
    if kind.is_char_device() {
        return match crate::nvme::path::namespace_block_device(p).and_then(|b| std::fs::metadata(b).ok()) {
            Some(b) => Some((0, b.rdev())),
            None => Some((1, meta.rdev())),
        };
    }
    if kind.is_block_device() {
        return Some((0, meta.rdev()));
    }
    Some((meta.dev(), meta.ino()))
}
/// Whether two backing paths name the same storage.
fn same_backing(a: &Path, b: &Path) -> bool {
    storage_key(a).is_some_and(|x| storage_key(b) == Some(x))
}
/// The device a state file says serves `backing`, with the pid of its daemon where one
/// serves it; `live` only where the driver has that daemon serving it now (not stopping).
fn served_by_state(backing: &Path, live: bool) -> Option<String> {
    state::state_ids().into_iter().find_map(|id| {
        let read = state::read_state(id);
        let (cfg, _) = read.as_ref().ok()?;
        if !same_backing(backing, &cfg.backing) {
            return None;
        }
        let daemon = serving_daemon(id, &read)?;
        if live && ublk_server(id).is_none_or(|(pid, _)| pid as u32 != daemon.pid) {
            return None;
        }
        // Killed while its NVMe commands are in flight: `del` now would fail LMCache's I/O
        // that the driver may yet hold for a recovery.
        if exiting(daemon.pid) {
            return Some(format!(
                "backing {} is served by {}, whose daemon (pid {daemon}) is exiting (NVMe commands in flight); once it is gone, `fdpblk recover -n {id}` brings the device back (or `fdpblk del -n {id}` deletes it)",
                backing.display(),
                state::bdev_path(id)
            ));
        }
        Some(format!(
            "backing {} is served by {} (daemon pid {daemon}); stop it first (`fdpblk del -n {id}`)",
            backing.display(),
            state::bdev_path(id)
        ))
    })
}
/// Names the fdpblk device whose daemon serves `backing` now, live: `add` refuses it at once.
/// The daemon's own exclusive open would refuse it too, but only after the few seconds it
/// grants a holder to let go, meant for a device `del` has just stopped (whose daemon may
/// still be closing the backing; its device is no longer live).
pub(super) fn backing_served_live(backing: &Path) -> Option<String> {
    served_by_state(backing, true)
}
/// Names the fdpblk device a running daemon serves on `backing`, if any: by the state files,
/// else by an fdpblk process holding the backing open (its state file gone with `/run`).
pub(super) fn backing_served(backing: &Path) -> Option<String> {
    served_by_state(backing, false).or_else(|| {
        // Either node of the namespace: the daemon may hold `/dev/ng0n1` where the add names
        // `/dev/nvme0n1`, whose exclusive open does not see a char device's opener.
        let other = crate::nvme::path::namespace_other_node(backing);
        let pid = std::iter::once(backing).chain(other.as_deref()).find_map(|p| state::fdpblk_holding(&[p]))?;
        Some(format!(
            "backing {} is held open by fdpblk (pid {pid}), which no state file names as its daemon (one whose state file is gone, or another fdpblk command); stop it first (`fdpblk list` shows a device without its state file, `fdpblk del -n ID` stops it)",
            backing.display()
        ))
    })
}
/// How long `add` waits for another program that holds the namespace open for writing to
/// let go (udev's probe after a write closes it again at once).
pub(super) const OTHER_WRITER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// A program other than fdpblk holding the namespace open for writing through either of its
/// nodes (LMCache pointed at the drive itself, fio, a passthrough tool): its writes would land
/// over LMCache's slots and fdpblk's own state, and the daemon's exclusive open sees none of
/// them (only exclusive holders conflict, and a char device cannot be claimed). Readers
/// (blktrace) are no harm. Waits `wait` for a passing one. fdpblk's own processes are left
/// to the daemon's lock, which names the device they serve.
pub(super) fn other_writers(backing: &Path, wait: std::time::Duration) -> Option<String> {
    let start = std::time::Instant::now();
    loop {
        let found = state::foreign_writers(backing);
        if found.is_empty() {
            return None;
        }
        if start.elapsed() >= wait {
            return Some(format!(
                "backing {} is open for writing by {}: its writes would land over LMCache's slots and fdpblk's own state; stop it (LMCache's device_path must be fdpblk's device, not the drive), then add again",
                backing.display(),
                found.join(", ")
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
/// Refuses a backing of an fdpblk device whose daemon died: a live daemon holds its backing
/// open exclusively and locked (a second one is refused when it opens it), a dead one
/// holds nothing while the driver keeps its writes for recovery, which would then land over
/// the new device's.
pub(super) fn backing_in_use(backing: &Path) -> Option<String> {
    for id in state::state_ids() {
        let read = state::read_state(id);
        let cfg = match &read {
            Ok((cfg, _)) => cfg,
            // Not known free: a device no daemon serves whose state file does not read (one
            // of another fdpblk version, after an upgrade by killing the daemon) may hold this
            // backing's writes for recovery, and a second device on it would take LMCache's
            // path while the first holds LMCache's I/O.
            Err(e) if target::device_exists(id) && ublk_server(id).is_none() => {
                return Some(format!(
                    "{} has a state file that does not read ({e}) and no daemon: it may hold the writes of backing {} for recovery; recover it with the fdpblk version that added it, or `fdpblk del -n {id}` deletes it first",
                    state::bdev_path(id),
                    backing.display()
                ))
            }
            Err(_) => continue,
        };
        // A stopped device (its daemon died while stopping it) holds no writes.
        if !same_backing(backing, &cfg.backing) || !orphaned(id, &read) || ublk_stopped(id) {
            continue;
        }
        return Some(format!(
            "backing {} belongs to {}, whose daemon died: the driver holds its writes for recovery; `fdpblk recover -n {id}` brings it back, or `fdpblk del -n {id}` deletes it first",
            backing.display(),
            state::bdev_path(id)
        ));
    }
    // A device fdpblk added (by its tag) whose daemon died and whose state file is gone (`/run`
    // cleared, or a container's own `/run` after a restart): which backing it served is not
    // known, nor can it be recovered, but the driver holds its writes, maybe this backing's.
    // A second device here would take LMCache's path while the first hangs LMCache's I/O.
    ublk_ids().into_iter().filter(|&id| !state::state_path(id).exists()).find_map(|id| {
        let info = target::ublk_ctrl(id).ok()?.dev_info();
        (Maker::of(info.ublksrv_flags) == Maker::Fdpblk && u32::from(info.state) == sys::UBLK_S_DEV_QUIESCED).then(|| {
            format!(
                "{} is fdpblk's and its daemon died, but its state file in {} is gone (`/run` cleared, or a container's own): the driver holds its writes, maybe of backing {}, for a recovery that needs that file; `fdpblk del -n {id}` deletes it first (the I/O it holds fails), unless another fdpblk (in another container) has its state file: recover it there",
                state::bdev_path(id),
                state::RUN_DIR,
                backing.display()
            )
        })
    })
}
/// The processes that hold `dev` open, but `skip`: "name (pid N)" each.
pub(super) fn holders(dev: &Path, skip: Option<u32>) -> Vec<String> {
    state::openers(dev).into_iter().filter(|&(pid, _)| Some(pid) != skip).map(|(pid, comm)| format!("{comm} (pid {pid})")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::scratch;

    #[test]
    fn one_storage_is_one_backing_by_any_path() {
        let dir = scratch("same");
        let (a, b, link) = (dir.join("a.img"), dir.join("b.img"), dir.join("link"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        std::os::unix::fs::symlink(&a, &link).unwrap();
        assert!(same_backing(&a, &link));
        assert!(!same_backing(&a, &b));
        assert!(!same_backing(&a, &dir.join("missing")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn holders_of_a_file_are_found_by_its_path() {
        // Held by a child (`del` leaves itself out): a sleep with the file as its stdin.
        let f = std::env::temp_dir().join(format!("fdpblk-holders-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let f = std::fs::canonicalize(&f).unwrap();
        let mut child = std::process::Command::new("sleep").arg("30").stdin(std::fs::File::open(&f).unwrap()).spawn().unwrap();
        let it = format!("sleep (pid {})", child.id());
        let mut found = false;
        for _ in 0..100 {
            found = holders(&f, None).contains(&it);
            if found {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(found, "{:?}", holders(&f, None));
        let _mine = std::fs::File::open(&f).unwrap();
        assert!(!holders(&f, None).iter().any(|h| h.ends_with(&format!("(pid {})", std::process::id()))), "not itself");
        assert!(!holders(&f, Some(child.id())).contains(&it), "nor the device's daemon");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!holders(&f, None).contains(&it));
        std::fs::remove_file(&f).unwrap();
    }

    #[test]
    fn blkid_signatures_are_described() {
        assert_eq!(describe_signature("DEVNAME=/dev/x\nTYPE=ext4\nUSAGE=filesystem\n", false), "an ext4 file system");
        assert_eq!(describe_signature("TYPE=LVM2_member\nUSAGE=raid\n", false), "a LVM2_member (raid) signature");
        assert_eq!(describe_signature("PTUUID=ab\nPTTYPE=gpt\n", false), "a gpt partition table");
        assert_eq!(describe_signature("", true), "several signatures");
    }

    /// blkid, mkswap and wipefs are util-linux, on every system fdpblk runs on (and in CI).
    #[test]
    fn a_swap_signature_is_found_and_a_blank_file_is_not() {
        let dir = scratch("sig");
        let img = dir.join("a.img");
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        assert_eq!(foreign_signature(&img), Ok(None));
        let mkswap = sbin_tool("mkswap");
        let st = std::process::Command::new(&mkswap).arg(&img).output().expect("mkswap (util-linux) runs");
        assert!(st.status.success(), "{st:?}");
        assert_eq!(foreign_signature(&img), Ok(Some("a swap (other) signature".into())));
        // What --force does: erased, nothing is found any more.
        wipe_signatures(&img).unwrap();
        assert_eq!(foreign_signature(&img), Ok(None));
        // A path blkid cannot open is an error (the caller warns), not "nothing found".
        assert!(foreign_signature(&dir.join("missing.img")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
