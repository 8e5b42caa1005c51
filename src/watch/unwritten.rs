//! Unwritten slots: deallocating the slots LMCache has not written on a drive fdpblk takes for
//! the first time.
//!
//! # Unwritten slots
//!
//! LMCache never deallocates, and its allocator reuses freed slots before it takes new ones,
//! so on a drive that held data before (a benchmark's fill, an earlier tenant) the slots it
//! does not write keep that data valid for good: the drive copies it in garbage collection
//! and loses it as spare space. With `reclaim`, a daemon started by `add` (every write of
//! this run seen) deallocates slot `s` when, at the moment of its trim CAS:
//!
//! - R1. **never written through fdpblk**: `s` is marked *unwritten* (state `Evicted`
//!   without a confirmation). `Watcher::new` sets the mark when fdpblk first takes the device
//!   (its reserved tail holds no superblock at all; not where a state of another layout, an
//!   unreadable one, or a tail too small to save one leaves earlier runs' writes unknown),
//!   before it serves I/O, on every slot that neither container lists; any
//!   write to the slot turns its state to `Unknown`, so the mark means no write since. The
//!   marks are saved with the state: a clean stop keeps them for the next run, an unclean
//!   one (writes after the last cycle) drops them;
//! - R2. **LMCache uses fdpblk's layout**: a checkpoint LMCache committed through this run was
//!   read back with fdpblk's geometry, and no checkpoint header block was read since (the
//!   early tails' gate: LMCache opening the device again waits for its next checkpoint). A
//!   LMCache with another layout would have its own containers elsewhere, possibly inside
//!   what fdpblk takes for an unwritten slot;
//! - conditions 3 and 4 hold (listed by neither container, contents durable; nothing pending).
//!
//! *Claim D.* Let `P` be the LMCache process using the device. Every write of `P` came
//! through fdpblk, in this run or (across clean restarts, or if `P` outlived a `del`) in
//! earlier runs whose state this one loaded. `P`'s index is a loaded checkpoint plus `P`'s
//! puts less its deletes. A put of `P` into `s` would have written `s` (R1), in flight or not. Through its load: the loaded checkpoint listed `s` and was in a container, and while
//! `s` stays in `P`'s index every snapshot `P` writes lists it; for neither container to list
//! it now, `P` must have deleted it. A later process loads one of the two containers. The
//! trim CAS closes the race with a put into `s` as claim C says. Condition 5 is not needed:
//! no index names `s`, whatever it holds.
//!
//! Conditions 1–5 and claims A–C are in the doc of [`super`].

use super::*;

/// Marked unwritten (R1): `Evicted` without a confirmation, not being trimmed. Any write
/// makes the state `Unknown`.
fn is_unwritten(l: u64) -> bool {
    life::state(l) == SlotState::Evicted && l & (life::CONFIRMED | life::TRIMMING) == 0
}

impl Watcher {
    /// Marks the slots that neither container lists and no checkpoint confirmed as unwritten
    /// (R1 of "Unwritten slots"): before the device serves I/O, when fdpblk first takes the
    /// device (its reserved tail read, and no superblock there) and both containers are known.
    pub(super) fn mark_unwritten(&mut self) {
        // A clean state's marks still hold: its run's last cycle saved every write's `Unknown`.
        // An unclean one's may not (writes after its last cycle), nor may any where this run
        // served writes the table did not see: drop them, whether this run reclaims or not (a
        // later clean start would trust them).
        let stale = !self.loaded.clean || self.cfg.writes_unseen || !self.cfg.trust_saved_confirmations;
        if self.loaded.found && stale {
            for slot in 0..self.slots.len() as u64 {
                let l = self.slots.life(slot);
                if is_unwritten(l) {
                    self.slots.cas_life(slot, l, life::with_state(l, SlotState::Unknown));
                }
            }
        }
        // Only where no run of fdpblk saved a state here: a state of another layout, one that
        // could not be read, or persistence off leave earlier runs' writes unknown.
        if !self.cfg.reclaim || self.loaded.found || !self.loaded.none_saved {
            return;
        }
        // No saved state: no run of fdpblk served this device's LMCache before this one.
        if self.containers.iter().any(|c| matches!(c, Container::Unknown)) {
            return;
        }
        for slot in 0..self.slots.len() as u64 {
            let l = self.slots.life(slot);
            let dead = l & (life::CONFIRMED | life::TRIMMING) == 0 && !matches!(life::state(l), SlotState::Trimmed | SlotState::Evicted);
            if dead && !self.containers[0].lists(slot) && !self.containers[1].lists(slot) {
                self.slots.cas_life(slot, l, life::with_state(l, SlotState::Evicted));
            }
        }
    }

