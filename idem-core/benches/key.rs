//! Key derivation throughput at 64 B, 1 KiB, 16 KiB and 64 KiB payloads (`scripts/bench-key`
//! runs it beside `openssl speed` and prints the ratios).
#![allow(missing_docs)] // criterion_group! generates undocumented functions.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use idem_core::IdempotencyKey;

fn derive(c: &mut Criterion) {
    let mut g = c.benchmark_group("derive");
    for size in [64usize, 1024, 16 * 1024, 64 * 1024] {
        let payload: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &payload, |b, p| {
            b.iter(|| {
                IdempotencyKey::derive(
                    "A-2026-014",
                    "2026-07-01T09:00:00Z",
                    std::hint::black_box(p),
                )
            });
        });
    }
    g.finish();
}

criterion_group!(benches, derive);
criterion_main!(benches);
