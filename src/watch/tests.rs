//! The deallocation rule against LMCache's behaviour: a model of LMCache 0.5.6 raw_block
//! (puts as separate allocate / header / payload / commit steps, deletes, LIFO slot reuse,
//! checkpoints as snapshot / payload / header steps in either order, restarts with and
//! without loading) drives the real pipeline into an in-memory device, and fdpblk's state
//! thread runs between the steps. Every deallocation is checked against an oracle of what is
//! live at that moment; every load checks the bytes LMCache reads back.

use super::*;
use crate::classify::Op;
use crate::engine::{Engine, Errno};
use crate::layout::checkpoint::{newest_valid, read_copies, read_entries};
use crate::layout::checkpoint_json::JsonLimits;
use crate::layout::keys;
use crate::layout::slot_header::SlotHeader;
use crate::layout::GeometryConfig;
use crate::persist::dev::{MemDev, MemOp};
use crate::pipeline::{Pipeline, Request};
use crate::slot_table::ContainerWrites;
use crate::place::RegionPolicy;
use std::collections::{BTreeSet, HashMap};

const BA: u64 = 512;

fn geometry(slots: u64, meta_total: u64) -> Geometry {
    GeometryConfig { block_align: BA, header_bytes: BA, slot_bytes: 4 * BA, meta_total_bytes: meta_total, capacity_bytes: 0 }
        .validate(meta_total + slots * 4 * BA)
        .unwrap()
}

struct MemEngine(Arc<MemDev>);

