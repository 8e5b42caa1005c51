//! Geometry of a raw_block device, validated with exactly LMCache's rules
//! (`RawBlockCore.__init__`, `_ensure_capacity_and_layout`).

use std::fmt;

/// LMCache's defaults (non-MP plugin); the MP adapter uses a 256 MiB metadata region.
pub const DEFAULT_BLOCK_ALIGN: u64 = 4096;
pub const DEFAULT_HEADER_BYTES: u64 = 4096;
pub const DEFAULT_META_TOTAL_BYTES_NON_MP: u64 = 128 << 20;
pub const DEFAULT_META_TOTAL_BYTES_MP: u64 = 256 << 20;

/// The values LMCache is configured with, named like its config keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeometryConfig {
    pub block_align: u64,
    pub header_bytes: u64,
    pub slot_bytes: u64,
    pub meta_total_bytes: u64,
    /// `capacity_bytes` as configured: 0 means the whole device.
    pub capacity_bytes: u64,
}

/// A validated layout with the derived values every other module uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub block_align: u64,
    pub header_bytes: u64,
    pub slot_bytes: u64,
    pub meta_total_bytes: u64,
    /// Effective capacity: `min(capacity_bytes or device_size, device_size)`.
    pub capacity_bytes: u64,
    /// Size of each of the two mirrored checkpoint containers.
    pub container_bytes: u64,
    pub max_slots: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GeometryError {
    BlockAlignNotPowerOfTwo(u64),
    BlockAlignTooLarge(u64),
    HeaderBytes(u64, u64),
    SlotBytes { slot_bytes: u64, header_bytes: u64, block_align: u64 },
    MetaTotalBytes(u64, u64),
    ContainerTooSmall { container_bytes: u64, block_align: u64 },
    DeviceTooSmall { meta_total_bytes: u64, capacity: u64, slot_bytes: u64 },
    /// The same, where the device would hold a slot but `capacity_bytes` caps it below one.
    CapacityTooSmall { meta_total_bytes: u64, capacity_bytes: u64, slot_bytes: u64 },
    TooManySlots { max_slots: u64, capacity: u64, slot_bytes: u64 },
}

/// The largest `block_align` fdpblk takes (buffers of that size are read per checkpoint
/// event; LMCache's own default is 4096, O_DIRECT needs at most the drive's block size).
pub const MAX_BLOCK_ALIGN: u64 = 1 << 20;

/// The most slots fdpblk tracks: 256 TiB in LMCache's smallest (1 MiB) slots. The slot table
/// takes memory per slot, so a capacity from a garbage value must not size it.
pub const MAX_SLOTS: u64 = 1 << 28;

impl fmt::Display for GeometryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::BlockAlignNotPowerOfTwo(a) => write!(
                f,
                "block_align {a} is not a power of two; set --block-align to LMCache's block_align (default 4096)"
            ),
            Self::BlockAlignTooLarge(a) => write!(
                f,
                "block_align {a} is above the {MAX_BLOCK_ALIGN} bytes fdpblk supports; set LMCache's block_align (and --block-align) to the drive's block size, e.g. 4096"
            ),
            Self::HeaderBytes(h, a) => write!(
                f,
                "header_bytes {h} must be >= 24 and a multiple of block_align {a}; set --header-bytes to LMCache's header_bytes (default 4096)"
            ),
            Self::SlotBytes { slot_bytes, header_bytes, block_align } => write!(
                f,
                "slot_bytes {slot_bytes} must be > header_bytes {header_bytes} and a multiple of block_align {block_align}; set --slot-bytes to LMCache's slot_bytes"
            ),
            Self::MetaTotalBytes(m, a) => write!(
                f,
                "meta_total_bytes {m} must be > block_align {a} and a multiple of it; set --meta-total-bytes to LMCache's meta_total_bytes (128 MiB non-MP, 256 MiB MP)"
            ),
            Self::ContainerTooSmall { container_bytes, block_align } => write!(
                f,
                "checkpoint container of {container_bytes} bytes is not larger than block_align {block_align}; raise --meta-total-bytes"
            ),
            Self::DeviceTooSmall { meta_total_bytes, capacity, slot_bytes } => write!(
                f,
                "capacity {capacity} bytes holds no slot of {slot_bytes} bytes after the {meta_total_bytes}-byte metadata region; use a larger device or a smaller --meta-total-bytes/--slot-bytes"
            ),
            Self::CapacityTooSmall { meta_total_bytes, capacity_bytes, slot_bytes } => write!(
                f,
                "capacity_bytes {capacity_bytes} holds no slot of {slot_bytes} bytes after the {meta_total_bytes}-byte metadata region; raise --capacity-bytes (LMCache's capacity_bytes) above {}, or leave it 0 for the whole device",
                meta_total_bytes.saturating_add(slot_bytes).saturating_sub(1)
            ),
            Self::TooManySlots { max_slots, capacity, slot_bytes } => write!(
                f,
                "capacity {capacity} bytes makes {max_slots} slots of {slot_bytes} bytes, more than the {MAX_SLOTS} fdpblk tracks; check --slot-bytes and the capacity (--capacity-bytes, or replay's --device-size)"
            ),
        }
    }
}

