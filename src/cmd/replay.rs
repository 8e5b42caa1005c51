//! `fdpblk replay`: drives the engine core with a trace of block requests into the simulated
//! drive and reports per-class counts, slot identities seen, and bytes per placement handle.
//!
//! Two trace formats, told apart per file (or chosen with `--format`):
//! - JSON lines, one request each:
//!   `{"op":"write|read|flush|discard|write_zeroes","offset":N,"len":N,"data_hex":"<first bytes>"}`.
//!   `data_hex` is optional and may hold only a prefix of the written bytes: a slot header is
//!   recognised when its first 24 bytes are present.
//! - blkparse's default text output ([`crate::blkparse`]), one event kind per I/O
//!   (`--blk-event`, default `D`). A blktrace records sector ranges and no data: the classes
//!   come from the geometry alone, but no slot header can be read, so no identity is known
//!   and policies that place by identity fall back (the report says so).

use super::CmdResult;
use crate::blkparse::{parse_line, BlkAction, BoundedLines};
use crate::classify::{ExtentKind, Op};
use crate::cli::ReplayArgs;
use crate::device::open_readonly;
use crate::engine::sim::SimEngine;
use crate::layout::discover::{discover, DiscoverError};
use crate::layout::{Geometry, GeometryConfig};
use crate::pipeline::{class_report, HeaderWait, Pipeline, Request, Segment};
use crate::place::{policy_by_name, POLICY_NAMES};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// One parsed trace line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    pub data: Vec<u8>,
}

/// Parses one JSON-lines trace record; errors say what is wrong with it.
pub fn parse_trace_line(line: &str) -> Result<TraceRequest, String> {
    let v: Value = serde_json::from_str(line)
        .map_err(|e| format!("not JSON: {e} (a trace of blkparse's text takes --format blkparse or auto; a JSON-lines trace has one object per line, without a byte-order mark)"))?;
    // A misspelt field would be dropped in silence (a "datahex" losing the bytes a header's
    // classification needs).
    const FIELDS: [&str; 4] = ["op", "offset", "len", "data_hex"];
    if let Some(k) = v.as_object().and_then(|o| o.keys().find(|k| !FIELDS.contains(&k.as_str()))) {
        return Err(format!("unknown field \"{k}\" (a record has {})", FIELDS.join(", ")));
    }
    // JSON takes a field named twice at its last value, in silence. Counting the quoted name in
    // the text is exact here: no value of a record that passes the checks below holds a quote.
    if let Some(k) = FIELDS.iter().find(|k| line.matches(&format!("\"{k}\"")).count() > 1) {
        return Err(format!("\"{k}\" is given twice (a record names each field once)"));
    }
    let op_name = v.get("op").and_then(Value::as_str).ok_or("missing \"op\"")?;
    let op = Op::parse(op_name).ok_or_else(|| format!("unknown op \"{op_name}\" (write, read, flush, discard, write_zeroes)"))?;
    let num = |k: &str| -> Result<u64, String> {
        match v.get(k) {
            None if op == Op::Flush => Ok(0),
            None => Err(format!("missing \"{k}\"")),
            Some(n) => n.as_u64().ok_or_else(|| format!("\"{k}\" is not a non-negative integer")),
        }
    };
    let (offset, len) = (num("offset")?, num("len")?);
    offset.checked_add(len).ok_or("offset + len overflows")?;
    let data = match v.get("data_hex").and_then(Value::as_str) {
        None => Vec::new(),
        Some(h) => {
            if h.len() % 2 != 0 || (h.len() / 2) as u64 > len {
                return Err("\"data_hex\" must be an even number of hex digits, at most len bytes".into());
            }
            decode_hex(h).ok_or("\"data_hex\" is not hexadecimal")?
        }
    };
    Ok(TraceRequest { op, offset, len, data })
}

fn decode_hex(h: &str) -> Option<Vec<u8>> {
    let b = h.as_bytes();
    b.chunks(2)
        .map(|p| {
            let d = |c: u8| (c as char).to_digit(16);
            Some((d(p[0])? * 16 + d(p[1])?) as u8)
        })
        .collect()
}

/// What a replay found.
#[derive(Debug)]
pub struct ReplayReport {
    pub geometry: Geometry,
    pub policy: &'static str,
    pub requests: u64,
    pub errors: u64,
    /// The distinct slot identities seen, the first [`MAX_IDENTITIES`] of them.
    pub identities: BTreeSet<u64>,
    /// More distinct identities came than were kept.
    pub identities_capped: bool,
    pub pipeline: crate::pipeline::PipelineStats,
    pub engine: crate::engine::sim::SimCounters,
    /// `--ssd`: the SSD model's counters and WAF.
    pub ssd: Option<Value>,
}

