//! Everything a device needs to run, validated before it is created, and stored in the ublk
//! device's target JSON so that `fdpblk recover` rebuilds exactly the same device.

use crate::layout::discover::GeometryFlags;
use crate::layout::{Geometry, GeometryConfig};
use serde_json::{json, Value};
use std::path::PathBuf;

/// fdpblk's own state lives in a fixed tail of the backing device, never exported:
/// `max(8 MiB, round_up(backing_bytes / 4096, 1 MiB))` — 1/4096 of the device (512 MiB on
/// 2 TiB, 466 MiB on 2 TB) holds the state's two copies (about 55 bytes per slot,
/// `persist::Layout`) down to slots of about 220 KiB. The formula is fixed so the exported capacity never changes
/// between versions.
pub fn reserved_tail_bytes(backing_bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    (backing_bytes / 4096).div_ceil(MIB).saturating_mul(MIB).max(8 * MIB)
}

/// Bytes exported on `/dev/ublkbN`: the backing device less the reserved tail, in whole
/// logical blocks.
pub fn exported_bytes(backing_bytes: u64, lba_bytes: u64) -> Option<u64> {
    let e = backing_bytes.checked_sub(reserved_tail_bytes(backing_bytes))?;
    let e = e / lba_bytes.max(512) * lba_bytes.max(512);
    (e > 0).then_some(e)
}

