//! What every connection of a store shares: the statements built once from the schema, and
//! what the schema has.

use idem_core::ident::Ident;
use idem_core::sql::SqlText;
use idem_core::{sql, StoreError};
use sqlx::SqlStr;

use crate::config::{PgConfig, PgLayout};
use crate::outbox::subject_lock_space;
use crate::sql::statement;
use crate::warm::Warm;

/// Statements built once per store from the validated schema name.
#[derive(Debug)]
pub(crate) struct Sql {
    /// Without the identity column (a table not migrated to 0006).
    pub(crate) claim: SqlStr,
    pub(crate) claim_batch: SqlStr,
    /// With the identity column: `ON CONFLICT DO NOTHING` on any unique index (the key's
    /// and the identity's).
    pub(crate) claim_identity: SqlStr,
    pub(crate) claim_batch_identity: SqlStr,
    /// Whether `claim_identity` and `claim_batch_identity` answer every item —
    /// `(inserted, duplicate)`, and the key first in a batch; duplicate when it inserted
    /// nothing and the key's own row is in the statement's snapshot — rather than the
    /// inserted rows alone. Any other refusal (a conflict, or a row committed while the
    /// statement waited) is left to `classify`, whose fresh snapshot answers as it always
    /// did.
    pub(crate) claims_classify: bool,
    /// After an identity claim inserted nothing: the key's own row (`o = 0`: duplicate),
    /// else the identity's (`o = 1`: conflict), per item.
    pub(crate) classify: SqlStr,
    /// By [`Shared::outbox_slot`]: `[relay with pg_notify, relay without, change data
    /// capture]`; `$1..$5` the event, `$6` the channel (the first only).
    pub(crate) enqueue: [SqlStr; 3],
    /// As `enqueue`; `$1..$5` the events, `$6` the channel.
    pub(crate) enqueue_many: [SqlStr; 3],
    /// As `enqueue`, with the `traceparent` column (migration 0007) as `$6` and the
    /// channel as `$7`.
    pub(crate) enqueue_traced: [SqlStr; 3],
    /// As `enqueue_many`, with the `traceparent` column as `$6` and the channel as `$7`.
    pub(crate) enqueue_many_traced: [SqlStr; 3],
    /// `enqueue_many`'s text after its leading `WITH `: the common table expressions and
    /// the final query, for a statement that puts one more expression before them
    /// ([`crate::PgRows`]).
    pub(crate) enqueue_many_ctes: [SqlText; 3],
    /// `enqueue_many_traced`'s text after its leading `WITH `.
    pub(crate) enqueue_many_traced_ctes: [SqlText; 3],
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: PgConfig,
    /// The layout the claim statements are written for.
    pub(crate) layout: PgLayout,
    /// The schema, validated.
    pub(crate) schema: Ident,
    pub(crate) channel: String,
    pub(crate) begin: SqlStr,
    pub(crate) sql: Sql,
    /// Whether `processed_messages` has the identity column (migration 0006): claims then
    /// record the identity and detect conflicts. Found at connect, set by `migrate`.
    pub(crate) identity: std::sync::atomic::AtomicBool,
    /// Whether `outbox` has the `traceparent` column (migration 0007): events are then
    /// written with their trace context. Found at connect, set by `migrate`.
    pub(crate) traceparent: std::sync::atomic::AtomicBool,
    /// Whether a change-data-capture connector reads the outbox
    /// ([`OutboxMode::ChangeDataCapture`](crate::OutboxMode::ChangeDataCapture)):
    /// recorded in the schema, found at connect, set by `migrate`.
    pub(crate) cdc: std::sync::atomic::AtomicBool,
    /// When the last notifying insert was sent, in microseconds since `epoch`.
    last_notify: std::sync::atomic::AtomicU64,
    epoch: std::time::Instant,
    /// Connections of claim transactions that ended cleanly, for the next `begin`
    /// ([`crate::warm`]).
    pub(crate) warm: Warm,
}

