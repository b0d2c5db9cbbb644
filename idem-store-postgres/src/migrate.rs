//! [`PgStore::migrate`] and [`PgStore::migrate_append_only`]: the store's DDL, run by
//! `idem migrate` and at every consumer start.
//!
//! A start must never queue the claim writers behind a lock. Most DDL takes an ACCESS
//! EXCLUSIVE lock of its table, even when it changes nothing (`ALTER TABLE … ADD COLUMN IF
//! NOT EXISTS`, `CREATE TRIGGER`), and while it waits for that lock — behind any
//! transaction that has read the table and stays open — every writer of the table waits
//! behind it. So:
//!
//! - **No DDL when the catalog already matches.** The schema records the md5 of the last
//!   migration script it ran (`idem_migrations`, `migrations/0011_schema_version.sql`); when
//!   it is this script's, and every table, index, column and trigger the scripts create is
//!   in the catalog, nothing is run. Reading the catalog takes no lock a writer waits for.
//! - **A lock timeout when DDL is needed.** The script runs under `lock_timeout`
//!   ([`MIGRATE_LOCK_TIMEOUT`]): a lock not granted in time aborts it (writers held for at
//!   most that long), and it is tried again after a pause, [`MIGRATE_ATTEMPTS`] times in
//!   all. Then `migrate` fails with an error naming SQLSTATE 55P03 and the sessions that
//!   hold locks in the schema (their process id, state and how long their transaction has
//!   been open — never their statement's text).

use std::time::Duration;

use idem_core::sql::SqlText;
use idem_core::StoreError;
use sqlx::Executor;

use crate::config::PgLayout;
use crate::error::{map_sqlx, sqlstate, LOCK_NOT_AVAILABLE};
use crate::sql::statement;
use crate::store::PgStore;

/// The embedded migration, with `{schema}` standing for the quoted schema name.
const MIGRATION: &str = include_str!("../migrations/0001_tables.sql");
/// The store's identity (see [`crate::identity`]).
const IDENTITY: &str = include_str!("../migrations/0004_store_identity.sql");
/// The partitioned `processed_messages` ([`PgLayout::Partitioned`]), run before [`MIGRATION`].
const PARTITIONED: &str = include_str!("../migrations/0005_partitioned_claims.sql");
/// The optional retention / inspection indexes ([`crate::PgConfig::audit_indexes`]).
const AUDIT_INDEXES: &str = include_str!("../migrations/0002_audit_indexes.sql");
/// The Citus-ready tables ([`PgLayout::Distributed`]), run before [`MIGRATION`].
const DISTRIBUTED: &str = include_str!("../migrations/0009_distributed.sql");
/// The distributed layout's audit indexes, run instead of [`AUDIT_INDEXES`].
const DISTRIBUTED_AUDIT_INDEXES: &str =
    include_str!("../migrations/0009_distributed_audit_indexes.sql");
/// The identity column and its unique index (conflict detection, award lookups), every layout.
const CLAIM_IDENTITY: &str = include_str!("../migrations/0006_claim_identity.sql");
/// The outcome tally (`idem_outcome_counts`, [`crate::audit`]).
const OUTCOME_COUNTS: &str = include_str!("../migrations/0008_outcome_counts.sql");
/// The outbox's `traceparent` column (W3C trace context), every layout.
const OUTBOX_TRACEPARENT: &str = include_str!("../migrations/0007_outbox_traceparent.sql");
/// The relay's queue beside the outbox, filled by a trigger (every layout).
const OUTBOX_PENDING: &str = include_str!("../migrations/0010_outbox_pending.sql");
/// The outbox read by change data capture (`idem_outbox_cdc`,
/// [`OutboxMode::ChangeDataCapture`](crate::OutboxMode::ChangeDataCapture)), when asked
/// or already recorded.
const OUTBOX_CDC: &str = include_str!("../migrations/0014_outbox_cdc.sql");
/// The record of the last migration run (`idem_migrations`).
const SCHEMA_VERSION: &str = include_str!("../migrations/0011_schema_version.sql");
/// The reruns' record (`idem_runs`, `ClaimStore::note_run`), every layout.
const RUNS: &str = include_str!("../migrations/0012_runs.sql");
/// The log positions kept in claim transactions (`idem_positions`), every layout.
const POSITIONS: &str = include_str!("../migrations/0013_positions.sql");
/// The optional append-only triggers on `processed_messages` ([`PgStore::migrate_append_only`]).
const APPEND_ONLY: &str = include_str!("../migrations/0003_append_only.sql");

