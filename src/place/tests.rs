use super::*;

fn hdr(identity: u64) -> SlotHeader {
    SlotHeader { identity, payload_len: 1000 }
}

fn put(p: &mut dyn Policy, slot: u64, identity: u64) -> Handle {
    let h = hdr(identity);
    p.place(&Target::Slot { slot, header: Some(&h), previous: None })
}

#[test]
fn every_name_resolves_and_fits_the_drive() {
    for n in POLICY_NAMES {
        let p = policy_by_name(n).unwrap();
        assert_eq!(p.name(), *n);
        assert!(p.handles() <= 8);
    }
    assert!(policy_by_name("nope").is_none());
}

#[test]
fn key_aware_places_by_the_reads_an_identity_had() {
    let mut p = KeyAwarePolicy::new();
    assert_eq!(p.place(&Target::Checkpoint { copy: 1 }), KeyAwarePolicy::YOUNG);
    assert_eq!(p.place(&Target::OwnState), KeyAwarePolicy::YOUNG);
    // Never read: young, written the first time or again.
    assert_eq!(put(&mut p, 0, 10), KeyAwarePolicy::YOUNG);
    assert_eq!(put(&mut p, 1, 11), KeyAwarePolicy::YOUNG);
    // Identity 10 is read twice while in slot 0, then evicted; slot 0 reused by 12.
    p.observe(&Observation::Read { slot: 0, identity: Some(10), len: 1000, slot_reads: 1 });
    p.observe(&Observation::Read { slot: 0, identity: Some(10), len: 1000, slot_reads: 2 });
    assert_eq!(put(&mut p, 0, 12), KeyAwarePolicy::YOUNG);
    // 10 comes back (in another slot): read before, on the read handle; the new slot's
    // loads count from 1 again, and add to the identity's.
    assert_eq!(put(&mut p, 5, 10), KeyAwarePolicy::READ);
    p.observe(&Observation::Read { slot: 5, identity: Some(10), len: 1000, slot_reads: 1 });
    assert_eq!(put(&mut p, 6, 10), KeyAwarePolicy::HOT);
    // A payload without its header follows the slot's record.
    let prev = SlotEntry { handle: 2, generation: 1, ..Default::default() };
    assert_eq!(p.place(&Target::Slot { slot: 6, header: None, previous: Some(&prev) }), 2);
    // Unless that handle, restored from state another policy saved, lies past this policy's.
    let past = SlotEntry { handle: 7, generation: 1, ..Default::default() };
    assert_eq!(p.place(&Target::Slot { slot: 6, header: None, previous: Some(&past) }), KeyAwarePolicy::YOUNG);
    // A read of a slot without a header is ignored.
    p.observe(&Observation::Read { slot: 999, identity: None, len: 1, slot_reads: 0 });
    assert!(p.read_book().len() == 1 && p.read_book().reads(10) == 3);
}

/// A legacy key's layers share the chunk hash: one request loads every layer's slot once,
/// and that is one load of the identity, not one per layer.
#[test]
fn key_aware_counts_a_request_over_layer_slots_once() {
    let mut p = KeyAwarePolicy::new();
    let layers = 10..42u64;
    for s in layers.clone() {
        assert_eq!(put(&mut p, s, 7), KeyAwarePolicy::YOUNG);
    }
    let load = |p: &mut KeyAwarePolicy, slot, n| p.observe(&Observation::Read { slot, identity: Some(7), len: 1000, slot_reads: n });
    for s in layers.clone() {
        load(&mut p, s, 1);
    }
    assert_eq!(p.read_book().reads(7), 1, "one request");
    // Layer-wise retrieval interleaves the layers of several chunks; still one per request.
    for s in layers.clone().rev() {
        load(&mut p, s, 2);
    }
    assert_eq!(p.read_book().reads(7), 2);
    assert_eq!(put(&mut p, 50, 7), KeyAwarePolicy::READ, "a layer stored again: read twice before");
    // The next request loads the other layers (their third load) and the new one (its
    // first): one more, not the other layers' whole count again.
    load(&mut p, 10, 3);
    load(&mut p, 50, 1);
    for s in layers.clone().skip(1) {
        load(&mut p, s, 3);
    }
    assert_eq!(p.read_book().reads(7), 3);
    // Two queues' loads of one slot may arrive out of order: both count.
    let mut q = KeyAwarePolicy::new();
    put(&mut q, 3, 9);
    for n in [1, 3, 2] {
        q.observe(&Observation::Read { slot: 3, identity: Some(9), len: 1, slot_reads: n });
    }
    assert_eq!(q.read_book().reads(9), 3);
    // A slot count not known (0) counts one.
    q.observe(&Observation::Read { slot: 3, identity: Some(9), len: 1, slot_reads: 0 });
    assert_eq!(q.read_book().reads(9), 4);
    // Restored at start: a slot's loads so far, then one more load counts one.
    let mut r = KeyAwarePolicy::new();
    for s in layers.clone() {
        r.observe(&Observation::Resident { slot: s, identity: 7, reads: 2, listed: true });
    }
    assert_eq!(r.read_book().reads(7), 2);
    load(&mut r, 10, 3);
    load(&mut r, 11, 3);
    assert_eq!(r.read_book().reads(7), 3);
    assert_eq!(put(&mut r, 60, 7), KeyAwarePolicy::HOT);
    // An evicted copy (not yet reused or deallocated at the restart) brings its loads back,
    // but the copy put again elsewhere counts its own loads from its first.
    let mut e = KeyAwarePolicy::new();
    e.observe(&Observation::Resident { slot: 1, identity: 8, reads: 2, listed: false });
    e.observe(&Observation::Resident { slot: 2, identity: 8, reads: 0, listed: true });
    assert_eq!(e.read_book().reads(8), 2);
    e.observe(&Observation::Read { slot: 2, identity: Some(8), len: 1, slot_reads: 1 });
    assert_eq!(e.read_book().reads(8), 3, "its first load counts");
}

