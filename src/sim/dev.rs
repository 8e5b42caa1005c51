//! The simulated backing device as fdpblk's state thread ([`crate::watch::Watcher`]) sees it:
//! every write and deallocation lands in the SSD model, and the bytes the state thread reads
//! back are kept — both checkpoint containers, each slot's header prefix, and fdpblk's
//! own-state region. Slot payloads are not kept (nothing reads them back).

use super::{SimError, Ssd, SsdCounters};
use crate::layout::slot_header::SLOT_HEADER_PREFIX;
use crate::layout::Geometry;
use crate::persist::dev::StateWriter;
use crate::persist::Region;
use crate::pipeline::Segment;
use crate::place::Handle;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::{Mutex, MutexGuard};

const BLOCK: u64 = 4096;

pub struct DevInner {
    pub ssd: Ssd,
    geom: Geometry,
    containers: [Vec<u8>; 2],
    headers: Vec<[u8; SLOT_HEADER_PREFIX]>,
    region: Region,
    region_blocks: HashMap<u64, Box<[u8]>>,
    /// Slots the state thread deallocated since the last `take_trimmed`.
    trimmed: Vec<u64>,
    /// Every range the state thread deallocated since the last `take_discards`.
    discards: Vec<(u64, u64)>,
    /// Bytes the state thread wrote (fdpblk's own state).
    pub own_bytes: u64,
    /// Mapping units the state thread wrote since its last flush, with their handle: written
    /// to the model once each at the flush. (The model maps in units of up to 1 MiB, the
    /// state thread writes 4 KiB pages; a drive's write cache merges the pages of one cycle.)
    own_units: std::collections::BTreeMap<u64, Handle>,
    /// The first error of the SSD model (reported by the simulator).
    pub error: Option<String>,
    /// LMCache's writes on their way to the drive (the simulator pushes them); a deallocation
    /// writes out those it overlaps first.
    pub combiner: WriteCombiner,
}

impl DevInner {
    /// LMCache's bytes at `rel` in container `copy` (a checkpoint's header block or JSON).
    pub fn poke_container(&mut self, copy: u8, rel: u64, data: &[u8]) {
        let c = &mut self.containers[usize::from(copy & 1)];
        let end = rel as usize + data.len();
        if c.len() < end {
            c.resize(end, 0);
        }
        c[rel as usize..end].copy_from_slice(data);
    }
    /// A slot header written at the slot's start.
    pub fn set_header(&mut self, slot: u64, prefix: &[u8; SLOT_HEADER_PREFIX]) {
        if let Some(h) = self.headers.get_mut(slot as usize) {
            *h = *prefix;
        }
    }
    /// Deallocates without touching what the state thread reads (a stale tail past a header).
    pub fn deallocate(&mut self, off: u64, len: u64) {
        if let Err(e) = self.combiner.flush_overlapping(off, len, &mut self.ssd).and_then(|()| self.ssd.deallocate(off, len)) {
            self.error.get_or_insert(e.to_string());
        }
    }
    pub fn take_trimmed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.trimmed)
    }
    pub fn take_discards(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.discards)
    }

    fn read_piece(&self, off: u64, buf: &mut [u8]) -> usize {
        let g = &self.geom;
        let cb = g.container_bytes;
        let n = buf.len() as u64;
        if off < 2 * cb {
            let copy = (off / cb) as usize;
            let rel = off - copy as u64 * cb;
            let take = n.min(cb - rel) as usize;
            let c = &self.containers[copy];
            let have = c.len().saturating_sub(rel as usize).min(take);
            if have > 0 {
                buf[..have].copy_from_slice(&c[rel as usize..rel as usize + have]);
            }
            buf[have..take].fill(0);
            return take;
        }
        if off >= self.region.offset && off < self.region.offset + self.region.len {
            let rel = off - self.region.offset;
            let (blk, within) = (rel / BLOCK, rel % BLOCK);
            let take = n.min(BLOCK - within) as usize;
            match self.region_blocks.get(&blk) {
                Some(b) => buf[..take].copy_from_slice(&b[within as usize..within as usize + take]),
                None => buf[..take].fill(0),
            }
            return take;
        }
        if off >= g.meta_total_bytes && off < g.data_end_offset() {
            let rel = off - g.meta_total_bytes;
            let (slot, within) = (rel / g.slot_bytes, rel % g.slot_bytes);
            let take = n.min(g.slot_bytes - within) as usize;
            buf[..take].fill(0);
            if within < SLOT_HEADER_PREFIX as u64 {
                let h = &self.headers[slot as usize];
                let m = take.min(SLOT_HEADER_PREFIX - within as usize);
                buf[..m].copy_from_slice(&h[within as usize..within as usize + m]);
            }
            return take;
        }
        // Gaps and the tail: zeros up to the next known area.
        let next = [2 * cb, g.meta_total_bytes, g.data_end_offset(), self.region.offset]
            .into_iter()
            .filter(|&b| b > off)
            .min()
            .unwrap_or(u64::MAX);
        let take = n.min(next - off) as usize;
        buf[..take].fill(0);
        take
    }
}

