//! [`PgStore`] and its transaction [`PgTx`]: the claim, the business writes and the
//! outbox rows in one Postgres transaction.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::ident::Ident;
use idem_core::sql::SqlText;
use idem_core::{
    sql, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, PositionMove,
    RunNote, StoreError,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgTransactionManager;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool, Postgres, SqlStr};
use sqlx_core::transaction::TransactionManager;

use crate::config::{quote, PgConfig, PgLayout};
use crate::error::{map_sqlx, sqlstate, IN_FAILED_TRANSACTION, LOCK_NOT_AVAILABLE};
use crate::outbox::subject_lock_space;
use crate::sql::statement;
use crate::warm::Warm;

/// The SQLSTATE the append-only trigger raises.
pub const APPEND_ONLY_SQLSTATE: &str = "IDEM1";

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
    /// `[with pg_notify, without]`; `$1..$5` the event, `$6` the channel.
    pub(crate) enqueue: [SqlStr; 2],
    /// `[with pg_notify, without]`; `$1..$5` the events, `$6` the channel.
    pub(crate) enqueue_many: [SqlStr; 2],
    /// As `enqueue`, with the `traceparent` column (migration 0007) as `$6` and the
    /// channel as `$7`.
    pub(crate) enqueue_traced: [SqlStr; 2],
    /// As `enqueue_many`, with the `traceparent` column as `$6` and the channel as `$7`.
    pub(crate) enqueue_many_traced: [SqlStr; 2],
    /// `enqueue_many`'s text after its leading `WITH `: the common table expressions and
    /// the final query, for a statement that puts one more expression before them
    /// ([`crate::PgRows`]).
    pub(crate) enqueue_many_ctes: [SqlText; 2],
    /// `enqueue_many_traced`'s text after its leading `WITH `.
    pub(crate) enqueue_many_traced_ctes: [SqlText; 2],
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

    /// Whether this outbox insert should carry a `pg_notify` (see
    /// [`PgConfig::notify_interval`]).
    pub(crate) fn take_notify(&self) -> bool {
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

    fn new(
        config: PgConfig,
        layout: PgLayout,
        identity: bool,
        traceparent: bool,
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
        // The many-event statements without their leading `WITH ` (see `Sql`).
        let enqueue_many_ctes = [notify_tail, quiet_tail].map(|tail| {
            sql!(
                "l AS (SELECT pg_advisory_xact_lock({space}, h) FROM \
                       (SELECT DISTINCT hashtext(x) AS h FROM unnest($3::text[]) AS x ORDER BY 1) q), \
                     ins AS (INSERT INTO {ob} \
                     (event_id, event_type, subject, idempotency_key, payload, created_at) \
                     SELECT e, t, s, k, p::jsonb, now() \
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) \
                     WITH ORDINALITY AS u(e, t, s, k, p, n) \
                     WHERE (SELECT count(*) FROM l) >= 0 ORDER BY n \
                     ON CONFLICT {event_key} DO NOTHING{tail}", space, ob, event_key, tail
            )
        });
        let enqueue_many_traced_ctes = [notify_tail_traced, quiet_tail].map(|tail| {
            sql!(
                "l AS (SELECT pg_advisory_xact_lock({space}, h) FROM \
                       (SELECT DISTINCT hashtext(x) AS h FROM unnest($3::text[]) AS x ORDER BY 1) q), \
                     ins AS (INSERT INTO {ob} \
                     (event_id, event_type, subject, idempotency_key, payload, created_at, \
                      traceparent) \
                     SELECT e, t, s, k, p::jsonb, now(), tp \
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
                       $6::text[]) \
                     WITH ORDINALITY AS u(e, t, s, k, p, tp, n) \
                     WHERE (SELECT count(*) FROM l) >= 0 ORDER BY n \
                     ON CONFLICT {event_key} DO NOTHING{tail}", space, ob, event_key, tail
            )
        });
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
            // Per-subject order: see crate::outbox (a transaction-scoped advisory lock per
            // subject, taken before the row's id is drawn).
            enqueue: [notify_tail, quiet_tail].map(|tail| {
                statement(sql!(
                    "WITH l AS (SELECT pg_advisory_xact_lock({space}, hashtext($3))), \
                     ins AS (INSERT INTO {ob} \
                     (event_id, event_type, subject, idempotency_key, payload, created_at) \
                     SELECT $1, $2, $3, $4, $5::jsonb, now() FROM l \
                     ON CONFLICT {event_key} DO NOTHING{tail}", space, ob, event_key, tail
                ))
            }),
            enqueue_many: enqueue_many_ctes
                .clone()
                .map(|ctes| statement(sql!("WITH {ctes}", ctes))),
            enqueue_traced: [notify_tail_traced, quiet_tail].map(|tail| {
                statement(sql!(
                    "WITH l AS (SELECT pg_advisory_xact_lock({space}, hashtext($3))), \
                     ins AS (INSERT INTO {ob} \
                     (event_id, event_type, subject, idempotency_key, payload, created_at, \
                      traceparent) \
                     SELECT $1, $2, $3, $4, $5::jsonb, now(), $6 FROM l \
                     ON CONFLICT {event_key} DO NOTHING{tail}", space, ob, event_key, tail
                ))
            }),
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

/// The Postgres claim store: a [`PgPool`] and a validated schema. Clones share the pool.
///
/// # Contract
/// - A claim is `INSERT INTO processed_messages … ON CONFLICT (idempotency_key) DO
///   NOTHING` in the caller's transaction (on the partitioned layout, [`PgLayout`], the
///   row also gets the month of [`ClaimMeta::submission_timestamp`] and the target is
///   `(idempotency_key, submission_month)`; on the distributed layout the target is
///   `(award_id, idempotency_key)`, the award id being [`ClaimMeta::subject`]): a
///   concurrent claim of the same key waits on
///   the unique index until the first transaction commits (`Duplicate`) or rolls back
///   (`Claimed`), or answers `InProgress` after [`PgConfig::lock_timeout`].
/// - Conflicts: [`migrate`](PgStore::migrate) adds a nullable `submission_timestamp`
///   column and a unique index on `(award_id, submission_timestamp)`, where a row
///   without a timestamp conflicts with none (`migrations/0006_claim_identity.sql`; on
///   the partitioned layout the index also holds `submission_month`, a function of the
///   timestamp). A claim then records
///   [`ClaimMeta::identity`] and its conflict target is any unique index: a new key of an
///   identity already claimed inserts nothing, and a second statement finds the row that
///   refused it — the key's (`Duplicate`) or the identity's ([`ClaimOutcome::Conflict`]).
///   A concurrent claim of the same identity waits on that index like one of the same
///   key. [`Capabilities::detects_conflicts`] says whether the column is there.
/// - Without that migration it uses only the reference columns `idempotency_key,
///   award_id, claimed_at` of `processed_messages`, so a table created by another program
///   works unchanged (it needs a primary key or unique index on `idempotency_key`), without
///   conflict detection. After the migration the reference program still works: it never
///   fills the new column, and its rows are never in conflict.
/// - [`ClaimTx::claim_batch`] is one round trip.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::{ident::Ident, sql, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
/// use idem_store_postgres::{sql::statement, PgConfig, PgStore};
///
/// let store = PgStore::connect("postgres://postgres@127.0.0.1/test", PgConfig::new("grants")?).await?;
/// store.migrate().await?;
/// let key = IdempotencyKey::derive("A-2026-014", "2026-07-01T09:00:00Z", b"{}")?;
/// let mut tx = store.begin().await?;
/// if tx.claim(&key, &ClaimMeta::new("A-2026-014")).await? == ClaimOutcome::Claimed {
///     let table = Ident::new("disbursements")?;
///     let insert = sql!("INSERT INTO {schema}.{table} (award_id, amount_cents, idempotency_key) \
///                        VALUES ($1, $2, $3)", schema = store.schema_ident(), table);
///     sqlx::query(statement(insert)).bind("A-2026-014").bind(125_000_i64).bind(key.to_hex())
///         .execute(tx.conn()).await?;
///     tx.commit().await?;
/// } else {
///     tx.rollback().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    shared: Arc<Shared>,
}

