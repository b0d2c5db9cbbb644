//! The integration tests of `idem-cli`, one module per former test file, in one test
//! binary: the dependency world is linked once instead of once per file. They run the
//! `idem` binary (`env!("CARGO_BIN_EXE_idem")`) as a child process, each command with the
//! environment it is given; every test uses queues, schemas and files of its own, so they
//! run in parallel. None changes state of the whole test process (its environment, its
//! current directory, a rustls provider, a panic hook).

mod common;

mod audit;
mod cli;
mod conflict;
mod docs;
mod filter_scoping;
mod first_run;
mod horizon;
mod operate;
mod ops;
mod reconnect;
mod refused_bodies;
mod report;
mod secrets;
mod sql_handler;
/// `idem` against TLS-only Postgres, Redis Streams, NATS and RabbitMQ: a build with `tls`
/// and each of them.
#[cfg(all(
    feature = "tls",
    feature = "postgres",
    feature = "redis-streams",
    feature = "nats",
    feature = "rabbitmq"
))]
mod tls;
mod trace;
