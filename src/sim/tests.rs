//! Model tests: validation against the analytic WAF, the FDP special cases (WAF 1 for FIFO
//! and whole-RU invalidation), handle isolation, counters and configuration errors.

use super::*;
use std::collections::{BTreeMap, BTreeSet};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn ssd(cfg: SsdConfig) -> Ssd {
    Ssd::new(cfg).unwrap()
}

/// Fills the logical space sequentially, then does `warm` and `measure` uniform random
/// single-unit overwrites; returns the WAF over the measured window.
fn uniform_waf(ssd: &mut Ssd, seed: u64, warm: u64, measure: u64) -> f64 {
    let unit = ssd.config().unit_bytes;
    let units = ssd.logical_bytes() / unit;
    let mut rng = SplitMix64(seed);
    ssd.write(0, units * unit, 0).unwrap();
    for _ in 0..warm {
        ssd.write(rng.below(units) * unit, unit, 0).unwrap();
    }
    let before = ssd.counters().clone();
    for _ in 0..measure {
        ssd.write(rng.below(units) * unit, unit, 0).unwrap();
    }
    ssd.counters().since(&before).waf()
}

/// Uniform random overwrite of a device with `rus` RUs of `upr` 4 KiB units and over-provisioning
/// `op` (fraction of physical). Returns (simulated WAF, analytic WAF for the space that really
/// holds data, analytic WAF for the nominal OP).
///
/// Open RUs and the GC reserve consume spare space. Measured with the FIFO victim policy,
/// whose WAF does not depend on the RU size, the space lost to them is W + ½ RUs (W =
/// `free_ru_low_watermark`): the reserve, which is always empty, plus on average half of the
/// host's open RU. The GC RU's empty part costs nothing, because the data in it simply waits
/// longer before it reaches the head of the log (`fifo_matches_analytic_with_the_open_ru_correction`
/// pins this down). So the model is compared with α = (physical − (W + ½) RUs) / logical.
fn validation_run(victim: Victim, rus: u64, upr: u64, op: f64, passes: u64) -> (f64, f64, f64) {
    let unit = 4 * KIB;
    let ru = upr * unit;
    let physical = rus * ru;
    let logical = (physical as f64 * (1.0 - op)) as u64 / unit * unit;
    let mut cfg = SsdConfig::new(logical, physical, unit, ru, 1, HandleType::InitiallyIsolated);
    cfg.gc.victim = victim;
    let w = f64::from(cfg.gc.free_ru_low_watermark);
    let mut s = ssd(cfg);
    let lu = logical / unit;
    let sim = uniform_waf(&mut s, 0x5eed, passes * lu, passes * lu);
    s.audit().unwrap();
    let alpha_eff = (rus as f64 - w - 0.5) * upr as f64 / lu as f64;
    (sim, analytic_waf_alpha(alpha_eff), analytic_waf_uniform(op))
}

/// Greedy GC, 1024 RUs of 1024 units (4 MiB RUs of 4 KiB pages, 4 GiB physical): one
/// sequential fill, one pass of random overwrites to reach steady state, one measured pass.
/// Greedy needs large RUs to reach the analytic (large-erase-unit) limit: with 64 units per RU
/// it is ~9 % below at 7 % OP, with 256 ~3 %, with 1024 ~1 %.
fn check_greedy_validation(op: f64, table: f64) {
    let (sim, corrected, nominal) = validation_run(Victim::Greedy, 1024, 1024, op, 1);
    eprintln!("greedy op {op}: simulated {sim:.3}, analytic {corrected:.3} (nominal {nominal:.3})");
    assert!((nominal - table).abs() < 0.006, "table value {table} vs {nominal}");
    // The spare it really has, sharply; the nominal value within the 3 % the model promises.
    assert!((sim / corrected - 1.0).abs() < 0.015, "op {op}: simulated {sim:.3} vs analytic {corrected:.3}");
    assert!((sim / nominal - 1.0).abs() < 0.03, "op {op}: simulated {sim:.3} vs nominal {nominal:.3}");
    // Where the two differ by more than the tolerance (7 % OP: 1.9 %), nearer the real spare's.
    if (corrected / nominal - 1.0).abs() > 0.015 {
        assert!((sim - corrected).abs() < (sim - nominal).abs(), "op {op}: simulated {sim:.3} is nearer the nominal {nominal:.3}");
    }
}

#[test]
fn validation_uniform_random_greedy_op07() {
    check_greedy_validation(0.07, 7.32);
}

#[test]
fn validation_uniform_random_greedy_op20() {
    check_greedy_validation(0.20, 2.69);
}

#[test]
fn validation_uniform_random_greedy_op28() {
    check_greedy_validation(0.28, 1.99);
}

/// The headline drive of docs/waf.md (1.88 TB logical, 7 % OP, 1 MiB units, 6 GB RUs: 336
/// whole RUs, the rest of a 337th unused) under uniform random overwrites, greedy: within 1.5 %
/// of the analytic WAF for the spare it really has (whole RUs, less the reserve and half an
/// open RU), which lies above the nominal 7 % value. docs/waf.md quotes both
/// (`cargo test --release --lib headline_drive -- --nocapture`).
#[test]
fn validation_uniform_random_greedy_on_the_headline_drive() {
    let unit = MIB;
    let logical = 1_880_000_000_000 / unit * unit;
    let ru = 6_000_000_000 / unit * unit;
    let physical = SsdConfig::physical_for_op(logical, 0.07);
    let cfg = SsdConfig::new(logical, physical, unit, ru, 1, HandleType::InitiallyIsolated);
    let w = f64::from(cfg.gc.free_ru_low_watermark);
    let mut s = ssd(cfg);
    let lu = logical / unit;
    let sim = uniform_waf(&mut s, 0x5eed, 2 * lu, 2 * lu);
    s.audit().unwrap();
    let whole = (physical / ru) as f64;
    let corrected = analytic_waf_alpha((whole - w - 0.5) * (ru / unit) as f64 / lu as f64);
    let nominal = analytic_waf_uniform(0.07);
    eprintln!("headline drive ({whole} whole RUs): simulated {sim:.3}, analytic for its spare {corrected:.3}, nominal {nominal:.3}");
    assert!((sim / corrected - 1.0).abs() < 0.015, "simulated {sim:.3} vs analytic {corrected:.3}");
}

