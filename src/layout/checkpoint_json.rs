//! Streaming, bounded-memory parser for the JSON payload of an LMCache `raw_block` checkpoint.
//!
//! LMCache 0.5.6 writes its whole index as
//! `json.dumps(state, separators=(",", ":"), ensure_ascii=True)` into a checkpoint container
//! on the device (reference doc §4). A large device has >1 M entries, i.e. a payload of a few
//! hundred MiB, and the bytes come from a device we do not trust, so this parser:
//!
//! * never builds a DOM: `entries` members are handed to a callback one at a time, with the key
//!   in one reusable buffer and only `offset`/`size` extracted;
//! * validates the complete JSON grammar (RFC 8259) so that a torn or corrupted payload is an
//!   error with the byte offset where it went wrong, not a silently partial index;
//! * bounds memory: a fixed 64 KiB read buffer, decoded strings at most
//!   [`JsonLimits::max_string_bytes`], nesting at most [`JsonLimits::max_depth`] (tracked with an
//!   explicit stack, never recursion), and input at most [`JsonLimits::max_payload_bytes`];
//! * never panics and never overflows on any input (numbers that do not fit `u64` become `None`).
//!
//! Decisions a caller should know:
//! * Trailing whitespace after the top-level object is accepted, any other trailing byte (a
//!   NUL too) is an error, as in Python's `json.loads`: the callers read exactly the header's
//!   `payload_len`, not the container's zero padding after it.
//! * An integer (no fraction or exponent) of more than [`MAX_INT_DIGITS`] digits is an error:
//!   Python's `int()` refuses it, so LMCache cannot load that checkpoint.
//! * A lone surrogate escape (`\ud800`) is accepted, as Python's `json.loads` (LMCache's)
//!   accepts it: LMCache writes one for a model name that was not valid UTF-8 (decoded with
//!   `surrogateescape`). Decoded strings (member names, entry keys, `device_path`, `meta_magic`)
//!   get U+FFFD in its place, and an entry key that had one is marked (`EntryRef::key_lossy`):
//!   its slot identity, if it is an object key, cannot be computed. Strings that are only
//!   skipped are checked for grammar (four hex digits) like serde_json's `IgnoredAny`.
//! * Duplicate member names are not merged: for top-level fields and for `offset`/`size` the last
//!   one wins (as in Python), but every member of `entries` is reported, duplicates included,
//!   and two `entries` members are both streamed. Deduplication is the caller's business.
//! * An `entries` member whose value is not an object is still reported, with `offset` and `size`
//!   `None`; an `entries` value that is not an object is validated and skipped.
//! * Fields may come in any order; the callback may run before later top-level fields (such as a
//!   `device_path` after `entries`) are known, so check the returned [`CheckpointMeta`] before
//!   trusting what the callback collected.

use std::fmt;
use std::io::{self, Read};

/// Size of the fixed read buffer: large enough that `read` calls are rare, small enough to be
/// irrelevant next to the index being built.
const READ_BUF_BYTES: usize = 64 * 1024;

/// Bounds that keep parsing of device-read JSON finite in memory.
#[derive(Clone, Debug)]
pub struct JsonLimits {
    /// Deepest container nesting accepted (the top-level object is depth 1, an entry's object
    /// depth 3). Real payloads need 4; the cap keeps the skip stack small.
    pub max_depth: usize,
    /// Longest *decoded* string we buffer (keys, member names, `device_path`, `meta_magic`).
    /// Strings that are only skipped are not buffered and not limited.
    pub max_string_bytes: usize,
    /// Stop reading past this many input bytes (including any trailing padding): a corrupted
    /// length or an endless reader then ends in [`JsonError::TooLarge`] instead of running on.
    pub max_payload_bytes: u64,
}

impl Default for JsonLimits {
    /// Generous for every real checkpoint (payload capped at 128 MiB by LMCache's 256 MiB MP
    /// metadata area, keys of ~100 bytes), tight enough to bound a hostile one.
    fn default() -> Self {
        JsonLimits {
            max_depth: 32,
            max_string_bytes: 64 * 1024,
            max_payload_bytes: 1 << 30,
        }
    }
}

/// Top-level fields of a version-1 checkpoint (all optional: LMCache defaults missing ones).
///
/// A field that is present but not a plain integer or string (e.g. a string where a number
/// belongs, a float, a bool, a negative integer or one beyond `u64`) is `None`, has its bit
/// set in `wrong_type` and, if numeric, what Python made of it in `loose`: absent means
/// LMCache's configured value; `65536.0` or `true` still equal an integer in Python.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckpointMeta {
    pub version: Option<u64>,
    pub device_path: Option<String>,
    pub capacity_bytes: Option<u64>,
    pub block_align: Option<u64>,
    pub header_bytes: Option<u64>,
    pub slot_bytes: Option<u64>,
    pub meta_total_bytes: Option<u64>,
    pub meta_magic: Option<String>,
    pub meta_version: Option<u64>,
    pub data_base_offset: Option<u64>,
    pub next_slot: Option<u64>,
    /// The top-level fields above that are present with a value of the wrong type: a bit per
    /// name of [`META_FIELDS`]; the last occurrence of a name decides, as in Python.
    pub wrong_type: u16,
    /// For each numeric field of [`META_FIELDS`] present with a value that is not a plain
    /// integer, what Python's `json.loads` made of it (the last occurrence decides).
    pub loose: [Option<Loose>; META_FIELDS.len()],
    /// Number of entries seen (callback invocations).
    pub entries: u64,
    /// Bytes of the (last) `entries` object, braces included: the rest of the payload is what
    /// a checkpoint costs besides its entries.
    pub entries_bytes: u64,
    /// Payload bytes consumed: everything read up to end of input, trailing padding included.
    pub bytes: u64,
}

/// A numeric top-level field that is not a plain integer, as LMCache's comparisons (Python's
/// `==`, `!=` and `isinstance(x, int)`) see the value `json.loads` gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loose {
    /// A number with a fraction or exponent (a Python float); `int` is its value where that
    /// is a whole number in u64, so that `65536.0 == 65536` holds as in Python.
    Float { int: Option<u64> },
    /// `true` or `false`: a Python bool is an int, 1 or 0.
    Bool(bool),
    /// Anything else (a string, null, an array, an object, a negative integer or one past
    /// u64): never equal to a configured value.
    Other,
}

/// Longest number text kept to decide a [`Loose::Float`]'s value; a longer one counts as
/// [`Loose::Other`].
const MAX_NUMBER_TEXT: usize = 512;

/// Most digits of an integer Python's `json.loads` takes: `int()` refuses longer strings
/// (`sys.get_int_max_str_digits()`, 4300 by default since Python 3.11, 3.10.7 and 3.9.14).
pub const MAX_INT_DIGITS: usize = 4300;

/// The top-level fields [`CheckpointMeta`] keeps, in the order of its `wrong_type` bits.
pub const META_FIELDS: [&str; 11] = [
    "version",
    "device_path",
    "capacity_bytes",
    "block_align",
    "header_bytes",
    "slot_bytes",
    "meta_total_bytes",
    "meta_magic",
    "meta_version",
    "data_base_offset",
    "next_slot",
];

/// Records in `wrong_type` whether the field `name` of [`META_FIELDS`] had a usable value, and
/// passes the value on.
fn typed<T>(wrong_type: &mut u16, name: &str, v: Option<T>) -> Option<T> {
    let bit = 1 << META_FIELDS.iter().position(|&f| f == name).unwrap_or(15);
    if v.is_some() {
        *wrong_type &= !bit;
    } else {
        *wrong_type |= bit;
    }
    v
}

impl CheckpointMeta {
    fn set_loose(&mut self, name: &str, v: Option<Loose>) {
        if let Some(i) = META_FIELDS.iter().position(|&f| f == name) {
            self.loose[i] = v;
        }
    }

    fn loose_of(&self, name: &str) -> Option<Loose> {
        META_FIELDS.iter().position(|&f| f == name).and_then(|i| self.loose[i])
    }

    /// The integer Python's `==` takes a numeric field for: its plain value, a whole float's
    /// value, or a bool's 1/0. `None` when absent or never equal to an integer in u64.
    pub fn py_int(&self, name: &str) -> Option<u64> {
        let plain = match name {
            "version" => self.version,
            "capacity_bytes" => self.capacity_bytes,
            "block_align" => self.block_align,
            "header_bytes" => self.header_bytes,
            "slot_bytes" => self.slot_bytes,
            "meta_total_bytes" => self.meta_total_bytes,
            "meta_version" => self.meta_version,
            "data_base_offset" => self.data_base_offset,
            "next_slot" => self.next_slot,
            _ => None,
        };
        plain.or(match self.loose_of(name) {
            Some(Loose::Float { int }) => int,
            Some(Loose::Bool(b)) => Some(u64::from(b)),
            _ => None,
        })
    }

    /// Names of the fields present with a value of the wrong type, in [`META_FIELDS`] order.
    pub fn wrong_type_fields(&self) -> impl Iterator<Item = &'static str> + '_ {
        META_FIELDS.iter().enumerate().filter(move |(i, _)| self.wrong_type & (1 << i) != 0).map(|(_, &f)| f)
    }

    /// Why LMCache 0.5.6's loader would discard this whole checkpoint and start empty, judged
    /// against the layout `g` (the configuration LMCache must have for this device) and
    /// LMCache's default `meta_magic`/`meta_version`. `None` when it would load it. Numbers
    /// compare as Python compares them (`1.0 == 1`, `True == 1`). `device_path` is compared by
    /// LMCache with its configured path, which a device image does not tell: callers show it.
    pub fn loader_rejection(&self, g: &crate::layout::Geometry) -> Option<String> {
        match self.py_int("version") {
            Some(1) => {}
            Some(v) => return Some(format!("its version is {v}; LMCache 0.5.6 loads only version 1")),
            None => return Some("it has no integer version; LMCache 0.5.6 loads only version 1".into()),
        }
        // Present but never equal to the configured value: a string where a number belongs,
        // a negative or fractional number, a number where a string belongs.
        // capacity_bytes and data_base_offset LMCache does not check.
        let unequal = |f: &str| match f {
            "device_path" | "meta_magic" => true,
            "next_slot" => !matches!(self.loose_of(f), Some(Loose::Bool(_))),
            _ => self.py_int(f).is_none(),
        };
        let mut checked = self.wrong_type_fields().filter(|f| !matches!(*f, "version" | "capacity_bytes" | "data_base_offset"));
        if let Some(f) = checked.find(|f| unequal(f)) {
            let what = match f {
                "device_path" | "meta_magic" => "a string",
                "next_slot" => "an int (LMCache requires one)",
                _ => "a non-negative whole number",
            };
            return Some(format!("its {f} is not {what}, so it cannot match LMCache's configuration"));
        }
        let layout = [("block_align", g.block_align), ("header_bytes", g.header_bytes), ("slot_bytes", g.slot_bytes), ("meta_total_bytes", g.meta_total_bytes)];
        if let Some((f, theirs, ours)) = layout.iter().find_map(|&(f, ours)| self.py_int(f).filter(|&t| t != ours).map(|t| (f, t, ours))) {
            return Some(format!("its {f} is {theirs}, but the layout's is {ours}"));
        }
        if let Some(n) = self.py_int("next_slot").filter(|&n| n > g.max_slots) {
            return Some(format!("its next_slot {n} is past the layout's {} slots", g.max_slots));
        }
        if let Some(m) = self.meta_magic.as_deref().filter(|&m| m != "LMCIDX01") {
            return Some(format!("its meta_magic {m:?} is not LMCache's default \"LMCIDX01\" (it loads only under a configured meta_magic of that value)"));
        }
        if let Some(v) = self.py_int("meta_version").filter(|&v| v != 1) {
            return Some(format!("its meta_version {v} is not LMCache's default 1 (it loads only under a configured meta_version of that value)"));
        }
        None
    }
}