    /// R2 of "Unwritten slots": LMCache committed a checkpoint through this run with fdpblk's
    /// geometry, and has not read a checkpoint header block since.
    pub(super) fn layout_in_use(&self) -> bool {
        self.layout_in_use_at(self.slots.checkpoint_reads())
    }

    /// [`Self::layout_in_use`] with the checkpoint-read count `reads` the caller took (and
    /// compares again later).
    pub(super) fn layout_in_use_at(&self, reads: u64) -> bool {
        self.conflict.is_none() && self.geometry_seen_at == Some(reads)
    }

    /// Whether the pass for unwritten slots may go on now: one is pending, and R2 and
    /// conditions 3 and 4 hold (the caller flushes for condition 3).
    pub(super) fn reclaim_ready(&self) -> bool {
        self.reclaim_cursor.is_some() && self.trims_allowed() && self.layout_in_use() && self.reclaim_error_epoch != Some(self.seen_epoch)
    }

    /// Goes on with the pass for unwritten slots from its cursor and deallocates those found
    /// (R1 checked per slot by the CAS, listing by neither container here). Runs of
    /// consecutive slots go in one deallocation (a fresh drive's unwritten slots are mostly
    /// one run past LMCache's bump pointer). A round ends after `trim_per_round` requests or
    /// `trim_round_time`, as the evictions' do, so that checkpoints keep being read back;
    /// the next round follows at once and goes on from there.
    pub(super) fn reclaim(&mut self) -> u64 {
        let Some(mut slot) = self.reclaim_cursor else { return 0 };
        let began = Instant::now();
        let end = self.slots.len() as u64;
        let (mut done, mut requests) = (0, 0);
        let mut run: Vec<(u64, u64)> = Vec::new();
        let run_slots = reclaim_run_slots(self.geom.slot_bytes);
        while slot < end {
            if slot.is_multiple_of(RECLAIM_SCAN_STRIDE) && began.elapsed() >= self.cfg.trim_round_time {
                break;
            }
            let l = self.slots.life(slot);
            // Marked `TRIMMING` as it joins the run: a write to it waits from here on, so a run
            // goes out as soon as the next slot does not join it, not when the scan moves on.
            let joins = (run.len() as u64) < run_slots
                && is_unwritten(l)
                && !self.containers[0].lists(slot)
                && !self.containers[1].lists(slot)
                && self.slots.cas_life(slot, l, l | life::TRIMMING);
            if joins {
                run.push((slot, l | life::TRIMMING));
                slot += 1;
                continue;
            }
            if !run.is_empty() {
                requests += 1;
                let Some(n) = self.reclaim_run(&run) else {
                    // Paused (an error, or no longer allowed): its slots stay unwritten.
                    self.reclaim_cursor = Some(run[0].0);
                    return done;
                };
                done += n;
                run.clear();
                if requests >= self.cfg.trim_per_round || began.elapsed() >= self.cfg.trim_round_time {
                    break;
                }
                // This slot again: it may start the next run (the last one was full).
                continue;
            }
            slot += 1;
        }
        let first = run.first().map(|&(s, _)| s);
        match self.reclaim_run(&run) {
            Some(n) => {
                done += n;
                self.reclaim_cursor = (slot < end).then_some(slot);
            }
            None => self.reclaim_cursor = first,
        }
        done
    }

    /// Deallocates a run of consecutive slots whose trim CAS set the `began` words; the count
    /// done, `None` after an error or when deallocation is no longer allowed.
    fn reclaim_run(&mut self, run: &[(u64, u64)]) -> Option<u64> {
        let Some(&(first, _)) = run.first() else { return Some(0) };
        let g = self.geom;
        let allowed = self.trims_allowed() && self.layout_in_use();
        let res = if allowed { self.dev.discard(g.slot_offset(first), run.len() as u64 * g.slot_bytes) } else { Err(std::io::Error::other("not allowed now")) };
        for &(slot, began) in run {
            self.slots.end_trim(slot, began, res.is_ok());
        }
        match res {
            Ok(()) => {
                self.reclaim_failing = false;
                let n = run.len() as u64;
                self.reclaimed += n;
                self.reclaimed_bytes += n * g.slot_bytes;
                for &(slot, _) in run {
                    if self.slots.get(slot).is_some() {
                        self.summary.by_state[SlotState::Evicted as usize] = self.summary.by_state[SlotState::Evicted as usize].saturating_sub(1);
                        self.summary.by_state[SlotState::Trimmed as usize] += 1;
                    }
                }
                Some(n)
            }
            Err(_) if !allowed => None,
            Err(err) => {
                // Once a streak of failures (the pass tries again at each checkpoint).
                if !self.reclaim_failing {
                    tracing::warn!("device {}: deallocating unwritten slots from {first}: {err}; paused until the next checkpoint", self.cfg.device);
                }
                self.reclaim_failing = true;
                self.reclaim_error_epoch = Some(self.seen_epoch);
                None
            }
        }
    }
}