#[test]
fn fifo_matches_analytic_with_the_open_ru_correction() {
    // Few, large RUs: FIFO's WAF does not depend on their size, and half an RU is then a large
    // part of the spare (at 7 % OP, 128 RUs hold 9 spare ones: each half moves the WAF by
    // about 6 %), so the correction is told apart from W + 0 and W + 1 RUs, not only within
    // a tolerance of the analytic value.
    let (rus, upr, unit) = (128u64, 256u64, 4 * KIB);
    for op in [0.07, 0.20] {
        let physical = rus * upr * unit;
        let logical = (physical as f64 * (1.0 - op)) as u64 / unit * unit;
        let mut cfg = SsdConfig::new(logical, physical, unit, upr * unit, 1, HandleType::InitiallyIsolated);
        cfg.gc.victim = Victim::Fifo;
        let w = f64::from(cfg.gc.free_ru_low_watermark);
        let mut s = ssd(cfg);
        let lu = logical / unit;
        let sim = uniform_waf(&mut s, 0x5eed, 3 * lu, 6 * lu);
        s.audit().unwrap();
        let lost = |x: f64| analytic_waf_alpha((rus as f64 - w - x) * upr as f64 / lu as f64);
        let (none, half, one) = (lost(0.0), lost(0.5), lost(1.0));
        eprintln!("fifo op {op}: simulated {sim:.3}; analytic with W + 0, ½, 1 RUs lost: {none:.3}, {half:.3}, {one:.3}");
        assert!((sim / half - 1.0).abs() < 0.01, "op {op}: simulated {sim:.3} vs analytic {half:.3}");
        assert!((sim - half).abs() < (sim - none).abs().min((sim - one).abs()), "op {op}: simulated {sim:.3} is nearer another correction");
    }
}

/// The 8-handle FIFO drive of the open-RU tests: 512 RUs of 64 4 KiB units, 7 % OP. Returns
/// its configuration, RUs, units per RU and logical units.
fn eight_handle_fifo_drive() -> (SsdConfig, u64, u64, u64) {
    let (rus, upr, op) = (512u64, 64u64, 0.07);
    let unit = 4 * KIB;
    let ru = upr * unit;
    let logical = ((rus * ru) as f64 * (1.0 - op)) as u64 / unit * unit;
    let mut cfg = SsdConfig::new(logical, rus * ru, unit, ru, 8, HandleType::InitiallyIsolated);
    cfg.gc.victim = Victim::Fifo;
    (cfg, rus, upr, logical / unit)
}

/// With `hold_open_rus`, each handle never written keeps one RU out of the spare: uniform
/// random writes on handle 0 of an 8-handle drive match the analytic WAF with 7 RUs more
/// lost, and without it the one-handle correction.
#[test]
fn every_handle_holds_an_open_ru_when_asked() {
    for hold in [false, true] {
        let (mut cfg, rus, upr, lu) = eight_handle_fifo_drive();
        cfg.hold_open_rus = hold;
        let lost = f64::from(cfg.gc.free_ru_low_watermark) + 0.5 + if hold { 7.0 } else { 0.0 };
        let mut s = ssd(cfg);
        let sim = uniform_waf(&mut s, 0x5eed, 2 * lu, 2 * lu);
        s.audit().unwrap();
        let analytic = analytic_waf_alpha((rus as f64 - lost) * upr as f64 / lu as f64);
        eprintln!("hold {hold}: simulated {sim:.3}, analytic {analytic:.3}");
        assert!((sim / analytic - 1.0).abs() < 0.015, "hold {hold}: simulated {sim:.3} vs analytic {analytic:.3}");
    }
}

#[test]
fn sequential_overwrite_is_waf_one() {
    for victim in [Victim::Greedy, Victim::CostBenefit, Victim::Fifo] {
        let logical = 64 * MIB;
        let mut cfg = SsdConfig::new(
            logical,
            SsdConfig::physical_for_op(logical, 0.10),
            64 * KIB,
            MIB,
            1,
            HandleType::InitiallyIsolated,
        );
        cfg.gc.victim = victim;
        let mut s = ssd(cfg);
        s.write(0, logical, 0).unwrap();
        let warm = s.counters().clone();
        // Ten device writes in odd-sized requests that straddle RU boundaries.
        let mut off = 0;
        let req = 3 * MIB + 256 * KIB;
        for _ in 0..10 * logical / req {
            let len = req.min(logical - off);
            s.write(off, len, 0).unwrap();
            off = (off + len) % logical;
        }
        let d = s.counters().since(&warm);
        assert_eq!(d.relocated_bytes, 0, "{victim:?}");
        assert_eq!(d.waf(), 1.0, "{victim:?}");
        assert!(d.gc_events > 100, "{victim:?}: GC ran ({})", d.gc_events);
        s.audit().unwrap();
    }
}

