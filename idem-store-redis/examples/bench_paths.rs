//! Throughput of our two hot paths against a real Redis, for `scripts/bench-redis`:
//!
//! - `claim`: [`ClaimTx::claim`] (one `SET … NX PX … GET`) at depth 1, and
//!   [`ClaimTx::claim_batch`] of `depth` keys (one pipelined round trip) above;
//! - `lookup`: [`DoneFilter::seen`] of 1 key, or of `depth` keys in one round trip.
//!
//! `clients` tasks run at once, each with its own store and filter (its own connection),
//! like `redis-benchmark -c clients`. Every claimed key is new, like `-r 1000000`.
//!
//! ```text
//! cargo run --release -p idem-store-redis --example bench_paths -- \
//!     [--url redis://127.0.0.1:6379] [--clients 1] [--requests 200000] [--depths 1,100]
//! ```
//!
//! Prints one line per path and depth: `PATH DEPTH OPS_PER_SECOND`.

use std::time::{Duration, Instant};

use idem_engine::{ClaimMeta, ClaimStore, ClaimTx, DoneFilter, IdempotencyKey};
use idem_store_redis::{RedisConfig, RedisFilter, RedisLeaseStore};

struct Args {
    url: String,
    clients: usize,
    requests: usize,
    depths: Vec<usize>,
}

fn args() -> Args {
    let mut a = Args {
        url: "redis://127.0.0.1:6379".into(),
        clients: 1,
        requests: 200_000,
        depths: vec![1, 100],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => a.url = v,
            "--clients" => a.clients = v.parse().expect("--clients N"),
            "--requests" => a.requests = v.parse().expect("--requests N"),
            "--depths" => {
                a.depths = v
                    .split(',')
                    .map(|d| d.parse().expect("--depths 1,100"))
                    .collect();
            }
            other => panic!("unknown flag {other}"),
        }
    }
    a.clients = a.clients.max(1);
    a
}

fn random_key() -> IdempotencyKey {
    format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    )
    .parse()
    .expect("64 hex")
}

fn config(url: &str) -> RedisConfig {
    RedisConfig::new(url)
        .with_key_prefix(format!("idem-bench:{:08x}:", rand::random::<u32>()))
        .with_lease(Duration::from_secs(120))
        .with_retention(Duration::from_secs(120))
        .with_timeout(Duration::from_secs(5))
}

/// Runs `clients` tasks, each doing `per_client` rounds of `depth` operations, and
/// returns operations per second.
async fn run<F, Fut>(clients: usize, per_client: usize, depth: usize, make: F) -> f64
where
    F: Fn(Vec<Vec<IdempotencyKey>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let rounds: Vec<Vec<IdempotencyKey>> = (0..per_client / depth)
            .map(|_| (0..depth).map(|_| random_key()).collect())
            .collect();
        tasks.push(make(rounds));
    }
    let start = Instant::now();
    let handles: Vec<_> = tasks.into_iter().map(tokio::spawn).collect();
    for h in handles {
        h.await.expect("bench task");
    }
    let ops = clients * (per_client / depth) * depth;
    ops as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let a = args();
    // One client is latency-bound: run it on one thread, as redis-benchmark's event loop
    // does; more clients get a worker per core.
    let rt = if a.clients == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    }
    .expect("runtime");
    rt.block_on(bench(a));
}

async fn bench(a: Args) {
    let per_client = a.requests / a.clients;
    let mut stores = Vec::new();
    let mut filters = Vec::new();
    for _ in 0..a.clients {
        stores.push(
            RedisLeaseStore::connect(config(&a.url))
                .await
                .expect("connect"),
        );
        filters.push(RedisFilter::connect(config(&a.url)).await.expect("connect"));
    }
    // Warm up every connection (and the server's script cache) before timing.
    for (s, f) in stores.iter().zip(&filters) {
        for _ in 0..500 {
            let mut tx = s.begin().await.expect("begin");
            let k = random_key();
            tx.claim_batch(&[
                (k, ClaimMeta::new("warm")),
                (random_key(), ClaimMeta::new("warm")),
            ])
            .await
            .expect("claim");
            tx.rollback().await.expect("rollback");
            f.seen(&[k]).await.expect("seen");
        }
    }
    // Half the looked-up keys are marked, so lookups see both answers.
    for f in &filters {
        let marked: Vec<_> = (0..1000).map(|_| random_key()).collect();
        f.mark_done(&marked).await.expect("mark");
    }
    for &depth in &a.depths {
        let depth = depth.max(1);
        let idx = std::sync::atomic::AtomicUsize::new(0);
        let rate = run(a.clients, per_client, depth, |rounds| {
            let store = stores[idx.fetch_add(1, std::sync::atomic::Ordering::Relaxed)].clone();
            async move {
                let meta = ClaimMeta::new("bench");
                for keys in rounds {
                    // One transaction per round; its leases simply expire.
                    let mut tx = store.begin().await.expect("begin");
                    if depth == 1 {
                        tx.claim(&keys[0], &meta).await.expect("claim");
                    } else {
                        let items: Vec<_> = keys.iter().map(|k| (*k, meta.clone())).collect();
                        tx.claim_batch(&items).await.expect("claim_batch");
                    }
                    std::mem::forget(tx);
                }
            }
        })
        .await;
        println!("claim {depth} {rate:.0}");

        let idx = std::sync::atomic::AtomicUsize::new(0);
        let rate = run(a.clients, per_client, depth, |rounds| {
            let filter = filters[idx.fetch_add(1, std::sync::atomic::Ordering::Relaxed)].clone();
            async move {
                for keys in rounds {
                    filter.seen(&keys).await.expect("seen");
                }
            }
        })
        .await;
        println!("lookup {depth} {rate:.0}");
    }
}
