//! The grant tables and their read-back, per store.

use async_trait::async_trait;
use idem_engine::{IdempotencyKey, OutboxBacklog, StoreError};

use crate::handler::GrantHandler;

/// The reference name of the business table.
pub const GRANT_TABLE: &str = "disbursements";

/// The tables a consumer reads and inserts into.
#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
const CONSUMER_TABLES: [&str; 3] = ["processed_messages", GRANT_TABLE, "outbox"];

/// One `disbursements` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRow {
    /// The submission's key.
    pub key: IdempotencyKey,
    /// The award.
    pub award_id: String,
    /// The amount.
    pub amount_cents: i64,
}

/// The grant pipeline's view of a store: create its tables, and read back what was
/// committed (for the demo's verdict and for audits).
#[async_trait]
pub trait GrantDb: Send + Sync {
    /// Creates the store's tables and `disbursements` if missing. Idempotent.
    async fn migrate_grants(&self) -> Result<(), StoreError>;

    /// Every `disbursements` row.
    async fn ledger(&self) -> Result<Vec<LedgerRow>, StoreError>;

    /// How many `processed_messages` rows (committed claims) there are.
    async fn claim_rows(&self) -> Result<u64, StoreError>;

    /// How many outbox rows there are.
    async fn outbox_rows(&self) -> Result<u64, StoreError>;

    /// The outbox's unpublished events and the age of the oldest (as
    /// [`OutboxSource::backlog`](idem_engine::OutboxSource::backlog) reports them).
    async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError>;

    /// Checks, changing nothing, that the tables a consumer writes (`processed_messages`,
    /// `disbursements`, `outbox`) exist and that this connection may read them: what a
    /// process started without migrating (`--no-migrate`, under a least-privilege role)
    /// verifies before it takes a delivery.
    ///
    /// # Errors
    /// [`StoreError::Config`] naming the missing table or the refused privilege.
    async fn check_grants(&self) -> Result<(), StoreError>;

    /// The handler writing to this store's `disbursements` table.
    fn grant_handler(&self) -> GrantHandler;

    /// How many `processed_messages` rows have an `award_id` starting with `prefix` (one
    /// run's claims, among others'). The default is [`claim_rows`](GrantDb::claim_rows),
    /// every row: right only for a store that holds one run (the in-memory store).
    async fn claim_rows_with_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let _ = prefix;
        self.claim_rows().await
    }

    /// `(rows, distinct keys)` of the `disbursements` whose `award_id` starts with
    /// `prefix`, counted by the store (nothing held in memory). The default reads
    /// [`ledger`](GrantDb::ledger).
    async fn ledger_counts(&self, prefix: &str) -> Result<(u64, u64), StoreError> {
        let rows: Vec<LedgerRow> = self
            .ledger()
            .await?
            .into_iter()
            .filter(|r| r.award_id.starts_with(prefix))
            .collect();
        let keys: std::collections::HashSet<IdempotencyKey> = rows.iter().map(|r| r.key).collect();
        Ok((rows.len() as u64, keys.len() as u64))
    }

    /// Up to `limit` `disbursements` rows whose `award_id` starts with `prefix`, ordered
    /// by `(award_id, idempotency_key)` (byte order) and after `after` (an `(award_id,
    /// 64-hex key)` pair; `("", "")` for the first page): a keyset page, so a verifier can
    /// read millions of rows in constant memory. The default sorts
    /// [`ledger`](GrantDb::ledger).
    async fn ledger_page(
        &self,
        prefix: &str,
        after: (&str, &str),
        limit: usize,
    ) -> Result<Vec<LedgerRow>, StoreError> {
        let mut rows: Vec<LedgerRow> = self
            .ledger()
            .await?
            .into_iter()
            .filter(|r| r.award_id.starts_with(prefix))
            .filter(|r| (r.award_id.as_str(), r.key.to_hex().as_str()) > after)
            .collect();
        rows.sort_by(|a, b| (&a.award_id, a.key.to_hex()).cmp(&(&b.award_id, b.key.to_hex())));
        rows.truncate(limit);
        Ok(rows)
    }
}

