//! The sweep for evicted slots, their deallocation, and early evictions (zeroing the older
//! checkpoint container).
//!
//! # Early evictions
//!
//! Condition 3 keeps an evicted slot's data on the drive for one to two checkpoint intervals
//! after LMCache dropped it: the older container still lists it. With `early_evictions` (the
//! default; `--no-early-evictions`), fdpblk does not wait for LMCache to overwrite that
//! container. When
//!
//! - the container of the newest checkpoint header write this run has seen (write order, not
//!   seq order) holds a valid checkpoint with seq `n`, the other container one with seq
//!   `n - 1`, both read back, and
//! - some confirmed slot (1, 2) is listed by the other container only, or an early tail
//!   waits only because the other container lists a longer payload in its slot ("Early
//!   tails"),
//!
//! fdpblk makes the other container unloadable: after the flush of condition 3 it writes
//! that container's header block with zeroes (LMCache's load skips a block without
//! `LMCIDX01`), flushes again, and drops the block from the page cache of `/dev/ublkbN` (a
//! reader through the page cache would otherwise still see the old header). Then condition 3
//! holds for those slots, and they go by the rules of [`super`], in the same round. A LMCache
//! opening the device reads the header blocks, and a read in flight can return the old header
//! past the zeroes: no zeroing while a header block was read since the newest checkpoint was
//! read back (the early tails' gate), and a container one was read from during its zeroing
//! counts as unknown.
//!
//! That container holds nothing LMCache needs while its current process runs. Its next
//! checkpoint, `n + 1`, overwrites that container anyway, and a load takes the valid copy
//! with the highest seq, `n`. That copy was written by the process now using the device, or by
//! one before it whose checkpoint the current process loaded or ignored (it started empty).
//! What the zeroing costs is the fallback to `n - 1`, which LMCache uses only when `n` is
//! lost: a media error, a power loss that takes `n + 1` from the drive's volatile cache while
//! `n + 2` is torn, or a process that started empty (another `device_path` string) writing its
//! seq 1 over `n` before a later process with the right configuration starts. In those cases
//! LMCache starts empty instead of from `n - 1`: KV data is lost from the cache, never served
//! wrong.
//!
//! Why `n - 1` exactly: its header write has come through fdpblk and was read back, so no
//! write of it is still on its way. With buffered I/O the page cache writes back the header
//! pages of consecutive checkpoints in any order; with an older view (`n - 3`), the header of
//! `n - 1` could reach the drive after the zeroes and bring back a copy that lists the
//! deallocated slots (`an_older_checkpoint_header_written_back_late_is_waited_for`).
//!
//! Without the zeroing, deallocating while the older copy lists the slot is unsafe. A later
//! process can load that copy: after an LMCache restart that rejected its index, seq 1 goes
//! over the newer copy and the stale one has the higher seq. If that process re-puts the same
//! key into the same slot and dies between header and payload, the stale entry passes the
//! header check in front of deallocated payload
//! (`early_eviction_then_same_key_reput_torn_by_a_crash_after_a_seq_restart`).
//!
//! The zeroing must not destroy a checkpoint LMCache is writing into that container. The
//! handshake is the one of the slot trim: every write, discard or write-zeroes of a header
//! block counts itself in the container's guard before it is submitted
//! ([`SlotTable::checkpoint_header`]). fdpblk sets the guard's zeroing bit with a CAS that
//! expects the count of its last event for that container. So either LMCache's write came
//! first (the CAS fails, its event comes next), or the write sees the bit and its queue holds
//! it until the zeroes are written and flushed. If the write or the flush of the zeroes
//! fails, the container is unknown, which stops all deallocation until LMCache writes it
//! again.
//!
//! Early evictions are off where `block_align` is not a whole number of the drive's blocks
//! (zeroing the header block would take part of the JSON with it) or, on a ublk device
//! (whose page cache LMCache may write through), smaller than a page: LMCache writes a
//! checkpoint's JSON before its header, and a buffered JSON write into the header's page
//! dirties that page with the old header in it, before the zeroing; a dirty page cannot be
//! dropped, and its writeback would bring the older copy back. This holds whatever I/O
//! LMCache uses now: a LMCache restarted with buffered I/O would not be seen in time.
//!
//! Conditions 1–5 and claims A–C are in the doc of [`super`].

