//! Parsers for the FDP data structures: the FDP Configurations (0x20), Reclaim Unit Handle
//! Usage (0x21), FDP Statistics (0x22) and FDP Events (0x23) log pages, the Reclaim Unit Handle
//! Status (I/O Management Receive, MO 1), and the FDP feature (0x1D) value.
//!
//! Layouts: NVMe Base Specification 2.0c (TP4146), as summarised in `fdp-waf.md` §2.3 of the
//! reference notes, cross-checked with libnvme's `struct nvme_fdp_config_log`,
//! `nvme_fdp_config_desc`, `nvme_fdp_ruhu_log`, `nvme_fdp_stats_log`, `nvme_fdp_events_log`,
//! `nvme_fdp_event` and `nvme_fdp_ruh_status` (`src/nvme/types.h`), and against images
//! captured from QEMU's FDP emulation (`tests/data/nvme/`).
//!
//! Everything here reads untrusted device data: each count is checked against the buffer, no
//! function panics or allocates more than the buffer can justify.

use std::fmt;

/// Why a structure from the drive cannot be parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseError {
    /// The buffer ends before what the structure says it holds.
    Truncated { what: &'static str, need: u64, have: usize },
    /// A field holds an impossible value.
    Invalid { what: &'static str, why: String },
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Truncated { what, need, have } => {
                write!(
                    f,
                    "{what}: {have} bytes, the structure needs {need} (the drive returned less than it describes)"
                )
            }
            ParseError::Invalid { what, why } => write!(f, "{what}: {why}"),
        }
    }
}

impl std::error::Error for ParseError {}

// Little-endian fields of NVMe data structures (callers check lengths first); `identify` uses
// them too.
pub(super) fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
pub(super) fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
pub(super) fn le64(b: &[u8], o: usize) -> u64 {
    u64::from(le32(b, o)) | (u64::from(le32(b, o + 4)) << 32)
}
fn le128(b: &[u8], o: usize) -> u128 {
    u128::from(le64(b, o)) | (u128::from(le64(b, o + 8)) << 64)
}

fn need(what: &'static str, b: &[u8], n: u64) -> Result<(), ParseError> {
    if (b.len() as u64) < n {
        Err(ParseError::Truncated { what, need: n, have: b.len() })
    } else {
        Ok(())
    }
}

// ---- FDP feature (FID 0x1D) ----------------------------------------------------------------

/// Get Features 0x1D result (DW0): bit 0 FDPE, bits 15:8 FDPCIDX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdpFeature {
    pub enabled: bool,
    pub config_index: u8,
}

impl FdpFeature {
    pub fn from_dw0(dw0: u32) -> Self {
        FdpFeature { enabled: dw0 & 1 != 0, config_index: (dw0 >> 8) as u8 }
    }
}

// ---- FDP Configurations log (0x20) ---------------------------------------------------------

/// Header of log 0x20.
pub const CONFIG_LOG_HEADER: usize = 16;
/// Fixed part of one configuration descriptor before the RUH descriptors.
pub const CONFIG_DESC_FIXED: usize = 64;

/// Reclaim unit handle type (RUHT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuhType {
    InitiallyIsolated,
    PersistentlyIsolated,
    Other(u8),
}

impl RuhType {
    pub fn from_u8(v: u8) -> Self {
        match v {
            1 => RuhType::InitiallyIsolated,
            2 => RuhType::PersistentlyIsolated,
            o => RuhType::Other(o),
        }
    }
    pub fn as_u8(self) -> u8 {
        match self {
            RuhType::InitiallyIsolated => 1,
            RuhType::PersistentlyIsolated => 2,
            RuhType::Other(o) => o,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            RuhType::InitiallyIsolated => "Initially Isolated",
            RuhType::PersistentlyIsolated => "Persistently Isolated",
            RuhType::Other(_) => "Reserved",
        }
    }
}

