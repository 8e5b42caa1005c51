//! Tests with regular files as devices: the writer's images read back through fdpblk's own
//! inspector, the allocator and checkpoint rules, and a byte-level cross-check against the
//! images and I/O traces that the real LMCache 0.5.6 wrote (`../shared/fixtures`).

use super::*;
use crate::dev::LoggedWrite;
use crate::model::{CheckpointOutcome, Class, PutItem};
use fdpblk::cmd::inspect::inspect_entries;
use fdpblk::layout::checkpoint::{newest_valid, read_copies};
use fdpblk::layout::checkpoint_header::CheckpointHeader as CheckpointHeaderBytes;
use fdpblk::layout::Geometry;
use serde_json::Value;
use std::path::PathBuf;

/// A pre-sized scratch file, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str, size: u64) -> Scratch {
        let p = std::env::temp_dir().join(format!("rawblock-writer-test-{}-{name}", std::process::id()));
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(size).unwrap();
        Scratch(p)
    }
    fn from_bytes(name: &str, bytes: &[u8]) -> Scratch {
        let s = Scratch::new(name, 0);
        std::fs::write(&s.0, bytes).unwrap();
        s
    }
    fn bytes(&self) -> Vec<u8> {
        std::fs::read(&self.0).unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn opts(dtype: Dtype, path: &str) -> Options {
    Options {
        namespace: model::Namespace::Object,
        seed: 7,
        device_path: path.to_string(),
        model: "meta-llama/Llama-3.1-8B-Instruct".into(),
        kv_rank: 0x0100_0100,
        object_group_id: 0,
        dtype,
        layers: 4,
        hidden: 64,
        partial_every: 3,
        payload_bytes: None,
    }
}

fn geom(slot: u64, meta: u64, size: u64) -> Geometry {
    GeometryConfig {
        block_align: 4096,
        header_bytes: 4096,
        slot_bytes: slot,
        meta_total_bytes: meta,
        capacity_bytes: 0,
    }
    .validate(size)
    .unwrap()
}

/// Opens `path` for `engine`; None (with a note) when this kernel refuses io_uring.
fn open(path: &std::path::Path, engine: Engine) -> Option<Device> {
    match Device::open(path, engine, false, 4096) {
        Ok(d) => Some(d),
        Err(e) if engine == Engine::IoUring => {
            io_uring_missing(&e.to_string());
            eprintln!("note: io_uring unavailable here ({e}); io_uring part not run");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn put(w: &mut Writer, d: &mut Device, n: u64) {
    let items = w.plan_new(n, None, None, None).unwrap();
    w.put_many(d, items).unwrap();
}

fn slots_of(w: &Writer) -> Vec<u64> {
    w.entries().map(|e| e.slot).collect()
}

#[test]
fn script_parsing() {
    let t = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    let c = parse_script(&t("put 50 --salt tenantA:alice --payload-bytes 60K checkpoint delete 10 --random reput 2 --live put 3 --batch 2 --partial-every=2 --workers 2 --with-checkpoint load 4 --random --workers=4 verify reopen sync stats")).unwrap();
    assert_eq!(
        c,
        vec![
            Cmd::Put {
                n: 50,
                salt: Some("tenantA:alice".into()),
                payload_bytes: Some(61440),
                partial_every: None,
                batch: None,
                workers: 1,
                checkpoint: false
            },
            Cmd::Checkpoint,
            Cmd::Delete { n: 10, random: true },
            Cmd::Reput { n: 2, live: true, payload_bytes: None, partial_every: None, batch: None, workers: 1, checkpoint: false },
            Cmd::Put { n: 3, salt: None, payload_bytes: None, partial_every: Some(2), batch: Some(2), workers: 2, checkpoint: true },
            Cmd::Load { n: 4, random: true, workers: 4 },
            Cmd::Verify,
            Cmd::Reopen,
            Cmd::Sync,
            Cmd::Stats,
        ]
    );
    for bad in [
        "put",
        "put x",
        "put 3 --salt",
        "put 3 --live",
        "delete 2 --salt a",
        "frobnicate",
        "verify --x",
        "put 2 --batch 0",
        "put 1 --payload-bytes 1Q",
        "put 2 --workers 0",
        "put 2 --workers 65",
        "load",
        "load 2 --salt a",
        "load 2 --workers",
    ] {
        let e = parse_script(&t(bad)).unwrap_err();
        assert!(!e.is_empty() && !e.contains('\n'), "{bad}: {e}");
    }
}

#[test]
fn keys_are_lmcache_object_keys() {
    let mut w = Writer::new(geom(65536, 1 << 20, 4 << 20), opts(Dtype::Bf16, "/dev/ublkb0"));
    let k = w.new_key(Some("tenantA:alice"));
    let parts: Vec<&str> = k.split('@').collect();
    assert_eq!(parts[..3], ["meta-llama%2FLlama-3.1-8B-Instruct", "0x01000100", "0"]);
    assert_eq!(parts[3].len(), 64);
    assert_eq!(parts[4], "tenantA:alice");
    // fdpblk parses it as an object key, and its identity is the BLAKE2b-8 one.
    assert_eq!(fdpblk::layout::keys::identity(&k).unwrap(), fdpblk::layout::keys::object_identity(&k));
    assert_ne!(w.new_key(None), k);
    assert!(model::check_salt("a/b").is_err());
    assert_eq!(model::quote("a b/é~"), "a%20b%2F%C3%A9~");
    let mut s = String::new();
    model::py_str("x\"\\\n\u{7f}é😀", &mut s);
    assert_eq!(s, r#""x\"\\\n\u007f\u00e9\ud83d\ude00""#);
}

/// put / delete / put / checkpoint: fdpblk's inspector sees exactly the writer's live
/// entries, every slot header matching; verify and reopen agree. Both engines.
#[test]
fn image_reads_back_in_fdpblk_inspect() {
    for engine in [Engine::Posix, Engine::IoUring] {
        let size = 4 << 20;
        let f = Scratch::new(&format!("inspect-{}", engine.name()), size);
        let Some(mut d) = open(&f.0, engine) else { continue };
        let g = geom(65536, 1 << 20, size);
        for dtype in [Dtype::Bf16, Dtype::U8] {
            let mut w = Writer::new(g, opts(dtype, "/dev/ublkb0"));
            put(&mut w, &mut d, 20);
            let doomed = w.pick_keys(6, true).unwrap();
            assert_eq!(w.delete_keys(&doomed), 6);
            put(&mut w, &mut d, 9);
            assert!(matches!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Written { seq: 1, copy: 0, .. }));
            assert_eq!(w.live(), 23);
            assert_eq!(w.next_slot, 23);
            // Some payloads are partial, as asked (every 3rd).
            assert!(w.entries().any(|e| e.size < g.slot_payload_capacity()));
            let img = f.bytes();
            let copies = read_copies(&img, &g).unwrap();
            let mut got = Vec::new();
            let s = inspect_entries(&img, &g, &copies, false, &mut |r| {
                got.push(r.clone());
                Ok(())
            })
            .unwrap();
            assert_eq!(s.checkpoint_seq, Some(1));
            assert_eq!(s.header_mismatch, 0);
            let want: Vec<(String, u64, u64)> = w.entries().map(|e| (e.key.clone(), e.slot, e.size)).collect();
            let seen: Vec<(String, u64, u64)> =
                got.iter().map(|r| (r.key.clone(), r.slot.unwrap(), r.size.unwrap())).collect();
            assert_eq!(seen, want);
            assert!(got.iter().all(|r| r.header_ok && r.offset == Some(g.slot_offset(r.slot.unwrap()))));
            assert_eq!(w.verify(&mut d).unwrap(), (23, 0));
            let r = w.reopen(&mut d).unwrap();
            assert_eq!((r.seq, r.recovered, r.dropped, r.matches_previous), (Some(1), 23, 0, true));
            assert_eq!(w.verify(&mut d).unwrap(), (23, 0));
            // Fresh writer (no history): reopen still verifies, inferring the content.
            let mut fresh = Writer::new(g, opts(dtype, "/dev/ublkb0"));
            fresh.reopen(&mut d).unwrap();
            assert_eq!(fresh.verify(&mut d).unwrap(), (23, 23));
            // Corrupt one payload byte: verify names it.
            let e = w.entries().next().unwrap().clone();
            let file = std::fs::OpenOptions::new().write(true).open(&f.0).unwrap();
            std::os::unix::fs::FileExt::write_at(
                &file,
                &[0xAA ^ img[(g.slot_offset(e.slot) + 4096 + 5) as usize]],
                g.slot_offset(e.slot) + 4096 + 5,
            )
            .unwrap();
            let err = w.verify(&mut d).unwrap_err();
            assert!(err.contains("1 of 23") && err.contains("payload byte 5"), "{err}");
            std::fs::write(&f.0, vec![0u8; size as usize]).unwrap();
        }
    }
}

#[test]
fn freed_slots_are_reused_lifo() {
    let size = 4 << 20;
    let f = Scratch::new("lifo", size);
    let mut d = open(&f.0, Engine::Posix).unwrap();
    let mut w = Writer::new(geom(65536, 1 << 20, size), opts(Dtype::U8, "/dev/ublkb0"));
    put(&mut w, &mut d, 10);
    assert_eq!(slots_of(&w), (0..10).collect::<Vec<_>>());
    let key_at = |w: &Writer, s: u64| w.entries().find(|e| e.slot == s).unwrap().key.clone();
    let doomed: Vec<String> = [3, 7, 1].iter().map(|&s| key_at(&w, s)).collect();
    w.delete_keys(&doomed);
    assert_eq!(w.free_slots(), &[3, 7, 1]);
    put(&mut w, &mut d, 2);
    assert_eq!(slots_of(&w)[7..], [1, 7]);
    put(&mut w, &mut d, 2);
    assert_eq!(slots_of(&w)[9..], [3, 10], "the free set is empty, then the bump pointer");
    // Deleting nothing that exists writes and frees nothing.
    assert_eq!(w.delete_keys(&["nope".to_string()]), 0);
    // A re-put of a deleted key gets new content (generation 1) in the next LIFO slot.
    let k = key_at(&w, 5);
    w.delete_keys(std::slice::from_ref(&k));
    let items = w.plan_reput(1, false, Some(1000), Some(0)).unwrap();
    assert_eq!(items[0].key, k);
    w.put_many(&mut d, items).unwrap();
    let e = w.entry(&k).unwrap();
    assert_eq!((e.slot, e.size, e.gen), (5, 1000, Some(1)));
    // Re-putting an indexed key is a no-op without I/O.
    let before = f.bytes();
    let items = w.plan_reput(2, true, None, None).unwrap();
    w.put_many(&mut d, items).unwrap();
    assert_eq!(w.run.puts_noop, 2);
    assert_eq!(f.bytes(), before);
    w.verify(&mut d).unwrap();
    // After recovery the free set is ascending: the highest hole is reused first.
    let doomed: Vec<String> = [2, 8, 4].iter().map(|&s| key_at(&w, s)).collect();
    w.delete_keys(&doomed);
    w.checkpoint(&mut d).unwrap();
    assert_eq!(w.free_slots(), &[2, 8, 4]);
    w.reopen(&mut d).unwrap();
    assert_eq!(w.free_slots(), &[2, 4, 8]);
    put(&mut w, &mut d, 1);
    assert_eq!(*slots_of(&w).last().unwrap(), 8);
}

#[test]
fn checkpoints_alternate_containers_and_order_their_writes() {
    for engine in [Engine::Posix, Engine::IoUring] {
        let size = 4 << 20;
        let f = Scratch::new(&format!("alternate-{}", engine.name()), size);
        let Some(mut d) = open(&f.0, engine) else { continue };
        let g = geom(65536, 1 << 20, size);
        let mut w = Writer::new(g, opts(Dtype::Bf16, "/dev/ublkb0"));
        assert_eq!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Clean, "nothing dirty on a fresh index");
        for (round, want_copy) in [(1u64, 0u8), (2, 1), (3, 0), (4, 1)] {
            put(&mut w, &mut d, 2);
            d.log = Some(Vec::new());
            let out = w.checkpoint(&mut d).unwrap();
            let CheckpointOutcome::Written { seq, copy, payload_len } = out else { panic!("{out:?}") };
            assert_eq!((seq, copy), (round, want_copy));
            let c = g.container_offset(copy);
            let padded = payload_len.div_ceil(4096) * 4096;
            let log = d.log.take().unwrap();
            let shape: Vec<(u64, u64)> = log.iter().map(|l| (l.offset, l.len)).collect();
            assert_eq!(shape, [(c + 4096, padded), (c, 4096)], "payload first, then the header block");
            match engine {
                Engine::Posix => assert!(log.iter().all(|l| l.batch.is_none())),
                Engine::IoUring => {
                    assert!(log[0].batch.is_some() && log[0].batch.map(|b| b.0) == log[1].batch.map(|b| b.0))
                }
            }
            assert_eq!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Clean);
            let img = f.bytes();
            let copies = read_copies(&img, &g).unwrap();
            assert_eq!(newest_valid(&copies).unwrap().seq(), Some(round));
            assert_eq!(copies[copy as usize].seq(), Some(round));
            if round > 1 {
                assert_eq!(copies[1 - copy as usize].seq(), Some(round - 1), "the older copy stays");
            }
            // The payload's padding is zero.
            let end = (c + 4096 + payload_len) as usize;
            assert!(img[end..(c + 4096 + padded) as usize].iter().all(|&b| b == 0));
        }
        assert_eq!(w.run.checkpoints_written, 4);
        assert_eq!(w.run.writes[Class::CheckpointHeader as usize], 4);
        assert_eq!(w.run.bytes[Class::CheckpointHeader as usize], 4 * 4096);
    }
}

#[test]
fn put_batches_have_lmcache_shapes() {
    let size = 16 << 20;
    for (engine, odirect) in
        [(Engine::Posix, false), (Engine::Posix, true), (Engine::IoUring, false), (Engine::IoUring, true)]
    {
        let f = Scratch::new(&format!("shapes-{}-{odirect}", engine.name()), size);
        let Some(mut d) = open(&f.0, engine) else { continue };
        d.odirect = odirect; // write shapes only; the scratch file is opened buffered
        let g = geom(65536, 1 << 20, size);
        let mut w = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
        d.log = Some(Vec::new());
        // 70 keys in one put_many: io_uring makes a batch of 64 keys and one of 6.
        let mut items = w.plan_new(70, None, None, Some(0)).unwrap();
        items[1].size = 8181;
        items[2].size = 100;
        w.put_many(&mut d, items).unwrap();
        let log = d.log.take().unwrap();
        let s0 = g.slot_offset(0);
        let s1 = g.slot_offset(1);
        let s2 = g.slot_offset(2);
        let first: Vec<(u64, u64)> = log.iter().take(7).map(|l| (l.offset, l.len)).collect();
        match (engine, odirect) {
            (Engine::Posix, false) | (Engine::IoUring, false) => {
                assert_eq!(
                    first[..6],
                    [(s0, 4096), (s0 + 4096, 61440), (s1, 4096), (s1 + 4096, 8181), (s2, 4096), (s2 + 4096, 100)]
                )
            }
            (Engine::Posix, true) => assert_eq!(
                first,
                [
                    (s0, 4096),
                    (s0 + 4096, 61440),
                    (s1, 4096),
                    (s1 + 4096, 4096),
                    (s1 + 8192, 4096),
                    (s2, 4096),
                    (s2 + 4096, 4096)
                ]
            ),
            (Engine::IoUring, true) => {
                assert_eq!(
                    first[..6],
                    [(s0, 4096), (s0 + 4096, 61440), (s1, 4096), (s1 + 4096, 8192), (s2, 4096), (s2 + 4096, 4096)]
                )
            }
        }
        if engine == Engine::IoUring {
            let batches: Vec<(u64, usize)> = log.iter().map(|l| l.batch.unwrap()).collect();
            let sizes = batches.iter().fold(Vec::<usize>::new(), |mut v, b| {
                if b.1 == 0 {
                    v.push(0);
                }
                *v.last_mut().unwrap() += 1;
                v
            });
            assert_eq!(sizes, [128, 12]);
        } else {
            assert!(log.iter().all(|l| l.batch.is_none()));
        }
        let c = &w.run;
        assert_eq!(c.writes[Class::SlotHeader as usize], 70);
        assert_eq!(c.bytes[Class::SlotHeader as usize], 70 * 4096);
        let want_pay: u64 = if odirect { 68 * 61440 + 8192 + 4096 } else { 68 * 61440 + 8181 + 100 };
        assert_eq!(c.bytes[Class::SlotPayload as usize], want_pay);
        assert_eq!(c.device_bytes[Class::SlotPayload as usize], 68 * 61440 + 8192 + 4096);
    }
}

/// `put --with-checkpoint`: the checkpoint is snapshotted before the puts and written beside
/// them on a thread of its own. It lists the keys before the puts, not the puts (still dirty
/// afterwards); a reopen loads what it lists, and the next checkpoint lists the puts too.
#[test]
fn a_checkpoint_written_beside_puts_lists_what_came_before_them() {
    let size = 16 << 20;
    for engine in [Engine::Posix, Engine::IoUring] {
        let f = Scratch::new(&format!("beside-{}", engine.name()), size);
        let Some(mut d) = open(&f.0, engine) else { continue };
        let g = geom(65536, 1 << 20, size);
        let mut w = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
        let before = w.plan_new(10, None, None, None).unwrap();
        w.put_many(&mut d, before).unwrap();
        d.log = Some(Vec::new());
        let mut items = w.plan_new(40, None, None, Some(3)).unwrap();
        let calls: Vec<Vec<_>> = vec![items.drain(..20).collect(), items];
        let out = w.put_concurrent_with_checkpoint(&mut d, calls, 2).unwrap();
        assert!(matches!(out, CheckpointOutcome::Written { seq: 1, copy: 0, .. }), "{out:?}");
        assert_eq!((w.live(), w.seq), (50, 1));
        assert!(w.is_dirty(), "the puts came after the snapshot");
        // The checkpoint's writes and the puts' went out together, from threads of their own.
        let log = d.log.take().unwrap();
        assert!(log.iter().any(|l| l.offset == g.container_offset(0)), "the header block was written");
        assert_eq!(log.iter().filter(|l| l.offset >= g.slot_offset(10) && (l.offset - g.slot_offset(0)).is_multiple_of(65536)).count(), 40);
        assert_eq!(w.run.checkpoints_written, 1);
        let mut r = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
        assert_eq!(r.reopen(&mut d).unwrap().recovered, 10);
        assert!(matches!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Written { seq: 2, .. }));
        let mut r = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
        assert_eq!(r.reopen(&mut d).unwrap().recovered, 50);
        assert_eq!(r.verify(&mut d).unwrap().0, 50);
        // Nothing changed since: the put goes alone and says so.
        let one = w.plan_new(1, None, None, None).unwrap();
        w.checkpoint(&mut d).unwrap();
        assert!(matches!(w.put_concurrent_with_checkpoint(&mut d, vec![one], 1).unwrap(), CheckpointOutcome::Clean));
        assert_eq!(w.live(), 51);
        // More puts than free slots: none is written, but the checkpoint is, and it is booked.
        let too_many = w.plan_new(g.max_slots, None, None, None).unwrap();
        let err = w.put_concurrent_with_checkpoint(&mut d, vec![too_many], 2).unwrap_err();
        assert!(err.contains("no free slot"), "{err}");
        assert_eq!((w.live(), w.seq), (51, 3), "seq 2 was the last written");
        let mut r = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
        assert_eq!(r.reopen(&mut d).unwrap().recovered, 51);
    }
}

#[test]
fn store_and_load_workers_run_at_once_and_write_what_they_put() {
    let size = 16 << 20;
    for engine in [Engine::Posix, Engine::IoUring] {
        let f = Scratch::new(&format!("workers-{}", engine.name()), size);
        let Some(mut d) = open(&f.0, engine) else { continue };
        let g = geom(65536, 1 << 20, size);
        let mut w = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
        d.log = Some(Vec::new());
        // Three store tasks of 50 keys (one partial in three) on two threads; one key twice.
        let mut items = w.plan_new(150, None, None, None).unwrap();
        let twice = items[7].clone();
        let calls: Vec<Vec<_>> = vec![items.drain(..50).collect(), items.drain(..50).chain([twice]).collect(), items];
        let keys: Vec<Vec<String>> = calls.iter().map(|c| c.iter().map(|i| i.key.clone()).collect()).collect();
        w.put_concurrent(&mut d, calls, 2).unwrap();
        assert_eq!((w.run.puts, w.run.puts_noop, w.live()), (150, 1, 150));
        // Slots go to the tasks in turn, key by key, as interleaved allocations would.
        for (c, ks) in keys.iter().enumerate() {
            for (k, key) in ks.iter().take(50).enumerate() {
                assert_eq!(w.entry(key).unwrap().slot, 3 * k as u64 + c as u64, "task {c} key {k}");
            }
        }
        let log = d.log.take().unwrap();
        assert_eq!(w.run.writes[Class::SlotHeader as usize], 150);
        assert_eq!(log.iter().filter(|l| (l.offset - g.slot_offset(0)).is_multiple_of(65536)).count(), 150);
        if engine == Engine::Posix {
            // Each thread writes a key's header before its payload.
            for s in 0..150 {
                let h = log.iter().position(|l| l.offset == g.slot_offset(s)).unwrap();
                let p = log.iter().position(|l| l.offset == g.slot_offset(s) + 4096).unwrap();
                assert!(h < p, "slot {s}");
            }
        } else {
            // A batch of at most 64 keys per chunk, per task: 50, 51 -> 50 (one no-op), 50.
            let batches: std::collections::BTreeSet<u64> = log.iter().map(|l| l.batch.unwrap().0).collect();
            assert_eq!(batches.len(), 3);
        }
        assert_eq!(w.verify(&mut d).unwrap().0, 150);
        // Loads on four threads: payload reads only, checked.
        let all = w.pick_keys(150, false).unwrap();
        assert_eq!(w.load(&mut d, &all, 4).unwrap(), 150);
        assert_eq!(w.run.loads, 150);
        // A changed payload byte is found by a load, which names the slot.
        let e = w.entry(&all[33]).unwrap().clone();
        let fw = std::fs::OpenOptions::new().write(true).open(&f.0).unwrap();
        std::os::unix::fs::FileExt::write_at(&fw, &[0xa5, 0x5a], g.slot_offset(e.slot) + 4096 + 10).unwrap();
        let err = w.load(&mut d, &all, 3).unwrap_err();
        assert!(err.contains(&format!("slot {}", e.slot)) && err.contains("1 of 150"), "{err}");
        // No slot left for a task: nothing is written or indexed, and the slots taken are free again.
        let avail = |w: &Writer| w.free_slots().len() as u64 + g.max_slots - w.next_slot;
        let before = (w.live(), avail(&w));
        let more = w.plan_new(g.max_slots, None, None, None).unwrap();
        let half = more.len() / 2;
        let mut more = more;
        let rest = more.split_off(half);
        let err = w.put_concurrent(&mut d, vec![more, rest], 2).unwrap_err();
        assert!(err.contains("no free slot"), "{err}");
        assert_eq!(w.live(), before.0);
        assert_eq!(avail(&w), before.1);
    }
}

#[test]
fn oversized_checkpoint_is_skipped_every_time() {
    let size = 4 << 20;
    let f = Scratch::new("skip", size);
    let mut d = open(&f.0, Engine::Posix).unwrap();
    // meta_total 16 KiB: containers of 8 KiB, so at most 4096 bytes of JSON.
    let g = geom(65536, 16384, size);
    assert_eq!(g.payload_cap(), 4096);
    let mut w = Writer::new(g, opts(Dtype::Bf16, "/dev/ublkb0"));
    put(&mut w, &mut d, 30);
    assert!(w.snapshot_json().len() > 4096);
    for _ in 0..2 {
        assert!(matches!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Skipped { cap: 4096, .. }));
    }
    assert_eq!((w.run.checkpoints_skipped, w.run.checkpoints_written, w.seq), (2, 0, 0));
    assert!(w.is_dirty());
    assert!(f.bytes()[..16384].iter().all(|&b| b == 0), "nothing written to the metadata region");
    assert_eq!(w.run.writes[Class::CheckpointHeader as usize] + w.run.writes[Class::CheckpointPayload as usize], 0);
    // Small enough again: seq 1 goes to container 0.
    let doomed = w.pick_keys(25, false).unwrap();
    w.delete_keys(&doomed);
    assert!(matches!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Written { seq: 1, copy: 0, .. }));
}

