//! Prints what is left to settle in a queue or stream, for scripts (`scripts/build-release`
//! builds it with every broker feature):
//! `cargo run -p idem-broker --features rabbitmq,nats,redis-streams,sqs,kafka --example pending -- URL NAME`.
//!
//! RabbitMQ: ready messages; NATS: the durable consumer's pending + ack-pending;
//! Redis Streams: the group's lag + pending entries; Kafka (`kafka://HOST:PORT?group=G`):
//! per partition, the end minus the group's committed offset (see
//! `idem_broker::any::pending_count`).
//! Exit status 2 on bad arguments, 1 when the broker cannot be asked.

use idem_broker::any::{pending_count, BrokerUrl};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, name] = args.as_slice() else {
        eprintln!("usage: pending BROKER_URL NAME");
        std::process::exit(2);
    };
    let url = match BrokerUrl::parse(url) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("pending: {e}");
            std::process::exit(2);
        }
    };
    match pending_count(&url, name).await {
        Ok(n) => println!("{n}"),
        Err(e) => {
            eprintln!("pending: {e}");
            std::process::exit(1);
        }
    }
}
