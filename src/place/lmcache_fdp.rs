//! `lmcache-fdp`: an emulation of LMCache's built-in FDP mode, per-cache_salt bucket handles
//! learnt from checkpoints.

use super::*;

/// The cache_salt buckets of the identities in the two newest committed checkpoints (what
/// fdpblk can know of a key's tenant: only once a checkpoint listed it), so a key evicted
/// after one checkpoint is still known when it returns. Bounded by two checkpoints' entries.
#[derive(Debug, Default)]
pub struct BucketBook {
    current: HashMap<u64, u64>,
    previous: HashMap<u64, u64>,
    retired: Option<HashMap<u64, u64>>,
}

impl BucketBook {
    /// One checkpoint's buckets (needs no book: built off the policy's lock).
    pub fn generation(entries: &[LiveEntry]) -> HashMap<u64, u64> {
        entries.iter().filter(|e| e.salt_bucket != 0).map(|e| (e.identity, e.salt_bucket)).collect()
    }
    /// Makes `generation` the newest; the oldest is kept for [`BucketBook::take_retired`].
    pub fn push(&mut self, generation: HashMap<u64, u64>) {
        let oldest = std::mem::replace(&mut self.previous, std::mem::replace(&mut self.current, generation));
        self.retired = Some(oldest);
    }
    pub fn learn(&mut self, entries: &[LiveEntry]) {
        self.push(Self::generation(entries));
    }
    pub fn bucket(&self, identity: u64) -> Option<u64> {
        self.current.get(&identity).or_else(|| self.previous.get(&identity)).copied()
    }
    pub fn take_retired(&mut self) -> Option<HashMap<u64, u64>> {
        self.retired.take()
    }
}

/// An emulation of LMCache 0.5.6's built-in FDP mode (`fdp_data_placement_policy =
/// cache_salt_prefix`, `meta_checkpoint_placement_id` set, `fdp_slot_reuse_policy =
/// pid_affinity`; reference §14), for comparison. Handle 0 is "no directive", handle 1 the
/// checkpoint id, handles 2.. the data ids that cache_salt buckets take first come, first
/// served; LMCache never deallocates.
///
/// LMCache knows each key's salt when it writes. In the simulator the workload model plays
/// LMCache in FDP mode (it also reuses slots with pid affinity) and passes each write's id as
/// `Observation::WriterPlacement`. Under `fdpblk add` no such id reaches the block device: the
/// emulation then places a returning identity by the cache_salt bucket (the salt's part
/// before `:`, case-folded) a committed checkpoint listed it with (fdpblk's state thread
/// passes each one on), and anything else on handle 0.
#[derive(Debug)]
pub struct LmcacheFdpPolicy {
    /// Per slot, the id LMCache's last put into it was written with (the simulator's
    /// `WriterPlacement`): a batch (io_uring, page-cache writeback) delivers several puts'
    /// writes after all of their ids were chosen. At most one word pair per slot.
    writer_pid: HashMap<u64, Handle>,
    buckets: BucketBook,
    pub(super) bucket_handle: HashMap<u64, Handle>,
}

impl LmcacheFdpPolicy {
    pub const NO_DIRECTIVE: Handle = 0;
    pub const CHECKPOINT: Handle = 1;
    pub const FIRST_DATA: Handle = 2;
    pub const HANDLES: u16 = 8;

    pub fn new() -> Self {
        LmcacheFdpPolicy { writer_pid: HashMap::new(), buckets: BucketBook::default(), bucket_handle: HashMap::new() }
    }

    /// The data placement ids LMCache's default list gives buckets, in order.
    pub fn data_handles() -> Vec<Handle> {
        (Self::FIRST_DATA..Self::HANDLES).collect()
    }
}

impl Default for LmcacheFdpPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy for LmcacheFdpPolicy {
    fn name(&self) -> &'static str {
        "lmcache-fdp"
    }
    fn handles(&self) -> u16 {
        Self::HANDLES
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        match target {
            Target::Checkpoint { .. } => Self::CHECKPOINT,
            Target::Slot { slot, header, previous } => {
                if let Some(&pid) = self.writer_pid.get(slot) {
                    return pid;
                }
                if let Some(h) = header {
                    if let Some(t) = self.buckets.bucket(h.identity) {
                        if let Some(&h) = self.bucket_handle.get(&t) {
                            return h;
                        }
                        // First come, first served while ids last (at most 6 buckets kept);
                        // later buckets get no directive, as in LMCache.
                        let next = Self::FIRST_DATA + self.bucket_handle.len() as Handle;
                        if next < Self::HANDLES {
                            self.bucket_handle.insert(t, next);
                            return next;
                        }
                    }
                    return Self::NO_DIRECTIVE;
                }
                // A handle restored from state another policy saved may lie past ours.
                previous.map_or(Self::NO_DIRECTIVE, |p| if p.handle < Self::HANDLES { p.handle } else { Self::NO_DIRECTIVE })
            }
            Target::Outside | Target::OwnState => Self::NO_DIRECTIVE,
        }
    }
    fn observes_checkpoints(&self) -> bool {
        true
    }
    fn observe(&mut self, event: &Observation<'_>) {
        match *event {
            Observation::WriterPlacement { slot, pid } => {
                self.writer_pid.insert(slot, pid);
            }
            Observation::Checkpoint { entries, .. } => self.buckets.learn(entries),
            _ => {}
        }
    }
    fn checkpoint_lesson(&self) -> Option<CheckpointLesson> {
        Some(|entries| Box::new(BucketBook::generation(entries)))
    }
    fn learn(&mut self, lesson: Box<dyn std::any::Any + Send>) {
        if let Ok(generation) = lesson.downcast::<HashMap<u64, u64>>() {
            self.buckets.push(*generation);
        }
    }
    fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        self.buckets.take_retired().filter(|m| m.capacity() > 0).map(|m| Box::new(m) as Box<dyn std::any::Any + Send>)
    }
}