#[test]
fn state_round_trip_and_mismatches() {
    let size = 4 << 20;
    let f = Scratch::new("state", size);
    let mut d = open(&f.0, Engine::Posix).unwrap();
    let g = geom(65536, 1 << 20, size);
    let mut w = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
    put(&mut w, &mut d, 12);
    let doomed = w.pick_keys(4, true).unwrap();
    w.delete_keys(&doomed);
    w.checkpoint(&mut d).unwrap();
    put(&mut w, &mut d, 1);
    let st = w.to_state();
    let mut w2 = Writer::from_state(&st, g, opts(Dtype::U8, "/dev/ublkb0")).unwrap();
    assert_eq!(w2.to_state(), st);
    assert_eq!(w2.snapshot_json(), w.snapshot_json());
    assert!(w2.is_dirty());
    w2.verify(&mut d).unwrap();
    // The next random choices and keys continue the same sequence.
    assert_eq!(w2.pick_keys(3, true).unwrap(), w.pick_keys(3, true).unwrap());
    assert_eq!(w2.new_key(None), w.new_key(None));
    let mut o = opts(Dtype::U8, "/dev/ublkb0");
    o.seed = 8;
    assert!(Writer::from_state(&st, g, o).unwrap_err().contains("--seed 7"));
    assert!(Writer::from_state(&st, geom(131072, 1 << 20, size), opts(Dtype::U8, "x"))
        .unwrap_err()
        .contains("slot_bytes 65536"));
    assert!(Writer::from_state(&serde_json::json!({"x": 1}), g, opts(Dtype::U8, "x")).is_err());
}