#[test]
fn trim_of_whole_rus_is_waf_one() {
    // A host that keeps half the device live in RU-sized extents and, at random, TRIMs a live
    // extent and writes a dead one: every RU dies whole, so GC never copies anything.
    let ru = 4 * MIB;
    let logical = 128 * ru;
    let mut s = ssd(SsdConfig::new(
        logical,
        SsdConfig::physical_for_op(logical, 0.07),
        64 * KIB,
        ru,
        1,
        HandleType::InitiallyIsolated,
    ));
    let n = logical / ru;
    let (mut live, mut dead): (Vec<u64>, Vec<u64>) = (0..n).partition(|i| i % 2 == 0);
    for &e in &live {
        s.write(e * ru, ru, 0).unwrap();
    }
    let mut rng = SplitMix64(7);
    for _ in 0..20 * n {
        let i = rng.below(live.len() as u64) as usize;
        let j = rng.below(dead.len() as u64) as usize;
        s.deallocate(live[i] * ru, ru).unwrap();
        s.write(dead[j] * ru, ru, 0).unwrap();
        std::mem::swap(&mut live[i], &mut dead[j]);
    }
    let c = s.counters();
    assert_eq!(c.relocated_bytes, 0);
    assert_eq!(c.waf(), 1.0);
    assert!(c.gc_events > 10 * n);
    assert_eq!(c.deallocated_bytes, 20 * n * ru);
    s.audit().unwrap();
}

/// Hot/cold workload: 1/8 of the logical space takes 7/8 of the writes. `hot` and `cold` are
/// the handles each range is written with.
fn hot_cold_waf(cfg: SsdConfig, hot: u16, cold: u16, seed: u64) -> (Ssd, f64) {
    let unit = cfg.unit_bytes;
    let mut s = ssd(cfg);
    let units = s.logical_bytes() / unit;
    let hot_units = units / 8;
    s.write(0, hot_units * unit, hot).unwrap();
    s.write(hot_units * unit, (units - hot_units) * unit, cold).unwrap();
    let mut rng = SplitMix64(seed);
    let mut step = |s: &mut Ssd| {
        if rng.below(8) < 7 {
            s.write(rng.below(hot_units) * unit, unit, hot).unwrap();
        } else {
            s.write((hot_units + rng.below(units - hot_units)) * unit, unit, cold).unwrap();
        }
    };
    for _ in 0..3 * units {
        step(&mut s);
    }
    let before = s.counters().clone();
    for _ in 0..3 * units {
        step(&mut s);
    }
    let waf = s.counters().since(&before).waf();
    (s, waf)
}

fn hot_cold_cfg(kind: HandleType, victim: Victim) -> SsdConfig {
    let unit = 16 * KIB;
    let ru = 64 * unit;
    let logical = 256 * ru;
    let mut cfg = SsdConfig::new(logical, SsdConfig::physical_for_op(logical, 0.10), unit, ru, 2, kind);
    cfg.gc.victim = victim;
    cfg
}

/// The victim choice matters where lifetimes mix: hot and cold data on one handle (7 writes
/// in 8 to an eighth of the space). The oldest RU (FIFO) moves cold data that never dies;
/// greedy and cost-benefit pick RUs the hot data emptied. A greedy or cost-benefit choice
/// that fell back to oldest-first passes the uniform validation, not this.
#[test]
fn greedy_and_cost_benefit_beat_fifo_on_mixed_lifetimes() {
    let waf = |v| hot_cold_waf(hot_cold_cfg(HandleType::InitiallyIsolated, v), 0, 0, 3).1;
    let (fifo, greedy, cb) = (waf(Victim::Fifo), waf(Victim::Greedy), waf(Victim::CostBenefit));
    // FIFO 6.286, greedy 5.564, cost-benefit 3.801 (greedy's known weakness with hot and
    // cold data, which cost-benefit was made for).
    assert!(greedy < 0.92 * fifo && cb < 0.8 * greedy, "FIFO {fifo:.3}, greedy {greedy:.3}, cost-benefit {cb:.3}");
}

/// An RU with no valid data left goes before any other under cost-benefit too: erasing it
/// copies nothing, however young it is (LFS counts such segments clean). Here an old RU
/// holding one valid unit in 16 outscores a young empty one on (1 − u) · age / (1 + u).
#[test]
fn cost_benefit_takes_an_empty_ru_before_copying_anything() {
    let unit = 4 * KIB;
    let ru = 16 * unit;
    let mut cfg = SsdConfig::new(32 * unit, 6 * ru, unit, ru, 1, HandleType::InitiallyIsolated);
    cfg.gc.victim = Victim::CostBenefit;
    let mut s = ssd(cfg);
    s.write(0, 32 * unit, 0).unwrap();
    s.deallocate(unit, 15 * unit).unwrap();
    for _ in 0..3 {
        s.write(16 * unit, 16 * unit, 0).unwrap();
    }
    let before = s.counters().clone();
    s.write(16 * unit, 16 * unit, 0).unwrap();
    s.audit().unwrap();
    assert_eq!(s.counters().since(&before).relocated_bytes, 0, "garbage collection copied data while an empty RU waited");
}

