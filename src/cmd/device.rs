//! `fdpblk add | recover | del | list | stats | features`: the device lifecycle.
//! Everything is validated before a device is created; a failure creates nothing.

use super::up::Found;
use super::CmdResult;
use crate::cli::{AddArgs, DelArgs, IdArgs, ListArgs};
use crate::device::ReadAt;
use crate::engine::passthrough;
use crate::frontend::config::{exported_bytes, reserved_tail_bytes, DeviceConfig, EngineKind};
use crate::frontend::{state, target};
use crate::layout::discover::{discover, DiscoverError};
use crate::layout::geometry::{DEFAULT_BLOCK_ALIGN, DEFAULT_HEADER_BYTES};
use crate::layout::GeometryConfig;
use crate::nvme::discover::NamespaceIdentity;
use crate::nvme::path::DevKind;
use crate::nvme::pin::{suggested, BackingPin};
use crate::place::{policy_by_name, POLICY_NAMES};
use libublk::ctrl::UblkCtrl;
use libublk::sys;
use serde_json::json;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// A view of the backing device limited to the exported bytes: LMCache sees only those.
struct Exported<'a>(&'a std::fs::File, u64);

impl ReadAt for Exported<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let n = (self.1.saturating_sub(offset)).min(buf.len() as u64) as usize;
        ReadAt::read_at(self.0, &mut buf[..n], offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.1)
    }
}

/// ublk exports logical blocks of at most a page (`logical_bs_shift` ≤ PAGE_SHIFT), and the
/// reserved tail is laid out in 4 KiB blocks: a larger logical block is refused up front,
/// with the fix, rather than as a bare EINVAL from the driver.
fn block_size_error(lba: u64, backing: &std::path::Path) -> Option<String> {
    (lba > 4096).then(|| {
        format!(
            "{} has {lba}-byte logical blocks, more than the 4096 bytes a ublk device can export; format the namespace with a 512- or 4096-byte LBA format (nvme id-ns -H lists them; nvme format --lbaf=N erases the namespace)",
            backing.display()
        )
    })
}

fn lba_bytes(f: &std::fs::File) -> u64 {
    crate::device::logical_block_bytes(f)
}

fn sysfs_queue_attr(dev: &Path, attr: &str) -> Option<u64> {
    let name = std::fs::canonicalize(dev).ok()?.file_name()?.to_str()?.to_string();
    std::fs::read_to_string(format!("/sys/block/{name}/queue/{attr}")).ok()?.trim().parse().ok()
}

/// The command that erases LMCache's checkpoints: the first `meta_bytes` of the backing.
fn erase_checkpoint_command(meta_bytes: u64, backing: &Path, is_bdev: bool, is_chardev: bool) -> String {
    zero_command(0, meta_bytes, backing, is_bdev, is_chardev)
}

/// The command that zeroes `len` bytes at `offset` of the backing (both multiples of 512).
fn zero_command(offset: u64, len: u64, backing: &Path, is_bdev: bool, is_chardev: bool) -> String {
    let block = if is_chardev { crate::nvme::path::namespace_block_device(backing) } else { Some(backing.to_path_buf()) };
    let at = if offset == 0 { String::new() } else { format!("-o {offset} ") };
    match block {
        Some(b) if is_bdev || is_chardev => format!("blkdiscard -z {at}-l {len} {}", b.display()),
        Some(b) if offset == 0 => format!("dd if=/dev/zero of={} bs=4096 count={} conv=notrunc", b.display(), len.div_ceil(4096)),
        Some(b) => format!("dd if=/dev/zero of={} bs=512 seek={} count={} conv=notrunc", b.display(), offset / 512, len.div_ceil(512)),
        None => format!("zero {len} bytes at byte {offset} of the namespace behind {}", backing.display()),
    }
}

/// A geometry conflict is also what a changed LMCache configuration looks like (for instance
/// a larger meta_total_bytes after fdpblk's overflow alarm): LMCache discards its old index
/// then, so the way forward is to erase the old checkpoint, which the error spells out.
fn with_erase_hint(e: DiscoverError, backing: &Path, is_bdev: bool, is_chardev: bool) -> String {
    if let DiscoverError::TwoLayouts { offset, block_align, flag, .. } = e {
        // Its header block alone: LMCache's loader then skips that copy, and the current one stays.
        let erase = zero_command(offset, block_align, backing, is_bdev, is_chardev);
        let then = if flag.is_some() { "then add again" } else { "if the other one is LMCache's layout; then add again" };
        return format!("{e}. Erase the old copy's header (the current checkpoint stays) {then}: {erase}");
    }
    if let DiscoverError::DamagedCopy { offset, block_align, .. } = e {
        // Its header block alone: LMCache loads nothing from that copy either way.
        let erase = zero_command(offset, block_align, backing, is_bdev, is_chardev);
        return format!("{e}. Give LMCache's layout with --slot-bytes and --meta-total-bytes (LMCache overwrites the copy with its first checkpoint), or erase the copy's header and add again to learn the layout from that checkpoint: {erase}");
    }
    let (DiscoverError::Conflict { meta_bytes, .. } | DiscoverError::CheckpointTooBig { meta_bytes, .. } | DiscoverError::ImpossibleCheckpoint { meta_bytes, .. }) = e else {
        return e.to_string();
    };
    let erase = erase_checkpoint_command(meta_bytes, backing, is_bdev, is_chardev);
    let change = match e {
        DiscoverError::Conflict { .. } => "changed to the new value",
        DiscoverError::ImpossibleCheckpoint { .. } => "is as you give it with the flags",
        _ => "changed for this device",
    };
    format!("{e}. If LMCache's configuration {change} (LMCache then starts with an empty cache), erase its old checkpoint first: {erase}")
}

/// What of LMCache's a device shows before blkid is asked.
#[derive(Clone, Copy)]
enum Lmcache {
    /// No checkpoint (the layout comes from the flags, or is learned).
    Nothing,
    /// A valid copy 1 where copy 0, at the device's start, is not a whole checkpoint:
    /// something may have written over the start since (mkswap, a partition table, mkfs), and
    /// the copy LMCache left behind it does not vouch for the rest.
    Copy1Only,
}

/// A checkpoint whose capacity_bytes is more than the device exports was written on a larger
/// device: LMCache on the backing itself, before fdpblk reserved its tail. LMCache through
/// the ublk device drops entries past its new last slot (or the whole index), and a
/// `--capacity-bytes` cannot give the space back, so it is said once here.
fn capacity_past_exported(d: &crate::layout::discover::Discovered, exported: u64, backing_bytes: u64, backing: &Path) -> Option<String> {
    let theirs = d.checkpoint.as_ref()?.capacity_bytes.filter(|&c| c > exported)?;
    Some(format!(
        "LMCache's checkpoint on {} says capacity_bytes {theirs}, more than the {exported} bytes the fdpblk device exports (fdpblk keeps the backing's last {} bytes for its own state): it was written on a larger device, likely the backing itself without fdpblk. Through fdpblk LMCache has {} slots; what its index holds past them is lost when LMCache next starts",
        backing.display(),
        backing_bytes.saturating_sub(exported),
        d.geometry.max_slots
    ))
}

/// A checkpoint LMCache 0.5.6's loader throws away (another version, a field of the wrong
/// type or an unusual meta_magic): LMCache then starts empty with the layout it is configured
/// with, which may not be the checkpoint's that fdpblk takes. Said once here, with the way
/// out (`erase`: the command that zeroes the checkpoint, whose layout would otherwise
/// conflict with LMCache's flags); should they differ, LMCache's first checkpoint turns
/// deallocation off and names the conflict.
fn unloadable_checkpoint(d: &crate::layout::discover::Discovered, backing: &Path, erase: &str) -> Option<String> {
    let why = d.checkpoint.as_ref()?.loader_rejection(&d.geometry)?;
    Some(format!(
        "the LMCache checkpoint on {} is one LMCache 0.5.6 does not load ({why}): LMCache starts empty with its configured layout, and fdpblk takes the checkpoint's (slot_bytes {}, meta_total_bytes {}); if LMCache's differs, `fdpblk del` this device, erase that checkpoint (`{erase}`) and add it again with LMCache's --slot-bytes and --meta-total-bytes",
        backing.display(),
        d.geometry.slot_bytes,
        d.geometry.meta_total_bytes
    ))
}

/// Whether a discovered device still needs blkid's word, and what it shows of LMCache's:
/// None where copy 0, at the device's start, is a valid checkpoint. A copy 0 whose header
/// holds but whose JSON fails its CRC may be LMCache's torn write, or a partition table
/// written behind the header's first bytes (parted keeps bytes 0-445 of a disk's first
/// sector and puts GPT in the blocks after it): blkid tells, and finds nothing on LMCache's.
fn needs_blkid(d: &crate::layout::discover::Discovered) -> Option<Lmcache> {
    match (&d.source, &d.copies) {
        (crate::layout::discover::GeometrySource::Flags, _) => Some(Lmcache::Nothing),
        (_, Some(c)) if !c[0].is_valid() => Some(Lmcache::Copy1Only),
        _ => None,
    }
}

/// Refuses a backing that holds no LMCache checkpoint at its start ([`needs_blkid`]) but a
/// file system, partition table, RAID or LVM member (what `blkid -p` finds), unless `--force`:
/// fdpblk would write its state over the device's end and, after LMCache's first checkpoint,
/// deallocate every slot that checkpoint does not list. That is a typo in `--backing` away.
fn refuse_foreign_data(
    a: &AddArgs,
    found: Lmcache,
    is_chardev: bool,
    file: &std::fs::File,
    probe: &Option<passthrough::NsProbe>,
    backing_bytes: u64,
) -> Result<Option<std::path::PathBuf>, String> {
    let ours = read_whole_backing(a, file, probe, |r| crate::persist::state_present(r, backing_bytes)).unwrap_or(false);
    // fdpblk's state alone does not vouch for the rest: a device given a partition table or a
    // file system since it was fdpblk's keeps that state at its end (blkid looks anyway).
    // blkid reads the block device; a char device's is its namespace's.
    let target = if is_chardev { crate::nvme::path::namespace_block_device(&a.backing) } else { Some(a.backing.clone()) };
    let Some(target) = target else {
        tracing::warn!("{} has no block device to look for other data on (blkid); adding it anyway", a.backing.display());
        return Ok(None);
    };
    match foreign_signature(&target) {
        Ok(None) => Ok(None),
        // Erased (by the caller, once every other check passed), so that later starts
        // (`fdpblk up`, a restart before LMCache's first checkpoint) do not stop at the same
        // signature.
        Ok(Some(what)) if a.force => {
            tracing::info!("--force: {} holds {what}; it is erased once every other check has passed", target.display());
            Ok(Some(target))
        }
        Ok(Some(what)) => Err(format!(
            "backing {} holds {what} (blkid -p {}), and {}: fdpblk would overwrite and deallocate it. Check that this is the right device; if its data may go, erase it first (wipefs -a {}) or {}, which does that",
            a.backing.display(),
            target.display(),
            match (found, ours) {
                (Lmcache::Copy1Only, _) => "only copy 1 of an LMCache checkpoint (copy 0, at the device's start, is not a whole one)",
                (Lmcache::Nothing, true) => "no LMCache checkpoint (only fdpblk's state from an earlier use)",
                (Lmcache::Nothing, false) => "neither an LMCache checkpoint nor fdpblk's state",
            },
            target.display(),
            with_force(a)
        )),
        // Not even where fdpblk's state is there: it does not vouch for what was written
        // since (above), as README and deploy/README say.
        Err(e) if a.force => {
            tracing::warn!("--force: cannot check {} for other data ({e}); adding it anyway", target.display());
            Ok(None)
        }
        // Not knowing is not "nothing there".
        Err(e) => Err(format!(
            "cannot check backing {} for other data ({e}): fdpblk refuses a device that may hold a file system; install util-linux (blkid), or {} if its data may go",
            a.backing.display(),
            with_force(a)
        )),
    }
}

/// `read` run on the whole backing, its reserved tail included (the checks' reader stops at
/// the exported end): a namespace's through NVMe reads, else the file; `None` where the
/// namespace cannot be opened so.
fn read_whole_backing<T>(
    a: &AddArgs,
    file: &std::fs::File,
    probe: &Option<passthrough::NsProbe>,
    read: impl FnOnce(&(dyn ReadAt + Sync)) -> T,
) -> Option<T> {
    match probe {
        Some(p) => passthrough::NsReader::open(&a.backing, p.nsid, p.lba_size, p.ns_bytes, p.max_transfer).ok().map(|r| read(&r)),
        None => Some(read(file)),
    }
}

/// Refuses a backing whose reserved tail holds a newer fdpblk's own state
/// ([`crate::persist::newer_format`]), unless `--force`: this fdpblk cannot read it and would
/// start afresh over it, losing for good what that one learnt (a rollback must not cost an
/// operator that without being asked).
fn refuse_newer_state(a: &AddArgs, file: &std::fs::File, probe: &Option<passthrough::NsProbe>, backing_bytes: u64) -> Result<(), String> {
    match read_whole_backing(a, file, probe, |r| crate::persist::newer_format(r, backing_bytes)).flatten() {
        None => Ok(()),
        Some(v) if a.force => {
            tracing::warn!(
                "--force: the own state a newer fdpblk left on {} (format {v}) is started afresh: its slot history, pending deallocations and counters are lost (LMCache's data is not touched)",
                a.backing.display()
            );
            Ok(())
        }
        Some(v) => Err(format!(
            "backing {} holds fdpblk's own state in format {v}, written by a newer fdpblk (this one reads format {}): add it with that fdpblk; or, to start fdpblk's slot history, pending deallocations and counters afresh on it with this one (LMCache's data is not touched), {}",
            a.backing.display(),
            crate::persist::FORMAT,
            with_force(a)
        )),
    }
}

