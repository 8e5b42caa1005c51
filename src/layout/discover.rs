//! Geometry discovery: from the newest valid checkpoint already on a device, from explicit
//! flags named like LMCache's config keys, or both — where a flag and the checkpoint disagree,
//! that is an error (LMCache itself would discard its whole index over such a mismatch).

use super::checkpoint::{newest_valid, payload_crc, read_copies, read_entries, CopyStatus};
use super::checkpoint_header::CheckpointHeader;
use super::checkpoint_json::{CheckpointMeta, JsonError, JsonLimits};
use super::geometry::{DEFAULT_BLOCK_ALIGN, DEFAULT_HEADER_BYTES};
use super::{Geometry, GeometryConfig, GeometryError};
use crate::device::ReadAt;
use std::fmt;

/// Geometry flags as given on the command line; `None` = not given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GeometryFlags {
    pub block_align: Option<u64>,
    pub header_bytes: Option<u64>,
    pub slot_bytes: Option<u64>,
    pub meta_total_bytes: Option<u64>,
    pub capacity_bytes: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeometrySource {
    Checkpoint,
    Flags,
    /// Flags given and confirmed by the checkpoint.
    Both,
}

/// The layout, where it came from, and the checkpoint copies seen while finding it.
#[derive(Clone, Debug)]
pub struct Discovered {
    pub geometry: Geometry,
    pub source: GeometrySource,
    pub copies: Option<[CopyStatus; 2]>,
    /// Top-level fields of the newest valid checkpoint.
    pub checkpoint: Option<CheckpointMeta>,
}

#[derive(Debug)]
pub enum DiscoverError {
    Io(std::io::Error),
    /// No checkpoint on the device and not enough flags to build the layout.
    NoCheckpoint { missing: &'static str },
    /// `meta_bytes`: the bytes from the device's start that hold both checkpoint containers.
    Conflict { field: &'static str, flag: u64, checkpoint: u64, meta_bytes: u64 },
    /// LMCache's checkpoint on the device lays out more than the device holds.
    CheckpointTooBig { meta_bytes: u64, slot_bytes: u64, capacity: u64 },
    Geometry(GeometryError),
    /// The checkpoint's own values (with any flags that agree) break a rule LMCache itself
    /// enforces: a damaged or hand-made checkpoint, which a flag cannot override (it would
    /// conflict), so the way out is to erase it.
    ImpossibleCheckpoint { error: GeometryError, meta_bytes: u64 },
    /// `error` ([`Self::ImpossibleCheckpoint`], [`Self::CheckpointTooBig`]) is read from a
    /// copy whose checksum fails, at `offset` with its JSON `block_align` bytes on, and no
    /// sound copy is anywhere: LMCache skips it and starts empty, so its layout is no
    /// measure of what to erase; only its header block is in the way.
    DamagedCopy { error: Box<DiscoverError>, offset: u64, block_align: u64 },
    /// LMCache's newest checkpoint is valid JSON beyond the parser's bounds.
    Unparsable(JsonError),
    /// The two valid copies hold different layouts: LMCache restarted with a new one (starting
    /// again at seq 1 in copy 0) and has not yet overwritten the old copy, whose higher seq its
    /// own loader takes (and discards). `flag` is the flag given for `field`, which matches
    /// the other (current) copy; none given, fdpblk cannot tell which layout LMCache runs.
    TwoLayouts { field: &'static str, flag: Option<u64>, stale_value: u64, current_value: u64, stale: u8, stale_seq: u64, current_seq: u64, offset: u64, block_align: u64 },
}

impl fmt::Display for DiscoverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "reading the device: {e}"),
            Self::NoCheckpoint { missing } => write!(
                f,
                "no valid LMCache checkpoint on the device to learn the layout from; pass {missing} with the values from LMCache's raw_block config"
            ),
            Self::Conflict { field, flag, checkpoint, .. } => write!(
                f,
                "--{} {flag} conflicts with the checkpoint on the device ({field} {checkpoint}); LMCache would discard its index with that value: drop the flag or fix it to {checkpoint}",
                field.replace('_', "-")
            ),
            Self::CheckpointTooBig { meta_bytes, slot_bytes, capacity } => write!(
                f,
                "the LMCache checkpoint on the device lays out {meta_bytes} bytes of metadata and {slot_bytes}-byte slots, no slot of which fits in the device's {capacity} bytes; give the whole device LMCache wrote (is this a truncated image?)"
            ),
            Self::Geometry(e) => e.fmt(f),
            Self::DamagedCopy { error, offset, .. } => write!(
                f,
                "{error}; that copy (its header at byte {offset}) fails LMCache's checks too (its checksum, or a length past its container or the device), so LMCache skips it and starts with an empty cache"
            ),
            Self::ImpossibleCheckpoint { error, .. } => write!(
                f,
                "the LMCache checkpoint on the device lists a layout LMCache itself refuses ({error}): it is damaged or not LMCache's"
            ),
            Self::TwoLayouts { field, flag: Some(flag), stale_value, stale, stale_seq, current_seq, .. } => write!(
                f,
                "--{} {flag} matches LMCache's checkpoint seq {current_seq}, but the other container (copy {stale}) still holds an older layout's checkpoint with a higher seq ({stale_seq}, {field} {stale_value}), which LMCache's loader would take first and discard: LMCache was restarted with a new layout and has not overwritten it yet",
                field.replace('_', "-")
            ),
            Self::TwoLayouts { field, flag: None, stale_value, current_value, stale, stale_seq, current_seq, .. } => write!(
                f,
                "the two LMCache checkpoints on the device have different layouts ({field} {stale_value} in copy {stale}, seq {stale_seq}; {current_value} in the other, seq {current_seq}): LMCache was restarted with a new layout and has not overwritten the old copy yet, so fdpblk cannot tell which one LMCache runs with; give it: --{} (and the other geometry flags as in LMCache's config)",
                field.replace('_', "-")
            ),
            Self::Unparsable(e) => write!(
                f,
                "LMCache's checkpoint on the device is beyond what fdpblk parses ({e}); give the layout instead: --layout lmcache --slot-bytes B --meta-total-bytes B (and --block-align/--header-bytes if not 4096)"
            ),
        }
    }
}

impl std::error::Error for DiscoverError {}

impl From<std::io::Error> for DiscoverError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<GeometryError> for DiscoverError {
    fn from(e: GeometryError) -> Self {
        Self::Geometry(e)
    }
}