/// LMCache-like: a small hot region (1/16 of the space, like metadata) rewritten at random,
/// and a large cold region written as a circular log (like slots under LRU), half the writes
/// each.
fn hot_random_cold_log_waf(cfg: SsdConfig, hot: u16, cold: u16) -> f64 {
    let unit = cfg.unit_bytes;
    let mut s = ssd(cfg);
    let units = s.logical_bytes() / unit;
    let hot_units = units / 16;
    let cold_units = units - hot_units;
    s.write(0, units * unit, cold).unwrap();
    let mut rng = SplitMix64(21);
    let mut next = 0;
    let mut step = |s: &mut Ssd| {
        if rng.below(2) == 0 {
            s.write(rng.below(hot_units) * unit, unit, hot).unwrap();
        } else {
            s.write((hot_units + next) * unit, unit, cold).unwrap();
            next = (next + 1) % cold_units;
        }
    };
    for _ in 0..4 * units {
        step(&mut s);
    }
    let before = s.counters().clone();
    for _ in 0..4 * units {
        step(&mut s);
    }
    s.audit().unwrap();
    s.counters().since(&before).waf()
}

#[test]
fn separating_lifetimes_beats_mixing_them() {
    // Same drive either way; "mixed" puts both streams on handle 0. RUs open on first write,
    // so separation holds one more open RU than mixing (two more with PI's own GC RUs): the
    // spare it loses makes these comparisons conservative.
    for victim in [Victim::Greedy, Victim::CostBenefit] {
        let (_, mixed) = hot_cold_waf(hot_cold_cfg(HandleType::PersistentlyIsolated, victim), 0, 0, 1);
        let (_, pi) = hot_cold_waf(hot_cold_cfg(HandleType::PersistentlyIsolated, victim), 0, 1, 1);
        let (_, ii) = hot_cold_waf(hot_cold_cfg(HandleType::InitiallyIsolated, victim), 0, 1, 1);
        let lm = hot_random_cold_log_waf(hot_cold_cfg(HandleType::PersistentlyIsolated, victim), 0, 0);
        let lpi = hot_random_cold_log_waf(hot_cold_cfg(HandleType::PersistentlyIsolated, victim), 0, 1);
        let lii = hot_random_cold_log_waf(hot_cold_cfg(HandleType::InitiallyIsolated, victim), 0, 1);
        eprintln!("{victim:?}: random/random mixed {mixed:.3}, separated II {ii:.3}, PI {pi:.3}; random/log mixed {lm:.3} II {lii:.3} PI {lpi:.3}");
        // The FDP design target: a FIFO stream on its own handle dies whole RU by RU.
        assert!(lpi < 0.4 * lm && lii < 0.4 * lm, "{victim:?}: log separated {lii:.3}/{lpi:.3} vs mixed {lm:.3}");
        // Two random streams of different heat: separation still helps, PI more than II.
        assert!(pi < ii && ii < mixed, "{victim:?}: PI {pi:.3}, II {ii:.3}, mixed {mixed:.3}");
    }
}

/// For every mapped unit, the owner of the RU holding it; grouped by RU.
fn owners_by_ru(s: &Ssd, hot_units: u64) -> BTreeMap<u32, (RuOwner, BTreeSet<bool>)> {
    let unit = s.config().unit_bytes;
    let mut out: BTreeMap<u32, (RuOwner, BTreeSet<bool>)> = BTreeMap::new();
    for lu in 0..s.logical_bytes() / unit {
        if let Some(l) = s.locate(lu * unit) {
            out.entry(l.ru).or_insert((l.owner, BTreeSet::new())).1.insert(lu < hot_units);
        }
    }
    out
}

#[test]
fn persistently_isolated_handles_keep_their_data_apart_through_gc() {
    let (s, _) = hot_cold_waf(hot_cold_cfg(HandleType::PersistentlyIsolated, Victim::Greedy), 0, 1, 2);
    let hot_units = s.logical_bytes() / s.config().unit_bytes / 8;
    let mut gc_rus = 0;
    for (ru, (owner, kinds)) in owners_by_ru(&s, hot_units) {
        // Hot data (handle 0) only in handle 0's RUs, cold only in handle 1's.
        match owner {
            RuOwner::Host(h) | RuOwner::HandleGc(h) => {
                assert_eq!(kinds, BTreeSet::from([h == 0]), "RU {ru} of {owner:?}");
                gc_rus += usize::from(matches!(owner, RuOwner::HandleGc(_)));
            }
            RuOwner::SharedGc => panic!("PI data in the shared GC RU {ru}"),
        }
    }
    assert!(gc_rus > 0);
    assert_eq!(s.shared_gc_rus_in_use(), 0);
    let u = s.ruh_usage();
    assert!(u.iter().all(|h| h.gc_rus_in_use > 0 && h.rus_in_use > 0), "{u:?}");
    s.audit().unwrap();
}

#[test]
fn initially_isolated_handles_mix_in_the_shared_gc_ru() {
    let (s, _) = hot_cold_waf(hot_cold_cfg(HandleType::InitiallyIsolated, Victim::Greedy), 0, 1, 3);
    let hot_units = s.logical_bytes() / s.config().unit_bytes / 8;
    let mut mixed = 0;
    for (ru, (owner, kinds)) in owners_by_ru(&s, hot_units) {
        match owner {
            RuOwner::Host(h) => assert_eq!(kinds, BTreeSet::from([h == 0]), "RU {ru}"),
            RuOwner::HandleGc(_) => panic!("II data in a per-handle GC RU {ru}"),
            RuOwner::SharedGc => mixed += usize::from(kinds.len() == 2),
        }
    }
    assert!(mixed > 0, "no shared GC RU holds both handles' data");
    assert!(s.shared_gc_rus_in_use() > 0);
    assert!(s.ruh_usage().iter().all(|h| h.gc_rus_in_use == 0));
}

