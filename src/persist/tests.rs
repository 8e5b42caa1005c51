//! Persistence: round trips, and crash consistency at every write boundary of a persist
//! cycle with torn and dropped writes.

use super::dev::{MemDev, MemOp};
use super::*;
use crate::layout::slot_header::SlotHeader;
use crate::layout::GeometryConfig;
use crate::slot_table::{life, SlotState};

fn geom(slots: u64) -> Geometry {
    GeometryConfig { block_align: 4096, header_bytes: 4096, slot_bytes: 65536, meta_total_bytes: 1 << 20, capacity_bytes: 0 }
        .validate((1 << 20) + slots * 65536)
        .unwrap()
}

use crate::test_fixtures::XorShift as Rng;

/// Changes `n` random slots (headers, confirmations, states, tags) and the history.
fn mutate(t: &SlotTable, rng: &mut Rng, n: usize) {
    for _ in 0..n {
        let slot = rng.below(t.len() as u64);
        let id = rng.draw() | 1;
        t.record_header(slot, &SlotHeader { identity: id, payload_len: rng.below(60000) + 1 }, rng.below(4) as u16);
        let l = t.life(slot);
        let tag = t.tags().intern(&format!("model{}", rng.below(3)), &format!("salt{}", rng.below(5)));
        let state = SlotState::ALL[rng.below(4) as usize];
        // Confirmed only where a checkpoint can confirm: live or evicted contents.
        let conf = if rng.below(2) == 0 && matches!(state, SlotState::Live | SlotState::Evicted) { life::CONFIRMED } else { 0 };
        t.cas_life(slot, l, life::with_tag(life::with_state(l | conf, state), tag));
        t.history().insert(rng.draw(), tag);
    }
}

/// The persisted form of a table: every record, the history and the tags.
fn snapshot(t: &SlotTable) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rec = [0u8; RECORD_BYTES];
    for s in 0..t.len() as u64 {
        t.encode_record(s, &mut rec);
        out.extend_from_slice(&rec);
    }
    for i in 0..t.history().capacity() {
        out.extend_from_slice(&t.history().raw(i).to_le_bytes());
    }
    for tag in 1..=t.tags().len() as u16 {
        let (m, s) = t.tags().name(tag).unwrap();
        out.extend_from_slice(m.as_bytes());
        out.push(0);
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }
    out
}

/// Where two snapshots first differ (for messages).
fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

/// A table of `slots` slots (`geom`) with its state loaded from a blank region: the geometry,
/// table, region, device and persistence.
fn blank_state(slots: u64) -> (Geometry, SlotTable, Region, MemDev, Persist) {
    let g = geom(slots);
    let t = SlotTable::new(g.max_slots);
    let region = region_for(&t);
    let dev = MemDev::new(region.len);
    let p = Persist::load(&dev, region, &g, &t, 3).0.unwrap();
    (g, t, region, dev, p)
}

/// Slot `slot` holds `id` (payload 9), live and confirmed.
fn confirm_live(t: &SlotTable, slot: u64, id: u64) {
    t.record_header(slot, &SlotHeader { identity: id, payload_len: 9 }, 1);
    let l = t.life(slot);
    assert!(t.cas_life(slot, l, life::with_state(l | life::CONFIRMED, SlotState::Live)));
}

fn region_for(t: &SlotTable) -> Region {
    Region { offset: 0, len: Layout::of(t).bytes() }
}

fn load(g: &Geometry, img: Vec<u8>, region: Region) -> (SlotTable, Option<Persist>, Loaded, Arc<MemDev>) {
    let dev = Arc::new(MemDev::new(0));
    dev.set_image(img);
    let t = SlotTable::new(g.max_slots);
    let (p, l) = Persist::load(&*dev, region, g, &t, 3);
    (t, p, l, dev)
}

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

#[test]
fn round_trip_and_incremental() {
    let g = geom(2000);
    let t = SlotTable::new(g.max_slots);
    let region = region_for(&t);
    let dev = MemDev::new(region.len);
    let (p, loaded) = Persist::load(&dev, region, &g, &t, 3);
    assert!(!loaded.found);
    let mut p = p.unwrap();
    let mut rng = Rng(42);
    mutate(&t, &mut rng, 300);
    let c = Counters {
        trims: 5,
        trim_bytes: 5 * 65536,
        trims_by_handle: vec![0, 2, 3],
        checkpoint_seen: Some((41, 1_700_000_000)),
        writeback_pause: Some(SavedPause { interval_ms: 2500, buffered: true }),
        uncheckpointed_since: Some(1_700_000_100),
        ..Counters::default()
    };
    let r = p.cycle(&dev, &t, &c, true, false).unwrap().unwrap();
    assert!(r.pages > 3);
    // Nothing changed: nothing written.
    dev.take_log();
    assert_eq!(p.cycle(&dev, &t, &c, true, false).unwrap(), None);
    assert!(dev.take_log().is_empty());
    // One slot changes: one page and the superblock.
    t.record_header(7, &SlotHeader { identity: 77, payload_len: 7 }, 1);
    let r = p.cycle(&dev, &t, &c, true, false).unwrap().unwrap();
    assert_eq!(r.pages, 1);
    let writes: Vec<u64> = dev.take_log().iter().filter_map(|o| if let MemOp::Write { len, handle: 3, .. } = o { Some(*len) } else { None }).collect();
    assert_eq!(writes, vec![4096, 4096], "one page, one superblock, on the own-state handle");
    let (u, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && l.clean);
    assert_eq!(l.counters.trims, 5);
    assert_eq!(l.counters.checkpoint_seen, Some((41, 1_700_000_000)));
    assert_eq!(l.counters.writeback_pause, Some(SavedPause { interval_ms: 2500, buffered: true }));
    assert_eq!(l.counters.uncheckpointed_since, Some(1_700_000_100));
    assert_eq!(l.counters.trims_by_handle, vec![0, 2, 3]);
    assert_eq!(first_diff(&snapshot(&u), &snapshot(&t)), None, "records are {} bytes", t.len() * RECORD_BYTES);
    assert_eq!(u.get(7).unwrap().identity, 77);
}

