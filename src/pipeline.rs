//! The engine core: classify → place → submit, independent of the frontend.
//!
//! The ublk frontend (one `Pipeline` per queue thread) and `fdpblk replay` both drive it:
//! `plan` turns one request into placed segments (adjacent extents on the same handle merged);
//! `execute` also submits them to a synchronous engine. Every byte of a slot's payload goes to
//! the handle its header was placed on. A payload that arrives before its header (io_uring
//! batches and page-cache writeback do not keep LMCache's order) can be held by the caller:
//! `plan` then reports the slot it waits for instead of placing a guess.

use crate::classify::{classify, Class, Extent, ExtentKind, Op, Parsed};
use crate::layout::checkpoint_header::CHECKPOINT_HEADER_LEN;
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::engine::{Engine, Errno};
use crate::layout::Geometry;
use crate::place::{Handle, Observation, Policy, Target};
use crate::slot_table::{ContainerWrites, SlotTable};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

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

#[derive(Debug, Default)]
struct AtomicCounter {
    requests: AtomicU64,
    bytes: AtomicU64,
}

impl AtomicCounter {
    fn add(&self, requests: u64, bytes: u64) {
        self.requests.fetch_add(requests, Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
    }
    fn get(&self) -> Counter {
        Counter { requests: self.requests.load(Relaxed), bytes: self.bytes.load(Relaxed) }
    }
}

/// Slots of a discard or write-zeroes classified at a time ([`Pipeline::plan`]).
pub const DISCARD_PIECE_SLOTS: u64 = 1024;

pub const OPS: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes];

fn op_index(op: Op) -> usize {
    match op {
        Op::Read => 0,
        Op::Write => 1,
        Op::Flush => 2,
        Op::Discard => 3,
        Op::WriteZeroes => 4,
    }
}

/// Counters of one pipeline, readable from other threads (relaxed atomics, one writer).
#[derive(Debug)]
pub struct PipelineCounters {
    classes: [AtomicCounter; 6],
    ops: [AtomicCounter; 5],
    handle_bytes: Box<[AtomicU64]>,
    payload_fallbacks: AtomicU64,
    header_waits: AtomicU64,
}

/// What one planned request adds to the counters (besides its bytes per handle, which its
/// segments carry): added at once, or where the pipeline was told to
/// ([`Pipeline::count_when_served`]) by the caller once the engine served it
/// ([`PipelineCounters::served`]), so that requests a failing drive refuses are not counted
/// as served, nor their bytes as written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    op: Option<usize>,
    op_bytes: u64,
    classes: [Counter; 6],
    fell_back: bool,
}

impl PipelineCounters {
    /// Adds a request the engine served: its tally, and for a write its `segments`' bytes
    /// per handle (exactly the pieces planned for it).
    pub fn served(&self, t: &Tally, segments: &[Segment]) {
        self.add_tally(t);
        for s in segments {
            if let Some(b) = self.handle_bytes.get(usize::from(s.handle)) {
                b.fetch_add(s.len, Relaxed);
            }
        }
    }

    fn add_tally(&self, t: &Tally) {
        let Some(op) = t.op else { return };
        self.ops[op].add(1, t.op_bytes);
        for (c, n) in self.classes.iter().zip(&t.classes) {
            if n.requests > 0 || n.bytes > 0 {
                c.add(n.requests, n.bytes);
            }
        }
        if t.fell_back {
            self.payload_fallbacks.fetch_add(1, Relaxed);
        }
    }

    pub fn new(handles: u16) -> Self {
        Self {
            classes: Default::default(),
            ops: Default::default(),
            handle_bytes: (0..handles.max(1)).map(|_| AtomicU64::new(0)).collect(),
            payload_fallbacks: AtomicU64::new(0),
            header_waits: AtomicU64::new(0),
        }
    }
    pub fn snapshot(&self) -> PipelineStats {
        PipelineStats {
            classes: std::array::from_fn(|i| self.classes[i].get()),
            ops: std::array::from_fn(|i| self.ops[i].get()),
            handle_bytes: self.handle_bytes.iter().map(|b| b.load(Relaxed)).collect(),
            payload_fallbacks: self.payload_fallbacks.load(Relaxed),
            header_waits: self.header_waits.load(Relaxed),
        }
    }
}

/// A plain copy of the counters, summable across queues.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Per class, over all data requests (a request counts once per class it touches).
    pub classes: [Counter; 6],
    /// Per op, indexed like `OPS` (flushes have zero bytes).
    pub ops: [Counter; 5],
    /// Bytes written per logical handle.
    pub handle_bytes: Vec<u64>,
    /// Slot payload pieces placed without their header seen (after any wait).
    pub payload_fallbacks: u64,
    /// Payload pieces held until their header arrived.
    pub header_waits: u64,
}

impl PipelineStats {
    pub fn op(&self, op: Op) -> Counter {
        self.ops[op_index(op)]
    }
    pub fn add(&mut self, o: &PipelineStats) {
        for i in 0..6 {
            self.classes[i].requests += o.classes[i].requests;
            self.classes[i].bytes += o.classes[i].bytes;
        }
        for i in 0..5 {
            self.ops[i].requests += o.ops[i].requests;
            self.ops[i].bytes += o.ops[i].bytes;
        }
        if self.handle_bytes.len() < o.handle_bytes.len() {
            self.handle_bytes.resize(o.handle_bytes.len(), 0);
        }
        for (a, b) in self.handle_bytes.iter_mut().zip(&o.handle_bytes) {
            *a += b;
        }
        self.payload_fallbacks += o.payload_fallbacks;
        self.header_waits += o.header_waits;
    }
    pub fn to_json(&self) -> serde_json::Value {
        let classes: serde_json::Map<String, serde_json::Value> = Class::ALL
            .iter()
            .map(|c| {
                let n = self.classes[c.index()];
                (c.name().to_string(), serde_json::json!({"requests": n.requests, "bytes": n.bytes}))
            })
            .collect();
        let ops: serde_json::Map<String, serde_json::Value> = OPS
            .iter()
            .map(|&o| {
                let n = self.op(o);
                (o.name().to_string(), serde_json::json!({"requests": n.requests, "bytes": n.bytes}))
            })
            .collect();
        let handles: serde_json::Map<String, serde_json::Value> = self
            .handle_bytes
            .iter()
            .enumerate()
            .filter(|(_, &b)| b > 0)
            .map(|(h, b)| (h.to_string(), serde_json::json!(b)))
            .collect();
        serde_json::json!({
            "classes": classes, "ops": ops, "handles": handles,
            "payload_fallbacks": self.payload_fallbacks, "header_waits": self.header_waits,
        })
    }
}

/// Whether `plan` may hold a payload whose header has not arrived yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderWait {
    /// Report the slot instead of placing (the caller waits and retries).
    Allowed,
    /// Place now: the slot's last known handle, else the policy's guess (a counted fallback).
    Expired,
}

pub struct Pipeline {
    geom: Geometry,
    policy: Box<dyn Policy>,
    slots: Arc<SlotTable>,
    counters: Arc<PipelineCounters>,
    extents: Vec<Extent>,
    /// Slots written by the last planned request while fdpblk was deallocating them.
    trim_waits: Vec<u64>,
    /// Checkpoint containers whose header block the last planned request writes while the
    /// state thread zeroes it.
    container_waits: Vec<u8>,
    /// Slot headers the last planned request carries, as (slot, generation).
    headers: Vec<(u64, u16)>,
    /// What the last planned request changes of the checkpoint containers.
    containers: ContainerWrites,
    /// The last planned request's counts (a write's payload fallback among them: a request
    /// counts once in `payload_fallbacks`, whatever its pieces: payload and padding, several
    /// slots).
    tally: Tally,
    /// Counted by the caller once served ([`Self::count_when_served`]), not at planning.
    deferred: bool,
}