#[test]
fn mixed_handle_types_relocate_each_to_its_own_target() {
    let mut cfg = hot_cold_cfg(HandleType::InitiallyIsolated, Victim::Greedy);
    cfg.handles = vec![HandleType::PersistentlyIsolated, HandleType::InitiallyIsolated];
    let (s, _) = hot_cold_waf(cfg, 0, 1, 4);
    let hot_units = s.logical_bytes() / s.config().unit_bytes / 8;
    for (ru, (owner, kinds)) in owners_by_ru(&s, hot_units) {
        let expect = match owner {
            RuOwner::Host(h) => h == 0,
            RuOwner::HandleGc(h) => {
                assert_eq!(h, 0, "RU {ru}: only the PI handle has its own GC RU");
                true
            }
            RuOwner::SharedGc => false, // only the II handle (cold) relocates here
        };
        assert_eq!(kinds, BTreeSet::from([expect]), "RU {ru} of {owner:?}");
    }
}

#[test]
fn counters_stay_consistent_under_a_mixed_workload() {
    for victim in [Victim::Greedy, Victim::CostBenefit, Victim::Fifo] {
        let unit = 4 * KIB;
        let ru = 32 * unit;
        let logical = 200 * ru + 3 * KIB; // a partial last unit
        let mut cfg = SsdConfig::new(
            logical,
            SsdConfig::physical_for_op(logical, 0.15),
            unit,
            ru,
            3,
            HandleType::InitiallyIsolated,
        );
        cfg.handles[1] = HandleType::PersistentlyIsolated;
        cfg.gc = GcConfig { victim, free_ru_low_watermark: 3 };
        let mut s = ssd(cfg);
        let mut rng = SplitMix64(11);
        let mut halfway = None;
        for i in 0..60_000u64 {
            if i == 30_000 {
                halfway = Some(s.counters().clone());
            }
            let off = rng.below(logical);
            let len = (1 + rng.below(6 * unit)).min(logical - off);
            match rng.below(20) {
                0 => s.deallocate(off, len).unwrap(),
                1 => s.ruh_update(rng.below(3) as u16).unwrap(),
                _ => s.write(off, len, rng.below(3) as u16).unwrap(),
            }
            if i % 5_000 == 0 {
                s.audit().unwrap();
            }
        }
        s.audit().unwrap();
        let c = s.counters().clone();
        assert_eq!(c.media_bytes, c.host_bytes + c.relocated_bytes);
        assert_eq!(c.erased_bytes, c.rus_erased * ru);
        assert_eq!(c.host_bytes_by_handle.iter().sum::<u64>(), c.host_bytes);
        // GC by the stream that filled each victim: 3 host streams, 3 PI GC streams (handle 1's
        // used), the shared one; victims of host writes and of GC alike, over any window.
        assert_eq!((stream_owner(3, 2), stream_owner(3, 4), stream_owner(3, 6)), (RuOwner::Host(2), RuOwner::HandleGc(1), RuOwner::SharedGc));
        for w in [c.clone(), c.since(halfway.as_ref().unwrap())] {
            assert_eq!(w.gc_victims_by_stream.len(), 7);
            assert_eq!(w.gc_victims_by_stream.iter().sum::<u64>(), w.gc_events);
            assert_eq!(w.relocated_bytes_by_stream.iter().sum::<u64>(), w.relocated_bytes);
            assert!(w.gc_victims_by_stream[..3].iter().sum::<u64>() > 0, "{victim:?}: {:?}", w.gc_victims_by_stream);
            assert!(w.gc_victims_by_stream[4] + w.gc_victims_by_stream[6] > 0, "{victim:?}: {:?}", w.gc_victims_by_stream);
            // Handles 0 and 2 are II: their GC streams never fill an RU.
            assert_eq!(w.gc_victims_by_stream[3] + w.gc_victims_by_stream[5], 0, "{victim:?}");
            for ((v, r), age) in w.gc_victims_by_stream.iter().zip(&w.relocated_bytes_by_stream).zip(&w.victim_age_bytes_by_stream) {
                assert!(*r <= v * ru, "{victim:?}: {r} bytes relocated out of {v} victims");
                // An RU closes after its last write and is taken after the write that needs
                // room: no older than the host bytes of the whole run each.
                assert!(*age <= v * c.host_bytes && (*v > 0 || *age == 0), "{victim:?}: age {age} of {v} victims");
            }
            assert!(w.victim_age_bytes_by_stream.iter().sum::<u64>() > 0, "{victim:?}");
            // Each victim lands in one bucket of its stream's age and valid-share histograms,
            // and its stream's mean age lies within the buckets it filled.
            for (i, &v) in w.gc_victims_by_stream.iter().enumerate() {
                let (ages, valid) = (&w.victim_age_hist_by_stream[i], &w.victim_valid_hist_by_stream[i]);
                assert_eq!((ages.iter().sum::<u64>(), valid.iter().sum::<u64>()), (v, v), "{victim:?} stream {i}");
                if v > 0 {
                    let mean = w.victim_age_bytes_by_stream[i] as f64 / v as f64 / logical as f64 / AGE_HIST_STEP;
                    let lo = ages.iter().position(|&c| c > 0).unwrap() as f64;
                    let hi = ages.iter().rposition(|&c| c > 0).unwrap() as f64 + 1.0;
                    assert!(lo <= mean && (mean <= hi || hi == AGE_HIST_BUCKETS as f64), "{victim:?} stream {i}: mean {mean} outside [{lo}, {hi})");
                }
            }
        }
        assert!(c.host_bytes >= c.host_request_bytes);
        assert!(c.gc_events > 0 && c.ru_updates > 0 && c.deallocated_bytes > 0 && c.padding_bytes > 0);
        // Every mapped unit is counted in exactly one handle's or the shared GC stream's RUs.
        let mapped = (0..logical.div_ceil(unit)).filter(|&u| s.locate(u * unit).is_some()).count() as u64;
        let usage = s.ruh_usage();
        let in_handles: u64 = usage.iter().map(|h| h.valid_bytes).sum();
        let shared: u64 = (0..logical.div_ceil(unit))
            .filter(|&u| s.locate(u * unit).is_some_and(|l| l.owner == RuOwner::SharedGc))
            .count() as u64;
        assert_eq!(in_handles + shared * unit, mapped * unit, "{victim:?}");
        // A window's delta adds back up.
        let d = c.since(&SsdCounters::default());
        assert_eq!(d, c);
    }
}

