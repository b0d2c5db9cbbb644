//! [`PgConfig`]: the schema, the table layout, the lock timeout and the pool's size.

use std::time::Duration;

use idem_core::ident::Ident;

use crate::error::PgError;

/// How a [`PgStore`](crate::PgStore) talks to its database.
///
/// Build it with [`PgConfig::new`] (which validates the schema name) and adjust the
/// public fields or use the `with_*` methods:
///
/// ```
/// use std::time::Duration;
/// use idem_store_postgres::PgConfig;
///
/// let config = PgConfig::new("grants")?
///     .with_lock_timeout(Some(Duration::from_millis(500)))
///     .with_max_connections(16);
/// assert_eq!(config.schema, "grants");
/// assert!(PgConfig::new("grants; DROP TABLE x").is_err());
/// # Ok::<(), idem_store_postgres::PgError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgConfig {
    /// The schema holding `processed_messages` and `outbox` (and, by convention, the
    /// business tables). An SQL identifier: `^[A-Za-z_][A-Za-z0-9_]{0,62}$`. It is always
    /// quoted, so its case is kept. Default `public`.
    pub schema: String,
    /// How long a claim waits for a concurrent transaction holding the same key before it
    /// answers [`ClaimOutcome::InProgress`](idem_core::ClaimOutcome) (the gate defers the
    /// delivery: nack with a delay) instead of waiting on. `SET LOCAL lock_timeout` at the
    /// start of each claim transaction, so it bounds every lock wait of that transaction
    /// (the handler's business writes included) and nothing outside it.
    ///
    /// Default [`PgConfig::DEFAULT_LOCK_TIMEOUT`] (5 s): longer than a healthy handler
    /// holds a key, short enough that redeliveries of a key stuck behind a hung
    /// transaction do not pile up on the pool. `None` waits until the other transaction
    /// ends, however long.
    pub lock_timeout: Option<Duration>,
    /// How long any one statement of a claim transaction may run on the server before the
    /// server cancels it (SQLSTATE 57014): `SET LOCAL statement_timeout` at the start of
    /// each claim transaction, in the same round trip as the lock timeout. Set it to the
    /// handler's deadline (`idem consume --handler-timeout` does): a handler dropped at
    /// its deadline leaves no statement running on the server, and the rollback that
    /// follows waits for nothing longer. Default `None`: the server's own setting.
    pub statement_timeout: Option<Duration>,
    /// How long the store's [probe](idem_core::ClaimStore::probe) (a new connection that
    /// commits a transaction id) may take before it answers that the store does not work.
    /// Default [`PgConfig::DEFAULT_PROBE_TIMEOUT`] (5 s).
    pub probe_timeout: Duration,
    /// How long a round trip of a claim transaction (its `BEGIN`, claims, outbox and
    /// position writes, `COMMIT` or `ROLLBACK`) waits for the server's answer beyond the
    /// longer of [`lock_timeout`](Self::lock_timeout) and
    /// [`statement_timeout`](Self::statement_timeout), which the server itself enforces.
    /// No answer by then means the network path or the server is dead (a path that drops
    /// packets gives no error for the kernel's whole retransmission time, about fifteen
    /// minutes): the connection is closed, not given back to the pool, and the statement
    /// fails with [`StoreError::Unavailable`](idem_core::StoreError) (a `COMMIT`'s outcome
    /// is then unknown: the delivery is not acked, and its redelivery finds the claim done
    /// or not). Default [`PgConfig::DEFAULT_REPLY_TIMEOUT`] (30 s).
    pub reply_timeout: Duration,
    /// The pool's maximum number of connections ([`PgStore::connect`](crate::PgStore::connect)
    /// only). Default 10.
    pub max_connections: u32,
    /// How long [`begin`](idem_core::ClaimStore::begin) waits for a free connection before
    /// answering [`StoreError::Unavailable`](idem_core::StoreError). Default 30 s.
    pub acquire_timeout: Duration,
    /// Whether an outbox insert also sends `pg_notify` (delivered on commit only) so that
    /// [`PgOutboxSource::wait`](crate::PgOutboxSource) wakes at once. Without it the relay
    /// finds new events at its polling interval. Default `true`.
    pub notify: bool,
    /// Sends at most one `pg_notify` per this interval from one store (clones share the
    /// clock); outbox inserts in between rely on that notification or, at worst, on the
    /// relay's polling interval. Postgres serialises the commits of notifying transactions
    /// (a cluster-wide lock held through the commit's WAL flush), so notifying on every
    /// insert costs concurrent consumers throughput. Default 10 ms; zero notifies always.
    pub notify_interval: Duration,
    /// Whether [`PgStore::migrate`](crate::PgStore::migrate) creates the indexes that make
    /// [`purge`](crate::PgStore::purge) and [`inspect_key`](crate::PgStore::inspect_key) /
    /// [`inspect_subject`](crate::PgStore::inspect_subject) fast
    /// (`processed_messages(claimed_at)` and a hash index of `outbox(idempotency_key)`, in
    /// `migrations/0002_audit_indexes.sql`; lookups by award id use the identity index).
    /// They are maintained on every insert (what each costs the batched claims:
    /// `scripts/index-costs`); without them those operations scan the tables. Default
    /// `true`. Setting it to `false` does not drop indexes that exist.
    pub audit_indexes: bool,
    /// The layout [`PgStore::migrate`](crate::PgStore::migrate) creates when
    /// `processed_messages` does not exist yet. Default [`PgLayout::Plain`] (the
    /// reference's table, shared with consumers in other languages). A store connected
    /// with [`PgStore::connect`](crate::PgStore::connect) uses the layout of the table it
    /// finds, whatever this says; [`PgStore::from_pool`](crate::PgStore::from_pool) uses
    /// this one.
    pub layout: PgLayout,
    /// Who reads the outbox: idem's relay (the default) or a change-data-capture
    /// connector ([`OutboxMode::ChangeDataCapture`]). [`PgStore::migrate`](crate::PgStore::migrate)
    /// records [`OutboxMode::ChangeDataCapture`] in the schema when asked; a store
    /// connected with [`PgStore::connect`](crate::PgStore::connect) follows what the schema
    /// records, whatever this says; [`PgStore::from_pool`](crate::PgStore::from_pool)
    /// uses this one.
    pub outbox: OutboxMode,
    /// Months of partitions created before the current one by
    /// [`PgStore::ensure_partitions`](crate::PgStore::ensure_partitions) (partitioned
    /// layout only). Default 12.
    pub partition_months_back: u32,
    /// Months of partitions created after the current one. Default 3: a consumer started
    /// (or migrated) at least once a quarter never files a current claim in the default
    /// partition.
    pub partition_months_ahead: u32,
}