#[test]
fn key_aware_resumes_from_a_restored_slot_table() {
    let slots = SlotTable::new(8);
    slots.record_header(2, &hdr(20), KeyAwarePolicy::HOT);
    slots.record_header(3, &hdr(30), KeyAwarePolicy::YOUNG);
    for _ in 0..3 {
        slots.note_read(2);
    }
    slots.note_read(3);
    // Identity 40 was loaded twice, then evicted and its slot deallocated.
    slots.record_header(4, &hdr(40), KeyAwarePolicy::YOUNG);
    slots.note_read(4);
    slots.note_read(4);
    let l = slots.life(4);
    assert!(slots.cas_life(4, l, crate::slot_table::life::with_state(l | crate::slot_table::life::CONFIRMED, SlotState::Evicted)));
    let l = slots.life(4) | crate::slot_table::life::TRIMMING;
    assert!(slots.cas_life(4, slots.life(4), l));
    slots.end_trim(4, l, true);
    // A restarted daemon: a fresh policy given the table fdpblk's own state restored.
    let shared = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
    assert_eq!(shared.resume(&slots), 3);
    let mut p = shared.clone();
    // Identity 20 had 3 loads, 30 one: returning, they keep their classes.
    assert_eq!(put(&mut p, 5, 20), KeyAwarePolicy::HOT);
    assert_eq!(put(&mut p, 6, 30), KeyAwarePolicy::READ);
    // The deallocated slot's key, put again, is still one read before.
    assert_eq!(put(&mut p, 1, 40), KeyAwarePolicy::READ);
    // Later loads add to them.
    p.observe(&Observation::Read { slot: 3, identity: Some(30), len: 1000, slot_reads: 0 });
    p.observe(&Observation::Read { slot: 3, identity: Some(30), len: 1000, slot_reads: 0 });
    assert_eq!(put(&mut p, 7, 30), KeyAwarePolicy::HOT);
    // Policies without history take nothing.
    assert_eq!(SharedPolicy::new(Box::new(NonePolicy)).resume(&slots), 0);
    // The history is sized by the layout, not by the highest slot it was told of.
    let big = SlotTable::new(5000);
    big.record_header(4000, &hdr(40), KeyAwarePolicy::YOUNG);
    let mut k = KeyAwarePolicy::new();
    assert_eq!(resume(&mut k, &big), 1);
    assert_eq!(k.read_book().limit, 5000);
}

/// What a policy lets go of (a read book generation, hundreds of MB on a large drive) is
/// freed on a thread of its own, off the lock every queue takes and off the I/O path.
#[test]
fn a_retired_generation_is_freed_off_the_lock() {
    struct Probe(std::sync::mpsc::Sender<Option<String>>);
    impl Drop for Probe {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().name().map(String::from));
        }
}
struct Retiring(Option<std::sync::mpsc::Sender<Option<String>>>);
impl Policy for Retiring {
    fn name(&self) -> &'static str {
        "retiring"
    }
    fn handles(&self) -> u16 {
        1
    }
    fn place(&mut self, _: &Target<'_>) -> Handle {
        0
    }
    fn take_retired(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        self.0.take().map(|tx| Box::new(Probe(tx)) as Box<dyn std::any::Any + Send>)
    }
}
let (tx, rx) = std::sync::mpsc::channel();
let mut shared = SharedPolicy::new(Box::new(Retiring(Some(tx))));
shared.observe(&Observation::Layout { max_slots: 1 });
let by = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("freed");
assert_eq!(by.as_deref(), Some("fdpblk-free"));
// The key-aware policy hands over the generation its read book forgets.
let mut k = KeyAwarePolicy::new();
k.observe(&Observation::Layout { max_slots: ReadBook::MIN_LIMIT as u64 });
assert!(k.take_retired().is_none());
for i in 0..=ReadBook::MIN_LIMIT as u64 {
    k.observe(&Observation::Read { slot: 0, identity: Some(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)), len: 1, slot_reads: 0 });
}
assert!(k.take_retired().is_some(), "the forgotten generation");
assert!(k.take_retired().is_none());
}

