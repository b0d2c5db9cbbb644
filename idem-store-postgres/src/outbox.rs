//! The outbox writer: events inserted in the claim's transaction, with a `pg_notify`
//! that Postgres delivers only when that transaction commits.
//!
//! # Order per subject
//! Each insert first takes a transaction-scoped advisory lock on its subject
//! (`pg_advisory_xact_lock(space, hashtext(subject))`, several subjects in sorted order),
//! and only then draws the row's id. `space` belongs to the schema ([`subject_lock_space`]):
//! advisory locks are shared by the whole database, and one schema's open transaction must
//! not hold up another schema's writers of the same subject (two pipelines, or a test and a
//! production schema, sharing a database). A second transaction writing an event of the
//! same subject waits until the first commits or rolls back, so one subject's ids follow
//! its commit order, and the relay — which publishes a subject's events in id order, never
//! past an earlier unpublished one — publishes them in commit order. Without the lock, a
//! later id committed first would be published before the earlier one. The cost: writers
//! of one subject serialise from their enqueue to their commit (different subjects never
//! wait, except on a 32-bit hash collision), and each transaction holds one lock per
//! distinct subject in the shared lock table (sized by `max_locks_per_transaction` ×
//! `max_connections`, 6,400 by default: keep batch size × concurrency well below it).

use async_trait::async_trait;
use idem_core::ident::Ident;
use idem_core::sql;
use idem_core::sql::SqlText;
use idem_core::{OutboxEvent, OutboxWriter, StoreError};

use crate::error::map_sqlx;
use crate::store::PgTx;

/// The first key of a schema's per-subject advisory locks; the second is
/// `hashtext(subject)`. The 32-bit FNV-1a hash of `idem outbox ` followed by the schema's
/// name: stable across versions and processes, so every writer of one schema takes the same
/// locks, and writers of two schemas take the same lock only on a hash collision (which
/// costs a wait, never an order). Other programs sharing the database should not take
/// two-key advisory locks with it.
pub(crate) fn subject_lock_space(schema: &Ident) -> i32 {
    let hash = b"idem outbox "
        .iter()
        .chain(schema.as_str().as_bytes())
        .fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
        });
    i32::from_ne_bytes(hash.to_ne_bytes())
}

fn payload_text(event: &OutboxEvent) -> Result<&str, StoreError> {
    std::str::from_utf8(&event.payload).map_err(|_| StoreError::Rejected {
        // The payload itself is never put in a message.
        message: format!(
            "outbox payload of event {} is not UTF-8 (the column is jsonb)",
            event.event_id
        ),
        source: None,
    })
}

/// One column of [`PgRows`]: its values, one per row, as a Postgres array.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum PgColumn<'a> {
    /// `text[]`.
    Text(Vec<&'a str>),
    /// `text[]`, owned (hex keys and other values built for the statement).
    OwnedText(Vec<String>),
    /// `int8[]` (`bigint`).
    Int8(Vec<i64>),
    /// `int4[]` (`integer`).
    Int4(Vec<i32>),
    /// `bool[]`.
    Bool(Vec<bool>),
}

impl PgColumn<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Text(v) => v.len(),
            Self::OwnedText(v) => v.len(),
            Self::Int8(v) => v.len(),
            Self::Int4(v) => v.len(),
            Self::Bool(v) => v.len(),
        }
    }

    fn cast(&self) -> &'static str {
        match self {
            Self::Text(_) | Self::OwnedText(_) => "text[]",
            Self::Int8(_) => "int8[]",
            Self::Int4(_) => "int4[]",
            Self::Bool(_) => "bool[]",
        }
    }
}

