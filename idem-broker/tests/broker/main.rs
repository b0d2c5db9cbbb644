//! The integration tests of `idem-broker`, one module per former test file (`kafka`, a
//! directory, with its own modules), in one test binary: the dependency world is linked
//! once instead of once per file. Each module is behind the features of the brokers it
//! uses, as its file was (`required-features` or a `#![cfg]`); with none, the binary is
//! empty. Each test still uses its own queue, stream or topic name and its own Postgres
//! schema (`common`), so they run in parallel; the Kafka tests run one at a time
//! (`.config/nextest.toml`: `test(/^kafka::/)` in this binary).
//!
//! `rabbitmq_leaks.rs` stays a binary of its own: it counts the process's lapin I/O
//! threads, which the other RabbitMQ tests would start beside it under plain `cargo test`.
//!
//! Some modules change state of the whole process and rely on one process per test, as
//! `scripts/test` runs them (`cargo nextest`); under plain `cargo test`, whose tests share
//! one process, they could disturb the tests running beside them:
//! - `tls` sets `SSL_CERT_FILE` (the roots of every adapter's TLS configuration) to a
//!   throwaway CA, and checks that no process-wide rustls crypto provider was installed,
//!   then installs one (so its own tests fail one another there, as they did in a binary
//!   of their own);
//! - `kafka::positions` switches a mutant on (`idem_engine::mutant::set`, process-wide in
//!   a build with idem-engine's `_mutants` feature, which the workspace's `--all-features`
//!   turns on).

/// The broker conformance suite (`conformance!`) and the helpers of the broker modules.
#[cfg(any(
    feature = "rabbitmq",
    feature = "nats",
    feature = "redis-streams",
    feature = "sqs",
    feature = "kafka"
))]
mod common;

#[cfg(all(
    feature = "sqs",
    feature = "nats",
    feature = "redis-streams",
    feature = "rabbitmq"
))]
mod horizon;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "kafka")]
mod kafka_sasl;
#[cfg(feature = "kafka")]
mod kafka_zstd;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "nats")]
mod nats_limits;
/// Each test needs its adapter's feature.
#[cfg(any(
    feature = "rabbitmq",
    feature = "nats",
    feature = "redis-streams",
    feature = "sqs"
))]
mod own_client;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "rabbitmq")]
mod rabbitmq_limits;
#[cfg(feature = "redis-streams")]
mod redis_streams;
#[cfg(feature = "redis-streams")]
mod redis_streams_frozen;
#[cfg(feature = "sqs")]
mod sqs;
#[cfg(feature = "sqs")]
mod sqs_limits;
/// Some of its tests also need `tls`.
#[cfg(all(feature = "rabbitmq", feature = "redis-streams", feature = "nats"))]
mod tls;
