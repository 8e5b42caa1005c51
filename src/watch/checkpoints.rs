//! Reading a checkpoint container back: its header, the CRC of its payload, the slots it lists
//! and the confirmations it gives (claim A in the doc of [`super`]).

use super::*;

/// One bit per slot, all clear.
fn bitset(n: u64) -> Vec<u64> {
    vec![0u64; n.div_ceil(64) as usize]
}

/// A confirmation found while parsing a checkpoint, applied once the parsed bytes' CRC matched
/// and the commit was weighed against the writeback delay ([`Watcher::apply_confirms`]).
pub(super) struct Confirm {
    slot: u64,
    was: u64,
    new: u64,
    /// The slot's write predates the checkpoint: its "written unseen" mark can go.
    fresh: bool,
}

/// Applies a confirmation parsed from `c.was`. Besides loads (which `cas_life` takes), only
/// the completion of the slot's header write may have come since: it sets `HEADER_DONE`
/// and writes nothing (with buffered I/O LMCache commits a put before its header is written
/// back). The confirmation stands over it; a failed CAS would drop it until the next
/// checkpoint that lists the slot, and a slot deleted before that stays on the drive.
fn confirm(slots: &SlotTable, c: &Confirm) {
    let tag = life::tag(c.new);
    let mut was = c.was;
    for _ in 0..4 {
        let new = life::with_state(life::with_tag(was | life::CONFIRMED, tag), SlotState::Live);
        if slots.cas_life(c.slot, was, new) {
            return;
        }
        let now = slots.life(c.slot);
        let completed = now & !was & life::HEADER_DONE;
        if !life::same_but_loads(now & !completed, was) {
            return; // written (or trimmed) since the parse
        }
        was = now;
    }
}

/// Intervals between commits the writeback check looks at (the second shortest of them).
const RECENT_GAPS: usize = 8;

/// Hashes what the parser reads, so that what is parsed is what the CRC vouched for.
struct CrcRead<R> {
    inner: R,
    crc: crc32fast::Hasher,
    bytes: u64,
    /// The first read that failed: the payload is not known to be incomplete.
    error: Option<String>,
}

impl<R: std::io::Read> std::io::Read for CrcRead<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf).inspect_err(|e| {
            self.error.get_or_insert_with(|| e.to_string());
        })?;
        self.crc.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Why a payload read back is not taken (yet).
pub(super) enum Partial {
    /// The bytes are not those the header's CRC vouches for: still on their way, or being
    /// rewritten.
    NotMatching,
    /// Reading them failed: read again later.
    ReadFailed(String),
}

impl Watcher {
    /// Reads both checkpoint containers again (those with no read-back pending). For a layout
    /// learned while serving: `new` read them before the queues classified writes, so a
    /// checkpoint LMCache wrote in between (while the state loaded) came with no event.
    pub fn reread_containers(&mut self) {
        for copy in 0..2u8 {
            if self.pending.iter().any(|p| p.ev.copy == copy) {
                continue;
            }
            self.containers[usize::from(copy)] = match self.read_container(copy, None, None) {
                Read::Done(c) => c,
                Read::NotYet | Read::Incomplete => Container::Unknown,
            };
        }
        // The baseline for the overflow estimate and the stats, as `new` sets it: under the
        // epoch of the last event taken (none yet when the learner calls this), so every
        // checkpoint header written since still counts as newer.
        let baseline = self.newest().map(|v| (v.seq, v.payload_len, v.entries, v.fixed_bytes));
        if let Some((seq, payload_len, entries, fixed_bytes)) = baseline.filter(|b| self.commit.as_ref().is_none_or(|c| c.seq != b.0)) {
            self.commit = Some(Commit { seq, payload_len, entries, at: Instant::now(), puts_at: 0, fixed_bytes, epoch: self.seen_epoch, observed: false });
            self.carried_dirty = false;
            self.arm_alarm();
        }
        self.need_sweep = true;
    }

    /// Why container `copy`'s header block is not a checkpoint header LMCache would load.
    pub(super) fn container_header_error(&self, copy: u8) -> Option<String> {
        let mut block = vec![0u8; self.geom.block_align as usize];
        match self.dev.read_at(self.geom.container_offset(copy), &mut block) {
            Err(e) => Some(e.to_string()),
            Ok(_) => CheckpointHeader::parse(&block, self.geom.payload_cap()).err().map(|e| e.to_string()),
        }
    }

