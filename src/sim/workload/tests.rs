use super::*;
use crate::layout::checkpoint_json::{parse_checkpoint_json, JsonLimits};
use crate::layout::keys;

fn spec(text: &str) -> WorkloadSpec {
    WorkloadSpec::from_json_str(text).unwrap()
}

fn small(eviction: &str, tenants: &str) -> WorkloadSpec {
    // One slot per eviction tick and a checkpoint every 60 slots, as on a large drive.
    spec(&format!(
        r#"{{"slot_bytes": "1M", "meta_total_bytes": "4M", "write_rate_mb_s": 1, {eviction} "tenants": [{tenants}]}}"#
    ))
}

const ONE: &str =
    r#"{"name": "a", "salt": "a:1", "zipf": 0.9, "universe": 4, "doc_chunks": [1, 8], "unique_tail_chunks": 1}"#;
const LRU: &str = r#""eviction": {"policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2},"#;

/// Runs `n` requests and returns every operation as a string (for determinism checks) and
/// the workload.
fn drive(mut w: Workload, n: usize) -> (Vec<String>, Workload) {
    let mut ops = Vec::new();
    for _ in 0..n {
        w.step(&mut |op| ops.push(format!("{op:?}")));
    }
    (ops, w)
}

/// A workload whose tables would not fit in memory is an error naming the fields to change,
/// before anything is allocated; so are too many tenants and a layout LMCache refuses.
#[test]
fn a_workload_too_large_for_memory_is_refused_naming_the_fix() {
    // 8 KiB slots on 1.88 TB: 229 million slots, a universe of 100 single-chunk documents each.
    let huge = spec(r#"{"slot_bytes": "8K", "meta_total_bytes": "4M", "tenants": [{"universe": 100, "doc_chunks": [1, 1]}]}"#);
    let e = Workload::new(huge, 1_880_000_000_000, 0, 1, None).err().expect("refused");
    assert!(e.contains("\"universe\"") && e.contains("--device-size"), "{e}");
    let tenants = vec![r#"{"universe": 1}"#; spec::MAX_TENANTS + 1].join(",");
    let e = WorkloadSpec::from_json_str(&format!(r#"{{"slot_bytes": "1M", "meta_total_bytes": "4M", "tenants": [{tenants}]}}"#)).unwrap_err();
    assert!(e.contains("at most 4096"), "{e}");
    // Its slot tables alone: 229 million 8 KiB slots take about 28 GiB.
    let cap = 2 << 20;
    let e = workload_fits(229_000_000, 1, 0, 0, cap, Some(16 << 30)).unwrap_err();
    assert!(e.contains("\"slot_bytes\"") && e.contains("--device-size"), "{e}");
    assert!(workload_fits(229_000_000, 1, 0, 0, cap, Some(64 << 30)).is_ok());
    // An L1 of every slot adds about 11 GB.
    assert!(workload_fits(229_000_000, 1, 0, 0, cap, Some(36 << 30)).is_ok());
    assert!(workload_fits(229_000_000, 1, 229_000_000, 0, cap, Some(36 << 30)).is_err());
    // Two checkpoint snapshots (the one built, one a request keeps) add 24 bytes an entry
    // each, and their JSON up to the container's payload (here 2 MiB).
    assert!(workload_fits(229_000_000, 1, 0, 2, cap, Some(36 << 30)).is_err());
    assert!(workload_fits(229_000_000, 1, 0, 2, cap, Some(40 << 30)).is_ok());
    assert!(workload_fits(100_000, 1, 0, 2, 128 << 20, Some(128 << 20)).is_ok(), "100 k entries' JSON: 51 MB each");
    assert!(workload_fits(1_000_000, 1, 0, 17, 128 << 20, Some(1 << 30)).is_err(), "17 copies of 158 MB");
    // A request's snapshots: one tick it starts just before, and one per interval it lasts.
    assert_eq!(spec(r#"{"tenants": [{"universe": 1}]}"#).checkpoints_per_request_at_most(), 1);
    let slow = spec(r#"{"write_rate_mb_s": 1, "checkpoint_interval_s": 10, "tenants": [{"universe": 1, "doc_chunks": [4, 4]}]}"#);
    assert!(slow.checkpoints_per_request_at_most() > 1, "{}", slow.checkpoints_per_request_at_most());
    let odd = spec(r#"{"slot_bytes": "1M", "meta_total_bytes": "4M", "header_bytes": "6K", "tenants": [{"universe": 1}]}"#);
    let e = odd.geometry(64 << 20, 0).unwrap_err();
    assert!(e.contains("the workload's \"header_bytes\"") && !e.contains("--header-bytes"), "{e}");
}

#[test]
fn shipped_workloads_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/workloads");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let s = WorkloadSpec::from_json_str(&std::fs::read_to_string(&p).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!s.name.is_empty() && !s.description.is_empty(), "{}", p.display());
        n += 1;
    }
    assert!(n >= 4);
}

#[test]
fn bad_specs_say_what_is_wrong() {
    for (text, needle) in [
        (r#"{"tenants": []}"#, "non-empty"),
        (r#"{"tenant": [{}]}"#, "unknown field \"tenant\""),
        (r#"{"mode": "x", "tenants": [{}]}"#, "mode"),
        (r#"{"slot_bytes": "1Q", "tenants": [{}]}"#, "slot_bytes"),
        (r#"{"eviction": {"policy": "IsolatedLRU"}, "tenants": [{}]}"#, "quota"),
        (r#"{"mode": "non_mp", "eviction": {}, "tenants": [{}]}"#, "non_mp"),
        (r#"{"eviction": {"policy": "IsolatedLRU"}, "tenants": [{"quota": 1.5}]}"#, "in (0, 1]"),
        (r#"{"eviction": {}, "tenants": [{"quota": 0.5}]}"#, "read only by the IsolatedLRU"),
        (r#"{"tenants": [{"quota": 0.5}]}"#, "read only by the IsolatedLRU"),
        (
            r#"{"eviction": {"policy": "IsolatedLRU"}, "tenants": [{"name": "a", "salt": "x", "quota": 0.3}, {"name": "b", "salt": "x", "quota": 0.3}]}"#,
            "share the cache_salt \"x\"",
        ),
        (r#"{"mode": "non_mp", "chunk_hash_bytes": 8, "tenants": [{}]}"#, "chunk_hash_bytes"),
        (r#"{"tenants": [{"doc_chunks": [3, 1]}]}"#, "doc_chunks"),
        (r#"{"chunk_bytes": "32M", "tenants": [{}]}"#, "chunk_bytes"),
        (r#"{"io": "aio", "tenants": [{}]}"#, "io_uring"),
        (r#"{"ublk_queue_depth": 5000, "tenants": [{}]}"#, "ublk_queue_depth"),
        (r#"{"model_name": "a@b", "tenants": [{}]}"#, "model_name"),
        (r#"{"model_name": "a\"b", "tenants": [{}]}"#, "model_name"),
        (r#"{"model_name": "lläma", "tenants": [{}]}"#, "model_name"),
        (r#"{"tenants": [{"name": "t", "salt": "a/b"}]}"#, "salt"),
        (&format!(r#"{{"tenants": [{{"name": "t", "salt": "{}"}}]}}"#, "s".repeat(129)), "salt"),
        (r#"{"tenants": [{"name": "t", "salt": "a\u0000"}]}"#, "salt"),
        (r#"{"tenants": [{"name": "t", "salt": "a\"b"}]}"#, "salt"),
        // Too large for its field: the bound is named (it said "a non-negative integer").
        (r#"{"writeback_puts": 5000000000, "tenants": [{}]}"#, "\"writeback_puts\" must be a whole number from 0 to 4294967295"),
        (r#"{"slot_bytes": 1e20, "tenants": [{}]}"#, "from 0 to 18446744073709551615 or a size"),
        (r#"{"tenants": [{"name": "a", "share": 1e308}, {"name": "b", "share": 1e308}]}"#, "share must be > 0 and at most 1e9"),
        // A request lasting many checkpoint intervals or eviction checks (a copy of the index
        // for each, an entry per check: memory without bound).
        (
            r#"{"slot_bytes": "16M", "write_rate_mb_s": 1, "checkpoint_interval_s": 1, "tenants": [{"name": "a", "prefix_chunks": 0, "doc_chunks": [60000, 60000]}]}"#,
            "tenant \"a\": a request of up to 60000 chunks takes",
        ),
        (
            r#"{"slot_bytes": "16M", "write_rate_mb_s": 1, "checkpoint_interval_s": 86400, "eviction": {"policy": "LRU", "interval_s": 0.01}, "tenants": [{"prefix_chunks": 0, "doc_chunks": [65536, 65536]}]}"#,
            "100000 eviction checks (0.01 s each)",
        ),
    ] {
        let e = WorkloadSpec::from_json_str(text).unwrap_err();
        assert!(e.contains(needle), "{text}: {e}");
    }
}

#[test]
fn zipf_masses_sum_to_one_and_fall_with_rank() {
    let p = Popularity::new(1000, 0.9);
    let sum: f64 = (0..1000).map(|r| p.mass(r)).sum();
    assert!((sum - 1.0).abs() < 1e-9, "{sum}");
    assert!(p.mass(0) > p.mass(1) && p.mass(1) > p.mass(999) && p.mass(999) > 0.0);
    assert_eq!(p.mass(1000), 0.0);
    // Rank 1 against rank 10 under Zipf 0.9: 10^0.9.
    assert!((p.mass(0) / p.mass(9) - 10f64.powf(0.9)).abs() < 1e-6);
}

#[test]
fn puts_carry_how_often_their_chunk_is_asked_for() {
    let mut w = Workload::new(small(LRU, ONE), 64 << 20, 0, 3, None).unwrap();
    // identity → (puts, popularity)
    let mut seen: HashMap<u64, (u64, f64)> = HashMap::new();
    let mut mismatched = 0;
    for _ in 0..20_000 {
        w.step(&mut |op| {
            if let LmOp::Put { identity, popularity, .. } = *op {
                assert!((0.0..=1.0).contains(&popularity), "{popularity}");
                let e = seen.entry(identity).or_insert((0, popularity));
                e.0 += 1;
                if e.1 != popularity {
                    mismatched += 1;
                }
            }
        });
    }
    assert_eq!(mismatched, 0, "a chunk's chance changed between its puts");
    // A request's unique tail (chance 0) is never put again; chunks put again and again
    // are the popular ones.
    assert!(seen.values().any(|&(_, p)| p == 0.0));
    assert!(seen.values().filter(|&&(_, p)| p == 0.0).all(|&(n, _)| n == 1));
    // The chance is how often requests ask for the chunk: count it over many requests.
    let n = 200_000;
    let mut asked: HashMap<u64, (u64, f64)> = HashMap::new();
    for _ in 0..n {
        for (id, _, p) in w.request_chunks(0) {
            asked.entry(id).or_insert((0, p)).0 += 1;
        }
    }
    let mut checked = 0;
    for (count, p) in asked.values().copied().filter(|&(_, p)| p > 0.01) {
        let f = count as f64 / n as f64;
        assert!((f - p).abs() < 0.1 * p, "asked for in {f} of the requests, chance {p}");
        checked += 1;
    }
    assert!(checked >= 10, "{checked}");
}

#[test]
fn deterministic_from_the_seed() {
    let s = small(LRU, ONE);
    let a = drive(Workload::new(s.clone(), 64 << 20, 0, 7, None).unwrap(), 3000).0;
    let b = drive(Workload::new(s.clone(), 64 << 20, 0, 7, None).unwrap(), 3000).0;
    let c = drive(Workload::new(s, 64 << 20, 0, 8, None).unwrap(), 3000).0;
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn bump_pointer_then_lifo_reuse_and_lru_watermark() {
    let s = small(LRU, ONE);
    let mut w = Workload::new(s, 512 << 20, 0, 1, None).unwrap();
    let max = w.geometry.max_slots;
    let mut puts = Vec::new();
    let mut deletes: Vec<u64> = Vec::new();
    let mut reuse_checked = 0;
    for _ in 0..5000 {
        let mut step_puts = Vec::new();
        let mut step_deletes = Vec::new();
        w.step(&mut |op| match *op {
            LmOp::Put { slot, .. } => step_puts.push(slot),
            LmOp::Delete { slot } => step_deletes.push(slot),
            _ => {}
        });
        // A put after evictions takes the most recently freed slot first (LIFO).
        if !deletes.is_empty() && !step_puts.is_empty() {
            assert_eq!(step_puts[0], *deletes.last().unwrap());
            reuse_checked += 1;
        }
        for p in &step_puts {
            deletes.retain(|d| d != p);
        }
        deletes.extend(step_deletes);
        puts.extend(step_puts);
        assert!(w.live() as f64 <= 0.8 * max as f64 + 16.0, "live {} of {max}", w.live());
    }
    w.audit().unwrap();
    // A fresh device is filled 0, 1, 2, ...
    assert_eq!(&puts[..10], &(0..10).collect::<Vec<u64>>()[..]);
    // LMCache's default watermark leaves the top fifth of the slots unwritten.
    assert!(w.next_slot() < (0.85 * max as f64) as u64, "{} of {max}", w.next_slot());
    assert!(reuse_checked > 10 && w.stats.evictions > 0 && w.stats.hits > 0);
}

#[test]
fn non_mp_fills_then_puts_fail() {
    let s = spec(
        r#"{"mode": "non_mp", "slot_bytes": "1M", "tenants": [{"zipf": 0.5, "universe": 4, "doc_chunks": [1, 4]}]}"#,
    );
    assert_eq!((s.io, s.meta_total_bytes), (IoMode::Buffered, 128 << 20));
    let (_, w) = drive(Workload::new(s, 192 << 20, 0, 3, None).unwrap(), 2000);
    assert_eq!(w.live(), w.geometry.max_slots);
    assert!(w.stats.puts_failed > 0 && w.stats.deletes == 0 && w.stats.evictions == 0);
    w.audit().unwrap();
}

#[test]
fn quotas_bound_each_tenant() {
    let s = small(
        r#""eviction": {"policy": "IsolatedLRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2},"#,
        r#"{"name": "busy", "salt": "busy:1", "share": 0.8, "quota": 0.3, "universe": 2},
           {"name": "quiet", "salt": "quiet:1", "share": 0.2, "quota": 0.7, "universe": 2}"#,
    );
    let mut w = Workload::new(s, 128 << 20, 0, 5, None).unwrap();
    let max = w.geometry.max_slots as f64;
    for _ in 0..6000 {
        w.step(&mut |_| {});
        assert!((w.tenants[0].used as f64) < 0.3 * max * 0.8 + 12.0);
        assert!((w.tenants[1].used as f64) < 0.7 * max * 0.8 + 12.0);
    }
    assert!(w.tenants[1].used > w.tenants[0].used);
    w.audit().unwrap();
}

#[test]
fn checkpoint_json_is_lmcaches_and_its_size_is_predicted() {
    let s = small(LRU, ONE);
    let mut sized = Workload::new(s.clone(), 64 << 20, 0, 2, None).unwrap();
    let mut w = Workload::new(s.clone(), 64 << 20, 0, 2, None).unwrap();
    w.emit_json(true);
    let mut got = Vec::new();
    let mut headers: HashMap<u64, u64> = HashMap::new();
    let (mut seen, mut listed) = (0, 0);
    for _ in 0..20000 {
        let mut predicted = Vec::new();
        let before = got.len();
        sized.step(&mut |op| {
            if let LmOp::Checkpoint { json_bytes, .. } = op {
                predicted.push(*json_bytes);
            }
        });
        w.step(&mut |op| match *op {
            LmOp::Put { slot, identity, .. } => {
                headers.insert(slot, identity);
            }
            LmOp::Checkpoint { json: Some(j), entries, json_bytes, .. } => {
                assert_eq!(j.len() as u64, json_bytes);
                got.push(json_bytes);
                // fdpblk's own parser reads it; every key's identity is the slot header's.
                let mut n = 0;
                let meta = parse_checkpoint_json(j, &JsonLimits::default(), &mut |e| {
                    let slot = (e.offset.unwrap() - s.meta_total_bytes) / s.slot_bytes;
                    assert_eq!(keys::identity(e.key).unwrap(), headers[&slot], "{}", e.key);
                    assert!(
                        e.key.ends_with("@a:1")
                            && e.key.starts_with("meta-llama%2FLlama-3.1-8B-Instruct@0x01000100@0@")
                    );
                    n += 1;
                    Ok(())
                })
                .unwrap();
                assert_eq!((n, meta.entries), (entries.len() as u64, entries.len() as u64));
                listed = entries.len();
                seen += 1;
            }
            _ => {}
        });
        // The size-only path predicts each checkpoint and its JSON length exactly.
        assert_eq!(predicted, got[before..]);
    }
    assert!(seen >= 2, "{seen} checkpoints");
    // About 240 bytes per entry (reference §11: 236 B for a 64-hex object key).
    let per = (got[seen - 1] as f64 - 330.0) / listed as f64;
    // (Slightly less here: offsets of 7 and 8 digits instead of 13.)
    assert!((220.0..260.0).contains(&per), "{per} bytes per entry");
}

#[test]
fn a_header_region_larger_than_the_largest_request_is_split_with_the_header_first() {
    for io in ["odirect", "io_uring", "buffered"] {
        let s = spec(&format!(
            r#"{{"slot_bytes": "1M", "meta_total_bytes": "4M", "header_bytes": "12K", "max_request_bytes": "8K", "io": "{io}", "writeback_puts": 1, "write_rate_mb_s": 1, {LRU} "tenants": [{ONE}]}}"#
        ));
        let g = s.geometry(64 << 20, 0).unwrap();
        let mut sh = IoShaper::new(&s, g, 1);
        let mut out = Vec::new();
        sh.shape(&LmOp::Put { slot: 3, identity: 9, payload_len: 20_000, tenant: 0, pid: None, popularity: 0.0 }, &mut |io| out.push(*io));
        sh.flush(&mut |io| out.push(*io));
        let base = g.slot_offset(3);
        let mut lens: Vec<(u64, u64, bool)> = out.iter().map(|io| (io.offset - base, io.len, io.header.is_some())).collect();
        lens.sort_unstable();
        assert!(lens.iter().all(|&(_, l, _)| l <= 8192), "{io}: {lens:?}");
        assert_eq!(lens.iter().filter(|l| l.2).count(), 1, "{io}: one request carries the header: {lens:?}");
        assert_eq!(lens[0], (0, 8192, true), "{io}");
        assert_eq!(lens.iter().map(|l| l.1).sum::<u64>(), 12288 + 20480, "{io}: header region and payload, once each");
    }
}

#[test]
fn odirect_and_buffered_shapes() {
    let s = small(LRU, ONE);
    let g = s.geometry(64 << 20, 0).unwrap();
    let mut sh = IoShaper::new(&s, g, 1);
    let mut out = Vec::new();
    sh.shape(&LmOp::Put { slot: 3, identity: 9, payload_len: 600_000, tenant: 0, pid: None, popularity: 0.0 }, &mut |io| {
        out.push(*io)
    });
    let base = g.slot_offset(3);
    let lens: Vec<(u64, u64, bool)> =
        out.iter().map(|io| (io.offset - base, io.len, io.header.is_some())).collect();
    // Header, then the payload rounded to 4 KiB and split at 512 KiB.
    assert_eq!(lens, vec![(0, 4096, true), (4096, 524288, false), (4096 + 524288, 602112 - 524288, false)]);
    let mut b = s.clone();
    b.io = IoMode::Buffered;
    b.writeback_puts = 4;
    let mut sh = IoShaper::new(&b, g, 1);
    let mut out = Vec::new();
    for (slot, len) in [(5, 1000u64), (4, g.slot_payload_capacity()), (9, 5000), (5, 2000)] {
        sh.shape(&LmOp::Put { slot, identity: slot, payload_len: len, tenant: 0, pid: None, popularity: 0.0 }, &mut |io| {
            out.push(*io)
        });
    }
    sh.flush(&mut |io| out.push(*io));
    // Writeback in offset order; slot 5 once, with its newest header; slots 4 and 5 are
    // adjacent but each request starts at most one header.
    let starts: Vec<(u64, Option<u64>)> =
        out.iter().map(|io| (io.offset, io.header.map(|h| h.payload_len))).collect();
    assert_eq!(starts[0], (g.slot_offset(4), Some(g.slot_payload_capacity())));
    assert!(starts.contains(&(g.slot_offset(5), Some(2000))));
    assert!(starts.contains(&(g.slot_offset(9), Some(5000))));
    assert!(starts.windows(2).all(|w| w[0].0 < w[1].0), "{starts:?}");
    let total: u64 = out.iter().map(|io| io.len).sum();
    assert_eq!(total, 3 * 4096 + g.slot_payload_capacity() + 4096 + 8192);
}

/// Buffered: a checkpoint's pages go out after the dirty slot pages of the puts it lists, or,
/// with `"checkpoint_writeback": "before_slots"`, ahead of them; every page once either way.
#[test]
fn buffered_checkpoint_writeback_goes_after_or_before_the_dirty_slots() {
    let order = |before: bool| {
        let mut b = small(LRU, ONE);
        b.io = IoMode::Buffered;
        b.writeback_puts = 8;
        b.checkpoint_before_slots = before;
        let g = b.geometry(64 << 20, 0).unwrap();
        let mut sh = IoShaper::new(&b, g, 1);
        let mut out = Vec::new();
        for slot in [3, 7] {
            sh.shape(&LmOp::Put { slot, identity: slot, payload_len: 5000, tenant: 0, pid: None, popularity: 0.0 }, &mut |io| out.push(*io));
        }
        assert!(out.is_empty(), "held until writeback");
        sh.shape(&LmOp::Checkpoint { seq: 1, json_bytes: 100, entries: &[], json: None }, &mut |io| out.push(*io));
        sh.flush(&mut |io| out.push(*io));
        out.iter().map(|io| if io.checkpoint.is_some() { 'c' } else if io.header.is_some() { 's' } else { '.' }).collect::<String>()
    };
    // Each slot one request from its header (header and payload pages adjacent); the
    // checkpoint's payload, then its header block.
    assert_eq!(order(false), "ss.c");
    assert_eq!(order(true), ".css");
    let spec_of = |v: &str| spec(&format!(r#"{{"mode": "non_mp", "io": "buffered", "checkpoint_writeback": "{v}", "tenants": [{{"name": "a"}}]}}"#));
    assert!(spec_of("before_slots").checkpoint_before_slots);
    assert!(!spec_of("after_slots").checkpoint_before_slots);
}

/// Buffered: a shorter put into a slot still dirty leaves the earlier put's pages past its
/// end dirty, and writeback writes them; a load of a dirty slot comes from the page cache.
#[test]
fn buffered_keeps_a_longer_dirty_extent_and_reads_dirty_slots_from_the_cache() {
    let mut b = small(LRU, ONE);
    b.io = IoMode::Buffered;
    b.writeback_puts = 8;
    let g = b.geometry(64 << 20, 0).unwrap();
    let mut sh = IoShaper::new(&b, g, 1);
    let mut out = Vec::new();
    let put = |slot, payload_len| LmOp::Put { slot, identity: slot, payload_len, tenant: 0, pid: None, popularity: 0.0 };
    sh.shape(&put(5, 9000), &mut |io| out.push(*io));
    sh.shape(&put(5, 2000), &mut |io| out.push(*io));
    sh.shape(&LmOp::Load { slot: 5, payload_len: 2000 }, &mut |io| out.push(*io));
    assert!(out.is_empty(), "a dirty slot is read from the page cache: {out:?}");
    sh.shape(&LmOp::Load { slot: 7, payload_len: 2000 }, &mut |io| out.push(*io));
    assert_eq!(out.iter().map(|io| (io.write, io.offset)).collect::<Vec<_>>(), vec![(false, g.slot_offset(7) + g.header_bytes)]);
    out.clear();
    sh.flush(&mut |io| out.push(*io));
    assert_eq!(out.iter().map(|io| io.len).sum::<u64>(), 4096 + 12288, "the first put's third page is still dirty");
    assert_eq!(out[0].header.map(|h| h.payload_len), Some(2000), "with the newest header");
    // Written back: the next put starts a new extent.
    out.clear();
    sh.shape(&put(5, 2000), &mut |io| out.push(*io));
    sh.flush(&mut |io| out.push(*io));
    assert_eq!(out.iter().map(|io| io.len).sum::<u64>(), 4096 + 4096);
}

/// io_uring: a store's keys go out in batches of 64, every request once; with a window
/// of 0 in submission order, with a larger one some payloads before their header but no
/// request further back than the window.
#[test]
fn io_uring_batches_keys_and_reorders_within_the_window() {
    let mut s = small(LRU, ONE);
    s.io = IoMode::IoUring;
    let g = s.geometry(256 << 20, 0).unwrap();
    let put = |slot: u64| LmOp::Put { slot, identity: slot + 1, payload_len: 600_000, tenant: 0, pid: None, popularity: 0.0 };
    // Submission order: per key the header, then two payload pieces.
    let submitted = |keys: std::ops::Range<u64>| -> Vec<(u64, u64)> {
        keys.flat_map(|k| {
            let o = g.slot_offset(k);
            [(o, 4096), (o + 4096, 524288), (o + 4096 + 524288, 602112 - 524288)]
        })
        .collect()
    };
    for window in [0u64, 8] {
        s.uring_reorder_window = window;
        let mut sh = IoShaper::new(&s, g, 3);
        let mut out = Vec::new();
        for k in 0..70 {
            sh.shape(&put(k), &mut |io| out.push(*io));
        }
        // The first 64 keys went as one batch; the other 6 wait for the end of the store.
        assert_eq!(out.len(), 64 * 3);
        sh.end_store(&mut |io| out.push(*io));
        assert_eq!(out.len(), 70 * 3);
        let got: Vec<(u64, u64)> = out.iter().map(|io| (io.offset, io.len)).collect();
        let want = submitted(0..70);
        assert!(out.iter().all(|io| io.header.is_some() == (io.len == 4096)));
        if window == 0 {
            assert_eq!(got, want);
            continue;
        }
        let mut sorted = got.clone();
        sorted.sort_unstable();
        let mut w2 = want.clone();
        w2.sort_unstable();
        assert_eq!(sorted, w2, "every request exactly once");
        // Within its batch a request is delivered less than a window from where it was
        // submitted (it ranks at its index plus less than the window).
        let (first, second) = (&got[..64 * 3], &got[64 * 3..]);
        let pos = |r: &(u64, u64), v: &[(u64, u64)]| v.iter().position(|x| x == r).unwrap();
        for (i, r) in want[..64 * 3].iter().enumerate() {
            assert!(pos(r, first).abs_diff(i) < window as usize, "{r:?} submitted {i}, delivered {}", pos(r, first));
        }
        assert!(second.iter().all(|r| want[64 * 3..].contains(r)), "batches do not mix");
        let early = (0..70u64)
            .filter(|&k| pos(&(g.slot_offset(k) + 4096, 524288), &got) < pos(&(g.slot_offset(k), 4096), &got))
            .count();
        assert!(early > 0, "some payload came before its header");
    }
    // A checkpoint writes the gathered keys first; its payload and header are one batch,
    // in order without a window, in either order with one (LMCache's checkpoint batch).
    for window in [0u64, 8] {
        s.uring_reorder_window = window;
        let mut sh = IoShaper::new(&s, g, 3);
        let mut out = Vec::new();
        sh.shape(&put(1), &mut |io| out.push(*io));
        assert!(out.is_empty());
        let mut header_first = 0;
        for seq in 1..=40 {
            let start = out.len();
            sh.shape(&LmOp::Checkpoint { seq, json_bytes: 100, entries: &[], json: None }, &mut |io| out.push(*io));
            let cp = &out[start..];
            assert_eq!(cp.len(), if seq == 1 { 3 + 2 } else { 2 });
            let cp = &cp[cp.len() - 2..];
            assert!(cp.iter().all(|io| io.offset < g.meta_total_bytes) && cp.iter().filter(|io| io.checkpoint.is_some()).count() == 1);
            header_first += usize::from(cp[0].checkpoint.is_some());
        }
        if window == 0 {
            assert_eq!(header_first, 0, "posix order: payload, then header");
        } else {
            assert!((1..40).contains(&header_first), "{header_first} of 40 headers first");
        }
    }
}

/// Two tenants with buckets of their own ("a", "b": salts with a prefix) and one without.
const THREE_BUCKETS: &str = r#"{"name": "a", "salt": "a:1", "share": 0.5, "universe": 4, "doc_chunks": [1, 8]},
    {"name": "b", "salt": "B:2", "share": 0.5, "universe": 4, "doc_chunks": [1, 8]},
    {"name": "c", "salt": "nosalt", "share": 0.2, "universe": 1, "doc_chunks": [1, 2]}"#;

#[test]
fn pid_affinity_reuses_a_buckets_own_slots() {
    let s = small(LRU, THREE_BUCKETS);
    let fdp = LmcacheFdpMode { data_pids: vec![2, 3, 4] };
    let mut w = Workload::new(s, 64 << 20, 0, 4, Some(fdp)).unwrap();
    let mut last_pid: HashMap<u64, u16> = HashMap::new();
    let (mut same, mut other) = (0, 0);
    for _ in 0..8000 {
        w.step(&mut |op| {
            if let LmOp::Put { slot, tenant, pid: Some(pid), .. } = *op {
                // Buckets by the salt's prefix, case-folded; a salt without ':' gets none.
                assert_eq!(pid == 0, tenant == 2);
                match last_pid.get(&slot) {
                    Some(&p) if p != 0 && pid != 0 => {
                        if p == pid {
                            same += 1
                        } else {
                            other += 1
                        }
                    }
                    _ => {}
                }
                last_pid.insert(slot, pid);
            }
        });
    }
    // Reuses between the two data ids keep the slot within its id far more often than
    // chance (half): the global pool is only the fallback when an id has no freed slot,
    // and the salt-less tenant draws from it too.
    assert!(2 * same > 3 * other, "same {same}, other {other}");
    w.audit().unwrap();
    // The free stacks keep stale entries (a slot taken from the other stack) only up to twice
    // the slots: a long run does not grow them.
    let bound = w.compact_over;
    let (mut longest, mut deletes) = (0, w.stats.deletes);
    for _ in 0..40_000 {
        w.step(&mut |_| {});
        longest = longest.max(w.free.len()).max(w.free_by_pid.iter().map(Vec::len).max().unwrap_or(0));
    }
    deletes = w.stats.deletes - deletes;
    assert!(deletes > 4 * bound as u64 && longest <= bound + 1, "{deletes} deletes, longest stack {longest}, bound {bound}");
    w.audit().unwrap();
}

/// Dropping what `alloc` would skip leaves the order of what it takes: a run compacting its
/// free stacks at every delete makes the very operations of one that never does.
#[test]
fn compacting_the_free_stacks_changes_no_operation() {
    let s = small(LRU, THREE_BUCKETS);
    let fdp = || Some(LmcacheFdpMode { data_pids: vec![2, 3, 4] });
    let mut always = Workload::new(s.clone(), 64 << 20, 0, 4, fdp()).unwrap();
    let mut never = Workload::new(s, 64 << 20, 0, 4, fdp()).unwrap();
    always.compact_over = 0;
    never.compact_over = usize::MAX;
    let (a, always) = drive(always, 20_000);
    let (b, never) = drive(never, 20_000);
    assert!(a == b, "the operations differ");
    assert!(never.free.len() > always.free.len() && always.stats.deletes > 10_000, "{} {} {}", never.free.len(), always.free.len(), always.stats.deletes);
}

/// Dropping what `alloc` would skip leaves the order of what it takes.
#[test]
fn compacting_a_free_stack_keeps_the_topmost_live_entry_of_each_slot_in_order() {
    let mut stack = vec![1, 2, 3, 1, 4, 2, 5];
    let live = [false, true, true, false, true, false];
    super::compact_stack(&mut stack, &mut Vec::new(), |s| live.get(s as usize).copied().unwrap_or(false));
    assert_eq!(stack, vec![1, 4, 2]);
}

#[test]
fn reputs_into_a_listed_slot_are_counted_as_the_op_stream_shows_them() {
    // Loads remove what they read, so a document asked for again is put again, and LIFO
    // reuse often hands it a slot a checkpoint still lists for it.
    let s = spec(
        r#"{"mode": "non_mp", "slot_bytes": "1M", "meta_total_bytes": "4M", "write_rate_mb_s": 1, "remove_after_read": true,
            "tenants": [{"zipf": 1.2, "universe": 0.5, "system_prompts": 1, "prefix_chunks": 0, "doc_chunks": [1, 3], "unique_tail_chunks": 0}]}"#,
    );
    let mut w = Workload::new(s, 64 << 20, 0, 5, None).unwrap();
    let g = w.geometry;
    // The oracle: what each container's committed checkpoint lists per slot, from the
    // checkpoints' entries and the puts' lengths as emitted.
    let n = g.max_slots as usize;
    let mut len_now = vec![0u64; n];
    let mut listed = [vec![(0u64, 0u64, false); n], vec![(0u64, 0u64, false); n]];
    let (mut reputs, mut over_tail, mut both) = (0u64, 0u64, 0u64);
    for _ in 0..20_000 {
        w.step(&mut |op| match *op {
            LmOp::Put { slot, identity, payload_len, .. } => {
                let hits: Vec<bool> = listed.iter().filter(|c| c[slot as usize].0 == identity && identity != 0).map(|c| c[slot as usize].2).collect();
                reputs += u64::from(!hits.is_empty());
                both += u64::from(hits.len() == 2);
                over_tail += u64::from(hits.iter().any(|&t| t));
                for c in &mut listed {
                    let l = &mut c[slot as usize];
                    l.2 |= g.payload_end(payload_len) < g.payload_end(l.1);
                }
                len_now[slot as usize] = payload_len;
            }
            LmOp::Checkpoint { seq, entries, .. } => {
                let c = &mut listed[((seq - 1) % 2) as usize];
                c.fill((0, 0, false));
                for e in entries {
                    c[e.slot as usize] = (e.identity, len_now[e.slot as usize], false);
                }
            }
            _ => {}
        });
    }
    w.audit().unwrap();
    assert_eq!((w.stats.reputs_listed, w.stats.reputs_listed_over_tail), (reputs, over_tail));
    // Some re-puts are listed by both containers: each counts once.
    assert!(over_tail > 0 && reputs > over_tail && both > 0, "{reputs} re-puts, {over_tail} over a tail, {both} listed twice");
}

#[test]
fn a_checkpoint_past_its_container_is_not_written_nor_built() {
    // 32 KiB containers hold about 100 entries: the first checkpoint (60 slots written at
    // 1 MB/s) fits, the device's 250 slots do not.
    let s = spec(&format!(r#"{{"slot_bytes": "1M", "meta_total_bytes": "64K", "write_rate_mb_s": 1, {LRU} "tenants": [{ONE}]}}"#));
    let mut w = Workload::new(s, 256 << 20, 0, 2, None).unwrap();
    w.emit_json(true);
    let cap = w.geometry.payload_cap();
    let mut written = 0;
    for _ in 0..20000 {
        w.step(&mut |op| {
            if let LmOp::Checkpoint { json: Some(j), json_bytes, .. } = op {
                assert!(*json_bytes <= cap && j.len() as u64 == *json_bytes);
                written += 1;
            }
        });
    }
    assert!(written > 0, "the first checkpoints fit");
    assert!(w.stats.checkpoints_overflow > 0, "later ones do not");
    assert!(w.json.is_empty(), "the last, too large, was not built");
}

#[test]
fn a_non_mp_checkpoints_size_is_predicted_with_its_unpadded_chunk_hashes() {
    // Legacy keys carry Python's `f"{chunk_hash:x}"`: one hash in 16 has fewer than 16 digits.
    let s = spec(
        r#"{"mode": "non_mp", "slot_bytes": "64K", "meta_total_bytes": "4M", "write_rate_mb_s": 1, "remove_after_read": true,
            "tenants": [{"zipf": 0.9, "universe": 2, "system_prompts": 1, "prefix_chunks": 0, "doc_chunks": [1, 16], "unique_tail_chunks": 0}]}"#,
    );
    let mut sized = Workload::new(s.clone(), 256 << 20, 0, 3, None).unwrap();
    let mut w = Workload::new(s, 256 << 20, 0, 3, None).unwrap();
    w.emit_json(true);
    let (mut predicted, mut got) = (Vec::new(), Vec::new());
    for _ in 0..5000 {
        sized.step(&mut |op| {
            if let LmOp::Checkpoint { json_bytes, .. } = op {
                predicted.push(*json_bytes);
            }
        });
        w.step(&mut |op| {
            if let LmOp::Checkpoint { json: Some(j), .. } = op {
                got.push(j.len() as u64);
            }
        });
    }
    assert!(got.len() >= 2 && got.iter().all(|&n| n > 100 * 150), "{got:?}: checkpoints of hundreds of entries");
    assert_eq!(predicted, got);
}

/// A request that writes for longer than a checkpoint interval, with evictions between the
/// ticks, commits several checkpoints: each goes out with its own seq (so into alternate
/// containers) and its own entries and JSON, as LMCache's checkpoint thread writes them.
#[test]
fn checkpoints_committed_within_one_request_keep_their_own_seq_and_contents() {
    // 1 s per 1 MiB slot, a checkpoint tick every second: a request of up to 9 chunks spans
    // several ticks, and the eviction controller (every 1.7 s) deletes between them.
    let s = spec(&format!(
        r#"{{"slot_bytes": "1M", "meta_total_bytes": "4M", "write_rate_mb_s": 1, "checkpoint_interval_s": 1, "eviction": {{"policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2, "interval_s": 1.7}}, "tenants": [{ONE}]}}"#
    ));
    let mut w = Workload::new(s.clone(), 64 << 20, 0, 2, None).unwrap();
    w.emit_json(true);
    let (mut last_seq, mut several) = (0, 0);
    for _ in 0..2000 {
        let mut in_step: Vec<(u64, Vec<u64>)> = Vec::new();
        w.step(&mut |op| {
            if let LmOp::Checkpoint { seq, json: Some(j), entries, json_bytes } = op {
                assert_eq!(j.len() as u64, *json_bytes);
                let mut slots = Vec::new();
                parse_checkpoint_json(*j, &JsonLimits::default(), &mut |e| {
                    slots.push((e.offset.unwrap() - s.meta_total_bytes) / s.slot_bytes);
                    Ok(())
                })
                .unwrap();
                slots.sort_unstable();
                let mut listed: Vec<u64> = entries.iter().map(|e| e.slot).collect();
                listed.sort_unstable();
                assert_eq!(slots, listed, "checkpoint {seq}: its JSON lists its own entries");
                in_step.push((*seq, slots));
            }
        });
        for (seq, _) in &in_step {
            assert_eq!(*seq, last_seq + 1, "one seq after another");
            last_seq = *seq;
        }
        if in_step.len() >= 2 {
            several += 1;
            assert!(in_step.windows(2).any(|p| p[0].1 != p[1].1), "the eviction between them shows");
        }
    }
    assert!(several > 0, "some requests committed several checkpoints");
}

/// LMCache 0.5.6's LRU (`eviction_policy/lru.py`) takes a request's keys last chunk first,
/// both when a store adds them and when a load refreshes them, so the request's first chunk
/// ends most recent and its later chunks go first; a put of a key already present does not
/// refresh it (`put_many` skips it). `"lru_insert": "forward"` takes both the other way.
#[test]
fn a_requests_loads_and_puts_enter_the_lru_in_lmcaches_order() {
    for (order, reversed) in [("", true), (r#""lru_insert": "forward","#, false)] {
        let s = small(&format!("{LRU} {order}"), ONE);
        let mut w = Workload::new(s, 512 << 20, 0, 1, None).unwrap();
        let (mut checked, mut noops) = (0, 0);
        for _ in 0..5000 {
            let (mut loads, mut puts) = (Vec::new(), Vec::new());
            let (noop0, evictions0) = (w.stats.puts_noop, w.stats.evictions);
            w.step(&mut |op| match *op {
                LmOp::Load { slot, .. } => loads.push(slot as u32),
                LmOp::Put { slot, .. } => puts.push(slot as u32),
                _ => {}
            });
            if w.stats.evictions != evictions0 {
                continue; // an eviction may have taken some of them
            }
            let mut want: Vec<u32> = Vec::new();
            if reversed {
                want.extend(&puts);
                want.extend(&loads);
            } else {
                want.extend(puts.iter().rev());
                want.extend(loads.iter().rev());
            }
            // The MRU end, walked back from the tail.
            let mut got = Vec::new();
            let mut s = w.global_lru.tail;
            while got.len() < want.len() && s != NONE {
                got.push(s);
                s = w.slots[s as usize].prev;
            }
            assert_eq!(got, want, "order {order:?}: loads {loads:?}, puts {puts:?}");
            checked += u64::from(!loads.is_empty() && !puts.is_empty());
            if w.stats.puts_noop != noop0 {
                // A no-op put's key was not moved: it is not among the request's MRU keys.
                noops += 1;
            }
        }
        assert!(checked > 100 && noops > 0, "{checked} requests with loads and puts, {noops} with no-op puts");
    }
}

/// With an L1 (`l1_share`), LMCache MP serves the chunks L1 holds without reading the
/// device and loads only the rest; every stored chunk enters L1, and a chunk L1 holds is not
/// put to the device again. Without one, every hit is a device load.
#[test]
fn an_l1_serves_what_it_holds_and_loads_only_the_rest() {
    let s = small(&format!(r#"{LRU} "l1_share": 0.2,"#), ONE);
    let mut w = Workload::new(s, 512 << 20, 0, 1, None).unwrap();
    let cap = (0.2 * w.geometry.max_slots as f64).round() as usize;
    for _ in 0..5000 {
        let (mut loads, mut puts) = (Vec::new(), Vec::new());
        w.step(&mut |op| match *op {
            LmOp::Load { slot, .. } => loads.push(slot as usize),
            LmOp::Put { slot, .. } => puts.push(slot as usize),
            _ => {}
        });
        for &s in &loads {
            assert!(!w.l1.contains(w.slots[s].id), "slot {s} loaded from the device while L1 holds its key");
        }
        for &s in &puts {
            assert!(w.l1.contains(w.slots[s].id), "slot {s} put without entering L1");
        }
    }
    let st = &w.stats;
    assert_eq!(st.hits, st.l1_hits + st.loads);
    assert!(st.l1_hits > st.hits / 5 && st.loads > 0 && w.l1.len() == cap, "{st:?}");
    // No L1: every hit reads the device.
    let (_, w) = drive(Workload::new(small(LRU, ONE), 512 << 20, 0, 1, None).unwrap(), 2000);
    assert_eq!((w.stats.l1_hits, w.stats.loads), (0, w.stats.hits));
    // An L1 only where the model has one, of at most the cache's size.
    let bad = |extra: &str| WorkloadSpec::from_json_str(&format!(r#"{{{extra}, "tenants": [{ONE}]}}"#)).unwrap_err();
    assert!(bad(r#""mode": "non_mp", "l1_share": 0.1"#).contains("MP option"));
    assert!(bad(r#""l1_share": 1.5"#).contains("0 to 1"));
}