impl Pipeline {
    /// A pipeline with its own slot table (one queue, or a trace replay).
    pub fn new(geom: Geometry, policy: Box<dyn Policy>) -> Self {
        let slots = Arc::new(SlotTable::new(geom.max_slots));
        Self::with_slots(geom, policy, slots)
    }

    /// A pipeline sharing `slots` with the other queues of the same device.
    pub fn with_slots(geom: Geometry, mut policy: Box<dyn Policy>, slots: Arc<SlotTable>) -> Self {
        policy.observe(&Observation::Layout { max_slots: geom.max_slots });
        let counters = Arc::new(PipelineCounters::new(policy.handles()));
        Self { geom, policy, slots, counters, extents: Vec::new(), trim_waits: Vec::new(), container_waits: Vec::new(), headers: Vec::new(), containers: ContainerWrites::default(), tally: Tally::default(), deferred: false }
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geom
    }
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }
    pub fn slots(&self) -> &Arc<SlotTable> {
        &self.slots
    }
    pub fn counters(&self) -> &Arc<PipelineCounters> {
        &self.counters
    }
    pub fn stats(&self) -> PipelineStats {
        self.counters.snapshot()
    }

    /// Classifies `req`, counts it, and for writes appends its placed segments to `segments`.
    /// With `HeaderWait::Allowed`, a write carrying payload of a slot whose header has not
    /// arrived returns `Err(slot)` and counts nothing, so the caller can wait and retry.
    pub fn plan(&mut self, req: &Request<'_>, segments: &mut Vec<Segment>, wait: HeaderWait) -> Result<&[Extent], u64> {
        self.extents.clear();
        self.tally = Tally::default();
        self.trim_waits.clear();
        self.container_waits.clear();
        self.headers.clear();
        self.containers = ContainerWrites::default();
        if matches!(req.op, Op::Discard | Op::WriteZeroes) {
            return Ok(self.plan_discard(req));
        }
        classify(&self.geom, req.op, req.offset, req.len, req.data, self.slots.as_ref(), &mut self.extents);
        if req.op == Op::Write && wait == HeaderWait::Allowed && self.slots.headers_seen() {
            if let Some(slot) = self.awaited_header() {
                return Err(slot);
            }
        }
        self.tally.op = Some(op_index(req.op));
        self.tally.op_bytes = if req.op == Op::Flush { 0 } else { req.len };
        let mut touched = 0u8;
        self.count_classes(&mut touched);
        if req.op == Op::Write {
            for i in 0..self.extents.len() {
                let e = self.extents[i];
                let handle = self.place(&e);
                let prev = segments.last().map(|s| s.handle);
                let kept = push_segment(segments, e.offset, e.len, handle, self.geom.block_align);
                if self.deferred {
                    continue; // the caller counts the segments
                }
                for (h, n) in [(prev.unwrap_or(handle), kept), (handle, e.len - kept)] {
                    if let Some(b) = self.counters.handle_bytes.get(usize::from(h)).filter(|_| n > 0) {
                        b.fetch_add(n, Relaxed);
                    }
                }
            }
        } else {
            self.observe_other(req.op);
        }
        if !self.deferred {
            self.counters.add_tally(&self.tally);
        }
        Ok(&self.extents)
    }

    /// A discard or write-zeroes, a piece of at most [`DISCARD_PIECE_SLOTS`] slots at a time:
    /// one can span the whole device (`blkdiscard`), and its extents (two or three a slot)
    /// would otherwise be held at once, and their memory kept for the queue's life. Returns
    /// the last piece's extents.
    fn plan_discard(&mut self, req: &Request<'_>) -> &[Extent] {
        self.tally.op = Some(op_index(req.op));
        self.tally.op_bytes = req.len;
        let piece = self.geom.slot_bytes.saturating_mul(DISCARD_PIECE_SLOTS);
        let end = req.offset.saturating_add(req.len);
        let (mut off, mut touched) = (req.offset, 0u8);
        while off < end {
            let len = piece.min(end - off);
            self.extents.clear();
            classify(&self.geom, req.op, off, len, None, self.slots.as_ref(), &mut self.extents);
            self.count_classes(&mut touched);
            self.observe_other(req.op);
            off += len;
        }
        if !self.deferred {
            self.counters.add_tally(&self.tally);
        }
        &self.extents
    }

    /// Adds the last classified extents to the per-class counters; a class counts one request
    /// per request (`touched` carries which were counted across a request's pieces).
    fn count_classes(&mut self, touched: &mut u8) {
        for e in &self.extents {
            let i = e.kind.class().index();
            let c = &mut self.tally.classes[i];
            c.requests += u64::from(*touched & (1 << i) == 0);
            c.bytes += e.len;
            *touched |= 1 << i;
        }
    }

    /// From now on the counts of a planned request wait for the caller: once the engine
    /// served it, [`PipelineCounters::served`] with [`Self::tally`] and its segments (which
    /// the caller clears before each plan). A ublk queue does, so that a failing drive's
    /// refusals do not count as served requests and written bytes.
    pub fn count_when_served(&mut self) {
        self.deferred = true;
    }

    /// The last planned request's counts (see [`Self::count_when_served`]).
    pub fn tally(&self) -> Tally {
        self.tally
    }

    /// The slot headers the last planned write carries, as (slot, generation): once the
    /// write completed, the caller reports each with [`SlotTable::header_completed`]
    /// ([`Self::completed`] does it for the last plan).
    pub fn planned_headers(&self) -> &[(u64, u16)] {
        &self.headers
    }

    /// Reports the last planned write as completed: its slot headers, and what it wrote of
    /// the checkpoint containers.
    pub fn completed(&self) {
        self.headers_completed();
        self.slots.containers_written(self.containers);
    }

    fn headers_completed(&self) {
        for &(slot, generation) in &self.headers {
            self.slots.header_completed(slot, generation);
        }
    }

    /// What the last planned write, discard or write-zeroes changes of the checkpoint
    /// containers: once it has reached the device (or failed), the caller reports it with
    /// [`SlotTable::containers_written`] ([`Self::completed`] does it for the last plan).
    pub fn planned_containers(&self) -> ContainerWrites {
        self.containers
    }

    /// Slots the last planned write touched while fdpblk was deallocating them: the caller
    /// must not submit the write before [`SlotTable::trimming`] is false for each.
    pub fn trim_waits(&self) -> &[u64] {
        &self.trim_waits
    }

    /// Checkpoint containers whose header block the last planned write (or discard) touches
    /// while fdpblk zeroes it: the caller must not submit the request before
    /// [`SlotTable::container_zeroing`] is false for each.
    pub fn container_waits(&self) -> &[u8] {
        &self.container_waits
    }

    /// What reads, discards and write-zeroes tell the slot table: loads of slot contents,
    /// and (for the two that change data) writes to slots and containers.
    /// A load is a read that begins at a payload's start (LMCache reads from there, never
    /// the header): a read that only runs into a payload from before it (readahead across a
    /// slot boundary, a header read enlarged by the page cache) is not one.
    fn observe_other(&mut self, op: Op) {
        for (i, e) in self.extents.iter().enumerate() {
            match (op, e.kind) {
                (Op::Read, ExtentKind::SlotPayload { slot }) if i == 0 && e.offset == self.geom.slot_offset(slot) + self.geom.header_bytes => {
                    let slot_reads = self.slots.note_read(slot);
                    let identity = self.slots.get(slot).map(|h| h.identity);
                    self.policy.observe(&Observation::Read { slot, identity, len: e.len, slot_reads });
                }
                (Op::Read, ExtentKind::CheckpointHeader { copy, .. }) => self.slots.note_checkpoint_read(copy),
                (Op::Discard | Op::WriteZeroes, kind) => match kind {
                    ExtentKind::CheckpointHeader { copy, .. } => {
                        if self.slots.checkpoint_header(copy, None) {
                            self.container_waits.push(copy);
                        }
                        self.containers.header_block(copy);
                    }
                    ExtentKind::CheckpointPayload { copy } => {
                        self.containers.payloads |= 1 << copy;
                        self.slots.container_touched(copy)
                    }
                    ExtentKind::SlotHeader { slot, .. } | ExtentKind::SlotPayload { slot } | ExtentKind::SlotPadding { slot } => {
                        if self.slots.note_write(slot) {
                            self.trim_waits.push(slot);
                        }
                    }
                    ExtentKind::Outside => {}
                },
                _ => {}
            }
        }
    }

    /// The first slot whose payload this request carries while its header is not known:
    /// no header seen in this request, and the slot's current header expects no more payload.
    /// Bytes past the current header's payload (padding by that header) count too: a longer
    /// put's payload, come before its header. Also those inside the payload's last
    /// `block_align` block: there a request split inside that block (`block_align` > 4 KiB)
    /// may carry the put's own padding, which then waits once; but it may as well be a longer
    /// put's page, which must be counted to that put's header when it comes.
    fn awaited_header(&self) -> Option<u64> {
        let mut header_here = None;
        for e in &self.extents {
            match e.kind {
                ExtentKind::SlotHeader { slot, header } if header.valid().is_some() => header_here = Some(slot),
                ExtentKind::SlotPayload { slot } | ExtentKind::SlotPadding { slot }
                    if header_here != Some(slot) && !self.slots.expects_payload(slot) =>
                {
                    return Some(slot)
                }
                _ => {}
            }
        }
        None
    }

    fn place(&mut self, e: &Extent) -> Handle {
        // The header generation a payload or padding write is judged against; another queue
        // may record a new header before it is placed (see `judged_on_a_replaced_header`).
        let judged = match e.kind {
            ExtentKind::SlotPayload { slot } | ExtentKind::SlotPadding { slot } => self.slots.generation(slot),
            _ => None,
        };
        if let Some(slot) = e.kind.slot() {
            // Every write to a slot (its header's through `record_header`) is stamped.
            let header = matches!(e.kind, ExtentKind::SlotHeader { header, .. } if header.valid().is_some());
            let waits = match e.kind {
                _ if header => false,
                ExtentKind::SlotPayload { .. } | ExtentKind::SlotPadding { .. } if self.within_payload(slot, e) => {
                    self.slots.note_payload_write(slot)
                }
                ExtentKind::SlotPayload { .. } | ExtentKind::SlotPadding { .. } => {
                    // Past the current payload: a longer put's bytes ahead of its header. The
                    // orphan mark goes first: a tail deallocation that read no mark then finds
                    // the write's touch (its CAS fails) or holds the write (`note_write`).
                    self.slots.note_orphan(slot, self.orphan_end(slot, e));
                    self.slots.note_write(slot)
                }
                // The rest of a header block past its identity and length (the page cache
                // writing back an 8 KiB header's second page apart): neither payload nor tail.
                ExtentKind::SlotHeader { header: Parsed::Absent, .. }
                    if e.offset >= self.geom.slot_offset(slot) + SLOT_HEADER_PREFIX as u64 =>
                {
                    self.slots.note_payload_write(slot)
                }
                _ => self.slots.note_write(slot),
            };
            if waits {
                self.trim_waits.push(slot);
            }
        }
        match e.kind {
            ExtentKind::CheckpointHeader { copy, .. } if e.offset >= self.geom.container_offset(copy) + CHECKPOINT_HEADER_LEN as u64 => {
                // Only the header's padding (a block past 4 KiB written alone): it waits for a
                // zeroing under way but does not hold one off, and either order is safe, since
                // the zeroed 32-byte header alone makes the copy one LMCache does not load.
                if self.slots.checkpoint_block_padding(copy) {
                    self.container_waits.push(copy);
                }
                self.policy.place(&Target::Checkpoint { copy })
            }
            ExtentKind::CheckpointHeader { copy, header } => {
                // Before the write goes out: its epoch must precede LMCache's next snapshot.
                if self.slots.checkpoint_header(copy, header.valid().copied()) {
                    self.container_waits.push(copy);
                }
                self.containers.header_block(copy);
                self.policy.place(&Target::Checkpoint { copy })
            }
            ExtentKind::CheckpointPayload { copy } => {
                self.containers.payloads |= 1 << copy;
                self.slots.container_touched(copy);
                self.policy.place(&Target::Checkpoint { copy })
            }
            ExtentKind::Outside => self.policy.place(&Target::Outside),
            ExtentKind::SlotHeader { slot, header } => match header.valid() {
                Some(h) => {
                    // A header claiming more payload than its slot holds (not LMCache's: its
                    // loader drops such an entry) is taken as a full slot; its count would
                    // otherwise never end, and the slot would expect payload until its next put.
                    let h = &SlotHeader { payload_len: h.payload_len.min(self.geom.slot_payload_capacity()), ..*h };
                    // Bytes that came before this header within its payload are its own (or
                    // it overwrites them).
                    self.slots.settle_orphans(slot, self.covered_units(h.payload_len));
                    let previous = self.slots.get(slot);
                    // The old header still expected payload: some bytes inside its payload
                    // came without being counted (ahead of it past the header wait, a failed
                    // batch, another LMCache's slot after a geometry change), so what lies
                    // there past this shorter payload is not known to be a stale tail.
                    if let Some(old) = previous.filter(|o| o.payload_len > h.payload_len && self.slots.expects_payload(slot)) {
                        let old_end = self.geom.payload_end(old.payload_len).min(self.geom.slot_bytes);
                        self.slots.note_orphan(slot, self.slot_fraction(old_end, true));
                    }
                    let handle =
                        self.policy.place(&Target::Slot { slot, header: Some(h), previous: previous.as_ref() });
                    let generation = self.slots.record_header(slot, h, handle);
                    if self.slots.trimming(slot) {
                        self.trim_waits.push(slot);
                    }
                    self.headers.push((slot, generation));
                    handle
                }
                None => self.slot_handle(slot),
            },
            ExtentKind::SlotPayload { slot } => {
                let known = self.slots.expected_payload(slot);
                let h = self.slot_handle(slot);
                if self.judged_on_a_replaced_header(slot, e, judged) {
                    return h;
                }
                if let Some(generation) = known {
                    self.slots.payload_written(slot, e.len, generation);
                } else {
                    // Placed without its header: maybe a later put's payload. Not where a
                    // credit ended the current header's count early: its own bytes, late.
                    self.slots.note_orphan(slot, self.orphan_end(slot, e));
                    if self.slots.headers_seen() && !(self.slots.count_ended_on_a_credit(slot) && self.within_payload(slot, e)) {
                        self.slots.payload_ahead(slot, e.len);
                    }
                    self.tally.fell_back = true;
                }
                h
            }
            ExtentKind::SlotPadding { slot } => {
                // Past a payload that is complete: a longer put's bytes ahead of its header,
                // which its header takes as written (as for the part over the old payload).
                let ahead = !self.within_payload(slot, e) && !self.slots.expects_payload(slot) && self.slots.headers_seen();
                if self.judged_on_a_replaced_header(slot, e, judged) {
                    return self.slot_handle(slot);
                }
                if ahead {
                    self.slots.payload_ahead(slot, e.len);
                    self.tally.fell_back = true;
                }
                self.slot_handle(slot)
            }
        }
    }

    /// True, after marking the bytes as orphans, when another queue recorded a header for
    /// `slot` since this payload or padding write was judged against header generation
    /// `judged`, and the bytes do not lie within the new header's payload. They were taken
    /// as the old header's payload (its tail bits kept), and the new header, shorter, would
    /// put them in its stale tail: they may be a later put's payload ahead of its header
    /// (buffered writeback, two queues). Read after the payload count (`expects_payload`):
    /// a header stores its generation before its count, so a count seen here is the
    /// generation's read next, or an older one's. Call it after the placement has read what
    /// it needs of the slot's current header.
    fn judged_on_a_replaced_header(&mut self, slot: u64, e: &Extent, judged: Option<u16>) -> bool {
        let now = self.slots.generation(slot);
        if now == judged || (self.within_payload(slot, e) && self.slots.generation(slot) == now) {
            return false;
        }
        // The orphan mark before the touch, as for bytes past the payload.
        self.slots.note_orphan(slot, self.orphan_end(slot, e));
        if self.slots.note_write(slot) {
            self.trim_waits.push(slot);
        }
        true
    }

    /// True when extent `e` of `slot` ends within the current header's payload rounded up to
    /// `block_align` (LMCache's O_DIRECT padding included): it leaves the header and any
    /// deallocated tail as they are.
    fn within_payload(&self, slot: u64, e: &Extent) -> bool {
        let g = &self.geom;
        let Some(cur) = self.slots.get(slot) else { return false };
        if cur.payload_len >= u64::from(u32::MAX) {
            return false; // the table keeps 32 bits of length
        }
        let end = g.payload_end(cur.payload_len);
        e.offset >= g.slot_offset(slot) + g.header_bytes && e.offset + e.len <= g.slot_offset(slot) + end
    }

    /// How far into `slot` extent `e` reaches, in orphan units rounded up.
    fn orphan_end(&self, slot: u64, e: &Extent) -> u16 {
        self.slot_fraction((e.offset + e.len).saturating_sub(self.geom.slot_offset(slot)), true)
    }

    /// How far a header with `payload_len` settles orphan bytes, in orphan units: `u16::MAX`
    /// when its payload reaches the slot's end (a last unit that is only partly the slot's
    /// is then covered too).
    fn covered_units(&self, payload_len: u64) -> u16 {
        let end = self.geom.payload_end(payload_len);
        if end >= self.geom.slot_bytes {
            u16::MAX
        } else {
            self.slot_fraction(end, false)
        }
    }

    /// `bytes` into a slot in orphan units (rounded up or down): `block_align` blocks, or as
    /// many blocks each as keep a slot within 16 bits. With one block a unit (slots of up to
    /// 65535 blocks), a header settles exactly the bytes its payload reaches; with more, a
    /// payload ending inside a unit leaves the last one to a later header (tails wait).
    fn slot_fraction(&self, bytes: u64, up: bool) -> u16 {
        let g = &self.geom;
        let blocks = g.slot_bytes.div_ceil(g.block_align.max(1));
        let unit = g.block_align.max(1).saturating_mul(blocks.div_ceil(u64::from(u16::MAX)).max(1));
        let f = if up { bytes.div_ceil(unit) } else { bytes / unit };
        f.min(u64::from(u16::MAX)) as u16
    }

    /// The handle of the slot's current header, or the policy's guess when none was seen.
    fn slot_handle(&mut self, slot: u64) -> Handle {
        match self.slots.get(slot) {
            // A handle restored from state another policy saved may be past this one's.
            Some(entry) if entry.handle < self.policy.handles() => entry.handle,
            _ => self.policy.place(&Target::Slot { slot, header: None, previous: None }),
        }
    }

    /// Counts one payload piece that was held for its header.
    pub fn note_header_wait(&self) {
        self.counters.header_waits.fetch_add(1, Relaxed);
    }

    /// Plans `req` (never waiting) and submits it to a synchronous `engine`.
    pub fn execute(&mut self, engine: &mut dyn Engine, req: &Request<'_>) -> Result<(), Errno> {
        let mut segments = Vec::new();
        let _ = self.plan(req, &mut segments, HeaderWait::Expired);
        let res = match req.op {
            Op::Write => {
                let data = req.data.unwrap_or(&[]);
                let res = segments.iter().try_for_each(|s| {
                    let rel = (s.offset - req.offset) as usize;
                    let end = (rel + s.len as usize).min(data.len());
                    engine.write(s.offset, s.len, data.get(rel..end).unwrap_or(&[]), s.handle)
                });
                if res.is_ok() {
                    self.headers_completed();
                }
                res
            }
            Op::Read => {
                let mut buf = vec![0u8; req.len as usize];
                engine.read(req.offset, &mut buf)
            }
            Op::Flush => engine.flush(),
            Op::Discard => engine.discard(req.offset, req.len),
            Op::WriteZeroes => engine.write_zeroes(req.offset, req.len),
        };
        // Failed too: part of it may have landed.
        self.slots.containers_written(self.containers);
        res
    }
}

