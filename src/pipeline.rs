//! The engine core: classify → place → submit, independent of the frontend.
//!
//! The ublk frontend and `fdpblk replay` both drive a `Pipeline`: `plan` turns one request
//! into placed segments (adjacent extents on the same handle merged), `execute` also submits
//! them to a synchronous engine. Every byte of a slot's payload goes to the handle its header
//! was placed on; a payload seen before any header of its slot is a counted fallback.

use crate::classify::{classify, Class, Extent, ExtentKind, Op};
use crate::engine::{Engine, Errno};
use crate::layout::Geometry;
use crate::place::{Handle, Policy, Target};
use crate::slot_table::SlotTable;
use std::collections::BTreeMap;

/// One block request. For writes `data` holds the bytes (or, in a trace, a prefix).
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    pub data: Option<&'a [u8]>,
}

/// A contiguous piece of a request on one placement handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
    pub handle: Handle,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub requests: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Per class, over all data requests (a request counts once per class it touches).
    pub classes: [Counter; 6],
    /// Per op (flushes have zero bytes).
    pub ops: BTreeMap<&'static str, Counter>,
    /// Bytes written per logical handle.
    pub handle_bytes: BTreeMap<Handle, u64>,
    /// Slot payload bytes placed without a header of their slot seen first.
    pub payload_fallbacks: u64,
}

pub struct Pipeline {
    geom: Geometry,
    policy: Box<dyn Policy>,
    slots: SlotTable,
    stats: PipelineStats,
    extents: Vec<Extent>,
}

impl Pipeline {
    pub fn new(geom: Geometry, policy: Box<dyn Policy>) -> Self {
        Self { slots: SlotTable::new(geom.max_slots), geom, policy, stats: PipelineStats::default(), extents: Vec::new() }
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geom
    }
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }
    pub fn slots(&self) -> &SlotTable {
        &self.slots
    }
    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    /// Classifies `req`, counts it, and for writes appends its placed segments to `segments`.
    /// Returns the extents, valid until the next call.
    pub fn plan(&mut self, req: &Request<'_>, segments: &mut Vec<Segment>) -> &[Extent] {
        self.extents.clear();
        classify(&self.geom, req.op, req.offset, req.len, req.data, &self.slots, &mut self.extents);
        let op = self.stats.ops.entry(req.op.name()).or_default();
        op.requests += 1;
        op.bytes += if req.op == Op::Flush { 0 } else { req.len };
        let mut touched = 0u8;
        for e in &self.extents {
            let c = e.kind.class().index();
            self.stats.classes[c].bytes += e.len;
            if touched & (1 << c) == 0 {
                touched |= 1 << c;
                self.stats.classes[c].requests += 1;
            }
        }
        if req.op == Op::Write {
            for i in 0..self.extents.len() {
                let e = self.extents[i];
                let handle = self.place(&e);
                *self.stats.handle_bytes.entry(handle).or_default() += e.len;
                match segments.last_mut() {
                    Some(s) if s.handle == handle && s.offset + s.len == e.offset => s.len += e.len,
                    _ => segments.push(Segment { offset: e.offset, len: e.len, handle }),
                }
            }
        }
        &self.extents
    }

    fn place(&mut self, e: &Extent) -> Handle {
        match e.kind {
            ExtentKind::CheckpointHeader { copy, .. } | ExtentKind::CheckpointPayload { copy } => {
                self.policy.place(&Target::Checkpoint { copy })
            }
            ExtentKind::Outside => self.policy.place(&Target::Outside),
            ExtentKind::SlotHeader { slot, header } => match header.valid() {
                Some(h) => {
                    let previous = self.slots.get(slot).copied();
                    let handle =
                        self.policy.place(&Target::Slot { slot, header: Some(h), previous: previous.as_ref() });
                    self.slots.record_header(slot, h, handle);
                    handle
                }
                None => self.slot_handle(slot),
            },
            ExtentKind::SlotPayload { slot } | ExtentKind::SlotPadding { slot } => self.slot_handle(slot),
        }
    }

    /// The handle of the slot's current header, or the policy's guess when none was seen.
    fn slot_handle(&mut self, slot: u64) -> Handle {
        match self.slots.get(slot) {
            Some(entry) => entry.handle,
            None => {
                self.stats.payload_fallbacks += 1;
                self.policy.place(&Target::Slot { slot, header: None, previous: None })
            }
        }
    }

    /// Plans `req` and submits it to `engine`.
    pub fn execute(&mut self, engine: &mut dyn Engine, req: &Request<'_>) -> Result<(), Errno> {
        match req.op {
            Op::Write => {
                let mut segments = Vec::new();
                self.plan(req, &mut segments);
                let data = req.data.unwrap_or(&[]);
                for s in segments {
                    let rel = (s.offset - req.offset) as usize;
                    let end = (rel + s.len as usize).min(data.len());
                    let bytes = data.get(rel..end).unwrap_or(&[]);
                    engine.write(s.offset, s.len, bytes, s.handle)?;
                }
                Ok(())
            }
            Op::Read => {
                self.plan(req, &mut Vec::new());
                let mut buf = vec![0u8; req.len as usize];
                engine.read(req.offset, &mut buf)
            }
            Op::Flush => {
                self.plan(req, &mut Vec::new());
                engine.flush()
            }
            Op::Discard => {
                self.plan(req, &mut Vec::new());
                engine.discard(req.offset, req.len)
            }
            Op::WriteZeroes => {
                self.plan(req, &mut Vec::new());
                engine.write_zeroes(req.offset, req.len)
            }
        }
    }
}