/// The connection options of `url`, its TLS settings read as libpq reads them where
/// sqlx reads them otherwise, and a password refused over a connection whose server is
/// not verified:
///
/// - `sslmode=require` with an `sslrootcert` verifies the server's certificate chain, as
///   `verify-ca` does (libpq's rule; sqlx verified nothing, so a certificate from any CA
///   was accepted);
/// - a password (in the URL, `?password=`, or `PGPASSWORD`) is sent to a host that is not
///   loopback (`127.0.0.0/8`, `::1`, `localhost`, a Unix socket) only over `verify-ca` or
///   `verify-full`: with `prefer` (the default) anyone on the path can refuse TLS and ask
///   for the password in clear, and with an unverified `require` present a certificate
///   of their own. `accept_unverified=true` in the URL sends it anyway.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions, StoreError> {
    use sqlx::postgres::PgSslMode;
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    let (mut root, mut accept, mut password) = (false, false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "accept_unverified" => {
                accept = match v {
                    "true" => true,
                    "false" => false,
                    _ => {
                        return Err(StoreError::Config(format!(
                            "accept_unverified={v}: must be true or false"
                        )))
                    }
                };
                continue;
            }
            "sslrootcert" => root = !v.is_empty(),
            "password" => password = !v.is_empty(),
            _ => {}
        }
        kept.push(pair);
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut options = PgConnectOptions::from_str(&url).map_err(|e| map_sqlx(e, "parse URL"))?;
    root |= std::env::var_os("PGSSLROOTCERT").is_some_and(|r| !r.is_empty());
    if matches!(options.get_ssl_mode(), PgSslMode::Require) && root {
        options = options.ssl_mode(PgSslMode::VerifyCa);
    }
    let authority = base.split_once("://").map_or("", |(_, rest)| {
        rest.split(['/', '?']).next().unwrap_or_default()
    });
    password |= authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
        || std::env::var_os("PGPASSWORD").is_some_and(|p| !p.is_empty());
    let host = options
        .get_host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let loopback = options.get_socket().is_some()
        || host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let verified = matches!(
        options.get_ssl_mode(),
        PgSslMode::VerifyCa | PgSslMode::VerifyFull
    );
    if password && !loopback && !verified && !accept {
        return Err(StoreError::Config(format!(
            "refusing to send a password to {host} over a connection whose server is not \
             verified (sslmode={}): use sslmode=verify-full (or verify-ca) with sslrootcert, \
             or add accept_unverified=true to the URL to send it anyway",
            match options.get_ssl_mode() {
                PgSslMode::Disable => "disable",
                PgSslMode::Allow => "allow",
                PgSslMode::Prefer => "prefer",
                PgSslMode::Require => "require",
                PgSslMode::VerifyCa => "verify-ca",
                PgSslMode::VerifyFull => "verify-full",
            }
        )));
    }
    Ok(options)
}

