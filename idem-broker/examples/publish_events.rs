//! Publishes each line of a file as an outbox event through the relay's own
//! [`Publisher`] — the same messages the relay sends (headers, message id, event id),
//! in the relay's shape (batches of `BATCH`, `IN_FLIGHT` batches at once) — but with no
//! outbox behind it. `scripts/bench-relay` runs it beside `idem relay` and `idem publish`,
//! so the relay's rate is compared both with the broker's raw publish and with its own
//! publisher alone (what the outbox's lease and mark cost):
//! `publish_events BROKER_URL NAME FILE [BATCH] [IN_FLIGHT]` (defaults 500 and 4, the
//! `idem relay` defaults). Prints `published: N` and `throughput_msgs_per_s: R`.
//! Exit status 2 on bad arguments, 1 when the broker fails.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use idem_broker::any::{AnyPublisher, BrokerUrl};
use idem_engine::{IdempotencyKey, OutboxEvent, Publisher};

fn fail(code: i32, msg: &str) -> ! {
    eprintln!("publish_events: {msg}");
    std::process::exit(code);
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (url, name, file) = match args.as_slice() {
        [u, n, f, ..] => (u, n, f),
        _ => fail(
            2,
            "usage: publish_events BROKER_URL NAME FILE [BATCH] [IN_FLIGHT]",
        ),
    };
    let number = |i: usize, default: usize| match args.get(i) {
        None => default,
        Some(s) => s
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or_else(|| fail(2, &format!("{s:?} is not a positive number"))),
    };
    let (batch, in_flight) = (number(3, 500), number(4, 4));
    let url = BrokerUrl::parse(url).unwrap_or_else(|e| fail(2, &e.to_string()));
    let data = std::fs::read(file).unwrap_or_else(|e| fail(2, &format!("{file}: {e}")));
    let events: Vec<OutboxEvent> = data
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .enumerate()
        .map(|(i, line)| {
            let subject = format!("bench-{i}");
            let key = IdempotencyKey::derive(&subject, "2026-01-01T00:00:00Z", line)
                .unwrap_or_else(|e| fail(2, &e.to_string()));
            OutboxEvent::new(key, "disbursement.recorded", subject, line.to_vec())
        })
        .collect();
    let publisher = AnyPublisher::connect(&url, name)
        .await
        .unwrap_or_else(|e| fail(1, &e.to_string()));
    let chunks: Vec<&[OutboxEvent]> = events.chunks(batch).collect();
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let worker = || async {
        while let Some(chunk) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
            publisher.publish(chunk).await?;
        }
        Ok::<(), idem_engine::PublishError>(())
    };
    futures::future::try_join_all((0..in_flight).map(|_| worker()))
        .await
        .unwrap_or_else(|e| fail(1, &e.to_string()));
    let seconds = started.elapsed().as_secs_f64();
    println!("published: {}", events.len());
    println!("seconds: {seconds:.3}");
    if seconds > 0.0 {
        println!(
            "throughput_msgs_per_s: {:.0}",
            events.len() as f64 / seconds
        );
    }
}
