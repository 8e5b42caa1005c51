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
//! The parts, one concept each: `checkpoints` reads a container back and learns from it;
//! `evictions` sweeps for evicted slots and deallocates them (and zeroes the older
//! container for early evictions); `tails` deallocates the bytes a shorter put leaves behind
//! its payload (stale and early tails); `unwritten` deallocates the slots LMCache has not
//! written on a drive fdpblk takes for the first time; `page_cache` keeps LMCache's reads of
//! the checkpoint header blocks visible to fdpblk; `overflow` raises the checkpoint-overflow
//! alarm. Here: the rules they share (below), the round ([`Watcher::step`]) and fdpblk's own
//! persistence.
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
//! 4. **nothing pending**: every checkpoint header write seen has ended (a read can return a
//!    write's bytes before it completed, and the flush of 3 covers only completed ones) and
//!    was read back since;
//! 5. the slot header on the drive still carries the confirmed identity and length.
//!
//! In the terms of the issue: contents are evicted once they are "absent from two consecutive
//! committed checkpoints" (the two containers; consecutive seqs alternate between them) "and
//! not written since the earlier of them" (2), and only contents LMCache is known to have
//! committed qualify (1).
//!
//! # Why no live slot is ever deallocated
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
//! One kind of write leaves a CAS for a stale tail able to succeed: a write within the
//! current header's payload keeps the tail bits (`HEADER_DONE`, `STALE_TAIL`) and, in the
//! same epoch, the `life` word unchanged. It is excluded by range, not by the CAS: the tail
//! starts where that payload ends (both rounded up to `block_align`, the length checked
//! against the header on the drive), and a payload write judged against a header that
//! another queue replaced before it was placed counts as orphan bytes (`Pipeline::place`).
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
//!   seq, never one above, and a late seq 1 is not taken for a new index while the other
//!   container's seq 2 is the commit (before that, a late header is taken as newest by its
//!   higher seq, as it always was).
//! - *fdpblk restart*: unclean, confirmations are dropped; clean, they are kept (nothing
//!   writes the backing device while fdpblk is stopped — assumed; a checkpoint written then
//!   changes a container's header, which the clean stop recorded, and drops them all; 5
//!   checks each slot's header).
//!
//! Not proved, assumed: a single LMCache process per device, writing one checkpoint at a
//! time (0.5.6: the periodic thread, and `close()` after joining it; the join waits at most
//! 5 s, so a checkpoint `close()` or `checkpoint_now()` writes may overlap a slow periodic one.
//! Traced: two snapshots in flight at once that leave a torn or out-of-order container stop
//! deallocation, since condition 3 needs both containers' contents known and neither listing
//! the slot. If both land whole and in order, the later one can confirm with the other
//! in-flight header as K-1, whose completion does not precede the later snapshot: claim A's
//! premise fails. A put into slot s issued between the two snapshots can then be confirmed
//! while in flight; that is harmless, since the confirming checkpoint lists s, and LMCache's
//! idle rule takes no later snapshot without s while that put is still in flight.)
//!
//! Not closed, LMCache's own: a put whose header and checkpoint reach the drive while its
//! payload does not (LMCache never flushes; a power loss under buffered I/O or a volatile
//! write cache) is loaded after the crash over whatever the slot held: the previous key's
//! bytes without fdpblk, zeroes once fdpblk deallocated the slot. For the same key put back
//! into its own deallocated slot, that is zeroes where its identical old bytes would have
//! stood. With O_DIRECT on a drive whose completions are durable there is no such window.
//!
//! Claims A and B read "planned before" as "issued before": true for O_DIRECT (posix and
//! io_uring: a put commits after its writes completed). Buffered writeback (the non-MP
//! default) hands fdpblk the page cache's writes in its own order and time. While a dirty page
//! waits, LMCache reads it from the page cache, and fdpblk's later view of it is newer, so a
//! deallocation that races it is followed by its writeback. What the argument then assumes is
//! that writeback does not hold a checkpoint's header page back for a checkpoint interval
//! while slot pages dirtied after the next snapshot go out first: that checkpoint, arriving
//! late, could confirm a slot's old contents under a later put's payload. The kernel writes
//! an inode's dirty pages back once they are `vm.dirty_expire_centisecs` (30 s by default)
//! old, at the next flusher period (`vm.dirty_writeback_centisecs`, 5 s), against LMCache's
//! 60 s interval; keep it below the interval. That is per inode, not per page: the device is
//! one inode, written back in offset order, so under a heavy dirty load a pass over its dirty
//! pages can take longer (its dirty bytes over the drive's bandwidth); the check below
//! counts only the settings. `WatchConfig::writeback` checks this against the
//! observed interval and warns (`writeback_risk`); while that holds and LMCache is seen to
//! write through the page cache (dirty pages of the exported device), or where that cannot be
//! told, deallocation pauses (`WatchConfig::buffered`, [`Watcher::check_writeback_pause`]).
//! The pause is saved with fdpblk's state, and a restarted daemon carries it on until it has
//! judged the risk itself ([`Watcher::carry_writeback_pause`]); one with nothing to carry
//! pauses where it sees buffered writes until it has judged
//! ([`Watcher::pause_until_judged`]).

