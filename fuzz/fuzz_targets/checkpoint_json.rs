//! The streaming checkpoint JSON parser on arbitrary bytes: errors, never panics or hangs.
#![no_main]
use fdpblk::layout::checkpoint_json::{parse_checkpoint_slice, JsonLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = JsonLimits { max_depth: 32, max_string_bytes: 4096, max_payload_bytes: 1 << 20 };
    let mut n = 0u64;
    let _ = parse_checkpoint_slice(data, &limits, &mut |e| {
        n += e.key.len() as u64 + e.offset.unwrap_or(0) % 7 + e.size.unwrap_or(0) % 5;
        Ok(())
    });
});
