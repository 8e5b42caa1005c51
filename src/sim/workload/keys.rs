//! LMCache's key strings and their identities, as the model makes them for each chunk.

use super::*;

/// A document's hash (its system prompt and length derive from it).
pub(super) fn doc_hash(tenant_seed: u64, doc: u64) -> u64 {
    mix64(tenant_seed ^ mix64(doc.wrapping_add(0x5151)))
}

/// `urllib.parse.quote(s, safe="")`.
pub(super) fn quote(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"_.-~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The encoded key string LMCache indexes for the model's key number `id` of a tenant whose
/// salt is `salt` (`object_key_to_string` in MP mode, `CacheEngineKey.to_string()` in non-MP),
/// written into `out`.
pub fn key_string(mode: Mode, quoted_model: &str, hash_bytes: u32, salt: &str, id: u64, out: &mut String) {
    use std::fmt::Write as _;
    out.clear();
    match mode {
        Mode::Mp => {
            let _ = write!(out, "{quoted_model}@0x01000100@0@");
            let mut i = 0u64;
            let mut left = hash_bytes as usize * 2;
            while left > 0 {
                let w = format!("{:016x}", mix64(id ^ i.wrapping_mul(0xa076_1d64_78bd_642f)));
                out.push_str(&w[..left.min(16)]);
                left -= left.min(16);
                i += 1;
            }
            if !salt.is_empty() {
                out.push('@');
                out.push_str(salt);
            }
        }
        // The model name is not escaped in legacy keys; the chunk hash is its low 64 bits.
        Mode::NonMp => {
            let _ = write!(out, "{}@1@0@{id:x}@bfloat16", percent_decode_model(quoted_model));
        }
    }
}

fn percent_decode_model(q: &str) -> String {
    crate::layout::keys::percent_decode(q)
}

/// The slot identity LMCache writes for the key (`slot_identity` in `key_codec.py`).
pub fn key_identity(mode: Mode, key: &str, id: u64) -> u64 {
    match mode {
        Mode::Mp => crate::layout::keys::object_identity(key),
        Mode::NonMp => id,
    }
}

/// A strong 64-bit mix (the SplitMix64 finaliser) for deterministic identities.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(super) fn ident(parts: &[u64]) -> u64 {
    let mut h = 0x6a09_e667_f3bc_c908u64;
    for &p in parts {
        h = mix64(h ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
    h
}
