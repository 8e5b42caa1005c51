//! The device's layout, known from the start or learned from LMCache's first checkpoint.
//!
//! `fdpblk add --layout auto` on a device with no LMCache checkpoint and without the geometry
//! flags cannot classify anything yet: LMCache has not told where its slots are. The device
//! then starts *learning*: every request is served unclassified and every write goes to the
//! policy's handle for bytes outside the layout (the drive's default handle for the shipped
//! policies). A learner thread looks for LMCache's first checkpoint (it is written within
//! LMCache's checkpoint interval once there is anything to checkpoint) and, once one is
//! valid on the drive (header, CRC and JSON, exactly as LMCache's loader would take it) and
//! the other copy is not one being written (a header whose JSON fails its CRC), sets the
//! layout: each queue switches to a classifying pipeline at its next request and the state
//! thread starts.
//!
//! Why the checkpoint and not the first slot headers: a header tells where one slot starts,
//! not `slot_bytes`, `meta_total_bytes`, `header_bytes` or `block_align` (LMCache's batches
//! write slots out of order, and the first one need not be slot 0 on a reused device); a
//! layout guessed from them and later contradicted would have placed, stamped and deallocated
//! by the wrong slot boundaries. The checkpoint carries every field LMCache itself checks.
//!
//! What is lost by learning rather than being told: placement of the writes before the
//! switch, and the slot table's record of the slots written then (their headers were never
//! seen), so those slots are neither confirmed nor deallocated until LMCache writes them again.
//! Explicit flags (`--slot-bytes`, `--meta-total-bytes`) avoid both.

use crate::device::ReadAt;
use crate::layout::discover::{discover, DiscoverError, GeometryFlags};
use crate::layout::Geometry;
use crate::persist::dev::StateWriter;
use crate::pipeline::{Pipeline, PipelineCounters};
use crate::place::{Handle, SharedPolicy};
use crate::slot_table::SlotTable;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::{Acquire, Relaxed, Release}};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The layout once known, with the slot table sized for it.
pub struct Known {
    pub geometry: Geometry,
    pub slots: Arc<SlotTable>,
}

/// What every queue and the stats writer share about the layout.
pub struct LayoutCell {
    known: OnceLock<Known>,
    policy: SharedPolicy,
    /// The counters of every pipeline built so far (for stats).
    counters: Mutex<Vec<Arc<PipelineCounters>>>,
    /// The policy's handle for bytes outside LMCache's layout (the same for every write): where
    /// unclassified writes go while learning, and Write Zeroes always (tools other than
    /// LMCache send those: `blkdiscard -z`, mkfs).
    pub learning_handle: Handle,
    /// Writes served while learning (requests, bytes).
    pub learning_writes: AtomicU64,
    pub learning_bytes: AtomicU64,
    /// Writes, discards and write-zeroes served while learning that have completed (failed
    /// ones too: part of one may have landed). The learner looks again only when this moved:
    /// nothing else changes the device.
    learning_done: AtomicU64,
    /// Writes, discards and write-zeroes that began while learning: once the layout is set,
    /// the learner waits for `learning_done` to reach it before it reads the checkpoint
    /// containers again ([`Self::wait_learning_drained`]).
    learning_started: AtomicU64,
    /// Why the learned layout was refused, if it was.
    refused: Mutex<Option<String>>,
    /// A checkpoint copy the learner has found half-written for long (which, since when):
    /// LMCache crashed writing it, and nothing is learned until its next checkpoint.
    half_written: Mutex<Option<(u8, Instant)>>,
}

impl LayoutCell {
    pub fn new(policy: SharedPolicy, learning_handle: Handle) -> Self {
        LayoutCell {
            known: OnceLock::new(),
            policy,
            counters: Mutex::new(Vec::new()),
            learning_handle,
            learning_writes: AtomicU64::new(0),
            learning_bytes: AtomicU64::new(0),
            learning_done: AtomicU64::new(0),
            learning_started: AtomicU64::new(0),
            refused: Mutex::new(None),
            half_written: Mutex::new(None),
        }
    }

    /// The one policy of all the device's pipelines.
    pub fn policy(&self) -> &SharedPolicy {
        &self.policy
    }