/// One index entry, borrowed for the duration of the callback (the key lives in the parser's
/// reusable buffer, so no allocation per entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRef<'a> {
    /// The decoded key string LMCache indexed (escapes resolved; a lone surrogate as U+FFFD).
    pub key: &'a str,
    /// The key held a lone surrogate escape (`\ud800`): Python's `json.loads` keeps it, but the
    /// string has no UTF-8 form, so `key` is not exactly LMCache's. A legacy key's identity is
    /// its (ASCII) chunk hash and still holds; an object key's identity is a hash of the whole
    /// string's UTF-8, which LMCache fails to compute, dropping the entry when it loads.
    pub key_lossy: bool,
    /// Absolute byte offset of the slot; `None` if missing or not a non-negative integer in u64.
    pub offset: Option<u64>,
    /// Payload length; `None` if missing or not a non-negative integer in u64.
    pub size: Option<u64>,
}

/// Why a payload was rejected. Offsets (`at`) are byte offsets into the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonError {
    /// The reader failed (not end of input: that is a syntax error).
    Io(String),
    /// Malformed JSON; `at` is the offending byte, or the input length for a premature end.
    Syntax { at: u64, what: &'static str },
    /// A container at `at` would nest deeper than `max_depth`.
    TooDeep { at: u64 },
    /// The string starting (opening quote) at `at` decodes to more than `max_string_bytes`.
    StringTooLong { at: u64 },
    /// The input is longer than `max_payload_bytes` (= `limit`).
    TooLarge { limit: u64 },
    /// Valid JSON value at top level, but not an object.
    NotAnObject,
    /// The callback returned `Err(message)`.
    Aborted(String),
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonError::Io(e) => write!(f, "checkpoint JSON: read error: {e}"),
            JsonError::Syntax { at, what } => write!(f, "checkpoint JSON: {what} at byte {at}"),
            JsonError::TooDeep { at } => {
                write!(f, "checkpoint JSON: nesting too deep at byte {at}")
            }
            JsonError::StringTooLong { at } => {
                write!(
                    f,
                    "checkpoint JSON: string starting at byte {at} is too long"
                )
            }
            JsonError::TooLarge { limit } => {
                write!(f, "checkpoint JSON: payload larger than {limit} bytes")
            }
            JsonError::NotAnObject => {
                write!(f, "checkpoint JSON: top-level value is not an object")
            }
            JsonError::Aborted(m) => write!(f, "checkpoint JSON: aborted by caller: {m}"),
        }
    }
}

impl std::error::Error for JsonError {}

/// Streams `reader` (the JSON payload, exactly payload_len bytes or a prefix-limited reader) and
/// calls `on_entry` once per member of `entries`, in document order. Fields of an entry other
/// than `offset`/`size` are skipped without allocation; a non-integer or negative offset/size
/// gives None. Unknown top-level fields are skipped. The callback may abort by returning
/// Err(message).
///
/// The reader is read in 64 KiB chunks; wrapping it in a `BufReader` is unnecessary.
pub fn parse_checkpoint_json<R: Read>(
    reader: R,
    limits: &JsonLimits,
    on_entry: &mut dyn FnMut(EntryRef<'_>) -> Result<(), String>,
) -> Result<CheckpointMeta, JsonError> {
    Parser::new(
        Input::new(reader, READ_BUF_BYTES, limits.max_payload_bytes),
        limits,
    )
    .run(on_entry)
}

/// Convenience for tests and small payloads (same semantics as [`parse_checkpoint_json`];
/// the read buffer is sized to the slice when that is smaller than 64 KiB).
pub fn parse_checkpoint_slice(
    bytes: &[u8],
    limits: &JsonLimits,
    on_entry: &mut dyn FnMut(EntryRef<'_>) -> Result<(), String>,
) -> Result<CheckpointMeta, JsonError> {
    let cap = bytes.len().saturating_add(1).min(READ_BUF_BYTES);
    Parser::new(Input::new(bytes, cap, limits.max_payload_bytes), limits).run(on_entry)
}

// ------------------------------------------------------------------------------------------
// Input: a fixed buffer over the reader, with the byte offset and the payload limit.

/// Bytes that end the fast scan inside a string: quote, backslash, control characters (not
/// allowed raw in JSON strings) and non-ASCII (needs UTF-8 validation).
static STRING_STOP: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = i < 0x20 || i == b'"' as usize || i == b'\\' as usize || i >= 0x80;
        i += 1;
    }
    t
};

struct Input<R> {
    reader: R,
    buf: Box<[u8]>,
    /// Next unread byte in `buf`.
    pos: usize,
    /// End of valid data in `buf`.
    end: usize,
    /// Stream offset of `buf[0]`.
    base: u64,
    /// Bytes obtained from the reader so far.
    read_total: u64,
    limit: u64,
    /// The reader had a byte beyond `limit`; the next refill fails with TooLarge.
    over: bool,
    eof: bool,
    /// A decoded string held a lone surrogate escape (set by the decoder, cleared by callers).
    lossy: bool,
}

impl<R: Read> Input<R> {
    fn new(reader: R, cap: usize, limit: u64) -> Self {
        Input {
            reader,
            buf: vec![0u8; cap.max(1)].into_boxed_slice(),
            pos: 0,
            end: 0,
            base: 0,
            read_total: 0,
            limit,
            over: false,
            eof: false,
            lossy: false,
        }
    }

    /// Stream offset of the next unread byte.
    #[inline]
    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    #[inline]
    fn err(&self, what: &'static str) -> JsonError {
        JsonError::Syntax {
            at: self.offset(),
            what,
        }
    }

    /// Called when the buffer is used up: reads the next chunk. Ok(false) at end of input.
    /// Never asks for more than one byte past the limit, so a huge reader is not drained.
    #[cold]
    fn refill(&mut self) -> Result<bool, JsonError> {
        if self.pos < self.end {
            return Ok(true);
        }
        if self.over {
            return Err(JsonError::TooLarge { limit: self.limit });
        }
        if self.eof {
            return Ok(false);
        }
        self.base += self.end as u64;
        self.pos = 0;
        self.end = 0;
        let room = self.limit.saturating_sub(self.read_total).saturating_add(1);
        let want = usize::try_from(room).map_or(self.buf.len(), |r| r.min(self.buf.len()));
        loop {
            match self.reader.read(&mut self.buf[..want]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    // `min` guards against a Read impl that claims more than it was given.
                    let mut n = n.min(want);
                    self.read_total += n as u64;
                    if self.read_total > self.limit {
                        // Hide the byte past the limit: TooLarge is raised only when the parser
                        // asks for it, so the outcome does not depend on how the reader chunks.
                        self.over = true;
                        n -= usize::try_from(self.read_total - self.limit)
                            .unwrap_or(n)
                            .min(n);
                        if n == 0 {
                            return Err(JsonError::TooLarge { limit: self.limit });
                        }
                    }
                    self.end = n;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(JsonError::Io(e.to_string())),
            }
        }
    }

    #[inline]
    fn peek(&mut self) -> Result<Option<u8>, JsonError> {
        if self.pos < self.end || self.refill()? {
            Ok(Some(self.buf[self.pos]))
        } else {
            Ok(None)
        }
    }

    #[inline]
    fn next_byte(&mut self) -> Result<Option<u8>, JsonError> {
        let b = self.peek()?;
        if b.is_some() {
            self.pos += 1;
        }
        Ok(b)
    }

