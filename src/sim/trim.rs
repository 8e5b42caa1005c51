//! The stale-tail rule, proposed for fdpblk's state thread and measured by the simulator.
//!
//! When a slot header with a shorter payload than the slot's previous one is written, the
//! rest of the old payload can be deallocated at once: LMCache never reads past a header's
//! `payload_len` (loads read `payload_len` rounded up to `block_align`; recovery reads only
//! headers), so those bytes are garbage the drive would otherwise keep valid, and copy in GC,
//! until a longer payload overwrites them. LMCache's last chunk of a prompt is partial, so a
//! third of the puts of the shipped workloads leave such a tail (`docs/waf.md`).
//!
//! In the simulator the deallocation follows the header write at once; in fdpblk it would go
//! through the state thread's trim handshake (`crate::watch`), which already orders a
//! deallocation against later writes to the same slot.
//!
//! Evicted slots are deallocated by fdpblk's real state thread (issue #6's rule,
//! [`crate::watch::Watcher`]), which the simulator runs as is.

use crate::layout::slot_header::SlotHeader;
use crate::layout::Geometry;
use crate::slot_table::SlotEntry;

/// The stale tail a new header leaves in its slot, relative to the slot's start: from the end
/// of its payload (rounded up to `block_align`) to the end of the previous payload, or to the
/// slot's end when the previous occupant is unknown. None when nothing is left behind.
pub fn stale_tail(previous: Option<&SlotEntry>, header: &SlotHeader, g: &Geometry) -> Option<(u64, u64)> {
    let round = |n: u64| n.div_ceil(g.block_align) * g.block_align;
    let new_end = g.header_bytes + round(header.payload_len).min(g.slot_payload_capacity());
    let old_end = match previous {
        Some(p) => g.header_bytes + round(p.payload_len).min(g.slot_payload_capacity()),
        None => g.slot_bytes,
    };
    (old_end > new_end).then(|| (new_end, old_end - new_end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_tails() {
        use crate::layout::GeometryConfig;
        let g = GeometryConfig {
            block_align: 4096,
            header_bytes: 4096,
            slot_bytes: 65536,
            meta_total_bytes: 1 << 20,
            capacity_bytes: 0,
        }
        .validate(4 << 20)
        .unwrap();
        let h = |n| SlotHeader { identity: 1, payload_len: n };
        let prev = |n| SlotEntry { identity: 2, payload_len: n, generation: 1, ..Default::default() };
        // Unknown previous occupant: everything past the new payload (rounded to 4 KiB).
        assert_eq!(stale_tail(None, &h(5000), &g), Some((4096 + 8192, 65536 - 4096 - 8192)));
        // A longer previous payload: up to its end only.
        assert_eq!(stale_tail(Some(&prev(61440)), &h(100), &g), Some((8192, 61440 - 4096)));
        // Shorter or equal after rounding: nothing.
        assert_eq!(stale_tail(Some(&prev(4000)), &h(100), &g), None);
        assert_eq!(stale_tail(Some(&prev(100)), &h(61440), &g), None);
        assert_eq!(stale_tail(None, &h(61440), &g), None);
    }
}
