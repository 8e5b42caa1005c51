//! The few fields fdpblk needs from Identify Controller (CNS 1), Identify Namespace (CNS 0)
//! and the active namespace list (CNS 2).
//!
//! Offsets are from the NVMe Base Specification 2.0 (Identify Controller / Identify
//! Namespace data structures) and were checked against libnvme's `struct nvme_id_ctrl` and
//! `struct nvme_id_ns` (`src/nvme/types.h`), summing the field sizes:
//!
//! | structure | field | offset | size |
//! |---|---|---|---|
//! | id_ctrl | VID | 0 | 2 |
//! | id_ctrl | SN / MN / FR | 4 / 24 / 64 | 20 / 40 / 8 (ASCII, space padded) |
//! | id_ctrl | MDTS | 77 | 1 (2^n units of the minimum page size; 0 = no limit) |
//! | id_ctrl | CNTLID | 78 | 2 |
//! | id_ctrl | CTRATT | 96 | 4 (bit 19 FDPS, bit 4 endurance groups) |
//! | id_ctrl | CRDT1..3 | 128 / 130 / 132 | 2 each (100 ms units) |
//! | id_ctrl | ENDGIDMAX | 340 | 2 |
//! | id_ctrl | ONCS | 520 | 2 (bit 2 DSM, bit 3 write zeroes) |
//! | id_ns | NSZE / NCAP / NUSE | 0 / 8 / 16 | 8 each (logical blocks) |
//! | id_ns | NLBAF | 25 | 1 (0-based) |
//! | id_ns | FLBAS | 26 | 1 (format index = bits 3:0 + bits 6:5 << 4, as libnvme's `nvme_id_ns_flbas_to_lbaf_inuse`) |
//! | id_ns | DLFEAT | 33 | 1 (bits 2:0: what a deallocated block reads, 1 = zeroes; bit 3: Write Zeroes takes DEAC) |
//! | id_ns | ENDGID | 102 | 2 |
//! | id_ns | LBAF[i] | 128 + 4 i | 4: MS u16, LBADS u8 (2^n bytes), RP u8 — LBADS is bits 23:16 |

use super::fdp::{le16, le32, le64, ParseError};

fn ascii(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim_end_matches([' ', '\0']).trim().to_string()
}

/// Length of every Identify data structure.
pub const IDENTIFY_LEN: usize = 4096;

/// CTRATT bit 19: Flexible Data Placement supported.
pub const CTRATT_FDPS: u32 = 1 << 19;
/// CTRATT bit 4: endurance groups supported.
pub const CTRATT_EGS: u32 = 1 << 4;

/// Identify Controller, the fields fdpblk uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdCtrl {
    pub vid: u16,
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// MDTS as stored: maximum transfer = 2^mdts × the minimum memory page size; 0 = none.
    pub mdts: u8,
    pub cntlid: u16,
    pub ctratt: u32,
    pub endgidmax: u16,
    pub oncs: u16,
    /// Log Page Attributes (byte 261); bit 2: Get Log Page takes an offset (extended data).
    pub lpa: u8,
    /// Command Retry Delay Times 1..3, in 100 ms units: how long a host waits before it
    /// retries a command the controller failed with CRD 1..3 (the kernel enables this, ACRE,
    /// when CRDT1 is set).
    pub crdt: [u16; 3],
}

impl IdCtrl {
    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        if b.len() < 522 {
            return Err(ParseError::Truncated { what: "identify controller", need: 522, have: b.len() });
        }
        Ok(IdCtrl {
            vid: le16(b, 0),
            serial: ascii(&b[4..24]),
            model: ascii(&b[24..64]),
            firmware: ascii(&b[64..72]),
            mdts: b[77],
            cntlid: le16(b, 78),
            ctratt: le32(b, 96),
            endgidmax: le16(b, 340),
            oncs: le16(b, 520),
            lpa: b[261],
            crdt: [le16(b, 128), le16(b, 130), le16(b, 132)],
        })
    }

    /// The controller supports Flexible Data Placement (CTRATT bit 19).
    pub fn fdp_supported(&self) -> bool {
        self.ctratt & CTRATT_FDPS != 0
    }

    /// Get Log Page takes a log page offset (LPA bit 2), which every controller of NVMe 1.3
    /// or later sets.
    pub fn log_offsets_supported(&self) -> bool {
        self.lpa & (1 << 2) != 0
    }

    /// Dataset Management supported (ONCS bit 2).
    pub fn dsm_supported(&self) -> bool {
        self.oncs & (1 << 2) != 0
    }

    /// Write Zeroes supported (ONCS bit 3).
    pub fn write_zeroes_supported(&self) -> bool {
        self.oncs & (1 << 3) != 0
    }

    /// The MDTS limit in bytes, assuming a 4 KiB minimum memory page size (CAP.MPSMIN = 0,
    /// which the passthrough interface cannot read; the kernel's `max_hw_sectors_kb` is the
    /// authoritative limit and already folds MPSMIN in). None = no limit reported.
    pub fn mdts_bytes(&self) -> Option<u64> {
        match self.mdts {
            0 => None,
            m if m >= 52 => Some(u64::MAX),
            m => Some(4096u64 << m),
        }
    }
}

