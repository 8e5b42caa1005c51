//! `IoShaper`: LMCache's operations as the block requests the device receives (posix O_DIRECT,
//! buffered writeback, io_uring batches).

use super::*;

/// One block request the device receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIo {
    pub write: bool,
    pub offset: u64,
    pub len: u64,
    /// The slot header this write starts with, if it starts at one. (Buffered writeback can
    /// merge several slots into one request; the model cuts such a request at each header, so
    /// a header always starts a request. fdpblk classifies by position, so the placement is
    /// the same as for the merged request whose bytes carry the header.)
    pub header: Option<SlotHeader>,
    /// The 32-byte `LMCIDX01` header this write starts with (a checkpoint commit).
    pub checkpoint: Option<[u8; 32]>,
}

/// Turns LMCache's operations into block requests (see the module comment).
pub struct IoShaper {
    geom: Geometry,
    io: IoMode,
    max_req: u64,
    window: usize,
    /// Buffered: a checkpoint goes out ahead of the dirty slot pages (`checkpoint_writeback`).
    checkpoint_first: bool,
    /// Buffered: the latest dirty put per slot, in first-dirtied order, with the payload bytes
    /// dirty since the slot's last writeback: a shorter put leaves an earlier one's pages past
    /// its end dirty, and the kernel writes them back too.
    dirty: Vec<(u64, SlotHeader, u64)>,
    dirty_pos: HashMap<u64, usize>,
    runs: Vec<(u64, u64)>,
    /// io_uring: the puts of the batch being gathered, the batch's requests with their
    /// delivery rank, the reorder window and its generator.
    pending: Vec<(u64, SlotHeader)>,
    batch: Vec<(u64, BlockIo)>,
    reorder: u64,
    rng: SplitMix64,
    /// io_uring: the delivery order of a checkpoint's two writes (a generator of its own, so
    /// that the puts' batches come out as they would without checkpoints).
    checkpoint_rng: SplitMix64,
}

impl IoShaper {
    /// `seed` drives io_uring's delivery order only (the other modes are deterministic).
    pub fn new(spec: &WorkloadSpec, geom: Geometry, seed: u64) -> Self {
        IoShaper {
            geom,
            io: spec.io,
            max_req: spec.max_request_bytes,
            window: spec.writeback_puts,
            // Only page-cache writeback holds slot pages back: O_DIRECT and io_uring puts are
            // out before LMCache's checkpoint tick (the tick waits for no I/O in flight).
            checkpoint_first: spec.checkpoint_before_slots && spec.io == IoMode::Buffered,
            dirty: Vec::new(),
            dirty_pos: HashMap::new(),
            runs: Vec::new(),
            pending: Vec::new(),
            batch: Vec::new(),
            reorder: spec.uring_reorder_window,
            rng: SplitMix64(mix64(seed ^ 0x1e0_0d1e_c7ed)),
            checkpoint_rng: SplitMix64(mix64(seed ^ 0xc4e_c7b0_1d7e)),
        }
    }

    fn split(&self, offset: u64, len: u64, header: Option<SlotHeader>, write: bool, out: &mut dyn FnMut(&BlockIo)) {
        let mut pos = offset;
        let end = offset + len;
        let mut first = true;
        while pos < end {
            let n = (end - pos).min(self.max_req);
            let h = if first { header } else { None };
            out(&BlockIo { write, offset: pos, len: n, header: h, checkpoint: None });
            first = false;
            pos += n;
        }
    }

    fn round(&self, n: u64) -> u64 {
        n.div_ceil(self.geom.block_align) * self.geom.block_align
    }

