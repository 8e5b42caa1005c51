//! The state thread of a device: checkpoint awareness, deallocation of evicted slots, the
//! checkpoint-overflow alarm, and fdpblk's own persistence.
//!
//! LMCache commits a checkpoint by writing its container header block after (posix) or
//! together with (io_uring) the JSON payload. The data path sees the header write
//! ([`SlotTable::checkpoint_header`], before the write is submitted) and starts a new
//! *epoch*; this thread reads the container back off the data path, checks that it holds
//! exactly that header and that the payload's CRC matches (retrying while the payload is still
//! on its way), and streams the JSON ([`crate::layout::checkpoint_json`], bounded memory,
//! hashing what it parses: nothing it found counts unless that CRC matches too):
//! which slots each container lists, and for each entry whose key's identity (BLAKE2b-8 of the
//! key string for object keys) matches the slot's header, a *confirmation* of the slot's
//! contents and its (model, cache_salt) tag.
//!
//! # When a slot is deallocated
//!
//! Slot `s` is deallocated (trimmed) only when all of these hold at the moment fdpblk marks
//! it `TRIMMING` with a compare-and-swap (CAS) on its `life` word:
//!
//! 1. **confirmed**: its current contents (the writes since its last put) were listed, with
//!    the same identity and payload length, by a committed checkpoint of epoch `K` while the
//!    slot's last write was stamped with an epoch `<= K - 2`; that checkpoint was the newest
//!    when read back (`Watcher::is_newer`: an older one whose header writeback held back past
//!    later snapshots may list a key deleted and put again into the slot since);
//! 2. **not written since**: no write, discard or write-zeroes touched the slot since that
//!    confirmation (every such request clears the confirmation; the CAS expects it set);
//! 3. **listed by neither container**: both checkpoint containers' current contents are known
//!    (read back and parsed, or known to hold no loadable checkpoint), neither lists `s`, and
//!    a flush made those contents durable (LMCache never flushes; after a power loss a
//!    container back at older contents could list `s`);
//! 4. **nothing pending**: no checkpoint header write has been seen that is not processed yet;
//! 5. the slot header on the drive still carries the confirmed identity and length.
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
//! # Stale tails
//!
//! A put with a shorter payload than the slot's earlier contents leaves their bytes behind the
//! new payload; the drive would keep them valid, and copy them in garbage collection, until a
//! longer payload overwrites them. Once the current contents are **confirmed** (1) and **not
//! written since** (2, the same CAS), and the header on the drive carries them (5), the
//! slot's bytes past `payload_len` rounded up to `block_align` are deallocated: no LMCache
//! process reads past that (`Watcher::trim_tails` says why). Conditions 3 and 4 are not
//! needed: a container listing the slot names either these contents or contents whose header
//! is gone, which LMCache's load drops.
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
//!   or fdpblk zeroes it as for an early eviction (below; on the same conditions, and only
//!   when the newest checkpoint lists no longer payload there). Then no loadable
//!   checkpoint names the old contents.
//!
//! Then no LMCache process reads the tail: the current put's entry (if it commits) reads its
//! own `payload_len`; an entry for any earlier contents of the slot, in a checkpoint LMCache
//! loads after a crash, lists no longer payload, or is dropped by the header check of its
//! load (`meta_verify_on_load`, on by default). With that check off, LMCache would serve such
//! an entry from a slot whose header already names the new put and whose payload that put is
//! overwriting: fdpblk assumes the default.
//!
//! ## Early evictions
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
//! holds for those slots, and they go by the rule above, in the same round.
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
//! In the terms of the issue: contents are evicted once they are "absent from two consecutive
//! committed checkpoints" (the two containers; consecutive seqs alternate between them) "and
//! not written since the earlier of them" (2), and only contents LMCache is known to have
//! committed qualify (1).
//!
//! ## Why no live slot is ever deallocated
//!
//! LMCache facts used (reference §4.1, §7, §9, §12): a slot is in LMCache's index only after
//! its put allocated it, wrote it and committed; an allocated slot is in neither the index nor
//! the free set until its put commits or rolls back, so no two puts hold one slot; delete and
//! eviction only remove index entries (no I/O); a process's index starts as the checkpoint it
//! loaded (the newest valid one in the two containers, entries with a mismatching slot header
//! dropped) and changes only by its own puts and deletes; one checkpoint is written at a time
//! (snapshot under the index lock, then payload and header), so the snapshot of checkpoint `K`
//! is taken after the header write of checkpoint `K-1` completed; one LMCache process uses
//! the device at a time.
//!
//! *Claim A (confirmation is sound).* If checkpoint `K` lists `(s, id, len)` and the slot's
//! last write is stamped `e <= K-2`, then the put that wrote those contents committed before
//! snapshot `K`. The stamp is read (SeqCst) when the write is planned, so the write was planned
//! before header `K-1` was, and the put had allocated `s` before that; the header write of
//! `K-1` completed before snapshot `K` was taken. So at snapshot `K` the slot was already
//! allocated to that put, and it is in the index then only if that put committed (no other put
//! can hold `s` while it is allocated, and any later put of `s` would have written it,
//! giving a newer stamp). The entry names the put's identity and length, so it is that
//! put's entry. Epochs count distinct header writes: the same header written again keeps the
//! epoch of its first write, so one checkpoint never counts as two. For writes before fdpblk started, the stamp is 0 and `K >= 2`: the write
//! preceded header 1 as seen by this run. Confirmations saved by an earlier run are used only
//! after a clean shutdown: after a crash, a slot may have been written after the last persist.
//!
//! *Claim B (a confirmed, unwritten slot that neither container lists is dead).* Let `P` be
//! the process now using the device. `P`'s index started as a loaded checkpoint and changed
//! by `P`'s puts and deletes. `s` cannot be in `P`'s index through a put of `P` after the
//! confirmation: that put would have written `s` (clearing the confirmation). Through a put
//! before the confirmation: then `s`'s contents are that put's, confirmed committed (A), and a
//! container lists `s` until a later snapshot of `P` lacks it, i.e. `P` deleted it; a snapshot
//! that postdates the confirmation and lacks `s` overwrote the container that listed it.
//! Through its load: the loaded checkpoint was in a container; for neither container to list
//! `s` now, `P` must have overwritten that one with a snapshot lacking `s`, again a delete.
//! Nor can any later process have `s`: it loads one of the two containers, and neither lists
//! `s` (condition 3; a container with no loadable checkpoint lists nothing; a payload being
//! overwritten without a new header cannot pass the CRC as anything but the old contents).
//! A checkpoint header seen but not yet read back could list anything: condition 4.
//!
//! *Claim C (the CAS closes every race).* Each write to a slot first updates its `life` word
//! (new stamp, confirmation cleared; for a header, after storing the new identity). If that
//! update comes before fdpblk's CAS, the CAS fails. If after, the writer sees `TRIMMING` and
//! its queue holds the write until the deallocation returned, so the write lands after it.
//! The slot header read (5) happens before the CAS, so a slot changed outside fdpblk's view
//! (another writer of the backing device while fdpblk was stopped) is not trimmed.
//!
//! The cases the issue names:
//! - *A put in flight while LMCache takes its snapshot* is in neither the index nor that
//!   checkpoint: its contents are not confirmed (1), so nothing happens to its slot; the next
//!   checkpoint lists it (or it was deleted, and confirmed contents are needed anyway).
//! - *Slot reuse*: a put into a freed slot writes it, which clears the confirmation and, if a
//!   trim had begun, waits for it; the new contents need their own confirmation.
//! - *LMCache restart*: the new process loads a container's checkpoint (whose listed slots
//!   stay protected by 3 until overwritten by its own snapshots), or nothing.
//! - *Seq restarting at 1 in container 0 while a stale copy 1 has a higher seq*: the rule is
//!   about what the two containers hold now, not about seq order, so the stale copy's slots
//!   stay protected until container 1 is overwritten. Which checkpoint confirms (the
//!   newest, `Watcher::is_newer`) follows seq 1 and then each seq one above the other
//!   container's, LMCache's own rule for its next write, so an fdpblk started while the stale
//!   copy is there follows the new process past it; a header of the same process delivered
//!   late by writeback, once the newer one was read back, is one below the other container's
//!   seq, never one above (before that, a late header is taken as newest by its higher seq, as
//!   it always was).
//! - *fdpblk restart*: unclean, confirmations are dropped; clean, they are kept (nothing
//!   writes the backing device while fdpblk is stopped — assumed; 5 checks it per slot).
//!
//! Not proved, assumed: a single LMCache process per device, writing one checkpoint at a
//! time (true for 0.5.6: the periodic thread, and `close()` after joining it).
//!
//! Claims A and B read "planned before" as "issued before": true for O_DIRECT (posix and
//! io_uring: a put commits after its writes completed). Buffered writeback (the non-MP
//! default) hands fdpblk the page cache's writes in its own order and time. While a dirty page
//! waits, LMCache reads it from the page cache, and fdpblk's later view of it is newer, so a
//! deallocation that races it is followed by its writeback. What the argument then assumes is
//! that writeback does not hold a checkpoint's header page back for a checkpoint interval
//! while slot pages dirtied after the next snapshot go out first: that checkpoint, arriving
//! late, could confirm a slot's old contents under a later put's payload. The kernel writes
//! a dirty page back within `vm.dirty_expire_centisecs` (30 s by default) of dirtying it,
//! plus one flusher period (`vm.dirty_writeback_centisecs`, 5 s), against LMCache's 60 s
//! interval; keep it below the interval. `WatchConfig::writeback` checks this against the
//! observed interval and warns (`writeback_risk`).