/// Names of the classes in report order, with their counters.
pub fn class_report(stats: &PipelineStats) -> Vec<(Class, Counter)> {
    Class::ALL.iter().map(|&c| (c, stats.classes[c.index()])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sim::SimEngine;
    use crate::layout::slot_header::SlotHeader;
    use crate::layout::GeometryConfig;
    use crate::place::{NonePolicy, RegionPolicy};

    fn geom() -> Geometry {
        GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate(4 << 20)
            .unwrap()
    }

    #[test]
    fn payload_follows_header_and_segments_merge() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut eng = SimEngine::new(4 << 20, 4);
        let hdr = SlotHeader { identity: 7, payload_len: 61440 }.encode(4096);
        let mut segs = Vec::new();
        p.plan(&Request { op: Op::Write, offset: g.slot_offset(1), len: 4096, data: Some(&hdr) }, &mut segs);
        assert_eq!(segs, vec![Segment { offset: g.slot_offset(1), len: 4096, handle: RegionPolicy::SLOTS }]);
        p.execute(&mut eng, &Request { op: Op::Write, offset: g.slot_offset(1) + 4096, len: 61440, data: None }).unwrap();
        assert_eq!(p.stats().payload_fallbacks, 0);
        // A write over a checkpoint container and into slot 0: two handles, two segments.
        segs.clear();
        p.plan(&Request { op: Op::Write, offset: g.container_offset(1), len: (1 << 20) - g.container_offset(1) + 8192, data: None }, &mut segs);
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].handle, RegionPolicy::CHECKPOINT);
        assert_eq!(segs[1].handle, RegionPolicy::SLOTS);
        // Slot 0's header position carried no bytes, so neither it nor the payload knew a header.
        assert_eq!(p.stats().payload_fallbacks, 2);
        assert_eq!(eng.counters.bytes_by_handle[&RegionPolicy::SLOTS], 61440);
    }

    #[test]
    fn none_policy_puts_everything_on_default() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(NonePolicy));
        let mut eng = SimEngine::new(4 << 20, 1);
        p.execute(&mut eng, &Request { op: Op::Write, offset: 0, len: 4 << 20, data: None }).unwrap();
        assert_eq!(eng.counters.bytes_by_handle[&0], 4 << 20);
        let total: u64 = p.stats().classes.iter().map(|c| c.bytes).sum();
        assert_eq!(total, 4 << 20);
    }
}