#[test]
fn unclean_state_drops_confirmations_and_other_geometry_starts_fresh() {
    let (g, t, region, dev, mut p) = blank_state(500);
    t.record_header(3, &SlotHeader { identity: 9, payload_len: 9 }, 1);
    let l = t.life(3);
    assert!(t.cas_life(3, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    p.cycle(&dev, &t, &Counters::default(), false, true).unwrap();
    let (u, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && !l.clean);
    let e = u.get(3).unwrap();
    assert_eq!((e.identity, e.confirmed, e.state), (9, false, SlotState::Evicted));
    // A clean state is trusted, unless writes were served the table never saw (a layout
    // learned while serving).
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let (c, _, l, _) = load(&g, dev.image(), region);
    assert!(l.clean && c.get(3).unwrap().confirmed);
    let c = SlotTable::new(g.max_slots);
    let (_, l) = Persist::load_trusting(&dev, region, &g, &c, 3, false, CheckpointsNow::NotCompared);
    assert!(l.found && !l.clean);
    // Said, so that a clean stop not trusted is not taken for an unclean one.
    assert!(l.note.as_deref().is_some_and(|n| n.contains("marked as a clean stop, but this start does not trust")), "{l:?}");
    assert_eq!((c.get(3).unwrap().identity, c.get(3).unwrap().confirmed), (9, false));
    // The same image under another slot size: not used.
    let g2 = GeometryConfig { slot_bytes: 131072, ..g.config() }.validate((1 << 20) + 250 * 131072).unwrap();
    let (u2, p2, l2, _) = load(&g2, dev.image(), Region { offset: 0, len: region.len * 2 });
    assert!(!l2.found);
    assert!(l2.note.as_deref().is_some_and(|n| n.contains("another layout (block_align 4096, header_bytes 4096, slot_bytes 65536") && n.contains("this run's: block_align 4096, header_bytes 4096, slot_bytes 131072") && n.contains("replaces it")), "{l2:?}");
    assert!(u2.get(3).is_none());
    assert!(p2.unwrap().next_seq > 1, "seq continues above the old state's");
    // A region too small: persistence off.
    let (_, p3, l3, _) = load(&g, dev.image(), Region { offset: 0, len: 8192 });
    assert!(p3.is_none() && l3.note.is_some());
}

/// Confirmations an unclean load drops are dropped on the drive too, by its first cycle: a
/// later clean stop vouches for the pages on the drive, and a page this run never changed
/// would otherwise bring back a confirmation that a write after the crashed run's last cycle
/// made stale.
#[test]
fn confirmations_an_unclean_load_drops_do_not_come_back_after_a_clean_stop() {
    let (g, t, region, dev, mut p) = blank_state(500);
    confirm_live(&t, 3, 9);
    // The crashed run: its last cycle left the state in use.
    p.cycle(&dev, &t, &Counters::default(), false, true).unwrap();
    let (u, p2, l, dev2) = load(&g, dev.image(), region);
    assert!(l.found && !l.clean && !u.get(3).unwrap().confirmed);
    // This run changes nothing on slot 3's page and stops cleanly.
    let mut p2 = p2.unwrap();
    p2.cycle(&*dev2, &u, &Counters::default(), false, true).unwrap();
    p2.cycle(&*dev2, &u, &Counters::default(), true, true).unwrap();
    let (v, _, l, _) = load(&g, dev2.image(), region);
    assert!(l.clean);
    let e = v.get(3).unwrap();
    assert_eq!((e.identity, e.confirmed), (9, false), "the dropped confirmation came back: {e:?}");
}

/// What of a torn write lands: its first bytes, or some of its 512-byte sectors in any
/// order (a drive need not persist a write front to back).
#[derive(Clone, Copy, Debug)]
enum Tear {
    Prefix(usize),
    /// Sector `i` lands where bit `i % 64` is set.
    Sectors(u64),
}

/// Applies `ops` to `img`: writes, with write `torn` landing only as its [`Tear`] says and
/// the writes in `drop` lost.
fn apply(img: &mut [u8], ops: &[MemOp], torn: Option<(usize, Tear)>, drop: &[usize]) {
    for (i, op) in ops.iter().enumerate() {
        if let MemOp::Write { off, data, .. } = op {
            if drop.contains(&i) {
                continue;
            }
            let at = *off as usize;
            match torn {
                Some((t, Tear::Prefix(cut))) if t == i => {
                    let n = cut.min(data.len());
                    img[at..at + n].copy_from_slice(&data[..n]);
                }
                Some((t, Tear::Sectors(mask))) if t == i => {
                    for (k, sector) in data.chunks(512).enumerate() {
                        if mask >> (k % 64) & 1 == 1 {
                            img[at + k * 512..at + k * 512 + sector.len()].copy_from_slice(sector);
                        }
                    }
                }
                _ => img[at..at + data.len()].copy_from_slice(data),
            }
        }
    }
}

/// [`snapshot`] of `t` as a load that does not trust it restores it: confirmations dropped.
fn snapshot_untrusted(t: &SlotTable) -> Vec<u8> {
    let mut out = snapshot(t);
    let scratch = SlotTable::new(t.len() as u64);
    let mut rec = [0u8; RECORD_BYTES];
    for s in 0..t.len() as u64 {
        t.encode_record(s, &mut rec);
        scratch.restore_record(s, &rec, false);
        scratch.encode_record(s, &mut rec);
        out[s as usize * RECORD_BYTES..(s as usize + 1) * RECORD_BYTES].copy_from_slice(&rec);
    }
    out
}

/// A crash variant: the write torn (index, what landed) and the writes lost.
type Variant = (Option<(usize, Tear)>, Vec<usize>);

#[test]
fn crash_at_every_write_boundary_loads_a_committed_state() {
    let g = geom(4000);
    let mut rng = Rng(7);
    let mut checked = 0;
    let mut most_unflushed = 0;
    for round in 0..12 {
        let t = SlotTable::new(g.max_slots);
        let region = region_for(&t);
        let dev = MemDev::new(region.len);
        let mut p = Persist::load(&dev, region, &g, &t, 3).0.unwrap();
        mutate(&t, &mut rng, 200);
        p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
        let snap_a = snapshot(&t);
        let img_a = dev.image();
        dev.take_log();
        // Cycle B changes a few pages (scattered and adjacent), the history and the tags; in
        // odd rounds it is a run's first, in-use cycle (not clean): what it commits then loads
        // untrusted, its confirmations dropped.
        mutate(&t, &mut rng, 2 + round * 2);
        let b_clean = round % 2 == 0;
        let snap_b = if b_clean { snapshot(&t) } else { snapshot_untrusted(&t) };
        p.cycle(&dev, &t, &Counters { trims: 1, ..Counters::default() }, b_clean, false).unwrap().unwrap();
        let ops = dev.take_log();
        let sb_index = ops.iter().rposition(|o| matches!(o, MemOp::Write { .. })).unwrap();
        assert!(matches!(ops.last(), Some(MemOp::Flush)));
        for p_cut in 0..=ops.len() {
            let prefix = &ops[..p_cut];
            let last_flush = prefix.iter().rposition(|o| matches!(o, MemOp::Flush)).map_or(0, |i| i + 1);
            let unflushed: Vec<usize> = (last_flush..p_cut).filter(|&i| matches!(ops[i], MemOp::Write { .. })).collect();
            // Variants: the cut is clean; the next write is torn (half, and one page of a
            // run; or only some of its sectors: every other one, every other page, all but
            // the first of each 32 KiB); any subset of the unflushed writes was lost (every
            // subset: the cycles here leave few unflushed, 8 at most when this was written).
            let mut variants: Vec<Variant> = vec![(None, vec![])];
            if let Some(MemOp::Write { data, .. }) = ops.get(p_cut) {
                variants.push((Some((p_cut, Tear::Prefix(data.len() / 2))), vec![]));
                variants.push((Some((p_cut, Tear::Prefix(4096.min(data.len() - 1)))), vec![]));
                variants.push((Some((p_cut, Tear::Prefix(100))), vec![]));
                for mask in [0x5555_5555_5555_5555, 0xff00_ff00_ff00_ff00, !1] {
                    variants.push((Some((p_cut, Tear::Sectors(mask))), vec![]));
                }
            }
            let n = unflushed.len();
            assert!(n <= 12, "{n} unflushed writes: too many subsets to try them all");
            for mask in 1..1usize << n {
                variants.push((None, (0..n).filter(|b| mask & (1 << b) != 0).map(|b| unflushed[b]).collect()));
            }
            most_unflushed = most_unflushed.max(n);
            for (torn, drop) in variants {
                let mut img = img_a.clone();
                let upto = match torn {
                    Some((t, _)) => t + 1,
                    None => p_cut,
                };
                apply(&mut img, &ops[..upto], torn, &drop);
                // The superblock is durable when its bytes are all on the image: a tear whose
                // lost tail happens to equal the old bytes there (the CRC's last byte matches
                // the older superblock's one time in 256) is a complete write.
                let sb_durable = upto > sb_index
                    && !drop.contains(&sb_index)
                    && match &ops[sb_index] {
                        MemOp::Write { off, data, .. } => img[*off as usize..*off as usize + data.len()] == data[..],
                        _ => false,
                    };
                let (u, p2, l, dev2) = load(&g, img, region);
                assert!(l.found && l.clean == (b_clean || !sb_durable), "round {round} cut {p_cut}: {l:?}");
                let got = snapshot(&u);
                let want = if sb_durable { &snap_b } else { &snap_a };
                assert!(got == *want, "round {round} cut {p_cut} torn {torn:?} drop {drop:?}: loaded state is not the committed one (sb durable {sb_durable})");
                checked += 1;
                if checked % 5 != 0 {
                    continue;
                }
                // The next run continues from there: one more cycle, then a crash in it
                // before its superblock, must still load the state loaded here; a complete
                // one loads the new state.
                let mut p2 = p2.unwrap();
                mutate(&u, &mut rng, 3);
                let snap_c = snapshot(&u);
                let before = dev2.image();
                dev2.take_log();
                p2.cycle(&*dev2, &u, &Counters::default(), true, false).unwrap();
                let ops2 = dev2.take_log();
                let (v, _, _, _) = load(&g, dev2.image(), region);
                assert!(snapshot(&v) == snap_c, "round {round} cut {p_cut}: the cycle after recovery did not commit");
                let mut img = before;
                let sb2 = ops2.iter().rposition(|o| matches!(o, MemOp::Write { .. })).unwrap();
                apply(&mut img, &ops2[..sb2], None, &[]);
                let (w, _, _, _) = load(&g, img, region);
                assert!(snapshot(&w) == got, "round {round} cut {p_cut}: a crash in the next cycle lost the recovered state");
            }
        }
    }
    eprintln!("{checked} crash variants (cut, torn, lost unflushed writes) loaded a committed state; up to {most_unflushed} writes were unflushed at a cut");
    assert!(checked > 3000, "{checked}");
    // The cycles here must leave more writes unflushed than the earlier limit of 6 covered.
    assert!(most_unflushed > 6, "{most_unflushed}");
}

/// A table of 400 slots with its state loaded from a blank region, then 50 changes (`seed`).
fn changed_table(seed: u64) -> (Geometry, SlotTable, Region, MemDev, Persist, Rng) {
    let g = geom(400);
    let t = SlotTable::new(g.max_slots);
    let region = region_for(&t);
    let dev = MemDev::new(region.len);
    let p = Persist::load(&dev, region, &g, &t, 3).0.unwrap();
    let mut rng = Rng(seed);
    mutate(&t, &mut rng, 50);
    (g, t, region, dev, p, rng)
}

#[test]
fn failed_writes_keep_changes_pending() {
    let (g, t, region, dev, mut p, _) = changed_table(3);
    dev.set_fail_writes(true);
    assert!(p.cycle(&dev, &t, &Counters::default(), true, false).is_err());
    dev.set_fail_writes(false);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let (u, _, _, _) = load(&g, dev.image(), region);
    assert!(snapshot(&u) == snapshot(&t));
}

/// A superblock that read back after its flush failed may still be only in the drive's cache:
/// the next cycle, which overwrites the copies the older superblock vouches for, first needs
/// a flush to succeed.
#[test]
fn a_superblock_whose_flush_failed_is_flushed_before_the_next_cycle_writes() {
    let (g, t, region, dev, mut p, mut rng) = changed_table(5);
    p.cycle(&dev, &t, &Counters::default(), false, false).unwrap().unwrap();
    mutate(&t, &mut rng, 50);
    // The flush after the pages succeeds, the one after the superblock fails.
    dev.set_fail_flushes(Some(1));
    let r = p.cycle(&dev, &t, &Counters::default(), false, false).unwrap().unwrap();
    // Taken as committed from the read-back, its bytes counted as the superblock counts them
    // (else the lifetime count the next superblock saves would go down).
    let sb = Persist::read_superblock(&dev, region).unwrap();
    assert!(r.bytes > 0 && sb.counters.own_bytes == r.bytes, "{} against {}", r.bytes, sb.counters.own_bytes);
    mutate(&t, &mut rng, 50);
    // Flushes still fail: the next cycle writes nothing and keeps its changes.
    dev.set_fail_flushes(Some(0));
    let _ = dev.take_log();
    assert!(p.cycle(&dev, &t, &Counters::default(), false, false).is_err());
    assert!(dev.take_log().is_empty(), "nothing written before a flush succeeded");
    dev.set_fail_flushes(None);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    assert!(matches!(dev.take_log().first(), Some(MemOp::Flush)), "the owed flush comes first");
    let (u, _, _, _) = load(&g, dev.image(), region);
    assert!(snapshot(&u) == snapshot(&t));
}

/// The same superblock, read back from the drive's volatile cache and then lost with it: once
/// a flush succeeds it no longer reads back, and the superblock before it stands again. The
/// next cycle must leave that one's page copies alone: a crash before its own superblock then
/// loads the state of the superblock before.
#[test]
fn a_superblock_lost_after_its_failed_flush_leaves_the_one_before_it_whole() {
    let (g, t, region, dev, mut p, mut rng) = changed_table(6);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let first = snapshot(&t);
    let before = dev.image();
    mutate(&t, &mut rng, 50);
    dev.set_fail_flushes(Some(1));
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    assert!(p.flush_owed());
    // The drive loses its cache: the superblocks are as before that cycle.
    let mut img = dev.image();
    img[..8192].copy_from_slice(&before[..8192]);
    dev.set_image(img);
    mutate(&t, &mut rng, 50);
    // The owed flush succeeds; the flush after the pages fails, before any superblock.
    dev.set_fail_flushes(Some(1));
    assert!(p.cycle(&dev, &t, &Counters::default(), true, false).is_err());
    let (u, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && l.clean, "{l:?}");
    assert!(first_diff(&snapshot(&u), &first).is_none(), "the first cycle's state is not whole");
    // Then the cycles go on as usual.
    dev.set_fail_flushes(None);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let (u, _, l, _) = load(&g, dev.image(), region);
    assert!(l.clean && snapshot(&u) == snapshot(&t));
}

#[test]
fn garbage_region_never_panics() {
    let g = geom(300);
    let t = SlotTable::new(g.max_slots);
    let region = region_for(&t);
    let mut rng = Rng(99);
    for _ in 0..50 {
        let mut img: Vec<u8> = (0..region.len).map(|_| rng.draw() as u8).collect();
        // Valid-looking superblock magic with garbage after it.
        img[..8].copy_from_slice(b"FDPBSB01");
        let (_, p, l, _) = load(&g, img, region);
        assert!(p.is_some() && !l.found);
    }
}

#[test]
fn summary_reads_the_state_at_the_tail_of_an_image() {
    let g = geom(600);
    let size = (64 << 20) + 12345 * 4096;
    let region = Region::tail(size);
    assert!(region.offset >= size - crate::frontend::config::reserved_tail_bytes(size));
    assert_eq!(region.offset % 4096, 0);
    let dev = MemDev::new(size);
    let t = SlotTable::new(g.max_slots);
    let mut p = Persist::load(&dev, region, &g, &t, 3).0.unwrap();
    for s in 0..10 {
        t.record_header(s, &SlotHeader { identity: s + 100, payload_len: 10 }, 2);
    }
    let l = t.life(4);
    t.cas_life(4, l, life::with_state(l | life::CONFIRMED, SlotState::Live));
    t.history().insert(999, 0);
    let pause = Some(SavedPause { interval_ms: 1500, buffered: true });
    let c = Counters { trims: 3, trims_by_handle: vec![0, 0, 3], writeback_pause: pause, checkpoint_seen: Some((7, 1_700_000_000)), uncheckpointed_since: Some(1_700_000_060), checkpoint_headers: read_checkpoint_headers(&dev, &g), ..Counters::default() };
    p.cycle(&dev, &t, &c, true, true).unwrap();
    // Another checkpoint written since the clean stop: trusted no more.
    let mut img = dev.image();
    img[..8].copy_from_slice(b"LMCIDX01");
    let v = summary(&img, size).unwrap().unwrap();
    assert_eq!(v["trusted"], false);
    assert!(v["note"].as_str().unwrap().contains("container 0: zeroes then, no checkpoint now"), "{}", v["note"]);
    let img = dev.image();
    let v = summary(&img, size).unwrap().unwrap();
    assert_eq!(v["writeback_pause"], serde_json::json!({"interval_s": 1.5, "buffered": true}));
    assert_eq!(v["checkpoint_seen"], serde_json::json!({"seq": 7, "at_unix": 1_700_000_000u64}));
    assert_eq!(v["uncheckpointed_since_unix"], 1_700_000_060u64);
    assert_eq!(v["slots"]["with_header"], 10);
    assert_eq!(v["slots"]["live"], 1);
    assert_eq!(v["slots"]["unknown"], 9);
    assert_eq!(v["identity_history"], 1);
    assert_eq!(v["trims"], 3);
    assert_eq!(v["trims_by_handle"]["2"], 3);
    assert_eq!(v["clean"], true);
    assert_eq!((&v["trusted"], &v["note"]), (&serde_json::json!(true), &serde_json::Value::Null));
    assert_eq!(v["checkpoint_headers_recorded"], true);
    assert!(summary(&vec![0u8; 1 << 20], 1 << 20).is_none());
    // A page copy rotted whole: what a start would make of it, with why.
    let mut rotted = img.clone();
    let page0 = p.page_off(0, p.current[0]) as usize;
    rotted[page0..page0 + 32].fill(0);
    let v = summary(&rotted, size).unwrap().unwrap();
    assert_eq!((&v["found"], &v["clean"], &v["trusted"]), (&serde_json::json!(true), &serde_json::json!(true), &serde_json::json!(false)));
    assert!(v["note"].as_str().is_some_and(|n| n.contains("not the versions its superblock committed")), "{v}");

    // A superblock with a valid CRC and a slot count no saved state of this size can hold
    // (2^36: terabytes of slot table) is not believed, where it used to be allocated.
    let mut img = img;
    let sb_at = region.offset as usize;
    let mut rewritten = 0;
    for copy in 0..2 {
        let b = &mut img[sb_at + copy * 4096..sb_at + (copy + 1) * 4096];
        if let Some(mut sb) = Superblock::decode(b) {
            sb.geometry[4] = 1 << 36;
            sb.encode(b);
            rewritten += 1;
        }
    }
    assert!(rewritten > 0);
    let why = summary(&img, size).unwrap().unwrap_err();
    assert!(why.contains("max_slots 68719476736") && why.contains("not one fdpblk serves"), "{why}");
    // Nor one whose slots, at its own slot size, would not fit in the device: the region
    // could hold their records, the device not the slots.
    for copy in 0..2 {
        let b = &mut img[sb_at + copy * 4096..sb_at + (copy + 1) * 4096];
        if let Some(mut sb) = Superblock::decode(b) {
            sb.geometry[4] = 150_000;
            sb.encode(b);
        }
    }
    assert!(2 * 4096 + 2 * 150_000u64.div_ceil(RECORDS_PER_PAGE) * 4096 <= region.len, "the region alone would take it");
    let why = summary(&img, size).unwrap().unwrap_err();
    assert!(why.contains("max_slots 150000") && why.contains("does not fit the"), "{why}");
}

/// A cycle that wrote the tag pages and died before its superblock leaves them forced for the
/// next run, whose tags did not change: they are written with the table's names, not zeros.
#[test]
fn tag_pages_of_an_unfinished_cycle_are_rewritten_with_the_names() {
    let (g, t, region, dev, mut p) = blank_state(300);
    t.tags().intern("m", "a");
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let committed = dev.image();
    dev.take_log();
    // The next cycle writes the tag pages (a new tag) and crashes before its superblock.
    t.tags().intern("m", "b");
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let ops = dev.take_log();
    let sb = ops.iter().rposition(|o| matches!(o, MemOp::Write { .. })).unwrap();
    let mut img = committed;
    apply(&mut img, &ops[..sb], None, &[]);
    let (u, p2, l, dev2) = load(&g, img, region);
    assert!(l.found);
    assert_eq!(u.tags().name(1), Some(("m".into(), "a".into())));
    assert_eq!(u.tags().len(), 1, "the unfinished cycle's tag is not committed");
    // The start-up cycle (nothing changed but the forced pages), then a reload.
    let mut p2 = p2.unwrap();
    p2.cycle(&*dev2, &u, &Counters::default(), false, true).unwrap().unwrap();
    let (v, _, _, _) = load(&g, dev2.image(), region);
    assert_eq!(v.tags().name(1), Some(("m".into(), "a".into())), "tag names survive the forced rewrite");
}

/// A failed cycle skips its seq; the next superblock still goes to the copy that does not
/// hold the newest committed one (by seq parity it would overwrite it).
#[test]
fn a_skipped_seq_never_overwrites_the_newest_superblock() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let sbs = |dev: &MemDev| -> [Option<u64>; 2] {
        let img = dev.image();
        [0usize, 1].map(|c| Superblock::decode(&img[c * 4096..(c + 1) * 4096]).map(|s| s.seq))
    };
    for i in 0..2 {
        t.record_header(i, &SlotHeader { identity: 10 + i, payload_len: 1 }, 1);
        p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    }
    let newest = p.seq();
    t.record_header(5, &SlotHeader { identity: 50, payload_len: 1 }, 1);
    dev.set_fail_writes(true);
    assert!(p.cycle(&dev, &t, &Counters::default(), true, false).is_err());
    dev.set_fail_writes(false);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let s = sbs(&dev);
    assert!(s.contains(&Some(newest)), "superblocks {s:?}: the newest committed before ({newest}) was overwritten");
    assert!(s.contains(&Some(p.seq())) && p.seq() == newest + 2);
    // After a reload the copy is known again: one more cycle keeps the last one.
    let (u, p2, _, dev2) = load(&g, dev.image(), region);
    let mut p2 = p2.unwrap();
    u.record_header(6, &SlotHeader { identity: 60, payload_len: 1 }, 1);
    let before = p2.seq();
    p2.cycle(&*dev2, &u, &Counters::default(), true, false).unwrap().unwrap();
    assert!(sbs(&dev2).contains(&Some(before)));
}

/// A clean state marked in use before serving (a layout still to be learned) loads unclean,
/// with the same records; a state that is not clean is left alone.
#[test]
fn marking_a_clean_state_in_use_makes_it_untrusted() {
    let (g, t, region, dev, mut p) = blank_state(300);
    t.record_header(3, &SlotHeader { identity: 9, payload_len: 9 }, 1);
    let l = t.life(3);
    assert!(t.cas_life(3, l, life::with_state(l | life::CONFIRMED, SlotState::Evicted)));
    t.record_header(4, &SlotHeader { identity: 8, payload_len: 9 }, 1);
    let l = t.life(4);
    assert!(t.cas_life(4, l, life::with_state(l, SlotState::Trimmed)));
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    assert_eq!(load(&g, dev.image(), region).0.get(4).unwrap().state, SlotState::Trimmed, "trusted: kept");
    assert!(Persist::mark_in_use(&dev, region, 3).unwrap().is_some());
    let (u, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && !l.clean);
    assert_eq!((u.get(3).unwrap().identity, u.get(3).unwrap().confirmed), (9, false));
    // A trimmed slot stays trimmed (what `inspect` and `stats` report after a crash).
    assert_eq!(u.get(4).unwrap().state, SlotState::Trimmed);
    assert!(Persist::mark_in_use(&dev, region, 3).unwrap().is_none(), "already not clean");
    assert!(Persist::mark_in_use(&MemDev::new(region.len), region, 3).unwrap().is_none(), "no state");
}

#[test]
fn a_damaged_newest_page_copy_makes_a_clean_state_untrusted_once() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let confirm = |slot: u64, id: u64| confirm_live(&t, slot, id);
    confirm(3, 9);
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    // Slot 3 again: page 0's newest version goes to its other copy.
    confirm(3, 10);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let newest = p.page_off(0, p.current[0]);
    let (u, _, l, _) = load(&g, dev.image(), region);
    assert!(l.clean && u.get(3).unwrap().confirmed && u.get(3).unwrap().identity == 10);
    // That copy rots (its checksum fails): the older one, which still passes, must not be
    // trusted as the newest.
    let mut img = dev.image();
    img[(newest + 100) as usize] ^= 0x40;
    let (u, p2, l, dev2) = load(&g, img, region);
    assert!(l.found && !l.clean, "{l:?}");
    assert!(l.note.as_deref().is_some_and(|n| n.contains("damaged newest copy")), "{l:?}");
    assert!(!u.get(3).unwrap().confirmed, "the older copy's confirmation is dropped");
    // The next cycle writes that page again: the load after it is trusted.
    let mut p2 = p2.unwrap();
    p2.cycle(&*dev2, &u, &Counters::default(), true, false).unwrap().unwrap();
    assert!(load(&g, dev2.image(), region).2.clean);
}