/// Shared by the simulator (the data path) and the state thread.
pub struct SimDev {
    inner: Mutex<DevInner>,
}

impl SimDev {
    pub fn new(ssd: Ssd, geom: Geometry, region: Region) -> SimDev {
        let headers = vec![[0u8; SLOT_HEADER_PREFIX]; geom.max_slots as usize];
        SimDev {
            inner: Mutex::new(DevInner {
                ssd,
                geom,
                containers: [Vec::new(), Vec::new()],
                headers,
                region,
                region_blocks: HashMap::new(),
                trimmed: Vec::new(),
                discards: Vec::new(),
                own_bytes: 0,
                own_units: Default::default(),
                error: None,
                combiner: WriteCombiner::default(),
            }),
        }
    }
    pub fn lock(&self) -> MutexGuard<'_, DevInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl StateWriter for SimDev {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let d = self.lock();
        let mut pos = 0;
        while pos < buf.len() {
            pos += d.read_piece(off + pos as u64, &mut buf[pos..]);
        }
        Ok(())
    }
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()> {
        let mut d = self.lock();
        let g = d.geom;
        let cb = g.container_bytes;
        let in_container = off < 2 * cb && off.is_multiple_of(BLOCK) && (off % cb) + buf.len() as u64 <= cb;
        if in_container {
            // An early eviction makes the older checkpoint container unloadable.
            d.poke_container((off / cb) as u8, off % cb, buf);
        } else if off < d.region.offset || off + buf.len() as u64 > d.region.offset + d.region.len || !off.is_multiple_of(BLOCK) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "state-thread write outside its region and the checkpoint containers"));
        } else {
            for (i, chunk) in buf.chunks(BLOCK as usize).enumerate() {
                let blk = (off - d.region.offset) / BLOCK + i as u64;
                let b = d.region_blocks.entry(blk).or_insert_with(|| vec![0u8; BLOCK as usize].into_boxed_slice());
                b[..chunk.len()].copy_from_slice(chunk);
            }
        }
        d.own_bytes += buf.len() as u64;
        let unit = d.ssd.config().unit_bytes;
        for u in off / unit..(off + buf.len() as u64).div_ceil(unit) {
            d.own_units.insert(u, handle);
        }
        Ok(())
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        let mut d = self.lock();
        d.discards.push((off, len));
        let g = d.geom;
        if off >= g.meta_total_bytes && off < g.data_end_offset() {
            let first = (off - g.meta_total_bytes).div_ceil(g.slot_bytes);
            let end = ((off + len).min(g.data_end_offset()) - g.meta_total_bytes) / g.slot_bytes;
            for s in first..end {
                d.headers[s as usize] = [0; SLOT_HEADER_PREFIX];
                d.trimmed.push(s);
            }
        }
        let DevInner { combiner, ssd, .. } = &mut *d;
        combiner.flush_overlapping(off, len, ssd).and_then(|()| ssd.deallocate(off, len)).map_err(|e| io::Error::other(e.to_string()))
    }
    fn flush(&self) -> io::Result<()> {
        let mut d = self.lock();
        let unit = d.ssd.config().unit_bytes;
        let logical = d.ssd.logical_bytes();
        for (u, h) in std::mem::take(&mut d.own_units) {
            let len = unit.min(logical - u * unit);
            d.ssd.write(u * unit, len, h).map_err(|e| io::Error::other(e.to_string()))?;
        }
        Ok(())
    }
    fn size(&self) -> u64 {
        self.lock().ssd.logical_bytes()
    }
}

