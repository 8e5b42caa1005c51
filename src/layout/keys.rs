//! LMCache key strings of both namespaces and the slot identity each one maps to
//! (`key_codec.py`). The identity is what LMCache writes into slot header bytes 8..16, so a
//! block device can tie a slot to the key that a checkpoint lists for it.

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;

/// Which codec wrote a key: the non-MP plugin (`legacy`) or the MP L2 adapter (`object`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Namespace {
    Legacy,
    Object,
}

/// A legacy `CacheEngineKey` / `LayerCacheEngineKey` string, split into its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegacyKey<'a> {
    pub model_name: &'a str,
    pub world_size: u64,
    pub worker_id: u64,
    pub chunk_hash_hex: &'a str,
    pub dtype: &'a str,
    pub layer_id: Option<u64>,
    /// `tag%value` items from `lmcache.tag.*` request configs, as written.
    pub tags: Vec<&'a str>,
}

/// An MP `ObjectKey` string, split into its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectKey<'a> {
    /// Percent-encoded as in the key (`meta-llama%2FX`).
    pub model_quoted: &'a str,
    pub kv_rank: u32,
    /// None for the pre-0.5.6 shape without an object_group_id field.
    pub object_group_id: Option<u64>,
    pub chunk_hash_hex: &'a str,
    pub cache_salt: Option<&'a str>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key<'a> {
    Legacy(LegacyKey<'a>),
    Object(ObjectKey<'a>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    TooFewFields,
    BadNumber(&'static str),
    BadHash,
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooFewFields => f.write_str("key has too few '@' fields for either LMCache namespace"),
            Self::BadNumber(what) => write!(f, "key field {what} is not a number"),
            Self::BadHash => f.write_str("key chunk hash is not hexadecimal"),
        }
    }
}

impl std::error::Error for KeyError {}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_kv_rank(s: &str) -> bool {
    s.len() == 10 && s.starts_with("0x") && is_hex(&s[2..])
}

impl<'a> Key<'a> {
    /// Parses a key of either namespace; the second field tells them apart
    /// (`0x%08x` kv_rank for object keys, a decimal world size for legacy ones).
    pub fn parse(key: &'a str) -> Result<Self, KeyError> {
        let mut it = key.split('@');
        let first = it.next().ok_or(KeyError::TooFewFields)?;
        let second = it.next().ok_or(KeyError::TooFewFields)?;
        if is_kv_rank(second) {
            let kv_rank = u32::from_str_radix(&second[2..], 16).map_err(|_| KeyError::BadNumber("kv_rank"))?;
            let rest: Vec<&str> = it.collect();
            // 0.5.6: group@hash[@salt]; older: hash[@salt] (no group id).
            let (group, hash, salt) = match rest.as_slice() {
                [g, h] if is_hex(g) && is_hex(h) && h.len() >= 16 => (Some(*g), *h, None),
                [g, h, s] if is_hex(g) && is_hex(h) => (Some(*g), *h, Some(*s)),
                [h] => (None, *h, None),
                [h, s] if is_hex(h) => (None, *h, Some(*s)),
                _ => return Err(KeyError::TooFewFields),
            };
            if !is_hex(hash) {
                return Err(KeyError::BadHash);
            }
            let object_group_id = match group {
                Some(g) => Some(u64::from_str_radix(g, 16).map_err(|_| KeyError::BadNumber("object_group_id"))?),
                None => None,
            };
            return Ok(Key::Object(ObjectKey {
                model_quoted: first,
                kv_rank,
                object_group_id,
                chunk_hash_hex: hash,
                cache_salt: salt,
            }));
        }
        let world_size = second.parse().map_err(|_| KeyError::BadNumber("world_size"))?;
        let worker_id = it.next().ok_or(KeyError::TooFewFields)?.parse().map_err(|_| KeyError::BadNumber("worker_id"))?;
        let chunk_hash_hex = it.next().ok_or(KeyError::TooFewFields)?;
        let digits = chunk_hash_hex.strip_prefix('-').unwrap_or(chunk_hash_hex);
        if !is_hex(digits) {
            return Err(KeyError::BadHash);
        }
        let dtype = it.next().ok_or(KeyError::TooFewFields)?;
        let mut layer_id = None;
        let mut tags = Vec::new();
        for (i, f) in it.enumerate() {
            match f.parse::<u64>() {
                Ok(l) if i == 0 && !f.contains('%') => layer_id = Some(l),
                _ => tags.push(f),
            }
        }
        Ok(Key::Legacy(LegacyKey { model_name: first, world_size, worker_id, chunk_hash_hex, dtype, layer_id, tags }))
    }

    pub fn namespace(&self) -> Namespace {
        match self {
            Key::Legacy(_) => Namespace::Legacy,
            Key::Object(_) => Namespace::Object,
        }
    }

    /// The tenant tag LMCache's own FDP mode buckets by: the object key's cache_salt.
    pub fn cache_salt(&self) -> Option<&'a str> {
        match self {
            Key::Object(o) => o.cache_salt,
            Key::Legacy(_) => None,
        }
    }

    /// The model name as LMCache was given it (object keys are percent-decoded).
    pub fn model_name(&self) -> String {
        match self {
            Key::Legacy(l) => l.model_name.to_string(),
            Key::Object(o) => percent_decode(o.model_quoted),
        }
    }
}