/// One connection, alone, before the pool: a server that refuses it (none listening, a
/// wrong password, no such database) answers at once, and its reason is the error. A pool
/// retries a refused connection until `acquire_timeout` and then says only that it timed
/// out, so an unreachable server took 30 s to be reported, without its cause.
async fn first_connection(options: &PgConnectOptions, limit: Duration) -> Result<(), StoreError> {
    use sqlx::Connection as _;
    match tokio::time::timeout(limit, PgConnection::connect_with(options)).await {
        Ok(Ok(connection)) => {
            // Its work is done; a failed goodbye changes nothing.
            let _ = connection.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(map_sqlx(e, "connect to Postgres")),
        Err(_) => Err(StoreError::Unavailable {
            message: format!(
                "connect to Postgres: no answer within {} ms (acquire_timeout)",
                limit.as_millis()
            ),
            source: None,
        }),
    }
}

impl PgStore {
    /// Connects a pool of at most [`PgConfig::max_connections`] to `url`.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid URL or schema, [`StoreError::Unavailable`]
    /// when the server cannot be reached.
    ///
    /// The claim statements follow the layout of the `processed_messages` found in the
    /// schema ([`PgLayout`]), or [`PgConfig::layout`] when there is none yet.
    pub async fn connect(url: &str, config: PgConfig) -> Result<Self, StoreError> {
        config.validate()?;
        // sqlx builds its TLS configuration from rustls's process default, which rustls
        // picks by itself only when exactly one provider is compiled in (a build with
        // the SQS client has two): install ring unless one is installed.
        #[cfg(feature = "tls")]
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let options = connect_options(url)?;
        first_connection(&options, config.acquire_timeout).await?;
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.acquire_timeout)
            // A ping per acquire would add a round trip to every claim transaction; a
            // broken connection surfaces as an Unavailable error on first use instead.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(|e| map_sqlx(e, "connect to Postgres"))?;
        let layout = crate::partition::detect_layout(&pool, &config.schema)
            .await?
            .unwrap_or(config.layout);
        let identity = has_column(
            &pool,
            &config.schema,
            "processed_messages",
            "submission_timestamp",
        )
        .await?;
        let traceparent = has_column(&pool, &config.schema, "outbox", "traceparent").await?;
        Ok(Self {
            pool,
            shared: Arc::new(Shared::new(config, layout, identity, traceparent)?),
        })
    }

    /// Wraps an existing pool. Its claims are written for [`PgConfig::layout`] and for
    /// migrated tables (with the identity column of `migrations/0006_claim_identity.sql`
    /// and the outbox's `traceparent` of `migrations/0007_outbox_traceparent.sql`):
    /// nothing is read from the database here; use [`connect`](PgStore::connect) to
    /// follow the table's layout and columns.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid schema.
    pub fn from_pool(pool: PgPool, config: PgConfig) -> Result<Self, StoreError> {
        Ok(Self {
            pool,
            shared: {
                let layout = config.layout;
                Arc::new(Shared::new(config, layout, true, true)?)
            },
        })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &PgConfig {
        &self.shared.config
    }

    /// The schema name (unquoted).
    pub fn schema(&self) -> &str {
        &self.shared.config.schema
    }

    /// The schema as a validated identifier, for [`sql!`](idem_core::sql!) text (see
    /// [`crate::sql`]).
    pub fn schema_ident(&self) -> &Ident {
        &self.shared.schema
    }

    /// The quoted, schema-qualified name of `name`, for example `"grants"."disbursements"`.
    /// `name` is quoted as given (any `"` doubled), so it cannot break out of the
    /// identifier.
    pub fn table(&self, name: &str) -> String {
        format!("{}.{}", self.shared.schema.quoted(), quote(name))
    }

    /// `"schema"."name"` for one of the store's own tables, as SQL text.
    pub(crate) fn sql_table(&self, name: &'static str) -> SqlText {
        self.shared.table(name)
    }

    /// The NOTIFY channel of this schema's outbox.
    pub fn channel(&self) -> &str {
        &self.shared.channel
    }

    #[allow(dead_code)]
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

#[async_trait]
impl ClaimStore for PgStore {
    type Tx = PgTx;

    /// A connection kept warm by the last transaction that ended cleanly (`src/warm.rs`:
    /// without the round trip sqlx spends testing a connection given back to its pool),
    /// else one from the pool; then `BEGIN; SET LOCAL lock_timeout`.
    async fn begin(&self) -> Result<PgTx, StoreError> {
        let begin = || Some(self.shared.begin.clone());
        let tx = |conn| PgTx {
            conn: Some(conn),
            pool: self.pool.clone(),
            shared: self.shared.clone(),
            aborted: false,
            claimed: false,
            lent: false,
            stuck: false,
        };
        let bound = self.shared.config.reply_bound();
        if let Some(mut conn) = self.shared.warm.take() {
            // A failure means it broke while it was parked (a server restart): it is
            // dropped, and a pooled connection is tried instead.
            match tokio::time::timeout(bound, PgTransactionManager::begin(&mut conn, begin())).await
            {
                Ok(Ok(())) => return Ok(tx(conn)),
                Ok(Err(_)) => {}
                Err(_) => drop(conn.detach()),
            }
        }
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| map_sqlx(e, "begin"))?;
        match tokio::time::timeout(bound, PgTransactionManager::begin(&mut conn, begin())).await {
            Ok(begun) => begun.map_err(|e| map_sqlx(e, "begin"))?,
            Err(_) => {
                drop(conn.detach());
                return Err(map_sqlx(no_answer(bound), "begin"));
            }
        }
        Ok(tx(conn))
    }

    /// A new connection (not a pooled one, so it also proves that the server takes new
    /// connections, as after a failover) that commits a transaction holding a transaction
    /// id and an `UPDATE` of `idem_runs` that matches no row: the commit writes and flushes
    /// its WAL record, and writes nothing else. A standby refuses it, and so does a
    /// database made read-only (`default_transaction_read_only`, SQLSTATE 25006); an
    /// operator's lock on `idem_runs`, a stalled WAL disk or a synchronous standby that
    /// does not answer holds it, and [`PgConfig::probe_timeout`] bounds it all. A schema
    /// without `idem_runs` (not migrated since it came) commits the transaction id alone.
    async fn probe(&self) -> Result<(), StoreError> {
        use sqlx::{Connection as _, Executor as _};
        let options = self.pool.connect_options();
        let limit = self.shared.config.probe_timeout;
        let runs = self.sql_table("idem_runs");
        let write = crate::sql::statement(sql!(
            "SELECT txid_current(); UPDATE {runs} SET runs = runs WHERE false",
            runs
        ));
        let run = async {
            let mut conn = PgConnection::connect_with(&options)
                .await
                .map_err(|e| map_sqlx(e, "probe: connect"))?;
            let mut done = conn
                .execute(sqlx::raw_sql(write))
                .await
                .map_err(|e| map_sqlx(e, "probe: commit a write"));
            if matches!(done, Err(StoreError::Config(_))) {
                done = conn
                    .execute(sqlx::raw_sql("SELECT txid_current()"))
                    .await
                    .map_err(|e| map_sqlx(e, "probe: commit a transaction id"));
            }
            let _ = conn.close().await;
            done.map(|_| ())
        };
        match tokio::time::timeout(limit, run).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Unavailable {
                message: format!("probe: no commit within {} ms", limit.as_millis()),
                source: None,
            }),
        }
    }

    /// Conflicts are detected once `processed_messages` has the identity column
    /// (`migrate`); on a reference table that was never migrated they are not.
    fn capabilities(&self) -> Capabilities {
        Capabilities::TRANSACTIONAL.with_conflict_detection(self.shared.has_identity())
    }

    /// One autocommitted statement on a pooled connection (`idem_runs`,
    /// `migrations/0012_runs.sql`): committed, so durable, when it returns. A schema not
    /// migrated since the table was added answers an error (the gate then runs the rerun
    /// without the check).
    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let runs = self.sql_table("idem_runs");
        let text = match note {
            RunNote::Started => sql!(
                "INSERT INTO {runs} AS r (idempotency_key, runs) VALUES ($1, 1) \
                 ON CONFLICT (idempotency_key) DO UPDATE \
                 SET runs = r.runs + 1, last_run_at = now() RETURNING r.runs",
                runs
            ),
            RunNote::NotRun => sql!(
                "UPDATE {runs} SET runs = greatest(runs - 1, 0) WHERE idempotency_key = $1 \
                 RETURNING runs",
                runs
            ),
            RunNote::Settled => sql!(
                "DELETE FROM {runs} WHERE idempotency_key = $1 RETURNING 0",
                runs
            ),
        };
        let n: Option<i32> = sqlx::query_scalar(statement(text))
            .bind(key.to_hex())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| map_sqlx(e, "recording a rerun"))?;
        Ok(Some(u32::try_from(n.unwrap_or(0)).unwrap_or(0)))
    }
}