/// `(idempotency_key, award_id, amount_cents)` rows, as every SQL store reads them, as
/// ledger rows.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) type LedgerTuple = (String, String, i64);

/// [`LedgerTuple`]s as ledger rows (a malformed key is an error, not skipped).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn ledger_rows(rows: Vec<LedgerTuple>) -> Result<Vec<LedgerRow>, StoreError> {
    rows.into_iter()
        .map(|(key, award_id, amount_cents)| {
            Ok(LedgerRow {
                key: parse_key(&key)?,
                award_id,
                amount_cents,
            })
        })
        .collect()
}

/// A stored key read back (by every store feature; none without one).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "memory"))]
pub(crate) fn parse_key(s: &str) -> Result<IdempotencyKey, StoreError> {
    s.parse().map_err(|e| {
        StoreError::other(
            format!("corrupt idempotency key in disbursements: {e}"),
            false,
        )
    })
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use crate::handler::GrantBook;
    use crate::submission::Grant;
    use idem_engine::ident::Ident;
    use idem_engine::sql;
    use idem_engine::sql::SqlText;
    use idem_store_sqlite::sql::statement;
    use idem_store_sqlite::{SqliteStore, SqliteTx};

    /// By SQLite result code, as the store's own statements: a full disk is the store's
    /// fault (retried), a refused value the message's (dead-lettered).
    fn err(what: &str, e: sqlx::Error) -> StoreError {
        idem_store_sqlite::map_sqlx(e, what)
    }

    #[async_trait]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    impl GrantBook for SqliteTx {
        async fn record_disbursement(
            &mut self,
            table: &SqlText,
            grant: &Grant,
            key: &IdempotencyKey,
        ) -> Result<(), StoreError> {
            sqlx::query(statement(sql!(
                "INSERT INTO {table} (award_id, amount_cents, idempotency_key) VALUES (?, ?, ?)",
                table
            )))
            .bind(&grant.award_id)
            .bind(grant.amount_cents)
            .bind(key.to_hex())
            .execute(self.conn())
            .await
            .map_err(|e| err("recording a disbursement", e))?;
            Ok(())
        }

        async fn record_batch(
            &mut self,
            table: &SqlText,
            items: &[(&Grant, &IdempotencyKey)],
            events: &[idem_engine::OutboxEvent],
        ) -> Result<(), StoreError> {
            // One multi-row INSERT per chunk (3 bound variables a row, far below SQLite's limit).
            for chunk in items.chunks(1000) {
                let mut sql = sql!(
                    "INSERT INTO {table} (award_id, amount_cents, idempotency_key) VALUES ",
                    table
                );
                for i in 0..chunk.len() {
                    sql.push(if i > 0 { ", (?, ?, ?)" } else { "(?, ?, ?)" });
                }
                let mut q = sqlx::query(statement(sql));
                for (grant, key) in chunk {
                    q = q
                        .bind(grant.award_id.clone())
                        .bind(grant.amount_cents)
                        .bind(key.to_hex());
                }
                q.execute(self.conn())
                    .await
                    .map_err(|e| err("recording disbursements", e))?;
            }
            self.enqueue_many(events).await
        }
    }

    #[async_trait]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    impl GrantDb for SqliteStore {
        async fn migrate_grants(&self) -> Result<(), StoreError> {
            self.migrate().await?;
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS disbursements (
                    award_id TEXT NOT NULL,
                    amount_cents INTEGER NOT NULL CHECK (amount_cents >= 0),
                    idempotency_key TEXT NOT NULL
                 );
                 CREATE INDEX IF NOT EXISTS disbursements_award_id ON disbursements (award_id);",
            )
            .execute(self.pool())
            .await
            .map_err(|e| err("creating the disbursements table", e))?;
            Ok(())
        }

        async fn ledger(&self) -> Result<Vec<LedgerRow>, StoreError> {
            let rows = sqlx::query_as::<_, LedgerTuple>(
                "SELECT idempotency_key, award_id, amount_cents FROM disbursements",
            )
            .fetch_all(self.pool())
            .await
            .map_err(|e| err("reading disbursements", e))?;
            ledger_rows(rows)
        }

        async fn claim_rows(&self) -> Result<u64, StoreError> {
            Ok(self
                .count("processed_messages")
                .await?
                .try_into()
                .unwrap_or(0))
        }

        async fn outbox_rows(&self) -> Result<u64, StoreError> {
            Ok(self.count("outbox").await?.try_into().unwrap_or(0))
        }

        async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
            SqliteStore::outbox_backlog(self).await
        }

        async fn check_grants(&self) -> Result<(), StoreError> {
            for table in CONSUMER_TABLES {
                let t = Ident::from_static(table);
                sqlx::query(statement(sql!("SELECT 1 FROM {t} LIMIT 0", t)))
                    .execute(self.pool())
                    .await
                    .map_err(|e| {
                        StoreError::Config(format!(
                            "table {table}: {e}; run `idem migrate` on this database first"
                        ))
                    })?;
            }
            Ok(())
        }

        async fn claim_rows_with_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM processed_messages WHERE substr(award_id, 1, length(?1)) = ?1",
            )
            .bind(prefix)
            .fetch_one(self.pool())
            .await
            .map_err(|e| err("counting claims", e))?;
            Ok(n.unsigned_abs())
        }

        async fn ledger_counts(&self, prefix: &str) -> Result<(u64, u64), StoreError> {
            let (n, k): (i64, i64) = sqlx::query_as(
                "SELECT count(*), count(DISTINCT idempotency_key) FROM disbursements \
                 WHERE substr(award_id, 1, length(?1)) = ?1",
            )
            .bind(prefix)
            .fetch_one(self.pool())
            .await
            .map_err(|e| err("counting disbursements", e))?;
            Ok((n.unsigned_abs(), k.unsigned_abs()))
        }

        async fn ledger_page(
            &self,
            prefix: &str,
            after: (&str, &str),
            limit: usize,
        ) -> Result<Vec<LedgerRow>, StoreError> {
            let rows = sqlx::query_as::<_, LedgerTuple>(
                "SELECT idempotency_key, award_id, amount_cents FROM disbursements \
                 WHERE substr(award_id, 1, length(?1)) = ?1 \
                   AND (award_id > ?2 OR (award_id = ?2 AND idempotency_key > ?3)) \
                 ORDER BY award_id, idempotency_key LIMIT ?4",
            )
            .bind(prefix)
            .bind(after.0)
            .bind(after.1)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(|e| err("reading disbursements", e))?;
            ledger_rows(rows)
        }

        fn grant_handler(&self) -> GrantHandler {
            GrantHandler::new()
        }
    }
}