impl std::error::Error for GeometryError {}

impl GeometryConfig {
    /// Validates against LMCache's init rules for a device of `device_size` bytes.
    pub fn validate(&self, device_size: u64) -> Result<Geometry, GeometryError> {
        let a = self.block_align;
        if a == 0 || !a.is_power_of_two() {
            return Err(GeometryError::BlockAlignNotPowerOfTwo(a));
        }
        if a > MAX_BLOCK_ALIGN {
            return Err(GeometryError::BlockAlignTooLarge(a));
        }
        if self.header_bytes < 24 || !self.header_bytes.is_multiple_of(a) {
            return Err(GeometryError::HeaderBytes(self.header_bytes, a));
        }
        if self.slot_bytes <= self.header_bytes || !self.slot_bytes.is_multiple_of(a) {
            return Err(GeometryError::SlotBytes {
                slot_bytes: self.slot_bytes,
                header_bytes: self.header_bytes,
                block_align: a,
            });
        }
        if self.meta_total_bytes <= a || !self.meta_total_bytes.is_multiple_of(a) {
            return Err(GeometryError::MetaTotalBytes(self.meta_total_bytes, a));
        }
        let container_bytes = (self.meta_total_bytes / 2) / a * a;
        if container_bytes <= a {
            return Err(GeometryError::ContainerTooSmall { container_bytes, block_align: a });
        }
        let capacity = if self.capacity_bytes > 0 {
            self.capacity_bytes.min(device_size)
        } else {
            device_size
        };
        // The cap is to blame only where the whole device would hold a slot.
        let too_small = if capacity < device_size && device_size.saturating_sub(self.meta_total_bytes) >= self.slot_bytes && self.meta_total_bytes < device_size {
            GeometryError::CapacityTooSmall { meta_total_bytes: self.meta_total_bytes, capacity_bytes: capacity, slot_bytes: self.slot_bytes }
        } else {
            GeometryError::DeviceTooSmall { meta_total_bytes: self.meta_total_bytes, capacity, slot_bytes: self.slot_bytes }
        };
        if self.meta_total_bytes >= capacity {
            return Err(too_small);
        }
        let max_slots = (capacity - self.meta_total_bytes) / self.slot_bytes;
        if max_slots == 0 {
            return Err(too_small);
        }
        if max_slots > MAX_SLOTS {
            return Err(GeometryError::TooManySlots { max_slots, capacity, slot_bytes: self.slot_bytes });
        }
        Ok(Geometry {
            block_align: a,
            header_bytes: self.header_bytes,
            slot_bytes: self.slot_bytes,
            meta_total_bytes: self.meta_total_bytes,
            capacity_bytes: capacity,
            container_bytes,
            max_slots,
        })
    }
}