use crate::layout::checkpoint_header::CheckpointHeader;
use crate::layout::checkpoint_json::{parse_checkpoint_json, JsonLimits};
use crate::layout::keys::{legacy_identity, object_identity, salt_bucket_id, Key};
use crate::layout::slot_header::{SlotHeader, SLOT_HEADER_PREFIX};
use crate::layout::Geometry;
use crate::persist::dev::{DevReader, StateWriter};
use crate::persist::{CheckpointsNow, Counters, Loaded, Persist, Region, SavedPause};
use crate::place::{Handle, LiveEntry, Observation, Policy, SharedPolicy};
use crate::slot_table::{life, CheckpointEvent, SlotEntry, SlotState, SlotTable};
use crate::device::RegionReader;
use evictions::Sweep;
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
    /// `tails.rs`), before a checkpoint confirmed the slot.
    pub early_tails: bool,
    /// Deallocate an evicted slot once the checkpoint written last no longer lists it, after
    /// zeroing the older container's header ("Early evictions" in `evictions.rs`), instead of
    /// waiting until LMCache overwrote the older container.
    pub early_evictions: bool,
    /// Deallocate slots that no checkpoint lists and that this run has not written ("Unwritten
    /// slots" in `unwritten.rs`): on a drive that held data before, what LMCache never writes
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
    /// Checkpoints count as stalled this long (STALL_MIN by default) after the first slot write
    /// no checkpoint followed, or 3 observed intervals or 2 shortest gaps if longer.
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
    /// Whether LMCache writes through the page cache: while the writeback delay reaches the
    /// checkpoint interval (`writeback_risk`), deallocation pauses where it does, or where
    /// that cannot be told.
    pub buffered: BufferedWrites,
    /// Most evicted slots one round deallocates, and the longest it spends on them (the rest
    /// go in the next round, at once): [`TRIM_PER_ROUND`], [`TRIM_ROUND_TIME`].
    pub trim_per_round: u64,
    pub trim_round_time: Duration,
    /// Why deallocation is off although it was asked for (the backing takes none), for the
    /// stats; `None` where `trim` is what was asked.
    pub trim_off_because: Option<String>,
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

/// Whether the exported device is written through the page cache (LMCache's non-MP default:
/// buffered writes), which only then makes the writeback assumption of the module doc matter.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferedWrites {
    /// Not checked: taken as not buffered (the simulator, whose writeback is counted in puts).
    Unchecked,
    /// A fixed answer (`None`: cannot be told).
    Fixed(Option<bool>),
    /// Dirty or under-writeback pages of [`WatchConfig::page_cache`] (the `cachestat` system
    /// call, Linux 6.5): only a write through the page cache leaves them; O_DIRECT does not.
    PageCache,
}

impl BufferedWrites {
    /// Whether buffered writes are seen now (`Err`: why that cannot be told).
    fn seen(&self, page_cache: Option<&std::path::Path>) -> Result<bool, String> {
        match self {
            Self::Unchecked => Ok(false),
            Self::Fixed(b) => b.ok_or_else(|| "not known".to_string()),
            Self::PageCache => match page_cache {
                None => Err("no exported device to look at".into()),
                Some(p) => dirty_pages(p).map(|n| n > 0).map_err(|e| format!("cachestat on {}: {e}", p.display())),
            },
        }
    }
}

/// Pages of `path`'s page cache that are dirty or under writeback.
fn dirty_pages(path: &std::path::Path) -> std::io::Result<u64> {
    let st = page_cache::cachestat(&std::fs::File::open(path)?, 0, 0)?; // len 0: to the end
    Ok(st.nr_dirty.saturating_add(st.nr_writeback))
}

/// Wall-clock seconds (Unix time), what a checkpoint's sighting is kept in across a restart.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The longest a dirty page waits for writeback without memory pressure or a sync: it expires
/// after `expire` centiseconds and the flusher looks every `every` (0: never, unbounded).
pub fn kernel_writeback_delay(expire: u64, every: u64) -> Option<Duration> {
    (every > 0).then(|| Duration::from_millis(expire.saturating_add(every).saturating_mul(10)))
}

/// Checkpoint intervals seen before the writeback risk is judged: the first few may be
/// LMCache's out-of-turn checkpoints (`close()`, `checkpoint_now()`) or idle multiples.
const JUDGE_GAPS: u32 = 3;
/// LMCache's checkpoint thread wakes every `max(1, meta_checkpoint_interval_sec)` seconds.
const MIN_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

