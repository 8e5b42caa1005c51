//! One policy instance shared by every queue of a device and its state thread, and its resumption
//! from the slot table after a restart.

use super::*;

/// A policy shared between the pipeline that asks it and an observer on another path (the
/// simulator; the checkpoint reader): both hold a clone.
#[derive(Clone)]
pub struct SharedPolicy {
    inner: Arc<Mutex<Box<dyn Policy>>>,
    name: &'static str,
    handles: u16,
    needs_state: bool,
    observes_checkpoints: bool,
    pub(super) lesson: Option<CheckpointLesson>,
}

impl SharedPolicy {
    pub fn new(p: Box<dyn Policy>) -> Self {
        let (name, handles, needs_state, observes_checkpoints) = (p.name(), p.handles(), p.needs_state(), p.observes_checkpoints());
        let lesson = p.checkpoint_lesson();
        SharedPolicy { inner: Arc::new(Mutex::new(p)), name, handles, needs_state, observes_checkpoints, lesson }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Box<dyn Policy>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`resume`] under the lock.
    pub fn resume(&self, slots: &SlotTable) -> u64 {
        if !self.needs_state {
            return 0;
        }
        resume(self.lock().as_mut(), slots)
    }
}

/// Frees what a policy let go of on a thread of its own: unmapping hundreds of MB takes tens
/// of ms, which every queue would wait through under the policy's lock, and one queue's
/// request without it. Where no thread can be started, here.
fn free_elsewhere(retired: Option<Box<dyn std::any::Any + Send>>) {
    if let Some(r) = retired {
        let _ = std::thread::Builder::new().name("fdpblk-free".into()).spawn(move || drop(r));
    }
}

/// Tells a policy that keeps history (`needs_state`) the layout and what each slot of a slot
/// table restored from fdpblk's own state holds, before the device serves I/O. Returns the
/// slots reported.
pub fn resume(p: &mut dyn Policy, slots: &SlotTable) -> u64 {
    // The layout first: a policy sizes its history by it, not by the slots it is told of.
    p.observe(&Observation::Layout { max_slots: slots.len() as u64 });
    let mut n = 0;
    for slot in 0..slots.len() as u64 {
        if let Some(e) = slots.get(slot) {
            let listed = !matches!(e.state, SlotState::Evicted | SlotState::Trimmed);
            p.observe(&Observation::Resident { slot, identity: e.identity, reads: e.reads, listed });
            n += 1;
        }
    }
    n
}

impl Policy for SharedPolicy {
    fn name(&self) -> &'static str {
        self.name
    }
    fn handles(&self) -> u16 {
        self.handles
    }
    fn place(&mut self, target: &Target<'_>) -> Handle {
        let (h, retired) = {
            let mut p = self.lock();
            (p.place(target), p.take_retired())
        };
        free_elsewhere(retired);
        h
    }
    fn observe(&mut self, event: &Observation<'_>) {
        let lesson = match (event, self.lesson) {
            (Observation::Checkpoint { entries, .. }, Some(f)) => Some(f(entries)),
            _ => None,
        };
        let retired = {
            let mut p = self.lock();
            match lesson {
                Some(l) => p.learn(l),
                None => p.observe(event),
            }
            p.take_retired()
        };
        free_elsewhere(retired);
    }
    fn needs_state(&self) -> bool {
        self.needs_state
    }
    fn observes_checkpoints(&self) -> bool {
        self.observes_checkpoints
    }
}
