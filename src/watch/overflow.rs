//! The checkpoint-overflow alarm: LMCache's next checkpoint JSON estimated against the container
//! it has to fit (past it LMCache stops checkpointing, and a restart loses what it wrote since).

use super::*;

/// Why a checkpoint that still fits is late, and its fix.
const IDLE_RULE: &str = "LMCache writes a checkpoint only when no I/O has been in flight for 100 ms at its tick (meta_checkpoint_interval_sec, 60 s by default), so continuous traffic defers it; fix: leave LMCache idle moments, or lower meta_checkpoint_interval_sec";

impl Watcher {
    /// The estimated size of LMCache's next checkpoint: entries of the newest committed one
    /// plus every put since (deletes are not visible, so it errs high), at most one per slot
    /// (puts into slots that evictions freed replace entries), times the observed bytes per
    /// entry.
    pub fn estimate(&self) -> Option<Estimate> {
        let c = self.baseline();
        let puts = self.slots.header_writes().saturating_sub(c.puts_at);
        let entry_bytes = if c.entries > 0 { c.payload_len.saturating_sub(c.fixed_bytes).max(1) as f64 / c.entries as f64 } else { DEFAULT_ENTRY_BYTES };
        let entries = c.entries.saturating_add(puts).min(self.lmcache_slots().max(c.entries));
        Some(Estimate { entries, bytes: c.fixed_bytes + (entries as f64 * entry_bytes).ceil() as u64, cap: self.geom.payload_cap(), entry_bytes })
    }

    /// The most entries LMCache's index can hold: one per slot of its layout, which a larger
    /// `capacity_bytes` in its checkpoint than fdpblk's (warned about) makes larger.
    fn lmcache_slots(&self) -> u64 {
        let g = &self.geom;
        let theirs = self.capacity_warned.map_or(0, |c| c.saturating_sub(g.meta_total_bytes) / g.slot_bytes.max(1));
        g.max_slots.max(theirs)
    }

    /// The newest committed checkpoint, or an empty one when fdpblk started.
    fn baseline(&self) -> Commit {
        self.commit.clone().unwrap_or(Commit { seq: 0, payload_len: 0, entries: 0, at: self.started, puts_at: 0, fixed_bytes: FIXED_JSON_BYTES, epoch: 0, observed: false })
    }

    /// Tells the data path after how many more puts the estimate reaches the risk threshold.
    pub(super) fn arm_alarm(&self) {
        let c = self.baseline();
        let Some(e) = self.estimate() else { return };
        let threshold = RISK_FRACTION * e.cap as f64 - c.fixed_bytes as f64;
        let fit = (threshold / e.entry_bytes).floor().max(0.0) as u64;
        if fit >= self.lmcache_slots().max(c.entries.saturating_add(1)) {
            // Every slot listed still fits: no number of puts raises the alarm.
            self.slots.set_alarm_at(u64::MAX);
            return;
        }
        self.slots.set_alarm_at(c.puts_at + fit.saturating_sub(c.entries).max(1));
    }

    /// LMCache's checkpoint with an entry in every slot of its layout (bytes, at the bytes per
    /// entry measured so far), and how many entries fit its container.
    pub fn full_index(&self) -> (u64, u64) {
        let c = self.baseline();
        let entry_bytes = self.estimate().map_or(DEFAULT_ENTRY_BYTES, |e| e.entry_bytes);
        let bytes = c.fixed_bytes + (self.lmcache_slots() as f64 * entry_bytes).ceil() as u64;
        let fits = (self.geom.payload_cap().saturating_sub(c.fixed_bytes) as f64 / entry_bytes).floor() as u64;
        (bytes, fits)
    }

    /// LMCache's `meta_total_bytes` whose containers hold twice `bytes` (the next checkpoint's
    /// estimate) and, with a twentieth to spare, every slot's entry: one that never has to
    /// be raised again, each raise costing LMCache its cache.
    pub fn meta_total_needed(&self, bytes: u64) -> u64 {
        let a = self.geom.block_align;
        let full = self.full_index().0;
        let payload = (2 * bytes).max(full + full / 20);
        let container = (a + payload).div_ceil(a) * a;
        (2 * container).div_ceil(1 << 20) << 20
    }