#[cfg(feature = "memory")]
mod memory {
    use super::*;
    use crate::handler::GrantBook;
    use crate::submission::Grant;
    use idem_sim::{MemoryStore, MemoryTx, Row};

    #[async_trait]
    #[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
    impl GrantBook for MemoryTx {
        async fn record_disbursement(
            &mut self,
            table: &idem_engine::sql::SqlText,
            grant: &Grant,
            key: &IdempotencyKey,
        ) -> Result<(), StoreError> {
            let mut row = Row::new();
            row.insert("award_id".into(), grant.award_id.clone());
            row.insert("amount_cents".into(), grant.amount_cents.to_string());
            row.insert("idempotency_key".into(), key.to_hex());
            self.insert(table.as_str(), row);
            Ok(())
        }
    }

    #[async_trait]
    #[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
    impl GrantDb for MemoryStore {
        async fn migrate_grants(&self) -> Result<(), StoreError> {
            Ok(())
        }

        async fn ledger(&self) -> Result<Vec<LedgerRow>, StoreError> {
            self.rows(GRANT_TABLE)
                .iter()
                .map(|r| {
                    let get = |k: &str| r.get(k).cloned().unwrap_or_default();
                    Ok(LedgerRow {
                        key: parse_key(&get("idempotency_key"))?,
                        award_id: get("award_id"),
                        amount_cents: get("amount_cents").parse().unwrap_or(-1),
                    })
                })
                .collect()
        }

