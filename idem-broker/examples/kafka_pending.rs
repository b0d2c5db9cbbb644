//! Prints what a Kafka consumer group has not committed in a topic, for scripts and
//! tests: `cargo run -p idem-broker --features kafka --example kafka_pending -- URL NAME`
//! with `URL` a `kafka://host:port?group=G` URL (see `idem_broker::kafka::pending_count`:
//! per partition, the end of the partition minus the group's committed offset).
//!
//! Its own example (not `pending`) so that scripts building `pending` with other broker
//! features never replace this binary under a running `scripts/e2e-kafka`.
//! Exit status 2 on bad arguments, 1 when the broker cannot be asked.

use idem_broker::any::{pending_count, BrokerKind, BrokerUrl};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, name] = args.as_slice() else {
        eprintln!("usage: kafka_pending kafka://HOST:PORT?group=GROUP TOPIC");
        std::process::exit(2);
    };
    let url = match BrokerUrl::parse(url) {
        Ok(u) if u.kind() == BrokerKind::Kafka => u,
        Ok(_) => {
            eprintln!("kafka_pending: not a kafka:// URL");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("kafka_pending: {e}");
            std::process::exit(2);
        }
    };
    match pending_count(&url, name).await {
        Ok(n) => println!("{n}"),
        Err(e) => {
            eprintln!("kafka_pending: {e}");
            std::process::exit(1);
        }
    }
}
