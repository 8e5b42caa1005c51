//! The simulated backing device as fdpblk's state thread ([`crate::watch::Watcher`]) sees it:
//! every write and deallocation lands in the SSD model, and the bytes the state thread reads
//! back are kept — both checkpoint containers, each slot's header prefix, and fdpblk's
//! own-state region. Slot payloads are not kept (nothing reads them back).

use super::{SimError, Ssd};
use crate::layout::slot_header::SLOT_HEADER_PREFIX;
use crate::layout::Geometry;
use crate::persist::dev::StateWriter;
use crate::persist::Region;
use crate::pipeline::Segment;
use crate::place::Handle;
use std::collections::HashMap;
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
    /// Bytes the state thread wrote (fdpblk's own state).
    pub own_bytes: u64,
    /// Mapping units the state thread wrote since its last flush, with their handle: written
    /// to the model once each at the flush. (The model maps in units of up to 1 MiB, the
    /// state thread writes 4 KiB pages; a drive's write cache merges the pages of one cycle.)
    own_units: std::collections::BTreeMap<u64, Handle>,
    /// The first error of the SSD model (reported by the simulator).
    pub error: Option<String>,
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
        if let Err(e) = self.ssd.deallocate(off, len) {
            self.error.get_or_insert(e.to_string());
        }
    }
    pub fn take_trimmed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.trimmed)
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
                own_bytes: 0,
                own_units: Default::default(),
                error: None,
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
        let in_container = off < 2 * cb && off % BLOCK == 0 && (off % cb) + buf.len() as u64 <= cb;
        if in_container {
            // An early eviction makes the older checkpoint container unloadable.
            d.poke_container((off / cb) as u8, off % cb, buf);
        } else if off < d.region.offset || off + buf.len() as u64 > d.region.offset + d.region.len || off % BLOCK != 0 {
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
        let g = d.geom;
        if off >= g.meta_total_bytes && off < g.data_end_offset() {
            let first = (off - g.meta_total_bytes).div_ceil(g.slot_bytes);
            let end = ((off + len).min(g.data_end_offset()) - g.meta_total_bytes) / g.slot_bytes;
            for s in first..end {
                d.headers[s as usize] = [0; SLOT_HEADER_PREFIX];
                d.trimmed.push(s);
            }
        }
        d.ssd.deallocate(off, len).map_err(|e| io::Error::other(e.to_string()))
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
/// share twice.)
#[derive(Debug, Default)]
pub struct WriteCombiner {
    pending: Option<Segment>,
}

impl WriteCombiner {
    pub fn push(&mut self, s: Segment, ssd: &mut Ssd) -> Result<(), SimError> {
        if let Some(p) = &mut self.pending {
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
        self.flush(ssd)?;
        self.pending = Some(s);
        Ok(())
    }
    /// Writes what is pending; call before anything that must see it (a deallocation).
    pub fn flush(&mut self, ssd: &mut Ssd) -> Result<(), SimError> {
        if let Some(p) = self.pending.take() {
            ssd.write(p.offset, p.len, p.handle)?;
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
        let ru = ru_bytes.unwrap_or_else(|| (size as f64 * super::run::RU_PER_DEVICE) as u64);
        let ru = (ru / unit).max(1) * unit;
        let physical = super::SsdConfig::physical_for_op(size, op);
        let cfg = super::SsdConfig::new(size, physical, unit, ru, handles.max(8), super::HandleType::InitiallyIsolated);
        let ssd = Ssd::new(cfg).map_err(|e| format!("{e} (for a replay, pass --ssd-op or --ssd-ru-size)"))?;
        Ok(TraceSsd { ssd, combiner: WriteCombiner::default() })
    }
    pub fn write(&mut self, s: Segment) -> Result<(), SimError> {
        self.combiner.push(s, &mut self.ssd)
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
        Ok(serde_json::json!({
            "waf": if c.host_bytes > 0 { Some((c.waf() * 1e4).round() / 1e4) } else { None },
            "host_bytes": c.host_bytes, "media_bytes": c.media_bytes, "relocated_bytes": c.relocated_bytes,
            "deallocated_bytes": c.deallocated_bytes, "gc_events": c.gc_events,
            "host_bytes_by_handle": c.host_bytes_by_handle,
            "logical_bytes": cfg.logical_bytes, "physical_bytes": cfg.physical_bytes, "ru_bytes": cfg.ru_bytes,
            "unit_bytes": cfg.unit_bytes, "handles": cfg.handles.len(),
        }))
    }
}