#[test]
fn reopen_follows_the_loader_rules() {
    let size = 4 << 20;
    let f = Scratch::new("loader", size);
    let mut d = open(&f.0, Engine::Posix).unwrap();
    let g = geom(65536, 1 << 20, size);
    let mut w = Writer::new(g, opts(Dtype::Bf16, "/dev/ublkb0"));
    // No checkpoint: empty index.
    let r = w.reopen(&mut d).unwrap();
    assert!(r.rejected.is_some() && w.live() == 0);
    put(&mut w, &mut d, 8);
    w.checkpoint(&mut d).unwrap();
    // A different device_path string discards the whole index.
    let mut other = Writer::new(g, opts(Dtype::Bf16, "/dev/ublkb1"));
    let r = other.reopen(&mut d).unwrap();
    assert!(r.rejected.unwrap().contains("device_path"));
    assert_eq!((other.live(), other.seq, other.next_slot), (0, 0, 0));
    // A slot reused after the checkpoint fails its header check: dropped, slot reused first.
    let keys: Vec<String> = w.entries().map(|e| e.key.clone()).collect();
    w.delete_keys(&keys[2..3]);
    put(&mut w, &mut d, 1); // lands in slot 2 with another key, no checkpoint
    let r = w.reopen(&mut d).unwrap();
    assert_eq!((r.recovered, r.dropped, r.matches_previous), (7, 1, false));
    assert_eq!(w.free_slots(), &[2]);
    assert!(w.is_dirty(), "a validation drop makes the next checkpoint write");
    w.verify(&mut d).unwrap();
}