/// The most 512-byte sectors a discard or write-zeroes request may span: as much as the
/// field holds, in whole logical blocks. Kernels before 6.10 split a larger request at
/// exactly this many sectors, so an odd limit would start every later piece off a 4 KiB block,
/// which the backing refuses.
pub fn max_request_sectors(lba_shift: u8) -> u32 {
    let per_block = 1u32 << lba_shift.saturating_sub(9).min(12);
    (u32::MAX >> 9) & !(per_block - 1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Plain,
    Streams,
    Passthrough,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Plain => "plain",
            EngineKind::Streams => "streams",
            EngineKind::Passthrough => "passthrough",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "plain" => EngineKind::Plain,
            "streams" => EngineKind::Streams,
            "passthrough" => EngineKind::Passthrough,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    pub id: i32,
    pub name: Option<String>,
    pub backing: PathBuf,
    pub engine: EngineKind,
    pub policy: String,
    pub queues: u16,
    pub depth: u16,
    pub io_buf_bytes: u32,
    pub lba_shift: u8,
    pub backing_bytes: u64,
    /// What names the backing whatever its path ([`crate::frontend::target::backing_identity`]:
    /// an NVMe namespace's identity, a file's inode), checked at every daemon start; `None`
    /// for a block device of another kind, or a config of an older version.
    pub backing_identity: Option<String>,
    pub exported_bytes: u64,
    /// LMCache's layout; `None` while fdpblk learns it from LMCache's first checkpoint
    /// (`--layout auto` on a device without one; see [`super::learn`]).
    pub geometry: Option<Geometry>,
    /// The geometry flags given to `add` (checked against a learned layout).
    pub layout_flags: GeometryFlags,
    /// Logical handle -> write stream (streams engine).
    pub streams: Vec<u8>,
    /// Logical handle -> NVMe placement identifier (passthrough engine; empty = no directive).
    pub pids: Vec<u16>,
    /// How long a payload may wait for its slot header before it is placed anyway.
    pub header_wait_us: u64,
    /// Deallocate slots LMCache evicted and stale tails (`--no-trim` turns it off).
    pub trim: bool,
    /// With `trim`: deallocate stale tails as soon as the new header is durable
    /// (`--no-early-tails` turns it off).
    pub early_tails: bool,
    /// With `trim`: deallocate an evicted slot once the newest checkpoint lacks it, after
    /// zeroing the older checkpoint container's header (`--no-early-evictions` turns it off).
    pub early_evictions: bool,
    /// Own-state persist interval; 0 = only at start and stop.
    pub persist_interval_ms: u64,
}

impl DeviceConfig {
    /// Checks that the saved handle map names a stream (streams engine) or placement
    /// identifier (passthrough) for each of a policy's `handles`: the engines send a handle
    /// past the map without placement, where it would mix with the drive's default handle.
    /// A one-handle policy needs none (no directive at all).
    pub fn check_handle_map(&self, handles: u16) -> Result<(), String> {
        let (what, have) = match self.engine {
            EngineKind::Streams => ("write streams", self.streams.len()),
            EngineKind::Passthrough => ("placement identifiers", self.pids.len()),
            EngineKind::Plain => return Ok(()),
        };
        if handles > 1 && have < usize::from(handles) {
            return Err(format!(
                "device {}: policy {} places writes on {handles} handles, but its saved config maps {have} to {what} \
                 (a state file edited by hand or written by another version): `fdpblk del -n {}` and add it again",
                self.id, self.policy, self.id
            ));
        }
        Ok(())
    }

    pub fn to_json(&self) -> Value {
        let geometry = self.geometry.map(|g| {
            let g = g.config();
            json!({"block_align": g.block_align, "header_bytes": g.header_bytes, "slot_bytes": g.slot_bytes,
                   "meta_total_bytes": g.meta_total_bytes, "capacity_bytes": g.capacity_bytes})
        });
        let f = &self.layout_flags;
        json!({
            "id": self.id, "name": self.name, "backing": self.backing, "engine": self.engine.name(),
            "policy": self.policy, "queues": self.queues, "depth": self.depth, "io_buf_bytes": self.io_buf_bytes,
            "lba_shift": self.lba_shift, "backing_bytes": self.backing_bytes, "backing_identity": self.backing_identity,
            "exported_bytes": self.exported_bytes,
            "geometry": geometry,
            "layout_flags": {"block_align": f.block_align, "header_bytes": f.header_bytes, "slot_bytes": f.slot_bytes,
                             "meta_total_bytes": f.meta_total_bytes, "capacity_bytes": f.capacity_bytes},
            "streams": self.streams, "pids": self.pids, "header_wait_us": self.header_wait_us, "trim": self.trim, "early_tails": self.early_tails, "early_evictions": self.early_evictions,
            "persist_interval_ms": self.persist_interval_ms,
        })
    }

    pub fn from_json(v: &Value) -> Result<Self, String> {
        let u = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| format!("device config lacks \"{k}\""));
        let gv = v.get("geometry").ok_or("device config lacks \"geometry\"")?;
        let gu = |k: &str| gv.get(k).and_then(Value::as_u64).ok_or_else(|| format!("device geometry lacks \"{k}\""));
        let exported = u("exported_bytes")?;
        // Exported bytes past this would reach fdpblk's own state in the reserved tail.
        let lba = 1u64 << within(u("lba_shift")?, "lba_shift", 9, 12)?;
        if Some(exported) != exported_bytes(u("backing_bytes")?, lba) {
            return Err(format!("device config's \"exported_bytes\" {exported} is not what its \"backing_bytes\" and \"lba_shift\" give"));
        }
        let geometry = if gv.is_null() {
            None
        } else {
            Some(
                GeometryConfig {
                    block_align: gu("block_align")?,
                    header_bytes: gu("header_bytes")?,
                    slot_bytes: gu("slot_bytes")?,
                    meta_total_bytes: gu("meta_total_bytes")?,
                    capacity_bytes: gu("capacity_bytes")?,
                }
                .validate(exported)
                .map_err(|e| e.to_string())?,
            )
        };
        let fv = v.get("layout_flags");
        let fu = |k: &str| fv.and_then(|f| f.get(k)).and_then(Value::as_u64);
        let layout_flags = GeometryFlags {
            block_align: fu("block_align"),
            header_bytes: fu("header_bytes"),
            slot_bytes: fu("slot_bytes"),
            meta_total_bytes: fu("meta_total_bytes"),
            capacity_bytes: fu("capacity_bytes"),
        };
        let cfg = Self {
            id: v.get("id").and_then(Value::as_i64).and_then(|i| i32::try_from(i).ok()).filter(|&i| i >= 0).ok_or("device config lacks \"id\" (a device id, 0 or more)")?,
            // It names a link under /dev/fdpblk/: checked as `add --name` checks it.
            name: match v.get("name").and_then(Value::as_str) {
                Some(n) => Some(super::state::check_name(n).map(|()| n.to_string()).map_err(|e| format!("device config's \"name\" {e}"))?),
                None => None,
            },
            backing: PathBuf::from(v.get("backing").and_then(Value::as_str).ok_or("device config lacks \"backing\"")?),
            engine: v.get("engine").and_then(Value::as_str).and_then(EngineKind::parse).ok_or("bad \"engine\"")?,
            // Not checked against this version's policies here: `list`, `up` and the check for
            // a backing in use must still see the device (`recover` refuses it, naming why).
            policy: v.get("policy").and_then(Value::as_str).ok_or("device config lacks \"policy\"")?.to_string(),
            // The ranges `add` allows: a state file edited by hand (or by another version) is
            // refused here rather than run with wrapped values.
            queues: within(u("queues")?, "queues", 1, MAX_QUEUES.into())? as u16,
            depth: within(u("depth")?, "depth", 1, MAX_DEPTH.into())? as u16,
            io_buf_bytes: within(u("io_buf_bytes")?, "io_buf_bytes", 512, 32 << 20)? as u32,
            lba_shift: within(u("lba_shift")?, "lba_shift", 9, 12)? as u8,
            backing_bytes: u("backing_bytes")?,
            backing_identity: match v.get("backing_identity") {
                None | Some(Value::Null) => None,
                Some(i) => Some(i.as_str().ok_or("device config's \"backing_identity\" is not a string")?.to_string()),
            },
            exported_bytes: exported,
            geometry,
            layout_flags,
            streams: numbers(v, "streams", 1, 255)?.into_iter().map(|s| s as u8).collect(),
            pids: numbers(v, "pids", 0, 0xffff)?.into_iter().map(|p| p as u16).collect(),
            // Absent in files of older versions: the defaults. Present, brought into the
            // ranges `add` allows now (versions before took any wait and intervals from 1 ms):
            // a wait of hours would leave payloads whose header never comes holding their tags.
            header_wait_us: match v.get("header_wait_us") {
                None => 5000,
                Some(_) => clamped(u("header_wait_us")?, "header_wait_us", 0, 1_000_000),
            },
            trim: v.get("trim").and_then(Value::as_bool).unwrap_or(true),
            early_tails: v.get("early_tails").and_then(Value::as_bool).unwrap_or(true),
            early_evictions: v.get("early_evictions").and_then(Value::as_bool).unwrap_or(true),
            persist_interval_ms: match v.get("persist_interval_ms") {
                None => 5000,
                Some(_) => match u("persist_interval_ms")? {
                    0 => 0,
                    n => clamped(n, "persist_interval_ms", 50, u64::MAX),
                },
            },
        };
        // A request buffer holds whole logical blocks (`add` takes powers of two from 4096, or
        // the namespace's largest transfer, in whole blocks, below that).
        if !cfg.io_buf_bytes.is_multiple_of(1u32 << cfg.lba_shift) {
            return Err(format!("device config's \"io_buf_bytes\" {} is not a whole number of {}-byte blocks", cfg.io_buf_bytes, 1u32 << cfg.lba_shift));
        }
        Ok(cfg)
    }
}