/// Whether LMCache's checkpoint `interval` leaves the writeback assumption in doubt: a page may
/// be held back (`delay`, `None` unbounded) for as long as the interval.
pub fn writeback_outlasts_interval(interval: Duration, delay: Option<Duration>) -> bool {
    delay.is_none_or(|d| d >= interval)
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self { trim: true, trim_tails: true, early_tails: true, early_evictions: true, reclaim: true, trust_saved_confirmations: true, writes_unseen: false, early_tails_every: EARLY_TAILS_INTERVAL, retry_base: Duration::from_millis(2), persist_interval: Duration::from_secs(5), device: -1, stall_min: STALL_MIN, page_cache: None, writeback: WritebackDelay::Unchecked, buffered: BufferedWrites::Unchecked, trim_per_round: TRIM_PER_ROUND, trim_round_time: TRIM_ROUND_TIME, trim_off_because: None }
    }
}

/// Most evicted slots deallocated in one round of the state thread, and the longest a round
/// spends on them: the rest wait for the next round, which follows at once, so that saves and
/// a stop are never held up behind a long eviction round (each slot costs a header read and a
/// deallocation).
pub const TRIM_PER_ROUND: u64 = 4096;
pub const TRIM_ROUND_TIME: Duration = Duration::from_secs(1);

/// Most unwritten slots in one deallocation request (a run of consecutive slots), and most
/// bytes ([`reclaim_run_slots`]).
const RECLAIM_RUN_SLOTS: u64 = 256;
const RECLAIM_RUN_BYTES: u64 = 256 << 20;

/// Slots of `slot_bytes` in one reclaim run: a put into any of them waits for the whole
/// deallocation, and the run lies where LMCache's next new slots go (past its bump pointer),
/// so 256 slots of 32 MiB (8 GiB in one request) would hold its puts for as long as a drive
/// takes over that; at most 256 MiB, and at least one slot.
fn reclaim_run_slots(slot_bytes: u64) -> u64 {
    (RECLAIM_RUN_BYTES / slot_bytes.max(1)).clamp(1, RECLAIM_RUN_SLOTS)
}
/// How many slots the reclaim pass looks at between two looks at the round's clock.
const RECLAIM_SCAN_STRIDE: u64 = 1 << 16;

/// How often the state thread deallocates early stale tails (its longest sleep): each round
/// with work costs one flush of the drive.
pub const EARLY_TAILS_INTERVAL: Duration = Duration::from_secs(1);

/// The overflow alarm fires when the next checkpoint is estimated at this fraction of the cap.
pub const RISK_FRACTION: f64 = 0.9;
/// How often a checkpoint stall that lasts is said again.
const STALL_REPEAT: Duration = Duration::from_secs(3600);
/// JSON bytes of a checkpoint besides its entries (plus the device_path string), assumed
/// before a checkpoint with an `entries` object was seen; then its own figure is used.
const FIXED_JSON_BYTES: u64 = 320;
/// Bytes per entry assumed before a checkpoint with entries was seen (reference §11).
const DEFAULT_ENTRY_BYTES: f64 = 240.0;
/// The default of `WatchConfig::stall_min`.
const STALL_MIN: Duration = Duration::from_secs(180);
/// Active retries of a checkpoint whose header block is not the one announced stop after
/// this; later only writes to the container (or a new header) trigger a look. A payload that
/// does not match its header's CRC is read again after a write to it, at any time, and (in
/// case a write came unseen, as while the layout was learned) every
/// [`PAYLOAD_RECHECK`] within this window.
const RETRY_WINDOW: Duration = Duration::from_secs(120);

/// See [`RETRY_WINDOW`].
const PAYLOAD_RECHECK: Duration = Duration::from_secs(30);

/// Evicted slots whose header could not be read that are tried after the others (beyond this
/// many, they are tried in slot order again).
const UNREADABLE_HEADERS_MAX: usize = 4096;

/// How long a written checkpoint may stay unreadable before fdpblk says why it waits.
const STUCK_AFTER: Duration = Duration::from_secs(30);

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
    /// Per slot, the longest payload the checkpoint lists there.
    listed_len: ListedLens,
    /// The path the LMCache that wrote it opened (its index is only for that path).
    device_path: Option<String>,
}

/// Per slot a checkpoint lists, the longest payload it lists there plus one (saturating: one of
/// 4 GiB or more protects the whole slot), sorted by slot. Its size follows the checkpoint's
/// entries (8 bytes each; about 4.5 MiB for a full 128 MiB checkpoint), not the layout's slot
/// count, which as a table would be 1 GiB at 2^28 slots.
#[derive(Clone, Debug, Default)]
struct ListedLens {
    /// (slot, longest length plus one), sorted and one per slot after a merge.
    entries: Vec<(u32, u32)>,
    /// Entries at which the next merge comes.
    merge_at: usize,
}

impl ListedLens {
    /// Entries noted before the first merge.
    const FIRST_MERGE: usize = 1 << 16;