/// A claim transaction. Write business rows through [`PgTx::conn`] and outbox events
/// through [`OutboxWriter`](idem_core::OutboxWriter); all of it commits with the claim.
///
/// Dropping it without [`commit`](ClaimTx::commit) rolls back (a crash).
///
/// A statement of this transaction that failed (including a claim that answered
/// `InProgress` after the lock timeout) aborts the transaction on the server; `commit`
/// then rolls back and returns an error rather than a silent success. Handlers must
/// propagate errors of their own statements on [`PgTx::conn`] for the same reason.
#[derive(Debug)]
pub struct PgTx {
    /// `Some` until the transaction ends; its transaction depth is 1 while it is open.
    conn: Option<PoolConnection<Postgres>>,
    pool: PgPool,
    shared: Arc<Shared>,
    aborted: bool,
    claimed: bool,
    /// The handler was handed the connection ([`PgTx::conn`]): its statements may have
    /// failed, or ended the transaction, without this transaction knowing.
    lent: bool,
    /// A round trip got no answer within [`PgConfig::reply_timeout`]: the connection is
    /// closed at the transaction's end, not given back to the pool.
    stuck: bool,
}

/// The bound on one round trip of a claim transaction ([`PgConfig::reply_timeout`]).
pub(crate) struct Reply<'a> {
    bound: Duration,
    stuck: &'a mut bool,
}

impl Reply<'_> {
    /// `answer`, or an I/O error (`TimedOut`, so [`StoreError::Unavailable`]) once it has
    /// not come within the bound; the transaction's connection is then closed at its end.
    pub(crate) async fn wait<T>(
        self,
        answer: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        match tokio::time::timeout(self.bound, answer).await {
            Ok(r) => r,
            Err(_) => {
                *self.stuck = true;
                Err(no_answer(self.bound))
            }
        }
    }
}

