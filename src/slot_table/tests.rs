use super::*;

#[test]
fn tags_stop_where_the_saved_state_ends_and_all_of_them_come_back() {
    let t = TagTable::default();
    let long = "m".repeat(200);
    let mut ids = Vec::new();
    for i in 0..1000 {
        match t.intern(&long, &format!("tenant-{i}:v1")) {
            0 => break,
            id => ids.push(id),
        }
    }
    // Full well before MAX_TAGS: the names would not fit the saved pages.
    assert!(ids.len() > 10 && ids.len() < 200, "{}", ids.len());
    assert_eq!(t.intern(&long, "one-more"), 0);
    assert_eq!(t.intern(&long, "tenant-0:v1"), 1, "a known pair keeps its tag");
    let bytes = t.take_dirty().unwrap();
    assert!(bytes.len() <= TagTable::MAX_BYTES);
    let back = TagTable::default();
    back.restore(&bytes);
    assert_eq!(back.len(), ids.len());
    for &id in &ids {
        assert_eq!(back.name(id), t.name(id));
    }
    // After a restore the budget is the same: nothing more fits.
    assert_eq!(back.intern(&long, "one-more"), 0);
}

#[test]
fn releasing_the_holds_frees_every_write_a_dead_state_thread_held() {
    let t = SlotTable::new(4);
    let l = t.life(2);
    assert!(t.cas_life(2, l, l | life::TRIMMING));
    assert!(t.begin_container_zeroing(1, 0));
    assert!(t.trimming(2) && t.container_zeroing(1));
    t.release_holds();
    assert!(!t.trimming(2) && !t.container_zeroing(1));
    assert_eq!(t.life(2), l, "nothing else changes");
}

#[test]
fn a_write_stamped_after_the_epoch_was_read_is_never_old() {
    // The state thread reads the epoch, then a slot's life word: a put in between carries a
    // newer stamp. Wrapped, that distance would be 2^24 - 1 epochs: "fresh enough" to be
    // confirmed as the content of a checkpoint that never saw it.
    assert_eq!(life::epochs_since(101, 100), 0);
    assert_eq!(life::epochs_since(100 + 5, 100), 0);
    assert_eq!(life::epochs_since(95, 100), 5);
    assert_eq!(life::epochs_since(100, 100), 0);
    // Across the 2^24 wrap of the stamp field.
    let top = life::STAMP_MASK as u32;
    assert_eq!(life::epochs_since(top, 2), 3);
    assert_eq!(life::epochs_since(top - 2, top + 1), 3);
    assert_eq!(life::epochs_since(3, top + 1), 0, "stamp 3 is after epoch 2^24 (0 in 24 bits)");
    assert_eq!(life::epochs_since(1, (1 << 23) + 1), 0, "2^23 epochs or more: unknown, so not old");
}

#[test]
fn completed_headers_are_queued_when_a_stale_tail_may_be_behind_them() {
    let t = SlotTable::new(4);
    t.record_header(2, &SlotHeader { identity: 1, payload_len: 10 }, 0);
    t.record_header(2, &SlotHeader { identity: 2, payload_len: 10 }, 0);
    t.header_completed(2, 1); // the first header's write completes late: not current
    assert!(t.take_completed_headers().is_empty());
    t.header_completed(2, 2);
    assert_eq!(t.take_completed_headers(), vec![2]);
    assert!(t.take_completed_headers().is_empty());
    // Payload writes keep a deallocated tail (and HEADER_DONE); anything else drops both.
    assert!(t.cas_life(2, t.life(2), (t.life(2) | life::TRIMMING) & !life::TAIL_DONE));
    t.end_tail_trim(2, t.life(2), true);
    assert_eq!(t.life(2) & (life::TAIL_DONE | life::STALE_TAIL | life::TRIMMING), life::TAIL_DONE);
    t.note_payload_write(2);
    assert_eq!(t.life(2) & (life::TAIL_DONE | life::HEADER_DONE), life::TAIL_DONE | life::HEADER_DONE);
    // A no longer payload after a deallocated tail leaves nothing stale...
    t.record_header(2, &SlotHeader { identity: 3, payload_len: 10 }, 0);
    t.header_completed(2, 3);
    assert!(t.take_completed_headers().is_empty());
    // ...a longer one does, and so does any write past the payload.
    t.record_header(2, &SlotHeader { identity: 4, payload_len: 9 }, 0);
    t.header_completed(2, 4);
    assert_eq!(t.take_completed_headers(), vec![2]);
    assert!(t.life(2) & life::HEADER_DONE != 0);
    t.note_write(2);
    assert!(t.life(2) & (life::TAIL_DONE | life::HEADER_DONE) == 0);
    t.record_header(2, &SlotHeader { identity: 5, payload_len: 9 }, 0);
    t.header_completed(2, 4); // too late: a new header
    assert!(t.life(2) & life::HEADER_DONE == 0 && t.take_completed_headers().is_empty());
    // A write past the payload while the header is in flight: nothing to do early.
    let g = t.record_header(2, &SlotHeader { identity: 6, payload_len: 1 }, 0);
    t.note_write(2);
    t.header_completed(2, g);
    assert!(t.life(2) & life::HEADER_DONE == 0 && t.take_completed_headers().is_empty());
    // None is persisted: a restarted table knows nothing of them.
    assert_eq!(persisted_life(life::STALE_TAIL | life::TAIL_DONE | life::HEADER_DONE), 0);
}