    /// Skips JSON whitespace and returns (without consuming) the next byte.
    #[inline]
    fn skip_ws(&mut self) -> Result<Option<u8>, JsonError> {
        loop {
            while self.pos < self.end {
                let b = self.buf[self.pos];
                if !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                    return Ok(Some(b));
                }
                self.pos += 1;
            }
            if !self.refill()? {
                return Ok(None);
            }
        }
    }

    /// Skips whitespace, then consumes `want` or fails with `what`.
    #[inline]
    fn expect(&mut self, want: u8, what: &'static str) -> Result<(), JsonError> {
        if self.skip_ws()? == Some(want) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.err(what))
        }
    }

    /// Consumes everything after the top-level value: only whitespace allowed.
    fn trailing(&mut self) -> Result<(), JsonError> {
        loop {
            while self.pos < self.end {
                if !matches!(self.buf[self.pos], b' ' | b'\n' | b'\r' | b'\t') {
                    return Err(self.err("trailing data after the top-level object"));
                }
                self.pos += 1;
            }
            if !self.refill()? {
                return Ok(());
            }
        }
    }

    /// Consumes a string whose opening quote (at stream offset `start`) was just consumed.
    /// With `out`, appends the decoded UTF-8 (at most `max` bytes in all); without, only checks
    /// the grammar.
    fn string(
        &mut self,
        mut out: Option<&mut Vec<u8>>,
        max: usize,
        start: u64,
    ) -> Result<(), JsonError> {
        loop {
            let chunk = &self.buf[self.pos..self.end];
            let run = chunk
                .iter()
                .position(|&b| STRING_STOP[b as usize])
                .unwrap_or(chunk.len());
            if let Some(o) = out.as_deref_mut() {
                if o.len().saturating_add(run) > max {
                    return Err(JsonError::StringTooLong { at: start });
                }
                o.extend_from_slice(&chunk[..run]);
            }
            self.pos += run;
            if self.pos == self.end {
                if !self.refill()? {
                    return Err(self.err("unterminated string"));
                }
                continue;
            }
            match self.buf[self.pos] {
                b'"' => {
                    self.pos += 1;
                    return Ok(());
                }
                b'\\' => {
                    self.pos += 1;
                    self.escape(out.as_deref_mut(), max, start)?;
                }
                0..=0x1f => return Err(self.err("control character in string")),
                _ => self.utf8_char(out.as_deref_mut(), max, start)?,
            }
        }
    }

    /// Decodes the escape after a backslash.
    fn escape(
        &mut self,
        out: Option<&mut Vec<u8>>,
        max: usize,
        start: u64,
    ) -> Result<(), JsonError> {
        let at = self.offset();
        let b = self.next_byte()?;
        if b != Some(b'u') {
            let simple = self.simple_escape(b, at)?;
            return out.map_or(Ok(()), |o| push(o, &[simple], max, start));
        }
        let mut unit = self.hex4()?;
        // A skipped string is checked for grammar only; the string loop sees what follows.
        let Some(out) = out else { return Ok(()) };
        let mut tmp = [0u8; 4];
        loop {
            let cp = match unit {
                0xD800..=0xDBFF => {
                    if self.peek()? != Some(b'\\') {
                        return self.lone_surrogate(out, max, start);
                    }
                    self.pos += 1;
                    let at = self.offset();
                    let b = self.next_byte()?;
                    if b != Some(b'u') {
                        self.lone_surrogate(out, max, start)?;
                        let simple = self.simple_escape(b, at)?;
                        return push(out, &[simple], max, start);
                    }
                    let lo = self.hex4()?;
                    if !(0xDC00..=0xDFFF).contains(&lo) {
                        // Python keeps the lone high surrogate and decodes `lo` on its own.
                        self.lone_surrogate(out, max, start)?;
                        unit = lo;
                        continue;
                    }
                    0x10000 + ((unit - 0xD800) << 10) + (lo - 0xDC00)
                }
                0xDC00..=0xDFFF => return self.lone_surrogate(out, max, start),
                _ => unit,
            };
            let ch = char::from_u32(cp).ok_or(JsonError::Syntax { at, what: "invalid \\u escape" })?;
            return push(out, ch.encode_utf8(&mut tmp).as_bytes(), max, start);
        }
    }

    /// The byte of the one-letter escape `b` (read at `at`), or why it is not one.
    fn simple_escape(&self, b: Option<u8>, at: u64) -> Result<u8, JsonError> {
        simple_escape(b).ok_or_else(|| match b {
            None => self.err("unterminated string"),
            Some(_) => JsonError::Syntax { at, what: "invalid escape" },
        })
    }

    /// A surrogate escape with no partner: Python's `json.loads` (LMCache's) keeps it in the
    /// string, which then cannot be UTF-8. It is decoded as U+FFFD and the string marked lossy.
    fn lone_surrogate(&mut self, out: &mut Vec<u8>, max: usize, start: u64) -> Result<(), JsonError> {
        self.lossy = true;
        push(out, "\u{FFFD}".as_bytes(), max, start)
    }

    /// Four hex digits of a `\u` escape.
    fn hex4(&mut self) -> Result<u32, JsonError> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = match self.peek()? {
                Some(b) => match b {
                    b'0'..=b'9' => b - b'0',
                    b'a'..=b'f' => b - b'a' + 10,
                    b'A'..=b'F' => b - b'A' + 10,
                    _ => return Err(self.err("invalid \\u escape")),
                },
                None => return Err(self.err("unterminated string")),
            };
            self.pos += 1;
            v = (v << 4) | u32::from(d);
        }
        Ok(v)
    }

    /// Validates (and with `out`, copies) one multi-byte UTF-8 sequence whose lead byte
    /// (>= 0x80) is current. Rejects overlongs, surrogates and code points above U+10FFFF.
    fn utf8_char(
        &mut self,
        out: Option<&mut Vec<u8>>,
        max: usize,
        start: u64,
    ) -> Result<(), JsonError> {
        let lead = self.buf[self.pos];
        let (n, lo, hi) = match lead {
            0xC2..=0xDF => (1, 0x80, 0xBF),
            0xE0 => (2, 0xA0, 0xBF),
            0xE1..=0xEC | 0xEE..=0xEF => (2, 0x80, 0xBF),
            0xED => (2, 0x80, 0x9F),
            0xF0 => (3, 0x90, 0xBF),
            0xF1..=0xF3 => (3, 0x80, 0xBF),
            0xF4 => (3, 0x80, 0x8F),
            _ => return Err(self.err("invalid UTF-8")),
        };
        self.pos += 1;
        let mut seq = [lead, 0, 0, 0];
        for (k, slot) in seq.iter_mut().enumerate().skip(1).take(n) {
            let (l, h) = if k == 1 { (lo, hi) } else { (0x80, 0xBF) };
            match self.peek()? {
                Some(b) if (l..=h).contains(&b) => {
                    *slot = b;
                    self.pos += 1;
                }
                Some(_) => return Err(self.err("invalid UTF-8")),
                None => return Err(self.err("unterminated string")),
            }
        }
        match out {
            Some(o) => push(o, &seq[..=n], max, start),
            None => Ok(()),
        }
    }

    /// Consumes one JSON number (current byte is `-` or a digit). Returns its value only when it
    /// is a plain non-negative integer that fits u64 (no sign, fraction or exponent): the only
    /// form LMCache writes for offsets and sizes.
    fn number(&mut self) -> Result<Option<u64>, JsonError> {
        self.number_text(None)
    }

    /// [`Self::number`], also appending the number's text to `text` (while it holds at most
    /// [`MAX_NUMBER_TEXT`] bytes; a longer one is cut there).
    fn number_text(&mut self, mut text: Option<&mut Vec<u8>>) -> Result<Option<u64>, JsonError> {
        let keep = |t: &mut Option<&mut Vec<u8>>, b: &[u8]| {
            if let Some(t) = t.as_deref_mut() {
                let room = MAX_NUMBER_TEXT.saturating_sub(t.len());
                t.extend_from_slice(&b[..b.len().min(room)]);
            }
        };
        let mut exact = true;
        let mut neg = false;
        if self.peek()? == Some(b'-') {
            self.pos += 1;
            neg = true;
            keep(&mut text, b"-");
        }
        let mut v: u64 = 0;
        let mut int_digits = 0usize;
        match self.peek()? {
            Some(b'0') => {
                self.pos += 1;
                int_digits = 1;
                keep(&mut text, b"0");
                if matches!(self.peek()?, Some(b'0'..=b'9')) {
                    return Err(self.err("leading zero in number"));
                }
            }
            Some(b'1'..=b'9') => loop {
                let chunk = &self.buf[self.pos..self.end];
                let mut i = 0;
                while i < chunk.len() && chunk[i].is_ascii_digit() {
                    let d = u64::from(chunk[i] - b'0');
                    match v.checked_mul(10).and_then(|x| x.checked_add(d)) {
                        Some(x) => v = x,
                        None => exact = false,
                    }
                    i += 1;
                }
                keep(&mut text, &chunk[..i]);
                self.pos += i;
                int_digits += i;
                if self.pos < self.end || !self.refill()? {
                    break;
                }
            },
            _ => return Err(self.err("expected digit")),
        }
        let mut float = false;
        if self.peek()? == Some(b'.') {
            self.pos += 1;
            float = true;
            keep(&mut text, b".");
            self.digits(&mut text)?;
        }
        if let Some(e @ (b'e' | b'E')) = self.peek()? {
            self.pos += 1;
            float = true;
            keep(&mut text, &[e]);
            if let Some(sign @ (b'+' | b'-')) = self.peek()? {
                self.pos += 1;
                keep(&mut text, &[sign]);
            }
            self.digits(&mut text)?;
        }
        if !float && int_digits > MAX_INT_DIGITS {
            return Err(self.err("integer of more than 4300 digits (Python's int() refuses it, so LMCache cannot load this)"));
        }
        Ok(if exact && !float && !neg { Some(v) } else { None })
    }

    /// One or more digits (fraction or exponent), appended to `text` as `number_text` does.
    fn digits(&mut self, text: &mut Option<&mut Vec<u8>>) -> Result<(), JsonError> {
        if !matches!(self.peek()?, Some(b'0'..=b'9')) {
            return Err(self.err("expected digit"));
        }
        while let Some(d @ b'0'..=b'9') = self.peek()? {
            self.pos += 1;
            if let Some(t) = text.as_deref_mut() {
                if t.len() < MAX_NUMBER_TEXT {
                    t.push(d);
                }
            }
        }
        Ok(())
    }

    /// `true`, `false` or `null`, whose first byte is current.
    fn literal(&mut self, word: &'static [u8]) -> Result<(), JsonError> {
        for &w in word {
            if self.peek()? != Some(w) {
                return Err(self.err("invalid literal"));
            }
            self.pos += 1;
        }
        Ok(())
    }
}

/// The byte a one-letter escape stands for.
fn simple_escape(b: Option<u8>) -> Option<u8> {
    Some(match b? {
        b'"' => b'"',
        b'\\' => b'\\',
        b'/' => b'/',
        b'b' => 0x08,
        b'f' => 0x0c,
        b'n' => b'\n',
        b'r' => b'\r',
        b't' => b'\t',
        _ => return None,
    })
}

/// Appends decoded bytes, enforcing the string limit before the buffer grows.
#[inline]
fn push(out: &mut Vec<u8>, bytes: &[u8], max: usize, start: u64) -> Result<(), JsonError> {
    if out.len().saturating_add(bytes.len()) > max {
        return Err(JsonError::StringTooLong { at: start });
    }
    out.extend_from_slice(bytes);
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Parser: the checkpoint's fixed shape at depths 1..=3, a generic iterative skipper below.

struct Parser<'l, R> {
    inp: Input<R>,
    limits: &'l JsonLimits,
    /// The current entry's decoded key (reused for every entry).
    key: Vec<u8>,
    /// Decoded member names and short string values (reused).
    field: Vec<u8>,
    /// Closing bytes of the containers open inside a skipped value (bounded by max_depth).
    stack: Vec<u8>,
}

impl<'l, R: Read> Parser<'l, R> {
    fn new(inp: Input<R>, limits: &'l JsonLimits) -> Self {
        Parser {
            inp,
            limits,
            key: Vec::new(),
            field: Vec::new(),
            stack: Vec::new(),
        }
    }

    /// Fails with TooDeep if a container opened at the current byte would have depth `depth`.
    fn check_depth(&self, depth: usize) -> Result<(), JsonError> {
        if depth > self.limits.max_depth {
            Err(JsonError::TooDeep {
                at: self.inp.offset(),
            })
        } else {
            Ok(())
        }
    }

    fn run(
        mut self,
        on_entry: &mut dyn FnMut(EntryRef<'_>) -> Result<(), String>,
    ) -> Result<CheckpointMeta, JsonError> {
        let mut meta = CheckpointMeta::default();
        match self.inp.skip_ws()? {
            Some(b'{') => {}
            None => return Err(self.inp.err("empty payload")),
            Some(b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n') => {
                return Err(JsonError::NotAnObject)
            }
            Some(_) => return Err(self.inp.err("expected '{'")),
        }
        self.check_depth(1)?;
        self.inp.pos += 1;
        let max_str = self.limits.max_string_bytes;
        let mut first = true;
        while self.next_member(&mut first)? {
            read_name(&mut self.inp, &mut self.field, max_str)?;
            match self.field.as_slice() {
                b"version" => meta.version = self.meta_u64(&mut meta, "version")?,
                b"device_path" => meta.device_path = typed(&mut meta.wrong_type, "device_path", self.string_value(1)?),
                b"capacity_bytes" => meta.capacity_bytes = self.meta_u64(&mut meta, "capacity_bytes")?,
                b"block_align" => meta.block_align = self.meta_u64(&mut meta, "block_align")?,
                b"header_bytes" => meta.header_bytes = self.meta_u64(&mut meta, "header_bytes")?,
                b"slot_bytes" => meta.slot_bytes = self.meta_u64(&mut meta, "slot_bytes")?,
                b"meta_total_bytes" => meta.meta_total_bytes = self.meta_u64(&mut meta, "meta_total_bytes")?,
                b"meta_magic" => meta.meta_magic = typed(&mut meta.wrong_type, "meta_magic", self.string_value(1)?),
                b"meta_version" => meta.meta_version = self.meta_u64(&mut meta, "meta_version")?,
                b"data_base_offset" => meta.data_base_offset = self.meta_u64(&mut meta, "data_base_offset")?,
                b"next_slot" => meta.next_slot = self.meta_u64(&mut meta, "next_slot")?,
                b"entries" => self.entries(&mut meta, on_entry)?,
                _ => self.skip_value(1)?,
            }
        }
        self.inp.trailing()?;
        meta.bytes = self.inp.offset();
        Ok(meta)
    }

    /// Inside an object (just after `{` when `*first`, else after a member's value): true when
    /// another member follows, with its name's opening quote current; false after consuming `}`.
    fn next_member(&mut self, first: &mut bool) -> Result<bool, JsonError> {
        let b = self.inp.skip_ws()?;
        if std::mem::replace(first, false) {
            return match b {
                Some(b'}') => {
                    self.inp.pos += 1;
                    Ok(false)
                }
                Some(b'"') => Ok(true),
                _ => Err(self.inp.err("expected member name or '}'")),
            };
        }
        match b {
            Some(b',') => {
                self.inp.pos += 1;
                if self.inp.skip_ws()? == Some(b'"') {
                    Ok(true)
                } else {
                    Err(self.inp.err("expected member name"))
                }
            }
            Some(b'}') => {
                self.inp.pos += 1;
                Ok(false)
            }
            _ => Err(self.inp.err("expected ',' or '}'")),
        }
    }

    /// A numeric top-level field: its value if a plain integer in u64, else what Python made
    /// of it (in `meta.loose`), with its `wrong_type` bit set.
    fn meta_u64(&mut self, meta: &mut CheckpointMeta, name: &str) -> Result<Option<u64>, JsonError> {
        let (v, loose) = match self.inp.skip_ws()? {
            Some(b'-' | b'0'..=b'9') => {
                let mut text = std::mem::take(&mut self.field);
                text.clear();
                let v = self.inp.number_text(Some(&mut text));
                let loose = match std::str::from_utf8(&text) {
                    Ok(t) if t.len() < MAX_NUMBER_TEXT && t.contains(['.', 'e', 'E']) => {
                        // Rust's parse rounds as Python's float() does: both are correctly rounded.
                        let f = t.parse::<f64>().ok();
                        Loose::Float { int: f.filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 18_446_744_073_709_551_616.0).map(|f| f as u64) }
                    }
                    // Python's int 0; taken as a whole float here (serde_json reads it so).
                    Ok("-0") => Loose::Float { int: Some(0) },
                    _ => Loose::Other,
                };
                self.field = text;
                let v = v?;
                (v, v.is_none().then_some(loose))
            }
            Some(b't') => {
                self.inp.literal(b"true")?;
                (None, Some(Loose::Bool(true)))
            }
            Some(b'f') => {
                self.inp.literal(b"false")?;
                (None, Some(Loose::Bool(false)))
            }
            _ => {
                self.skip_value(1)?;
                (None, Some(Loose::Other))
            }
        };
        meta.set_loose(name, loose);
        Ok(typed(&mut meta.wrong_type, name, v))
    }