#[test]
fn key_aware_read_book_follows_the_layout_or_the_slots_seen() {
    let mut p = KeyAwarePolicy::new();
    put(&mut p, 0, 1);
    assert_eq!(p.read_book().limit, ReadBook::MIN_LIMIT);
    p.observe(&Observation::Layout { max_slots: 60_000 });
    assert_eq!(p.read_book().limit, 60_000);
    let spread = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for i in 0..60_000 {
        p.observe(&Observation::Read { slot: 0, identity: Some(spread(i)), len: 1, slot_reads: 0 });
    }
    // The current generation is full; the next new identity starts another.
    assert_eq!(p.read_book().reads(spread(7)), 1);
    assert_eq!(p.read_book().reads(1), 0, "identity 1 was never read");
    p.observe(&Observation::Read { slot: 0, identity: Some(spread(60_000)), len: 1, slot_reads: 0 });
    assert_eq!(p.read_book().reads(spread(7)), 1, "the previous generation is still read");
    assert!(p.read_book().len() <= 2 * 60_000);
    assert_eq!(p.read_book().heap_bytes(), 2 * 8 * (60_000 * 4 / 3 + 1));
    // Without a layout, slots beyond the limit double it; counts survive the rebuild.
    let mut q = KeyAwarePolicy::new();
    q.observe(&Observation::Read { slot: 0, identity: Some(5), len: 1, slot_reads: 0 });
    put(&mut q, 1500, 9);
    assert_eq!(q.read_book().limit, 2048);
    assert_eq!((q.read_book().reads(5), q.read_book().reads(9)), (1, 0));
}

#[test]
fn read_book_counts_saturate_and_bounds_hold() {
    let mut b = ReadBook::new(1024);
    for _ in 0..300 {
        b.note_read(42);
    }
    assert_eq!(b.reads(42), 255);
    // Restored counts only raise.
    b.note_reads(42, 3, true);
    b.note_reads(43, 7, true);
    assert_eq!((b.reads(42), b.reads(43)), (255, 7));
    assert_eq!(b.reads(44), 0);
    // Many more identities than the limit: never more than two generations, never a
    // full table (a probe always ends).
    for i in 0..100_000u64 {
        b.note_read(i << 8);
        assert!(b.current.len <= b.limit && b.current.len < b.current.words.len());
    }
    assert!(b.len() <= 2 * 1024);
}

#[test]
fn read_book_forgets_whole_generations() {
    let mut b = ReadBook::new(1024);
    for i in 0..1024 {
        b.note_read(i);
    }
    b.note_read(5000); // rotates: 0..1024 become the previous generation
    assert_eq!((b.reads(3), b.reads(5000)), (1, 1));
    b.note_read(3); // moves to the current generation with its count
    assert_eq!(b.reads(3), 2);
    for i in 10_000..12_100 {
        b.note_read(i);
    }
    assert_eq!((b.reads(3), b.reads(4)), (0, 0), "forgotten after two rotations");
}