impl Geometry {
    /// Byte offset of checkpoint container `copy` (0 or 1).
    pub fn container_offset(&self, copy: u8) -> u64 {
        u64::from(copy) * self.container_bytes
    }
    /// Largest JSON payload a checkpoint may have before LMCache skips it.
    pub fn payload_cap(&self) -> u64 {
        self.container_bytes - self.block_align
    }
    pub fn data_base_offset(&self) -> u64 {
        self.meta_total_bytes
    }
    /// End of the last whole slot; bytes past it are never written by LMCache.
    pub fn data_end_offset(&self) -> u64 {
        self.meta_total_bytes + self.max_slots * self.slot_bytes
    }
    /// Where a payload of `payload_len` bytes ends within its slot, rounded up to
    /// `block_align` (what LMCache's O_DIRECT writes and loads cover); saturating.
    pub fn payload_end(&self, payload_len: u64) -> u64 {
        self.header_bytes.saturating_add(payload_len.div_ceil(self.block_align.max(1)).saturating_mul(self.block_align))
    }
    pub fn slot_payload_capacity(&self) -> u64 {
        self.slot_bytes - self.header_bytes
    }
    pub fn slot_offset(&self, slot: u64) -> u64 {
        self.meta_total_bytes + slot * self.slot_bytes
    }
    /// The slot holding byte `offset` and the offset within it, if `offset` is in slot space.
    pub fn slot_of(&self, offset: u64) -> Option<(u64, u64)> {
        if offset < self.meta_total_bytes || offset >= self.data_end_offset() {
            return None;
        }
        let rel = offset - self.meta_total_bytes;
        Some((rel / self.slot_bytes, rel % self.slot_bytes))
    }
    /// Which container copy an entry written with sequence number `seq` goes to.
    pub fn copy_for_seq(seq: u64) -> u8 {
        (seq.wrapping_sub(1) % 2) as u8
    }
    pub fn config(&self) -> GeometryConfig {
        GeometryConfig {
            block_align: self.block_align,
            header_bytes: self.header_bytes,
            slot_bytes: self.slot_bytes,
            meta_total_bytes: self.meta_total_bytes,
            capacity_bytes: self.capacity_bytes,
        }
    }
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "block_align": self.block_align,
            "header_bytes": self.header_bytes,
            "slot_bytes": self.slot_bytes,
            "meta_total_bytes": self.meta_total_bytes,
            "data_base_offset": self.data_base_offset(),
            "max_slots": self.max_slots,
            "capacity_bytes": self.capacity_bytes,
            "container_bytes": self.container_bytes,
            "payload_cap": self.payload_cap(),
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_block_align_past_a_mebibyte_is_refused_with_the_fix() {
        let c = |a: u64| super::GeometryConfig { block_align: a, header_bytes: a, slot_bytes: 4 * a, meta_total_bytes: 4 * a, capacity_bytes: 0 };
        assert!(c(1 << 20).validate(64 << 20).is_ok());
        let e = c(2 << 20).validate(64 << 20).unwrap_err();
        assert!(matches!(e, super::GeometryError::BlockAlignTooLarge(2097152)), "{e}");
        assert!(e.to_string().contains("e.g. 4096"), "{e}");
    }

    use super::*;

    fn cfg(a: u64, h: u64, s: u64, m: u64, c: u64) -> GeometryConfig {
        GeometryConfig { block_align: a, header_bytes: h, slot_bytes: s, meta_total_bytes: m, capacity_bytes: c }
    }

    #[test]
    fn fixture_geometry_derivations() {
        // object-evict: 4 MiB, 64 KiB slots, 1 MiB metadata -> 48 slots.
        let g = cfg(4096, 4096, 65536, 1 << 20, 4 << 20).validate(4 << 20).unwrap();
        assert_eq!(g.container_bytes, 524288);
        assert_eq!(g.container_offset(1), 524288);
        assert_eq!(g.payload_cap(), 520192);
        assert_eq!(g.max_slots, 48);
        assert_eq!(g.slot_payload_capacity(), 61440);
        assert_eq!(g.slot_of(1048576), Some((0, 0)));
        assert_eq!(g.slot_of(1048576 + 65536 * 3 + 5), Some((3, 5)));
        assert_eq!(g.slot_of(4 << 20), None);
        assert_eq!(g.slot_of(1048575), None);
        // object-multitenant: header 8192, slot 196608, whole 4.5 MiB file -> 18 slots.
        let g = cfg(4096, 8192, 196608, 1 << 20, 0).validate(4718592).unwrap();
        assert_eq!(g.max_slots, 18);
        assert_eq!(g.data_end_offset(), (1 << 20) + 18 * 196608);
    }

    #[test]
    fn slot_count_is_bounded() {
        let one_mib = cfg(4096, 4096, 1 << 20, 1 << 20, 0);
        assert_eq!(one_mib.validate((1 << 20) + (MAX_SLOTS << 20)).unwrap().max_slots, MAX_SLOTS);
        let e = one_mib.validate((1 << 20) + ((MAX_SLOTS + 1) << 20)).unwrap_err();
        assert!(matches!(e, GeometryError::TooManySlots { max_slots, .. } if max_slots == MAX_SLOTS + 1), "{e}");
        assert!(e.to_string().contains("--device-size"), "{e}");
    }