    /// Reads container `copy`. With `expect`, it must hold exactly that header (else `NotYet`)
    /// and a payload matching its CRC (else `Incomplete`); `confirm_epoch` confirms matching
    /// slots (claim A).
    pub(super) fn read_container(&mut self, copy: u8, expect: Option<CheckpointHeader>, confirm_epoch: Option<u32>) -> Read {
        let g = self.geom;
        let off = g.container_offset(copy);
        let mut block = vec![0u8; g.block_align as usize];
        if let Err(e) = self.dev.read_at(off, &mut block) {
            tracing::warn!("device {}: reading checkpoint container {copy}: {e}", self.cfg.device);
            return Read::NotYet;
        }
        let h = match CheckpointHeader::parse(&block, g.payload_cap()) {
            Ok(h) => h,
            Err(_) if expect.is_none() => return Read::Done(Container::Empty),
            Err(_) => return Read::NotYet,
        };
        if let Some(x) = expect {
            if (x.seq, x.payload_len, x.crc32, x.version) != (h.seq, h.payload_len, h.crc32, h.version) {
                return Read::NotYet;
            }
        }
        // One pass: the parse hashes what it reads, and nothing counts unless the CRC matches.
        match self.parse(copy, &h, confirm_epoch) {
            // Not the bytes the header vouches for: the payload is still on its way, or
            // LMCache is rewriting it.
            Ok(Err(Partial::NotMatching)) => Read::Incomplete,
            Ok(Err(Partial::ReadFailed(e))) => {
                tracing::warn!("device {}: reading checkpoint container {copy}'s payload: {e}", self.cfg.device);
                Read::NotYet
            }
            Ok(Ok(v)) => Read::Done(Container::Valid(Box::new(v))),
            Err(e) => {
                tracing::warn!("device {}: checkpoint seq {} in container {copy} is not usable: {e}; no deallocation until it is replaced", self.cfg.device, h.seq);
                Read::Done(Container::Unknown)
            }
        }
    }