use crate::layout::checkpoint_header::CheckpointHeader;
use crate::layout::checkpoint_json::{parse_checkpoint_json, JsonLimits};
use crate::layout::keys::{legacy_identity, object_identity, salt_bucket_id, Key};
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::layout::Geometry;
use crate::persist::dev::{DevReader, StateWriter};
use crate::persist::{Counters, Loaded, Persist, Region};
use crate::place::{Handle, LiveEntry, Observation, Policy, SharedPolicy};
use crate::slot_table::{life, CheckpointEvent, SlotEntry, SlotState, SlotTable};
use crate::device::RegionReader;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How the state thread runs.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    /// Deallocate evicted slots.
    pub trim: bool,
    /// Deallocate stale tails: what earlier contents left past a confirmed slot's payload.
    pub trim_tails: bool,
    /// Deallocate a stale tail as soon as its slot's new header is durable ("Early tails" in
    /// the module doc), before a checkpoint confirmed the slot.
    pub early_tails: bool,
    /// Deallocate an evicted slot once the checkpoint written last no longer lists it, after
    /// zeroing the older container's header ("Early evictions" in the module doc), instead of
    /// waiting until LMCache overwrote the older container.
    pub early_evictions: bool,
    /// Deallocate slots that no checkpoint lists and that this run has not written ("Unwritten
    /// slots" in the module doc): on a drive that held data before, what LMCache never writes
    /// again. Only where every write was seen (not with `writes_unseen`).
    pub reclaim: bool,
    /// Take the confirmations of a cleanly saved state. Off when writes were served before
    /// the slot table existed (the layout was learned while serving): a same-key re-put among
    /// them would leave a stale confirmation that the header check cannot tell apart.
    pub trust_saved_confirmations: bool,
    /// LMCache may have written slots that this table never saw: a recovered device (its
    /// earlier daemon served writes after its last persist) or a layout learned while
    /// serving. Any slot may then hold a later put's payload ahead of its header, so every
    /// slot starts with orphan bytes to its end ([`SlotTable::orphans_everywhere`]).
    pub writes_unseen: bool,
    /// How often `step` runs the early-tail round (each round with work flushes the drive);
    /// `Duration::MAX`: never (the simulator runs it on simulated time).
    pub early_tails_every: Duration,
    /// First retry delay for a checkpoint whose payload is not complete yet (doubles to 1 s).
    pub retry_base: Duration,
    /// Persist cycle interval.
    pub persist_interval: Duration,
    /// Device id, for messages.
    pub device: i32,
    /// Checkpoints count as stalled after max(3 observed intervals, 180 s, this).
    pub stall_min: Duration,
    /// The exported block device (`/dev/ublkbN`): where fdpblk writes the backing underneath
    /// it (zeroing a checkpoint container), it drops the clean cached pages of that range, so
    /// that a reader through the page cache sees the new bytes. It also drops both containers'
    /// header blocks in each early-tail round (once a second), so that a LMCache opening the
    /// device reads them through fdpblk, which is how fdpblk learns of it (`geometry_seen_at`).
    pub page_cache: Option<std::path::PathBuf>,
    /// The longest the kernel holds a dirty page back, checked against LMCache's observed
    /// checkpoint interval (the writeback assumption in the module doc).
    pub writeback: WritebackDelay,
    /// Most evicted slots one round deallocates, and the longest it spends on them (the rest
    /// go in the next round, at once): [`TRIM_PER_ROUND`], [`TRIM_ROUND_TIME`].
    pub trim_per_round: u64,
    pub trim_round_time: Duration,
}

/// How long a buffered write may wait in the page cache before it reaches fdpblk.
#[derive(Clone, Debug, PartialEq)]
pub enum WritebackDelay {
    /// Not checked (the simulator: its writeback window is counted in puts, not time).
    Unchecked,
    /// A fixed delay (`None`: unbounded).
    Fixed(Option<Duration>),
    /// This kernel's `vm.dirty_expire_centisecs` + `vm.dirty_writeback_centisecs`, read at each check.
    Kernel,
}

impl WritebackDelay {
    /// The delay now: `Some(None)` when unbounded (periodic writeback is off), `None` when
    /// not checked or unreadable.
    fn now(&self) -> Option<Option<Duration>> {
        match self {
            Self::Unchecked => None,
            Self::Fixed(d) => Some(*d),
            Self::Kernel => {
                let read = |name: &str| std::fs::read_to_string(format!("/proc/sys/vm/{name}")).ok()?.trim().parse::<u64>().ok();
                Some(kernel_writeback_delay(read("dirty_expire_centisecs")?, read("dirty_writeback_centisecs")?))
            }
        }
    }
}

/// The longest a dirty page waits for writeback without memory pressure or a sync: it expires
/// after `expire` centiseconds and the flusher looks every `every` (0: never, unbounded).
pub fn kernel_writeback_delay(expire: u64, every: u64) -> Option<Duration> {
    (every > 0).then(|| Duration::from_millis(expire.saturating_add(every).saturating_mul(10)))
}

/// Whether LMCache's checkpoint `interval` leaves the writeback assumption in doubt: a page may
/// be held back (`delay`, `None` unbounded) for as long as the interval.
pub fn writeback_outlasts_interval(interval: Duration, delay: Option<Duration>) -> bool {
    delay.is_none_or(|d| d >= interval)
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self { trim: true, trim_tails: true, early_tails: true, early_evictions: true, reclaim: true, trust_saved_confirmations: true, writes_unseen: false, early_tails_every: EARLY_TAILS_INTERVAL, retry_base: Duration::from_millis(2), persist_interval: Duration::from_secs(5), device: -1, stall_min: STALL_MIN, page_cache: None, writeback: WritebackDelay::Unchecked, trim_per_round: TRIM_PER_ROUND, trim_round_time: TRIM_ROUND_TIME }
    }
}

/// Most evicted slots deallocated in one round of the state thread, and the longest a round
/// spends on them: the rest wait for the next round, which follows at once, so that saves and
/// a stop are never held up behind a long eviction round (each slot costs a header read and a
/// deallocation).
pub const TRIM_PER_ROUND: u64 = 4096;
pub const TRIM_ROUND_TIME: Duration = Duration::from_secs(1);

/// Most unwritten slots in one deallocation request (a run of consecutive slots).
const RECLAIM_RUN_SLOTS: u64 = 256;
/// How many slots the reclaim pass looks at between two looks at the round's clock.
const RECLAIM_SCAN_STRIDE: u64 = 1 << 16;

/// How often the state thread deallocates early stale tails (its longest sleep): each round
/// with work costs one flush of the drive.
pub const EARLY_TAILS_INTERVAL: Duration = Duration::from_secs(1);

/// The overflow alarm fires when the next checkpoint is estimated at this fraction of the cap.
pub const RISK_FRACTION: f64 = 0.9;
/// JSON bytes of a checkpoint besides its entries (plus the device_path string), assumed
/// before a checkpoint with an `entries` object was seen; then its own figure is used.
const FIXED_JSON_BYTES: u64 = 320;
/// Bytes per entry assumed before a checkpoint with entries was seen (reference §11).
const DEFAULT_ENTRY_BYTES: f64 = 240.0;
/// Checkpoints are considered stalled after max(3 intervals, this).
const STALL_MIN: Duration = Duration::from_secs(180);
/// Active retries of an incomplete checkpoint stop after this; later only writes to the
/// container (or a new header) trigger a look.
const RETRY_WINDOW: Duration = Duration::from_secs(120);

/// What a sweep found, each slot with the `life` word it saw (the trim CAS expects it).
struct Sweep {
    /// Confirmed and listed by neither container.
    dead: Vec<(u64, u64)>,
    /// Confirmed and listed by the older container only (early evictions).
    early: Vec<(u64, u64)>,
    /// The newer container `early` was found against ([`Watcher::early_eviction_basis`]).
    basis: Option<usize>,
    /// Confirmed and listed, with a stale tail not yet deallocated.
    tails: Vec<(u64, u64)>,
}

/// Reads of a written checkpoint container after which fdpblk says why it waits (at the 1 s
/// backoff, about half a minute).
const STUCK_READ_TRIES: u32 = 40;

/// One container's known contents.
#[derive(Clone, Debug)]
enum Container {
    /// Not known: blocks deallocation.
    Unknown,
    /// No loadable checkpoint (the header block is not a valid header).
    Empty,
    Valid(Box<ValidCopy>),
}

#[derive(Clone, Debug)]
struct ValidCopy {
    seq: u64,
    payload_len: u64,
    entries: u64,
    /// JSON bytes besides the entries (estimated).
    fixed_bytes: u64,
    /// One bit per slot the checkpoint lists.
    listed: Vec<u64>,
    /// Per slot, the longest payload the checkpoint lists there plus one (saturating: one
    /// of 4 GiB or more protects the whole slot); 0 where it lists none.
    listed_len: Vec<u32>,
}