    /// Slot `slot` (below [`crate::layout::geometry::MAX_SLOTS`]) is listed with `n` (length
    /// plus one); a slot listed again (LMCache never does; a crafted checkpoint may, as often
    /// as its payload has room) adds an entry, which [`Self::finish`] merges. Merged whenever
    /// the entries double since the last merge, so they stay within twice the slots listed.
    fn note(&mut self, slot: u64, n: u32) {
        if let Ok(s) = u32::try_from(slot) {
            self.entries.push((s, n));
            if self.entries.len() >= self.merge_at.max(Self::FIRST_MERGE) {
                self.merge();
                self.merge_at = 2 * self.entries.len();
            }
        }
    }
    /// Sorted by slot, one entry per slot with its longest length.
    fn merge(&mut self) {
        self.entries.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        self.entries.dedup_by_key(|e| e.0);
    }
    /// [`Self::merge`], its spare room given back.
    fn finish(&mut self) {
        self.merge();
        self.entries.shrink_to_fit();
    }
    /// The slot's longest length plus one; 0 where none is listed. A slot past any layout,
    /// which [`Self::note`] could not keep, reads as listed whole.
    fn get(&self, slot: u64) -> u32 {
        let Ok(s) = u32::try_from(slot) else { return u32::MAX };
        self.entries.binary_search_by_key(&s, |e| e.0).map_or(0, |i| self.entries[i].1)
    }
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
            Container::Valid(v) => match v.listed_len.get(slot) {
                0 => None,
                u32::MAX => Some(u64::MAX),
                n => Some(u64::from(n) - 1),
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
    /// The last read found the announced header and a payload not (yet) matching its CRC:
    /// read again only after a write to the payload (each read may be 64 MiB), or after
    /// [`PAYLOAD_RECHECK`].
    payload_wait: bool,
    /// When it was last read.
    read_at: Instant,
    /// The payload was written since the last read (or the write of one planned before it
    /// landed).
    written: bool,
    /// Said why it waits.
    warned: bool,
    /// Rounds it waited for its header write to end ([`SlotTable::header_writes_ended`]);
    /// 0 once it has.
    write_waits: u32,
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
    /// The header is not (yet) what the event announced, or could not be read.
    NotYet,
    /// The header is, but the payload is not (yet) the bytes its CRC vouches for.
    Incomplete,
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
    /// The last round that saw no slot write past the baseline commit (at first, the start):
    /// LMCache has had something to checkpoint since then at most. An idle LMCache writes no
    /// checkpoint, so the commit's own age says nothing of a stall.
    clean_at: Instant,
    /// The previous daemon saw slot writes that no checkpoint followed yet (its saved
    /// `uncheckpointed_since`, for the checkpoint this one starts from), until the next one.
    carried_dirty: bool,
    /// `SlotTable::checkpoint_reads` when LMCache's last index load was taken: the next is a
    /// pair of header-block reads after it (`Watcher::check_reload`).
    loads_taken: u64,
    /// `SlotTable::header_writes` when LMCache last opened the device with puts unlisted
    /// by the checkpoint it loaded: the index it has now lacks them, so they no longer wait
    /// for a checkpoint (0: not in this run). The overflow estimate still counts them.
    reloaded_at: u64,
    /// LMCache index loads seen by this daemon (both header blocks read in a row), and the
    /// puts they lost (made after the checkpoint loaded), for stats.
    lmcache_opens: u64,
    lmcache_lost_puts: u64,
    /// The running average of how long LMCache took to checkpoint what it wrote: from the
    /// previous commit, or from the first slot write after it where LMCache was idle first.
    interval: Option<Duration>,
    /// Intervals seen between commits (the check waits for a few).
    gaps: u32,
    /// The last few intervals, for the writeback check ([`Watcher::short_gap`]).
    recent_gaps: std::collections::VecDeque<Duration>,
    /// The writeback delay at the last check, and whether it reached the interval.
    writeback: Option<Option<Duration>>,
    writeback_risk: bool,
    /// Why deallocation is paused: `writeback_risk` while LMCache writes through the page
    /// cache, or while that cannot be told ([`Watcher::check_writeback_pause`]).
    writeback_pause: Option<String>,
    /// Buffered writes were seen on the exported device during this run (it stays so).
    buffered_seen: bool,
    /// The pause is one before the risk was judged ([`Watcher::pause_until_judged`]).
    pause_unjudged: bool,
    /// The kernel's delay while the risk is not yet judged ([`Watcher::unjudged_delay`]), as
    /// weighed at the last checkpoint (or the start): like the judged risk, it changes only
    /// with a checkpoint, which then confirms nothing if it ends a pause.
    unjudged: Option<Option<Duration>>,
    /// A pause the previous run saved ([`Watcher::carry_writeback_pause`]): until this run has
    /// seen enough intervals to judge itself, the risk is weighed against its interval, and
    /// buffered writes it saw count as seen.
    carried: Option<SavedPause>,
    /// A persist cycle is due now (the saved pause changed), unless persisting only at start
    /// and stop.
    persist_soon: bool,
    /// When the page cache was last looked at (once a second at most).
    buffered_checked: Option<Instant>,
    /// The confirmations of the checkpoint parsed last, applied by [`Watcher::apply_confirms`].
    confirms: Vec<checkpoints::Confirm>,
    conflict: Option<String>,
    /// The larger capacity_bytes of LMCache's checkpoint last warned about.
    capacity_warned: Option<u64>,
    risk: bool,
    /// Whether this start said that LMCache's checkpoint cannot list every slot.
    full_index_said: bool,
    stalled: bool,
    /// When the stall was last said ([`STALL_REPEAT`]).
    stall_said_at: Option<Instant>,
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
    /// Unwritten slots deallocated by this daemon ("Unwritten slots" in `unwritten.rs`), and
    /// their bytes.
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
    /// The same for evicted slots (a failed header read, deallocation or flush): a drive that
    /// refuses deallocation is not asked again, with a flush, at every round.
    trim_error_epoch: Option<u32>,
    /// Evicted slots whose header read failed, with their life word then: tried after the
    /// others until a read succeeds or the slot changes (LMCache writes it again). At most one
    /// is added per epoch (the failed read pauses the rest), and at most
    /// [`UNREADABLE_HEADERS_MAX`] are kept.
    unreadable_headers: std::collections::HashMap<u64, u64>,
    /// Completed headers whose early tail waits until no loadable checkpoint lists a longer
    /// payload in their slot (at most one per slot and header generation).
    deferred_tails: Vec<(u64, u16)>,
    /// A policy that learns from committed checkpoints (`Policy::observes_checkpoints`).
    observer: Option<SharedPolicy>,
    published: Arc<Mutex<Published>>,
    /// Rounds ([`Watcher::step`]) since the start: a check that nothing happened can wait
    /// for rounds that would have seen it happen.
    rounds: u64,
}

/// What the state thread last published for the stats thread, and when: the ages in it are
/// worked out when the stats are written, so that they keep growing while the state thread
/// is held up (a drive slow to flush or deallocate) instead of freezing at their last value.
#[derive(Clone, Debug, Default)]
pub struct Published {
    json: Value,
    at: Option<Instant>,
    checkpoint_at: Option<Instant>,
}

impl Published {
    /// The published JSON, with `state_age_s` (since the state thread last published; it
    /// does at least every [`EARLY_TAILS_INTERVAL`] and after every deallocation round) and
    /// `checkpoint_age_s` as of now. Null before the first publish.
    pub fn now(&self) -> Value {
        let mut v = self.json.clone();
        if let (Some(at), Some(o)) = (self.at, v.as_object_mut()) {
            let tenths = |i: Instant| (i.elapsed().as_secs_f64() * 10.0).round() / 10.0;
            o.insert("state_age_s".into(), json!(tenths(at)));
            o.insert("checkpoint_age_s".into(), json!(self.checkpoint_at.map(tenths)));
        }
        v
    }
}

impl Watcher {
    /// Loads fdpblk's state from `region` into `slots` (a fresh table), reads both checkpoint
    /// containers, and marks the persisted state unclean. Call before the device serves I/O.
    pub fn new(geom: Geometry, slots: Arc<SlotTable>, dev: Arc<dyn StateWriter>, cfg: WatchConfig, region: Option<Region>, own_handle: Handle) -> Self {
        let (persist, loaded) = match region {
            Some(r) => {
                // What the clean stop's confirmations are checked against.
                let now = CheckpointsNow::read(&*dev, &geom);
                Persist::load_trusting(&*dev, r, &geom, &slots, own_handle, cfg.trust_saved_confirmations, now)
            }
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
        // A header block smaller than a page: its page's writeback could undo the zeroing
        // (`evictions`' module doc).
        let page = crate::device::page_size();
        if cfg.early_evictions && cfg.page_cache.is_some() && !geom.block_align.is_multiple_of(page) {
            tracing::warn!(
                "device {}: early evictions off: LMCache's block_align {} is smaller than a {page}-byte page, whose writeback could bring a zeroed checkpoint header back (a block_align of {page} or more turns them on)",
                cfg.device,
                geom.block_align,
            );
            cfg.early_evictions = false;
        }
        let now = Instant::now();
        let reclaim = cfg.reclaim;
        let mut w = Watcher {
            geom,
            slots,
            dev,
            // The checkpoint headers are a clean stop's to record, not a running state's.
            counters: Counters { checkpoint_headers: None, ..loaded.counters.clone() },
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
            clean_at: Instant::now(),
            carried_dirty: false,
            loads_taken: 0,
            reloaded_at: 0,
            lmcache_opens: 0,
            lmcache_lost_puts: 0,
            interval: None,
            gaps: 0,
            pause_unjudged: false,
            unjudged: None,
            recent_gaps: std::collections::VecDeque::new(),
            writeback: None,
            writeback_risk: false,
            writeback_pause: None,
            buffered_seen: false,
            carried: None,
            persist_soon: false,
            buffered_checked: None,
            confirms: Vec::new(),
            conflict: None,
            capacity_warned: None,
            geometry_seen_at: None,
            stopped: false,
            unclean_error: None,
            risk: false,
            full_index_said: false,
            stalled: false,
            stall_said_at: None,
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
            trim_error_epoch: None,
            unreadable_headers: Default::default(),
            deferred_tails: Vec::new(),
            observer: None,
            published: Arc::new(Mutex::new(Published::default())),
            rounds: 0,
        };
        w.seen_epoch = w.slots.epoch();
        for copy in 0..2u8 {
            w.containers[usize::from(copy)] = match w.read_container(copy, None, None) {
                Read::Done(c) => c,
                Read::NotYet | Read::Incomplete => Container::Unknown,
            };
        }
        w.mark_unwritten();
        // Baseline for the overflow estimate: the newest valid checkpoint on the device. Its
        // age goes on from when an earlier daemon saw it written (kept in the own state); one
        // no daemon saw counts from now.
        if let Some((seq, payload_len, entries, fixed_bytes)) = w.newest().map(|v| (v.seq, v.payload_len, v.entries, v.fixed_bytes)) {
            let unix = unix_now();
            let at = match w.counters.checkpoint_seen {
                Some((s, seen)) if s == seq && seen <= unix => now.checked_sub(Duration::from_secs(unix - seen)).unwrap_or(now),
                _ => {
                    w.counters.checkpoint_seen = Some((seq, unix));
                    now
                }
            };
            w.commit = Some(Commit { seq, payload_len, entries, at, puts_at: 0, fixed_bytes, epoch: w.seen_epoch, observed: false });
            // Slot writes the previous daemon saw after that checkpoint, none checkpointed yet:
            // a stall goes on from then.
            if let Some(t) = w.counters.uncheckpointed_since.filter(|&t| t <= unix && w.counters.checkpoint_seen.is_some_and(|(s, _)| s == seq)) {
                w.clean_at = now.checked_sub(Duration::from_secs(unix - t)).unwrap_or(now);
                w.carried_dirty = true;
            }
        }
        if !w.carried_dirty {
            w.counters.uncheckpointed_since = None;
        }
        w.arm_alarm();
        w.carry_writeback_pause();
        w.unjudged = w.unjudged_delay();
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
        // A carried pause shows from the start.
        w.check_writeback_pause();
        w.publish();
        w
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
    /// Unwritten slots this daemon deallocated ("Unwritten slots" in `unwritten.rs`).
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
    /// What the stats thread shows (refreshed by every step).
    pub fn published(&self) -> Arc<Mutex<Published>> {
        self.published.clone()
    }

    /// The JSON the stats thread would show now.
    pub fn published_json(&self) -> Value {
        self.published.lock().unwrap_or_else(|e| e.into_inner()).now()
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
        while !stop.load(Ordering::Acquire) {
            let wait = self.next_wakeup().min(EARLY_TAILS_INTERVAL);
            self.slots.wait_events(wait);
            self.step();
            if self.persist_due() {
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

    /// Whether a persist cycle is due after a step: the interval passed, the start's mark is
    /// retried (once a second), or something is to be saved at once (`persist_soon`), unless
    /// the state is persisted only at start and stop.
    fn persist_due(&mut self) -> bool {
        let retry = self.unclean_error.is_some() && self.last_persist.elapsed() >= Duration::from_secs(1);
        let soon = std::mem::take(&mut self.persist_soon) && self.cfg.persist_interval != Duration::MAX;
        retry || soon || self.last_persist.elapsed() >= self.cfg.persist_interval
    }

    /// The last round left evicted or unwritten slots to deallocate (the next one follows at
    /// once).
    pub fn trim_backlog(&self) -> bool {
        self.trim_backlog || self.reclaim_ready()
    }

    /// Says, once per checkpoint, why deallocation waits for one written [`STUCK_AFTER`] ago
    /// that still does not read back complete.
    fn warn_stuck(&mut self) {
        for i in 0..self.pending.len() {
            let p = &self.pending[i];
            if p.warned || p.since.elapsed() < STUCK_AFTER {
                continue;
            }
            let (copy, since, tries, payload_wait) = (p.ev.copy, p.since, p.tries, p.payload_wait);
            if p.write_waits > 0 {
                tracing::warn!(
                    "device {}: the write of checkpoint container {copy}'s header has not completed in {:.0} s; deallocation waits for it (a stuck backing device?)",
                    self.cfg.device,
                    since.elapsed().as_secs_f64()
                );
                self.pending[i].warned = true;
                continue;
            }
            let why = if payload_wait {
                ": its payload does not match the CRC in its header (LMCache stopped while writing it?); it is read again when it is written".to_string()
            } else {
                // Where the header on the device is not one fdpblk reads (another meta_magic
                // or version).
                self.container_header_error(copy).map_or(String::new(), |e| format!(": its header block: {e}"))
            };
            tracing::warn!(
                "device {}: checkpoint container {copy} written {:.0} s ago is still not a complete checkpoint after {tries} reads{why}; deallocation waits for it (fdpblk reads LMCache 0.5.6's LMCIDX01 version 1 checkpoints)",
                self.cfg.device,
                since.elapsed().as_secs_f64()
            );
            self.pending[i].warned = true;
        }
    }

    fn next_wakeup(&self) -> Duration {
        if self.trim_backlog() {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let mut d = self.cfg.persist_interval.saturating_sub(self.last_persist.elapsed());
        for p in &self.pending {
            if p.write_waits > 0 {
                d = d.min(p.next.saturating_duration_since(now));
            } else if p.since.elapsed() < RETRY_WINDOW {
                // A payload waiting for a write is looked at by the next round (at most
                // EARLY_TAILS_INTERVAL away): its flag does not wake this thread.
                let at = if p.payload_wait && !p.written { p.read_at + PAYLOAD_RECHECK } else { p.next };
                d = d.min(at.saturating_duration_since(now));
            }
        }
        d
    }

    /// One round: take checkpoint events, read back what they announced, update slot states,
    /// deallocate what is dead, check the overflow estimate, publish the stats.
    pub fn step(&mut self) {
        self.rounds += 1;
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
            self.pending.push(Pending { ev, since: now, next: now, tries: 0, payload_wait: false, read_at: now, written: false, warned: false, write_waits: 0 });
            changed = true;
        }
        let now = Instant::now();
        let mut still = Vec::new();
        for mut p in std::mem::take(&mut self.pending) {
            // Its header write may still be in flight: a read could return the new header
            // before the write completed, and a flush covers only completed commands
            // (condition 3). Read back once it ended (or failed).
            if self.slots.header_writes_ended(p.ev.copy) < p.ev.writes {
                p.write_waits = p.write_waits.saturating_add(1);
                p.next = now + self.cfg.retry_base.saturating_mul(1 << p.write_waits.min(6));
                still.push(p);
                continue;
            }
            let write_ended = std::mem::take(&mut p.write_waits) > 0;
            // Said why it waited: what it waits for next gets its own warning.
            p.warned &= !write_ended;
            let touched = self.slots.take_touched(p.ev.copy);
            p.written |= touched | self.slots.take_landed(p.ev.copy);
            let in_window = p.since.elapsed() < RETRY_WINDOW;
            let due = write_ended || match (p.payload_wait, in_window) {
                (true, true) => (p.written && p.next <= now) || p.read_at.elapsed() >= PAYLOAD_RECHECK,
                (true, false) => p.written,
                (false, true) => p.next <= now || touched,
                (false, false) => touched,
            };
            if !due {
                still.push(p);
                continue;
            }
            p.written = false;
            p.read_at = Instant::now();
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
                    // After the commit flagged a writeback risk, if it did. The checkpoint that
                    // ends a pause confirms nothing either: the kernel may only now write back
                    // a header it held.
                    if self.check_writeback_pause() {
                        self.need_sweep = true;
                        self.confirms.clear();
                    }
                    self.apply_confirms();
                    self.containers[usize::from(p.ev.copy)] = c;
                    changed = true;
                }
                r @ (Read::NotYet | Read::Incomplete) => {
                    p.tries += 1;
                    p.payload_wait = matches!(r, Read::Incomplete);
                    let backoff = self.cfg.retry_base.saturating_mul(1 << p.tries.min(20)).min(Duration::from_secs(1));
                    p.next = Instant::now() + backoff;
                    still.push(p);
                }
            }
        }
        self.pending = still;
        self.warn_stuck();
        // A container left unknown (torn at start-up) is looked at again when it is written.
        for copy in 0..2u8 {
            if matches!(self.containers[usize::from(copy)], Container::Unknown)
                && !self.pending.iter().any(|p| p.ev.copy == copy)
                && (self.slots.take_touched(copy) | self.slots.take_landed(copy))
            {
                if let Read::Done(c) = self.read_container(copy, None, None) {
                    // Written, and no checkpoint there: LMCache's payload may have come
                    // before its header, as into a container fdpblk zeroed (below).
                    if matches!(c, Container::Empty) {
                        self.awaiting_header[usize::from(copy)] = true;
                    }
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
        // Deallocation resumes at the first sweep after the pause ends.
        self.need_sweep |= self.check_writeback_pause();
        if changed || std::mem::take(&mut self.need_sweep) || self.summary_at.elapsed() >= Duration::from_secs(10) {
            let allow = self.slot_trims_allowed();
            let Sweep { dead: candidates, early, basis, tails } = self.sweep(allow);
            // Set again by either pass of `trim` below that leaves slots for the next round.
            self.trim_backlog = false;
            // The checkpoints read back must survive a power loss before a slot goes on their
            // word (condition 3): LMCache never flushes, and a container back at older contents
            // could list the slot.
            let wanted = allow && (!candidates.is_empty() || !early.is_empty());
            let durable = wanted && self.flush_checkpoints();
            if wanted && !durable {
                self.trim_error_epoch = Some(self.seen_epoch);
            }
            if durable && !candidates.is_empty() {
                self.trim(candidates);
            }
            // Slots only the older container lists go once it can no longer be loaded.
            if let (true, Some(n)) = (durable && !early.is_empty() && self.slot_trims_allowed(), basis) {
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

    /// Every checkpoint header write planned so far was taken from the mailbox and read back.
    fn checkpoints_read_back(&self) -> bool {
        !self.slots.events_pending() && self.slots.epoch() == self.seen_epoch && self.pending.is_empty()
    }

    /// True when deallocation may happen now (conditions 3 and 4 of the module doc).
    pub fn trims_allowed(&self) -> bool {
        self.cfg.trim
            && self.conflict.is_none()
            && self.writeback_pause.is_none()
            && self.containers.iter().all(|c| !matches!(c, Container::Unknown))
            && !self.awaiting_header.iter().any(|&a| a)
            && self.checkpoints_read_back()
    }

    /// True when evicted slots may go now: deallocation is allowed and not paused after an
    /// error in this checkpoint's epoch (a trim in this round may have paused it).
    fn slot_trims_allowed(&self) -> bool {
        self.trims_allowed() && self.trim_error_epoch != Some(self.seen_epoch)
    }

    /// Runs a persist cycle now (`clean` at shutdown; `force` even if nothing changed, as is
    /// every cycle until the start-up one committed). The error, if it failed.
    pub fn persist_now(&mut self, clean: bool, force: bool) -> Result<(), String> {
        self.last_persist = Instant::now();
        let Some(p) = self.persist.as_mut() else { return Ok(()) };
        let clean = clean && self.conflict.is_none();
        if clean {
            // The checkpoints this clean state's confirmations hold for: the next start
            // trusts them only if the containers still begin so.
            self.counters.checkpoint_headers = crate::persist::read_checkpoint_headers(&*self.dev, &self.geom);
        }
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
            "state_rounds": self.rounds,
            "checkpoint_seq": c.map(|c| c.seq),
            "checkpoint_bytes": c.map(|c| c.payload_len),
            "checkpoint_entries": c.map(|c| c.entries),
            "checkpoint_cap_bytes": self.geom.payload_cap(),
            "checkpoint_estimate_bytes": est.map(|e| e.bytes),
            "overflow_risk": self.risk,
            "checkpoint_full_bytes": self.full_index().0,
            "checkpoint_stalled": self.stalled,
            "lmcache_opens": self.lmcache_opens,
            "lmcache_lost_puts": self.lmcache_lost_puts,
            "checkpoint_interval_s": self.interval.map(|i| (i.as_secs_f64() * 10.0).round() / 10.0),
            "checkpoint_interval_shortest_s": self.short_gap().map(|i| (i.as_secs_f64() * 1000.0).round() / 1000.0),
            "writeback_delay_s": self.writeback.map(|d| d.map(|d| d.as_secs_f64())),
            "writeback_risk": self.writeback_risk,
            // Only for a checkpoint too large: a stall of a busy LMCache needs no new layout.
            "meta_total_bytes_needed": self.risk.then(|| est.map(|e| self.meta_total_needed(e.bytes))).flatten(),
            "containers": containers,
            "slots": {
                "max_slots": self.slots.len(), "with_header": s.with_header, "confirmed": s.confirmed,
                "unknown": s.by_state[0], "live": s.by_state[1], "evicted": s.by_state[2], "trimmed": s.by_state[3],
                "identity_history": self.slots.history().len(), "identity_history_capacity": self.slots.history().capacity(),
                "returning": self.slots.returning(), "tags": self.slots.tags().len(),
            },
            "trim": {
                "enabled": self.cfg.trim, "off_because": self.cfg.trim_off_because, "allowed_now": self.trims_allowed(), "blocked_by": self.conflict,
                "paused_by": self.writeback_pause,
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
                "loaded": self.loaded.found, "loaded_clean": self.loaded.clean, "loaded_note": self.loaded.note,
                "region_offset": self.persist.as_ref().map(|p| p.region().offset), "region_bytes": self.persist.as_ref().map(|p| p.region().len),
            },
            "since_start": {
                "trims": self.counters.trims.saturating_sub(was.trims), "trim_bytes": self.counters.trim_bytes.saturating_sub(was.trim_bytes),
                "trim_handles": since_handles, "evictions": self.counters.evictions.saturating_sub(was.evictions),
                "own_state_cycles": self.counters.cycles.saturating_sub(was.cycles), "own_state_bytes": self.counters.own_bytes.saturating_sub(was.own_bytes),
            },
        });
        *self.published.lock().unwrap_or_else(|e| e.into_inner()) = Published { json: v, at: Some(Instant::now()), checkpoint_at: c.map(|c| c.at) };
    }
}

mod checkpoints;
mod evictions;
mod overflow;
mod page_cache;
mod tails;
mod unwritten;

#[cfg(test)]
mod tests;