    /// Streams the JSON: which slots it lists; confirmations and tags for matching entries.
    /// `Ok(Err(_))`: the bytes parsed are not those the header's CRC vouches for, or could not
    /// all be read; nothing was confirmed.
    pub(super) fn parse(&mut self, copy: u8, h: &CheckpointHeader, confirm_epoch: Option<u32>) -> Result<Result<ValidCopy, Partial>, String> {
        let g = self.geom;
        let slots = &*self.slots;
        let mut listed = bitset(g.max_slots);
        let mut listed_len = ListedLens::default();
        // A slot listed again (LMCache never does; a crafted checkpoint may, thousands of
        // times) adds no live entry and no confirmation: both stay within one per slot, not
        // one per entry. A slot's first entry with an identity is its live entry; the first
        // whose key its header holds, its confirmation.
        let mut confirming = bitset(g.max_slots);
        let epoch_now = slots.epoch();
        // Epochs since commit `K`: the slot's stamp must be at least this + 2 epochs old.
        let need = confirm_epoch.map(|k| epoch_now.wrapping_sub(k)).filter(|&d| u64::from(d) + 2 < life::STAMP_MASK);
        let mut last_tag: (String, String, u16) = (String::new(), String::new(), 0);
        let mut last_bucket: (String, u64) = (String::new(), 0);
        // Every live entry, for a policy that learns tenants from committed checkpoints.
        let mut live: Option<Vec<LiveEntry>> = (self.observer.is_some() && confirm_epoch.is_some()).then(Vec::new);
        let mut observed = if live.is_some() { bitset(g.max_slots) } else { Vec::new() };
        // Confirmations wait until the CRC of the very bytes parsed matches the header's.
        self.confirms.clear();
        let mut confirms: Vec<Confirm> = Vec::new();
        let dev = DevReader(&*self.dev);
        let mut reader = CrcRead { inner: RegionReader::new(&dev, g.container_offset(copy) + g.block_align, h.payload_len), crc: crc32fast::Hasher::new(), bytes: 0, error: None };
        let limits = JsonLimits { max_payload_bytes: g.payload_cap().max(h.payload_len), ..JsonLimits::default() };
        let meta = parse_checkpoint_json(&mut reader, &limits, &mut |e| {
            // LMCache writes both as plain integers, and its loader takes anything `int()`
            // takes ("65536", 65536.0): an entry whose slot fdpblk cannot tell may list any
            // slot, so the whole copy is unknown and no deallocation rests on it.
            let (Some(off), Some(size)) = (e.offset, e.size) else {
                return Err(format!("entry {:?} has no plain integer offset and size", e.key.chars().take(200).collect::<String>()));
            };
            let Some((slot, 0)) = g.slot_of(off) else { return Ok(()) };
            let (word, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
            listed[word] |= bit;
            let n = u32::try_from(size.saturating_add(1)).unwrap_or(u32::MAX);
            listed_len.note(slot, n);
            // An object key with a lone surrogate has no identity (its UTF-8 is LMCache's hash
            // input): listed, so protected, but never confirmed. A legacy key's is its hash's.
            let key = Key::parse(e.key).ok().filter(|k| !e.key_lossy || matches!(k, Key::Legacy(_)));
            if let Some(live) = live.as_mut().filter(|_| observed[word] & bit == 0) {
                if let Some(key) = &key {
                    let (identity, salt) = match key {
                        Key::Legacy(k) => (legacy_identity(k.chunk_hash_hex), ""),
                        Key::Object(k) => (object_identity(e.key), k.cache_salt.unwrap_or("")),
                    };
                    // Consecutive entries mostly share a salt: hash its bucket once per run.
                    if last_bucket.0 != salt {
                        last_bucket = (salt.to_string(), salt_bucket_id(salt));
                    }
                    observed[word] |= bit;
                    live.push(LiveEntry { slot, identity, salt_bucket: last_bucket.1 });
                }
            }
            let Some(need) = need.filter(|_| confirming[word] & bit == 0) else { return Ok(()) };
            let l = slots.life(slot);
            let Some(cur) = slots.entry(slot) else { return Ok(()) };
            if !cur.has_header() || cur.payload_len != size.min(u64::from(u32::MAX)) || l & life::TRIMMING != 0 {
                return Ok(());
            }
            let Some(key) = key else { return Ok(()) };
            let (id, model, salt) = match &key {
                Key::Legacy(k) => (legacy_identity(k.chunk_hash_hex), k.model_name, ""),
                Key::Object(k) => (object_identity(e.key), k.model_quoted, k.cache_salt.unwrap_or("")),
            };
            if id != cur.identity {
                return Ok(());
            }
            let fresh = life::epochs_since(life::stamp(l), epoch_now) >= need + 2;
            if l & life::CONFIRMED == 0 && !fresh {
                return Ok(());
            }
            if last_tag.0 != model || last_tag.1 != salt {
                last_tag = (model.to_string(), salt.to_string(), slots.tags().intern(&key.model_name(), salt));
            }
            let new = life::with_state(life::with_tag(l | life::CONFIRMED, last_tag.2), SlotState::Live);
            confirming[word] |= bit;
            confirms.push(Confirm { slot, was: l, new, fresh });
            Ok(())
        });
        // A payload that does not parse may be one still on its way or being rewritten: if the
        // bytes read, and the rest, do not make the CRC, it is read again, not called unusable.
        let whole = |r: &mut CrcRead<_>| std::io::copy(r, &mut std::io::sink()).is_ok() && r.bytes == h.payload_len && r.crc.clone().finalize() == h.crc32;
        let partial = |r: &mut CrcRead<_>| Ok(Err(r.error.take().map_or(Partial::NotMatching, Partial::ReadFailed)));
        let meta = match meta {
            Err(_) if !whole(&mut reader) => return partial(&mut reader),
            m => m.map_err(|e| e.to_string())?,
        };
        if !whole(&mut reader) {
            return partial(&mut reader);
        }
        // Compared as Python's loader compares them: `65536.0 == 65536`.
        let geo = [
            ("block_align", meta.py_int("block_align"), g.block_align),
            ("header_bytes", meta.py_int("header_bytes"), g.header_bytes),
            ("slot_bytes", meta.py_int("slot_bytes"), g.slot_bytes),
            ("meta_total_bytes", meta.py_int("meta_total_bytes"), g.meta_total_bytes),
        ];
        let differ: Vec<(&str, u64, u64)> = geo.into_iter().filter_map(|(n, t, o)| t.filter(|&t| t != o).map(|t| (n, t, o))).collect();
        if !differ.is_empty() {
            let says = differ.iter().map(|(n, t, o)| format!("{n} {t} (fdpblk serves {o})")).collect::<Vec<_>>().join(", ");
            let flags = differ.iter().map(|(n, t, _)| format!("--{} {t}", n.replace('_', "-"))).collect::<Vec<_>>().join(" ");
            let keys = differ.iter().map(|(n, t, _)| format!("{n} = {t}")).collect::<Vec<_>>().join(", ");
            let msg = format!(
                "LMCache's checkpoint seq {} says {says}: fdpblk's layout is wrong, so placement is too, and deallocation is off; add the device again with {flags} (`{keys}` in its config file; `systemctl restart fdpblk@NAME`, or `fdpblk del` then `add`)",
                h.seq
            );
            if self.conflict.is_none() {
                tracing::error!("device {}: {msg}", self.cfg.device);
            }
            self.conflict = Some(msg.clone());
            return Err(msg);
        }
        // A geometry field no integer equals (a string, a fraction): LMCache discards the copy
        // when it loads, but what LMCache is configured with is then not known.
        if let Some((name, _, _)) = geo.iter().find(|(f, v, _)| v.is_none() && meta.wrong_type_fields().any(|w| w == *f)) {
            return Err(format!("its {name} is not a whole number, so fdpblk cannot tell whether LMCache's layout matches its own"));
        }
        // LMCache does not check capacity_bytes when it loads: a larger one since fdpblk took
        // its layout means slots past fdpblk's last one may be in use, which fdpblk classifies
        // as outside the layout (safe, but not placed by key and never deallocated).
        if let Some(theirs) = meta.py_int("capacity_bytes").filter(|&c| c > g.capacity_bytes) {
            if self.capacity_warned != Some(theirs) {
                self.capacity_warned = Some(theirs);
                tracing::warn!(
                    "device {}: LMCache's checkpoint seq {} says capacity_bytes {theirs}, more than the {} fdpblk took its layout with: slots past slot {} are not placed by key nor deallocated; re-add the device with --capacity-bytes {theirs} (unless that is more than the device exports: then LMCache wrote this checkpoint on a larger device, the backing without fdpblk, and its own through this device will say less)",
                    self.cfg.device, h.seq, g.capacity_bytes, g.max_slots.saturating_sub(1)
                );
            }
        }
        // Only a checkpoint of fdpblk's geometry confirms: another's offsets name another
        // layout's slots. Applied by the caller once the commit has been weighed against the
        // writeback delay, which this very checkpoint may flag.
        self.confirms = confirms;
        // What the checkpoint costs besides its entries, as measured in this one.
        let fixed_bytes = match meta.entries_bytes {
            0 => FIXED_JSON_BYTES + meta.device_path.as_ref().map_or(0, |p| p.len() as u64),
            e => h.payload_len.saturating_sub(e),
        };
        if let (Some(entries), Some(p)) = (live, self.observer.as_mut()) {
            p.observe(&Observation::Checkpoint { seq: h.seq, entries: &entries });
        }
        listed_len.finish();
        Ok(Ok(ValidCopy { seq: h.seq, payload_len: h.payload_len, entries: meta.entries, fixed_bytes, listed, listed_len, device_path: meta.device_path }))
    }

    /// Whether a checkpoint read back whole (header `h`, its write's `epoch`) is newer than
    /// the commit on record: its header write came later (read-backs complete out of order),
    /// and its seq is higher, or 1 (LMCache starting a new index), or one more than the seq
    /// the other container holds (LMCache's rule: seq `n` goes to the container not holding
    /// `n - 1`, its current one). The last is how a new index is followed past a stale
    /// higher seq left in the other container by an earlier LMCache (found as the baseline
    /// when fdpblk started after LMCache's restart). Buffered writeback can deliver checkpoint
    /// `n`'s header after `n + 1`'s (pages go back in offset order, and `n + 1` may be in the
    /// lower container): once `n + 1` was read back, the seq tells those apart, since `n` is
    /// then neither higher than the commit `n + 1` nor the successor of the other container's
    /// `n + 1`. For `n` = 1, the commit being the other container's seq 2 tells them apart:
    /// seq 1 after it is taken as that late header, not as a new index. (A new index written
    /// over an earlier process's seq 1 while that process's seq 2 is the commit is followed
    /// from its own seq 2 on, one checkpoint later, as the successor of its seq 1.)
    pub(super) fn is_newer(&self, h: Option<CheckpointHeader>, epoch: u32, copy: u8) -> bool {
        let (Some(h), Some(c)) = (h, self.commit.as_ref()) else { return true };
        let other = &self.containers[usize::from(1 - copy.min(1))];
        let successor = matches!(other, Container::Valid(o) if o.seq.checked_add(1) == Some(h.seq));
        let late_first = h.seq == 1 && c.seq == 2 && matches!(other, Container::Valid(o) if o.seq == 2);
        (epoch.wrapping_sub(c.epoch) as i32) > 0 && (h.seq > c.seq || (h.seq == 1 && !late_first) || successor)
    }

    /// A checkpoint LMCache committed through fdpblk (read back and verified).
    pub(super) fn committed(&mut self, h: CheckpointHeader, entries: u64, fixed_bytes: u64, epoch: u32) {
        let now = Instant::now();
        // The first checkpoint after a baseline found at start comes any time after the start.
        let prev = self.commit.as_ref().filter(|c| c.observed).map(|c| (c.at, c.puts_at));
        if let Some((p, puts_at)) = prev {
            let d = now.duration_since(p);
            // From the first slot write (within a round), not over an idle stretch before it:
            // LMCache checkpoints only a changed index. (Deletes alone change it unseen: such
            // a gap is left out.)
            if self.slots.header_writes() > puts_at {
                let busy = now.saturating_duration_since(p.max(self.clean_at));
                self.interval = Some(match self.interval {
                    Some(i) => (i * 3 + busy) / 4,
                    None => busy,
                });
            }
            self.gaps = self.gaps.saturating_add(1);
            if self.recent_gaps.len() == RECENT_GAPS {
                self.recent_gaps.pop_front();
            }
            self.recent_gaps.push_back(d);
            self.check_writeback();
        } else if self.carried.is_some() {
            // A carried pause is weighed at every checkpoint, the first after the start too.
            self.check_writeback();
        }
        self.commit = Some(Commit {
            seq: h.seq,
            payload_len: h.payload_len,
            entries,
            at: now,
            puts_at: self.slots.header_writes(),
            fixed_bytes,
            epoch,
            observed: true,
        });
        self.unjudged = self.unjudged_delay();
        self.counters.checkpoint_seen = Some((h.seq, unix_now()));
        self.counters.uncheckpointed_since = None;
        self.carried_dirty = false;
        self.stalled = false;
        self.arm_alarm();
    }

    /// Warns (once per episode) when the kernel may hold a dirty page back as long as LMCache's
    /// checkpoint interval ([`Self::short_gap`]): with buffered writes a checkpoint's header could then reach the
    /// drive after slot writes of a later snapshot, which the deallocation rules assume it
    /// does not. O_DIRECT writes (MP mode) do not wait in the page cache.
    fn check_writeback(&mut self) {
        let Some(delay) = self.cfg.writeback.now() else { return };
        // Until this run has seen enough intervals, a pause the previous run saved holds while
        // the delay still reaches the interval it was judged at.
        if self.gaps >= JUDGE_GAPS {
            self.carried = None;
        }
        let carried = self.carried.map(|p| p.interval());
        let Some(shortest) = carried.or_else(|| self.short_gap()).or(self.interval) else { return };
        self.writeback = Some(delay);
        let risk = (carried.is_some() || self.gaps >= JUDGE_GAPS) && writeback_outlasts_interval(shortest, delay);
        if risk && !self.writeback_risk {
            // Looked at at once: this checkpoint's confirmations wait for the answer.
            self.buffered_checked = None;
            let held = delay.map_or_else(|| "indefinitely (vm.dirty_writeback_centisecs is 0)".to_string(), |d| format!("{:.1}s (vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs)", d.as_secs_f64()));
            tracing::warn!(
                "device {}: LMCache checkpoints as often as every {:.1}s, and the kernel may hold a dirty page back {held}: with buffered writes (LMCache's non-MP default) a checkpoint header could reach the drive after later slot writes, which fdpblk's deallocation assumes it does not; fix: keep vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs well below LMCache's meta_checkpoint_interval_sec (in centiseconds), or raise that interval. O_DIRECT writes (MP mode) are not affected",
                self.cfg.device,
                shortest.as_secs_f64()
            );
        } else if !risk && self.writeback_risk {
            tracing::info!("device {}: LMCache's checkpoint interval is again above the kernel's writeback delay", self.cfg.device);
        }
        self.writeback_risk = risk;
    }

    /// Takes over the pause the previous run saved (`Counters::writeback_pause`): a daemon
    /// restarted under a running LMCache (`fdpblk recover`) would otherwise deallocate for 3
    /// intervals before it could judge the risk again. It holds from the start while the
    /// kernel's delay still reaches the interval the pause was judged at (weighed again at
    /// each checkpoint, as a pause's end is: that checkpoint confirms nothing), until this run
    /// has judged for itself ([`Self::check_writeback`]). Buffered writes the previous run saw
    /// count as seen only until then.
    pub(super) fn carry_writeback_pause(&mut self) {
        let Some(p) = self.counters.writeback_pause else { return };
        let interval = p.interval();
        let delay = self.cfg.writeback.now();
        if self.cfg.trim && delay.is_some_and(|d| writeback_outlasts_interval(interval, d)) {
            self.carried = Some(p);
            self.writeback_risk = true;
            self.writeback = delay;
            tracing::warn!(
                "device {}: the previous run paused deallocation (LMCache checkpointed as often as every {:.1}s, within the kernel's writeback delay): paused until this run has seen 3 checkpoint intervals, or a checkpoint comes with the kernel's delay below that interval",
                self.cfg.device,
                interval.as_secs_f64()
            );
        } else if self.cfg.trim {
            // The kernel's delay was lowered since (or is not checked): nothing to carry.
            self.counters.writeback_pause = None;
            self.counters_dirty = true;
        }
    }

    /// The second shortest of the last [`RECENT_GAPS`] intervals (the shortest with one only):
    /// the interval LMCache keeps to. LMCache's idle rule skips ticks, so gaps come in
    /// multiples of its interval, which an average would hide; and a checkpoint it writes
    /// out of turn (`close()`, `checkpoint_now()`) makes one short gap, not two.
    pub(super) fn short_gap(&self) -> Option<Duration> {
        let mut g: Vec<Duration> = self.recent_gaps.iter().copied().collect();
        g.sort_unstable();
        g.get(1).or(g.first()).copied()
    }

    /// Pauses deallocation while `writeback_risk` holds and LMCache writes through the page
    /// cache, or while that cannot be told: a checkpoint header the kernel holds back past
    /// later snapshots' slot writes could then confirm a slot's old contents (claim A), and
    /// its late arrival bring back a listing (claim B). O_DIRECT writes leave no dirty pages,
    /// so LMCache's MP mode is not paused. Resumes once the interval is above the delay again.
    /// Returns true when the pause ended now.
    pub(super) fn check_writeback_pause(&mut self) -> bool {
        let resume = |w: &mut Self, why: &str| {
            if w.writeback_pause.take().is_some() {
                tracing::info!("device {}: deallocation resumes: {why}", w.cfg.device);
                return true;
            }
            false
        };
        if self.stopped || !self.cfg.trim {
            return resume(self, "the device stopped");
        }
        if !self.writeback_risk {
            if let Some(delay) = self.unjudged {
                return self.pause_until_judged(delay);
            }
            self.save_writeback_pause(None);
            let why = if !std::mem::take(&mut self.pause_unjudged) {
                "LMCache's checkpoint interval is above the kernel's writeback delay again"
            } else if self.gaps >= JUDGE_GAPS {
                "LMCache's checkpoint interval, now seen, is above the kernel's writeback delay"
            } else {
                "the kernel's writeback delay is below LMCache's shortest checkpoint interval (1 s), or no longer readable"
            };
            return resume(self, why);
        }
        self.pause_unjudged = false;
        // Buffered writes, once seen, pause at every risk for the rest of the run; a pause
        // because that could not be told is looked at again once a second.
        let seen = self.buffered_seen || self.carried.is_some_and(|p| p.buffered);
        let why = if seen {
            None
        } else {
            match self.look_for_buffered_writes() {
                None => return false,
                Some(Ok(false)) => {
                    self.save_writeback_pause(None);
                    return resume(self, "no write through the page cache is seen");
                }
                Some(Ok(true)) => None,
                Some(Err(e)) => Some(format!("fdpblk cannot tell whether LMCache writes through the page cache ({e})")),
            }
        };
        let why = why.unwrap_or_else(|| "LMCache writes through the page cache (its non-MP default)".to_string());
        let carried = if self.carried.is_some() { " (as the previous run judged it, until this run has seen 3 checkpoint intervals)" } else { "" };
        let why = format!(
            "{why}, and the kernel may hold a dirty page back as long as LMCache's checkpoint interval{carried}: a checkpoint could reach the drive after later slot writes; fix: keep vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs well below LMCache's meta_checkpoint_interval_sec (in centiseconds), or raise that interval"
        );
        if self.writeback_pause.as_deref() != Some(why.as_str()) {
            tracing::warn!("device {}: deallocation paused: {why}", self.cfg.device);
            self.writeback_pause = Some(why);
        }
        let saved = match self.carried {
            Some(p) => p,
            None => {
                let interval = self.short_gap().or(self.interval).unwrap_or(Duration::ZERO);
                SavedPause { interval_ms: u32::try_from(interval.as_millis()).unwrap_or(u32::MAX).max(1), buffered: seen }
            }
        };
        self.save_writeback_pause(Some(saved));
        false
    }

    /// The kernel's writeback delay while this run has not yet seen the [`JUDGE_GAPS`]
    /// checkpoint intervals it judges the risk by, nor carries a judgement over, and a dirty
    /// page may wait as long as LMCache's shortest interval (1 s); `None` otherwise.
    pub(super) fn unjudged_delay(&self) -> Option<Option<Duration>> {
        if !self.cfg.trim || self.carried.is_some() || self.gaps >= JUDGE_GAPS {
            return None;
        }
        self.cfg.writeback.now().filter(|&d| writeback_outlasts_interval(MIN_CHECKPOINT_INTERVAL, d))
    }

    /// Before the risk is judged (a fresh start, or a restart whose predecessor saved no
    /// pause): LMCache's interval may be within the kernel's delay, so deallocation pauses
    /// where buffered writes are seen, until the intervals are (LMCache's default 60 s is above
    /// the kernel's default 35 s: then it resumes). Where that cannot be told (no cachestat)
    /// it goes on, as before this run judged. Not saved: a restart starts unjudged again.
    /// No pause to end here: this one needs buffered writes seen, which stays so for the run.
    fn pause_until_judged(&mut self, delay: Option<Duration>) -> bool {
        if !self.buffered_seen && self.look_for_buffered_writes() != Some(Ok(true)) {
            return false;
        }
        let held = delay.map_or_else(|| "indefinitely (vm.dirty_writeback_centisecs is 0)".to_string(), |d| format!("{:.1}s", d.as_secs_f64()));
        let why = format!(
            "LMCache writes through the page cache, and fdpblk has seen {} of the {JUDGE_GAPS} checkpoint intervals it compares with the kernel's writeback delay ({held}): a checkpoint could reach the drive after later slot writes if the interval is shorter; deallocation resumes once they are seen above it",
            self.gaps
        );
        if self.writeback_pause.as_deref() != Some(why.as_str()) {
            // Expected at every start under a buffered LMCache: not a warning.
            tracing::info!("device {}: deallocation paused: {why}", self.cfg.device);
            self.writeback_pause = Some(why);
        }
        self.pause_unjudged = true;
        false
    }

    /// Looks at the exported device's page cache for buffered writes, at most once a second
    /// (`None`: looked at less than a second ago); a "yes" counts for the rest of the run.
    fn look_for_buffered_writes(&mut self) -> Option<Result<bool, String>> {
        if self.buffered_checked.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return None;
        }
        self.buffered_checked = Some(Instant::now());
        let seen = self.cfg.buffered.seen(self.cfg.page_cache.as_deref());
        self.buffered_seen |= seen == Ok(true);
        Some(seen)
    }

    /// Keeps the pause in force in the saved state (for the next run: see
    /// [`Self::carry_writeback_pause`]). Not cleared when the device stops: the kernel's
    /// delay and LMCache's interval have not changed with it.
    fn save_writeback_pause(&mut self, p: Option<SavedPause>) {
        if self.counters.writeback_pause != p {
            self.counters.writeback_pause = p;
            self.counters_dirty = true;
            // At once: a crash before the next periodic cycle would lose it.
            self.persist_soon = true;
        }
    }

    /// Applies the confirmations of the checkpoint read last, unless deallocation is paused
    /// for a writeback delay: its header may be one the kernel held back past later slot
    /// writes.
    pub(super) fn apply_confirms(&mut self) {
        let confirms = std::mem::take(&mut self.confirms);
        if self.writeback_pause.is_some() {
            return;
        }
        for c in confirms {
            if c.fresh {
                // Snapshotted after the write, which came through this run (or, for a
                // record from before it, after this run's first checkpoint header).
                self.slots.settle_unseen(c.slot);
            }
            if c.new != c.was {
                confirm(&self.slots, &c);
            }
        }
    }
}