impl Container {
    fn lists(&self, slot: u64) -> bool {
        match self {
            Container::Unknown => true,
            Container::Empty => false,
            Container::Valid(v) => v.listed.get((slot / 64) as usize).is_some_and(|w| w & (1 << (slot % 64)) != 0),
        }
    }
    /// The length of the longest payload this container lists in `slot`; an unknown
    /// container may list any, to the slot's end.
    fn listed_len(&self, slot: u64) -> Option<u64> {
        match self {
            Container::Unknown => Some(u64::MAX),
            Container::Empty => None,
            Container::Valid(v) => match v.listed_len.get(slot as usize).copied() {
                Some(0) | None => None,
                Some(u32::MAX) => Some(u64::MAX),
                Some(n) => Some(u64::from(n) - 1),
            },
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Container::Unknown => "unknown",
            Container::Empty => "empty",
            Container::Valid(_) => "valid",
        }
    }
}

/// A header write waiting to be read back.
#[derive(Clone, Debug)]
struct Pending {
    ev: CheckpointEvent,
    since: Instant,
    next: Instant,
    tries: u32,
}

/// The newest committed checkpoint, for the overflow estimate.
#[derive(Clone, Debug)]
struct Commit {
    seq: u64,
    payload_len: u64,
    entries: u64,
    at: Instant,
    /// `SlotTable::header_writes` when it was committed.
    puts_at: u64,
    fixed_bytes: u64,
    /// The epoch its header write started (write order): read-backs complete out of order
    /// (an io_uring checkpoint's payload can land after the next checkpoint was read back),
    /// and only a later header write makes a newer commit. Seqs do not tell: they restart
    /// with LMCache's index.
    epoch: u32,
    /// Seen written (not a baseline found on the device at start): only the time between
    /// two such is an interval of LMCache's.
    observed: bool,
}

/// The overflow estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub entries: u64,
    pub bytes: u64,
    pub cap: u64,
    pub entry_bytes: f64,
}

/// Counts of slots by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub with_header: u64,
    pub confirmed: u64,
    pub by_state: [u64; 4],
}

/// Outcome of reading a container.
enum Read {
    Done(Container),
    /// The header or payload is not (yet) what the event announced.
    NotYet,
}

pub struct Watcher {
    geom: Geometry,
    slots: Arc<SlotTable>,
    dev: Arc<dyn StateWriter>,
    cfg: WatchConfig,
    containers: [Container; 2],
    pending: Vec<Pending>,
    /// The epoch of the newest event taken from the mailbox.
    seen_epoch: u32,
    counters: Counters,
    counters_dirty: bool,
    persist: Option<Persist>,
    loaded: Loaded,
    last_persist: Instant,
    /// `SlotTable::checkpoint_reads` when LMCache last committed a checkpoint through fdpblk
    /// (as its header write was planned), with fdpblk's geometry (None: not in this run). Early tails run only while it is the
    /// current count: before, a slot header may come from a LMCache that restarted with another
    /// slot size (it drops its old index) while the checkpoints on the drive still match, and a
    /// tail computed with fdpblk's slot size could be the start of LMCache's next slot; a read
    /// of a checkpoint header block since may be LMCache opening the device again. Such a read
    /// served from the page cache would not count: see [`Watcher::drop_header_pages`].
    geometry_seen_at: Option<u64>,
    /// The final round after the device stopped: `/dev/ublkbN` is gone, nothing to drop.
    stopped: bool,
    /// Why the cycle that marks the saved state unclean has not committed yet (it is retried).
    /// Until it does, a crash leaves the previous run's clean state on the drive, and the next
    /// run would trust confirmations that LMCache's writes since made stale.
    unclean_error: Option<String>,
    commit: Option<Commit>,
    started: Instant,
    interval: Option<Duration>,
    /// Intervals seen between commits (the check waits for a few).
    gaps: u32,
    /// The writeback delay at the last check, and whether it reached the interval.
    writeback: Option<Option<Duration>>,
    writeback_risk: bool,
    conflict: Option<String>,
    /// The larger capacity_bytes of LMCache's checkpoint last warned about.
    capacity_warned: Option<u64>,
    risk: bool,
    stalled: bool,
    summary: Summary,
    summary_at: Instant,
    trim_error: bool,
    /// Per container: it holds no loadable checkpoint, and LMCache wrote its payload since
    /// without a header write yet. That header may still come (buffered I/O writes back in
    /// any order) and make the container list what it lists: no deallocation until it does.
    awaiting_header: [bool; 2],
    /// Sweep (and deallocate) at the next step even without a checkpoint event.
    need_sweep: bool,
    /// Where the pass over the table for unwritten slots goes on (`None`: no pass pending).
    /// One pass after the start takes them all: nothing marks a slot unwritten later.
    reclaim_cursor: Option<u64>,
    reclaim_logged_at: Option<Instant>,
    /// The last deallocation of unwritten slots failed (its warning was given).
    reclaim_failing: bool,
    /// The last round left evicted slots to deallocate: the next one follows at once.
    trim_backlog: bool,
    /// Stale tails deallocated by this run, and their bytes (not persisted).
    tail_trims: u64,
    /// Unwritten slots deallocated by this daemon ("Unwritten slots"), and their bytes.
    reclaimed: u64,
    reclaimed_bytes: u64,
    /// The checkpoint epoch in which deallocating unwritten slots last failed: they pause
    /// until the next checkpoint.
    reclaim_error_epoch: Option<u32>,
    tail_trim_bytes: u64,
    /// Of `tail_trims`, those done early (before a checkpoint confirmed the slot).
    early_tail_trims: u64,
    /// Slots deallocated by the early-eviction rule in this run (not persisted).
    early_evictions: u64,
    /// Older containers made unloadable for early evictions (or early tails) in this run.
    invalidations: u64,
    /// Per container: header-block writes planned in this run, as of its last event taken
    /// (what a zeroing expects; see [`SlotTable::begin_container_zeroing`]).
    container_writes: [u64; 2],
    /// The handle of fdpblk's own writes.
    own_handle: Handle,
    /// The container of the newest checkpoint header write taken in this run (its write
    /// order; seqs can run backwards after an LMCache restart).
    last_written: Option<u8>,
    last_early_tails: Instant,
    /// Tail deallocation failed while this epoch was the newest seen: paused until the next.
    tail_error_epoch: Option<u32>,
    /// Completed headers whose early tail waits until no loadable checkpoint lists a longer
    /// payload in their slot (at most one per slot and header generation).
    deferred_tails: Vec<(u64, u16)>,
    /// A policy that learns from committed checkpoints (`Policy::observes_checkpoints`).
    observer: Option<SharedPolicy>,
    published: Arc<Mutex<Value>>,
}

/// Marked unwritten (R1): `Evicted` without a confirmation, not being trimmed. Any write
/// makes the state `Unknown`.
fn is_unwritten(l: u64) -> bool {
    life::state(l) == SlotState::Evicted && l & (life::CONFIRMED | life::TRIMMING) == 0
}

fn bitset(n: u64) -> Vec<u64> {
    vec![0u64; n.div_ceil(64) as usize]
}

