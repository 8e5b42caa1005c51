//! Speed of the FDP SSD model in steady state: mapping units written per second (host units;
//! GC relocations come on top and are in the time). Device: 64 GiB logical, 7 % OP of
//! physical, 1 MiB units, 256 MiB RUs, one handle, greedy GC, prefilled and aged with one
//! device-write of random overwrites before measuring.
//!
//! `cargo bench --bench ssd -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fdpblk::sim::{HandleType, SplitMix64, Ssd, SsdConfig, SsdCounters};
use std::hint::black_box;

const MIB: u64 = 1 << 20;
const LOGICAL: u64 = 64 << 30;
const BATCH: u64 = 4096;

fn aged_drive() -> Ssd {
    let physical = SsdConfig::physical_for_op(LOGICAL, 0.07);
    let mut s = Ssd::new(SsdConfig::new(LOGICAL, physical, MIB, 256 * MIB, 1, HandleType::InitiallyIsolated)).unwrap();
    let units = LOGICAL / MIB;
    s.write(0, LOGICAL, 0).unwrap();
    let mut rng = SplitMix64(1);
    for _ in 0..units {
        s.write(rng.below(units) * MIB, MIB, 0).unwrap();
    }
    s
}

/// Prints the WAF of a run (skipped when a filter left the benchmark out).
fn report(name: &str, s: &Ssd, before: &SsdCounters) {
    let d = s.counters().since(before);
    if d.host_bytes > 0 {
        eprintln!("{name}: WAF over the run {:.3}", d.waf());
    }
}

fn bench(c: &mut Criterion) {
    let units = LOGICAL / MIB;
    let mut g = c.benchmark_group("ssd_64g_1m_units_256m_ru");

    // Uniform random 1 MiB overwrites: WAF ≈ 7.4, so ~6.4 relocations per host unit.
    let mut s = aged_drive();
    let mut rng = SplitMix64(2);
    let before = s.counters().clone();
    g.throughput(Throughput::Elements(BATCH));
    g.bench_function("uniform_random_1_unit", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                s.write(black_box(rng.below(units) * MIB), MIB, 0).unwrap();
            }
        })
    });
    report("uniform_random_1_unit", &s, &before);

    // Uniform random 16 MiB slots (16 units per request, slot-aligned).
    let slots = LOGICAL / (16 * MIB);
    let before = s.counters().clone();
    g.bench_function("uniform_random_16_unit_slots", |b| {
        b.iter(|| {
            for _ in 0..BATCH / 16 {
                s.write(black_box(rng.below(slots) * 16 * MIB), 16 * MIB, 0).unwrap();
            }
        })
    });
    report("uniform_random_16_unit_slots", &s, &before);

    // Sequential 16 MiB writes around the device: WAF 1, GC erases dead RUs only.
    let mut s = aged_drive();
    let mut off = 0;
    g.bench_function("sequential_16_unit", |b| {
        b.iter(|| {
            for _ in 0..BATCH / 16 {
                s.write(black_box(off), 16 * MIB, 0).unwrap();
                off = (off + 16 * MIB) % LOGICAL;
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
