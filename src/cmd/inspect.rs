//! `fdpblk inspect`: the layout, both checkpoint copies, and every live entry of the newest
//! valid checkpoint with a check of its slot header, as LMCache's loader would check it.
//! Entries are streamed, so a checkpoint of a million entries prints in bounded memory.

use super::CmdResult;
use crate::cli::InspectArgs;
use crate::device::{open_readonly, ReadAt};
use crate::layout::checkpoint::{newest_valid, python_only_literal_at, read_entries, CopyStatus};
use crate::layout::checkpoint_json::{JsonError, JsonLimits};
use crate::layout::discover::{discover, GeometryFlags};
use crate::layout::keys;
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::layout::Geometry;
use serde_json::json;
use std::io::{BufWriter, Write};

/// One index entry and what its slot header says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryReport {
    pub key: String,
    pub slot: Option<u64>,
    pub offset: Option<u64>,
    pub size: Option<u64>,
    pub identity: Option<u64>,
    pub header_ok: bool,
    /// Why the entry would be dropped by LMCache's loader, if it would.
    pub problem: Option<&'static str>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InspectSummary {
    /// Entries LMCache would load: those listed whose slot header is their key's, or 0 when
    /// it would discard the checkpoint.
    pub live: u64,
    /// Keys the newest valid checkpoint lists (an entry repeating a key counts once).
    pub listed: u64,
    /// Entries that repeat a key listed before in the same checkpoint: Python's `json.loads`
    /// (LMCache's) keeps the last of them, so the last one's verdict counts.
    pub duplicates: u64,
    /// Keys not checked for repeats, each counted in `listed`: keys with a lone surrogate
    /// (their text lost it, so two different keys may read the same) and keys past the first
    /// [`MAX_TRACKED_KEYS`].
    pub duplicates_unchecked: u64,
    pub header_mismatch: u64,
    /// Entries in slots past the end of an image file, not checked (and not counted in
    /// `header_mismatch` or `live`); on a device such entries count in `header_mismatch`.
    pub beyond_end: u64,
    /// An image shorter than the checkpoint's `capacity_bytes` (a truncated copy of a larger
    /// device): that capacity, which LMCache's checks are then made against.
    pub truncated_from: Option<u64>,
    pub checkpoint_seq: Option<u64>,
    /// Why LMCache would discard the whole checkpoint, if it would.
    pub rejected: Option<String>,
    /// The JSON stopped decoding: `listed` counts the keys read before the error.
    pub undecodable: bool,
    /// The path LMCache must be configured with to load it (compared exactly).
    pub device_path: Option<String>,
}

/// The problem of an entry whose slot lies past the end of the image or device.
const BEYOND_END: &str = "offset is beyond the device (a truncated image, or a checkpoint of a larger device)";

/// Checks one entry against the layout and its slot header (`_validate_loaded_entries`).
/// `lossy`: the key held a lone surrogate (`EntryRef::key_lossy`).
pub fn check_entry<D: ReadAt + ?Sized>(dev: &D, g: &Geometry, key: &str, lossy: bool, offset: Option<u64>, size: Option<u64>) -> EntryReport {
    // An object key's identity hashes its UTF-8, which a lone surrogate does not have.
    let lossy_object = lossy && matches!(keys::Key::parse(key), Ok(keys::Key::Object(_)));
    let identity = keys::identity(key).ok().filter(|_| !lossy_object);
    let mut r = EntryReport { key: key.to_string(), slot: None, offset, size, identity, header_ok: false, problem: None };
    let (Some(off), Some(sz)) = (offset, size) else {
        r.problem = Some("offset or size missing or not a non-negative integer");
        return r;
    };
    let slot = match g.slot_of(off) {
        Some((s, 0)) => s,
        // A slot LMCache's geometry has, past the end of this image or device.
        None if off >= g.meta_total_bytes && (off - g.meta_total_bytes).is_multiple_of(g.slot_bytes) => {
            r.problem = Some(BEYOND_END);
            return r;
        }
        _ => {
            r.problem = Some("offset is not a slot start");
            return r;
        }
    };
    r.slot = Some(slot);
    if sz == 0 || sz > g.slot_payload_capacity() {
        r.problem = Some("size outside the slot's payload capacity");
        return r;
    }
    let Some(id) = identity else {
        r.problem = Some(if lossy_object {
            "key has a lone surrogate escape, so no UTF-8 form: LMCache cannot load the entry"
        } else {
            "key is not an LMCache key string"
        });
        return r;
    };
    let mut b = [0u8; SLOT_HEADER_PREFIX];
    r.problem = match dev.read_exact_at(&mut b, off).map_err(|_| ()).and_then(|_| SlotHeader::parse(&b).map_err(|_| ())) {
        Err(()) => Some("slot header missing (no LMCBLK01)"),
        Ok(h) if h.identity != id => Some("slot header identity differs (slot reused)"),
        Ok(h) if h.payload_len != sz => Some("slot header payload_len differs"),
        Ok(_) => None,
    };
    r.header_ok = r.problem.is_none();
    r
}