        async fn claim_rows(&self) -> Result<u64, StoreError> {
            Ok(self.claim_count() as u64)
        }

        async fn outbox_rows(&self) -> Result<u64, StoreError> {
            Ok(self.outbox().len() as u64)
        }

        async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
            use idem_engine::OutboxSource as _;
            idem_sim::MemoryOutbox::new(self.clone(), std::time::Duration::ZERO)
                .backlog()
                .await
        }

        async fn check_grants(&self) -> Result<(), StoreError> {
            Ok(())
        }

        fn grant_handler(&self) -> GrantHandler {
            GrantHandler::new()
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use crate::handler::GrantBook;
    use crate::submission::Grant;
    use idem_engine::ident::Ident;
    use idem_engine::sql;
    use idem_engine::sql::SqlText;
    use idem_engine::OutboxEvent;
    use idem_store_postgres::error::map_sqlx;
    use idem_store_postgres::sql::statement;
    use idem_store_postgres::{PgColumn, PgRows, PgStore, PgTx};

    /// `"schema"."name"` for a table of the store's schema.
    fn table(store: &PgStore, name: &'static str) -> SqlText {
        let name = Ident::from_static(name);
        sql!("{schema}.{name}", schema = store.schema_ident(), name)
    }

    #[async_trait]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    impl GrantBook for PgTx {
        async fn record_disbursement(
            &mut self,
            table: &SqlText,
            grant: &Grant,
            key: &IdempotencyKey,
        ) -> Result<(), StoreError> {
            sqlx::query(statement(sql!(
                "INSERT INTO {table} (award_id, amount_cents, idempotency_key) VALUES ($1, $2, $3)",
                table
            )))
            .bind(&grant.award_id)
            .bind(grant.amount_cents)
            .bind(key.to_hex())
            .execute(self.conn())
            .await
            .map_err(|e| map_sqlx(e, "recording a disbursement"))?;
            Ok(())
        }

        async fn record_batch(
            &mut self,
            table: &SqlText,
            items: &[(&Grant, &IdempotencyKey)],
            events: &[OutboxEvent],
        ) -> Result<(), StoreError> {
            // The rows and their events in one statement: one round trip.
            let rows = PgRows::new(table.clone())
                .column(
                    "award_id",
                    PgColumn::Text(items.iter().map(|(g, _)| g.award_id.as_str()).collect()),
                )
                .and_then(|r| {
                    r.column(
                        "amount_cents",
                        PgColumn::Int8(items.iter().map(|(g, _)| g.amount_cents).collect()),
                    )
                })
                .and_then(|r| {
                    r.column(
                        "idempotency_key",
                        PgColumn::OwnedText(items.iter().map(|(_, k)| k.to_hex()).collect()),
                    )
                })
                .map_err(|e| StoreError::other(e.to_string(), false))?;
            self.insert_and_enqueue(&rows, events).await
        }
    }