/// A saved state whose page 0 has two versions (slot 3 confirmed as identity 9, then as 10)
/// and slot 200 (page 1) confirmed as 7; the newest superblock clean, the one before it clean
/// or not (`first_clean`). Its geometry, region, device and the offset of page 0's newest copy.
fn two_versions_of_page_0() -> (Geometry, Region, MemDev, u64) {
    two_versions_of_page_0_first(true)
}

fn two_versions_of_page_0_first(first_clean: bool) -> (Geometry, Region, MemDev, u64) {
    let (g, t, region, dev, mut p) = blank_state(300);
    let confirm = |slot: u64, id: u64| confirm_live(&t, slot, id);
    confirm(3, 9);
    confirm(200, 7);
    p.cycle(&dev, &t, &Counters::default(), first_clean, true).unwrap();
    confirm(3, 10);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let newest = p.page_off(0, p.current[0]);
    assert!(load(&g, dev.image(), region).2.clean);
    (g, region, dev, newest)
}

/// One unreadable sector in the page area costs that page copy, not the state: the other
/// copy stands (untrusted, as it may be older), the rest of the run it was read in is
/// restored, and the first cycle writes the unreadable copy again.
#[test]
fn an_unreadable_page_copy_is_taken_from_its_other_copy_and_written_again() {
    let (g, region, dev, newest) = two_versions_of_page_0();
    dev.set_fail_reads(Some(newest..newest + 4096));
    let u = SlotTable::new(g.max_slots);
    let (p2, l) = Persist::load(&dev, region, &g, &u, 3);
    assert!(l.found && !l.clean, "{l:?}");
    assert!(l.note.as_deref().is_some_and(|n| n.contains("cannot read 1 page copy")), "{l:?}");
    let s3 = u.get(3).unwrap();
    assert!(s3.identity == 9 && !s3.confirmed, "the older copy, untrusted: {s3:?}");
    assert_eq!(u.get(200).unwrap().identity, 7, "page 1, read in the same run, is restored");
    // The first cycle (reads still failing) writes page 0 into the copy that did not read.
    let mut p2 = p2.unwrap();
    dev.take_log();
    p2.cycle(&dev, &u, &Counters::default(), true, false).unwrap().unwrap();
    assert!(dev.take_log().iter().any(|op| matches!(op, MemOp::Write { off, .. } if *off == newest)));
    dev.set_fail_reads(None);
    let (v, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && l.clean && snapshot(&v) == snapshot(&u), "{l:?}");
}