impl Watcher {
    /// Loads fdpblk's state from `region` into `slots` (a fresh table), reads both checkpoint
    /// containers, and marks the persisted state unclean. Call before the device serves I/O.
    pub fn new(geom: Geometry, slots: Arc<SlotTable>, dev: Arc<dyn StateWriter>, cfg: WatchConfig, region: Option<Region>, own_handle: Handle) -> Self {
        let (persist, loaded) = match region {
            Some(r) => Persist::load_trusting(&*dev, r, &geom, &slots, own_handle, cfg.trust_saved_confirmations),
            None => (None, Loaded::default()),
        };
        if let Some(n) = &loaded.note {
            tracing::warn!("device {}: own state: {n}", cfg.device);
        }
        if cfg.writes_unseen {
            slots.orphans_everywhere();
        }
        let mut cfg = cfg;
        // Only where this run sees every write (R1); and only as a kind of slot trim.
        cfg.reclaim &= cfg.trim && !cfg.writes_unseen;
        // Zeroing a header block of another size would need a read-modify-write racing
        // LMCache's payload writes into the same block: keep the older copy instead.
        if cfg.early_evictions && !geom.block_align.is_multiple_of(dev.block_bytes()) {
            tracing::warn!(
                "device {}: early evictions off: LMCache's block_align {} is not a whole number of the drive's {}-byte blocks",
                cfg.device,
                geom.block_align,
                dev.block_bytes()
            );
            cfg.early_evictions = false;
        }
        let now = Instant::now();
        let reclaim = cfg.reclaim;
        let mut w = Watcher {
            geom,
            slots,
            dev,
            counters: loaded.counters.clone(),
            cfg,
            containers: [Container::Unknown, Container::Unknown],
            pending: Vec::new(),
            seen_epoch: 0,
            counters_dirty: false,
            persist,
            loaded,
            last_persist: now,
            commit: None,
            started: now,
            interval: None,
            gaps: 0,
            writeback: None,
            writeback_risk: false,
            conflict: None,
            capacity_warned: None,
            geometry_seen_at: None,
            stopped: false,
            unclean_error: None,
            risk: false,
            stalled: false,
            summary: Summary::default(),
            summary_at: now,
            trim_error: false,
            awaiting_header: [false; 2],
            need_sweep: true,
            reclaim_cursor: reclaim.then_some(0),
            reclaim_logged_at: None,
            reclaim_failing: false,
            trim_backlog: false,
            tail_trims: 0,
            reclaimed: 0,
            reclaimed_bytes: 0,
            reclaim_error_epoch: None,
            tail_trim_bytes: 0,
            early_tail_trims: 0,
            early_evictions: 0,
            invalidations: 0,
            container_writes: [0; 2],
            own_handle,
            last_written: None,
            last_early_tails: Instant::now(),
            tail_error_epoch: None,
            deferred_tails: Vec::new(),
            observer: None,
            published: Arc::new(Mutex::new(Value::Null)),
        };
        w.seen_epoch = w.slots.epoch();
        for copy in 0..2u8 {
            w.containers[usize::from(copy)] = match w.read_container(copy, None, None) {
                Read::Done(c) => c,
                Read::NotYet => Container::Unknown,
            };
        }
        w.mark_unwritten();
        // Baseline for the overflow estimate: the newest valid checkpoint on the device.
        if let Some(v) = w.newest() {
            w.commit = Some(Commit { seq: v.seq, payload_len: v.payload_len, entries: v.entries, at: now, puts_at: 0, fixed_bytes: v.fixed_bytes, epoch: w.seen_epoch, observed: false });
        }
        w.arm_alarm();
        // From now on a crash leaves an unclean state: confirmations are not trusted then.
        // A transient failure gets two more tries; after that the caller decides (`add`
        // refuses to serve) and the cycle is retried while the device runs.
        let mut marked = w.mark_in_use(region);
        for _ in 0..2 {
            if marked.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            marked = w.mark_in_use(region);
        }
        w.unclean_error = marked.err();
        let _ = w.sweep(false);
        w.publish();
        w
    }

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
                Read::NotYet => Container::Unknown,
            };
        }
        // The baseline for the overflow estimate and the stats, as `new` sets it: under the
        // epoch of the last event taken (none yet when the learner calls this), so every
        // checkpoint header written since still counts as newer.
        let baseline = self.newest().map(|v| (v.seq, v.payload_len, v.entries, v.fixed_bytes));
        if let Some((seq, payload_len, entries, fixed_bytes)) = baseline.filter(|b| self.commit.as_ref().is_none_or(|c| c.seq != b.0)) {
            self.commit = Some(Commit { seq, payload_len, entries, at: Instant::now(), puts_at: 0, fixed_bytes, epoch: self.seen_epoch, observed: false });
            self.arm_alarm();
        }
        self.need_sweep = true;
    }

    pub fn loaded(&self) -> &Loaded {
        &self.loaded
    }
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
    pub fn summary(&self) -> Summary {
        self.summary
    }
    /// Stale tails deallocated by this run.
    pub fn tail_trims(&self) -> u64 {
        self.tail_trims
    }
    /// Of [`Self::tail_trims`], those done before a checkpoint confirmed the slot.
    pub fn early_tail_trims(&self) -> u64 {
        self.early_tail_trims
    }
    /// Unwritten slots this daemon deallocated ("Unwritten slots" in the module doc).
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed
    }
    /// Slots deallocated by the early-eviction rule in this run.
    pub fn early_evictions(&self) -> u64 {
        self.early_evictions
    }
    /// Older checkpoint containers fdpblk made unloadable (zeroed) for early evictions.
    pub fn containers_invalidated(&self) -> u64 {
        self.invalidations
    }
    /// Connects the data path's `policy`: it takes back the history the restored slot table
    /// holds ([`SharedPolicy::resume`]), and gets every committed checkpoint's live entries if
    /// it wants them. Returns the slots it resumed from.
    pub fn attach(&mut self, policy: SharedPolicy) -> u64 {
        let resumed = policy.resume(&self.slots);
        self.observer = policy.observes_checkpoints().then_some(policy);
        resumed
    }
    /// The JSON the stats thread shows (refreshed by every step).
    pub fn published(&self) -> Arc<Mutex<Value>> {
        self.published.clone()
    }

    /// The valid copy LMCache loads: the highest seq, the first of two with one seq (as
    /// [`crate::layout::checkpoint::newest_valid`]).
    fn newest(&self) -> Option<&ValidCopy> {
        self.containers
            .iter()
            .rev()
            .filter_map(|c| match c {
                Container::Valid(v) => Some(&**v),
                _ => None,
            })
            .max_by_key(|v| v.seq)
    }

    /// Runs the state thread until `stop`, then a final step and a clean persist, or, when
    /// `clean` is false at the stop, a persist that leaves the state marked in use.
    pub fn run(mut self, stop: &AtomicBool, clean: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            let wait = self.next_wakeup().min(EARLY_TAILS_INTERVAL);
            self.slots.wait_events(wait);
            self.step();
            let retry = self.unclean_error.is_some() && self.last_persist.elapsed() >= Duration::from_secs(1);
            if retry || self.last_persist.elapsed() >= self.cfg.persist_interval {
                let _ = self.persist_now(false, false);
            }
        }
        self.stopped = true;
        self.step();
        let clean = clean.load(Ordering::SeqCst);
        if !clean {
            tracing::warn!("device {}: fdpblk's own state is saved as in use: the device did not stop cleanly", self.cfg.device);
        }
        let _ = self.persist_now(clean, true);
        self.publish();
    }

    /// The last round left evicted or unwritten slots to deallocate (the next one follows at
    /// once).
    pub fn trim_backlog(&self) -> bool {
        self.trim_backlog || self.reclaim_ready()
    }

    fn next_wakeup(&self) -> Duration {
        if self.trim_backlog() {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let mut d = self.cfg.persist_interval.saturating_sub(self.last_persist.elapsed());
        for p in &self.pending {
            if p.since.elapsed() < RETRY_WINDOW {
                d = d.min(p.next.saturating_duration_since(now));
            }
        }
        d
    }

    /// One round: take checkpoint events, read back what they announced, update slot states,
    /// deallocate what is dead, check the overflow estimate, publish the stats.
    pub fn step(&mut self) {
        let (events, alarm) = self.slots.take_events();
        let mut changed = false;
        for ev in events {
            self.seen_epoch = self.seen_epoch.max(ev.epoch);
            self.last_written = Some(ev.copy);
            self.container_writes[usize::from(ev.copy)] = ev.writes;
            self.awaiting_header[usize::from(ev.copy)] = false;
            // A newer write to the header block supersedes what was pending there.
            self.pending.retain(|p| p.ev.copy != ev.copy);
            self.containers[usize::from(ev.copy)] = Container::Unknown;
            let now = Instant::now();
            self.pending.push(Pending { ev, since: now, next: now, tries: 0 });
            changed = true;
        }
        let now = Instant::now();
        let mut still = Vec::new();
        for mut p in std::mem::take(&mut self.pending) {
            let touched = self.slots.take_touched(p.ev.copy);
            let due = if p.since.elapsed() < RETRY_WINDOW { p.next <= now } else { touched };
            if !due && !touched {
                still.push(p);
                continue;
            }
            // Only the newest checkpoint confirms: an older one read back late (its header
            // held back by writeback past later snapshots) may list a key deleted and put
            // again into the same slot since, which the newest, snapshotted before that
            // put, lacks.
            let confirm = p.ev.header.filter(|_| self.is_newer(p.ev.header, p.ev.epoch, p.ev.copy)).map(|_| p.ev.epoch);
            match self.read_container(p.ev.copy, p.ev.header, confirm) {
                Read::Done(c) => {
                    if let (Some(h), Container::Valid(v), true) = (p.ev.header, &c, self.is_newer(p.ev.header, p.ev.epoch, p.ev.copy)) {
                        self.committed(h, v.entries, v.fixed_bytes, p.ev.epoch);
                        self.geometry_seen_at = Some(p.ev.reads);
                    }
                    self.containers[usize::from(p.ev.copy)] = c;
                    changed = true;
                }
                Read::NotYet => {
                    p.tries += 1;
                    if p.tries == STUCK_READ_TRIES {
                        // Deallocation waits for this read: say why, once, where the header on
                        // the device is not one fdpblk reads (another meta_magic or version).
                        let why = self.container_header_error(p.ev.copy).map_or(String::new(), |e| format!(": its header block: {e}"));
                        tracing::warn!(
                            "device {}: checkpoint container {} written {:.0} s ago is still not a complete checkpoint after {} reads{why}; deallocation waits for it (fdpblk reads LMCache 0.5.6's LMCIDX01 version 1 checkpoints)",
                            self.cfg.device, p.ev.copy, p.since.elapsed().as_secs_f64(), p.tries
                        );
                    }
                    let backoff = self.cfg.retry_base.saturating_mul(1 << p.tries.min(20)).min(Duration::from_secs(1));
                    p.next = Instant::now() + backoff;
                    still.push(p);
                }
            }
        }
        self.pending = still;
        // A container left unknown (torn at start-up) is looked at again when it is written.
        for copy in 0..2u8 {
            if matches!(self.containers[usize::from(copy)], Container::Unknown)
                && !self.pending.iter().any(|p| p.ev.copy == copy)
                && self.slots.take_touched(copy)
            {
                if let Read::Done(c) = self.read_container(copy, None, None) {
                    self.containers[usize::from(copy)] = c;
                    changed = true;
                }
            }
            if matches!(self.containers[usize::from(copy)], Container::Empty)
                && !self.pending.iter().any(|p| p.ev.copy == copy)
                && self.slots.take_touched(copy)
            {
                self.awaiting_header[usize::from(copy)] = true;
                changed = true;
            }
        }
        if changed || std::mem::take(&mut self.need_sweep) || self.summary_at.elapsed() >= Duration::from_secs(10) {
            let allow = self.trims_allowed();
            let Sweep { dead: candidates, early, basis, tails } = self.sweep(allow);
            // Set again by either pass of `trim` below that leaves slots for the next round.
            self.trim_backlog = false;
            // The checkpoints read back must survive a power loss before a slot goes on their
            // word (condition 3): LMCache never flushes, and a container back at older contents
            // could list the slot.
            let durable = allow && (!candidates.is_empty() || !early.is_empty()) && self.flush_checkpoints();
            if durable && !candidates.is_empty() {
                self.trim(candidates);
            }
            // Slots only the older container lists go once it can no longer be loaded.
            if let (true, Some(n)) = (durable && !early.is_empty() && self.trims_allowed(), basis) {
                if self.invalidate_container(1 - n as u8) {
                    self.early_evictions += self.trim(early);
                }
            }
            if !tails.is_empty() {
                self.trim_tails(tails);
            }
        }
        // Its own pass, not the sweep's: a used drive's first start can leave millions of
        // unwritten slots, and a round takes only a bounded share of them.
        if self.reclaim_ready() {
            if self.flush_checkpoints() {
                let n = self.reclaim();
                // Once when the pass ends, and about once a minute while it goes on.
                let at = self.reclaim_logged_at.get_or_insert_with(Instant::now);
                if (self.reclaim_cursor.is_none() && self.reclaimed > 0) || (n > 0 && at.elapsed() >= Duration::from_secs(60)) {
                    *at = Instant::now();
                    let how = if self.reclaim_cursor.is_none() { "in all" } else { "so far" };
                    tracing::info!(
                        "device {}: deallocated {} slots {how} that no checkpoint lists and LMCache has not written since the start",
                        self.cfg.device, self.reclaimed
                    );
                }
            } else {
                // Not again in this checkpoint's epoch (the flush's warning said so).
                self.reclaim_error_epoch = Some(self.seen_epoch);
            }
        }
        if self.last_early_tails.elapsed() >= self.cfg.early_tails_every {
            self.last_early_tails = Instant::now();
            self.drop_header_pages();
            self.trim_early_tails();
        }
        self.check_overflow(alarm);
        self.publish();
    }

    /// True when deallocation may happen now (conditions 3 and 4 of the module doc).
    pub fn trims_allowed(&self) -> bool {
        self.cfg.trim
            && self.conflict.is_none()
            && self.pending.is_empty()
            && self.containers.iter().all(|c| !matches!(c, Container::Unknown))
            && !self.awaiting_header.iter().any(|&a| a)
            && !self.slots.events_pending()
            && self.slots.epoch() == self.seen_epoch
    }

    /// Why container `copy`'s header block is not a checkpoint header LMCache would load.
    fn container_header_error(&self, copy: u8) -> Option<String> {
        let mut block = vec![0u8; self.geom.block_align as usize];
        match self.dev.read_at(self.geom.container_offset(copy), &mut block) {
            Err(e) => Some(e.to_string()),
            Ok(_) => CheckpointHeader::parse(&block, self.geom.payload_cap()).err().map(|e| e.to_string()),
        }
    }

    /// Reads container `copy`. With `expect`, it must hold exactly that header and a payload
    /// matching its CRC (else `NotYet`); `confirm_epoch` confirms matching slots (claim A).
    fn read_container(&mut self, copy: u8, expect: Option<CheckpointHeader>, confirm_epoch: Option<u32>) -> Read {
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
            Ok(None) => Read::NotYet,
            Ok(Some(v)) => Read::Done(Container::Valid(Box::new(v))),
            Err(e) => {
                tracing::warn!("device {}: checkpoint seq {} in container {copy} is not usable: {e}; no deallocation until it is replaced", self.cfg.device, h.seq);
                Read::Done(Container::Unknown)
            }
        }
    }

    /// Streams the JSON: which slots it lists; confirmations and tags for matching entries.
    /// `Ok(None)`: the bytes parsed are not those the header's CRC vouches for (still on their
    /// way, or being rewritten); nothing was confirmed.
    fn parse(&mut self, copy: u8, h: &CheckpointHeader, confirm_epoch: Option<u32>) -> Result<Option<ValidCopy>, String> {
        let g = self.geom;
        let slots = &*self.slots;
        let mut listed = bitset(g.max_slots);
        let mut listed_len = vec![0u32; g.max_slots as usize];
        let epoch_now = slots.epoch();
        // Epochs since commit `K`: the slot's stamp must be at least this + 2 epochs old.
        let need = confirm_epoch.map(|k| epoch_now.wrapping_sub(k)).filter(|&d| u64::from(d) + 2 < life::STAMP_MASK);
        let mut last_tag: (String, String, u16) = (String::new(), String::new(), 0);
        let mut last_bucket: (String, u64) = (String::new(), 0);
        // Every live entry, for a policy that learns tenants from committed checkpoints.
        let mut live: Option<Vec<LiveEntry>> = (self.observer.is_some() && confirm_epoch.is_some()).then(Vec::new);
        // Confirmations wait until the CRC of the very bytes parsed matches the header's.
        let mut confirms: Vec<Confirm> = Vec::new();
        let dev = DevReader(&*self.dev);
        let mut reader = CrcRead { inner: RegionReader::new(&dev, g.container_offset(copy) + g.block_align, h.payload_len), crc: crc32fast::Hasher::new(), bytes: 0 };
        let limits = JsonLimits { max_payload_bytes: g.payload_cap().max(h.payload_len), ..JsonLimits::default() };
        let meta = parse_checkpoint_json(&mut reader, &limits, &mut |e| {
            // LMCache writes both as plain integers, and its loader takes anything `int()`
            // takes ("65536", 65536.0): an entry whose slot fdpblk cannot tell may list any
            // slot, so the whole copy is unknown and no deallocation rests on it.
            let (Some(off), Some(size)) = (e.offset, e.size) else {
                return Err(format!("entry {:?} has no plain integer offset and size", e.key.chars().take(200).collect::<String>()));
            };
            let Some((slot, 0)) = g.slot_of(off) else { return Ok(()) };
            listed[(slot / 64) as usize] |= 1 << (slot % 64);
            let n = u32::try_from(size.saturating_add(1)).unwrap_or(u32::MAX);
            if let Some(l) = listed_len.get_mut(slot as usize) {
                *l = (*l).max(n);
            }
            // An object key with a lone surrogate has no identity (its UTF-8 is LMCache's hash
            // input): listed, so protected, but never confirmed. A legacy key's is its hash's.
            let key = Key::parse(e.key).ok().filter(|k| !e.key_lossy || matches!(k, Key::Legacy(_)));
            if let Some(live) = live.as_mut() {
                if let Some(key) = &key {
                    let (identity, salt) = match key {
                        Key::Legacy(k) => (legacy_identity(k.chunk_hash_hex), ""),
                        Key::Object(k) => (object_identity(e.key), k.cache_salt.unwrap_or("")),
                    };
                    // Consecutive entries mostly share a salt: hash its bucket once per run.
                    if last_bucket.0 != salt {
                        last_bucket = (salt.to_string(), salt_bucket_id(salt));
                    }
                    live.push(LiveEntry { slot, identity, salt_bucket: last_bucket.1 });
                }
            }
            let Some(need) = need else { return Ok(()) };
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
            confirms.push(Confirm { slot, was: l, new, fresh });
            Ok(())
        });
        // A payload that does not parse may be one still on its way or being rewritten: if the
        // bytes read, and the rest, do not make the CRC, it is read again, not called unusable.
        let whole = |r: &mut CrcRead<_>| std::io::copy(r, &mut std::io::sink()).is_ok() && r.bytes == h.payload_len && r.crc.clone().finalize() == h.crc32;
        let meta = match meta {
            Err(_) if !whole(&mut reader) => return Ok(None),
            m => m.map_err(|e| e.to_string())?,
        };
        if !whole(&mut reader) {
            return Ok(None);
        }
        for c in confirms {
            if c.fresh {
                // Snapshotted after the write, which came through this run (or, for a
                // record from before it, after this run's first checkpoint header).
                slots.settle_unseen(c.slot);
            }
            if c.new != c.was {
                slots.cas_life(c.slot, c.was, c.new);
            }
        }
        // Compared as Python's loader compares them: `65536.0 == 65536`.
        let geo = [
            ("block_align", meta.py_int("block_align"), g.block_align),
            ("header_bytes", meta.py_int("header_bytes"), g.header_bytes),
            ("slot_bytes", meta.py_int("slot_bytes"), g.slot_bytes),
            ("meta_total_bytes", meta.py_int("meta_total_bytes"), g.meta_total_bytes),
        ];
        if let Some((name, Some(theirs), ours)) = geo.into_iter().find(|(_, t, o)| t.is_some_and(|t| t != *o)) {
            let msg = format!(
                "LMCache's checkpoint seq {} says {name} {theirs}, but fdpblk serves the device with {ours}: fdpblk's layout is wrong; deallocation is off until the device is re-added with the right geometry",
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
                    "device {}: LMCache's checkpoint seq {} says capacity_bytes {theirs}, more than the {} fdpblk took its layout with: slots past slot {} are not placed by key nor deallocated; re-add the device with --capacity-bytes {theirs}",
                    self.cfg.device, h.seq, g.capacity_bytes, g.max_slots.saturating_sub(1)
                );
            }
        }
        // What the checkpoint costs besides its entries, as measured in this one.
        let fixed_bytes = match meta.entries_bytes {
            0 => FIXED_JSON_BYTES + meta.device_path.as_ref().map_or(0, |p| p.len() as u64),
            e => h.payload_len.saturating_sub(e),
        };
        if let (Some(entries), Some(p)) = (live, self.observer.as_mut()) {
            p.observe(&Observation::Checkpoint { seq: h.seq, entries: &entries });
        }
        Ok(Some(ValidCopy { seq: h.seq, payload_len: h.payload_len, entries: meta.entries, fixed_bytes, listed, listed_len }))
    }

    /// A checkpoint LMCache committed through fdpblk (read back and verified).
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
    /// `n + 1`.
    fn is_newer(&self, h: Option<CheckpointHeader>, epoch: u32, copy: u8) -> bool {
        let (Some(h), Some(c)) = (h, self.commit.as_ref()) else { return true };
        let successor = matches!(&self.containers[usize::from(1 - copy.min(1))], Container::Valid(o) if o.seq.checked_add(1) == Some(h.seq));
        (epoch.wrapping_sub(c.epoch) as i32) > 0 && (h.seq > c.seq || h.seq == 1 || successor)
    }

    fn committed(&mut self, h: CheckpointHeader, entries: u64, fixed_bytes: u64, epoch: u32) {
        let now = Instant::now();
        // The first checkpoint after a baseline found at start comes any time after the start.
        let prev = self.commit.as_ref().filter(|c| c.observed).map(|c| c.at);
        if let Some(p) = prev {
            let d = now.duration_since(p);
            self.interval = Some(match self.interval {
                Some(i) => (i * 3 + d) / 4,
                None => d,
            });
            self.gaps = self.gaps.saturating_add(1);
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
        self.stalled = false;
        self.arm_alarm();
    }

    /// Warns (once per episode) when the kernel may hold a dirty page back as long as LMCache's
    /// checkpoint interval: with buffered writes a checkpoint's header could then reach the
    /// drive after slot writes of a later snapshot, which the deallocation rules assume it
    /// does not. O_DIRECT writes (MP mode) do not wait in the page cache.
    fn check_writeback(&mut self) {
        const GAPS: u32 = 3;
        let (Some(interval), Some(delay)) = (self.interval, self.cfg.writeback.now()) else { return };
        self.writeback = Some(delay);
        let risk = self.gaps >= GAPS && writeback_outlasts_interval(interval, delay);
        if risk && !self.writeback_risk {
            let held = delay.map_or_else(|| "indefinitely (vm.dirty_writeback_centisecs is 0)".to_string(), |d| format!("{:.1}s (vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs)", d.as_secs_f64()));
            tracing::warn!(
                "device {}: LMCache checkpoints about every {:.1}s, and the kernel may hold a dirty page back {held}: with buffered writes (LMCache's non-MP default) a checkpoint header could reach the drive after later slot writes, which fdpblk's deallocation assumes it does not; fix: keep vm.dirty_expire_centisecs + vm.dirty_writeback_centisecs well below LMCache's meta_checkpoint_interval_sec (in centiseconds), or raise that interval. O_DIRECT writes (MP mode) are not affected",
                self.cfg.device,
                interval.as_secs_f64()
            );
        } else if !risk && self.writeback_risk {
            tracing::info!("device {}: LMCache's checkpoint interval is again above the kernel's writeback delay", self.cfg.device);
        }
        self.writeback_risk = risk;
    }

    /// The container whose not listing a confirmed slot makes it an early eviction: the one
    /// written last in this run, when it holds a valid checkpoint whose seq is one higher than
    /// the other's (the one LMCache loads, and the newest snapshot of the process writing).
    fn early_eviction_basis(&self) -> Option<usize> {
        if !self.cfg.early_evictions {
            return None;
        }
        let n = usize::from(self.last_written?);
        let Container::Valid(v) = &self.containers[n] else { return None };
        match &self.containers[1 - n] {
            // Only the immediate predecessor: its header write has come and gone. With an
            // older view, that header (buffered I/O writes back in any order) may still be on
            // its way and would bring back a copy listing what was deallocated.
            // (An empty one lists nothing: no slot is an early eviction then.)
            Container::Valid(o) if o.seq.checked_add(1) == Some(v.seq) => Some(n),
            _ => None,
        }
    }

    /// Counts slots by state, relabels confirmed ones live/evicted, and returns, when `allow`,
    /// the trim candidates (confirmed and listed by neither container) and the early evictions
    /// (confirmed, listed only by the older container), and the slots whose stale tail may go
    /// (confirmed, listed, tail not yet deallocated).
    fn sweep(&mut self, allow: bool) -> Sweep {
        let mut s = Summary::default();
        let mut out = Vec::new();
        let mut early = Vec::new();
        let mut tails = Vec::new();
        let basis = self.early_eviction_basis();
        let tails_on = self.cfg.trim_tails && self.conflict.is_none();
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

    /// Marks the slots that neither container lists and no checkpoint confirmed as unwritten
    /// (R1 of "Unwritten slots"): before the device serves I/O, when fdpblk first takes the
    /// device (its reserved tail read, and no superblock there) and both containers are known.
    fn mark_unwritten(&mut self) {
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
    fn layout_in_use(&self) -> bool {
        self.conflict.is_none() && self.geometry_seen_at == Some(self.slots.checkpoint_reads())
    }

    /// Whether the pass for unwritten slots may go on now: one is pending, and R2 and
    /// conditions 3 and 4 hold (the caller flushes for condition 3).
    fn reclaim_ready(&self) -> bool {
        self.reclaim_cursor.is_some() && self.trims_allowed() && self.layout_in_use() && self.reclaim_error_epoch != Some(self.seen_epoch)
    }

    /// Goes on with the pass for unwritten slots from its cursor and deallocates those found
    /// (R1 checked per slot by the CAS, listing by neither container here). Runs of
    /// consecutive slots go in one deallocation (a fresh drive's unwritten slots are mostly
    /// one run past LMCache's bump pointer). A round ends after `trim_per_round` requests or
    /// `trim_round_time`, as the evictions' do, so that checkpoints keep being read back;
    /// the next round follows at once and goes on from there.
    fn reclaim(&mut self) -> u64 {
        let Some(mut slot) = self.reclaim_cursor else { return 0 };
        let began = Instant::now();
        let end = self.slots.len() as u64;
        let (mut done, mut requests) = (0, 0);
        let mut run: Vec<(u64, u64)> = Vec::new();
        while slot < end {
            if slot.is_multiple_of(RECLAIM_SCAN_STRIDE) && began.elapsed() >= self.cfg.trim_round_time {
                break;
            }
            let l = self.slots.life(slot);
            // Marked `TRIMMING` as it joins the run: a write to it waits from here on, so a run
            // goes out as soon as the next slot does not join it, not when the scan moves on.
            let joins = (run.len() as u64) < RECLAIM_RUN_SLOTS
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

    /// The stale tail of `slot`'s current contents, as (offset in the slot, length): from the
    /// end of its payload (rounded up to `block_align`, what LMCache's loads read) to the end
    /// of the slot. None when the payload fills the slot.
    fn tail_of(&self, slot: u64) -> Option<(u64, u64)> {
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
    /// `payload_len` rounded up to `block_align`: no process can read past it. A put into the
    /// slot during the deallocation is held by its queue until it returned, like a slot trim.
    fn trim_tails(&mut self, candidates: Vec<(u64, u64)>) {
        if self.tail_error_epoch == Some(self.seen_epoch) {
            return; // paused after an error until the next checkpoint
        }
        // The headers must be durable before their tails go (as for early tails).
        if !self.flush_for_tails() {
            return;
        }
        let g = self.geom;
        let mut hdr = vec![0u8; SLOT_HEADER_PREFIX];
        for (slot, l0) in candidates {
            let l = self.slots.life(slot);
            if l != l0 {
                continue;
            }
            // One snapshot of the record, checked against the header on the drive; the range
            // comes from that header's own (full-width) length.
            let Some(e) = self.slots.entry(slot) else { continue };
            let off = g.slot_offset(slot);
            let Ok(Some(h)) = self.header_on_drive(off, &e, &mut hdr) else { continue };
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
    /// round, before any checkpoint confirmed them ("Early tails" in the module doc): one
    /// flush makes those headers durable, then each slot whose header is still that one
    /// and whose on-drive header carries it has its tail deallocated under the trim CAS.
    pub fn trim_early_tails(&mut self) {
        // While the gate is closed (LMCache opened the device, or an error paused tails until
        // the next checkpoint) the completions stay flagged and the deferred tails kept: they
        // go once the gate opens, not only when a checkpoint confirms them.
        if !self.cfg.early_tails || self.conflict.is_some() || self.geometry_seen_at != Some(self.slots.checkpoint_reads()) {
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
        let quiet = !self.slots.events_pending() && self.slots.epoch() == self.seen_epoch && self.pending.is_empty();
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
        if !self.flush_for_tails() {
            return;
        }
        let g = self.geom;
        let mut hdr = vec![0u8; SLOT_HEADER_PREFIX];
        for (slot, generation) in todo {
            let Some(e) = current(self, slot, generation) else { continue };
            let off = g.slot_offset(slot);
            let Ok(Some(h)) = self.header_on_drive(off, &e, &mut hdr) else { continue };
            let Some((start, len)) = self.tail_after(h.payload_len) else { continue };
            // The life word changes with loads and stamps too: retry while nothing but payload
            // was written since the header completed (a write past the payload, such as the
            // next put's payload ahead of its header, clears HEADER_DONE).
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
    fn listed_longer(&self, slot: u64, payload_len: u64) -> bool {
        (0..2).any(|c| self.listed_longer_in(c, slot, payload_len))
    }

    /// [`Watcher::listed_longer`] for container `c` alone.
    fn listed_longer_in(&self, c: usize, slot: u64, payload_len: u64) -> bool {
        // The tail starts where this payload's last block ends; a listed one reaches to its own.
        let ours = self.geom.payload_end(payload_len);
        self.containers[c].listed_len(slot).is_some_and(|len| self.geom.payload_end(len) > ours)
    }

    /// The slot header at `off` on the drive, when it carries `e`'s identity and length
    /// (condition 5; the table keeps 32 bits of length).
    fn header_on_drive(&self, off: u64, e: &SlotEntry, buf: &mut [u8]) -> std::io::Result<Option<SlotHeader>> {
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
                tracing::warn!("device {}: flushing before deallocating stale tails: {err}; paused until the next checkpoint", self.cfg.device);
                self.tail_error_epoch = Some(self.seen_epoch);
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
                if self.tail_error_epoch.is_none() {
                    tracing::warn!("device {}: deallocating the stale tail of slot {slot}: {err}; paused until the next checkpoint", self.cfg.device);
                }
                self.tail_error_epoch = Some(self.seen_epoch);
                false
            }
        }
    }

    /// Deallocates the candidates (conditions 2, 4 and 5 checked per slot; see the module doc).
    fn trim(&mut self, candidates: Vec<(u64, u64)>) -> u64 {
        let mut done = 0;
        let g = self.geom;
        let mut hdr = vec![0u8; SLOT_HEADER_PREFIX];
        let began = Instant::now();
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
            if l != l0 || l & life::CONFIRMED == 0 || l & life::TRIMMING != 0 {
                continue;
            }
            let Some(e) = self.slots.entry(slot) else { continue };
            let off = g.slot_offset(slot);
            match self.header_on_drive(off, &e, &mut hdr) {
                Ok(Some(_)) => {}
                // Changed behind fdpblk's back: forget the confirmation.
                Ok(None) => {
                    self.slots.cas_life(slot, l, life::with_state(l & !life::CONFIRMED, SlotState::Unknown));
                    continue;
                }
                // A read that failed tells nothing about the slot: keep it, pause.
                Err(err) => {
                    if !self.trim_error {
                        tracing::warn!("device {}: reading slot {slot}'s header before deallocating it: {err}; deallocation paused until the next checkpoint", self.cfg.device);
                        self.trim_error = true;
                    }
                    return done;
                }
            }
            if !self.slots.cas_life(slot, l, l | life::TRIMMING) {
                continue;
            }
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
                    return done;
                }
            }
        }
        self.trim_error = false;
        done
    }

    /// Flushes the drive before deallocating on the word of the checkpoints read back.
    fn flush_checkpoints(&mut self) -> bool {
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

    /// Drops both containers' header blocks from the exported device's page cache, in each
    /// early-tail round (once a second) while early tails or the pass for unwritten slots are
    /// on. A LMCache that opens the device reads them first; with buffered I/O its own
    /// earlier checkpoint writes leave them cached, and a read served from the cache never
    /// reaches fdpblk, which would miss the restart that holds early tails and the pass for
    /// unwritten slots back (`geometry_seen_at`). Pages written back within the last second,
    /// and dirty ones, stay cached until the next drop: a LMCache process starts in seconds.
    /// If the drop fails, those wait for LMCache's next checkpoint, as after a read.
    fn drop_header_pages(&mut self) {
        if self.stopped || self.cfg.page_cache.is_none() || !self.cfg.trim || !(self.cfg.early_tails || self.cfg.reclaim) {
            return;
        }
        let g = self.geom;
        let res = (0..2u8).try_for_each(|c| self.drop_cached_range(g.container_offset(c), g.block_align));
        if let Err((path, e)) = res {
            if self.geometry_seen_at.take().is_none() {
                return; // the gate is closed already
            }
            if node_gone(&path, &e) {
                tracing::debug!("device {}: {} is gone ({e}); early tails and the pass for unwritten slots wait for LMCache's next checkpoint", self.cfg.device, path.display());
            } else {
                tracing::warn!("device {}: dropping the checkpoint header blocks of {} from the page cache: {e}; a LMCache opening the device could go unseen, so early tails and the pass for unwritten slots wait for its next checkpoint", self.cfg.device, path.display());
            }
        }
    }

    /// Drops the clean cached pages of `[off, off + len)` of the exported device (see
    /// [`WatchConfig::page_cache`]). Dirty pages stay: they hold LMCache's newer writes.
    fn drop_cached(&mut self, off: u64, len: u64) -> bool {
        match self.drop_cached_range(off, len) {
            Ok(()) => true,
            Err((path, e)) if node_gone(&path, &e) => {
                tracing::debug!("device {}: {} is gone ({e}); no early deallocation rests on its page cache", self.cfg.device, path.display());
                false
            }
            Err((path, e)) => {
                tracing::warn!("device {}: dropping {} from the page cache: {e}; a buffered reader may see the zeroed checkpoint header's old bytes, so no early deallocation rests on it", self.cfg.device, path.display());
                false
            }
        }
    }

    fn drop_cached_range(&self, off: u64, len: u64) -> Result<(), (std::path::PathBuf, std::io::Error)> {
        use std::os::fd::AsRawFd;
        let Some(path) = &self.cfg.page_cache else { return Ok(()) };
        std::fs::File::open(path).and_then(|f| {
            // Whole pages: the kernel drops only pages entirely inside the range.
            let (start, end) = (off & !4095, off.saturating_add(len).div_ceil(4096) * 4096);
            let (off, len) = (i64::try_from(start).unwrap_or(i64::MAX), i64::try_from(end - start).unwrap_or(i64::MAX));
            // SAFETY: a plain syscall on an open descriptor; it touches no memory of ours.
            match unsafe { libc::posix_fadvise(f.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED) } {
                0 => Ok(()),
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        })
        .map_err(|e| (path.clone(), e))
    }

    /// Makes the older container unloadable ("Early evictions" in the module doc): zeroes its
    /// header block, unless a write to that block was planned since this thread's view of it,
    /// with such writes held until the zeroes are durable. True when the container now holds
    /// no loadable checkpoint.
    fn invalidate_container(&mut self, copy: u8) -> bool {
        let c = usize::from(copy);
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

    /// The estimated size of LMCache's next checkpoint: entries of the newest committed one
    /// plus every put since (deletes are not visible, so it errs high), times the observed
    /// bytes per entry.
    pub fn estimate(&self) -> Option<Estimate> {
        let c = self.baseline();
        let puts = self.slots.header_writes().saturating_sub(c.puts_at);
        let entry_bytes = if c.entries > 0 { c.payload_len.saturating_sub(c.fixed_bytes).max(1) as f64 / c.entries as f64 } else { DEFAULT_ENTRY_BYTES };
        let entries = c.entries + puts;
        Some(Estimate { entries, bytes: c.fixed_bytes + (entries as f64 * entry_bytes).ceil() as u64, cap: self.geom.payload_cap(), entry_bytes })
    }

    /// The newest committed checkpoint, or an empty one when fdpblk started.
    fn baseline(&self) -> Commit {
        self.commit.clone().unwrap_or(Commit { seq: 0, payload_len: 0, entries: 0, at: self.started, puts_at: 0, fixed_bytes: FIXED_JSON_BYTES, epoch: 0, observed: false })
    }

    /// Tells the data path after how many more puts the estimate reaches the risk threshold.
    fn arm_alarm(&self) {
        let c = self.baseline();
        let Some(e) = self.estimate() else { return };
        let threshold = RISK_FRACTION * e.cap as f64 - c.fixed_bytes as f64;
        let fit = (threshold / e.entry_bytes).floor().max(0.0) as u64;
        self.slots.set_alarm_at(c.puts_at + fit.saturating_sub(c.entries).max(1));
    }

    /// LMCache's `meta_total_bytes` that holds a checkpoint of twice `bytes`.
    pub fn meta_total_needed(&self, bytes: u64) -> u64 {
        let a = self.geom.block_align;
        let container = (a + 2 * bytes).div_ceil(a) * a;
        (2 * container).div_ceil(1 << 20) << 20
    }

    fn check_overflow(&mut self, _alarm: bool) {
        let Some(e) = self.estimate() else { return };
        let c = self.baseline();
        let risk = e.bytes as f64 >= RISK_FRACTION * e.cap as f64;
        let dev = self.cfg.device;
        if risk && !self.risk {
            tracing::error!(
                "device {dev}: checkpoint overflow risk: LMCache's next checkpoint will be about {} bytes ({} entries x {:.0} bytes), {:.0}% of the {}-byte limit of a checkpoint container (meta_total_bytes {}). Above the limit LMCache skips every checkpoint with only a warning, and its next restart loses every entry stored since checkpoint seq {}. Fix: set LMCache's meta_total_bytes to at least {} (rust_raw_block.meta_total_bytes, or meta_total_bytes of the MP adapter); that is a new layout, so LMCache starts with an empty cache, and fdpblk must be re-added with the new value (its error then names the command that erases the old checkpoint)",
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
        let puts = self.slots.header_writes().saturating_sub(c.puts_at);
        let after = self.interval.map_or(STALL_MIN, |i| (i * 3).max(STALL_MIN)).max(self.cfg.stall_min);
        let age = c.at.elapsed();
        let stalled = puts > 0 && age >= after;
        if stalled && !self.stalled {
            let cause = if e.bytes >= e.cap {
                format!(
                    "its checkpoint (about {} bytes) no longer fits the {}-byte container, so LMCache skips it; fix: meta_total_bytes of at least {} (a new layout: LMCache starts empty)",
                    e.bytes,
                    e.cap,
                    self.meta_total_needed(e.bytes)
                )
            } else {
                "LMCache writes a checkpoint only when no I/O has been in flight for 100 ms at its (60 s) tick, so continuous traffic defers it; fix: leave LMCache idle moments, or lower meta_checkpoint_interval_sec".to_string()
            };
            tracing::error!(
                "device {dev}: LMCache wrote {puts} slots but no checkpoint for {}s (last seq {}): {cause}. A restart now loses those entries",
                age.as_secs(),
                c.seq
            );
        }
        self.stalled = stalled;
    }

    /// Runs a persist cycle now (`clean` at shutdown; `force` even if nothing changed, as is
    /// every cycle until the start-up one committed). The error, if it failed.
    pub fn persist_now(&mut self, clean: bool, force: bool) -> Result<(), String> {
        self.last_persist = Instant::now();
        let Some(p) = self.persist.as_mut() else { return Ok(()) };
        let clean = clean && self.conflict.is_none();
        let force = force || self.counters_dirty || self.unclean_error.is_some();
        match p.cycle(&*self.dev, &self.slots, &self.counters, clean, force) {
            Ok(r) => {
                if let Some(r) = r {
                    self.counters.cycles = self.counters.cycles.saturating_add(1);
                    self.counters.own_bytes = self.counters.own_bytes.saturating_add(r.bytes);
                    self.counters_dirty = false;
                }
                // Marked only once durable: a superblock whose flush failed is not yet.
                if !p.flush_owed() && self.unclean_error.take().is_some() && !clean {
                    tracing::info!("device {}: own state written: the saved state is marked in use", self.cfg.device);
                }
                Ok(())
            }
            Err(e) => {
                let e = e.to_string();
                tracing::warn!("device {}: writing own state: {e}", self.cfg.device);
                Err(e)
            }
        }
    }

    /// The start's mark: the saved state is in use from now on, durably. Where the region
    /// cannot hold this layout's state, a clean one of another layout there is marked, or a
    /// later run of that layout would trust confirmations this run may have outdated.
    fn mark_in_use(&mut self, region: Option<Region>) -> Result<(), String> {
        if self.persist.is_none() {
            let Some(r) = region else { return Ok(()) };
            return Persist::mark_in_use(&*self.dev, r, self.own_handle).map(|_| ()).map_err(|e| format!("marking the saved state in use: {e}"));
        }
        self.persist_now(false, true)?;
        match &self.persist {
            Some(p) if p.flush_owed() => Err("the flush after the state's superblock failed, so the mark may not be durable".into()),
            _ => Ok(()),
        }
    }

    /// Why the saved state could not be marked in use at start (see `unclean_error`), while
    /// that is so.
    pub fn unclean_error(&self) -> Option<&str> {
        self.unclean_error.as_deref()
    }

    /// Refreshes the JSON the stats thread shows.
    pub fn publish(&self) {
        let est = self.estimate();
        let c = self.commit.as_ref();
        let s = &self.summary;
        let handles: serde_json::Map<String, Value> =
            self.counters.trims_by_handle.iter().enumerate().filter(|(_, &n)| n > 0).map(|(h, n)| (h.to_string(), json!(n))).collect();
        let containers: Vec<Value> = self
            .containers
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = match c {
                    Container::Valid(v) => json!({"copy": i, "state": "valid", "seq": v.seq, "payload_len": v.payload_len, "entries": v.entries}),
                    c => json!({"copy": i, "state": c.name()}),
                };
                // A checkpoint header write whose read-back is not complete yet: what an
                // operator (or a test) needs when a checkpoint seems not to be followed.
                if let (Some(p), Some(o)) = (self.pending.iter().find(|p| usize::from(p.ev.copy) == i), v.as_object_mut()) {
                    o.insert("reading".into(), json!({
                        "seq": p.ev.header.map(|h| h.seq), "tries": p.tries,
                        "for_s": (p.since.elapsed().as_secs_f64() * 10.0).round() / 10.0,
                    }));
                }
                v
            })
            .collect();
        // What this daemon counted: the lifetime counters come back from the drive at every
        // start, a crash loses up to one persist interval of them, so they can go backwards;
        // monitoring takes these, which only restart at 0.
        let was = &self.loaded.counters;
        let since_handles: serde_json::Map<String, Value> = self
            .counters
            .trims_by_handle
            .iter()
            .enumerate()
            .map(|(h, &n)| (h, n.saturating_sub(was.trims_by_handle.get(h).copied().unwrap_or(0))))
            .filter(|&(_, n)| n > 0)
            .map(|(h, n)| (h.to_string(), json!(n)))
            .collect();
        let v = json!({
            "checkpoint_seq": c.map(|c| c.seq),
            "checkpoint_age_s": c.map(|c| (c.at.elapsed().as_secs_f64() * 10.0).round() / 10.0),
            "checkpoint_bytes": c.map(|c| c.payload_len),
            "checkpoint_entries": c.map(|c| c.entries),
            "checkpoint_cap_bytes": self.geom.payload_cap(),
            "checkpoint_estimate_bytes": est.map(|e| e.bytes),
            "overflow_risk": self.risk,
            "checkpoint_stalled": self.stalled,
            "checkpoint_interval_s": self.interval.map(|i| (i.as_secs_f64() * 10.0).round() / 10.0),
            "writeback_delay_s": self.writeback.map(|d| d.map(|d| d.as_secs_f64())),
            "writeback_risk": self.writeback_risk,
            "meta_total_bytes_needed": (self.risk || self.stalled).then(|| est.map(|e| self.meta_total_needed(e.bytes))).flatten(),
            "containers": containers,
            "slots": {
                "max_slots": self.slots.len(), "with_header": s.with_header, "confirmed": s.confirmed,
                "unknown": s.by_state[0], "live": s.by_state[1], "evicted": s.by_state[2], "trimmed": s.by_state[3],
                "identity_history": self.slots.history().len(), "identity_history_capacity": self.slots.history().capacity(),
                "returning": self.slots.returning(), "tags": self.slots.tags().len(),
            },
            "trim": {
                "enabled": self.cfg.trim, "allowed_now": self.trims_allowed(), "blocked_by": self.conflict,
                "layout_in_use": self.layout_in_use(),
                "trims": self.counters.trims, "trim_bytes": self.counters.trim_bytes, "handles": handles,
                "evictions": self.counters.evictions,
                "tails_enabled": self.cfg.trim_tails, "early_tails_enabled": self.cfg.early_tails,
                "tail_trims": self.tail_trims, "early_tail_trims": self.early_tail_trims, "tail_trim_bytes": self.tail_trim_bytes,
                "reclaim_enabled": self.cfg.reclaim, "reclaimed": self.reclaimed, "reclaimed_bytes": self.reclaimed_bytes,
                "early_evictions_enabled": self.cfg.early_evictions, "early_evictions": self.early_evictions, "containers_invalidated": self.invalidations, "containers_invalidated_bytes": self.invalidations * self.geom.block_align,
            },
            "own_state": {
                "persisted": self.persist.is_some(), "seq": self.persist.as_ref().map(|p| p.seq()),
                "cycles": self.counters.cycles, "bytes_written": self.counters.own_bytes,
                "loaded": self.loaded.found, "loaded_clean": self.loaded.clean,
                "region_offset": self.persist.as_ref().map(|p| p.region().offset), "region_bytes": self.persist.as_ref().map(|p| p.region().len),
            },
            "since_start": {
                "trims": self.counters.trims.saturating_sub(was.trims), "trim_bytes": self.counters.trim_bytes.saturating_sub(was.trim_bytes),
                "trim_handles": since_handles, "evictions": self.counters.evictions.saturating_sub(was.evictions),
                "own_state_cycles": self.counters.cycles.saturating_sub(was.cycles), "own_state_bytes": self.counters.own_bytes.saturating_sub(was.own_bytes),
            },
        });
        *self.published.lock().unwrap_or_else(|e| e.into_inner()) = v;
    }
}

/// The exported device `path` is gone: a stop under way (the kernel removes the disk before
/// the stop reaches the state thread). It serves no reader, so a failed page-cache drop there
/// is not worth a warning; nothing that needs the drop goes ahead either way. A node missing
/// while the kernel still has the disk (a mount namespace without it) is a setup problem,
/// and warns.
fn node_gone(path: &std::path::Path, e: &std::io::Error) -> bool {
    let disk_gone = || path.file_name().is_none_or(|n| !std::path::Path::new("/sys/class/block").join(n).exists());
    matches!(e.raw_os_error(), Some(libc::ENXIO | libc::ENODEV)) || (e.kind() == std::io::ErrorKind::NotFound && disk_gone())
}

#[cfg(test)]
mod tests;

/// A confirmation found while parsing a checkpoint, applied once the parsed bytes' CRC matched.
struct Confirm {
    slot: u64,
    was: u64,
    new: u64,
    /// The slot's write predates the checkpoint: its "written unseen" mark can go.
    fresh: bool,
}

/// Hashes what the parser reads, so that what is parsed is what the CRC vouched for.
struct CrcRead<R> {
    inner: R,
    crc: crc32fast::Hasher,
    bytes: u64,
}

impl<R: std::io::Read> std::io::Read for CrcRead<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}