/// One FDP configuration descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdpConfig {
    /// DSZE: descriptor size in bytes.
    pub dsze: u16,
    /// FDPA: bits 3:0 RGIF, bit 4 FDPVWC, bit 7 valid.
    pub fdpa: u8,
    /// VSS: vendor-specific bytes at the end of the descriptor.
    pub vss: u8,
    /// NRG: reclaim groups.
    pub nrg: u32,
    /// NRUH: reclaim unit handles.
    pub nruh: u16,
    /// MAXPIDS: most placement identifiers per namespace, 0-based as the spec stores it.
    pub maxpids: u16,
    /// NNSS: namespaces supported.
    pub nnss: u32,
    /// RUNS: reclaim unit nominal size in bytes.
    pub runs: u64,
    /// ERUTL: estimated reclaim unit time limit in seconds (0 = not reported).
    pub erutl: u32,
    /// RUHT of each handle, in RUH id order.
    pub ruh_types: Vec<RuhType>,
}

impl FdpConfig {
    /// Reclaim Group Identifier Format: bits of a PID that select the reclaim group.
    pub fn rgif(&self) -> u8 {
        self.fdpa & 0xf
    }
    /// A placement identifier's reclaim group and placement handle: the group in its top
    /// RGIF bits, the handle in the rest. The RUH Status log lists one descriptor per handle
    /// per group, so its index is a handle only where there is one group.
    pub fn split_pid(&self, pid: u16) -> (u16, u16) {
        match u32::from(self.rgif().min(16)) {
            0 => (0, pid),
            16 => (pid, 0),
            g => (pid >> (16 - g), pid & ((1u16 << (16 - g)) - 1)),
        }
    }
    /// FDP volatile write cache present.
    pub fn fdpvwc(&self) -> bool {
        self.fdpa & 0x10 != 0
    }
    /// The configuration is valid.
    pub fn valid(&self) -> bool {
        self.fdpa & 0x80 != 0
    }
}

/// Log 0x20.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdpConfigLog {
    /// VER.
    pub version: u8,
    /// SZE: log size in bytes, as the drive reports it.
    pub size: u32,
    /// NUMFDPC + 1 descriptors; index = FDPCIDX.
    pub configs: Vec<FdpConfig>,
}

impl FdpConfigLog {
    /// Reads the 16-byte header: (NUMFDPC + 1, SZE). Read the log again with SZE bytes.
    pub fn header(b: &[u8]) -> Result<(u32, u32), ParseError> {
        need("FDP configurations log header", b, CONFIG_LOG_HEADER as u64)?;
        Ok((u32::from(le16(b, 0)) + 1, le32(b, 4)))
    }

    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        const W: &str = "FDP configurations log";
        let (n, size) = Self::header(b)?;
        let end = size as u64;
        need(W, b, end)?;
        if end < CONFIG_LOG_HEADER as u64 {
            return Err(ParseError::Invalid { what: W, why: format!("SZE {size} is smaller than the 16-byte header") });
        }
        let b = &b[..size as usize];
        let mut configs = Vec::new();
        let mut off = CONFIG_LOG_HEADER;
        for i in 0..n {
            if off + CONFIG_DESC_FIXED > b.len() {
                return Err(ParseError::Truncated { what: W, need: (off + CONFIG_DESC_FIXED) as u64, have: b.len() });
            }
            let d = &b[off..];
            let dsze = le16(d, 0);
            let nruh = le16(d, 8);
            let vss = d[3];
            let body = CONFIG_DESC_FIXED as u64 + 4 * u64::from(nruh) + u64::from(vss);
            if u64::from(dsze) < body {
                return Err(ParseError::Invalid {
                    what: W,
                    why: format!("descriptor {i}: DSZE {dsze} is smaller than 64 + 4 x NRUH {nruh} + VSS {vss}"),
                });
            }
            if off as u64 + u64::from(dsze) > b.len() as u64 {
                return Err(ParseError::Truncated { what: W, need: off as u64 + u64::from(dsze), have: b.len() });
            }
            let ruh_types = (0..usize::from(nruh)).map(|j| RuhType::from_u8(d[CONFIG_DESC_FIXED + 4 * j])).collect();
            configs.push(FdpConfig {
                dsze,
                fdpa: d[2],
                vss,
                nrg: le32(d, 4),
                nruh,
                maxpids: le16(d, 10),
                nnss: le32(d, 12),
                runs: le64(d, 16),
                erutl: le32(d, 24),
                ruh_types,
            });
            off += usize::from(dsze);
        }
        Ok(FdpConfigLog { version: b[2], size, configs })
    }
}

// ---- Reclaim Unit Handle Usage log (0x21) --------------------------------------------------

