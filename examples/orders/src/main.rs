//! The orders consumer: RabbitMQ → `OrderHandler` → Postgres or SQLite, and the outbox
//! relayed to the events queue.
//!
//! ```sh
//! # RabbitMQ on localhost (guest/guest); orders into SQLite (orders.db), until Ctrl-C:
//! cargo run -p orders
//! # into Postgres, draining the queue and the outbox, then exiting:
//! ORDERS_STORE=postgres://postgres@127.0.0.1:5432/test ORDERS_EXIT_WHEN_IDLE=5 cargo run -p orders
//! ```
//!
//! Settings come from the environment ([`orders::Settings::from_env`]): `ORDERS_BROKER`,
//! `ORDERS_SOURCE`, `ORDERS_EVENTS`, `ORDERS_STORE`, `ORDERS_SCHEMA`,
//! `ORDERS_EXIT_WHEN_IDLE`. Exit status 0 when the run ends cleanly, 1 otherwise.

use std::process::ExitCode;

use orders::{run, Settings};

#[tokio::main]
async fn main() -> ExitCode {
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("orders: {e}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "orders: {} → {} ({}); events → {}",
        settings.source,
        idem::redact_url(&settings.store),
        idem::redact_url(&settings.broker),
        settings.events
    );
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match run(&settings, shutdown).await {
        Ok(report) => {
            let c = report.consumed;
            println!(
                "processed: {}\nduplicates: {}\nrejected: {}\nconflicts: {}\nrelayed: {}",
                c.processed, c.duplicates, c.rejected, c.conflicts, report.relayed
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("orders: {e}");
            ExitCode::FAILURE
        }
    }
}
