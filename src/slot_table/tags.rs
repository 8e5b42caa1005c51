//! The (model, cache_salt) names behind the slots' tags.

use super::*;

/// Names of (model, cache_salt) pairs, interned as small tags (1..=MAX_TAGS). Touched by the
/// state thread per checkpoint (not per request); readers take the lock briefly.
#[derive(Debug, Default)]
pub struct TagTable {
    inner: Mutex<TagInner>,
}

#[derive(Debug, Default)]
struct TagInner {
    ids: HashMap<(String, String), u16>,
    names: Vec<(String, String)>,
    /// Bytes of the serialised form (`take_dirty`), kept within `MAX_BYTES`.
    bytes: usize,
    dirty: bool,
}

impl TagTable {
    pub const MAX_TAGS: usize = 4096;
    /// Longest model name or salt kept (longer ones are cut at a character boundary).
    pub const MAX_NAME: usize = 255;
    /// Largest serialised form: what fdpblk's own state saves of it (`persist::TAG_PAGES`
    /// pages). A tag past it would be lost at a restart and its number given to another pair,
    /// so the table is full there.
    pub const MAX_BYTES: usize = crate::persist::TAG_PAGES as usize * crate::persist::PAGE_PAYLOAD;

    fn cut(s: &str) -> String {
        let mut end = s.len().min(Self::MAX_NAME);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s[..end].to_string()
    }

    /// The tag of (model, salt), interning it; 0 when the table is full.
    pub fn intern(&self, model: &str, salt: &str) -> u16 {
        let key = (Self::cut(model), Self::cut(salt));
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&id) = t.ids.get(&key) {
            return id;
        }
        let bytes = t.bytes.max(2) + 2 + key.0.len() + key.1.len();
        if t.names.len() >= Self::MAX_TAGS || bytes > Self::MAX_BYTES {
            return 0;
        }
        t.bytes = bytes;
        t.names.push(key.clone());
        let id = t.names.len() as u16;
        t.ids.insert(key, id);
        t.dirty = true;
        id
    }

    pub fn name(&self, tag: u16) -> Option<(String, String)> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.names.get(usize::from(tag).checked_sub(1)?).cloned()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).names.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Serialised form (u16 count, then per tag u8 len + model bytes, u8 len + salt bytes) if
    /// it changed since the last call.
    pub fn take_dirty(&self) -> Option<Vec<u8>> {
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if !std::mem::take(&mut t.dirty) {
            return None;
        }
        Some(Self::serialize(&t))
    }

    /// The serialised form, changed or not.
    pub fn serialized(&self) -> Vec<u8> {
        Self::serialize(&self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn serialize(t: &TagInner) -> Vec<u8> {
        let mut out = (t.names.len() as u16).to_le_bytes().to_vec();
        for (m, s) in &t.names {
            out.push(m.len() as u8);
            out.extend_from_slice(m.as_bytes());
            out.push(s.len() as u8);
            out.extend_from_slice(s.as_bytes());
        }
        out
    }

    pub fn redirty(&self) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).dirty = true;
    }

    /// Restores from [`take_dirty`](Self::take_dirty)'s form; stops at the first malformed tag.
    pub fn restore(&self, b: &[u8]) {
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let n = b.get(..2).map_or(0, |x| u16::from_le_bytes([x[0], x[1]])) as usize;
        let mut pos = 2;
        let take = |pos: &mut usize| -> Option<String> {
            let len = usize::from(*b.get(*pos)?);
            let s = std::str::from_utf8(b.get(*pos + 1..*pos + 1 + len)?).ok()?.to_string();
            *pos += 1 + len;
            Some(s)
        };
        t.ids.clear();
        t.names.clear();
        t.bytes = 2;
        for _ in 0..n.min(Self::MAX_TAGS) {
            let (Some(m), Some(s)) = (take(&mut pos), take(&mut pos)) else { break };
            t.bytes += 2 + m.len() + s.len();
            t.names.push((m.clone(), s.clone()));
            let id = t.names.len() as u16;
            t.ids.insert((m, s), id);
        }
    }
}