impl ReplayReport {
    pub fn to_json(&self) -> Value {
        let classes: serde_json::Map<String, Value> = class_report(&self.pipeline)
            .into_iter()
            .map(|(c, n)| (c.name().to_string(), json!({"requests": n.requests, "bytes": n.bytes})))
            .collect();
        let handles: serde_json::Map<String, Value> =
            self.engine.bytes_by_handle.iter().map(|(h, b)| (h.to_string(), json!(b))).collect();
        let ops: serde_json::Map<String, Value> = self
            .pipeline
            .to_json()["ops"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        json!({
            "geometry": self.geometry.to_json(),
            "policy": self.policy,
            "requests": self.requests,
            "errors": self.errors,
            "classes": classes,
            "ops": ops,
            "identities": self.identities.iter().collect::<Vec<_>>(),
            "identities_capped": self.identities_capped,
            "handles": handles,
            "payload_fallbacks": self.pipeline.payload_fallbacks,
            "ssd": self.ssd,
        })
    }
}

/// Distinct slot identities a replay keeps (tens of MiB at most, and as many numbers in
/// `--json`): a day-long trace of LMCache's puts carries millions of keys, each seen once.
pub const MAX_IDENTITIES: usize = 1 << 20;

/// Adds `id` to `kept` while it holds fewer than `cap`; past that, a new one sets `capped`.
fn keep_identity(kept: &mut BTreeSet<u64>, capped: &mut bool, id: u64, cap: usize) {
    if kept.len() < cap {
        kept.insert(id);
    } else if !kept.contains(&id) {
        *capped = true;
    }
}

/// The largest read or write a trace may hold: far above any block request (the kernel splits
/// at max_sectors_kb, a few MiB), so only a damaged trace has larger ones.
const MAX_IO_BYTES: u64 = 1 << 30;
/// A read or write past [`MAX_IO_BYTES`]: why the trace is damaged. Checked when a trace
/// file is scanned (naming its line) and again for requests handed to [`replay_into`]
/// directly, before anything is sized by them.
fn oversized(t: &TraceRequest) -> Option<String> {
    (matches!(t.op, Op::Write | Op::Read) && t.len > MAX_IO_BYTES).then(|| {
        format!("a {} of {} bytes; no block request moves more than {MAX_IO_BYTES} bytes, so the trace is damaged", t.op.name(), t.len)
    })
}
/// Reads are replayed in pieces of this size.
const READ_PIECE: u64 = 1 << 20;

/// Replays parsed requests through a pipeline with `policy` into a simulated drive.
pub fn replay(geometry: Geometry, policy: &str, size: u64, trace: impl IntoIterator<Item = TraceRequest>) -> Result<ReplayReport, String> {
    replay_into(geometry, policy, size, trace, None)
}

/// `replay`, with the placed writes also run into the SSD model when `ssd` is given.
pub fn replay_into(
    geometry: Geometry,
    policy: &str,
    size: u64,
    trace: impl IntoIterator<Item = TraceRequest>,
    mut ssd: Option<crate::sim::dev::TraceSsd>,
) -> Result<ReplayReport, String> {
    let p = policy_by_name(policy)
        .ok_or_else(|| format!("unknown policy \"{policy}\"; choose one of {}", POLICY_NAMES.join(", ")))?;
    let handles = p.handles();
    let mut pipeline = Pipeline::new(geometry, p);
    let mut engine = SimEngine::new(size, handles);
    let mut identities = BTreeSet::new();
    let mut identities_capped = false;
    let (mut requests, mut errors) = (0u64, 0u64);
    let mut segments: Vec<Segment> = Vec::new();
    let mut read_buf = Vec::new();
    for t in trace {
        requests += 1;
        if let Some(why) = oversized(&t) {
            return Err(format!("request {requests}: {why}"));
        }
        // Past the device: the drive would refuse it, and planning a huge discard there
        // would go through it a slot's worth at a time.
        if t.op != Op::Flush && t.offset.checked_add(t.len).is_none_or(|end| end > size) {
            errors += 1;
            continue;
        }
        let req = Request { op: t.op, offset: t.offset, len: t.len, data: Some(&t.data) };
        segments.clear();
        for e in pipeline.plan(&req, &mut segments, HeaderWait::Expired).unwrap_or(&[]) {
            if let ExtentKind::SlotHeader { header: crate::classify::Parsed::Valid(h), .. } = e.kind {
                keep_identity(&mut identities, &mut identities_capped, h.identity, MAX_IDENTITIES);
            }
        }
        let res = match t.op {
            Op::Write => segments.iter().try_for_each(|s| {
                let rel = (s.offset - t.offset) as usize;
                let bytes = t.data.get(rel..(rel + s.len as usize).min(t.data.len())).unwrap_or(&[]);
                crate::engine::Engine::write(&mut engine, s.offset, s.len, bytes, s.handle)
            }),
            Op::Read => {
                // In pieces through one buffer: a trace's reads are only counted and checked.
                read_buf.resize(t.len.min(READ_PIECE) as usize, 0);
                (0..t.len).step_by(READ_PIECE as usize).try_for_each(|at| {
                    let n = (t.len - at).min(READ_PIECE) as usize;
                    crate::engine::Engine::read(&mut engine, t.offset + at, &mut read_buf[..n])
                })
            }
            Op::Flush => crate::engine::Engine::flush(&mut engine),
            Op::Discard => crate::engine::Engine::discard(&mut engine, t.offset, t.len),
            Op::WriteZeroes => crate::engine::Engine::write_zeroes(&mut engine, t.offset, t.len),
        };
        // As the daemon does (`Pipeline::execute`): a write's headers completed, and the
        // checkpoint containers it changed landed (a failed one may have partly).
        if t.op == Op::Write && res.is_ok() {
            pipeline.completed();
        } else {
            pipeline.slots().containers_written(pipeline.planned_containers());
        }
        if let (Some(d), true) = (&mut ssd, res.is_ok()) {
            let r = match t.op {
                Op::Write => segments.iter().try_for_each(|s| d.write(*s)),
                Op::Discard | Op::WriteZeroes => d.deallocate(t.offset, t.len),
                _ => Ok(()),
            };
            r.map_err(|e| format!("simulated SSD: {e}"))?;
        }
        if res.is_err() {
            errors += 1;
        }
    }
    Ok(ReplayReport {
        geometry,
        policy: pipeline.policy().name(),
        requests,
        errors,
        identities,
        identities_capped,
        pipeline: pipeline.stats(),
        engine: engine.counters,
        ssd: match &mut ssd {
            Some(d) => Some(d.finish().map_err(|e| format!("simulated SSD: {e}"))?),
            None => None,
        },
    })
}

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormat {
    /// JSON lines when the first non-blank character is `{`, else blkparse.
    Auto,
    Json,
    Blkparse,
}

/// What reading a trace found, besides its requests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceInfo {
    /// `json` or `blkparse`.
    pub format: &'static str,
    pub lines: usize,
    /// blkparse: the event kind taken.
    pub event: Option<BlkAction>,
    /// blkparse: event lines of any kind and device.
    pub events: u64,
    /// blkparse: events taken (each gives one request, or two for a write with a pre-flush).
    pub taken: u64,
    /// blkparse: completions of the taken kind with a non-zero error, not replayed.
    pub failed: u64,
    /// blkparse: events of the taken kind that stand for no block request (a passthrough
    /// command, a range that overflows), with the first one's line.
    pub unusable: u64,
    pub first_unusable: Option<(usize, &'static str)>,
    /// blkparse: lines that are not events (summaries, messages, garbage).
    pub other_lines: u64,
    /// blkparse: the devices of the events taken.
    pub devices: Vec<(u32, u32)>,
    /// Whether any write carried data bytes (never for blkparse).
    pub carries_data: bool,
    /// A hash of every request given (op, offset, length, data), so that a trace rewritten
    /// between replay's two reads is told apart even where its line count stays.
    pub digest: u64,
}

impl TraceInfo {
    pub fn to_json(&self) -> Value {
        let mut v = json!({"format": self.format, "lines": self.lines, "carries_data": self.carries_data});
        if let Some(e) = self.event {
            let devices: Vec<String> = self.devices.iter().map(|(a, b)| format!("{a},{b}")).collect();
            v["event"] = json!(e.letter());
            v["events"] = json!(self.events);
            v["taken"] = json!(self.taken);
            v["failed_completions"] = json!(self.failed);
            v["unusable"] = json!(self.unusable);
            v["other_lines"] = json!(self.other_lines);
            v["devices"] = json!(devices);
        }
        v
    }
}

/// What a trace without data lets replay tell, for `policy`.
pub fn no_data_note(policy: &str) -> String {
    let placement = match policy {
        "key-aware" => "key-aware places slots by identity and its reads, so here it puts every slot on handle 0 (young), \
                        as --policy none would: this is not key-aware's placement or WAF",
        "lmcache-fdp" => "lmcache-fdp places slots by the tenant of an identity, so here it puts every slot on handle 0 \
                          (no directive)",
        _ => "this policy places by position only, so its placement is the one the device would make",
    };
    format!(
        "the trace carries no data (a blktrace records only sector ranges): classes and bytes follow from the geometry, \
         but no slot header can be read, so no slot identity is known and every slot payload counts as a payload \
         fallback; {placement}"
    )
}

fn open_trace(path: &Path) -> Result<BufReader<Box<dyn Read>>, String> {
    let reader: Box<dyn Read> = if path.as_os_str() == "-" {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(path).map_err(|e| format!("cannot open trace {}: {e}", path.display()))?)
    };
    Ok(BufReader::with_capacity(1 << 16, reader))
}

/// Skips leading whitespace; returns the first other byte (not consumed) and the newlines
/// skipped.
fn first_byte(r: &mut impl BufRead) -> Result<(Option<u8>, usize), String> {
    let mut newlines = 0;
    loop {
        let buf = r.fill_buf().map_err(|e| format!("reading trace: {e}"))?;
        if buf.is_empty() {
            return Ok((None, newlines));
        }
        match buf.iter().position(|c| !c.is_ascii_whitespace()) {
            Some(p) => {
                newlines += buf[..p].iter().filter(|&&c| c == b'\n').count();
                let c = buf[p];
                r.consume(p);
                return Ok((Some(c), newlines));
            }
            None => {
                let n = buf.len();
                newlines += buf.iter().filter(|&&c| c == b'\n').count();
                r.consume(n);
            }
        }
    }
}

/// Which blkparse events a replay takes, and where they are.
#[derive(Clone, Copy, Debug)]
pub struct BlkFilter {
    /// The event taken for each I/O.
    pub event: BlkAction,
    /// Only this device's events (MAJ,MIN).
    pub device: Option<(u32, u32)>,
    /// Sectors subtracted from every request: a partition's start, since blktrace reports a
    /// partition's I/O in whole-disk sectors.
    pub sector_offset: u64,
    /// The partition's size in bytes, where known (`--device-size` with `--sector-offset`).
    pub partition_bytes: Option<u64>,
}

impl BlkFilter {
    fn of(a: &ReplayArgs) -> BlkFilter {
        BlkFilter { event: a.blk_event, device: a.blk_device, sector_offset: a.sector_offset, partition_bytes: a.device_size.filter(|_| a.sector_offset > 0) }
    }
}

/// Reads a trace in the format `format` (`Auto`: told by its first non-blank character),
/// all of it in memory.
pub fn read_trace_from(r: impl BufRead, format: TraceFormat, blk: BlkFilter) -> Result<(Vec<TraceRequest>, TraceInfo), String> {
    let mut out = Vec::new();
    let info = visit_trace(r, format, blk, &mut |t| {
        out.push(t);
        Ok(())
    })?;
    Ok((out, info))
}