/// Business rows for one table, column by column, that
/// [`PgTx::insert_and_enqueue`] inserts in the same statement — and so the same round
/// trip — as the outbox events that announce them.
///
/// ```
/// use idem_store_postgres::{PgColumn, PgRows};
/// let rows = PgRows::new(idem_core::sql!("disbursements"))
///     .column("award_id", PgColumn::Text(vec!["A-1", "A-2"]))?
///     .column("amount_cents", PgColumn::Int8(vec![125_000, 99_000]))?;
/// assert_eq!(rows.len(), Some(2));
/// // Column names are checked identifiers, never raw SQL.
/// assert!(PgRows::new(idem_core::sql!("t")).column("a; DROP TABLE t", PgColumn::Bool(vec![])).is_err());
/// # Ok::<(), idem_core::ident::InvalidIdent>(())
/// ```
#[derive(Debug, Clone)]
pub struct PgRows<'a> {
    table: SqlText,
    columns: Vec<(Ident, PgColumn<'a>)>,
}

impl<'a> PgRows<'a> {
    /// Rows for `table`: SQL text naming it, possibly schema-qualified (program text and
    /// validated identifiers only, like [`PgTx::table`]).
    pub fn new(table: SqlText) -> Self {
        Self {
            table,
            columns: Vec::new(),
        }
    }

    /// Adds the column `name` with one value per row.
    ///
    /// # Errors
    /// [`InvalidIdent`](idem_core::ident::InvalidIdent) when `name` is not a plain
    /// identifier.
    pub fn column(
        mut self,
        name: &str,
        values: PgColumn<'a>,
    ) -> Result<Self, idem_core::ident::InvalidIdent> {
        self.columns.push((Ident::new(name)?, values));
        Ok(self)
    }

    /// The number of rows: `None` when there is no column or the columns' lengths differ.
    pub fn len(&self) -> Option<usize> {
        let first = self.columns.first()?.1.len();
        self.columns
            .iter()
            .all(|(_, c)| c.len() == first)
            .then_some(first)
    }

    /// Whether there are no rows (or no columns).
    pub fn is_empty(&self) -> bool {
        self.len().unwrap_or(0) == 0
    }

    /// `idem_rows AS (INSERT INTO table (c1, …) SELECT * FROM unnest($first::t1[], …)), `
    fn cte(&self, first: usize) -> SqlText {
        let table = &self.table;
        let mut sql = sql!("idem_rows AS (INSERT INTO {table} (", table);
        for (i, (name, _)) in self.columns.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.push(name);
        }
        sql.push(") SELECT * FROM unnest(");
        for (i, (_, column)) in self.columns.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.push("$").push(first + i).push("::").push(column.cast());
        }
        sql.push(")), ");
        sql
    }
}

impl PgTx {
    /// Stages several events in one round trip (`INSERT … SELECT … FROM unnest(…)`),
    /// in slice order (their ids, and so their publication order, follow it). An event
    /// id already in the outbox, or repeated in `events`, is stored once. Each event's
    /// [`traceparent`](OutboxEvent::traceparent) goes to the `traceparent` column (when
    /// the outbox has it: `migrations/0007_outbox_traceparent.sql`).
    ///
    /// # Errors
    /// [`StoreError::Rejected`] when a payload is not valid JSON (the `jsonb` column
    /// refuses it; the transaction is then aborted), or the database's error.
    pub async fn enqueue_many(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        self.stage(None, events).await
    }

    /// Inserts `rows` and stages `events` ([`enqueue_many`](Self::enqueue_many)) in one
    /// statement: one round trip where two separate statements take two. Both commit
    /// or roll back with the claim, as always; a failure of either aborts the
    /// transaction (its [`commit`](idem_core::ClaimTx::commit) then rolls back).
    ///
    /// # Errors
    /// [`StoreError::Rejected`] when the columns of `rows` differ in length (nothing is
    /// sent) or a payload is not valid JSON; else the database's error (a constraint of
    /// the business table included).
    pub async fn insert_and_enqueue(
        &mut self,
        rows: &PgRows<'_>,
        events: &[OutboxEvent],
    ) -> Result<(), StoreError> {
        if rows.len().is_none() {
            return Err(StoreError::Rejected {
                message: "the business rows' columns are missing or differ in length".into(),
                source: None,
            });
        }
        self.stage(Some(rows), events).await
    }