    /// Emits the block requests of `op` (buffered puts may be held until writeback).
    pub fn shape(&mut self, op: &LmOp<'_>, out: &mut dyn FnMut(&BlockIo)) {
        let g = self.geom;
        match *op {
            LmOp::Put { slot, identity, payload_len, .. } => {
                let h = SlotHeader { identity, payload_len };
                match self.io {
                    IoMode::ODirect => {
                        // Two writes, each split at the largest request (a header region
                        // larger than that too: only its first request carries the header).
                        let off = g.slot_offset(slot);
                        self.split(off, g.header_bytes, Some(h), true, out);
                        self.split(off + g.header_bytes, self.round(payload_len), None, true, out);
                    }
                    IoMode::Buffered => {
                        match self.dirty_pos.get(&slot) {
                            Some(&i) => {
                                let d = &mut self.dirty[i];
                                d.1 = h;
                                d.2 = d.2.max(payload_len);
                            }
                            None => {
                                self.dirty_pos.insert(slot, self.dirty.len());
                                self.dirty.push((slot, h, payload_len));
                            }
                        }
                        if self.dirty.len() >= self.window {
                            self.flush(out);
                        }
                    }
                    IoMode::IoUring => {
                        self.pending.push((slot, h));
                        if self.pending.len() >= URING_BATCH_KEYS {
                            self.submit_batch(out);
                        }
                    }
                }
            }
            // Buffered: a slot whose put is still dirty is read from the page cache. (Clean
            // pages the cache still holds are read from the drive here: see docs/waf.md, Limits.)
            LmOp::Load { slot, .. } if self.io == IoMode::Buffered && self.dirty_pos.contains_key(&slot) => {}
            LmOp::Load { slot, payload_len } => {
                self.split(g.slot_offset(slot) + g.header_bytes, self.round(payload_len), None, false, out);
            }
            LmOp::Checkpoint { seq, json_bytes, json, .. } => {
                // Payload first, then the header block (posix order). Buffered: the dirty slot
                // pages go before them, or right after (`checkpoint_writeback`). io_uring: the
                // two are one `batched_write`, delivered in the modelled order as a put
                // batch is, so the header may come first.
                if !self.checkpoint_first {
                    self.flush(out);
                }
                let c = g.container_offset(Geometry::copy_for_seq(seq));
                let mut reqs = Vec::new();
                self.split(c + g.block_align, self.round(json_bytes), None, true, &mut |io| reqs.push(*io));
                let crc = json.map_or(0, crc32fast::hash);
                let mut hb = [0u8; 32];
                hb[..8].copy_from_slice(crate::layout::checkpoint_header::META_MAGIC);
                hb[8..12].copy_from_slice(&crate::layout::checkpoint_header::META_VERSION.to_le_bytes());
                hb[12..20].copy_from_slice(&seq.to_le_bytes());
                hb[20..28].copy_from_slice(&json_bytes.to_le_bytes());
                hb[28..32].copy_from_slice(&crc.to_le_bytes());
                reqs.push(BlockIo { write: true, offset: c, len: g.block_align, header: None, checkpoint: Some(hb) });
                if self.io == IoMode::IoUring && self.reorder > 1 {
                    let mut ranked: Vec<(u64, BlockIo)> =
                        reqs.into_iter().enumerate().map(|(i, io)| (i as u64 + self.checkpoint_rng.below(self.reorder), io)).collect();
                    ranked.sort_by_key(|&(rank, _)| rank);
                    reqs = ranked.into_iter().map(|(_, io)| io).collect();
                }
                for io in &reqs {
                    out(io);
                }
                if self.checkpoint_first {
                    self.flush(out);
                }
            }
            LmOp::Delete { .. } | LmOp::Tick { .. } => {}
        }
    }

    /// The end of one store (LMCache's `put_many` of a request's keys): io_uring submits the
    /// keys gathered for the last batch.
    pub fn end_store(&mut self, out: &mut dyn FnMut(&BlockIo)) {
        if !self.pending.is_empty() {
            self.submit_batch(out);
        }
    }

