//! The least-privilege role layout of docs/operations.md ("Evidence and least privilege"), applied
//! verbatim to a fresh schema: the consumer claims and writes but cannot delete or
//! rewrite evidence; the relay may only mark outbox rows published; the auditor reads.

use crate::common;

use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxBatch, OutboxEvent,
    OutboxSource, OutboxWriter, RunNote,
};
use idem_store_postgres::{error::sqlstate, PgConfig, PgOutboxSource, PgStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::Executor;

/// The GRANT statements of docs/operations.md, with the schema and role names substituted.
fn grants(schema: &str, consumer: &str, relay: &str, auditor: &str) -> String {
    format!(
        r#"
GRANT USAGE ON SCHEMA {schema} TO {consumer}, {relay}, {auditor};
GRANT SELECT, INSERT ON {schema}.processed_messages, {schema}.disbursements, {schema}.outbox TO {consumer};
GRANT USAGE ON SEQUENCE {schema}.outbox_id_seq TO {consumer};
GRANT SELECT, INSERT, UPDATE ON {schema}.idem_outcome_counts TO {consumer};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.idem_runs TO {consumer};
GRANT SELECT, UPDATE (published_at, publish_attempts, last_error, failed_at) ON {schema}.outbox TO {relay};
GRANT SELECT, UPDATE, DELETE ON {schema}.outbox_pending TO {relay};
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {auditor};
"#
    )
}

/// A store whose every connection runs as `role`.
async fn as_role(schema: &str, role: &str) -> PgStore {
    let set = format!("SET ROLE {role}");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(move |conn, _| {
            let set = set.clone();
            Box::pin(async move {
                conn.execute(sqlx::AssertSqlSafe(set)).await?;
                Ok(())
            })
        })
        .connect(&common::url())
        .await
        .expect("connect");
    PgStore::from_pool(pool, PgConfig::new(schema).expect("schema")).expect("store")
}

async fn denied(store: &PgStore, sql: &str) {
    let err = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .expect_err(&format!("{sql} must be refused"));
    assert_eq!(sqlstate(&err).as_deref(), Some("42501"), "{sql}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_grants_keep_evidence_safe() {
    let owner = common::fresh_pg().await;
    let schema = owner.schema().to_owned();
    let tag = &schema["idem_t_".len()..];
    let (consumer, relay, auditor) = (
        format!("idem_c_{tag}"),
        format!("idem_r_{tag}"),
        format!("idem_a_{tag}"),
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (award_id text, amount_cents bigint, idempotency_key text)",
        owner.table("disbursements")
    )))
    .execute(owner.pool())
    .await
    .expect("disbursements");
    for r in [&consumer, &relay, &auditor] {
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE {r} NOLOGIN")))
            .execute(owner.pool())
            .await
            .expect("create role");
    }
    owner
        .pool()
        .execute(sqlx::AssertSqlSafe(grants(
            &schema, &consumer, &relay, &auditor,
        )))
        .await
        .expect("the documented GRANTs");

    let result = tokio::spawn({
        let (owner, schema, consumer, relay, auditor) = (
            owner.clone(),
            schema.clone(),
            consumer.clone(),
            relay.clone(),
            auditor.clone(),
        );
        async move { check(&owner, &schema, &consumer, &relay, &auditor).await }
    })
    .await;

    common::drop_schema(&owner).await;
    for r in [&consumer, &relay, &auditor] {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP OWNED BY {r}")))
            .execute(owner.pool())
            .await;
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE {r}")))
            .execute(owner.pool())
            .await;
    }
    if let Err(e) = result {
        std::panic::resume_unwind(e.into_panic());
    }
}