#[test]
fn lmcache_fdp_emulation_follows_the_writer_then_checkpoint_tenants() {
    let mut p = LmcacheFdpPolicy::new();
    assert_eq!(p.place(&Target::Checkpoint { copy: 0 }), LmcacheFdpPolicy::CHECKPOINT);
    p.observe(&Observation::WriterPlacement { slot: 4, pid: 3 });
    assert_eq!(put(&mut p, 4, 77), 3);
    // Without a writer's id (under `fdpblk add`): the tenant a checkpoint taught, buckets
    // first come first served; unknown identities get no directive.
    assert_eq!(put(&mut p, 5, 88), LmcacheFdpPolicy::NO_DIRECTIVE);
    let entries =
        [LiveEntry { slot: 5, identity: 88, salt_bucket: 9 }, LiveEntry { slot: 6, identity: 99, salt_bucket: 4 }];
    p.observe(&Observation::Checkpoint { seq: 1, entries: &entries });
    assert_eq!(put(&mut p, 7, 99), LmcacheFdpPolicy::FIRST_DATA);
    assert_eq!(put(&mut p, 8, 88), LmcacheFdpPolicy::FIRST_DATA + 1);
    assert_eq!(put(&mut p, 9, 99), LmcacheFdpPolicy::FIRST_DATA);
    // A batch (io_uring, page-cache writeback): both ids were chosen before either put's
    // writes arrive; each write takes its own slot's.
    p.observe(&Observation::WriterPlacement { slot: 10, pid: 5 });
    p.observe(&Observation::WriterPlacement { slot: 11, pid: LmcacheFdpPolicy::NO_DIRECTIVE });
    assert_eq!((put(&mut p, 10, 99), put(&mut p, 11, 99)), (5, LmcacheFdpPolicy::NO_DIRECTIVE));
    // Ids run out after six buckets: later ones get no directive, and are not kept.
    let many: Vec<LiveEntry> = (0..100_000u64).map(|i| LiveEntry { slot: i, identity: 1000 + i, salt_bucket: 50 + i }).collect();
    p.observe(&Observation::Checkpoint { seq: 2, entries: &many });
    let got: Vec<Handle> = (0..100_000u64).map(|i| put(&mut p, 20, 1000 + i)).collect();
    assert_eq!(&got[..4], &[4, 5, 6, 7], "buckets 9 and 4 took ids 2 and 3");
    assert!(got[4..].iter().all(|&h| h == LmcacheFdpPolicy::NO_DIRECTIVE));
    assert_eq!(p.bucket_handle.len(), 6);
    // A payload without its header follows the slot's record, unless that handle, restored
    // from state another policy saved, lies past this policy's.
    let prev = |handle| SlotEntry { handle, generation: 1, ..Default::default() };
    assert_eq!(p.place(&Target::Slot { slot: 30, header: None, previous: Some(&prev(5)) }), 5);
    assert_eq!(p.place(&Target::Slot { slot: 30, header: None, previous: Some(&prev(9)) }), LmcacheFdpPolicy::NO_DIRECTIVE);
}

#[test]
fn lmcache_fdp_remembers_the_two_newest_checkpoints_tenants_also_when_shared() {
    let s = SharedPolicy::new(Box::new(LmcacheFdpPolicy::new()));
    assert!(s.lesson.is_some(), "learns off the lock");
    let mut p = s.clone();
    let cp = |p: &mut SharedPolicy, seq, identity| {
        p.observe(&Observation::Checkpoint { seq, entries: &[LiveEntry { slot: 0, identity, salt_bucket: identity + 100 }] })
    };
    cp(&mut p, 1, 1);
    cp(&mut p, 2, 2);
    assert_eq!((put(&mut p, 9, 1), put(&mut p, 9, 2)), (LmcacheFdpPolicy::FIRST_DATA, LmcacheFdpPolicy::FIRST_DATA + 1));
    cp(&mut p, 3, 3);
    let got = (put(&mut p, 9, 1), put(&mut p, 9, 2), put(&mut p, 9, 3));
    assert_eq!(got, (LmcacheFdpPolicy::NO_DIRECTIVE, LmcacheFdpPolicy::FIRST_DATA + 1, LmcacheFdpPolicy::FIRST_DATA + 2));
}

#[test]
fn shared_policy_is_one_policy() {
    let s = SharedPolicy::new(Box::new(KeyAwarePolicy::new()));
    let (mut a, mut b) = (s.clone(), s);
    assert_eq!((a.name(), a.handles(), a.needs_state()), ("key-aware", 3, true));
    assert_eq!(put(&mut a, 0, 1), KeyAwarePolicy::YOUNG);
    b.observe(&Observation::Read { slot: 0, identity: Some(1), len: 1, slot_reads: 0 });
    assert_eq!(put(&mut a, 1, 1), KeyAwarePolicy::READ);
}

/// tools/waf-compare checks each configuration's handles against the drive before its first
/// erase, from a table of its own: the table is each policy's `handles()`.
#[test]
fn waf_compares_table_of_handles_is_the_policies() {
    let tool = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tools/waf-compare")).unwrap();
    let line = tool.lines().find(|l| l.starts_with("declare -A HANDLES_NEEDED=(")).expect("the table");
    let table: Vec<(String, u16)> = line
        .split('[')
        .skip(1)
        .map(|e| {
            let (name, rest) = e.split_once("]=").unwrap();
            (name.to_string(), rest.trim_end_matches([')', ' ']).parse().unwrap())
        })
        .collect();
    for name in ["none", "region", "lmcache-fdp", "key-aware"] {
        let want = super::policy_by_name(name).unwrap().handles();
        let listed = table.iter().find(|(n, _)| n == name).map(|&(_, h)| h);
        assert_eq!(listed.unwrap_or(1), want, "{name}");
    }
    assert_eq!(table.len(), 3, "{table:?}");
}

#[test]
fn the_choices_named_in_errors_are_each_policys_handles() {
    assert_eq!(super::handles_of_each(), "none 1, region 4, lmcache-fdp 8, key-aware 3");
}