/// The error of a round trip without an answer within `bound`.
fn no_answer(bound: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer from Postgres within {} ms (the lock or statement timeout plus \
             reply_timeout): the network path or the server is dead; the connection is closed",
            bound.as_millis()
        ),
    ))
}

/// A transaction dropped before its end (a crash, a cancelled future) is rolled back as
/// sqlx's `Transaction` does it: the `ROLLBACK` is queued on the connection and sent by
/// the pool's test when the connection goes back to it; the connection is never kept warm.
impl Drop for PgTx {
    fn drop(&mut self) {
        if self.stuck {
            // No answer came on it: closed, not given back to the pool (whose test of it
            // would wait on the dead path).
            if let Some(conn) = self.conn.take() {
                drop(conn.detach());
            }
            return;
        }
        if let Some(conn) = self.conn.as_mut() {
            if PgTransactionManager::get_transaction_depth(conn) > 0 {
                PgTransactionManager::start_rollback(conn);
            }
        }
    }
}

impl PgTx {
    /// The transaction's connection, for the handler's business writes.
    ///
    /// A handler must propagate the errors of its statements: after a failed statement
    /// the server has aborted the transaction, and its `COMMIT` would answer `ROLLBACK`.
    /// Once the connection has been lent, [`commit`](ClaimTx::commit) checks the
    /// transaction's state on the server first (one round trip): a transaction aborted
    /// by an ignored error is rolled back and reported (retried, never acked), and one
    /// the handler ended itself (`COMMIT` or `ROLLBACK` sent on this connection) is a
    /// [`StoreError::Config`] — a bug in the handler, which stops the consumer.
    pub fn conn(&mut self) -> &mut PgConnection {
        self.lent = true;
        self.own_conn()
    }

    /// The connection and the bound on its answers, for this crate's own statements
    /// (which record their failures): see [`PgConfig::reply_timeout`].
    pub(crate) fn io(&mut self) -> (&mut PgConnection, Reply<'_>) {
        let conn = self
            .conn
            .as_deref_mut()
            .expect("a PgTx holds its connection until commit or rollback consumes it");
        let reply = Reply {
            bound: self.shared.config.reply_bound(),
            stuck: &mut self.stuck,
        };
        (conn, reply)
    }

    /// The connection, for this crate's own statements (which record their failures).
    pub(crate) fn own_conn(&mut self) -> &mut PgConnection {
        self.conn
            .as_deref_mut()
            .expect("a PgTx holds its connection until commit or rollback consumes it")
    }

    /// Before the commit of a transaction whose connection was lent: is it still open and
    /// not aborted on the server? `Ok(())` when it can be committed; otherwise it has been
    /// rolled back (or was ended by the handler) and the error says which.
    async fn check_lent(&mut self) -> Result<(), StoreError> {
        let (conn, reply) = self.io();
        let state: Result<bool, sqlx::Error> = reply
            .wait(
                sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
                    .fetch_one(conn),
            )
            .await;
        match state {
            Ok(true) => Ok(()),
            // Nothing written: nothing to lose, and nothing to tell apart (a transaction
            // that wrote nothing has no id whether or not it is still open).
            Ok(false) if !self.claimed => Ok(()),
            Ok(false) => {
                // The server is outside any transaction block: the handler sent COMMIT
                // or ROLLBACK itself. sqlx still counts the transaction as open.
                if let Some(conn) = self.conn.as_mut() {
                    PgTransactionManager::start_rollback(conn);
                }
                Err(StoreError::Config(
                    "the handler ended the claim transaction itself (COMMIT or ROLLBACK on \
                     PgTx::conn): the claim and the handler's writes were not committed as \
                     one; fix the handler"
                        .into(),
                ))
            }
            Err(e) => {
                self.aborted = true;
                Err(StoreError::Conflict {
                    message: if sqlstate(&e).as_deref() == Some(IN_FAILED_TRANSACTION) {
                        "a statement of the handler failed and the handler went on: the \
                         server aborted the transaction, which has been rolled back, not \
                         committed"
                            .into()
                    } else {
                        "checking the transaction before its commit".into()
                    },
                    source: Some(Box::new(e)),
                })
            }
        }
    }