async fn check(owner: &PgStore, schema: &str, consumer: &str, relay: &str, auditor: &str) {
    // The consumer: the whole claim transaction works.
    let c = as_role(schema, consumer).await;
    let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
    let mut tx = c.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key, &ClaimMeta::new("A-1")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (award_id, amount_cents, idempotency_key) VALUES ('A-1', 5, $1)",
        tx.table("disbursements")
    )))
    .bind(key.to_hex())
    .execute(tx.conn())
    .await
    .expect("business row");
    tx.enqueue(&OutboxEvent::new(
        key,
        "disbursement.recorded",
        "A-1",
        r#"{"award_id":"A-1"}"#,
    ))
    .await
    .expect("outbox");
    tx.commit().await.expect("commit");
    // The record of reruns (the check before the handler, on by default).
    for (note, n) in [
        (RunNote::Started, 1),
        (RunNote::NotRun, 0),
        (RunNote::Settled, 0),
    ] {
        assert_eq!(
            c.note_run(&key, note)
                .await
                .expect("the consumer records a rerun"),
            Some(n)
        );
    }
    let mut tx = c.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key, &ClaimMeta::new("A-1")).await.expect("claim"),
        ClaimOutcome::Duplicate
    );
    tx.rollback().await.expect("rollback");
    let pm = c.table("processed_messages");
    let ob = c.table("outbox");
    denied(&c, &format!("DELETE FROM {pm}")).await;
    denied(&c, &format!("UPDATE {pm} SET award_id = 'X'")).await;
    denied(&c, &format!("TRUNCATE {pm}")).await;
    denied(&c, &format!("DELETE FROM {ob}")).await;
    // The outcome tally: the consumer adds to it (twice: insert, then update), and
    // cannot delete it.
    for _ in 0..2 {
        c.add_outcome_counts(&[idem_engine::record::OutcomeCount::new(
            "2026-07-01",
            "duplicate",
            "",
            1,
        )])
        .await
        .expect("the consumer flushes its outcome counts");
    }
    denied(
        &c,
        &format!("DELETE FROM {}", c.table("idem_outcome_counts")),
    )
    .await;

    // The relay: leases, records what the broker refused (and moves an event aside),
    // marks published, nothing else.
    let r = as_role(schema, relay).await;
    let source = PgOutboxSource::new(r.clone(), std::time::Duration::from_millis(50));
    for (attempt, moved) in [(1, 0), (2, 1)] {
        let batch = source.lease(10).await.expect("lease");
        assert_eq!(batch.events().len(), 1, "attempt {attempt}");
        assert_eq!(
            batch
                .record_failure("refused by the broker", 2)
                .await
                .expect("the relay records a refused publish under its role"),
            moved,
            "attempt {attempt}"
        );
    }
    assert!(source.lease(10).await.expect("lease").events().is_empty());
    assert_eq!(source.moved_aside().await.expect("count"), 1);
    // An operator (the owner) puts it back in line; the relay publishes it.
    let event_id = OutboxEvent::new(key, "disbursement.recorded", "A-1", "{}").event_id;
    assert!(owner.outbox_requeue(&event_id).await.expect("requeue"));
    let batch = source.lease(10).await.expect("lease");
    assert_eq!(batch.events().len(), 1);
    batch.mark_published().await.expect("mark published");
    denied(&r, &format!("UPDATE {ob} SET event_type = 'x'")).await;
    denied(&r, &format!("DELETE FROM {ob}")).await;
    denied(&r, &format!("SELECT * FROM {pm}")).await;
    denied(&r, &format!("DELETE FROM {pm}")).await;

    // The auditor: reads everything, writes nothing.
    let a = as_role(schema, auditor).await;
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {pm} JOIN {ob} USING (idempotency_key) WHERE published_at IS NOT NULL"
    )))
    .fetch_one(a.pool())
    .await
    .expect("auditor reads");
    assert_eq!(n, 1);
    let tallied = a
        .outcome_counts("2026-07-01T00:00:00Z", "2026-07-02T00:00:00Z")
        .await
        .expect("auditor reads the outcome tally")
        .expect("the table");
    assert_eq!(tallied.len(), 1);
    assert_eq!(tallied[0].count, 2);
    denied(
        &a,
        &format!("INSERT INTO {pm} (idempotency_key) VALUES ('x')"),
    )
    .await;
    denied(&a, &format!("DELETE FROM {pm}")).await;
    denied(&a, &format!("UPDATE {ob} SET published_at = NULL")).await;
}