/// Writes `json` as checkpoint `seq` into its container, as LMCache would.
fn write_checkpoint_json(path: &std::path::Path, g: &Geometry, seq: u64, json: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let off = g.container_offset(Geometry::copy_for_seq(seq));
    let a = g.block_align as usize;
    f.write_all_at(&CheckpointHeaderBytes::encode_for(seq, json, a), off).unwrap();
    let mut pay = json.to_vec();
    pay.resize(json.len().next_multiple_of(a), 0);
    f.write_all_at(&pay, off + g.block_align).unwrap();
}

/// A hand-edited checkpoint, read as Python's `json.loads` reads it: of two `entries` members
/// the last counts, and a key listed twice takes its last entry (here a misaligned one, so
/// the key is skipped and its slot is free).
#[test]
fn reopen_reads_repeated_json_members_as_python_does() {
    let size = 4 << 20;
    let f = Scratch::new("repeated", size);
    let mut d = open(&f.0, Engine::Posix).unwrap();
    let g = geom(65536, 1 << 20, size);
    let mut w = Writer::new(g, opts(Dtype::Bf16, "/dev/ublkb0"));
    put(&mut w, &mut d, 8);
    w.checkpoint(&mut d).unwrap();
    let mut by_slot: Vec<(u64, String, u64)> = w.entries().map(|e| (e.slot, e.key.clone(), e.size)).collect();
    by_slot.sort();
    let by_slot: Vec<(String, u64)> = by_slot.into_iter().map(|(_, k, n)| (k, n)).collect();
    let (k0, k3) = (&by_slot[0].0, &by_slot[3].0);
    let mut doc: Value = serde_json::from_slice(&w.snapshot_json()).unwrap();
    let mut entries = doc["entries"].take().as_object().unwrap().clone();
    let e0 = entries.remove(k0).unwrap();
    let mut listed = serde_json::to_string(&entries).unwrap();
    listed.pop();
    let bad3 = serde_json::json!({"offset": g.slot_offset(3) + 4096, "size": by_slot[3].1});
    listed += &format!(",{}:{bad3}}}", serde_json::to_string(k3).unwrap());
    doc["entries"] = Value::String("@entries@".into());
    let body = serde_json::to_string(&doc).unwrap().replace("\"@entries@\"", &listed);
    let text = format!("{{\"entries\":{{{}:{e0}}},{}", serde_json::to_string(k0).unwrap(), &body[1..]);
    write_checkpoint_json(&f.0, &g, 2, text.as_bytes());
    let r = w.reopen(&mut d).unwrap();
    assert_eq!((r.rejected.as_deref(), r.seq, r.recovered, r.skipped, r.dropped), (None, Some(2), 6, 1, 0));
    let mut slots = slots_of(&w);
    slots.sort();
    assert_eq!(slots, [1, 2, 4, 5, 6, 7]);
    assert_eq!(w.free_slots(), &[0, 3]);
}

