//! Test helpers shared by the unit tests: the LMCache fixtures beside the repository, a
//! small standard geometry and a scratch directory.

use crate::layout::{Geometry, GeometryConfig};
use std::path::PathBuf;

/// A directory of its own for a test (`tag`) in this test process.
pub fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fdpblk-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The LMCache 0.5.6 fixtures (real images, manifests and I/O captures).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6")
}

/// A scenario's device image and manifest.
pub fn fixture(scenario: &str) -> (Vec<u8>, serde_json::Value) {
    let dir = fixtures_dir().join(scenario);
    let img = std::fs::read(dir.join("device.img")).unwrap();
    let m = serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    (img, m)
}

/// The seq and JSON of the checkpoint container at byte `at` of an image (block_align 4096).
pub fn copy_json(img: &[u8], at: usize) -> (u64, String) {
    let h = crate::layout::checkpoint_header::CheckpointHeader::parse(&img[at..at + 32], img.len() as u64).unwrap();
    (h.seq, String::from_utf8(img[at + 4096..at + 4096 + h.payload_len as usize].to_vec()).unwrap())
}

/// Writes `json` as checkpoint `seq` into the container at byte `at` (block_align 4096): a
/// header whose length and CRC match it, then the JSON.
pub fn put_copy(img: &mut [u8], at: usize, seq: u64, json: &str) {
    img[at..at + 4096].copy_from_slice(&crate::layout::checkpoint_header::CheckpointHeader::encode_for(seq, json.as_bytes(), 4096));
    img[at + 4096..at + 4096 + json.len()].copy_from_slice(json.as_bytes());
}

/// The fixtures' geometry on a 4 MiB device: 1 MiB metadata, 64 KiB slots (48 of them).
pub fn small_geometry() -> Geometry {
    GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
        .validate(4 << 20)
        .unwrap()
}

/// The JSON field names of `value` (one level down too, and in an array's first element)
/// that README's `fdpblk stats --json` paragraph does not name, as `key` or `key.inner`.
pub fn stats_fields_missing_from_readme(value: &serde_json::Value) -> Vec<String> {
    let readme = include_str!("../README.md");
    let start = readme.find("`fdpblk stats --json` fields:").expect("README's stats --json paragraph");
    let end = start + readme[start..].find("\n\n").expect("the paragraph ends");
    let listed: String = readme[start..end].split_whitespace().collect();
    let named = |k: &str| listed.contains(&format!("`{k}")) || listed.contains(&format!("{k},")) || listed.contains(&format!("{k}}}"));
    let mut missing = Vec::new();
    for (key, val) in value.as_object().expect("an object") {
        // A top-level field as itself, not as some object's inner field of that name.
        if !listed.contains(&format!("`{key}")) {
            missing.push(key.clone());
        }
        let inner = match val {
            serde_json::Value::Array(a) => a.first(),
            o => Some(o),
        };
        for k in inner.and_then(|o| o.as_object()).into_iter().flat_map(|o| o.keys()) {
            if !named(k) {
                missing.push(format!("{key}.{k}"));
            }
        }
    }
    missing
}

/// xorshift64: the seeded generator of the tests that mutate inputs (a fixed seed, the same
/// draws on every run).
pub struct XorShift(pub u64);

impl XorShift {
    pub fn draw(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.draw() % n.max(1)
    }
}
