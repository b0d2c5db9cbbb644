//! Postgres dedup store, transactional outbox and relay source for idem.