/// The append-only guard's row trigger (UPDATE, DELETE) on `processed_messages`, which
/// Postgres clones onto every partition.
pub(crate) const ROW_GUARD: &str = "idem_append_only";
/// The append-only guard's TRUNCATE trigger: statement-level, so it is on
/// `processed_messages` and on each of its partitions, one by one.
pub(crate) const TRUNCATE_GUARD: &str = "idem_append_only_truncate";

/// How long one try of a migration waits for a table lock (`SET LOCAL lock_timeout`):
/// the longest the claim writers queue behind it.
pub const MIGRATE_LOCK_TIMEOUT: Duration = Duration::from_secs(3);
/// How many times a migration is tried when a lock is not granted in time.
pub const MIGRATE_ATTEMPTS: u32 = 4;
/// The pause after the first try that did not get its lock; doubled after each.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Relations (tables and indexes) the scripts create on every layout.
const RELATIONS: &[&str] = &[
    "processed_messages",
    "processed_messages_identity_key",
    "outbox",
    "outbox_event_id_key",
    "outbox_pending",
    "outbox_pending_subject_idx",
    "outbox_created_at_brin",
    "outbox_moved_aside_idx",
    "idem_store_identity",
    "idem_outcome_counts",
    "idem_outcome_flushes",
    "idem_migrations",
    "idem_runs",
    "idem_positions",
    "idem_position_offsets",
];
/// Columns the scripts add to tables that may have been created without them.
const COLUMNS: &[(&str, &str)] = &[
    ("processed_messages", "submission_timestamp"),
    ("outbox", "id"),
    ("outbox", "event_id"),
    ("outbox", "subject"),
    ("outbox", "idempotency_key"),
    ("outbox", "published_at"),
    ("outbox", "publish_attempts"),
    ("outbox", "last_error"),
    ("outbox", "failed_at"),
    ("outbox", "traceparent"),
];
/// Triggers the scripts create.
const TRIGGERS: &[(&str, &str)] = &[("outbox", "idem_outbox_pending")];

/// What the catalog must hold for [`PgStore::migrate`] to run no DDL.
struct Expected {
    relations: Vec<&'static str>,
    columns: Vec<(&'static str, &'static str)>,
    triggers: Vec<(&'static str, &'static str)>,
}

impl Expected {
    fn of(layout: PgLayout, audit_indexes: bool, cdc: bool) -> Self {
        let mut relations = RELATIONS.to_vec();
        if cdc {
            relations.push("idem_outbox_cdc");
        }
        match layout {
            PgLayout::Plain => {}
            PgLayout::Partitioned => relations.push(crate::partition::DEFAULT_PARTITION),
            PgLayout::Distributed => {
                relations.extend(["disbursements", "outbox_id_idx", "outbox_pending_id_idx"]);
            }
        }
        if audit_indexes {
            relations.push("processed_messages_claimed_at_idx");
            match layout {
                PgLayout::Plain | PgLayout::Partitioned => {
                    relations.push("outbox_idempotency_key_hash");
                }
                PgLayout::Distributed => relations.extend([
                    "outbox_idempotency_key_idx",
                    "processed_messages_idempotency_key_idx",
                ]),
            }
        }
        Self {
            relations,
            columns: COLUMNS.to_vec(),
            triggers: TRIGGERS.to_vec(),
        }
    }
}

/// What one try of a migration did.
enum Tried {
    /// The catalog matched: nothing was run.
    Current,
    /// The script ran and committed.
    Ran,
}