/// How `processed_messages` is laid out (see `docs/scale.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum PgLayout {
    /// One plain table with `idempotency_key` as its primary key: the reference's
    /// layout (`migrations/0001_tables.sql`). Retention deletes row by row.
    #[default]
    Plain,
    /// Range-partitioned by `submission_month`, the month written in the message's own
    /// submission timestamp (`migrations/0005_partitioned_claims.sql`): primary key
    /// `(idempotency_key, submission_month)`, one partition per month, a default
    /// partition for timestamps that do not parse. Retention drops whole partitions.
    /// Dedup stays exact because the month is a pure function of the key's preimage:
    /// a message and all its redeliveries carry the same timestamp, hence the same
    /// month, hence meet in the same partition's unique index.
    Partitioned,
    /// Ready to be distributed by Citus (`migrations/0009_distributed.sql`): every
    /// unique index of `processed_messages`, `disbursements` and `outbox` holds the
    /// distribution column — the award id (`award_id`; the outbox's `subject`, which the
    /// grant handler sets to it) — so that the three rows one message writes can live on
    /// one shard. `processed_messages` has the primary key `(award_id, idempotency_key)`
    /// with `award_id NOT NULL`, the claim's target is `ON CONFLICT (award_id,
    /// idempotency_key)`, and the outbox's event ids are unique per subject (`ON CONFLICT
    /// (subject, event_id)`). Dedup stays exact because the award id is the first field
    /// of the key's preimage: one key has one award id, so all its claims meet in one
    /// unique index (see [`crate::distributed`]).
    ///
    /// It runs on plain Postgres, where it is tested. When the `citus` extension is
    /// installed, [`PgStore::migrate`](crate::PgStore::migrate) also distributes the three
    /// tables, colocated; that step is not exercised by this crate's tests (no Citus
    /// there). Unlike the plain layout, it is not shared with consumers in other
    /// languages: their `ON CONFLICT (idempotency_key)` needs a unique index on the key
    /// alone.
    Distributed,
}

