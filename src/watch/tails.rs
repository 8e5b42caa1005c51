//! Stale tails and early tails: the bytes a shorter put leaves behind its payload, and when
//! fdpblk deallocates them.
//!
//! # Stale tails
//!
//! A put with a shorter payload than the slot's earlier contents leaves their bytes behind the
//! new payload; the drive would keep them valid, and copy them in garbage collection, until a
//! longer payload overwrites them. Once the current contents are **confirmed** (1) and **not
//! written since** (2, the same CAS), and the header on the drive carries them (5), the
//! slot's bytes past `payload_len` rounded up to `block_align` are deallocated: no LMCache
//! process reads past that (`Watcher::trim_tails` says why). Nor may either container list
//! a payload in the slot that reaches past the current one ([`Watcher::listed_longer`]; a
//! container not read back lists everything): such an entry fails LMCache's header check
//! only while the slot's header stays the current one, and the same key put into the slot
//! again would bring it back (see "Early tails" below). The older container can list one:
//! LMCache may snapshot it before a delete and a shorter put into the slot, and write it
//! after them, so that the next checkpoint confirms the shorter put while the older one still
//! lists the longer. Such a tail waits until LMCache overwrites that container (the
//! early-tail round may zero it sooner, for a slot it still holds). Conditions 3 and 4 are not needed otherwise: a
//! container lists the slot with these contents or with contents whose header is gone.
//!
//! No tail of a slot goes, on this path or the early one, while the slot holds **orphan**
//! bytes ([`SlotTable::note_orphan`]): payload bytes that no known header expected when they
//! were placed (a payload ahead of its header after the header wait, or bytes past the
//! current payload), and, when a shorter header replaces one whose payload fdpblk never saw
//! written in full, the rest of that older payload (what lies there may be anyone's). With io_uring, and with buffered writeback, which reorders pages, they
//! may be a later put's payload whose header is still to come, while an older header arrives
//! first and would put them in its "tail". They stay until a header whose payload reaches as
//! far: the orphan bytes are then its own, or it overwrites them. (That header is taken to be
//! newer than the bytes: writeback that delivered a put's payload, then an older put's long
//! header, then a still older short one, all before the first put's header, is not covered.)
//! The marks are not persisted. A daemon that recovers a device LMCache kept open
//! (`fdpblk recover`), or that learned the layout while serving, cannot know what was written
//! unseen: it starts with every slot marked *unseen*, which counts as orphan bytes to the
//! slot's end, until a header whose payload reaches the slot's end, or until a checkpoint
//! whose snapshot LMCache took after this run began confirms the slot's contents (the
//! confirmation rule's epochs say so: the snapshot followed a write this run saw). Then any
//! put to the slot after those contents came after that snapshot, so through this run. Until
//! then its tails stay on the drive (WAF only).
//!
//! ## Early tails
//!
//! A tail can go before any checkpoint confirmed the slot, once its new header is durable and
//! a checkpoint written since was read back, because LMCache's load checks every entry against
//! the slot header on the drive.
//! The conditions, checked by the state thread's round (once a second,
//! [`Watcher::trim_early_tails`]):
//!
//! - the queue that served the header write saw it complete ([`SlotTable::header_completed`]:
//!   the slot is `HEADER_DONE`, with the same header generation), and nothing but that
//!   header's payload was written to the slot since the header was planned (any other write,
//!   such as the next put's payload ahead of its header or a buffered writeback of a later
//!   put, clears `STALE_TAIL` before the completion and `HEADER_DONE` after it);
//! - the drive was flushed after that completion, so the header survives a power loss (the
//!   confirmed path flushes too);
//! - the header on the drive carries the identity and length of the slot's record (5), and
//!   the trim CAS holds any later write to the slot until the deallocation returned;
//! - LMCache has committed a checkpoint through this run of fdpblk, with fdpblk's geometry.
//!   The checkpoints already on the drive do not tell: a LMCache restarted with a smaller
//!   slot size drops its old index and writes slots that start inside fdpblk's, so a header
//!   at an fdpblk slot start would put LMCache's next slot in its "tail". A LMCache that
//!   restarts while fdpblk keeps running first reads both containers' header blocks: any such
//!   read through fdpblk after a checkpoint's header write was planned (not after the state
//!   thread read it back) holds early tails back until the next checkpoint (with buffered
//!   I/O LMCache's own writes leave those blocks cached, so the state thread drops them from
//!   the page cache once a second: [`Watcher::drop_header_pages`]), whose geometry
//!   then either matches or conflicts (and a conflict stops all deallocation). A LMCache
//!   that reads no checkpoint when it starts (`load_checkpoint_on_init` off) gives no such
//!   sign: run fdpblk with `--no-early-tails` there, or add it again after changing
//!   LMCache's geometry;
//! - a checkpoint header written after the slot's last write has been read back, with
//!   nothing pending, and neither container lists a payload in the slot that reaches past
//!   the new one. The header check drops such an entry only while the slot's header stays the
//!   new one: the same key put into the slot again, its header landing and its payload lost
//!   in a crash (a power loss with buffered I/O, two LMCache crashes with O_DIRECT), would
//!   pass the check over bytes the tail took, where without fdpblk they still held that
//!   key's data. LMCache snapshots a checkpoint before it writes it, so the one written
//!   next after the put may still list the previous key; one written after that cannot
//!   (its snapshot followed that write, which followed the put). A tail held back by this
//!   waits in the round until the older listing is gone: LMCache overwrites that container,
//!   or fdpblk zeroes it as for an early eviction (`evictions.rs`; on the same conditions,
//!   and only when the newest checkpoint lists no longer payload there). Then no loadable
//!   checkpoint names the old contents.
//!
//! Then no LMCache process reads the tail: the current put's entry (if it commits) reads its
//! own `payload_len`; an entry for any earlier contents of the slot, in a checkpoint LMCache
//! loads after a crash, lists no longer payload, or is dropped by the header check of its
//! load (`meta_verify_on_load`, on by default). With that check off, LMCache would serve such
//! an entry from a slot whose header already names the new put and whose payload that put is
//! overwriting: fdpblk assumes the default.
//!
//! Conditions 1–5 and claims A–C are in the doc of [`super`].