/// One LBA format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbaFormat {
    /// Metadata bytes per block.
    pub ms: u16,
    /// LBA data size as a power of two.
    pub lbads: u8,
    /// Relative performance (0 best).
    pub rp: u8,
}

/// Identify Namespace, the fields fdpblk uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdNs {
    /// Namespace size in logical blocks.
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    pub flbas: u8,
    /// The formats (NLBAF + 1 of them, at most 64).
    pub lbafs: Vec<LbaFormat>,
    pub endgid: u16,
    /// Deallocate Logical Block Features.
    pub dlfeat: u8,
    /// Namespace Globally Unique Identifier (bytes 104..120; zeroes = not reported).
    pub nguid: [u8; 16],
    /// IEEE Extended Unique Identifier (bytes 120..128; zeroes = not reported).
    pub eui64: [u8; 8],
}

impl IdNs {
    pub fn parse(b: &[u8]) -> Result<Self, ParseError> {
        if b.len() < 128 + 4 {
            return Err(ParseError::Truncated { what: "identify namespace", need: 132, have: b.len() });
        }
        // NLBAF is 0-based; the table has 64 entries (bytes 128..384).
        let n = (usize::from(b[25]) + 1).min(64).min((b.len() - 128) / 4);
        let lbafs = (0..n)
            .map(|i| {
                let o = 128 + 4 * i;
                LbaFormat { ms: le16(b, o), lbads: b[o + 2], rp: b[o + 3] & 3 }
            })
            .collect();
        let mut nguid = [0u8; 16];
        let mut eui64 = [0u8; 8];
        if let Some(id) = b.get(104..128) {
            nguid.copy_from_slice(&id[..16]);
            eui64.copy_from_slice(&id[16..]);
        }
        Ok(IdNs {
            nsze: le64(b, 0),
            ncap: le64(b, 8),
            nuse: le64(b, 16),
            flbas: b[26],
            lbafs,
            endgid: le16(b, 102),
            dlfeat: b[33],
            nguid,
            eui64,
        })
    }

    /// Whether a Write Zeroes may carry DEAC: the namespace takes it (DLFEAT bit 3) and its
    /// deallocated blocks read as zeroes (bits 2:0 = 1). Linux's own rule (`NVME_NS_DEAC`):
    /// the spec makes DEAC a no-op otherwise, and some drives mishandle it.
    pub fn write_zeroes_deallocates(&self) -> bool {
        self.dlfeat & 0x7 == 1 && self.dlfeat & 0x8 != 0
    }

    /// Index of the LBA format in use (FLBAS bits 3:0, and bits 6:5 as index bits 5:4).
    pub fn format_index(&self) -> usize {
        usize::from(self.flbas & 0xf) | (usize::from((self.flbas >> 5) & 3) << 4)
    }

    /// The format in use.
    pub fn format(&self) -> Result<LbaFormat, ParseError> {
        let i = self.format_index();
        self.lbafs.get(i).copied().ok_or_else(|| ParseError::Invalid {
            what: "identify namespace",
            why: format!("FLBAS selects LBA format {i}, but only {} are listed", self.lbafs.len()),
        })
    }

    /// Logical block size in bytes: 512 B to 64 KiB (the spec requires LBADS ≥ 9; Linux
    /// block devices take at most 64 KiB, from about 6.15 on, the page size before; and
    /// every passthrough read buffer is at least one block).
    pub fn lba_size(&self) -> Result<u32, ParseError> {
        let f = self.format()?;
        if !(9..=16).contains(&f.lbads) {
            return Err(ParseError::Invalid {
                what: "identify namespace",
                why: format!(
                    "LBA data size 2^{} is not a usable block size (512 B to 64 KiB); format the namespace \
                     with a 512 B or 4 KiB LBA format (`nvme id-ns -H` lists them, `nvme format --lbaf=N` selects one)",
                    f.lbads
                ),
            });
        }
        Ok(1u32 << f.lbads)
    }

    /// Namespace size in bytes (NSZE × block size), refused when it does not fit a file
    /// offset (i64): no real drive comes near, so it is a corrupt identify.
    pub fn size_bytes(&self) -> Result<u64, ParseError> {
        let lba = u64::from(self.lba_size()?);
        self.nsze.checked_mul(lba).filter(|&b| b <= i64::MAX as u64).ok_or_else(|| ParseError::Invalid {
            what: "identify namespace",
            why: format!("NSZE {} blocks of {lba} bytes is more than 2^63 bytes", self.nsze),
        })
    }
}