/// Finds the layout of `dev`. The checkpoint is preferred; flags fill gaps and must agree.
pub fn discover<D: ReadAt + ?Sized>(dev: &D, flags: &GeometryFlags) -> Result<Discovered, DiscoverError> {
    let size = dev.size()?;
    let found = match find_checkpoint(dev, flags, size) {
        // Nothing LMCache loads, and the flags give the layout: theirs (LMCache overwrites
        // the damaged copy with its first checkpoint).
        Err(e @ DiscoverError::DamagedCopy { .. }) if flags.slot_bytes.is_some() && flags.meta_total_bytes.is_some() => {
            tracing::warn!("{e}: taking the layout of the flags");
            None
        }
        r => r?,
    };
    let (meta, copies, found_in, found_align) = match &found {
        Some((meta, copies, geom)) => (Some(meta.clone()), Some(copies.clone()), geom.meta_total_bytes, Some(geom.block_align)),
        None => (None, None, 0, None),
    };
    if let Some((meta, copies, geom)) = &found {
        if let Some(e) = two_layouts(dev, flags, meta, copies, geom) {
            return Err(e);
        }
    }
    // Where the old checkpoint lies: its own meta_total_bytes, or the layout it was found with.
    let meta_bytes = meta.as_ref().and_then(|m| m.meta_total_bytes).filter(|&b| b > 0 && b <= size).unwrap_or(found_in);
    let pick = |field: &'static str, flag: Option<u64>, ck: Option<u64>| -> Result<Option<u64>, DiscoverError> {
        match (flag, ck) {
            (Some(f), Some(c)) if f != c => Err(DiscoverError::Conflict { field, flag: f, checkpoint: c, meta_bytes }),
            (Some(f), _) => Ok(Some(f)),
            (None, c) => Ok(c),
        }
    };
    let m = meta.clone().unwrap_or_default();
    // A checkpoint without the field was found at a payload offset: that block_align.
    let block_align = pick("block_align", flags.block_align, m.block_align)?.or(found_align).unwrap_or(DEFAULT_BLOCK_ALIGN);
    let header_bytes = pick("header_bytes", flags.header_bytes, m.header_bytes)?.unwrap_or(DEFAULT_HEADER_BYTES);
    let slot_bytes = pick("slot_bytes", flags.slot_bytes, m.slot_bytes)?;
    let meta_total = pick("meta_total_bytes", flags.meta_total_bytes, m.meta_total_bytes)?;
    let (slot_bytes, meta_total_bytes) = match (slot_bytes, meta_total) {
        (Some(s), Some(mt)) => (s, mt),
        (None, Some(_)) => return Err(DiscoverError::NoCheckpoint { missing: "--slot-bytes" }),
        (Some(_), None) => return Err(DiscoverError::NoCheckpoint { missing: "--meta-total-bytes" }),
        (None, None) => return Err(DiscoverError::NoCheckpoint { missing: "--slot-bytes and --meta-total-bytes" }),
    };
    // capacity_bytes is not part of LMCache's mismatch check; an explicit flag wins.
    let capacity_bytes = flags.capacity_bytes.or(m.capacity_bytes).unwrap_or(0);
    let geometry = GeometryConfig { block_align, header_bytes, slot_bytes, meta_total_bytes, capacity_bytes }.validate(size).map_err(|error| {
        // A rule broken by the checkpoint's own values (a too-small device aside, which a
        // truncated image explains): no flag fixes that, since a flag would conflict. Not so
        // where a flag filled in a field the checkpoint lacks: that flag may be the culprit.
        let fields = [(flags.block_align, m.block_align), (flags.header_bytes, m.header_bytes), (flags.slot_bytes, m.slot_bytes), (flags.meta_total_bytes, m.meta_total_bytes)];
        let from_checkpoint = fields.iter().any(|(flag, ck)| flag.is_none() && ck.is_some()) && !fields.iter().any(|(flag, ck)| flag.is_some() && ck.is_none());
        match error {
            GeometryError::DeviceTooSmall { .. } | GeometryError::CapacityTooSmall { .. } | GeometryError::TooManySlots { .. } => DiscoverError::Geometry(error),
            _ if from_checkpoint => DiscoverError::ImpossibleCheckpoint { error, meta_bytes },
            _ => DiscoverError::Geometry(error),
        }
    })?;
    let any_flag = flags.block_align.is_some()
        || flags.header_bytes.is_some()
        || flags.slot_bytes.is_some()
        || flags.meta_total_bytes.is_some();
    let source = match (&meta, any_flag) {
        (Some(_), true) => GeometrySource::Both,
        (Some(_), false) => GeometrySource::Checkpoint,
        (None, _) => GeometrySource::Flags,
    };
    Ok(Discovered { geometry, source, copies, checkpoint: meta })
}

/// Whether two layouts place everything alike (the capacity aside).
fn same_layout(a: &Geometry, b: &Geometry) -> bool {
    (a.block_align, a.header_bytes, a.slot_bytes, a.meta_total_bytes) == (b.block_align, b.header_bytes, b.slot_bytes, b.meta_total_bytes)
}

/// The layout a half-written copy 0 names (its header sound, its JSON failing its CRC, its
/// first bytes whole) where that is not the layout `d` took from the other copy: LMCache
/// restarted with a new layout writes its first checkpoint there (reference §4.1), and one
/// that crashed during that write runs with the new layout while copy 1 still holds the old.
/// The learner waits for such a copy; `add` takes the sound one, and says this.
pub fn torn_copy_layout<D: ReadAt + ?Sized>(dev: &D, flags: &GeometryFlags, d: &Discovered) -> Option<Geometry> {
    let c0 = &d.copies.as_ref()?[0];
    if c0.header.is_err() || c0.crc_ok != Some(false) {
        return None;
    }
    let Ok(Some(Hint::Layout(g))) = geometry_hint_at(dev, flags, dev.size().ok()?, 0) else { return None };
    (!same_layout(&g, &d.geometry)).then_some(g)
}

/// Two valid copies with different layouts: the newest is an older layout's (reference §4.1:
/// a LMCache restarted with a new layout writes seq 1 into copy 0 and leaves the other copy's
/// higher seq). An error unless the flags match one of them: the newest's, or the other's,
/// which is then LMCache's current checkpoint behind a stale copy to erase.
fn two_layouts<D: ReadAt + ?Sized>(dev: &D, flags: &GeometryFlags, newest: &CheckpointMeta, copies: &[CopyStatus; 2], geom: &Geometry) -> Option<DiscoverError> {
    let fields = |m: &CheckpointMeta| {
        [
            ("block_align", flags.block_align, m.block_align),
            ("header_bytes", flags.header_bytes, m.header_bytes),
            ("slot_bytes", flags.slot_bytes, m.slot_bytes),
            ("meta_total_bytes", flags.meta_total_bytes, m.meta_total_bytes),
        ]
    };
    let stale = newest_valid(copies)?;
    let current = copies.iter().find(|c| c.copy != stale.copy && c.is_valid())?;
    let other = read_entries(dev, geom, current, &JsonLimits::default(), &mut |_| Ok(())).ok()?;
    // The fields the two layouts differ in, and the flags given for them.
    let differ: Vec<_> = fields(newest)
        .into_iter()
        .zip(fields(&other))
        .filter_map(|((n, f, a), (_, _, b))| match (a, b) {
            (Some(a), Some(b)) if a != b => Some((n, f, a, b)),
            _ => None,
        })
        .collect();
    let &(first, _, stale_first, current_first) = differ.first()?;
    let flagged: Vec<_> = differ.iter().filter(|d| d.1.is_some()).collect();
    let (field, flag, stale_value, current_value) = match flagged.first() {
        // No flag tells the two apart: fdpblk cannot tell which one LMCache runs with.
        None => (first, None, stale_first, current_first),
        // The newest copy's layout, given: taken as LMCache's loader takes it.
        Some(_) if flagged.iter().all(|d| d.1 == Some(d.2)) => return None,
        // The other copy's, given: LMCache's current checkpoint, behind a stale copy.
        Some(&&d) if flagged.iter().all(|d| d.1 == Some(d.3)) => d,
        // Neither: the conflict with the newest copy says so.
        Some(_) => return None,
    };
    Some(DiscoverError::TwoLayouts {
        field,
        flag,
        stale_value,
        current_value,
        stale: stale.copy,
        stale_seq: stale.seq().unwrap_or(0),
        current_seq: current.seq().unwrap_or(0),
        offset: stale.offset,
        block_align: geom.block_align,
    })
}