impl Engine for MemEngine {
    fn name(&self) -> &'static str {
        "mem"
    }
    fn write(&mut self, offset: u64, len: u64, data: &[u8], _handle: Handle) -> Result<(), Errno> {
        assert_eq!(data.len() as u64, len);
        self.0.poke(offset, data);
        Ok(())
    }
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.0.read_at(offset, buf).map_err(|_| Errno(libc::EIO))
    }
    fn flush(&mut self) -> Result<(), Errno> {
        Ok(())
    }
    fn discard(&mut self, offset: u64, len: u64) -> Result<(), Errno> {
        self.0.zero(offset, len);
        Ok(())
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), Errno> {
        self.0.zero(offset, len);
        Ok(())
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[derive(Clone, Debug)]
struct Put {
    key: String,
    slot: u64,
    size: u64,
    gen: u32,
    hdr: bool,
    pay: bool,
}

#[derive(Clone, Debug)]
struct Ckpt {
    seq: u64,
    json: Vec<u8>,
    slots: BTreeSet<u64>,
    pay: bool,
    hdr: bool,
}

/// LMCache's raw_block core, one process.
#[derive(Clone, Debug, Default)]
struct Lmc {
    /// Committed entries in insertion order: key, slot, size, content generation.
    index: Vec<(String, u64, u64, u32)>,
    /// Free slots; `pop` is `dict.popitem()` (LIFO).
    free: Vec<u64>,
    next_slot: u64,
    seq: u64,
    puts: Vec<Put>,
    ckpt: Option<Ckpt>,
    deleted: Vec<String>,
    keys: u64,
    gens: HashMap<String, u32>,
}

/// A key's bytes (KV data is a function of its key; the same key always has the same data).
fn payload(key: &str, _gen: u32, size: u64) -> Vec<u8> {
    let h = key.bytes().fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
    let mut v: Vec<u8> = (0..size).map(|i| (h.wrapping_add(i * 7) % 251) as u8 + 1).collect();
    v.resize(size.div_ceil(BA) as usize * BA as usize, 0);
    v
}

struct Rig {
    g: Geometry,
    dev: Arc<MemDev>,
    region: Region,
    slots: Arc<SlotTable>,
    pipe: Pipeline,
    eng: MemEngine,
    w: Watcher,
    cfg: WatchConfig,
    lmc: Lmc,
    trims: u64,
    /// Stale tails deallocated (each checked against the oracle).
    tails: u64,
    /// Deallocations checked against the oracle.
    checked: u64,
    /// Of `tails`, those of contents no checkpoint had confirmed yet (earlier instances').
    early_tails: u64,
    /// Of `trims`, early evictions (fdpblk's count, after each step).
    early_evictions: u64,
    /// Unwritten slots deallocated by earlier watchers of this rig (restarts).
    reclaimed: u64,
    /// Deallocation requests of whole slots (a run of unwritten slots is one).
    slot_discards: u64,
    /// Checkpoint containers fdpblk zeroed (each checked against the oracle).
    invalidated: u64,
    /// Flushes fdpblk issued.
    flushes: u64,
    /// fdpblk's zeroings and tail deallocations in the order they reached the device:
    /// (`'z'`, container) and (`'t'`, slot).
    order: Vec<(char, u64)>,
    /// Early evictions and zeroed containers of earlier fdpblk instances.
    earlier: (u64, u64),
    /// Flushes may fail: a zeroing written but not flushed is not one fdpblk counts.
    faults: bool,
    /// Containers written since the last flush, by LMCache (which never flushes) or by
    /// fdpblk's zeroing: a power loss can take them back to older contents.
    volatile_containers: std::collections::HashSet<u8>,
    /// Slots whose last header write is not yet durable: written since the last flush (the
    /// drive's volatile write cache, as far as the tests model it).
    volatile: std::collections::HashSet<u64>,
    /// Slots whose payload a put lost at an LMCache restart overwrote while the header still
    /// names the earlier contents: LMCache itself serves another key's bytes from them (its
    /// io_uring path may write a payload before its header), with or without fdpblk, so
    /// their payloads are not checked.
    lmcache_torn: std::collections::HashSet<u64>,
    filler: Vec<String>,
    /// A restarted fdpblk is told that writes went by unseen (as `fdpblk recover` does); off
    /// only to show what that prevents.
    recovery_marks_orphans: bool,
}

const OWN: Handle = RegionPolicy::OWN_STATE;

impl Rig {
    fn new(nslots: u64, meta_total: u64, trim: bool) -> Rig {
        Rig::new_with(nslots, meta_total, trim, false, true)
    }

    /// With `reclaim`: unwritten slots go too ("Unwritten slots"); on a fresh device, so the
    /// first start finds no saved state and marks them.
    fn new_with(nslots: u64, meta_total: u64, trim: bool, reclaim: bool, early_evictions: bool) -> Rig {
        let g = geometry(nslots, meta_total);
        let table = SlotTable::new(g.max_slots);
        let layout = crate::persist::Layout::of(&table);
        let region = Region { offset: g.data_end_offset().div_ceil(4096) * 4096, len: layout.bytes() };
        let dev = Arc::new(MemDev::new(region.offset + region.len));
        let slots = Arc::new(table);
        let cfg = WatchConfig {
            trim,
            trim_tails: trim,
            early_tails: trim,
            early_evictions: trim && early_evictions,
            reclaim: reclaim && trim,
            trust_saved_confirmations: true,
            writes_unseen: false,
            early_tails_every: Duration::ZERO,
            retry_base: Duration::ZERO, persist_interval: Duration::from_secs(3600), device: 0, stall_min: STALL_MIN, page_cache: None, writeback: WritebackDelay::Unchecked, buffered: BufferedWrites::Unchecked, trim_per_round: TRIM_PER_ROUND, trim_round_time: TRIM_ROUND_TIME, trim_off_because: None };
        let w = Watcher::new(g, slots.clone(), dev.clone(), cfg.clone(), Some(region), OWN);
        let pipe = Pipeline::with_slots(g, Box::new(RegionPolicy), slots.clone());
        let eng = MemEngine(dev.clone());
        Rig {
            g,
            dev,
            region,
            slots,
            pipe,
            eng,
            w,
            cfg,
            lmc: Lmc::default(),
            trims: 0,
            tails: 0,
            checked: 0,
            early_tails: 0,
            early_evictions: 0,
            reclaimed: 0,
            slot_discards: 0,
            invalidated: 0,
            flushes: 0,
            order: Vec::new(),
            earlier: (0, 0),
            faults: false,
            volatile_containers: Default::default(),
            volatile: Default::default(),
            lmcache_torn: Default::default(),
            filler: Vec::new(),
            recovery_marks_orphans: true,
        }
    }

    /// The same rig with only the two-container rule for evicted slots.
    fn without_early_evictions(mut self) -> Rig {
        self.cfg.early_evictions = false;
        self.w = Watcher::new(self.g, self.slots.clone(), self.dev.clone(), self.cfg.clone(), Some(self.region), OWN);
        self
    }

    /// The same rig with only the confirmed rule for stale tails.
    fn without_early_tails(mut self) -> Rig {
        self.cfg.early_tails = false;
        self.w = Watcher::new(self.g, self.slots.clone(), self.dev.clone(), self.cfg.clone(), Some(self.region), OWN);
        self
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        for c in 0..2u8 {
            let at = self.g.container_offset(c);
            if offset < at + self.g.container_bytes && offset + data.len() as u64 > at {
                self.volatile_containers.insert(c);
            }
        }
        let req = Request { op: Op::Write, offset, len: data.len() as u64, data: Some(data) };
        self.pipe.execute(&mut self.eng, &req).unwrap();
        assert!(self.pipe.trim_waits().is_empty(), "no trim runs concurrently in these tests");
    }

    fn read(&mut self, offset: u64, len: u64) -> Vec<u8> {
        let mut segs = Vec::new();
        let _ = self.pipe.plan(&Request { op: Op::Read, offset, len, data: None }, &mut segs, crate::pipeline::HeaderWait::Expired);
        self.dev.peek(offset, len as usize)
    }

    fn step(&mut self) {
        self.w.step();
        self.check_trims();
        self.early_evictions = self.earlier.0 + self.w.early_evictions();
        if !self.faults {
            assert_eq!(self.invalidated, self.earlier.1 + self.w.containers_invalidated(), "every zeroed container is counted");
        }
    }

    /// The oracle: why `slot` must not be deallocated now, if it must not.
    fn protected(&self, slot: u64) -> Option<String> {
        if let Some(why) = self.held(slot) {
            return Some(why);
        }
        if self.lmc.ckpt.as_ref().is_some_and(|c| c.slots.contains(&slot)) {
            return Some("listed by the checkpoint being written".into());
        }
        let dev = crate::persist::dev::DevReader(&*self.dev);
        let copies = read_copies(&dev, &self.g).unwrap();
        for c in copies.iter().filter(|c| c.is_valid()) {
            let mut listed = false;
            read_entries(&dev, &self.g, c, &JsonLimits::default(), &mut |e| {
                listed |= e.offset == Some(self.g.slot_offset(slot));
                Ok(())
            })
            .unwrap();
            if listed {
                return Some(format!("listed by the loadable checkpoint seq {:?} in container {}", c.seq(), c.copy));
            }
        }
        None
    }

    /// The oracle for a stale tail from `rel`: why it must not go, if it must not. Readable
    /// are the payloads (rounded to the block) of LMCache's index entries, of puts in flight,
    /// and of entries of a loadable checkpoint whose slot header on the device matches them.
    fn tail_protected(&self, slot: u64, rel: u64) -> Option<String> {
        let end = |size: u64| self.g.header_bytes + size.div_ceil(BA) * BA;
        if let Some(e) = self.lmc.index.iter().find(|e| e.1 == slot && end(e.2) > rel) {
            return Some(format!("{} in LMCache's index reads up to {}", e.0, end(e.2)));
        }
        if let Some(p) = self.lmc.puts.iter().find(|p| p.slot == slot && (p.hdr || p.pay) && end(p.size) > rel) {
            return Some(format!("a put in flight of {} writes up to {}", p.key, end(p.size)));
        }
        let dev = crate::persist::dev::DevReader(&*self.dev);
        let on_disk = SlotHeader::parse(&self.dev.peek(self.g.slot_offset(slot), 64)).ok();
        let mut why = None;
        for c in read_copies(&dev, &self.g).unwrap().iter().filter(|c| c.is_valid()) {
            read_entries(&dev, &self.g, c, &JsonLimits::default(), &mut |e| {
                if e.offset == Some(self.g.slot_offset(slot)) {
                    let (Some(size), Ok(id)) = (e.size, keys::identity(e.key)) else { return Ok(()) };
                    if on_disk.is_some_and(|h| h.identity == id && h.payload_len == size) && end(size) > rel {
                        why = Some(format!("checkpoint seq {:?} lists {} up to {}", c.seq(), e.key, end(size)));
                    }
                }
                Ok(())
            })
            .unwrap();
        }
        why
    }

    /// Why no running LMCache process may lose `slot`'s contents now, if so.
    fn held(&self, slot: u64) -> Option<String> {
        if let Some((k, ..)) = self.lmc.index.iter().find(|e| e.1 == slot) {
            return Some(format!("live in LMCache's index ({k})"));
        }
        if let Some(p) = self.lmc.puts.iter().find(|p| p.slot == slot && (p.hdr || p.pay)) {
            return Some(format!("a put in flight wrote it ({})", p.key));
        }
        None
    }

    fn check_trims(&mut self) {
        for op in self.dev.take_log() {
            if matches!(op, MemOp::Flush) {
                self.flushes += 1;
                self.volatile.clear();
                self.volatile_containers.clear();
            }
            if let MemOp::Write { off, len, data, .. } = &op {
                if let Some(copy) = (0..2u8).find(|&c| *off >= self.g.container_offset(c) && *off < self.g.container_offset(c) + self.g.container_bytes) {
                    // An early eviction's first step: the older container made unloadable.
                    assert!(*off == self.g.container_offset(copy) && *len == BA && data.iter().all(|&b| b == 0), "fdpblk wrote {len} bytes into container {copy} at {off}");
                    self.check_invalidation(copy);
                    self.order.push(('z', u64::from(copy)));
                    self.volatile_containers.insert(copy);
                    self.invalidated += 1;
                }
                assert!(self.g.slot_of(*off).is_none(), "fdpblk wrote into a slot at {off}");
            }
            if let MemOp::Discard { off, len } = op {
                let (slot, rel) = self.g.slot_of(off).expect("only slots are deallocated");
                if rel != 0 {
                    // A stale tail: up to the slot's end, past every payload anyone can read,
                    // behind a header that a crash cannot take back.
                    assert!(rel >= self.g.header_bytes && rel + len == self.g.slot_bytes, "tail {rel}+{len} of slot {slot}");
                    if let Some(why) = self.tail_protected(slot, rel) {
                        panic!("the tail of slot {slot} from {rel} was deallocated but {why}");
                    }
                    assert!(!self.volatile.contains(&slot), "the tail of slot {slot} was deallocated before its header was flushed");
                    self.order.push(('t', slot));
                    self.tails += 1;
                    continue;
                }
                // Whole slots: one, or a run of unwritten ones.
                self.slot_discards += 1;
                assert!(len > 0 && len % self.g.slot_bytes == 0, "whole slots: {len} bytes at slot {slot}");
                for slot in slot..slot + len / self.g.slot_bytes {
                    assert!(self.volatile_containers.is_empty(), "slot {slot} was deallocated on the word of checkpoints not yet durable");
                    if let Some(why) = self.protected(slot) {
                        panic!("slot {slot} was deallocated but is {why}");
                    }
                    self.trims += 1;
                    self.checked += 1;
                }
            }
        }
    }

    /// The oracle for fdpblk's zeroing of container `copy` (just done): LMCache loses nothing
    /// it could load or is writing. The other container holds the newest loadable checkpoint:
    /// the current process's own (or the one it loaded), unless it loaded nothing; and no
    /// checkpoint of the current process is half written into `copy`.
    fn check_invalidation(&self, copy: u8) {
        let dev = crate::persist::dev::DevReader(&*self.dev);
        let copies = read_copies(&dev, &self.g).unwrap();
        let newest = newest_valid(&copies).expect("a loadable checkpoint remains");
        assert_eq!(newest.copy, 1 - copy, "the other container holds the newest checkpoint");
        // (A checkpoint whose header went first is loadable early when its JSON is the same
        // bytes as the container's earlier one.)
        let writing = self.lmc.ckpt.as_ref().filter(|c| c.hdr).map(|c| c.seq);
        if self.lmc.seq > 0 && newest.seq() != writing {
            assert_eq!(newest.seq(), Some(self.lmc.seq), "LMCache's current checkpoint remains loadable");
        }
        if let Some(c) = &self.lmc.ckpt {
            assert!(!(c.hdr && Geometry::copy_for_seq(c.seq) == copy), "zeroed the header of checkpoint seq {} being written", c.seq);
        }
    }

    // ---- LMCache ----

    fn new_key(&mut self, salted: bool) -> String {
        self.lmc.keys += 1;
        let salt = if salted { "@tenantA:alice" } else { "" };
        format!("meta-llama%2FLlama-3.1-8B@0x01000100@0@{:032x}{salt}", self.lmc.keys.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// `_allocate_slot_locked` and the start of a put; false when the device is full.
    fn start_put(&mut self, key: String, size: u64) -> bool {
        if self.lmc.index.iter().any(|e| e.0 == key) || self.lmc.puts.iter().any(|p| p.key == key) {
            return false; // indexed: no I/O
        }
        let slot = match self.lmc.free.pop() {
            Some(s) => s,
            None if self.lmc.next_slot < self.g.max_slots => {
                self.lmc.next_slot += 1;
                self.lmc.next_slot - 1
            }
            None => return false,
        };
        let gen = self.lmc.gens.get(&key).map_or(0, |g| g + 1);
        self.lmc.gens.insert(key.clone(), gen);
        self.lmc.puts.push(Put { key, slot, size, gen, hdr: false, pay: false });
        true
    }

    fn put_header(&mut self, i: usize) {
        let p = self.lmc.puts[i].clone();
        let id = keys::identity(&p.key).unwrap();
        let h = SlotHeader { identity: id, payload_len: p.size }.encode(BA as usize);
        self.write(self.g.slot_offset(p.slot), &h);
        self.volatile.insert(p.slot);
        self.lmc.puts[i].hdr = true;
    }

    fn put_payload(&mut self, i: usize) {
        let p = self.lmc.puts[i].clone();
        self.write(self.g.slot_offset(p.slot) + BA, &payload(&p.key, p.gen, p.size));
        self.lmc.puts[i].pay = true;
    }

    fn put_commit(&mut self, i: usize) {
        let p = self.lmc.puts.remove(i);
        assert!(p.hdr && p.pay);
        self.lmcache_torn.remove(&p.slot);
        self.lmc.index.push((p.key, p.slot, p.size, p.gen));
    }

    fn put_rollback(&mut self, i: usize) {
        let p = self.lmc.puts.remove(i);
        self.lmc.free.push(p.slot);
    }

    /// A whole put: allocate, header, payload, commit.
    fn put(&mut self, key: String) -> Option<u64> {
        self.put_sized(key, BA - 100)
    }

    /// A whole put of `size` payload bytes: header, payload, commit. The slot, if any.
    fn put_sized(&mut self, key: String, size: u64) -> Option<u64> {
        if !self.start_put(key, size) {
            return None;
        }
        let i = self.lmc.puts.len() - 1;
        self.put_header(i);
        self.put_payload(i);
        let slot = self.lmc.puts[i].slot;
        self.put_commit(i);
        Some(slot)
    }

    fn delete(&mut self, i: usize) -> String {
        let (k, slot, ..) = self.lmc.index.remove(i);
        self.lmc.free.push(slot);
        self.lmc.deleted.push(k.clone());
        k
    }

    fn delete_key(&mut self, key: &str) -> u64 {
        let i = self.lmc.index.iter().position(|e| e.0 == key).unwrap();
        let slot = self.lmc.index[i].1;
        self.delete(i);
        slot
    }

    fn json(&self) -> Vec<u8> {
        let g = &self.g;
        let mut s = format!(
            "{{\"version\":1,\"device_path\":\"/dev/ublkb0\",\"capacity_bytes\":{},\"block_align\":{},\"header_bytes\":{},\"slot_bytes\":{},\"meta_total_bytes\":{},\"meta_magic\":\"LMCIDX01\",\"meta_version\":1,\"data_base_offset\":{},\"next_slot\":{},\"entries\":{{",
            g.capacity_bytes, g.block_align, g.header_bytes, g.slot_bytes, g.meta_total_bytes, g.meta_total_bytes, self.lmc.next_slot
        );
        for (i, (k, slot, size, _)) in self.lmc.index.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&format!(
                "\"{k}\":{{\"offset\":{},\"size\":{size},\"shape\":[{size}],\"dtype\":\"uint8\",\"fmt\":\"BINARY\",\"cached_positions\":null}}",
                g.slot_offset(*slot)
            ));
        }
        s.push_str("}}");
        s.into_bytes()
    }

    /// Snapshot under the index lock; false when the JSON does not fit (skipped, as LMCache).
    fn snapshot(&mut self) -> bool {
        if self.lmc.ckpt.is_some() {
            return false;
        }
        let json = self.json();
        if json.len() as u64 > self.g.payload_cap() {
            return false;
        }
        let slots = self.lmc.index.iter().map(|e| e.1).collect();
        self.lmc.ckpt = Some(Ckpt { seq: self.lmc.seq + 1, json, slots, pay: false, hdr: false });
        true
    }

    fn ckpt_payload(&mut self) {
        let c = self.lmc.ckpt.clone().unwrap();
        let copy = Geometry::copy_for_seq(c.seq);
        let mut b = c.json.clone();
        b.resize(b.len().div_ceil(BA as usize) * BA as usize, 0);
        self.write(self.g.container_offset(copy) + BA, &b);
        self.ckpt_done(|c| c.pay = true);
    }

    fn ckpt_header(&mut self) {
        let c = self.lmc.ckpt.clone().unwrap();
        let copy = Geometry::copy_for_seq(c.seq);
        let h = CheckpointHeader::encode_for(c.seq, &c.json, BA as usize);
        self.write(self.g.container_offset(copy), &h);
        self.ckpt_done(|c| c.hdr = true);
    }

    fn ckpt_done(&mut self, f: impl FnOnce(&mut Ckpt)) {
        let c = self.lmc.ckpt.as_mut().unwrap();
        f(c);
        if c.pay && c.hdr {
            self.lmc.seq = c.seq;
            self.lmc.ckpt = None;
        }
    }

    /// A whole checkpoint in posix order (payload, then header).
    fn checkpoint(&mut self) {
        assert!(self.snapshot());
        self.ckpt_payload();
        self.ckpt_header();
    }

    /// A put of a new key, deleting the oldest entry first when no slot is free (as an
    /// eviction would), without a checkpoint.
    fn put_in_a_full_cache(&mut self, salted: bool) {
        if self.lmc.free.is_empty() {
            self.delete(0);
        }
        let k = self.new_key(salted);
        assert!(self.put(k).is_some());
    }

    /// A checkpoint whose JSON says `capacity_bytes` `capacity` (an LMCache configured with
    /// another capacity than the layout fdpblk took).
    fn checkpoint_saying_capacity(&mut self, capacity: u64) {
        let cap = self.g.capacity_bytes;
        assert!(self.snapshot());
        let c = self.lmc.ckpt.as_mut().unwrap();
        let json = String::from_utf8(c.json.clone()).unwrap();
        c.json = json.replace(&format!("\"capacity_bytes\":{cap}"), &format!("\"capacity_bytes\":{capacity}")).into_bytes();
        self.ckpt_payload();
        self.ckpt_header();
    }

    /// LMCache's process ends (in-flight puts are lost; a checkpoint being written stays as
    /// far as it got) and a new one starts: it loads the newest valid checkpoint, dropping
    /// entries whose slot header does not match, or (`load` false, e.g. another device_path
    /// string) starts empty.
    fn restart_lmcache(&mut self, load: bool) {
        self.lmcache_torn.extend(self.lmc.puts.iter().filter(|p| p.pay && !p.hdr).map(|p| p.slot));
        let keys = self.lmc.keys;
        let gens = std::mem::take(&mut self.lmc.gens);
        let deleted = std::mem::take(&mut self.lmc.deleted);
        self.lmc = Lmc { keys, gens, deleted, ..Lmc::default() };
        if !load {
            return;
        }
        let dev = crate::persist::dev::DevReader(&*self.dev);
        let copies = read_copies(&dev, &self.g).unwrap();
        let Some(c) = newest_valid(&copies) else { return };
        let mut entries = Vec::new();
        let meta = read_entries(&dev, &self.g, c, &JsonLimits::default(), &mut |e| {
            entries.push((e.key.to_string(), e.offset.unwrap(), e.size.unwrap()));
            Ok(())
        })
        .unwrap();
        self.lmc.seq = c.seq().unwrap();
        self.lmc.next_slot = meta.next_slot.unwrap();
        let mut used = BTreeSet::new();
        let mut dropped = Vec::new();
        for (k, off, size) in entries {
            let slot = self.g.slot_of(off).unwrap().0;
            let h = SlotHeader::parse(&self.dev.peek(off, 24)).ok();
            if h.is_some_and(|h| h.identity == keys::identity(&k).unwrap() && h.payload_len == size) {
                let gen = self.lmc.gens[&k];
                self.lmc.index.push((k, slot, size, gen));
                used.insert(slot);
            } else {
                dropped.push(slot);
            }
        }
        self.lmc.free = (0..self.lmc.next_slot).filter(|s| !used.contains(s) && !dropped.contains(s)).collect();
        self.lmc.free.extend(dropped);
        self.verify_all();
    }

    /// fdpblk stops (cleanly: a final persist) or crashes (state as of its last persist), and
    /// a new instance starts on the same device; LMCache's I/O continues (ublk recovery; the
    /// recovered daemon marks every slot unseen, unless `recovery_marks_orphans` is off).
    fn restart_fdpblk(&mut self, clean: bool) {
        if clean {
            self.w.step();
            let _ = self.w.persist_now(true, true);
        }
        self.check_trims();
        self.early_tails += self.w.early_tail_trims();
        self.reclaimed += self.w.reclaimed();
        self.earlier.0 += self.w.early_evictions();
        self.earlier.1 += self.w.containers_invalidated();
        let table = Arc::new(SlotTable::new(self.g.max_slots));
        // After a crash the new daemon recovers the device (`fdpblk recover`); a clean stop
        // deletes it, and the next `add` serves a LMCache that reopened it.
        let cfg = WatchConfig { writes_unseen: self.recovery_marks_orphans && !clean, ..self.cfg.clone() };
        self.w = Watcher::new(self.g, table.clone(), self.dev.clone(), cfg, Some(self.region), OWN);
        self.pipe = Pipeline::with_slots(self.g, Box::new(RegionPolicy), table.clone());
        self.slots = table;
        assert!(self.w.loaded().found);
        self.check_trims();
    }

    /// LMCache reads an entry back (header and payload): it must be exactly what was put.
    fn verify(&mut self, i: usize) {
        let (k, slot, size, gen) = self.lmc.index[i].clone();
        let off = self.g.slot_offset(slot);
        let hdr = SlotHeader::parse(&self.dev.peek(off, 24)).unwrap_or_else(|e| panic!("slot {slot} of live {k}: header {e}"));
        assert_eq!((hdr.identity, hdr.payload_len), (keys::identity(&k).unwrap(), size), "slot {slot} of live {k}");
        let got = self.read(off + BA, size.div_ceil(BA) * BA);
        if self.lmcache_torn.contains(&slot) {
            return;
        }
        assert!(got == payload(&k, gen, size), "slot {slot} of live {k}: payload differs");
    }

    fn verify_all(&mut self) {
        for i in 0..self.lmc.index.len() {
            self.verify(i);
        }
    }

    fn state(&self, slot: u64) -> SlotState {
        self.slots.get(slot).map_or(SlotState::Unknown, |e| e.state)
    }
}

const SLOTS: u64 = 12;
const META: u64 = 8192;

#[test]
fn evicted_slots_are_trimmed_after_two_checkpoints() {
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    let keys: Vec<String> = (0..6).map(|i| r.new_key(i % 2 == 0)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.fillers(3);
    r.checkpoint(); // seq 1 -> container 0
    r.step();
    r.checkpoint_dirty(); // seq 2 -> container 1: confirms the first six
    r.step();
    assert!((0..6).all(|s| r.slots.get(s).unwrap().confirmed && r.state(s) == SlotState::Live));
    let tag = r.slots.get(0).unwrap().tag;
    assert_eq!(r.slots.tag_name(tag), Some(("meta-llama/Llama-3.1-8B".into(), "tenantA:alice".into())));
    let (a, b) = (r.delete_key(&keys[0]), r.delete_key(&keys[1]));
    r.checkpoint(); // seq 3 -> container 0 lacks them; container 1 still lists them
    r.step();
    assert_eq!(r.trims, 0);
    assert_eq!(r.state(a), SlotState::Evicted);
    r.checkpoint_dirty(); // seq 4 -> container 1 lacks them too
    r.step();
    assert_eq!(r.trims, 2);
    assert_eq!((r.state(a), r.state(b)), (SlotState::Trimmed, SlotState::Trimmed));
    for s in [a, b] {
        assert!(r.dev.peek(r.g.slot_offset(s), r.g.slot_bytes as usize).iter().all(|&x| x == 0));
    }
    r.verify_all();
    assert_eq!(r.w.counters().trims_by_handle, vec![0, 0, 2], "two trims on the slots handle");
    let v = r.w.published_json();
    assert_eq!(v["trim"]["trims"], 2);
    assert_eq!((v["since_start"]["trims"].as_u64(), v["since_start"]["trim_handles"]["2"].as_u64()), (Some(2), Some(2)));
    assert_eq!(v["slots"]["trimmed"], 2);
    assert_eq!(v["checkpoint_seq"], 4);
    // The identities of the evicted keys are in the history; a returning one is recognised
    // with its tag.
    r.put(keys[0].clone()).unwrap();
    let e = r.slots.get(r.lmc.index.last().unwrap().1).unwrap();
    assert!(e.seen_before);
    assert_eq!(e.tag, tag);
    // A new daemon gets the lifetime counters back from the drive; what it counts itself
    // (monitoring's counters) starts at 0.
    r.restart_fdpblk(true);
    r.w.publish();
    let v = r.w.published_json();
    assert_eq!((v["trim"]["trims"].as_u64(), v["since_start"]["trims"].as_u64()), (Some(2), Some(0)));
    assert_eq!(v["since_start"]["trim_handles"].as_object().map(|h| h.len()), Some(0));
    assert_eq!(v["since_start"]["evictions"].as_u64(), Some(0));
}

/// The [`StateWriter`] methods a test device wrapper passes on to its `dev` unchanged.
macro_rules! forward_to_dev {
    () => {
        fn block_bytes(&self) -> u64 {
            self.dev.block_bytes()
        }
        fn discard(&self, off: u64, len: u64) -> std::io::Result<()> {
            self.dev.discard(off, len)
        }
        fn flush(&self) -> std::io::Result<()> {
            self.dev.flush()
        }
        fn size(&self) -> u64 {
            self.dev.size()
        }
    };
}

/// The state thread's device: while armed, its reads of a checkpoint payload past the
/// parser's first 64 KiB run `during` on the slot table (what the data path does meanwhile),
/// after the parse took the entries of the first 64 KiB and before it applied their
/// confirmations.
struct DuringCheckpointRead {
    dev: Arc<MemDev>,
    table: Arc<SlotTable>,
    payloads: [std::ops::Range<u64>; 2],
    during: Box<dyn Fn(&SlotTable) + Send + Sync>,
    armed: std::sync::atomic::AtomicBool,
}

impl StateWriter for DuringCheckpointRead {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        if self.armed.load(std::sync::atomic::Ordering::Relaxed) && self.payloads.iter().any(|r| r.contains(&off) && off >= r.start + 65536) {
            (self.during)(&self.table);
        }
        self.dev.read_at(off, buf)
    }
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> std::io::Result<()> {
        self.dev.write_at(off, buf, handle)
    }
    forward_to_dev!();
}

impl Rig {
    /// A rig large enough for a checkpoint payload past the parser's first 64 KiB read, whose
    /// state thread runs `during` while it reads one (see [`DuringCheckpointRead`]).
    fn with_work_during_checkpoint_reads(during: impl Fn(&SlotTable) + Send + Sync + 'static) -> (Rig, Arc<DuringCheckpointRead>) {
        let mut r = Rig::new(600, 1 << 20, true).without_early_evictions().without_early_tails();
        let payload_of = |c: u8| r.g.container_offset(c) + r.g.block_align..r.g.container_offset(c) + r.g.container_bytes;
        let dev = Arc::new(DuringCheckpointRead {
            dev: r.dev.clone(),
            table: r.slots.clone(),
            payloads: [payload_of(0), payload_of(1)],
            during: Box::new(during),
            armed: false.into(),
        });
        r.w = Watcher::new(r.g, r.slots.clone(), dev.clone(), r.cfg.clone(), Some(r.region), OWN);
        (r, dev)
    }

    /// Checkpoints 1 (listing `keys` first, then 500 fillers) and 2, which confirms them, read
    /// back with `dev` armed.
    fn confirm_during(&mut self, dev: &DuringCheckpointRead) {
        self.fillers(500);
        self.checkpoint();
        self.step();
        assert!(self.w.containers.iter().any(|c| matches!(c, Container::Valid(v) if v.entries > 500)));
        dev.armed.store(true, std::sync::atomic::Ordering::Relaxed);
        self.checkpoint_dirty();
        self.step();
        dev.armed.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// LMCache loads slots while fdpblk reads back the checkpoint that confirms them, after the
/// parse took their entries and before it applied the confirmations (a load counts in the
/// slot's life word): they are confirmed all the same, and go once evicted. (A lost
/// confirmation waited for the next checkpoint listing the slot; a slot evicted before that
/// stayed on the drive, and its stale tail too.)
#[test]
fn loads_during_the_read_back_do_not_lose_the_confirmation() {
    let (mut r, dev) = Rig::with_work_during_checkpoint_reads(|t| {
        for s in 0..6 {
            t.note_read(s);
        }
    });
    let keys: Vec<String> = (0..6).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.confirm_during(&dev);
    for s in 0..6 {
        assert!(r.slots.life(s) & life::READS_MASK != 0, "slot {s} was loaded during the read-back");
        assert!(r.slots.get(s).unwrap().confirmed, "slot {s} confirmed despite the loads");
    }
    let a = r.delete_key(&keys[0]);
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    assert_eq!(r.trims, 1);
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();
}

/// With buffered I/O LMCache commits a put while its header is still in the page cache: the
/// header write can complete (`HEADER_DONE`) while fdpblk reads back a checkpoint that
/// confirms the put. The confirmation stands.
#[test]
fn a_header_write_completing_during_the_read_back_does_not_lose_the_confirmation() {
    let (mut r, dev) = Rig::with_work_during_checkpoint_reads(|t| {
        if let Some(g) = t.generation(0) {
            t.header_completed(0, g);
        }
    });
    let k = r.new_key(false);
    assert!(r.start_put(k.clone(), 100));
    assert_eq!(r.lmc.puts[0].slot, 0);
    // The header is planned (on the device: written back) but its completion not yet seen.
    let h = SlotHeader { identity: keys::identity(&k).unwrap(), payload_len: 100 }.encode(BA as usize);
    let mut segs = Vec::new();
    r.pipe.plan(&Request { op: Op::Write, offset: r.g.slot_offset(0), len: BA, data: Some(&h) }, &mut segs, crate::pipeline::HeaderWait::Expired).unwrap();
    r.dev.poke(r.g.slot_offset(0), &h);
    r.lmc.puts[0].hdr = true;
    r.put_payload(0);
    r.put_commit(0);
    assert_eq!(r.slots.life(0) & (life::HEADER_DONE | life::STALE_TAIL), life::STALE_TAIL, "a fresh slot may hold a stale tail");
    r.confirm_during(&dev);
    assert_ne!(r.slots.life(0) & life::HEADER_DONE, 0, "completed during the read-back");
    assert!(r.slots.get(0).unwrap().confirmed, "confirmed despite the completion");
    r.delete_key(&k);
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    assert_eq!(r.state(0), SlotState::Trimmed);
    r.verify_all();
}

/// An early tail whose round failed (its flush here, or its header read or deallocation) is
/// tried again once the pause ends at the next checkpoint: its completion was taken, and the
/// confirmed path never takes a key deleted before a second checkpoint listed it.
#[test]
fn an_early_tail_whose_round_failed_goes_after_the_pause() {
    let mut r = Rig::new(SLOTS, META, true);
    r.faults = true;
    r.checkpoint();
    r.step();
    let a = r.new_key(false);
    let s = r.put_sized(a.clone(), 3 * BA - 10).unwrap(); // fills the slot: no tail
    r.step();
    r.delete_key(&a);
    let b = r.new_key(false);
    assert_eq!(r.put_sized(b.clone(), 100), Some(s)); // leaves a stale tail
    r.step();
    let tails = r.tails;
    r.dev.set_fail_flushes(Some(0));
    r.checkpoint(); // written after the put: the early tail may go, but the flush fails
    r.step();
    r.step();
    assert_eq!(r.tails, tails, "no tail without a flush");
    r.dev.set_fail_flushes(None);
    r.delete_key(&b); // never confirmed: only the early path can take its tail
    r.checkpoint();
    r.step();
    r.step();
    assert_eq!(r.tails, tails + 1, "the tail went once the pause ended");
    assert!(r.dev.peek(r.g.slot_offset(s) + 2 * BA, 2 * BA as usize).iter().all(|&x| x == 0));
    assert!(!r.slots.get(s).unwrap().confirmed);
    r.verify_all();
}

/// The stats thread works the ages out when it writes them: while the state thread is held
/// up (no step, no publish), both the state's and the checkpoint's age keep growing.
#[test]
fn published_ages_grow_while_the_state_thread_is_held_up() {
    let mut r = Rig::new(SLOTS, META, true);
    let k = r.new_key(false);
    r.put(k).unwrap();
    r.checkpoint();
    r.step();
    let first = r.w.published_json();
    let (state0, ckpt0) = (first["state_age_s"].as_f64().unwrap(), first["checkpoint_age_s"].as_f64().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let later = r.w.published_json();
    assert!(later["state_age_s"].as_f64().unwrap() >= state0 + 0.2, "{first} then {later}");
    assert!(later["checkpoint_age_s"].as_f64().unwrap() >= ckpt0 + 0.2, "{first} then {later}");
    assert_eq!(later["checkpoint_seq"], first["checkpoint_seq"]);
    assert_eq!(later["state_rounds"].as_u64().unwrap(), first["state_rounds"].as_u64().unwrap(), "no round while held up");
    r.step();
    let after = r.w.published_json();
    assert!(after["state_age_s"].as_f64().unwrap() < later["state_age_s"].as_f64().unwrap(), "a step publishes afresh: {later} then {after}");
    assert_eq!(after["state_rounds"].as_u64().unwrap(), first["state_rounds"].as_u64().unwrap() + 1, "each step is a round");
}

/// LMCache's newest checkpoint keeps its age across a daemon restart (the own state keeps
/// when it was seen): a stalled LMCache stays visible after fdpblk restarts. One the saved
/// state did not see (another seq) counts from the start.
#[test]
fn checkpoint_age_goes_on_across_a_daemon_restart() {
    let mut r = Rig::new(SLOTS, META, true);
    let k = r.new_key(false);
    r.put(k).unwrap();
    r.checkpoint();
    r.step();
    let seq = r.w.published_json()["checkpoint_seq"].as_u64().unwrap();
    assert_eq!(r.w.counters().checkpoint_seen.map(|(s, _)| s), Some(seq), "seen when written");
    // As if it was written 600 s ago.
    r.w.counters.checkpoint_seen = Some((seq, unix_now() - 600));
    r.restart_fdpblk(true);
    r.w.publish();
    let age = r.w.published_json()["checkpoint_age_s"].as_f64().unwrap();
    assert!((600.0..700.0).contains(&age), "age {age} s after the restart");
    // Saved for another seq: this one was never seen written, so it counts from the start.
    r.w.counters.checkpoint_seen = Some((seq + 5, unix_now() - 600));
    r.restart_fdpblk(true);
    r.w.publish();
    let age = r.w.published_json()["checkpoint_age_s"].as_f64().unwrap();
    assert!(age < 60.0, "age {age} s of a checkpoint found at the start");
    assert_eq!(r.w.counters().checkpoint_seen.map(|(s, _)| s), Some(seq));
}

impl Rig {
    /// A rig whose stall alarm goes off after 3 s (not 180 s).
    fn stall_rig() -> Rig {
        let mut r = Rig::new(SLOTS, META, true);
        r.cfg.stall_min = Duration::from_secs(3);
        r.w.cfg.stall_min = r.cfg.stall_min;
        r
    }
    fn stalled(&self) -> bool {
        self.w.published_json()["checkpoint_stalled"].as_bool().unwrap()
    }
    /// A put of a new key.
    fn put_new(&mut self) {
        let k = self.new_key(false);
        self.put(k).unwrap();
    }
    /// `n` rounds of a put of a new key and a checkpoint listing it.
    fn checkpointed_puts(&mut self, n: usize) {
        for _ in 0..n {
            self.put_new();
            self.checkpoint();
            self.step();
        }
    }
    /// `rounds` rounds, each `step` later since the last checkpoint and the last moment
    /// nothing waited for one.
    fn age_uncheckpointed(&mut self, rounds: usize, step: Duration) {
        for _ in 0..rounds {
            self.w.clean_at = self.w.clean_at.checked_sub(step).unwrap();
            let c = self.w.commit.as_mut().unwrap();
            c.at = c.at.checked_sub(step).unwrap();
            self.step();
        }
    }
}

/// An idle LMCache writes no checkpoint: a put after an idle stretch is no stall, and the idle
/// stretch is no interval of LMCache's. A put left without a checkpoint past the stall time is,
/// and stays one across a daemon restart.
#[test]
fn a_put_after_an_idle_stretch_is_no_stall() {
    let mut r = Rig::stall_rig();
    let (stalled, put) = (Rig::stalled, Rig::put_new);
    r.checkpointed_puts(2);
    assert!(r.w.commit.as_ref().is_some_and(|c| c.observed));
    // Idle for 30 s since that checkpoint, then one put.
    let c = r.w.commit.as_mut().unwrap();
    c.at = c.at.checked_sub(Duration::from_secs(30)).expect("an uptime of 30 s");
    r.w.counters.checkpoint_seen = r.w.counters.checkpoint_seen.map(|(s, at)| (s, at - 30));
    put(&mut r);
    r.step();
    assert!(!stalled(&r), "one put after an idle stretch taken for a stall");
    // The put waits 5 s for a checkpoint (past the 3 s): a stall.
    r.w.clean_at = r.w.clean_at.checked_sub(Duration::from_secs(5)).unwrap();
    r.w.counters.uncheckpointed_since = r.w.counters.uncheckpointed_since.map(|t| t - 5);
    r.step();
    assert!(stalled(&r));
    // A restarted daemon goes on from the saved time (the previous one saw the put).
    r.restart_fdpblk(true);
    r.step();
    assert!(stalled(&r), "the restart forgot the stall");
    // Its checkpoint ends the stall.
    r.checkpoint();
    r.step();
    assert!(!stalled(&r));
    // The interval is what LMCache took from a first put to its checkpoint, not the idle
    // stretch before: (3 x before + 5 s) / 4, where counting the idle stretch would make it
    // about 9 s.
    r.checkpointed_puts(2);
    let c = r.w.commit.as_mut().unwrap();
    c.at = c.at.checked_sub(Duration::from_secs(30)).unwrap();
    put(&mut r);
    r.step();
    r.w.clean_at = r.w.clean_at.checked_sub(Duration::from_secs(5)).unwrap();
    let before = r.w.interval.unwrap();
    r.checkpoint();
    r.step();
    let i = r.w.interval.unwrap();
    assert!(before < Duration::from_secs(1) && i < Duration::from_secs(3), "interval {i:?} (was {before:?}): the idle stretch counted");
    // LMCache's checkpoints come 10 s apart at the shortest: a put just after one waits a whole
    // gap, which is no stall, however short the average from first puts to checkpoints.
    r.w.recent_gaps = std::iter::repeat_n(Duration::from_secs(10), 8).collect();
    let c = r.w.commit.as_mut().unwrap();
    c.at = c.at.checked_sub(Duration::from_secs(30)).unwrap();
    put(&mut r);
    r.step();
    r.w.clean_at = r.w.clean_at.checked_sub(Duration::from_secs(5)).unwrap();
    r.step();
    assert!(!stalled(&r), "a put waiting less than two of LMCache's gaps taken for a stall");
}

/// A stall is said when it begins, not again at every round, and again once an hour while it
/// lasts.
#[test]
fn a_lasting_stall_is_said_again_each_hour() {
    let mut r = Rig::stall_rig();
    let (stalled, put) = (Rig::stalled, Rig::put_new);
    r.checkpointed_puts(2);
    let said = warnings_during(|| {
        put(&mut r);
        r.step();
        r.age_uncheckpointed(4, Duration::from_secs(5));
    });
    assert!(stalled(&r));
    assert_eq!(said.matches("and no checkpoint since").count(), 1, "{said}");
    let again = warnings_during(|| {
        r.step();
        r.w.stall_said_at = r.w.stall_said_at.and_then(|t| t.checked_sub(STALL_REPEAT));
        r.step();
        r.step();
    });
    assert_eq!(again.matches("and no checkpoint since").count(), 1, "an hour on: {again}");
}

/// A stall while the overflow estimate is near the cap but below it may be either cause:
/// said so, with both fixes.
#[test]
fn a_stall_near_the_cap_names_the_overflow_too() {
    // 64 slots, of which about 13 entries fit a checkpoint container.
    let mut r = Rig::new(64, META, true);
    r.cfg.stall_min = Duration::from_secs(3);
    r.w.cfg.stall_min = r.cfg.stall_min;
    r.put_new();
    r.checkpoint();
    r.step();
    let mut near = false;
    for _ in 0..64 {
        r.put_new();
        r.step();
        let v = r.w.published_json();
        if v["overflow_risk"] == true {
            near = v["checkpoint_estimate_bytes"].as_u64().unwrap() < v["checkpoint_cap_bytes"].as_u64().unwrap();
            break;
        }
    }
    assert!(near, "the test needs an estimate between 90 % and 100 % of the cap");
    let said = warnings_during(|| {
        r.age_uncheckpointed(4, Duration::from_secs(5));
    });
    assert!(Rig::stalled(&r));
    assert!(said.contains("leave LMCache idle moments") && said.contains("its checkpoint no longer fits") && said.contains("meta_total_bytes of at least"), "{said}");
}

/// A LMCache that opens the device again (it reads both checkpoint copies' header blocks)
/// loaded its last checkpoint: puts it made after that are lost to it, not waiting for a
/// checkpoint, so they end the stall; one header block read (a probe) does not.
#[test]
fn a_restarted_lmcache_ends_the_stall_of_the_puts_it_lost() {
    let mut r = Rig::stall_rig();
    let (stalled, put) = (Rig::stalled, Rig::put_new);
    let age = |r: &mut Rig| {
        r.w.clean_at = r.w.clean_at.checked_sub(Duration::from_secs(5)).unwrap();
        r.w.counters.uncheckpointed_since = r.w.counters.uncheckpointed_since.map(|t| t - 5);
        r.step();
    };
    let (c0, c1) = (r.g.container_offset(0), r.g.container_offset(1));
    r.checkpointed_puts(2);
    let c = r.w.commit.as_mut().unwrap();
    c.at = c.at.checked_sub(Duration::from_secs(30)).expect("an uptime of 30 s");
    r.w.counters.checkpoint_seen = r.w.counters.checkpoint_seen.map(|(s, at)| (s, at - 30));
    let listed = r.w.estimate().unwrap().entries;
    let opens = |r: &Rig| (r.w.published_json()["lmcache_opens"].as_u64().unwrap(), r.w.published_json()["lmcache_lost_puts"].as_u64().unwrap());
    // LMCache opening the device while nothing waits for a checkpoint: counted, nothing lost.
    r.read(c0, BA);
    r.read(c1, BA);
    r.step();
    assert_eq!(opens(&r), (1, 0));
    // A header block read while nothing waits for a checkpoint is not half of a later reload.
    r.read(c1, BA);
    r.step();
    put(&mut r);
    put(&mut r);
    r.step();
    age(&mut r);
    assert!(stalled(&r));
    assert_eq!(r.w.estimate().unwrap().entries, listed + 2);
    // A probe of the first block only is no reload, nor, with puts between, a later lone read
    // of the other.
    r.read(c0, BA);
    r.step();
    assert!(stalled(&r), "one header block read taken for LMCache's reload");
    put(&mut r);
    r.read(c1, BA);
    r.step();
    assert!(stalled(&r), "two header block reads far apart taken for LMCache's reload");
    // LMCache restarts: it reads both, loads the checkpoint and puts once more.
    r.read(c0, BA);
    r.read(c1, BA);
    r.restart_lmcache(true);
    put(&mut r);
    r.step();
    assert!(!stalled(&r), "the stall of puts the restarted LMCache lost goes on");
    assert_eq!(opens(&r), (2, 3), "the three puts after the checkpoint lost");
    assert!(r.w.counters.uncheckpointed_since.is_some(), "the put after the reload waits for a checkpoint");
    assert_eq!(r.w.estimate().unwrap().entries, listed + 4, "the overflow estimate errs high: it keeps the lost puts");
    // That put, unlisted past the stall time, is a stall of its own.
    age(&mut r);
    assert!(stalled(&r));
    // Across a restart of fdpblk (the puts saved as uncheckpointed), LMCache reloading ends it.
    r.restart_fdpblk(true);
    r.step();
    assert!(stalled(&r));
    r.read(c0, BA);
    r.read(c1, BA);
    r.restart_lmcache(true);
    r.step();
    assert!(!stalled(&r));
    assert_eq!(r.w.counters.uncheckpointed_since, None);
    r.verify_all();
}

/// LMCache's closing checkpoint, its header read back before its payload landed (io_uring),
/// then LMCache opening the device again: the load is judged once that checkpoint is
/// committed, so the puts it lists are not taken for lost.
#[test]
fn a_reload_right_after_a_checkpoint_waits_for_its_read_back() {
    let mut r = Rig::stall_rig();
    let (c0, c1) = (r.g.container_offset(0), r.g.container_offset(1));
    let lost = |r: &Rig| r.w.published_json()["lmcache_lost_puts"].as_u64().unwrap();
    r.put_new();
    r.checkpoint();
    r.step();
    r.put_new();
    r.put_new();
    r.step();
    assert!(r.snapshot());
    r.ckpt_header();
    r.read(c0, BA);
    r.read(c1, BA);
    r.step();
    assert_eq!(lost(&r), 0, "judged against the checkpoint before the one still landing");
    r.ckpt_payload();
    r.step();
    assert_eq!((r.w.published_json()["lmcache_opens"].as_u64(), lost(&r)), (Some(1), 0));
    assert_eq!(r.w.counters.uncheckpointed_since, None);
    r.verify_all();
}

#[test]
fn evicted_slots_go_early_once_the_newest_checkpoint_lacks_them() {
    let (mut r, keys) = rig_with_keys(6, 3);
    r.checkpoint(); // seq 1 -> container 0
    r.step();
    r.checkpoint_dirty(); // seq 2 -> container 1: confirms the first six
    r.step();
    let (a, b) = (r.delete_key(&keys[0]), r.delete_key(&keys[1]));
    r.checkpoint(); // seq 3 -> container 0 lacks them; container 1 (seq 2) still lists them
    r.step();
    assert_eq!((r.trims, r.early_evictions, r.w.early_evictions()), (2, 2, 2));
    assert_eq!((r.state(a), r.state(b)), (SlotState::Trimmed, SlotState::Trimmed));
    assert_eq!(r.w.published_json()["trim"]["early_evictions"], 2);
    for s in [a, b] {
        assert!(r.dev.peek(r.g.slot_offset(s), r.g.slot_bytes as usize).iter().all(|&x| x == 0));
    }
    // First the older container (seq 2) was made unloadable, and flushed.
    assert_eq!(r.invalidated, 1);
    assert!(r.dev.peek(r.g.container_offset(Geometry::copy_for_seq(2)), BA as usize).iter().all(|&x| x == 0));
    assert_eq!(r.w.published_json()["trim"]["containers_invalidated"], 1);
    // A new LMCache process loads seq 3.
    let mut probe = r.lmc.clone();
    std::mem::swap(&mut probe, &mut r.lmc);
    r.restart_lmcache(true);
    assert_eq!(r.lmc.seq, 3);
    assert_eq!(r.lmc.index.len(), probe.index.len());
    r.verify_all();
    // Had seq 3 become unreadable, it would load nothing: no entry names a deallocated slot.
    std::mem::swap(&mut probe, &mut r.lmc);
    r.dev.zero(r.g.container_offset(Geometry::copy_for_seq(3)), BA);
    r.restart_lmcache(true);
    assert_eq!((r.lmc.seq, r.lmc.index.len()), (0, 0));
    r.verify_all();
}

#[test]
fn no_early_evictions_when_a_header_block_is_smaller_than_the_drives_block() {
    // block_align 512 on a drive of 4 KiB blocks: zeroing the header block would take the
    // start of the container's JSON with it.
    let mut r = Rig::new(SLOTS, META, true);
    r.dev.set_block_bytes(4096);
    r.w = Watcher::new(r.g, r.slots.clone(), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    evictions_wait_for_the_older_copy(r);
}

#[test]
fn no_early_evictions_when_a_header_block_is_smaller_than_a_page() {
    // block_align 512 on a drive of 512-byte blocks, served through a page cache: LMCache's
    // buffered payload write dirties the header's page, old header included, and its
    // writeback would undo the zeroing.
    let mut r = Rig::new(SLOTS, META, true);
    assert!(BA < crate::device::page_size());
    let cache = std::env::temp_dir().join(format!("fdpblk-page-cache-small-block-{}", std::process::id()));
    std::fs::write(&cache, vec![0u8; 8192]).unwrap();
    r.cfg.page_cache = Some(cache.clone());
    r.w = Watcher::new(r.g, r.slots.clone(), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    evictions_wait_for_the_older_copy(r);
    std::fs::remove_file(&cache).unwrap();
}

/// With early evictions off: an evicted slot the older container still lists stays until
/// LMCache overwrites that container (the two-container rule), then goes.
fn evictions_wait_for_the_older_copy(mut r: Rig) {
    let keys: Vec<String> = (0..6).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.fillers(3);
    let a = r.evict_first_behind_two_checkpoints(&keys);
    assert_eq!((r.early_evictions, r.invalidated, r.w.early_evictions()), (0, 0, 0));
    assert_ne!(r.state(a), SlotState::Trimmed);
    assert_eq!(r.w.published_json()["trim"]["early_evictions_enabled"], false);
    r.checkpoint();
    r.step();
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();
}

/// A rig with `keys` keys put, then `fillers` filler keys.
fn rig_with_keys(keys: usize, fillers: usize) -> (Rig, Vec<String>) {
    let mut r = Rig::new(SLOTS, META, true);
    let keys: Vec<String> = (0..keys).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.fillers(fillers);
    (r, keys)
}

/// Six keys confirmed by seq 2, the first deleted, then seq 3 with `fault` in the drive: the
/// older container cannot be zeroed durably, so nothing goes until LMCache writes it again.
fn zeroing_fails(fault: impl Fn(&MemDev), heal: impl Fn(&MemDev)) {
    let (mut r, keys) = rig_with_keys(6, 3);
    r.faults = true;
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    let a = r.delete_key(&keys[0]);
    fault(&r.dev);
    r.checkpoint(); // seq 3 lacks slot a; seq 2 still lists it
    r.step();
    r.w.need_sweep = true; // (the daemon sweeps at least every 10 s)
    r.step();
    assert_eq!((r.trims, r.w.containers_invalidated(), r.early_evictions), (0, 0, 0));
    assert_eq!(r.state(a), SlotState::Evicted);
    assert!(!r.w.trims_allowed(), "the container is unknown until LMCache writes it again");
    heal(&r.dev);
    r.w.need_sweep = true;
    r.step();
    assert_eq!(r.trims, 0);
    // LMCache's next checkpoint goes into that container: known again, and slot a goes.
    r.checkpoint_dirty(); // seq 4
    r.step();
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();
}

#[test]
fn a_failed_zeroing_of_the_older_container_deallocates_nothing_early() {
    zeroing_fails(|d| d.set_fail_writes(true), |d| d.set_fail_writes(false));
}

#[test]
fn a_failed_flush_after_zeroing_the_older_container_deallocates_nothing() {
    // The flush before deallocating passes, the one after the zeroes fails.
    zeroing_fails(|d| d.set_fail_flushes(Some(1)), |d| d.set_fail_flushes(None));
}

/// A device on which a checkpoint header block is read (a LMCache opening the device)
/// while fdpblk writes zeroes over one: the read is counted as the data path counts it.
struct ReadDuringZeroing {
    dev: Arc<MemDev>,
    table: Arc<SlotTable>,
    headers: [u64; 2],
}

impl StateWriter for ReadDuringZeroing {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.dev.read_at(off, buf)
    }
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> std::io::Result<()> {
        if let Some(copy) = self.headers.iter().position(|&h| h == off).filter(|_| buf.iter().all(|&b| b == 0)) {
            self.table.note_checkpoint_read(copy as u8);
        }
        self.dev.write_at(off, buf, handle)
    }
    forward_to_dev!();
}

/// A header block read while the older container is zeroed may return the old header past
/// the zeroes (a read in flight, into the page cache or the opener's buffer): nothing goes
/// early, and the container is unknown until LMCache writes it again. One read since the
/// newest checkpoint was read back holds the zeroing back (the early tails' gate).
#[test]
fn a_header_read_during_or_before_the_zeroing_deallocates_nothing_early() {
    // During the zeroing.
    let (mut r, keys) = rig_with_keys(6, 3);
    r.faults = true;
    let headers = [r.g.container_offset(0), r.g.container_offset(1)];
    r.w = Watcher::new(r.g, r.slots.clone(), Arc::new(ReadDuringZeroing { dev: r.dev.clone(), table: r.slots.clone(), headers }), r.cfg.clone(), Some(r.region), OWN);
    let a = r.evict_first_behind_two_checkpoints(&keys);
    assert_eq!((r.trims, r.w.containers_invalidated(), r.w.early_evictions()), (0, 0, 0));
    assert_eq!(r.state(a), SlotState::Evicted);
    assert!(!r.w.trims_allowed(), "the container is unknown until LMCache writes it again");
    r.checkpoint_dirty(); // seq 4 into that container: both lack slot a
    r.step();
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();

    // Before the round: the header read comes after seq 3's header write.
    let (mut r, keys) = rig_with_keys(6, 3);
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    let a = r.delete_key(&keys[0]);
    r.checkpoint(); // seq 3 lacks slot a; seq 2 still lists it
    r.read(r.g.container_offset(1), BA);
    r.step();
    assert_eq!((r.trims, r.invalidated, r.w.early_evictions()), (0, 0, 0), "held back while a header read may be in flight");
    assert_eq!(r.state(a), SlotState::Evicted);
    // The next checkpoint read back clears the gate; slot a goes by the two-container rule.
    r.checkpoint_dirty(); // seq 4
    r.step();
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();
}

/// Six keys and three fillers on a device whose cached pages cannot be dropped (here: no
/// such device node), so a zeroed container stays unknown.
fn rig_with_an_undroppable_page_cache() -> (Rig, Vec<String>) {
    let (mut r, keys) = rig_with_keys(6, 3);
    r.faults = true;
    r.cfg.page_cache = Some(std::path::PathBuf::from("/nonexistent/ublkb0"));
    r.w = Watcher::new(r.g, r.slots.clone(), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    // The rig's header blocks are smaller than a page, which turns early evictions off
    // under a page cache; as with a page-sized `block_align`, they stay on here.
    assert!(!r.w.cfg.early_evictions);
    r.w.cfg.early_evictions = true;
    (r, keys)
}

#[test]
fn a_zeroed_header_block_left_in_the_page_cache_deallocates_nothing_early() {
    let (mut r, keys) = rig_with_an_undroppable_page_cache();
    let a = r.evict_first_behind_two_checkpoints(&keys);
    assert_eq!((r.trims, r.w.containers_invalidated(), r.w.early_evictions()), (0, 0, 0));
    assert!(!r.w.trims_allowed(), "the container is unknown until LMCache writes it again");
    // LMCache's next checkpoint goes into that container: both lack slot a, which goes.
    r.checkpoint_dirty(); // seq 4
    r.step();
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();
}

/// The older container zeroed, but its cached block could not be dropped: unknown, with
/// zeroes on the drive. LMCache's seq 4 then goes there with its header held back: read
/// again, the container is empty, and it awaits that header as one zeroed cleanly would.
#[test]
fn an_unknown_container_rewritten_without_its_header_yet_stops_deallocation() {
    let (mut r, keys) = rig_with_an_undroppable_page_cache();
    r.evict_first_behind_two_checkpoints(&keys);
    assert_eq!(r.w.containers_invalidated(), 0, "zeroed on the drive, but unknown");
    let late = checkpoint_with_late_header(&mut r); // seq 4 lists keys[1]
    r.step();
    assert!(!r.w.trims_allowed(), "container {} awaits its header", Geometry::copy_for_seq(4));
    let b = r.delete_key(&keys[1]);
    let trims = r.trims;
    r.checkpoint(); // seq 5 lacks slot b; seq 4's header is still to come
    r.step();
    assert_eq!(r.trims, trims);
    assert_eq!(r.state(b), SlotState::Evicted);
    finish_late_header(&mut r, &late, b);
}

/// LMCache's seq 4: snapshot and payload written, its header held back (buffered I/O writes
/// back pages in any order). Returns the header, for the caller to write later.
fn checkpoint_with_late_header(r: &mut Rig) -> Vec<u8> {
    assert!(r.snapshot());
    let c = r.lmc.ckpt.clone().unwrap();
    r.ckpt_payload();
    r.ckpt_done(|c| c.hdr = true); // written, as far as LMCache knows (page cache)
    CheckpointHeader::encode_for(c.seq, &c.json, BA as usize).to_vec()
}

/// Six keys and four fillers, then seq 1..3 (with a filler deleted before each when `dirty`),
/// then seq 4 with its header held back; returns the rig, the keys and that header.
fn rig_with_a_late_header(dirty: bool) -> (Rig, Vec<String>, Vec<u8>) {
    let (mut r, keys) = rig_with_keys(6, 4);
    for _ in 0..3 {
        if dirty {
            r.checkpoint_dirty();
        } else {
            r.checkpoint();
        }
        r.step();
    }
    assert_eq!(r.invalidated, u64::from(dirty), "container 1 (seq 2) zeroed for seq 3 when a filler went");
    let late = checkpoint_with_late_header(&mut r);
    r.step();
    (r, keys, late)
}

/// After the late header: the next checkpoint, and no deallocated slot is listed by a
/// checkpoint LMCache could load.
fn finish_late_header(r: &mut Rig, late: &[u8], a: u64) {
    r.write(r.g.container_offset(Geometry::copy_for_seq(4)), late);
    r.step();
    assert_ne!(r.state(a), SlotState::Trimmed, "seq 4 lists slot {a}");
    r.checkpoint_dirty(); // seq 6 -> container 1, lacking slot a
    r.step();
    assert_eq!(r.state(a), SlotState::Trimmed);
    for s in 0..SLOTS {
        if r.state(s) == SlotState::Trimmed {
            assert_eq!(r.protected(s), None, "slot {s}");
        }
    }
    r.verify_all();
}

#[test]
fn an_older_checkpoint_header_written_back_late_is_waited_for() {
    // Seq 4's header reaches the device after seq 5. Until it does, fdpblk's view of that
    // container is seq 2, which is no basis for zeroing it (only the immediate predecessor
    // of the newest seq is).
    let (mut r, keys, late) = rig_with_a_late_header(false);
    let a = r.delete_key(&keys[0]);
    r.checkpoint(); // seq 5 -> container 0 lacks slot a; container 1 still shows seq 2
    r.step();
    assert_eq!((r.trims, r.invalidated), (0, 0), "container 1's newer header may still come");
    assert_eq!(r.state(a), SlotState::Evicted);
    finish_late_header(&mut r, &late, a);
}

#[test]
fn a_zeroed_container_rewritten_without_its_header_yet_stops_deallocation() {
    // As above, but container 1 was zeroed (early eviction of a filler at seq 3): seq 4's
    // payload there, without a header, may still become a loadable copy listing slot a.
    let (mut r, keys, late) = rig_with_a_late_header(true);
    assert!(!r.w.trims_allowed(), "container 1 awaits its header");
    let a = r.delete_key(&keys[0]);
    let trims = r.trims;
    r.checkpoint(); // seq 5 -> container 0 lacks slot a; container 1 is empty so far
    r.step();
    assert_eq!(r.trims, trims);
    assert_eq!(r.state(a), SlotState::Evicted);
    finish_late_header(&mut r, &late, a);
}

/// Why an early eviction first makes the older container unloadable: a slot early-evicted
/// while the older container still lists it; LMCache restarts with its index rejected (seq
/// back to 1, written over the newer container), re-puts the same key into the same slot
/// (bump allocation from 0), and dies between the header and the payload. Had the older
/// copy survived, the next LMCache would load it (the higher seq), its entry would pass the
/// header check, and LMCache would read the deallocated payload.
#[test]
fn early_eviction_then_same_key_reput_torn_by_a_crash_after_a_seq_restart() {
    let (mut r, keys) = rig_with_keys(4, 5);
    for _ in 0..4 {
        r.checkpoint_dirty(); // seq 1..4; seq 4 (container 1) lists every key
        r.step();
    }
    let s0 = r.delete_key(&keys[0]);
    assert_eq!(s0, 0);
    r.checkpoint(); // seq 5 -> container 0 lacks slot 0; seq 4 (container 1) lists it
    r.step();
    assert!(r.early_evictions >= 1 && r.state(s0) == SlotState::Trimmed);
    // LMCache restarts with its index rejected: seq 1 goes to container 0, over seq 5.
    r.restart_lmcache(false);
    r.lmc.deleted.push(keys[0].clone());
    assert!(r.start_put(keys[0].clone(), BA - 100)); // the same key into slot 0 (bump)
    assert_eq!(r.lmc.puts[0].slot, s0);
    r.put_header(0); // ... and it dies before the payload
    let k = r.new_key(false);
    r.put(k);
    r.checkpoint(); // seq 1 -> container 0
    r.step();
    // The next LMCache finds no seq 4: it loads seq 1, which does not list the key.
    r.restart_lmcache(true);
    assert_eq!(r.lmc.seq, 1);
    assert!(r.lmc.index.iter().all(|e| e.0 != keys[0]));
    r.verify_all();
}

/// Early evictions take the newest checkpoint and its predecessor of one LMCache as their
/// basis: a pair that names two device paths (two LMCache processes, the later of which
/// rejected the other's index) deallocates nothing early; the two-container rule still holds.
#[test]
fn early_evictions_need_both_checkpoints_from_one_device_path() {
    for other in [false, true] {
        let (mut r, keys) = rig_with_keys(4, 6);
        for _ in 0..4 {
            r.checkpoint_dirty(); // seq 1..4; seq 4 lists every key
            r.step();
        }
        let s0 = r.delete_key(&keys[0]);
        let before = r.early_evictions;
        // Seq 5 lacks slot s0; seq 4 lists it.
        r.checkpoint_edited("\"device_path\":\"/dev/ublkb0\"", other.then_some("\"device_path\":\"/dev/ublkb1\""));
        assert_eq!(r.early_evictions > before, !other, "another device_path: {other}");
        assert_eq!(r.state(s0) == SlotState::Trimmed, !other, "another device_path: {other}: {:?}", r.state(s0));
        // The two-container rule still holds: once neither copy lists it, it goes.
        r.checkpoint_dirty();
        r.step();
        assert_eq!(r.state(s0), SlotState::Trimmed, "another device_path: {other}");
        r.verify_all();
    }
}

#[test]
fn early_evictions_wait_for_the_checkpoint_written_last_to_hold_the_higher_seq() {
    // The first fdpblk deallocates by the two-container rule only.
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.fillers(4);
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    let a = r.delete_key(&keys[0]);
    r.checkpoint(); // seq 4 lacks slot a; seq 3 lists it
    r.step();
    assert_eq!(r.state(a), SlotState::Evicted);
    let before = r.trims;
    // fdpblk restarts with early evictions: it has not seen which container LMCache wrote
    // last (seq order is not write order after an LMCache seq restart), so slot a waits.
    r.cfg.early_evictions = true;
    r.restart_fdpblk(true);
    r.step();
    assert_eq!(r.trims, before, "the newest container's writer is unknown: slot {a} waits");
    assert_eq!(r.state(a), SlotState::Evicted);
    // A checkpoint written since: seq 5 is the newest and lacks both slot a and the filler
    // deleted for it; the filler goes early (seq 4 still lists it), slot a by either rule.
    let f = r.filler.pop().unwrap();
    let fs = r.delete_key(&f);
    r.checkpoint();
    r.step();
    assert_eq!((r.state(a), r.state(fs)), (SlotState::Trimmed, SlotState::Trimmed));
    assert_eq!(r.early_evictions, 1);
    r.verify_all();
}

#[test]
fn a_put_in_flight_across_snapshots_is_never_trimmed() {
    let mut r = Rig::new(SLOTS, META, true);
    let k0 = r.new_key(false);
    r.put(k0.clone());
    r.fillers(1);
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    // Delete k0; a new put takes its slot (LIFO), writes it, and does not commit for a while.
    let s0 = r.delete_key(&k0);
    let k1 = r.new_key(false);
    assert!(r.start_put(k1.clone(), 300));
    assert_eq!(r.lmc.puts[0].slot, s0);
    r.put_payload(0); // io_uring: payload before header
    r.put_header(0);
    for _ in 0..4 {
        // Checkpoints go on without it (each snapshot misses the uncommitted put).
        let k = r.new_key(false);
        r.put(k);
        r.checkpoint();
        r.step();
        assert_eq!(r.trims, 0);
    }
    r.put_commit(0);
    r.checkpoint();
    r.step();
    r.verify_all();
    // The same with a re-put of the same key into the same slot (same identity and length).
    let s = r.delete_key(&k1);
    assert!(r.start_put(k1.clone(), 300));
    assert_eq!(r.lmc.puts[0].slot, s);
    r.put_header(0);
    r.put_payload(0);
    for _ in 0..3 {
        let k = r.new_key(false);
        r.put(k);
        r.checkpoint();
        r.step();
    }
    r.put_commit(0);
    r.checkpoint();
    r.step();
    r.verify_all();
    assert_eq!(r.trims, 0);
}

#[test]
fn a_same_key_reput_written_during_a_checkpoint_is_not_confirmed_by_it() {
    // Checkpoint K's snapshot lists key k in slot s; then k is deleted and put again (LIFO:
    // slot s, same identity and length) and its writes land before K's header. K lists
    // (s, k) but that entry is the old contents: the new put is not committed. The epoch rule
    // (written before K-1's header) keeps it from being confirmed; two more checkpoints
    // without it must not deallocate the slot while the put is still in flight.
    let mut r = Rig::new(SLOTS, META, true);
    let k = r.new_key(false);
    let s = r.put(k.clone()).unwrap();
    r.fillers(8);
    for _ in 0..2 {
        r.checkpoint_dirty();
        r.step();
    }
    assert!(r.slots.get(s).unwrap().confirmed);
    let f = r.filler.pop().unwrap();
    r.delete_key(&f);
    assert!(r.snapshot()); // lists k in s
    r.delete_key(&k);
    assert!(r.start_put(k.clone(), BA - 100));
    assert_eq!(r.lmc.puts[0].slot, s);
    r.put_header(0);
    r.put_payload(0);
    r.ckpt_payload();
    r.ckpt_header();
    r.step();
    assert!(!r.slots.get(s).unwrap().confirmed, "the old entry must not confirm the new contents");
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.state(s), SlotState::Unknown);
    r.put_commit(0);
    r.checkpoint_dirty();
    r.step();
    r.verify_all();
}

/// Six keys confirmed by two checkpoints; the first deleted and a third checkpoint
/// snapshotted, not written yet.
fn rig_snapshotting_after_two_checkpoints() -> Rig {
    let (mut r, keys) = rig_with_keys(6, 3);
    for _ in 0..2 {
        r.checkpoint();
        r.step();
    }
    r.delete_key(&keys[0]);
    assert!(r.snapshot());
    r
}

/// LMCache stopped between a checkpoint's header and its payload (io_uring writes both at
/// once): the header vouches for bytes that never come. Each read of such a payload may be
/// 64 MiB, so it is read again only after a write to it, not at every retry; and a write
/// planned before a read that lands after it still brings the read that finds it.
#[test]
fn a_payload_that_never_comes_is_read_again_only_after_a_write_to_it() {
    let mut r = rig_snapshotting_after_two_checkpoints();
    let c = r.lmc.ckpt.clone().unwrap();
    let copy = Geometry::copy_for_seq(c.seq);
    let payload = r.g.container_offset(copy) + BA;
    r.dev.count_reads(Some(payload..payload + r.g.container_bytes));
    r.ckpt_header();
    r.step();
    let first = r.dev.counted_reads();
    assert!(first > 0, "the announced checkpoint is read once");
    assert!(r.w.next_wakeup() >= Duration::from_secs(1), "nothing to do at once: the state thread must not spin");
    for _ in 0..50 {
        r.step();
    }
    assert_eq!(r.dev.counted_reads(), first, "no write to the payload, no read of it");
    // Unless a write went unseen: looked at again after PAYLOAD_RECHECK.
    for p in r.w.pending.iter_mut() {
        p.read_at -= PAYLOAD_RECHECK;
    }
    r.step();
    assert_eq!(r.dev.counted_reads(), 2 * first, "read again after PAYLOAD_RECHECK");
    assert!(!r.w.trims_allowed(), "nothing is deallocated while the newest checkpoint is unknown");

    // The payload's write is planned (a queue classified it), the state thread reads before
    // it lands, and it lands: the read that finds it must still come.
    let mut b = c.json.clone();
    b.resize(b.len().div_ceil(BA as usize) * BA as usize, 0);
    let mut segs = Vec::new();
    let req = Request { op: Op::Write, offset: payload, len: b.len() as u64, data: Some(&b) };
    let _ = r.pipe.plan(&req, &mut segs, crate::pipeline::HeaderWait::Expired);
    r.step();
    assert!(!r.w.pending.is_empty(), "the payload has not landed");
    r.dev.poke(payload, &b);
    r.pipe.completed();
    r.step();
    assert!(r.w.pending.is_empty(), "the landed payload was read");
    r.ckpt_done(|c| c.pay = true);
    r.dev.count_reads(None);
    r.checkpoint_dirty();
    r.step();
    assert!(r.w.trims_allowed());
    assert!(r.trims > 0, "the deleted key's slot went");
    r.verify_all();
}

#[test]
fn early_tails_wait_for_the_header_write_to_complete_and_a_flush() {
    let mut r = Rig::new(SLOTS, META, true);
    // Early tails start once LMCache checkpointed through fdpblk with its geometry.
    r.checkpoint();
    r.step();
    // Fresh slots: what they held before fdpblk is not known, so their tails go too, once a
    // checkpoint written after the puts was read back (one LMCache snapshotted before them
    // could list the slots' earlier keys).
    r.fillers(10);
    r.step();
    assert_eq!(r.tails, 0);
    r.checkpoint();
    r.step();
    assert_eq!((r.tails, r.w.early_tail_trims()), (10, 10));
    let a = r.new_key(false);
    assert!(r.put_sized(a.clone(), 3 * BA - 10).is_some()); // fills the slot: no tail
    r.step();
    assert_eq!(r.tails, 10);
    let s = r.delete_key(&a);
    // LMCache reuses the slot for a short payload: the old payload's last blocks are stale.
    let b = r.new_key(false);
    assert!(r.start_put(b.clone(), 100));
    assert_eq!(r.lmc.puts[0].slot, s);
    // The header write is planned and its bytes are on the device, but the queue has not
    // seen it complete.
    let h = SlotHeader { identity: keys::identity(&b).unwrap(), payload_len: 100 }.encode(BA as usize);
    let off = r.g.slot_offset(s);
    let mut segs = Vec::new();
    let req = Request { op: Op::Write, offset: off, len: BA, data: Some(&h) };
    r.pipe.plan(&req, &mut segs, crate::pipeline::HeaderWait::Expired).unwrap();
    r.dev.poke(off, &h);
    r.volatile.insert(s);
    r.lmc.puts[0].hdr = true;
    r.step();
    assert_eq!(r.tails, 10, "not before the header write completed");
    r.pipe.completed();
    r.step();
    assert_eq!(r.tails, 10, "not before a checkpoint written after the put");
    r.checkpoint();
    r.step();
    assert_eq!((r.tails, r.w.early_tail_trims()), (11, 11), "after its completion, a checkpoint and a flush, before any confirmation");
    assert!(r.dev.peek(off + 2 * BA, 2 * BA as usize).iter().all(|&x| x == 0));
    // The payload keeps the tail deallocated; the confirmation does not deallocate it again.
    r.put_payload(0);
    r.put_commit(0);
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert!(r.slots.get(s).unwrap().confirmed);
    assert_eq!(r.tails, 11);
    r.verify_all();
    // A write into the tail (past the payload) is bytes no header expected: perhaps a later
    // put's payload ahead of its header. Confirmations do not take it.
    r.write(off + 3 * BA, &vec![7u8; BA as usize]);
    assert!(r.slots.is_orphan(s));
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!((r.tails, r.w.early_tail_trims()), (11, 11));
    assert!(r.dev.peek(off + 3 * BA, BA as usize).iter().all(|&x| x == 7));
    r.verify_all();
    // A short put after a whole-slot deallocation has nothing stale behind it.
    let c = r.lmc.index.iter().find(|e| e.1 != s).unwrap().0.clone();
    let t = r.delete_key(&c);
    for _ in 0..2 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.state(t), SlotState::Trimmed);
    r.lmc.free.retain(|&x| x != t);
    r.lmc.free.push(t); // LMCache's next put takes slot t
    let d = r.new_key(false);
    assert_eq!(r.put(d), Some(t));
    r.step();
    assert_eq!((r.tails, r.w.early_tail_trims()), (11, 11));
    r.verify_all();
}

/// K1 (long) put into slot s; `between` runs (a checkpoint, a snapshot); then LMCache deletes
/// K1 and puts K2 (short) into s, and K2's header is durable and completed, its payload not
/// yet. Returns the rig, s's offset and K1's bytes past K2's payload.
fn long_key_then_short_header(early_evictions: bool, between: impl FnOnce(&mut Rig)) -> (Rig, u64, Vec<u8>) {
    let mut r = Rig::new(SLOTS, META, true);
    if !early_evictions {
        r = r.without_early_evictions();
    }
    r.checkpoint();
    r.step();
    r.fillers(4);
    let k1 = r.new_key(false);
    let long = 3 * BA - 10;
    let s = r.put_sized(k1.clone(), long).unwrap();
    between(&mut r);
    r.delete_key(&k1);
    let k2 = r.new_key(false);
    assert!(r.start_put(k2, 100));
    assert_eq!(r.lmc.puts[0].slot, s);
    r.put_header(0);
    for _ in 0..2 {
        r.step();
    }
    let off = r.g.slot_offset(s);
    (r, off, payload(&k1, 0, long)[BA as usize..].to_vec())
}

/// Slot s holds K1 (long). LMCache snapshots a checkpoint listing K1, then deletes K1 and
/// puts K2 (short) into s before it writes that checkpoint; the next one lists K2 and
/// confirms it. The confirmed path must not take K2's tail while the older container still
/// lists K1 there: after a LMCache restarted with its index rejected writes seq 1 over the
/// newer container, a later LMCache loads the older one, and K1 put into s again, its
/// payload past K2's lost in a crash, would pass the header check over deallocated bytes.
#[test]
fn a_confirmed_tail_waits_while_the_older_container_lists_a_longer_payload() {
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions().without_early_tails();
    r.checkpoint();
    r.step();
    r.fillers(4);
    let k1 = r.new_key(false);
    let long = 3 * BA - 10;
    let s = r.put_sized(k1.clone(), long).unwrap();
    assert!(r.snapshot()); // lists K1 in s
    r.delete_key(&k1);
    let k2 = r.new_key(false);
    assert_eq!(r.put_sized(k2, 100), Some(s));
    r.ckpt_payload();
    r.ckpt_header();
    r.step();
    r.checkpoint_dirty(); // lists K2 and confirms it; the older container lists K1
    for _ in 0..2 {
        r.step();
    }
    assert!(r.slots.get(s).unwrap().confirmed);
    let off = r.g.slot_offset(s);
    let k1_tail = payload(&k1, 0, long)[BA as usize..].to_vec();
    assert!(r.dev.peek(off + 2 * BA, k1_tail.len()) == k1_tail, "K1's bytes past K2's payload, while the older container lists K1 there");
    // Meanwhile the sweeps (at least every 10 s) do not flush for a tail that must wait.
    let flushes = r.flushes;
    for _ in 0..3 {
        r.w.summary_at = Instant::now() - Duration::from_secs(11);
        r.step();
    }
    assert_eq!(r.flushes, flushes, "no flush for a tail a container lists longer");
    // The next checkpoint overwrites the older container: the tail goes.
    let tails = r.w.tail_trims();
    r.checkpoint_dirty();
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.w.tail_trims(), tails + 1, "the tail waited, and then went");
    assert!(r.dev.peek(off + 2 * BA, k1_tail.len()).iter().all(|&b| b == 0));
    r.verify_all();
}

/// Slot s holds K1 (long), listed by a checkpoint. LMCache deletes K1 and puts K2 (short)
/// into s; K2's header is durable, its payload not yet. Were K2's early tail to go now, K1's
/// later bytes would be gone while a checkpoint LMCache may load still lists K1 in s: the
/// same key put into s again, its header landing and its payload lost in a crash, would
/// pass LMCache's header check over the deallocated bytes. The tail waits until no loadable
/// checkpoint lists a longer payload there.
#[test]
fn an_early_tail_waits_while_a_checkpoint_lists_a_longer_payload_in_the_slot() {
    let (mut r, off, k1_tail) = long_key_then_short_header(false, |r| {
        r.checkpoint_dirty(); // lists K1 in s
        r.step();
    });
    // A checkpoint after K2's put lacks K1; the older container still lists it.
    r.checkpoint_dirty();
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.dev.peek(off + 2 * BA, k1_tail.len()), k1_tail, "K1's bytes past K2's payload, while a checkpoint lists K1 there");
    // The next one overwrites the older container: nothing loadable lists K1 there now.
    let early = r.w.early_tail_trims();
    r.checkpoint_dirty();
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.w.early_tail_trims(), early + 1, "the tail waited, and then went");
    assert!(r.dev.peek(off + 2 * BA, k1_tail.len()).iter().all(|&b| b == 0));
    r.put_payload(0);
    r.put_commit(0);
    r.verify_all();
}

/// Container 1 was zeroed (an early eviction) and LMCache wrote seq 4 there, its header held
/// back by writeback: once that header lands, seq 4 is loadable and lists K1 (long) in slot
/// s. K2 (short) takes s and seq 5 (container 0) lists it: K2's tail must wait for seq 4's
/// header and then for a checkpoint over it, as a container that lists K1 would make it.
#[test]
fn an_early_tail_waits_while_a_zeroed_container_awaits_its_header() {
    let (mut r, _) = rig_with_keys(6, 4);
    let k1 = r.new_key(false);
    let long = 3 * BA - 10;
    let s = r.put_sized(k1.clone(), long).unwrap();
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.invalidated, 1, "container 1 (seq 2) zeroed for seq 3 when a filler went");
    let late = checkpoint_with_late_header(&mut r); // seq 4 lists K1 in s
    r.step();
    r.delete_key(&k1);
    let k2 = r.new_key(false);
    assert!(r.start_put(k2, 100));
    assert_eq!(r.lmc.puts[0].slot, s);
    r.put_header(0);
    r.put_payload(0);
    r.put_commit(0);
    let off = r.g.slot_offset(s);
    let k1_tail = payload(&k1, 0, long)[BA as usize..].to_vec();
    r.checkpoint(); // seq 5 -> container 0, listing K2 in s
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.dev.peek(off + 2 * BA, k1_tail.len()), k1_tail, "seq 4's header may still come, listing K1 in s");
    r.write(r.g.container_offset(Geometry::copy_for_seq(4)), &late);
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.dev.peek(off + 2 * BA, k1_tail.len()), k1_tail, "seq 4 lists K1 in s");
    r.checkpoint_dirty(); // seq 6 -> container 1, over seq 4
    for _ in 0..2 {
        r.step();
    }
    assert!(r.dev.peek(off + 2 * BA, k1_tail.len()).iter().all(|&b| b == 0), "the tail waited, and then went");
    r.verify_all();
}

