//! Claim paths against the server at `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), each in a fresh schema:
//!
//! - `claim_commit`: begin, one claim, commit (one message per transaction);
//! - `claim_outbox_commit`: begin, claim, outbox insert with NOTIFY, commit;
//! - `claim_batch_100`: begin, one 100-key batch claim, commit.
//!
//! `cargo bench -p idem-store-postgres --bench claim`

#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use idem_engine::{ClaimMeta, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter};
use idem_store_postgres::{PgConfig, PgStore};

fn url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn next_key(run: u64) -> IdempotencyKey {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    IdempotencyKey::derive(&format!("B-{n}"), &run.to_string(), b"{}").expect("key")
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    let schema = format!("idem_bench_{run}");
    let store = rt.block_on(async {
        let store = PgStore::connect(&url(), PgConfig::new(&schema).expect("schema"))
            .await
            .expect("a Postgres server (IDEM_TEST_POSTGRES_URL)");
        store.migrate().await.expect("migrate");
        store
    });

    let mut g = c.benchmark_group("postgres");
    g.throughput(Throughput::Elements(1));
    g.bench_function("claim_commit", |b| {
        b.iter(|| {
            rt.block_on(async {
                let k = next_key(run);
                let mut tx = store.begin().await.expect("begin");
                tx.claim(&k, &ClaimMeta::new("B")).await.expect("claim");
                tx.commit().await.expect("commit");
            });
        });
    });
    g.bench_function("claim_outbox_commit", |b| {
        b.iter(|| {
            rt.block_on(async {
                let k = next_key(run);
                let mut tx = store.begin().await.expect("begin");
                tx.claim(&k, &ClaimMeta::new("B")).await.expect("claim");
                tx.enqueue(&OutboxEvent::new(k, "bench", "B", "{\"award_id\":\"B\"}"))
                    .await
                    .expect("enqueue");
                tx.commit().await.expect("commit");
            });
        });
    });
    g.throughput(Throughput::Elements(100));
    g.bench_function("claim_batch_100", |b| {
        b.iter(|| {
            rt.block_on(async {
                let items: Vec<(IdempotencyKey, ClaimMeta)> = (0..100)
                    .map(|_| (next_key(run), ClaimMeta::new("B")))
                    .collect();
                let mut tx = store.begin().await.expect("begin");
                tx.claim_batch(&items).await.expect("claim_batch");
                tx.commit().await.expect("commit");
            });
        });
    });
    g.finish();
    rt.block_on(async {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
        )))
        .execute(store.pool())
        .await;
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