/// Merges adjacent segments on the same handle into one drive write, as a page-mapped FTL
/// programs them back to back into the same open RU. (With mapping units larger than a 4 KiB
/// slot header, writing the header and its payload separately would count the unit they
/// share twice.) Up to `cap` runs wait to be joined: 1 for writes that come in order; more
/// where the pieces of one write arrive apart (io_uring), which a drive mapping 4 KiB pages
/// would place as they come without rounding each to the model's unit.
#[derive(Debug)]
pub struct WriteCombiner {
    /// With `cap` 1 (ordered writes, the simulator's hot path): the one pending run.
    single: Option<Segment>,
    /// Pending runs by start offset, each with its arrival stamp; disjoint.
    runs: BTreeMap<u64, (Segment, u64)>,
    /// Arrival stamp → start offset: the oldest run is written first when there are too many.
    order: BTreeMap<u64, u64>,
    stamp: u64,
    cap: usize,
}

impl Default for WriteCombiner {
    fn default() -> Self {
        WriteCombiner::with_cap(1)
    }
}

impl WriteCombiner {
    /// A combiner holding at most `cap` (at least 1) runs.
    pub fn with_cap(cap: usize) -> Self {
        WriteCombiner { single: None, runs: BTreeMap::new(), order: BTreeMap::new(), stamp: 0, cap: cap.max(1) }
    }

    pub fn push(&mut self, s: Segment, ssd: &mut Ssd) -> Result<(), SimError> {
        if s.len == 0 {
            return Ok(());
        }
        if self.cap == 1 {
            if let Some(p) = &mut self.single {
                if p.handle == s.handle && p.offset + p.len == s.offset {
                    p.len += s.len;
                    return Ok(());
                }
                if p.handle == s.handle && s.offset + s.len == p.offset {
                    p.offset = s.offset;
                    p.len += s.len;
                    return Ok(());
                }
            }
            if let Some(p) = self.single.replace(s) {
                ssd.write(p.offset, p.len, p.handle)?;
            }
            return Ok(());
        }
        let end = s.offset + s.len;
        let before = self.runs.range(..=s.offset).next_back().map(|(_, &(p, st))| (p, st));
        let after = self.runs.range(s.offset..).next().map(|(_, &(q, st))| (q, st));
        // Bytes written again while an earlier write of them waits: write out everything
        // first, so the drive sees the two in order.
        if before.is_some_and(|(p, _)| p.offset + p.len > s.offset) || after.is_some_and(|(q, _)| q.offset < end) {
            self.flush(ssd)?;
            return self.push(s, ssd);
        }
        let joins_before = before.filter(|(p, _)| p.handle == s.handle && p.offset + p.len == s.offset);
        let joins_after = after.filter(|(q, _)| q.handle == s.handle && q.offset == end);
        let (mut run, stamp) = match joins_before {
            Some((p, st)) => (Segment { len: p.len + s.len, ..p }, st),
            None => {
                self.stamp += 1;
                (s, self.stamp)
            }
        };
        if let Some((q, qst)) = joins_after {
            self.runs.remove(&q.offset);
            self.order.remove(&qst);
            run.len += q.len;
        }
        if joins_before.is_none() {
            self.order.insert(stamp, run.offset);
        }
        self.runs.insert(run.offset, (run, stamp));
        while self.runs.len() > self.cap {
            let (_, start) = self.order.pop_first().expect("one stamp per run");
            let (oldest, _) = self.runs.remove(&start).expect("a run per stamp");
            ssd.write(oldest.offset, oldest.len, oldest.handle)?;
        }
        Ok(())
    }