/// The same with early evictions on: once a checkpoint after K2's put (seq n) lacks K1 and
/// only the older container (n - 1) lists it, the round zeroes that container, as an early
/// eviction does, and the tail goes a checkpoint sooner. No slot is an early eviction here
/// (the checkpoint frees none), so the tail alone makes the zeroing.
#[test]
fn an_early_tail_listed_longer_only_by_the_older_container_goes_once_the_round_zeroes_it() {
    let (mut r, off, k1_tail) = long_key_then_short_header(true, |r| {
        r.checkpoint_dirty(); // lists K1 in s
        r.step();
    });
    let (early, zeroed) = (r.w.early_tail_trims(), r.w.containers_invalidated());
    r.checkpoint(); // K1's deletion made the index dirty; K2 is not committed yet
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.w.containers_invalidated(), zeroed + 1, "the older container, which lists K1, was zeroed");
    assert_eq!(r.w.early_evictions(), 0, "for the tail, not for an early eviction");
    assert_eq!(r.w.early_tail_trims(), early + 1, "the tail went after one checkpoint");
    let s = r.g.slot_of(off).unwrap().0;
    let at = |op: (char, u64)| r.order.iter().position(|&o| o == op);
    let older = Geometry::copy_for_seq(r.lmc.seq - 1);
    assert!(at(('z', u64::from(older))) < at(('t', s)) && at(('t', s)).is_some(), "the container first, then the tail: {:?}", r.order);
    assert!(r.dev.peek(off + 2 * BA, k1_tail.len()).iter().all(|&b| b == 0));
    r.put_payload(0);
    r.put_commit(0);
    r.verify_all();
    // A LMCache restart loads the newest checkpoint, which lists neither K1 nor K2 there.
    r.restart_lmcache(true);
}

