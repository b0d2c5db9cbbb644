//! One member of a Kafka consumer group writing grant disbursements into Postgres, in
//! its own process so that a test can kill it (`SIGKILL`) mid-run:
//!
//! ```text
//! cargo run -p idem-broker --features kafka --example kafka_member -- \
//!     URL TOPIC SCHEMA [--delay-ms N] [--exit-when-idle SECS] [--batch N] \
//!     [--concurrency N] [--positions 1]
//! ```
//!
//! `URL` is a `kafka://host:port?group=G…` URL, `SCHEMA` a migrated grant schema of the
//! Postgres at `IDEM_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! One message at a time (or `--concurrency` batches of up to `--batch`), each after
//! `--delay-ms` (default 0); `--positions 1` keeps the group's positions in the store
//! (`?positions=store`). Prints `joined` once the
//! group assigned it partitions, and with `--exit-when-idle` ends after that long without
//! a delivery, printing its stats; otherwise it consumes until it is killed.
//! Exit status 2 on bad arguments, 1 on a failure.

use std::time::Duration;

use futures::StreamExt;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_broker::until_idle;
use idem_engine::{consumer, ConsumerConfig, Gate};
use idem_grant::GrantDb;
use idem_store_postgres::{PgConfig, PgStore};

fn usage() -> ! {
    eprintln!(
        "usage: kafka_member URL TOPIC SCHEMA [--delay-ms N] [--exit-when-idle SECS] \
         [--batch N] [--concurrency N] [--positions 1]"
    );
    std::process::exit(2)
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("kafka_member: {what}: {e}");
    std::process::exit(1)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (url, topic, schema) = match args.as_slice() {
        [u, t, s, ..] => (u.clone(), t.clone(), s.clone()),
        _ => usage(),
    };
    let mut delay = Duration::ZERO;
    let mut idle = None;
    let (mut batch, mut concurrency, mut positions) = (1, 1, false);
    let mut rest = args[3..].iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| usage());
        match flag.as_str() {
            "--delay-ms" => delay = Duration::from_millis(value),
            "--exit-when-idle" => idle = Some(Duration::from_secs(value)),
            "--batch" => batch = usize::try_from(value).unwrap_or_else(|_| usage()),
            "--concurrency" => concurrency = usize::try_from(value).unwrap_or_else(|_| usage()),
            "--positions" => positions = value == 1,
            _ => usage(),
        }
    }
    let url = if positions {
        format!("{url}&positions=store")
    } else {
        url
    };
    let url = BrokerUrl::parse(&url).unwrap_or_else(|e| fail("URL", e));
    let pg = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let config = PgConfig::new(schema)
        .unwrap_or_else(|e| fail("schema", e))
        .with_max_connections(2);
    let store = PgStore::connect(&pg, config)
        .await
        .unwrap_or_else(|e| fail("Postgres", e));
    // A group that is rebalancing after a member died can take tansu longer than one join
    // timeout to hand out partitions, and a member now also reads the partitions' delivery
    // counts (`NAME.attempts`) when they are assigned: under the whole suite's load that
    // took tansu more than three join timeouts. Try six times.
    const TRIES: u32 = 6;
    let mut tries = 0;
    let deliveries = loop {
        tries += 1;
        let position_store: std::sync::Arc<dyn idem_engine::PositionStore> =
            std::sync::Arc::new(store.clone());
        let prefetch = (2 * batch * concurrency).max(4);
        match AnyConsumer::connect_with(&url, &topic, prefetch, Some(position_store)).await {
            Ok(d) => break d,
            Err(e) if tries < TRIES => {
                eprintln!("kafka_member: connect (try {tries} of {TRIES}): {e:?}");
            }
            Err(e) => fail("connect", e),
        }
    };
    println!("joined");
    let deliveries = Box::pin(deliveries.then(move |d| async move {
        tokio::time::sleep(delay).await;
        d
    }));
    let gate = Gate::new(store.clone(), store.grant_handler());
    let config = ConsumerConfig::new(concurrency, batch);
    let stats = match idle {
        Some(idle) => {
            consumer::run(
                &gate,
                until_idle(deliveries, idle),
                config,
                std::future::pending::<()>(),
                |_| {},
            )
            .await
        }
        None => {
            consumer::run(
                &gate,
                deliveries,
                config,
                std::future::pending::<()>(),
                |_| {},
            )
            .await
        }
    }
    .unwrap_or_else(|e| fail("consume", e));
    println!("{stats:?}");
}
