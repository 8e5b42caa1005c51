//! `fdpblk replay`: drives the engine core with a trace of block requests into the simulated
//! drive and reports per-class counts, slot identities seen, and bytes per placement handle.
//!
//! Trace format (JSON lines, one request each):
//! `{"op":"write|read|flush|discard|write_zeroes","offset":N,"len":N,"data_hex":"<first bytes>"}`.
//! `data_hex` is optional and may hold only a prefix of the written bytes: a slot header is
//! recognised when its first 24 bytes are present.

use super::CmdResult;
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
use std::io::{BufRead, BufReader, Read};

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
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
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
    pub identities: BTreeSet<u64>,
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
            "handles": handles,
            "payload_fallbacks": self.pipeline.payload_fallbacks,
            "ssd": self.ssd,
        })
    }
}

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
    let (mut requests, mut errors) = (0u64, 0u64);
    let mut segments: Vec<Segment> = Vec::new();
    for t in trace {
        requests += 1;
        let req = Request { op: t.op, offset: t.offset, len: t.len, data: Some(&t.data) };
        segments.clear();
        for e in pipeline.plan(&req, &mut segments, HeaderWait::Expired).unwrap_or(&[]) {
            if let ExtentKind::SlotHeader { header: crate::classify::Parsed::Valid(h), .. } = e.kind {
                identities.insert(h.identity);
            }
        }
        let res = match t.op {
            Op::Write => segments.iter().try_for_each(|s| {
                let rel = (s.offset - t.offset) as usize;
                let bytes = t.data.get(rel..(rel + s.len as usize).min(t.data.len())).unwrap_or(&[]);
                crate::engine::Engine::write(&mut engine, s.offset, s.len, bytes, s.handle)
            }),
            Op::Read => {
                let mut buf = vec![0u8; t.len.min(1 << 30) as usize];
                crate::engine::Engine::read(&mut engine, t.offset, &mut buf)
            }
            Op::Flush => crate::engine::Engine::flush(&mut engine),
            Op::Discard => crate::engine::Engine::discard(&mut engine, t.offset, t.len),
            Op::WriteZeroes => crate::engine::Engine::write_zeroes(&mut engine, t.offset, t.len),
        };
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
        pipeline: pipeline.stats(),
        engine: engine.counters,
        ssd: match &mut ssd {
            Some(d) => Some(d.finish().map_err(|e| format!("simulated SSD: {e}"))?),
            None => None,
        },
    })
}

fn read_trace(a: &ReplayArgs) -> Result<Vec<TraceRequest>, String> {
    let reader: Box<dyn Read> = if a.trace.as_os_str() == "-" {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(&a.trace).map_err(|e| format!("cannot open trace {}: {e}", a.trace.display()))?)
    };
    let mut out = Vec::new();
    for (i, line) in BufReader::new(reader).lines().enumerate() {
        let line = line.map_err(|e| format!("reading trace: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_trace_line(&line).map_err(|e| format!("trace line {}: {e}", i + 1))?);
    }
    Ok(out)
}

pub fn run(a: &ReplayArgs) -> CmdResult {
    let trace = read_trace(a)?;
    let flags = a.geometry.flags();
    let (geometry, size) = match &a.device {
        Some(path) => {
            let dev = open_readonly(path)?;
            let d = discover(&dev, &flags)?;
            (d.geometry, a.device_size.unwrap_or(crate::device::ReadAt::size(&dev)?))
        }
        None => {
            let furthest = trace.iter().map(|t| t.offset + t.len).max().unwrap_or(0);
            let size = a.device_size.or(flags.capacity_bytes).unwrap_or(furthest);
            let (Some(slot_bytes), Some(meta_total_bytes)) = (flags.slot_bytes, flags.meta_total_bytes) else {
                return Err(DiscoverError::NoCheckpoint { missing: "--device IMAGE, or --slot-bytes and --meta-total-bytes" }.into());
            };
            let g = GeometryConfig {
                block_align: flags.block_align.unwrap_or(4096),
                header_bytes: flags.header_bytes.unwrap_or(4096),
                slot_bytes,
                meta_total_bytes,
                capacity_bytes: flags.capacity_bytes.unwrap_or(0),
            }
            .validate(size)?;
            (g, size)
        }
    };
    let ssd = if a.ssd {
        let handles = policy_by_name(&a.policy).map_or(1, |p| p.handles());
        Some(crate::sim::dev::TraceSsd::new(size, &geometry, a.ssd_op, a.ssd_ru_size, handles)?)
    } else {
        None
    };
    let report = replay_into(geometry, &a.policy, size, trace, ssd)?;
    if a.json {
        println!("{}", report.to_json());
    } else {
        print_text(&report);
    }
    Ok(())
}

fn print_text(r: &ReplayReport) {
    println!("policy {}: {} requests, {} engine errors, {} payload fallbacks", r.policy, r.requests, r.errors, r.pipeline.payload_fallbacks);
    println!("{:<20} {:>10} {:>16}", "class", "requests", "bytes");
    for (c, n) in class_report(&r.pipeline) {
        println!("{:<20} {:>10} {:>16}", c.name(), n.requests, n.bytes);
    }
    println!("distinct slot identities: {}", r.identities.len());
    println!("{:<8} {:>16}", "handle", "bytes written");
    for (h, b) in &r.engine.bytes_by_handle {
        println!("{h:<8} {b:>16}");
    }
    if let Some(s) = &r.ssd {
        println!(
            "simulated SSD: WAF {} (host {} bytes, media {} bytes, relocated {} bytes; RU {} bytes, {} handles)",
            s["waf"].as_f64().map_or("-".to_string(), |w| format!("{w:.3}")),
            s["host_bytes"],
            s["media_bytes"],
            s["relocated_bytes"],
            s["ru_bytes"],
            s["handles"]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::discover::GeometryFlags;
    use crate::place::RegionPolicy;

    #[test]
    fn trace_lines() {
        let t = parse_trace_line(r#"{"op":"write","offset":4096,"len":8192,"data_hex":"4c4d"}"#).unwrap();
        assert_eq!((t.op, t.offset, t.len, t.data), (Op::Write, 4096, 8192, vec![0x4c, 0x4d]));
        assert_eq!(parse_trace_line(r#"{"op":"flush"}"#).unwrap().op, Op::Flush);
        for bad in [
            "",
            "{}",
            r#"{"op":"trim","offset":0,"len":1}"#,
            r#"{"op":"read","offset":-1,"len":1}"#,
            r#"{"op":"read","offset":0}"#,
            r#"{"op":"write","offset":0,"len":1,"data_hex":"abcd"}"#,
            r#"{"op":"write","offset":0,"len":4,"data_hex":"zz"}"#,
            r#"{"op":"write","offset":18446744073709551615,"len":4}"#,
        ] {
            assert!(parse_trace_line(bad).is_err(), "{bad}");
        }
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
