//! The test kit's crash-at-every-step suite against `OrderHandler`: orders sent twice, a
//! changed resend, bad amounts and bodies that are not orders, under crashes before the
//! claim, after it, after the handler, during the commit, after the commit before the
//! ack, lost acks, injected errors, redeliveries and expired visibility timeouts, one at
//! a time and concurrently — on SQLite and on Postgres, a fresh database for each
//! schedule. Each schedule must leave exactly one `orders` row per distinct order and
//! dead-letter every message that is not one.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use idem::postgres::{PgConfig, PgStore};
use idem::sqlite::{SqliteConfig, SqliteStore};
use idem::StoreError;
use idem_testkit::sim::{crash_suite, Expect, Message};
use idem_testkit::Effect;
use orders::{OrderHandler, OrderRow, OrdersDb};

const AT: &str = "2026-07-01T09:00:00Z";

fn order(id: &str, amount: &str) -> Vec<u8> {
    format!(
        r#"{{"order_id":"{id}","customer":"C-{id}","amount_cents":{amount},"created_at":"{AT}"}}"#
    )
    .into_bytes()
}

/// Eight orders, every other one sent twice; O-3 resent with another amount (a conflict
/// under the default policy, a second order under `process`); two bad amounts; two bodies
/// that are not orders.
fn messages() -> Vec<Message> {
    let mut out = Vec::new();
    for i in 0..8_i64 {
        let amount = 1_000 + i;
        let body = order(&format!("O-{i}"), &amount.to_string());
        out.push(Message::effect(body.clone(), amount));
        if i % 2 == 0 {
            out.push(Message::effect(body, amount)); // the at-least-once duplicate
        }
    }
    out.push(Message::effect(order("O-3", "9999"), 9_999));
    out.push(Message::dead_letter(order("O-neg", "-5"))); // refused by the handler
    out.push(Message::dead_letter(order("O-str", "\"12.50\""))); // refused by the handler
    out.push(Message::dead_letter(br#"{"order_id":"O-x"}"#.to_vec())); // no identity
    out.push(Message::dead_letter(b"{not json".to_vec()));
    out
}

fn effects(rows: Vec<OrderRow>) -> Vec<Effect> {
    rows.into_iter()
        .map(|r| Effect {
            key: r.key,
            subject: r.order_id,
            amount: r.amount_cents,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_leaves_one_order_each_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut n = 0;
    let fresh = || {
        n += 1;
        let path = dir.path().join(format!("orders-{n}.db"));
        async move {
            let path = path.to_str().ok_or("a non UTF-8 path")?.to_owned();
            let store = SqliteStore::connect(&path, SqliteConfig::default()).await?;
            store.migrate_orders().await?;
            Ok::<_, Box<dyn std::error::Error>>((store, OrderHandler::new()))
        }
    };
    let read = |store: SqliteStore| async move {
        let rows = store.orders().await;
        store.pool().close().await;
        rows.map(effects)
    };
    let report = crash_suite(&messages(), fresh, read)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(report.total_crashes() > 0, "{report:?}");
}

fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A new schema name per schedule: `orders_t_<unix seconds>_<random>`.
fn schema_name() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    format!("orders_t_{secs}_{:08x}", rand::random::<u32>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_leaves_one_order_each_on_postgres() {
    let schemas: Arc<Mutex<Vec<String>>> = Arc::default();
    let fresh = || {
        let schemas = Arc::clone(&schemas);
        async move {
            let schema = schema_name();
            let config = PgConfig::new(schema.clone())?.with_max_connections(4);
            let store = PgStore::connect(&postgres_url(), config).await?;
            schemas.lock().expect("schemas").push(schema);
            store.migrate_orders().await?; // creates the schema
            Ok::<_, Box<dyn std::error::Error>>((store, OrderHandler::new()))
        }
    };
    // Reads the rows back, then drops the schedule's schema and closes its pool (each
    // schedule has a store of its own).
    let read = |store: PgStore| async move {
        let rows = store.orders().await;
        drop_schema(&store).await?;
        store.pool().close().await;
        rows.map(effects)
    };
    let report = crash_suite(&messages(), fresh, read)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(report.total_crashes() > 0, "{report:?}");
    assert_eq!(
        report.schedules,
        schemas.lock().expect("schemas").len(),
        "one schema per schedule"
    );
}

async fn drop_schema(store: &PgStore) -> Result<(), StoreError> {
    let drop = idem::sql!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE",
        schema = store.schema_ident()
    );
    idem::postgres::sqlx::query(idem::postgres::sql::statement(drop))
        .execute(store.pool())
        .await
        .map_err(|e| idem::postgres::error::map_sqlx(e, "dropping the test schema"))?;
    Ok(())
}

/// The suite is not a formality: a handler that writes its row on a connection of its
/// own, outside the claim's transaction, commits the row even when the claim rolls back
/// (a crash after the handler, a commit that fails), and the suite says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_catches_a_write_outside_the_claims_transaction() {
    use idem::postgres::PgTx;
    use idem::{Handler, HandlerError, Headers, RejectReason, Submission};
    use orders::{parse_order, Order};

    struct OutsideTheTransaction(PgStore);

    #[idem::async_trait]
    impl Handler<PgTx> for OutsideTheTransaction {
        type Input = Order;

        fn identify(&self, body: &[u8], _: &Headers) -> Result<Submission<Order>, RejectReason> {
            parse_order(body)
        }

        async fn handle(
            &self,
            _tx: &mut PgTx,
            sub: &Submission<Order>,
        ) -> Result<(), HandlerError> {
            let insert = idem::sql!(
                "INSERT INTO {schema}.orders \
                 (idempotency_key, order_id, customer, amount_cents, created_at) \
                 VALUES ($1, $2, $3, $4, $5)",
                schema = self.0.schema_ident()
            );
            idem::postgres::sqlx::query(idem::postgres::sql::statement(insert))
                .bind(sub.key.to_hex())
                .bind(&sub.input.order_id)
                .bind(&sub.input.customer)
                .bind(sub.input.amount_cents.unwrap_or(1))
                .bind(&sub.input.created_at)
                .execute(self.0.pool()) // wrong: not `tx.conn()`
                .await
                .map_err(|e| idem::postgres::error::map_sqlx(e, "recording an order"))?;
            Ok(())
        }
    }

    let fresh = || async {
        let config = PgConfig::new(schema_name())?.with_max_connections(4);
        let store = PgStore::connect(&postgres_url(), config).await?;
        store.migrate_orders().await?;
        Ok::<_, Box<dyn std::error::Error>>((store.clone(), OutsideTheTransaction(store)))
    };
    let read = |store: PgStore| async move {
        let rows = store.orders().await;
        drop_schema(&store).await?;
        store.pool().close().await;
        rows.map(effects)
    };
    // Only the orders that take effect: the point is the effect, not the rejections.
    let valid: Vec<Message> = messages()
        .into_iter()
        .filter(|m| matches!(m.expect, Expect::Effect { .. }))
        .collect();
    let err = crash_suite(&valid, fresh, read)
        .await
        .expect_err("a write outside the transaction is not exactly-once");
    assert!(
        err.contains("duplicated") || err.contains("dead letters") || err.contains("effects"),
        "{err}"
    );
}