/// A slot header that does not read drops its entry, as LMCache's loader drops it, and the
/// rest are recovered: on both engines (a batch that fails is read again one by one).
#[test]
fn reopen_drops_an_entry_whose_header_does_not_read() {
    for engine in [Engine::Posix, Engine::IoUring] {
        let size = 4 << 20;
        let f = Scratch::new(&format!("unreadable-{engine:?}"), size);
        let Some(mut d) = open(&f.0, engine) else { continue };
        let g = geom(65536, 1 << 20, size);
        let mut w = Writer::new(g, opts(Dtype::Bf16, "/dev/ublkb0"));
        put(&mut w, &mut d, 8);
        w.checkpoint(&mut d).unwrap();
        drop(d);
        // The device now ends where slot 7 starts: its header read fails.
        std::fs::OpenOptions::new().write(true).open(&f.0).unwrap().set_len(g.slot_offset(7)).unwrap();
        let mut d = open(&f.0, engine).unwrap();
        let r = w.reopen(&mut d).unwrap();
        assert_eq!((r.rejected.as_deref(), r.recovered, r.dropped), (None, 7, 1), "{engine:?}");
        assert_eq!(slots_of(&w).iter().max(), Some(&6), "{engine:?}");
        assert_eq!(w.free_slots(), &[7], "{engine:?}");
    }
}