/// Reads a trace request by request, handing each to `each` (whose error stops the read);
/// returns what it found. A trace that turns out unusable at its end (several blkparse
/// devices, no usable event) is an error after its requests went to `each`.
pub fn visit_trace(
    mut r: impl BufRead,
    format: TraceFormat,
    blk: BlkFilter,
    each: &mut dyn FnMut(TraceRequest) -> Result<(), String>,
) -> Result<TraceInfo, String> {
    let (first, skipped) = first_byte(&mut r)?;
    let json = match format {
        TraceFormat::Json => true,
        TraceFormat::Blkparse => false,
        TraceFormat::Auto => first == Some(b'{'),
    };
    if first.is_none() {
        return Err("the trace is empty: give a JSON-lines trace or blkparse's output (see tools/trace/capture-blktrace.sh)".into());
    }
    // Fixed keys (`new`): the same requests give the same digest in both reads.
    let mut digest = std::hash::DefaultHasher::new();
    let mut each = |t: TraceRequest| {
        use std::hash::Hash;
        (t.op, t.offset, t.len, &t.data).hash(&mut digest);
        each(t)
    };
    let mut info = visit_format(r, json, skipped, blk, &mut each)?;
    use std::hash::Hasher;
    info.digest = digest.finish();
    Ok(info)
}

fn visit_format(
    r: impl BufRead,
    json: bool,
    skipped: usize,
    blk: BlkFilter,
    each: &mut dyn FnMut(TraceRequest) -> Result<(), String>,
) -> Result<TraceInfo, String> {
    if json {
        let mut carries_data = false;
        let mut lines = skipped;
        // One request per line; a line is bounded so that a file without newlines is an
        // error, not a read of the whole file into memory.
        const MAX_JSON_LINE: usize = 1 << 20;
        let mut reader = BoundedLines::with_limit(r, MAX_JSON_LINE);
        while let Some((i, line, truncated)) = reader.next_line().map_err(|e| format!("reading trace: {e}"))? {
            lines = skipped + i;
            if truncated {
                return Err(format!("trace line {lines}: longer than {MAX_JSON_LINE} bytes; a JSON-lines trace has one request per line, and `data_hex` needs only the first 32 bytes of what was written"));
            }
            if line.trim().is_empty() {
                continue;
            }
            let t = parse_trace_line(&line).map_err(|e| format!("trace line {lines}: {e}"))?;
            if let Some(why) = oversized(&t) {
                return Err(format!("trace line {lines}: {why}"));
            }
            carries_data |= t.op == Op::Write && !t.data.is_empty();
            each(t)?;
        }
        Ok(TraceInfo { format: "json", lines, carries_data, ..Default::default() })
    } else {
        read_blkparse(r, skipped, blk, each)
    }
}

fn dev_name(d: (u32, u32)) -> String {
    format!("{},{}", d.0, d.1)
}