    /// The outbox insert of `events`, after `rows`' insert in the same statement when
    /// given.
    async fn stage(
        &mut self,
        rows: Option<&PgRows<'_>>,
        events: &[OutboxEvent],
    ) -> Result<(), StoreError> {
        let mut ids = Vec::with_capacity(events.len());
        let mut types = Vec::with_capacity(events.len());
        let mut subjects = Vec::with_capacity(events.len());
        let mut keys = Vec::with_capacity(events.len());
        let mut payloads = Vec::with_capacity(events.len());
        for ev in events {
            ids.push(ev.event_id.to_string());
            types.push(ev.event_type.as_str());
            subjects.push(ev.subject.as_str());
            keys.push(ev.idempotency_key.to_hex());
            payloads.push(payload_text(ev)?);
        }
        let shared = self.shared_arc();
        let (slot, notify) = shared.outbox_slot();
        let traced = shared.has_traceparent();
        // The outbox's own parameters come first: the events' columns, the traceparents,
        // the channel; the rows' columns follow.
        let own = 5 + usize::from(traced) + usize::from(notify);
        let sql = match rows {
            None if traced => shared.sql.enqueue_many_traced[slot].clone(),
            None => shared.sql.enqueue_many[slot].clone(),
            Some(rows) => {
                let ctes = if traced {
                    &shared.sql.enqueue_many_traced_ctes[slot]
                } else {
                    &shared.sql.enqueue_many_ctes[slot]
                };
                let prefix = rows.cte(own + 1);
                crate::sql::statement(sql!("WITH {prefix}{ctes}", prefix, ctes))
            }
        };
        let mut q = sqlx::query(sql)
            .bind(&ids)
            .bind(&types)
            .bind(&subjects)
            .bind(&keys)
            .bind(&payloads);
        if traced {
            let traces: Vec<Option<String>> = events
                .iter()
                .map(|e| e.traceparent.map(|t| t.to_string()))
                .collect();
            q = q.bind(traces);
        }
        if notify {
            q = q.bind(shared.channel.as_str());
        }
        for (_, column) in rows.map(|r| r.columns.as_slice()).unwrap_or_default() {
            q = match column {
                PgColumn::Text(v) => q.bind(v),
                PgColumn::OwnedText(v) => q.bind(v),
                PgColumn::Int8(v) => q.bind(v),
                PgColumn::Int4(v) => q.bind(v),
                PgColumn::Bool(v) => q.bind(v),
            };
        }
        let (conn, reply) = self.io();
        if let Err(e) = reply.wait(q.execute(conn)).await {
            self.mark_aborted();
            return Err(map_sqlx(
                e,
                if rows.is_some() {
                    "insert rows and enqueue their outbox events"
                } else {
                    "enqueue outbox events"
                },
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl OutboxWriter for PgTx {
    /// Inserts the event (`ON CONFLICT (event_id) DO NOTHING`) and, when
    /// [`PgConfig::notify`](crate::PgConfig::notify) is on (at most once per
    /// [`PgConfig::notify_interval`](crate::PgConfig::notify_interval)), `pg_notify`s the
    /// schema's channel in the same statement: the relay wakes when this transaction
    /// commits. The event's [`traceparent`](OutboxEvent::traceparent) goes to the
    /// `traceparent` column (when the outbox has it).
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        let payload = payload_text(event)?;
        let shared = self.shared_arc();
        let (slot, notify) = shared.outbox_slot();
        let traced = shared.has_traceparent();
        let sql = if traced {
            &shared.sql.enqueue_traced
        } else {
            &shared.sql.enqueue
        };
        let mut q = sqlx::query(sql[slot].clone())
            .bind(event.event_id.to_string())
            .bind(event.event_type.as_str())
            .bind(event.subject.as_str())
            .bind(event.idempotency_key.to_hex())
            .bind(payload);
        if traced {
            q = q.bind(event.traceparent.map(|t| t.to_string()));
        }
        if notify {
            q = q.bind(shared.channel.as_str());
        }
        let (conn, reply) = self.io();
        if let Err(e) = reply.wait(q.execute(conn)).await {
            self.mark_aborted();
            return Err(map_sqlx(e, "enqueue outbox event"));
        }
        Ok(())
    }
}