use super::*;

/// What a sweep found, each slot with the `life` word it saw (the trim CAS expects it).
pub(super) struct Sweep {
    /// Confirmed and listed by neither container.
    pub(super) dead: Vec<(u64, u64)>,
    /// Confirmed and listed by the older container only (early evictions).
    pub(super) early: Vec<(u64, u64)>,
    /// The newer container `early` was found against ([`Watcher::early_eviction_basis`]).
    pub(super) basis: Option<usize>,
    /// Confirmed and listed, with a stale tail not yet deallocated.
    pub(super) tails: Vec<(u64, u64)>,
}

impl Watcher {
    /// The container whose not listing a confirmed slot makes it an early eviction: the one
    /// written last in this run, when it holds a valid checkpoint whose seq is one higher than
    /// the other's (the one LMCache loads, and the newest snapshot of the process writing).
    pub(super) fn early_eviction_basis(&self) -> Option<usize> {
        if !self.cfg.early_evictions {
            return None;
        }
        let n = usize::from(self.last_written?);
        let Container::Valid(v) = &self.containers[n] else { return None };
        match &self.containers[1 - n] {
            // Only the immediate predecessor: its header write has come and gone. With an
            // older view, that header (buffered I/O writes back in any order) may still be on
            // its way and would bring back a copy listing what was deallocated.
            // (An empty one lists nothing: no slot is an early eviction then.) Both of one
            // LMCache's: a LMCache that rejected the other's index (another device_path)
            // numbers its own checkpoints from 1, and a late header of the other's could pass
            // for its predecessor.
            Container::Valid(o) if o.seq.checked_add(1) == Some(v.seq) && o.device_path == v.device_path => Some(n),
            _ => None,
        }
    }

    /// Counts slots by state, relabels confirmed ones live/evicted, and returns, when `allow`,
    /// the trim candidates (confirmed and listed by neither container) and the early evictions
    /// (confirmed, listed only by the older container), and, whether or not `allow`, the slots
    /// whose stale tail may go (confirmed, listed, tail not yet deallocated; `trim_tails`
    /// checks the rest).
    pub(super) fn sweep(&mut self, allow: bool) -> Sweep {
        let mut s = Summary::default();
        let mut out = Vec::new();
        let mut early = Vec::new();
        let mut tails = Vec::new();
        let basis = self.early_eviction_basis();
        let tails_on = self.cfg.trim_tails && self.conflict.is_none() && self.writeback_pause.is_none();
        let newest = self.containers.iter().enumerate().rev().filter_map(|(i, c)| match c {
            Container::Valid(v) => Some((i, v.seq)),
            _ => None,
        }).max_by_key(|&(_, seq)| seq).map(|(i, _)| i);
        let unknown = self.containers.iter().any(|c| matches!(c, Container::Unknown));
        for slot in 0..self.slots.len() as u64 {
            let mut l = self.slots.life(slot);
            if l & life::CONFIRMED != 0 {
                s.confirmed += 1;
                let in_newest = newest.is_some_and(|i| self.containers[i].lists(slot));
                let listed = self.containers[0].lists(slot) || self.containers[1].lists(slot);
                let want = if in_newest { SlotState::Live } else { SlotState::Evicted };
                if !unknown && life::state(l) != want {
                    let new = life::with_state(l, want);
                    if self.slots.cas_life(slot, l, new) {
                        if want == SlotState::Evicted {
                            if let Some(e) = self.slots.entry(slot) {
                                self.slots.history().insert(e.identity, e.tag);
                            }
                            self.counters.evictions = self.counters.evictions.saturating_add(1);
                            self.counters_dirty = true;
                        }
                        l = new;
                    }
                }
                if allow && !listed {
                    out.push((slot, l));
                } else if allow && l & life::TRIMMING == 0 && basis.is_some_and(|n| !self.containers[n].lists(slot)) {
                    early.push((slot, l));
                } else if tails_on
                    && listed
                    && l & (life::TAIL_DONE | life::TRIMMING) == 0
                    && !self.slots.is_orphan(slot)
                    && self.tail_of(slot).is_some()
                {
                    tails.push((slot, l));
                }
            }
            if self.slots.get(slot).is_some() {
                s.with_header += 1;
                s.by_state[life::state(l) as usize] += 1;
            }
        }
        self.summary = s;
        self.summary_at = Instant::now();
        Sweep { dead: out, early, basis, tails }
    }