/// Where neither copy of a page reads, nothing of it is known: the state is not used, and the
/// next cycles (a new instance) never pick up the old pages.
#[test]
fn a_page_with_both_copies_unreadable_starts_a_fresh_state() {
    let (g, region, dev, _) = two_versions_of_page_0();
    let pages = Layout::of(&SlotTable::new(g.max_slots)).pages();
    let (c0, c1) = (region.offset + 2 * 4096, region.offset + (2 + pages) * 4096);
    let u = SlotTable::new(g.max_slots);
    // Both copies of page 0, one bad sector each: fail the reads that touch either.
    let (a, b) = (c0..c0 + 4096, c1..c1 + 4096);
    let fail = FailReads { dev: &dev, fails: |off, end| touches(&a, off, end) || touches(&b, off, end) };
    let (p2, l) = Persist::load(&fail, region, &g, &u, 3);
    assert!(!l.found && l.note.as_deref().is_some_and(|n| n.contains("either copy")), "{l:?}");
    assert!(u.get(3).is_none() && u.get(200).is_none());
    p2.unwrap().cycle(&dev, &u, &Counters::default(), true, true).unwrap();
    let (v, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && v.get(3).is_none() && v.get(200).is_none(), "the old instance's pages stay ignored");
}

/// Many page copies that do not read (a failing region): the load gives up after a few
/// rather than spend the drive's error recovery on every page.
#[test]
fn many_unreadable_page_copies_start_a_fresh_state() {
    let (g, t, region, dev, mut p) = blank_state(4000);
    mutate(&t, &mut Rng(7), 500);
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    // Nine copies, all of copy 0: no page loses both.
    assert!(Layout::of(&t).pages() >= 9);
    let c0 = region.offset + 2 * 4096;
    dev.set_fail_reads(Some(c0..c0 + 9 * 4096));
    let u = SlotTable::new(g.max_slots);
    let (_, l) = Persist::load(&dev, region, &g, &u, 3);
    assert!(!l.found && l.note.as_deref().is_some_and(|n| n.contains("more than 8 page copies")), "{l:?}");
    // Eight load, untrusted.
    dev.set_fail_reads(Some(c0..c0 + 8 * 4096));
    let (_, l) = Persist::load(&dev, region, &g, &SlotTable::new(g.max_slots), 3);
    assert!(l.found && !l.clean && l.note.as_deref().is_some_and(|n| n.contains("cannot read 8 page copy")), "{l:?}");
}

/// A load that gives the saved state up (too many copies did not read) starts a new instance
/// whose first cycle writes pages over the old state's copies: a crash in that cycle must not
/// leave the old clean superblock vouching for copies the new instance overwrote.
#[test]
fn a_crash_in_a_fresh_states_first_cycle_never_trusts_the_old_state_half_overwritten() {
    let (g, t, region, dev, mut p) = blank_state(4000);
    let mut rng = Rng(11);
    for _ in 0..3 {
        mutate(&t, &mut rng, 3000);
        p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    }
    let old = snapshot(&t);
    let c0 = region.offset + 2 * 4096;
    dev.set_fail_reads(Some(c0..c0 + 9 * 4096));
    let u = SlotTable::new(g.max_slots);
    let (p2, l) = Persist::load(&dev, region, &g, &u, 3);
    assert!(!l.found, "{l:?}");
    dev.set_fail_reads(None);
    mutate(&u, &mut Rng(12), 3000);
    let before = dev.image();
    dev.take_log();
    p2.unwrap().cycle(&dev, &u, &Counters::default(), false, true).unwrap().unwrap();
    let ops = dev.take_log();
    let writes: Vec<usize> = (0..ops.len()).filter(|&i| matches!(ops[i], MemOp::Write { .. })).collect();
    for (k, &w) in writes.iter().enumerate() {
        for cut in [2048, 4096] {
            let mut img = before.clone();
            apply(&mut img, &ops, Some((w, Tear::Prefix(cut))), &writes[k + 1..]);
            let (v, _, l, _) = load(&g, img, region);
            assert!(!l.clean || snapshot(&v) == old, "a crash in write {k} (cut at {cut}) left the old state trusted, half overwritten: {l:?}");
        }
    }
}

/// Tag names span several pages, all written with one seq. Where one tag page's newest copy
/// does not read, the older copy that loads is of another stream: the names are cut before
/// it, and slots (and history entries) whose tag was past the cut start untagged, so that
/// no slot is ever given another tag's name, now or when a new tag takes the number.
#[test]
fn a_tag_page_of_another_cycle_cuts_the_names_there_and_untags_what_was_past_it() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let name = |i: u64| (format!("model-{i:03}-{}", "m".repeat(90)), format!("salt-{i:03}-{}", "s".repeat(90)));
    let tag = |slot: u64| {
        let (m, s) = name(slot);
        let tag = t.tags().intern(&m, &s);
        t.record_header(slot, &SlotHeader { identity: 1000 + slot, payload_len: 9 }, 1);
        let l = t.life(slot);
        assert!(t.cas_life(slot, l, life::with_tag(l, tag)));
        t.history().insert(5000 + slot, tag);
        tag
    };
    for slot in 0..30 {
        assert_eq!(tag(slot), slot as u16 + 1);
    }
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    for slot in 30..50 {
        tag(slot);
    }
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let l = Layout::of(&t);
    let page1 = l.record_pages + l.history_pages + 1;
    assert!(t.tags().serialized().len() > 2 * PAGE_PAYLOAD, "the names span three pages");
    let newest = p.page_off(page1, p.current[page1 as usize]);
    let whole = dev.image();
    dev.set_fail_reads(Some(newest..newest + 4096));
    let u = SlotTable::new(g.max_slots);
    let (p2, l2) = Persist::load(&dev, region, &g, &u, 3);
    assert!(l2.found, "{l2:?}");
    let known = u.tags().len() as u16;
    assert!(known > 0 && known < 30, "cut within page 0: {known} names");
    for slot in 0..50u64 {
        let tg = life::tag(u.life(slot));
        match u.tag_name(tg) {
            Some(n) => assert_eq!(n, name(slot), "slot {slot}: tag {tg} names another"),
            None => assert_eq!(tg, 0, "slot {slot}: tag {tg} has no name"),
        }
    }
    // History entries past the cut lost their tags too.
    for i in 0..u.history().capacity() {
        let e = u.history().raw(i);
        assert!(e & 0xffff <= u64::from(known), "history entry {i} keeps tag {}", e & 0xffff);
    }
    // A new tag takes the next number; no slot carries it.
    let fresh = u.tags().intern("new-model", "new-salt");
    assert_eq!(fresh, known + 1);
    assert!((0..50).all(|s| life::tag(u.life(s)) != fresh));
    // Saved again: the next load reads the same, whole.
    dev.set_fail_reads(None);
    p2.unwrap().cycle(&dev, &u, &Counters::default(), true, true).unwrap();
    let (v, _, l3, _) = load(&g, dev.image(), region);
    assert!(l3.found && l3.clean && snapshot(&v) == snapshot(&u), "{l3:?}");

    // The older copy of tag page 1 does not read: the names load whole (the newest copies
    // share one seq), and the cycle that writes that copy again writes every tag page with
    // it, so the next load finds them sharing one seq still, and cuts nothing.
    let (v, _, _, dev3) = load(&g, whole, region);
    let older = p.page_off(page1, 1 - p.current[page1 as usize]);
    let names = v.tags().len();
    assert_eq!(names, 50);
    let w = SlotTable::new(g.max_slots);
    dev3.set_fail_reads(Some(older..older + 4096));
    let (p4, l4) = Persist::load(&*dev3, region, &g, &w, 3);
    assert!(l4.found && w.tags().len() == names, "{l4:?}");
    p4.unwrap().cycle(&*dev3, &w, &Counters::default(), true, true).unwrap();
    dev3.set_fail_reads(None);
    let (x, _, l5, _) = load(&g, dev3.image(), region);
    assert!(l5.found && l5.clean && x.tags().len() == names, "{} of {names} names: {l5:?}", x.tags().len());
}

