//! Criterion benchmarks of the two hot paths against the Redis at `IDEM_TEST_REDIS_URL`
//! (default `redis://127.0.0.1:6379`): a claim (one key, and a batch of 100 in one round
//! trip) and a front-filter lookup (1 key, and 100 keys in one round trip).
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use idem_engine::{ClaimMeta, ClaimStore, ClaimTx, DoneFilter, IdempotencyKey};
use idem_store_redis::{RedisConfig, RedisFilter, RedisLeaseStore};

fn random_key() -> IdempotencyKey {
    format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    )
    .parse()
    .expect("64 hex")
}

fn config() -> RedisConfig {
    let url =
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    RedisConfig::new(url)
        .with_key_prefix(format!("idem-bench:{:08x}:", rand::random::<u32>()))
        .with_lease(Duration::from_secs(60))
        .with_retention(Duration::from_secs(60))
        .with_timeout(Duration::from_secs(5))
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt
        .block_on(RedisLeaseStore::connect(config()))
        .expect("Redis must be running");
    let filter = rt
        .block_on(RedisFilter::connect(config()))
        .expect("Redis must be running");
    let meta = ClaimMeta::new("bench");

    let mut g = c.benchmark_group("claim");
    for depth in [1usize, 100] {
        g.throughput(Throughput::Elements(depth as u64));
        g.bench_function(format!("depth_{depth}"), |b| {
            b.to_async(&rt).iter_batched(
                || {
                    (0..depth)
                        .map(|_| (random_key(), meta.clone()))
                        .collect::<Vec<_>>()
                },
                |items| {
                    let store = store.clone();
                    async move {
                        let mut tx = store.begin().await.expect("begin");
                        tx.claim_batch(&items).await.expect("claim");
                        tx.rollback().await.expect("rollback");
                    }
                },
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();

    let mut g = c.benchmark_group("filter_lookup");
    for depth in [1usize, 100] {
        let keys: Vec<_> = (0..depth).map(|_| random_key()).collect();
        rt.block_on(filter.mark_done(&keys[..depth / 2]))
            .expect("mark");
        g.throughput(Throughput::Elements(depth as u64));
        g.bench_function(format!("depth_{depth}"), |b| {
            b.to_async(&rt)
                .iter(|| async { filter.seen(&keys).await.expect("seen") });
        });
    }
    g.finish();
}

criterion_group!(redis, benches);
criterion_main!(redis);