    #[test]
    fn defaults_match_lmcache_table() {
        let g = cfg(4096, 4096, 33558528, DEFAULT_META_TOTAL_BYTES_NON_MP, 0).validate(1 << 40).unwrap();
        assert_eq!(g.payload_cap(), 67_104_768);
        let g = cfg(4096, 4096, 33558528, DEFAULT_META_TOTAL_BYTES_MP, 0).validate(1 << 40).unwrap();
        assert_eq!(g.payload_cap(), 134_213_632);
        // A non-aligned half: container rounds down, the gap is never written.
        let g = cfg(4096, 4096, 8192, 5 * 4096, 0).validate(1 << 20).unwrap();
        assert_eq!(g.container_bytes, 2 * 4096);
        assert_eq!(g.data_base_offset(), 5 * 4096);
    }

    #[test]
    fn rejects_what_lmcache_rejects() {
        use GeometryError::*;
        assert!(matches!(cfg(3000, 4096, 8192, 1 << 20, 0).validate(1 << 30), Err(BlockAlignNotPowerOfTwo(_))));
        assert!(matches!(cfg(0, 4096, 8192, 1 << 20, 0).validate(1 << 30), Err(BlockAlignNotPowerOfTwo(_))));
        assert!(matches!(cfg(16, 16, 64, 1 << 20, 0).validate(1 << 30), Err(HeaderBytes(..))));
        assert!(matches!(cfg(4096, 6000, 8192, 1 << 20, 0).validate(1 << 30), Err(HeaderBytes(..))));
        assert!(matches!(cfg(4096, 4096, 4096, 1 << 20, 0).validate(1 << 30), Err(SlotBytes { .. })));
        assert!(matches!(cfg(4096, 4096, 10000, 1 << 20, 0).validate(1 << 30), Err(SlotBytes { .. })));
        // Values from a hostile checkpoint: refused, never an overflow.
        assert!(matches!(cfg(1, u64::MAX, 4096, 1 << 20, 0).validate(1 << 30), Err(SlotBytes { .. })));
        assert!(matches!(cfg(4096, 4096, 8192, 4096, 0).validate(1 << 30), Err(MetaTotalBytes(..))));
        assert!(matches!(cfg(4096, 4096, 8192, 2 * 4096, 0).validate(1 << 30), Err(ContainerTooSmall { .. })));
        assert!(matches!(cfg(4096, 4096, 8192, 1 << 20, 0).validate(1 << 20), Err(DeviceTooSmall { .. })));
        assert!(matches!(cfg(4096, 4096, 8192, 1 << 20, 0).validate((1 << 20) + 4096), Err(DeviceTooSmall { .. })));
        // capacity_bytes caps the device but never extends it.
        let g = cfg(4096, 4096, 8192, 1 << 20, 2 << 20).validate(1 << 30).unwrap();
        assert_eq!(g.capacity_bytes, 2 << 20);
        let g = cfg(4096, 4096, 8192, 1 << 20, 1 << 40).validate(2 << 20).unwrap();
        assert_eq!(g.capacity_bytes, 2 << 20);
    }

    #[test]
    fn errors_name_the_fix() {
        let e = cfg(4096, 4096, 10000, 1 << 20, 0).validate(1 << 30).unwrap_err();
        assert!(e.to_string().contains("--slot-bytes"));
        // A capacity_bytes below one slot past the metadata: that flag is named.
        let e = cfg(4096, 4096, 8192, 1 << 20, (1 << 20) + 4096).validate(1 << 30).unwrap_err();
        assert!(matches!(e, GeometryError::CapacityTooSmall { capacity_bytes: 1052672, .. }), "{e}");
        assert!(e.to_string().contains("raise --capacity-bytes") && e.to_string().contains("above 1056767"), "{e}");
        // Where the device itself is too small, the device is.
        let e = cfg(4096, 4096, 8192, 1 << 20, (1 << 20) + 4096).validate((1 << 20) + 4096).unwrap_err();
        assert!(matches!(e, GeometryError::DeviceTooSmall { .. }), "{e}");
    }
}
