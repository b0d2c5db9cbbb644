//! What idem's own tests need beyond the test kit and never ships: servers with a TLS
//! listener (a throwaway certificate authority, and a second Postgres, Redis, NATS or
//! RabbitMQ on a free loopback port), spawned from the machine's own server binaries.
//! Not published: a dev-dependency of idem's crates only.

pub mod tls;
