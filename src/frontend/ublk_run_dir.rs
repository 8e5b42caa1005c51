//! libublk's run directory, `/run/ublksrvd`: libublk keeps a JSON file per device there
//! (`NNNN.json`). Where libublk creates the directory itself it makes it 0777 without the
//! sticky bit, and it creates, chmods and reads the files there following links, as root.
//! Any local user could then plant `0000.json` as a link to `/etc/passwd` (truncated and
//! made 0700 by the next `add`) or as a FIFO (a `list` or a recovery that never returns).
//! fdpblk makes the directory first, root's and not writable by others; one already writable
//! by others gets the sticky bit (unprivileged ublk servers of other programs may need to
//! write there), under which the kernel does not let root follow others' links or open
//! others' FIFOs; and a device's file is looked at before libublk reads or writes it.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// libublk's `UblkCtrl::run_dir()`.
pub const RUN_DIR: &str = "/run/ublksrvd";

/// A device file is a few hundred bytes of JSON; libublk reads it whole.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// libublk's file for device `id` in `dir`.
pub fn file_of(dir: &Path, id: i32) -> PathBuf {
    dir.join(format!("{id:04}.json"))
}

/// Makes `dir` safe for libublk to write in as root (see the module). Err names the fix when
/// it is not a directory of root's. Does nothing unless this process is root.
pub fn secure(dir: &Path) -> Result<(), String> {
    if !crate::device::running_as_root() {
        return Ok(());
    }
    secure_for(dir, 0)?;
    // The sticky bit protects only with the kernel's link and FIFO protections on (systemd
    // turns them on; the kernel's own defaults are off).
    let others_write = std::fs::metadata(dir).is_ok_and(|m| m.mode() & 0o002 != 0);
    let off: Vec<&str> = ["protected_symlinks", "protected_fifos", "protected_regular"]
        .into_iter()
        .filter(|s| std::fs::read_to_string(format!("/proc/sys/fs/{s}")).is_ok_and(|v| v.trim() == "0"))
        .collect();
    if others_write && !off.is_empty() {
        tracing::warn!(
            "{} is writable by others and fs.{} is 0: libublk, as root, may follow a link or open a FIFO another user plants there; set it to 1 (sysctl), or chmod 755 {} where no unprivileged ublk server needs it",
            dir.display(),
            off.join(", fs."),
            dir.display()
        );
    }
    Ok(())
}

