//! Slot and checkpoint headers, key strings and the classifier on arbitrary bytes.
#![no_main]
use fdpblk::classify::{classify, Op};
use fdpblk::layout::checkpoint_header::CheckpointHeader;
use fdpblk::layout::slot_header::SlotHeader;
use fdpblk::layout::{keys, GeometryConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = SlotHeader::parse(data);
    if let Ok(h) = CheckpointHeader::parse(data, u64::MAX) {
        let _ = h.crc_matches(data.get(32..).unwrap_or(&[]));
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = keys::identity(s);
        if let Ok(k) = keys::Key::parse(s) {
            let _ = k.model_name();
        }
    }
    // Geometry and a request from the first bytes, data from the rest.
    if data.len() >= 24 {
        let w = |i: usize| u32::from_le_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]) as u64;
        let cfg = GeometryConfig {
            block_align: 1 << (9 + w(0) % 4),
            header_bytes: 4096 * (1 + w(4) % 2),
            slot_bytes: 4096 * (3 + w(8) % 64),
            meta_total_bytes: 4096 * (3 + w(12) % 64),
            capacity_bytes: 0,
        };
        if let Ok(g) = cfg.validate(1 << 30) {
            let mut out = Vec::new();
            let off = w(16) * 512 % (1 << 30);
            let len = (w(20) % (1 << 22)).min((1 << 30) - off);
            classify(&g, Op::Write, off, len, Some(&data[24..]), &(), &mut out);
            assert_eq!(out.iter().map(|e| e.len).sum::<u64>(), len);
        }
    }
});