    /// io_uring: one `batched_write` of the gathered puts (header, then payload rounded to
    /// `block_align`, per key), delivered in the modelled order: each request ranks at its
    /// submission index plus a random delay below the reorder window; ties keep their order.
    fn submit_batch(&mut self, out: &mut dyn FnMut(&BlockIo)) {
        let g = self.geom;
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        let mut n = 0u64;
        let mut push = |io: BlockIo, rng: &mut SplitMix64| {
            let delay = if self.reorder > 1 { rng.below(self.reorder) } else { 0 };
            batch.push((n + delay, io));
            n += 1;
        };
        for &(slot, h) in &self.pending {
            let off = g.slot_offset(slot);
            // The header region, then the payload, each split at the largest request; only
            // the first request carries the header.
            for (start, end) in [(off, off + g.header_bytes), (off + g.header_bytes, off + g.payload_end(h.payload_len))] {
                let mut pos = start;
                while pos < end {
                    let len = (end - pos).min(self.max_req);
                    let header = (pos == off).then_some(h);
                    push(BlockIo { write: true, offset: pos, len, header, checkpoint: None }, &mut self.rng);
                    pos += len;
                }
            }
        }
        self.pending.clear();
        batch.sort_by_key(|&(rank, _)| rank);
        for (_, io) in &batch {
            out(io);
        }
        self.batch = batch;
    }

    /// Writes out whatever is held: io_uring's gathered batch; buffered, every dirty page,
    /// sorted by offset, merged and split.
    pub fn flush(&mut self, out: &mut dyn FnMut(&BlockIo)) {
        self.end_store(out);
        if self.dirty.is_empty() {
            return;
        }
        let g = self.geom;
        let mut d = std::mem::take(&mut self.dirty);
        self.dirty_pos.clear();
        d.sort_unstable_by_key(|&(s, _, _)| s);
        // Contiguous runs of dirty pages: a slot's header and its payload pages are adjacent;
        // consecutive slots merge when the earlier one's payload fills its slot.
        self.runs.clear();
        for &(slot, _, dirty_len) in &d {
            let off = g.slot_offset(slot);
            let len = g.header_bytes + self.round(dirty_len);
            match self.runs.last_mut() {
                Some((o, l)) if *o + *l == off => *l += len,
                _ => self.runs.push((off, len)),
            }
        }
        // Headers inside merged runs: one request can carry several; each request reports the
        // header at its start (the classifier parses a header only from a request's bytes).
        let mut hi = 0;
        let runs = std::mem::take(&mut self.runs);
        for &(off, len) in &runs {
            let end = off + len;
            let mut pos = off;
            while pos < end {
                let n = (end - pos).min(self.max_req);
                // The dirty slot whose header sits at `pos`, if any.
                while hi < d.len() && g.slot_offset(d[hi].0) < pos {
                    hi += 1;
                }
                let header = match d.get(hi) {
                    Some(&(s, h, _)) if g.slot_offset(s) == pos => Some(h),
                    _ => None,
                };
                // A header in the middle of the request: cut the request there.
                let mut cut = n;
                if let Some(&(s, _, _)) = d.get(hi + usize::from(header.is_some())) {
                    let ho = g.slot_offset(s);
                    if ho > pos && ho < pos + n {
                        cut = ho - pos;
                    }
                }
                out(&BlockIo { write: true, offset: pos, len: cut, header, checkpoint: None });
                pos += cut;
            }
        }
        self.runs = runs;
    }

    /// The 24 header bytes LMCache writes, for a request's data.
    pub fn header_bytes(h: &SlotHeader) -> [u8; SLOT_HEADER_PREFIX] {
        let mut b = [0u8; SLOT_HEADER_PREFIX];
        b[..8].copy_from_slice(crate::layout::slot_header::SLOT_MAGIC);
        b[8..16].copy_from_slice(&h.identity.to_le_bytes());
        b[16..24].copy_from_slice(&h.payload_len.to_le_bytes());
        b
    }
}