fn secure_for(dir: &Path, owner: u32) -> Result<(), String> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match std::fs::DirBuilder::new().mode(0o755).create(dir) {
                Ok(()) => {}
                // Another process made it meanwhile: looked at below.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
            }
            std::fs::symlink_metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        }
        Err(e) => return Err(format!("cannot read {}: {e}", dir.display())),
    };
    if !meta.file_type().is_dir() {
        return Err(format!(
            "{} is not a directory (a link or file left there, maybe planted): libublk would write device files through it as root; remove it (rm {}) and add again",
            dir.display(),
            dir.display()
        ));
    }
    if meta.uid() != owner {
        return Err(format!(
            "{} belongs to uid {}, not root: its owner could replace the device files libublk writes there as root; remove it (rm -r {}) and add again",
            dir.display(),
            meta.uid(),
            dir.display()
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o1000))
            .map_err(|e| format!("cannot set the sticky bit on {} (mode {mode:o}, writable by others): {e}", dir.display()))?;
        tracing::warn!(
            "{} was writable by others without the sticky bit (mode {mode:o}; libublk makes it 0777): set it, so that files planted there are not followed; chmod 755 {} where no unprivileged ublk server needs it",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Before libublk reads device `id`'s file in `dir`: a link, anything but a regular file, or
/// one past 1 MiB (libublk would follow it, block on it or read it whole) is removed, as
/// nothing libublk writes; Err where it cannot be.
pub fn check_readable(dir: &Path, id: i32) -> Result<(), String> {
    let path = file_of(dir, id);
    let what = match std::fs::symlink_metadata(&path) {
        Err(_) => return Ok(()),
        Ok(m) if m.file_type().is_file() && m.len() <= MAX_FILE_BYTES => return Ok(()),
        Ok(m) if m.file_type().is_symlink() => "a link".to_string(),
        Ok(m) if m.file_type().is_file() => format!("{} bytes", m.len()),
        Ok(_) => "not a regular file".to_string(),
    };
    std::fs::remove_file(&path).map_err(|e| format!("{} is not libublk's device file ({what}) and cannot be removed: {e}", path.display()))?;
    tracing::warn!("removed {}: not libublk's device file ({what}), which libublk would have read", path.display());
    Ok(())
}

/// Before libublk writes device `id`'s file in `dir` (an add or a recovery of that device,
/// which writes it anew): anything there but a regular file of root's, with one link, is
/// removed, so libublk's create neither follows it nor is refused by the kernel's
/// protection of others' files in a sticky directory.
pub fn clear_for_write(dir: &Path, id: i32) -> Result<(), String> {
    if !crate::device::running_as_root() {
        return Ok(());
    }
    clear_for_write_by(dir, id, 0)
}

fn clear_for_write_by(dir: &Path, id: i32, owner: u32) -> Result<(), String> {
    let path = file_of(dir, id);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if !(m.file_type().is_file() && m.uid() == owner && m.nlink() == 1) => {
            std::fs::remove_file(&path).map_err(|e| format!("cannot remove {}, which libublk would write through: {e}", path.display()))?;
            tracing::warn!("removed {}: not a file of root's that libublk wrote (a link, a FIFO or another user's file)", path.display());
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Bytes a probe writes: more than libublk's device file (a few hundred bytes of JSON).
const PROBE_BYTES: usize = 16 << 10;

/// Whether libublk will be able to write its device file in `dir`: a file of
/// [`PROBE_BYTES`] is written there and removed. libublk writes it at the device's start,
/// after a recovery has begun (`START_USER_RECOVERY`): failing there would leave the device
/// quiesced, LMCache's I/O held, with a bare errno. Err names the directory and the fix.
pub fn room_to_write(dir: &Path) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join(format!(".fdpblk-probe.{}", std::process::id()));
    let _ = std::fs::remove_file(&probe);
    let wrote = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&probe)
        .and_then(|mut f| f.write_all(&[0u8; PROBE_BYTES]).and_then(|()| f.sync_all()));
    let _ = std::fs::remove_file(&probe);
    wrote.map_err(|e| {
        format!(
            "libublk cannot write its device file in {} ({e}), which it does as the device starts: make room there or make it writable (`df {}`, `mount | grep /run`)",
            dir.display(),
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::scratch;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    /// The probe leaves nothing behind; a directory libublk could not write in is named.
    #[test]
    fn room_to_write_is_probed_and_named() {
        let base = scratch("ublk-run-dir-room");
        room_to_write(&base).unwrap();
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 0, "the probe is removed");
        let gone = base.join("missing");
        let e = room_to_write(&gone).unwrap_err();
        assert!(e.contains(&format!("libublk cannot write its device file in {}", gone.display())) && e.contains("make room there"), "{e}");
    }

    #[test]
    fn the_directory_is_made_without_write_for_others_or_made_sticky() {
        let base = scratch("ublk-run-dir");
        let me = std::fs::metadata(&base).unwrap().uid();
        let dir = base.join("ublksrvd");
        let _ = std::fs::remove_dir_all(&dir);
        secure_for(&dir, me).unwrap();
        assert_eq!(mode(&dir) & 0o022, 0, "made: {:o}", mode(&dir));
        // libublk's own 0777: the sticky bit is added, write for others kept.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        secure_for(&dir, me).unwrap();
        assert_eq!(mode(&dir), 0o1777);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        secure_for(&dir, me).unwrap();
        assert_eq!(mode(&dir), 0o755, "left as it is");
        // Another owner, a link, a file: refused, naming the fix.
        let e = secure_for(&dir, me + 1).unwrap_err();
        assert!(e.contains("not root") && e.contains("rm -r"), "{e}");
        let link = base.join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = secure_for(&link, me).unwrap_err();
        assert!(e.contains("is not a directory") && e.contains("rm "), "{e}");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_planted_device_file_is_neither_read_nor_written_through() {
        let dir = scratch("ublk-run-files");
        let me = std::fs::metadata(&dir).unwrap().uid();
        let target = dir.join("victim");
        std::fs::write(&target, b"keep").unwrap();
        let f = file_of(&dir, 7);
        assert_eq!(f.file_name().unwrap(), "0007.json");
        let _ = std::fs::remove_file(&f);
        assert!(check_readable(&dir, 7).is_ok(), "no file: libublk goes without");
        std::fs::write(&f, b"{}").unwrap();
        assert!(check_readable(&dir, 7).is_ok());
        clear_for_write_by(&dir, 7, me).unwrap();
        assert!(f.exists(), "a file of the owner's is libublk's own");
        clear_for_write_by(&dir, 7, me + 1).unwrap();
        assert!(!f.exists(), "another user's file is removed");
        let gone = |f: &Path| std::fs::symlink_metadata(f).is_err();
        let fifo = |f: &Path| {
            let c = std::ffi::CString::new(f.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: a NUL-terminated path this test owns.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        };
        // Before a write and before a read: a link, a FIFO, a file past 1 MiB are removed.
        std::os::unix::fs::symlink(&target, &f).unwrap();
        clear_for_write_by(&dir, 7, me).unwrap();
        assert!(gone(&f) && std::fs::read(&target).unwrap() == b"keep", "the link is removed, its target kept");
        std::os::unix::fs::symlink(&target, &f).unwrap();
        check_readable(&dir, 7).unwrap();
        assert!(gone(&f) && std::fs::read(&target).unwrap() == b"keep");
        fifo(&f);
        clear_for_write_by(&dir, 7, me).unwrap();
        assert!(gone(&f));
        fifo(&f);
        check_readable(&dir, 7).unwrap();
        assert!(gone(&f));
        std::fs::File::create(&f).unwrap().set_len(MAX_FILE_BYTES + 1).unwrap();
        check_readable(&dir, 7).unwrap();
        assert!(gone(&f));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