    /// The overflow's fix, for an estimate of `bytes`.
    fn overflow_fix(&self, bytes: u64) -> String {
        format!("meta_total_bytes of at least {} (a new layout: LMCache starts empty)", self.meta_total_needed(bytes))
    }

    /// Said once a start: LMCache's checkpoint cannot list every slot of its layout, so a
    /// cache filled far enough stops checkpointing. Said before that happens, while a new
    /// `meta_total_bytes` costs an operator little (LMCache starts empty on a new layout).
    fn say_full_index(&mut self) {
        if self.full_index_said {
            return;
        }
        self.full_index_said = true;
        let (bytes, fits) = self.full_index();
        let cap = self.geom.payload_cap();
        if bytes <= cap {
            return;
        }
        let slots = self.lmcache_slots();
        tracing::warn!(
            "device {}: LMCache's checkpoint cannot list all {slots} slots: with an entry in each it would be about {bytes} bytes, past the {cap}-byte checkpoint container (meta_total_bytes {}); once LMCache holds about {fits} entries ({:.0}% of its slots) it stops checkpointing, and its next restart loses what it stored since (an MP LMCache whose eviction keeps fewer entries never gets there). Fix, cheapest while the cache is still to fill: LMCache's meta_total_bytes of at least {} (a new layout: LMCache starts empty; add fdpblk again with it)",
            self.cfg.device,
            self.geom.meta_total_bytes,
            100.0 * fits as f64 / slots.max(1) as f64,
            self.meta_total_needed(0)
        );
    }

    pub(super) fn check_overflow(&mut self, _alarm: bool) {
        self.say_full_index();
        let Some(e) = self.estimate() else { return };
        let c = self.baseline();
        let risk = e.bytes as f64 >= RISK_FRACTION * e.cap as f64;
        let dev = self.cfg.device;
        if risk && !self.risk {
            tracing::error!(
                "device {dev}: checkpoint overflow risk: LMCache's next checkpoint will be about {} bytes ({} entries x {:.0} bytes), {:.0}% of the {}-byte limit of a checkpoint container (meta_total_bytes {}). Above the limit LMCache skips every checkpoint with only a warning, and its next restart loses every entry stored since its last checkpoint that fit (seq {} or a later one). Fix: set LMCache's meta_total_bytes to at least {} (rust_raw_block.meta_total_bytes, or meta_total_bytes of the MP adapter); that is a new layout, so LMCache starts with an empty cache, and fdpblk must be re-added with the new value (its error then names the command that erases the old checkpoint)",
                e.bytes,
                e.entries,
                e.entry_bytes,
                100.0 * e.bytes as f64 / e.cap as f64,
                e.cap,
                self.geom.meta_total_bytes,
                c.seq,
                self.meta_total_needed(e.bytes)
            );
        } else if !risk && self.risk {
            tracing::info!("device {dev}: checkpoint overflow risk gone: next checkpoint about {} of {} bytes", e.bytes, e.cap);
        }
        self.risk = risk;
        self.check_reload(&c);
        // Puts that wait for a checkpoint: since the commit, or since LMCache reloaded it (the
        // estimate above still counts the puts before a reload: it errs high, the safe side
        // for an overflow alarm, should the reload have been another reader's).
        let puts = self.slots.header_writes().saturating_sub(c.puts_at.max(self.reloaded_at));
        let dirty = puts > 0 || self.carried_dirty;
        let since = c.at.max(self.clean_at);
        if !dirty {
            self.clean_at = Instant::now();
            self.counters.uncheckpointed_since = None;
        } else if self.counters.uncheckpointed_since.is_none() {
            // Saved with the own state (once, not a value that moves every round): a restarted
            // daemon goes on from it.
            self.counters.uncheckpointed_since = Some(unix_now().saturating_sub(since.elapsed().as_secs()).max(1));
        }
        // `stall_min` is STALL_MIN unless configured (the simulator: never). Not below two of
        // LMCache's shortest gaps between checkpoints: a write just after its tick waits a
        // whole one, which the average from first writes to checkpoints can fall below.
        let ticks = self.short_gap().map_or(Duration::ZERO, |g| g * 2);
        let after = self.interval.map_or(Duration::ZERO, |i| i * 3).max(ticks).max(self.cfg.stall_min);
        // From the first slot write LMCache has not checkpointed, not from the last checkpoint:
        // after an idle hour, one put is no stall.
        let age = since.elapsed();
        let stalled = dirty && age >= after;
        // Said when it begins, and again each hour it lasts, with what a restart would lose
        // by then (one line at the start scrolls away in a long stall).
        let again = stalled && self.stalled && self.stall_said_at.is_some_and(|t| t.elapsed() >= STALL_REPEAT);
        if stalled && (!self.stalled || again) {
            self.stall_said_at = Some(Instant::now());
            let fix = self.overflow_fix(e.bytes);
            let cause = if e.bytes >= e.cap {
                format!("its checkpoint (about {} bytes) no longer fits the {}-byte container, so LMCache skips it; fix: {fix}", e.bytes, e.cap)
            } else if self.risk {
                // Near the cap, below it: either may be the cause.
                format!("{IDLE_RULE}; or, the estimate (about {} bytes of {}) being near the cap, its checkpoint no longer fits (LMCache's log then says the payload is too large): fix then: {fix}", e.bytes, e.cap)
            } else {
                IDLE_RULE.to_string()
            };
            let slots = if self.carried_dirty { format!("{puts} slots since fdpblk restarted, others before that") } else { format!("{puts} slots") };
            tracing::error!(
                "device {dev}: LMCache wrote {slots}, the first {}s ago, and no checkpoint since (last seq {}): {cause}. A restart now loses those entries",
                age.as_secs(),
                c.seq
            );
        }
        self.stalled = stalled;
    }

