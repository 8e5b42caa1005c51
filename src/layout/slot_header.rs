//! The `LMCBLK01` slot header: magic, identity (u64 LE), payload_len (u64 LE), zeros.

pub const SLOT_MAGIC: &[u8; 8] = b"LMCBLK01";
/// Bytes of the header that carry information; the rest of `header_bytes` is zero.
pub const SLOT_HEADER_PREFIX: usize = 24;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHeader {
    pub identity: u64,
    pub payload_len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotHeaderError {
    /// Fewer than 24 bytes were available.
    Short,
    /// The first 8 bytes are not `LMCBLK01` (free, never written, or foreign data).
    BadMagic,
}

impl std::fmt::Display for SlotHeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Short => f.write_str("slot header shorter than 24 bytes"),
            Self::BadMagic => f.write_str("no LMCBLK01 magic"),
        }
    }
}

impl std::error::Error for SlotHeaderError {}

impl SlotHeader {
    /// Parses the first 24 bytes of `bytes`; never reads past them.
    pub fn parse(bytes: &[u8]) -> Result<Self, SlotHeaderError> {
        let prefix: &[u8; SLOT_HEADER_PREFIX] =
            bytes.get(..SLOT_HEADER_PREFIX).and_then(|b| b.try_into().ok()).ok_or(SlotHeaderError::Short)?;
        if &prefix[..8] != SLOT_MAGIC {
            return Err(SlotHeaderError::BadMagic);
        }
        Ok(Self {
            identity: u64::from_le_bytes(prefix[8..16].try_into().unwrap_or_default()),
            payload_len: u64::from_le_bytes(prefix[16..24].try_into().unwrap_or_default()),
        })
    }

    /// The header block LMCache writes (`_encode_header`), `header_bytes` long.
    pub fn encode(&self, header_bytes: usize) -> Vec<u8> {
        let mut b = vec![0u8; header_bytes.max(SLOT_HEADER_PREFIX)];
        b[..8].copy_from_slice(SLOT_MAGIC);
        b[8..16].copy_from_slice(&self.identity.to_le_bytes());
        b[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// LMCache accepts an entry only if its size is in `(0, slot payload capacity]`.
    pub fn payload_len_fits(&self, payload_capacity: u64) -> bool {
        self.payload_len > 0 && self.payload_len <= payload_capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let h = SlotHeader { identity: 0xcdddaf2a88212cff, payload_len: 61440 };
        let b = h.encode(4096);
        assert_eq!(b.len(), 4096);
        assert_eq!(&b[8..16], &[0xff, 0x2c, 0x21, 0x88, 0x2a, 0xaf, 0xdd, 0xcd]);
        assert_eq!(SlotHeader::parse(&b), Ok(h));
        assert_eq!(SlotHeader::parse(&b[..23]), Err(SlotHeaderError::Short));
        assert_eq!(SlotHeader::parse(&[]), Err(SlotHeaderError::Short));
        let mut bad = b.clone();
        bad[7] ^= 1;
        assert_eq!(SlotHeader::parse(&bad), Err(SlotHeaderError::BadMagic));
        assert!(h.payload_len_fits(61440));
        assert!(!h.payload_len_fits(61439));
        assert!(!SlotHeader { identity: 0, payload_len: 0 }.payload_len_fits(10));
    }
}
