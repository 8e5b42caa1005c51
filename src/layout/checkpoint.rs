//! Reading LMCache's two mirrored checkpoint copies back from a device, and picking the one
//! its loader would trust (`_select_latest_checkpoint`): valid header, matching CRC, highest seq.

use super::checkpoint_header::{CheckpointHeader, CheckpointHeaderError};
use super::checkpoint_json::{parse_checkpoint_json, CheckpointMeta, EntryRef, JsonError, JsonLimits};
use super::Geometry;
use crate::device::{ReadAt, RegionReader};
use std::io;

/// What one container holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyStatus {
    pub copy: u8,
    pub offset: u64,
    pub header: Result<CheckpointHeader, CheckpointHeaderError>,
    /// None when the header was already invalid, so the payload was not read.
    pub crc_ok: Option<bool>,
}

impl CopyStatus {
    pub fn is_valid(&self) -> bool {
        self.header.is_ok() && self.crc_ok == Some(true)
    }
    pub fn seq(&self) -> Option<u64> {
        self.header.as_ref().ok().map(|h| h.seq)
    }
    pub fn payload_len(&self) -> Option<u64> {
        self.header.as_ref().ok().map(|h| h.payload_len)
    }
    /// Byte offset of the JSON payload: one block after the header.
    pub fn payload_offset(&self, geom: &Geometry) -> u64 {
        self.offset + geom.block_align
    }
}

/// Reads container `copy`'s header block and, if it passes the loader's checks, CRCs its
/// payload in bounded chunks.
pub fn read_copy<D: ReadAt + ?Sized>(dev: &D, geom: &Geometry, copy: u8) -> io::Result<CopyStatus> {
    let offset = geom.container_offset(copy);
    let mut hdr = [0u8; 32];
    dev.read_exact_at(&mut hdr, offset)?;
    let header = CheckpointHeader::parse(&hdr, geom.payload_cap());
    let crc_ok = match &header {
        Ok(h) => Some(payload_crc(dev, offset + geom.block_align, h.payload_len)? == h.crc32),
        Err(_) => None,
    };
    Ok(CopyStatus { copy, offset, header, crc_ok })
}

/// Both copies, in container order.
pub fn read_copies<D: ReadAt + ?Sized>(dev: &D, geom: &Geometry) -> io::Result<[CopyStatus; 2]> {
    Ok([read_copy(dev, geom, 0)?, read_copy(dev, geom, 1)?])
}

/// The copy LMCache's loader would take: the valid one with the highest seq, the first of
/// two with one seq (its `>` keeps the first; `max_by_key` keeps the last, hence `rev`).
pub fn newest_valid(copies: &[CopyStatus]) -> Option<&CopyStatus> {
    copies.iter().rev().filter(|c| c.is_valid()).max_by_key(|c| c.seq())
}

/// CRC-32 (zlib) of `len` bytes at `offset`, read 1 MiB at a time.
pub fn payload_crc<D: ReadAt + ?Sized>(dev: &D, offset: u64, len: u64) -> io::Result<u32> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; (1 << 20).min(len as usize).max(1)];
    let mut done = 0u64;
    while done < len {
        let n = buf.len().min((len - done) as usize);
        dev.read_exact_at(&mut buf[..n], offset + done)?;
        hasher.update(&buf[..n]);
        done += n as u64;
    }
    Ok(hasher.finalize())
}

/// Whether the syntax error at byte `at` of `copy`'s JSON is a NaN or Infinity literal, which
/// Python's json.loads (LMCache's) accepts and strict JSON does not: LMCache loads that
/// checkpoint, so it is not one to take as malformed.
pub fn python_only_literal_at<D: ReadAt + ?Sized>(dev: &D, geom: &Geometry, copy: &CopyStatus, at: u64) -> io::Result<bool> {
    let mut b = [0u8; 9];
    let n = b.len().min(copy.payload_len().unwrap_or(0).saturating_sub(at) as usize);
    dev.read_exact_at(&mut b[..n], copy.payload_offset(geom) + at)?;
    Ok([&b"NaN"[..], b"Infinity", b"-Infinity"].iter().any(|w| b[..n].starts_with(w)))
}