impl AsRef<Warm> for Shared {
    fn as_ref(&self) -> &Warm {
        &self.warm
    }
}

impl Shared {
    /// Whether claims record the identity (the table has its column).
    pub(crate) fn has_identity(&self) -> bool {
        self.identity.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether outbox rows have the `traceparent` column.
    pub(crate) fn has_traceparent(&self) -> bool {
        self.traceparent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a change-data-capture connector reads the outbox.
    pub(crate) fn is_cdc(&self) -> bool {
        self.cdc.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Which of the outbox statements the next insert sends (the index into
    /// [`Sql::enqueue`] and its siblings), and whether it binds the relay's channel:
    /// `(0, true)` for a relay's insert that wakes it, `(1, false)` for one that does not
    /// ([`take_notify`](Self::take_notify)), `(2, false)` under change data capture.
    pub(crate) fn outbox_slot(&self) -> (usize, bool) {
        if self.is_cdc() {
            (2, false)
        } else if self.take_notify() {
            (0, true)
        } else {
            (1, false)
        }
    }

    /// Whether this outbox insert should carry a `pg_notify` (see
    /// [`PgConfig::notify_interval`]).
    fn take_notify(&self) -> bool {
        use std::sync::atomic::Ordering;
        if !self.config.notify {
            return false;
        }
        let interval = u64::try_from(self.config.notify_interval.as_micros()).unwrap_or(u64::MAX);
        if interval == 0 {
            return true;
        }
        // +1 so that the very first insert always notifies.
        let now =
            u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX) + interval + 1;
        let last = self.last_notify.load(Ordering::Relaxed);
        now.saturating_sub(last) >= interval
            && self
                .last_notify
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// `"schema"."name"` for one of the store's own tables.
    pub(crate) fn table(&self, name: &'static str) -> SqlText {
        table_in(&self.schema, name)
    }

    /// `"schema"."name"` for a table named in configuration or generated (a partition).
    pub(crate) fn table_ident(&self, name: &Ident) -> SqlText {
        let schema = &self.schema;
        sql!("{schema}.{name}", schema, name)
    }

    pub(super) fn new(
        config: PgConfig,
        layout: PgLayout,
        identity: bool,
        traceparent: bool,
        cdc: bool,
    ) -> Result<Self, StoreError> {
        config.validate()?;
        let schema = Ident::new(&config.schema).map_err(crate::PgError::from)?;
        let pm = table_in(&schema, "processed_messages");
        let ob = table_in(&schema, "outbox");
        // The first key of this schema's per-subject locks (crate::outbox).
        let space = subject_lock_space(&schema);
        let notify_tail = " RETURNING 1) SELECT pg_notify($6, '') FROM ins LIMIT 1";
        let quiet_tail = " RETURNING 1) SELECT 1 FROM ins LIMIT 1";
        let notify_tail_traced = " RETURNING 1) SELECT pg_notify($7, '') FROM ins LIMIT 1";
        // The outbox's unique event index (crate::distributed: per subject there).
        let event_key = match layout {
            PgLayout::Plain | PgLayout::Partitioned => "(event_id)",
            PgLayout::Distributed => "(subject, event_id)",
        };
        // The parameters of the classification (and of the batch claim that classifies):
        // $1 keys, $2 award ids, $3 submission timestamps, $4 months (partitioned).
        let month = match layout {
            PgLayout::Plain | PgLayout::Distributed => "",
            PgLayout::Partitioned => " AND p.submission_month = u.m::date",
        };
        let months = match layout {
            PgLayout::Plain | PgLayout::Distributed => "",
            PgLayout::Partitioned => ", $4::text[]",
        };
        let m = match layout {
            PgLayout::Plain | PgLayout::Distributed => "",
            PgLayout::Partitioned => ", m",
        };
        // The key's own row is (award_id, key) on the distributed layout: the primary
        // key's lookup (on Citus, one shard's).
        let award = match layout {
            PgLayout::Plain | PgLayout::Partitioned => "",
            PgLayout::Distributed => " AND p.award_id = u.a",
        };
        // Which row refused item `u`: the key's own (`o = 0`: duplicate), else the
        // identity's (`o = 1`: conflict).
        let lookup = sql!(
            "LEFT JOIN LATERAL ( \
               SELECT p.idempotency_key, 0 AS o FROM {pm} p \
               WHERE p.idempotency_key = u.k{award}{month} \
               UNION ALL \
               (SELECT p.idempotency_key, 1 AS o FROM {pm} p \
                WHERE p.award_id = u.a AND p.submission_timestamp = u.ts \
                AND p.award_id IS NOT NULL AND p.submission_timestamp IS NOT NULL{month} \
                LIMIT 1) \
               ORDER BY o LIMIT 1) f ON true",
            pm,
            award,
            month
        );
        // The outbox statements, by `Shared::outbox_slot`: a relay's insert takes its
        // subjects' locks before its ids are drawn (crate::outbox) and, in the first
        // variant, wakes the relay; under change data capture the log's commit order is
        // the subjects' order, so the insert takes no lock, and its events are handed to
        // the log at commit (`published_at`), queued for no relay.
        let variants =
            |notify: &'static str| [(true, notify), (true, quiet_tail), (false, quiet_tail)];
        let published = |lock: bool| {
            if lock {
                ("", "")
            } else {
                (", published_at", ", now()")
            }
        };
        // The many-event statements without their leading `WITH ` (see `Sql`).
        let many_ctes = |notify: &'static str,
                         trace_col: &'static str,
                         trace_arr: &'static str,
                         trace_var: &'static str| {
            variants(notify).map(|(lock, tail)| {
                let (lock_cte, lock_where) = if lock {
                    (
                        sql!(
                            "l AS (SELECT pg_advisory_xact_lock({space}, h) FROM \
                             (SELECT DISTINCT hashtext(x) AS h FROM unnest($3::text[]) AS x ORDER BY 1) q), ",
                            space
                        ),
                        "WHERE (SELECT count(*) FROM l) >= 0 ",
                    )
                } else {
                    (SqlText::new(), "")
                };
                let (pc, pv) = published(lock);
                sql!(
                    "{lock_cte}ins AS (INSERT INTO {ob} \
                     (event_id, event_type, subject, idempotency_key, payload, created_at{trace_col}{pc}) \
                     SELECT e, t, s, k, p::jsonb, now(){trace_var}{pv} \
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]{trace_arr}) \
                     WITH ORDINALITY AS u(e, t, s, k, p{trace_var}, n) \
                     {lock_where}ORDER BY n \
                     ON CONFLICT {event_key} DO NOTHING{tail}",
                    lock_cte, ob, trace_col, pc, trace_var, pv, trace_arr, lock_where, event_key, tail
                )
            })
        };
        let enqueue_many_ctes = many_ctes(notify_tail, "", "", "");
        let enqueue_many_traced_ctes =
            many_ctes(notify_tail_traced, ", traceparent", ", $6::text[]", ", tp");
        // The one-event statements.
        let one = |notify: &'static str, trace_col: &'static str, trace_val: &'static str| {
            variants(notify).map(|(lock, tail)| {
                let (lock_cte, from_l) = if lock {
                    (
                        sql!("l AS (SELECT pg_advisory_xact_lock({space}, hashtext($3))), ", space),
                        " FROM l",
                    )
                } else {
                    (SqlText::new(), "")
                };
                let (pc, pv) = published(lock);
                statement(sql!(
                    "WITH {lock_cte}ins AS (INSERT INTO {ob} \
                     (event_id, event_type, subject, idempotency_key, payload, created_at{trace_col}{pc}) \
                     SELECT $1, $2, $3, $4, $5::jsonb, now(){trace_val}{pv}{from_l} \
                     ON CONFLICT {event_key} DO NOTHING{tail}",
                    lock_cte, ob, trace_col, pc, trace_val, pv, from_l, event_key, tail
                ))
            })
        };
        let sql = Sql {
            claim: match layout {
                PgLayout::Plain => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at) VALUES ($1, $2, now()) \
                     ON CONFLICT (idempotency_key) DO NOTHING", pm
                )),
                // $3 is the submission month (crate::partition): part of the primary key,
                // so part of the conflict target.
                PgLayout::Partitioned => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at, submission_month) \
                     VALUES ($1, $2, now(), $3::date) \
                     ON CONFLICT (idempotency_key, submission_month) DO NOTHING", pm
                )),
                // The award id leads the primary key (crate::distributed).
                PgLayout::Distributed => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at) VALUES ($1, $2, now()) \
                     ON CONFLICT (award_id, idempotency_key) DO NOTHING", pm
                )),
            },
            claim_batch: match layout {
                PgLayout::Plain => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at) \
                     SELECT k, a, now() FROM unnest($1::text[], $2::text[]) AS t(k, a) \
                     ON CONFLICT (idempotency_key) DO NOTHING RETURNING idempotency_key", pm
                )),
                PgLayout::Partitioned => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at, submission_month) \
                     SELECT k, a, now(), m::date FROM unnest($1::text[], $2::text[], $3::text[]) \
                     AS t(k, a, m) \
                     ON CONFLICT (idempotency_key, submission_month) DO NOTHING \
                     RETURNING idempotency_key", pm
                )),
                PgLayout::Distributed => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at) \
                     SELECT k, a, now() FROM unnest($1::text[], $2::text[]) AS t(k, a) \
                     ON CONFLICT (award_id, idempotency_key) DO NOTHING RETURNING idempotency_key", pm
                )),
            },
            // Any unique index: the key's primary key and the identity's index. One round
            // trip for the claim and, when it inserted nothing, whether the key's own row
            // is there (see `claims_classify`): a redelivery is answered without a second
            // statement. The lookup runs only when nothing was inserted.
            claim_identity: match layout {
                PgLayout::Plain | PgLayout::Partitioned => {
                    let (column, value, month) = match layout {
                        PgLayout::Partitioned => (
                            ", submission_month",
                            ", $4::date",
                            " AND p.submission_month = $4::date",
                        ),
                        PgLayout::Plain | PgLayout::Distributed => ("", "", ""),
                    };
                    statement(sql!(
                        "WITH ins AS (INSERT INTO {pm} \
                         (idempotency_key, award_id, claimed_at, submission_timestamp{column}) \
                         VALUES ($1, $2, now(), $3{value}) ON CONFLICT DO NOTHING RETURNING 1) \
                         SELECT EXISTS (SELECT 1 FROM ins), \
                         CASE WHEN NOT EXISTS (SELECT 1 FROM ins) THEN \
                         EXISTS (SELECT 1 FROM {pm} p WHERE p.idempotency_key = $1{month}) END",
                        pm, column, value, month
                    ))
                }
                // See `claim_batch_identity`: on Citus the insert and the classification
                // stay apart.
                PgLayout::Distributed => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at, submission_timestamp) \
                     VALUES ($1, $2, now(), $3) ON CONFLICT DO NOTHING", pm
                )),
            },
            claim_batch_identity: match layout {
                // One round trip for the claim and, for what it could not insert, whether
                // the key's own row is there (see `claims_classify`): a lateral
                // index lookup per such key, never a plan that reads the whole table.
                PgLayout::Plain | PgLayout::Partitioned => {
                    let (column, value) = match layout {
                        PgLayout::Partitioned => (", submission_month", ", m::date"),
                        PgLayout::Plain | PgLayout::Distributed => ("", ""),
                    };
                    statement(sql!(
                        "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]{months}) \
                         WITH ORDINALITY AS t(k, a, ts{m}, n)), \
                         ins AS (INSERT INTO {pm} \
                         (idempotency_key, award_id, claimed_at, submission_timestamp{column}) \
                         SELECT k, a, now(), ts{value} FROM u ORDER BY n \
                         ON CONFLICT DO NOTHING RETURNING idempotency_key) \
                         SELECT u.k, i.idempotency_key IS NOT NULL, d.found IS NOT NULL \
                         FROM u LEFT JOIN ins i ON i.idempotency_key = u.k \
                         LEFT JOIN LATERAL (SELECT true AS found FROM {pm} p \
                           WHERE i.idempotency_key IS NULL AND p.idempotency_key = u.k{month} \
                           LIMIT 1) d ON true \
                         ORDER BY u.n",
                        months, m, pm, column, value, month
                    ))
                }
                // A modifying CTE joined with its own distributed table is not a plain
                // single-shard statement on Citus (and real Citus is not in our tests):
                // the distributed layout keeps the insert and the classification apart.
                PgLayout::Distributed => statement(sql!(
                    "INSERT INTO {pm} (idempotency_key, award_id, claimed_at, submission_timestamp) \
                     SELECT k, a, now(), ts FROM unnest($1::text[], $2::text[], $3::text[]) \
                     WITH ORDINALITY AS u(k, a, ts, n) ORDER BY n \
                     ON CONFLICT DO NOTHING RETURNING idempotency_key", pm
                )),
            },
            claims_classify: layout != PgLayout::Distributed,
            classify: {
                statement(sql!(
                    "SELECT u.k, f.idempotency_key, f.o \
                     FROM unnest($1::text[], $2::text[], $3::text[]{months}) AS u(k, a, ts{m}) \
                     {lookup}", months, m, lookup
                ))
            },
            enqueue: one(notify_tail, "", ""),
            enqueue_many: enqueue_many_ctes
                .clone()
                .map(|ctes| statement(sql!("WITH {ctes}", ctes))),
            enqueue_traced: one(notify_tail_traced, ", traceparent", ", $6"),
            enqueue_many_traced: enqueue_many_traced_ctes
                .clone()
                .map(|ctes| statement(sql!("WITH {ctes}", ctes))),
            enqueue_many_ctes,
            enqueue_many_traced_ctes,
        };
        // One round trip: a simple query with the settings after BEGIN.
        let begin = match (config.lock_timeout, config.statement_timeout) {
            (Some(l), Some(st)) => statement(sql!(
                "BEGIN; SET LOCAL lock_timeout = '{l}ms'; SET LOCAL statement_timeout = '{st}ms'",
                l = l.as_millis(),
                st = st.as_millis()
            )),
            (Some(l), None) => statement(sql!(
                "BEGIN; SET LOCAL lock_timeout = '{ms}ms'",
                ms = l.as_millis()
            )),
            (None, Some(st)) => statement(sql!(
                "BEGIN; SET LOCAL statement_timeout = '{ms}ms'",
                ms = st.as_millis()
            )),
            (None, None) => sqlx::SqlSafeStr::into_sql_str("BEGIN"),
        };
        // Channel names are identifiers of at most 63 bytes; a truncated name shared by
        // two schemas only causes a spurious wake-up.
        let mut channel = format!("idem_outbox.{}", config.schema);
        channel.truncate(63);
        Ok(Self {
            config,
            layout,
            schema,
            channel,
            begin,
            sql,
            identity: std::sync::atomic::AtomicBool::new(identity),
            traceparent: std::sync::atomic::AtomicBool::new(traceparent),
            cdc: std::sync::atomic::AtomicBool::new(cdc),
            last_notify: std::sync::atomic::AtomicU64::new(0),
            warm: Warm::default(),
            epoch: std::time::Instant::now(),
        })
    }
}

/// `"schema"."name"` for a table whose name is program text.
fn table_in(schema: &Ident, name: &'static str) -> SqlText {
    let name = Ident::from_static(name);
    sql!("{schema}.{name}", schema, name)
}