/// A util-linux tool by its full path (a daemon's or a user's PATH may lack the sbin
/// directories), else by name.
fn sbin_tool(name: &str) -> String {
    ["/usr/sbin", "/sbin"].iter().map(|d| format!("{d}/{name}")).find(|p| Path::new(p).exists()).unwrap_or_else(|| name.to_string())
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
fn foreign_signature(path: &Path) -> Result<Option<String>, String> {
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

/// Refuses, without `--force`, a backing whose LMCache checkpoint was written through another
/// fdpblk name (`device_path` `/dev/fdpblk/OTHER`) than the `--name` it is added under: a
/// swapped `backing` between two devices' configs (tensor-parallel ranks) would serve one
/// rank's cache to the other, whose LMCache discards the index (another `device_path`) and
/// overwrites the slots, and fdpblk then deallocates them.
fn refuse_other_name(a: &AddArgs, device_path: Option<&str>, erase: impl FnOnce() -> String) -> Result<(), String> {
    let (Some(name), Some(path)) = (&a.name, device_path) else { return Ok(()) };
    let Some(theirs) = path.strip_prefix("/dev/fdpblk/") else { return Ok(()) };
    if theirs == name || a.force {
        return Ok(());
    }
    // --force writes nothing here: the checkpoint keeps naming the other device until LMCache
    // writes one through this name, and every add before that (`up` after a reboot) asks
    // again. Erasing it is what sticks, and all a config file can do.
    let force = match a.config {
        Some(_) => String::new(),
        None => format!(
            ", or add it with --force (this add only: until LMCache writes a checkpoint through /dev/fdpblk/{name}, the next add refuses again)"
        ),
    };
    Err(format!(
        "backing {} holds the LMCache cache of /dev/fdpblk/{theirs} (its checkpoint's device_path), not of {name}: check --backing (`backing` in the device's config file); to give this cache up and use the device for {name}, erase its checkpoint ({}){force}",
        a.backing.display(),
        erase(),
    ))
}

/// The warning for a backing whose LMCache checkpoint lists entries and was written through
/// a `device_path` that LMCache on this device will not have: LMCache discards the index of
/// another path (it compares `device_path` exactly) and fdpblk then deallocates its slots.
/// With `--name`, any path but `/dev/fdpblk/NAME` (another name's is refused before); without
/// one, a path that is no fdpblk device's (`/dev/nvme1n1`: LMCache on the drive itself). A typo
/// in `--backing` that lands on a drive another LMCache uses directly looks like this, and so
/// does a drive moved under fdpblk on purpose: warned of, not refused.
fn other_path_warning(a: &AddArgs, meta: Option<&crate::layout::checkpoint_json::CheckpointMeta>) -> Option<String> {
    let meta = meta.filter(|m| m.entries > 0)?;
    let path = meta.device_path.as_deref()?;
    let backing = a.backing.display();
    let entries = meta.entries;
    if path.starts_with("/dev/fdpblk/") {
        return None;
    }
    match a.name.as_deref() {
        Some(n) if path.starts_with("/dev/ublkb") => Some(format!(
            "backing {backing} holds an LMCache cache of {entries} entries written through device_path {path}: LMCache keeps it only while its device_path stays exactly that (a ublk id can change at a restart), and pointed at /dev/fdpblk/{n} it discards that index and fdpblk then deallocates its slots"
        )),
        None if path.starts_with("/dev/ublkb") => None,
        n => Some(format!(
            "backing {backing} holds an LMCache cache of {entries} entries written through device_path {path}, not through an fdpblk device: an LMCache pointed at this one ({}) discards that index (it compares device_path exactly), and fdpblk then deallocates its slots. If another LMCache uses {backing} directly, stop this device now and check --backing (and pin it with --backing-id)",
            n.map_or("/dev/ublkbN, or /dev/fdpblk/NAME with --name".to_string(), |n| format!("/dev/fdpblk/{n}"))
        )),
    }
}

/// How to pass --force: a command-line flag only, so a device started from a config file
/// (`fdpblk up`, a systemd unit) is added once by hand with it.
fn with_force(a: &AddArgs) -> String {
    match &a.config {
        Some(c) => format!(
            "add it with --force once by hand (`fdpblk add --config {} --name {name} --force`, then `fdpblk del --name {name}`, then start it \
             as before: `fdpblk up {name}` or its systemd unit; neither the config file nor `fdpblk up` takes --force)",
            c.display(),
            name = a.name.as_deref().unwrap_or("NAME")
        ),
        None => "add it with --force".into(),
    }
}

/// `--backing-id`: the backing must be the namespace it names ([`crate::nvme::pin`]); an
/// error names where that namespace is now, if any node has it. `identify` and `find` are
/// [`crate::nvme::discover::identity_of`] and [`crate::nvme::discover::find_namespace_where`]
/// (a test's stand-ins otherwise); `kind` is the backing's (`/dev/ngXnY`: generic), whose
/// nodes are searched first.
fn check_backing_pin<E: std::fmt::Display>(
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
fn missing_backing_error(a: &AddArgs, e: &std::io::Error, find: impl Fn(&dyn Fn(&NamespaceIdentity) -> bool, DevKind) -> Option<PathBuf>) -> String {
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
fn unpinned_warning<E>(a: &AddArgs, identify: impl Fn(&Path) -> Result<Option<NamespaceIdentity>, E>) -> Option<String> {
    let file = a.config.as_ref().filter(|_| a.backing_id.is_none() && a.from_config.contains(&"backing"))?;
    if std::fs::symlink_metadata(&a.backing).is_ok_and(|m| m.file_type().is_symlink()) {
        return None;
    }
    let id = identify(&a.backing).ok()??;
    Some(format!(
        "backing {} is a kernel name, which can name another drive after a reboot; pin the namespace: add `{}` to {}",
        a.backing.display(),
        super::config_file::toml_line("backing_id", &suggested(&id).to_string()),
        file.display()
    ))
}

/// Turns `fdpblk add` arguments into a device config, checking everything first; with
/// `--force`, erases the signatures that would refuse it once every check passed.
pub fn validate(a: &AddArgs) -> Result<DeviceConfig, String> {
    let (cfg, to_wipe) = check(a)?;
    erase_signatures(to_wipe)?;
    Ok(cfg)
}

/// What `--force` erases, once nothing else can refuse the device (the ublk driver too).
fn erase_signatures(to_wipe: Option<PathBuf>) -> Result<(), String> {
    match to_wipe {
        Some(target) => {
            tracing::warn!("--force: erasing the signatures on {} (wipefs -a)", target.display());
            wipe_signatures(&target)
        }
        None => Ok(()),
    }
}

/// [`validate`] without the erasing: the config, and the path whose signatures `--force`
/// erases if the add goes ahead.
fn check(a: &AddArgs) -> Result<(DeviceConfig, Option<PathBuf>), String> {
    // The flags alone first: nothing is opened, let alone erased, for a typo.
    let policy = policy_by_name(&a.policy)
        .ok_or_else(|| format!("unknown --policy {}; choose one of {}", a.policy, POLICY_NAMES.join(", ")))?;
    if a.number < -1 {
        return Err(format!("-n {}: give a device id (0, 1, ...) or -1 to let the driver choose", a.number));
    }
    // A payload waits this long for its header with its queue slot held: seconds would stall LMCache.
    if a.header_wait_us > 1_000_000 {
        return Err(format!("--header-wait-us {}: at most 1000000 (one second); the default is 5000", a.header_wait_us));
    }
    // Own state is written as it changes: every few ms would be a stream of small writes.
    if a.persist_interval_ms != 0 && a.persist_interval_ms < 50 {
        return Err(format!(
            "--persist-interval-ms {}: 0 (only when the device starts and stops) or at least 50; the default is 5000",
            a.persist_interval_ms
        ));
    }
    use crate::frontend::config::{MAX_DEPTH, MAX_QUEUES};
    if a.queues == 0 || a.queues > MAX_QUEUES {
        return Err(format!("--queues must be 1..={MAX_QUEUES}"));
    }
    if a.depth == 0 || a.depth > MAX_DEPTH {
        return Err(format!("--depth must be 1..={MAX_DEPTH}"));
    }
    if a.io_buf_size < 4096 || !a.io_buf_size.is_power_of_two() || a.io_buf_size > 32 << 20 {
        return Err("--io-buf-size must be a power of two from 4K to 32M".into());
    }
    if let Some(n) = &a.name {
        state::check_new_name(n).map_err(|e| format!("--name {e}"))?;
    }
    let meta = std::fs::metadata(&a.backing)
        .map_err(|e| missing_backing_error(a, &e, |is, kind| crate::nvme::discover::find_namespace_where(is, kind)))?;
    let is_bdev = meta.file_type().is_block_device();
    let is_chardev = meta.file_type().is_char_device();
    if !is_bdev && !is_chardev && !meta.file_type().is_file() {
        return Err(format!("backing {} is neither a block device nor a file; pass an NVMe namespace (/dev/nvmeXnY, /dev/ngXnY) or a file", a.backing.display()));
    }
    if is_bdev {
        if let Some(id) = ublk_disk_of(meta.rdev()) {
            return Err(ublk_backing_error(&a.backing, id, state::read_state(id).ok().map(|(c, _)| c.backing)));
        }
    }
    // Before anything else reads the backing: a wrong drive is named as such.
    let kind = if is_chardev { DevKind::Generic } else { DevKind::Block };
    check_backing_pin(a, kind, crate::nvme::discover::identity_of, |is, kind| crate::nvme::discover::find_namespace_where(is, kind))?;
    let partition = if is_bdev { partition_of(meta.rdev()) } else { None };
    let engine = match a.engine.as_str() {
        // A char device can only be driven by passthrough (which refuses one that is not NVMe).
        "auto" if is_chardev => EngineKind::Passthrough,
        "auto" if is_bdev && sysfs_queue_attr(&a.backing, "max_write_streams").unwrap_or(0) > 0 => EngineKind::Streams,
        "auto" => {
            if let (Some(disk), true) = (&partition, policy.handles() > 1) {
                return Err(partition_error(&a.backing, disk));
            }
            if policy.handles() > 1 {
                return Err(format!(
                    "{} offers no FDP placement (no write streams: needs an FDP drive with one reclaim group and Linux >= 6.16); use --policy none, or --engine plain to run without placement; on an FDP drive with an older kernel, pass its char device /dev/ngXnY as --backing (NVMe passthrough)",
                    a.backing.display()
                ));
            }
            EngineKind::Plain
        }
        e => EngineKind::parse(e).ok_or_else(|| format!("unknown --engine {e}; choose auto, passthrough, streams or plain"))?,
    };
    if is_chardev && engine != EngineKind::Passthrough {
        let block = crate::nvme::path::namespace_block_device(&a.backing)
            .map_or_else(|| "the namespace's block device (/dev/nvmeXnY)".to_string(), |b| b.display().to_string());
        return Err(format!(
            "--engine {} needs a block device, and {} is a char device: use {block} as --backing, or --engine passthrough on {}",
            a.engine,
            a.backing.display(),
            a.backing.display()
        ));
    }
    let mut probe = None;
    if engine == EngineKind::Passthrough {
        if !is_chardev {
            return Err(format!(
                "--engine passthrough needs an NVMe generic char device (/dev/ngXnY); {} is not one (use --engine streams or plain on a block device)",
                a.backing.display()
            ));
        }
        probe = Some(passthrough::probe(&a.backing, &a.policy, policy.handles())?);
    }
    let mut streams = Vec::new();
    if engine == EngineKind::Streams {
        if !is_bdev {
            return Err(format!("--engine streams needs an NVMe block device (/dev/nvmeXnY); {} is not one", a.backing.display()));
        }
        if let Some(disk) = &partition {
            return Err(partition_error(&a.backing, disk));
        }
        let max = sysfs_queue_attr(&a.backing, "max_write_streams").unwrap_or(0);
        if max == 0 {
            return Err(format!(
                "{} has no write streams (max_write_streams is 0 or absent): it needs an FDP-enabled drive with one reclaim group and Linux >= 6.16; on an older kernel use --engine passthrough on /dev/ngXnY, otherwise --engine plain",
                a.backing.display()
            ));
        }
        if u64::from(policy.handles()) > max {
            return Err(format!(
                "policy {} needs {} placement handles but {} has {max}; use a policy with fewer handles",
                a.policy,
                policy.handles(),
                a.backing.display()
            ));
        }
        // Stream N writes to the drive's placement identifier N-1 (RUH Status order).
        streams = (1..=policy.handles()).map(|h| h as u8).collect();
    } else if engine == EngineKind::Plain && policy.handles() > 1 {
        tracing::warn!("engine plain: placement is off, every write goes to the drive's default handle");
    }
    if !is_bdev && !meta.file_type().is_file() && probe.is_none() {
        return Err(format!("backing {} is neither a block device nor a file", a.backing.display()));
    }
    let file = std::fs::File::open(&a.backing).map_err(|e| {
        let root = if e.kind() == std::io::ErrorKind::PermissionDenied { "; run as root" } else { "" };
        format!("cannot open backing {}: {e}{root}", a.backing.display())
    })?;
    // A char device has no BLKGETSIZE64 or pread: its size and blocks come from Identify.
    let backing_bytes = match &probe {
        Some(p) => p.ns_bytes,
        None => ReadAt::size(&file).map_err(|e| format!("size of {}: {e}", a.backing.display()))?,
    };
    let lba = match &probe {
        Some(p) => u64::from(p.lba_size),
        None if is_bdev => lba_bytes(&file),
        // A file is opened O_DIRECT where its file system allows: requests must then be
        // aligned as that file system needs.
        None => match crate::device::file_dio_block_bytes(&file) {
            b if b <= 4096 && b.is_power_of_two() => b,
            b => {
                return Err(format!(
                    "backing file {} needs O_DIRECT I/O aligned to {b} bytes, more than the 4096-byte blocks a ublk device can have; put it on another file system or use a block device",
                    a.backing.display()
                ))
            }
        },
    };
    if let Some(e) = block_size_error(lba, &a.backing) {
        return Err(e);
    }
    let exported = exported_bytes(backing_bytes, lba).ok_or_else(|| {
        format!(
            "backing {} ({backing_bytes} bytes) is too small: fdpblk reserves {} bytes at its end for its own state; use a device larger than that plus LMCache's meta_total_bytes and one slot_bytes",
            a.backing.display(),
            reserved_tail_bytes(backing_bytes)
        )
    })?;
    refuse_newer_state(a, &file, &probe, backing_bytes)?;
    let source: Box<dyn ReadAt + '_> = match &probe {
        Some(p) => Box::new(
            passthrough::NsReader::open(&a.backing, p.nsid, p.lba_size, exported, p.max_transfer)
                .map_err(|e| format!("cannot open backing {}: {e}", a.backing.display()))?,
        ),
        None => Box::new(Exported(&file, exported)),
    };
    let flags = a.geometry.flags();
    // What --force erases, once nothing else can refuse the device.
    let mut to_wipe = None;
    // A discovered layout, under either --layout: refused if its cache is another device's
    // or what blkid finds is not LMCache's; what --force then erases.
    let discovered = |d: &crate::layout::discover::Discovered| -> Result<Option<PathBuf>, String> {
        let device_path = d.checkpoint.as_ref().and_then(|m| m.device_path.as_deref());
        refuse_other_name(a, device_path, || erase_checkpoint_command(d.geometry.meta_total_bytes, &a.backing, is_bdev, is_chardev))?;
        if let Some(w) = other_path_warning(a, d.checkpoint.as_ref()) {
            tracing::warn!("{w}");
        }
        let wipe = match needs_blkid(d) {
            Some(found) => refuse_foreign_data(a, found, is_chardev, &file, &probe, backing_bytes)?,
            None => None,
        };
        if let Some(w) = capacity_past_exported(d, exported, backing_bytes, &a.backing) {
            tracing::warn!("{w}");
        }
        let erase = erase_checkpoint_command(d.geometry.meta_total_bytes, &a.backing, is_bdev, is_chardev);
        if let Some(w) = unloadable_checkpoint(d, &a.backing, &erase) {
            tracing::warn!("{w}");
        }
        if let Some(g) = crate::layout::discover::torn_copy_layout(&*source, &flags, d) {
            // No erase named: what is stale depends on what LMCache writes next, which a new
            // `add` sees (and names, if anything must go).
            tracing::warn!(
                "copy 0 of the LMCache checkpoint on {} is half-written (its JSON fails its CRC) and names another layout (slot_bytes {}, meta_total_bytes {}) than copy 1, which fdpblk takes (slot_bytes {}, meta_total_bytes {}): LMCache may be writing, or have crashed writing, its first checkpoint with a new layout, which it then runs with; if so, `fdpblk del` this device and add it again once LMCache has written a whole checkpoint (or with LMCache's --slot-bytes and --meta-total-bytes)",
                a.backing.display(),
                g.slot_bytes,
                g.meta_total_bytes,
                d.geometry.slot_bytes,
                d.geometry.meta_total_bytes
            );
        }
        Ok(wipe)
    };
    let geometry = match a.layout.as_str() {
        "auto" => match discover(&*source, &flags) {
            Ok(d) => {
                to_wipe = discovered(&d)?;
                Some(d.geometry)
            }
            // Learned from LMCache's first checkpoint while serving (`frontend::learn`).
            // Half a layout is a typo or a line left out of a config file, not a wish to learn.
            Err(DiscoverError::NoCheckpoint { missing }) if flags.slot_bytes.is_some() || flags.meta_total_bytes.is_some() => {
                let given = if flags.slot_bytes.is_some() { "--slot-bytes" } else { "--meta-total-bytes" };
                return Err(format!(
                    "{given} is given but {missing} is not, and {} has no LMCache checkpoint to take it from: pass {missing} (LMCache's value), or neither flag to learn the layout from LMCache's first checkpoint",
                    a.backing.display()
                ));
            }
            Err(DiscoverError::NoCheckpoint { missing }) => {
                to_wipe = refuse_foreign_data(a, Lmcache::Nothing, is_chardev, &file, &probe, backing_bytes)?;
                // `list` and `stats` say `learning`; the daemon's log says it too.
                tracing::debug!(
                    "no LMCache checkpoint on {} yet: fdpblk learns the layout from LMCache's first one (pass {missing} to place from the first write)",
                    a.backing.display()
                );
                None
            }
            Err(e) => return Err(with_erase_hint(e, &a.backing, is_bdev, is_chardev)),
        },
        "lmcache" => {
            let (Some(slot_bytes), Some(meta_total_bytes)) = (flags.slot_bytes, flags.meta_total_bytes) else {
                return Err("--layout lmcache needs --slot-bytes and --meta-total-bytes".into());
            };
            let from_flags = || {
                GeometryConfig {
                    block_align: flags.block_align.unwrap_or(DEFAULT_BLOCK_ALIGN),
                    header_bytes: flags.header_bytes.unwrap_or(DEFAULT_HEADER_BYTES),
                    slot_bytes,
                    meta_total_bytes,
                    capacity_bytes: flags.capacity_bytes.unwrap_or(0),
                }
                .validate(exported)
                .map_err(|e| e.to_string())
            };
            // A checkpoint already on the device must agree with the flags, and gives the
            // fields they leave out (LMCache's header_bytes, block_align and capacity_bytes,
            // not the defaults). Other errors too, as under `--layout auto`: a checkpoint
            // that cannot be read or does not fit the device is not a layout to serve on the
            // flags' word.
            match discover(&*source, &flags) {
                Ok(d) => {
                    to_wipe = discovered(&d)?;
                    // Without a checkpoint, the flags' layout with the same defaults.
                    Some(d.geometry)
                }
                Err(DiscoverError::NoCheckpoint { .. }) => {
                    to_wipe = refuse_foreign_data(a, Lmcache::Nothing, is_chardev, &file, &probe, backing_bytes)?;
                    Some(from_flags()?)
                }
                // LMCache's (its CRC holds), past what fdpblk parses: the error under `auto`
                // sends the operator here. Served on the flags; the state thread cannot read
                // it either, so nothing is deallocated while it stands.
                Err(DiscoverError::Unparsable(e)) => {
                    tracing::warn!(
                        "LMCache's checkpoint on {} is beyond what fdpblk parses ({e}): serving the layout of the flags, unchecked against it (device_path too); fdpblk deallocates nothing until LMCache replaces it with one it can read",
                        a.backing.display()
                    );
                    Some(from_flags()?)
                }
                Err(e) => return Err(with_erase_hint(e, &a.backing, is_bdev, is_chardev)),
            }
        }
        l => return Err(format!("unknown --layout {l}; use auto or lmcache")),
    };
    let io_buf = a.io_buf_size;
    // Passthrough commands are not split by the block layer: no request may exceed one.
    let io_buf = match &probe {
        Some(p) if io_buf > u64::from(p.max_transfer) => {
            let cap = 1u64 << (63 - u64::from(p.max_transfer).leading_zeros());
            tracing::debug!("--io-buf-size {io_buf} capped at {cap}: the largest NVMe transfer of {}", a.backing.display());
            cap
        }
        _ => io_buf,
    };
    if let Some(e) = crate::device::mem_total_bytes().and_then(|m| buffer_memory_error(a.queues, a.depth, io_buf, m)) {
        return Err(e);
    }
    if let Some(e) = geometry.and_then(|g| crate::frontend::target::layout_error(&g, lba, &a.backing)) {
        return Err(e);
    }
    // Checked at every daemon start: the path may come to name another namespace or file.
    let backing_identity = target::backing_identity(&a.backing).map_err(|e| {
        format!("cannot identify backing {} ({e}), which a restarting daemon checks is still the same one", a.backing.display())
    })?;
    if let Some(w) = no_deallocation_warning(&passthrough::CommandLimits::of(&a.backing), engine == EngineKind::Passthrough, !a.no_trim, &a.backing) {
        tracing::warn!("{w}");
    }
    let cfg = DeviceConfig {
        id: a.number,
        name: a.name.clone(),
        backing: std::fs::canonicalize(&a.backing).unwrap_or_else(|_| a.backing.clone()),
        engine,
        policy: a.policy.clone(),
        queues: a.queues,
        depth: a.depth,
        io_buf_bytes: io_buf as u32,
        lba_shift: lba.trailing_zeros() as u8,
        backing_bytes,
        backing_identity,
        exported_bytes: exported,
        geometry,
        layout_flags: flags,
        streams,
        pids: probe.map(|p| p.pids).unwrap_or_default(),
        header_wait_us: a.header_wait_us,
        trim: !a.no_trim,
        early_tails: !a.no_trim && !a.no_early_tails,
        early_evictions: !a.no_trim && !a.no_early_evictions,
        persist_interval_ms: a.persist_interval_ms,
    };
    Ok((cfg, to_wipe))
}

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
fn daemonize(foreground: bool, body: impl FnOnce(Box<dyn FnOnce(Result<i32, String>) + Send>) -> Result<(), String>) -> CmdResult {
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
            super::up::notify_ready(id); // systemd Type=notify; nothing outside systemd
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
            super::daemon_log::redirect(Path::new(state::RUN_DIR));
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

fn need_ublk_driver() -> Result<(), String> {
    if Path::new(target::UBLK_CONTROL).exists() {
        Ok(())
    } else {
        Err("no ublk driver: /dev/ublk-control is missing; run `modprobe ublk_drv` (Linux >= 6.0 with CONFIG_BLK_DEV_UBLK)".into())
    }
}

pub fn add(a: &AddArgs) -> CmdResult {
    add_device(a).map_err(|e| super::config_file::name_config_keys(with_limit_fix(e.to_string()), a).into())
}

/// `e` with the fix for running out of file descriptors, which any step of the set-up can hit
/// (the backing, the ublk char device, each queue's rings and eventfds).
fn with_limit_fix(e: String) -> String {
    if e.contains("(os error 24)") || e.contains("(os error 23)") {
        format!("{e}; raise the open-files limit (ulimit -n; LimitNOFILE= in a systemd unit)")
    } else {
        e
    }
}

/// Raises the open-files limit to what `queues` queues need, as far as it may: a daemon
/// started with a low `ulimit -n` would otherwise fail somewhere in its set-up. Each queue
/// holds its ublk ring, its engine's ring and eventfds; a few more are the device's own.
fn raise_fd_limit(queues: u16) {
    let want = 64 + 16 * u64::from(queues);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 || lim.rlim_cur >= want {
            return;
        }
        // Above the hard limit only with CAP_SYS_RESOURCE (root has it); else up to it.
        let raised = libc::rlimit { rlim_cur: want, rlim_max: lim.rlim_max.max(want) };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
            let capped = libc::rlimit { rlim_cur: want.min(lim.rlim_max), rlim_max: lim.rlim_max };
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &capped);
        }
    }
}

fn add_device(a: &AddArgs) -> CmdResult {
    raise_fd_limit(a.queues);
    // The name first: a device of the same name whose daemon died is named with `recover`,
    // where the id's message would name `del`, which fails LMCache's held I/O.
    if let Some(name) = &a.name {
        // Two devices under one name would point LMCache's device_path at the wrong backing.
        match super::up::find(name) {
            // Killed (or stopping): the driver may hold LMCache's I/O for its recovery, which
            // `del` would fail.
            super::up::Found::Running { id, pid } if exiting(pid) => {
                return Err(format!(
                    "--name {name} is taken by {}, whose daemon (pid {pid}) is exiting (NVMe commands in flight); once it is gone, `fdpblk up {name}` recovers the device (or adds it again)",
                    state::bdev_path(id)
                )
                .into())
            }
            super::up::Found::Running { id, .. } => {
                return Err(format!("--name {name} is taken by {}; pick another name or `fdpblk del -n {id}` first", state::bdev_path(id)).into())
            }
            // Its daemon died while stopping it: nothing is held for a recovery.
            super::up::Found::Orphaned { id } if ublk_stopped(id) => {
                return Err(format!(
                    "--name {name} is taken by {}, which its daemon stopped before it died: `fdpblk del -n {id}` deletes it, then add again (`fdpblk up {name}` does both)",
                    state::bdev_path(id)
                )
                .into())
            }
            super::up::Found::Orphaned { id } => {
                return Err(format!(
                    "--name {name} is taken by {}, whose daemon died; `fdpblk recover -n {id}` (or `fdpblk up {name}`) brings it back, `fdpblk del -n {id}` deletes it",
                    state::bdev_path(id)
                )
                .into())
            }
            super::up::Found::Stale { cfg } => super::up::remove_stale(&cfg),
            super::up::Found::None => {}
        }
    }
    if a.number >= 0 && target::device_exists(a.number) {
        return Err(target::id_exists(a.number).into());
    }
    if let Some(e) = backing_in_use(&a.backing) {
        return Err(e.into());
    }
    // The daemon's lock refuses a second add only once its checks passed, after --force
    // erased signatures: on a file a daemon serves, those of the data it serves.
    if let Some(e) = backing_served(&a.backing).filter(|_| a.force) {
        return Err(format!("--force: {e}; nothing was erased").into());
    }
    // The driver last: a typo in the arguments is worth hearing before `modprobe`.
    let (cfg, to_wipe) = check(a)?;
    // After the checks of the backing (a ublk device given as one, another namespace than
    // --backing-id names), which name the right fix.
    if let Some(e) = other_writers(&a.backing, OTHER_WRITER_WAIT) {
        return Err(e.into());
    }
    need_ublk_driver()?;
    erase_signatures(to_wipe)?;
    daemonize(a.foreground, move |notify| target::run(cfg, false, notify))
}

/// Block device `rdev`'s sysfs directory, and whether it is a partition (listed under its disk).
fn sysfs_block(rdev: u64) -> Option<(PathBuf, bool)> {
    let dir = crate::device::sysfs_block_dir(rdev)?;
    let partition = dir.join("partition").exists();
    Some((dir, partition))
}

/// The disk a partition is on (`nvme0n1` for `nvme0n1p2`); None for a whole disk.
fn partition_of(rdev: u64) -> Option<String> {
    let (dir, true) = sysfs_block(rdev)? else { return None };
    dir.parent()?.file_name()?.to_str().map(str::to_string)
}

/// FDP placement on a partition: write streams are the whole disk's, and passthrough
/// addresses the namespace's LBAs, so neither reaches a partition.
fn partition_error(backing: &Path, disk: &str) -> String {
    format!(
        "{} is a partition of /dev/{disk}, and FDP placement (write streams, NVMe passthrough) works on a whole namespace only: give fdpblk the whole namespace (/dev/{disk}, or its char device for passthrough; its partition table and every partition then go to fdpblk), or run on the partition without placement (--policy none, or --engine plain)",
        backing.display()
    )
}

/// The ublk device (`/dev/ublkbN`) block device `rdev` is, or is a partition of.
fn ublk_disk_of(rdev: u64) -> Option<i32> {
    let (dir, partition) = sysfs_block(rdev)?;
    let disk = if partition { dir.parent()? } else { &dir };
    state::ublk_disk_id(disk.file_name()?.to_str()?)
}

/// A ublk device as a backing: an fdpblk device's is the path LMCache writes to, and a new
/// device on it would put its own state and deallocations over that device's cache.
fn ublk_backing_error(backing: &Path, id: i32, under: Option<PathBuf>) -> String {
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

/// Names the fdpblk device a running daemon serves on `backing`, if any: by the state files,
/// else by an fdpblk process holding the backing open (its state file gone with `/run`).
fn backing_served(backing: &Path) -> Option<String> {
    let by_state = state::state_ids().into_iter().find_map(|id| {
        let read = state::read_state(id);
        let (cfg, _) = read.as_ref().ok()?;
        if !same_backing(backing, &cfg.backing) {
            return None;
        }
        let daemon = serving_daemon(id, &read)?;
        Some(format!(
            "backing {} is served by {} (daemon pid {daemon}); stop it first (`fdpblk del -n {id}`)",
            backing.display(),
            state::bdev_path(id)
        ))
    });
    by_state.or_else(|| {
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
const OTHER_WRITER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A program other than fdpblk holding the namespace open for writing through either of its
/// nodes (LMCache pointed at the drive itself, fio, a passthrough tool): its writes would land
/// over LMCache's slots and fdpblk's own state, and the daemon's exclusive open sees none of
/// them (only exclusive holders conflict, and a char device cannot be claimed). Readers
/// (blktrace) are no harm. Waits `wait` for a passing one. fdpblk's own processes are left
/// to the daemon's lock, which names the device they serve.
fn other_writers(backing: &Path, wait: std::time::Duration) -> Option<String> {
    let meta = std::fs::metadata(backing).ok()?;
    if !meta.file_type().is_block_device() && !meta.file_type().is_char_device() {
        return None;
    }
    let other = crate::nvme::path::namespace_other_node(backing);
    let nodes: Vec<&Path> = std::iter::once(backing).chain(other.as_deref()).collect();
    let find = || -> Vec<String> {
        nodes
            .iter()
            .flat_map(|n| state::writers(n).into_iter().filter(|(_, comm)| !comm.starts_with("fdpblk")).map(move |(pid, comm)| format!("{comm} (pid {pid}) on {}", n.display())))
            .collect()
    };
    let start = std::time::Instant::now();
    loop {
        let found = find();
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
fn backing_in_use(backing: &Path) -> Option<String> {
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

/// Whether process `pid` is exiting: its main thread is a zombie while other threads still
/// wait (in NVMe ioctls, say).
pub(crate) fn exiting(pid: u32) -> bool {
    state::state_letter(&format!("/proc/{pid}/stat")) == Some('Z')
}

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

/// Whether device `id` is stopped (neither live nor held for recovery).
pub(crate) fn ublk_stopped(id: i32) -> bool {
    target::ublk_ctrl(id).is_ok_and(|c| u32::from(c.dev_info().state) == sys::UBLK_S_DEV_DEAD)
}

/// The ids of every ublk device, from the driver's char devices in sysfs.
fn ublk_ids() -> Vec<i32> {
    let mut ids: Vec<i32> = std::fs::read_dir("/sys/class/ublk-char")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
        .collect();
    ids.sort_unstable();
    ids
}

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
        (None, false, Some(name)) => match super::up::find(name) {
            Found::Running { id, .. } | Found::Orphaned { id } => vec![id],
            Found::Stale { cfg } => vec![cfg.id],
            // What fdpblk-release@ runs after its unit gave up: a unit whose adds were all
            // refused left no device, and there is nothing to release. Not where the name's
            // link leads to a device whose state file does not read: that may be it, held
            // with LMCache's I/O.
            Found::None if a.if_orphaned && super::up::linked_unreadable(name).is_none() => {
                say_out(format_args!("no fdpblk device named {name}: nothing to delete"));
                return Ok(());
            }
            Found::None => {
                return Err(match super::up::linked_unreadable(name) {
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
                super::up::remove_stale(c);
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

/// The processes that hold `dev` open, but `skip`: "name (pid N)" each.
fn holders(dev: &Path, skip: Option<u32>) -> Vec<String> {
    state::openers(dev).into_iter().filter(|&(pid, _)| Some(pid) != skip).map(|(pid, comm)| format!("{comm} (pid {pid})")).collect()
}

/// The driver's state of device `id` (one word) and what an operator can do about it.
fn dev_state(id: i32, name: Option<&str>) -> (&'static str, Option<String>) {
    match target::ublk_ctrl(id).map(|c| u32::from(c.dev_info().state)) {
        Ok(sys::UBLK_S_DEV_LIVE) => ("live", None),
        Ok(s @ (sys::UBLK_S_DEV_QUIESCED | sys::UBLK_S_DEV_FAIL_IO)) => (
            if s == sys::UBLK_S_DEV_QUIESCED { "quiesced" } else { "fail-io" },
            Some(format!(
                "its daemon died: `fdpblk recover -n {id}` brings it back (under systemd: `systemctl reset-failed fdpblk@{0}; systemctl start fdpblk@{0}`)",
                name.unwrap_or("NAME")
            )),
        ),
        Ok(_) => ("dead", Some(format!("stopped: `fdpblk del -n {id}` deletes it"))),
        Err(_) if !target::device_exists(id) => ("gone", None),
        Err(e) => ("unknown", Some(format!("the ublk driver does not answer ({e}); run as root"))),
    }
}

/// Whose ublk device `id` is, for one that has no state file: its server's pid and name.
fn ublk_owner(id: i32) -> String {
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
enum Maker {
    Fdpblk,
    /// Another server that tags its devices.
    Other,
    /// Untagged: another server's, or one an fdpblk before the tag added.
    Unknown,
}

impl Maker {
    /// By the tag's first seven bytes (`fdpblk\0`): its last byte is a version, which a
    /// later fdpblk may raise.
    fn of(ublksrv_flags: u64) -> Maker {
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
fn ublk_server(id: i32) -> Option<(i32, String)> {
    live_server(&target::ublk_ctrl(id).ok()?.dev_info())
}

/// [`ublk_server`] of the device info read already.
fn live_server(info: &sys::ublksrv_ctrl_dev_info) -> Option<(i32, String)> {
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

pub fn list(a: &ListArgs) -> CmdResult {
    let mut out = Vec::new();
    let known = state::state_ids();
    for &id in &known {
        let read = state::read_state(id);
        let (st, mut hint) = dev_state(id, read.as_ref().ok().and_then(|(c, _)| c.name.as_deref()));
        // Not "recover it" where the device is another server's by now.
        if let Some(whose) = read.as_ref().ok().and_then(|(_, d)| foreign_server(id, d)) {
            hint = Some(format!("ublk device {id} {whose}: this state file is left over; `fdpblk del -n {id}` removes it"));
        }
        // The daemon that serves it, which may not be the one its file names yet.
        let serving = read.as_ref().ok().and_then(|_| serving_daemon(id, &read));
        let (cfg, pid) = match read {
            Ok(s) => s,
            Err(e) => {
                // Listed, not hidden: its device may still run (or be deleted with `del`).
                out.push(json!({"id": id, "device": state::bdev_path(id), "state": st, "error": e, "hint": format!("`fdpblk del -n {id}` removes it")}));
                continue;
            }
        };
        let mut v = cfg.to_json();
        v["state"] = json!(st);
        v["hint"] = json!(hint);
        v["pid"] = json!(serving.unwrap_or(pid).pid);
        v["device"] = json!(state::bdev_path(id));
        out.push(v);
    }
    // A ublk device with no state file: another server's, or fdpblk's after its state went
    // (a cleared /run). Listed so that it is not invisible while it holds a device number.
    for id in ublk_ids().into_iter().filter(|id| !known.contains(id)) {
        out.push(json!({
            "id": id,
            "device": state::bdev_path(id),
            "state": dev_state(id, None).0,
            "error": format!("no state file in {}", state::RUN_DIR),
            "hint": ublk_owner(id),
        }));
    }
    if a.json {
        println!("{}", serde_json::Value::Array(out));
    } else if out.is_empty() {
        println!("no fdpblk devices");
    } else {
        for v in out {
            let hint = v["hint"].as_str().map(|h| format!("  ({h})")).unwrap_or_default();
            if let Some(e) = v["error"].as_str() {
                println!("{}  {}  {e}{hint}", v["device"].as_str().unwrap_or(""), v["state"].as_str().unwrap_or(""));
                continue;
            }
            println!(
                "{}  name {}  backing {}  engine {}  policy {}  slot_bytes {}  meta_total_bytes {}  {}{hint}",
                v["device"].as_str().unwrap_or(""),
                v["name"].as_str().unwrap_or("-"),
                v["backing"].as_str().unwrap_or(""),
                v["engine"].as_str().unwrap_or(""),
                v["policy"].as_str().unwrap_or(""),
                if v["geometry"].is_null() { "learning".into() } else { v["geometry"]["slot_bytes"].to_string() },
                if v["geometry"].is_null() { "learning".into() } else { v["geometry"]["meta_total_bytes"].to_string() },
                v["state"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}

/// The daemon's stats file, a JSON object (`stats` adds fields to it; indexing anything else
/// would panic).
fn parse_stats(p: &Path, text: &str) -> Result<serde_json::Value, String> {
    // The daemon rewrites it every half second (atomically): a corrupt one is not fdpblk's.
    let corrupt = |e: &dyn std::fmt::Display| format!("{} is corrupt ({e}); the daemon rewrites it within a second if it runs, see `fdpblk list`", p.display());
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(corrupt(&"not a JSON object")),
        Err(e) => Err(corrupt(&e)),
    }
}

pub fn stats(a: &IdArgs, json_out: bool) -> CmdResult {
    let p = state::stats_path(a.number);
    let text = std::fs::read_to_string(&p).map_err(|e| format!("no stats for device {} ({}: {e}); is it running? see `fdpblk list`", a.number, p.display()))?;
    let mut v = parse_stats(&p, &text)?;
    let read = state::read_state(a.number);
    // A daemon that died leaves its last figures behind (they stay for `recover`): say so.
    let serving = read.as_ref().ok().and_then(|_| serving_daemon(a.number, &read));
    let daemon_up = serving.is_some();
    // The daemon recovering the device serves before it writes its own stats.
    let previous = serving.filter(|d| !d.wrote_stats(&v));
    let saved = read.ok();
    let name = saved.as_ref().and_then(|(cfg, _)| cfg.name.clone());
    v["daemon_up"] = json!(daemon_up);
    v["stats_of_serving_daemon"] = json!(daemon_up && previous.is_none());
    let age_s = std::fs::metadata(&p).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).map(|d| d.as_secs());
    v["stats_age_s"] = json!(age_s);
    // The drive's own counters since `add`: host vs media bytes (QEMU's drive has no GC).
    // In a child with a deadline: a hung drive must not hold the command (nor its figures).
    let (fdp, drive_error) = match saved.map(|(cfg, _)| state::fdp_deltas_within(&cfg, state::DRIVE_READ_DEADLINE)) {
        Some(Ok(f)) => (f, None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    v["fdp"] = fdp.clone().unwrap_or(serde_json::Value::Null);
    if let Some(e) = &drive_error {
        v["fdp_error"] = json!(e);
    }
    if json_out {
        println!("{v}");
        return Ok(());
    }
    if !daemon_up {
        println!(
            "DAEMON NOT RUNNING: these are its last figures, {} s old; `fdpblk list` shows the device's state",
            age_s.map_or_else(|| "-".to_string(), |a| a.to_string())
        );
    }
    if let Some(d) = previous {
        println!(
            "PREVIOUS DAEMON'S FIGURES (pid {}), {} s old: the daemon now serving the device (pid {d}) has not written its own yet; ask again in a second",
            v["pid"],
            age_s.map_or_else(|| "-".to_string(), |a| a.to_string())
        );
    }
    println!("device {}  engine {}  policy {}", state::bdev_path(a.number), v["engine"].as_str().unwrap_or(""), v["policy"].as_str().unwrap_or(""));
    if let Some(age) = v["state_age_s"].as_f64().filter(|&a| daemon_up && a >= STATE_AGE_HELD_UP_S) {
        println!("STATE THREAD HELD UP: its figures below (checkpoint, slots, deallocation) are {age:.0} s old; it refreshes them at least once a second");
    }
    let l = &v["layout"];
    if let (Some(c), Some(s)) = (l["half_written"]["copy"].as_u64(), l["half_written"]["for_s"].as_u64()) {
        println!(
            "LAYOUT WAITING: LMCache's checkpoint copy {c} has been half-written (its JSON fails its CRC) for {s} s; the layout is learned from LMCache's next whole checkpoint, and {} writes ({} bytes) so far are neither placed by key nor deallocated",
            l["writes_before_layout"], l["bytes_before_layout"]
        );
    } else if l["state"] == "learning" && l["refused"].is_null() {
        println!(
            "LAYOUT LEARNING: no LMCache checkpoint seen yet; {} writes ({} bytes) so far are neither placed by key nor deallocated",
            l["writes_before_layout"], l["bytes_before_layout"]
        );
    }
    if let Some(r) = l["refused"].as_str() {
        println!("LAYOUT REFUSED: {r}");
    }
    let p = &v["pipeline"];
    println!("{:<20} {:>10} {:>16}", "class", "requests", "bytes");
    if let Some(c) = p["classes"].as_object() {
        for (k, n) in c {
            println!("{k:<20} {:>10} {:>16}", n["requests"].as_u64().unwrap_or(0), n["bytes"].as_u64().unwrap_or(0));
        }
    }
    println!("{:<20} {:>16}", "handle", "bytes written");
    if let Some(h) = p["handles"].as_object() {
        for (k, b) in h {
            println!("{k:<20} {:>16}", b.as_u64().unwrap_or(0));
        }
    }
    println!("header waits {}  payload fallbacks {}", p["header_waits"], p["payload_fallbacks"]);
    if let Some(q) = v["queues"].as_array() {
        let per = |k: &str| q.iter().map(|n| n[k].as_u64().unwrap_or(0).to_string()).collect::<Vec<_>>().join(" / ");
        println!("requests per queue {}  most tags waiting for headers at once {}", per("requests"), per("header_wait_peak"));
        let longest_ms = |n: &serde_json::Value| format!("{:.1}", n["held_longest_us"].as_u64().unwrap_or(0) as f64 / 1e3);
        println!(
            "requests held for deallocations per queue {} (longest ms {})",
            per("held_for_trims"),
            q.iter().map(longest_ms).collect::<Vec<_>>().join(" / ")
        );
        if q.iter().any(|n| n["errors"].as_u64().unwrap_or(0) > 0) {
            let last: Vec<&str> = q.iter().filter_map(|n| n["last_error"].as_str()).collect();
            println!("FAILED REQUESTS per queue {} (last: {}); the daemon's log has them", per("errors"), last.join(" / "));
        }
    }
    if let Some(e) = &drive_error {
        println!("DRIVE NOT ANSWERING: {e}");
    }
    if let Some(f) = fdp {
        println!(
            "drive since add{}: host {} bytes, media {} bytes (ratio {}), erased {} bytes",
            if f["drive_stats_reset"] == true { " (since its statistics were reset)" } else { "" },
            f["host_bytes"],
            f["media_bytes"],
            f["media_host_ratio"].as_f64().map_or_else(|| "-".to_string(), |r| format!("{r:.3}")),
            f["erased_bytes"]
        );
    }
    print_watch(&v);
    if !daemon_up {
        // A script that reads only the exit status must not take a dead device for a live one.
        if !target::device_exists(a.number) {
            return Err(format!(
                "the daemon of device {0} is not running and the device is gone (its state file is left over): `fdpblk del -n {0}` removes it",
                a.number
            )
            .into());
        }
        let how = match &name {
            Some(n) => format!(
                "under systemd `systemctl reset-failed fdpblk@{n}; systemctl start fdpblk@{n}` (its own restart does it unless the unit gave up), by hand fdpblk up {n} (or fdpblk recover -n {})",
                a.number
            ),
            None => format!("fdpblk recover -n {}", a.number),
        };
        return Err(format!(
            "the daemon of device {} is not running; recover the device: {how}",
            a.number
        )
        .into());
    }
    Ok(())
}

/// Prints a line for the operator; `del` and `down` run under systemd's ExecStop with SIGPIPE
/// ignored, where a stream journald dropped must not turn a done stop into a panic.
pub(crate) fn say_out(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stdout(), "{line}");
}

/// [`say_out`] on standard error.
pub(crate) fn say_err(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `stats` flags the state thread's figures as held up from this age (it refreshes them at
/// least once a second, after a deallocation round of at most 1 s).
const STATE_AGE_HELD_UP_S: f64 = 5.0;

/// The state thread's part of the stats: LMCache's checkpoints, slots, deallocation.
fn print_watch(v: &serde_json::Value) {
    if v.get("checkpoint_cap_bytes").is_none() {
        return;
    }
    let n = |x: &serde_json::Value| x.as_u64().map_or_else(|| "-".to_string(), |n| n.to_string());
    println!(
        "checkpoint seq {}  age {}s  {} of {} bytes ({} entries; next about {} bytes)",
        n(&v["checkpoint_seq"]),
        v["checkpoint_age_s"].as_f64().map_or_else(|| "-".to_string(), |a| format!("{a:.0}")),
        n(&v["checkpoint_bytes"]),
        n(&v["checkpoint_cap_bytes"]),
        n(&v["checkpoint_entries"]),
        n(&v["checkpoint_estimate_bytes"])
    );
    if let Some(opens) = v["lmcache_opens"].as_u64().filter(|&o| o > 0) {
        println!("LMCache loaded its index {opens} time(s) since this daemon started (restarts, or readers such as fdpblk inspect); {} put(s) made after the checkpoint it loaded were lost to it", n(&v["lmcache_lost_puts"]));
    }
    // A stall whose checkpoint still fits is LMCache's idle rule, also when it is close to the cap.
    let stalled = v["checkpoint_stalled"] == true;
    let past_cap = v["checkpoint_estimate_bytes"].as_u64().zip(v["checkpoint_cap_bytes"].as_u64()).is_some_and(|(e, c)| e >= c);
    if v["overflow_risk"] == true {
        println!(
            "OVERFLOW RISK: LMCache's checkpoint {}; set LMCache's meta_total_bytes to at least {} (a new layout: LMCache starts empty)",
            if stalled && past_cap { "stopped being written: it no longer fits its container" } else { "is close to its container's size" },
            n(&v["meta_total_bytes_needed"])
        );
    }
    if stalled && !past_cap {
        println!(
            "CHECKPOINT STALLED: LMCache writes slots but no checkpoint, and a restart would lose them; it checkpoints only when no I/O has been in flight for 100 ms at its tick: leave it idle moments, or lower meta_checkpoint_interval_sec"
        );
    }
    if v["writeback_risk"] == true {
        println!(
            "WRITEBACK RISK: LMCache checkpoints about every {}s, but the kernel may hold a dirty page back {}; with buffered writes keep vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs well below LMCache's checkpoint interval",
            v["checkpoint_interval_s"].as_f64().map_or_else(|| "-".to_string(), |a| format!("{a:.1}")),
            v["writeback_delay_s"].as_f64().map_or_else(|| "indefinitely".to_string(), |d| format!("{d:.1}s"))
        );
    }
    let s = &v["slots"];
    println!(
        "slots {} with a header: {} live, {} evicted, {} trimmed, {} unknown; identity history {} of {}, {} returning",
        n(&s["with_header"]),
        n(&s["live"]),
        n(&s["evicted"]),
        n(&s["trimmed"]),
        n(&s["unknown"]),
        n(&s["identity_history"]),
        n(&s["identity_history_capacity"]),
        n(&s["returning"])
    );
    let t = &v["trim"];
    let per: Vec<String> = t["handles"].as_object().map(|h| h.iter().map(|(k, c)| format!("{k}:{c}")).collect()).unwrap_or_default();
    if let Some(why) = t["blocked_by"].as_str() {
        println!("DEALLOCATION BLOCKED: {why}");
    }
    if let Some(why) = t["paused_by"].as_str() {
        println!("DEALLOCATION PAUSED: {why}");
    }
    if let Some(why) = t["off_because"].as_str() {
        println!("DEALLOCATION OFF: {why}");
    }
    println!(
        "deallocation {}: {} trims, {} bytes (per handle {}), {} evictions seen; stale tails {} ({} early), {} bytes; unwritten slots {}, {} bytes",
        deallocation_state(t),
        n(&t["trims"]),
        n(&t["trim_bytes"]),
        if per.is_empty() { "-".to_string() } else { per.join(" ") },
        n(&t["evictions"]),
        n(&t["tail_trims"]),
        n(&t["early_tail_trims"]),
        n(&t["tail_trim_bytes"]),
        n(&t["reclaimed"]),
        n(&t["reclaimed_bytes"])
    );
    let o = &v["own_state"];
    println!(
        "own state: {} ({} cycles, {} bytes written){}",
        if o["persisted"] == true { "saved in the reserved tail" } else { "in memory only" },
        n(&o["cycles"]),
        n(&o["bytes_written"]),
        match (o["loaded"] == true, o["loaded_clean"] == true, o["loaded_note"].as_str()) {
            (true, true, None) => "; loaded from a clean stop".to_string(),
            (true, true, Some(note)) => format!("; loaded from a clean stop: {note}"),
            // Why a saved state was not trusted, or not used (a bad sector, a lost write).
            (true, false, Some(note)) => format!("; loaded, its confirmations not trusted: {note}"),
            (true, false, None) => "; loaded after an unclean stop".to_string(),
            (false, _, Some(note)) => format!("; started fresh: {note}"),
            (false, _, None) => String::new(),
        }
    );
}

/// `on`, `off` (--no-trim), `on but blocked` (LMCache's checkpoint disagrees with the layout)
/// or `on but paused` (buffered writes the kernel may hold back past a checkpoint interval).
fn deallocation_state(trim: &serde_json::Value) -> &'static str {
    match (trim["enabled"] == true, trim["blocked_by"].is_string(), trim["paused_by"].is_string()) {
        (false, _, _) => "off",
        (true, true, _) => "on but blocked",
        (true, false, true) => "on but paused",
        (true, false, false) => "on",
    }
}

/// For `stats`, in a child: the drive's FDP counters since `add` of device `id` as JSON, or
/// nothing where it has none.
pub fn drive_deltas(id: i32) -> CmdResult {
    // Its own name in `ps` and for fdpblk's own checks of who holds a backing.
    if let Ok(name) = std::ffi::CString::new(state::DRIVE_CHILD_NAME) {
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
        unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
    }
    let (cfg, _) = state::read_state(id)?;
    if let Some(v) = state::fdp_deltas(&cfg) {
        println!("{v}");
    }
    Ok(())
}

/// For udev: prints the stable name of device `id`, or fails if it has none.
pub fn name(id: i32) -> CmdResult {
    let (cfg, daemon) = state::read_state(id)?;
    if let Some(whose) = foreign_server(id, &daemon) {
        return Err(format!("ublk device {id} {whose}; its state file is left over").into());
    }
    match cfg.name {
        Some(n) => {
            println!("{n}");
            Ok(())
        }
        None => Err(format!("device {id} has no --name").into()),
    }
}

pub fn features(json_out: bool) -> CmdResult {
    const NAMES: [&str; 21] = [
        "ZERO_COPY", "URING_CMD_COMP_IN_TASK", "NEED_GET_DATA", "USER_RECOVERY", "USER_RECOVERY_REISSUE",
        "UNPRIVILEGED_DEV", "CMD_IOCTL_ENCODE", "USER_COPY", "ZONED", "USER_RECOVERY_FAIL_IO", "UPDATE_SIZE",
        "AUTO_BUF_REG", "QUIESCE", "PER_IO_DAEMON", "BUF_REG_OFF_DAEMON", "BATCH_IO", "INTEGRITY",
        "SAFE_STOP_DEV", "NO_AUTO_PART_SCAN", "SHMEM_ZC", "BIT20",
    ];
    const USED: [&str; 2] = ["USER_RECOVERY", "USER_RECOVERY_REISSUE"];
    if !Path::new("/dev/ublk-control").exists() {
        return Err("no ublk driver: /dev/ublk-control is missing; run `modprobe ublk_drv`".into());
    }
    // Linux < 6.5 has no GET_FEATURES: say so rather than print "no features".
    let f = UblkCtrl::get_features().ok_or("the ublk driver does not report its features; Linux >= 6.5 does")?;
    let names: Vec<&str> = (0..NAMES.len()).filter(|b| f & (1u64 << b) != 0).map(|b| NAMES[b]).collect();
    let mut streams = serde_json::Map::new();
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if let Ok(m) = std::fs::read_to_string(e.path().join("queue/max_write_streams")) {
            streams.insert(n, json!(m.trim().parse::<u64>().unwrap_or(0)));
        }
    }
    if json_out {
        println!("{}", json!({"ublk_features": f, "names": names, "used": USED, "write_streams": streams}));
    } else {
        println!("ublk driver features {f:#x}: {}", names.join(" "));
        println!("fdpblk uses: {}", USED.join(" "));
        if streams.is_empty() {
            println!("block write streams: not supported by this kernel (needs Linux >= 6.16)");
        } else {
            for (n, m) in streams {
                println!("block write streams: {n} max_write_streams {m}");
            }
        }
    }
    Ok(())
}

/// What `add` says of a backing that takes no deallocation
/// ([`CommandLimits::deallocates`](passthrough::CommandLimits::deallocates) false for its
/// engine): most of fdpblk's gain is the deallocation of evicted slots and stale tails, and
/// the daemon runs with it off ([`target::no_deallocation`]).
fn no_deallocation_warning(limits: &passthrough::CommandLimits, passthrough: bool, trim: bool, backing: &Path) -> Option<String> {
    (trim && !limits.deallocates(passthrough)).then(|| format!("{}; the daemon runs with deallocation off (--no-trim says so)", target::no_deallocation(backing)))
}

/// Why `queues` × `depth` I/O buffers of `io_buf` bytes are too much for a machine with
/// `mem_total` bytes: every tag of every queue holds its own buffer for the daemon's life,
/// and each fills up as requests of that size come, so the daemon would grow into them
/// until the OOM killer stops it, with LMCache's I/O hung on the device. Half the memory is
/// the line: LMCache and the rest of the host need the remainder.
fn buffer_memory_error(queues: u16, depth: u16, io_buf: u64, mem_total: u64) -> Option<String> {
    let need = u64::from(queues) * u64::from(depth) * io_buf;
    (need > mem_total / 2).then(|| {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        format!(
            "--queues {queues} × --depth {depth} × --io-buf-size {io_buf} need {:.1} GiB of I/O buffers (one per request tag, held while the device runs), more than half of this machine's {:.1} GiB; fix: lower --depth or --io-buf-size (the defaults, 1 × 128 × 512 KiB, need 64 MiB)",
            gib(need),
            gib(mem_total)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add_args(argv: &[&str]) -> AddArgs {
        use clap::Parser;
        match crate::cli::Cli::try_parse_from(["fdpblk", "add"].iter().chain(argv)).unwrap().command {
            crate::cli::Command::Add(a) => a,
            _ => unreachable!(),
        }
    }

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

    #[test]
    fn a_ublk_device_is_no_backing() {
        assert_eq!(state::ublk_disk_id("ublkb0"), Some(0));
        assert_eq!(state::ublk_disk_id("ublkb12"), Some(12));
        for other in ["nvme0n1", "ublkc0", "ublkb", "ublkb1p1", "vda"] {
            assert_eq!(state::ublk_disk_id(other), None, "{other}");
        }
        let e = ublk_backing_error(Path::new("/dev/fdpblk/kv0"), 0, Some("/dev/nvme0n1".into()));
        assert!(e.contains("/dev/fdpblk/kv0 is fdpblk device 0, whose backing is /dev/nvme0n1") && e.contains("device_path"), "{e}");
        assert!(ublk_backing_error(Path::new("/dev/ublkb3"), 3, None).contains("is ublk device 3:"));
    }

    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("fdpblk-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A 64 MiB image `kv.img` in `dir` whose copy 0 is a checkpoint (seq 1) of `json`.
    fn checkpoint_image(dir: &Path, json: &[u8]) -> PathBuf {
        let img = dir.join("kv.img");
        let mut bytes = crate::layout::checkpoint_header::CheckpointHeader::encode_for(1, json, 4096);
        bytes.extend_from_slice(json);
        std::fs::write(&img, &bytes).unwrap();
        std::fs::File::options().write(true).open(&img).unwrap().set_len(64 << 20).unwrap();
        img
    }

    /// `--backing-id` refuses another namespace under the backing's name and says where the
    /// pinned one is now; a file cannot be pinned; the pin is checked before anything reads
    /// the backing (a bad pin on a real file stops `validate` before its geometry checks).
    #[test]
    fn a_pinned_backing_must_be_the_namespace_it_names() {
        // Finds the namespace of a kind that a predicate picks.
        type Find<'a> = dyn Fn(&dyn Fn(&NamespaceIdentity) -> bool, DevKind) -> Option<PathBuf> + 'a;
        let ns = |serial: &str, nsid| NamespaceIdentity { model: "QEMU NVMe Ctrl".into(), serial: serial.into(), nsid, nguid: None, eui64: None };
        let args = |pin: &str| add_args(&["--backing", "/dev/ng0n1", "--backing-id", pin]);
        // The backing given as `kind`, whose namespace is fdp0's first.
        let check_as = |kind: DevKind, a: &AddArgs, find: &Find<'_>| {
            check_backing_pin(a, kind, |_: &Path| Ok::<_, String>(Some(ns("fdp0", 1))), find)
        };
        let check = |a: &AddArgs, find: &Find<'_>| check_as(DevKind::Generic, a, find);
        let nowhere = |_: &dyn Fn(&NamespaceIdentity) -> bool, _: DevKind| None;
        assert_eq!(check(&args("serial fdp0 nsid 1"), &nowhere), Ok(()));
        assert_eq!(check(&args(r#"NVMe namespace model "QEMU NVMe Ctrl" serial "fdp0" nsid 1"#), &nowhere), Ok(()));
        let e = check(&args("serial fdp1 nsid 1"), &nowhere).unwrap_err();
        assert_eq!(
            e,
            r#"backing /dev/ng0n1 is the NVMe namespace model "QEMU NVMe Ctrl" serial "fdp0" nsid 1, not the one --backing-id pins (serial "fdp1" nsid 1): serial "fdp0", not "fdp1". Nothing was written; no node names the pinned namespace now: check that its drive is in, or if it was replaced on purpose set --backing-id to this one's"#
        );
        // The node the pinned namespace has now: of the backing's kind first, else the other
        // (a namespace with no block device has only its generic node).
        let at = |kind: DevKind, node: &'static str| {
            move |is: &dyn Fn(&NamespaceIdentity) -> bool, k: DevKind| (k == kind && is(&ns("fdp1", 1))).then(|| PathBuf::from(node))
        };
        let e = check(&args("serial fdp1 nsid 1"), &at(DevKind::Generic, "/dev/ng1n1")).unwrap_err();
        assert!(e.ends_with("Nothing was written; the pinned namespace is /dev/ng1n1 now: set --backing to it"), "{e}");
        let e = check_as(DevKind::Block, &args("serial fdp1 nsid 1"), &at(DevKind::Generic, "/dev/ng1n1")).unwrap_err();
        assert!(e.ends_with("the pinned namespace is /dev/ng1n1 now: set --backing to it"), "{e}");
        let both = |is: &dyn Fn(&NamespaceIdentity) -> bool, k: DevKind| {
            is(&ns("fdp1", 1)).then(|| PathBuf::from(if k == DevKind::Block { "/dev/nvme1n1" } else { "/dev/ng1n1" }))
        };
        let e = check_as(DevKind::Block, &args("serial fdp1 nsid 1"), &both).unwrap_err();
        assert!(e.ends_with("the pinned namespace is /dev/nvme1n1 now: set --backing to it"), "the backing's kind first: {e}");
        // From a config file, the error names the keys (as add's other errors do).
        let mut from_file = args("serial fdp0 nsid 2");
        from_file.config = Some("/etc/fdpblk/kv0.toml".into());
        from_file.from_config.extend(["backing", "backing_id"]);
        let e = crate::cmd::config_file::name_config_keys(check(&from_file, &nowhere).unwrap_err(), &from_file);
        assert!(e.contains(": nsid 1, not 2.") && e.ends_with("(from `backing`, `backing_id` in /etc/fdpblk/kv0.toml)"), "{e}");
        let e = check(&args("nsid 1"), &nowhere).unwrap_err();
        assert!(e.contains("names no single namespace"), "{e}");
        let e = check_backing_pin(&args("serial fdp0 nsid 1"), DevKind::Generic, |_: &Path| Ok::<_, String>(None), nowhere).unwrap_err();
        assert!(e.contains("is not one (a file, a partition"), "{e}");
        let e = check_backing_pin(&args("serial fdp0 nsid 1"), DevKind::Generic, |_: &Path| Err("Identify timed out"), nowhere).unwrap_err();
        assert!(e.contains("cannot read the identity of backing /dev/ng0n1: Identify timed out"), "{e}");
        // A backing node that is not there (a renumbering left it unused): where the pinned
        // namespace is now, if anywhere; without a pin, what a backing may be.
        let gone = std::io::Error::from_raw_os_error(libc::ENOENT);
        let e = missing_backing_error(&args("serial fdp1 nsid 1"), &gone, at(DevKind::Generic, "/dev/ng1n1"));
        assert!(e.starts_with("backing /dev/ng0n1: No such file or directory") && e.ends_with(r#"the namespace --backing-id pins (serial "fdp1" nsid 1) is /dev/ng1n1 now: set --backing to it"#), "{e}");
        let e = missing_backing_error(&args("serial fdp1 nsid 1"), &gone, nowhere);
        assert!(e.ends_with("no node names the namespace --backing-id pins (serial \"fdp1\" nsid 1) now: check that its drive is in"), "{e}");
        let e = missing_backing_error(&add_args(&["--backing", "/dev/ng0n1"]), &gone, at(DevKind::Generic, "/dev/ng1n1"));
        assert!(e.ends_with("pass an NVMe namespace (/dev/nvmeXnY, /dev/ngXnY) or a file"), "{e}");
        // Through validate, on a file: refused before anything else is looked at.
        let dir = scratch("pin");
        let img = dir.join("kv.img");
        std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
        let e = validate(&add_args(&["--backing", img.to_str().unwrap(), "--policy", "none", "--backing-id", "serial fdp0 nsid 1"])).unwrap_err();
        assert!(e.starts_with("--backing-id names an NVMe namespace, and backing ") && e.contains("leave --backing-id out"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A config file whose backing is an NVMe kernel name and pins none is warned of, with
    /// the line to add; not a command line, a pinned file, a link, or a backing that is no
    /// namespace. The drive is asked only where a warning can follow.
    #[test]
    fn an_unpinned_kernel_name_in_a_config_file_gets_the_line_to_add() {
        let asked = std::cell::Cell::new(0);
        let ng0n1 = |_: &Path| {
            asked.set(asked.get() + 1);
            Ok::<_, String>(Some(NamespaceIdentity { model: "QEMU NVMe Ctrl".into(), serial: "fdp0".into(), nsid: 1, nguid: None, eui64: None }))
        };
        let from_file = |argv: &[&str]| {
            let mut a = add_args(argv);
            a.config = Some("/etc/fdpblk/kv0.toml".into());
            a.from_config.push("backing");
            a
        };
        assert_eq!(
            unpinned_warning(&from_file(&["--backing", "/dev/ng0n1"]), ng0n1).as_deref(),
            Some("backing /dev/ng0n1 is a kernel name, which can name another drive after a reboot; pin the namespace: add `backing_id = 'serial \"fdp0\" nsid 1'` to /etc/fdpblk/kv0.toml")
        );
        assert_eq!(asked.get(), 1);
        assert_eq!(unpinned_warning(&add_args(&["--backing", "/dev/ng0n1"]), ng0n1), None, "typed by hand");
        let mut typed_over_the_file = add_args(&["--backing", "/dev/ng0n1"]);
        typed_over_the_file.config = Some("/etc/fdpblk/kv0.toml".into());
        assert_eq!(unpinned_warning(&typed_over_the_file, ng0n1), None, "the file's backing is not the one served");
        assert_eq!(unpinned_warning(&from_file(&["--backing", "/dev/ng0n1", "--backing-id", "serial fdp0 nsid 1"]), ng0n1), None, "pinned");
        assert_eq!(asked.get(), 1, "neither asked the drive");
        assert_eq!(unpinned_warning(&from_file(&["--backing", "/dev/ng0n1"]), |_: &Path| Ok::<_, String>(None)), None, "no namespace");
        let dir = scratch("unpinned");
        std::os::unix::fs::symlink("/dev/ng0n1", dir.join("nvme-eui.0025388b91c3e4f1")).unwrap();
        let link = dir.join("nvme-eui.0025388b91c3e4f1");
        assert_eq!(unpinned_warning(&from_file(&["--backing", link.to_str().unwrap()]), ng0n1), None, "a link that stays");
        assert_eq!(asked.get(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// --force erases a signature only once nothing else refuses the device: a typo in
    /// another flag must not cost the device's file system.
    #[test]
    fn force_erases_only_when_the_add_would_go_ahead() {
        let dir = scratch("force");
        let img = dir.join("swap.img");
        std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
        assert!(std::process::Command::new(sbin_tool("mkswap")).arg(&img).output().unwrap().status.success());
        let path = img.to_str().unwrap();
        let base = ["--backing", path, "--engine", "plain", "--policy", "none", "--slot-bytes", "64K", "--meta-total-bytes", "1M"];
        let e = validate(&add_args(&base)).unwrap_err();
        assert!(e.contains("or add it with --force, which"), "{e}");
        // From a config file (`fdpblk up`): the one command that passes --force.
        let mut from_file = add_args(&base);
        from_file.config = Some("/etc/fdpblk/kv0.toml".into());
        // The name `fdpblk up` takes from the file's, which `add --config` does not: given.
        from_file.name = Some("kv0".into());
        let e = validate(&from_file).unwrap_err();
        assert!(e.contains("once by hand (`fdpblk add --config /etc/fdpblk/kv0.toml --name kv0 --force`, then `fdpblk del --name kv0`"), "{e}");
        let with = |extra: &[&str]| validate(&add_args(&[&base[..], extra].concat()));
        // Refused after the signature was found (by the buffers' memory), and by a flag that
        // is checked before the backing is opened.
        let e = with(&["--force", "-q", "32", "-d", "4096", "--io-buf-size", "32M"]).unwrap_err();
        assert!(e.contains("I/O buffers"), "{e}");
        let e = with(&["--force", "--name", "kv 0"]).unwrap_err();
        assert!(e.contains("--name"), "{e}");
        assert!(foreign_signature(&img).unwrap().is_some(), "kept while the add is refused");
        with(&["--force"]).unwrap();
        assert_eq!(foreign_signature(&img), Ok(None), "erased when it goes ahead");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A device node another program holds open for writing is named with that program;
    /// a file backing is not looked at (the daemon's lock covers it).
    #[test]
    fn another_writer_of_the_backing_is_named() {
        let dev = std::path::Path::new("/dev/null");
        let mut child = std::process::Command::new("sh").arg("-c").arg("exec 3<>/dev/null; read -r _").stdin(std::process::Stdio::piped()).spawn().unwrap();
        let pid = format!("(pid {}) on /dev/null", child.id());
        let e = (0..200).find_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            other_writers(dev, std::time::Duration::ZERO).filter(|e| e.contains(&pid))
        });
        drop(child.stdin.take());
        child.wait().unwrap();
        let e = e.expect("the child holding /dev/null read-write is named");
        assert!(e.starts_with("backing /dev/null is open for writing by ") && e.contains("stop it"), "{e}");
        let file = std::env::temp_dir().join(format!("fdpblk-other-writers-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let mut child = std::process::Command::new("sh").arg("-c").arg("exec 3<>\"$0\"; read -r _").arg(&file).stdin(std::process::Stdio::piped()).spawn().unwrap();
        let held = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            state::writers(&file).iter().any(|&(p, _)| p == child.id())
        });
        let e = other_writers(&file, std::time::Duration::ZERO);
        drop(child.stdin.take());
        child.wait().unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(held);
        assert_eq!(e, None, "a file backing");
    }

    /// `add` checks its arguments and the backing before it asks for the ublk driver: a typo
    /// is heard before `modprobe`, on a host without the driver too.
    #[test]
    fn add_names_a_bad_argument_before_a_missing_driver() {
        let dir = scratch("add-order");
        let img = dir.join("kv.img");
        std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
        let path = img.to_str().unwrap();
        for (argv, says) in [
            (vec!["--backing", path, "--policy", "bogus"], "unknown --policy bogus"),
            (vec!["--backing", path, "--engine", "plain", "--policy", "none", "--slot-bytes", "64K"], "--slot-bytes is given but --meta-total-bytes is not"),
            (vec!["--backing", "/nonexistent/kv.img"], "/nonexistent/kv.img"),
        ] {
            let e = add(&add_args(&argv)).unwrap_err().to_string();
            assert!(e.contains(says) && !e.contains("ublk_drv"), "{argv:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A backing whose reserved tail holds a newer fdpblk's own state (a rollback) is refused,
    /// naming that fdpblk and --force; with --force the add goes ahead and writes nothing yet.
    #[test]
    fn a_newer_fdpblks_own_state_is_refused_unless_forced() {
        let dir = scratch("newer-state");
        let img = dir.join("kv.img");
        let (mut bytes, _) = crate::test_fixtures::fixture("object-evict");
        let size = 64u64 << 20;
        bytes.resize(size as usize, 0);
        let tail = crate::persist::Region::tail(size).offset as usize;
        let sb = &mut bytes[tail + 4096..tail + 8192];
        sb[..8].copy_from_slice(b"FDPBSB01");
        sb[8..12].copy_from_slice(&(crate::persist::FORMAT + 1).to_le_bytes());
        let crc = crc32fast::hash(&sb[..4092]);
        sb[4092..].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&img, &bytes).unwrap();
        let base = ["--backing", img.to_str().unwrap(), "--engine", "plain", "--policy", "none"];
        let e = validate(&add_args(&base)).unwrap_err();
        let format = format!("own state in format {}, written by a newer fdpblk (this one reads format {})", crate::persist::FORMAT + 1, crate::persist::FORMAT);
        assert!(e.contains(&format) && e.contains("add it with --force"), "{e}");
        validate(&add_args(&[&base[..], &["--force"]].concat())).unwrap();
        assert!(std::fs::read(&img).unwrap() == bytes, "--force: the daemon starts afresh, the add writes nothing");
        // A torn copy of that format is damage, not a newer fdpblk's: no refusal.
        bytes[tail + 4096 + 100] ^= 1;
        std::fs::write(&img, &bytes).unwrap();
        validate(&add_args(&base)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// LMCache restarted with a new slot size: the old layout's copy with the higher seq is
    /// named with the command that erases it alone, and that command (run as printed) lets
    /// the add go ahead with LMCache's current checkpoint.
    #[test]
    fn a_stale_copy_of_an_old_layout_is_named_with_the_command_that_erases_it() {
        let dir = scratch("relayout");
        let img = dir.join("kv.img");
        let (mut bytes, _) = crate::test_fixtures::fixture("object-evict");
        let h = crate::layout::checkpoint_header::CheckpointHeader::parse(&bytes[..32], bytes.len() as u64).unwrap();
        let json = String::from_utf8(bytes[4096..4096 + h.payload_len as usize].to_vec()).unwrap().replace(r#""slot_bytes":65536"#, r#""slot_bytes":32768"#);
        bytes[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
        bytes[12..20].copy_from_slice(&1u64.to_le_bytes());
        bytes[28..32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
        std::fs::write(&img, &bytes).unwrap();
        std::fs::File::options().write(true).open(&img).unwrap().set_len(64 << 20).unwrap(); // room for fdpblk's state
        let args = add_args(&["--backing", img.to_str().unwrap(), "--engine", "plain", "--policy", "none", "--slot-bytes", "32K"]);
        let e = validate(&args).unwrap_err();
        let cmd = e.rsplit(": ").next().unwrap();
        assert!(e.contains("copy 1") && cmd.starts_with("dd if=/dev/zero"), "{e}");
        assert!(std::process::Command::new("sh").arg("-c").arg(cmd).output().unwrap().status.success(), "{cmd}");
        let cfg = validate(&args).unwrap_or_else(|e| panic!("after `{cmd}`: {e}"));
        assert_eq!(cfg.geometry.map(|g| g.slot_bytes), Some(32768));
        assert!(std::fs::read(&img).unwrap()[..4096] == bytes[..4096], "the current copy stays");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Copy 0 failing its CRC with a torn meta_total_bytes, no sound copy: the command the
    /// error prints zeroes that copy's header block only (not the 934 MB its JSON says), and
    /// the add then learns the layout; with the layout's flags it goes ahead at once.
    #[test]
    fn a_damaged_copy_is_erased_by_its_header_block_or_passed_by_the_flags() {
        let dir = scratch("damaged");
        let img = dir.join("kv.img");
        let (mut bytes, _) = crate::test_fixtures::fixture("object-evict");
        let json = crate::test_fixtures::copy_json(&bytes, 0).1.replace(r#""meta_total_bytes":1048576"#, r#""meta_total_bytes":934217728"#);
        bytes[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
        bytes[524288..524288 + 4096].fill(0);
        std::fs::write(&img, &bytes).unwrap();
        std::fs::File::options().write(true).open(&img).unwrap().set_len(64 << 20).unwrap(); // room for fdpblk's state
        let base = ["--backing", img.to_str().unwrap(), "--engine", "plain", "--policy", "none"];
        let with = |extra: &[&str]| validate(&add_args(&[&base[..], extra].concat()));
        let flagged = with(&["--slot-bytes", "64K", "--meta-total-bytes", "1M"]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(flagged.geometry.map(|g| (g.slot_bytes, g.meta_total_bytes)), Some((65536, 1 << 20)));
        let e = with(&[]).unwrap_err();
        let cmd = e.rsplit(": ").next().unwrap();
        assert!(e.contains("LMCache skips it") && e.contains("--slot-bytes") && cmd.ends_with("bs=4096 count=1 conv=notrunc"), "{e}");
        assert!(std::process::Command::new("sh").arg("-c").arg(cmd).output().unwrap().status.success(), "{cmd}");
        let learning = with(&[]).unwrap_or_else(|e| panic!("after `{cmd}`: {e}"));
        assert!(learning.geometry.is_none(), "learns the layout");
        assert!(std::fs::read(&img).unwrap()[4096..1 << 20] == bytes[4096..1 << 20], "only the header block is zeroed");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_checkpoint_past_the_parsers_bounds_is_served_on_the_flags() {
        let dir = scratch("unparsable");
        // Valid JSON LMCache loads, with a key past fdpblk's 64 KiB string bound.
        let json = format!(
            r#"{{"version":1,"device_path":"/dev/fdpblk/kv0","capacity_bytes":33554432,"block_align":4096,"header_bytes":4096,"slot_bytes":65536,"meta_total_bytes":1048576,"meta_magic":"LMCIDX01","meta_version":1,"data_base_offset":1048576,"next_slot":1,"entries":{{"{}":{{"offset":1048576,"size":1}}}}}}"#,
            "k".repeat(70 * 1024)
        );
        let img = checkpoint_image(&dir, json.as_bytes());
        let path = img.to_str().unwrap();
        let base = ["--backing", path, "--engine", "plain", "--policy", "none"];
        let with = |extra: &[&str]| validate(&add_args(&[&base[..], extra].concat()));
        let e = with(&[]).unwrap_err();
        assert!(e.contains("--layout lmcache --slot-bytes"), "{e}");
        // What that error says to do works.
        let c = with(&["--layout", "lmcache", "--slot-bytes", "64K", "--meta-total-bytes", "1M"]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.geometry.unwrap().slot_bytes, 65536);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A checkpoint written through /dev/fdpblk/kv1 is kv1's cache: adding its backing as
    /// kv0 (configs with swapped backings) is refused unless --force.
    #[test]
    fn a_cache_written_through_another_name_is_refused_without_force() {
        let dir = scratch("othername");
        let json = br#"{"version":1,"device_path":"/dev/fdpblk/kv1","capacity_bytes":33554432,"block_align":4096,"header_bytes":4096,"slot_bytes":65536,"meta_total_bytes":1048576,"meta_magic":"LMCIDX01","meta_version":1,"data_base_offset":1048576,"next_slot":0,"entries":{}}"#;
        let img = checkpoint_image(&dir, json);
        let path = img.to_str().unwrap();
        let base = ["--backing", path, "--engine", "plain", "--policy", "none"];
        let with = |extra: &[&str]| validate(&add_args(&[&base[..], extra].concat()));
        let e = with(&["--name", "kv0"]).unwrap_err();
        assert!(e.contains("/dev/fdpblk/kv1") && e.contains("--force"), "{e}");
        let e = with(&["--name", "kv0", "--layout", "lmcache", "--slot-bytes", "64K", "--meta-total-bytes", "1M"]).unwrap_err();
        assert!(e.contains("/dev/fdpblk/kv1"), "{e}");
        for ok in [&["--name", "kv1"][..], &[], &["--name", "kv0", "--force"]] {
            let c = with(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
            assert_eq!(c.geometry.unwrap().slot_bytes, 65536);
        }
        std::fs::remove_dir_all(&dir).unwrap();
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

    /// A cache written through a path that is no fdpblk device's (LMCache on the drive
    /// itself) is warned of: LMCache on this device discards it, and fdpblk then deallocates.
    #[test]
    fn a_cache_written_through_another_path_is_warned_of() {
        let meta = |path: &str, entries: u64| crate::layout::checkpoint_json::CheckpointMeta { device_path: Some(path.into()), entries, ..Default::default() };
        let warn = |args: &[&str], path: &str| other_path_warning(&add_args(&[&["--backing", "/dev/ng1n1"][..], args].concat()), Some(&meta(path, 3)));
        let w = warn(&["--name", "kv0"], "/dev/nvme1n1").unwrap();
        assert!(
            w.starts_with("backing /dev/ng1n1 holds an LMCache cache of 3 entries written through device_path /dev/nvme1n1") && w.contains("(/dev/fdpblk/kv0) discards that index"),
            "{w}"
        );
        assert!(warn(&[], "/var/tmp/kv.img").unwrap().contains("(/dev/ublkbN, or /dev/fdpblk/NAME with --name)"));
        // Through a bare ublk path, under a name: LMCache must keep that path.
        let w = warn(&["--name", "kv0"], "/dev/ublkb0").unwrap();
        assert!(w.contains("device_path /dev/ublkb0: LMCache keeps it only while") && w.contains("pointed at /dev/fdpblk/kv0 it discards"), "{w}");
        // The name's own path; another name's (refused before this); any fdpblk path without a name.
        for (args, path) in [(&["--name", "kv0"][..], "/dev/fdpblk/kv0"), (&["--name", "kv0"], "/dev/fdpblk/kv1"), (&[], "/dev/ublkb0"), (&[], "/dev/fdpblk/kv0")] {
            assert_eq!(warn(args, path), None, "{args:?} {path}");
        }
        // Nothing to lose: no checkpoint, or one that lists no entry.
        let a = add_args(&["--backing", "/dev/ng1n1", "--name", "kv0"]);
        assert_eq!(other_path_warning(&a, None), None);
        assert_eq!(other_path_warning(&a, Some(&meta("/dev/nvme1n1", 0))), None);
    }

    /// `--layout lmcache` takes the fields its flags leave out from LMCache's checkpoint: it
    /// used to take the defaults (a header_bytes of 4096 where LMCache's is 8192, and the whole
    /// device where LMCache uses 32 MiB of it).
    #[test]
    fn layout_lmcache_takes_what_its_flags_leave_out_from_the_checkpoint() {
        let dir = scratch("lmcachefill");
        let json = br#"{"version":1,"device_path":"/dev/fdpblk/kv0","capacity_bytes":33554432,"block_align":4096,"header_bytes":8192,"slot_bytes":65536,"meta_total_bytes":1048576,"meta_magic":"LMCIDX01","meta_version":1,"data_base_offset":1048576,"next_slot":0,"entries":{}}"#;
        let img = checkpoint_image(&dir, json);
        let path = img.to_str().unwrap();
        let lmcache = ["--backing", path, "--engine", "plain", "--policy", "none", "--layout", "lmcache", "--slot-bytes", "64K", "--meta-total-bytes", "1M"];
        let with = |extra: &[&str]| validate(&add_args(&[&lmcache[..], extra].concat()));
        let g = with(&[]).unwrap_or_else(|e| panic!("{e}")).geometry.unwrap();
        assert_eq!((g.header_bytes, g.capacity_bytes, g.max_slots), (8192, 33554432, 496));
        let e = with(&["--header-bytes", "4096"]).unwrap_err();
        assert!(e.contains("header_bytes"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// LMCache's checkpoint from the backing used without fdpblk says a capacity past what the
    /// ublk device exports: `add` says so (the slots past the device's last are lost to
    /// LMCache), where it used to cap it silently.
    #[test]
    fn a_checkpoint_of_a_larger_device_is_named_as_such() {
        let image = |capacity: u64| {
            let json = format!(
                r#"{{"version":1,"device_path":"/dev/nvme0n1","capacity_bytes":{capacity},"block_align":4096,"header_bytes":4096,"slot_bytes":65536,"meta_total_bytes":1048576,"meta_magic":"LMCIDX01","meta_version":1,"data_base_offset":1048576,"next_slot":0,"entries":{{}}}}"#
            );
            let mut img = crate::layout::checkpoint_header::CheckpointHeader::encode_for(1, json.as_bytes(), 4096);
            img.extend_from_slice(json.as_bytes());
            img
        };
        let backing = 64u64 << 20;
        let exported = exported_bytes(backing, 512).unwrap();
        let found = |capacity: u64| {
            let mut img = image(capacity);
            img.resize(exported as usize, 0);
            let d = crate::layout::discover::discover(&img, &Default::default()).unwrap();
            capacity_past_exported(&d, exported, backing, Path::new("/dev/nvme0n1")).map(|w| (w, d.geometry.max_slots))
        };
        let (w, slots) = found(backing).expect("the whole backing is more than the device exports");
        assert!(w.contains(&format!("capacity_bytes {backing}")) && w.contains(&format!("{slots} slots")), "{w}");
        assert!(w.contains(&format!("last {} bytes", backing - exported)), "{w}");
        assert_eq!(found(exported), None, "LMCache through the device");
        assert_eq!(found(32 << 20), None, "a capacity_bytes below it");
    }

    /// A checkpoint LMCache's loader would throw away is named at `add`; LMCache's own
    /// checkpoints are not.
    #[test]
    fn a_checkpoint_lmcache_would_not_load_is_named() {
        let (img, _) = crate::test_fixtures::fixture("object-evict");
        let d = crate::layout::discover::discover(&img, &Default::default()).unwrap();
        assert_eq!(unloadable_checkpoint(&d, Path::new("/dev/ng0n1"), "erase"), None);
        // Version 2 in both copies, their CRCs fixed: still a layout, but not one LMCache loads.
        let mut v2 = img.clone();
        for at in [0usize, 524288] {
            let (seq, json) = crate::test_fixtures::copy_json(&v2, at);
            crate::test_fixtures::put_copy(&mut v2, at, seq, &json.replacen(r#"{"version":1,"#, r#"{"version":2,"#, 1));
        }
        let d = crate::layout::discover::discover(&v2, &Default::default()).unwrap();
        let w = unloadable_checkpoint(&d, Path::new("/dev/ng0n1"), "blkdiscard -z -l 1048576 /dev/nvme0n1").expect("named");
        assert!(w.contains("version is 2") && w.contains("--slot-bytes") && w.contains("slot_bytes 65536"), "{w}");
        assert!(w.contains("erase that checkpoint (`blkdiscard -z -l 1048576 /dev/nvme0n1`)"), "{w}");
    }

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
    fn a_namespace_without_deallocation_is_warned_of_unless_trim_is_off() {
        let off = passthrough::CommandLimits { discard_off: true, ..Default::default() };
        let p = Path::new("/dev/ng0n1");
        let w = no_deallocation_warning(&off, true, true, p).unwrap();
        assert!(w.contains("/dev/ng0n1 takes no deallocation") && w.contains("--no-trim"), "{w}");
        assert_eq!(no_deallocation_warning(&off, true, false, p), None);
        assert_eq!(no_deallocation_warning(&passthrough::CommandLimits::default(), true, true, p), None);
        // Through the block device, an unmapping Write Zeroes deallocates where a discard
        // is not offered (the state thread's fallback); only without both is there none.
        let b = Path::new("/dev/nvme0n1");
        assert_eq!(no_deallocation_warning(&off, false, true, b), None);
        let neither = passthrough::CommandLimits { discard_off: true, write_zeroes_off: true, ..Default::default() };
        assert!(no_deallocation_warning(&neither, false, true, b).is_some());
    }

    #[test]
    fn del_deletes_only_the_device_it_stopped() {
        assert!(still_the_stopped_device(Some(10), 10), "its daemon stopped (or died) without deleting it: del deletes it");
        assert!(!still_the_stopped_device(Some(10), 11), "an add took the id: its daemon serves it");
        assert!(!still_the_stopped_device(Some(10), -1) && !still_the_stopped_device(Some(10), 0), "an add's device not started yet");
        assert!(still_the_stopped_device(None, 11) && still_the_stopped_device(None, -1), "no daemon to wait for: nothing freed the id");
    }

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

    #[test]
    fn io_buffers_past_half_the_memory_are_refused_with_the_fix() {
        let gib = 1u64 << 30;
        assert_eq!(buffer_memory_error(1, 128, 512 << 10, 8 * gib), None, "the defaults");
        assert_eq!(buffer_memory_error(32, 4096, 32 << 10, 8 * gib), None, "4 GiB of 8: just fits");
        let e = buffer_memory_error(32, 4096, 64 << 10, 8 * gib).unwrap();
        assert!(e.contains("8.0 GiB of I/O buffers") && e.contains("8.0 GiB;") && e.contains("lower --depth or --io-buf-size"), "{e}");
        assert!(buffer_memory_error(32, 4096, 32 << 20, 1 << 40).is_some(), "4 TiB of buffers");
        assert!(crate::device::mem_total_bytes().is_some_and(|m| m > 1 << 20), "MemTotal is read");
    }

    #[test]
    fn logical_blocks_past_4096_bytes_are_refused_with_the_fix() {
        let p = std::path::Path::new("/dev/ng0n1");
        assert!(block_size_error(512, p).is_none());
        assert!(block_size_error(4096, p).is_none());
        let e = block_size_error(8192, p).unwrap();
        assert!(e.contains("8192-byte logical blocks") && e.contains("nvme format"), "{e}");
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
    fn a_blocked_deallocation_is_not_called_on() {
        assert_eq!(deallocation_state(&json!({"enabled": true, "blocked_by": null})), "on");
        assert_eq!(deallocation_state(&json!({"enabled": true, "blocked_by": "slot_bytes differs"})), "on but blocked");
        assert_eq!(deallocation_state(&json!({"enabled": false, "blocked_by": null})), "off");
        assert_eq!(deallocation_state(&json!({"enabled": true, "blocked_by": null, "paused_by": "buffered writes"})), "on but paused");
    }

    /// mkswap (like a partition table or mkfs) writes over the device's first block, copy 0's
    /// header, and leaves copy 1 of LMCache's checkpoint valid behind it: that copy does not
    /// vouch for the device, blkid is asked. A torn copy 0 (its JSON's CRC fails, its header
    /// holds) is LMCache's own and needs no blkid.
    #[test]
    fn a_checkpoint_copy_1_left_behind_a_new_signature_does_not_skip_blkid() {
        let dir = scratch("copy1");
        let img = dir.join("evict.img");
        std::fs::copy(crate::test_fixtures::fixtures_dir().join("object-evict/device.img"), &img).unwrap();
        // Room for fdpblk's reserved tail behind LMCache's 4 MiB.
        std::fs::OpenOptions::new().write(true).open(&img).unwrap().set_len(64 << 20).unwrap();
        let path = img.to_str().unwrap();
        for layout in [&["--layout", "auto"][..], &["--layout", "lmcache", "--slot-bytes", "64K", "--meta-total-bytes", "1M"]] {
            let args = add_args(&[&["--backing", path, "--engine", "plain", "--policy", "none"][..], layout].concat());
            validate(&args).unwrap();
            // LMCache's torn write of copy 0's JSON: blkid finds nothing, the device is added.
            let f = std::fs::OpenOptions::new().read(true).write(true).open(&img).unwrap();
            use std::os::unix::fs::FileExt;
            let mut b = [0u8; 1];
            FileExt::read_exact_at(&f, &mut b, 4096).unwrap();
            f.write_all_at(&[b[0] ^ 0xff], 4096).unwrap();
            validate(&args).unwrap();
            f.write_all_at(&b, 4096).unwrap();
            drop(f);
        }
        // A signature written behind copy 0's header bytes, which survive (as parted keeps a
        // disk's first 446 bytes), tearing its JSON: a swap signature's page past byte 1024.
        let swap = dir.join("swap.img");
        std::fs::write(&swap, vec![0u8; 1 << 20]).unwrap();
        assert!(std::process::Command::new(sbin_tool("mkswap")).arg(&swap).output().unwrap().status.success());
        let page = std::fs::read(&swap).unwrap();
        let saved = std::fs::read(&img).unwrap();
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
            f.write_all_at(&page[1024..4096], 1024).unwrap();
            f.write_all_at(&[saved[4096] ^ 0xff], 4096).unwrap();
        }
        let copies = crate::layout::checkpoint::read_copies(&std::fs::File::open(&img).unwrap(), &crate::test_fixtures::small_geometry()).unwrap();
        assert!(copies[0].header.is_ok() && copies[0].crc_ok == Some(false) && copies[1].is_valid());
        let e = validate(&add_args(&["--backing", path, "--engine", "plain", "--policy", "none"])).unwrap_err();
        assert!(e.contains("holds a swap") && e.contains("only copy 1 of an LMCache checkpoint"), "{e}");
        std::fs::write(&img, &saved).unwrap();
        assert!(std::process::Command::new(sbin_tool("mkswap")).arg(&img).output().unwrap().status.success());
        let copies = crate::layout::checkpoint::read_copies(&std::fs::File::open(&img).unwrap(), &crate::test_fixtures::small_geometry()).unwrap();
        assert!(copies[0].header.is_err() && copies[1].is_valid(), "the fixture's copy 1 survives mkswap");
        for layout in [&["--layout", "auto"][..], &["--layout", "lmcache", "--slot-bytes", "64K", "--meta-total-bytes", "1M"]] {
            let e = validate(&add_args(&[&["--backing", path, "--engine", "plain", "--policy", "none"][..], layout].concat())).unwrap_err();
            assert!(e.contains("holds a swap") && e.contains("only copy 1 of an LMCache checkpoint"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A stats file that is valid JSON but not an object is as corrupt as one that is not JSON.
    #[test]
    fn a_stats_file_that_is_not_an_object_is_corrupt_not_a_panic() {
        let p = Path::new("/run/fdpblk/0.stats.json");
        for text in ["[]", "3", "null", "\"x\"", "{", ""] {
            let e = parse_stats(p, text).unwrap_err();
            assert!(e.starts_with("/run/fdpblk/0.stats.json is corrupt (") && e.contains("see `fdpblk list`"), "{text}: {e}");
        }
        assert!(parse_stats(p, r#"{"io":{}}"#).unwrap()["io"].is_object());
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
