//! The I/O classifier: one request (op, byte range, and for writes the bytes or a prefix of
//! them) becomes extents tagged with what they are in LMCache's layout.
//!
//! Classification is by position, never by request boundaries: buffered writeback merges and
//! reorders, O_DIRECT requests are split at the queue's max size, and a slot header can arrive
//! merged with its payload. Work is O(1) per extent: no scans of slots or keys.

use crate::layout::checkpoint_header::{CheckpointHeader, META_MAGIC};
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::layout::Geometry;

/// A block request as a frontend (ublk, a trace) sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write_zeroes",
        }
    }
    pub fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "read" => Op::Read,
            "write" => Op::Write,
            "flush" => Op::Flush,
            "discard" => Op::Discard,
            "write_zeroes" => Op::WriteZeroes,
            _ => return None,
        })
    }
}

/// The class of an extent, for counters and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    CheckpointHeader,
    CheckpointPayload,
    SlotHeader,
    SlotPayload,
    SlotPadding,
    Outside,
}

impl Class {
    pub const ALL: [Class; 6] = [
        Class::CheckpointHeader,
        Class::CheckpointPayload,
        Class::SlotHeader,
        Class::SlotPayload,
        Class::SlotPadding,
        Class::Outside,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Class::CheckpointHeader => "checkpoint_header",
            Class::CheckpointPayload => "checkpoint_payload",
            Class::SlotHeader => "slot_header",
            Class::SlotPayload => "slot_payload",
            Class::SlotPadding => "slot_padding",
            Class::Outside => "outside",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Contents parsed from the bytes of a header position, when the request carried them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parsed<T> {
    /// No bytes (a read, a discard) or not the header's first bytes.
    Absent,
    Valid(T),
    /// Bytes were there but are not a header (zeros, foreign data).
    Invalid,
}

impl<T> Parsed<T> {
    pub fn valid(&self) -> Option<&T> {
        match self {
            Parsed::Valid(t) => Some(t),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtentKind {
    CheckpointHeader { copy: u8, header: Parsed<CheckpointHeader> },
    CheckpointPayload { copy: u8 },
    SlotHeader { slot: u64, header: Parsed<SlotHeader> },
    SlotPayload { slot: u64 },
    /// Bytes of a slot past its known payload_len (O_DIRECT zero padding, or stale tails).
    SlotPadding { slot: u64 },
    Outside,
}

impl ExtentKind {
    pub fn class(&self) -> Class {
        match self {
            ExtentKind::CheckpointHeader { .. } => Class::CheckpointHeader,
            ExtentKind::CheckpointPayload { .. } => Class::CheckpointPayload,
            ExtentKind::SlotHeader { .. } => Class::SlotHeader,
            ExtentKind::SlotPayload { .. } => Class::SlotPayload,
            ExtentKind::SlotPadding { .. } => Class::SlotPadding,
            ExtentKind::Outside => Class::Outside,
        }
    }
    pub fn slot(&self) -> Option<u64> {
        match *self {
            ExtentKind::SlotHeader { slot, .. }
            | ExtentKind::SlotPayload { slot }
            | ExtentKind::SlotPadding { slot } => Some(slot),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub kind: ExtentKind,
}

/// What the classifier may know about a slot from earlier requests (the slot table).
pub trait PayloadLens {
    /// The payload length of the slot's current header, if known.
    fn payload_len(&self, slot: u64) -> Option<u64>;
}

/// No memory of earlier requests.
impl PayloadLens for () {
    fn payload_len(&self, _slot: u64) -> Option<u64> {
        None
    }
}

/// Splits `[offset, offset+len)` into extents, appended to `out` in order; they tile the
/// request exactly. `data`, when given, holds the request's first bytes (all of them, or a
/// prefix, as in a trace). Flushes have no range and produce nothing.
pub fn classify(
    geom: &Geometry,
    op: Op,
    offset: u64,
    len: u64,
    data: Option<&[u8]>,
    lens: &dyn PayloadLens,
    out: &mut Vec<Extent>,
) {
    if op == Op::Flush || len == 0 {
        return;
    }
    let data = if op == Op::Write { data } else { None };
    let bytes_at = |pos: u64, n: usize| -> Option<&[u8]> {
        let d = data?;
        let start = usize::try_from(pos - offset).ok()?;
        d.get(start..start.checked_add(n)?)
    };
    let end = offset.saturating_add(len);
    let meta_end = 2 * geom.container_bytes;
    let data_end = geom.data_end_offset();
    // A header parsed in this request tells where its own payload ends (merged writes).
    let mut local_len: Option<(u64, u64)> = None;
    let mut pos = offset;
    while pos < end {
        let (stop, kind) = if pos < meta_end {
            let copy = (pos / geom.container_bytes) as u8;
            let base = geom.container_offset(copy);
            if pos < base + geom.block_align {
                let header = if pos == base {
                    match bytes_at(pos, 32) {
                        None => Parsed::Absent,
                        Some(b) => match CheckpointHeader::decode(b) {
                            Ok(h) if &h.magic == META_MAGIC => Parsed::Valid(h),
                            _ => Parsed::Invalid,
                        },
                    }
                } else {
                    Parsed::Absent
                };
                (base + geom.block_align, ExtentKind::CheckpointHeader { copy, header })
            } else {
                (base + geom.container_bytes, ExtentKind::CheckpointPayload { copy })
            }
        } else if pos < geom.meta_total_bytes {
            (geom.meta_total_bytes, ExtentKind::Outside)
        } else if pos < data_end {
            let rel = pos - geom.meta_total_bytes;
            let slot = rel / geom.slot_bytes;
            let start = geom.meta_total_bytes + slot * geom.slot_bytes;
            let in_slot = rel % geom.slot_bytes;
            if in_slot < geom.header_bytes {
                let header = if in_slot == 0 {
                    match bytes_at(pos, SLOT_HEADER_PREFIX) {
                        None => Parsed::Absent,
                        Some(b) => match SlotHeader::parse(b) {
                            Ok(h) => {
                                local_len = Some((slot, h.payload_len));
                                Parsed::Valid(h)
                            }
                            Err(_) => Parsed::Invalid,
                        },
                    }
                } else {
                    Parsed::Absent
                };
                (start + geom.header_bytes, ExtentKind::SlotHeader { slot, header })
            } else {
                let known = match local_len {
                    Some((s, l)) if s == slot => Some(l),
                    _ => lens.payload_len(slot),
                };
                let slot_end = start + geom.slot_bytes;
                match known {
                    Some(l) => {
                        let payload_end = start + geom.header_bytes + l.min(geom.slot_payload_capacity());
                        if pos < payload_end {
                            (payload_end, ExtentKind::SlotPayload { slot })
                        } else {
                            (slot_end, ExtentKind::SlotPadding { slot })
                        }
                    }
                    None => (slot_end, ExtentKind::SlotPayload { slot }),
                }
            }
        } else {
            (u64::MAX, ExtentKind::Outside)
        };
        let stop = stop.min(end);
        out.push(Extent { offset: pos, len: stop - pos, kind });
        pos = stop;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::GeometryConfig;
    use proptest::prelude::*;

    use crate::test_fixtures::small_geometry as geom;

    fn run(g: &Geometry, op: Op, off: u64, len: u64, data: Option<&[u8]>) -> Vec<Extent> {
        let mut v = Vec::new();
        classify(g, op, off, len, data, &(), &mut v);
        v
    }

    #[test]
    fn header_merged_with_payload_and_padding() {
        let g = geom();
        let slot_off = g.slot_offset(2);
        let hdr = SlotHeader { identity: 42, payload_len: 8181 }.encode(4096);
        // A merged header + 12 KiB write: header, 8181 payload bytes, the rest is padding.
        let ext = run(&g, Op::Write, slot_off, 4096 + 12288, Some(&hdr));
        assert_eq!(ext.len(), 3);
        assert_eq!(ext[0].kind, ExtentKind::SlotHeader { slot: 2, header: Parsed::Valid(SlotHeader { identity: 42, payload_len: 8181 }) });
        assert_eq!((ext[1].offset, ext[1].len, ext[1].kind), (slot_off + 4096, 8181, ExtentKind::SlotPayload { slot: 2 }));
        assert_eq!(ext[2].kind, ExtentKind::SlotPadding { slot: 2 });
        assert_eq!(ext[2].len, 12288 - 8181);
    }

    #[test]
    fn partial_header_and_reads_carry_no_identity() {
        let g = geom();
        let ext = run(&g, Op::Write, g.slot_offset(0) + 512, 512, Some(&[0u8; 512]));
        assert_eq!(ext[0].kind, ExtentKind::SlotHeader { slot: 0, header: Parsed::Absent });
        let ext = run(&g, Op::Read, g.slot_offset(0), 4096, None);
        assert_eq!(ext[0].kind, ExtentKind::SlotHeader { slot: 0, header: Parsed::Absent });
        let ext = run(&g, Op::Write, g.slot_offset(0), 4096, Some(&[0u8; 4096]));
        assert_eq!(ext[0].kind, ExtentKind::SlotHeader { slot: 0, header: Parsed::Invalid });
        assert!(run(&g, Op::Flush, 0, 0, None).is_empty());
    }

    #[test]
    fn spans_containers_gap_slots_and_tail() {
        let g = GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 8192, meta_total_bytes: 5 * 4096, capacity_bytes: 0 }
            .validate(5 * 4096 + 2 * 8192 + 4096)
            .unwrap();
        assert_eq!(g.container_bytes, 8192);
        let total = 5 * 4096 + 2 * 8192 + 4096;
        let ext = run(&g, Op::Discard, 0, total, None);
        let kinds: Vec<Class> = ext.iter().map(|e| e.kind.class()).collect();
        use Class::*;
        assert_eq!(kinds, vec![CheckpointHeader, CheckpointPayload, CheckpointHeader, CheckpointPayload, Outside, SlotHeader, SlotPayload, SlotHeader, SlotPayload, Outside]);
    }

    #[test]
    fn checkpoint_header_is_parsed() {
        let g = geom();
        let b = crate::layout::checkpoint_header::CheckpointHeader::encode_for(3, b"{}", 4096);
        let ext = run(&g, Op::Write, g.container_offset(0), 4096, Some(&b));
        match ext[0].kind {
            ExtentKind::CheckpointHeader { copy: 0, header: Parsed::Valid(h) } => assert_eq!((h.seq, h.payload_len), (3, 2)),
            k => panic!("{k:?}"),
        }
        let ext = run(&g, Op::Write, g.container_offset(1) + 4096, 8192, None);
        assert_eq!(ext[0].kind, ExtentKind::CheckpointPayload { copy: 1 });
    }

    /// Byte-by-byte reference: the class of each byte from first principles.
    fn slow_class(g: &Geometry, pos: u64, lens: Option<(u64, u64)>) -> (Class, Option<u64>) {
        let cb = (g.meta_total_bytes / 2) / g.block_align * g.block_align;
        if pos < 2 * cb {
            let c = pos / cb;
            return if pos - c * cb < g.block_align { (Class::CheckpointHeader, None) } else { (Class::CheckpointPayload, None) };
        }
        if pos < g.meta_total_bytes {
            return (Class::Outside, None);
        }
        let slot = (pos - g.meta_total_bytes) / g.slot_bytes;
        if slot >= g.max_slots {
            return (Class::Outside, None);
        }
        let r = (pos - g.meta_total_bytes) % g.slot_bytes;
        if r < g.header_bytes {
            return (Class::SlotHeader, Some(slot));
        }
        match lens {
            Some((s, l)) if s == slot && r - g.header_bytes >= l => (Class::SlotPadding, Some(slot)),
            _ => (Class::SlotPayload, Some(slot)),
        }
    }

    struct OneLen(u64, u64);
    impl PayloadLens for OneLen {
        fn payload_len(&self, slot: u64) -> Option<u64> {
            (slot == self.0).then_some(self.1)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn extents_tile_and_agree_with_reference(
            align_shift in 9u32..13,
            header_blocks in 1u64..3,
            slot_extra in 1u64..6,
            meta_blocks in 4u64..12,
            nslots in 1u64..6,
            tail in 0u64..3,
            start_frac in 0.0f64..1.0,
            len_frac in 0.0f64..1.0,
            hint_slot in 0u64..6,
            hint_len_frac in 0.0f64..1.2,
            op_i in 0usize..4,
        ) {
            let a = 1u64 << align_shift;
            let hb = header_blocks * a;
            let sb = hb + slot_extra * a;
            let mt = meta_blocks * a;
            let size = mt + nslots * sb + tail * a;
            let g = GeometryConfig { block_align: a, header_bytes: hb, slot_bytes: sb, meta_total_bytes: mt, capacity_bytes: 0 }
                .validate(size).unwrap();
            // 512-byte granular requests, like a block device's.
            let sectors = size / 512;
            let s = ((start_frac * sectors as f64) as u64).min(sectors - 1);
            let n = 1 + ((len_frac * (sectors - s) as f64) as u64).min(sectors - s - 1);
            let (off, len) = (s * 512, n * 512);
            let hint_len = ((hint_len_frac * (sb - hb) as f64) as u64).min(sb - hb);
            let op = [Op::Read, Op::Write, Op::Discard, Op::WriteZeroes][op_i];
            let lens = OneLen(hint_slot, hint_len);
            let mut ext = Vec::new();
            classify(&g, op, off, len, None, &lens, &mut ext);
            // Tiling: contiguous, non-empty, covering exactly the request.
            let mut pos = off;
            for e in &ext {
                prop_assert_eq!(e.offset, pos);
                prop_assert!(e.len > 0);
                pos += e.len;
            }
            prop_assert_eq!(pos, off + len);
            // Agreement with the byte-by-byte reference at every extent's edges and middle.
            for e in &ext {
                for p in [e.offset, e.offset + e.len / 2, e.offset + e.len - 1] {
                    let (c, slot) = slow_class(&g, p, Some((hint_slot, hint_len)));
                    prop_assert_eq!(e.kind.class(), c, "byte {} in {:?}", p, e);
                    prop_assert_eq!(e.kind.slot(), slot);
                }
            }
            // Extents are maximal: neighbours never share class and slot.
            for w in ext.windows(2) {
                let merged_ok = w[0].kind.class() != w[1].kind.class()
                    || w[0].kind.slot() != w[1].kind.slot()
                    || matches!(w[0].kind, ExtentKind::CheckpointHeader { .. });
                prop_assert!(merged_ok, "adjacent extents {:?} {:?}", w[0], w[1]);
            }
        }
    }
}