/// The array `key` of numbers in `lo..=hi` (absent: empty); anything else is refused, not
/// skipped or wrapped: a handle map with a hole would place writes on the wrong handle.
fn numbers(v: &Value, key: &str, lo: u64, hi: u64) -> Result<Vec<u64>, String> {
    let Some(a) = v.get(key).filter(|a| !a.is_null()) else { return Ok(Vec::new()) };
    let a = a.as_array().ok_or_else(|| format!("device config's \"{key}\" is not a list"))?;
    a.iter()
        .map(|n| {
            let n = n.as_u64().ok_or_else(|| format!("device config's \"{key}\" holds {n}, not a number"))?;
            within(n, key, lo, hi)
        })
        .collect()
}

/// `v` brought into `lo..=hi`, with a warning when it was not: a value an older version
/// allowed, which this one no longer runs with.
fn clamped(v: u64, key: &str, lo: u64, hi: u64) -> u64 {
    let c = v.clamp(lo, hi);
    if c != v {
        tracing::warn!("device config's \"{key}\" is {v}, outside {lo}..={hi} (an older fdpblk allowed it): running with {c}");
    }
    c
}

/// The ranges `add` allows for `--queues` and `--depth` (a config file's keys and a saved
/// device config are held to the same).
pub const MAX_QUEUES: u16 = 32;
/// ublk's largest queue depth.
pub const MAX_DEPTH: u16 = 4096;