    /// LMCache opened the device again: it read both containers' header blocks in a row (its
    /// index load) since the last load taken. Judged once every checkpoint header written so
    /// far was read back (its closing checkpoint is then the commit). With puts no checkpoint
    /// listed, a restarted LMCache loaded the last checkpoint, so those puts are lost to it,
    /// said once here; they no longer wait for a checkpoint, and the stall alarm counts from
    /// its puts since. (Another reader of both blocks, `fdpblk inspect` of the device, looks
    /// the same: the stall alarm then waits for the puts after it; the overflow estimate
    /// keeps them.)
    fn check_reload(&mut self, c: &Commit) {
        if !self.checkpoints_read_back() {
            return;
        }
        let Some(at) = self.slots.both_headers_read_since(self.loads_taken) else { return };
        self.loads_taken = self.slots.checkpoint_reads();
        let lost = at.saturating_sub(c.puts_at.max(self.reloaded_at));
        self.lmcache_opens += 1;
        self.lmcache_lost_puts += lost;
        if lost == 0 && !self.carried_dirty {
            return;
        }
        let slots = match (self.carried_dirty, lost) {
            (true, 0) => "slots before fdpblk restarted".to_string(),
            (true, _) => format!("{lost} slots since fdpblk restarted, and others before that"),
            _ => format!("{lost} slots"),
        };
        tracing::warn!(
            "device {}: LMCache opened the device again (it read both checkpoint copies) after it wrote {slots} that no checkpoint lists: a restarted LMCache loaded checkpoint seq {} and has lost those entries (their slots are free to it), and the stall alarm counts from its puts after that. Fix: {}. (Another reader of both blocks, `fdpblk inspect` of this device or a copy of it, looks the same.)",
            self.cfg.device,
            c.seq,
            if self.risk {
                format!("the overflow alarm's {} (past the container LMCache writes no checkpoint, at close neither)", self.overflow_fix(self.estimate().map_or(0, |e| e.bytes)))
            } else {
                "none now; to keep such puts over a restart, let LMCache checkpoint before it stops (it writes one at close)".to_string()
            }
        );
        self.reloaded_at = at;
        self.carried_dirty = false;
        self.counters.uncheckpointed_since = None;
        self.clean_at = Instant::now();
        self.stalled = false;
    }
}