    pub fn known(&self) -> Option<&Known> {
        self.known.get()
    }

    /// Sets the layout (once; a second call is ignored and returns false).
    pub fn set(&self, known: Known) -> bool {
        let ok = self.known.set(known).is_ok();
        if ok {
            self.clear_refusal();
            self.half_written(None);
        }
        ok
    }

    /// Notes the copy found half-written for long (since `since`), or that none is.
    pub fn half_written(&self, copy: Option<(u8, Instant)>) {
        *self.half_written.lock().unwrap_or_else(|e| e.into_inner()) = copy;
    }

    /// A classifying pipeline for one queue, once the layout is known; the queue counts each
    /// request once served ([`Pipeline::count_when_served`]).
    pub fn pipeline(&self) -> Option<Pipeline> {
        let k = self.known.get()?;
        let mut p = Pipeline::with_slots(k.geometry, Box::new(self.policy.clone()), k.slots.clone());
        p.count_when_served();
        self.counters.lock().unwrap_or_else(|e| e.into_inner()).push(p.counters().clone());
        Some(p)
    }

    pub fn counters(&self) -> Vec<Arc<PipelineCounters>> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Counts a write served before the layout was known.
    pub fn note_learning_write(&self, bytes: u64) {
        self.learning_writes.fetch_add(1, Relaxed);
        self.learning_bytes.fetch_add(bytes, Relaxed);
    }

    /// Counts a write (discard, write-zeroes) served while learning that completed, with or
    /// without an error.
    pub fn note_learning_done(&self) {
        self.learning_done.fetch_add(1, Release);
    }

    /// How many writes, discards and write-zeroes served while learning have completed.
    pub fn learning_done(&self) -> u64 {
        self.learning_done.load(Acquire)
    }

    /// Counts a write, discard or write-zeroes that may be served while learning, before the
    /// queue looks for the layout: with the fence, and the learner's after its `set`, either
    /// the queue finds the layout or the learner's wait counts the request (a request counted
    /// and then classified is counted done at once).
    pub fn note_learning_started(&self) {
        self.learning_started.fetch_add(1, Release);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits, after the layout was set, until every write that began while learning has
    /// completed (a queue held in a controller reset can hold one for many seconds), at most
    /// `limit` or until `stop`; true when they all have. Such a write raises no event of the
    /// classified path, so the containers are read again only after it.
    pub fn wait_learning_drained(&self, limit: std::time::Duration, stop: &std::sync::atomic::AtomicBool) -> bool {
        let start = Instant::now();
        // Pairs with `note_learning_started`'s fence: the layout set before it is seen by
        // every request counted after.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        loop {
            if self.learning_done.load(Acquire) >= self.learning_started.load(Acquire) {
                return true;
            }
            if stop.load(Relaxed) || start.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    pub fn refuse(&self, why: String) {
        *self.refused.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    /// What refused the layout is gone; learning goes on.
    pub fn clear_refusal(&self) {
        *self.refused.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// `layout` in `fdpblk stats`.
    pub fn to_json(&self, learned: bool) -> serde_json::Value {
        let state = match (self.known.get(), learned) {
            (None, _) => "learning",
            (Some(_), true) => "learned",
            (Some(_), false) => "given",
        };
        serde_json::json!({
            "state": state,
            "writes_before_layout": self.learning_writes.load(Relaxed),
            "bytes_before_layout": self.learning_bytes.load(Relaxed),
            "refused": *self.refused.lock().unwrap_or_else(|e| e.into_inner()),
            "half_written": self.half_written.lock().unwrap_or_else(|e| e.into_inner())
                .map(|(copy, since)| serde_json::json!({"copy": copy, "for_s": since.elapsed().as_secs()})),
        })
    }
}

/// The exported part of the backing device, through the state thread's device access.
pub struct ExportedReader<'a> {
    pub dev: &'a dyn StateWriter,
    pub size: u64,
}

impl ReadAt for ExportedReader<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset >= self.size {
            return Ok(0);
        }
        let n = buf.len().min((self.size - offset).min(1 << 20) as usize);
        self.dev.read_at(offset, &mut buf[..n])?;
        Ok(n)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.size)
    }
}