/// Block sizes to try when `block_align` is unknown: where the JSON of copy 0 begins.
const ALIGN_CANDIDATES: [u64; 12] = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1 << 20];
/// Every 0.5.6 payload starts with these bytes (`json.dumps` with insertion order).
const JSON_START: &[u8] = br#"{"version":"#;

fn find_checkpoint<D: ReadAt + ?Sized>(
    dev: &D,
    flags: &GeometryFlags,
    size: u64,
) -> Result<Option<(CheckpointMeta, [CopyStatus; 2], Geometry)>, DiscoverError> {
    // Step 1: a provisional layout, from the flags or from either copy's own JSON.
    if let Some(geom) = provisional_from_flags(flags, size) {
        if let Some(found) = checkpoint_at(dev, geom)? {
            return Ok(Some(found));
        }
    }
    // None there: a checkpoint written with another block_align has its JSON elsewhere, and
    // one with another meta_total_bytes its copy 1; only the copies' own fields can tell
    // where. Found, it conflicts with the flags (an error naming the field), rather than
    // leaving the flags' layout to serve LMCache's other one. A copy whose own fields are
    // damaged (its CRC fails: LMCache skips it) must not hide a sound one elsewhere: sound
    // copies' layouts first, then damaged ones', then the damaged ones' errors.
    let mut damaged_layouts = Vec::new();
    let mut damaged_error = None;
    for at in std::iter::once(0).chain(COPY1_CANDIDATES.map(|shift| 1u64 << shift)) {
        let Some(hint) = geometry_hint_at(dev, flags, size, at)? else { continue };
        match hint {
            Hint::Layout(g) if at == 0 || g.container_offset(1) == at => {
                let copies = read_copies(dev, &g)?;
                // Copy 0 torn, its layout's copy 1 sound and naming the same layout, and copy
                // 0's header that copy's successor: LMCache's checkpoint (a crash while
                // writing the next one), found before an older layout's copy 1 that may lie
                // inside its container 0. (A header of another run over this layout's old
                // JSON has another seq: the older layout's copy 1 is then LMCache's.)
                let sound_copy_1 = at == 0
                    && copies[1].is_valid()
                    && copies[0].seq().zip(copies[1].seq()).is_some_and(|(torn, sound)| torn == sound.wrapping_add(1))
                    && matches!(geometry_hint_at(dev, flags, size, g.container_offset(1))?, Some(Hint::Layout(h)) if same_layout(&h, &g));
                if copies[usize::from(at != 0)].is_valid() || sound_copy_1 {
                    return checkpoint_in(dev, g, copies);
                }
                damaged_layouts.push((g, copies));
            }
            Hint::Layout(_) => {}
            Hint::Error { error, crc_ok: true, .. } => return Err(error),
            Hint::Error { error, crc_ok: false, block_align } => {
                damaged_error.get_or_insert(DiscoverError::DamagedCopy { error: Box::new(error), offset: at, block_align });
            }
        }
    }
    for (g, copies) in damaged_layouts {
        if let Some(found) = checkpoint_in(dev, g, copies)? {
            return Ok(Some(found));
        }
    }
    damaged_error.map_or(Ok(None), Err)
}

/// Step 2: with a layout, the copy the loader would trust, and its fields.
fn checkpoint_at<D: ReadAt + ?Sized>(
    dev: &D,
    geom: Geometry,
) -> Result<Option<(CheckpointMeta, [CopyStatus; 2], Geometry)>, DiscoverError> {
    checkpoint_in(dev, geom, read_copies(dev, &geom)?)
}

/// [`checkpoint_at`] with the copies already read there.
fn checkpoint_in<D: ReadAt + ?Sized>(
    dev: &D,
    geom: Geometry,
    copies: [CopyStatus; 2],
) -> Result<Option<(CheckpointMeta, [CopyStatus; 2], Geometry)>, DiscoverError> {
    let Some(newest) = newest_valid(&copies) else { return Ok(None) };
    let meta = match read_entries(dev, &geom, newest, &JsonLimits::default(), &mut |_| Ok(())) {
        Ok(m) => m,
        // Past fdpblk's bounds, not malformed: LMCache would load it.
        Err(e @ (JsonError::TooDeep { .. } | JsonError::StringTooLong { .. } | JsonError::TooLarge { .. })) => {
            return Err(DiscoverError::Unparsable(e))
        }
        Err(JsonError::Io(e)) => return Err(DiscoverError::Io(std::io::Error::other(e))),
        // Python's json.loads takes NaN and Infinity: LMCache loads it.
        Err(JsonError::Syntax { at, .. }) if super::checkpoint::python_only_literal_at(dev, &geom, newest, at)? => {
            return Err(DiscoverError::Unparsable(JsonError::Syntax { at, what: "a NaN or Infinity literal (Python's json.loads, LMCache's, takes it)" }))
        }
        Err(_) => return Ok(None), // valid CRC but malformed JSON: LMCache starts empty too
    };
    Ok(Some((meta, copies, geom)))
}

fn provisional_from_flags(flags: &GeometryFlags, size: u64) -> Option<Geometry> {
    let a = flags.block_align.unwrap_or(DEFAULT_BLOCK_ALIGN);
    probe_layout(
        GeometryConfig {
            block_align: a,
            header_bytes: flags.header_bytes.unwrap_or(DEFAULT_HEADER_BYTES),
            // Only the metadata layout matters for reading checkpoints.
            slot_bytes: flags.slot_bytes.unwrap_or(flags.header_bytes.unwrap_or(DEFAULT_HEADER_BYTES).saturating_add(a)),
            meta_total_bytes: flags.meta_total_bytes?,
            capacity_bytes: 0,
        },
        size,
    )
    .ok()
}

/// A layout to look for checkpoints with: only its metadata region matters, so one whose
/// slots over the whole device are more than fdpblk tracks is looked at with one slot (its
/// real capacity, from the checkpoint or `--capacity-bytes`, is checked once it is known).
fn probe_layout(cfg: GeometryConfig, size: u64) -> Result<Geometry, GeometryError> {
    match cfg.validate(size) {
        Err(GeometryError::TooManySlots { .. }) => {
            GeometryConfig { capacity_bytes: cfg.meta_total_bytes.saturating_add(cfg.slot_bytes), ..cfg }.validate(size)
        }
        r => r,
    }
}

/// Where copy 1 may sit when copy 0 is unreadable: half of a power-of-two metadata region
/// from 1 MiB to 2 GiB (LMCache's defaults are 128 and 256 MiB).
const COPY1_CANDIDATES: std::ops::RangeInclusive<u32> = 19..=30;

/// What one container's own JSON says of the layout (copy 0 at offset 0, else copy 1 at one
/// of the usual places). Only the geometry fields are read (they precede `entries`), so a
/// copy whose payload is torn still tells where everything is; one that fails its CRC is
/// believed only where nothing sound says otherwise.
enum Hint {
    Layout(Geometry),
    /// A layout that cannot be, whether its copy passes its CRC (then it is LMCache's), and
    /// the block size its JSON was found with.
    Error { error: DiscoverError, crc_ok: bool, block_align: u64 },
}

