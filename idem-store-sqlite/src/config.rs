//! Configuration of the SQLite store.

use std::time::Duration;

/// How the SQLite store opens its database.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteConfig {
    /// How long a writer waits for SQLite's single write lock before a retryable
    /// [`StoreError::Conflict`](idem_core::StoreError::Conflict). Default 30 s.
    pub busy_timeout: Duration,
    /// Pool size. SQLite has one writer at a time; extra connections serve readers.
    /// Default 4.
    pub max_connections: u32,
    /// Create the file if it does not exist. Default true.
    pub create_if_missing: bool,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(30),
            max_connections: 4,
            create_if_missing: true,
        }
    }
}