/// The same, with the checkpoint that lists K1 still on its way when K2's header completes:
/// LMCache snapshots before it writes, so a checkpoint written after the put may list the
/// slot's previous key. The tail waits until one written after the put was read back.
#[test]
fn an_early_tail_waits_for_a_checkpoint_written_after_the_put() {
    let (mut r, off, k1_tail) = long_key_then_short_header(false, |r| assert!(r.snapshot())); // lists K1; written below
    assert_eq!(r.dev.peek(off + 2 * BA, k1_tail.len()), k1_tail, "no checkpoint since K2's put was read back");
    r.ckpt_payload();
    r.ckpt_header();
    for _ in 0..2 {
        r.step();
    }
    assert_eq!(r.dev.peek(off + 2 * BA, k1_tail.len()), k1_tail, "that checkpoint lists K1 in the slot");
    r.put_payload(0);
    r.put_commit(0);
    r.verify_all();
}

#[test]
fn an_early_tail_never_takes_the_next_puts_payload_written_ahead_of_its_header() {
    // io_uring: put C's payload reaches the slot before C's header, while the slot's current
    // header is B's, completed and queued for its early tail. C's payload reaches past B's.
    let mut r = Rig::new(SLOTS, META, true);
    r.checkpoint();
    r.step();
    // Keys for later checkpoints (their fresh slots' tails go first).
    r.fillers(4);
    let b = r.new_key(false);
    assert!(r.put_sized(b.clone(), 100).is_some());
    r.step();
    r.checkpoint();
    r.step();
    let base = r.tails;
    let s = r.delete_key(&b);
    let c = r.new_key(false);
    assert!(r.start_put(c.clone(), BA + 5));
    assert_eq!(r.lmc.puts[0].slot, s);
    r.put_payload(0);
    r.step();
    assert_eq!(r.tails, base, "B's tail now holds C's payload");
    r.put_header(0);
    r.put_commit(0);
    r.step();
    // The bytes that came before C's header lie within C's payload: C's own, settled by it.
    assert!(!r.slots.is_orphan(s));
    r.checkpoint();
    r.step();
    assert_eq!(r.tails, base + 1, "C's own tail, after its header completed and a checkpoint");
    r.verify_all();
}

#[test]
fn an_older_short_header_written_back_after_a_later_puts_payload_cuts_nothing() {
    // Buffered writeback: LMCache puts B (short) into slot s, deletes it and puts C (long)
    // into s. C's payload pages reach fdpblk first, B's header page after them, and it
    // completes: B's tail is where C's payload is, and C's header is still to come.
    let mut r = Rig::new(SLOTS, META, true);
    r.checkpoint();
    r.step();
    r.fillers(2);
    let (s, hb, c_payload) = r.short_put_held_back_then_long_payload();
    r.old_header_written_back_cuts_nothing(s, &hb, &c_payload);
}

#[test]
fn a_checkpoint_written_with_no_event_is_seen_by_a_reread() {
    // A layout learned while serving: LMCache's checkpoint reached the drive before the queues
    // classified writes (here: straight onto the device), after the watcher read the containers.
    let mut r = rig_snapshotting_a_checkpoint();
    let c = r.lmc.ckpt.clone().unwrap();
    let copy = Geometry::copy_for_seq(c.seq);
    let at = r.g.container_offset(copy);
    let mut b = c.json.clone();
    b.resize(b.len().div_ceil(BA as usize) * BA as usize, 0);
    r.dev.poke(at + BA, &b);
    r.dev.poke(at, &CheckpointHeader::encode_for(c.seq, &c.json, BA as usize));
    r.step();
    let seq_of = |r: &Rig| r.w.published_json()["containers"][usize::from(copy)]["seq"].clone();
    assert_ne!(seq_of(&r), c.seq, "no event, no read");
    r.w.reread_containers();
    r.step();
    assert_eq!(seq_of(&r), c.seq);
    assert_eq!(r.w.published_json()["checkpoint_seq"], c.seq, "the baseline follows");
}

/// A rig past its first checkpoint, with one more put, whose next checkpoint LMCache has
/// snapshotted (`lmc.ckpt`) but not written.
fn rig_snapshotting_a_checkpoint() -> Rig {
    let mut r = Rig::new(SLOTS, META, true);
    r.checkpoint();
    r.step();
    let k = r.new_key(false);
    r.put(k).unwrap();
    assert!(r.snapshot());
    r
}

/// Checkpoint n goes out only in part (`first`: its header or its payload), then n + 1
/// whole and read back; the rest of n is left to the test (returned). Also checks that
/// n + 1 is the newest so far, and gives the published stats' `checkpoint_seq`.
fn checkpoint_left_behind(first: fn(&mut Rig)) -> (Rig, Ckpt) {
    left_behind(rig_snapshotting_a_checkpoint(), first)
}

/// [`checkpoint_left_behind`] from `r`, which has taken checkpoint n's snapshot.
fn left_behind(mut r: Rig, first: fn(&mut Rig)) -> (Rig, Ckpt) {
    first(&mut r);
    r.step();
    let late = r.lmc.ckpt.take().unwrap();
    r.lmc.seq = late.seq;
    let k = r.new_key(false);
    r.put(k).unwrap();
    r.checkpoint();
    r.step();
    assert_eq!(published_seq(&r), late.seq + 1);
    (r, late)
}

fn published_seq(r: &Rig) -> serde_json::Value {
    r.w.published_json()["checkpoint_seq"].clone()
}

#[test]
fn a_late_read_back_of_an_older_checkpoint_does_not_become_the_newest() {
    // io_uring order under load: checkpoint n's header reaches fdpblk, its payload lands only
    // after checkpoint n + 1 was written and read back whole.
    let (mut r, late) = checkpoint_left_behind(Rig::ckpt_header);
    let mut b = late.json.clone();
    b.resize(b.len().div_ceil(BA as usize) * BA as usize, 0);
    let copy = Geometry::copy_for_seq(late.seq);
    r.write(r.g.container_offset(copy) + BA, &b);
    r.step();
    assert_eq!(r.w.published_json()["containers"][usize::from(copy)]["seq"], late.seq, "read back");
    assert_eq!(published_seq(&r), late.seq + 1, "the newest stays the newest");
}