    /// Writes the pending runs that overlap `[off, off + len)`, oldest first (before a
    /// deallocation of those bytes).
    pub fn flush_overlapping(&mut self, off: u64, len: u64, ssd: &mut Ssd) -> Result<(), SimError> {
        let end = off.saturating_add(len);
        if self.single.is_some_and(|p| p.offset < end && off < p.offset + p.len) {
            return self.flush(ssd);
        }
        let first = self.runs.range(..=off).next_back().filter(|(_, (r, _))| r.offset + r.len > off).map_or(off, |(&s, _)| s);
        let mut hit: Vec<u64> = self.runs.range(first..end).map(|(_, &(_, st))| st).collect();
        hit.sort_unstable();
        for st in hit {
            let start = self.order.remove(&st).expect("a start per stamp");
            let (run, _) = self.runs.remove(&start).expect("a run per stamp");
            ssd.write(run.offset, run.len, run.handle)?;
        }
        Ok(())
    }

    /// Writes what is pending, oldest first; call before anything that must see it (a
    /// deallocation).
    pub fn flush(&mut self, ssd: &mut Ssd) -> Result<(), SimError> {
        if let Some(p) = self.single.take() {
            ssd.write(p.offset, p.len, p.handle)?;
        }
        while let Some((_, start)) = self.order.pop_first() {
            let (run, _) = self.runs.remove(&start).expect("a run per stamp");
            ssd.write(run.offset, run.len, run.handle)?;
        }
        Ok(())
    }
}

/// A trace replayed into the SSD model (`fdpblk replay --ssd`): placed writes, discards and
/// write-zeroes (as deallocations) of a captured trace, on a drive sized like the replayed
/// device.
pub struct TraceSsd {
    ssd: Ssd,
    combiner: WriteCombiner,
    /// Host bytes before the WAF window starts, and the counters where it started.
    warmup_bytes: u64,
    window_start: Option<SsdCounters>,
}

/// A drive whose tables would pass `budget` (a size taken from a trace's furthest byte, which
/// one stray line can set) is refused before the allocation could exhaust memory.
fn model_fits(size: u64, physical: u64, unit: u64, ru: u64, budget: Option<u64>) -> Result<(), String> {
    super::memory::drive_fits(
        size,
        physical,
        unit,
        ru,
        budget,
        "give --device-size (the traced drive's size) or a larger --ssd-ru-size, or replay on a machine with more memory",
    )
}

