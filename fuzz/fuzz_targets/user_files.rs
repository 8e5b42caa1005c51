//! What an operator hands fdpblk as a file, on arbitrary bytes: `replay`'s traces (JSON lines
//! and blkparse's text, then replayed on a small device), `simulate`'s workload files,
//! `plot`'s tables and `/etc/fdpblk/NAME.toml`. The first byte picks the reader and its
//! options; none may panic or allocate past what the input asks for.
#![no_main]
use fdpblk::blkparse::BlkAction;
use fdpblk::cmd::config_file::ConfigFile;
use fdpblk::cmd::plot::parse_table;
use fdpblk::cmd::replay::{read_trace_from, replay, BlkFilter, TraceFormat};
use fdpblk::layout::GeometryConfig;
use fdpblk::sim::workload::WorkloadSpec;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let text = std::str::from_utf8(rest);
    match pick % 4 {
        0 => {
            let format = [TraceFormat::Auto, TraceFormat::Json, TraceFormat::Blkparse][usize::from(pick / 4) % 3];
            let event = [BlkAction::Queue, BlkAction::Issue, BlkAction::Complete][usize::from(pick / 12) % 3];
            // With the top bit, a partition of 48 MiB at that offset (`--device-size`).
            let blk = BlkFilter { event, device: None, sector_offset: u64::from(pick / 36), partition_bytes: (pick & 0x80 != 0).then_some(48 << 20) };
            if let Ok((trace, _)) = read_trace_from(rest, format, blk) {
                let size = 64 << 20;
                let g = GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 1 << 20, meta_total_bytes: 8 << 20, capacity_bytes: 0 }
                    .validate(size)
                    .expect("a valid geometry");
                let _ = replay(g, "key-aware", size, trace);
            }
        }
        1 => {
            if let Ok(t) = text {
                let _ = WorkloadSpec::from_json_str(t);
            }
        }
        2 => {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) {
                let _ = parse_table(&v);
            }
        }
        _ => {
            if let Ok(t) = text {
                let _ = ConfigFile::parse(Path::new("fuzz.toml"), t);
            }
        }
    }
});