#[test]
fn the_first_checkpoint_header_written_back_after_the_second_stays_older() {
    // Writeback out of offset order: checkpoint 2's header (container 1) reaches the drive
    // before checkpoint 1's (container 0). Seq 1 on its own reads as a new index.
    let mut r = Rig::new(SLOTS, META, true);
    let k = r.new_key(false);
    r.put(k).unwrap();
    assert!(r.snapshot());
    let (mut r, late) = left_behind(r, Rig::ckpt_payload);
    assert_eq!(late.seq, 1);
    r.write(r.g.container_offset(0), &CheckpointHeader::encode_for(1, &late.json, BA as usize));
    r.step();
    assert_eq!(r.w.published_json()["containers"][0]["seq"], 1, "read back");
    assert_eq!(published_seq(&r), 2, "seq 1 came last but is older");
}

#[test]
fn an_older_checkpoint_header_written_back_after_a_newer_one_stays_older() {
    // Buffered writeback goes in offset order: checkpoint n + 1 in container 0 reaches the
    // drive before n's header in container 1.
    let (mut r, late) = checkpoint_left_behind(Rig::ckpt_payload);
    let copy = Geometry::copy_for_seq(late.seq);
    r.write(r.g.container_offset(copy), &CheckpointHeader::encode_for(late.seq, &late.json, BA as usize));
    r.step();
    assert_eq!(r.w.published_json()["containers"][usize::from(copy)]["seq"], late.seq);
    assert_eq!(published_seq(&r), late.seq + 1, "seq n came last but is older");
}

/// Buffered writeback holds checkpoint headers back past two later snapshots: a late older
/// checkpoint lists a key that was deleted and put again into the same slot since (LIFO,
/// same header). Its read-back must not confirm that slot: the newest checkpoint, snapshotted
/// before the put, lacks it, and a confirmed slot the newest checkpoint lacks is trimmed.
#[test]
fn a_late_older_checkpoint_confirms_nothing() {
    let mut r = Rig::new(SLOTS, META, true);
    r.checkpoint();
    r.step();
    r.fillers(2);
    let y = r.new_key(false);
    let s = r.put(y.clone()).unwrap();
    let mut held = Vec::new();
    // Snapshot K lists y; K + 1 after y's delete does not; K + 2 is taken before y comes
    // back. Only their payloads reach the drive for now (K + 2's not even that).
    for delete in [false, true, false] {
        if delete {
            r.delete_key(&y);
        }
        assert!(r.snapshot());
        let c = r.lmc.ckpt.take().unwrap();
        if held.len() < 2 {
            r.lmc.ckpt = Some(c.clone());
            r.ckpt_payload();
            r.lmc.ckpt = None;
        }
        r.lmc.seq = c.seq;
        held.push(c);
    }
    assert_eq!(r.put(y.clone()), Some(s), "LIFO: y comes back into its old slot");
    // Writeback: K + 1's header, then K's, then K + 2 whole.
    for c in [&held[1], &held[0]] {
        r.write(r.g.container_offset(Geometry::copy_for_seq(c.seq)), &CheckpointHeader::encode_for(c.seq, &c.json, BA as usize));
    }
    r.step();
    r.step();
    r.lmc.ckpt = Some(held[2].clone());
    r.ckpt_payload();
    r.ckpt_header();
    for _ in 0..3 {
        r.step(); // the oracle fails the test if y's slot goes
    }
    assert_ne!(r.state(s), SlotState::Trimmed);
}

#[test]
fn stats_show_a_checkpoint_read_back_waiting_for_its_payload() {
    // io_uring order: the header reaches fdpblk before the payload.
    let mut r = rig_snapshotting_a_checkpoint();
    let copy = Geometry::copy_for_seq(r.lmc.seq + 1);
    r.ckpt_header();
    r.step();
    let v = r.w.published_json();
    let c = &v["containers"][usize::from(copy)];
    assert_eq!(c["state"], "unknown");
    assert_eq!(c["reading"]["seq"], r.lmc.seq + 1);
    assert_eq!(v["checkpoint_seq"], r.lmc.seq);
    r.ckpt_payload();
    r.step();
    let v = r.w.published_json();
    assert_eq!(v["checkpoint_seq"], r.lmc.seq);
    assert!(v["containers"][usize::from(copy)].get("reading").is_none());
}

/// The orphan case above across a daemon crash and recovery: C's payload reached the
/// earlier daemon, whose orphan mark died with it; B's old header reaches the recovered one.
/// The oracle (`check_trims`) fails the test if B's tail goes.
fn orphans_across_a_recovery(marks: bool) {
    let mut r = Rig::new(SLOTS, META, true);
    r.recovery_marks_orphans = marks;
    r.checkpoint();
    r.step();
    r.fillers(3);
    let (s, hb, c_payload) = r.short_put_held_back_then_long_payload();
    r.restart_fdpblk(false);
    // A checkpoint through the recovered daemon: early tails may go from now on.
    r.checkpoint_dirty();
    r.step();
    r.old_header_written_back_cuts_nothing(s, &hb, &c_payload);
}

#[test]
fn unseen_marks_go_once_a_checkpoint_snapshotted_after_the_recovery_confirms_the_slot() {
    let mut r = Rig::new(SLOTS, META, true);
    r.checkpoint();
    r.step();
    r.fillers(4);
    r.restart_fdpblk(false);
    let a = r.new_key(false);
    let s = r.put_sized(a, 100).unwrap();
    for _ in 0..2 {
        r.step();
    }
    let base = r.tails;
    assert!(r.slots.is_orphan(s), "every slot may hold what the dead daemon took");
    assert_eq!(r.w.early_tail_trims(), 0);
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert!(!r.slots.is_orphan(s));
    assert!(r.tails > base, "the partial put's tail goes once a checkpoint confirmed it");
    r.verify_all();
}

#[test]
fn a_recovered_daemon_keeps_a_payload_its_predecessor_took_before_the_header() {
    orphans_across_a_recovery(true);
}

#[test]
#[should_panic(expected = "was deallocated but a put in flight")]
fn without_the_recovery_marks_that_payload_would_be_cut() {
    orphans_across_a_recovery(false);
}

#[test]
fn a_write_past_the_payload_while_the_header_is_in_flight_cancels_the_early_tail() {
    // Buffered writeback: D's header write is still in flight when a write lands past D's
    // payload (pages of a later put into the same slot); D's completion must not let the
    // state thread deallocate what that write brought.
    let mut r = Rig::new(SLOTS, META, true);
    let d = r.new_key(false);
    assert!(r.start_put(d.clone(), 100));
    let s = r.lmc.puts[0].slot;
    let h = SlotHeader { identity: keys::identity(&d).unwrap(), payload_len: 100 }.encode(BA as usize);
    let off = r.g.slot_offset(s);
    let mut segs = Vec::new();
    r.pipe.plan(&Request { op: Op::Write, offset: off, len: BA, data: Some(&h) }, &mut segs, crate::pipeline::HeaderWait::Expired).unwrap();
    let headers = r.pipe.planned_headers().to_vec();
    r.dev.poke(off, &h);
    r.write(off + 2 * BA, &vec![9u8; BA as usize]);
    for (slot, generation) in headers {
        r.slots.header_completed(slot, generation);
    }
    r.step();
    assert_eq!(r.tails, 0);
    assert_eq!(r.dev.peek(off + 2 * BA, 4), vec![9u8; 4]);
}

impl Rig {
    /// Buffered writeback's reordering: LMCache puts A (long) into slot s and deletes it, puts
    /// B (short) whose header stays in the page cache, deletes B and puts C (long) into s,
    /// whose payload reaches fdpblk. Returns s, B's header block (still to be written back)
    /// and C's payload blocks as on the drive; C's header is `puts[0]`'s, still to come.
    fn short_put_held_back_then_long_payload(&mut self) -> (u64, Vec<u8>, Vec<u8>) {
        let a = self.new_key(false);
        assert!(self.put_sized(a.clone(), 3 * BA - 10).is_some());
        self.step();
        let s = self.delete_key(&a);
        let b = self.new_key(false);
        assert!(self.start_put(b.clone(), 100));
        assert_eq!(self.lmc.puts[0].slot, s);
        let hb = SlotHeader { identity: keys::identity(&b).unwrap(), payload_len: 100 }.encode(BA as usize);
        self.lmc.puts[0].hdr = true; // in the page cache, not yet written back
        self.put_payload(0);
        self.put_commit(0);
        self.delete_key(&b);
        let c = self.new_key(false);
        assert!(self.start_put(c, 3 * BA - 10));
        assert_eq!(self.lmc.puts[0].slot, s);
        self.put_payload(0);
        let c_payload = self.dev.peek(self.g.slot_offset(s) + BA, 3 * BA as usize);
        (s, hb, c_payload)
    }

    /// The rest of [`Self::short_put_held_back_then_long_payload`]: B's header is written back
    /// and completes; fdpblk must deallocate none of C's payload. Then C's header comes and
    /// every entry verifies.
    fn old_header_written_back_cuts_nothing(&mut self, s: u64, hb: &[u8], c_payload: &[u8]) {
        let base = self.tails;
        let off = self.g.slot_offset(s);
        self.write(off, hb);
        self.volatile.insert(s);
        // A checkpoint written after B's header and read back: from then on B's early tail
        // would go but for what keeps it.
        self.checkpoint_dirty();
        for _ in 0..2 {
            self.step();
        }
        // (Other slots' tails may go here, the fillers' among them.)
        assert!(self.tails >= base);
        assert_eq!(self.dev.peek(off + BA, 3 * BA as usize), c_payload, "B's tail holds C's payload");
        self.put_header(0);
        self.put_commit(0);
        self.step();
        self.verify_all();
    }

    /// Puts `n` keys whose later deletion makes LMCache's index dirty without freeing a slot
    /// that a test watches (LMCache writes a checkpoint only when something changed).
    fn fillers(&mut self, n: usize) {
        for _ in 0..n {
            let k = self.new_key(false);
            self.put(k.clone()).unwrap();
            self.filler.push(k);
        }
    }

    /// A checkpoint after a change: deletes a filler (no put, so no freed slot is reused).
    /// Checkpoints 1 and 2 (the second confirms what the first listed), then `keys[0]`
    /// deleted and checkpoint 3, which lacks its slot while checkpoint 2 still lists it.
    /// Returns that slot.
    fn evict_first_behind_two_checkpoints(&mut self, keys: &[String]) -> u64 {
        self.checkpoint();
        self.step();
        self.checkpoint_dirty();
        self.step();
        let a = self.delete_key(&keys[0]);
        self.checkpoint();
        self.step();
        a
    }

    /// `n` new keys put, and two checkpoints (the second drops a filler) that confirm them.
    fn confirmed_keys(&mut self, n: usize) -> Vec<String> {
        let keys: Vec<String> = (0..n).map(|_| self.new_key(false)).collect();
        for k in &keys {
            self.put(k.clone()).unwrap();
        }
        self.fillers(3);
        self.checkpoint();
        self.step();
        self.checkpoint_dirty();
        self.step();
        keys
    }

    fn checkpoint_dirty(&mut self) {
        let k = self.filler.pop().expect("a filler key");
        self.delete_key(&k);
        self.checkpoint();
    }

    /// `checkpoint_dirty` with `from` in the checkpoint's JSON (it must be there) replaced by
    /// `to` (`None`: as LMCache wrote it), then a step.
    fn checkpoint_edited(&mut self, from: &str, to: Option<&str>) {
        let k = self.filler.pop().expect("a filler key");
        self.delete_key(&k);
        assert!(self.snapshot());
        let c = self.lmc.ckpt.as_mut().unwrap();
        let json = String::from_utf8(c.json.clone()).unwrap();
        assert!(json.contains(from), "{from} in {json}");
        if let Some(to) = to {
            c.json = json.replace(from, to).into_bytes();
        }
        self.ckpt_payload();
        self.ckpt_header();
        self.step();
    }
}

#[test]
fn a_checkpoint_header_before_its_payload_is_read_back_when_complete() {
    let mut r = rig_snapshotting_after_an_eviction();
    // io_uring: the header lands first; the payload is still on its way.
    r.ckpt_header();
    r.step();
    assert!(!r.w.trims_allowed(), "a header whose payload is incomplete blocks deallocation");
    assert_eq!(r.trims, 0);
    r.ckpt_payload();
    r.step();
    assert_eq!(r.trims, 1);
    assert!(r.w.trims_allowed());
}

/// A key confirmed and deleted, a checkpoint lacking it read back, a filler deleted, and
/// LMCache's snapshot of the next checkpoint taken (not written): that checkpoint's read-back
/// deallocates the key's slot (two-container rule alone).
fn rig_snapshotting_after_an_eviction() -> Rig {
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    let k = r.new_key(false);
    r.put(k.clone());
    r.fillers(3);
    r.checkpoint_dirty();
    r.step();
    r.checkpoint_dirty();
    r.step();
    r.delete_key(&k);
    r.checkpoint();
    r.step();
    let f = r.filler.pop().unwrap();
    r.delete_key(&f);
    assert!(r.snapshot());
    r
}

/// A read can return a write's bytes before the write completed, and a flush covers only
/// completed commands: a checkpoint whose header is on the device but whose write has not
/// ended is not read back, and nothing goes on its word, until the write ends.
#[test]
fn a_checkpoint_is_read_back_only_once_its_header_write_ended() {
    let mut r = rig_snapshotting_after_an_eviction();
    r.ckpt_payload();
    // The header's write is planned (a queue classified it) and its bytes read back already,
    // but the queue has not seen it end.
    let c = r.lmc.ckpt.clone().unwrap();
    let copy = Geometry::copy_for_seq(c.seq);
    let h = CheckpointHeader::encode_for(c.seq, &c.json, BA as usize);
    let off = r.g.container_offset(copy);
    let mut segs = Vec::new();
    r.pipe.plan(&Request { op: Op::Write, offset: off, len: BA, data: Some(&h) }, &mut segs, crate::pipeline::HeaderWait::Expired).unwrap();
    assert_eq!(r.pipe.planned_containers().header_blocks[usize::from(copy)], 1);
    r.dev.poke(off, &h);
    r.volatile_containers.insert(copy);
    r.ckpt_done(|c| c.hdr = true);
    for _ in 0..3 {
        r.step();
    }
    assert_eq!(r.w.pending.len(), 1, "not read back before its write ended");
    assert!(!r.w.trims_allowed(), "nothing goes while a header write is in flight");
    assert_eq!(r.trims, 0);
    assert!(r.w.next_wakeup() <= Duration::from_millis(200), "looked at again soon");
    r.pipe.completed();
    r.step();
    assert!(r.w.pending.is_empty(), "read back once it ended");
    assert_eq!(r.trims, 1, "the deleted key's slot goes then");
    assert!(r.w.trims_allowed());
}

#[test]
fn lmcache_restart_with_seq_restart_keeps_the_stale_copy_protected() {
    // The two-container rule alone (with early evictions the older copy is zeroed once a
    // slot only it lists goes: `early_eviction_then_same_key_reput_torn_by_a_crash_after_a_seq_restart`).
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    let old: Vec<String> = (0..8).map(|_| r.new_key(false)).collect();
    for k in &old {
        r.put(k.clone());
    }
    r.fillers(3);
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    // seq 3 is in container 0 and seq 2 in container 1; all confirmed.
    assert_eq!(r.lmc.seq, 3);
    // LMCache restarts and loads nothing (another device_path string): seq restarts at 1 in
    // container 0, slots are handed out from 0 again.
    r.restart_lmcache(false);
    for _ in 0..3 {
        let k = r.new_key(false);
        r.put(k);
    }
    let before = r.trims;
    r.checkpoint(); // seq 1 -> container 0; container 1 still holds seq 2 (higher: stale)
    r.step();
    assert_eq!(r.trims, before, "the stale copy 1 (seq 2) still lists the old slots");
    // A restart now would load the stale copy: LMCache's loader takes the highest seq.
    let mut probe = r.lmc.clone();
    std::mem::swap(&mut probe, &mut r.lmc);
    r.restart_lmcache(true);
    assert_eq!(r.lmc.seq, 2, "the stale copy is what a restart would load");
    std::mem::swap(&mut probe, &mut r.lmc);
    let k = r.new_key(false);
    r.put(k);
    r.checkpoint(); // seq 2 -> container 1: the stale copy is gone
    r.step();
    // Old slots 4.. (not overwritten by the new process's 4 puts) are dead now, but they
    // were confirmed only as the old process's contents: trimmed.
    assert!(r.trims > before);
    r.verify_all();
}

/// LMCache restarted empty (seq back at 1 in container 0) while container 1 still holds the
/// earlier process's higher seq, and then fdpblk restarted: the stale seq is its baseline.
/// LMCache's next checkpoints (seq 2, 3, ...) follow the one in the other container, so they
/// confirm and their evictions go, instead of waiting until the seq passes the stale one.
#[test]
fn a_new_index_is_followed_past_a_stale_higher_seq_found_at_start() {
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    r.fillers(8);
    for _ in 0..8 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.lmc.seq, 8, "seq 7 in container 0, seq 8 in container 1");
    r.restart_lmcache(false);
    let new: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &new {
        r.put(k.clone());
    }
    r.checkpoint(); // seq 1 -> container 0; container 1 keeps the stale seq 8
    r.step();
    r.restart_fdpblk(true);
    // Seq 2 -> container 1 (the stale copy goes), 3 -> container 0: both list the new keys.
    for _ in 0..2 {
        let k = r.new_key(false);
        r.put(k);
        r.checkpoint();
        r.step();
    }
    assert_eq!(r.w.commit.as_ref().map(|c| c.seq), Some(3), "LMCache's seq 3 is the commit, not the stale 8");
    let before = r.trims;
    // Evictions without puts (a put would take the freed slot back first).
    for k in &new[..2] {
        r.delete_key(k);
        r.checkpoint(); // seq 4, then 5: after 5 neither lists the first key's slot
        r.step();
    }
    assert!(r.trims > before, "LMCache's new index confirms and its eviction goes");
    r.verify_all();
}

/// The one case a new index looks like a late header: the earlier process wrote exactly seq
/// 1 and 2 (the commit), and the new one's seq 1 goes over its seq 1. Its seq 2 is then the
/// successor of its seq 1 and is followed.
#[test]
fn a_new_index_over_an_earlier_seq_1_and_2_is_followed_from_its_seq_2() {
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    r.fillers(4);
    for _ in 0..2 {
        r.checkpoint_dirty();
        r.step();
    }
    r.restart_lmcache(false);
    let new: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &new {
        r.put(k.clone());
    }
    r.checkpoint(); // seq 1 -> container 0; container 1 keeps the earlier seq 2
    r.step();
    let commit = |r: &Rig| r.w.commit.as_ref().map(|c| (c.seq, c.epoch)).unwrap();
    let earlier = commit(&r);
    assert_eq!(earlier.0, 2, "taken for the earlier process's late seq 1");
    let k = r.new_key(false);
    r.put(k);
    r.checkpoint(); // seq 2 -> container 1, the successor of the new seq 1
    r.step();
    let now = commit(&r);
    assert_eq!(now.0, 2);
    assert_ne!(now.1, earlier.1, "the new index's seq 2 is the commit");
    r.verify_all();
}

#[test]
fn fdpblk_restart_clean_keeps_pending_trims_unclean_drops_them() {
    for clean in [true, false] {
        let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
        let ks: Vec<String> = (0..5).map(|_| r.new_key(false)).collect();
        for k in &ks {
            r.put(k.clone());
        }
        r.fillers(6);
        r.checkpoint_dirty();
        r.step();
        r.checkpoint_dirty();
        r.step();
        let _ = r.w.persist_now(false, false);
        let s = r.delete_key(&ks[0]);
        r.checkpoint(); // evicted in one container
        r.step();
        let _ = r.w.persist_now(false, false);
        r.restart_fdpblk(clean);
        assert_eq!(r.slots.get(s).unwrap().identity, keys::identity(&ks[0]).unwrap(), "the slot table came back");
        assert_eq!(r.slots.get(s).unwrap().confirmed, clean);
        r.checkpoint_dirty();
        r.step();
        assert_eq!(r.trims, u64::from(clean), "clean: the pending trim happens; unclean: forgotten");
        // Live contents are confirmed again by the second checkpoint after the restart, so
        // later evictions are trimmed either way.
        r.checkpoint_dirty();
        r.step();
        let s1 = r.delete_key(&ks[1]);
        r.checkpoint();
        r.step();
        r.checkpoint_dirty();
        r.step();
        assert_eq!(r.state(s1), SlotState::Trimmed, "clean {clean}");
        r.verify_all();
    }
}

#[test]
fn no_trim_keeps_everything_and_still_tracks_states() {
    let mut r = Rig::new(SLOTS, META, false);
    let k = r.new_key(false);
    let s = r.put(k.clone()).unwrap();
    r.fillers(5);
    for _ in 0..2 {
        r.checkpoint_dirty();
        r.step();
    }
    r.delete_key(&k);
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.trims, 0);
    assert_eq!(r.state(s), SlotState::Evicted);
}

/// A confirmed slot, evicted and missing from the newest checkpoint only: the next checkpoint
/// without it deallocates it (early evictions off). The rig and the slot.
fn rig_with_one_eviction_pending() -> (Rig, u64) {
    let mut r = Rig::new(SLOTS, META, true).without_early_evictions();
    let k = r.new_key(false);
    let s = r.put(k.clone()).unwrap();
    r.fillers(3);
    for _ in 0..2 {
        r.checkpoint_dirty();
        r.step();
    }
    r.delete_key(&k);
    r.checkpoint();
    r.step();
    (r, s)
}

#[test]
fn foreign_write_behind_fdpblk_prevents_the_trim() {
    let (mut r, s) = rig_with_one_eviction_pending();
    // Someone rewrites the slot header directly on the backing device.
    let other = SlotHeader { identity: 12345, payload_len: 600 }.encode(BA as usize);
    r.dev.poke(r.g.slot_offset(s), &other);
    r.checkpoint_dirty();
    r.step();
    assert_eq!(r.trims, 0);
    assert!(!r.slots.get(s).unwrap().confirmed);
}

/// More evicted slots than one round takes, and the first round over them run.
fn rig_after_a_long_eviction_round() -> (Rig, usize) {
    let n = TRIM_PER_ROUND as usize + 300;
    let mut r = Rig::new(n as u64 + 16, 4 << 20, true).without_early_evictions();
    let keys = r.confirmed_keys(n);
    for k in &keys {
        r.delete_key(k);
    }
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    (r, n)
}

#[test]
fn a_long_eviction_round_is_deallocated_over_several_rounds() {
    // More evicted slots than one round takes: the rest follow in the next rounds, so a save or
    // a stop never waits behind the whole eviction.
    let (mut r, n) = rig_after_a_long_eviction_round();
    assert!(r.trims > 0 && r.trims <= TRIM_PER_ROUND, "one round deallocated {}", r.trims);
    assert_eq!(r.w.next_wakeup(), Duration::ZERO, "the next round follows at once");
    for _ in 0..4 {
        r.step();
    }
    assert_eq!(r.trims, n as u64);
    assert!(r.w.next_wakeup() > Duration::ZERO);
}

