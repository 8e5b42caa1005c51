//! The `LMCIDX01` checkpoint container header: struct `<8sIQQI` (32 bytes, little-endian)
//! at the start of a `block_align` block; the JSON payload follows one block later.

pub const META_MAGIC: &[u8; 8] = b"LMCIDX01";
pub const META_VERSION: u32 = 1;
pub const CHECKPOINT_HEADER_LEN: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointHeader {
    pub magic: [u8; 8],
    pub version: u32,
    pub seq: u64,
    pub payload_len: u64,
    pub crc32: u32,
}

/// Why LMCache's loader (`_select_latest_checkpoint`) would skip a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointHeaderError {
    Short,
    BadMagic,
    BadVersion(u32),
    /// `payload_len <= 0` or larger than the container's payload capacity.
    BadPayloadLen { payload_len: u64, cap: u64 },
}

impl std::fmt::Display for CheckpointHeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::Short => f.write_str("checkpoint header shorter than 32 bytes"),
            Self::BadMagic => f.write_str("no LMCIDX01 magic"),
            Self::BadVersion(v) => write!(f, "checkpoint header version {v}, expected {META_VERSION}"),
            Self::BadPayloadLen { payload_len, cap } => {
                write!(f, "checkpoint payload_len {payload_len} outside (0, {cap}]")
            }
        }
    }
}

impl std::error::Error for CheckpointHeaderError {}

impl CheckpointHeader {
    /// Decodes the 32-byte struct without judging it.
    pub fn decode(bytes: &[u8]) -> Result<Self, CheckpointHeaderError> {
        let b: &[u8; CHECKPOINT_HEADER_LEN] = bytes
            .get(..CHECKPOINT_HEADER_LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or(CheckpointHeaderError::Short)?;
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&b[..8]);
        Ok(Self {
            magic,
            version: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            seq: u64::from_le_bytes([b[12], b[13], b[14], b[15], b[16], b[17], b[18], b[19]]),
            payload_len: u64::from_le_bytes([b[20], b[21], b[22], b[23], b[24], b[25], b[26], b[27]]),
            crc32: u32::from_le_bytes([b[28], b[29], b[30], b[31]]),
        })
    }

    /// Decodes and applies the loader's header checks (magic, version, payload_len bound).
    pub fn parse(bytes: &[u8], payload_cap: u64) -> Result<Self, CheckpointHeaderError> {
        let h = Self::decode(bytes)?;
        if &h.magic != META_MAGIC {
            return Err(CheckpointHeaderError::BadMagic);
        }
        if h.version != META_VERSION {
            return Err(CheckpointHeaderError::BadVersion(h.version));
        }
        if h.payload_len == 0 || h.payload_len > payload_cap {
            return Err(CheckpointHeaderError::BadPayloadLen { payload_len: h.payload_len, cap: payload_cap });
        }
        Ok(h)
    }

    /// The header block LMCache writes for `payload`, `block_align` bytes long.
    pub fn encode_for(seq: u64, payload: &[u8], block_align: usize) -> Vec<u8> {
        let mut b = vec![0u8; block_align.max(CHECKPOINT_HEADER_LEN)];
        b[..8].copy_from_slice(META_MAGIC);
        b[8..12].copy_from_slice(&META_VERSION.to_le_bytes());
        b[12..20].copy_from_slice(&seq.to_le_bytes());
        b[20..28].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        b[28..32].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
        b
    }

    pub fn crc_matches(&self, payload: &[u8]) -> bool {
        payload.len() as u64 == self.payload_len && crc32fast::hash(payload) == self.crc32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_byte_by_byte() {
        let payload = br#"{"version":1}"#;
        let b = CheckpointHeader::encode_for(7, payload, 4096);
        assert_eq!(&b[..8], b"LMCIDX01");
        assert_eq!(&b[8..12], &[1, 0, 0, 0]);
        assert_eq!(&b[12..20], &[7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[20..28], &[13, 0, 0, 0, 0, 0, 0, 0]);
        assert!(b[32..].iter().all(|&x| x == 0));
        let h = CheckpointHeader::parse(&b, 4096).unwrap();
        assert_eq!((h.seq, h.payload_len), (7, 13));
        assert!(h.crc_matches(payload));
        assert!(!h.crc_matches(br#"{"version":2}"#));
        // zlib.crc32(b"123456789") = 0xcbf43926: the IEEE CRC LMCache uses.
        assert_eq!(crc32fast::hash(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn loader_rejections() {
        let b = CheckpointHeader::encode_for(1, b"{}", 4096);
        assert_eq!(CheckpointHeader::parse(&b[..31], 4096), Err(CheckpointHeaderError::Short));
        assert_eq!(CheckpointHeader::parse(&b, 1), Err(CheckpointHeaderError::BadPayloadLen { payload_len: 2, cap: 1 }));
        let mut v = b.clone();
        v[8] = 2;
        assert_eq!(CheckpointHeader::parse(&v, 4096), Err(CheckpointHeaderError::BadVersion(2)));
        let mut m = b.clone();
        m[0] = b'X';
        assert_eq!(CheckpointHeader::parse(&m, 4096), Err(CheckpointHeaderError::BadMagic));
        let mut z = b;
        z[20..28].fill(0);
        assert!(matches!(CheckpointHeader::parse(&z, 4096), Err(CheckpointHeaderError::BadPayloadLen { .. })));
    }
}