/// Zeroes both copies of every tag page of `t`'s state in `img`: all tag names lost.
fn lose_tag_pages(p: &Persist, t: &SlotTable, img: &mut [u8]) {
    let l = Layout::of(t);
    for page in l.record_pages + l.history_pages..l.pages() {
        for copy in 0..2 {
            let o = p.page_off(page, copy) as usize;
            img[o..o + 4096].fill(0);
        }
    }
}

/// Every copy of every tag page is unreadable: no tag stream loads, nothing is cut, and
/// the slots and history entries that carried tags start untagged, so that tags interned
/// from now on cannot name them.
#[test]
fn slots_whose_tag_names_are_all_lost_start_untagged() {
    let (g, t, region, dev, mut p) = blank_state(300);
    for slot in 0..5u64 {
        let tag = t.tags().intern(&format!("model-{slot}"), "salt");
        t.record_header(slot, &SlotHeader { identity: 1000 + slot, payload_len: 9 }, 1);
        let l = t.life(slot);
        assert!(t.cas_life(slot, l, life::with_tag(l, tag)));
        t.history().insert(5000 + slot, tag);
    }
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let mut img = dev.image();
    lose_tag_pages(&p, &t, &mut img);
    let (v, p2, l2, dev2) = load(&g, img, region);
    // (Its note is the page digest's, said first: the lost pages were committed.)
    assert!(l2.found, "{l2:?}");
    for slot in 0..5u64 {
        assert_eq!((v.get(slot).unwrap().identity, life::tag(v.life(slot))), (1000 + slot, 0), "slot {slot}");
    }
    assert!((0..v.history().capacity()).all(|i| v.history().raw(i) & 0xffff == 0));
    assert_eq!(v.tags().intern("new-model", "new-salt"), 1);
    // Saved again, untagged, with the new name: the next load has nothing to clear.
    p2.unwrap().cycle(&*dev2, &v, &Counters::default(), true, true).unwrap();
    let (w, _, l3, _) = load(&g, dev2.image(), region);
    assert!(l3.found && l3.note.is_none() && snapshot(&w) == snapshot(&v), "{l3:?}");
}

/// A page version the superblock committed but the drive no longer holds (its write lost
/// after the flush acknowledged it, or its copy rotted whole, header too) leaves the older
/// copy, which passes every check of its own: the page digest in the superblock tells, and
/// the state is not trusted that time. The next cycle commits what loaded; trusted again.
#[test]
fn a_committed_page_version_the_drive_lost_makes_a_clean_state_untrusted() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let confirm = |slot: u64, id: u64| confirm_live(&t, slot, id);
    // Three versions of page 0: the newest one's copy holds the first before it.
    confirm(3, 9);
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    confirm(3, 10);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let img2 = dev.image();
    confirm(3, 11);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap().unwrap();
    let newest = p.page_off(0, p.current[0]) as usize;
    assert!(load(&g, dev.image(), region).2.clean);
    for how in ["lost", "header rotted"] {
        let mut img = dev.image();
        match how {
            // The last write never reached the medium: its copy still holds version 1, whole.
            "lost" => img[newest..newest + 4096].copy_from_slice(&img2[newest..newest + 4096]),
            _ => img[newest..newest + 32].fill(0),
        }
        let (u, p2, l, dev2) = load(&g, img, region);
        assert!(l.found && !l.clean, "{how}: {l:?}");
        assert!(l.note.as_deref().is_some_and(|n| n.contains("not the versions its superblock committed")), "{how}: {l:?}");
        let e = u.get(3).unwrap();
        assert_eq!((e.identity, e.confirmed), (10, false), "{how}: version 2 loads, untrusted");
        p2.unwrap().cycle(&*dev2, &u, &Counters::default(), true, true).unwrap();
        let (v, _, l, _) = load(&g, dev2.image(), region);
        assert!(l.clean && v.get(3).unwrap().identity == 10, "{how}: {l:?}");
    }
    // A superblock of an fdpblk before the digest (flag clear) loads as it did.
    let mut img = dev.image();
    let mut rewritten = 0;
    for c in 0..2 {
        if let Some(mut sb) = Superblock::decode(&img[c * 4096..(c + 1) * 4096]) {
            sb.digest = None;
            sb.encode(&mut img[c * 4096..(c + 1) * 4096]);
            rewritten += 1;
        }
    }
    assert_eq!(rewritten, 2, "both superblocks decode");
    let (_, _, l, _) = load(&g, img, region);
    assert!(l.found && l.clean, "{l:?}");
}

/// A device whose reads of `off..end` fail where `fails` says so (a bad sector, a momentary
/// failure); everything else goes to `dev`.
struct FailReads<'a, F: Fn(u64, u64) -> bool + Send + Sync> {
    dev: &'a MemDev,
    fails: F,
}

impl<F: Fn(u64, u64) -> bool + Send + Sync> StateWriter for FailReads<'_, F> {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        if (self.fails)(off, off + buf.len() as u64) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.dev.read_at(off, buf)
    }
    fn write_at(&self, off: u64, buf: &[u8], handle: Handle) -> io::Result<()> {
        self.dev.write_at(off, buf, handle)
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.dev.discard(off, len)
    }
    fn flush(&self) -> io::Result<()> {
        self.dev.flush()
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
}

fn touches(r: &std::ops::Range<u64>, off: u64, end: u64) -> bool {
    r.start < end && off < r.end
}

/// A read that fails once at load (both superblock copies, or a page copy) is read again: the
/// saved state loads whole and trusted, where giving up would start a new instance over it
/// (the superblocks) or take an older copy untrusted (a page).
#[test]
fn a_read_that_fails_once_at_load_is_read_again() {
    let (g, region, dev, newest) = two_versions_of_page_0();
    let want = snapshot(&load(&g, dev.image(), region).0);
    let superblocks = region.offset..region.offset + 2 * 4096;
    // The two superblock copies are read together, then one by one: one failure of each read.
    for (range, fails) in [(superblocks, 3), (newest..newest + 4096, 2)] {
        // Reads touching `range` fail the first `fails` times.
        let left = std::sync::atomic::AtomicU32::new(fails);
        let d = FailReads { dev: &dev, fails: |off, end| touches(&range, off, end) && left.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok() };
        let u = SlotTable::new(g.max_slots);
        let (p, l) = Persist::load(&d, region, &g, &u, 3);
        assert!(l.found && l.clean && l.note.is_none(), "{range:?}: {l:?}");
        assert!(p.is_some() && snapshot(&u) == want, "{range:?}");
        assert_eq!(left.load(SeqCst), 0, "{range:?}: the failures were met");
    }
}

/// A clean state loaded untrusted (page 0's newest copy rotted, or does not read, or the
/// newest superblock does not read) must stay untrusted across a crash anywhere in the first
/// cycle, which overwrites that copy: a crash after the page write but before the superblock
/// would otherwise leave the clean superblock vouching for the older copy, now the only one
/// that passes.
#[test]
fn a_crash_in_the_cycle_rewriting_a_suspect_copy_never_trusts_the_older_one() {
    // What went wrong at load: page 0's newest copy rotted (0) or does not read (1), or the
    // newest superblock copy does not read (2); the superblock before the newest clean or not
    // (as a periodic cycle's is); the read failing through the first cycle or at load only.
    let cases = [(0, true, false), (1, true, false), (2, true, false), (2, false, false), (2, true, true), (2, false, true)];
    for (unreadable, first_clean, at_load_only) in cases {
        let (g, region, dev, newest) = two_versions_of_page_0_first(first_clean);
        match unreadable {
            0 => {
                let mut img = dev.image();
                img[(newest + 100) as usize] ^= 0x40;
                dev.set_image(img);
            }
            1 => dev.set_fail_reads(Some(newest..newest + 4096)),
            _ => {
                let sb = (0..2u64).max_by_key(|c| Superblock::decode(&dev.peek(c * 4096, 4096)).map(|s| s.seq)).unwrap();
                dev.set_fail_reads(Some(sb * 4096..(sb + 1) * 4096));
            }
        }
        let before = dev.image();
        let u = SlotTable::new(g.max_slots);
        let (p2, l) = Persist::load(&dev, region, &g, &u, 3);
        assert!(l.found && !l.clean, "{l:?}");
        if at_load_only {
            dev.set_fail_reads(None);
        }
        dev.take_log();
        p2.unwrap().cycle(&dev, &u, &Counters::default(), false, false).unwrap().unwrap();
        let ops = dev.take_log();
        let writes: Vec<usize> = (0..ops.len()).filter(|&i| matches!(ops[i], MemOp::Write { .. })).collect();
        assert!(writes.len() >= 2, "{ops:?}");
        for (k, &w) in writes.iter().enumerate() {
            // The crash: writes before `w` landed, `w` torn halfway (or whole), none after it.
            for cut in [2048, 4096] {
                let mut img = before.clone();
                let later: Vec<usize> = writes[k + 1..].to_vec();
                apply(&mut img, &ops, Some((w, Tear::Prefix(cut))), &later);
                // (The sector that did not read is read here again: trusting is right only
                // where the newest copy, identity 10, is what loads.)
                let (v, _, l, _) = load(&g, img, region);
                let id = v.get(3).map(|e| e.identity);
                assert!(
                    !l.clean || id == Some(10),
                    "case {:?}: a crash in write {k} (cut at {cut}) left the older copy trusted: {l:?}",
                    (unreadable, first_clean, at_load_only)
                );
            }
        }
    }
}