// ---- the real LMCache fixtures -----------------------------------------------------------

fn fixture_dir(scen: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6").join(scen)
}

fn manifest(scen: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir(scen).join("manifest.json")).unwrap()).unwrap()
}

fn fixture_geometry(m: &Value) -> Geometry {
    let c = &m["core_config"];
    GeometryConfig {
        block_align: c["block_align"].as_u64().unwrap(),
        header_bytes: c["header_bytes"].as_u64().unwrap(),
        slot_bytes: c["slot_bytes"].as_u64().unwrap(),
        meta_total_bytes: c["meta_total_bytes"].as_u64().unwrap(),
        capacity_bytes: c["capacity_bytes"].as_u64().unwrap(),
    }
    .validate(m["device"]["size_bytes"].as_u64().unwrap())
    .unwrap()
}

/// Legacy keys are what LMCache's non-MP plugin writes: fdpblk parses them as legacy keys,
/// layer keys of one chunk share its identity, and negative chunk hashes are spelled `-hex`.
#[test]
fn legacy_keys_are_cache_engine_keys() {
    use fdpblk::layout::keys::{identity, Key};
    let mut o = opts(Dtype::Bf16, "/dev/ublkb0");
    o.namespace = model::Namespace::Legacy { key_layers: 3 };
    o.kv_rank = 0x0201_0201;
    let mut w = Writer::new(geom(65536, 1 << 20, 4 << 20), o);
    let keys: Vec<String> = (0..60).map(|i| w.new_key((i == 0).then_some("alice"))).collect();
    let Ok(Key::Legacy(l)) = Key::parse(&keys[0]) else { panic!("{} is not a legacy key", keys[0]) };
    assert_eq!((l.model_name, l.world_size, l.worker_id, l.dtype, l.layer_id), ("meta-llama/Llama-3.1-8B-Instruct", 2, 1, "bfloat16", Some(0)));
    assert_eq!(l.tags, vec!["salt%alice"]);
    for c in keys.chunks(3) {
        let id = identity(&c[0]).unwrap();
        assert!(c.iter().all(|k| identity(k).unwrap() == id), "one chunk, one identity: {c:?}");
    }
    assert_ne!(identity(&keys[0]).unwrap(), identity(&keys[3]).unwrap());
    assert!(keys.iter().any(|k| k.split('@').nth(3).unwrap().starts_with('-')), "some negative chunk hashes");
    let mut s = std::collections::HashSet::new();
    assert!(keys.iter().all(|k| s.insert(k.clone())), "distinct key strings");
}

fn fixture_opts(m: &Value) -> Options {
    let mut o = opts(Dtype::U8, m["core_config"]["device_path"].as_str().unwrap());
    o.partial_every = 0;
    o
}

/// A write as (io_uring batch ordinal and index, offset, len).
type WriteShape = (Option<(u64, usize)>, u64, u64);