impl TraceSsd {
    /// A drive of `size` logical bytes, `op` over-provisioning (fraction of physical), RUs of
    /// `ru_bytes` (None: the 6 GB per 1.88 TB ratio of `sim::run`), 8 initially isolated
    /// handles (more if the policy needs them), greedy GC, and the mapping unit that keeps the
    /// layout's slots whole.
    pub fn new(size: u64, geom: &Geometry, op: f64, ru_bytes: Option<u64>, handles: u16) -> Result<TraceSsd, String> {
        // 4 KiB units (exact for LMCache's block_align) up to 64 GiB; larger devices map in the
        // simulator's unit, which keeps slots whole.
        let unit = if size <= 64 << 30 { 4096 } else { super::run::auto_unit(geom.slot_bytes, geom.meta_total_bytes) };
        // Below 4 KiB is no reclaim unit of any drive (it became one unit in silence); a size
        // that is not a whole number of units is rounded to one, which the report shows.
        if let Some(r) = ru_bytes.filter(|&r| r < 4096) {
            return Err(format!("--ssd-ru-size {r}: give at least 4K (a drive's reclaim units are megabytes to gigabytes)"));
        }
        let ru = ru_bytes.unwrap_or((size as f64 * super::run::RU_PER_DEVICE) as u64);
        let ru = (ru / unit).max(1) * unit;
        let physical = super::SsdConfig::physical_for_op(size, op);
        model_fits(size, physical, unit, ru, super::memory::budget())?;
        let cfg = super::SsdConfig::new(size, physical, unit, ru, handles.max(8), super::HandleType::InitiallyIsolated);
        let ssd = Ssd::new(cfg).map_err(|e| format!("{e} (for a replay: --ssd-op, --ssd-ru-size, or --device-size for the traced drive's size)"))?;
        Ok(TraceSsd { ssd, combiner: WriteCombiner::default(), warmup_bytes: 0, window_start: Some(SsdCounters::default()) })
    }
    /// Measures WAF only once the trace has written `bytes` (a fill, which costs no garbage
    /// collection, would otherwise pull the figure toward 1): the trace's own bytes, not the
    /// drive's whole mapping units (which past 64 GiB are up to 1 MiB each).
    pub fn with_warmup(mut self, bytes: u64) -> Self {
        self.warmup_bytes = bytes;
        self.window_start = (bytes == 0).then(SsdCounters::default);
        self
    }
    pub fn write(&mut self, s: Segment) -> Result<(), SimError> {
        self.combiner.push(s, &mut self.ssd)?;
        if self.window_start.is_none() && self.ssd.counters().host_request_bytes >= self.warmup_bytes {
            self.window_start = Some(self.ssd.counters().clone());
        }
        Ok(())
    }
    pub fn deallocate(&mut self, offset: u64, len: u64) -> Result<(), SimError> {
        self.combiner.flush(&mut self.ssd)?;
        self.ssd.deallocate(offset, len)
    }
    /// Flushes and reports the drive's counters and configuration.
    pub fn finish(&mut self) -> Result<serde_json::Value, SimError> {
        self.combiner.flush(&mut self.ssd)?;
        let c = self.ssd.counters();
        let cfg = self.ssd.config();
        let waf = |c: &SsdCounters| (c.host_bytes > 0).then(|| (c.waf() * 1e4).round() / 1e4);
        let window = self.window_start.as_ref().map(|w| c.since(w));
        Ok(serde_json::json!({
            // Over the window: null when the trace never got past the warm-up.
            "waf": window.as_ref().and_then(waf),
            "warmup_bytes": self.warmup_bytes,
            "window_host_bytes": window.as_ref().map(|w| w.host_bytes),
            "window_host_request_bytes": window.as_ref().map(|w| w.host_request_bytes),
            // 0: the drive never had to collect in the window (the trace did not fill it), so
            // its WAF says nothing about a full drive.
            "window_gc_events": window.as_ref().map(|w| w.gc_events),
            "waf_whole_trace": waf(c),
            // host_bytes counts whole mapping units (unit_bytes) as the model writes them;
            // host_request_bytes is what the trace wrote.
            "host_bytes": c.host_bytes, "host_request_bytes": c.host_request_bytes, "media_bytes": c.media_bytes, "relocated_bytes": c.relocated_bytes,
            "deallocated_bytes": c.deallocated_bytes, "gc_events": c.gc_events,
            "host_bytes_by_handle": c.host_bytes_by_handle,
            "gc_victims_by_stream": c.gc_victims_by_stream, "relocated_bytes_by_stream": c.relocated_bytes_by_stream,
            "logical_bytes": cfg.logical_bytes, "physical_bytes": cfg.physical_bytes, "ru_bytes": cfg.ru_bytes,
            "unit_bytes": cfg.unit_bytes, "handles": cfg.handles.len(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{HandleType, SsdConfig};

    /// A 64 MiB drive mapping 1 MiB units in 1 MiB RUs: a write of part of a unit counts the whole unit.
    fn ssd() -> Ssd {
        let logical = 64 << 20;
        let cfg = SsdConfig::new(logical, SsdConfig::physical_for_op(logical, 0.2), 1 << 20, 1 << 20, 4, HandleType::InitiallyIsolated);
        Ssd::new(cfg).unwrap()
    }

    fn seg(offset: u64, len: u64, handle: Handle) -> Segment {
        Segment { offset, len, handle }
    }

    #[test]
    fn a_drive_whose_map_would_not_fit_in_memory_is_refused_naming_device_size() {
        const GIB: u64 = 1 << 30;
        // 2 TB in 4 KiB units and 6 GB RUs: about 2 GiB of map for each side, 4 GiB in all.
        let e = model_fits(2_000_000_000_000, 2_150_000_000_000, 4096, 6 << 30, Some(2 * GIB)).unwrap_err();
        assert!(e.contains("--device-size") && e.contains("3865 MiB"), "{e}");
        assert!(model_fits(2_000_000_000_000, 2_150_000_000_000, 4096, 6 << 30, Some(8 * GIB)).is_ok());
        // One-unit RUs: their tables count too.
        assert!(model_fits(2_000_000_000_000, 2_150_000_000_000, 4096, 4096, Some(8 * GIB)).is_err());
        assert!(model_fits(u64::MAX, u64::MAX, 4096, 4096, Some(64 * GIB)).is_err(), "no overflow");
        assert!(model_fits(GIB, GIB, 4096, 4096, None).is_ok(), "unknown memory: not refused");
    }

    /// The warm-up counts the trace's bytes: 4 KiB writes into 1 MiB units reach a 64 KiB
    /// warm-up after 16 writes, not after the first (which writes a whole unit). The
    /// combiner holds one run, so a write reaches the drive when the next one comes.
    #[test]
    fn warmup_counts_the_traces_bytes_not_whole_units() {
        let mut t = TraceSsd { ssd: ssd(), combiner: WriteCombiner::with_cap(1), warmup_bytes: 0, window_start: None }
            .with_warmup(64 << 10);
        for i in 0..17 {
            assert!(t.window_start.is_none(), "write {i}");
            t.write(seg(i * (1 << 20), 4096, 1)).unwrap();
        }
        let start = t.window_start.clone().expect("the window starts once 16 writes reached the drive");
        assert_eq!(start.host_request_bytes, 64 << 10);
        let v = t.finish().unwrap();
        assert_eq!((v["host_request_bytes"].as_u64(), v["unit_bytes"].as_u64()), (Some(17 * 4096), Some(1 << 20)));
        assert_eq!(v["host_bytes"].as_u64(), Some(17 << 20));
        // 17 MiB on a drive of many: nothing to collect.
        assert_eq!(v["window_gc_events"].as_u64(), Some(0));
    }

    #[test]
    fn combiner_joins_pieces_that_arrive_apart_and_keeps_rewrites_in_order() {
        const K: u64 = 1024;
        // Two 1 MiB units written in four pieces, out of order: with room for a few runs they
        // join and count two units; with one run, each piece is a unit of its own.
        let pieces = [seg(1536 * K, 512 * K, 1), seg(0, 512 * K, 1), seg(1024 * K, 512 * K, 1), seg(512 * K, 512 * K, 1)];
        for (cap, units) in [(4, 2), (1, 4)] {
            let mut d = ssd();
            let mut c = WriteCombiner::with_cap(cap);
            for p in pieces {
                c.push(p, &mut d).unwrap();
            }
            c.flush(&mut d).unwrap();
            assert_eq!(d.counters().host_bytes, units << 20, "cap {cap}");
        }
        // Adjacent pieces on two handles stay apart.
        let mut d = ssd();
        let mut c = WriteCombiner::with_cap(8);
        c.push(seg(0, 1 << 20, 1), &mut d).unwrap();
        c.push(seg(1 << 20, 1 << 20, 2), &mut d).unwrap();
        c.flush(&mut d).unwrap();
        assert_eq!(d.counters().host_bytes_by_handle[1..3], [1 << 20, 1 << 20]);
        // A rewrite of pending bytes writes the earlier write out first: both count.
        let mut d = ssd();
        let mut c = WriteCombiner::with_cap(8);
        c.push(seg(0, 1 << 20, 1), &mut d).unwrap();
        c.push(seg(4 << 20, 1 << 20, 1), &mut d).unwrap();
        c.push(seg(512 * K, 1 << 20, 2), &mut d).unwrap();
        assert_eq!(d.counters().host_bytes, 2 << 20, "the two pending runs went out");
        c.flush(&mut d).unwrap();
        assert_eq!(d.counters().host_bytes, 4 << 20);
        // Before a deallocation only the runs it overlaps go out.
        let mut d = ssd();
        let mut c = WriteCombiner::with_cap(8);
        for o in [0, 2, 4, 6] {
            c.push(seg(o << 20, 1 << 20, 1), &mut d).unwrap();
        }
        c.flush_overlapping((1 << 20) + 4096, (4 << 20) - 8192, &mut d).unwrap();
        assert_eq!(d.counters().host_bytes, 2 << 20, "the runs at 2 and 4 MiB");
        c.flush(&mut d).unwrap();
        assert_eq!(d.counters().host_bytes, 4 << 20);
    }
}