    /// A value inside a container of depth `depth`, kept only if it is a u64.
    fn u64_value(&mut self, depth: usize) -> Result<Option<u64>, JsonError> {
        match self.inp.skip_ws()? {
            Some(b'-' | b'0'..=b'9') => self.inp.number(),
            _ => self.skip_value(depth).map(|()| None),
        }
    }

    /// A value inside a container of depth `depth`, kept only if it is a string.
    fn string_value(&mut self, depth: usize) -> Result<Option<String>, JsonError> {
        if self.inp.skip_ws()? != Some(b'"') {
            return self.skip_value(depth).map(|()| None);
        }
        let start = self.inp.offset();
        self.inp.pos += 1;
        self.field.clear();
        self.inp
            .string(Some(&mut self.field), self.limits.max_string_bytes, start)?;
        String::from_utf8(self.field.clone())
            .map(Some)
            .map_err(|_| JsonError::Syntax {
                at: start,
                what: "invalid UTF-8",
            })
    }

    /// The value of the top-level `entries` member: streams each member to `on_entry`.
    fn entries(
        &mut self,
        meta: &mut CheckpointMeta,
        on_entry: &mut dyn FnMut(EntryRef<'_>) -> Result<(), String>,
    ) -> Result<(), JsonError> {
        if self.inp.skip_ws()? != Some(b'{') {
            return self.skip_value(1);
        }
        let start = self.inp.offset();
        self.check_depth(2)?;
        self.inp.pos += 1;
        let max_str = self.limits.max_string_bytes;
        let mut first = true;
        while self.next_member(&mut first)? {
            let key_at = self.inp.offset();
            self.inp.lossy = false;
            read_name(&mut self.inp, &mut self.key, max_str)?;
            let key_lossy = self.inp.lossy;
            let (mut offset, mut size) = (None, None);
            if self.inp.skip_ws()? == Some(b'{') {
                self.check_depth(3)?;
                self.inp.pos += 1;
                let mut first_field = true;
                while self.next_member(&mut first_field)? {
                    read_name(&mut self.inp, &mut self.field, max_str)?;
                    match self.field.as_slice() {
                        b"offset" => offset = self.u64_value(3)?,
                        b"size" => size = self.u64_value(3)?,
                        _ => self.skip_value(3)?,
                    }
                }
            } else {
                self.skip_value(2)?;
            }
            let key = std::str::from_utf8(&self.key).map_err(|_| JsonError::Syntax {
                at: key_at,
                what: "invalid UTF-8",
            })?;
            on_entry(EntryRef { key, key_lossy, offset, size }).map_err(JsonError::Aborted)?;
            meta.entries += 1;
        }
        meta.entries_bytes = self.inp.offset() - start;
        Ok(())
    }

    /// Validates and discards one value inside a container of depth `depth`, iteratively:
    /// `stack` holds the closing byte of each container opened inside it.
    fn skip_value(&mut self, depth: usize) -> Result<(), JsonError> {
        self.stack.clear();
        'value: loop {
            match self.inp.skip_ws()? {
                Some(open @ (b'{' | b'[')) => {
                    self.check_depth(depth + self.stack.len() + 1)?;
                    self.inp.pos += 1;
                    let close = if open == b'{' { b'}' } else { b']' };
                    if self.inp.skip_ws()? == Some(close) {
                        self.inp.pos += 1;
                    } else {
                        self.stack.push(close);
                        if close == b'}' {
                            self.skip_name()?;
                        }
                        continue 'value;
                    }
                }
                Some(b'"') => {
                    let start = self.inp.offset();
                    self.inp.pos += 1;
                    self.inp.string(None, 0, start)?;
                }
                Some(b'-' | b'0'..=b'9') => {
                    self.inp.number()?;
                }
                Some(b't') => self.inp.literal(b"true")?,
                Some(b'f') => self.inp.literal(b"false")?,
                Some(b'n') => self.inp.literal(b"null")?,
                _ => return Err(self.inp.err("expected value")),
            }
            // A value is complete: close containers or move to the next element.
            loop {
                let Some(&close) = self.stack.last() else {
                    return Ok(());
                };
                match self.inp.skip_ws()? {
                    Some(b',') => {
                        self.inp.pos += 1;
                        if close == b'}' {
                            self.skip_name()?;
                        }
                        continue 'value;
                    }
                    Some(c) if c == close => {
                        self.inp.pos += 1;
                        self.stack.pop();
                    }
                    _ => {
                        return Err(self.inp.err(if close == b'}' {
                            "expected ',' or '}'"
                        } else {
                            "expected ',' or ']'"
                        }))
                    }
                }
            }
        }
    }

    /// A member name and its colon inside a skipped object (grammar only).
    fn skip_name(&mut self) -> Result<(), JsonError> {
        if self.inp.skip_ws()? != Some(b'"') {
            return Err(self.inp.err("expected member name"));
        }
        let start = self.inp.offset();
        self.inp.pos += 1;
        self.inp.string(None, 0, start)?;
        self.inp.expect(b':', "expected ':'")
    }
}