impl PgLayout {
    /// `plain`, `partitioned` or `distributed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Partitioned => "partitioned",
            Self::Distributed => "distributed",
        }
    }
}

impl std::fmt::Display for PgLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PgLayout {
    type Err = PgError;

    fn from_str(s: &str) -> Result<Self, PgError> {
        match s {
            "plain" => Ok(Self::Plain),
            "partitioned" => Ok(Self::Partitioned),
            "distributed" => Ok(Self::Distributed),
            other => Err(PgError::InvalidOption(format!(
                "unknown layout {:?}: expected plain, partitioned or distributed",
                other.chars().take(40).collect::<String>()
            ))),
        }
    }
}

/// Who reads the outbox (see `docs/stores.md`, "Change data capture").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum OutboxMode {
    /// idem's relay (`idem relay`, [`PgOutboxSource`](crate::PgOutboxSource)): each event
    /// is queued for it (`outbox_pending`, filled by a trigger), its writers take a lock per
    /// subject so that a subject's ids follow commit order, and the relay marks
    /// `published_at` when the broker confirms.
    #[default]
    Relay,
    /// A change-data-capture connector (Debezium's outbox event router, or any reader of
    /// the write-ahead log) reads the outbox's inserts in commit order: events are written
    /// with `published_at` set to their transaction's time (handed to the log at commit),
    /// nothing is queued, no subject lock is taken, no relay wakes. The relay refuses such
    /// a schema. Recorded in the schema (`idem_outbox_cdc`, `migrations/0014_outbox_cdc.sql`)
    /// so that every writer agrees; a schema switches to it only with an empty relay queue,
    /// and never back.
    ChangeDataCapture,
}

impl OutboxMode {
    /// `relay` or `cdc`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Relay => "relay",
            Self::ChangeDataCapture => "cdc",
        }
    }
}

impl std::fmt::Display for OutboxMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OutboxMode {
    type Err = PgError;

    fn from_str(s: &str) -> Result<Self, PgError> {
        match s {
            "relay" => Ok(Self::Relay),
            "cdc" => Ok(Self::ChangeDataCapture),
            other => Err(PgError::InvalidOption(format!(
                "unknown outbox mode {:?}: expected relay or cdc",
                other.chars().take(40).collect::<String>()
            ))),
        }
    }
}

impl Default for PgConfig {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            lock_timeout: Some(Self::DEFAULT_LOCK_TIMEOUT),
            statement_timeout: None,
            probe_timeout: Self::DEFAULT_PROBE_TIMEOUT,
            reply_timeout: Self::DEFAULT_REPLY_TIMEOUT,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(30),
            notify: true,
            notify_interval: Duration::from_millis(10),
            audit_indexes: true,
            layout: PgLayout::Plain,
            outbox: OutboxMode::Relay,
            partition_months_back: 12,
            partition_months_ahead: 3,
        }
    }
}