/// Streams the newest valid checkpoint's entries through `on_entry`. `image`: `dev` is an
/// image file, which may be a truncated copy of a larger device (a block device is the size
/// LMCache sees, and so is an image given with `--capacity-bytes`).
pub fn inspect_entries<D: ReadAt + ?Sized>(
    dev: &D,
    g: &Geometry,
    copies: &[CopyStatus],
    image: bool,
    on_entry: &mut dyn FnMut(&EntryReport) -> std::io::Result<()>,
) -> Result<InspectSummary, Box<dyn std::error::Error>> {
    inspect_entries_tracking(dev, g, copies, MAX_TRACKED_KEYS, image, on_entry)
}

/// [`inspect_entries`], checking at most `max_tracked` keys for repeats.
fn inspect_entries_tracking<D: ReadAt + ?Sized>(
    dev: &D,
    g: &Geometry,
    copies: &[CopyStatus],
    max_tracked: usize,
    image: bool,
    on_entry: &mut dyn FnMut(&EntryReport) -> std::io::Result<()>,
) -> Result<InspectSummary, Box<dyn std::error::Error>> {
    let mut s = InspectSummary::default();
    let Some(newest) = newest_valid(copies) else { return Ok(s) };
    s.checkpoint_seq = newest.seq();
    // Each key seen, with its last entry's verdict (LMCache never writes a key twice; a
    // hand-edited or foreign checkpoint may): 18 bytes a bucket, at most `max_tracked` keys
    // ([`MAX_TRACKED_KEYS`]).
    #[derive(Clone, Copy, PartialEq)]
    enum Verdict {
        Loads,
        Dropped,
        BeyondEnd,
    }
    let mut seen: std::collections::HashMap<[u8; 16], Verdict> = std::collections::HashMap::new();
    let read = read_entries(dev, g, newest, &JsonLimits::default(), &mut |e| {
        let r = check_entry(dev, g, e.key, e.key_lossy, e.offset, e.size);
        let verdict = match (r.problem, r.header_ok) {
            // On a device LMCache loads from, such an entry is dropped (its checkpoint, whose
            // next_slot is past the slots there, is refused whole).
            (Some(BEYOND_END), _) if image => Verdict::BeyondEnd,
            (_, true) => Verdict::Loads,
            (_, false) => Verdict::Dropped,
        };
        let digest = key_digest(e.key);
        let repeat = if e.key_lossy || (seen.len() >= max_tracked && !seen.contains_key(&digest)) {
            s.duplicates_unchecked += 1;
            None
        } else {
            seen.insert(digest, verdict)
        };
        // Python keeps the last entry of a key: an earlier one's verdict no longer counts.
        match repeat {
            None => s.listed += 1,
            Some(was) => {
                s.duplicates += 1;
                match was {
                    Verdict::Dropped => s.header_mismatch -= 1,
                    Verdict::BeyondEnd => s.beyond_end -= 1,
                    Verdict::Loads => {}
                }
            }
        }
        match verdict {
            Verdict::Dropped => s.header_mismatch += 1,
            Verdict::BeyondEnd => s.beyond_end += 1,
            Verdict::Loads => {}
        }
        on_entry(&r).map_err(|e| e.to_string())
    });
    let meta = match read {
        Ok(meta) => meta,
        // LMCache's json.loads fails on the same bytes: it starts empty (reference §12), and
        // does not fall back to the other copy. Python also takes NaN and Infinity, which
        // strict JSON has not: there the verdict is not known.
        Err(e @ JsonError::Syntax { at, .. }) => {
            if python_only_literal_at(dev, g, newest, at)? {
                return Err(format!("{e}: a NaN or Infinity literal, which Python's json.loads (LMCache's) accepts; what LMCache would load is not known").into());
            }
            s.rejected = Some(format!("its JSON does not decode ({e})"));
            s.undecodable = true;
            s.live = 0;
            return Ok(s);
        }
        Err(e) => return Err(e.into()),
    };
    // An image shorter than the device the checkpoint was written on: LMCache's checks (its
    // next_slot against the slots there) are made against that device's capacity.
    let truncated = meta.py_int("capacity_bytes").filter(|&c| image && ReadAt::size(dev).is_ok_and(|n| c > n));
    let loader = truncated.and_then(|c| {
        let mut lc = g.config();
        lc.capacity_bytes = c;
        lc.validate(c).ok()
    });
    s.truncated_from = loader.map(|l| l.capacity_bytes);
    s.rejected = meta.loader_rejection(loader.as_ref().unwrap_or(g));
    // LMCache's load (`meta_verify_on_load`, on by default) drops an entry whose slot header
    // is not its key's.
    s.live = if s.rejected.is_some() { 0 } else { s.listed.saturating_sub(s.header_mismatch + s.beyond_end) };
    s.device_path = meta.device_path;
    Ok(s)
}