/// The writes LMCache's traces show, in order.
fn trace_writes(scen: &str, m: &Value) -> Vec<WriteShape> {
    let dir = fixture_dir(scen);
    let mut out = Vec::new();
    if m["use_odirect"] == true {
        // What the block device receives: the strace of the O_DIRECT fd.
        for l in std::fs::read_to_string(dir.join("syscalls.jsonl")).unwrap().lines() {
            let v: Value = serde_json::from_str(l).unwrap();
            if v["syscall"] == "pwrite64" {
                out.push((None, v["offset"].as_u64().unwrap(), v["len"].as_u64().unwrap()));
            }
        }
        return out;
    }
    let mut ordinals: Vec<u64> = Vec::new();
    for l in std::fs::read_to_string(dir.join("iotrace.jsonl")).unwrap().lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        if v["op"] != "write" {
            continue;
        }
        let batch = v["batch_id"].as_u64().map(|b| {
            if ordinals.last() != Some(&b) {
                ordinals.push(b);
            }
            (ordinals.len() as u64, v["batch_index"].as_u64().unwrap() as usize)
        });
        out.push((batch, v["offset"].as_u64().unwrap(), v["total_len"].as_u64().unwrap()));
    }
    out
}

/// Replays a fixture scenario's calls (same keys, sizes, shapes, dtypes, formats; not the
/// same payload bytes) through the writer on a scratch file.
fn replay(scen: &str) -> (Scratch, Writer, Vec<LoggedWrite>, Value) {
    let m = manifest(scen);
    let g = fixture_geometry(&m);
    let f = Scratch::new(&format!("replay-{scen}"), m["device"]["size_bytes"].as_u64().unwrap());
    let engine = if m["io_engine"] == "io_uring" { Engine::IoUring } else { Engine::Posix };
    let mut d = open(&f.0, engine).unwrap_or_else(|| panic!("{scen}: io_uring needed for this fixture"));
    d.odirect = m["use_odirect"] == true;
    d.log = Some(Vec::new());
    let mut w = Writer::new(g, fixture_opts(&m));
    let recs = m["keys"].as_array().unwrap();
    for p in m["phases"].as_array().unwrap() {
        match p["op"].as_str().unwrap() {
            "put_many" => {
                let mut items = Vec::new();
                for (i, k) in p["keys"].as_array().unwrap().iter().enumerate() {
                    if p["outcome"][i] == "failed" {
                        continue; // LMCache rejects it before any write
                    }
                    let key = k.as_str().unwrap();
                    let len = p["payload_lens"][i].as_u64().unwrap();
                    let r = recs
                        .iter()
                        .find(|r| r["key"] == key && r["payload_len"] == len)
                        .unwrap_or_else(|| panic!("{scen}: no record for {key}"));
                    items.push(PutItem {
                        key: key.to_string(),
                        size: len,
                        shape: r["shape"].clone(),
                        dtype: r["dtype"].clone(),
                        fmt: r["fmt"].clone(),
                        cached_positions: r["cached_positions"].clone(),
                    });
                }
                w.put_many(&mut d, items).unwrap();
            }
            "delete_many" => {
                let keys: Vec<String> =
                    p["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect();
                w.delete_keys(&keys);
            }
            "checkpoint_now" | "close" => {
                w.checkpoint(&mut d).unwrap();
            }
            op => panic!("{scen}: unknown phase op {op}"),
        }
    }
    let log = d.log.take().unwrap();
    (f, w, log, m)
}

/// Every scenario and variant: the same writes (offsets, lengths, order, io_uring batches)
/// as LMCache made, a metadata region and slot headers byte-identical to LMCache's image,
/// and the same final allocator state.
#[test]
fn replays_match_lmcache_fixtures_byte_for_byte() {
    let mut n = 0;
    let want = if IoUringProbe::unavailable() { 6 } else { 9 };
    for base in ["object-evict", "object-multitenant", "legacy-basic"] {
        for var in ["", ".io_uring", ".odirect"] {
            let scen = format!("{base}{var}");
            if var == ".io_uring" && IoUringProbe::unavailable() {
                continue;
            }
            let (f, w, log, m) = replay(&scen);
            let g = w.geom;
            let got: Vec<WriteShape> = log.iter().map(|l| (l.batch, l.offset, l.len)).collect();
            assert_eq!(got, trace_writes(&scen, &m), "{scen}: write sequence");
            let mine = f.bytes();
            let theirs = std::fs::read(fixture_dir(&scen).join("device.img")).unwrap();
            assert_eq!(mine.len(), theirs.len());
            let meta = g.meta_total_bytes as usize;
            assert!(mine[..meta] == theirs[..meta], "{scen}: metadata region (checkpoint headers and JSON) differs");
            for s in 0..g.max_slots {
                let o = g.slot_offset(s) as usize;
                let h = g.header_bytes as usize;
                assert!(mine[o..o + h] == theirs[o..o + h], "{scen}: slot {s} header differs");
            }
            let fs = &m["final_state"];
            let free: Vec<u64> =
                fs["free_slots_order"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            assert_eq!(w.free_slots(), free.as_slice(), "{scen}");
            assert_eq!(w.next_slot, fs["next_slot"].as_u64().unwrap(), "{scen}");
            assert_eq!(w.live() as u64, fs["indexed_key_count"].as_u64().unwrap(), "{scen}");
            assert_eq!(w.seq, fs["metadata_seq"].as_u64().unwrap(), "{scen}");
            assert!(!w.is_dirty());
            n += 1;
        }
    }
    assert_eq!(n, want, "fixture variants replayed");
}

/// The `reopen` fixture: LMCache reopened object-evict's image. Same recovered entries
/// (order and metadata), seq, next_slot and free-list order; nothing dirty; and the JSON the
/// writer would write next is the loaded one byte for byte.
#[test]
fn reopen_matches_lmcache_recovery() {
    for scen in ["reopen", "reopen.odirect"] {
        let m = manifest(scen);
        let g = fixture_geometry(&m);
        let img = std::fs::read(fixture_dir(scen).join("device.img")).unwrap();
        let f = Scratch::from_bytes(&format!("reopen-{scen}"), &img);
        let mut d = open(&f.0, Engine::Posix).unwrap();
        let mut w = Writer::new(g, fixture_opts(&m));
        let r = w.reopen(&mut d).unwrap();
        assert_eq!(r.rejected, None);
        let rec = &m["recovery"];
        assert_eq!(r.recovered, rec["recovered_count"].as_u64().unwrap());
        let want: Vec<(String, u64, u64, Value, Value, Value)> = rec["recovered"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["key"].as_str().unwrap().to_string(),
                    e["offset"].as_u64().unwrap(),
                    e["size"].as_u64().unwrap(),
                    e["shape"].clone(),
                    e["dtype"].clone(),
                    e["fmt"].clone(),
                )
            })
            .collect();
        let got: Vec<(String, u64, u64, Value, Value, Value)> = w
            .entries()
            .map(|e| (e.key.clone(), g.slot_offset(e.slot), e.size, e.shape.clone(), e.dtype.clone(), e.fmt.clone()))
            .collect();
        assert_eq!(got, want, "{scen}");
        let fs = &m["final_state"];
        let free: Vec<u64> = fs["free_slots_order"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(w.free_slots(), free.as_slice());
        assert_eq!((w.seq, w.next_slot), (fs["metadata_seq"].as_u64().unwrap(), fs["next_slot"].as_u64().unwrap()));
        assert!(!w.is_dirty());
        let copies = read_copies(&img, &g).unwrap();
        let newest = newest_valid(&copies).unwrap();
        let off = newest.payload_offset(&g) as usize;
        let json = &img[off..off + newest.payload_len().unwrap() as usize];
        assert!(w.snapshot_json() == json, "{scen}: re-encoded JSON differs from the loaded one");
    }
}

/// CI must run the io_uring parts (the byte-for-byte match with LMCache's io_uring fixtures):
/// there a missing io_uring fails the test instead of skipping those parts.
fn io_uring_missing(why: &str) {
    assert!(std::env::var_os("CI").is_none(), "io_uring is unavailable ({why}) and CI is set: the io_uring parts must run in CI; allow io_uring_setup (seccomp, kernel.io_uring_disabled)");
}

/// Whether this kernel lets us set up an io_uring (containers may forbid it).
struct IoUringProbe;

impl IoUringProbe {
    fn unavailable() -> bool {
        match io_uring::IoUring::new(8) {
            Ok(_) => false,
            Err(e) => {
                io_uring_missing(&e.to_string());
                eprintln!("note: io_uring unavailable here ({e}); io_uring fixtures not replayed");
                true
            }
        }
    }
}

/// The writer's own identity rule gives what LMCache 0.5.6 wrote: every key of every fixture
/// (its manifest's identity, read from the image) and the identity vectors, in both namespaces.
#[test]
fn identities_are_lmcaches_without_fdpblks_parser() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("identity_vectors.json")).unwrap()).unwrap();
    let mut pairs: Vec<(String, u64)> = Vec::new();
    for list in [&v["object_vectors"], &v["legacy_vectors"]["vectors"]] {
        for x in list.as_array().unwrap() {
            pairs.push((x["key"].as_str().unwrap().into(), x["lmcache_slot_identity_u64"].as_u64().unwrap()));
        }
    }
    for scen in ["legacy-basic", "object-evict", "object-multitenant", "reopen"] {
        let m: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(scen).join("manifest.json")).unwrap()).unwrap();
        for k in m["keys"].as_array().unwrap() {
            pairs.push((k["key"].as_str().unwrap().into(), k["identity_u64"].as_u64().unwrap()));
        }
    }
    let legacy = pairs.iter().filter(|(k, _)| !k.split('@').nth(1).unwrap_or("").starts_with("0x")).count();
    assert!(legacy >= 10 && pairs.len() - legacy >= 10, "both namespaces: {legacy} legacy of {}", pairs.len());
    for (key, want) in &pairs {
        assert_eq!(crate::model::lmcache_identity(key), Ok(*want), "{key}");
    }
    assert!(crate::model::lmcache_identity("no-at-signs").is_err());
    assert!(crate::model::lmcache_identity("m@1@0@xyz@bfloat16").is_err());
}