fn read_blkparse(
    r: impl BufRead,
    skipped: usize,
    blk: BlkFilter,
    each: &mut dyn FnMut(TraceRequest) -> Result<(), String>,
) -> Result<TraceInfo, String> {
    let BlkFilter { event, device, sector_offset, partition_bytes } = blk;
    let base = sector_offset.saturating_mul(512);
    const MAX_DEVICES: usize = 64;
    let mut info = TraceInfo { format: "blkparse", event: Some(event), ..Default::default() };
    let mut ops = Vec::new();
    let mut first_other: Option<(usize, &'static str)> = None;
    let mut actions = BTreeSet::new();
    let mut all_devices = BTreeSet::new();
    let mut lines = BoundedLines::new(r);
    while let Some((n, line, truncated)) = lines.next_line().map_err(|e| format!("reading trace: {e}"))? {
        let n = n + skipped;
        info.lines = n;
        // A line cut short could still parse, as a shorter request than the one traced.
        let parsed = if truncated { Err("a line too long for blkparse's output") } else { parse_line(&line) };
        let e = match parsed {
            Ok(e) => e,
            Err(why) => {
                if !line.trim().is_empty() {
                    info.other_lines += 1;
                    first_other.get_or_insert((n, why));
                }
                continue;
            }
        };
        info.events += 1;
        if actions.len() < 64 {
            actions.insert(e.action_str().to_string());
        }
        if all_devices.len() < MAX_DEVICES {
            all_devices.insert(e.device());
        }
        if device.is_some_and(|d| d != e.device()) || !e.is(event) {
            continue;
        }
        if e.error.unwrap_or(0) != 0 {
            info.failed += 1;
            continue;
        }
        if let Err(why) = e.ops(&mut ops) {
            info.unusable += 1;
            info.first_unusable.get_or_insert((n, why));
            continue;
        }
        if ops.is_empty() {
            info.unusable += 1;
            info.first_unusable.get_or_insert((n, "no block request (RWBS N without a flush)"));
            continue;
        }
        // A partition's trace holds whole-disk sectors: before its start is another partition.
        if ops.iter().any(|&(op, offset, _)| op != Op::Flush && offset < base) {
            info.unusable += 1;
            info.first_unusable.get_or_insert((n, "a request before --sector-offset (another partition's)"));
            continue;
        }
        // The kernel's partition filter also lets through a request starting at the next
        // partition's first sector (`sector > end_lba` with end_lba = start + size).
        if let Some(end) = partition_bytes.map(|b| base.saturating_add(b)) {
            if ops.iter().any(|&(op, offset, _)| op != Op::Flush && offset == end) {
                info.unusable += 1;
                info.first_unusable.get_or_insert((n, "a request at the partition's end (the next partition's first sector)"));
                continue;
            }
        }
        // blktrace shows a write-zeroes (`blkdiscard -z`) as a write: one past what any
        // write carries is one, and moves no data.
        if let Some(&(op, _, _)) = ops.iter().find(|&&(op, _, len)| matches!(op, Op::Write | Op::Read) && len > MAX_IO_BYTES) {
            info.unusable += 1;
            info.first_unusable.get_or_insert((
                n,
                if op == Op::Write {
                    "a write larger than any write request (a write-zeroes, which blktrace shows as a write)"
                } else {
                    "a read larger than any block request"
                },
            ));
            continue;
        }
        info.taken += 1;
        if info.devices.len() < MAX_DEVICES && !info.devices.contains(&e.device()) {
            info.devices.push(e.device());
        }
        for &(op, offset, len) in &ops {
            let offset = if op == Op::Flush { offset } else { offset - base };
            each(TraceRequest { op, offset, len, data: Vec::new() })?;
        }
    }
    if info.taken == 0 {
        let hint = "replay reads blkparse's default output (blkparse -i TRACE, no -f; tools/trace/capture-blktrace.sh writes it) \
                    or JSON lines (--format json)";
        if info.events == 0 {
            return Err(match first_other {
                Some((n, why)) => format!("no blkparse events in {} lines of the trace: line {n}: {why}; {hint}", info.lines),
                None => format!("no blkparse events in the trace; {hint}"),
            });
        }
        let names = |s: &BTreeSet<(u32, u32)>| s.iter().map(|&d| dev_name(d)).collect::<Vec<_>>().join(", ");
        if let Some(d) = device.filter(|d| !all_devices.contains(d)) {
            return Err(format!("the trace has no events of device {} (--blk-device); it has {}", dev_name(d), names(&all_devices)));
        }
        let mut why = format!(
            "the trace has {} blkparse events but no usable {} ({}) events",
            info.events,
            event.letter(),
            event.describe()
        );
        if info.failed > 0 {
            why += &format!(" ({} failed completions)", info.failed);
        }
        if let Some((n, w)) = info.first_unusable {
            why += &format!(" (line {n}: {w})");
        }
        let present: Vec<String> = actions.into_iter().collect();
        // The action's events are there but none was usable: another action would not help,
        // the line's reason says what would.
        if info.first_unusable.is_some() && present.iter().any(|a| a == event.letter()) {
            return Err(format!("{why}: none of them could be replayed (--sector-offset, --blk-device and the trace's requests decide which can)"));
        }
        return Err(format!("{why}; actions present: {}; choose one with --blk-event Q|D|C", present.join(" ")));
    }
    if info.devices.len() > 1 && device.is_none() {
        let names: Vec<String> = info.devices.iter().map(|&d| dev_name(d)).collect();
        return Err(format!(
            "the trace has {} events of devices {}: replay one device at a time with --blk-device MAJ,MIN",
            event.letter(),
            names.join(" and ")
        ));
    }
    Ok(info)
}

/// The smallest device holding every slot the trace reaches: its furthest byte rounded up to
/// the end of its slot (a slot's last request, a partial chunk's payload, ends before it).
fn inferred_device_size(furthest: u64, slot_bytes: u64, meta_total_bytes: u64) -> u64 {
    match furthest.checked_sub(meta_total_bytes) {
        Some(past) if slot_bytes > 0 => past.div_ceil(slot_bytes).saturating_mul(slot_bytes).saturating_add(meta_total_bytes),
        _ => furthest,
    }
}

/// The furthest byte a request (other than a flush) reaches.
fn furthest_byte(furthest: &mut u64, t: &TraceRequest) {
    if t.op != Op::Flush {
        *furthest = (*furthest).max(t.offset.saturating_add(t.len));
    }
}

/// A trace file is read twice, in bounded memory: once for what it holds and how far it
/// reaches (which the device's size may come from), once to replay it.
fn scan_trace(a: &ReplayArgs, trace: &Path) -> Result<(TraceInfo, u64), String> {
    let mut furthest = 0;
    let info = visit_trace(open_trace(trace)?, a.format, BlkFilter::of(a), &mut |t| {
        furthest_byte(&mut furthest, &t);
        Ok(())
    })?;
    Ok((info, furthest))
}

/// Standard input, or a trace path that is not a regular file (a FIFO, `<(blkparse ...)`,
/// `/dev/stdin`), copied to a file, so that it too is read twice in bounded memory rather than
/// held: a long trace piped from blkparse would not fit, and a pipe opened a second time would
/// wait for a writer that has gone. The file is unlinked as soon as it is made and read through
/// `/proc/self/fd` (`path`): a replay stopped by Ctrl-C leaves no copy of the trace behind, in
/// a `$TMPDIR` that is often memory. Without `/proc` (or where the unlink fails) it is read by
/// its name and removed on drop.
struct SpooledTrace {
    path: std::path::PathBuf,
    /// Keeps the unlinked file, and `/proc/self/fd/N` with it.
    _file: std::fs::File,
    /// The file's name, where it was not unlinked.
    named: Option<std::path::PathBuf>,
}

impl SpooledTrace {
    fn from(mut input: impl Read, what: &str) -> Result<SpooledTrace, String> {
        use std::os::fd::AsRawFd as _;
        let dir = std::env::temp_dir();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let path = dir.join(format!("fdpblk-replay-{}-{nanos}.trace", std::process::id()));
        // Only this user may read it: a trace carries the cache's data.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("cannot spool {what} to {} ({e}); set TMPDIR to a writable directory, or give the trace as a file", path.display()))?;
        let by_fd = std::path::PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
        let mut spool = if by_fd.exists() && std::fs::remove_file(&path).is_ok() {
            SpooledTrace { path: by_fd, _file: f, named: None }
        } else {
            SpooledTrace { path: path.clone(), _file: f, named: Some(path) }
        };
        let cannot = |e: String| format!("cannot spool {what} to {} ({e}); free space there (TMPDIR), or give the trace as a file", dir.display());
        spool_within(&mut input, &mut spool._file, || space_of(&dir)).map_err(cannot)?;
        spool._file.flush().map_err(|e| cannot(e.to_string()))?;
        Ok(spool)
    }
}

impl Drop for SpooledTrace {
    fn drop(&mut self) {
        if let Some(p) = &self.named {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Space a spool leaves free in its directory: `$TMPDIR` is often a tmpfs, whose pages are the
/// host's memory, and an endless input (`/dev/zero`, a capture that never stops) must not
/// take them all. 1 GiB, or a twentieth of a smaller file system.
const SPOOL_KEEP_FREE: u64 = 1 << 30;

/// Copies `input` to `out` while the file system keeps its floor free (`space()`: bytes
/// available and in all, `None` when it cannot tell), looking again at least every 64 MiB.
/// Returns the bytes copied.
fn spool_within(input: &mut impl Read, out: &mut impl Write, space: impl Fn() -> Option<(u64, u64)>) -> Result<u64, String> {
    const CHECK_EVERY: u64 = 64 << 20;
    let mut buf = vec![0u8; 1 << 20];
    let (mut copied, mut next_check) = (0u64, 0u64);
    loop {
        if copied >= next_check {
            next_check = match space() {
                None => copied + CHECK_EVERY,
                Some((free, total)) => {
                    let floor = SPOOL_KEEP_FREE.min(total / 20);
                    let budget = free.saturating_sub(floor).min(CHECK_EVERY);
                    if budget == 0 {
                        // At the floor: refused only if there is more to copy.
                        if input.read(&mut buf[..1]).map_err(|e| e.to_string())? == 0 {
                            return Ok(copied);
                        }
                        return Err(format!(
                            "{} MiB copied and {} MiB left free there, where replay keeps {} MiB free: the trace does not end, or is too long to spool; write it to a file on a disk and pass its path",
                            copied >> 20,
                            free >> 20,
                            floor >> 20
                        ));
                    }
                    copied + budget
                }
            };
        }
        let want = buf.len().min((next_check - copied) as usize);
        let n = match input.read(&mut buf[..want]) {
            Ok(0) => return Ok(copied),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        };
        out.write_all(&buf[..n]).map_err(|e| e.to_string())?;
        copied += n as u64;
    }
}

/// Bytes an unprivileged user may still write on the file system holding `dir`, and its size.
fn space_of(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a statvfs the call fills.
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| ((st.f_bavail as u64).saturating_mul(st.f_frsize as u64), (st.f_blocks as u64).saturating_mul(st.f_frsize as u64)))
}

/// Replays the trace file again from its start, read on a thread as the pipeline goes (a
/// short queue: a JSON-lines request carries up to 512 KiB of data).
fn replay_file(a: &ReplayArgs, trace: &Path, scanned: &TraceInfo, geometry: Geometry, size: u64, ssd: Option<crate::sim::dev::TraceSsd>) -> Result<ReplayReport, String> {
    let (tx, rx) = std::sync::mpsc::sync_channel(32);
    let (path, format, blk) = (trace.to_path_buf(), a.format, BlkFilter::of(a));
    let reader = std::thread::spawn(move || {
        visit_trace(open_trace(&path)?, format, blk, &mut |t| tx.send(t).map_err(|_| "replay stopped".to_string()))
    });
    let report = replay_into(geometry, &a.policy, size, rx, ssd)?;
    let again = reader.join().map_err(|_| "the trace reader panicked".to_string())??;
    if again != *scanned {
        return Err(format!(
            "trace {} changed while replay read it (it is read twice: for its extent, then to replay it); replay a trace that is complete",
            trace.display()
        ));
    }
    Ok(report)
}

pub fn run(a: &ReplayArgs) -> CmdResult {
    // A typo in the policy is reported before a long trace is read.
    if policy_by_name(&a.policy).is_none() {
        return Err(format!("unknown --policy {}; choose one of {}", a.policy, POLICY_NAMES.join(", ")).into());
    }
    let spool = if a.trace.as_os_str() == "-" {
        Some(SpooledTrace::from(std::io::stdin().lock(), "standard input")?)
    } else {
        use std::os::unix::fs::FileTypeExt;
        let f = std::fs::File::open(&a.trace).map_err(|e| format!("cannot open trace {}: {e}", a.trace.display()))?;
        let t = f.metadata().map_err(|e| format!("trace {}: {e}", a.trace.display()))?.file_type();
        if t.is_file() {
            None
        } else if t.is_fifo() || t.is_socket() || t.is_char_device() {
            Some(SpooledTrace::from(f, &format!("trace {}", a.trace.display()))?)
        } else {
            return Err(format!(
                "trace {} is a {}, not a trace: give the trace file (JSON lines or blkparse's text), or `-` for standard input",
                a.trace.display(),
                if t.is_dir() { "directory" } else { "block device" }
            )
            .into());
        }
    };

    let trace = spool.as_ref().map_or(a.trace.as_path(), |s| s.path.as_path());
    let (info, furthest) = scan_trace(a, trace)?;
    if a.sector_offset > 0 && info.format == "json" {
        return Err("--sector-offset applies to blkparse traces (whole-disk sectors of a partition); a JSON trace's offsets are the device's own".into());
    }
    let flags = a.geometry.flags();
    let (geometry, size) = match &a.device {
        Some(path) => {
            let dev = open_readonly(path)?;
            let d = discover(&dev, &flags).map_err(|e| match e {
                DiscoverError::Unparsable(e) => format!(
                    "LMCache's checkpoint on {} is beyond what fdpblk parses ({e}): leave out --device and give the layout with --slot-bytes and --meta-total-bytes (and --device-size)",
                    path.display()
                ),
                e => e.to_string(),
            })?;
            match a.device_size {
                // The image may be a prefix of the traced device: its slot count comes from
                // the traced device's size, as LMCache derived it there.
                Some(size) => {
                    let g = &d.geometry;
                    let capacity_bytes = flags.capacity_bytes.or(d.checkpoint.as_ref().and_then(|m| m.capacity_bytes)).unwrap_or(0);
                    let cfg = GeometryConfig {
                        block_align: g.block_align,
                        header_bytes: g.header_bytes,
                        slot_bytes: g.slot_bytes,
                        meta_total_bytes: g.meta_total_bytes,
                        capacity_bytes,
                    };
                    (cfg.validate(size)?, size)
                }
                None => (d.geometry, crate::device::ReadAt::size(&dev)?),
            }
        }
        None => {
            let given = a.device_size.or(flags.capacity_bytes);
            let (Some(slot_bytes), Some(meta_total_bytes)) = (flags.slot_bytes, flags.meta_total_bytes) else {
                return Err(DiscoverError::NoCheckpoint { missing: "--device IMAGE, or --slot-bytes and --meta-total-bytes" }.into());
            };
            let size = given.unwrap_or_else(|| inferred_device_size(furthest, slot_bytes, meta_total_bytes));
            let g = GeometryConfig {
                block_align: flags.block_align.unwrap_or(4096),
                header_bytes: flags.header_bytes.unwrap_or(4096),
                slot_bytes,
                meta_total_bytes,
                capacity_bytes: flags.capacity_bytes.unwrap_or(0),
            }
            .validate(size)
            .map_err(|e| match given {
                Some(_) => e.to_string(),
                None => format!(
                    "without --device-size the device ends with the slot holding the trace's furthest byte ({furthest}), at {size}: {e}; give --device-size, the traced device's size"
                ),
            })?;
            if given.is_none() {
                eprintln!(
                    "note: without --device-size the device is taken to end with the slot holding the trace's furthest byte ({size} bytes); --ssd then models a drive that size"
                );
            }
            (g, size)
        }
    };
    if furthest > size {
        return Err(format!(
            "the trace reaches byte {furthest}, past the {size}-byte device; pass the traced device's size (--device-size, or --device IMAGE)"
        )
        .into());
    }
    if let Some(e) = crate::device::mem_total_bytes().and_then(|m| table_error(&geometry, m)) {
        return Err(e.into());
    }
    let ssd = if a.ssd {
        let handles = policy_by_name(&a.policy).map_or(1, |p| p.handles());
        if !(0.0..0.9).contains(&a.ssd_op) {
            return Err(format!("--ssd-op {}: give a fraction of physical space, e.g. 0.07", a.ssd_op).into());
        }
        Some(crate::sim::dev::TraceSsd::new(size, &geometry, a.ssd_op, a.ssd_ru_size, handles)?.with_warmup(a.ssd_warmup))
    } else {
        None
    };
    let report = replay_file(a, trace, &info, geometry, size, ssd)?;
    let note = (!info.carries_data && report.pipeline.op(Op::Write).requests > 0).then(|| no_data_note(report.policy));
    if a.json {
        let mut v = report.to_json();
        let mut t = info.to_json();
        t["identities_known"] = json!(info.carries_data);
        if let Some(n) = &note {
            t["note"] = json!(n);
        }
        v["trace"] = t;
        println!("{v}");
    } else {
        print_trace_info(&info);
        print_text(&report);
        if let Some(n) = &note {
            println!("note: {n}");
        }
    }
    if report.errors > 0 {
        return Err(format!("{} of {} requests failed in the simulated engine (see the report above)", report.errors, report.requests).into());
    }
    Ok(())
}

fn print_trace_info(i: &TraceInfo) {
    match i.event {
        None => println!("trace: JSON lines, {} lines", i.lines),
        Some(e) => {
            let devices: Vec<String> = i.devices.iter().map(|&d| dev_name(d)).collect();
            println!(
                "trace: blkparse, {} lines: {} events, {} {} ({}) events of device {} taken; {} failed completions and {} events without a block request left out; {} lines not events",
                i.lines,
                i.events,
                i.taken,
                e.letter(),
                e.describe(),
                devices.join(","),
                i.failed,
                i.unusable,
                i.other_lines
            );
        }
    }
}

fn print_text(r: &ReplayReport) {
    println!("policy {}: {} requests, {} engine errors, {} payload fallbacks", r.policy, r.requests, r.errors, r.pipeline.payload_fallbacks);
    println!("{:<20} {:>10} {:>16}", "class", "requests", "bytes");
    for (c, n) in class_report(&r.pipeline) {
        println!("{:<20} {:>10} {:>16}", c.name(), n.requests, n.bytes);
    }
    if r.identities_capped {
        println!("distinct slot identities: more than {} (only that many are kept)", r.identities.len());
    } else {
        println!("distinct slot identities: {}", r.identities.len());
    }
    println!("{:<8} {:>16}", "handle", "bytes written");
    for (h, b) in &r.engine.bytes_by_handle {
        println!("{h:<8} {b:>16}");
    }
    if let Some(s) = &r.ssd {
        let f = |v: &Value| v.as_f64().map_or("-".to_string(), |w| format!("{w:.3}"));
        let window = if s["warmup_bytes"].as_u64().unwrap_or(0) > 0 {
            format!(
                " after the trace's first {} bytes ({} in the window; {} over the whole trace)",
                s["warmup_bytes"],
                s["window_host_request_bytes"],
                f(&s["waf_whole_trace"])
            )
        } else {
            String::new()
        };
        // A WAF from a window in which the drive never collected is a fill's, not a full drive's.
        let never = if s["window_gc_events"].as_u64() == Some(0) {
            format!(
                "; garbage collection never ran in the window: the trace did not fill the modelled drive's {} physical bytes, so this is no full drive's WAF (trace longer, or model the size the trace uses with --device-size)",
                s["physical_bytes"]
            )
        } else {
            String::new()
        };
        println!(
            "simulated SSD: WAF {}{window} (host {} bytes in whole {}-byte units, the trace's {}; media {} bytes, relocated {} bytes; RU {} bytes, {} handles{never})",
            f(&s["waf"]),
            s["host_bytes"],
            s["unit_bytes"],
            s["host_request_bytes"],
            s["media_bytes"],
            s["relocated_bytes"],
            s["ru_bytes"],
            s["handles"]
        );
    }
}

/// Why the slot table of `g` is too much to replay on a machine of `mem_total` bytes: more
/// than half of it, as `add` refuses (a trace's furthest byte sets the slot count when no
/// size is given).
fn table_error(g: &Geometry, mem_total: u64) -> Option<String> {
    let what = format!("{} slots of {} bytes", g.max_slots, g.slot_bytes);
    crate::persist::table_memory_error(&what, g.max_slots, mem_total)
        .map(|e| format!("{e}, or give the traced device's size (--device-size), which sets how many slots there are"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::discover::GeometryFlags;
    use crate::place::RegionPolicy;

    /// A trace that makes more slots than half the memory holds is refused, naming
    /// --device-size; one that fits is not.
    #[test]
    fn a_slot_table_past_half_the_memory_is_refused() {
        let g = GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate((1 << 20) + (1 << 20) * 65536)
            .unwrap();
        let need = crate::slot_table::SlotTable::heap_bytes_for(g.max_slots);
        let e = table_error(&g, need).expect("a table of half the memory and more");
        assert!(e.contains("1048576 slots of 65536 bytes") && e.contains("--device-size"), "{e}");
        assert_eq!(table_error(&g, 2 * need + 2), None);
    }

    /// The identities kept stop at the cap: one seen again adds nothing, a new one past the
    /// cap is counted as missing, not kept.
    #[test]
    fn identities_are_kept_up_to_the_cap() {
        let (mut kept, mut capped) = (BTreeSet::new(), false);
        for id in [5, 1, 5, 9] {
            keep_identity(&mut kept, &mut capped, id, 3);
        }
        assert_eq!((kept.iter().copied().collect::<Vec<_>>(), capped), (vec![1, 5, 9], false));
        keep_identity(&mut kept, &mut capped, 9, 3);
        assert!(!capped, "one already kept");
        keep_identity(&mut kept, &mut capped, 2, 3);
        assert_eq!((kept.len(), capped), (3, true));
    }

    /// An input that does not end (`fdpblk replay /dev/zero`) stops at the spool's file
    /// system's floor, instead of filling a tmpfs, i.e. the host's memory; a short one is
    /// copied even where little is free.
    #[test]
    fn a_spool_stops_at_its_file_systems_floor() {
        let total = 100u64 << 30;
        let free = std::cell::Cell::new(SPOOL_KEEP_FREE + (150 << 20));
        let mut out = std::io::sink();
        let mut endless = std::io::repeat(0).take(u64::MAX);
        // The file system loses what is copied: stopped exactly at the floor.
        let mut counted = CountingWriter(&mut out, &free);
        let e = spool_within(&mut endless, &mut counted, || Some((free.get(), total))).unwrap_err();
        assert!(e.contains("150 MiB copied and 1024 MiB left free there, where replay keeps 1024 MiB free") && e.contains("write it to a file on a disk"), "{e}");
        assert_eq!(free.get(), SPOOL_KEEP_FREE);
        // A small file system keeps a twentieth: 1 KiB copies into a 1 GiB tmpfs 90 % full.
        let mut v = Vec::new();
        assert_eq!(spool_within(&mut std::io::repeat(7).take(1024), &mut v, || Some((100 << 20, 1 << 30))).unwrap(), 1024);
        let e = spool_within(&mut std::io::repeat(7).take(1024), &mut v, || Some((50 << 20, 1 << 30))).unwrap_err();
        assert!(e.starts_with("0 MiB copied and 50 MiB left free there, where replay keeps 51 MiB free"), "{e}");
        // One that ends exactly at the floor is whole, not refused.
        let free = std::cell::Cell::new(SPOOL_KEEP_FREE + (3 << 20));
        let mut counted = CountingWriter(&mut out, &free);
        assert_eq!(spool_within(&mut std::io::repeat(1).take(3 << 20), &mut counted, || Some((free.get(), total))).unwrap(), 3 << 20);
        // An input that ends is copied whole; no figure for the free space copies it too.
        let mut v = Vec::new();
        assert_eq!(spool_within(&mut std::io::repeat(7).take(3 << 20), &mut v, || Some((u64::MAX, u64::MAX))).unwrap(), 3 << 20);
        assert_eq!(v.len(), 3 << 20);
        assert_eq!(spool_within(&mut &b"abc"[..], &mut Vec::new(), || None).unwrap(), 3);
    }

    struct CountingWriter<'a, W: Write>(&'a mut W, &'a std::cell::Cell<u64>);
    impl<W: Write> Write for CountingWriter<'_, W> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.1.set(self.1.get().saturating_sub(b.len() as u64));
            self.0.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    /// The slot written last counts as a slot though its partial payload ends before it.
    #[test]
    fn without_a_size_the_device_ends_with_the_last_slot_reached() {
        let (slot, meta) = (64 << 10, 1 << 20);
        assert_eq!(inferred_device_size(meta + slot + 4096 + 8192, slot, meta), meta + 2 * slot);
        assert_eq!(inferred_device_size(meta + 2 * slot, slot, meta), meta + 2 * slot, "a whole slot stays");
        assert_eq!(inferred_device_size(4096, slot, meta), 4096, "only metadata: as it is");
        assert_eq!(inferred_device_size(u64::MAX, slot, meta), u64::MAX);
    }

    #[test]
    fn trace_lines() {
        let t = parse_trace_line(r#"{"op":"write","offset":4096,"len":8192,"data_hex":"4c4d"}"#).unwrap();
        assert_eq!((t.op, t.offset, t.len, t.data), (Op::Write, 4096, 8192, vec![0x4c, 0x4d]));
        assert_eq!(parse_trace_line(r#"{"op":"flush"}"#).unwrap().op, Op::Flush);
        for bad in [
            "",
            "{}",
            r#"{"op":"trim","offset":0,"len":1}"#,
            r#"{"op":"write","offset":0,"len":4,"datahex":"4c4d"}"#,
            r#"{"op":"read","offset":-1,"len":1}"#,
            r#"{"op":"read","offset":0}"#,
            r#"{"op":"write","offset":0,"len":1,"data_hex":"abcd"}"#,
            r#"{"op":"write","offset":0,"len":4,"data_hex":"zz"}"#,
            r#"{"op":"write","offset":18446744073709551615,"len":4}"#,
        ] {
            assert!(parse_trace_line(bad).is_err(), "{bad}");
        }
        // A field given twice is refused, not taken at its last value.
        let e = parse_trace_line(r#"{"op":"write","offset":0,"len":4096,"offset":8192}"#).unwrap_err();
        assert_eq!(e, "\"offset\" is given twice (a record names each field once)");
        assert!(parse_trace_line(r#"{"op":"write","offset":0,"len":4,"data_hex":"00", "data_hex" :"4c4d"}"#).is_err());
    }

    const BLK_SAMPLE: &str = include_str!("../../tests/data/blkparse/ublk-sample.txt");

    fn read(text: &str, f: TraceFormat, e: BlkAction, d: Option<(u32, u32)>) -> Result<(Vec<TraceRequest>, TraceInfo), String> {
        read_trace_from(text.as_bytes(), f, BlkFilter { event: e, device: d, sector_offset: 0, partition_bytes: None })
    }

    #[test]
    fn blkparse_sample_is_detected_and_read() {
        let (reqs, info) = read(BLK_SAMPLE, TraceFormat::Auto, BlkAction::Issue, None).unwrap();
        let got: Vec<(Op, u64, u64)> = reqs.iter().map(|t| (t.op, t.offset, t.len)).collect();
        assert_eq!(
            got,
            vec![
                (Op::Write, 2048 * 512, 8192),
                (Op::Write, 4096 * 512, 120 * 512),
                (Op::Read, 0, 4096),
                (Op::Discard, 8192 * 512, 1 << 20),
                (Op::Flush, 0, 0),
                (Op::Flush, 0, 0),
                (Op::Write, 16384 * 512, 4096),
            ]
        );
        assert!(reqs.iter().all(|t| t.data.is_empty()));
        assert_eq!((info.format, info.lines, info.events, info.taken), ("blkparse", 40, 29, 6));
        assert_eq!((info.failed, info.unusable, info.other_lines), (0, 0, 10));
        assert_eq!(info.devices, vec![(259, 0)]);
        assert!(!info.carries_data);
        // Completions: the failed one ([-5]) is left out and counted.
        let (reqs, info) = read(BLK_SAMPLE, TraceFormat::Blkparse, BlkAction::Complete, None).unwrap();
        assert_eq!((reqs.len(), info.taken, info.failed), (5, 5, 1));
        // Queued: per bio, before the merge.
        let (reqs, _) = read(BLK_SAMPLE, TraceFormat::Auto, BlkAction::Queue, None).unwrap();
        assert_eq!(reqs.len(), 8);
    }

    #[test]
    fn a_json_trace_line_is_bounded() {
        let line = format!("{{\"op\":\"write\",\"offset\":0,\"len\":4096,\"data_hex\":\"{}\"}}", "0".repeat(2 << 20));
        let err = read(&line, TraceFormat::Auto, BlkAction::Issue, None).unwrap_err();
        assert!(err.contains("trace line 1: longer than 1048576 bytes"), "{err}");
    }

    /// A damaged trace's request past the device counts as an engine error without being
    /// planned, so a huge discard costs nothing.
    #[test]
    fn requests_past_the_device_are_errors_without_being_planned() {
        let size = 64 << 20;
        let g = crate::layout::GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 1 << 20, meta_total_bytes: 8 << 20, capacity_bytes: 0 }
            .validate(size)
            .unwrap();
        let req = |op, offset, len| TraceRequest { op, offset, len, data: Vec::new() };
        let trace = vec![req(Op::Discard, 0, 1 << 40), req(Op::Discard, u64::MAX, 2), req(Op::Write, size - 4096, 8192), req(Op::Discard, 0, size), req(Op::Flush, 0, 0)];
        let rep = replay(g, "key-aware", size, trace).unwrap();
        assert_eq!((rep.requests, rep.errors), (5, 3));
        assert_eq!(rep.pipeline.op(Op::Discard).requests, 1, "only the discard within the device was planned");
    }

    #[test]
    fn formats_are_told_apart_and_errors_name_the_line() {
        let json = "\n\n{\"op\":\"write\",\"offset\":0,\"len\":4096,\"data_hex\":\"4c4d\"}\n";
        let (reqs, info) = read(json, TraceFormat::Auto, BlkAction::Issue, None).unwrap();
        assert_eq!((reqs.len(), info.format, info.lines, info.carries_data), (1, "json", 3, true));
        let err = read(json, TraceFormat::Blkparse, BlkAction::Issue, None).unwrap_err();
        assert!(err.contains("no blkparse events in 3 lines of the trace: line 3: first field is not a device"), "{err}");
        let err = read(BLK_SAMPLE, TraceFormat::Json, BlkAction::Issue, None).unwrap_err();
        assert!(err.starts_with("trace line 1: not JSON") && err.contains("--format blkparse"), "{err}");
        let err = read("\n \nCPU0 (8,0):\n", TraceFormat::Auto, BlkAction::Issue, None).unwrap_err();
        assert!(err.contains("line 3: first field is not a device maj,min"), "{err}");
        assert!(err.contains("blkparse -i TRACE, no -f"), "{err}");
        assert!(read(" \n\n", TraceFormat::Auto, BlkAction::Issue, None).unwrap_err().contains("empty"));
        // Events, but none of the kind asked for.
        let q = "8,0 1 1 0.1 7 Q WS 0 + 8 [p]\n8,0 1 2 0.2 7 G WS 0 + 8 [p]\n";
        let err = read(q, TraceFormat::Auto, BlkAction::Issue, None).unwrap_err();
        assert!(err.contains("2 blkparse events but no usable D (issued to the driver) events"), "{err}");
        assert!(err.contains("actions present: G Q; choose one with --blk-event"), "{err}");
        let err = read("8,0 1 1 0.1 7 C WS 0 + 8 [-5]\n", TraceFormat::Auto, BlkAction::Complete, None).unwrap_err();
        assert!(err.contains("1 failed completions"), "{err}");
        let err = read("8,0 1 1 0.1 7 D N 0 (12 00) [p]\n", TraceFormat::Auto, BlkAction::Issue, None).unwrap_err();
        assert!(err.contains("line 1: no block request"), "{err}");
        // Events of the action asked for, none usable: not "choose another action".
        let before = "259,1 1 1 0.1 7 D WS 8 + 8 [p]\n";
        let err = read_trace_from(before.as_bytes(), TraceFormat::Auto, BlkFilter { event: BlkAction::Issue, device: None, sector_offset: 2048, partition_bytes: None })
            .unwrap_err();
        assert!(err.contains("line 1: a request before --sector-offset") && err.contains("none of them could be replayed") && !err.contains("choose one with"), "{err}");
        // A 4 GiB write-zeroes shows as a write: unusable, named, not "damaged".
        let wz = "8,0 1 1 0.1 7 D WS 0 + 8 [p]\n8,0 1 2 0.2 7 D WS 8 + 8388600 [blkdiscard]\n";
        let (reqs, info) = read(wz, TraceFormat::Auto, BlkAction::Issue, None).unwrap();
        assert_eq!((reqs.len(), info.unusable, info.first_unusable.unwrap().0), (1, 1, 2));
        assert!(info.first_unusable.unwrap().1.contains("write-zeroes"));
        // A partition starting at sector 2048: its requests come partition-relative, one
        // before its start is another partition's.
        let part = "259,1 1 1 0.1 7 D WS 2048 + 8 [p]\n259,1 1 2 0.2 7 D R 4096 + 16 [p]\n259,1 1 3 0.3 7 D WS 8 + 8 [p]\n259,1 1 4 0.4 7 D FN [p]\n";
        let (reqs, info) = read_trace_from(
            part.as_bytes(),
            TraceFormat::Auto,
            BlkFilter { event: BlkAction::Issue, device: None, sector_offset: 2048, partition_bytes: None },
        )
        .unwrap();
        let got: Vec<(Op, u64, u64)> = reqs.iter().map(|t| (t.op, t.offset, t.len)).collect();
        assert_eq!(got, vec![(Op::Write, 0, 4096), (Op::Read, 2048 * 512, 8192), (Op::Flush, 0, 0)]);
        assert_eq!((info.unusable, info.first_unusable.unwrap().0), (1, 3));
        // Of a 2 MiB partition: a read of the next one's first sector (blkid) came through the
        // kernel's filter; it is not the partition's.
        let next = format!("{part}259,1 1 5 0.5 7 D R {} + 8 [blkid]\n", 2048 + 4096);
        let (reqs, info) = read_trace_from(
            next.as_bytes(),
            TraceFormat::Auto,
            BlkFilter { event: BlkAction::Issue, device: None, sector_offset: 2048, partition_bytes: Some(2 << 20) },
        )
        .unwrap();
        assert_eq!((reqs.len(), info.unusable), (3, 2));
        // In a JSON trace the scan names the line.
        let big = "{\"op\":\"write\",\"offset\":0,\"len\":4096}\n{\"op\":\"write\",\"offset\":0,\"len\":2147483648}\n";
        let err = read(big, TraceFormat::Auto, BlkAction::Issue, None).unwrap_err();
        assert!(err.starts_with("trace line 2: a write of 2147483648 bytes"), "{err}");
    }

    /// A line longer than blkparse writes is cut at `MAX_LINE`: one cut inside its block
    /// count would read as a shorter request, so it is counted among the other lines instead.
    #[test]
    fn a_cut_blkparse_line_is_not_taken_for_a_shorter_request() {
        let head = "259,0 1 2 0.2 7";
        let tail = " D WS 0 + 12";
        let long = format!("{head}{}{tail}34 [p]", " ".repeat(crate::blkparse::MAX_LINE - head.len() - tail.len()));
        let text = format!("259,0 1 1 0.1 7 D WS 0 + 8 [p]\n{long}\n");
        let (reqs, info) = read(&text, TraceFormat::Auto, BlkAction::Issue, None).unwrap();
        assert_eq!(reqs.iter().map(|t| t.len).collect::<Vec<_>>(), vec![4096], "not a 12-sector write");
        assert_eq!((info.events, info.other_lines), (1, 1));
    }

    #[test]
    fn one_device_at_a_time() {
        let two = "259,0 1 1 0.1 7 D WS 0 + 8 [p]\n8,16 1 1 0.2 7 D WS 8 + 8 [p]\n8,16 1 2 0.3 7 D R 8 + 16 [p]\n";
        let err = read(two, TraceFormat::Auto, BlkAction::Issue, None).unwrap_err();
        assert!(err.contains("devices 259,0 and 8,16: replay one device at a time with --blk-device MAJ,MIN"), "{err}");
        let (reqs, info) = read(two, TraceFormat::Auto, BlkAction::Issue, Some((8, 16))).unwrap();
        assert_eq!((reqs.len(), info.taken, info.devices.clone()), (2, 2, vec![(8, 16)]));
        let err = read(two, TraceFormat::Auto, BlkAction::Issue, Some((8, 0))).unwrap_err();
        assert!(err.contains("no events of device 8,0 (--blk-device); it has 8,16, 259,0"), "{err}");
    }

    /// A blktrace has no data: the classes follow from the geometry, identities stay unknown,
    /// and key-aware places every slot on its young handle.
    #[test]
    fn blkparse_replay_classifies_by_geometry() {
        let g = crate::test_fixtures::small_geometry();
        let slot1 = g.slot_offset(1) / 512;
        let text = format!(
            "259,0 0 1 0.1 9 D WS 0 + 8 [p]\n259,0 0 2 0.2 9 D WS 8 + 16 [p]\n259,0 0 3 0.3 9 D WS {slot1} + 128 [p]\n259,0 0 4 0.4 9 D R {} + 8 [p]\n",
            slot1 + 8
        );
        let (trace, info) = read(&text, TraceFormat::Auto, BlkAction::Issue, None).unwrap();
        assert_eq!(info.taken, 4);
        let rep = replay(g, "key-aware", 4 << 20, trace).unwrap();
        let c = |cls: crate::classify::Class| rep.pipeline.classes[cls.index()];
        use crate::classify::Class;
        assert_eq!(c(Class::CheckpointHeader).bytes, 4096);
        assert_eq!(c(Class::CheckpointPayload).bytes, 8192);
        assert_eq!(c(Class::SlotHeader).bytes, 4096);
        assert_eq!(c(Class::SlotPayload).bytes, 65536 - 4096 + 4096);
        assert!(rep.identities.is_empty());
        assert_eq!(rep.pipeline.payload_fallbacks, 1);
        assert_eq!(rep.engine.bytes_by_handle.keys().copied().collect::<Vec<_>>(), vec![crate::place::KeyAwarePolicy::YOUNG]);
        assert!(no_data_note("key-aware").contains("handle 0 (young)"));
    }

    /// Converts a fixture's captured LMCache I/O (iotrace.jsonl) into trace requests.
    fn fixture_trace(dir: &std::path::Path) -> Vec<(TraceRequest, String)> {
        let text = std::fs::read_to_string(dir.join("iotrace.jsonl")).unwrap();
        let mut out = Vec::new();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            let op = match v["op"].as_str().unwrap() {
                "write" => "write",
                "read" => "read",
                _ => continue,
            };
            let line = json!({"op": op, "offset": v["offset"], "len": v["total_len"], "data_hex": if op == "write" { v["head32_hex"].clone() } else { Value::Null }});
            out.push((parse_trace_line(&line.to_string()).unwrap(), v["region"].as_str().unwrap_or("").to_string()));
        }
        out
    }

    /// A trace file is replayed as it is read, and gives what the trace held in memory gives;
    /// standard input goes through a spooled file the same way.
    #[test]
    fn a_trace_file_replays_as_it_is_read_like_one_in_memory() {
        use clap::Parser;
        let dir = crate::test_fixtures::fixtures_dir().join("legacy-basic");
        let img = dir.join("device.img");
        let tmp = std::env::temp_dir().join(format!("fdpblk-replay-{}.jsonl", std::process::id()));
        let lines: Vec<String> = fixture_trace(&dir)
            .iter()
            .map(|(t, _)| json!({"op": t.op.name(), "offset": t.offset, "len": t.len, "data_hex": t.data.iter().map(|b| format!("{b:02x}")).collect::<String>()}).to_string())
            .collect();
        std::fs::write(&tmp, lines.join("\n")).unwrap();
        let args = |trace: &str| match crate::cli::Cli::try_parse_from(["fdpblk", "replay", trace, "--device", img.to_str().unwrap(), "--policy", "key-aware"]).unwrap().command {
            crate::cli::Command::Replay(a) => a,
            _ => unreachable!(),
        };
        let a = args(tmp.to_str().unwrap());
        let (info, furthest) = scan_trace(&a, &a.trace).unwrap();
        assert_eq!(info.lines, lines.len());
        let (trace, in_memory_info) = read_trace_from(lines.join("\n").as_bytes(), TraceFormat::Auto, BlkFilter::of(&a)).unwrap();
        assert_eq!(info, in_memory_info);
        assert_eq!(furthest, trace.iter().filter(|t| t.op != Op::Flush).map(|t| t.offset + t.len).max().unwrap());
        let g = discover(&std::fs::read(&img).unwrap(), &GeometryFlags::default()).unwrap().geometry;
        let size = std::fs::metadata(&img).unwrap().len();
        let streamed = replay_file(&a, &a.trace, &info, g, size, None).unwrap();
        let held = replay(g, "key-aware", size, trace).unwrap();
        assert!(streamed.requests > 0);
        assert_eq!(streamed.to_json(), held.to_json());
        // Read again, the file must be what the first pass read.
        let shorter = TraceInfo { lines: info.lines - 1, ..info.clone() };
        assert!(replay_file(&a, &a.trace, &shorter, g, size, None).unwrap_err().contains("changed while replay read it"));
        // As many lines, two requests swapped: told apart by the requests' digest.
        let mut moved = lines.clone();
        let other = moved.iter().position(|l| *l != moved[0]).unwrap();
        moved.swap(0, other);
        let (_, moved_info) = read_trace_from(moved.join("\n").as_bytes(), TraceFormat::Auto, BlkFilter::of(&a)).unwrap();
        assert_eq!((moved_info.lines, moved_info.format), (info.lines, info.format));
        assert_ne!(moved_info.digest, info.digest);
        assert!(replay_file(&a, &a.trace, &moved_info, g, size, None).unwrap_err().contains("changed while replay read it"));
        // Standard input, spooled: the same requests, and the spool goes with its guard.
        let spool = SpooledTrace::from(lines.join("\n").as_bytes(), "standard input").unwrap();
        let (spooled_info, _) = scan_trace(&a, &spool.path).unwrap();
        assert_eq!(spooled_info, info);
        let from_spool = replay_file(&a, &spool.path, &spooled_info, g, size, None).unwrap();
        assert_eq!(from_spool.to_json(), held.to_json());
        // Nothing of it is left in the directory, even while it is read.
        let ours = format!("fdpblk-replay-{}-", std::process::id());
        let left: Vec<_> = std::fs::read_dir(std::env::temp_dir()).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&ours)).collect();
        assert!(left.is_empty(), "{left:?}");
        drop(spool);
        std::fs::remove_file(&tmp).unwrap();
    }

    #[test]
    fn fixture_traces_classify_like_the_capture_says() {
        let root = crate::test_fixtures::fixtures_dir();
        for scen in ["legacy-basic", "object-evict.io_uring", "object-multitenant.odirect", "reopen"] {
            let dir = root.join(scen);
            let img = std::fs::read(dir.join("device.img")).unwrap();
            let m: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
            let g = discover(&img, &GeometryFlags::default()).unwrap().geometry;
            let trace = fixture_trace(&dir);
            // Every request's first extent agrees with the capture's own region label.
            let mut p = Pipeline::new(g, Box::new(RegionPolicy));
            for (t, region) in &trace {
                let mut segs = Vec::new();
                let first = p.plan(&Request { op: t.op, offset: t.offset, len: t.len, data: Some(&t.data) }, &mut segs, HeaderWait::Expired).unwrap()[0];
                let class = first.kind.class().name();
                let ok = match region.as_str() {
                    "slot_header" => class == "slot_header",
                    "slot_payload" => class == "slot_payload",
                    "meta_header" | "checkpoint_header" => class == "checkpoint_header",
                    "meta_payload" | "checkpoint_payload" => class == "checkpoint_payload",
                    other => panic!("{scen}: unknown region label {other}"),
                };
                assert!(ok, "{scen}: {t:?} labelled {region} classified {class}");
            }
            // Identities seen in the written headers are exactly the manifest's written keys'.
            let rep = replay(g, "region", img.len() as u64, trace.into_iter().map(|(t, _)| t)).unwrap();
            // (`reopen` only reads: recovery writes nothing.)
            let want: BTreeSet<u64> = if scen == "reopen" {
                BTreeSet::new()
            } else {
                m["keys"].as_array().unwrap().iter().map(|k| k["identity_u64"].as_u64().unwrap()).collect()
            };
            assert_eq!(rep.identities, want, "{scen}");
            assert_eq!(rep.errors, 0);
            // Region placement: checkpoint bytes on one handle, slot bytes on another.
            let cls = &rep.pipeline.classes;
            let ckpt = cls[0].bytes + cls[1].bytes;
            let slots = cls[2].bytes + cls[3].bytes + cls[4].bytes;
            let written = |h| rep.engine.bytes_by_handle.get(&h).copied().unwrap_or(0);
            let write_bytes = rep.pipeline.op(Op::Write).bytes;
            assert_eq!(written(RegionPolicy::CHECKPOINT) + written(RegionPolicy::SLOTS) + written(RegionPolicy::OUTSIDE), write_bytes);
            if scen != "reopen" {
                assert!(written(RegionPolicy::CHECKPOINT) > 0 && written(RegionPolicy::SLOTS) > 0);
            }
            assert!(ckpt + slots >= write_bytes);
            assert_eq!(rep.pipeline.payload_fallbacks, 0, "{scen}");
        }
    }
}