/// The most keys `inspect` checks for repeats: a real checkpoint (LMCache caps its JSON at 128
/// MiB, about 240 bytes an entry) lists fewer than 600 000; a hostile container could list
/// hundreds of millions. At the cap the table holds 4 Mi buckets of 18 bytes, about 75 MB, and
/// 113 MB for a moment while it grows to them.
pub const MAX_TRACKED_KEYS: usize = 2 << 20;

/// A key's 128-bit BLAKE2b digest, for counting repeats in bounded memory.
fn key_digest(key: &str) -> [u8; 16] {
    use blake2::digest::{Update, VariableOutput};
    let mut h = blake2::Blake2bVar::new(16).expect("16 is a valid BLAKE2b output size");
    h.update(key.as_bytes());
    let mut out = [0u8; 16];
    h.finalize_variable(&mut out).expect("the output is 16 bytes");
    out
}

/// fdpblk's own saved state, when `dev` is a backing device (or its image); `Err` says why a
/// superblock whose CRC holds is not read.
fn own_state(dev: &std::fs::File) -> Option<Result<serde_json::Value, String>> {
    crate::persist::summary(dev, ReadAt::size(dev).ok()?)
}

fn copy_json(c: &CopyStatus) -> serde_json::Value {
    json!({
        "copy": c.copy,
        "seq": c.seq(),
        "payload_len": c.payload_len(),
        "crc_ok": c.crc_ok,
        "valid": c.is_valid(),
        "error": c.header.as_ref().err().map(|e| e.to_string()),
    })
}

fn entry_json(r: &EntryReport) -> serde_json::Value {
    json!({
        "key": r.key, "slot": r.slot, "offset": r.offset, "size": r.size,
        "identity": r.identity, "header_ok": r.header_ok, "problem": r.problem,
    })
}