/// Names of the classes in report order, with their counters.
pub fn class_report(stats: &PipelineStats) -> Vec<(Class, Counter)> {
    Class::ALL.iter().map(|&c| (c, stats.classes[c.index()])).collect()
}

/// Whether `segments` are the request `[offset, offset + len)` exactly: contiguous, in order,
/// none empty. A write is acknowledged once its pieces are written.
pub fn segments_tile(segments: &[Segment], offset: u64, len: u64) -> bool {
    let mut pos = offset;
    for s in segments {
        if s.offset != pos || s.len == 0 {
            return false;
        }
        pos += s.len;
    }
    pos == offset + len
}

/// Appends `len` bytes at `offset` on `handle` to the segments, merging with the last one
/// when it ends there on the same handle. A change of handle inside a `block_align` block
/// (a payload's end and its padding, when another queue's new header for the slot changed
/// its handle between the two look-ups) is not split there: the engines write whole logical
/// blocks (an O_DIRECT or NVMe command at an unaligned offset fails), so the bytes up to the
/// next block boundary stay with the segment before. Returns how many bytes did (0 when
/// the handles agree).
fn push_segment(segments: &mut Vec<Segment>, offset: u64, len: u64, handle: Handle, block_align: u64) -> u64 {
    let block_align = block_align.max(1);
    match segments.last_mut() {
        Some(s) if s.offset + s.len == offset && s.handle == handle => {
            s.len += len;
            0
        }
        Some(s) if s.offset + s.len == offset && !offset.is_multiple_of(block_align) => {
            let head = (block_align - offset % block_align).min(len);
            s.len += head;
            if len > head {
                segments.push(Segment { offset: offset + head, len: len - head, handle });
            }
            head
        }
        _ => {
            segments.push(Segment { offset, len, handle });
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sim::SimEngine;
    use crate::place::{NonePolicy, RegionPolicy};

    use crate::test_fixtures::small_geometry as geom;

    #[test]
    fn payload_follows_header_and_segments_merge() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut eng = SimEngine::new(4 << 20, 4);
        let hdr = SlotHeader { identity: 7, payload_len: 61440 }.encode(4096);
        let mut segs = Vec::new();
        p.plan(&Request { op: Op::Write, offset: g.slot_offset(1), len: 4096, data: Some(&hdr) }, &mut segs, HeaderWait::Allowed)
            .unwrap();
        assert_eq!(segs, vec![Segment { offset: g.slot_offset(1), len: 4096, handle: RegionPolicy::SLOTS }]);
        p.execute(&mut eng, &Request { op: Op::Write, offset: g.slot_offset(1) + 4096, len: 61440, data: None }).unwrap();
        assert_eq!(p.stats().payload_fallbacks, 0);
        // A write over a checkpoint container and into slot 0: two handles, two segments.
        segs.clear();
        let big = Request { op: Op::Write, offset: g.container_offset(1), len: (1 << 20) - g.container_offset(1) + 8192, data: None };
        // Slot 0's payload has no header yet: the pipeline asks to wait, counting nothing.
        assert_eq!(p.plan(&big, &mut segs, HeaderWait::Allowed).err(), Some(0), "slot 1's header was seen");
        assert!(segs.is_empty());
        p.plan(&big, &mut segs, HeaderWait::Expired).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].handle, RegionPolicy::CHECKPOINT);
        assert_eq!(segs[1].handle, RegionPolicy::SLOTS);
        assert_eq!(p.stats().payload_fallbacks, 1);
        assert_eq!(eng.counters.bytes_by_handle[&RegionPolicy::SLOTS], 61440);
    }

    /// A longer put into a slot whose shorter payload is complete, its payload ahead of its
    /// header (past the header wait): the bytes past the old payload count as its payload too,
    /// so the header expects no more once they are all there.
    #[test]
    fn a_longer_puts_payload_ahead_of_its_header_is_all_counted() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let mut write = |p: &mut Pipeline, off: u64, len: u64, data: Option<&[u8]>| {
            p.plan(&Request { op: Op::Write, offset: g.slot_offset(1) + off, len, data }, &mut segs, HeaderWait::Expired).unwrap();
        };
        let short = SlotHeader { identity: 7, payload_len: 8192 }.encode(4096);
        write(&mut p, 0, 4096, Some(&short));
        write(&mut p, 4096, 8192, None);
        assert!(!p.slots().expects_payload(1));
        // The next put: 60 KiB of payload first, over the old payload and past it.
        write(&mut p, 4096, 8192, None);
        write(&mut p, 4096 + 8192, 61440 - 8192, None);
        assert_eq!(p.stats().payload_fallbacks, 2);
        let long = SlotHeader { identity: 8, payload_len: 61440 }.encode(4096);
        write(&mut p, 0, 4096, Some(&long));
        assert!(!p.slots().expects_payload(1), "the header still expects payload that came ahead of it");
    }

    /// One write past the header wait that runs from a complete payload into the padding past
    /// it (a longer put's bytes, ahead of its header) is one fallback, not one per piece.
    #[test]
    fn a_fallback_over_payload_and_padding_counts_once() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let mut write = |p: &mut Pipeline, off: u64, len: u64, data: Option<&[u8]>| {
            p.plan(&Request { op: Op::Write, offset: g.slot_offset(1) + off, len, data }, &mut segs, HeaderWait::Expired).unwrap();
        };
        let short = SlotHeader { identity: 7, payload_len: 8192 }.encode(4096);
        write(&mut p, 0, 4096, Some(&short));
        write(&mut p, 4096, 8192, None);
        write(&mut p, 4096, 61440, None);
        assert_eq!(p.stats().payload_fallbacks, 1);
    }

    /// A pipeline that counts once served (a ublk queue's) counts nothing at planning, and,
    /// given each served request's tally and segments, exactly what one counting at once does;
    /// a request the engine failed is not counted.
    #[test]
    fn counted_when_served_as_at_planning_and_failed_requests_not_at_all() {
        let g = geom();
        let new = || Pipeline::new(g, Box::new(RegionPolicy));
        let (mut now, mut later, mut failed) = (new(), new(), new());
        later.count_when_served();
        failed.count_when_served();
        let mut hdr_and_payload = SlotHeader { identity: 7, payload_len: 8192 }.encode(4096);
        hdr_and_payload.resize(4096 + 8192, 1);
        let reqs = [
            Request { op: Op::Write, offset: g.slot_offset(1), len: 4096 + 8192, data: Some(&hdr_and_payload) },
            Request { op: Op::Write, offset: g.container_offset(0), len: 8192, data: None },
            // Payload without its header (a fallback) running into the next slot's header block.
            Request { op: Op::Write, offset: g.slot_offset(3) - 8192, len: 12288, data: None },
            Request { op: Op::Read, offset: g.slot_offset(1) + 4096, len: 8192, data: None },
            Request { op: Op::Flush, offset: 0, len: 0, data: None },
            Request { op: Op::Discard, offset: g.slot_offset(4), len: 2 * g.slot_bytes, data: None },
            Request { op: Op::WriteZeroes, offset: g.slot_offset(6), len: 4096, data: None },
        ];
        let zero = failed.stats();
        let mut segs = Vec::new();
        for r in &reqs {
            segs.clear();
            now.plan(r, &mut segs, HeaderWait::Expired).unwrap();
            let at_once = std::mem::take(&mut segs);
            let before = later.stats();
            later.plan(r, &mut segs, HeaderWait::Expired).unwrap();
            assert_eq!(segs, at_once);
            assert_eq!(later.stats(), before, "{:?} counted before it was served", r.op);
            later.counters().served(&later.tally(), if r.op == Op::Write { &segs } else { &[] });
            assert_eq!(later.stats(), now.stats(), "after {:?} at {}", r.op, r.offset);
            segs.clear();
            failed.plan(r, &mut segs, HeaderWait::Expired).unwrap();
        }
        assert_eq!(failed.stats(), zero, "requests never served are not counted");
        let s = now.stats();
        assert_eq!((s.payload_fallbacks, s.ops.iter().map(|o| o.requests).sum::<u64>()), (1, 7));
        assert!(s.handle_bytes.iter().filter(|&&b| b > 0).count() >= 2, "{:?}", s.handle_bytes);
    }

    /// A header whose payload_len is past the slot's capacity (foreign bytes that parse as
    /// one): its count ends with the slot's last payload byte, as a full slot's would.
    #[test]
    fn a_header_longer_than_its_slot_counts_as_a_full_slot() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let mut write = |p: &mut Pipeline, off: u64, len: u64, data: Option<&[u8]>| {
            p.plan(&Request { op: Op::Write, offset: g.slot_offset(1) + off, len, data }, &mut segs, HeaderWait::Expired).unwrap();
        };
        let long = SlotHeader { identity: 7, payload_len: 1 << 20 }.encode(4096);
        write(&mut p, 0, 4096, Some(&long));
        assert!(p.slots().expects_payload(1));
        write(&mut p, 4096, g.slot_payload_capacity(), None);
        assert!(!p.slots().expects_payload(1), "the slot still expects payload past its end");
        assert_eq!(p.stats().payload_fallbacks, 0);
    }

    /// A wrong credit (a piece of the put before, re-sent after a restart, placed while no
    /// header expected payload) ends the next put's count early, and that one only: its own
    /// last bytes, which then come with no payload expected, are no credit for the put after.
    #[test]
    fn a_wrong_credit_ends_one_puts_count_early_not_every_later_ones() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let mut write = |p: &mut Pipeline, off: u64, len: u64, data: Option<&[u8]>| {
            p.plan(&Request { op: Op::Write, offset: g.slot_offset(1) + off, len, data }, &mut segs, HeaderWait::Expired).unwrap();
        };
        let header = |identity| SlotHeader { identity, payload_len: 8192 }.encode(4096);
        write(&mut p, 0, 4096, Some(&header(7)));
        write(&mut p, 4096, 8192, None);
        assert!(!p.slots().expects_payload(1));
        write(&mut p, 8192, 4096, None);
        assert_eq!(p.stats().payload_fallbacks, 1);
        // The next put takes it as its own: its count ends with its first piece.
        write(&mut p, 0, 4096, Some(&header(8)));
        write(&mut p, 4096, 4096, None);
        assert!(!p.slots().expects_payload(1));
        write(&mut p, 8192, 4096, None);
        assert_eq!(p.stats().payload_fallbacks, 2);
        // The put after it expects all of its payload.
        write(&mut p, 0, 4096, Some(&header(9)));
        write(&mut p, 4096, 4096, None);
        assert!(p.slots().expects_payload(1), "the put before's late bytes were credited to this one");
        write(&mut p, 8192, 4096, None);
        assert!(!p.slots().expects_payload(1));
        assert_eq!(p.stats().payload_fallbacks, 2);
    }

    /// 8 KiB header blocks (`header_bytes` and `block_align` 8192) written back by the page
    /// cache a page at a time: the second page, all padding, neither supersedes the
    /// checkpoint header the first carried nor takes back a slot header's completion.
    #[test]
    fn the_second_page_of_an_8k_header_changes_neither_header() {
        use crate::layout::checkpoint_header::CheckpointHeader as Ck;
        use crate::slot_table::life::{HEADER_DONE, STALE_TAIL};
        let g = crate::layout::GeometryConfig { block_align: 8192, header_bytes: 8192, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate(16 << 20)
            .unwrap();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let page = |p: &mut Pipeline, segs: &mut Vec<Segment>, offset: u64, data: &[u8]| {
            p.plan(&Request { op: Op::Write, offset, len: 4096, data: Some(data) }, segs, HeaderWait::Expired).unwrap();
        };
        let zeros = [0u8; 4096];
        // Checkpoint seq 3 in copy 1: its header's page, then the block's second page.
        let ck = Ck::encode_for(3, b"{}", 8192);
        page(&mut p, &mut segs, g.container_offset(1), &ck[..4096]);
        page(&mut p, &mut segs, g.container_offset(1) + 4096, &zeros);
        let (events, _) = p.slots().take_events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].header.map(|h| h.seq), Some(3));
        // Nor does it hold back the state thread's zeroing of the block planned on that event.
        assert!(p.slots().begin_container_zeroing(1, events[0].writes));
        p.slots().end_container_zeroing(1);
        // The same for a slot header: the completed header keeps its stale tail to trim.
        let hdr = SlotHeader { identity: 5, payload_len: 4096 }.encode(8192);
        page(&mut p, &mut segs, g.slot_offset(2), &hdr[..4096]);
        p.completed();
        assert_eq!(p.slots().life(2) & (STALE_TAIL | HEADER_DONE), STALE_TAIL | HEADER_DONE);
        page(&mut p, &mut segs, g.slot_offset(2) + 4096, &zeros);
        assert_eq!(p.slots().life(2) & (STALE_TAIL | HEADER_DONE), STALE_TAIL | HEADER_DONE, "the header's padding page");
        // A write over the identity is another matter.
        page(&mut p, &mut segs, g.slot_offset(2), &zeros);
        assert_eq!(p.slots().life(2) & (STALE_TAIL | HEADER_DONE), 0);
        page(&mut p, &mut segs, g.container_offset(1), &zeros);
        assert_eq!(p.slots().take_events().0[0].header, None);
    }

    /// The queue acknowledges a write once its planned pieces are written: they must be the
    /// whole request, whatever handles its bytes go to.
    #[test]
    fn planned_write_segments_tile_the_request() {
        let seg = |offset, len| Segment { offset, len, handle: 1 };
        assert!(segments_tile(&[seg(4096, 100), seg(4196, 4000)], 4096, 4100));
        assert!(segments_tile(&[], 512, 0));
        assert!(!segments_tile(&[seg(4096, 100), seg(4200, 3996)], 4096, 4100), "a gap");
        assert!(!segments_tile(&[seg(4096, 100)], 4096, 4100), "short");
        assert!(!segments_tile(&[seg(0, 4096)], 4096, 4096), "elsewhere");
        assert!(!segments_tile(&[seg(4096, 0), seg(4096, 4096)], 4096, 4096), "an empty piece");
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let hdr = SlotHeader { identity: 7, payload_len: 61440 }.encode(4096);
        let mut segs = Vec::new();
        p.plan(&Request { op: Op::Write, offset: g.slot_offset(1), len: 4096, data: Some(&hdr) }, &mut segs, HeaderWait::Allowed)
            .unwrap();
        // Writes of four sizes, from 512 bytes to past a slot, at offsets stepping across the
        // metadata, slot edges and slots.
        let size = 4u64 << 20;
        for offset in (0..size).step_by(24_576 + 512) {
            for len in [512, 4096, 65536 + 512, 300 * 1024] {
                let len = len.min(size - offset);
                segs.clear();
                p.plan(&Request { op: Op::Write, offset, len, data: None }, &mut segs, HeaderWait::Expired).unwrap();
                assert!(segments_tile(&segs, offset, len), "write at {offset} of {len}: {segs:?}");
            }
        }
    }

    #[test]
    fn segments_change_handle_only_at_block_boundaries() {
        let seg = |offset, len, handle| Segment { offset, len, handle };
        let mut s = Vec::new();
        assert_eq!(push_segment(&mut s, 0, 5000, 1, 4096), 0);
        assert_eq!(push_segment(&mut s, 5000, 100, 1, 4096), 0);
        assert_eq!(s, vec![seg(0, 5100, 1)]);
        // Another handle from inside a block: the block's rest stays on handle 1.
        assert_eq!(push_segment(&mut s, 5100, 5000, 2, 4096), 3092);
        assert_eq!(s, vec![seg(0, 8192, 1), seg(8192, 1908, 2)]);
        // Ending inside that block: all of it stays.
        let mut t = vec![seg(0, 5000, 1)];
        assert_eq!(push_segment(&mut t, 5000, 100, 2, 4096), 100);
        assert_eq!(t, vec![seg(0, 5100, 1)]);
        // At a boundary, a new segment; a gap, too.
        push_segment(&mut s, 10100, 100, 2, 4096);
        push_segment(&mut s, 12288, 4096, 3, 4096);
        push_segment(&mut s, 20480, 10, 3, 4096);
        assert_eq!(s, vec![seg(0, 8192, 1), seg(8192, 2008, 2), seg(12288, 4096, 3), seg(20480, 10, 3)]);
    }

    #[test]
    fn orphans_marked_everywhere_are_settled_only_by_a_payload_to_the_slot_end() {
        use crate::layout::GeometryConfig;
        // 80 MiB slots of 512-byte blocks: an orphan unit is 3 blocks, and the slot's end
        // falls inside its last unit.
        let big = GeometryConfig { block_align: 512, header_bytes: 4096, slot_bytes: 80 << 20, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate((1 << 20) + (160 << 20))
            .unwrap();
        for g in [geom(), big] {
            let slots = Arc::new(SlotTable::new(g.max_slots));
            let mut p = Pipeline::with_slots(g, Box::new(NonePolicy), slots.clone());
            slots.orphans_everywhere();
            let mut segs = Vec::new();
            let mut put = |payload_len: u64| {
                let hdr = SlotHeader { identity: 9, payload_len }.encode(g.header_bytes as usize);
                let req = Request { op: Op::Write, offset: g.slot_offset(0), len: g.header_bytes, data: Some(&hdr) };
                p.plan(&req, &mut segs, HeaderWait::Expired).unwrap();
                slots.is_orphan(0)
            };
            let full = g.slot_bytes - g.header_bytes;
            assert!(put(full - g.block_align), "a payload one block short of the end settles nothing");
            assert!(!put(full - 1), "a payload that reaches the end (rounded up) settles all");
            assert!(slots.is_orphan(1), "other slots keep theirs");
        }
    }

    /// A discard of the whole device goes a piece at a time: each slot is told of it, each
    /// class counts one request and all its bytes, and the extents held stay one piece's.
    #[test]
    fn a_device_wide_discard_is_planned_in_bounded_pieces() {
        let g = crate::layout::GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 8192, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
            .validate(64 << 20)
            .unwrap();
        assert!(g.max_slots > 4 * DISCARD_PIECE_SLOTS);
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let hdr = SlotHeader { identity: 7, payload_len: 4096 }.encode(4096);
        use crate::slot_table::life::STALE_TAIL;
        for slot in [0, g.max_slots - 1] {
            p.plan(&Request { op: Op::Write, offset: g.slot_offset(slot), len: 4096, data: Some(&hdr) }, &mut segs, HeaderWait::Expired).unwrap();
            assert!(p.slots().life(slot) & STALE_TAIL != 0, "a new header over unknown bytes");
        }
        let before = p.stats();
        let len = 64 << 20;
        p.plan(&Request { op: Op::Discard, offset: 0, len, data: None }, &mut segs, HeaderWait::Allowed).unwrap();
        let after = p.stats();
        let class_requests: u64 = after.classes.iter().zip(&before.classes).map(|(a, b)| a.requests - b.requests).sum();
        let class_bytes: u64 = after.classes.iter().zip(&before.classes).map(|(a, b)| a.bytes - b.bytes).sum();
        assert_eq!(class_bytes, len, "every byte in some class");
        assert!(class_requests <= 4, "one request per class, not per piece: {class_requests}");
        for slot in [0, g.max_slots - 1] {
            assert_eq!(p.slots().life(slot) & STALE_TAIL, 0, "slot {slot} was told of the discard");
        }
        assert!(p.extents.capacity() <= 4 * DISCARD_PIECE_SLOTS as usize, "{} extents held", p.extents.capacity());
    }

    #[test]
    fn a_checkpoint_header_write_waits_while_fdpblk_zeroes_that_container() {
        let g = geom();
        let mut p = Pipeline::new(g, Box::new(RegionPolicy));
        let mut segs = Vec::new();
        let block = vec![0u8; g.block_align as usize];
        let header = |copy: u8| Request { op: Op::Write, offset: g.container_offset(copy), len: g.block_align, data: Some(&block) };
        assert!(p.slots().begin_container_zeroing(1, 0));
        p.plan(&header(1), &mut segs, HeaderWait::Allowed).unwrap();
        assert_eq!(p.container_waits(), &[1]);
        p.plan(&header(0), &mut segs, HeaderWait::Allowed).unwrap();
        assert!(p.container_waits().is_empty());
        // A discard of the header block waits too.
        p.plan(&Request { op: Op::Discard, offset: g.container_offset(1), len: g.block_align, data: None }, &mut segs, HeaderWait::Allowed).unwrap();
        assert_eq!(p.container_waits(), &[1]);
        p.slots().end_container_zeroing(1);
        p.plan(&header(1), &mut segs, HeaderWait::Allowed).unwrap();
        assert!(p.container_waits().is_empty());
    }

    #[test]
    fn loads_on_one_queue_place_headers_on_another() {
        use crate::place::{KeyAwarePolicy, SharedPolicy};
        let g = geom();
        let slots = Arc::new(SlotTable::new(g.max_slots));
        let shared = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
        let mut q0 = Pipeline::with_slots(g, Box::new(shared.clone()), slots.clone());
        let mut q1 = Pipeline::with_slots(g, Box::new(shared), slots.clone());
        let mut segs = Vec::new();
        let put = |q: &mut Pipeline, slot: u64, identity: u64, segs: &mut Vec<Segment>| {
            let hdr = SlotHeader { identity, payload_len: 8192 }.encode(4096);
            segs.clear();
            q.plan(&Request { op: Op::Write, offset: g.slot_offset(slot), len: 4096, data: Some(&hdr) }, segs, HeaderWait::Expired)
                .unwrap();
            segs[0].handle
        };
        assert_eq!(put(&mut q0, 1, 42, &mut segs), KeyAwarePolicy::YOUNG);
        // A load reads from the payload start (once per load, however the read is split);
        // a read elsewhere in the slot is not a load.
        let load = Request { op: Op::Read, offset: g.slot_offset(1) + 4096, len: 4096, data: None };
        let other = Request { op: Op::Read, offset: g.slot_offset(1) + 8192, len: 4096, data: None };
        q1.plan(&load, &mut segs, HeaderWait::Expired).unwrap();
        q1.plan(&other, &mut segs, HeaderWait::Expired).unwrap();
        // Nor is readahead that runs from slot 0's payload, or from slot 1's header, into
        // slot 1's payload start.
        let over_boundary = Request { op: Op::Read, offset: g.slot_offset(1) - 4096, len: 12288, data: None };
        let header_read = Request { op: Op::Read, offset: g.slot_offset(1), len: 16384, data: None };
        q1.plan(&over_boundary, &mut segs, HeaderWait::Expired).unwrap();
        q1.plan(&header_read, &mut segs, HeaderWait::Expired).unwrap();
        // Identity 42 comes back into another slot, written through queue 0: read once before.
        assert_eq!(put(&mut q0, 3, 42, &mut segs), KeyAwarePolicy::READ);
        assert_eq!(put(&mut q0, 4, 43, &mut segs), KeyAwarePolicy::YOUNG);
        let reads = (slots.life(1) & crate::slot_table::life::READS_MASK) >> crate::slot_table::life::READS_SHIFT;
        assert_eq!(reads, 1, "one load of slot 1");
    }

    #[test]
    fn a_handle_saved_under_another_policy_is_not_used_past_this_ones_handles() {
        use crate::place::KeyAwarePolicy;
        let g = geom();
        let slots = Arc::new(SlotTable::new(g.max_slots));
        // Saved by `region`, whose own-state handle is 3; `key-aware` has 3 handles.
        slots.record_header(2, &SlotHeader { identity: 7, payload_len: 8192 }, 3);
        let mut q = Pipeline::with_slots(g, Box::new(KeyAwarePolicy::new()), slots);
        let mut segs = Vec::new();
        let payload = Request { op: Op::Write, offset: g.slot_offset(2) + 4096, len: 8192, data: None };
        q.plan(&payload, &mut segs, HeaderWait::Expired).unwrap();
        assert!(!segs.is_empty() && segs.iter().all(|s| s.handle < 3), "{segs:?}");
    }

    #[test]
    fn a_shorter_header_after_an_incomplete_payload_leaves_the_rest_unknown() {
        let g = geom();
        let slots = Arc::new(SlotTable::new(g.max_slots));
        let mut p = Pipeline::with_slots(g, Box::new(RegionPolicy), slots.clone());
        let mut segs = Vec::new();
        let mut put = |slot: u64, identity: u64, payload_len: u64, written: u64| {
            let hdr = SlotHeader { identity, payload_len }.encode(4096);
            p.plan(&Request { op: Op::Write, offset: g.slot_offset(slot), len: 4096, data: Some(&hdr) }, &mut segs, HeaderWait::Expired)
                .unwrap();
            if written > 0 {
                p.plan(&Request { op: Op::Write, offset: g.slot_offset(slot) + 4096, len: written, data: None }, &mut segs, HeaderWait::Expired)
                    .unwrap();
            }
        };
        // A long payload written whole, then a shorter one: its tail is a stale one.
        put(1, 1, 61440, 61440);
        put(1, 2, 8192, 8192);
        assert!(!slots.is_orphan(1));
        // A long payload of which fdpblk counted only part: past the shorter payload that
        // follows, bytes may be anyone's (another LMCache's slot, a later put's payload).
        put(2, 1, 61440, 8192);
        put(2, 2, 8192, 8192);
        assert!(slots.is_orphan(2), "the rest of the old payload is not a stale tail");
        // A header whose payload reaches as far settles it.
        put(2, 3, 61440, 61440);
        assert!(!slots.is_orphan(2));
        // io_uring: part of a payload ahead of its header (past the header wait) counts as
        // written when the header comes, so the put completes and the next, shorter one
        // leaves a stale tail as usual.
        let ahead = Request { op: Op::Write, offset: g.slot_offset(3) + 4096 + 8192, len: 53248, data: None };
        p.plan(&ahead, &mut segs, HeaderWait::Expired).unwrap();
        assert!(slots.is_orphan(3));
        let hdr = SlotHeader { identity: 4, payload_len: 61440 }.encode(4096);
        p.plan(&Request { op: Op::Write, offset: g.slot_offset(3), len: 4096, data: Some(&hdr) }, &mut segs, HeaderWait::Expired).unwrap();
        p.plan(&Request { op: Op::Write, offset: g.slot_offset(3) + 4096, len: 8192, data: None }, &mut segs, HeaderWait::Expired).unwrap();
        assert!(!slots.expects_payload(3), "the whole payload came");
        let hdr = SlotHeader { identity: 5, payload_len: 8192 }.encode(4096);
        p.plan(&Request { op: Op::Write, offset: g.slot_offset(3), len: 4096, data: Some(&hdr) }, &mut segs, HeaderWait::Expired).unwrap();
        assert!(!slots.is_orphan(3));
    }

    #[test]
    fn a_new_put_of_a_reused_slot_waits_for_its_header() {
        let g = geom();
        let slots = Arc::new(SlotTable::new(g.max_slots));
        let mut q0 = Pipeline::with_slots(g, Box::new(RegionPolicy), slots.clone());
        let mut q1 = Pipeline::with_slots(g, Box::new(RegionPolicy), slots);
        let hdr = SlotHeader { identity: 1, payload_len: 8192 }.encode(4096);
        let payload = Request { op: Op::Write, offset: g.slot_offset(2) + 4096, len: 8192, data: None };
        let header = Request { op: Op::Write, offset: g.slot_offset(2), len: 4096, data: Some(&hdr) };
        let mut segs = Vec::new();
        // Before any LMCache header was seen (fio, mkfs), nothing waits.
        assert!(q1.plan(&payload, &mut segs, HeaderWait::Allowed).is_ok());
        let other = SlotHeader { identity: 5, payload_len: 4096 }.encode(4096);
        q0.plan(&Request { op: Op::Write, offset: g.slot_offset(0), len: 4096, data: Some(&other) }, &mut segs, HeaderWait::Allowed).unwrap();
        assert!(q1.plan(&payload, &mut segs, HeaderWait::Allowed).is_err());
        q0.plan(&header, &mut segs, HeaderWait::Allowed).unwrap(); // the header lands on queue 0
        q1.plan(&payload, &mut segs, HeaderWait::Allowed).unwrap(); // now the payload can go
        // The put is complete; a second payload write means a new put: wait again.
        assert!(q1.plan(&payload, &mut segs, HeaderWait::Allowed).is_err());
        // So does a longer put's payload past the old one (padding by the old header), and
        // once its header came it is payload, placed with that header.
        let longer = Request { op: Op::Write, offset: g.slot_offset(2) + 4096 + 8192, len: 8192, data: None };
        assert!(q1.plan(&longer, &mut segs, HeaderWait::Allowed).is_err());
        let hdr16 = SlotHeader { identity: 9, payload_len: 16384 }.encode(4096);
        q0.plan(&Request { op: Op::Write, offset: g.slot_offset(2), len: 4096, data: Some(&hdr16) }, &mut segs, HeaderWait::Allowed).unwrap();
        let planned = q1.plan(&longer, &mut segs, HeaderWait::Allowed).unwrap();
        assert!(matches!(planned, [Extent { kind: ExtentKind::SlotPayload { slot: 2 }, .. }]), "{planned:?}");
        q1.plan(&payload, &mut segs, HeaderWait::Allowed).unwrap(); // its first half: the put is complete
        assert!(!q1.slots().expects_payload(2));
        let mut s = q0.stats();
        s.add(&q1.stats());
        assert_eq!(s.payload_fallbacks, 1); // the fio-like write before any header
        assert_eq!(s.handle_bytes[RegionPolicy::SLOTS as usize], 3 * 4096 + 4 * 8192);
    }

    /// Queue 1 judges a payload write against slot 1's complete long header; before it places
    /// the bytes, queue 0 records a shorter header (buffered writeback hands fdpblk pages of
    /// two puts on two queues). Bytes past the new payload must not count as its payload, or
    /// its early tail would deallocate them (they may be a later put's, ahead of its header).
    #[test]
    fn a_payload_judged_against_a_header_replaced_meanwhile_is_orphaned() {
        use crate::slot_table::life;
        let g = geom();
        let slots = Arc::new(SlotTable::new(g.max_slots));
        let mut q0 = Pipeline::with_slots(g, Box::new(RegionPolicy), slots.clone());
        let mut q1 = Pipeline::with_slots(g, Box::new(RegionPolicy), slots.clone());
        let mut segs = Vec::new();
        let mut write = |q: &mut Pipeline, slot: u64, off: u64, len: u64, data: Option<&[u8]>| {
            q.plan(&Request { op: Op::Write, offset: g.slot_offset(slot) + off, len, data }, &mut segs, HeaderWait::Expired).unwrap();
        };
        let long = SlotHeader { identity: 1, payload_len: 61440 }.encode(4096);
        let short = SlotHeader { identity: 2, payload_len: 8192 }.encode(4096);
        for slot in [1, 2, 3] {
            write(&mut q0, slot, 0, 4096, Some(&long));
            write(&mut q0, slot, 4096, 61440, None);
        }
        let judged = |slot| slots.generation(slot);
        let at = |slot, off, len| Extent { offset: g.slot_offset(slot) + 4096 + off, len, kind: ExtentKind::SlotPayload { slot } };
        // Past the new, shorter payload: orphan bytes, and no stale tail.
        let was = judged(1);
        write(&mut q0, 1, 0, 4096, Some(&short));
        assert_ne!(slots.life(1) & life::STALE_TAIL, 0);
        assert!(q1.judged_on_a_replaced_header(1, &at(1, 16384, 8192), was));
        assert!(slots.is_orphan(1));
        assert_eq!(slots.life(1) & (life::STALE_TAIL | life::HEADER_DONE), 0);
        // Within the new payload: its own.
        let was = judged(2);
        write(&mut q0, 2, 0, 4096, Some(&short));
        assert!(!q1.judged_on_a_replaced_header(2, &at(2, 0, 8192), was));
        assert!(!slots.is_orphan(2));
        // No header since: nothing to do.
        assert!(!q1.judged_on_a_replaced_header(3, &at(3, 16384, 8192), judged(3)));
        assert!(!slots.is_orphan(3));
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