impl PgStore {
    /// Creates the schema, `processed_messages`, `outbox`, the store's identity
    /// (`idem_store_identity`, a random id kept once created) and the outcome tally
    /// (`idem_outcome_counts`, [`PgStore::add_outcome_counts`]) if missing, and adds this
    /// crate's columns and indexes to an `outbox` that lacks them (plus the audit indexes
    /// of [`PgConfig::audit_indexes`] when on). On the partitioned layout
    /// ([`PgConfig::layout`], or a partitioned table already there) it creates the
    /// partitioned `processed_messages` (`migrations/0005_partitioned_claims.sql`) and
    /// then [`ensure_partitions`](PgStore::ensure_partitions). On the distributed layout
    /// ([`PgLayout::Distributed`], [`crate::distributed`]) it creates `processed_messages`,
    /// `outbox` and the grant pipeline's `disbursements` keyed by the award id
    /// (`migrations/0009_distributed.sql`), and then, when the `citus` extension is
    /// installed, distributes them, colocated (untested: no Citus where the tests run);
    /// on plain Postgres it logs that it skipped that step. Asking
    /// [`PgConfig::layout`] for a layout other than the one of an existing table is an
    /// error (a conversion is a data migration). Idempotent, and safe
    /// to run from several processes at once (an advisory lock serialises them). Business
    /// tables (`disbursements`, …) are their owners' to create.
    ///
    /// With [`PgConfig::outbox`] at [`OutboxMode::ChangeDataCapture`](crate::OutboxMode::ChangeDataCapture),
    /// or on a schema that records it, it records that a change-data-capture connector
    /// reads the outbox (`migrations/0014_outbox_cdc.sql`): on an existing schema only
    /// while the relay's queue is empty (else an error that says so), and for good.
    ///
    /// It runs no DDL, and so takes no lock that a claim waits for, when the schema is
    /// already migrated by this version (see [the module](crate::migrate)); when DDL is
    /// needed it waits at most [`MIGRATE_LOCK_TIMEOUT`] for each lock, tried
    /// [`MIGRATE_ATTEMPTS`] times, so that an open transaction on one of the tables never
    /// queues the claim writers behind it for longer.
    ///
    /// [`PgConfig::audit_indexes`]: crate::PgConfig::audit_indexes
    /// [`PgConfig::layout`]: crate::PgConfig::layout
    /// [`PgConfig::outbox`]: crate::PgConfig::outbox
    ///
    /// # Errors
    /// [`StoreError`] from the database; [`StoreError::Conflict`] naming SQLSTATE 55P03
    /// and the sessions holding locks in the schema when the DDL did not get its locks.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let found = crate::partition::detect_layout(self.pool(), self.schema()).await?;
        let shared = self.shared();
        let asked = shared.config.layout;
        if let Some(found) = found.filter(|f| asked != PgLayout::Plain && *f != asked) {
            return Err(StoreError::Config(format!(
                "processed_messages in schema {:?} is a {found} table: the {asked} layout is \
                 created in a new schema, not converted in place (docs/scale.md)",
                self.schema()
            )));
        }
        if found.is_some_and(|f| f != self.layout()) {
            return Err(StoreError::Config(format!(
                "processed_messages in schema {:?} is {}, but this store writes claims for the \
                 {} layout: reconnect",
                self.schema(),
                found.map_or("missing", PgLayout::as_str),
                self.layout()
            )));
        }
        let layout = self.layout();
        let cdc = self.wants_cdc();
        if cdc && !shared.is_cdc() {
            self.check_queue_empty().await?;
        }
        let sql = self.migration_sql();
        let expected = Expected::of(layout, shared.config.audit_indexes, cdc);
        let tried = self.run_ddl(&sql, Some(&expected)).await?;
        if matches!(tried, Tried::Ran) {
            tracing::info!(target: "idem::migrate", schema = self.schema(), "schema migrated");
        }
        shared
            .identity
            .store(true, std::sync::atomic::Ordering::Relaxed);
        shared
            .traceparent
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if cdc {
            shared.cdc.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.ensure_partitions().await?;
        if layout == PgLayout::Distributed {
            // After the commit, in a transaction of its own (crate::distributed).
            self.distribute_tables().await?;
        }
        Ok(())
    }