use super::*;

impl Watcher {
    /// The stale tail of `slot`'s current contents, as (offset in the slot, length): from the
    /// end of its payload (rounded up to `block_align`, what LMCache's loads read) to the end
    /// of the slot. None when the payload fills the slot.
    pub(super) fn tail_of(&self, slot: u64) -> Option<(u64, u64)> {
        let e = self.slots.entry(slot)?;
        // The table keeps 32 bits of length: a longer payload's end is not known from it.
        (e.payload_len < u64::from(u32::MAX)).then(|| self.tail_after(e.payload_len)).flatten()
    }

    /// The tail of a slot whose payload is `payload_len` bytes (see [`Self::tail_of`]).
    fn tail_after(&self, payload_len: u64) -> Option<(u64, u64)> {
        let g = &self.geom;
        let start = g.payload_end(payload_len);
        (start < g.slot_bytes).then(|| (start, g.slot_bytes - start))
    }

    /// Deallocates the stale tails of confirmed slots.
    ///
    /// Why it is safe: the contents are confirmed (claim A: the put that wrote them committed,
    /// so its header write had completed) and unchanged since (the CAS), and the header on the
    /// drive carries the confirmed identity and length (read before the CAS). LMCache reads a
    /// slot's payload only through an index entry whose identity and length match the header
    /// (a loaded checkpoint's other entries are dropped by its header check), and reads
    /// `payload_len` rounded up to `block_align`: no process can read past it. No container
    /// lists a longer payload there, whose key put into the slot again would pass that check
    /// over the tail (the module doc). A put into the slot during the deallocation is held by
    /// its queue until it returned, like a slot trim.
    pub(super) fn trim_tails(&mut self, candidates: Vec<(u64, u64)>) {
        if self.tail_error_epoch == Some(self.seen_epoch) {
            return; // paused after an error until the next checkpoint
        }
        // Those a container still lists longer wait for it to change: no flush for them at
        // every sweep (checked again below, with the length on the drive).
        let candidates: Vec<(u64, u64)> = candidates
            .into_iter()
            .filter(|&(slot, _)| self.slots.entry(slot).is_some_and(|e| !self.listed_longer(slot, e.payload_len)))
            .collect();
        if candidates.is_empty() {
            return;
        }
        // The headers must be durable before their tails go (as for early tails).
        if !self.flush_for_tails() {
            return;
        }
        let g = self.geom;
        let mut hdr = vec![0u8; SLOT_HEADER_PREFIX];
        for (slot, l0) in candidates {
            let l = self.slots.life(slot);
            if !life::same_but_loads(l, l0) {
                continue;
            }
            // One snapshot of the record, checked against the header on the drive; the range
            // comes from that header's own (full-width) length.
            let Some(e) = self.slots.entry(slot) else { continue };
            if self.listed_longer(slot, e.payload_len) {
                continue; // checked again below with the drive's length; this saves the read
            }
            let off = g.slot_offset(slot);
            let Ok(Some(h)) = self.header_on_drive(off, &e, &mut hdr) else { continue };
            if self.listed_longer(slot, h.payload_len) {
                continue; // the next sweep after that container changed takes it
            }
            let Some((start, len)) = self.tail_after(h.payload_len) else { continue };
            if !self.slots.cas_life(slot, l, l | life::TRIMMING) {
                continue;
            }
            if !self.discard_tail(slot, l | life::TRIMMING, off + start, len, false) {
                return;
            }
        }
    }