/// Active namespace ids from an Identify CNS 2 list (zero-terminated, 1024 u32s).
pub fn parse_nsid_list(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).take_while(|&n| n != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_ctrl_by_spec_offsets() {
        let mut b = vec![0u8; IDENTIFY_LEN];
        b[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        b[4..24].copy_from_slice(b"SER123              ");
        b[24..28].copy_from_slice(b"Ctrl");
        b[64..72].copy_from_slice(b"1.0     ");
        b[77] = 5;
        b[78] = 3;
        b[96..100].copy_from_slice(&(CTRATT_FDPS | CTRATT_EGS).to_le_bytes());
        b[340..342].copy_from_slice(&4u16.to_le_bytes());
        b[520..522].copy_from_slice(&0x0cu16.to_le_bytes());
        b[261] = 0x0e;
        // CRDT1..3 at bytes 128..134 (after the 16-byte FRU GUID at 112); 134.. is reserved.
        b[128..134].copy_from_slice(&[5, 0, 0x10, 0x27, 1, 0]);
        b[134..140].copy_from_slice(&[9, 9, 9, 9, 9, 9]);
        let c = IdCtrl::parse(&b).unwrap();
        assert_eq!(c.crdt, [5, 10000, 1]);
        assert_eq!(
            (c.vid, c.serial.as_str(), c.model.as_str(), c.firmware.as_str()),
            (0x1b36, "SER123", "Ctrl", "1.0")
        );
        assert_eq!((c.mdts, c.cntlid, c.endgidmax), (5, 3, 4));
        assert!(c.fdp_supported() && c.dsm_supported() && c.write_zeroes_supported() && c.log_offsets_supported());
        b[261] = 0x0b;
        assert!(!IdCtrl::parse(&b).unwrap().log_offsets_supported());
        assert_eq!(c.mdts_bytes(), Some(128 << 10));
        b[96] = 0;
        b[98] = 0;
        assert!(!IdCtrl::parse(&b).unwrap().fdp_supported());
        b[77] = 0;
        assert_eq!(IdCtrl::parse(&b).unwrap().mdts_bytes(), None);
        b[77] = 255;
        assert_eq!(IdCtrl::parse(&b).unwrap().mdts_bytes(), Some(u64::MAX));
        assert!(IdCtrl::parse(&b[..521]).is_err());
    }

    #[test]
    fn id_ns_by_spec_offsets() {
        let mut b = vec![0u8; IDENTIFY_LEN];
        b[0..8].copy_from_slice(&0x20_0000u64.to_le_bytes());
        b[25] = 1; // two formats
        b[26] = 1; // format 1 in use
        b[102..104].copy_from_slice(&7u16.to_le_bytes());
        b[128 + 2] = 9;
        b[132..136].copy_from_slice(&[8, 0, 12, 2]);
        let ns = IdNs::parse(&b).unwrap();
        assert_eq!((ns.nsze, ns.endgid, ns.format_index()), (0x20_0000, 7, 1));
        assert_eq!(ns.format().unwrap(), LbaFormat { ms: 8, lbads: 12, rp: 2 });
        assert_eq!(ns.lba_size().unwrap(), 4096);
        assert_eq!(ns.size_bytes().unwrap(), 0x20_0000 << 12);
        // DEAC only where the namespace takes it and deallocated blocks read zeroes.
        for (dlfeat, deac) in [(0x00, false), (0x01, false), (0x08, false), (0x0a, false), (0x09, true), (0x19, true)] {
            b[33] = dlfeat;
            assert_eq!(IdNs::parse(&b).unwrap().write_zeroes_deallocates(), deac, "DLFEAT {dlfeat:#x}");
        }
        b[33] = 0;
        // Blocks past 64 KiB are refused (a 2 GiB block would size every read buffer), and
        // a size past 2^63 bytes.
        b[132 + 2] = 17;
        assert!(IdNs::parse(&b).unwrap().lba_size().unwrap_err().to_string().contains("nvme format --lbaf"));
        b[132 + 2] = 16;
        assert_eq!(IdNs::parse(&b).unwrap().lba_size().unwrap(), 65536);
        b[132 + 2] = 12;
        b[0..8].copy_from_slice(&(1u64 << 51).to_le_bytes());
        assert!(IdNs::parse(&b).unwrap().size_bytes().is_err());
        b[0..8].copy_from_slice(&((1u64 << 51) - 1).to_le_bytes());
        assert_eq!(IdNs::parse(&b).unwrap().size_bytes().unwrap(), ((1u64 << 51) - 1) << 12);
        // FLBAS high bits (6:5) extend the index past 16; beyond the list is an error.
        b[26] = 0x21;
        assert_eq!(IdNs::parse(&b).unwrap().format_index(), 17);
        assert!(IdNs::parse(&b).unwrap().lba_size().is_err());
        b[26] = 0;
        b[130] = 3;
        assert!(IdNs::parse(&b).unwrap().lba_size().is_err());
        // NLBAF 255 is clamped to the table; a short buffer is clamped to what it holds.
        b[25] = 255;
        assert_eq!(IdNs::parse(&b).unwrap().lbafs.len(), 64);
        assert_eq!(IdNs::parse(&b[..140]).unwrap().lbafs.len(), 3);
        assert!(IdNs::parse(&b[..131]).is_err());
    }

    #[test]
    fn nsid_list() {
        let mut b = vec![0u8; 16];
        b[0] = 1;
        b[4] = 3;
        assert_eq!(parse_nsid_list(&b), vec![1, 3]);
        assert_eq!(parse_nsid_list(&[]), Vec::<u32>::new());
    }
}