    /// Ends the transaction with `COMMIT` (or `ROLLBACK`); a connection whose
    /// transaction ended cleanly is kept warm for the next `begin`.
    async fn end(mut self, commit: bool) -> Result<(), sqlx::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        let bound = self.shared.config.reply_bound();
        if self.stuck {
            // A round trip got no answer: closing the connection ends the transaction on
            // the server (rolled back), if the server is there at all.
            drop(conn.detach());
            return if commit {
                Err(no_answer(bound))
            } else {
                Ok(())
            };
        }
        let ending = async {
            if commit {
                PgTransactionManager::commit(&mut conn).await
            } else {
                PgTransactionManager::rollback(&mut conn).await
            }
        };
        let Ok(ended) = tokio::time::timeout(bound, ending).await else {
            // Closed, not given back: its state is unknown (a COMMIT's outcome too).
            drop(conn.detach());
            return Err(no_answer(bound));
        };
        match ended {
            Ok(()) if PgTransactionManager::get_transaction_depth(&conn) == 0 => {
                let owner = Arc::downgrade(&self.shared);
                self.shared.warm.park(&self.pool, owner, conn);
                Ok(())
            }
            // Still open: a nested transaction of the handler was left open (forgotten),
            // so the `COMMIT` above only released its savepoint. Nothing was committed;
            // saying so keeps the message from being acked.
            Ok(()) => {
                while PgTransactionManager::get_transaction_depth(&conn) > 0 {
                    PgTransactionManager::start_rollback(&mut conn);
                }
                Err(sqlx::Error::Protocol(
                    "a nested transaction opened on PgTx::conn was left open: the claim \
                     transaction was rolled back, not committed"
                        .into(),
                ))
            }
            Err(e) => {
                // Not known to have ended: rolled back as sqlx's Transaction would be.
                PgTransactionManager::start_rollback(&mut conn);
                Err(e)
            }
        }
    }

    /// The quoted, schema-qualified name of `name` (see [`PgStore::table`]).
    pub fn table(&self, name: &str) -> String {
        format!("{}.{}", self.shared.schema.quoted(), quote(name))
    }

    /// The schema name (unquoted).
    pub fn schema(&self) -> &str {
        &self.shared.config.schema
    }

    /// The schema as a validated identifier, for [`sql!`](idem_core::sql!) text (see
    /// [`crate::sql`]).
    pub fn schema_ident(&self) -> &Ident {
        &self.shared.schema
    }

    pub(crate) fn shared_arc(&self) -> std::sync::Arc<Shared> {
        self.shared.clone()
    }

    /// Records that a statement failed: the server aborted the transaction.
    pub(crate) fn sql_table(&self, name: &'static str) -> SqlText {
        self.shared.table(name)
    }

    pub(crate) fn mark_aborted(&mut self) {
        self.aborted = true;
    }

    /// The month parameter of a claim on the partitioned layout.
    fn month(meta: &ClaimMeta) -> String {
        crate::partition::month_value(meta.submission_timestamp.as_deref())
    }

    /// Classifies identity claims that inserted nothing: the key's own row → `Duplicate`,
    /// else the identity's row → `Conflict`, else (both gone since, a purge) `InProgress`.
    /// One round trip for all of `items`.
    async fn classify(
        &mut self,
        items: &[(&IdempotencyKey, &ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let keys: Vec<String> = items.iter().map(|(k, _)| k.to_hex()).collect();
        let subjects: Vec<&str> = items.iter().map(|(_, m)| m.subject.as_str()).collect();
        let stamps: Vec<Option<&str>> = items
            .iter()
            .map(|(_, m)| m.identity().map(|(_, ts)| ts))
            .collect();
        let mut query = sqlx::query_as(self.shared.sql.classify.clone())
            .bind(&keys)
            .bind(&subjects)
            .bind(&stamps);
        if self.shared.layout == PgLayout::Partitioned {
            let months: Vec<String> = items.iter().map(|(_, m)| Self::month(m)).collect();
            query = query.bind(months);
        }
        let (conn, reply) = self.io();
        let answered = reply.wait(query.fetch_all(conn)).await;
        let rows: Vec<(String, Option<String>, Option<i32>)> = match answered {
            Ok(rows) => rows,
            Err(e) => {
                self.aborted = true;
                return Err(map_sqlx(e, "classify claims"));
            }
        };
        let mut found: HashMap<String, ClaimOutcome> = HashMap::with_capacity(rows.len());
        for (k, existing, o) in rows {
            found.insert(k, refusal(existing, o)?.unwrap_or(ClaimOutcome::InProgress));
        }
        Ok(keys
            .iter()
            .map(|k| found.get(k).copied().unwrap_or(ClaimOutcome::InProgress))
            .collect())
    }

    /// Runs one batch-claim insert over `order`'s items (sorted, distinct keys): keys and
    /// subjects, then, on a table with the identity column, [`ClaimMeta::identity`]'s
    /// timestamps, then the months on the partitioned layout. `None`: the lock timeout
    /// expired and nothing was claimed; else what the statement answered per key (hex),
    /// with `keys` in `order`'s order. A key it answered nothing for was not inserted.
    async fn insert_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
        order: &[usize],
    ) -> Result<(Vec<String>, Option<HashMap<String, Answer>>), StoreError> {
        let shared = Arc::clone(&self.shared);
        let identity = shared.has_identity();
        let keys: Vec<String> = order.iter().map(|&i| items[i].0.to_hex()).collect();
        let subjects: Vec<&str> = order.iter().map(|&i| items[i].1.subject.as_str()).collect();
        let sql = if identity {
            &shared.sql.claim_batch_identity
        } else {
            &shared.sql.claim_batch
        };
        let classifies = identity && shared.sql.claims_classify;
        let mut query = sqlx::query(sql.clone()).bind(&keys).bind(&subjects);
        if identity {
            let stamps: Vec<Option<&str>> = order
                .iter()
                .map(|&i| items[i].1.identity().map(|(_, ts)| ts))
                .collect();
            query = query.bind(stamps);
        }
        if shared.layout == PgLayout::Partitioned {
            let months: Vec<String> = order.iter().map(|&i| Self::month(&items[i].1)).collect();
            query = query.bind(months);
        }
        let (conn, reply) = self.io();
        let answered = reply.wait(query.fetch_all(conn)).await;
        let rows = match answered {
            Ok(rows) => rows,
            Err(e) => {
                self.aborted = true;
                if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) {
                    return Ok((keys, None));
                }
                return Err(map_sqlx(e, "claim batch"));
            }
        };
        let mut answers = HashMap::with_capacity(rows.len());
        for row in rows {
            use sqlx::Row as _;
            let decoded: Result<(String, bool, bool), sqlx::Error> = if classifies {
                (|| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))()
            } else {
                row.try_get(0).map(|k| (k, true, false))
            };
            let (k, claimed, duplicate) =
                decoded.map_err(|e| map_sqlx(e, "read the batch claim's answer"))?;
            if claimed {
                self.claimed = true;
            }
            answers.insert(k, Answer { claimed, duplicate });
        }
        Ok((keys, Some(answers)))
    }
}