/// The bucket LMCache's FDP mode (`cache_salt_prefix`, reference §14) files a cache_salt
/// under: the part before the first `:`, case-folded; `None` (no directive) for a salt without
/// `:` or with an empty prefix. Case folding is Unicode lowercasing here, which differs from
/// Python's `casefold()` only for a few letters such as `ß`.
pub fn salt_bucket(salt: &str) -> Option<String> {
    let (prefix, _) = salt.split_once(':')?;
    (!prefix.is_empty()).then(|| prefix.to_lowercase())
}

/// [`salt_bucket`] as a non-zero number (a hash of its name), 0 for no directive.
pub fn salt_bucket_id(salt: &str) -> u64 {
    salt_bucket(salt).map_or(0, |b| object_identity(&b) | 1)
}

/// The slot identity LMCache writes for `key` (`slot_identity` in `key_codec.py`).
pub fn identity(key: &str) -> Result<u64, KeyError> {
    match Key::parse(key)? {
        Key::Legacy(l) => Ok(legacy_identity(l.chunk_hash_hex)),
        Key::Object(_) => Ok(object_identity(key)),
    }
}

/// Object namespace: BLAKE2b with an 8-byte digest (output length in the parameter block,
/// not a truncated BLAKE2b-512) over the UTF-8 key, read little-endian.
pub fn object_identity(key: &str) -> u64 {
    let mut h = Blake2bVar::new(8).expect("8 is a valid BLAKE2b output size");
    h.update(key.as_bytes());
    let mut out = [0u8; 8];
    h.finalize_variable(&mut out).expect("buffer is exactly the output size");
    u64::from_le_bytes(out)
}

/// Legacy namespace: `int(chunk_hash) & (2**64 - 1)`, i.e. the low 64 bits, two's complement
/// for the `-hex` spelling of negative builtin hashes. `hex` must be validated hex.
pub fn legacy_identity(hex: &str) -> u64 {
    let (neg, digits) = match hex.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, hex),
    };
    // Only the last 16 digits matter modulo 2^64.
    let low = digits.get(digits.len().saturating_sub(16)..).unwrap_or("");
    let mag = u64::from_str_radix(low, 16).unwrap_or(0);
    if neg {
        mag.wrapping_neg()
    } else {
        mag
    }
}

