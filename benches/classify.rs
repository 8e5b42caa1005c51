//! Classification cost per request: a 1 MiB slot-payload write and a 4 KiB slot-header write,
//! through `classify` alone and through the whole `Pipeline::plan` (classify + place), next to
//! the cost of copying the request's bytes once (the floor of any copy-mode block server).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fdpblk::classify::{classify, Op};
use fdpblk::layout::slot_header::SlotHeader;
use fdpblk::layout::GeometryConfig;
use fdpblk::pipeline::{HeaderWait, Pipeline, Request};
use fdpblk::place::{KeyAwarePolicy, RegionPolicy};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    // LMCache non-MP defaults on a 1 TiB device: 32 MiB + 4 KiB slots, 128 MiB metadata.
    let g = GeometryConfig {
        block_align: 4096,
        header_bytes: 4096,
        slot_bytes: 33_558_528,
        meta_total_bytes: 128 << 20,
        capacity_bytes: 0,
    }
    .validate(1 << 40)
    .unwrap();
    let slot = 1000;
    let hdr = SlotHeader { identity: 0x1234_5678_9abc_def0, payload_len: 33_554_432 }.encode(4096);
    let payload = vec![0u8; 1 << 20];
    let mut out = Vec::with_capacity(8);

    let mut group = c.benchmark_group("classify");
    group.throughput(Throughput::Elements(1));
    group.bench_function("header_4k", |b| {
        b.iter(|| {
            out.clear();
            classify(&g, Op::Write, black_box(g.slot_offset(slot)), 4096, Some(black_box(&hdr)), &(), &mut out);
            black_box(out.len())
        })
    });
    group.bench_function("payload_1m", |b| {
        b.iter(|| {
            out.clear();
            classify(&g, Op::Write, black_box(g.slot_offset(slot) + 4096 + (4 << 20)), 1 << 20, Some(black_box(&payload)), &(), &mut out);
            black_box(out.len())
        })
    });
    group.finish();

    // Pipeline::plan with `region` and with the default `key-aware` (which looks the header's
    // identity up in its history).
    type NewPolicy = fn() -> Box<dyn fdpblk::place::Policy>;
    let policies: [(&str, NewPolicy); 2] =
        [("pipeline_plan", || Box::new(RegionPolicy)), ("pipeline_plan_key_aware", || Box::new(KeyAwarePolicy::new()))];
    for (name, policy) in policies {
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Elements(1));
        let mut p = Pipeline::new(g, policy());
        let mut segs = Vec::with_capacity(8);
        group.bench_function("header_4k", |b| {
            b.iter(|| {
                segs.clear();
                let r = Request { op: Op::Write, offset: g.slot_offset(slot), len: 4096, data: Some(&hdr) };
                black_box(p.plan(black_box(&r), &mut segs, HeaderWait::Expired).map(|e| e.len()))
            })
        });
        group.bench_function("payload_1m", |b| {
            b.iter(|| {
                segs.clear();
                let r = Request { op: Op::Write, offset: g.slot_offset(slot) + 4096 + (4 << 20), len: 1 << 20, data: Some(&payload) };
                black_box(p.plan(black_box(&r), &mut segs, HeaderWait::Expired).map(|e| e.len()))
            })
        });
        group.finish();
    }

    // The peer: one copy of the request's bytes, which any block server pays at least once.
    let mut group = c.benchmark_group("memcpy_baseline");
    group.throughput(Throughput::Elements(1));
    let mut dst4 = vec![0u8; 4096];
    let mut dst1m = vec![0u8; 1 << 20];
    group.bench_function("header_4k", |b| b.iter(|| dst4.copy_from_slice(black_box(&hdr))));
    group.bench_function("payload_1m", |b| b.iter(|| dst1m.copy_from_slice(black_box(&payload))));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