/// A claim's answer for one key, from the claim statement itself.
struct Answer {
    /// This statement inserted the key's row.
    claimed: bool,
    /// Else whether the key's own row was in the statement's snapshot: a duplicate
    /// (the key's row comes first in [`PgTx::classify`] too).
    duplicate: bool,
}

/// The outcome a refusing row found by [`PgTx::classify`] means: the key's own row
/// (`o = 0`) → `Duplicate`, the identity's (`o = 1`) → `Conflict`; `None` when no row
/// was found.
fn refusal(existing: Option<String>, o: Option<i32>) -> Result<Option<ClaimOutcome>, StoreError> {
    Ok(match (existing, o) {
        (Some(_), Some(0)) => Some(ClaimOutcome::Duplicate),
        (Some(existing), Some(_)) => Some(ClaimOutcome::Conflict {
            existing: existing.parse().map_err(|_| {
                StoreError::other(
                    format!("processed_messages holds a malformed key {existing:?}"),
                    false,
                )
            })?,
        }),
        _ => None,
    })
}

#[async_trait]
impl ClaimTx for PgTx {
    /// One `INSERT … ON CONFLICT DO NOTHING`: one row inserted → `Claimed`, none →
    /// `Duplicate`; a `lock_timeout` (SQLSTATE 55P03) → `InProgress`. With the identity
    /// column (migrated), the insert records [`ClaimMeta::identity`] and yields to the
    /// identity's unique index too; when it inserts nothing, the same statement answers
    /// whether the key's own row is in its snapshot (`Duplicate`, the common redelivery).
    /// Otherwise a second statement, with a snapshot of its own, reads which row refused
    /// it: the key's (`Duplicate`: committed while the claim waited) or the identity's
    /// (`Conflict`).
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let shared = Arc::clone(&self.shared);
        let identity = shared.has_identity();
        // Without the identity column only the key's own unique index can refuse it.
        let stamp = meta.identity().map(|(_, ts)| ts).filter(|_| identity);
        let sql = if identity {
            &shared.sql.claim_identity
        } else {
            &shared.sql.claim
        };
        let mut query = sqlx::query(sql.clone())
            .bind(key.to_hex())
            .bind(meta.subject.as_str());
        if identity {
            query = query.bind(stamp);
        }
        if shared.layout == PgLayout::Partitioned {
            query = query.bind(Self::month(meta));
        }
        let answered = if identity && shared.sql.claims_classify {
            {
                let (conn, reply) = self.io();
                reply.wait(query.fetch_one(conn)).await
            }
            .and_then(|row| {
                use sqlx::Row as _;
                let claimed: bool = row.try_get(0)?;
                let duplicate: Option<bool> = row.try_get(1)?;
                Ok(Answer {
                    claimed,
                    duplicate: duplicate == Some(true),
                })
            })
        } else {
            {
                let (conn, reply) = self.io();
                reply.wait(query.execute(conn)).await
            }
            .map(|r| Answer {
                claimed: r.rows_affected() == 1,
                duplicate: false,
            })
        };
        match answered {
            Ok(a) if a.claimed => {
                self.claimed = true;
                Ok(ClaimOutcome::Claimed)
            }
            Ok(_) if stamp.is_none() => Ok(ClaimOutcome::Duplicate),
            Ok(a) if a.duplicate => Ok(ClaimOutcome::Duplicate),
            Ok(_) => Ok(self
                .classify(&[(key, meta)])
                .await?
                .pop()
                .unwrap_or(ClaimOutcome::InProgress)),
            Err(e) => {
                self.aborted = true;
                if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) {
                    Ok(ClaimOutcome::InProgress)
                } else {
                    Err(map_sqlx(e, "claim"))
                }
            }
        }
    }

    /// One round trip: `INSERT … SELECT … FROM unnest($1, $2) ON CONFLICT DO NOTHING
    /// RETURNING idempotency_key`. Rows are inserted in [`idem_core::claim_order`]
    /// (identity, then key: two concurrent batches cannot deadlock on each other's keys or
    /// identities) and the answers mapped back to input order. A lock timeout answers `InProgress` for every key (nothing was claimed).
    /// With the identity column, keys not inserted that carry an identity are classified
    /// by a second statement (`Duplicate` or `Conflict`), one round trip for all of them.
    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let order = idem_core::claim_order(items);
        let (keys, inserted) = self.insert_batch(items, &order).await?;
        let Some(inserted) = inserted else {
            return Ok(vec![ClaimOutcome::InProgress; items.len()]);
        };
        let identity = self.shared.has_identity();
        let mut by_key: HashMap<IdempotencyKey, ClaimOutcome> = HashMap::with_capacity(order.len());
        let mut unsure: Vec<(&IdempotencyKey, &ClaimMeta)> = Vec::new();
        for (&i, hex) in order.iter().zip(&keys) {
            let (key, meta) = (&items[i].0, &items[i].1);
            let answer = inserted.get(hex);
            if answer.is_some_and(|a| a.claimed) {
                by_key.insert(*key, ClaimOutcome::Claimed);
            } else if !identity || meta.identity().is_none() {
                // Only the key's own unique index can have refused it.
                by_key.insert(*key, ClaimOutcome::Duplicate);
            } else if answer.is_some_and(|a| a.duplicate) {
                by_key.insert(*key, ClaimOutcome::Duplicate);
            } else {
                // Refused by the identity's row, or by a row the statement's snapshot
                // could not see (committed since it began, or inserted by the same
                // statement): classified by a statement of its own, which sees it.
                unsure.push((key, meta));
            }
        }
        if !unsure.is_empty() {
            let classified = self.classify(&unsure).await?;
            for ((key, _), c) in unsure.into_iter().zip(classified) {
                by_key.insert(*key, c);
            }
        }
        // In input order: a repeated key is a duplicate of its own claim (or the same
        // conflict again).
        let mut seen: HashSet<&IdempotencyKey> = HashSet::with_capacity(items.len());
        Ok(items
            .iter()
            .map(|(k, _)| {
                let out = by_key.get(k).copied().unwrap_or(ClaimOutcome::InProgress);
                if !seen.insert(k) && out == ClaimOutcome::Claimed {
                    ClaimOutcome::Duplicate
                } else {
                    out
                }
            })
            .collect())
    }

    /// Commits. After a failed statement the server has aborted the transaction (its
    /// `COMMIT` would silently roll back): this rolls back and returns
    /// [`StoreError::Conflict`] instead, so nothing is acked that was not committed.
    async fn commit(mut self) -> Result<(), StoreError> {
        if self.lent && !self.aborted {
            if let Err(e) = self.check_lent().await {
                if !matches!(e, StoreError::Config(_)) {
                    let _ = self.end(false).await;
                }
                return Err(e);
            }
        }
        if self.aborted {
            let claimed = self.claimed;
            let _ = self.end(false).await;
            return Err(StoreError::Conflict {
                message: format!(
                    "the transaction was aborted by an earlier failed statement and has been \
                     rolled back{}",
                    if claimed {
                        " (its claims are released)"
                    } else {
                        ""
                    }
                ),
                source: None,
            });
        }
        self.end(true).await.map_err(|e| map_sqlx(e, "commit"))
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.end(false).await.map_err(|e| map_sqlx(e, "rollback"))
    }

    /// One statement (`idem_positions`, [`idem_core::position`]): per partition, the
    /// slot row of its lowest offset is locked (in partition order) at the move's epoch
    /// and moved; a partition taken by another member since is [`StoreError::Fenced`]
    /// (the transaction must roll back).
    async fn advance_positions(&mut self, moves: &[PositionMove]) -> Result<(), StoreError> {
        crate::position::advance(self, moves).await
    }
}