    /// Deallocates the stale tails of slots whose new header's write completed since the last
    /// round, before any checkpoint confirmed them ("Early tails" above): one
    /// flush makes those headers durable, then each slot whose header is still that one
    /// and whose on-drive header carries it has its tail deallocated under the trim CAS.
    pub fn trim_early_tails(&mut self) {
        // While the gate is closed (LMCache opened the device, deallocation paused for a
        // writeback delay, or an error paused tails until the next checkpoint) the completions stay flagged and the deferred tails kept: they
        // go once the gate opens, not only when a checkpoint confirms them.
        if !self.cfg.early_tails || self.conflict.is_some() || self.writeback_pause.is_some() || self.geometry_seen_at != Some(self.slots.checkpoint_reads()) {
            return;
        }
        if self.tail_error_epoch == Some(self.seen_epoch) {
            return; // paused after an error until the next checkpoint
        }
        let mut done: Vec<(u64, Option<u16>)> = self.slots.take_completed_headers().into_iter().map(|s| (s, None)).collect();
        done.extend(std::mem::take(&mut self.deferred_tails).into_iter().map(|(s, g)| (s, Some(g))));
        if done.is_empty() {
            return;
        }
        let current = |w: &Self, slot: u64, generation: u16| {
            w.slots.get(slot).filter(|e| e.generation == generation && e.payload_len < u64::from(u32::MAX))
        };
        // The header generation whose completion set HEADER_DONE: read before and after the
        // life word (a new header stores its generation before it clears the bit). A deferred
        // one keeps the generation it was taken with.
        let mut todo: Vec<(u64, u16)> = Vec::new();
        let mut deferred_slots = std::collections::HashSet::new();
        // Every checkpoint header planned so far was taken and read back.
        let quiet = self.checkpoints_read_back();
        let basis = self.early_eviction_basis();
        let mut older_only: Vec<(u64, u16)> = Vec::new();
        for (slot, deferred) in done {
            let Some(before) = self.slots.get(slot) else { continue };
            let l = self.slots.life(slot);
            let Some(e) = current(self, slot, deferred.unwrap_or(before.generation)) else { continue };
            let ready = l & life::HEADER_DONE != 0
                && l & life::STALE_TAIL != 0
                && l & (life::TAIL_DONE | life::TRIMMING) == 0
                && !self.slots.is_orphan(slot)
                && self.tail_after(e.payload_len).is_some();
            if !ready {
                continue;
            }
            // Not before a checkpoint header written after the put was read back: LMCache
            // snapshots a checkpoint before it writes it, and the one in flight when the slot
            // was put may list the slot's previous key (see `listed_longer`).
            let read_since = quiet && life::epochs_since(life::stamp(l), self.seen_epoch) >= 1;
            if !read_since || self.listed_longer(slot, e.payload_len) {
                if read_since && basis.is_some_and(|n| !self.listed_longer_in(n, slot, e.payload_len)) {
                    // Only the older container lists the longer payload: zeroing it (below)
                    // lets the tail go a checkpoint sooner.
                    older_only.push((slot, e.generation));
                } else if deferred_slots.insert(slot) {
                    self.deferred_tails.push((slot, e.generation));
                }
                continue;
            }
            todo.push((slot, e.generation));
        }
        // The older container goes as for early evictions, on the same conditions (the newest
        // checkpoint, `n`, durable first); otherwise those tails wait.
        if !older_only.is_empty() {
            let zeroed = match basis {
                Some(n) if self.trims_allowed() => {
                    if self.flush_checkpoints() {
                        self.invalidate_container(1 - n as u8)
                    } else {
                        self.tail_error_epoch = Some(self.seen_epoch); // as flush_for_tails
                        false
                    }
                }
                _ => false,
            };
            if zeroed {
                todo.extend(older_only.iter().copied().filter(|&(slot, g)| current(self, slot, g).is_some_and(|e| !self.listed_longer(slot, e.payload_len))));
            } else {
                self.deferred_tails.extend(older_only.iter().copied().filter(|&(slot, _)| deferred_slots.insert(slot)));
            }
        }
        if todo.is_empty() {
            return;
        }
        // Every header in `todo` completed before this flush, so the flush makes it durable.
        // After an error the rest wait in `deferred_tails` for the pause to end: their
        // completions are taken, and no later round would see them again.
        if !self.flush_for_tails() {
            self.deferred_tails.extend(todo);
            return;
        }
        let g = self.geom;
        let mut hdr = vec![0u8; SLOT_HEADER_PREFIX];
        let mut todo = todo.into_iter();
        while let Some((slot, generation)) = todo.next() {
            let Some(e) = current(self, slot, generation) else { continue };
            let off = g.slot_offset(slot);
            let h = match self.header_on_drive(off, &e, &mut hdr) {
                Ok(Some(h)) => h,
                Ok(None) => continue, // not this header on the drive: nothing to cut
                // As a failed deallocation: paused until the next checkpoint, then again.
                Err(err) => {
                    self.pause_tails(format_args!("reading slot {slot}'s header before deallocating its stale tail: {err}"), false);
                    self.deferred_tails.push((slot, generation));
                    self.deferred_tails.extend(todo);
                    return;
                }
            };
            let Some((start, len)) = self.tail_after(h.payload_len) else { continue };
            // The life word changes with stamps too (a load does not fail the CAS): retry
            // while nothing but payload was written since the header completed (a write past
            // the payload, such as the next put's payload ahead of its header, clears
            // HEADER_DONE).
            let mut began = None;
            for _ in 0..8 {
                let l = self.slots.life(slot);
                if l & life::HEADER_DONE == 0 || l & life::STALE_TAIL == 0 || l & (life::TAIL_DONE | life::TRIMMING) != 0 {
                    break;
                }
                if self.slots.cas_life(slot, l, l | life::TRIMMING) {
                    began = Some(l | life::TRIMMING);
                    break;
                }
            }
            let Some(began) = began else { continue };
            // A header recorded before the CAS changed the generation (its HEADER_DONE, if any,
            // may postdate the flush): not ours to cut.
            if current(self, slot, generation).is_none() {
                self.slots.end_tail_trim(slot, began, false);
                continue;
            }
            if !self.discard_tail(slot, began, off + start, len, true) {
                self.deferred_tails.push((slot, generation));
                self.deferred_tails.extend(todo);
                return;
            }
        }
    }