/// Reclaim unit handle attributes (RUHA) of one handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuhAttr {
    Unused,
    HostSpecified,
    ControllerSpecified,
    Other(u8),
}

impl RuhAttr {
    pub fn from_u8(v: u8) -> Self {
        match v {
            0 => RuhAttr::Unused,
            1 => RuhAttr::HostSpecified,
            2 => RuhAttr::ControllerSpecified,
            o => RuhAttr::Other(o),
        }
    }
    pub fn as_u8(self) -> u8 {
        match self {
            RuhAttr::Unused => 0,
            RuhAttr::HostSpecified => 1,
            RuhAttr::ControllerSpecified => 2,
            RuhAttr::Other(o) => o,
        }
    }
}

/// Log 0x21: one attribute per handle (8-byte descriptors after an 8-byte header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuhUsageLog {
    pub ruhs: Vec<RuhAttr>,
}

impl RuhUsageLog {
    pub const HEADER: usize = 8;
    pub const DESC: usize = 8;

    /// NRUH from the header; the whole log is 8 + 8 × NRUH bytes.
    pub fn header(b: &[u8]) -> Result<u16, ParseError> {
        need("RUH usage log header", b, Self::HEADER as u64)?;
        Ok(le16(b, 0))
    }

    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        let n = usize::from(Self::header(b)?);
        need("RUH usage log", b, (Self::HEADER + Self::DESC * n) as u64)?;
        Ok(RuhUsageLog { ruhs: (0..n).map(|i| RuhAttr::from_u8(b[Self::HEADER + Self::DESC * i])).collect() })
    }
}

// ---- FDP Statistics log (0x22) -------------------------------------------------------------

/// Log 0x22, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FdpStats {
    /// HBMW: host bytes with metadata written.
    pub hbmw: u128,
    /// MBMW: media bytes with metadata written.
    pub mbmw: u128,
    /// MBE: media bytes erased.
    pub mbe: u128,
}

impl FdpStats {
    pub const LEN: usize = 64;

    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        // The reserved tail (48..64) is not needed.
        need("FDP statistics log", b, 48)?;
        Ok(FdpStats { hbmw: le128(b, 0), mbmw: le128(b, 16), mbe: le128(b, 32) })
    }

    /// MBMW / HBMW: the write amplification the drive reports (None before any host write).
    pub fn media_host_ratio(&self) -> Option<f64> {
        (self.hbmw != 0).then(|| self.mbmw as f64 / self.hbmw as f64)
    }

    /// The counters' growth since `earlier` (saturating: a counter never goes back).
    pub fn since(&self, earlier: &FdpStats) -> FdpStats {
        FdpStats {
            hbmw: self.hbmw.saturating_sub(earlier.hbmw),
            mbmw: self.mbmw.saturating_sub(earlier.mbmw),
            mbe: self.mbe.saturating_sub(earlier.mbe),
        }
    }
}

// ---- FDP Events log (0x23) -----------------------------------------------------------------

/// FDP event types.
pub mod event_type {
    pub const RU_NOT_FULLY_WRITTEN: u8 = 0x00;
    pub const RU_TIME_LIMIT_EXCEEDED: u8 = 0x01;
    pub const CTRL_RESET_MODIFIED_RUHS: u8 = 0x02;
    pub const INVALID_PID: u8 = 0x03;
    pub const MEDIA_REALLOCATED: u8 = 0x80;
    pub const IMPLICITLY_MODIFIED_RUH: u8 = 0x81;
}

/// One 64-byte FDP event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdpEvent {
    pub etype: u8,
    /// FDPEF: bit 0 PIV (pid valid), bit 1 NSIDV, bit 2 LV (rgid/ruhid valid).
    pub flags: u8,
    pub pid: u16,
    /// Timestamp in milliseconds since the epoch (the low 48 bits of the 8-byte field).
    pub timestamp_ms: u64,
    /// Timestamp attribute byte (byte 6 of the field: synch/origin).
    pub timestamp_attr: u8,
    pub nsid: u32,
    pub type_specific: [u8; 16],
    pub rgid: u16,
    pub ruhid: u8,
}

impl FdpEvent {
    pub const LEN: usize = 64;

