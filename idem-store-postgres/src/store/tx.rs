//! [`PgTx`]: the claim transaction, its connection, its claims and how it ends.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::ident::Ident;
use idem_core::sql::SqlText;
use idem_core::{ClaimMeta, ClaimOutcome, ClaimTx, IdempotencyKey, PositionMove, StoreError};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgTransactionManager;
use sqlx::{PgConnection, PgPool, Postgres};
use sqlx_core::transaction::TransactionManager;

use super::shared::Shared;
use crate::config::{quote, PgLayout};
use crate::error::{map_sqlx, sqlstate, IN_FAILED_TRANSACTION, LOCK_NOT_AVAILABLE};

#[cfg(doc)]
use super::PgStore;

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
    pub(super) conn: Option<PoolConnection<Postgres>>,
    pub(super) pool: PgPool,
    pub(super) shared: Arc<Shared>,
    pub(super) aborted: bool,
    pub(super) claimed: bool,
    /// The handler was handed the connection ([`PgTx::conn`]): its statements may have
    /// failed, or ended the transaction, without this transaction knowing.
    pub(super) lent: bool,
    /// A round trip got no answer within [`PgConfig::reply_timeout`]: the connection is
    /// closed at the transaction's end, not given back to the pool.
    pub(super) stuck: bool,
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
pub(super) fn no_answer(bound: Duration) -> sqlx::Error {
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