#[test]
fn record_and_generations() {
    let t = SlotTable::new(4);
    assert_eq!(t.get(1), None);
    let h = SlotHeader { identity: 99, payload_len: 8181 };
    t.record_header(1, &h, 3);
    let e = t.get(1).unwrap();
    assert_eq!((e.identity, e.payload_len, e.handle, e.generation), (99, 8181, 3, 1));
    assert_eq!((e.state, e.writes, e.reads, e.seen_before), (SlotState::Unknown, 1, 0, false));
    assert_eq!(t.expected_payload(1), Some(1));
    t.payload_written(1, 8192, 1);
    assert!(!t.expects_payload(1));
    t.record_header(1, &h, 2);
    assert_eq!(t.get(1).unwrap().generation, 2);
    assert_eq!(t.get(1).unwrap().writes, 2);
    t.record_header(9, &h, 2); // out of range: ignored
    assert_eq!(t.get(9), None);
    assert_eq!(t.note_read(1), 1);
    assert_eq!(t.note_read(1), 2);
    assert_eq!(t.get(1).unwrap().reads, 2);
    // Payloads past 2 GiB (a long chunk of a large model) are still counted to their end.
    let big = SlotHeader { identity: 7, payload_len: (3 << 30) + 100 };
    t.record_header(2, &big, 1);
    t.payload_written(2, 5 << 29, 1);
    assert!(t.expects_payload(2), "2.5 of 3 GiB written");
    t.payload_written(2, (1 << 29) + 4096, 1);
    assert!(!t.expects_payload(2));
    // A piece judged on header 1, counted after header 2 took the slot (another queue):
    // it is not header 2's payload, whose count stays whole.
    t.record_header(3, &h, 0);
    let judged = t.expected_payload(3).unwrap();
    t.record_header(3, &h, 0);
    t.payload_written(3, 8192, judged);
    assert_eq!(t.expected_payload(3), Some(judged + 1), "the newer header still expects all of its payload");
    t.payload_written(3, 8192, judged + 1);
    assert!(!t.expects_payload(3));
}

#[test]
fn loads_save_the_record_at_class_counts_only() {
    let t = SlotTable::new(2 * RECORDS_PER_PAGE);
    let slot = RECORDS_PER_PAGE + 3; // the second page
    t.record_header(slot, &SlotHeader { identity: 5, payload_len: 10 }, 0);
    assert_eq!(t.take_dirty_pages(), vec![1]);
    let mut saved_at = Vec::new();
    for n in 1..=300u32 {
        t.note_read(slot);
        if !t.take_dirty_pages().is_empty() {
            saved_at.push(n);
        }
    }
    assert_eq!(saved_at, [1, 2, 3, 4, 8, 16, 32, 64, 128, 255]);
    assert_eq!(t.get(slot).unwrap().reads, u8::MAX);
    t.note_read(9 * RECORDS_PER_PAGE); // out of range: ignored
    assert!(t.take_dirty_pages().is_empty());
}