    /// True when a checkpoint LMCache may load lists in `slot` a payload that ends past one of
    /// `payload_len`. Its entry fails LMCache's header check only while the slot's header
    /// stays the new one: the same key put into the slot again (its header first, its payload
    /// lost in a crash) would pass it over the bytes an early tail deallocated, where without
    /// fdpblk they still held that key's data. Such a tail waits in the round until no
    /// container lists the longer payload (see [`Watcher::trim_early_tails`]).
    pub(super) fn listed_longer(&self, slot: u64, payload_len: u64) -> bool {
        (0..2).any(|c| self.listed_longer_in(c, slot, payload_len))
    }

    /// [`Watcher::listed_longer`] for container `c` alone.
    fn listed_longer_in(&self, c: usize, slot: u64, payload_len: u64) -> bool {
        // A container whose new payload came without its header yet lists, once that header
        // lands, what LMCache snapshotted: anything, as far as fdpblk knows.
        if self.awaiting_header[c] {
            return true;
        }
        // The tail starts where this payload's last block ends; a listed one reaches to its own.
        let ours = self.geom.payload_end(payload_len);
        self.containers[c].listed_len(slot).is_some_and(|len| self.geom.payload_end(len) > ours)
    }

    /// The slot header at `off` on the drive, when it carries `e`'s identity and length
    /// (condition 5; the table keeps 32 bits of length).
    pub(super) fn header_on_drive(&self, off: u64, e: &SlotEntry, buf: &mut [u8]) -> std::io::Result<Option<SlotHeader>> {
        self.dev.read_at(off, buf)?;
        Ok(SlotHeader::parse(buf)
            .ok()
            .filter(|h| h.identity == e.identity && h.payload_len.min(u64::from(u32::MAX)) == e.payload_len))
    }