    /// Deallocates the candidates (conditions 2, 4 and 5 checked per slot; see the doc of `watch`).
    pub(super) fn trim(&mut self, candidates: Vec<(u64, u64)>) -> u64 {
        let mut done = 0;
        let g = self.geom;
        let mut hdr = vec![0u8; SLOT_HEADER_PREFIX];
        let began = Instant::now();
        // Slots whose header read failed before go last, so that one bad sector does not hold
        // up every slot after it, epoch after epoch. An entry whose slot changed since (LMCache
        // wrote it) is dropped.
        self.unreadable_headers.retain(|&slot, was| life::same_but_loads(self.slots.life(slot), *was));
        let (retried, mut candidates): (Vec<_>, Vec<_>) = candidates.into_iter().partition(|(slot, _)| self.unreadable_headers.contains_key(slot));
        candidates.extend(retried);
        for (slot, l0) in candidates {
            if !self.trims_allowed() {
                break;
            }
            if done >= self.cfg.trim_per_round || began.elapsed() >= self.cfg.trim_round_time {
                self.trim_backlog = true;
                self.need_sweep = true;
                break;
            }
            let l = self.slots.life(slot);
            if !life::same_but_loads(l, l0) || l & life::CONFIRMED == 0 || l & life::TRIMMING != 0 {
                continue;
            }
            let Some(e) = self.slots.entry(slot) else { continue };
            let off = g.slot_offset(slot);
            let read = self.header_on_drive(off, &e, &mut hdr);
            if read.is_ok() {
                self.unreadable_headers.remove(&slot);
            }
            match read {
                Ok(Some(_)) => {}
                // Changed behind fdpblk's back: forget the confirmation.
                Ok(None) => {
                    self.slots.cas_life(slot, l, life::with_state(l & !life::CONFIRMED, SlotState::Unknown));
                    continue;
                }
                // A read that failed tells nothing about the slot: keep it. Failing again,
                // after the others went, it holds up nothing more.
                Err(_) if self.unreadable_headers.contains_key(&slot) => continue,
                // The first failure pauses deallocation (the drive may be failing), and the slot
                // is tried after the others from then on (its sector may be bad).
                Err(err) => {
                    if self.unreadable_headers.len() < UNREADABLE_HEADERS_MAX {
                        self.unreadable_headers.insert(slot, l);
                    }
                    if !self.trim_error {
                        tracing::warn!("device {}: reading slot {slot}'s header before deallocating it: {err}; deallocation paused until the next checkpoint", self.cfg.device);
                        self.trim_error = true;
                    }
                    self.trim_error_epoch = Some(self.seen_epoch);
                    return done;
                }
            }
            if !self.slots.cas_life(slot, l, l | life::TRIMMING) {
                continue;
            }
            // One deallocation for the whole slot. Header block first, then the rest, would
            // make a torn deallocation leave no header in front of a deallocated payload (a
            // second line: no checkpoint can list the slot), but costs more than it guards:
            // on a drive whose mapping unit is larger than the header (the simulated SSD's,
            // a large-indirection-unit QLC drive's) the rest's first unit stays mapped. Tried:
            // `tools/demo.sh`'s key-aware + trim WAF went from 1.098 to 1.106.
            let res = self.dev.discard(off, g.slot_bytes);
            self.slots.end_trim(slot, l | life::TRIMMING, res.is_ok());
            match res {
                Ok(()) => {
                    self.counters.count_trim(e.handle, g.slot_bytes);
                    self.counters_dirty = true;
                    self.summary.by_state[life::state(l) as usize] = self.summary.by_state[life::state(l) as usize].saturating_sub(1);
                    self.summary.by_state[SlotState::Trimmed as usize] += 1;
                    self.summary.confirmed = self.summary.confirmed.saturating_sub(1);
                    done += 1;
                }
                Err(err) => {
                    if !self.trim_error {
                        tracing::warn!("device {}: deallocating slot {slot}: {err}; deallocation paused until the next checkpoint", self.cfg.device);
                        self.trim_error = true;
                    }
                    self.trim_error_epoch = Some(self.seen_epoch);
                    return done;
                }
            }
        }
        self.trim_error = false;
        done
    }