#[test]
fn returning_identity_is_recognised_with_its_tag() {
    let t = SlotTable::new(64);
    let tag = t.tags().intern("meta-llama/Llama-3.1-8B", "tenantA:alice");
    t.record_header(0, &SlotHeader { identity: 7, payload_len: 10 }, 1);
    // The state thread confirmed it and learnt its tag.
    let l = t.life(0);
    assert!(t.cas_life(0, l, life::with_tag(l | life::CONFIRMED, tag)));
    // Slot 0 is reused for identity 8: 7 goes to the history.
    t.record_header(0, &SlotHeader { identity: 8, payload_len: 10 }, 1);
    assert!(!t.get(0).unwrap().seen_before);
    assert_eq!(t.history().lookup(7), Some(tag));
    // 7 comes back in slot 5: recognised, with its tag.
    t.record_header(5, &SlotHeader { identity: 7, payload_len: 10 }, 1);
    let e = t.get(5).unwrap();
    assert!(e.seen_before);
    assert_eq!(e.tag, tag);
    assert_eq!(t.tag_name(tag), Some(("meta-llama/Llama-3.1-8B".into(), "tenantA:alice".into())));
    assert_eq!(t.returning(), 1);
    // Evicted from slot 5 and put back into it: returning too, not a rewrite of the same put.
    let l = t.life(5);
    assert!(t.cas_life(5, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    t.record_header(5, &SlotHeader { identity: 7, payload_len: 10 }, 1);
    assert_eq!(t.returning(), 2);
    // A header of the same put written again (its slot not evicted) is no return.
    t.record_header(5, &SlotHeader { identity: 7, payload_len: 10 }, 1);
    assert_eq!(t.returning(), 2);
    // A first key evicted and put back into its own slot has been seen before from then on.
    t.record_header(9, &SlotHeader { identity: 70, payload_len: 10 }, 1);
    let l = t.life(9);
    assert!(t.cas_life(9, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    t.record_header(9, &SlotHeader { identity: 70, payload_len: 10 }, 1);
    assert!(t.get(9).unwrap().seen_before);
    assert_eq!(t.returning(), 3);
}

#[test]
fn writes_clear_confirmation_and_see_trims() {
    let t = SlotTable::new(4);
    t.record_header(2, &SlotHeader { identity: 5, payload_len: 100 }, 0);
    let l = t.life(2);
    assert!(t.cas_life(2, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    let l = t.life(2);
    // The state thread begins a trim; a payload write now sees it.
    assert!(t.cas_life(2, l, l | life::TRIMMING));
    assert!(t.trimming(2));
    assert!(t.note_write(2), "a write during a trim must wait");
    assert!(!t.get(2).unwrap().confirmed);
    t.end_trim(2, l | life::TRIMMING, true);
    assert!(!t.trimming(2));
    // The write came first: the slot is not reported trimmed.
    assert_eq!(t.get(2).unwrap().state, SlotState::Unknown);
    // A new header held during a trim keeps its payload count once the trim ends.
    let l = t.life(2);
    assert!(t.cas_life(2, l, l | life::TRIMMING));
    t.record_header(2, &SlotHeader { identity: 6, payload_len: 8192 }, 0);
    t.end_trim(2, l | life::TRIMMING, true);
    assert!(t.expects_payload(2), "the put's payload must not wait out the header wait");
    // A CAS expecting the old word fails after a write.
    let l = t.life(2);
    t.note_write(2);
    assert!(t.cas_life(2, t.life(2), t.life(2)));
    assert!(!t.cas_life(2, l | life::CONFIRMED, l | life::TRIMMING));
}

#[test]
fn a_load_during_a_trim_does_not_undo_it_and_an_old_payload_count_goes() {
    let t = SlotTable::new(4);
    // A put whose payload never all came: 4096 of 8192 bytes written.
    t.record_header(1, &SlotHeader { identity: 5, payload_len: 8192 }, 0);
    t.payload_written(1, 4096, 1);
    let l = t.life(1);
    assert!(t.cas_life(1, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    let l = t.life(1);
    assert!(t.cas_life(1, l, l | life::TRIMMING));
    t.note_read(1); // a load while the discard runs: not a write
    assert!(!t.note_write(3), "another slot's write does not wait");
    t.end_trim(1, l | life::TRIMMING, true);
    let e = t.get(1).unwrap();
    assert_eq!((e.state, e.confirmed, t.trimming(1)), (SlotState::Trimmed, false, false));
    assert_eq!((e.identity, e.reads), (5, 1), "a trimmed slot keeps its identity and loads (for a restart)");
    assert!(!t.expects_payload(1), "the old put's payload count went with the slot");
    // A failed discard leaves the slot as it was, the load counted.
    t.record_header(2, &SlotHeader { identity: 6, payload_len: 100 }, 0);
    let l = t.life(2);
    assert!(t.cas_life(2, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    let l = t.life(2);
    assert!(t.cas_life(2, l, l | life::TRIMMING));
    t.note_read(2);
    t.end_trim(2, l | life::TRIMMING, false);
    let e = t.get(2).unwrap();
    assert_eq!((e.state, e.confirmed, e.reads, t.trimming(2)), (SlotState::Evicted, true, 1, false));
}

#[test]
fn a_put_after_a_trim_keeps_an_equal_payload_count() {
    // The window in `end_trim` between the slot's word checked unchanged (the trim stands,
    // `TRIMMING` cleared) and the old put's unfinished count cleared: a new put of the same
    // payload length that records its header there must keep its count.
    let t = SlotTable::new(4);
    t.record_header(1, &SlotHeader { identity: 5, payload_len: 8192 }, 0);
    t.payload_written(1, 4096, 1);
    let left = t.remaining[1].load(Ordering::Acquire);
    t.record_header(1, &SlotHeader { identity: 6, payload_len: 4096 }, 0);
    assert_eq!(count_of(t.remaining[1].load(Ordering::Acquire)), count_of(left), "the same count as the old put's");
    t.clear_left_count(1, left);
    assert!(t.expects_payload(1), "the new put's payload count must stay");
    // Unchanged, the old count goes.
    let left = t.remaining[1].load(Ordering::Acquire);
    t.clear_left_count(1, left);
    assert!(!t.expects_payload(1));
    // Payload written and ahead keep the header's generation.
    t.record_header(2, &SlotHeader { identity: 7, payload_len: 8192 }, 0);
    t.payload_written(2, 4096, 1);
    let g = t.remaining[2].load(Ordering::Acquire) >> 32;
    assert_eq!(Some(g as u16), t.generation(2));
    t.payload_written(2, 4096, 1);
    t.payload_ahead(2, 512);
    assert_eq!(t.remaining[2].load(Ordering::Acquire) >> 32, g);
    assert!(!t.expects_payload(2), "bytes ahead of a header are not expected payload");
}

#[test]
fn a_repeated_header_write_is_not_a_new_epoch() {
    let t = SlotTable::new(4);
    let h = CheckpointHeader { magic: *b"LMCIDX01", version: 1, seq: 3, payload_len: 10, crc32: 7 };
    let _ = t.checkpoint_header(0, Some(h));
    let _ = t.checkpoint_header(1, Some(CheckpointHeader { seq: 4, ..h }));
    let _ = t.checkpoint_header(0, Some(h)); // written again after epoch 2 began
    assert_eq!(t.epoch(), 2);
    let (ev, _) = t.take_events();
    assert_eq!(ev.len(), 2, "one pending event per container");
    assert_eq!((ev[1].copy, ev[1].epoch), (0, 1), "the repeat keeps its first epoch");
    let _ = t.checkpoint_header(0, None);
    assert_eq!(t.epoch(), 2);
    let _ = t.checkpoint_header(0, Some(CheckpointHeader { seq: 5, ..h }));
    assert_eq!(t.epoch(), 3);
}

#[test]
fn zeroing_a_container_and_writing_its_header_exclude_each_other() {
    let t = SlotTable::new(4);
    // Nothing written to container 1 since the state thread's view of it: it may zero.
    assert!(t.begin_container_zeroing(1, 0));
    assert!(t.container_zeroing(1) && !t.container_zeroing(0));
    assert!(t.checkpoint_header(1, None), "a header write during the zeroing is held");
    assert!(!t.checkpoint_header(0, None), "the other container's is not");
    t.end_container_zeroing(1);
    assert!(!t.container_zeroing(1));
    // A write planned since the view makes the zeroing fail until its event is taken.
    assert!(!t.begin_container_zeroing(1, 0));
    let h = CheckpointHeader { magic: *b"LMCIDX01", version: 1, seq: 3, payload_len: 10, crc32: 7 };
    assert!(!t.checkpoint_header(1, Some(h)));
    let (ev, _) = t.take_events();
    let writes = ev.iter().find(|e| e.copy == 1).unwrap().writes;
    assert_eq!(writes, 2);
    assert!(!t.begin_container_zeroing(1, writes - 1));
    assert!(t.begin_container_zeroing(1, writes));
    t.end_container_zeroing(1);
}

#[test]
fn record_round_trip() {
    let t = SlotTable::new(8);
    t.record_header(3, &SlotHeader { identity: 0xdead_beef, payload_len: 4096 }, 2);
    let l = t.life(3);
    assert!(t.cas_life(3, l, life::with_tag(life::with_state(l | life::CONFIRMED, SlotState::Live), 4)));
    let mut rec = [0u8; RECORD_BYTES];
    t.encode_record(3, &mut rec);
    let u = SlotTable::new(8);
    u.restore_record(3, &rec, true);
    let (a, b) = (t.get(3).unwrap(), u.get(3).unwrap());
    assert_eq!(a, b);
    let w = SlotTable::new(8);
    w.restore_record(3, &rec, false);
    let c = w.get(3).unwrap();
    assert!(!c.confirmed);
    assert_eq!(c.state, SlotState::Unknown);
    assert_eq!(c.identity, 0xdead_beef);
}

#[test]
fn a_record_confirmed_in_a_state_no_checkpoint_confirms_is_restored_unconfirmed() {
    let t = SlotTable::new(8);
    t.record_header(3, &SlotHeader { identity: 0xdead_beef, payload_len: 4096 }, 2);
    let mut rec = [0u8; RECORD_BYTES];
    for (state, kept) in [(SlotState::Unknown, false), (SlotState::Trimmed, false), (SlotState::Live, true), (SlotState::Evicted, true)] {
        let l = t.life(3);
        assert!(t.cas_life(3, l, life::with_state(l | life::CONFIRMED, state)));
        t.encode_record(3, &mut rec);
        let u = SlotTable::new(8);
        u.restore_record(3, &rec, true);
        let r = u.get(3).unwrap();
        assert_eq!((r.state, r.confirmed), (state, kept), "{state:?}");
    }
}

#[test]
fn history_is_bounded_and_keeps_recent() {
    let h = IdentityHistory::new(64);
    for id in 0..10_000u64 {
        h.insert(id, 1);
    }
    assert!(h.len() <= 64);
    let recent = (9_900..10_000u64).filter(|&i| h.lookup(i).is_some()).count();
    assert!(recent > 30, "{recent}");
    assert!(h.lookup(5).is_none());
}

#[test]
fn tags_round_trip() {
    let t = TagTable::default();
    assert_eq!(t.intern("m", "s"), 1);
    assert_eq!(t.intern("m2", ""), 2);
    assert_eq!(t.intern("m", "s"), 1);
    let b = t.take_dirty().unwrap();
    assert!(t.take_dirty().is_none());
    let u = TagTable::default();
    u.restore(&b);
    assert_eq!(u.name(2), Some(("m2".into(), "".into())));
    u.restore(&[5, 0, 200]); // malformed: no panic
}

/// A load counted by the data path between the state thread's read of a life word and its
/// CAS does not undo the CAS (a confirmation would be lost until the next checkpoint); the
/// count stays. A write in between does.
#[test]
fn a_load_between_read_and_cas_keeps_the_cas_and_its_count() {
    let t = SlotTable::new(4);
    let l = t.life(1);
    assert_eq!(t.note_read(1), 1);
    assert!(t.cas_life(1, l, l | life::CONFIRMED), "a load changes no contents");
    let now = t.life(1);
    assert_eq!(now & life::CONFIRMED, life::CONFIRMED);
    assert_eq!((now & life::READS_MASK) >> life::READS_SHIFT, 1, "the load stays counted");
    assert!(life::same_but_loads(now, l | life::CONFIRMED));
    let l = t.life(1);
    let _ = t.note_write(1);
    assert!(!t.cas_life(1, l, l | life::TRIMMING), "a write in between fails the CAS");
    // A caller that sets the count itself needs the exact word.
    let l = t.life(1);
    t.note_read(1);
    assert!(!t.cas_life(1, l, l & !life::READS_MASK));
}

/// What a layout costs is known before its table is made, exactly.
#[test]
fn a_tables_memory_is_known_before_it_is_made() {
    for n in [1u64, 63, 64, 65, 1000, 4096, 100_003, 1 << 20] {
        assert_eq!(SlotTable::heap_bytes_for(n), SlotTable::new(n).heap_bytes() as u64, "{n} slots");
    }
    let per_slot = SlotTable::heap_bytes_for(1 << 20) as f64 / f64::from(1u32 << 20);
    assert!((36.0..38.0).contains(&per_slot), "{per_slot} bytes a slot");
}

/// A wake that comes before the state thread waits (between its look at the stop flag and
/// its wait) ends that wait at once; the next wait waits again.
#[test]
fn a_wake_before_the_wait_is_not_lost() {
    let t = SlotTable::new(4);
    t.wake();
    let began = std::time::Instant::now();
    t.wait_events(Duration::from_secs(60));
    assert!(began.elapsed() < Duration::from_secs(30), "waited {:?} for a wake already given", began.elapsed());
    assert!(!t.mailbox.lock().unwrap().woken, "the wake is taken once");
}