/// Streams the JSON of a copy whose header is valid, calling `on_entry` per index entry.
pub fn read_entries<D: ReadAt + ?Sized>(
    dev: &D,
    geom: &Geometry,
    copy: &CopyStatus,
    limits: &JsonLimits,
    on_entry: &mut dyn FnMut(EntryRef<'_>) -> Result<(), String>,
) -> Result<CheckpointMeta, JsonError> {
    let len = copy.payload_len().ok_or(JsonError::NotAnObject)?;
    let reader = RegionReader::new(dev, copy.payload_offset(geom), len);
    // The header check bounds `len` by the container: any payload LMCache could load is read.
    let limits = JsonLimits { max_payload_bytes: limits.max_payload_bytes.max(len), ..limits.clone() };
    parse_checkpoint_json(io::BufReader::with_capacity(1 << 16, reader), &limits, on_entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::GeometryConfig;
    use crate::test_fixtures::fixture;

    fn geom_of(m: &serde_json::Value, size: u64) -> Geometry {
        let g = &m["geometry"];
        GeometryConfig {
            block_align: g["block_align"].as_u64().unwrap(),
            header_bytes: g["header_bytes"].as_u64().unwrap(),
            slot_bytes: g["slot_bytes"].as_u64().unwrap(),
            meta_total_bytes: g["meta_total_bytes"].as_u64().unwrap(),
            capacity_bytes: g["capacity_bytes_configured"].as_u64().unwrap(),
        }
        .validate(size)
        .unwrap()
    }

    #[test]
    fn copies_match_manifests() {
        for scen in ["legacy-basic", "object-evict", "object-multitenant", "reopen", "object-evict.odirect"] {
            let (img, m) = fixture(scen);
            let geom = geom_of(&m, img.len() as u64);
            let copies = read_copies(&img, &geom).unwrap();
            let on_dev = m["checkpoints_on_device"].as_object().unwrap();
            for c in &copies {
                match on_dev.get(&c.copy.to_string()) {
                    Some(seq) => {
                        assert!(c.is_valid(), "{scen} copy {}", c.copy);
                        assert_eq!(c.seq(), seq.as_u64());
                    }
                    None => assert!(!c.is_valid(), "{scen} copy {}", c.copy),
                }
            }
            let newest = newest_valid(&copies).unwrap();
            assert_eq!(newest.seq(), m["latest_checkpoint_seq"].as_u64(), "{scen}");
            let want: Vec<&str> = m["checkpoints"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["seq"].as_u64() == newest.seq())
                .unwrap()["entry_keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            let mut got = Vec::new();
            let meta = read_entries(&img, &geom, newest, &JsonLimits::default(), &mut |e| {
                got.push(e.key.to_string());
                Ok(())
            })
            .unwrap();
            assert_eq!(got, want, "{scen}");
            assert_eq!(meta.slot_bytes, Some(geom.slot_bytes));
        }
    }

    #[test]
    fn two_copies_with_one_seq_load_the_first_and_a_small_bound_reads_the_whole_payload() {
        use crate::layout::checkpoint_header::CheckpointHeader;
        let (mut img, m) = fixture("object-evict");
        let geom = geom_of(&m, img.len() as u64);
        let ba = geom.block_align as usize;
        // Copy 0 (seq 1) rewritten as seq 2, copy 1's seq: LMCache's `>` keeps copy 0.
        let copies = read_copies(&img, &geom).unwrap();
        let len = copies[0].payload_len().unwrap() as usize;
        let payload = img[ba..ba + len].to_vec();
        img[..ba].copy_from_slice(&CheckpointHeader::encode_for(2, &payload, ba));
        let copies = read_copies(&img, &geom).unwrap();
        assert_eq!((copies[0].seq(), copies[1].seq()), (Some(2), Some(2)));
        let newest = newest_valid(&copies).unwrap();
        assert_eq!(newest.copy, 0);
        // A payload the header check let through is read whole, whatever the caller's bound.
        let tight = JsonLimits { max_payload_bytes: 16, ..JsonLimits::default() };
        let mut n = 0;
        read_entries(&img, &geom, newest, &tight, &mut |_| {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert!(n > 0);
    }

    #[test]
    fn corrupt_payload_fails_crc_and_falls_back() {
        let (mut img, m) = fixture("object-evict");
        let geom = geom_of(&m, img.len() as u64);
        // Flip one JSON byte of copy 1 (seq 2): the loader must fall back to copy 0 (seq 1).
        img[(geom.container_offset(1) + geom.block_align + 10) as usize] ^= 0x20;
        let copies = read_copies(&img, &geom).unwrap();
        assert_eq!(copies[1].crc_ok, Some(false));
        assert_eq!(newest_valid(&copies).unwrap().seq(), Some(1));
        // A torn header (zeroed) is invalid without reading the payload.
        img[..32].fill(0);
        let copies = read_copies(&img, &geom).unwrap();
        assert_eq!(copies[0].crc_ok, None);
        assert!(newest_valid(&copies).is_none());
    }
}