    pub fn pid_valid(&self) -> bool {
        self.flags & 1 != 0
    }
    pub fn nsid_valid(&self) -> bool {
        self.flags & 2 != 0
    }
    pub fn location_valid(&self) -> bool {
        self.flags & 4 != 0
    }
    pub fn type_name(&self) -> &'static str {
        match self.etype {
            event_type::RU_NOT_FULLY_WRITTEN => "Reclaim Unit Not Fully Written",
            event_type::RU_TIME_LIMIT_EXCEEDED => "Reclaim Unit Time Limit Exceeded",
            event_type::CTRL_RESET_MODIFIED_RUHS => "Controller Level Reset Modified Reclaim Unit Handles",
            event_type::INVALID_PID => "Invalid Placement Identifier",
            event_type::MEDIA_REALLOCATED => "Media Reallocated",
            event_type::IMPLICITLY_MODIFIED_RUH => "Implicitly Modified Reclaim Unit Handle",
            _ => "Unknown",
        }
    }
    /// Media Reallocated: (NLBAM, LBA if its LBAV flag is set).
    pub fn media_reallocated(&self) -> Option<(u16, Option<u64>)> {
        if self.etype != event_type::MEDIA_REALLOCATED {
            return None;
        }
        let t = &self.type_specific;
        let lba = (t[0] & 1 != 0).then(|| le64(t, 4));
        Some((le16(t, 2), lba))
    }

    fn parse(d: &[u8]) -> Self {
        let mut type_specific = [0u8; 16];
        type_specific.copy_from_slice(&d[16..32]);
        FdpEvent {
            etype: d[0],
            flags: d[1],
            pid: le16(d, 2),
            timestamp_ms: le64(d, 4) & 0xffff_ffff_ffff,
            timestamp_attr: d[10],
            nsid: le32(d, 12),
            type_specific,
            rgid: le16(d, 32),
            ruhid: d[34],
        }
    }
}

/// Log 0x23.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdpEventsLog {
    /// NEVENTS as the drive reports it.
    pub nevents: u32,
    /// The events that fit in the buffer (at most NEVENTS).
    pub events: Vec<FdpEvent>,
}

impl FdpEventsLog {
    pub const HEADER: usize = 64;
    /// What nvme-cli and libnvme read: the header and 63 events.
    pub const READ_LEN: usize = 4096;

    /// Parses NEVENTS events; when the buffer holds fewer, parses those and `truncated()`
    /// says so (a drive may report more events than a 4 KiB read returns).
    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        need("FDP events log", b, Self::HEADER as u64)?;
        let nevents = le32(b, 0);
        let fit = (b.len() - Self::HEADER) / FdpEvent::LEN;
        let n = (nevents as usize).min(fit);
        let events = (0..n)
            .map(|i| FdpEvent::parse(&b[Self::HEADER + i * FdpEvent::LEN..Self::HEADER + (i + 1) * FdpEvent::LEN]))
            .collect();
        Ok(FdpEventsLog { nevents, events })
    }

    pub fn truncated(&self) -> bool {
        (self.events.len() as u64) < u64::from(self.nevents)
    }
}

// ---- Reclaim Unit Handle Status (I/O Management Receive, MO 1) -----------------------------

/// One RUH Status descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuhStatusDesc {
    /// Placement identifier: what a write puts in DSPEC.
    pub pid: u16,
    /// Reclaim unit handle identifier.
    pub ruhid: u16,
    /// EARUTR: estimated active reclaim unit time remaining, seconds.
    pub earutr: u32,
    /// RUAMW: reclaim unit available media writes, in logical blocks.
    pub ruamw: u64,
}

/// RUH Status: the namespace's placement handles in placement-handle order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuhStatus {
    pub descs: Vec<RuhStatusDesc>,
}

impl RuhStatus {
    pub const HEADER: usize = 16;
    pub const DESC: usize = 32;

    /// NRUHSD from the 16-byte header.
    pub fn header(b: &[u8]) -> Result<u16, ParseError> {
        need("RUH status header", b, Self::HEADER as u64)?;
        Ok(le16(b, 14))
    }