/// Reads the container header at `at`, finds its JSON one block later (trying each possible
/// `block_align`), and parses the geometry fields from the JSON's first bytes.
fn geometry_hint_at<D: ReadAt + ?Sized>(
    dev: &D,
    flags: &GeometryFlags,
    size: u64,
    at: u64,
) -> Result<Option<Hint>, DiscoverError> {
    const PREFIX: u64 = 64 * 1024;
    if at.saturating_add(64) > size {
        return Ok(None);
    }
    let mut hdr = [0u8; 32];
    dev.read_exact_at(&mut hdr, at)?;
    let Ok(h) = CheckpointHeader::parse(&hdr, size) else { return Ok(None) };
    // The flag's first, then the others: a checkpoint of another block_align is LMCache's
    // all the same, and conflicts with the flag.
    let aligns: Vec<u64> = flags.block_align.into_iter().chain(ALIGN_CANDIDATES.into_iter().filter(|&c| Some(c) != flags.block_align)).collect();
    for a in aligns {
        let Some(start) = at.checked_add(a) else { continue };
        let n = h.payload_len.min(PREFIX).min(size.saturating_sub(start));
        if n < JSON_START.len() as u64 {
            continue;
        }
        let mut buf = vec![0u8; n as usize];
        dev.read_exact_at(&mut buf, start)?;
        if !buf.starts_with(JSON_START) {
            continue;
        }
        let Some(meta) = geometry_prefix(&buf) else { continue };
        let get = |k: &str| meta.get(k).and_then(serde_json::Value::as_u64);
        let (Some(slot_bytes), Some(meta_total_bytes)) = (get("slot_bytes"), get("meta_total_bytes")) else { continue };
        let cfg = GeometryConfig {
            block_align: get("block_align").unwrap_or(a),
            header_bytes: get("header_bytes").or(flags.header_bytes).unwrap_or(DEFAULT_HEADER_BYTES),
            slot_bytes,
            meta_total_bytes,
            capacity_bytes: 0,
        };
        let error = match probe_layout(cfg, size) {
            Ok(g) => return Ok(Some(Hint::Layout(g))),
            // A checkpoint that is LMCache's (its JSON begins where its block_align says) on
            // a device too small for its layout: that is the error, not "no checkpoint".
            Err(GeometryError::DeviceTooSmall { meta_total_bytes, capacity, slot_bytes }) if get("block_align") == Some(a) => {
                DiscoverError::CheckpointTooBig { meta_bytes: meta_total_bytes.min(size), slot_bytes, capacity }
            }
            // A layout LMCache takes but fdpblk does not serve: not damage, nothing to erase.
            Err(error @ GeometryError::BlockAlignTooLarge(_)) if get("block_align") == Some(a) => DiscoverError::Geometry(error),
            // Its own values break a rule LMCache enforces: damaged, said so (flags would
            // only conflict with it).
            Err(error) if get("block_align") == Some(a) => {
                DiscoverError::ImpossibleCheckpoint { error, meta_bytes: meta_total_bytes.min(size) }
            }
            Err(_) => continue,
        };
        // Only here, on the way to an error. A payload longer than its own layout's container
        // holds is one LMCache's loader skips: damaged without reading it (a torn length
        // would otherwise have every look, the learner's every 30 s, read the device whole).
        // The JSON's own `meta_total_bytes` may be as damaged: past the most any checkpoint
        // is read (`JsonLimits`), it is not read either.
        let cap = ((meta_total_bytes / 2) / a * a).saturating_sub(a).min(JsonLimits::default().max_payload_bytes);
        let crc_ok = h.payload_len <= cap.min(size - start) && payload_crc(dev, start, h.payload_len)? == h.crc32;
        return Ok(Some(Hint::Error { error, crc_ok, block_align: a }));
    }
    Ok(None)
}