impl PgConfig {
    /// The default [`lock_timeout`](PgConfig::lock_timeout): 5 s.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);
    /// The default [`probe_timeout`](PgConfig::probe_timeout): 5 s.
    pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
    /// The default [`reply_timeout`](PgConfig::reply_timeout): 30 s.
    pub const DEFAULT_REPLY_TIMEOUT: Duration = Duration::from_secs(30);

    /// How long a round trip of a claim transaction waits for an answer in all: the
    /// longer of the lock and statement timeouts, plus the
    /// [`reply_timeout`](PgConfig::reply_timeout).
    pub(crate) fn reply_bound(&self) -> Duration {
        let server = self
            .lock_timeout
            .unwrap_or_default()
            .max(self.statement_timeout.unwrap_or_default());
        server.saturating_add(self.reply_timeout)
    }

    /// The default configuration for `schema`.
    ///
    /// # Errors
    /// [`PgError::InvalidSchema`] when `schema` is not an SQL identifier.
    pub fn new(schema: impl Into<String>) -> Result<Self, PgError> {
        let schema = schema.into();
        Ident::new(&schema)?;
        Ok(Self {
            schema,
            ..Self::default()
        })
    }

    /// Sets [`lock_timeout`](PgConfig::lock_timeout).
    #[must_use]
    pub fn with_lock_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// Sets [`statement_timeout`](PgConfig::statement_timeout).
    #[must_use]
    pub fn with_statement_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Sets [`reply_timeout`](PgConfig::reply_timeout).
    #[must_use]
    pub fn with_reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = timeout;
        self
    }

    /// Sets [`max_connections`](PgConfig::max_connections) (at least 1).
    #[must_use]
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Sets [`acquire_timeout`](PgConfig::acquire_timeout).
    #[must_use]
    pub fn with_acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets [`audit_indexes`](PgConfig::audit_indexes).
    #[must_use]
    pub fn with_audit_indexes(mut self, create: bool) -> Self {
        self.audit_indexes = create;
        self
    }

    /// Sets [`layout`](PgConfig::layout).
    #[must_use]
    pub fn with_layout(mut self, layout: PgLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Sets [`outbox`](PgConfig::outbox).
    #[must_use]
    pub fn with_outbox(mut self, outbox: OutboxMode) -> Self {
        self.outbox = outbox;
        self
    }

    /// Sets [`partition_months_back`](PgConfig::partition_months_back) and
    /// [`partition_months_ahead`](PgConfig::partition_months_ahead).
    #[must_use]
    pub fn with_partition_window(mut self, back: u32, ahead: u32) -> Self {
        self.partition_months_back = back;
        self.partition_months_ahead = ahead;
        self
    }

    /// Sets [`notify`](PgConfig::notify).
    #[must_use]
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Checks the fields that [`PgConfig::new`] checks (the fields are public, so a
    /// config may have been changed since).
    ///
    /// # Errors
    /// [`PgError::InvalidSchema`] or [`PgError::InvalidOption`].
    pub fn validate(&self) -> Result<(), PgError> {
        Ident::new(&self.schema)?;
        if self.max_connections == 0 {
            return Err(PgError::InvalidOption(
                "max_connections must be at least 1".into(),
            ));
        }
        if self.lock_timeout.is_some_and(|t| t.as_millis() == 0) {
            return Err(PgError::InvalidOption(
                "lock_timeout must be at least 1 ms (use None for no timeout)".into(),
            ));
        }
        if self.statement_timeout.is_some_and(|t| t.as_millis() == 0) {
            return Err(PgError::InvalidOption(
                "statement_timeout must be at least 1 ms (use None for the server's)".into(),
            ));
        }
        if self.partition_months_back > 1200 || self.partition_months_ahead > 1200 {
            return Err(PgError::InvalidOption(
                "the partition window is at most 1200 months each way".into(),
            ));
        }
        Ok(())
    }
}

/// Quotes any name (`"name"`, a `"` doubled): [`PgStore::table`](crate::PgStore::table)
/// takes names as given.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
