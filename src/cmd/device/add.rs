//! `fdpblk add`: every check on the arguments and the backing, then the launch. Everything
//! is validated before a device is created; a failure creates nothing.

use super::backing::{
    backing_in_use, backing_served, backing_served_live, check_backing_pin, erase_signatures, foreign_signature, lba_bytes,
    missing_backing_error, other_writers, partition_error, partition_of, sysfs_queue_attr, ublk_backing_error,
    ublk_disk_of, OTHER_WRITER_WAIT,
};
use super::daemon::daemonize;
use super::server::{exiting, ublk_stopped};
use crate::cmd::CmdResult;
use crate::cli::AddArgs;
use crate::device::ReadAt;
use crate::engine::passthrough;
use crate::frontend::config::{exported_bytes, reserved_tail_bytes, DeviceConfig, EngineKind};
use crate::frontend::{state, target};
use crate::layout::discover::{discover, DiscoverError};
use crate::layout::geometry::{DEFAULT_BLOCK_ALIGN, DEFAULT_HEADER_BYTES};
use crate::layout::GeometryConfig;
use crate::nvme::path::DevKind;
use crate::place::{policy_by_name, POLICY_NAMES};
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
/// The command that erases LMCache's checkpoints: the first `meta_bytes` of the backing.
fn erase_checkpoint_command(meta_bytes: u64, backing: &Path, is_bdev: bool, is_chardev: bool) -> String {
    zero_command(0, meta_bytes, backing, is_bdev, is_chardev)
}
/// `path` as one shell word: a file backing's name with a space or a `;` must not make the
/// pasted command write somewhere else.
fn shell_word(path: &Path) -> String {
    let s = path.to_string_lossy();
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+:@,=".contains(c)) {
        return s.into_owned();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The command that zeroes `len` bytes at `offset` of the backing (both multiples of 512).
fn zero_command(offset: u64, len: u64, backing: &Path, is_bdev: bool, is_chardev: bool) -> String {
    let block = if is_chardev { crate::nvme::path::namespace_block_device(backing) } else { Some(backing.to_path_buf()) };
    let at = if offset == 0 { String::new() } else { format!("-o {offset} ") };
    match block.as_deref().map(shell_word) {
        Some(b) if is_bdev || is_chardev => format!("blkdiscard -z {at}-l {len} {b}"),
        Some(b) if offset == 0 => format!("dd if=/dev/zero of={b} bs=4096 count={} conv=notrunc", len.div_ceil(4096)),
        Some(b) => format!("dd if=/dev/zero of={b} bs=512 seek={} count={} conv=notrunc", offset / 512, len.div_ceil(512)),
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
            shell_word(&target),
            match (found, ours) {
                (Lmcache::Copy1Only, _) => "only copy 1 of an LMCache checkpoint (copy 0, at the device's start, is not a whole one)",
                (Lmcache::Nothing, true) => "no LMCache checkpoint (only fdpblk's state from an earlier use)",
                (Lmcache::Nothing, false) => "neither an LMCache checkpoint nor fdpblk's state",
            },
            shell_word(&target),
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
/// Turns `fdpblk add` arguments into a device config, checking everything first; with
/// `--force`, erases the signatures that would refuse it once every check passed.
pub fn validate(a: &AddArgs) -> Result<DeviceConfig, String> {
    let (cfg, to_wipe) = check(a)?;
    erase_signatures(to_wipe)?;
    Ok(cfg)
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
                "policy {} needs {} placement handles but {} has {max}; use a policy of at most {max} ({}), or give the namespace more handles",
                a.policy,
                policy.handles(),
                a.backing.display(),
                crate::place::handles_of_each()
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
pub(super) fn need_ublk_driver() -> Result<(), String> {
    if Path::new(target::UBLK_CONTROL).exists() {
        Ok(())
    } else {
        Err("no ublk driver: /dev/ublk-control is missing; run `modprobe ublk_drv` (Linux >= 6.0 with CONFIG_BLK_DEV_UBLK)".into())
    }
}
pub fn add(a: &AddArgs) -> CmdResult {
    add_device(a).map_err(|e| crate::cmd::config_file::name_config_keys(with_limit_fix(e.to_string()), a).into())
}
/// `e` with the fix for running out of file descriptors, which any step of the set-up can hit
/// (the backing, the ublk char device, each queue's rings and eventfds).
pub(super) fn with_limit_fix(e: String) -> String {
    if e.contains("(os error 24)") || e.contains("(os error 23)") {
        format!("{e}; raise the open-files limit (ulimit -n; LimitNOFILE= in a systemd unit)")
    } else {
        e
    }
}
/// Raises the open-files limit to what `queues` queues need, as far as it may: a daemon
/// started with a low `ulimit -n` would otherwise fail somewhere in its set-up. Each queue
/// holds its ublk ring, its engine's ring and eventfds; a few more are the device's own.
pub(super) fn raise_fd_limit(queues: u16) {
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
        match crate::cmd::up::find(name) {
            // Killed (or stopping): the driver may hold LMCache's I/O for its recovery, which
            // `del` would fail.
            crate::cmd::up::Found::Running { id, pid } if exiting(pid) => {
                return Err(format!(
                    "--name {name} is taken by {}, whose daemon (pid {pid}) is exiting (NVMe commands in flight); once it is gone, `fdpblk up {name}` recovers the device (or adds it again)",
                    state::bdev_path(id)
                )
                .into())
            }
            crate::cmd::up::Found::Running { id, .. } => {
                return Err(format!("--name {name} is taken by {}; pick another name or `fdpblk del -n {id}` first", state::bdev_path(id)).into())
            }
            // Its daemon died while stopping it: nothing is held for a recovery.
            crate::cmd::up::Found::Orphaned { id } if ublk_stopped(id) => {
                return Err(format!(
                    "--name {name} is taken by {}, which its daemon stopped before it died: `fdpblk del -n {id}` deletes it, then add again (`fdpblk up {name}` does both)",
                    state::bdev_path(id)
                )
                .into())
            }
            crate::cmd::up::Found::Orphaned { id } => {
                return Err(format!(
                    "--name {name} is taken by {}, whose daemon died; `fdpblk recover -n {id}` (or `fdpblk up {name}`) brings it back, `fdpblk del -n {id}` deletes it",
                    state::bdev_path(id)
                )
                .into())
            }
            crate::cmd::up::Found::Stale { cfg } => crate::cmd::up::remove_stale(&cfg),
            crate::cmd::up::Found::None => {}
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
    if let Some(e) = backing_served_live(&a.backing) {
        return Err(e.into());
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
    use super::super::backing::{sbin_tool, unpinned_warning};
    use super::*;
    use crate::nvme::discover::NamespaceIdentity;
    use crate::test_fixtures::scratch;

    fn add_args(argv: &[&str]) -> AddArgs {
        use clap::Parser;
        match crate::cli::Cli::try_parse_from(["fdpblk", "add"].iter().chain(argv)).unwrap().command {
            crate::cli::Command::Add(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn printed_commands_quote_a_backing_the_shell_would_split() {
        assert_eq!(zero_command(0, 8192, Path::new("/dev/nvme0n1"), true, false), "blkdiscard -z -l 8192 /dev/nvme0n1");
        assert_eq!(
            zero_command(4096, 4096, Path::new("/srv/kv cache;rm x/it's.img"), false, false),
            r"dd if=/dev/zero of='/srv/kv cache;rm x/it'\''s.img' bs=512 seek=8 count=8 conv=notrunc"
        );
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
            state::writers(&[&file]).iter().any(|w| w.pid == child.id())
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
}