/// A superblock or page whose seq is past the bound is corrupt, whatever its CRC says.
#[test]
fn seqs_past_the_bound_are_refused() {
    let (g, t, region, dev, mut p) = blank_state(300);
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let mut img = dev.image();
    let mut sb = [0, 1].iter().find_map(|&c| Superblock::decode(&img[c * 4096..(c + 1) * 4096])).unwrap();
    sb.seq = u64::MAX;
    sb.encode(&mut img[..4096]);
    assert!(Superblock::decode(&img[..4096]).is_none());
    let (_, p2, _, _) = load(&g, img.clone(), region);
    assert!(p2.unwrap().next_seq < 1 << 62);
    // The bound itself is refused too: taking it would make every later superblock one that
    // a load refuses, so an older clean state would stay the newest for good.
    sb.seq = 1 << 63;
    sb.encode(&mut img[..4096]);
    assert!(Superblock::decode(&img[..4096]).is_none());
    // Just below it, the state loads but a cycle fails with the fix rather than write a
    // superblock no load takes.
    sb.seq = (1 << 63) - 1;
    sb.clean = true;
    sb.encode(&mut img[..4096]);
    let (t, p3, l, dev) = load(&g, img, region);
    assert!(l.clean);
    let e = p3.unwrap().cycle(&*dev, &t, &Counters::default(), false, true).unwrap_err();
    assert!(e.to_string().contains("blkdiscard -z"), "{e}");
}

/// What the docs say of the reserved tail: 1/4096 of a 2 TB drive holds the state down to
/// slots of about 220 KiB.
#[test]
fn the_reserved_tail_holds_the_state_down_to_about_220_kib_slots() {
    let size = 2_000_000_000_000u64;
    let region = Region::tail(size);
    let fits = |slot_bytes: u64| Layout::of(&SlotTable::new(size / slot_bytes)).bytes() <= region.len;
    assert!(fits(232 << 10));
    assert!(!fits(208 << 10));
}

/// A clean state, then an unfinished cycle (pages written with the next seq, no superblock),
/// then the mark: the pages of the unfinished cycle must not pass as committed.
#[test]
fn marking_in_use_never_vouches_for_an_unfinished_cycles_pages() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let mut rng = Rng(5);
    mutate(&t, &mut rng, 40);
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let img = dev.image();
    // The committed state as an untrusted load sees it (confirmations dropped).
    let committed = {
        let r = SlotTable::new(g.max_slots);
        let (_, l) = Persist::load_trusting(&dev, region, &g, &r, 3, false, CheckpointsNow::NotCompared);
        assert!(l.found);
        snapshot(&r)
    };
    dev.take_log();
    mutate(&t, &mut rng, 40);
    p.cycle(&dev, &t, &Counters::default(), true, false).unwrap();
    let ops = dev.take_log();
    let sb = ops.iter().rposition(|o| matches!(o, MemOp::Write { .. })).unwrap();
    let mut crashed = img;
    apply(&mut crashed, &ops[..sb], None, &[]);
    let dev2 = MemDev::new(region.len);
    dev2.set_image(crashed);
    assert!(Persist::mark_in_use(&dev2, region, 3).unwrap().is_some());
    let (u, p2, l, dev3) = load(&g, dev2.image(), region);
    assert!(l.found && !l.clean, "{l:?}");
    assert!(snapshot(&u) == committed, "the unfinished cycle's pages were taken");
    // The next cycle commits above both, and a reload keeps the marked state's records.
    p2.unwrap().cycle(&*dev3, &u, &Counters::default(), false, true).unwrap().unwrap();
    let (v, _, l, _) = load(&g, dev3.image(), region);
    assert!(l.found && !l.clean && snapshot(&v) == committed);
}

/// A state of three slots saved in three cycles: its geometry, region and device.
fn three_saved_cycles() -> (Geometry, Region, MemDev) {
    let (g, t, region, dev, mut p) = blank_state(300);
    for i in 0..3 {
        t.record_header(i, &SlotHeader { identity: 10 + i, payload_len: 1 }, 1);
        p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    }
    (g, region, dev)
}

/// Superblocks that cannot be read at load: the fresh state's first superblock goes into both
/// copies, so an older clean one with a higher seq cannot outrank it later.
#[test]
fn unreadable_superblocks_are_both_replaced() {
    let (g, region, dev) = three_saved_cycles();
    dev.set_fail_reads(Some(0..8192));
    let u = SlotTable::new(g.max_slots);
    let (p2, l) = Persist::load(&dev, region, &g, &u, 3);
    assert!(!l.found && l.note.as_deref().is_some_and(|n| n.contains("superblocks")));
    dev.set_fail_reads(None);
    p2.unwrap().cycle(&dev, &u, &Counters::default(), false, true).unwrap().unwrap();
    let img = dev.image();
    let sbs: Vec<_> = [0usize, 1].iter().map(|&c| Superblock::decode(&img[c * 4096..(c + 1) * 4096]).map(|s| (s.instance, s.clean))).collect();
    assert!(sbs[0].is_some() && sbs[0] == sbs[1], "{sbs:?}");
    let (v, _, l, _) = load(&g, img, region);
    assert!(l.found && !l.clean && v.get(1).is_none());
}

/// One superblock copy that does not read (a bad sector) costs that copy, not the state: the
/// other is loaded, untrusted (the lost one may be newer, or the mark that the state is in
/// use), and the next cycle writes both copies.
#[test]
fn one_unreadable_superblock_copy_keeps_the_state_untrusted() {
    for bad in 0..2u64 {
        let (g, region, dev) = three_saved_cycles();
        dev.set_fail_reads(Some(bad * 4096..(bad + 1) * 4096));
        let u = SlotTable::new(g.max_slots);
        let (p2, l) = Persist::load(&dev, region, &g, &u, 3);
        assert!(l.found && !l.clean && !l.none_saved, "copy {bad}: {l:?}");
        assert!(l.note.as_deref().is_some_and(|n| n.contains("one copy of the saved state's superblock")), "{l:?}");
        assert!(u.get(0).is_some_and(|e| e.identity == 10), "copy {bad}: the first cycle's slot is restored");
        p2.unwrap().cycle(&dev, &u, &Counters::default(), true, true).unwrap().unwrap();
        dev.set_fail_reads(None);
        let img = dev.image();
        let sbs: Vec<_> = [0usize, 1].iter().map(|&c| Superblock::decode(&img[c * 4096..(c + 1) * 4096]).map(|s| s.seq)).collect();
        assert!(sbs[0].is_some() && sbs[0] == sbs[1], "copy {bad}: both superblocks written: {sbs:?}");
        let (v, _, l, _) = load(&g, img, region);
        assert!(l.found && l.clean && snapshot(&v) == snapshot(&u), "copy {bad}: {l:?}");
    }
}

/// Where a cycle writes both superblock copies, the first is flushed before the second is
/// written: a power loss cannot tear both and lose the state.
#[test]
fn the_first_of_two_superblock_copies_is_durable_before_the_second_is_written() {
    let (g, region, dev) = three_saved_cycles();
    dev.set_fail_reads(Some(0..4096));
    let u = SlotTable::new(g.max_slots);
    let mut p = Persist::load(&dev, region, &g, &u, 3).0.unwrap();
    dev.set_fail_reads(None);
    dev.take_log();
    p.cycle(&dev, &u, &Counters::default(), true, true).unwrap().unwrap();
    let log = dev.take_log();
    let sb: Vec<usize> = log.iter().enumerate().filter(|(_, o)| matches!(o, MemOp::Write { off, .. } if *off < 8192)).map(|(i, _)| i).collect();
    // (First the mark that the state is in use, into the copy that did not read.)
    assert!(sb.len() >= 2, "both superblock copies written: {sb:?}");
    let sb = &sb[sb.len() - 2..];
    assert!(matches!((&log[sb[0]], &log[sb[1]]), (MemOp::Write { off: a, .. }, MemOp::Write { off: b, .. }) if a != b), "the two copies");
    assert!(log[sb[0]..sb[1]].iter().any(|o| matches!(o, MemOp::Flush)), "no flush between the superblock copies");
    assert!(matches!(log.last(), Some(MemOp::Flush)));
}

/// Untagging a large identity history (its tag names lost) forces each of its pages once,
/// not once per entry.
#[test]
fn untagging_the_history_forces_each_page_once() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let tag = t.tags().intern("model", "salt");
    for i in 0..100u64 {
        t.history().insert(7000 + i, tag);
    }
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let mut img = dev.image();
    lose_tag_pages(&p, &t, &mut img);
    let (v, p2, l2, _) = load(&g, img, region);
    assert!(l2.found && (0..v.history().capacity()).all(|i| v.history().raw(i) & 0xffff == 0), "{l2:?}");
    let forced = &p2.unwrap().forced;
    let l = Layout::of(&t);
    for page in l.record_pages..l.record_pages + l.history_pages {
        let n = forced.iter().filter(|&&f| f == page).count();
        assert!(n <= 1, "history page {page} forced {n} times");
    }
}