pub fn run(a: &InspectArgs) -> CmdResult {
    let dev = open_readonly(&a.path)?;
    let flags: GeometryFlags = a.geometry.flags();
    // An image file may be the leading part of a larger device, unless --capacity-bytes says
    // how much of it LMCache used.
    let file_size = std::fs::metadata(&a.path).ok().filter(|m| m.is_file()).map(|m| m.len());
    let image = file_size.is_some() && flags.capacity_bytes.is_none();
    // Past the image's end, the flag would be cut to the image's size in silence.
    if let (Some(size), Some(c)) = (file_size, flags.capacity_bytes) {
        if c > size {
            return Err(format!(
                "--capacity-bytes {c} is past the end of {} ({size} bytes): an image shorter than LMCache's device is checked against its checkpoint's capacity_bytes without the flag (`truncated_from`); with it, give at most the image's size",
                a.path.display()
            )
            .into());
        }
    }
    let d = discover(&dev, &flags).map_err(|e| match e {
        // `add`'s advice (`--layout lmcache`) is no help here: the entries are what inspect shows.
        crate::layout::discover::DiscoverError::Unparsable(e) => format!("LMCache's checkpoint on {} is beyond what fdpblk parses ({e}): inspect cannot list its entries", a.path.display()),
        e => e.to_string(),
    })?;
    let g = d.geometry;
    let copies = match d.copies {
        Some(c) => c,
        None => crate::layout::checkpoint::read_copies(&dev, &g)?,
    };
    let out = std::io::stdout();
    let mut w = BufWriter::new(out.lock());
    if a.json {
        let mut geo = g.to_json();
        if let Some(o) = geo.as_object_mut() {
            o.insert("source".into(), json!(format!("{:?}", d.source).to_lowercase()));
        }
        write!(w, "{{\"geometry\":{},\"checkpoints\":{},\"entries\":[", geo, json!(copies.iter().map(copy_json).collect::<Vec<_>>()))?;
        let mut first = true;
        let s = match inspect_entries(&dev, &g, &copies, image, &mut |r| {
            if !first {
                w.write_all(b",")?;
            }
            first = false;
            write!(w, "{}", entry_json(r))
        }) {
            Ok(s) => s,
            Err(e) => {
                // Still one whole document (the exit status says it failed too).
                let _ = writeln!(w, "],\"error\":{}}}", json!(e.to_string()));
                let _ = w.flush();
                return Err(e);
            }
        };
        writeln!(
            w,
            "],\"summary\":{},\"fdpblk_state\":{}}}",
            json!({"live": s.live, "listed": s.listed, "duplicates": s.duplicates, "duplicates_unchecked": s.duplicates_unchecked, "header_mismatch": s.header_mismatch, "checkpoint_seq": s.checkpoint_seq,
                   "loader_rejects": s.rejected, "undecodable": s.undecodable, "device_path": s.device_path,
                   "beyond_end": s.beyond_end, "truncated_from": s.truncated_from}),
            match own_state(&dev) {
                Some(Ok(v)) => v,
                Some(Err(why)) => json!({ "rejected": why }),
                None => serde_json::Value::Null,
            }
        )?;
    } else {
        writeln!(w, "geometry ({:?}):", d.source)?;
        writeln!(
            w,
            "  block_align {}  header_bytes {}  slot_bytes {}  meta_total_bytes {}",
            g.block_align, g.header_bytes, g.slot_bytes, g.meta_total_bytes
        )?;
        writeln!(
            w,
            "  data_base_offset {}  max_slots {}  capacity_bytes {}  checkpoint payload cap {}",
            g.data_base_offset(),
            g.max_slots,
            g.capacity_bytes,
            g.payload_cap()
        )?;
        writeln!(w, "checkpoints:")?;
        for c in &copies {
            match &c.header {
                Ok(h) => writeln!(
                    w,
                    "  copy {}  seq {}  payload_len {}  crc {}",
                    c.copy,
                    h.seq,
                    h.payload_len,
                    if c.crc_ok == Some(true) { "ok" } else { "MISMATCH" }
                )?,
                Err(e) => writeln!(w, "  copy {}  invalid: {e}", c.copy)?,
            }
        }
        writeln!(w, "entries:")?;
        let s = inspect_entries(&dev, &g, &copies, image, &mut |r| {
            writeln!(
                w,
                "  slot {:>8}  size {:>10}  identity {:>18}  header {}  {}",
                r.slot.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                r.size.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                r.identity.map(|i| format!("{i:#018x}")).unwrap_or_else(|| "-".into()),
                match r.problem {
                    None => "ok",
                    Some(p) => p,
                },
                // Read from the device: a control character would break the line or drive
                // the terminal.
                r.key.escape_debug()
            )
        })?;
        match (s.checkpoint_seq, &s.rejected) {
            (Some(seq), None) => writeln!(
                w,
                "summary: {} live entries (checkpoint seq {seq}); {} more listed that LMCache's load drops (a mismatched slot header, or a bad offset, size or key){}",
                s.live,
                s.header_mismatch,
                match (s.duplicates, s.duplicates_unchecked) {
                    (0, 0) => String::new(),
                    (d, 0) => format!("; {d} entries repeat a key listed before, and LMCache keeps the last of each"),
                    (d, u) => format!("; {d} entries repeat a key listed before, and LMCache keeps the last of each ({u} keys not checked for repeats)"),
                }
            )?,
            (Some(seq), Some(why)) if s.undecodable => writeln!(
                w,
                "summary: LMCache would start with an empty index: checkpoint seq {seq} is CRC-valid but {why}; the {} entries above were read before the error",
                s.listed + s.duplicates
            )?,
            (Some(seq), Some(why)) => writeln!(
                w,
                "summary: LMCache would discard checkpoint seq {seq} and start with an empty index: {why}; none of its {} keys would load",
                s.listed
            )?,
            (None, _) => writeln!(w, "summary: no valid checkpoint; LMCache would start with an empty index")?,
        }
        if let Some(c) = s.truncated_from {
            writeln!(
                w,
                "  this image is shorter than the checkpoint's capacity_bytes {c} (a truncated copy of a larger device?): LMCache's checks are made against {c} bytes, and {} entries in slots past the image's end are not checked",
                s.beyond_end
            )?;
        } else if s.beyond_end > 0 {
            writeln!(w, "  {} entries lie in slots past the end of the image, not checked", s.beyond_end)?;
        }
        if let Some(p) = &s.device_path {
            writeln!(w, "  LMCache loads it only with device_path exactly {p:?}")?;
        }
        match own_state(&dev) {
            Some(Err(why)) => writeln!(w, "fdpblk state: a superblock whose CRC holds, not read: {why} (damaged, or not fdpblk's)")?,
            Some(Ok(o)) => {
                let (sl, n) = (&o["slots"], |v: &serde_json::Value| v.as_u64().unwrap_or(0));
                writeln!(
                    w,
                    "fdpblk state (seq {}, {}): {} slots with a header: {} live, {} evicted, {} trimmed, {} unknown, {} returning; identity history {} of {}; {} tags; {} trims ({} bytes), per handle {}",
                    o["seq"],
                    if o["clean"] == true { "clean" } else { "unclean" },
                    n(&sl["with_header"]),
                    n(&sl["live"]),
                    n(&sl["evicted"]),
                    n(&sl["trimmed"]),
                    n(&sl["unknown"]),
                    n(&sl["returning"]),
                    o["identity_history"],
                    o["identity_history_capacity"],
                    o["tags"],
                    n(&o["trims"]),
                    n(&o["trim_bytes"]),
                    o["trims_by_handle"]
                )?;
                // What a daemon starting on it would make of it (a bad sector, a lost write).
                if let Some(note) = o["note"].as_str() {
                    writeln!(w, "  {note}")?;
                }
                if let (Some(t), Some(seq)) = (o["uncheckpointed_since_unix"].as_u64(), o["checkpoint_seen"]["seq"].as_u64()) {
                    writeln!(
                        w,
                        "  at the daemon's last state save, LMCache had slot writes since Unix time {t} that no checkpoint after seq {seq} followed: unless one came after that save, a LMCache restarted since has lost them"
                    )?;
                }
                if let Some(i) = o["writeback_pause"]["interval_s"].as_f64() {
                    writeln!(
                        w,
                        "  deallocation was paused for the kernel's writeback delay (LMCache checkpointed as often as every {i:.1}s): a daemon starting on it pauses too while vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs reach that, until it has seen 3 checkpoint intervals"
                    )?;
                }
            }
            None => writeln!(w, "fdpblk state: none (give the backing device or its image: the state lives in its reserved tail)")?,
        }
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::checkpoint::read_copies;

    #[test]
    fn every_fixture_matches_its_manifest() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6");
        let mut scenarios = 0;
        for dir in std::fs::read_dir(&root).unwrap() {
            let dir = dir.unwrap().path();
            if !dir.join("manifest.json").exists() {
                continue;
            }
            scenarios += 1;
            let img = std::fs::read(dir.join("device.img")).unwrap();
            let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
            let d = discover(&img, &GeometryFlags::default()).unwrap();
            let copies = read_copies(&img, &d.geometry).unwrap();
            let mut got = Vec::new();
            let s = inspect_entries(&img, &d.geometry, &copies, true, &mut |r| {
                got.push(r.clone());
                Ok(())
            })
            .unwrap();
            // The manifest's live keys: the last record of each key that is live at the end.
            let mut want = std::collections::BTreeMap::new();
            for k in m["keys"].as_array().unwrap() {
                if k["live_at_end"].as_bool() == Some(true) {
                    want.insert(k["key"].as_str().unwrap().to_string(), k.clone());
                }
            }
            assert_eq!(got.len(), want.len(), "{}", dir.display());
            assert_eq!(s.listed as usize, want.len());
            assert_eq!(s.live as usize, got.iter().filter(|r| r.header_ok).count(), "{}: what LMCache's load keeps", dir.display());
            for r in &got {
                let k = want.get(&r.key).unwrap_or_else(|| panic!("{}: unexpected {}", dir.display(), r.key));
                assert_eq!(r.identity, k["identity_u64"].as_u64());
                assert_eq!(r.slot, k["slot"].as_u64());
                assert_eq!(r.offset, k["offset"].as_u64());
                assert_eq!(r.size, k["payload_len"].as_u64());
                assert_eq!(r.header_ok, k["slot_header_on_disk"] == "this_key", "{}", r.key);
            }
            assert_eq!(s.header_mismatch, got.iter().filter(|r| !r.header_ok).count() as u64);
        }
        assert_eq!(scenarios, 12);
    }

    #[test]
    fn reused_slot_is_a_header_mismatch() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6/object-evict");
        let mut img = std::fs::read(root.join("device.img")).unwrap();
        let d = discover(&img, &GeometryFlags::default()).unwrap();
        let g = d.geometry;
        // Overwrite slot 0's identity, as if another key had been put there.
        let off = g.slot_offset(0) as usize;
        img[off + 8] ^= 0xff;
        let copies = read_copies(&img, &g).unwrap();
        let mut bad = Vec::new();
        let s = inspect_entries(&img, &g, &copies, true, &mut |r| {
            if !r.header_ok {
                bad.push(r.clone());
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(s.header_mismatch, 1);
        assert_eq!(s.live, s.listed - 1, "LMCache's load drops it");
        assert_eq!(bad[0].slot, Some(0));
        assert_eq!(bad[0].problem, Some("slot header identity differs (slot reused)"));
    }

    /// object-evict with each checkpoint copy's JSON edited by `edit` (same length), CRCs
    /// recomputed: a checkpoint LMCache wrote, as a loader of another kind would find it.
    fn object_evict_with_json(edit: impl Fn(&str) -> String) -> Vec<u8> {
        fixture_with_json("object-evict", edit)
    }

    /// A fixture (1 MiB metadata) with each checkpoint copy's JSON edited by `edit`.
    fn fixture_with_json(name: &str, edit: impl Fn(&str) -> String) -> Vec<u8> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6").join(name);
        let mut img = std::fs::read(root.join("device.img")).unwrap();
        for at in [0usize, 524288] {
            // A copy LMCache has not written yet stays as it is.
            let Ok(h) = crate::layout::checkpoint_header::CheckpointHeader::parse(&img[at..at + 32], img.len() as u64) else { continue };
            let range = at + 4096..at + 4096 + h.payload_len as usize;
            let json = edit(std::str::from_utf8(&img[range.clone()]).unwrap());
            img[range].fill(0);
            img[at + 4096..at + 4096 + json.len()].copy_from_slice(json.as_bytes());
            img[at + 20..at + 28].copy_from_slice(&(json.len() as u64).to_le_bytes());
            img[at + 28..at + 32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
        }
        img
    }

    /// Inspects an image with its discovered layout, checking at most `max_tracked` keys for
    /// repeats; returns the summary and every entry's report.
    fn inspect_image(img: &[u8], max_tracked: usize) -> (InspectSummary, Vec<EntryReport>) {
        let g = discover(img, &GeometryFlags::default()).unwrap().geometry;
        let copies = read_copies(img, &g).unwrap();
        let mut got = Vec::new();
        let s = inspect_entries_tracking(img, &g, &copies, max_tracked, true, &mut |r| {
            got.push(r.clone());
            Ok(())
        })
        .unwrap();
        (s, got)
    }

    fn summary_of(img: &[u8]) -> InspectSummary {
        inspect_image(img, MAX_TRACKED_KEYS).0
    }

    #[test]
    fn a_checkpoint_lmcache_would_discard_has_no_live_entries() {
        let s = summary_of(&object_evict_with_json(|j| j.to_string()));
        assert_eq!((s.live, s.listed, s.rejected.as_deref()), (14, 14, None));
        assert_eq!(s.device_path.as_deref(), Some("/dev/ublkb0"));
        let v2 = summary_of(&object_evict_with_json(|j| j.replacen(r#""version":1"#, r#""version":2"#, 1)));
        assert_eq!((v2.live, v2.listed), (0, 14));
        assert!(v2.rejected.unwrap().contains("version is 2"));
        let past = summary_of(&object_evict_with_json(|j| j.replacen(r#""next_slot":16"#, r#""next_slot":49"#, 1)));
        assert!(past.rejected.unwrap().contains("next_slot 49 is past the layout's 48 slots"));
        let all = summary_of(&object_evict_with_json(|j| j.replacen(r#""next_slot":16"#, r#""next_slot":48"#, 1)));
        assert_eq!(all.rejected, None);
        let magic = summary_of(&object_evict_with_json(|j| j.replacen("LMCIDX01", "LMCIDX02", 1)));
        assert!(magic.rejected.unwrap().contains("meta_magic"));
        // Present but of the wrong type is not absent: LMCache compares it and discards.
        let negative = summary_of(&object_evict_with_json(|j| j.replacen(r#""next_slot":16"#, r#""next_slot":-1"#, 1)));
        assert_eq!(negative.live, 0);
        assert!(negative.rejected.unwrap().contains("its next_slot is not an int"));
        let null = summary_of(&object_evict_with_json(|j| j.replacen(r#""header_bytes":4096"#, r#""header_bytes":null"#, 1)));
        assert!(null.rejected.unwrap().contains("its header_bytes is not"));
        // capacity_bytes LMCache does not check.
        let cap = summary_of(&object_evict_with_json(|j| j.replacen(r#""capacity_bytes":4194304"#, r#""capacity_bytes":"4 MiB""#, 1)));
        assert_eq!(cap.rejected, None);
    }

    /// The leading part of a device's image (its metadata and 8 of its 48 slots): LMCache's
    /// checks are made against the device the checkpoint names, so the checkpoint still
    /// loads; entries past the image are not checked, and not counted as dropped.
    #[test]
    fn a_truncated_image_is_checked_against_the_checkpoints_capacity() {
        let img = object_evict_with_json(|j| j.to_string());
        let cut = &img[..(1 << 20) + 8 * 65536];
        let (s, entries) = inspect_image(cut, MAX_TRACKED_KEYS);
        assert_eq!((s.rejected.as_deref(), s.truncated_from, s.header_mismatch), (None, Some(4 << 20), 0), "{s:?}");
        let beyond = entries.iter().filter(|e| e.problem == Some(BEYOND_END)).count() as u64;
        assert!(beyond > 0 && s.beyond_end == beyond && s.live + beyond == s.listed, "{s:?}");
        // A next_slot past the checkpoint's own device is still refused.
        let past = object_evict_with_json(|j| j.replacen(r#""next_slot":16"#, r#""next_slot":49"#, 1));
        let s = summary_of(&past[..(1 << 20) + 8 * 65536]);
        assert!(s.rejected.is_some_and(|r| r.contains("next_slot 49 is past the layout's 48 slots")));
    }

    /// A lone surrogate escape in a key: Python's json.loads keeps it. A legacy key's identity
    /// is its chunk hash, so the entry loads; an object key's is a hash of its UTF-8, which
    /// LMCache cannot encode, so that entry alone is dropped. The document stays valid.
    #[test]
    fn a_lone_surrogate_in_a_key_drops_only_an_object_entry() {
        let model = "meta-llama/Llama-3.1-8B-Instruct@";
        let legacy = fixture_with_json("legacy-basic", |j| j.replacen(model, "meta-llama/Llama-3.1-8B-\\udcffct@", 1));
        let s = summary_of(&legacy);
        assert_eq!((s.live, s.listed, s.header_mismatch, s.rejected.as_deref()), (20, 20, 0, None));
        let plain = summary_of(&object_evict_with_json(|j| j.to_string()));
        let first_key = |img: &[u8]| {
            let first = inspect_image(img, MAX_TRACKED_KEYS).1.swap_remove(0);
            (first.key, first.problem)
        };
        let (key, problem) = first_key(&object_evict_with_json(|j| j.to_string()));
        assert_eq!(problem, None);
        // Six characters of the first key's model name become one escape (same length).
        let at = key.find('%').unwrap() + 3;
        let lossy_key = format!("{}\\udc00{}", &key[..at], &key[at + 6..]);
        let img = object_evict_with_json(|j| j.replacen(&key, &lossy_key, 1));
        let s = summary_of(&img);
        assert_eq!((s.listed, s.rejected.as_deref()), (plain.listed, None));
        // Its text lost the surrogate, so it is not checked for repeats.
        assert_eq!((s.duplicates, s.duplicates_unchecked, plain.duplicates_unchecked), (0, 1, 0));
        assert_eq!(s.live, plain.live - 1);
        assert_eq!(first_key(&img).1, Some("key has a lone surrogate escape, so no UTF-8 form: LMCache cannot load the entry"));
    }

    /// A key listed twice: Python's dict keeps the last entry, so the key counts once, with the
    /// last entry's header check. Both orders: the repeat failing the check (the key is
    /// dropped) and the repeat passing it where the first failed (the key loads).
    #[test]
    fn a_key_listed_twice_counts_once_with_its_last_entry() {
        let plain = summary_of(&object_evict_with_json(|j| j.to_string()));
        assert_eq!((plain.live, plain.listed, plain.duplicates), (14, 14, 0));
        let k: Vec<String> = inspect_image(&object_evict_with_json(|j| j.to_string()), MAX_TRACKED_KEYS).1.into_iter().map(|r| r.key).collect();
        let quoted = |k: &str| serde_json::to_string(k).unwrap();
        // The second entry names the first key: its slot's header is the second key's.
        let last_bad = object_evict_with_json(|j| j.replacen(&quoted(&k[1]), &quoted(&k[0]), 1));
        let s = summary_of(&last_bad);
        assert_eq!((s.listed, s.duplicates, s.header_mismatch, s.live), (13, 1, 1, 12));
        // The first entry names the second key: its slot's header is the first key's, and the
        // second key's own entry follows and passes.
        let last_good = object_evict_with_json(|j| j.replacen(&quoted(&k[0]), &quoted(&k[1]), 1));
        let s = summary_of(&last_good);
        assert_eq!((s.listed, s.duplicates, s.header_mismatch, s.live), (13, 1, 0, 13));
        // A checkpoint LMCache would discard still counts each key once.
        let rejected = object_evict_with_json(|j| j.replacen(&quoted(&k[1]), &quoted(&k[0]), 1).replacen(r#""version":1"#, r#""version":2"#, 1));
        let s = summary_of(&rejected);
        assert_eq!((s.listed, s.duplicates, s.live, s.duplicates_unchecked), (13, 1, 0, 0));
        assert!(s.rejected.is_some());
        // Past the keys it tracks, a key is counted without the check: here the repeat of the
        // first key, which comes second, is still caught; with one key tracked it is too, and
        // the other twelve are unchecked.
        let tracked = |img: &[u8], max| inspect_image(img, max).0;
        let s = tracked(&last_bad, 1);
        assert_eq!((s.listed, s.duplicates, s.duplicates_unchecked, s.live), (13, 1, 12, 12));
        let s = tracked(&last_bad, 0);
        assert_eq!((s.listed, s.duplicates, s.duplicates_unchecked, s.live), (14, 0, 14, 13));
    }

    /// A CRC-valid copy whose JSON does not decode: LMCache starts empty (it does not try the
    /// other copy), and inspect says so instead of failing.
    #[test]
    fn a_checkpoint_whose_json_does_not_decode_loads_nothing() {
        let img = object_evict_with_json(|j| j.replacen("\"entries\":{", "\"entries\":[", 1));
        let flags = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..GeometryFlags::default() };
        let g = discover(&img, &flags).unwrap().geometry;
        let copies = read_copies(&img[..], &g).unwrap();
        let s = inspect_entries(&img[..], &g, &copies, true, &mut |_| Ok(())).unwrap();
        assert_eq!((s.live, s.undecodable), (0, true));
        assert!(s.rejected.as_deref().is_some_and(|r| r.starts_with("its JSON does not decode")), "{:?}", s.rejected);
        assert!(s.checkpoint_seq.is_some());
        // NaN and Infinity Python decodes: no verdict, an error that says so.
        let nan = object_evict_with_json(|j| j.replacen("\"capacity_bytes\":4194304", "\"capacity_bytes\":NaN    ", 1));
        let copies = read_copies(&nan[..], &g).unwrap();
        let e = inspect_entries(&nan[..], &g, &copies, true, &mut |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("NaN or Infinity"), "{e}");
    }

    /// LMCache's checks are Python comparisons: `1.0 == 1` and `True == 1` hold, and a bool
    /// is an int, but a float is not (`next_slot` must be an int).
    #[test]
    fn numbers_compare_as_python_compares_them() {
        let flags = GeometryFlags { slot_bytes: Some(65536), meta_total_bytes: Some(1 << 20), ..GeometryFlags::default() };
        let verdict = |from: &str, to: &str| {
            let img = object_evict_with_json(|j| {
                assert!(j.contains(from), "{from}");
                j.replacen(from, to, 1)
            });
            let g = discover(&img, &flags).unwrap().geometry;
            let copies = read_copies(&img[..], &g).unwrap();
            let s = inspect_entries(&img[..], &g, &copies, true, &mut |_| Ok(())).unwrap();
            assert_eq!(s.listed, 14);
            (s.live, s.rejected)
        };
        for (from, to) in [
            (r#""version":1,"#, r#""version":1.0,"#),
            (r#""version":1,"#, r#""version":true,"#),
            (r#""meta_version":1,"#, r#""meta_version":1e0,"#),
            (r#""slot_bytes":65536,"#, r#""slot_bytes":65536.0,"#),
            (r#""block_align":4096,"#, r#""block_align":4.096E3,"#),
            (r#""next_slot":16,"#, r#""next_slot":true,"#),
        ] {
            assert_eq!(verdict(from, to), (14, None), "{to}");
        }
        for (from, to, why) in [
            (r#""next_slot":16,"#, r#""next_slot":16.0,"#, "its next_slot is not an int"),
            (r#""version":1,"#, r#""version":"1","#, "no integer version"),
            (r#""version":1,"#, r#""version":false,"#, "its version is 0"),
            (r#""slot_bytes":65536,"#, r#""slot_bytes":65536.5,"#, "its slot_bytes is not a non-negative whole number"),
            (r#""slot_bytes":65536,"#, r#""slot_bytes":1.31072e5,"#, "its slot_bytes is 131072, but the layout's is 65536"),
            (r#""meta_version":1,"#, r#""meta_version":null,"#, "its meta_version is not"),
        ] {
            let (live, rejected) = verdict(from, to);
            assert_eq!(live, 0, "{to}");
            assert!(rejected.as_deref().is_some_and(|r| r.contains(why)), "{to}: {rejected:?}");
        }
    }

    #[test]
    fn an_entry_past_a_truncated_image_says_so() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6/object-evict");
        let img = std::fs::read(root.join("device.img")).unwrap();
        let g = discover(&img, &GeometryFlags::default()).unwrap().geometry;
        let key = "x";
        let past = check_entry(&img, &g, key, false, Some(g.slot_offset(g.max_slots + 2)), Some(100));
        assert_eq!(past.problem, Some("offset is beyond the device (a truncated image, or a checkpoint of a larger device)"));
        let odd = check_entry(&img, &g, key, false, Some(g.slot_offset(1) + 4096), Some(100));
        assert_eq!(odd.problem, Some("offset is not a slot start"));
    }
}