/// A round whose deallocations are not allowed keeps no backlog flag from the round before:
/// the state thread would otherwise run round after round at once, with nothing to do.
#[test]
fn no_round_follows_at_once_while_deallocation_is_not_allowed() {
    let (mut r, n) = rig_after_a_long_eviction_round();
    assert_eq!(r.w.next_wakeup(), Duration::ZERO, "a backlog: the next round follows at once");
    // Deallocation off (as while LMCache's layout conflicts with fdpblk's).
    r.w.cfg.trim = false;
    r.step();
    assert!(r.w.next_wakeup() > Duration::ZERO, "no round at once while nothing can go");
    r.w.cfg.trim = true;
    r.w.need_sweep = true;
    for _ in 0..4 {
        r.step();
    }
    assert_eq!(r.trims, n as u64, "the backlog goes once deallocation is allowed again");
}

#[test]
fn a_header_that_cannot_be_read_keeps_the_slot_confirmed_and_pauses_deallocation() {
    let (mut r, s) = rig_with_one_eviction_pending();
    // A media error (or a vanished drive) on the slot's header: the read tells nothing about
    // the slot, so its confirmation stays and nothing is deallocated.
    let off = r.g.slot_offset(s);
    r.dev.set_fail_reads(Some(off..off + 4096));
    r.checkpoint_dirty();
    r.step();
    assert_eq!(r.trims, 0);
    assert!(r.slots.get(s).unwrap().confirmed, "a failed read is not a changed header");
    // Paused until the next checkpoint, as the warning says: the rounds meanwhile (a sweep at
    // least every 10 s) neither read the slot again nor flush for it.
    let flushes = r.flushes;
    for _ in 0..3 {
        r.w.summary_at = Instant::now() - Duration::from_secs(11);
        r.step();
    }
    assert_eq!(r.flushes, flushes, "no flush while paused");
    // Readable again: the slot goes at the next checkpoint.
    r.dev.set_fail_reads(None);
    r.checkpoint();
    r.step();
    assert!(r.trims >= 1);
    assert_eq!(r.state(s), SlotState::Trimmed);
}

/// A bad sector under one evicted slot's header pauses deallocation for the checkpoint it
/// fails in; later rounds try that slot after the others, and its failing again holds up
/// nothing, so the evicted slots after it still go (early evictions too).
#[test]
fn an_unreadable_header_does_not_hold_up_the_evicted_slots_after_it() {
    unreadable_header(false);
    unreadable_header(true);
}

fn unreadable_header(early_evictions: bool) {
    let mut r = Rig::new_with(SLOTS, META, true, false, early_evictions);
    let keys: Vec<String> = (0..2).map(|_| r.new_key(false)).collect();
    let mut slots: Vec<u64> = keys.iter().map(|k| r.put(k.clone()).unwrap()).collect();
    slots.sort();
    r.fillers(9);
    for _ in 0..2 {
        r.checkpoint_dirty();
        r.step();
    }
    let off = r.g.slot_offset(slots[0]);
    r.dev.set_fail_reads(Some(off..off + BA));
    for k in &keys {
        r.delete_key(k);
    }
    for _ in 0..4 {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.state(slots[1]), SlotState::Trimmed, "the slot after the unreadable one went");
    assert_ne!(r.state(slots[0]), SlotState::Trimmed);
    assert!(r.slots.get(slots[0]).unwrap().confirmed, "a failed read is not a changed header");
    // Only the first failure paused: evictions since go in their first checkpoint.
    let k = r.filler.pop().unwrap();
    let s = r.delete_key(&k);
    r.checkpoint();
    r.step();
    if !early_evictions {
        r.checkpoint_dirty();
        r.step();
    }
    assert_eq!(r.state(s), SlotState::Trimmed, "a slot evicted after the bad one goes at once");
    assert!(!r.w.trim_error, "a known bad slot leaves no pause behind");
    r.verify_all();
}

/// A payload whose read fails (a media error, a controller reset) is not one still on its
/// way: it is read again on the timer, not only after a write to it.
#[test]
fn a_payload_read_that_fails_is_read_again_on_the_timer() {
    let mut r = rig_snapshotting_after_two_checkpoints();
    let copy = Geometry::copy_for_seq(r.lmc.ckpt.as_ref().unwrap().seq);
    let payload = r.g.container_offset(copy) + BA;
    r.dev.set_fail_reads(Some(payload..payload + BA));
    r.ckpt_payload();
    r.ckpt_header();
    r.step();
    assert!(!r.w.pending.is_empty(), "the payload could not be read");
    r.dev.set_fail_reads(None);
    r.step();
    assert!(r.w.pending.is_empty(), "read again once readable, with no write to it");
    r.checkpoint_dirty();
    r.step();
    r.verify_all();
}

/// A payload write's completion reported after the read that found the checkpoint complete
/// (a queue finishing late) is not a payload written into that container later: when the
/// container is empty (zeroed by fdpblk), it must not make deallocation wait for a header.
#[test]
fn a_late_completion_is_not_a_payload_without_its_header() {
    let (mut r, _) = rig_with_keys(6, 3);
    for _ in 0..2 {
        r.checkpoint();
        r.step();
    }
    r.slots.containers_written(ContainerWrites { payloads: 0b11, ..Default::default() });
    r.w.containers[0] = Container::Empty;
    r.step();
    assert_eq!(r.w.awaiting_header, [false, false]);
}

#[test]
fn overflow_alarm_comes_before_the_first_skipped_checkpoint() {
    // Containers of 4 KiB: about 20 entries fit.
    let mut r = Rig::new(64, 8192, true);
    let mut alarmed_at = None;
    let mut skipped = false;
    for i in 0..64 {
        let k = r.new_key(i % 3 == 0);
        r.put(k);
        r.step();
        let v = r.w.published_json();
        if v["overflow_risk"] == true && alarmed_at.is_none() {
            alarmed_at = Some(i);
            assert!(v["meta_total_bytes_needed"].as_u64().unwrap() > 8192);
        }
        if i % 4 == 3 {
            if r.snapshot() {
                r.ckpt_payload();
                r.ckpt_header();
                r.step();
            } else {
                skipped = true;
                assert!(alarmed_at.is_some(), "checkpoint skipped at put {i} before any alarm");
                break;
            }
        }
    }
    assert!(skipped);
    let v = r.w.published_json();
    assert_eq!(v["checkpoint_cap_bytes"], r.g.payload_cap());
    assert!(v["checkpoint_estimate_bytes"].as_u64().unwrap() > r.g.payload_cap());
    assert!(v["checkpoint_bytes"].as_u64().unwrap() <= r.g.payload_cap());
    assert!(v["checkpoint_seq"].as_u64().unwrap() >= 2);
    // LMCache restarts past the overflow: what it lost is said with the overflow's fix, not
    // with a closing checkpoint LMCache skips as well.
    let (c0, c1) = (r.g.container_offset(0), r.g.container_offset(1));
    let said = warnings_during(|| {
        r.read(c0, BA);
        r.read(c1, BA);
        r.restart_lmcache(true);
        let k = r.new_key(false);
        r.put(k);
        r.step();
    });
    assert!(said.contains("LMCache opened the device again") && said.contains("the overflow alarm's meta_total_bytes of at least"), "{said}");
    assert!(!said.contains("it writes one at close"), "{said}");
}

/// A layout whose checkpoint cannot list every slot is said once, at the start, before any
/// put, with the entries that fit and a `meta_total_bytes` that lists them all; one that can
/// is not.
#[test]
fn a_checkpoint_that_cannot_list_every_slot_is_said_at_the_start() {
    let mut said = None;
    let warned = warnings_during(|| {
        // Containers of 4 KiB (3584 bytes of payload): 13 entries of 240 bytes fit, 64 slots do not.
        let mut r = Rig::new(64, 8192, true);
        r.step();
        r.step();
        let v = r.w.published_json();
        let full = v["checkpoint_full_bytes"].as_u64().unwrap();
        assert!(full > r.g.payload_cap(), "{v}");
        said = Some((full, r.w.meta_total_needed(0), r.g.block_align));
    });
    let (full, needed, align) = said.unwrap();
    assert_eq!(warned.matches("cannot list all 64 slots").count(), 1, "once: {warned}");
    assert!(warned.contains("about 13 entries") && warned.contains(&format!("meta_total_bytes of at least {needed}")), "{warned}");
    // The named region's containers hold every slot's entry, with a twentieth to spare.
    assert!(needed / 2 - align >= full + full / 20, "{needed} for {full}");
    let quiet = warnings_during(|| {
        let mut r = Rig::new(8, 8192, true);
        r.step();
        assert!(r.w.published_json()["checkpoint_full_bytes"].as_u64().unwrap() <= r.g.payload_cap());
    });
    assert!(!quiet.contains("cannot list"), "{quiet}");
}

#[test]
fn puts_into_freed_slots_do_not_raise_the_overflow_alarm_past_the_slot_count() {
    // 8 slots, whose 8 entries fit a 4 KiB container with room to spare: however many puts
    // (each replacing a deleted entry) come without a checkpoint, LMCache's index never lists
    // more than 8, so no overflow is ahead. The estimate counted every put.
    let mut r = Rig::new(8, 8192, true);
    for _ in 0..4 {
        let k = r.new_key(false);
        r.put(k);
    }
    r.step();
    r.checkpoint();
    r.step();
    for _ in 0..200 {
        r.put_in_a_full_cache(true);
        r.step();
    }
    let v = r.w.published_json();
    assert_eq!(v["overflow_risk"], false, "{v}");
    assert!(v["meta_total_bytes_needed"].is_null());
    assert!(v["checkpoint_estimate_bytes"].as_u64().unwrap() < r.g.payload_cap(), "{v}");
}

#[test]
fn the_overflow_estimate_takes_lmcaches_larger_capacity_for_its_slot_count() {
    // LMCache's checkpoint says a capacity four times fdpblk's: its index can list about four
    // times the slots, not 8, and puts past fdpblk's 8 count towards the estimate.
    let mut r = Rig::new(8, 8192, true);
    let cap = r.g.capacity_bytes;
    let k = r.new_key(false);
    r.put(k);
    r.step();
    r.checkpoint_saying_capacity(cap * 4);
    r.step();
    assert_eq!(r.w.capacity_warned, Some(cap * 4));
    for _ in 0..80 {
        r.put_in_a_full_cache(false);
    }
    r.step();
    let theirs = (cap * 4 - r.g.meta_total_bytes) / r.g.slot_bytes;
    assert!(theirs < 81, "the test needs LMCache's slot count below its puts: {theirs}");
    assert_eq!(r.w.estimate().unwrap().entries, theirs, "one entry per slot of LMCache's layout");
}

#[test]
fn overflow_alarm_measured_on_a_one_entry_checkpoint_comes_before_the_overflow() {
    // The bytes per entry come from a checkpoint with a single entry: what the JSON costs
    // besides its entries must be measured, not assumed, or that entry looks far smaller.
    let mut r = Rig::new(64, 8192, true);
    let k = r.new_key(false);
    r.put(k);
    r.step();
    assert!(r.snapshot());
    r.ckpt_payload();
    r.ckpt_header();
    r.step();
    let mut alarmed = false;
    for i in 1..64 {
        let k = r.new_key(i % 3 == 0);
        r.put(k);
        r.step();
        if r.json().len() as u64 > r.g.payload_cap() {
            assert!(alarmed, "the checkpoint no longer fits after {i} more puts, and no alarm came first");
            return;
        }
        alarmed |= r.w.published_json()["overflow_risk"] == true;
    }
    panic!("the checkpoint never outgrew its container");
}

#[test]
fn a_checkpoint_rewritten_between_its_crc_and_its_parse_is_read_again() {
    // Into other valid JSON (an older checkpoint's, padded), and into bytes that do not parse.
    rewritten_between_crc_and_parse(false);
    rewritten_between_crc_and_parse(true);
}

fn rewritten_between_crc_and_parse(garbage: bool) {
    let mut r = Rig::new(64, 8192, true);
    let k = r.new_key(false);
    r.put(k);
    r.step();
    assert!(r.snapshot());
    r.ckpt_payload();
    r.ckpt_header();
    r.step();
    let seq = |r: &Rig| r.w.published_json()["checkpoint_seq"].as_u64();
    assert_eq!(seq(&r), Some(1));
    let older = r.json();
    for _ in 0..3 {
        let k = r.new_key(false);
        r.put(k);
        r.step();
    }
    assert!(r.snapshot());
    let c = r.lmc.ckpt.clone().unwrap();
    // When fdpblk reads it back, the payload under the new header is other valid JSON (an
    // older checkpoint's, padded: LMCache rewriting it) or bytes that do not parse: it must
    // not be taken for seq 2, nor called unusable.
    let mut spliced = if garbage { c.json[..c.json.len() / 2].to_vec() } else { older };
    spliced.resize(c.json.len(), if garbage { b'#' } else { b' ' });
    let at = r.g.container_offset(Geometry::copy_for_seq(c.seq)) + BA;
    r.ckpt_payload();
    r.ckpt_header();
    r.dev.poke(at, &spliced);
    r.step();
    assert_eq!(seq(&r), Some(1), "bytes the CRC did not vouch for were taken for checkpoint 2");
    // LMCache's own bytes are there again (it wrote them once more): read again, whole this
    // time.
    let mut b = c.json.clone();
    b.resize(b.len().div_ceil(BA as usize) * BA as usize, 0);
    r.write(at, &b);
    for _ in 0..5 {
        r.step();
    }
    assert_eq!(seq(&r), Some(2));
}

/// One random schedule of LMCache and fdpblk events (half of them deallocating unwritten
/// slots too); returns (trims, checkpoints, tails, early tails, early evictions, unwritten
/// slots deallocated).
fn schedule(seed: u64, steps: usize) -> (u64, u64, u64, u64, u64, u64) {
    let mut rng = Rng(seed);
    let early_evictions = !rng.chance(50);
    let mut r = Rig::new_with(SLOTS, META, true, seed % 2 == 1, early_evictions);
    let mut commits = 0;
    let posix = rng.chance(50);
    // Phases: filling (puts), churning, draining (deletes and checkpoints, so that evicted
    // slots stay free long enough to be deallocated: LMCache reuses freed slots first).
    let mut phase = 0;
    for step in 0..steps {
        if step % 16 == 0 {
            phase = if step == 0 { 0 } else { rng.below(3) };
        }
        let (put_w, del_w, ckpt_w) = [(30, 4, 12), (14, 10, 18), (2, 14, 36)][phase];
        let x = rng.below(100);
        let kind = if x < put_w {
            0
        } else if x < put_w + 16 {
            1
        } else if x < put_w + 16 + del_w {
            2
        } else if x < put_w + 16 + del_w + ckpt_w {
            3
        } else {
            4 + (x % 8)
        };
        match kind {
            0 => {
                // A new put, or a re-put of a deleted key (a returning identity).
                // The most recently deleted key comes back into its own slot (LIFO): the same
                // identity and maybe the same length in the same slot, the hardest case.
                let key = if !r.lmc.deleted.is_empty() && rng.chance(50) {
                    let i = if rng.chance(70) { r.lmc.deleted.len() - 1 } else { rng.below(r.lmc.deleted.len()) };
                    r.lmc.deleted.remove(i)
                } else {
                    r.new_key(rng.chance(30))
                };
                // Lengths from a fraction of a block to the whole payload capacity (3 blocks):
                // a shorter put after a longer one leaves a stale tail.
                let size = if rng.chance(30) { BA - 100 } else { 1 + rng.below(3 * BA as usize) as u64 };
                r.start_put(key, size);
            }
            1 if !r.lmc.puts.is_empty() => {
                let i = rng.below(r.lmc.puts.len());
                let p = r.lmc.puts[i].clone();
                match (p.hdr, p.pay) {
                    // io_uring: the payload may reach the device before the header.
                    (false, false) if !posix && rng.chance(30) => r.put_payload(i),
                    (false, false) if posix || rng.chance(50) => r.put_header(i),
                    (false, _) => r.put_header(i),
                    (true, false) => r.put_payload(i),
                    (true, true) if rng.chance(3) => r.put_rollback(i),
                    (true, true) if rng.chance(40) => r.put_commit(i),
                    (true, true) => {} // the commit lags behind the writes
                }
            }
            2 if !r.lmc.index.is_empty() => {
                let i = rng.below(r.lmc.index.len());
                r.delete(i);
            }
            3 => match r.lmc.ckpt.clone() {
                None => {
                    // Mostly a whole checkpoint at once; sometimes its writes interleave
                    // with everything else.
                    if r.snapshot() && rng.chance(60) {
                        if posix || rng.chance(50) {
                            r.ckpt_payload();
                            r.ckpt_header();
                        } else {
                            r.ckpt_header();
                            r.ckpt_payload();
                        }
                        commits += 1;
                    }
                }
                Some(c) => {
                    if !c.pay && (posix || rng.chance(50)) {
                        r.ckpt_payload();
                    } else if !c.hdr {
                        r.ckpt_header();
                    } else {
                        r.ckpt_payload();
                    }
                    if r.lmc.ckpt.is_none() {
                        commits += 1;
                    }
                }
            },
            4 if !r.lmc.index.is_empty() => {
                let i = rng.below(r.lmc.index.len());
                r.verify(i);
            }
            5 if rng.chance(30) => {
                let _ = r.w.persist_now(false, false);
            }
            6 if rng.chance(8) => {
                let load = rng.chance(75);
                r.restart_lmcache(load);
            }
            7 if rng.chance(8) => {
                let clean = rng.chance(50);
                r.restart_fdpblk(clean);
            }
            _ => r.step(),
        }
    }
    // Drain: finish everything in flight, checkpoint twice, and check every live entry.
    while !r.lmc.puts.is_empty() {
        if !r.lmc.puts[0].hdr {
            r.put_header(0);
        }
        if !r.lmc.puts[0].pay {
            r.put_payload(0);
        }
        r.put_commit(0);
    }
    if let Some(c) = r.lmc.ckpt.clone() {
        if !c.pay {
            r.ckpt_payload();
        }
        if !c.hdr {
            r.ckpt_header();
        }
    }
    // Then evict half of what is left: the deallocations after whatever state the schedule
    // left behind are checked too.
    for round in 0..4 {
        if round == 2 {
            for _ in 0..r.lmc.index.len() / 2 {
                let i = rng.below(r.lmc.index.len());
                r.delete(i);
            }
        } else if round == 3 && !r.lmc.index.is_empty() {
            r.delete(0);
        }
        if r.snapshot() {
            r.ckpt_payload();
            r.ckpt_header();
        }
        r.step();
    }
    r.verify_all();
    assert_eq!(r.checked, r.trims);
    (r.trims, commits, r.tails, r.early_tails + r.w.early_tail_trims(), r.early_evictions, r.reclaimed + r.w.reclaimed())
}

#[test]
fn randomized_interleavings_never_trim_a_live_slot() {
    // 10,000 in release builds (what CI runs: `cargo test --release`), 1,000 in debug builds.
    let default = if cfg!(debug_assertions) { 1_000 } else { 10_000 };
    let n: u64 = std::env::var("FDPBLK_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    // Another salt explores other schedules (CI runs the default).
    let salt: u64 = std::env::var("FDPBLK_SCHEDULE_SALT").ok().and_then(|v| v.parse().ok()).unwrap_or(0x1234);
    let t0 = std::time::Instant::now();
    let (mut trims, mut commits, mut tails, mut early, mut evictions, mut reclaimed) = (0, 0, 0, 0, 0, 0);
    for seed in 0..n {
        let (t, c, tl, e, ev, rc) = schedule(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ salt, 64);
        reclaimed += rc;
        trims += t;
        commits += c;
        tails += tl;
        early += e;
        evictions += ev;
    }
    eprintln!(
        "{n} schedules: {trims} deallocations ({evictions} early evictions, {reclaimed} unwritten slots) and {tails} stale tails ({early} early) checked, {commits} checkpoints, {:?}",
        t0.elapsed()
    );
    assert!(trims > n / 4, "the schedules exercise deallocation ({trims} trims)");
    assert!(reclaimed > n / 8 && reclaimed < trims, "the schedules exercise unwritten slots ({reclaimed} of {trims})");
    assert!(evictions > n / 8 && evictions < trims, "the schedules exercise both eviction rules ({evictions} of {trims} early)");
    assert!(tails > n / 4, "the schedules exercise stale tails ({tails} tails)");
    assert!(early > n / 8 && early < tails, "the schedules exercise both tail rules ({early} of {tails} early)");
}

/// A checkpoint listing one slot under many keys (LMCache never writes one; a crafted or
/// damaged one with a valid CRC can) costs the state thread one live entry and at most one
/// confirmation per slot, not one per entry: such a checkpoint can hold millions of short
/// entries. The key whose identity the slot's header holds is still confirmed, wherever the
/// others stand.
#[test]
fn a_slot_listed_many_times_is_observed_and_confirmed_once() {
    use crate::place::{Policy, SharedPolicy, Target};
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Counter(Arc<AtomicUsize>);
    impl Policy for Counter {
        fn name(&self) -> &'static str {
            "counter"
        }
        fn handles(&self) -> u16 {
            1
        }
        fn place(&mut self, _: &Target<'_>) -> Handle {
            0
        }
        fn observes_checkpoints(&self) -> bool {
            true
        }
        fn observe(&mut self, event: &Observation<'_>) {
            if let Observation::Checkpoint { entries, .. } = event {
                self.0.fetch_max(entries.len(), Ordering::Relaxed);
            }
        }
    }
    let mut r = Rig::new(SLOTS, 1 << 20, true).without_early_evictions();
    let seen = Arc::new(AtomicUsize::new(0));
    r.w.attach(SharedPolicy::new(Box::new(Counter(seen.clone()))));
    let (k, other) = (r.new_key(false), r.new_key(true));
    let slot = r.put(k.clone()).unwrap();
    let other_slot = r.put(other).unwrap();
    r.fillers(3);
    // 300 other keys listing `slot`, ahead of the key it holds; ahead of all, a key that is
    // not LMCache's (no identity) listing the other slot, which still gets its live entry.
    let mut dups: Vec<_> = (0..300).map(|_| (r.new_key(false), slot, BA - 100, 0)).collect();
    dups.insert(0, ("not-a-key".to_string(), other_slot, BA - 100, 0));
    r.lmc.index.splice(0..0, dups);
    let entries = r.lmc.index.len();
    r.checkpoint();
    r.step();
    r.checkpoint_dirty();
    r.step();
    assert!(r.w.containers.iter().any(|c| matches!(c, Container::Valid(v) if v.entries as usize >= entries - 1)));
    assert_eq!(seen.load(Ordering::Relaxed), 2 + 3, "one live entry per slot, of {entries} entries");
    assert!(r.slots.get(slot).unwrap().confirmed, "the key the header names is confirmed");
    r.lmc.index.retain(|e| (e.1 != slot || e.0 == k) && e.0 != "not-a-key");
    r.verify_all();
}