/// A cycle that writes both superblock copies (one did not read at load) and whose last flush
/// fails is taken as committed where a copy reads back, but only that copy is then known to
/// be there: the next cycle writes both again.
#[test]
fn an_owed_flush_keeps_both_superblock_copies_to_be_written() {
    let mut owed_seen = false;
    for after in 0..6 {
        let (g, region, dev) = three_saved_cycles();
        dev.set_fail_reads(Some(0..4096));
        let u = SlotTable::new(g.max_slots);
        let mut p = Persist::load(&dev, region, &g, &u, 3).0.unwrap();
        assert!(p.sb_both);
        dev.set_fail_flushes(Some(after));
        let r = p.cycle(&dev, &u, &Counters::default(), false, true);
        dev.set_fail_flushes(None);
        if r.is_ok() && p.flush_owed() {
            owed_seen = true;
            assert!(p.sb_both, "after {after} flushes: an owed cycle cleared sb_both");
            dev.take_log();
            p.cycle(&dev, &u, &Counters::default(), false, true).unwrap().unwrap();
            let sbs: Vec<u64> = dev.take_log().iter().filter_map(|op| if let MemOp::Write { off, .. } = op { Some(*off) } else { None }).filter(|&o| o < 8192).collect();
            assert!(sbs.contains(&0) && sbs.contains(&4096), "after {after} flushes: the next cycle wrote superblocks at {sbs:?}");
        }
    }
    assert!(owed_seen, "no flush count gave an owed cycle");
}

/// The bytes a cycle reports (what `own_bytes` adds up) are every block it wrote: its pages,
/// both superblock copies where both are written, and the in-use mark (one or two blocks);
/// the superblock saves the same sum.
#[test]
fn a_cycle_counts_both_superblock_copies_and_the_mark() {
    for unreadable in [None, Some(0..4096u64)] {
        let (g, region, dev) = three_saved_cycles();
        dev.set_fail_reads(unreadable.clone());
        let u = SlotTable::new(g.max_slots);
        let mut p = Persist::load_trusting(&dev, region, &g, &u, 3, false, CheckpointsNow::NotCompared).0.unwrap();
        let (both, mark) = (p.sb_both, p.unclean_first);
        assert!(mark, "a clean state loaded untrusted is marked in use by the first cycle");
        let _ = dev.take_log();
        let r = p.cycle(&dev, &u, &Counters::default(), false, true).unwrap().unwrap();
        let written: u64 = dev.take_log().iter().map(|op| if let MemOp::Write { len, .. } = op { *len } else { 0 }).sum();
        dev.set_fail_reads(None);
        let sb = Persist::read_superblock(&dev, region).unwrap();
        // The mark: the clean copy that reads, then the one that does not, or the other copy.
        let marks = if unreadable.is_some() { 2 } else { 1 };
        let want = (r.pages + if both { 2 } else { 1 } + marks) * 4096;
        assert!(
            (r.bytes, sb.counters.own_bytes, written) == (want, want, want),
            "{unreadable:?}: both {both}, mark {mark}: reported {}, saved {}, written {written}, want {want}",
            r.bytes,
            sb.counters.own_bytes
        );
    }
}

/// Marking in use where one superblock copy does not read: that copy gets the mark (it may be
/// the newest clean one), so no later load trusts the state, whichever copy it reads.
#[test]
fn marking_in_use_writes_the_mark_into_a_superblock_copy_that_does_not_read() {
    for bad in 0..2u64 {
        let (g, region, dev) = three_saved_cycles();
        dev.set_fail_reads(Some(bad * 4096..(bad + 1) * 4096));
        assert!(Persist::mark_in_use(&dev, region, 3).unwrap().is_some(), "copy {bad}");
        dev.set_fail_reads(None);
        let (_, _, l, _) = load(&g, dev.image(), region);
        assert!(l.found && !l.clean, "copy {bad}: {l:?}");
    }
    // Neither copy reads: each gets a block that keeps only the magic (a write may remap a
    // bad sector), so that no later load trusts the state, nor takes the region for unused.
    let (g, region, dev) = three_saved_cycles();
    let before = dev.image();
    dev.set_fail_reads(Some(0..8192));
    assert_eq!(Persist::mark_in_use(&dev, region, 3).unwrap(), None);
    dev.set_fail_reads(None);
    let after = dev.image();
    for c in 0..2 {
        assert!(after[c * 4096..][..8] == *SB_MAGIC && after[c * 4096 + 8..(c + 1) * 4096].iter().all(|&x| x == 0), "copy {c}");
    }
    assert!(after[8192..] == before[8192..], "only the superblocks are touched");
    let (_, _, l, _) = load(&g, after, region);
    assert!(!l.found && !l.clean && !l.none_saved, "{l:?}");
    // Nor written: an error.
    let (_, region, dev) = three_saved_cycles();
    dev.set_fail_reads(Some(0..8192));
    dev.set_fail_writes(true);
    let e = Persist::mark_in_use(&dev, region, 3).unwrap_err().to_string();
    assert!(e.contains("neither superblock copy reads") && e.contains("nor could be written again"), "{e}");
}

/// The same, where the old clean superblock's seq is above every page's (cycles that changed
/// nothing write only a superblock) and the new state's first cycle gets only its first
/// superblock copy out before a crash: that copy must still outrank the old clean one, whose
/// confirmations a load would otherwise trust.
#[test]
fn a_replacing_superblock_outranks_the_old_clean_one_after_a_crash_between_the_copies() {
    let (g, region, dev) = three_saved_cycles();
    let t = SlotTable::new(g.max_slots);
    let mut p = Persist::load(&dev, region, &g, &t, 3).0.unwrap();
    for _ in 0..3 {
        p.cycle(&dev, &t, &Counters::default(), true, true).unwrap().unwrap();
    }
    let old = dev.image();
    assert!(load(&g, old.clone(), region).2.clean);
    dev.set_fail_reads(Some(0..8192));
    let u = SlotTable::new(g.max_slots);
    let (p2, l) = Persist::load(&dev, region, &g, &u, 3);
    assert!(!l.found);
    dev.set_fail_reads(None);
    p2.unwrap().cycle(&dev, &u, &Counters::default(), false, true).unwrap().unwrap();
    // The crash: superblock copy 1 still holds the old clean state.
    let mut img = dev.image();
    img[4096..8192].copy_from_slice(&old[4096..8192]);
    let (_, _, l, _) = load(&g, img, region);
    assert!(!l.clean, "the old clean state won the load: {l:?}");
}