    /// Flushes the drive so that the headers of the tails about to go are durable; on an
    /// error, tails pause until the next checkpoint. False when they must not go.
    fn flush_for_tails(&mut self) -> bool {
        match self.dev.flush() {
            Ok(()) => true,
            Err(err) => {
                self.pause_tails(format_args!("flushing before deallocating stale tails: {err}"), true);
                false
            }
        }
    }

    /// Deallocates the stale tail `[off, off + len)` of `slot`, whose trim CAS set `began`,
    /// and counts it; false after an error (tails pause until the next checkpoint).
    fn discard_tail(&mut self, slot: u64, began: u64, off: u64, len: u64, early: bool) -> bool {
        let res = self.dev.discard(off, len);
        self.slots.end_tail_trim(slot, began, res.is_ok());
        match res {
            Ok(()) => {
                self.tail_trims += 1;
                self.early_tail_trims += u64::from(early);
                self.tail_trim_bytes += len;
                true
            }
            Err(err) => {
                self.pause_tails(format_args!("deallocating the stale tail of slot {slot}: {err}"), false);
                false
            }
        }
    }

    /// Pauses stale tails until the next checkpoint after an error, saying so (`always`, or
    /// only for the first error of this daemon: a failing drive repeats it per slot).
    fn pause_tails(&mut self, what: std::fmt::Arguments<'_>, always: bool) {
        if always || self.tail_error_epoch.is_none() {
            tracing::warn!("device {}: {what}; paused until the next checkpoint", self.cfg.device);
        }
        self.tail_error_epoch = Some(self.seen_epoch);
    }
}