/// Whether `schema.table` has `column` (false when the table does not exist yet): the
/// identity column of `migrations/0006_claim_identity.sql` on `processed_messages`, the
/// `traceparent` column of `migrations/0007_outbox_traceparent.sql` on `outbox`.
async fn has_column(
    pool: &PgPool,
    schema: &str,
    table: &str,
    column: &str,
) -> Result<bool, StoreError> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3 AND NOT a.attisdropped)",
    )
    .bind(schema)
    .bind(table)
    .bind(column)
    .fetch_one(pool)
    .await
    .map_err(|e| map_sqlx(e, &format!("read the columns of {table}")))
}

#[cfg(test)]
mod tls_policy_tests {
    use super::connect_options;
    use sqlx::postgres::PgSslMode;

    /// libpq's reading: `require` with a root certificate verifies the chain.
    #[test]
    fn require_with_a_root_certificate_verifies_the_ca() {
        let o = connect_options("postgres://app@db.internal/x?sslmode=require&sslrootcert=/ca.pem")
            .expect("options");
        assert!(matches!(o.get_ssl_mode(), PgSslMode::VerifyCa));
        let o = connect_options("postgres://app@db.internal/x?sslmode=require").expect("options");
        assert!(matches!(o.get_ssl_mode(), PgSslMode::Require));
    }

    /// A password goes to a remote host only over a verified connection, unless the URL
    /// says `accept_unverified=true`; to a loopback host always.
    #[test]
    fn a_password_is_refused_over_an_unverified_connection_to_a_remote_host() {
        for url in [
            "postgres://app:pw@db.internal/x",
            "postgres://app:pw@db.internal/x?sslmode=require",
            "postgres://app@10.1.2.3/x?sslmode=prefer&password=pw",
        ] {
            let e = connect_options(url).expect_err(url);
            assert!(e.to_string().contains("refusing to send a password"), "{e}");
        }
        for url in [
            "postgres://app:pw@db.internal/x?sslmode=verify-full&sslrootcert=/ca.pem",
            "postgres://app:pw@db.internal/x?sslmode=require&sslrootcert=/ca.pem",
            "postgres://app:pw@db.internal/x?sslmode=verify-ca",
            "postgres://app:pw@db.internal/x?accept_unverified=true",
            "postgres://app:pw@127.0.0.1/x",
            "postgres://app:pw@localhost:5433/x",
            "postgres://app:pw@[::1]/x",
            "postgres://app@db.internal/x",
        ] {
            connect_options(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        assert!(connect_options("postgres://a@h/x?accept_unverified=yes").is_err());
    }
}