/// A superblock that is there but does not decode (a newer fdpblk's version, or both copies
/// torn) is a state that could not be read: not "no fdpblk ever saved here", which would let
/// the watcher take every slot no checkpoint lists for unwritten.
#[test]
fn superblocks_of_another_version_or_torn_are_not_taken_for_a_never_used_device() {
    let (g, region, dev) = three_saved_cycles();
    // A newer version, with its CRC right.
    let mut img = dev.image();
    for c in 0..2 {
        let b = &mut img[c * 4096..(c + 1) * 4096];
        b[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        // Above every page's seq, so that only the superblocks' seqs can put the next above.
        b[16..24].copy_from_slice(&(1000 + c as u64).to_le_bytes());
        let crc = crc32fast::hash(&b[..CRC_AT]);
        b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }
    let (u, p, l, mem) = load(&g, img.clone(), region);
    assert!(!l.found && !l.none_saved, "{l:?}");
    assert!(l.note.as_deref().is_some_and(|n| n.contains(&format!("format {}, a newer fdpblk's", VERSION + 1))), "{:?}", l.note);
    // The fresh state's first superblock replaces both copies, above their seq: neither is
    // left for that version to take as its own newest (and clean) state.
    let newer_seq = [0usize, 1].map(|c| u64::from_le_bytes(img[c * 4096 + 16..c * 4096 + 24].try_into().unwrap()));
    p.unwrap().cycle(&*mem, &u, &Counters::default(), false, true).unwrap().unwrap();
    let after = mem.image();
    for c in 0..2 {
        let sb = Superblock::decode(&after[c * 4096..(c + 1) * 4096]);
        assert!(sb.as_ref().is_some_and(|s| s.seq > newer_seq[c]), "copy {c}: {sb:?} (the other version's seq {})", newer_seq[c]);
    }
    // Marking in use, as a device that learns its layout does before it serves: that
    // version's clean superblocks no longer pass their CRC, so they vouch for no stop; their
    // magic stays, so the region is still not taken for one no fdpblk ever used.
    let dev2 = MemDev::new(0);
    dev2.set_image(img.clone());
    assert!(Persist::mark_in_use(&dev2, region, 3).unwrap().is_none());
    let after = dev2.image();
    for c in 0..2 {
        let b = &after[c * 4096..(c + 1) * 4096];
        assert!(&b[..8] == SB_MAGIC && crc32fast::hash(&b[..CRC_AT]) != u32at(b, CRC_AT), "copy {c} is still whole");
    }
    assert!(after[8192..] == img[8192..], "only the superblocks are touched");
    let (_, _, l, _) = load(&g, after, region);
    assert!(!l.found && !l.none_saved, "{l:?}");
    // Both copies torn (a byte changed in each).
    let mut img = dev.image();
    img[100] ^= 1;
    img[4096 + 100] ^= 1;
    let (_, _, l, _) = load(&g, img, region);
    assert!(!l.found && !l.none_saved && l.note.is_some(), "{l:?}");
    // A blank region is still a device no fdpblk used.
    let (_, _, l, _) = load(&g, vec![0; region.len as usize], region);
    assert!(l.none_saved && l.note.is_none());
}

/// A clean state in one superblock copy, and in the other a later, whole one that does not
/// decode (a crashed run of another version; a seq past the bound): the clean one does not
/// vouch for the stop, and the next superblock goes into both copies. A torn one (its CRC
/// fails) is an unfinished cycle's and claims nothing (`crash_at_every_write_boundary_…`).
#[test]
fn a_newer_superblock_that_does_not_decode_makes_a_clean_state_untrusted() {
    let (g, region, dev) = three_saved_cycles();
    let img = dev.image();
    assert!(load(&g, img.clone(), region).2.clean);
    let sbs = [0usize, 1].map(|c| Superblock::decode(&img[c * 4096..(c + 1) * 4096]).unwrap());
    let (newest, other) = if sbs[0].seq > sbs[1].seq { (0, 1) } else { (1, 0) };
    let newer = |version: u32, seq: u64, keep_crc: bool| {
        let mut img = img.clone();
        let src = img[newest * 4096..(newest + 1) * 4096].to_vec();
        let b = &mut img[other * 4096..(other + 1) * 4096];
        b.copy_from_slice(&src);
        b[8..12].copy_from_slice(&version.to_le_bytes());
        b[12..16].copy_from_slice(&0u32.to_le_bytes());
        b[16..24].copy_from_slice(&seq.to_le_bytes());
        if keep_crc {
            let crc = crc32fast::hash(&b[..CRC_AT]);
            b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        }
        img
    };
    let seq = sbs[newest].seq;
    for (img, what) in [(newer(VERSION + 1, seq + 1, true), "another version"), (newer(VERSION, MAX_SEQ, true), "a seq past the bound")] {
        let (u, p, l, mem) = load(&g, img, region);
        assert!(l.found && !l.clean, "{what}: {l:?}");
        assert!(l.note.as_deref().is_some_and(|n| n.contains("claims seq ")), "{what}: {:?}", l.note);
        // The next superblock replaces both copies: the claim is gone.
        p.unwrap().cycle(&*mem, &u, &Counters::default(), true, true).unwrap().unwrap();
        let after = mem.image();
        assert!([0usize, 1].iter().all(|&c| Superblock::decode(&after[c * 4096..(c + 1) * 4096]).is_some()), "{what}");
        assert!(load(&g, after, region).2.clean, "{what}: clean again after a clean cycle");
    }
    // An older copy that does not decode claims nothing over the newest, nor does a torn one.
    for img in [newer(VERSION + 1, seq - 1, true), newer(VERSION, seq + 1, false)] {
        let (_, _, l, _) = load(&g, img, region);
        assert!(l.found && l.clean, "{l:?}");
    }
}

#[test]
fn state_present_looks_for_a_superblock_magic_in_the_reserved_tail() {
    let size = 16u64 << 20;
    let tail = Region::tail(size);
    let mut img = vec![0u8; size as usize];
    assert!(!state_present(&img, size));
    img[tail.offset as usize + 4096..][..8].copy_from_slice(b"FDPBSB01");
    assert!(state_present(&img, size), "the second copy's magic counts");
    img[tail.offset as usize + 4096] = 0;
    img[tail.offset as usize - 4096..][..8].copy_from_slice(b"FDPBSB01");
    assert!(!state_present(&img, size), "only the reserved tail counts");
}

/// A whole superblock of a later format, under the magic's later names too, is a newer
/// fdpblk's state; a torn one, this format's, or one outside the reserved tail is not.
#[test]
fn newer_format_finds_a_whole_superblock_of_a_later_format_in_the_tail() {
    let size = 16u64 << 20;
    let tail = Region::tail(size).offset as usize;
    let mut img = vec![0u8; size as usize];
    let put = |img: &mut Vec<u8>, at: usize, magic: &[u8; 8], version: u32| {
        let b = &mut img[at..at + 4096];
        b.fill(0);
        b[..8].copy_from_slice(magic);
        b[8..12].copy_from_slice(&version.to_le_bytes());
        let crc = crc32fast::hash(&b[..CRC_AT]);
        b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    };
    assert_eq!(newer_format(&img, size), None, "blank");
    put(&mut img, tail, b"FDPBSB01", VERSION);
    assert_eq!(newer_format(&img, size), None, "this format's");
    put(&mut img, tail + 4096, b"FDPBSB01", VERSION + 1);
    assert_eq!(newer_format(&img, size), Some(VERSION + 1), "copy 1 of a later format");
    img[tail + 4096 + 100] ^= 1;
    assert_eq!(newer_format(&img, size), None, "torn: damage, not a format");
    put(&mut img, tail, b"FDPBSB02", VERSION + 2);
    assert_eq!(newer_format(&img, size), Some(VERSION + 2), "a later magic");
    assert!(state_present(&img, size), "a later magic is a state too");
    img[tail..tail + 4096].fill(0);
    img[tail + 4096..tail + 8192].fill(0);
    put(&mut img, tail - 4096, b"FDPBSB01", VERSION + 1);
    assert_eq!(newer_format(&img, size), None, "only the reserved tail counts");
}

/// A page that reads in the first pass but not when it is restored is said, not dropped in
/// silence; its records start empty (which only forgets), the rest is restored.
#[test]
fn a_page_that_fails_its_second_read_is_noted() {
    let (g, t, region, dev, mut p) = blank_state(300);
    let far = RECORDS_PER_PAGE + 1; // on the second record page
    t.record_header(3, &SlotHeader { identity: 9, payload_len: 9 }, 1);
    t.record_header(far, &SlotHeader { identity: 8, payload_len: 9 }, 1);
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    let page0 = p.page_off(0, p.current[0]);
    // The single-page reads of that page (the first pass reads runs of pages).
    let bad = FailReads { dev: &dev, fails: |off, end| off == page0 && end - off == 4096 };
    let u = SlotTable::new(g.max_slots);
    let (p2, l) = Persist::load(&bad, region, &g, &u, 3);
    assert!(l.found, "{l:?}");
    assert!(l.note.as_deref().is_some_and(|n| n.contains("1 page(s)")), "{l:?}");
    assert!(u.get(3).is_none(), "the page that failed starts empty");
    assert_eq!(u.get(far).unwrap().identity, 8, "the others are restored");
    // The first cycle commits that page empty, so its old copy does not come back with a
    // later load (here, a clean stop with nothing else changed).
    p2.unwrap().cycle(&bad, &u, &Counters::default(), true, true).unwrap().unwrap();
    let (v, _, l, _) = load(&g, dev.image(), region);
    assert!(l.found && l.clean);
    assert!(v.get(3).is_none(), "the lost page's old records came back");
    assert_eq!(v.get(far).unwrap().identity, 8);
}

/// Pages that read in the first pass and then all fail: past `MAX_UNREAD` lost pages the
/// rest are not tried (each failed read may take the drive's error recovery, seconds); they
/// start empty too.
#[test]
fn pages_that_all_fail_their_second_read_are_tried_a_bounded_number_of_times() {
    let pages = 3 * MAX_UNREAD as u64;
    let (g, t, region, dev, mut p) = blank_state(pages * RECORDS_PER_PAGE);
    for i in 0..pages {
        t.record_header(i * RECORDS_PER_PAGE, &SlotHeader { identity: 9 + i, payload_len: 9 }, 1);
    }
    p.cycle(&dev, &t, &Counters::default(), true, true).unwrap();
    // Every single-page read (the first pass reads runs of pages), counted.
    let failed = std::sync::atomic::AtomicU64::new(0);
    let bad = FailReads {
        dev: &dev,
        fails: |off, end| {
            let page = end - off == 4096;
            if page {
                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            page
        },
    };
    let u = SlotTable::new(g.max_slots);
    let (_, l) = Persist::load(&bad, region, &g, &u, 3);
    assert!(l.found, "{l:?}");
    let failed = failed.load(std::sync::atomic::Ordering::Relaxed);
    assert!(failed <= 2 * MAX_UNREAD as u64, "{failed} failed reads");
    assert!(l.note.as_deref().is_some_and(|n| n.contains(&format!("{pages} page(s)"))), "every page with records is lost: {l:?}");
    assert!((0..pages).all(|i| u.get(i * RECORDS_PER_PAGE).is_none()));
}

/// What is read from the device may be hostile past its checksums: pages and superblocks
/// with random contents and valid CRCs (records, history, tag streams, layout and geometry
/// fields, a handle count of 65535) load and summarise without a panic.
#[test]
fn hostile_state_that_passes_its_crcs_never_panics() {
    let g = geom(600);
    let size = (64 << 20) + 12345 * 4096;
    let region = Region::tail(size);
    let dev = MemDev::new(size);
    let t = SlotTable::new(g.max_slots);
    let mut p = Persist::load(&dev, region, &g, &t, 3).0.unwrap();
    let mut rng = Rng(2024);
    mutate(&t, &mut rng, 400);
    p.cycle(&dev, &t, &Counters { trims_by_handle: vec![1, 2, 3], ..Counters::default() }, true, true).unwrap();
    let base = dev.image();
    let pages = p.layout().pages();
    let reseal = |b: &mut [u8]| {
        let crc = crc32fast::hash(&b[..CRC_AT]);
        b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    };
    for round in 0..120u64 {
        let mut img = base.clone();
        for _ in 0..1 + rng.below(8) {
            let (copy, idx) = (rng.below(2), rng.below(pages));
            let off = (region.offset + 2 * BLOCK + (copy * pages + idx) * BLOCK) as usize;
            let b = &mut img[off..off + BLOCK as usize];
            for byte in &mut b[PAGE_HEADER..CRC_AT] {
                if round % 2 == 0 || rng.below(16) == 0 {
                    *byte = rng.draw() as u8;
                }
            }
            // Tag streams: names without their terminator, or runs of 0xff (not UTF-8).
            if round % 5 == 0 {
                b[PAGE_HEADER..CRC_AT].fill(if round % 10 == 0 { 0xff } else { b'a' });
            }
            reseal(b);
        }
        if round % 3 == 0 {
            for copy in 0..2 {
                let off = (region.offset + copy * BLOCK) as usize;
                let b = &mut img[off..off + BLOCK as usize];
                for _ in 0..1 + rng.below(6) {
                    let i = 12 + rng.below((CRC_AT - 12) as u64) as usize;
                    b[i] = rng.draw() as u8;
                }
                if round % 6 == 0 {
                    b[128..130].copy_from_slice(&u16::MAX.to_le_bytes());
                }
                reseal(b);
            }
        }
        let _ = summary(&img, size);
        let d = MemDev::new(0);
        d.set_image(img);
        let u = SlotTable::new(g.max_slots);
        let _ = Persist::load(&d, region, &g, &u, 3);
    }
}

/// `inspect` refuses a saved table past half the memory before allocating it.
#[test]
fn a_table_past_half_the_memory_is_not_read() {
    let e = table_memory_error("its geometry", 1 << 28, 16 << 30).unwrap();
    assert!(e.starts_with("its geometry needs a slot table of 9.3 GiB") && e.contains("16.0 GiB"), "{e}");
    assert_eq!(table_memory_error("g", 1 << 28, 32 << 30), None);
    assert_eq!(table_memory_error("g", 2 << 20, 1 << 30), None, "2 M slots: 74 MiB");
}