#[test]
fn a_policy_that_observes_checkpoints_learns_tenants_from_them() {
    use crate::place::{KeyAwarePolicy, LmcacheFdpPolicy, Policy, SharedPolicy, Target};
    let mut r = Rig::new(SLOTS, META, true);
    let mut p = SharedPolicy::new(Box::new(LmcacheFdpPolicy::new()));
    r.w.attach(p.clone());
    let (salted, plain) = (r.new_key(true), r.new_key(false));
    let place = |p: &mut SharedPolicy, key: &str| {
        let h = SlotHeader { identity: keys::identity(key).unwrap(), payload_len: 100 };
        p.place(&Target::Slot { slot: 9, header: Some(&h), previous: None })
    };
    // LMCache's buckets: the salt's part before ':', case-folded; none without one.
    let with_salt = |r: &mut Rig, salt: &str| {
        r.lmc.keys += 1;
        format!("meta-llama%2FLlama-3.1-8B@0x01000100@0@{:032x}@{salt}", r.lmc.keys.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    };
    let (same_bucket, other_bucket, no_bucket) = (with_salt(&mut r, "TENANTA:bob"), with_salt(&mut r, "tenantB:x"), with_salt(&mut r, "alice"));
    for k in [&salted, &plain, &same_bucket, &other_bucket, &no_bucket] {
        r.put(k.clone()).unwrap();
    }
    assert_eq!(place(&mut p, &salted), LmcacheFdpPolicy::NO_DIRECTIVE, "nothing committed yet");
    r.checkpoint();
    r.step();
    // The committed checkpoint listed the salted key with its tenant: a bucket of its own.
    assert_eq!(place(&mut p, &salted), LmcacheFdpPolicy::FIRST_DATA);
    assert_eq!(place(&mut p, &plain), LmcacheFdpPolicy::NO_DIRECTIVE, "no cache_salt, no bucket");
    assert_eq!(place(&mut p, &same_bucket), LmcacheFdpPolicy::FIRST_DATA, "tenantA, case-folded");
    assert_eq!(place(&mut p, &other_bucket), LmcacheFdpPolicy::FIRST_DATA + 1);
    assert_eq!(place(&mut p, &no_bucket), LmcacheFdpPolicy::NO_DIRECTIVE, "a salt without ':' gets no directive");
    // A policy that does not learn from checkpoints is not handed them.
    r.w.attach(SharedPolicy::new(Box::new(KeyAwarePolicy::new())));
    assert!(r.w.observer.is_none());
}

#[test]
fn a_policy_with_history_resumes_from_the_restored_slot_table() {
    use crate::place::{KeyAwarePolicy, SharedPolicy, Target};
    let mut r = Rig::new(SLOTS, META, true);
    let (hot, once, never) = (r.new_key(false), r.new_key(true), r.new_key(false));
    for k in [&hot, &once, &never] {
        r.put(k.clone()).unwrap();
    }
    let at = |r: &Rig, k: &str| r.lmc.index.iter().position(|e| e.0 == k).unwrap();
    // The puts are saved first, so only the loads below can save the records again.
    r.w.step();
    let _ = r.w.persist_now(false, true);
    assert!(r.slots.take_dirty_pages().is_empty());
    for _ in 0..KeyAwarePolicy::HOT_READS {
        r.verify(at(&r, &hot));
    }
    r.verify(at(&r, &once));
    // A periodic persist, then fdpblk is killed and restarts: a fresh policy instance, the
    // slot table from fdpblk's own state.
    let _ = r.w.persist_now(false, false);
    r.restart_fdpblk(false);
    let mut p = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
    assert_eq!(r.w.attach(p.clone()), 3);
    let mut place = |key: &str| {
        let h = SlotHeader { identity: keys::identity(key).unwrap(), payload_len: 100 };
        p.place(&Target::Slot { slot: SLOTS - 1, header: Some(&h), previous: None })
    };
    // Each identity comes back on the handle its loads before the restart earned it.
    assert_eq!(place(&hot), KeyAwarePolicy::HOT);
    assert_eq!(place(&once), KeyAwarePolicy::READ);
    assert_eq!(place(&never), KeyAwarePolicy::YOUNG);
}

/// Four puts, a checkpoint read back, then a clean stop: the drive holds a clean state, whose
/// confirmations a start trusts.
fn rig_stopped_cleanly() -> Rig {
    let mut r = Rig::new(SLOTS, META, true);
    let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.checkpoint();
    r.step();
    r.w.persist_now(true, true).unwrap();
    r
}

#[test]
fn a_saved_state_that_cannot_be_marked_in_use_is_reported_and_retried() {
    let r = rig_stopped_cleanly();
    // The next start cannot write: it says so (`add` refuses to serve on it), and the drive
    // still holds the clean state.
    r.dev.set_fail_writes(true);
    let mut w = Watcher::new(r.g, Arc::new(SlotTable::new(r.g.max_slots)), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    assert!(w.loaded().clean);
    assert!(w.unclean_error().is_some());
    // Once the drive takes writes, the next cycle marks the state in use though nothing else
    // changed; a crash after it leaves an unclean state.
    r.dev.set_fail_writes(false);
    w.persist_now(false, false).unwrap();
    assert!(w.unclean_error().is_none());
    let after_crash = Watcher::new(r.g, Arc::new(SlotTable::new(r.g.max_slots)), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    assert!(after_crash.loaded().found && !after_crash.loaded().clean);
}

/// A checkpoint written while fdpblk was stopped (LMCache run on the drive itself, or any
/// program writing the backing): the clean state's confirmations are not taken, and the
/// start says why. The same containers as at the stop: they are.
#[test]
fn checkpoints_changed_while_stopped_void_the_clean_states_confirmations() {
    use crate::persist::dev::StateWriter;
    // Confirmations need a checkpoint two on from the puts.
    let mut r = Rig::new(SLOTS, META, true);
    for _ in 0..4 {
        let k = r.new_key(false);
        r.put(k).unwrap();
    }
    for _ in 0..3 {
        r.checkpoint();
        r.step();
    }
    r.w.persist_now(true, true).unwrap();
    let confirmed = |t: &SlotTable| (0..t.len() as u64).filter(|&s| t.life(s) & life::CONFIRMED != 0).count();
    assert!(confirmed(&r.slots) > 0, "the rig confirms its puts");
    let start = || {
        let t = Arc::new(SlotTable::new(r.g.max_slots));
        let w = Watcher::new(r.g, t.clone(), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
        (w, t)
    };
    let (w, t) = start();
    assert!(w.loaded().clean, "{:?}", w.loaded());
    assert_eq!(confirmed(&t), confirmed(&r.slots));
    // It stops cleanly again, recording the same checkpoints.
    let yes = std::sync::atomic::AtomicBool::new(true);
    w.run(&yes, &yes);
    // Another writer's next checkpoint into the same container: seq two on, payload kept.
    let off = r.g.container_offset(0);
    let mut h = vec![0u8; r.g.block_align as usize];
    r.dev.read_at(off, &mut h).unwrap();
    let seq = u64::from_le_bytes(h[12..20].try_into().unwrap());
    assert!(seq >= 1, "container 0 holds the rig's checkpoint");
    h[12..20].copy_from_slice(&(seq + 2).to_le_bytes());
    r.dev.write_at(off, &h, 0).unwrap();
    let (w, t) = start();
    assert!(w.loaded().found && !w.loaded().clean, "{:?}", w.loaded());
    assert_eq!(confirmed(&t), 0);
    let note = w.published_json()["own_state"]["loaded_note"].as_str().unwrap_or_default().to_string();
    assert!(
        note.contains(&format!("LMCache's checkpoints changed while fdpblk was stopped (container 0: seq {seq} then, seq {} now)", seq + 2)) && note.contains("not trusted this time"),
        "{note}"
    );
}

/// A bad sector under the saved state: the start loads the rest, untrusted, and says why in
/// its stats (`own_state.loaded_note`), where `fdpblk stats` prints it.
#[test]
fn a_saved_state_with_an_unreadable_page_copy_loads_and_says_why() {
    let r = rig_stopped_cleanly();
    let page0 = r.region.offset + 2 * 4096;
    r.dev.set_fail_reads(Some(page0..page0 + 4096));
    let w = Watcher::new(r.g, Arc::new(SlotTable::new(r.g.max_slots)), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    r.dev.set_fail_reads(None);
    assert!(w.loaded().found && !w.loaded().clean, "{:?}", w.loaded());
    let v = w.published_json();
    assert_eq!(v["own_state"]["loaded_clean"], false);
    let note = v["own_state"]["loaded_note"].as_str().unwrap_or_default().to_string();
    assert!(note.contains("cannot read 1 page copy"), "{note}");
}

/// Four puts before LMCache's first checkpoint through fdpblk (their early tails wait for it),
/// three after it, and a checkpoint written after those, read back: seven slots whose early
/// tails may go. Returns how many went once the first checkpoint was read back.
fn early_tail_candidates(r: &mut Rig) -> u64 {
    r.fillers(4);
    r.step();
    assert_eq!(r.w.early_tail_trims(), 0, "before LMCache's first checkpoint through fdpblk");
    r.checkpoint();
    r.step();
    let first = r.w.early_tail_trims();
    r.fillers(3);
    r.step();
    r.checkpoint(); // one written after the puts, read back
    r.step();
    first
}

/// What `f` logged at warning level or above.
fn warnings_during(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let w = buf.clone();
    let sub = tracing_subscriber::fmt().with_max_level(tracing::Level::WARN).with_ansi(false).with_writer(move || w.clone()).finish();
    tracing::subscriber::with_default(sub, f);
    let out = buf.0.lock().unwrap().clone();
    String::from_utf8_lossy(&out).into_owned()
}

/// A LMCache opening the device with buffered I/O may find the header blocks in the page cache
/// (its own checkpoint writes left them there), and its reads would not reach fdpblk: each
/// round drops them, and where that fails, early tails wait as after such a read.
#[test]
fn early_tails_wait_while_the_header_blocks_cannot_be_dropped_from_the_page_cache() {
    let cache = std::env::temp_dir().join(format!("fdpblk-page-cache-gate-{}", std::process::id()));
    std::fs::write(&cache, vec![0u8; 4096]).unwrap();
    // A node that is not there (a stop under way removes it before the state thread hears of
    // the stop) closes the gate without a warning; any other failure warns.
    // (page cache, early tails after the first checkpoint and after the second, warns)
    // (A disk name no kernel has: a host with a ublkb0 would warn of "/nonexistent/ublkb0".)
    let mut cases = vec![(cache.clone(), 4, 7, false), (std::path::PathBuf::from("/nonexistent/ublkb-no-such-disk"), 0, 0, false), (cache.join("ublkb0"), 0, 0, true)];
    // A node missing while the kernel has the disk (a mount namespace without it) warns.
    match std::fs::read_dir("/sys/class/block").ok().and_then(|mut d| d.next()).and_then(|e| e.ok()) {
        Some(disk) => cases.push((std::path::Path::new("/nonexistent").join(disk.file_name()), 0, 0, true)),
        None => assert!(std::env::var_os("CI").is_none(), "CI's host has no block device in /sys/class/block: a case went unchecked"),
    }
    for (path, first, tails, warns) in cases {
        let mut r = Rig::new(SLOTS + 4, META, true);
        r.cfg.page_cache = Some(path.clone());
        r.w = Watcher::new(r.g, r.slots.clone(), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
        let mut went = 0;
        let log = warnings_during(|| went = early_tail_candidates(&mut r));
        assert_eq!((went, r.w.early_tail_trims()), (first, tails), "page cache of {}", path.display());
        assert_eq!(log.contains("dropping the checkpoint header blocks"), warns, "page cache of {}: {log}", path.display());
        r.verify_all();
    }
    std::fs::remove_file(&cache).unwrap();
}

#[test]
fn early_tails_wait_for_lmcache_to_checkpoint_after_it_opened_the_device() {
    // Until then a header may come from a LMCache restarted with a smaller slot size, whose
    // next slot starts inside what fdpblk takes for this slot's tail.
    let mut r = Rig::new(SLOTS + 4, META, true);
    assert_eq!(early_tail_candidates(&mut r), 4, "held back until the first checkpoint, not dropped");
    assert_eq!(r.w.early_tail_trims(), 7);
    // LMCache opening the device again (it reads both containers' header blocks): early tails
    // wait for its next checkpoint, which lets the ones put meanwhile go too.
    let (c0, c1) = (r.g.container_offset(0), r.g.container_offset(1));
    r.read(c0, BA);
    r.read(c1, BA);
    r.fillers(2);
    r.step();
    assert_eq!(r.w.early_tail_trims(), 7);
    r.checkpoint();
    r.step();
    assert_eq!(r.w.early_tail_trims(), 9);
    r.fillers(2);
    r.step();
    r.checkpoint();
    r.step();
    assert_eq!(r.w.early_tail_trims(), 11);
    // LMCache opens the device between a checkpoint's header write and the state thread
    // reading it back: that checkpoint does not vouch for the geometry of what follows.
    r.checkpoint();
    r.read(c0, BA);
    r.read(c1, BA);
    r.step();
    r.fillers(2);
    r.step();
    assert_eq!(r.w.early_tail_trims(), 11);
    r.checkpoint();
    r.step();
    assert_eq!(r.w.early_tail_trims(), 13);
    r.fillers(1);
    r.step();
    r.checkpoint();
    r.step();
    assert_eq!(r.w.early_tail_trims(), 14);
    r.verify_all();
}

/// While the writeback delay reaches LMCache's checkpoint interval, deallocation pauses where
/// LMCache writes through the page cache, or where that cannot be told, and resumes once the
/// interval is above the delay again; writes that leave no dirty pages (O_DIRECT) go on.
#[test]
fn deallocation_pauses_while_buffered_writes_may_outlast_the_checkpoint_interval() {
    let hour = Some(Duration::from_secs(3600));
    for (buffered, paused) in [(Some(true), true), (None, true), (Some(false), false)] {
        let mut r = Rig::new(2 * SLOTS, META, true);
        r.w.cfg.writeback = WritebackDelay::Fixed(hour);
        // No buffered writes seen before the risk is judged (they would pause deallocation
        // until then: `buffered_writes_pause_deallocation_until_the_risk_is_judged`).
        r.w.cfg.buffered = BufferedWrites::Fixed(Some(false));
        let keys = r.confirmed_keys(4);
        r.fillers(8);
        r.w.cfg.buffered = BufferedWrites::Fixed(buffered);
        // Two more checkpoints: four intervals seen, the risk flagged.
        for _ in 0..2 {
            r.checkpoint_dirty();
            r.step();
        }
        let v = r.w.published_json();
        assert_eq!(v["writeback_risk"], true, "{buffered:?}");
        assert_eq!(v["trim"]["paused_by"].is_string(), paused, "{buffered:?}: {}", v["trim"]);
        assert_eq!(r.w.trims_allowed(), !paused);
        let (a, b) = (r.delete_key(&keys[0]), r.delete_key(&keys[1]));
        for _ in 0..2 {
            r.checkpoint_dirty();
            r.step();
        }
        let want = if paused { SlotState::Evicted } else { SlotState::Trimmed };
        assert_eq!((r.state(a), r.state(b)), (want, want), "{buffered:?}");
        // Nor does a checkpoint confirm a put, nor a stale tail go, while paused (a header may
        // have come late). A short put into a freed slot leaves a stale tail.
        let tails = r.tails;
        let k = r.new_key(false);
        let c = r.put_sized(k, 50).unwrap();
        for _ in 0..3 {
            r.checkpoint_dirty();
            r.step();
        }
        assert_eq!(r.slots.get(c).unwrap().confirmed, !paused, "{buffered:?}");
        if paused {
            assert_eq!(r.tails, tails, "{buffered:?}: no stale tail goes while paused");
        }
        // The kernel's delay lowered below the interval: the next checkpoint ends the pause.
        r.w.cfg.writeback = WritebackDelay::Fixed(Some(Duration::ZERO));
        r.checkpoint_dirty();
        r.step();
        r.step();
        assert!(r.w.published_json()["trim"]["paused_by"].is_null());
        for s in [a, b].into_iter().filter(|&s| s != c) {
            assert_eq!(r.state(s), SlotState::Trimmed, "{buffered:?}: slot {s}");
        }
        if paused {
            assert!(r.tails > tails, "{buffered:?}: the held tail went ({} early)", r.w.early_tail_trims());
        }
        // The risk again: paused again (buffered writes seen once count for the whole run).
        r.w.cfg.writeback = WritebackDelay::Fixed(hour);
        r.w.buffered_checked = None;
        r.checkpoint_dirty();
        r.step();
        r.step();
        assert_eq!(r.w.published_json()["trim"]["paused_by"].is_string(), paused, "{buffered:?}: a second risk");
        r.verify_all();
    }
}

/// Before a run has seen the intervals it judges the writeback risk by, a kernel delay that
/// could reach LMCache's interval pauses deallocation where buffered writes are seen (a fresh
/// start under a non-MP LMCache checkpointing more often than the delay would otherwise
/// deallocate on checkpoints that may have come late); not where none are seen, nor where that
/// cannot be told, nor where the delay is below LMCache's shortest interval (1 s). Once judged
/// safe, the pause ends and the checkpoints after it confirm and deallocate as usual.
#[test]
fn buffered_writes_pause_deallocation_until_the_risk_is_judged() {
    let hour = Some(Duration::from_secs(3600));
    let short = Some(Duration::from_millis(900));
    for (delay, buffered, paused) in [(hour, Some(true), true), (None, Some(true), true), (hour, Some(false), false), (hour, None, false), (short, Some(true), false)] {
        let case = format!("delay {delay:?}, buffered {buffered:?}");
        let mut r = Rig::new(2 * SLOTS, META, true);
        r.w.cfg.writeback = WritebackDelay::Fixed(delay);
        r.w.cfg.buffered = BufferedWrites::Fixed(buffered);
        let keys = r.confirmed_keys(2);
        r.fillers(8);
        let paused_by = |r: &Rig| r.w.published_json()["trim"]["paused_by"].as_str().map(str::to_string);
        assert_eq!(paused_by(&r).is_some_and(|w| w.contains("of the 3 checkpoint intervals")), paused, "{case}: {:?}", paused_by(&r));
        assert_eq!(r.w.trims_allowed(), !paused, "{case}");
        // Evicted before the risk is judged: kept while paused (its put was never confirmed).
        let a = r.delete_key(&keys[0]);
        r.checkpoint();
        r.step();
        assert_eq!(r.state(a) == SlotState::Trimmed, !paused, "{case}: {:?}", r.state(a));
        // The kernel's delay lowered below 1 s: weighed at the next checkpoint, not between
        // them (the checkpoint that ends a pause confirms nothing: it may be a header the
        // kernel held back until now).
        r.w.cfg.writeback = WritebackDelay::Fixed(Some(Duration::ZERO));
        r.step();
        assert_eq!(paused_by(&r).is_some(), paused, "{case}: still paused until a checkpoint");
        r.checkpoint_dirty();
        r.step();
        r.step();
        assert_eq!(paused_by(&r), None, "{case}");
        assert!(r.w.trims_allowed(), "{case}");
        for _ in 0..2 {
            r.checkpoint_dirty();
            r.step();
        }
        let b = r.delete_key(&keys[1]);
        for _ in 0..2 {
            r.checkpoint_dirty();
            r.step();
        }
        assert_eq!(r.state(b), SlotState::Trimmed, "{case}");
        r.verify_all();
    }
}

/// The pause before the risk is judged ends at the third interval where LMCache's interval is
/// above a kernel delay of a second or more (35 s against 60 s, the defaults); that checkpoint
/// confirms nothing, the ones after it do.
#[test]
fn a_pause_before_judging_ends_once_the_intervals_are_seen_above_the_delay() {
    let s = Duration::from_secs;
    let mut r = Rig::new(2 * SLOTS, META, true);
    r.w.cfg.writeback = WritebackDelay::Fixed(Some(s(35)));
    r.w.cfg.buffered = BufferedWrites::Fixed(Some(true));
    let keys = r.confirmed_keys(2);
    r.fillers(8);
    let paused_by = |r: &Rig| r.w.published_json()["trim"]["paused_by"].as_str().map(str::to_string);
    assert!(paused_by(&r).is_some_and(|w| w.contains("of the 3 checkpoint intervals")), "{:?}", paused_by(&r));
    r.checkpoint_dirty();
    r.step();
    assert_eq!(r.w.gaps, 2);
    // A checkpoint after LMCache's intervals as a 60 s one would give them (this rig's take
    // microseconds; the shortest but one is weighed).
    let checkpoint_60 = |r: &mut Rig| {
        r.w.recent_gaps.clear();
        r.w.recent_gaps.extend([s(60), s(60)]);
        r.checkpoint_dirty();
        r.step();
    };
    // The next checkpoint is the third interval, judged below the risk.
    let k = r.new_key(false);
    let c = r.put(k).unwrap();
    checkpoint_60(&mut r);
    assert_eq!(r.w.published_json()["writeback_risk"], false);
    assert_eq!(paused_by(&r), None);
    assert!(!r.slots.get(c).unwrap().confirmed, "the checkpoint that ended the pause confirms nothing");
    for _ in 0..2 {
        checkpoint_60(&mut r);
    }
    assert!(r.slots.get(c).unwrap().confirmed, "the next ones do");
    let a = r.delete_key(&keys[0]);
    for _ in 0..2 {
        checkpoint_60(&mut r);
    }
    assert_eq!(r.state(a), SlotState::Trimmed);
    r.verify_all();
}

/// A pause is saved with fdpblk's state: a daemon restarted under the same LMCache and kernel
/// settings, after a crash or a stop, is paused from its start (else it would deallocate for
/// 3 intervals before it could judge the risk), and holds the pause until it has judged the
/// risk itself: paused on where it sees buffered writes, resumed where it sees none (MP mode
/// since). A daemon started after the kernel's delay was lowered carries nothing; one whose
/// delay is lowered after its start resumes at its first checkpoint.
#[test]
fn a_writeback_pause_outlives_a_daemon_restart() {
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Then {
        LoweredBefore,
        LoweredAfter,
        Direct,
        Buffered,
    }
    let hour = WritebackDelay::Fixed(Some(Duration::from_secs(3600)));
    let low = WritebackDelay::Fixed(Some(Duration::ZERO));
    // A checkpoint (that deletes a filler key), and one after a new put (a put could take
    // a slot just freed: `checkpoint` alone after a delete).
    let checkpoint = |r: &mut Rig| {
        r.checkpoint_dirty();
        r.step();
    };
    let tick = |r: &mut Rig| {
        r.fillers(1);
        checkpoint(r);
    };
    let paused_by = |r: &Rig| r.w.published_json()["trim"]["paused_by"].as_str().map(str::to_string);
    for clean in [false, true] {
        for then in [Then::LoweredBefore, Then::LoweredAfter, Then::Direct, Then::Buffered] {
            let case = format!("clean {clean}, {then:?}");
            let mut r = Rig::new(2 * SLOTS, META, true);
            for c in [&mut r.cfg, &mut r.w.cfg] {
                c.writeback = hour.clone();
                c.buffered = BufferedWrites::Fixed(Some(true));
            }
            let keys = r.confirmed_keys(4);
            r.fillers(8);
            for _ in 0..2 {
                tick(&mut r);
            }
            assert!(paused_by(&r).is_some(), "{case}");
            // Saved at once, not at the next interval (an hour here), unless persisting only
            // at start and stop.
            assert!(r.w.persist_due(), "{case}");
            assert!(!r.w.persist_due(), "{case}: once");
            r.w.persist_soon = true;
            r.w.cfg.persist_interval = Duration::MAX;
            assert!(!r.w.persist_due(), "{case}: --persist-interval-ms 0");
            r.w.persist_now(false, false).unwrap();
            assert!(r.w.counters().writeback_pause.is_some_and(|p| p.buffered && p.interval_ms > 0), "{case}");
            // A clean stop ends the pause for its last round (nothing is written after it),
            // but keeps it saved.
            r.w.stopped = clean;
            r.cfg.buffered = BufferedWrites::Fixed(Some(then == Then::Buffered));
            if then == Then::LoweredBefore {
                r.cfg.writeback = low.clone();
            }
            r.restart_fdpblk(clean);
            let carried = then != Then::LoweredBefore;
            assert_eq!(r.w.trims_allowed(), !carried, "{case}: before the first step");
            assert_eq!(paused_by(&r).is_some_and(|w| w.contains("previous run")), carried, "{case}: {:?}", paused_by(&r));
            assert_eq!(r.w.counters().writeback_pause.is_some(), carried, "{case}: a lowered delay clears it");
            r.step();
            if then == Then::LoweredAfter {
                // Weighed at the first checkpoint after the start, which confirms nothing.
                r.w.cfg.writeback = low.clone();
                tick(&mut r);
                assert_eq!(paused_by(&r), None, "{case}");
                assert_eq!(r.w.counters().writeback_pause, None, "{case}");
            }
            let lowered = matches!(then, Then::LoweredBefore | Then::LoweredAfter);
            // Checkpoints to confirm the slot (after a crash its saved confirmation is not
            // trusted, and one from before the start takes two), then LMCache deletes it.
            tick(&mut r);
            tick(&mut r);
            let a = r.delete_key(&keys[0]);
            checkpoint(&mut r);
            assert_eq!(r.state(a) == SlotState::Trimmed, lowered, "{case}: {:?}", r.state(a));
            if lowered {
                continue;
            }
            // Judged by this run (its third interval), still at risk: paused on where this run
            // sees buffered writes; where it sees none, the carried pause ends.
            checkpoint(&mut r);
            assert_eq!(paused_by(&r).is_some_and(|w| !w.contains("previous run")), then == Then::Buffered, "{case}: {:?}", paused_by(&r));
            assert_eq!(r.w.counters().writeback_pause.is_some(), then == Then::Buffered, "{case}");
            if then == Then::Buffered {
                assert_ne!(r.state(a), SlotState::Trimmed, "{case}");
                // The delay lowered: it resumes, and the saved state no longer holds a pause.
                r.w.cfg.writeback = low.clone();
                checkpoint(&mut r);
                assert_eq!(paused_by(&r), None, "{case}");
                assert_eq!(r.w.counters().writeback_pause, None, "{case}");
            }
            // The next checkpoint confirms what it lists (the one that ended the pause did not).
            checkpoint(&mut r);
            let b = r.delete_key(&keys[1]);
            for _ in 0..2 {
                checkpoint(&mut r);
            }
            assert_eq!(r.state(b), SlotState::Trimmed, "{case}");
            r.verify_all();
        }
    }
}

/// The interval the writeback check weighs: the second shortest of the last few, so that one
/// checkpoint out of turn (LMCache's `close()`) does not pass for LMCache's interval, while a
/// short interval, which recurs, does.
#[test]
fn the_writeback_check_weighs_an_interval_that_recurs() {
    let mut r = Rig::new(SLOTS, META, true);
    let s = Duration::from_secs;
    assert_eq!(r.w.short_gap(), None);
    r.w.recent_gaps.extend([s(60)]);
    assert_eq!(r.w.short_gap(), Some(s(60)), "one gap: itself");
    r.w.recent_gaps.extend([s(120), s(3), s(60), s(180)]);
    assert_eq!(r.w.short_gap(), Some(s(60)), "a close() 3 s after a tick is one gap");
    r.w.recent_gaps.extend([s(20)]);
    assert_eq!(r.w.short_gap(), Some(s(20)));
    r.w.step();
    assert_eq!(r.w.published_json()["checkpoint_interval_shortest_s"], 20.0);
}

/// A pause because fdpblk could not tell whether LMCache writes through the page cache is
/// looked at again (once a second): an answer of "no" ends it. Buffered writes once seen keep
/// it until the risk ends; so does nothing with deallocation off.
#[test]
fn a_pause_for_want_of_an_answer_ends_when_the_page_cache_is_clean() {
    let mut r = Rig::new(SLOTS, META, true);
    r.w.cfg.writeback = WritebackDelay::Fixed(None);
    r.w.cfg.buffered = BufferedWrites::Fixed(None);
    r.confirmed_keys(2);
    r.fillers(3);
    for _ in 0..3 {
        r.checkpoint_dirty();
        r.step();
    }
    assert!(r.w.published_json()["trim"]["paused_by"].as_str().is_some_and(|w| w.contains("cannot tell")));
    r.w.cfg.buffered = BufferedWrites::Fixed(Some(false));
    r.step();
    assert!(r.w.published_json()["trim"]["paused_by"].is_string(), "looked at once a second at most");
    r.w.buffered_checked = None;
    r.step();
    assert!(r.w.published_json()["trim"]["paused_by"].is_null(), "a clean page cache ends it");
    r.w.cfg.buffered = BufferedWrites::Fixed(Some(true));
    r.w.buffered_checked = None;
    r.step();
    r.w.cfg.buffered = BufferedWrites::Fixed(Some(false));
    r.w.buffered_checked = None;
    r.step();
    assert!(r.w.published_json()["trim"]["paused_by"].as_str().is_some_and(|w| w.contains("writes through the page cache")), "seen once: kept");
    r.w.cfg.trim = false;
    r.step();
    assert!(r.w.published_json()["trim"]["paused_by"].is_null(), "no pause without deallocation");
}

/// Buffered writes leave dirty pages that `cachestat` counts until they are written back;
/// a file written with O_DIRECT has none.
#[test]
fn dirty_pages_are_counted_until_written_back() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // Under target/, on the disk's file system: a tmpfs /tmp keeps no dirty pages to count.
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("target/fdpblk-dirty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![7u8; 1 << 20]).unwrap();
    match dirty_pages(&path) {
        // Before Linux 6.5 there is no cachestat: fdpblk then pauses (cannot tell). The host's
        // kernel decides which path this test takes; the VM checks `ublk-buffered` and
        // `ublk-writeback-pause` test the counting on the guest's kernel, which has it. CI's
        // host has it: there a skip would pass unchecked.
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            assert!(std::env::var_os("CI").is_none(), "CI's kernel has no cachestat (Linux 6.5): this test checked nothing");
        }
        r => {
            assert!(r.unwrap() > 0, "buffered pages are dirty");
            f.sync_all().unwrap();
            assert_eq!(dirty_pages(&path).unwrap(), 0, "written back");
            let direct = dir.join("d");
            let mut d = std::fs::OpenOptions::new().write(true).create(true).custom_flags(libc::O_DIRECT).open(&direct).unwrap();
            let buf = crate::persist::dev::AlignedBuf::zeroed(1 << 20);
            // (A file system without O_DIRECT takes none: nothing to compare there.)
            if d.write_all(&buf).is_ok() {
                assert_eq!(dirty_pages(&direct).unwrap(), 0, "O_DIRECT leaves no dirty pages");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// LMCache's checkpoint interval against the kernel's writeback delay: flagged once a few
/// intervals were seen and a dirty page may wait that long (or forever), not otherwise.
#[test]
fn a_checkpoint_interval_the_writeback_delay_reaches_is_flagged() {
    let hour = Some(Duration::from_secs(3600));
    for (delay, flagged) in [(hour, true), (None, true), (Some(Duration::ZERO), false)] {
        let mut r = Rig::new(SLOTS, META, true);
        r.w.cfg.writeback = WritebackDelay::Fixed(delay);
        let risks = |r: &mut Rig, n: usize| -> Vec<bool> {
            (0..n)
                .map(|_| {
                    let k = r.new_key(false);
                    r.put(k).unwrap();
                    r.checkpoint();
                    r.step();
                    r.w.publish();
                    r.w.published_json()["writeback_risk"].as_bool().unwrap()
                })
                .collect()
        };
        // Four intervals after five checkpoints; the check waits for three.
        let want: Vec<bool> = (0..5).map(|i| flagged && i >= 3).collect();
        assert_eq!(risks(&mut r, 5), want, "delay {delay:?}");
        let v = r.w.published_json();
        assert!(v["checkpoint_interval_s"].is_number());
        assert_eq!(v["writeback_delay_s"].as_f64(), delay.map(|d| d.as_secs_f64()));
        // A new daemon finds a checkpoint on the device: the time from its start to LMCache's
        // next one is no interval of LMCache's, so three more are waited for.
        r.restart_fdpblk(true);
        r.w.cfg.writeback = WritebackDelay::Fixed(delay);
        let want: Vec<bool> = (0..4).map(|i| flagged && i >= 3).collect();
        assert_eq!(risks(&mut r, 4), want, "after a restart, delay {delay:?}");
    }
    assert_eq!(kernel_writeback_delay(3000, 500), Some(Duration::from_secs(35)));
    assert_eq!(kernel_writeback_delay(3000, 0), None);
    assert!(!writeback_outlasts_interval(Duration::from_secs(60), kernel_writeback_delay(3000, 500)));
    assert!(writeback_outlasts_interval(Duration::from_secs(30), kernel_writeback_delay(3000, 500)));
}

/// LMCache's loader takes an entry's offset and size through `int()`, so `1048576.0` or
/// `"1048576"` lists that slot to LMCache; fdpblk cannot read it as one, so such a copy is
/// unknown and deallocates nothing (before, its slots counted as unlisted and were trimmed).
#[test]
fn an_entry_offset_that_is_not_a_plain_integer_deallocates_nothing() {
    edited_checkpoints_deallocate_nothing(",\"size\"", ".0,\"size\"");
}

/// No integer equals 65536.5: LMCache discards such a copy, but what LMCache is configured
/// with is then not known, so nothing is deallocated on its word.
#[test]
fn a_geometry_field_that_is_not_a_plain_integer_deallocates_nothing() {
    edited_checkpoints_deallocate_nothing(",\"meta_total_bytes\"", ".5,\"meta_total_bytes\"");
}

/// A checkpoint LMCache wrote with another geometry confirms no slot: its offsets name
/// another layout's slots (one that happens to start where an fdpblk slot does is not that
/// slot's contents). The same puts and checkpoints with fdpblk's geometry confirm them.
#[test]
fn a_checkpoint_of_another_geometry_confirms_no_slot() {
    for conflicting in [false, true] {
        let mut r = Rig::new(SLOTS, META, true);
        let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
        for k in &keys {
            r.put(k.clone()).unwrap();
        }
        r.fillers(3);
        let ours = format!("\"slot_bytes\":{}", r.g.slot_bytes);
        let theirs = format!("\"slot_bytes\":{}", 2 * r.g.slot_bytes);
        for _ in 0..3 {
            r.checkpoint_edited(&ours, conflicting.then_some(theirs.as_str()));
        }
        let confirmed = (0..4).filter(|&s| r.slots.get(s).unwrap().confirmed).count();
        assert_eq!(confirmed, if conflicting { 0 } else { 4 }, "conflicting {conflicting}");
        assert_eq!(r.w.published_json()["trim"]["blocked_by"].is_string(), conflicting);
        if conflicting {
            // The way out, named: the flag and the config key, with LMCache's value.
            let why = r.w.published_json()["trim"]["blocked_by"].as_str().unwrap().to_string();
            let s = 2 * r.g.slot_bytes;
            assert!(why.contains(&format!("--slot-bytes {s}")) && why.contains(&format!("slot_bytes = {s}")), "{why}");
        }
    }
}

/// Confirmed slots, then two checkpoints that drop fillers, each with `from` in its JSON
/// replaced by `to`: no slot is deallocated, and every entry verifies.
fn edited_checkpoints_deallocate_nothing(from: &str, to: &str) {
    let mut r = Rig::new(SLOTS, META, true);
    r.confirmed_keys(4);
    assert!((0..4).all(|s| r.slots.get(s).unwrap().confirmed));
    for _ in 0..2 {
        r.checkpoint_edited(from, Some(to));
    }
    assert_eq!((r.trims, r.early_evictions), (0, 0));
    assert!((0..4).all(|s| r.state(s) == SlotState::Live));
    r.verify_all();
}

#[test]
fn the_start_mark_counts_only_once_its_flush_succeeded() {
    let mut r = Rig::new(SLOTS, META, true);
    let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.checkpoint();
    r.step();
    r.w.persist_now(true, true).unwrap();
    // The unclean superblock is written and reads back, but no flush makes it durable: a
    // lost drive cache would bring the clean state back, so the mark is not done.
    r.dev.set_fail_flushes(Some(0));
    let mut w = Watcher::new(r.g, Arc::new(SlotTable::new(r.g.max_slots)), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    assert!(w.unclean_error().is_some());
    w.persist_now(false, false).unwrap_err();
    assert!(w.unclean_error().is_some());
    r.dev.set_fail_flushes(None);
    w.persist_now(false, false).unwrap();
    assert!(w.unclean_error().is_none());
}

#[test]
fn a_clean_state_of_another_layout_is_marked_in_use_where_this_one_does_not_fit() {
    let mut r = Rig::new(SLOTS, META, true);
    let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.checkpoint();
    r.step();
    r.w.persist_now(true, true).unwrap();
    // A run whose state does not fit the region keeps it in memory, but still marks the
    // clean state there in use: a later run of the old layout must not trust it.
    let small = Region { offset: r.region.offset, len: 2 * crate::persist::BLOCK };
    let w = Watcher::new(r.g, Arc::new(SlotTable::new(r.g.max_slots)), r.dev.clone(), r.cfg.clone(), Some(small), OWN);
    assert!(w.unclean_error().is_none());
    let again = Watcher::new(r.g, Arc::new(SlotTable::new(r.g.max_slots)), r.dev.clone(), r.cfg.clone(), Some(r.region), OWN);
    assert!(again.loaded().found && !again.loaded().clean);
}

/// "Unwritten slots": on a device fdpblk takes for the first time, the slots LMCache has not
/// written go once LMCache committed a checkpoint with fdpblk's layout; written ones stay.
#[test]
fn unwritten_slots_go_once_lmcache_checkpoints_with_fdpblks_layout() {
    let mut r = Rig::new_with(SLOTS, META, true, true, true);
    // What a benchmark's fill left: LMCache never lists or writes it.
    for s in 4..SLOTS {
        r.dev.poke(r.g.slot_offset(s), &vec![0xa5; r.g.slot_bytes as usize]);
    }
    let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.step();
    assert_eq!(r.w.reclaimed(), 0, "not before LMCache committed a checkpoint through fdpblk");
    r.checkpoint();
    r.step();
    assert_eq!(r.w.reclaimed(), SLOTS - 4);
    assert!((4..SLOTS).all(|s| life::state(r.slots.life(s)) == SlotState::Trimmed));
    for s in 4..SLOTS {
        assert!(r.dev.peek(r.g.slot_offset(s), r.g.slot_bytes as usize).iter().all(|&b| b == 0), "slot {s} still holds the fill");
    }
    r.verify_all();
    // Slots LMCache takes later are written, never unwritten: nothing more goes that way.
    r.fillers(3);
    r.checkpoint();
    r.step();
    assert_eq!(r.w.reclaimed(), SLOTS - 4);
    r.verify_all();
}

/// The marks survive a clean restart only; after a crash (or where writes went unseen) they
/// are dropped, so a later clean start cannot trust them.
#[test]
fn unwritten_marks_survive_a_clean_restart_only() {
    for clean in [true, false] {
        let mut r = Rig::new_with(SLOTS, META, true, true, true);
        r.recovery_marks_orphans = false;
        let k = r.new_key(false);
        r.put(k).unwrap();
        r.restart_fdpblk(clean);
        r.checkpoint();
        r.step();
        assert_eq!(r.w.reclaimed(), if clean { SLOTS - 1 } else { 0 }, "clean {clean}");
        r.restart_fdpblk(true);
        r.checkpoint();
        r.step();
        assert_eq!(r.w.reclaimed(), 0, "clean {clean}: the first run took them all, or none were marked");
        r.verify_all();
    }
}

/// A LMCache whose checkpoint has another layout keeps its containers elsewhere, perhaps in
/// what fdpblk takes for a slot: nothing unwritten goes.
#[test]
fn no_unwritten_slot_goes_while_lmcaches_layout_differs() {
    let mut r = Rig::new_with(SLOTS, META, true, true, true);
    let k = r.new_key(false);
    r.put(k).unwrap();
    assert!(r.snapshot());
    let c = r.lmc.ckpt.as_mut().unwrap();
    let json = String::from_utf8(c.json.clone()).unwrap().replace(&format!("\"slot_bytes\":{}", r.g.slot_bytes), &format!("\"slot_bytes\":{}", 2 * r.g.slot_bytes));
    c.json = json.into_bytes();
    r.ckpt_payload();
    r.ckpt_header();
    r.step();
    assert_eq!(r.w.reclaimed(), 0);
    assert!(!r.w.trims_allowed());
}

#[test]
fn a_reclaim_run_is_at_most_256_mib() {
    assert_eq!(reclaim_run_slots(2048), RECLAIM_RUN_SLOTS);
    assert_eq!(reclaim_run_slots(1 << 20), 256);
    assert_eq!(reclaim_run_slots(16 << 20), 16);
    assert_eq!(reclaim_run_slots(32 << 20), 8);
    assert_eq!(reclaim_run_slots(80 << 20), 3);
    assert_eq!(reclaim_run_slots(512 << 20), 1);
}

/// Unwritten slots go in runs, at most `trim_per_round` requests a round; the next round
/// follows at once and goes on where the last one stopped, without a sweep of the table.
#[test]
fn unwritten_slots_go_in_runs_a_bounded_number_a_round() {
    let n = 3 * RECLAIM_RUN_SLOTS + 10;
    let mut r = Rig::new_with(n, META, true, true, true);
    r.w.cfg.trim_per_round = 2;
    let k = r.new_key(false);
    r.put(k).unwrap();
    r.checkpoint();
    r.step();
    // Slot 0 holds the put; 1..n are one stretch, cut into runs of RECLAIM_RUN_SLOTS.
    assert_eq!(r.w.reclaimed(), 2 * RECLAIM_RUN_SLOTS);
    assert_eq!(r.slot_discards, 2, "runs of {RECLAIM_RUN_SLOTS} slots");
    assert!(r.w.trim_backlog(), "the next round follows at once");
    assert_eq!(r.w.next_wakeup(), Duration::ZERO);
    assert_eq!(r.w.reclaim_cursor, Some(2 * RECLAIM_RUN_SLOTS + 1));
    r.step();
    assert_eq!(r.w.reclaimed(), n - 1);
    assert_eq!(r.slot_discards, 4);
    assert_eq!(r.w.reclaim_cursor, None, "one pass takes them all");
    assert!(!r.w.trim_backlog());
    r.verify_all();
}

/// A failed flush before unwritten slots go, or a failed deallocation of them, pauses them
/// until LMCache's next checkpoint, not a round at once after another.
#[test]
fn a_failure_pauses_unwritten_slots_until_the_next_checkpoint() {
    for flush in [true, false] {
        let mut r = Rig::new_with(SLOTS, META, true, true, true);
        let k = r.new_key(false);
        r.put(k).unwrap();
        if !flush {
            r.w.reclaim_error_epoch = Some(r.slots.epoch() + 1);
        }
        r.checkpoint();
        r.dev.set_fail_flushes(flush.then_some(0));
        r.step();
        assert_eq!(r.w.reclaimed(), 0, "flush {flush}");
        assert!(!r.w.trim_backlog(), "flush {flush}: no busy loop of failures");
        r.dev.set_fail_flushes(None);
        r.w.need_sweep = true;
        r.step();
        assert_eq!(r.w.reclaimed(), 0, "flush {flush}: paused in the epoch of the failure");
        r.checkpoint();
        r.step();
        assert_eq!(r.w.reclaimed(), SLOTS - 1, "flush {flush}: the next checkpoint resumes");
        r.verify_all();
    }
}

/// README lists every field of `stats --json` that the state thread publishes: a field added
/// here without a line there fails.
#[test]
fn readme_lists_every_published_stats_field() {
    let (mut r, _) = rig_with_keys(4, 1);
    r.checkpoint();
    r.step();
    r.w.publish();
    let missing = crate::test_fixtures::stats_fields_missing_from_readme(&r.w.published_json());
    assert!(missing.is_empty(), "README's `stats --json` paragraph lacks {missing:?}");
}

/// A checkpoint header fdpblk does not read (LMCache configured with another version) keeps
/// the read-back pending, and so deallocation off: the warning names what the header is.
#[test]
fn a_container_header_of_another_version_is_named() {
    let mut r = Rig::new(SLOTS, META, true);
    r.checkpoint();
    r.step();
    let written = Geometry::copy_for_seq(1);
    assert_eq!(r.w.container_header_error(written), None, "LMCache's checkpoint");
    let copy = 1 - written;
    assert_eq!(r.w.container_header_error(copy).as_deref(), Some("no LMCIDX01 magic"), "never written");
    let mut h = CheckpointHeader::encode_for(9, b"{}", BA as usize);
    h[8..12].copy_from_slice(&2u32.to_le_bytes());
    r.dev.poke(r.g.container_offset(copy), &h);
    assert_eq!(r.w.container_header_error(copy).as_deref(), Some("checkpoint header version 2, expected 1"));
}

/// A checkpoint that says LMCache's capacity grew past fdpblk's layout (LMCache does not check
/// it when it loads) is noted, once per value; LMCache's listing still rules deallocation.
#[test]
fn a_larger_capacity_in_lmcaches_checkpoint_is_noted() {
    let mut r = Rig::new(SLOTS, META, true);
    let cap = r.g.capacity_bytes;
    let keys: Vec<String> = (0..4).map(|_| r.new_key(false)).collect();
    for k in &keys {
        r.put(k.clone()).unwrap();
    }
    r.checkpoint();
    r.step();
    assert_eq!(r.w.capacity_warned, None, "LMCache's own capacity");
    for k in &keys[..2] {
        r.delete_key(k);
        r.checkpoint_saying_capacity(cap * 2);
        r.step();
        assert_eq!(r.w.capacity_warned, Some(cap * 2));
    }
    assert!(r.trims > 0, "the evicted slot is deallocated as usual");
    r.verify_all();
}

/// The longest payload a checkpoint lists per slot: in any entry order, a slot listed again
/// keeps its longest, and a slot not listed has none; its size follows the entries, not the
/// layout's slot count.
#[test]
fn listed_lengths_keep_the_longest_per_slot_in_bounded_memory() {
    let mut l = super::ListedLens::default();
    for (slot, n) in [(7, 100), (3, 5), (7, 4000), (1 << 27, u32::MAX), (7, 50), (0, 1)] {
        l.note(slot, n);
    }
    l.finish();
    assert_eq!([l.get(0), l.get(3), l.get(7), l.get(1 << 27)], [1, 5, 4000, u32::MAX]);
    assert_eq!([l.get(1), l.get(8)], [0, 0], "not listed");
    assert_eq!(l.get(u64::MAX), u32::MAX, "past any layout: protected whole");
    assert_eq!(l.entries.len(), 4, "one entry per slot");
    // One slot listed a million times (a crafted checkpoint): merged as it goes, the longest kept.
    let mut l = super::ListedLens::default();
    for i in 0..1_000_000u32 {
        l.note(u64::from(i % 3), i);
        assert!(l.entries.len() <= super::ListedLens::FIRST_MERGE, "{} entries for 3 slots", l.entries.len());
    }
    l.finish();
    assert_eq!([l.get(0), l.get(1), l.get(2)], [999_999, 999_997, 999_998]);
    assert_eq!(l.entries.len(), 3);
}