    /// Flushes the drive before deallocating on the word of the checkpoints read back.
    pub(super) fn flush_checkpoints(&mut self) -> bool {
        match self.dev.flush() {
            Ok(()) => true,
            Err(err) => {
                if !self.trim_error {
                    tracing::warn!("device {}: flushing before deallocation: {err}; deallocation paused until the next checkpoint", self.cfg.device);
                    self.trim_error = true;
                }
                false
            }
        }
    }

    /// Makes the older container unloadable ("Early evictions" above): zeroes its
    /// header block, unless a write to that block was planned since this thread's view of it,
    /// with such writes held until the zeroes are durable. True when the container now holds
    /// no loadable checkpoint.
    pub(super) fn invalidate_container(&mut self, copy: u8) -> bool {
        let c = usize::from(copy);
        // A header block read since the newest checkpoint was read back (a LMCache opening
        // the device) may be in flight: it could bring the old header back past the zeroes
        // (into the page cache, or the opener's buffer). The early tails' gate.
        // One count for both looks: a read counted between two would pass both.
        let reads = self.slots.checkpoint_reads();
        if !self.layout_in_use_at(reads) {
            return false;
        }
        if !self.slots.begin_container_zeroing(copy, self.container_writes[c]) {
            return false; // LMCache is writing it: its event comes next
        }
        let g = self.geom;
        let zeroes = vec![0u8; g.block_align as usize];
        let res = self.dev.write_at(g.container_offset(copy), &zeroes, self.own_handle).and_then(|()| self.dev.flush());
        match res {
            Ok(()) => {
                self.slots.end_container_zeroing(copy);
                // A reader through the page cache (a LMCache starting) must see the zeroes
                // too: if the cached block cannot be dropped, the container counts as
                // unknown, as after a failed write.
                if !self.drop_cached(g.container_offset(copy), g.block_align) {
                    self.containers[c] = Container::Unknown;
                    return false;
                }
                // A header read planned meanwhile may have read the old header: the zeroes
                // are durable, but what that reader loads is not known.
                if self.slots.checkpoint_reads() != reads {
                    self.containers[c] = Container::Unknown;
                    return false;
                }
                self.containers[c] = Container::Empty;
                self.invalidations += 1;
                true
            }
            Err(err) => {
                // The zeroes may or may not be on the drive, durable or not: the container is
                // unknown (no deallocation) until LMCache writes it again.
                self.slots.end_container_zeroing(copy);
                self.containers[c] = Container::Unknown;
                if !self.trim_error {
                    tracing::warn!("device {}: zeroing the older checkpoint container: {err}; no deallocation until LMCache writes that container again", self.cfg.device);
                    self.trim_error = true;
                }
                false
            }
        }
    }
}