#[test]
fn partial_units_round_out_on_write_and_in_on_deallocate() {
    let unit = 64 * KIB;
    let mut s = ssd(SsdConfig::new(16 * MIB, 32 * MIB, unit, MIB, 1, HandleType::InitiallyIsolated));
    s.write(unit - 1, 2, 0).unwrap(); // touches units 0 and 1
    let c = s.counters();
    assert_eq!((c.host_request_bytes, c.host_bytes, c.media_bytes), (2, 2 * unit, 2 * unit));
    assert!(s.locate(0).is_some() && s.locate(unit).is_some() && s.locate(2 * unit).is_none());
    s.deallocate(1, 2 * unit).unwrap(); // covers only unit 1 whole
    assert!(s.locate(0).is_some() && s.locate(unit).is_none());
    assert_eq!(s.counters().deallocated_bytes, unit);
    s.deallocate(0, unit).unwrap();
    s.deallocate(0, unit).unwrap(); // already unmapped: not counted again
    assert_eq!(s.counters().deallocated_bytes, 2 * unit);
    s.write(0, 0, 0).unwrap();
    assert_eq!(s.counters().host_request_bytes, 2);
}

#[test]
fn ruh_update_closes_the_open_ru_early() {
    let unit = 64 * KIB;
    let ru = MIB;
    let mut s = ssd(SsdConfig::new(16 * MIB, 32 * MIB, unit, ru, 2, HandleType::InitiallyIsolated));
    assert_eq!(s.ruh_usage()[0].ruamw_bytes, vec![ru]);
    s.write(0, 3 * unit, 0).unwrap();
    let first = s.locate(0).unwrap();
    assert!(first.open);
    assert_eq!(s.ruh_usage()[0].ruamw_bytes, vec![ru - 3 * unit]);
    s.ruh_update(0).unwrap();
    assert!(!s.locate(0).unwrap().open);
    assert_eq!(s.ruh_usage()[0].ruamw_bytes, vec![ru]);
    assert_eq!((s.counters().ru_updates, s.counters().padding_bytes), (1, ru - 3 * unit));
    s.ruh_update(0).unwrap(); // nothing open: no-op
    s.ruh_update(1).unwrap();
    assert_eq!(s.counters().ru_updates, 1);
    s.write(3 * unit, unit, 0).unwrap();
    assert_ne!(s.locate(3 * unit).unwrap().ru, first.ru);
    // Early-closed RUs are reclaimed like any other.
    let mut rng = SplitMix64(5);
    for _ in 0..20_000 {
        s.write(rng.below(256) * unit, unit, 0).unwrap();
        if rng.below(10) == 0 {
            s.ruh_update(0).unwrap();
        }
    }
    s.audit().unwrap();
    assert!(s.counters().padding_bytes > 0 && s.counters().gc_events > 0);
}