/// A put whose writes fail is rolled back (its slots free again, nothing indexed) and, as
/// LMCache's rollback does, makes the next tick write a checkpoint: on both engines and on
/// concurrent store tasks.
#[test]
fn failed_put_is_rolled_back_and_marks_the_index_dirty() {
    for engine in [Engine::Posix, Engine::IoUring] {
        for concurrent in [false, true] {
            let size = 4 << 20;
            let f = Scratch::new(&format!("rollback-{}-{concurrent}", engine.name()), size);
            let Some(mut d) = open(&f.0, engine) else { continue };
            let g = geom(65536, 1 << 20, size);
            let mut w = Writer::new(g, opts(Dtype::U8, "/dev/ublkb0"));
            put(&mut w, &mut d, 3);
            assert!(matches!(w.checkpoint(&mut d).unwrap(), CheckpointOutcome::Written { .. }));
            assert!(!w.is_dirty());
            let (live, free, next) = (w.live(), w.free_slots().to_vec(), w.next_slot);
            d.refuse_writes();
            let items = w.plan_new(4, None, None, None).unwrap();
            let err = if concurrent {
                let mut a = items;
                let b = a.split_off(2);
                w.put_concurrent(&mut d, vec![a, b], 2).unwrap_err()
            } else {
                w.put_many(&mut d, items).unwrap_err()
            };
            let what = format!("{} concurrent={concurrent}: {err}", engine.name());
            assert_eq!(w.live(), live, "{what}");
            assert_eq!(w.free_slots().len() as u64 + g.max_slots - w.next_slot, free.len() as u64 + g.max_slots - next, "{what}");
            assert!(w.is_dirty(), "a rolled-back put makes the next tick write: {what}");
        }
    }
}