/// What one look for LMCache's layout found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Looked {
    Layout(Geometry),
    /// No valid checkpoint yet.
    Nothing,
    /// A valid checkpoint, but this copy's header is there and its JSON fails its CRC.
    HalfWritten(u8),
}

/// One look for LMCache's layout on the device: `Ok(None)` while there is no valid checkpoint
/// yet, `Err` when there is one that the flags contradict (a one-line message with the fix).
pub fn look(dev: &dyn ReadAt, flags: &GeometryFlags) -> Result<Option<Geometry>, String> {
    look_why(dev, flags).map(|l| match l {
        Looked::Layout(g) => Some(g),
        _ => None,
    })
}

/// [`look`], saying why nothing was found.
pub fn look_why(dev: &dyn ReadAt, flags: &GeometryFlags) -> Result<Looked, String> {
    match discover(dev, flags) {
        // A copy whose header is there but whose JSON fails its CRC is, on a device LMCache is
        // writing, a checkpoint on its way (header and payload land in any order), maybe of a
        // new layout: the valid other copy may be an earlier run's, of another layout
        // (reference §4.1). Look again once it is whole; then both decide, as at `add`.
        Ok(d) => match d.copies.as_ref().and_then(|c| c.iter().find(|c| c.header.is_ok() && c.crc_ok == Some(false))) {
            Some(c) => Ok(Looked::HalfWritten(c.copy)),
            None => Ok(Looked::Layout(d.geometry)),
        },
        Err(DiscoverError::NoCheckpoint { .. }) => Ok(Looked::Nothing),
        // A read error or a torn copy now may be a checkpoint on its way: look again later.
        Err(DiscoverError::Io(_)) => Ok(Looked::Nothing),
        // A damaged copy LMCache skips; its first checkpoint overwrites it.
        Err(DiscoverError::DamagedCopy { .. }) => Ok(Looked::Nothing),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Op;
    use crate::layout::discover::discover;
    use crate::place::KeyAwarePolicy;
    use crate::pipeline::{HeaderWait, Request};
    use crate::test_fixtures::fixture;

    fn fixture_image() -> Vec<u8> {
        fixture("object-evict").0
    }

    #[test]
    fn learns_the_layout_of_a_real_lmcache_device_once_its_checkpoint_is_there() {
        // A real LMCache device image: before its checkpoint is there, nothing is learned;
        // with it, the layout is exactly what discovery reads at `fdpblk add`.
        let img = fixture_image();
        let want = discover(&img, &GeometryFlags::default()).unwrap().geometry;
        let mut blank = img.clone();
        let first_block = (want.block_align as usize).min(blank.len());
        blank[..first_block].fill(0); // copy 0's header not written yet
        if want.container_bytes as usize + first_block <= blank.len() {
            let c1 = want.container_offset(1) as usize;
            blank[c1..c1 + first_block].fill(0);
        }
        assert_eq!(look(&blank, &GeometryFlags::default()).unwrap(), None);
        assert_eq!(look(&img, &GeometryFlags::default()).unwrap(), Some(want));
        // A flag that contradicts the checkpoint is refused with the fix.
        let bad = GeometryFlags { slot_bytes: Some(want.slot_bytes * 2), ..Default::default() };
        let e = look(&img, &bad).unwrap_err();
        assert!(e.contains("--slot-bytes") && e.contains("conflicts"), "{e}");
    }

    /// LMCache restarted with a new slot_bytes writes its first checkpoint into copy 0 while
    /// copy 1 still holds the old layout's, with a higher seq: half-written, copy 0 fails its
    /// CRC and copy 1 alone is valid. Learned then, the old layout would be wrong.
    #[test]
    fn a_checkpoint_being_written_is_waited_for_not_learned_past() {
        let (img, _) = fixture("object-evict");
        let size = img.len() as u64;
        let h = crate::layout::checkpoint_header::CheckpointHeader::parse(&img[..32], size).unwrap();
        let json = String::from_utf8(img[4096..4096 + h.payload_len as usize].to_vec()).unwrap().replace(r#""slot_bytes":65536"#, r#""slot_bytes":32768"#);
        let mut new = img.clone();
        new[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
        new[12..20].copy_from_slice(&1u64.to_le_bytes());
        new[28..32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
        // Its header first, half its JSON so far.
        let mut half = new.clone();
        half[4096 + json.len() / 2..4096 + json.len()].fill(0);
        assert_eq!(discover(&half, &GeometryFlags::default()).unwrap().geometry.slot_bytes, 65536, "what add's discovery takes");
        assert_eq!(look(&half, &GeometryFlags::default()).unwrap(), None);
        assert_eq!(look_why(&half, &GeometryFlags::default()).unwrap(), Looked::HalfWritten(0));
        // Whole: two layouts, refused with the flag that tells them apart, as at add.
        let e = look(&new, &GeometryFlags::default()).unwrap_err();
        assert!(e.contains("--slot-bytes"), "{e}");
        let g = look(&new, &GeometryFlags { slot_bytes: Some(32768), ..Default::default() });
        assert!(g.is_err(), "the stale copy is named for erasing: {g:?}");
        // Torn and of the same layout (a crash mid-write), it is waited for too.
        let mut torn = img.clone();
        torn[4096 + 400] ^= 1;
        assert_eq!(look(&torn, &GeometryFlags::default()).unwrap(), None);
    }

    #[test]
    fn queues_switch_to_classifying_pipelines_once_the_layout_is_set() {
        let img = fixture_image();
        let g = discover(&img, &GeometryFlags::default()).unwrap().geometry;
        let cell = LayoutCell::new(SharedPolicy::new(Box::new(KeyAwarePolicy::new())), 0);
        assert!(cell.pipeline().is_none());
        assert_eq!(cell.to_json(true)["state"], "learning");
        assert!(cell.to_json(true)["half_written"].is_null());
        // A copy the learner has found half-written for long is in stats until the layout is set.
        cell.half_written(Some((1, Instant::now() - std::time::Duration::from_secs(130))));
        let j = cell.to_json(true);
        assert_eq!((j["half_written"]["copy"].as_u64(), j["half_written"]["for_s"].as_u64().is_some_and(|s| s >= 130)), (Some(1), true));
        cell.note_learning_write(4096);
        // A write that began while learning and has not completed holds the reread back.
        let stop = std::sync::atomic::AtomicBool::new(false);
        cell.note_learning_started();
        assert!(!cell.wait_learning_drained(std::time::Duration::from_millis(20), &stop), "one in flight");
        cell.note_learning_done();
        assert!(cell.wait_learning_drained(std::time::Duration::ZERO, &stop), "all completed");
        cell.note_learning_started();
        stop.store(true, Relaxed);
        assert!(!cell.wait_learning_drained(std::time::Duration::from_secs(3600), &stop), "a stop ends the wait");
        cell.note_learning_done();
        let slots = Arc::new(SlotTable::new(g.max_slots));
        assert!(cell.set(Known { geometry: g, slots: slots.clone() }));
        assert!(!cell.set(Known { geometry: g, slots }), "the layout is set once");
        assert!(cell.to_json(true)["half_written"].is_null(), "a layout learned is no longer waited for");
        let mut q0 = cell.pipeline().unwrap();
        let _q1 = cell.pipeline().unwrap();
        assert_eq!(cell.counters().len(), 2);
        let mut segs = Vec::new();
        q0.plan(&Request { op: Op::Write, offset: g.slot_offset(0) + g.header_bytes, len: 4096, data: None }, &mut segs, HeaderWait::Expired)
            .unwrap();
        assert_eq!(cell.counters()[0].snapshot().ops[1].bytes, 0, "counted once served");
        q0.counters().served(&q0.tally(), &segs);
        assert_eq!(cell.counters()[0].snapshot().ops[1].bytes, 4096);
        assert_eq!(cell.counters()[0].snapshot().handle_bytes.iter().sum::<u64>(), 4096);
        let j = cell.to_json(true);
        assert_eq!((j["state"].as_str(), j["writes_before_layout"].as_u64(), j["bytes_before_layout"].as_u64()), (Some("learned"), Some(1), Some(4096)));
    }
}