#[test]
fn reclaim_groups_are_separate_pools() {
    let unit = 64 * KIB;
    let ru = MIB;
    let logical = 64 * MIB;
    let mut cfg = SsdConfig::new(logical, 96 * MIB, unit, ru, 1, HandleType::InitiallyIsolated);
    cfg.reclaim_groups = 2;
    let mut s = ssd(cfg.clone());
    assert_eq!(s.rus_per_rg(), 48);
    // Spread over both groups: fine, and each group's data stays in its group.
    let mut rng = SplitMix64(9);
    for _ in 0..20_000 {
        let lu = rng.below(logical / unit);
        s.write_in((lu % 2) as u32, lu * unit, unit, 0).unwrap();
    }
    for lu in 0..logical / unit {
        if let Some(l) = s.locate(lu * unit) {
            assert_eq!(u64::from(l.rg), lu % 2);
        }
    }
    s.audit().unwrap();
    assert!(s.free_rus(0) >= 1 && s.free_rus(1) >= 1 && s.free_rus(2) == 0);
    // All of the logical space into group 0 does not fit in its 48 RUs: a clear error, no hang.
    let mut s = ssd(cfg);
    let mut err = None;
    for lu in 0..logical / unit {
        if let Err(e) = s.write(lu * unit, unit, 0) {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("group 0 overflowed without an error");
    assert_eq!(e, SimError::ReclaimGroupFull { rg: 0 });
    assert_eq!(e.errno(), libc::ENOSPC);
    assert!(e.to_string().contains("spread writes"), "{e}");
}

#[test]
fn bad_requests_are_errors() {
    let mut s = ssd(SsdConfig::new(16 * MIB, 32 * MIB, 4 * KIB, MIB, 2, HandleType::InitiallyIsolated));
    assert!(matches!(s.write(16 * MIB - 4096, 8192, 0), Err(SimError::OutOfRange { .. })));
    assert!(matches!(s.write(u64::MAX, 2, 0), Err(SimError::OutOfRange { .. })));
    assert!(matches!(s.deallocate(16 * MIB, 1), Err(SimError::OutOfRange { .. })));
    let e = s.write(0, 4096, 2).unwrap_err();
    assert_eq!(e, SimError::InvalidHandle { handle: 2, handles: 2 });
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(matches!(s.write_in(1, 0, 4096, 0), Err(SimError::InvalidReclaimGroup { rg: 1, groups: 1 })));
    assert!(matches!(s.ruh_update(9), Err(SimError::InvalidHandle { .. })));
    assert_eq!(s.counters().host_bytes, 0);
    s.write(16 * MIB - 4096, 4096, 1).unwrap();
    s.deallocate(0, 16 * MIB).unwrap();
    s.audit().unwrap();
}

#[test]
fn bad_configs_are_errors_that_name_the_fix() {
    let good = SsdConfig::new(64 * MIB, 80 * MIB, 4 * KIB, MIB, 4, HandleType::InitiallyIsolated);
    assert!(Ssd::new(good.clone()).is_ok());
    type Edit = fn(&mut SsdConfig);
    let cases: Vec<(Edit, &str)> = vec![
        ((|c| c.ru_bytes = 1 << 30), "larger than a reclaim group"),
        ((|c| c.handles.clear()), "at least one handle"),
        ((|c| c.physical_bytes = 66 * MIB), "over-provisioning too small"),
        ((|c| c.handles = vec![HandleType::PersistentlyIsolated; 8]), "fewer handles"),
        ((|c| c.physical_bytes = 32 * MIB), "below logical_bytes"),
        ((|c| c.unit_bytes = 0), "unit_bytes is 0"),
        ((|c| c.unit_bytes = 2 * MIB), "smaller unit"),
        ((|c| c.logical_bytes = 0), "logical_bytes is 0"),
        ((|c| c.reclaim_groups = 0), "reclaim_groups is 0"),
        ((|c| c.reclaim_groups = 200), "fewer reclaim groups"),
        ((|c| c.gc.free_ru_low_watermark = 0), "at least 1"),
        ((|c| c.gc.free_ru_low_watermark = 30), "lower watermark"),
        ((|c| c.handles = vec![HandleType::InitiallyIsolated; MAX_HANDLES + 1]), "at most"),
        (
            (|c| {
                c.unit_bytes = 512;
                c.logical_bytes = 4 << 40;
                c.physical_bytes = 5 << 40;
            }),
            "larger unit_bytes",
        ),
    ];
    for (i, (edit, hint)) in cases.iter().enumerate() {
        let mut c = good.clone();
        edit(&mut c);
        let e = Ssd::new(c).unwrap_err();
        assert!(matches!(e, SimError::InvalidConfig(_)));
        assert!(e.to_string().contains(hint), "case {i}: {e}");
    }
    // The smallest device that passes the check really works at 100 % fill.
    let unit = 4 * KIB;
    let ru = 16 * unit;
    let mut cfg = SsdConfig::new(64 * ru, 0, unit, ru, 2, HandleType::PersistentlyIsolated);
    // Needs 64 data RUs + 4 open (2 host, 2 PI GC) + 1 reserve + 1.
    cfg.physical_bytes = (64 + 4 + 1) * ru;
    assert!(Ssd::new(cfg.clone()).is_err());
    cfg.physical_bytes = (64 + 4 + 1 + 1) * ru;
    let mut s = ssd(cfg);
    let mut rng = SplitMix64(3);
    for _ in 0..50_000 {
        let lu = rng.below(64 * 16);
        s.write(lu * unit, unit, (lu % 2) as u16).unwrap();
    }
    s.audit().unwrap();
}

#[test]
fn unit_size_does_not_change_aligned_results() {
    // With writes and RUs that are whole multiples of both unit sizes, a coarse unit is exact:
    // the same victims in the same order, every count scaled by the unit.
    for victim in [Victim::Greedy, Victim::CostBenefit, Victim::Fifo] {
        let slot = 256 * KIB;
        let ru = 8 * slot;
        let logical = 128 * ru;
        let mut results = Vec::new();
        for unit in [16 * KIB, slot] {
            let mut cfg = SsdConfig::new(
                logical,
                SsdConfig::physical_for_op(logical, 0.12),
                unit,
                ru,
                2,
                HandleType::InitiallyIsolated,
            );
            cfg.handles[1] = HandleType::PersistentlyIsolated;
            cfg.gc.victim = victim;
            let mut s = ssd(cfg);
            let mut rng = SplitMix64(17);
            let slots = logical / slot;
            for _ in 0..6 * slots {
                let i = rng.below(slots);
                match rng.below(16) {
                    0 => s.deallocate(i * slot, slot).unwrap(),
                    1 => s.ruh_update((i % 2) as u16).unwrap(),
                    _ => s.write(i * slot, slot, (i % 2) as u16).unwrap(),
                }
            }
            s.audit().unwrap();
            results.push(s.counters().clone());
        }
        assert!(results[0].relocated_bytes > 0, "{victim:?}");
        assert_eq!(results[0], results[1], "{victim:?}");
    }
}

/// `cargo test --release --lib sim::tests::two_tb_target -- --ignored --nocapture`: five
/// device-writes of uniformly random 16 MiB slots on a 2 TB drive with ~6 GB RUs and 8 II
/// handles, 7 % vendor OP (7 % of the logical size added: 6.5 % of the physical space, where
/// `simulate --op` counts a share of the physical space), at 16 MiB, 1 MiB and 64 KiB mapping
/// units.
#[test]
#[ignore]
fn two_tb_target() {
    let logical: u64 = 2_000_000_000_000;
    let slot = 16 * MIB;
    let mut wafs = Vec::new();
    for unit in [16 * MIB, MIB, 64 * KIB] {
        let ru = 6_000_000_000 / slot * slot; // 357 slots ≈ 6.0 GB
        let physical = logical + logical * 7 / 100;
        let mut s = ssd(SsdConfig::new(logical, physical, unit, ru, 8, HandleType::InitiallyIsolated));
        let slots = logical / slot;
        let mut rng = SplitMix64(1);
        let t = std::time::Instant::now();
        for i in 0..5 * slots {
            s.write(rng.below(slots) * slot, slot, (i % 8) as u16).unwrap();
        }
        let secs = t.elapsed().as_secs_f64();
        let c = s.counters();
        let units = (c.media_bytes / unit) as f64;
        eprintln!(
            "2 TB, unit {} KiB: {:.2} s, WAF {:.3}, {:.0} media units/s ({:.0} host units/s)",
            unit / KIB,
            secs,
            c.waf(),
            units / secs,
            (c.host_bytes / unit) as f64 / secs
        );
        // Speed is reported, not asserted: timing lives in benchmarks (docs/waf.md, Speed).
        wafs.push(c.waf());
    }
    // Slot-aligned writes: the unit size changes the speed, not the result.
    assert!(wafs.windows(2).all(|w| w[0] == w[1]), "{wafs:?}");
}

#[test]
fn gc_percentiles_come_from_the_histogram() {
    use super::run::quantiles;
    // Ten victims: one in bucket 0, eight in bucket 3, one in bucket 9.
    let mut h = vec![0u64; 10];
    h[0] = 1;
    h[3] = 8;
    h[9] = 1;
    assert_eq!(quantiles(&h, 0.5), [0.25, 1.75, 1.75]);
    // Eleven: the 10th percentile is the 2nd victim (bucket 3), the 90th the 10th (bucket 9).
    h[9] = 2;
    assert_eq!(quantiles(&h, 0.5), [1.75, 1.75, 4.75]);
    assert!(quantiles(&[0, 0], 1.0).iter().all(|q| q.is_nan()));
}

/// A long write that needs fresh RUs, given at once or unit by unit, on a drive aged by
/// random overwrites. With a write buffer of one unit, the drive does the same either way;
/// with the whole write buffered (the default), GC copies less of what the write overwrites
/// than it does for the same bytes in one-unit requests.
#[test]
fn a_write_buffer_bounds_what_a_long_write_spares_gc() {
    let (unit, ru) = (64 * KIB, 4 * MIB);
    let logical = 256 * MIB;
    let aged = |buffer: u64| {
        let mut cfg = SsdConfig::new(logical, SsdConfig::physical_for_op(logical, 0.07), unit, ru, 1, HandleType::InitiallyIsolated);
        cfg.write_buffer_bytes = buffer;
        let mut s = ssd(cfg);
        uniform_waf(&mut s, 7, 2 * logical / unit, 0);
        s
    };
    let req = unit;
    // Sixteen RUs from the middle of the device, not aligned to an RU.
    let (off, len) = (100 * MIB + 3 * unit, 16 * ru);
    let relocated = |buffer: u64| {
        let mut at_once = aged(buffer);
        let mut by_request = at_once.clone();
        let before = at_once.counters().clone();
        at_once.write(off, len, 0).unwrap();
        for o in (off..off + len).step_by(req as usize) {
            by_request.write(o, req.min(off + len - o), 0).unwrap();
        }
        at_once.audit().unwrap();
        by_request.audit().unwrap();
        let (a, b) = (at_once.counters().since(&before), by_request.counters().since(&before));
        assert!(b.gc_events > 0, "the write made GC run");
        (a.relocated_bytes, b.relocated_bytes, a == b)
    };
    let (a, b, same) = relocated(req);
    assert!(same, "a one-unit buffer: {a} bytes relocated at once, {b} by request");
    let (a, b, _) = relocated(0);
    assert!(a < b, "the whole write buffered: {a} bytes relocated at once, {b} by request");
}

/// The drive every reported figure runs on has eight handles: uniform random writes spread
/// over all eight (II, FIFO) lose the reserve and half of each handle's open RU, W + 8 × ½
/// RUs, and the simulated WAF is told apart from one open RU's loss and from eight whole ones.
#[test]
fn eight_handles_each_lose_half_an_open_ru() {
    let (cfg, rus, upr, lu) = eight_handle_fifo_drive();
    let unit = cfg.unit_bytes;
    let w = f64::from(cfg.gc.free_ru_low_watermark);
    let mut s = ssd(cfg);
    let mut rng = SplitMix64(0x5eed);
    s.write(0, lu * unit, 0).unwrap();
    let mut write = |s: &mut Ssd, n: u64| {
        for i in 0..n {
            s.write(rng.below(lu) * unit, unit, (i % 8) as u16).unwrap();
        }
    };
    write(&mut s, 3 * lu);
    let before = s.counters().clone();
    write(&mut s, 4 * lu);
    let sim = s.counters().since(&before).waf();
    s.audit().unwrap();
    let lost = |x: f64| analytic_waf_alpha((rus as f64 - w - x) * upr as f64 / lu as f64);
    let (one, eight_halves, eight) = (lost(0.5), lost(4.0), lost(8.0));
    eprintln!("8 handles: simulated {sim:.3}; analytic with W + ½, 4, 8 RUs lost: {one:.3}, {eight_halves:.3}, {eight:.3}");
    assert!((sim / eight_halves - 1.0).abs() < 0.01, "simulated {sim:.3} vs analytic {eight_halves:.3}");
    assert!((sim - eight_halves).abs() < (sim - one).abs().min((sim - eight).abs()), "simulated {sim:.3} is nearer another loss");
}
