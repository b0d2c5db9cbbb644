//! Reads every message waiting in a queue or stream without settling any, for scripts
//! (`scripts/chaos`): `peek BROKER_URL NAME HEADER` prints one line per message — the
//! value of HEADER (or `-`), a tab, the SHA-256 of the body in hex. It stops once nothing
//! arrived for 3 s; the unsettled messages go back to the broker when it disconnects.
//! Exit status 2 on bad arguments, 1 when the broker cannot be reached.

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
    let consumer = match AnyConsumer::connect(&url, name, 65_535).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("peek: {e}");
            std::process::exit(1);
        }
    };
    let mut held = Vec::new();
    let mut stream = std::pin::pin!(until_idle(consumer, Duration::from_secs(3)));
    while let Some(item) = stream.next().await {
        match item {
            Ok(d) => {
                let value = d.header(header).unwrap_or("-").replace(['\t', '\n'], " ");
                println!("{value}\t{}", idem_core::sha256_hex(&d.payload));
                held.push(d);
            }
            Err(e) => {
                eprintln!("peek: {e}");
                std::process::exit(1);
            }
        }
    }
}