/// Decodes `%XX` escapes (Python `quote(..., safe="")`); invalid escapes are kept as written.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hexd = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hexd(b[i + 1]), hexd(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::fixtures_dir as fixtures;

    #[test]
    fn legacy_identity_never_panics_on_text_it_was_not_meant_for() {
        // Multi-byte characters where the last 16 bytes start: no slice inside a character.
        assert_eq!(legacy_identity("ééééééééé"), 0);
        assert_eq!(legacy_identity("-"), 0);
    }

    #[test]
    fn reference_vector() {
        let k = "meta-llama%2FLlama-3.1-8B@0x00000000@0@00112233445566778899aabbccddeeff";
        assert_eq!(object_identity(k), 0xcdddaf2a88212cff);
        assert_eq!(identity(k), Ok(0xcdddaf2a88212cff));
        // Pre-0.5.6 object key shape: a different string, so a different identity.
        let old = "meta-llama%2FLlama-3.1-8B@0x00000000@00112233445566778899aabbccddeeff";
        assert_eq!(object_identity(old).to_le_bytes(), [0xc8, 0x74, 0xe8, 0x6a, 0x13, 0xa0, 0x54, 0x16]);
    }

    #[test]
    fn identity_vectors_file() {
        let text = std::fs::read_to_string(fixtures().join("identity_vectors.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut n = 0;
        for vec in v["object_vectors"].as_array().unwrap() {
            let key = vec["key"].as_str().unwrap();
            assert_eq!(identity(key).unwrap(), vec["lmcache_slot_identity_u64"].as_u64().unwrap(), "{key}");
            let parsed = Key::parse(key).unwrap();
            assert_eq!(parsed.namespace(), Namespace::Object);
            assert_eq!(parsed.model_name(), vec["key_fields"]["model_name"].as_str().unwrap());
            let salt = vec["key_fields"]["cache_salt"].as_str().unwrap_or("");
            assert_eq!(parsed.cache_salt().unwrap_or(""), salt);
            n += 1;
        }
        for vec in v["legacy_vectors"]["vectors"].as_array().unwrap() {
            let key = vec["key"].as_str().unwrap();
            assert_eq!(identity(key).unwrap(), vec["lmcache_slot_identity_u64"].as_u64().unwrap(), "{key}");
            n += 1;
        }
        assert!(n >= 9);
    }

    #[test]
    fn every_manifest_key() {
        let mut n = 0;
        for scen in ["legacy-basic", "object-evict", "object-multitenant", "reopen"] {
            let text = std::fs::read_to_string(fixtures().join(scen).join("manifest.json")).unwrap();
            let m: serde_json::Value = serde_json::from_str(&text).unwrap();
            for k in m["keys"].as_array().unwrap() {
                let key = k["key"].as_str().unwrap();
                let want = k["identity_u64"].as_u64().unwrap();
                assert_eq!(identity(key).unwrap(), want, "{scen}: {key}");
                let parsed = Key::parse(key).unwrap();
                let f = &k["key_fields"];
                match (&parsed, f["type"].as_str().unwrap()) {
                    (Key::Legacy(l), "CacheEngineKey" | "LayerCacheEngineKey") => {
                        assert_eq!(l.model_name, f["model_name"].as_str().unwrap());
                        assert_eq!(l.world_size, f["world_size"].as_u64().unwrap());
                        assert_eq!(l.layer_id, f["layer_id"].as_u64());
                    }
                    (Key::Object(o), "ObjectKey") => {
                        assert_eq!(u64::from(o.kv_rank), f["kv_rank"].as_u64().unwrap());
                        assert_eq!(o.object_group_id, f["object_group_id"].as_u64());
                        assert_eq!(o.chunk_hash_hex, f["chunk_hash_hex"].as_str().unwrap());
                        assert_eq!(parsed.model_name(), f["model_name"].as_str().unwrap());
                    }
                    (p, t) => panic!("{key}: parsed {p:?} but manifest says {t}"),
                }
                n += 1;
            }
        }
        assert!(n > 50, "only {n} keys checked");
    }

    #[test]
    fn legacy_hash_edge_cases() {
        assert_eq!(legacy_identity("0"), 0);
        assert_eq!(legacy_identity("-1"), u64::MAX);
        assert_eq!(legacy_identity("ffffffffffffffff"), u64::MAX);
        assert_eq!(legacy_identity("1ffffffffffffffff"), u64::MAX);
        assert_eq!(legacy_identity("-8000000000000000"), 0x8000000000000000);
        let k = "m@1@0@-1a27c0e6eb031a37@bfloat16@user%alice";
        match Key::parse(k).unwrap() {
            Key::Legacy(l) => {
                assert_eq!(l.tags, vec!["user%alice"]);
                assert_eq!(l.layer_id, None);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(identity(k).unwrap(), 0xe5d83f1914fce5c9);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for k in ["", "@", "a@b", "a@0x0000000z@0@ab", "m@1@x@ab@f", "m@1@0@zz@f", "m@1@0", "m@0x00000000@"] {
            assert!(identity(k).is_err(), "{k}");
        }
        assert_eq!(percent_decode("a%2Fb%zz%4"), "a/b%zz%4");
        // LMCache's FDP buckets: the salt's prefix, case-folded; none without a prefix.
        assert_eq!(salt_bucket("TenantA:alice").as_deref(), Some("tenanta"));
        assert_eq!(salt_bucket_id("TenantA:alice"), salt_bucket_id("tenanta:bob"));
        assert_ne!(salt_bucket_id("tenantA:x"), salt_bucket_id("tenantB:x"));
        for none in ["alice", ":alice", ""] {
            assert_eq!((salt_bucket(none), salt_bucket_id(none)), (None, 0), "{none:?}");
        }
    }
}