    #[async_trait]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    impl GrantDb for PgStore {
        async fn migrate_grants(&self) -> Result<(), StoreError> {
            self.migrate().await?;
            let table = table(self, GRANT_TABLE);
            // Several consumers may start at once: serialise the DDL with an advisory
            // lock, as the store's own migration does, so concurrent CREATEs cannot deadlock.
            let lock = format!("idem-migrate-grants.{}", self.schema());
            let mut tx = self.begin_locked(lock, "grant migration").await?;
            // On the distributed layout `migrate` has created the table already, keyed
            // (award_id, idempotency_key) for Citus (migrations/0009_distributed.sql): this
            // finds it and leaves it alone.
            let ddl = [
                sql!(
                    "CREATE TABLE IF NOT EXISTS {table} (
                        award_id text COLLATE \"C\" NOT NULL,
                        amount_cents bigint NOT NULL CHECK (amount_cents >= 0),
                        idempotency_key text COLLATE \"C\" NOT NULL
                     )",
                    table
                ),
                sql!(
                    "CREATE INDEX IF NOT EXISTS disbursements_award_id ON {table} (award_id)",
                    table
                ),
            ];
            for text in ddl {
                sqlx::query(statement(text))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| map_sqlx(e, "creating the disbursements table"))?;
            }
            tx.commit()
                .await
                .map_err(|e| map_sqlx(e, "commit grant migration"))?;
            Ok(())
        }

        async fn ledger(&self) -> Result<Vec<LedgerRow>, StoreError> {
            let rows = sqlx::query_as::<_, LedgerTuple>(statement(sql!(
                "SELECT idempotency_key, award_id, amount_cents FROM {t}",
                t = table(self, GRANT_TABLE)
            )))
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "reading disbursements"))?;
            ledger_rows(rows)
        }

        async fn claim_rows(&self) -> Result<u64, StoreError> {
            count(self, "processed_messages").await
        }

        async fn outbox_rows(&self) -> Result<u64, StoreError> {
            count(self, "outbox").await
        }

        async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
            PgStore::outbox_backlog(self).await
        }

        async fn check_grants(&self) -> Result<(), StoreError> {
            for name in CONSUMER_TABLES {
                let t = table(self, name);
                sqlx::query(statement(sql!("SELECT 1 FROM {t} LIMIT 0", t = &t)))
                    .execute(self.pool())
                    .await
                    .map_err(|e| map_sqlx(e, &format!("checking {t}")))?;
            }
            Ok(())
        }

        async fn claim_rows_with_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
            let n: i64 = sqlx::query_scalar(statement(sql!(
                "SELECT count(*) FROM {t} WHERE starts_with(award_id, $1)",
                t = table(self, "processed_messages")
            )))
            .bind(prefix)
            .fetch_one(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "counting claims"))?;
            Ok(n.unsigned_abs())
        }

        async fn ledger_counts(&self, prefix: &str) -> Result<(u64, u64), StoreError> {
            let (n, k): (i64, i64) = sqlx::query_as(statement(sql!(
                "SELECT count(*), count(DISTINCT idempotency_key) FROM {t} \
                 WHERE starts_with(award_id, $1)",
                t = table(self, GRANT_TABLE)
            )))
            .bind(prefix)
            .fetch_one(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "counting disbursements"))?;
            Ok((n.unsigned_abs(), k.unsigned_abs()))
        }

        async fn ledger_page(
            &self,
            prefix: &str,
            after: (&str, &str),
            limit: usize,
        ) -> Result<Vec<LedgerRow>, StoreError> {
            let rows = sqlx::query_as::<_, LedgerTuple>(statement(sql!(
                "SELECT idempotency_key, award_id, amount_cents FROM {t} \
                 WHERE starts_with(award_id, $1) \
                   AND (award_id COLLATE \"C\", idempotency_key COLLATE \"C\") > ($2, $3) \
                 ORDER BY award_id COLLATE \"C\", idempotency_key COLLATE \"C\" LIMIT $4",
                t = table(self, GRANT_TABLE)
            )))
            .bind(prefix)
            .bind(after.0)
            .bind(after.1)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "reading disbursements"))?;
            ledger_rows(rows)
        }

        fn grant_handler(&self) -> GrantHandler {
            GrantHandler::new()
                .with_table(Some(self.schema()), GRANT_TABLE)
                .expect("a PgStore's schema and the grant table are valid identifiers")
        }
    }

    async fn count(store: &PgStore, name: &'static str) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(statement(sql!(
            "SELECT count(*) FROM {t}",
            t = table(store, name)
        )))
        .fetch_one(store.pool())
        .await
        .map_err(|e| map_sqlx(e, "counting rows"))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