    /// Before a schema's outbox turns to change data capture: no event may still wait for
    /// the relay, which would then never publish it. The script checks it again under a
    /// lock (`migrations/0014_outbox_cdc.sql`); this check gives the error its words.
    async fn check_queue_empty(&self) -> Result<(), StoreError> {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.table("outbox_pending"))
            .fetch_one(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "find the relay's queue"))?;
        if !exists {
            return Ok(());
        }
        let queue = self.sql_table("outbox_pending");
        let queued: i64 = sqlx::query_scalar(statement(idem_core::sql!(
            "SELECT count(*) FROM {queue}",
            queue
        )))
        .fetch_one(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "count the relay's queue"))?;
        if queued > 0 {
            return Err(StoreError::Config(format!(
                "{queued} events of schema {:?} are still queued for the relay: run `idem relay` \
                 until its queue is empty, then switch the outbox to change data capture",
                self.schema()
            )));
        }
        Ok(())
    }

    /// Whether [`migrate`](PgStore::migrate) records (or keeps) change data capture: asked
    /// by the config, or found in the schema at connect.
    fn wants_cdc(&self) -> bool {
        let shared = self.shared();
        shared.is_cdc() || shared.config.outbox == crate::OutboxMode::ChangeDataCapture
    }

    /// The script [`migrate`](PgStore::migrate) runs for this store's layout and config.
    fn migration_sql(&self) -> SqlText {
        let shared = self.shared();
        let schema: &dyn idem_core::sql::SqlPart = &shared.schema;
        let layout = self.layout();
        let partition_key = match layout {
            PgLayout::Plain | PgLayout::Distributed => "",
            PgLayout::Partitioned => ", submission_month",
        };
        let mut sql = SqlText::new();
        // The layout's own tables first: 0001's IF NOT EXISTS statements then leave them be.
        let first = match layout {
            PgLayout::Plain => None,
            PgLayout::Partitioned => Some(PARTITIONED),
            PgLayout::Distributed => Some(DISTRIBUTED),
        };
        if let Some(first) = first {
            sql.push(SqlText::render(first, &[("schema", schema)]));
        }
        sql.push(SqlText::render(MIGRATION, &[("schema", schema)]));
        sql.push(SqlText::render(
            CLAIM_IDENTITY,
            &[("schema", schema), ("partition_key", &partition_key)],
        ));
        for script in [
            IDENTITY,
            OUTCOME_COUNTS,
            OUTBOX_TRACEPARENT,
            OUTBOX_PENDING,
            RUNS,
            POSITIONS,
            SCHEMA_VERSION,
        ] {
            sql.push(SqlText::render(script, &[("schema", schema)]));
        }
        if self.wants_cdc() {
            sql.push(SqlText::render(OUTBOX_CDC, &[("schema", schema)]));
        }
        if shared.config.audit_indexes {
            let indexes = match layout {
                PgLayout::Plain | PgLayout::Partitioned => AUDIT_INDEXES,
                PgLayout::Distributed => DISTRIBUTED_AUDIT_INDEXES,
            };
            sql.push(SqlText::render(indexes, &[("schema", schema)]));
        }
        sql
    }

    /// Makes `processed_messages` append-only evidence (`migrations/0003_append_only.sql`):
    /// a trigger refuses every UPDATE, DELETE and TRUNCATE of it, and of each of its
    /// partitions (the default one, the monthly ones, and those created later by
    /// [`ensure_partitions`](PgStore::ensure_partitions)), with SQLSTATE
    /// [`APPEND_ONLY_SQLSTATE`](crate::APPEND_ONLY_SQLSTATE) — except DELETEs in a
    /// transaction that set `idem.purge = 'on'` locally, which is how
    /// [`PgStore::purge`] deletes. Claims (`INSERT … ON CONFLICT DO NOTHING`) are
    /// unaffected. Run it after [`migrate`](PgStore::migrate); idempotent, and like it,
    /// runs no DDL when every trigger is in place, and waits at most
    /// [`MIGRATE_LOCK_TIMEOUT`] per try for a lock. The setting is a guard against
    /// accidents, not a permission: withhold DELETE from every role but the owner.
    ///
    /// # Errors
    /// [`StoreError`] from the database (for example when the tables do not exist yet).
    pub async fn migrate_append_only(&self) -> Result<(), StoreError> {
        if self.append_only_in_place().await.unwrap_or(false) {
            return Ok(());
        }
        let sql = SqlText::render(APPEND_ONLY, &[("schema", &self.shared().schema)]);
        self.run_ddl(&sql, None).await.map(|_| ())
    }

    /// Whether the append-only function and triggers are on `processed_messages` and on
    /// every one of its partitions.
    async fn append_only_in_place(&self) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT to_regprocedure($1) IS NOT NULL \
               AND EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($2) AND tgname = $3) \
               AND NOT EXISTS (SELECT 1 FROM (SELECT to_regclass($2) AS relid \
                     UNION SELECT relid FROM pg_partition_tree(to_regclass($2))) t \
                   WHERE NOT EXISTS (SELECT 1 FROM pg_trigger g \
                                     WHERE g.tgrelid = t.relid AND g.tgname = $4))",
        )
        .bind(format!(
            "{}.idem_processed_messages_append_only()",
            self.shared().schema.quoted()
        ))
        .bind(self.table("processed_messages"))
        .bind(ROW_GUARD)
        .bind(TRUNCATE_GUARD)
        .fetch_one(self.pool())
        .await
    }

    /// Runs `sql` in one transaction under the migration's advisory lock, with no lock
    /// timeout. For scripts that take no table lock a claim waits for (the Citus step's
    /// checks); DDL goes through [`run_ddl`](Self::run_ddl).
    pub(crate) async fn run_script(&self, sql: SqlText) -> Result<(), StoreError> {
        let lock = format!("idem-migrate.{}", self.schema());
        let mut tx = self.begin_locked(lock, "migration").await?;
        // A simple (multi-statement) query: the script has no parameters.
        tx.execute(statement(sql))
            .await
            .map_err(|e| map_sqlx(e, "migrate"))?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "commit migration"))?;
        Ok(())
    }

    /// Runs the DDL script `sql` unless `expected` says the catalog already matches,
    /// under [`MIGRATE_LOCK_TIMEOUT`], tried [`MIGRATE_ATTEMPTS`] times when a lock is not
    /// granted in time; with `expected`, the script's md5 is recorded in `idem_migrations`
    /// in the same transaction.
    async fn run_ddl(
        &self,
        sql: &SqlText,
        expected: Option<&Expected>,
    ) -> Result<Tried, StoreError> {
        if let Some(expected) = expected {
            // Before any lock: the usual start, on a migrated schema, ends here.
            if self.is_current(sql, expected).await {
                return Ok(Tried::Current);
            }
        }
        let mut pause = RETRY_PAUSE;
        let mut attempt = 1;
        loop {
            match self.try_ddl(sql, expected).await {
                Ok(tried) => return Ok(tried),
                Err(e) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                    if attempt >= MIGRATE_ATTEMPTS {
                        return Err(self.locked_out(e, attempt).await);
                    }
                    tracing::warn!(
                        target: "idem::migrate",
                        schema = self.schema(),
                        attempt,
                        "migration did not get a table lock within {MIGRATE_LOCK_TIMEOUT:?} \
                         (another transaction holds it); trying again in {pause:?}"
                    );
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    attempt += 1;
                }
                Err(e) => return Err(map_sqlx(e, "migrate")),
            }
        }
    }

    /// One try of [`run_ddl`](Self::run_ddl).
    async fn try_ddl(
        &self,
        sql: &SqlText,
        expected: Option<&Expected>,
    ) -> Result<Tried, sqlx::Error> {
        let mut tx = self.pool().begin().await?;
        // Waiting for the advisory lock holds no table lock: no writer waits behind it.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("idem-migrate.{}", self.schema()))
            .execute(&mut *tx)
            .await?;
        if let Some(expected) = expected {
            // Another process may have migrated while this one waited for the lock.
            if self.is_current(sql, expected).await {
                tx.rollback().await?;
                return Ok(Tried::Current);
            }
        }
        let ms = i64::try_from(MIGRATE_LOCK_TIMEOUT.as_millis()).unwrap_or(i64::MAX);
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{ms}ms"))
            .execute(&mut *tx)
            .await?;
        // A simple (multi-statement) query: the script has no parameters.
        tx.execute(statement(sql.clone())).await?;
        if expected.is_some() {
            let t = self.sql_table("idem_migrations");
            sqlx::query(statement(idem_core::sql!(
                "INSERT INTO {t} (singleton, script_md5) VALUES (true, md5($1)) \
                 ON CONFLICT (singleton) DO UPDATE \
                 SET script_md5 = EXCLUDED.script_md5, migrated_at = now()",
                t
            )))
            .bind(sql.as_str())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Tried::Ran)
    }

    /// Whether the schema was migrated by `sql` and still holds everything `expected`
    /// names. Any error (a table missing, no privilege to read it) is a no: the script
    /// then runs and reports what is wrong.
    async fn is_current(&self, sql: &SqlText, expected: &Expected) -> bool {
        let t = self.sql_table("idem_migrations");
        let identity = self.sql_table("idem_store_identity");
        let recorded: Result<Option<bool>, _> = sqlx::query_scalar(statement(idem_core::sql!(
            "SELECT m.script_md5 = md5($1) AND EXISTS (SELECT 1 FROM {identity}) \
             FROM {t} m WHERE m.singleton",
            t,
            identity
        )))
        .bind(sql.as_str())
        .fetch_optional(self.pool())
        .await;
        if recorded.ok().flatten() != Some(true) {
            return false;
        }
        let (col_tables, col_names): (Vec<&str>, Vec<&str>) =
            expected.columns.iter().copied().unzip();
        let (trig_tables, trig_names): (Vec<&str>, Vec<&str>) =
            expected.triggers.iter().copied().unzip();
        let missing: Result<Vec<String>, _> = sqlx::query_scalar(
            "WITH s AS (SELECT quote_ident($1) || '.' AS q) \
             SELECT r FROM unnest($2::text[]) AS r, s \
               WHERE to_regclass(s.q || quote_ident(r)) IS NULL \
             UNION ALL \
             SELECT t || '.' || c FROM unnest($3::text[], $4::text[]) AS u(t, c), s \
               WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a \
                 WHERE a.attrelid = to_regclass(s.q || quote_ident(t)) \
                   AND a.attname = c AND NOT a.attisdropped) \
             UNION ALL \
             SELECT t || ' trigger ' || g FROM unnest($5::text[], $6::text[]) AS v(t, g), s \
               WHERE NOT EXISTS (SELECT 1 FROM pg_trigger tr \
                 WHERE tr.tgrelid = to_regclass(s.q || quote_ident(t)) AND tr.tgname = g)",
        )
        .bind(self.schema())
        .bind(&expected.relations)
        .bind(&col_tables)
        .bind(&col_names)
        .bind(&trig_tables)
        .bind(&trig_names)
        .fetch_all(self.pool())
        .await;
        match missing {
            Ok(missing) if missing.is_empty() => true,
            Ok(missing) => {
                tracing::info!(
                    target: "idem::migrate",
                    schema = self.schema(),
                    missing = ?missing,
                    "the schema lacks objects the migration creates: migrating"
                );
                false
            }
            Err(_) => false,
        }
    }

    /// The error of a migration that did not get its locks `attempts` times: SQLSTATE
    /// 55P03, and who holds locks in the schema.
    async fn locked_out(&self, e: sqlx::Error, attempts: u32) -> StoreError {
        let holders: Vec<(i32, String, String, i64)> = sqlx::query_as(
            "SELECT l.pid, string_agg(DISTINCT c.relname::text, ', '), \
                    coalesce(max(a.state), 'unknown'), \
                    coalesce(max(extract(epoch FROM now() - a.xact_start))::bigint, 0) \
             FROM pg_locks l \
             JOIN pg_class c ON c.oid = l.relation \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE n.nspname = $1 AND l.granted AND l.pid <> pg_backend_pid() \
             GROUP BY l.pid ORDER BY 4 DESC LIMIT 5",
        )
        .bind(self.schema())
        .fetch_all(self.pool())
        .await
        .unwrap_or_default();
        let who = if holders.is_empty() {
            "another transaction".to_owned()
        } else {
            holders
                .iter()
                .map(|(pid, tables, state, secs)| {
                    format!("pid {pid} ({state}, transaction open {secs} s) holding {tables}")
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        StoreError::Conflict {
            message: format!(
                "migrate schema {:?}: the migration's DDL did not get its table locks within \
                 {MIGRATE_LOCK_TIMEOUT:?}, {attempts} times (SQLSTATE {LOCK_NOT_AVAILABLE}, \
                 lock_not_available): held by {who}. End that transaction (or set \
                 idle_in_transaction_session_timeout) and migrate again; claims were held \
                 back at most {MIGRATE_LOCK_TIMEOUT:?} per try",
                self.schema()
            ),
            source: Some(Box::new(e)),
        }
    }
}