/// Decodes a member name (opening quote current) into `buf`, then consumes the colon.
fn read_name<R: Read>(inp: &mut Input<R>, buf: &mut Vec<u8>, max: usize) -> Result<(), JsonError> {
    let start = inp.offset();
    inp.pos += 1;
    buf.clear();
    inp.string(Some(buf), max, start)?;
    inp.expect(b':', "expected ':'")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Map, Value};
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    type Entry = (String, Option<u64>, Option<u64>);
    type Parsed = Result<(CheckpointMeta, Vec<Entry>), JsonError>;

    fn collect(
        f: impl FnOnce(
            &mut dyn FnMut(EntryRef<'_>) -> Result<(), String>,
        ) -> Result<CheckpointMeta, JsonError>,
    ) -> Parsed {
        let mut v = Vec::new();
        let meta = f(&mut |e: EntryRef<'_>| {
            v.push((e.key.to_owned(), e.offset, e.size));
            Ok(())
        })?;
        Ok((meta, v))
    }

    fn parse_slice(bytes: &[u8], limits: &JsonLimits) -> Parsed {
        collect(|cb| parse_checkpoint_slice(bytes, limits, cb))
    }

    /// A reader that hands out at most `sizes[i % len]` bytes per call, so that the parser's
    /// buffer boundaries fall everywhere (inside escapes, numbers, UTF-8 sequences, literals).
    struct Chunked<'a> {
        data: &'a [u8],
        sizes: Vec<usize>,
        i: usize,
    }

    impl Read for Chunked<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let want = self.sizes[self.i % self.sizes.len()].max(1);
            self.i += 1;
            let n = want.min(buf.len()).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn parse_chunked(bytes: &[u8], sizes: &[usize], limits: &JsonLimits) -> Parsed {
        let r = Chunked {
            data: bytes,
            sizes: sizes.to_vec(),
            i: 0,
        };
        collect(|cb| parse_checkpoint_json(r, limits, cb))
    }

    fn syntax_at(r: Parsed) -> u64 {
        match r {
            Err(JsonError::Syntax { at, .. }) => at,
            other => panic!("expected a syntax error, got {other:?}"),
        }
    }

    // ---- serde_json as oracle ----------------------------------------------------------------

    fn oracle_entries(doc: &Value) -> Vec<Entry> {
        let Some(m) = doc.get("entries").and_then(Value::as_object) else {
            return Vec::new();
        };
        m.iter()
            .map(|(k, e)| {
                let u = |f: &str| e.get(f).and_then(Value::as_u64);
                (k.clone(), u("offset"), u("size"))
            })
            .collect()
    }

    fn oracle_meta(doc: &Value, bytes: u64) -> CheckpointMeta {
        let u = |k: &str| doc.get(k).and_then(Value::as_u64);
        let s = |k: &str| doc.get(k).and_then(Value::as_str).map(str::to_owned);
        CheckpointMeta {
            version: u("version"),
            device_path: s("device_path"),
            capacity_bytes: u("capacity_bytes"),
            block_align: u("block_align"),
            header_bytes: u("header_bytes"),
            slot_bytes: u("slot_bytes"),
            meta_total_bytes: u("meta_total_bytes"),
            meta_magic: s("meta_magic"),
            meta_version: u("meta_version"),
            data_base_offset: u("data_base_offset"),
            next_slot: u("next_slot"),
            wrong_type: META_FIELDS
                .iter()
                .enumerate()
                .filter(|(_, &f)| {
                    let v = doc.get(f);
                    let usable = if matches!(f, "device_path" | "meta_magic") { v.and_then(Value::as_str).is_some() } else { v.and_then(Value::as_u64).is_some() };
                    v.is_some() && !usable
                })
                .fold(0, |m, (i, _)| m | 1 << i),
            loose: std::array::from_fn(|i| {
                let f = META_FIELDS[i];
                match doc.get(f) {
                    _ if matches!(f, "device_path" | "meta_magic") => None,
                    None => None,
                    Some(v) if v.as_u64().is_some() => None,
                    Some(Value::Bool(b)) => Some(Loose::Bool(*b)),
                    Some(Value::Number(n)) if n.is_f64() => Some(Loose::Float {
                        int: n.as_f64().filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 18_446_744_073_709_551_616.0).map(|f| f as u64),
                    }),
                    Some(_) => Some(Loose::Other),
                }
            }),
            entries: doc
                .get("entries")
                .and_then(Value::as_object)
                .map_or(0, |m| m.len() as u64),
            // Depends on the text's spacing: the callers compare it separately.
            entries_bytes: 0,
            bytes,
        }
    }

    /// Ours as a map with Python's last-wins semantics (serde_json's Map may be sorted).
    fn as_map(v: &[Entry]) -> BTreeMap<String, (Option<u64>, Option<u64>)> {
        v.iter().map(|(k, o, s)| (k.clone(), (*o, *s))).collect()
    }

    /// Asserts that our result agrees with serde_json on `bytes` (which must parse there).
    fn assert_agrees_with_oracle(bytes: &[u8], ours: &(CheckpointMeta, Vec<Entry>)) {
        let doc: Value = serde_json::from_slice(bytes).expect("oracle accepts");
        let (meta, entries) = ours;
        assert_eq!(as_map(entries), as_map(&oracle_entries(&doc)));
        let mut want = oracle_meta(&doc, meta.bytes);
        want.entries = meta.entries; // duplicates are reported by us, merged by serde_json
        want.entries_bytes = meta.entries_bytes;
        // serde_json reads an integer past u64 as a float: either way no integer equals it.
        let never = |m: &CheckpointMeta| {
            let mut m = m.clone();
            for l in m.loose.iter_mut().flatten() {
                if *l == (Loose::Float { int: None }) {
                    *l = Loose::Other;
                }
            }
            m
        };
        assert_eq!(never(meta), never(&want));
    }

    /// Serialises like Python's `json.dumps(..., ensure_ascii=...)`, with knobs that exercise
    /// the escapes serde_json never writes (`\/`, `\uXXXX` for ASCII, upper-case hex) and
    /// optional whitespace around every token.
    #[derive(Clone, Copy, Debug)]
    struct Style {
        ascii: bool,
        escape_slash: bool,
        upper_hex: bool,
        escape_all: bool,
        ws: &'static str,
    }

    fn write_str(s: &str, st: Style, out: &mut String) {
        let hex = |u: u32, out: &mut String| {
            if st.upper_hex {
                out.push_str(&format!("\\u{u:04X}"));
            } else {
                out.push_str(&format!("\\u{u:04x}"));
            }
        };
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '/' if st.escape_slash => out.push_str("\\/"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => hex(c as u32, out),
                c if (st.ascii && (c as u32) > 0x7e) || st.escape_all => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        hex(u32::from(*u), out);
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn write_json(v: &Value, st: Style, out: &mut String) {
        let ws = st.ws;
        match v {
            Value::Object(m) => {
                out.push('{');
                for (i, (k, e)) in m.iter().enumerate() {
                    out.push_str(if i > 0 { "," } else { "" });
                    out.push_str(ws);
                    write_str(k, st, out);
                    out.push_str(ws);
                    out.push(':');
                    out.push_str(ws);
                    write_json(e, st, out);
                }
                out.push_str(ws);
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, e) in a.iter().enumerate() {
                    out.push_str(if i > 0 { "," } else { "" });
                    out.push_str(ws);
                    write_json(e, st, out);
                }
                out.push_str(ws);
                out.push(']');
            }
            Value::String(s) => write_str(s, st, out),
            other => out.push_str(&other.to_string()),
        }
    }

    fn to_text(v: &Value, st: Style) -> Vec<u8> {
        let mut s = String::new();
        write_json(v, st, &mut s);
        s.into_bytes()
    }

    const PY: Style = Style {
        ascii: true,
        escape_slash: false,
        upper_hex: false,
        escape_all: false,
        ws: "",
    };

    // ---- real LMCache 0.5.6 fixtures ----------------------------------------------------------

    fn fixture_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6")
    }

    fn scenarios() -> Vec<PathBuf> {
        let root = fixture_root();
        let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
            .unwrap_or_else(|e| panic!("fixtures missing at {}: {e}", root.display()))
            .map(|d| d.unwrap().path())
            .filter(|p| p.join("manifest.json").is_file())
            .collect();
        v.sort();
        assert!(
            v.len() >= 12,
            "expected the 12 fixture scenarios under {}",
            root.display()
        );
        v
    }

    fn le(b: &[u8]) -> u64 {
        b.iter().rev().fold(0, |a, &x| (a << 8) | u64::from(x))
    }

    /// A checkpoint copy that passes LMCache's loader checks (magic, version, length, CRC).
    struct Copy {
        index: u64,
        seq: u64,
        crc: u64,
        payload: Vec<u8>,
        /// The payload as on disk: rounded up to `block_align` with zero padding.
        padded: Vec<u8>,
    }

    fn valid_copies(img: &[u8], m: &Value) -> Vec<Copy> {
        let g = &m["geometry"];
        let ba = g["block_align"].as_u64().unwrap() as usize;
        let cap = g["meta_payload_capacity"].as_u64().unwrap();
        let mut out = Vec::new();
        for (index, off) in g["meta_container_offsets"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let off = off.as_u64().unwrap() as usize;
            let h = &img[off..off + 32];
            let (seq, len, crc) = (le(&h[12..20]), le(&h[20..28]), le(&h[28..32]));
            if &h[..8] != b"LMCIDX01" || le(&h[8..12]) != 1 || len == 0 || len > cap {
                continue;
            }
            let start = off + ba;
            let payload = img[start..start + len as usize].to_vec();
            if u64::from(crc32fast::hash(&payload)) != crc {
                continue;
            }
            let padded = img[start..start + (len as usize).div_ceil(ba) * ba].to_vec();
            out.push(Copy {
                index: index as u64,
                seq,
                crc,
                payload,
                padded,
            });
        }
        out
    }

    /// The manifest key record the entry of checkpoint `seq` must equal, when the manifest's
    /// phases say which writes preceded that checkpoint (not for `reopen`, which has no writes).
    fn record_before_checkpoint<'m>(m: &'m Value, seq: u64, key: &str) -> Option<&'m Value> {
        let phases = m["phases"].as_array().unwrap();
        let cp_idx = phases
            .iter()
            .enumerate()
            .filter(|(_, p)| p["op"] == "checkpoint_now")
            .nth(seq as usize - 1)?
            .0;
        let phase_idx = |name: &Value| phases.iter().position(|p| p["phase"] == *name);
        m["keys"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| {
                r["key"] == key && phase_idx(&r["written_in_phase"]).is_some_and(|i| i < cp_idx)
            })
            .max_by_key(|r| r["write_seq"].as_u64())
    }

    fn all_fixture_payloads() -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = Vec::new();
        for dir in scenarios() {
            let img = std::fs::read(dir.join("device.img")).unwrap();
            let m: Value =
                serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
            for c in valid_copies(&img, &m) {
                if !v.contains(&c.payload) {
                    v.push(c.payload);
                }
            }
        }
        v
    }

    #[test]
    fn fixtures_every_copy_matches_manifest_and_oracle() {
        let limits = JsonLimits::default();
        let mut checked_entries = 0;
        for dir in scenarios() {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            let img = std::fs::read(dir.join("device.img")).unwrap();
            let m: Value =
                serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
            let g = &m["geometry"];
            let copies = valid_copies(&img, &m);
            let on_dev = m["checkpoints_on_device"].as_object().unwrap();
            assert_eq!(copies.len(), on_dev.len(), "{name}: valid copies");
            let latest = m["latest_checkpoint_seq"].as_u64().unwrap();
            for c in &copies {
                let ctx = format!("{name} copy {} seq {}", c.index, c.seq);
                assert_eq!(on_dev[&c.index.to_string()].as_u64(), Some(c.seq), "{ctx}");
                let cp = m["checkpoints"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .rfind(|cp| cp["seq"] == c.seq && cp["copy_index"] == c.index)
                    .unwrap_or_else(|| panic!("{ctx}: not in manifest"));
                assert_eq!(
                    cp["payload_len"].as_u64(),
                    Some(c.payload.len() as u64),
                    "{ctx}"
                );
                assert_eq!(cp["crc32"].as_u64(), Some(c.crc), "{ctx}");

                // The exact payload and a 1..13-byte-chunk stream of it agree; the container's
                // zero padding after it is not JSON (Python: "Extra data").
                let exact = parse_slice(&c.payload, &limits).unwrap();
                let streamed = parse_chunked(&c.payload, &[1, 2, 3, 5, 8, 13], &limits).unwrap();
                assert_eq!(exact.0.bytes, c.payload.len() as u64, "{ctx}");
                assert_eq!(exact, streamed, "{ctx}");
                if c.padded.len() > c.payload.len() {
                    assert_eq!(syntax_at(parse_slice(&c.padded, &limits)), c.payload.len() as u64, "{ctx}");
                }
                let (meta, entries) = exact;
                assert_agrees_with_oracle(&c.payload, &(meta.clone(), entries.clone()));

                // Top-level fields vs the configured geometry.
                assert_eq!(meta.version, Some(1), "{ctx}");
                assert_eq!(
                    meta.device_path.as_deref(),
                    m["device"]["device_path_in_checkpoint"].as_str()
                );
                assert_eq!(
                    meta.capacity_bytes,
                    g["capacity_bytes_effective"].as_u64(),
                    "{ctx}"
                );
                for f in [
                    "block_align",
                    "header_bytes",
                    "slot_bytes",
                    "meta_total_bytes",
                    "data_base_offset",
                ] {
                    let ours = match f {
                        "block_align" => meta.block_align,
                        "header_bytes" => meta.header_bytes,
                        "slot_bytes" => meta.slot_bytes,
                        "meta_total_bytes" => meta.meta_total_bytes,
                        _ => meta.data_base_offset,
                    };
                    assert_eq!(ours, g[f].as_u64(), "{ctx}: {f}");
                }
                assert_eq!(
                    meta.meta_magic.as_deref(),
                    g["meta_magic"].as_str(),
                    "{ctx}"
                );
                assert_eq!(meta.meta_version, g["meta_version"].as_u64(), "{ctx}");
                assert_eq!(meta.next_slot, cp["next_slot"].as_u64(), "{ctx}");

                // Entries: order and keys vs the manifest, offset/size vs the key records.
                let keys: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
                let want: Vec<&str> = cp["entry_keys"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|k| k.as_str().unwrap())
                    .collect();
                assert_eq!(keys, want, "{ctx}: entry keys");
                assert_eq!(meta.entries, entries.len() as u64);
                for (key, off, size) in &entries {
                    let recs: Vec<&Value> = m["keys"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|r| r["key"] == key.as_str())
                        .collect();
                    let got = (*off, *size);
                    let as_pair = |r: &Value| (r["offset"].as_u64(), r["payload_len"].as_u64());
                    assert!(
                        recs.iter().any(|r| as_pair(r) == got),
                        "{ctx}: {key} {got:?} not written"
                    );
                    if let Some(r) = record_before_checkpoint(&m, c.seq, key) {
                        assert_eq!(as_pair(r), got, "{ctx}: {key}");
                    }
                    if c.seq == latest {
                        let live: Vec<_> =
                            recs.iter().filter(|r| r["live_at_end"] == true).collect();
                        assert_eq!(live.len(), 1, "{ctx}: {key}");
                        assert_eq!(as_pair(live[0]), got, "{ctx}: {key} vs live record");
                    }
                    checked_entries += 1;
                }
                if c.seq == latest {
                    let live = m["keys"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|r| r["live_at_end"] == true)
                        .count();
                    assert_eq!(
                        entries.len(),
                        live,
                        "{ctx}: newest copy holds every live key"
                    );
                }
            }
        }
        assert!(
            checked_entries > 100,
            "only {checked_entries} entries checked"
        );
    }

    #[test]
    fn fixture_truncated_at_every_byte_is_a_syntax_error_at_the_cut() {
        let limits = JsonLimits::default();
        for (i, p) in all_fixture_payloads().iter().enumerate() {
            for n in 0..p.len() {
                assert_eq!(
                    syntax_at(parse_slice(&p[..n], &limits)),
                    n as u64,
                    "payload {i} cut at {n}"
                );
                // A torn write whose tail reads back as zeros is still torn.
                let mut z = p[..n].to_vec();
                z.resize(n + 64, 0);
                assert_eq!(
                    syntax_at(parse_slice(&z, &limits)),
                    n as u64,
                    "payload {i} zero tail at {n}"
                );
            }
            // Through a reader with small chunks as well (boundaries inside every token).
            for n in (0..p.len()).step_by(7) {
                assert_eq!(
                    syntax_at(parse_chunked(&p[..n], &[3, 1, 4], &limits)),
                    n as u64
                );
            }
        }
    }

    #[test]
    fn fixture_bit_flips_agree_with_oracle_and_never_panic() {
        let limits = JsonLimits::default();
        let payloads = all_fixture_payloads();
        assert!(payloads.len() >= 4);
        let (mut ok, mut err) = (0u32, 0u32);
        for p in &payloads {
            let mut buf = p.clone();
            for i in 0..buf.len() {
                // Two bits per byte, rotating, so every bit position is hit every 4 bytes
                // (all 8 per byte would make this test slow in debug builds).
                for bit in [i % 8, (i + 4) % 8] {
                    buf[i] ^= 1 << bit;
                    let ours = parse_slice(&buf, &limits);
                    match serde_json::from_slice::<Value>(&buf) {
                        Ok(doc) if doc.is_object() => {
                            let ours = ours.unwrap_or_else(|e| panic!("byte {i} bit {bit}: {e}"));
                            assert_agrees_with_oracle(&buf, &ours);
                            ok += 1;
                        }
                        _ => {
                            assert!(
                                ours.is_err(),
                                "byte {i} bit {bit}: accepted what serde_json rejects"
                            );
                            err += 1;
                        }
                    }
                    buf[i] ^= 1 << bit;
                }
            }
        }
        assert!(ok > 500 && err > 500, "ok {ok} err {err}");
    }

    // ---- synthetic LMCache-shaped payloads ------------------------------------------------------

    /// A payload shaped like LMCache's, with legacy and object keys, some carrying escapes
    /// (non-ASCII model names as surrogate pairs, `\/`, `\"`), shapes and cached_positions.
    fn lmcache_like_payload(n: usize) -> (Vec<u8>, Vec<Entry>) {
        let mut entries = Map::new();
        let mut expected = Vec::with_capacity(n);
        let base = 1u64 << 27;
        let slot = 33_558_528u64;
        for i in 0..n {
            let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let key = match i % 5 {
                0 => format!("meta-llama/Llama-3.1-8B-Instruct@1@0@{h:016x}@bfloat16"),
                1 => format!(
                    "meta-llama%2FLlama-3.1-8B-Instruct@0x00000000@0@{h:016x}{:048x}",
                    i
                ),
                2 => format!("Qwen%2FQwen3-8B@0x02010201@a@{h:016x}@tenant\u{e9}:\u{1F600}-{i}"),
                3 => format!("m\"odel\\x/y@1@0@-{h:x}@half@user%\u{4e2d}\u{6587}"),
                _ => format!("mistralai%2FMistral-7B@0x01000100@0@{h:016x}@tenantB:bob-{i}"),
            };
            let offset = base + i as u64 * slot;
            let size = 1 + h % (slot - 4096);
            let cached = if i % 7 == 0 {
                Value::from(vec![0u64, 1, 2, 3, 255])
            } else {
                Value::Null
            };
            let e = serde_json::json!({
                "offset": offset, "size": size, "shape": [2, 32, 256, 1024],
                "dtype": "bfloat16", "fmt": "KV_2LTD", "cached_positions": cached,
            });
            assert!(entries.insert(key.clone(), e).is_none());
            expected.push((key, Some(offset), Some(size)));
        }
        let mut doc = Map::new();
        for (k, v) in [
            ("version", Value::from(1)),
            ("device_path", Value::from("/dev/ublkb0")),
            ("capacity_bytes", Value::from(1u64 << 40)),
            ("block_align", Value::from(4096)),
            ("header_bytes", Value::from(4096)),
            ("slot_bytes", Value::from(slot)),
            ("meta_total_bytes", Value::from(base)),
            ("meta_magic", Value::from("LMCIDX01")),
            ("meta_version", Value::from(1)),
            ("data_base_offset", Value::from(base)),
            ("next_slot", Value::from(n as u64)),
        ] {
            doc.insert(k.to_owned(), v);
        }
        doc.insert("entries".to_owned(), Value::Object(entries));
        // Serialise in insertion order of `expected` regardless of serde_json's Map ordering:
        // write the header fields, then each entry by hand.
        let mut s = String::from("{");
        for (k, v) in doc.iter().filter(|(k, _)| *k != "entries") {
            write_str(k, PY, &mut s);
            s.push(':');
            write_json(v, PY, &mut s);
            s.push(',');
        }
        s.push_str("\"entries\":{");
        let em = doc["entries"].as_object().unwrap();
        for (i, (k, _, _)) in expected.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            write_str(k, PY, &mut s);
            s.push(':');
            let e = &em[k];
            // LMCache's field order.
            s.push_str(&format!(
                "{{\"offset\":{},\"size\":{},\"shape\":{},\"dtype\":{},\"fmt\":{},\"cached_positions\":{}}}",
                e["offset"], e["size"], e["shape"], e["dtype"], e["fmt"], e["cached_positions"]
            ));
        }
        s.push_str("}}");
        (s.into_bytes(), expected)
    }

    #[test]
    fn synthetic_50k_entries_exact() {
        let n = 50_000;
        let (payload, expected) = lmcache_like_payload(n);
        assert!(payload.is_ascii());
        assert!(payload.len() > 100 * READ_BUF_BYTES);
        let limits = JsonLimits::default();
        for (what, r) in [
            ("slice", parse_slice(&payload, &limits)),
            (
                "reader",
                collect(|cb| parse_checkpoint_json(&payload[..], &limits, cb)),
            ),
            (
                "odd chunks",
                parse_chunked(&payload, &[4093, 17, 65536, 1], &limits),
            ),
        ] {
            let (meta, entries) = r.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(meta.entries, n as u64, "{what}");
            assert_eq!(entries, expected, "{what}");
            assert_eq!(meta.next_slot, Some(n as u64));
            assert_eq!(meta.device_path.as_deref(), Some("/dev/ublkb0"));
        }
        assert_agrees_with_oracle(&payload, &parse_slice(&payload, &limits).unwrap());
    }

    // ---- escapes, UTF-8, grammar ----------------------------------------------------------------

    fn entry_doc(raw_key: &str) -> String {
        format!("{{\"entries\":{{\"{raw_key}\":{{\"offset\":1048576,\"size\":7}}}}}}")
    }

    #[test]
    fn escapes_and_surrogates_decode_like_serde_json() {
        let cases: &[(&str, &str)] = &[
            (r"plain", "plain"),
            (r"a\/b", "a/b"),
            (r#"q\"q\\"#, "q\"q\\"),
            (r"\b\f\n\r\t", "\u{8}\u{c}\n\r\t"),
            (r"\u00e9\u00E9", "éé"),
            (r"\u4e2d\u6587", "中文"),
            (r"\ud83d\ude00", "\u{1F600}"),
            (r"\uD83D\uDE00x", "\u{1F600}x"),
            (r"\udbff\udfff", "\u{10FFFF}"),
            (r"\u0000nul", "\u{0}nul"),
            (r"\u0041\u002f", "A/"),
            ("raw \u{e9}\u{1F600}", "raw é\u{1F600}"),
            (
                r"model\u00e9@1@0@-1a27c0e6eb031a37@bfloat16@user%alice",
                "modelé@1@0@-1a27c0e6eb031a37@bfloat16@user%alice",
            ),
        ];
        for (raw, want) in cases {
            let doc = entry_doc(raw);
            let (meta, entries) = parse_slice(doc.as_bytes(), &JsonLimits::default()).unwrap();
            assert_eq!(
                entries,
                vec![(want.to_string(), Some(1_048_576), Some(7))],
                "{raw}"
            );
            assert_eq!(meta.entries, 1);
            assert_agrees_with_oracle(doc.as_bytes(), &(meta, entries));
            // Same through a 1-byte reader: escapes split across buffer refills.
            let streamed = parse_chunked(doc.as_bytes(), &[1], &JsonLimits::default()).unwrap();
            assert_eq!(streamed.1[0].0, *want);
        }
    }

    #[test]
    fn lone_surrogates_are_kept_like_pythons_json_loads() {
        // Python: json.loads('"\\ud83dx"') == '\ud83dx'; ours has U+FFFD there, marked lossy.
        let cases: &[(&str, &str)] = &[
            (r"\ud83d", "\u{FFFD}"),
            (r"\ud83dx", "\u{FFFD}x"),
            (r"\ude00", "\u{FFFD}"),
            (r"\ud83d\u0041", "\u{FFFD}A"),
            (r"\ud83d\n", "\u{FFFD}\n"),
            (r"\ud83d\ud83d\ude00", "\u{FFFD}\u{1F600}"),
            (r"\ud83d\ude00\udc80", "\u{1F600}\u{FFFD}"),
            (r"m\udcff@1@0@-1a27c0e6eb031a37@bfloat16", "m\u{FFFD}@1@0@-1a27c0e6eb031a37@bfloat16"),
        ];
        for (raw, want) in cases {
            let doc = format!("{{\"entries\":{{\"{raw}\":{{\"offset\":1048576,\"size\":7}},\"plain\":{{}}}}}}");
            for chunk in [doc.len(), 1] {
                let mut got = Vec::new();
                let reader = Chunked { data: doc.as_bytes(), sizes: vec![chunk], i: 0 };
                let meta = parse_checkpoint_json(reader, &JsonLimits::default(), &mut |e| {
                    got.push((e.key.to_string(), e.key_lossy, e.offset));
                    Ok(())
                })
                .unwrap();
                assert_eq!(meta.entries, 2);
                // The mark is the key's own: the next entry's is clear.
                assert_eq!(got, vec![(want.to_string(), true, Some(1_048_576)), ("plain".to_string(), false, None)], "{raw}");
            }
        }
    }

    #[test]
    fn invalid_strings_are_syntax_errors_like_serde_json() {
        let bad: &[&[u8]] = &[
            br"\x",              // unknown escape
            br"\ud83d\x",        // high surrogate + unknown escape
            br"\u12",            // short \u
            br"\u12G4",          // bad hex
            b"\x01",             // raw control character
            b"tab\there",        // raw tab
            b"\xff",             // invalid UTF-8
            b"\xc0\x80",         // overlong NUL
            b"\xe0\x80\xaf",     // overlong '/'
            b"\xed\xa0\x80",     // encoded surrogate
            b"\xf4\x90\x80\x80", // above U+10FFFF
            b"\xe2\x82",         // truncated sequence
            b"\x80",             // stray continuation
        ];
        for raw in bad {
            let mut doc = b"{\"entries\":{\"".to_vec();
            doc.extend_from_slice(raw);
            doc.extend_from_slice(b"\":{}}}");
            let r = parse_slice(&doc, &JsonLimits::default());
            assert!(
                matches!(r, Err(JsonError::Syntax { .. })),
                "{:?}: {r:?}",
                String::from_utf8_lossy(raw)
            );
            assert!(serde_json::from_slice::<Value>(&doc).is_err());
            let r2 = parse_chunked(&doc, &[1], &JsonLimits::default());
            assert_eq!(r, r2, "streamed error differs");
        }
        // The error points into the string: at the bad escape/byte, not at the quote.
        assert_eq!(
            syntax_at(parse_slice(
                br#"{"entries":{"ab\x":1}}"#,
                &JsonLimits::default()
            )),
            16
        );
        assert_eq!(
            syntax_at(parse_slice(b"{\"a\xff\":1}", &JsonLimits::default())),
            3
        );
    }

    #[test]
    fn skipped_strings_are_grammar_checked_but_lone_surrogates_pass() {
        // Like Python's json.loads (which LMCache uses): a lone surrogate in a field we skip
        // does not reject the checkpoint.
        let doc = br#"{"entries":{"k":{"dtype":"\ud800","offset":5,"fmt":"\udc00x"}}}"#;
        let (_, e) = parse_slice(doc, &JsonLimits::default()).unwrap();
        assert_eq!(e, vec![("k".into(), Some(5), None)]);
        for bad in [
            &br#"{"x":"\q"}"#[..],
            br#"{"x":"\u00g0"}"#,
            b"{\"x\":\"\x1f\"}",
            b"{\"x\":\"\xc3\"}",
        ] {
            assert!(matches!(
                parse_slice(bad, &JsonLimits::default()),
                Err(JsonError::Syntax { .. })
            ));
        }
    }

    #[test]
    fn numbers_map_to_u64_exactly_like_serde_as_u64() {
        let cases: &[(&str, Option<u64>)] = &[
            ("0", Some(0)),
            ("7", Some(7)),
            ("1099511627776", Some(1 << 40)),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("99999999999999999999999999999999", None),
            ("-1", None),
            ("-0", None),
            ("-9223372036854775808", None),
            ("1.0", None),
            ("0.5", None),
            ("1e3", None),
            ("1E3", None),
            ("1e-3", None),
            ("-1.5e+10", None),
            ("4096.000", None),
        ];
        for (text, want) in cases {
            let doc = format!("{{\"next_slot\":{text},\"entries\":{{\"k\":{{\"offset\":{text},\"size\":{text}}}}}}}");
            let (meta, e) = parse_slice(doc.as_bytes(), &JsonLimits::default()).unwrap();
            assert_eq!(meta.next_slot, *want, "{text}");
            assert_eq!(e, vec![("k".into(), *want, *want)], "{text}");
            assert_agrees_with_oracle(doc.as_bytes(), &(meta, e));
        }
        // Wrong types are None too.
        let doc = br#"{"version":"1","block_align":null,"slot_bytes":[1],"entries":{"k":{"offset":true,"size":{"v":1}}}}"#;
        let (meta, e) = parse_slice(doc, &JsonLimits::default()).unwrap();
        assert_eq!(
            (meta.version, meta.block_align, meta.slot_bytes),
            (None, None, None)
        );
        assert_eq!(e, vec![("k".into(), None, None)]);
    }

    #[test]
    fn malformed_documents_are_syntax_errors_with_offsets() {
        let l = JsonLimits::default();
        let cases: &[(&[u8], u64)] = &[
            (b"", 0),
            (b"   \n", 4),
            (b"\0", 0),
            (b"\0{}", 0),
            (b"\xef\xbb\xbf{}", 0), // BOM
            (b"x", 0),
            (b"{", 1),
            (b"{\"a\"}", 4),
            (b"{\"a\" 1}", 5),
            (b"{\"a\":}", 5),
            (b"{\"a\":1,}", 7),
            (b"{,}", 1),
            (b"{\"a\":1 \"b\":2}", 7),
            (b"{'a':1}", 1),
            (b"{a:1}", 1),
            (b"{\"a\":01}", 6),
            (b"{\"a\":1.}", 7),
            (b"{\"a\":.5}", 5),
            (b"{\"a\":+1}", 5),
            (b"{\"a\":1e}", 7),
            (b"{\"a\":1e+}", 8),
            (b"{\"a\":-}", 6),
            (b"{\"a\":- 1}", 6),
            (b"{\"a\":tru}", 8),
            (b"{\"a\":nul}", 8),
            (b"{\"a\":True}", 5),
            (b"{\"a\":NaN}", 5),
            (b"{\"a\":Infinity}", 5),
            (b"{\"a\":[1,]}", 8),
            (b"{\"a\":[,1]}", 6),
            (b"{\"a\":[1 2]}", 8),
            (b"{\"a\":[1}", 7),
            (b"{\"a\":{\"b\"}}", 9),
            (b"{\"a\":{\"b\":1]}", 11),
            (b"{\"a\":{1:2}}", 6),
            (b"{\"a\":\"\n\"}", 6),
            (b"{\"a\":\"x}", 8),
            (b"{}x", 2),
            (b"{}{}", 2),
            (b"{} \0 x", 3),
            // NUL padding: Python's json.loads says "Extra data" (the callers stop at payload_len).
            (b"{}\0\0\0\0", 2),
            (b"{} \n\0 ", 4),
            (b"{\"entries\":{\"k\":{\"offset\":1,}}}", 28),
            (b"{\"entries\":{\"k\" {}}}", 16),
            (b"{\"entries\":{\"k\":{},}}", 19),
            (b"{\"entries\":{\"k\":{\"offset\":12x}}}", 28),
        ];
        for (doc, at) in cases {
            let r = parse_slice(doc, &l);
            assert_eq!(
                syntax_at(r.clone()),
                *at,
                "{:?}",
                String::from_utf8_lossy(doc)
            );
            assert_eq!(
                r,
                parse_chunked(doc, &[1], &l),
                "{:?}",
                String::from_utf8_lossy(doc)
            );
            assert!(serde_json::from_slice::<Value>(doc).is_err() || doc.ends_with(b"x"));
        }
        for doc in [
            &b"[]"[..],
            b"[1",
            b"\"s\"",
            b"1",
            b"-1",
            b"true",
            b"null",
            b" [[[[",
        ] {
            assert_eq!(parse_slice(doc, &l), Err(JsonError::NotAnObject));
        }
    }

    /// Python's `int()` takes at most 4300 digits, so `json.loads` (LMCache's loader) refuses a
    /// longer integer; a float's digits are not limited.
    #[test]
    fn an_integer_longer_than_python_takes_is_an_error() {
        let l = JsonLimits::default();
        let digits = |n: usize| "1".repeat(n);
        for (n, where_) in [(MAX_INT_DIGITS, "x"), (MAX_INT_DIGITS, "entries")] {
            let doc = if where_ == "x" { format!("{{\"x\":-{}}}", digits(n)) } else { format!("{{\"entries\":{{\"k\":{{\"offset\":{}}}}}}}", digits(n)) };
            assert!(parse_slice(doc.as_bytes(), &l).is_ok(), "{n} digits in {where_}");
            let doc = doc.replacen('1', "11", 1);
            let at = syntax_at(parse_slice(doc.as_bytes(), &l));
            assert_eq!(at as usize, doc.len() - if where_ == "x" { 1 } else { 3 }, "{} digits in {where_}", n + 1);
            // Read in small pieces, the digits span refills.
            assert_eq!(syntax_at(parse_chunked(doc.as_bytes(), &[7, 1, 300], &l)), at);
        }
        let float = format!("{{\"x\":{}.5,\"y\":1{}e0,\"z\":0.{}}}", digits(5000), "0".repeat(5000), digits(5000));
        assert!(parse_slice(float.as_bytes(), &l).is_ok());
    }

    #[test]
    fn odd_but_valid_documents() {
        let l = JsonLimits::default();
        let ok: &[&[u8]] = &[
            b"{}",
            b" \t\r\n{ \t\r\n} \t\r\n",
            b"{\"entries\":{}}",
            b"{\"entries\":[]}",
            b"{\"entries\":null}",
            b"{\"entries\":\"x\",\"other\":[{},[],{\"a\":[true,false,null,-0.5e-7,\"\"]}]}",
            b"{\"\":{\"\":[]}}",
        ];
        for doc in ok {
            let (meta, e) = parse_slice(doc, &l)
                .unwrap_or_else(|err| panic!("{:?}: {err}", String::from_utf8_lossy(doc)));
            assert!(e.is_empty());
            assert_eq!(meta.bytes, doc.len() as u64);
        }
        // Pretty-printed, fields in any order, unknown fields, non-object entry values.
        let doc = br#"
            { "x": {"nested": [1, {"y": null}]},
              "entries": {
                "a": { "shape": [2, 4, [5]], "size": 10, "junk": {"offset": 99}, "offset": 4096 },
                "b": null,
                "c": [1, 2],
                "d": { "offset": 1, "offset": 2 }
              },
              "device_path": "/dev/ublkb1",
              "version": 2
            }"#;
        let (meta, e) = parse_slice(doc, &l).unwrap();
        assert_eq!(
            e,
            vec![
                ("a".into(), Some(4096), Some(10)),
                ("b".into(), None, None),
                ("c".into(), None, None),
                ("d".into(), Some(2), None),
            ]
        );
        assert_eq!(meta.entries, 4);
        assert_eq!(meta.device_path.as_deref(), Some("/dev/ublkb1"));
        assert_eq!(meta.version, Some(2));
        // Duplicates: top-level last wins; duplicate entry keys are all reported.
        let doc = br#"{"version":1,"version":"x","entries":{"k":{"size":1},"k":{"size":2}}}"#;
        let (meta, e) = parse_slice(doc, &l).unwrap();
        assert_eq!(meta.version, None);
        assert_eq!(
            e,
            vec![("k".into(), None, Some(1)), ("k".into(), None, Some(2))]
        );
    }

    // ---- limits -------------------------------------------------------------------------------

    #[test]
    fn a_million_brackets_is_too_deep_without_stack_overflow() {
        let l = JsonLimits::default();
        let prefix = br#"{"entries":{"k":{"shape":"#;
        let mut doc = prefix.to_vec();
        doc.extend(std::iter::repeat_n(b'[', 1_000_000));
        // top 1, entries 2, entry 3: the 30th '[' would be depth 33.
        assert_eq!(
            parse_slice(&doc, &l),
            Err(JsonError::TooDeep {
                at: prefix.len() as u64 + 29
            })
        );
        let mut doc = b"{\"x\":".to_vec();
        for _ in 0..1_000_000 {
            doc.extend_from_slice(b"{\"a\":");
        }
        // `{"x":{` is depth 2 at byte 5; each `{"a":` is 5 bytes deeper, depth 33 is the 32nd.
        assert_eq!(
            parse_slice(&doc, &l),
            Err(JsonError::TooDeep { at: 5 + 31 * 5 })
        );
        let doc = vec![b'['; 1_000_000];
        assert_eq!(parse_slice(&doc, &l), Err(JsonError::NotAnObject));
        // Depth 32 is accepted, 33 is not.
        let nest = |n: usize| {
            let mut d = b"{\"x\":".to_vec();
            d.extend(std::iter::repeat_n(b'[', n));
            d.extend(std::iter::repeat_n(b']', n));
            d.push(b'}');
            d
        };
        assert!(parse_slice(&nest(31), &l).is_ok());
        assert_eq!(
            parse_slice(&nest(32), &l),
            Err(JsonError::TooDeep { at: 5 + 31 })
        );
    }

    #[test]
    fn max_depth_applies_to_the_checkpoint_levels_too() {
        let doc = br#"{"entries":{"k":{"shape":[1],"offset":3},"n":null}}"#;
        let with = |d| {
            parse_slice(
                doc,
                &JsonLimits {
                    max_depth: d,
                    ..JsonLimits::default()
                },
            )
        };
        assert!(with(4).is_ok());
        assert_eq!(with(3), Err(JsonError::TooDeep { at: 25 }));
        assert_eq!(with(2), Err(JsonError::TooDeep { at: 16 }));
        assert_eq!(with(1), Err(JsonError::TooDeep { at: 11 }));
        assert_eq!(with(0), Err(JsonError::TooDeep { at: 0 }));
        let l2 = JsonLimits {
            max_depth: 2,
            ..JsonLimits::default()
        };
        let (_, e) = parse_slice(br#"{"entries":{"k":null}}"#, &l2).unwrap();
        assert_eq!(e, vec![("k".into(), None, None)]);
    }

    #[test]
    fn strings_longer_than_the_limit() {
        let l = JsonLimits {
            max_string_bytes: 100,
            ..JsonLimits::default()
        };
        let key = |n: usize| entry_doc(&"k".repeat(n));
        assert_eq!(
            parse_slice(key(100).as_bytes(), &l).unwrap().1[0].0.len(),
            100
        );
        assert_eq!(
            parse_slice(key(101).as_bytes(), &l),
            Err(JsonError::StringTooLong { at: 12 })
        );
        assert_eq!(
            parse_slice(key(1 << 20).as_bytes(), &l),
            Err(JsonError::StringTooLong { at: 12 })
        );
        // Decoded bytes count: 50 x \u00e9 is 100 bytes, 51 is 102.
        assert!(parse_slice(entry_doc(&r"\u00e9".repeat(50)).as_bytes(), &l).is_ok());
        assert_eq!(
            parse_slice(entry_doc(&r"\u00e9".repeat(51)).as_bytes(), &l),
            Err(JsonError::StringTooLong { at: 12 })
        );
        // Names and kept string values are limited; skipped values are not buffered at all.
        let long = "x".repeat(101);
        let doc = format!("{{\"device_path\":\"{long}\"}}");
        assert_eq!(
            parse_slice(doc.as_bytes(), &l),
            Err(JsonError::StringTooLong { at: 15 })
        );
        let doc = format!("{{\"{long}\":1}}");
        assert_eq!(
            parse_slice(doc.as_bytes(), &l),
            Err(JsonError::StringTooLong { at: 1 })
        );
        let doc = format!(
            "{{\"entries\":{{\"k\":{{\"dtype\":\"{}\",\"size\":1}}}}}}",
            "y".repeat(1 << 20)
        );
        assert_eq!(
            parse_slice(doc.as_bytes(), &l).unwrap().1,
            vec![("k".into(), None, Some(1))]
        );
        // Same through a streaming reader (string spans many refills).
        assert_eq!(
            parse_chunked(key(5000).as_bytes(), &[7], &l),
            Err(JsonError::StringTooLong { at: 12 })
        );
    }

    #[test]
    fn payload_limit() {
        let (payload, _) = lmcache_like_payload(50);
        let len = payload.len() as u64;
        let lim = |n| JsonLimits {
            max_payload_bytes: n,
            ..JsonLimits::default()
        };
        assert!(parse_slice(&payload, &lim(len)).is_ok());
        assert_eq!(
            parse_slice(&payload, &lim(len - 1)),
            Err(JsonError::TooLarge { limit: len - 1 })
        );
        assert_eq!(
            parse_chunked(&payload, &[5], &lim(100)),
            Err(JsonError::TooLarge { limit: 100 })
        );
        assert_eq!(
            parse_slice(b"", &lim(0)),
            Err(JsonError::Syntax {
                at: 0,
                what: "empty payload"
            })
        );
        assert_eq!(
            parse_slice(b"{}", &lim(1)),
            Err(JsonError::TooLarge { limit: 1 })
        );
        // Padding counts: the reader must be limited to what the caller is willing to read.
        let mut padded = payload.clone();
        padded.extend_from_slice(&[b' '; 10]);
        assert_eq!(
            parse_slice(&padded, &lim(len + 5)),
            Err(JsonError::TooLarge { limit: len + 5 })
        );
        // The outcome does not depend on how the reader chunks: an error inside the first
        // `limit` bytes wins over TooLarge, however much the reader hands out at once.
        let doc = b"{\"entries\":{1:2}}                                                   ";
        let want = Err(JsonError::Syntax {
            at: 12,
            what: "expected member name or '}'",
        });
        for chunks in [&[1usize][..], &[4], &[64], &[1 << 16]] {
            assert_eq!(parse_chunked(doc, chunks, &lim(20)), want, "{chunks:?}");
        }
        assert_eq!(parse_slice(doc, &lim(20)), want);
        assert_eq!(
            parse_slice(doc, &lim(12)),
            Err(JsonError::TooLarge { limit: 12 })
        );
        // An endless reader stops at the limit, having read at most limit + 1 bytes.
        let endless = io::Read::chain(&b"{}"[..], io::repeat(b'\n'));
        let r = collect(|cb| parse_checkpoint_json(endless, &lim(1 << 20), cb));
        assert_eq!(r, Err(JsonError::TooLarge { limit: 1 << 20 }));
        let endless = io::Read::chain(&b"{\"a\":["[..], io::repeat(b' '));
        assert_eq!(
            collect(|cb| parse_checkpoint_json(endless, &lim(1 << 20), cb)),
            Err(JsonError::TooLarge { limit: 1 << 20 })
        );
    }

    // ---- reader and callback behaviour --------------------------------------------------------

    struct Flaky<'a> {
        data: &'a [u8],
        calls: u32,
        fail_after: usize,
    }

    impl Read for Flaky<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls % 2 == 1 {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "signal"));
            }
            if self.fail_after == 0 {
                return Err(io::Error::other("device gone"));
            }
            let n = buf.len().min(self.data.len()).min(self.fail_after).min(3);
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            self.fail_after -= n;
            Ok(n)
        }
    }

    #[test]
    fn io_errors_and_interrupts() {
        let (payload, expected) = lmcache_like_payload(20);
        let l = JsonLimits::default();
        let r = collect(|cb| {
            parse_checkpoint_json(
                Flaky {
                    data: &payload,
                    calls: 0,
                    fail_after: usize::MAX,
                },
                &l,
                cb,
            )
        });
        assert_eq!(r.unwrap().1, expected);
        let r = collect(|cb| {
            parse_checkpoint_json(
                Flaky {
                    data: &payload,
                    calls: 0,
                    fail_after: 100,
                },
                &l,
                cb,
            )
        });
        assert_eq!(r, Err(JsonError::Io("device gone".into())));
    }

    #[test]
    fn callback_can_abort() {
        let (payload, _) = lmcache_like_payload(10);
        let mut seen = 0;
        let r = parse_checkpoint_slice(&payload, &JsonLimits::default(), &mut |e| {
            seen += 1;
            if seen == 3 {
                Err(format!("stop at {}", e.key.len()))
            } else {
                Ok(())
            }
        });
        assert!(
            matches!(r, Err(JsonError::Aborted(ref m)) if m.starts_with("stop at ")),
            "{r:?}"
        );
        assert_eq!(seen, 3);
    }

    #[test]
    fn errors_display() {
        let errs = [
            JsonError::Io("x".into()),
            JsonError::Syntax {
                at: 3,
                what: "expected value",
            },
            JsonError::TooDeep { at: 1 },
            JsonError::StringTooLong { at: 2 },
            JsonError::TooLarge { limit: 9 },
            JsonError::NotAnObject,
            JsonError::Aborted("why".into()),
        ];
        for e in errs {
            let s = e.to_string();
            assert!(s.starts_with("checkpoint JSON: "), "{s}");
            let _: &dyn std::error::Error = &e;
        }
    }

    // ---- property tests against serde_json ------------------------------------------------------

    fn arb_string() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z0-9@%/._:-]{0,24}",
            any::<String>(),
            prop::collection::vec(
                prop_oneof![
                    Just('"'),
                    Just('\\'),
                    Just('/'),
                    Just('\u{0}'),
                    Just('\u{1f}'),
                    Just('\u{7f}'),
                    Just('\u{e9}'),
                    Just('\u{4e2d}'),
                    Just('\u{1F600}'),
                    Just('\u{10FFFF}'),
                    Just('\u{FFFF}'),
                    any::<char>(),
                ],
                0..10
            )
            .prop_map(|v| v.into_iter().collect()),
        ]
    }

    fn arb_number() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<u64>().prop_map(Value::from),
            (0u64..100_000).prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            Just(Value::from(u64::MAX)),
            Just(Value::from(0.0)),
        ]
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            arb_number(),
            arb_string().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 24, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map(arb_string(), inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_entry() -> impl Strategy<Value = Value> {
        let field = || prop::option::of(prop_oneof![3 => arb_number(), 1 => arb_value()]);
        prop_oneof![
            4 => (field(), field(), prop::collection::btree_map(arb_string(), arb_value(), 0..4), any::<bool>())
                .prop_map(|(offset, size, extra, lmcache_fields)| {
                    let mut m = Map::new();
                    for (k, v) in extra {
                        m.insert(k, v);
                    }
                    if let Some(v) = offset {
                        m.insert("offset".into(), v);
                    }
                    if let Some(v) = size {
                        m.insert("size".into(), v);
                    }
                    if lmcache_fields {
                        m.insert("shape".into(), serde_json::json!([2, 4, 256, 64]));
                        m.insert("dtype".into(), "bfloat16".into());
                        m.insert("fmt".into(), "KV_2LTD".into());
                        m.insert("cached_positions".into(), Value::Null);
                    }
                    Value::Object(m)
                }),
            1 => arb_value(),
        ]
    }

    const U64_FIELDS: [&str; 9] = [
        "version",
        "capacity_bytes",
        "block_align",
        "header_bytes",
        "slot_bytes",
        "meta_total_bytes",
        "meta_version",
        "data_base_offset",
        "next_slot",
    ];

    fn arb_doc() -> impl Strategy<Value = Value> {
        (
            prop::collection::vec(
                prop::option::of(prop_oneof![3 => arb_number(), 1 => arb_value()]),
                9,
            ),
            prop::collection::vec(
                prop::option::of(
                    prop_oneof![3 => arb_string().prop_map(Value::String), 1 => arb_value()],
                ),
                2,
            ),
            prop_oneof![
                8 => prop::collection::btree_map(arb_string(), arb_entry(), 0..12)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                1 => arb_value(),
            ],
            prop::collection::btree_map(arb_string(), arb_value(), 0..3),
            any::<bool>(),
        )
            .prop_map(|(nums, strs, entries, extra, has_entries)| {
                let mut m = Map::new();
                for (k, v) in extra {
                    m.insert(k, v);
                }
                for (k, v) in U64_FIELDS.iter().zip(nums) {
                    if let Some(v) = v {
                        m.insert((*k).into(), v);
                    }
                }
                for (k, v) in ["device_path", "meta_magic"].iter().zip(strs) {
                    if let Some(v) = v {
                        m.insert((*k).into(), v);
                    }
                }
                if has_entries {
                    m.insert("entries".into(), entries);
                }
                Value::Object(m)
            })
    }

    fn arb_style() -> impl Strategy<Value = Option<Style>> {
        prop_oneof![
            Just(None), // serde_json's own compact writer
            (
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                prop::sample::select(vec!["", " ", "\n  ", "\t\r\n"])
            )
                .prop_map(|(ascii, escape_slash, upper_hex, escape_all, ws)| Some(
                    Style {
                        ascii,
                        escape_slash,
                        upper_hex,
                        escape_all,
                        ws
                    }
                )),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn prop_agrees_with_serde_json(
            doc in arb_doc(),
            style in arb_style(),
            chunks in prop::collection::vec(1usize..12, 1..4),
            pad in 0usize..9,
            pad_byte in prop::sample::select(vec![b'\t', b' ', b'\n']),
        ) {
            let mut bytes = match style {
                None => serde_json::to_vec(&doc).unwrap(),
                Some(st) => to_text(&doc, st),
            };
            let text_len = bytes.len() as u64;
            // Our hand-written serialiser must be read back by serde_json to the same checkpoint
            // (floats too: the tests' serde_json rounds them correctly, `float_roundtrip`).
            let back: Value = serde_json::from_slice(&bytes).unwrap();
            prop_assert_eq!(oracle_entries(&back), oracle_entries(&doc));
            prop_assert_eq!(oracle_meta(&back, 0), oracle_meta(&doc, 0));
            bytes.extend(std::iter::repeat_n(pad_byte, pad));
            let l = JsonLimits::default();
            let (meta, entries) = parse_slice(&bytes, &l).unwrap();
            prop_assert_eq!(&entries, &oracle_entries(&doc));
            // Compact text: the entries object is exactly serde_json's rendering of it.
            if style.is_none() {
                let want = doc.get("entries").filter(|e| e.is_object()).map_or(0, |e| serde_json::to_vec(e).unwrap().len() as u64);
                prop_assert_eq!(meta.entries_bytes, want);
            }
            let mut want = oracle_meta(&doc, text_len + pad as u64);
            want.entries_bytes = meta.entries_bytes;
            prop_assert_eq!(&meta, &want);
            prop_assert_eq!(parse_chunked(&bytes, &chunks, &l), Ok((meta, entries)));
        }

        #[test]
        fn prop_mutations_never_panic_and_accepted_means_oracle_agrees(
            doc in arb_doc(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), 0u8..3, any::<u8>()), 1..6),
            chunks in prop::collection::vec(1usize..12, 1..4),
        ) {
            let mut bytes = to_text(&doc, PY);
            for (at, op, b) in edits {
                let i = at.index(bytes.len() + 1);
                match op {
                    0 if i < bytes.len() => bytes[i] = b,
                    1 if i < bytes.len() => { bytes.remove(i); }
                    _ => bytes.insert(i, b),
                }
            }
            let l = JsonLimits::default();
            let ours = parse_slice(&bytes, &l);
            prop_assert_eq!(&ours, &parse_chunked(&bytes, &chunks, &l));
            if let Ok(Value::Object(_)) = serde_json::from_slice::<Value>(&bytes) {
                let ours = ours.unwrap();
                assert_agrees_with_oracle(&bytes, &ours);
            }
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(
            bytes in prop::collection::vec(any::<u8>(), 0..256),
            prefix in prop::sample::select(vec![&b""[..], b"{", b"{\"entries\":{", b"{\"entries\":{\"k\":{\"offset\":"]),
            chunks in prop::collection::vec(1usize..12, 1..4),
        ) {
            let mut doc = prefix.to_vec();
            doc.extend_from_slice(&bytes);
            let l = JsonLimits { max_depth: 6, max_string_bytes: 16, max_payload_bytes: 200 };
            let ours = parse_slice(&doc, &l);
            prop_assert_eq!(&ours, &parse_chunked(&doc, &chunks, &l));
            if let Ok((meta, _)) = ours {
                prop_assert_eq!(meta.bytes, doc.len() as u64);
            }
        }
    }
}