    /// Bytes the whole structure takes for `nruhsd` descriptors.
    pub fn len_for(nruhsd: u16) -> usize {
        Self::HEADER + Self::DESC * usize::from(nruhsd)
    }

    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        let n = Self::header(b)?;
        need("RUH status", b, Self::len_for(n) as u64)?;
        let descs = (0..usize::from(n))
            .map(|i| {
                let d = &b[Self::HEADER + Self::DESC * i..];
                RuhStatusDesc { pid: le16(d, 0), ruhid: le16(d, 2), earutr: le32(d, 4), ruamw: le64(d, 8) }
            })
            .collect();
        Ok(RuhStatus { descs })
    }

    /// The placement identifiers in order: index i is placement handle i, and Linux write
    /// stream i + 1.
    pub fn placement_ids(&self) -> Vec<u16> {
        self.descs.iter().map(|d| d.pid).collect()
    }
}

/// Every parser of data read from the drive, on `b`, the results dropped: what the fuzz
/// target and `parsers_never_panic` run (none may panic, whatever `b` holds).
#[doc(hidden)]
pub fn every_parser(b: &[u8]) {
    use crate::nvme::identify::{parse_nsid_list, IdCtrl, IdNs};
    if let Ok(c) = FdpConfigLog::parse(b) {
        for d in &c.configs {
            for pid in 0..=d.maxpids.min(64) {
                let _ = d.split_pid(pid);
            }
        }
    }
    let _ = FdpConfigLog::header(b);
    let _ = RuhUsageLog::header(b);
    let _ = RuhUsageLog::parse(b);
    if let Ok(s) = FdpStats::parse(b) {
        let _ = s.since(&FdpStats::default());
    }
    let _ = FdpEventsLog::parse(b);
    let _ = RuhStatus::header(b);
    if let Ok(s) = RuhStatus::parse(b) {
        let _ = s.placement_ids();
    }
    if let Ok(c) = IdCtrl::parse(b) {
        let _ = (c.mdts_bytes(), c.fdp_supported());
    }
    if let Ok(n) = IdNs::parse(b) {
        let _ = (n.format(), n.lba_size(), n.size_bytes());
    }
    let _ = parse_nsid_list(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put16(b: &mut [u8], o: usize, v: u16) {
        b[o..o + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn put32(b: &mut [u8], o: usize, v: u32) {
        b[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn put64(b: &mut [u8], o: usize, v: u64) {
        b[o..o + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// A log 0x20 image with two configurations, built by the spec's layout.
    fn two_configs() -> Vec<u8> {
        let d0 = 64 + 4 * 2 + 4; // NRUH 2, VSS 4
        let d1 = 64 + 4 * 3;
        let size = 16 + d0 + d1;
        let mut b = vec![0u8; size];
        put16(&mut b, 0, 1); // NUMFDPC 0-based: 2 configurations
        b[2] = 1; // VER
        put32(&mut b, 4, size as u32);
        let o = 16;
        put16(&mut b, o, d0 as u16);
        b[o + 2] = 0x80 | 0x10 | 0x2; // valid, vwc, RGIF 2
        b[o + 3] = 4; // VSS
        put32(&mut b, o + 4, 4); // NRG
        put16(&mut b, o + 8, 2); // NRUH
        put16(&mut b, o + 10, 15); // MAXPIDS
        put32(&mut b, o + 12, 32); // NNSS
        put64(&mut b, o + 16, 1 << 30); // RUNS
        put32(&mut b, o + 24, 3600); // ERUTL
        b[o + 64] = 1;
        b[o + 68] = 2;
        b[o + 72..o + 76].copy_from_slice(b"VEND");
        let o = 16 + d0;
        put16(&mut b, o, d1 as u16);
        b[o + 2] = 0x80;
        put32(&mut b, o + 4, 1);
        put16(&mut b, o + 8, 3);
        put64(&mut b, o + 16, 96 << 20);
        b[o + 64] = 2;
        b[o + 68] = 2;
        b[o + 72] = 7;
        b
    }

    #[test]
    fn configs_by_spec_layout() {
        let b = two_configs();
        assert_eq!(FdpConfigLog::header(&b).unwrap(), (2, b.len() as u32));
        let log = FdpConfigLog::parse(&b).unwrap();
        assert_eq!(log.version, 1);
        assert_eq!(log.configs.len(), 2);
        let c = &log.configs[0];
        assert_eq!((c.fdpa, c.rgif(), c.fdpvwc(), c.valid(), c.vss), (0x92, 2, true, true, 4));
        // RGIF 2: the group in PID bits 15:14.
        assert_eq!((c.split_pid(0x4001), c.split_pid(3)), ((1, 1), (0, 3)));
        assert_eq!((c.nrg, c.nruh, c.maxpids, c.nnss, c.runs, c.erutl), (4, 2, 15, 32, 1 << 30, 3600));
        assert_eq!(c.ruh_types, vec![RuhType::InitiallyIsolated, RuhType::PersistentlyIsolated]);
        let c = &log.configs[1];
        assert_eq!((c.nrg, c.nruh, c.runs, c.rgif(), c.fdpvwc()), (1, 3, 96 << 20, 0, false));
        assert_eq!(c.split_pid(7), (0, 7));
        assert_eq!(c.ruh_types[2], RuhType::Other(7));
        assert_eq!(c.ruh_types[2].name(), "Reserved");
        // A longer buffer (a 4 KiB read) parses the same: SZE bounds the log.
        let mut long = b.clone();
        long.resize(4096, 0xff);
        assert_eq!(FdpConfigLog::parse(&long).unwrap(), log);
    }

    #[test]
    fn configs_reject_bad_counts() {
        let b = two_configs();
        // Short buffer.
        assert!(matches!(FdpConfigLog::parse(&b[..b.len() - 1]), Err(ParseError::Truncated { .. })));
        assert!(matches!(FdpConfigLog::parse(&b[..10]), Err(ParseError::Truncated { .. })));
        // SZE below the header.
        let mut x = b.clone();
        put32(&mut x, 4, 8);
        assert!(matches!(FdpConfigLog::parse(&x), Err(ParseError::Invalid { .. })));
        // DSZE 0 would loop forever; DSZE too small for NRUH.
        let mut x = b.clone();
        put16(&mut x, 16, 0);
        assert!(matches!(FdpConfigLog::parse(&x), Err(ParseError::Invalid { .. })));
        let mut x = b.clone();
        put16(&mut x, 16 + 8, 5000);
        assert!(matches!(FdpConfigLog::parse(&x), Err(ParseError::Invalid { .. })));
        // More configurations than the log holds.
        let mut x = b.clone();
        put16(&mut x, 0, 0xffff);
        assert!(matches!(FdpConfigLog::parse(&x), Err(ParseError::Truncated { .. })));
        // DSZE larger than the log.
        let mut x = b.clone();
        put16(&mut x, 16, 0xfff0);
        assert!(matches!(FdpConfigLog::parse(&x), Err(ParseError::Truncated { .. })));
    }

    #[test]
    fn usage_stats_status_by_spec_layout() {
        let mut u = vec![0u8; 8 + 3 * 8];
        put16(&mut u, 0, 3);
        u[8] = 1;
        u[16] = 2;
        u[24] = 0;
        let log = RuhUsageLog::parse(&u).unwrap();
        assert_eq!(log.ruhs, vec![RuhAttr::HostSpecified, RuhAttr::ControllerSpecified, RuhAttr::Unused]);
        assert!(RuhUsageLog::parse(&u[..31]).is_err());
        assert_eq!(RuhAttr::from_u8(9).as_u8(), 9);

        let mut s = vec![0u8; 64];
        put64(&mut s, 0, 0x1122);
        put64(&mut s, 8, 1); // high half of HBMW
        put64(&mut s, 16, 3000);
        put64(&mut s, 32, 7);
        let st = FdpStats::parse(&s).unwrap();
        assert_eq!(st.hbmw, (1u128 << 64) | 0x1122);
        assert_eq!((st.mbmw, st.mbe), (3000, 7));
        assert!(FdpStats::parse(&s[..47]).is_err());
        let st = FdpStats { hbmw: 1000, mbmw: 2500, mbe: 0 };
        assert_eq!(st.media_host_ratio(), Some(2.5));
        assert_eq!(FdpStats::default().media_host_ratio(), None);
        assert_eq!(st.since(&FdpStats { hbmw: 400, mbmw: 3000, mbe: 0 }), FdpStats { hbmw: 600, mbmw: 0, mbe: 0 });

        let mut r = vec![0u8; 16 + 2 * 32];
        put16(&mut r, 14, 2);
        put16(&mut r, 16, 0x1001);
        put16(&mut r, 18, 4);
        put32(&mut r, 20, 60);
        put64(&mut r, 24, 1 << 40);
        put16(&mut r, 48, 0x1002);
        put16(&mut r, 50, 5);
        let st = RuhStatus::parse(&r).unwrap();
        assert_eq!(
            st.descs,
            vec![
                RuhStatusDesc { pid: 0x1001, ruhid: 4, earutr: 60, ruamw: 1 << 40 },
                RuhStatusDesc { pid: 0x1002, ruhid: 5, earutr: 0, ruamw: 0 }
            ]
        );
        assert_eq!(st.placement_ids(), vec![0x1001, 0x1002]);
        assert_eq!(RuhStatus::len_for(2), r.len());
        assert!(matches!(RuhStatus::parse(&r[..r.len() - 1]), Err(ParseError::Truncated { need: 80, .. })));
        assert!(RuhStatus::header(&r[..15]).is_err());
    }

    #[test]
    fn events_by_spec_layout() {
        let mut e = vec![0u8; 64 + 2 * 64];
        put32(&mut e, 0, 2);
        let o = 64;
        e[o] = event_type::MEDIA_REALLOCATED;
        e[o + 1] = 0x7;
        put16(&mut e, o + 2, 9);
        put64(&mut e, o + 4, 0x00ff_0102_0304_0506); // attr byte 0xff above 48 bits
        put32(&mut e, o + 12, 3);
        e[o + 16] = 1; // LBAV
        put16(&mut e, o + 18, 77); // NLBAM
        put64(&mut e, o + 20, 0xabcdef);
        put16(&mut e, o + 32, 2);
        e[o + 34] = 6;
        e[128] = event_type::INVALID_PID;
        let log = FdpEventsLog::parse(&e).unwrap();
        assert!(!log.truncated());
        let ev = &log.events[0];
        assert_eq!((ev.pid, ev.nsid, ev.rgid, ev.ruhid), (9, 3, 2, 6));
        assert_eq!(ev.timestamp_ms, 0x0102_0304_0506);
        assert_eq!(ev.timestamp_attr, 0xff);
        assert!(ev.pid_valid() && ev.nsid_valid() && ev.location_valid());
        assert_eq!(ev.media_reallocated(), Some((77, Some(0xabcdef))));
        assert_eq!(ev.type_name(), "Media Reallocated");
        assert_eq!(log.events[1].type_name(), "Invalid Placement Identifier");
        assert_eq!(log.events[1].media_reallocated(), None);
        // NEVENTS beyond the buffer: parse what fits, say it is truncated.
        put32(&mut e, 0, u32::MAX);
        let log = FdpEventsLog::parse(&e).unwrap();
        assert_eq!(log.events.len(), 2);
        assert!(log.truncated());
        assert!(FdpEventsLog::parse(&e[..63]).is_err());
    }

    #[test]
    fn feature_value() {
        assert_eq!(FdpFeature::from_dw0(1), FdpFeature { enabled: true, config_index: 0 });
        assert_eq!(FdpFeature::from_dw0(0x0300), FdpFeature { enabled: false, config_index: 3 });
    }

    /// No input makes a parser panic; a small deterministic fuzz over random and mutated
    /// images, identify data included (the cargo-fuzz target `nvme_logs` in `fuzz/` runs
    /// the same calls on its own inputs).
    #[test]
    fn parsers_never_panic() {
        let mut rng = crate::test_fixtures::XorShift(0x9e37_79b9_7f4a_7c15);
        let mut rnd = move || rng.draw();
        let base = two_configs();
        for i in 0..20_000 {
            // Every tenth random input as long as an identify structure, to get past its
            // length check (half of the draws mutate `base` instead).
            let len = if i % 10 == 0 { 4096 + (rnd() % 200) as usize } else { (rnd() % 400) as usize };
            let mut b: Vec<u8> = if rnd() % 2 == 0 {
                (0..len).map(|_| rnd() as u8).collect()
            } else {
                let mut b = base.clone();
                for _ in 0..(rnd() % 6) {
                    let i = (rnd() as usize) % b.len();
                    b[i] = rnd() as u8;
                }
                b
            };
            if rnd() % 3 == 0 {
                b.truncate((rnd() as usize) % (b.len() + 1));
            }
            every_parser(&b);
        }
    }
}