/// `v` when it lies in `lo..=hi`, else an error naming the key.
fn within(v: u64, key: &str, lo: u64, hi: u64) -> Result<u64, String> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!("device config's \"{key}\" is {v}, outside {lo}..={hi}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_tail_formula() {
        assert_eq!(reserved_tail_bytes(1 << 30), 8 << 20);
        assert_eq!(reserved_tail_bytes(2_000_000_000_000), 466 << 20);
        assert_eq!(exported_bytes(1 << 30, 512), Some((1 << 30) - (8 << 20)));
        assert_eq!(exported_bytes(4 << 20, 512), None);
    }

    #[test]
    fn json_round_trip() {
        let geometry = GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate(1 << 30)
            .unwrap();
        let c = DeviceConfig {
            id: 3,
            name: Some("kv0".into()),
            backing: "/dev/nvme0n1".into(),
            engine: EngineKind::Streams,
            policy: "region".into(),
            queues: 2,
            depth: 64,
            io_buf_bytes: 524288,
            lba_shift: 9,
            backing_bytes: (1 << 30) + (8 << 20),
            backing_identity: Some("NVMe namespace model \"QEMU NVMe Ctrl\" serial \"fdp0\" nsid 1".into()),
            exported_bytes: 1 << 30,
            geometry: Some(geometry),
            layout_flags: GeometryFlags { slot_bytes: Some(65536), ..Default::default() },
            streams: vec![1, 2, 3, 4],
            pids: Vec::new(),
            header_wait_us: 5000,
            trim: true,
            early_tails: true,
            early_evictions: true,
            persist_interval_ms: 5000,
        };
        assert_eq!(DeviceConfig::from_json(&c.to_json()).unwrap(), c);
        let n = DeviceConfig { trim: false, persist_interval_ms: 0, ..c.clone() };
        assert_eq!(DeviceConfig::from_json(&n.to_json()).unwrap(), n);
        let mut old = c.to_json();
        old.as_object_mut().unwrap().remove("trim");
        assert!(DeviceConfig::from_json(&old).unwrap().trim, "configs saved before --no-trim existed trim");
        old.as_object_mut().unwrap().remove("early_tails");
        assert!(DeviceConfig::from_json(&old).unwrap().early_tails, "and have early tails");
        old.as_object_mut().unwrap().remove("early_evictions");
        assert!(DeviceConfig::from_json(&old).unwrap().early_evictions, "and early evictions");
        old.as_object_mut().unwrap().remove("header_wait_us");
        old.as_object_mut().unwrap().remove("persist_interval_ms");
        let d = DeviceConfig::from_json(&old).unwrap();
        assert_eq!((d.header_wait_us, d.persist_interval_ms), (5000, 5000), "and the default waits");
        // Values older versions allowed run within this one's ranges.
        for (wait, interval, want) in [(3_600_000_000u64, 1u64, (1_000_000, 50)), (0, 0, (0, 0)), (1_000_000, 50, (1_000_000, 50))] {
            let mut v = c.to_json();
            v["header_wait_us"] = json!(wait);
            v["persist_interval_ms"] = json!(interval);
            let d = DeviceConfig::from_json(&v).unwrap();
            assert_eq!((d.header_wait_us, d.persist_interval_ms), want, "{wait} {interval}");
        }
        old.as_object_mut().unwrap().remove("backing_identity");
        assert_eq!(DeviceConfig::from_json(&old).unwrap().backing_identity, None, "and no saved identity to check");
        let mut bad = c.to_json();
        bad["backing_identity"] = json!(7);
        assert!(DeviceConfig::from_json(&bad).unwrap_err().contains("backing_identity"));
        // A state file edited by hand: an id that wraps into another, a name that leaves /dev/fdpblk.
        // An exported size that reaches into the reserved tail.
        for (key, bad) in [("id", json!(4294967300u64)), ("id", json!("4")), ("name", json!("../sda")), ("exported_bytes", json!((1u64 << 30) + 4096))] {
            let mut v = c.to_json();
            v[key] = bad;
            let e = DeviceConfig::from_json(&v).unwrap_err();
            assert!(e.contains(key), "{e}");
        }
        let p = DeviceConfig {
            engine: EngineKind::Passthrough,
            backing: "/dev/ng0n1".into(),
            streams: Vec::new(),
            pids: vec![0, 1, 2, 0x1003],
            ..c.clone()
        };
        assert_eq!(DeviceConfig::from_json(&p.to_json()).unwrap(), p);
        assert!(DeviceConfig::from_json(&json!({})).is_err());
        // Values `add` never writes are refused, not wrapped into others.
        for (key, bad) in [("lba_shift", 40u64), ("queues", 65536), ("queues", 0), ("depth", 5000), ("io_buf_bytes", 1 << 32)] {
            let mut v = p.to_json();
            v[key] = json!(bad);
            let e = DeviceConfig::from_json(&v).unwrap_err();
            assert!(e.contains(key) && e.contains(&bad.to_string()), "{e}");
        }
        // A buffer of part of a 4 KiB block would give the ublk device requests of none.
        let mut v = DeviceConfig { lba_shift: 12, ..p.clone() }.to_json();
        v["io_buf_bytes"] = json!(2048);
        let e = DeviceConfig::from_json(&v).unwrap_err();
        assert!(e.contains("io_buf_bytes") && e.contains("4096-byte blocks"), "{e}");
        // A handle map with values no engine can send is refused, not wrapped or skipped.
        for (key, bad) in [("streams", json!([1, 2, 300])), ("streams", json!([0, 1])), ("pids", json!([1, "2"])), ("pids", json!(7))] {
            let mut v = p.to_json();
            v[key] = bad.clone();
            let e = DeviceConfig::from_json(&v).unwrap_err();
            assert!(e.contains(key), "{bad}: {e}");
        }
        // Every handle of the policy must be mapped, or it would go out without placement.
        assert!(c.check_handle_map(4).is_ok() && p.check_handle_map(4).is_ok());
        assert!(c.check_handle_map(5).unwrap_err().contains("maps 4 to write streams"));
        let unmapped = DeviceConfig { pids: vec![0, 1], ..p.clone() };
        assert!(unmapped.check_handle_map(3).unwrap_err().contains("maps 2 to placement identifiers"));
        assert!(DeviceConfig { streams: Vec::new(), ..c.clone() }.check_handle_map(1).is_ok(), "policy none");
        assert!(DeviceConfig { engine: EngineKind::Plain, streams: Vec::new(), ..c.clone() }.check_handle_map(8).is_ok());
        // A policy this version does not have (another version's state file) still reads:
        // the device stays visible to `list`, `up` and the backing-in-use check.
        let mut v = p.to_json();
        v["policy"] = json!("tenant-aware");
        assert_eq!(DeviceConfig::from_json(&v).unwrap().policy, "tenant-aware");
        // A device still learning its layout.
        let l = DeviceConfig { geometry: None, layout_flags: GeometryFlags::default(), ..c.clone() };
        assert_eq!(DeviceConfig::from_json(&l.to_json()).unwrap(), l);
    }
}