/// The top-level fields before `"entries"` as a JSON object: LMCache writes them first.
fn geometry_prefix(buf: &[u8]) -> Option<serde_json::Map<String, serde_json::Value>> {
    let cut = buf.windows(11).position(|w| w == br#","entries":"#)?;
    let mut head = buf[..cut].to_vec();
    head.push(b'}');
    match serde_json::from_slice::<serde_json::Value>(&head).ok()? {
        serde_json::Value::Object(m) => Some(m),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{copy_json, fixture, put_copy};

    #[test]
    fn every_fixture_from_its_checkpoint_alone() {
        for scen in [
            "legacy-basic",
            "legacy-basic.io_uring",
            "legacy-basic.odirect",
            "object-evict",
            "object-evict.io_uring",
            "object-evict.odirect",
            "object-multitenant",
            "object-multitenant.io_uring",
            "object-multitenant.odirect",
            "reopen",
            "reopen.io_uring",
            "reopen.odirect",
        ] {
            let (img, m) = fixture(scen);
            let d = discover(&img, &GeometryFlags::default()).unwrap_or_else(|e| panic!("{scen}: {e}"));
            let g = &m["geometry"];
            assert_eq!(d.source, GeometrySource::Checkpoint);
            assert_eq!(d.geometry.slot_bytes, g["slot_bytes"].as_u64().unwrap(), "{scen}");
            assert_eq!(d.geometry.header_bytes, g["header_bytes"].as_u64().unwrap(), "{scen}");
            assert_eq!(d.geometry.meta_total_bytes, g["meta_total_bytes"].as_u64().unwrap(), "{scen}");
            assert_eq!(d.geometry.max_slots, g["max_slots"].as_u64().unwrap(), "{scen}");
            assert_eq!(d.geometry.capacity_bytes, g["capacity_bytes_effective"].as_u64().unwrap(), "{scen}");
        }
    }

    #[test]
    fn flags_confirm_or_conflict() {
        let (img, _) = fixture("object-evict");
        let ok = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() };
        assert_eq!(discover(&img, &ok).unwrap().source, GeometrySource::Both);
        let bad = GeometryFlags { slot_bytes: Some(131072), ..Default::default() };
        let e = discover(&img, &bad).unwrap_err();
        assert!(matches!(e, DiscoverError::Conflict { field: "slot_bytes", flag: 131072, checkpoint: 65536, .. }), "{e}");
        assert!(e.to_string().contains("--slot-bytes"));
        // A new meta_total_bytes: the old containers are where the checkpoint's own value says.
        let bigger = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(2 << 20), ..Default::default() };
        let e = discover(&img, &bigger).unwrap_err();
        assert!(matches!(e, DiscoverError::Conflict { field: "meta_total_bytes", meta_bytes: 1048576, .. }), "{e}");
        // Erasing them (what LMCache's new configuration makes of them anyway) clears the way.
        let mut erased = img.clone();
        erased[..1 << 20].fill(0);
        assert_eq!(discover(&erased, &bigger).unwrap().source, GeometrySource::Flags);
        assert_eq!(discover(&erased, &bad).unwrap_err().to_string(), DiscoverError::NoCheckpoint { missing: "--meta-total-bytes" }.to_string());
    }

    /// A checkpoint with a valid CRC whose own values break LMCache's rules (header_bytes not
    /// a multiple of block_align): said so, not blamed on a flag that would then conflict.
    #[test]
    fn a_checkpoint_with_an_impossible_layout_is_named_as_such() {
        let (mut img, _) = fixture("object-evict");
        let size = img.len() as u64;
        for at in [0usize, 524288] {
            let h = CheckpointHeader::parse(&img[at..at + 32], size).unwrap();
            let range = at + 4096..at + 4096 + h.payload_len as usize;
            let json = String::from_utf8(img[range.clone()].to_vec()).unwrap();
            assert!(json.contains(r#""header_bytes":4096"#));
            let json = json.replace(r#""header_bytes":4096"#, r#""header_bytes":1000"#);
            img[range].copy_from_slice(json.as_bytes());
            img[at + 28..at + 32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
        }
        let layout = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() };
        for flags in [GeometryFlags::default(), layout] {
            let e = discover(&img, &flags).unwrap_err();
            assert!(matches!(e, DiscoverError::ImpossibleCheckpoint { meta_bytes: 1048576, .. }), "{e}");
            assert!(e.to_string().contains("header_bytes 1000") && e.to_string().contains("damaged"), "{e}");
        }
        // The flag for it conflicts, as before: the erase (named by `add`) is the way out.
        let fixed = GeometryFlags { header_bytes: Some(4096), ..layout };
        assert!(matches!(discover(&img, &fixed).unwrap_err(), DiscoverError::Conflict { field: "header_bytes", .. }));
    }

    /// The error a damaged copy at `offset` (block_align 4096) names.
    fn damaged_at(e: &DiscoverError, offset: u64) -> &DiscoverError {
        match e {
            DiscoverError::DamagedCopy { error, offset: o, block_align: 4096 } if *o == offset => error,
            _ => panic!("not a damaged copy at {offset}: {e:?}"),
        }
    }

    /// Copy 0 failing its CRC with a torn meta_total_bytes (not a 4 KiB multiple, 934 MB on a
    /// device of less) and no sound copy: LMCache skips it and starts empty. The flags' layout
    /// is taken; without them the error says so, and its own values size nothing.
    #[test]
    fn a_damaged_copy_with_an_impossible_layout_gives_way_to_the_flags() {
        let (mut img, _) = fixture("object-evict");
        let json = copy_json(&img, 0).1.replace(r#""meta_total_bytes":1048576"#, r#""meta_total_bytes":934217728"#);
        img[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
        img[524288..524288 + 4096].fill(0);
        let img = Sparse(img, 2 << 30, Default::default());
        let e = discover(&img, &GeometryFlags::default()).unwrap_err();
        assert!(matches!(damaged_at(&e, 0), DiscoverError::ImpossibleCheckpoint { .. }), "{e}");
        assert!(e.to_string().contains("fails LMCache's checks too (its checksum"), "{e}");
        let layout = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() };
        let d = discover(&img, &layout).unwrap();
        assert_eq!((d.source, d.geometry.meta_total_bytes, d.geometry.slot_bytes), (GeometrySource::Flags, 1 << 20, 65536));
        assert!(d.checkpoint.is_none());
        // Half the layout given: still the error (the other half is not known).
        let half = GeometryFlags { slot_bytes: Some(65536), ..Default::default() };
        assert!(matches!(discover(&img, &half).unwrap_err(), DiscoverError::DamagedCopy { .. }));
    }

    /// Python's json.loads takes NaN and Infinity: a checkpoint holding one is LMCache's to
    /// load, so it is past what fdpblk parses, not a malformed one LMCache starts empty over.
    #[test]
    fn a_checkpoint_with_a_nan_is_beyond_the_parser_not_malformed() {
        let (mut img, _) = fixture("object-evict");
        let (seq, json) = copy_json(&img, 524288);
        assert!(copy_json(&img, 0).0 < seq, "copy 1 is the newest");
        let with_nan = json.replacen(r#""entries":"#, r#""x":NaN,"entries":"#, 1);
        assert!(with_nan.contains("NaN"));
        put_copy(&mut img, 524288, seq, &with_nan);
        let e = discover(&img, &GeometryFlags::default()).unwrap_err();
        assert!(matches!(e, DiscoverError::Unparsable(JsonError::Syntax { .. })), "{e}");
        // Malformed in a way Python refuses too: LMCache starts empty; the older copy is not
        // its fallback either, so no checkpoint is taken from the container.
        put_copy(&mut img, 524288, seq, &json.replacen(r#""entries":"#, r#""x":nan,"entries":"#, 1));
        assert!(!matches!(discover(&img, &GeometryFlags::default()), Err(DiscoverError::Unparsable(_))));
    }

    /// An image, borrowed, counting the bytes read.
    struct Counting<'a>(&'a [u8], std::cell::Cell<u64>);
    impl ReadAt for Counting<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            let n = self.0.read_at(buf, offset)?;
            self.1.set(self.1.get() + n as u64);
            Ok(n)
        }
        fn size(&self) -> std::io::Result<u64> {
            self.0.size()
        }
    }

    /// Seeded mutations of real LMCache images: bytes of a container's header block and
    /// JSON flipped, its length torn, its CRC made to match the result or not. Discovery and
    /// a full read of the newest copy's entries never panic, and read a bounded number of
    /// bytes. (The fuzz targets do this unseeded and are not run in CI; this is.)
    #[test]
    fn mutated_fixture_images_never_panic_and_read_a_bounded_amount() {
        let mut rng = crate::test_fixtures::XorShift(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.draw();
        let mut images: Vec<Vec<u8>> = ["object-evict", "legacy-basic", "object-multitenant", "reopen"].map(|f| fixture(f).0).into();
        let flags = [GeometryFlags::default(), GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() }];
        let (mut found, mut entries, mut most) = (0, 0u64, 0u64);
        for i in 0..2000usize {
            let img = &mut images[i % 4];
            let size = img.len() as u64;
            let mut undo: Vec<(usize, u8)> = Vec::new();
            let mut set = |img: &mut Vec<u8>, at: usize, b: u8| {
                undo.push((at, img[at]));
                img[at] = b;
            };
            let at = if next() % 2 == 0 { 0 } else { 524288 };
            let len = u64::from_le_bytes(img[at + 20..at + 28].try_into().unwrap()).min(64 << 10) as usize;
            for _ in 0..1 + next() % 8 {
                let k = at + (next() as usize) % (4096 + len + 16);
                set(img, k, next() as u8);
            }
            if next() % 4 == 0 {
                let torn = match next() % 3 {
                    0 => next() % 64,
                    1 => next() % (size * 2),
                    _ => next(),
                };
                for (j, b) in torn.to_le_bytes().into_iter().enumerate() {
                    set(img, at + 20 + j, b);
                }
            }
            if next() % 2 == 0 {
                let n = u64::from_le_bytes(img[at + 20..at + 28].try_into().unwrap());
                if let Some(payload) = img.get(at + 4096..).and_then(|p| p.get(..usize::try_from(n).ok()?)) {
                    for (j, b) in crc32fast::hash(payload).to_le_bytes().into_iter().enumerate() {
                        set(img, at + 28 + j, b);
                    }
                }
            }
            for f in &flags {
                let dev = Counting(&img[..], Default::default());
                if let Ok(d) = discover(&dev, f) {
                    found += 1;
                    if let Some(c) = read_copies(&dev, &d.geometry).ok().as_ref().and_then(|c| newest_valid(c).cloned()) {
                        let _ = read_entries(&dev, &d.geometry, &c, &JsonLimits::default(), &mut |_| {
                            entries += 1;
                            Ok(())
                        });
                    }
                }
                most = most.max(dev.1.get());
            }
            for (k, b) in undo.into_iter().rev() {
                img[k] = b;
            }
        }
        // 3108 layouts and 40724 entries found, 1.77 MB read at most, with this seed.
        assert!(found > 2000 && entries > 20_000, "the mutations leave checkpoints to read ({found} found, {entries} entries)");
        assert!(most < 4 << 20, "one look read {most} bytes, more than the 4 MiB image");
    }

    /// An image (its first bytes), then zeroes up to a size; it counts the bytes read.
    struct Sparse(Vec<u8>, u64, std::cell::Cell<u64>);
    impl ReadAt for Sparse {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            let n = (buf.len() as u64).min(self.1.saturating_sub(offset)) as usize;
            buf[..n].fill(0);
            if let Some(head) = self.0.get(offset.min(self.0.len() as u64) as usize..) {
                let k = head.len().min(n);
                buf[..k].copy_from_slice(&head[..k]);
            }
            self.2.set(self.2.get() + n as u64);
            Ok(n)
        }
        fn size(&self) -> std::io::Result<u64> {
            Ok(self.1)
        }
    }

    /// A device whose whole size would hold more slots than fdpblk tracks still shows its
    /// checkpoint: only the metadata region is needed to find it, and the layout then takes
    /// the checkpoint's capacity_bytes (or the flag's, which may be the one too large).
    #[test]
    fn a_checkpoint_is_found_on_a_device_of_more_slots_than_fdpblk_tracks() {
        let (img, m) = fixture("object-evict");
        assert_eq!(m["geometry"]["capacity_bytes_effective"], 4 << 20);
        let size = (1 << 20) + (crate::layout::geometry::MAX_SLOTS + 1) * 65536;
        let dev = Sparse(img, size, Default::default());
        let layout = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() };
        for (flags, source) in [(GeometryFlags::default(), GeometrySource::Checkpoint), (layout, GeometrySource::Both)] {
            let d = discover(&dev, &flags).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!((d.source, d.geometry.max_slots, d.geometry.capacity_bytes), (source, 48, 4 << 20));
            assert!(d.checkpoint.is_some());
        }
        // The whole device as the capacity: too many slots, said so (not "no checkpoint").
        let whole = GeometryFlags { capacity_bytes: Some(size), ..layout };
        let e = discover(&dev, &whole).unwrap_err();
        assert!(matches!(e, DiscoverError::Geometry(GeometryError::TooManySlots { .. })), "{e}");
    }

    /// Copy 0 half-written with a new layout (LMCache crashed writing its first checkpoint
    /// after a restart with another slot_bytes): discovery takes copy 1's, and names copy 0's
    /// as a layout LMCache may run with. A copy 0 torn but of the same layout names nothing.
    #[test]
    fn a_half_written_copy_0_of_another_layout_is_named() {
        let (img, _) = fixture("object-evict");
        let json = copy_json(&img, 0).1.replace(r#""slot_bytes":65536"#, r#""slot_bytes":32768"#);
        let mut half = img.clone();
        put_copy(&mut half, 0, 1, &json);
        half[4096 + json.len() / 2..4096 + json.len()].fill(0);
        let flags = GeometryFlags::default();
        let d = discover(&half, &flags).unwrap();
        assert_eq!(d.geometry.slot_bytes, 65536);
        assert_eq!(torn_copy_layout(&half, &flags, &d).map(|g| g.slot_bytes), Some(32768));
        let mut torn = img.clone();
        torn[4096 + 400] ^= 1;
        let d = discover(&torn, &flags).unwrap();
        assert_eq!(torn_copy_layout(&torn, &flags, &d), None);
        let d = discover(&img, &flags).unwrap();
        assert_eq!(torn_copy_layout(&img, &flags, &d), None, "both copies sound");
    }

    /// LMCache moved from meta_total_bytes 1 MiB (A) to 2 MiB (B), checkpointed into both of
    /// B's copies, and crashed writing the next into copy 0. A's old copy 1 (at 512 KiB) still
    /// lies inside B's container 0; LMCache loads B's copy 1, and so does discovery.
    #[test]
    fn a_torn_copy_0_with_its_own_sound_copy_1_wins_over_an_older_layouts_copy_1() {
        let (mut img, _) = fixture("object-evict");
        let size = img.len() as u64;
        let a_json = copy_json(&img, 0).1;
        assert!(a_json.contains(r#""meta_total_bytes":1048576"#) && a_json.contains(r#""data_base_offset":1048576"#));
        let b_json = a_json.replace(r#""meta_total_bytes":1048576"#, r#""meta_total_bytes":2097152"#).replace(r#""data_base_offset":1048576"#, r#""data_base_offset":2097152"#);
        let a1_seq = copy_json(&img, 512 * 1024).0;
        assert_ne!(a1_seq, 6);
        img[..512 * 1024].fill(0);
        put_copy(&mut img, 1 << 20, 6, &b_json);
        put_copy(&mut img, 0, 7, &b_json);
        let half = b_json.len() / 2;
        img[4096 + half..4096 + b_json.len()].fill(0);
        assert!(CheckpointHeader::parse(&img[512 * 1024..512 * 1024 + 32], size).is_ok(), "A's copy 1 is still there");
        let d = discover(&img, &GeometryFlags::default()).unwrap();
        assert_eq!((d.geometry.meta_total_bytes, d.checkpoint.as_ref().and_then(|m| m.meta_total_bytes)), (2 << 20, Some(2 << 20)));
        assert_eq!(d.copies.as_ref().map(|c| c[1].seq()), Some(Some(6)));
        assert_eq!(torn_copy_layout(&img, &GeometryFlags::default(), &d), None, "copy 0 is of the layout taken");
        // LMCache back on A: its next header (A's copy 1 seq + 1) landed over B's old JSON
        // before its own JSON did. A's copy 1 is what LMCache loads, and discovery takes it.
        let mut back = img.clone();
        back[..4096].copy_from_slice(&CheckpointHeader::encode_for(a1_seq + 1, a_json.as_bytes(), 4096));
        back[4096..4096 + b_json.len()].copy_from_slice(b_json.as_bytes());
        let d = discover(&back, &GeometryFlags::default()).unwrap();
        assert_eq!(d.geometry.meta_total_bytes, 1 << 20, "the older layout's copy 1, LMCache's");
        assert_eq!(d.copies.as_ref().map(|c| c[1].seq()), Some(Some(a1_seq)));
    }

    /// A damaged copy whose length field reaches past its own container is not read whole
    /// to check its CRC: LMCache's loader skips it for that length alone.
    #[test]
    fn a_damaged_copy_longer_than_its_container_is_not_read_whole() {
        let (mut img, _) = fixture("object-evict");
        img.resize(64 << 20, 0);
        // Copy 0 with an impossible header_bytes, then its length torn to most of the device;
        // copy 1 gone.
        let json = String::from_utf8_lossy(&img[4096..4096 + 3730]).replace(r#""header_bytes":4096"#, r#""header_bytes":1000"#);
        img[4096..4096 + 3730].copy_from_slice(json.as_bytes());
        img[524288..524288 + 4096].fill(0);
        let run = |img: &[u8]| {
            let dev = Counting(img, Default::default());
            let e = discover(&dev, &GeometryFlags::default()).unwrap_err();
            (e, dev.1.get())
        };
        let (e, sound_len) = run(&img);
        assert!(matches!(damaged_at(&e, 0), DiscoverError::ImpossibleCheckpoint { .. }), "{e}");
        img[20..28].copy_from_slice(&((64u64 << 20) - 8192).to_le_bytes());
        let (e, torn_len) = run(&img);
        assert!(matches!(damaged_at(&e, 0), DiscoverError::ImpossibleCheckpoint { .. }), "still named: {e}");
        // Its JSON's first 64 KiB at each block size tried, not the 64 MiB its length says.
        assert!(torn_len < 1 << 20, "read {torn_len} bytes, {sound_len} with its true length");
    }

    /// A damaged copy whose JSON's own meta_total_bytes is past the device (so its container
    /// bounds nothing) and whose length reaches most of the device: not read either, beyond
    /// the most any checkpoint is read.
    #[test]
    fn a_damaged_copy_of_a_layout_past_the_device_is_not_read_whole() {
        let (mut img, _) = fixture("object-evict");
        let json = copy_json(&img, 0).1.replace(r#""meta_total_bytes":1048576"#, r#""meta_total_bytes":8589934592"#);
        put_copy(&mut img, 0, 1, &json);
        img[524288..524288 + 4096].fill(0);
        // Its length torn to 3 GiB of a 4 GiB device (the CRC no longer matches).
        img[20..28].copy_from_slice(&(3u64 << 30).to_le_bytes());
        let dev = Sparse(img, 4 << 30, Default::default());
        let e = discover(&dev, &GeometryFlags::default()).unwrap_err();
        assert!(matches!(damaged_at(&e, 0), DiscoverError::CheckpointTooBig { .. }), "{e}");
        assert!(dev.2.get() < 1 << 20, "read {} bytes", dev.2.get());
    }

    /// object-evict restarted with 32 KiB slots: LMCache wrote seq 1 into copy 0 and copy 1
    /// still holds the old layout's seq 2 or later (reference §4.1).
    fn object_evict_relayout() -> (Vec<u8>, u64) {
        let (mut img, _) = fixture("object-evict");
        let size = img.len() as u64;
        let h1 = CheckpointHeader::parse(&img[524288..524288 + 32], size).unwrap();
        assert!(h1.seq >= 2, "copy 1 must hold the higher seq");
        let h = CheckpointHeader::parse(&img[..32], size).unwrap();
        let json = String::from_utf8(img[4096..4096 + h.payload_len as usize].to_vec()).unwrap();
        let json = json.replace(r#""slot_bytes":65536"#, r#""slot_bytes":32768"#);
        img[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
        img[12..20].copy_from_slice(&1u64.to_le_bytes());
        img[28..32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
        (img, h1.seq)
    }

    #[test]
    fn two_copies_with_different_layouts_are_refused_unless_the_flags_tell() {
        let (img, stale_seq) = object_evict_relayout();
        // No flags: which layout LMCache runs with is not known.
        let e = discover(&img, &GeometryFlags::default()).unwrap_err();
        assert!(
            matches!(e, DiscoverError::TwoLayouts { field: "slot_bytes", flag: None, stale_value: 65536, current_value: 32768, stale: 1, current_seq: 1, offset: 524288, .. }),
            "{e}"
        );
        assert!(e.to_string().contains(&format!("seq {stale_seq}")) && e.to_string().contains("--slot-bytes"), "{e}");
        // The new layout's flags: the old copy is named, with where to erase it.
        let new = GeometryFlags { slot_bytes: Some(32768), ..Default::default() };
        let e = discover(&img, &new).unwrap_err();
        assert!(matches!(e, DiscoverError::TwoLayouts { flag: Some(32768), stale: 1, offset: 524288, block_align: 4096, .. }), "{e}");
        // A flag both layouts share tells nothing; with one that tells, the same as above.
        let shared = GeometryFlags { block_align: Some(4096), ..Default::default() };
        assert!(matches!(discover(&img, &shared).unwrap_err(), DiscoverError::TwoLayouts { flag: None, .. }));
        let both = GeometryFlags { block_align: Some(4096), slot_bytes: Some(32768), ..Default::default() };
        assert!(matches!(discover(&img, &both).unwrap_err(), DiscoverError::TwoLayouts { flag: Some(32768), .. }));
        // The old layout's flags: the loader's copy, taken as before.
        let old = GeometryFlags { slot_bytes: Some(65536), ..Default::default() };
        assert_eq!(discover(&img, &old).unwrap().geometry.slot_bytes, 65536);
        // A flag neither copy has: the usual conflict with the newest.
        let neither = GeometryFlags { slot_bytes: Some(131072), ..Default::default() };
        assert!(matches!(discover(&img, &neither).unwrap_err(), DiscoverError::Conflict { checkpoint: 65536, .. }));
        // With the old copy's header erased, the new layout is found from copy 0.
        let mut erased = img.clone();
        erased[524288..524288 + 4096].fill(0);
        assert_eq!(discover(&erased, &GeometryFlags::default()).unwrap().geometry.slot_bytes, 32768);
        assert_eq!(discover(&erased, &new).unwrap().source, GeometrySource::Both);
    }

    /// object-evict's checkpoint as LMCache writes it with `block_align` (and `header_bytes`)
    /// 8192: each copy's JSON one 8 KiB block after its header, CRC over the new JSON.
    fn object_evict_aligned_8k() -> Vec<u8> {
        object_evict_aligned_8k_with(r#""block_align":8192,"header_bytes":8192"#)
    }

    /// The same, with `fields` in place of the JSON's block_align and header_bytes (padded
    /// with spaces to their length: the header's payload length stays).
    fn object_evict_aligned_8k_with(fields: &str) -> Vec<u8> {
        let (img, _) = fixture("object-evict");
        let mut out = img.clone();
        for at in [0usize, 524288] {
            let h = CheckpointHeader::parse(&img[at..at + 32], img.len() as u64).unwrap();
            let json = String::from_utf8(img[at + 4096..at + 4096 + h.payload_len as usize].to_vec()).unwrap();
            let old = r#""block_align":4096,"header_bytes":4096"#;
            let json = json.replace(old, &format!("{fields:<0$}", old.len()));
            out[at + 4096..at + 8192 + json.len()].fill(0);
            out[at + 8192..at + 8192 + json.len()].copy_from_slice(json.as_bytes());
            out[at + 28..at + 32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
        }
        out
    }

    #[test]
    fn metadata_flags_without_block_align_still_find_a_checkpoint_of_another_block_size() {
        let img = object_evict_aligned_8k();
        let d = discover(&img, &GeometryFlags::default()).unwrap();
        assert_eq!((d.geometry.block_align, d.geometry.header_bytes), (8192, 8192));
        // --meta-total-bytes alone (block_align left to its default 4096) used to read the JSON
        // one 4 KiB block after the header, miss both copies and ask for --slot-bytes.
        let f = GeometryFlags { meta_total_bytes: Some(1 << 20), ..Default::default() };
        let d = discover(&img, &f).unwrap();
        assert_eq!(d.source, GeometrySource::Both);
        assert_eq!((d.geometry.block_align, d.geometry.slot_bytes), (8192, 65536));
        assert_eq!(d.checkpoint.unwrap().next_slot, Some(16));
        // ... and with --slot-bytes too, silently took a 4096-byte layout.
        let f = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() };
        assert_eq!(discover(&img, &f).unwrap().geometry.header_bytes, 8192);
        // A block_align given by flag that disagrees: an error naming it, with or without
        // the other flags (with them, the flags' layout used to be served as it was).
        for slot_bytes in [None, Some(65536)] {
            let f = GeometryFlags { block_align: Some(4096), slot_bytes, meta_total_bytes: Some(1 << 20), ..Default::default() };
            let e = discover(&img, &f).unwrap_err();
            assert!(matches!(e, DiscoverError::Conflict { field: "block_align", flag: 4096, checkpoint: 8192, .. }), "{e}");
        }
        // A checkpoint without block_align (LMCache always writes it; a hand-made one may not)
        // keeps the block size it was found with, not the default.
        let img = object_evict_aligned_8k_with(r#""header_bytes":8192"#);
        let d = discover(&img, &GeometryFlags::default()).unwrap();
        assert_eq!((d.geometry.block_align, d.geometry.header_bytes), (8192, 8192));
    }

    #[test]
    fn an_absurd_block_align_flag_is_refused_not_overflowed() {
        let (img, _) = fixture("object-evict");
        let f = GeometryFlags { block_align: Some(u64::MAX), ..Default::default() };
        assert!(discover(&img, &f).is_err());
    }

    #[test]
    fn a_checkpoint_beyond_the_parsers_bounds_is_an_error_naming_the_flags() {
        use crate::layout::checkpoint::{newest_valid, read_copies};
        use crate::layout::checkpoint_header::CheckpointHeader;
        // object-evict's newest checkpoint with a 70 KiB key first among its entries: valid
        // JSON that LMCache loads, past fdpblk's 64 KiB string bound. Not "no checkpoint".
        let (mut img, _) = fixture("object-evict");
        let g = discover(&img, &GeometryFlags::default()).unwrap().geometry;
        let copies = read_copies(&img, &g).unwrap();
        let newest = newest_valid(&copies).unwrap();
        let (seq, at, len) = (newest.seq().unwrap(), newest.offset as usize, newest.payload_len().unwrap() as usize);
        let ba = g.block_align as usize;
        let json = String::from_utf8(img[at + ba..at + ba + len].to_vec()).unwrap();
        let long = format!("\"entries\":{{\"{}\":{{\"offset\":0,\"size\":1}},", "k".repeat(70 * 1024));
        let json = json.replacen("\"entries\":{", &long, 1);
        assert!(json.len() as u64 <= g.payload_cap());
        img[at + ba..at + ba + json.len()].copy_from_slice(json.as_bytes());
        img[at..at + ba].copy_from_slice(&CheckpointHeader::encode_for(seq, json.as_bytes(), ba));
        let e = discover(&img, &GeometryFlags::default()).unwrap_err();
        assert!(matches!(e, DiscoverError::Unparsable(JsonError::StringTooLong { .. })), "{e}");
        assert!(e.to_string().contains("--layout lmcache --slot-bytes"), "{e}");
    }

    #[test]
    fn a_checkpoint_on_a_device_too_small_for_its_layout_says_so() {
        // object-evict's checkpoint (1 MiB of metadata, 64 KiB slots) on its first 1 MiB only.
        let (img, _) = fixture("object-evict");
        let small = img[..1 << 20].to_vec();
        let e = discover(&small, &GeometryFlags::default()).unwrap_err();
        assert!(matches!(e, DiscoverError::CheckpointTooBig { meta_bytes: 1048576, slot_bytes: 65536, capacity: 1048576 }), "{e}");
        // Not "a smaller --meta-total-bytes": that flag would conflict with the checkpoint.
        assert!(e.to_string().contains("give the whole device LMCache wrote"), "{e}");
        assert!(!e.to_string().contains("--meta-total-bytes"), "{e}");
    }

    #[test]
    fn blank_device_needs_flags() {
        let img = vec![0u8; 8 << 20];
        let e = discover(&img, &GeometryFlags::default()).unwrap_err();
        assert!(e.to_string().contains("--slot-bytes and --meta-total-bytes"), "{e}");
        let f = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..Default::default() };
        let d = discover(&img, &f).unwrap();
        assert_eq!(d.source, GeometrySource::Flags);
        assert_eq!(d.geometry.max_slots, 112);
        let tiny = vec![0u8; 1 << 20];
        assert!(matches!(discover(&tiny, &f), Err(DiscoverError::Geometry(GeometryError::DeviceTooSmall { .. }))));
    }

    #[test]
    fn copy0_payload_corrupt_copy1_still_found() {
        let (mut img, _) = fixture("object-evict");
        // One byte of copy 0's JSON (past the geometry fields): its CRC fails, copy 1 is newest.
        img[4096 + 400] ^= 0x01;
        let d = discover(&img, &GeometryFlags::default()).unwrap();
        assert_eq!(d.geometry.slot_bytes, 65536);
        let copies = d.copies.unwrap();
        assert_eq!(copies[0].crc_ok, Some(false));
        assert_eq!(d.checkpoint.unwrap().next_slot, Some(16));
    }

    #[test]
    fn a_corrupt_older_copy_does_not_hide_the_valid_newer_one() {
        // Copy 0 (seq 1) with a damaged geometry field and its CRC left stale: LMCache skips
        // it and loads copy 1 (seq 2). Impossible, it was taken for the checkpoint (an erase
        // advised); possible but wrong, copy 1 was looked for in the wrong place.
        for (from, to) in [(r#""slot_bytes":65536"#, r#""slot_bytes":75536"#), (r#""meta_total_bytes":1048576"#, r#""meta_total_bytes":2097152"#)] {
            let (mut img, _) = fixture("object-evict");
            let json = String::from_utf8_lossy(&img[4096..4096 + 3730]).replace(from, to);
            assert_eq!(json.len(), 3730, "{from} is in copy 0 and keeps its length");
            img[4096..4096 + 3730].copy_from_slice(json.as_bytes());
            let d = discover(&img, &GeometryFlags::default()).unwrap();
            assert_eq!((d.geometry.slot_bytes, d.geometry.meta_total_bytes), (65536, 1 << 20), "{to}");
            assert_eq!(newest_valid(d.copies.as_ref().unwrap()).unwrap().seq(), Some(2), "{to}");
            // With copy 1 gone too, nothing sound is left: an impossible layout is named, a
            // possible one finds no checkpoint where it says.
            img[524288..524288 + 4096].fill(0);
            let e = discover(&img, &GeometryFlags::default()).unwrap_err();
            match to.contains("slot_bytes") {
                true => assert!(matches!(damaged_at(&e, 0), DiscoverError::ImpossibleCheckpoint { .. }), "{to}: {e}"),
                false => assert!(matches!(e, DiscoverError::NoCheckpoint { .. }), "{to}: {e}"),
            }
        }
    }

    #[test]
    fn copy1_found_when_copy0_is_torn() {
        let (mut img, _) = fixture("object-evict");
        img[..4096].fill(0);
        // Found by probing the usual places of copy 1 (here 512 KiB for a 1 MiB region).
        let d = discover(&img, &GeometryFlags::default()).unwrap();
        assert_eq!(d.geometry.meta_total_bytes, 1 << 20);
        assert_eq!(d.checkpoint.as_ref().unwrap().next_slot, Some(16));
        // With the metadata size given, copy 1 is read where the flags say.
        let f = GeometryFlags { meta_total_bytes: Some(1 << 20), ..Default::default() };
        assert_eq!(discover(&img, &f).unwrap().geometry.slot_bytes, 65536);
        // Flags of another layout (whole, block_align too) do not hide copy 1: they conflict.
        let other = GeometryFlags { block_align: Some(4096), slot_bytes: Some(65536), meta_total_bytes: Some(2 << 20), ..Default::default() };
        let e = discover(&img, &other).unwrap_err();
        assert!(matches!(e, DiscoverError::Conflict { field: "meta_total_bytes", flag: 2097152, checkpoint: 1048576, .. }), "{e}");
        // Both headers gone: nothing to learn from; the error names the flags.
        img[524288..524288 + 4096].fill(0);
        assert!(discover(&img, &GeometryFlags::default()).is_err());
        let e = discover(&img, &f).unwrap_err();
        assert!(e.to_string().contains("--slot-bytes"), "{e}");
    }
}
