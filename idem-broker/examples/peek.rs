//! Reads every message waiting in a queue or stream without settling any, for scripts
//! (`scripts/chaos`): `peek BROKER_URL NAME HEADER` prints one line per message — the
//! value of HEADER (or `-`), a tab, the SHA-256 of the body in hex. It stops once nothing
//! arrived for 3 s; the unsettled messages go back to the broker when it disconnects.
//! A message may be printed twice (a redelivery of one already read): count distinct
//! lines.
//! A connection that fails is tried three times (a Kafka group may be rebalancing).
//! Exit status 2 on bad arguments, 1 when the broker cannot be reached.
//!
//! For Kafka, give peek a `group` of its own: joining the consumers' group would take
//! part in their rebalances.

use std::time::Duration;

use futures::StreamExt as _;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_broker::until_idle;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, name, header] = args.as_slice() else {
        eprintln!("usage: peek BROKER_URL NAME HEADER");
        std::process::exit(2);
    };
    let url = match BrokerUrl::parse(url) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("peek: {e}");
            std::process::exit(2);
        }
    };
    let mut tries = 0;
    let consumer = loop {
        tries += 1;
        match AnyConsumer::connect(&url, name, 65_535).await {
            Ok(c) => break c,
            Err(e) if tries < 3 && e.is_retryable() => {
                eprintln!("peek: {} (trying again)", chain(&e));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => {
                eprintln!("peek: {}", chain(&e));
                std::process::exit(1);
            }
        }
    };
    let mut held = Vec::new();
    let mut stream = std::pin::pin!(until_idle(consumer, Duration::from_secs(3)));
    while let Some(item) = stream.next().await {
        match item {
            Ok(d) => {
                let value = d.header(header).unwrap_or("-").replace(['\t', '\n'], " ");
                println!("{value}\t{}", idem_engine::sha256_hex(&d.payload));
                // A message received before (its visibility ran out while held: a
                // receive whose answer was lost, an extension that came late) is
                // printed again and let go rather than held: an SQS consumer starts
                // no receive while such a rerun is held unsettled, so holding it
                // would stall the read for good. Lines may repeat; the scripts count
                // distinct values.
                if d.attempt.is_none_or(|n| n <= 1) {
                    held.push(d);
                }
            }
            Err(e) => {
                eprintln!("peek: {}", chain(&e));
                std::process::exit(1);
            }
        }
    }
}

/// The error and its sources, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}
