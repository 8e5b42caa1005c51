//! Geometry discovery and checkpoint reading on an arbitrary small device image.
#![no_main]
use fdpblk::layout::checkpoint::{newest_valid, read_copies, read_entries};
use fdpblk::layout::checkpoint_json::JsonLimits;
use fdpblk::layout::discover::{discover, GeometryFlags};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let img = data.to_vec();
    let flags = GeometryFlags { block_align: Some(512), header_bytes: Some(512), slot_bytes: Some(1024), meta_total_bytes: Some(2048), capacity_bytes: None };
    for f in [GeometryFlags::default(), flags] {
        if let Ok(d) = discover(&img, &f) {
            if let Ok(copies) = read_copies(&img, &d.geometry) {
                if let Some(c) = newest_valid(&copies) {
                    let _ = read_entries(&img, &d.geometry, c, &JsonLimits::default(), &mut |_| Ok(()));
                }
            }
        }
    }
});
