//! End to end on the real services: orders published to RabbitMQ (`IDEM_TEST_AMQP_URL`,
//! default `amqp://guest:guest@127.0.0.1:5672/%2f`), each of them twice, consumed by
//! [`orders::run`] into Postgres (`IDEM_TEST_POSTGRES_URL`, a fresh schema) until idle,
//! with the relay publishing the outbox to the events queue. Then: one `orders` row per
//! order, one event per order on the events queue (read back by a downstream consumer
//! that dedups by event id), and the bad order dead-lettered. A missing service fails the
//! test.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::broker::any::{pending_count, AnyConsumer, AnyPublisher, BrokerUrl};
use idem::outbox::EVENT_ID_HEADER;
use idem::postgres::{PgConfig, PgStore};
use idem::{
    async_trait, consumer, ConsumerConfig, EventId, Gate, Handler, HandlerError, Headers,
    IdempotencyKey, RejectReason, Submission,
};
use idem_testkit::{MemoryStore, MemoryTx};
use orders::{OrdersDb, Settings, EVENT_ORDER_RECORDED};

const N: usize = 30;

fn amqp_url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn order(i: usize) -> Vec<u8> {
    format!(
        r#"{{"order_id":"O-{i}","customer":"C-{}","amount_cents":{},"created_at":"2026-07-01T09:{:02}:00Z"}}"#,
        i % 7,
        100 * (i + 1),
        i % 60
    )
    .into_bytes()
}

/// Downstream: records each `order.recorded` event once, by its event id.
struct Events;

#[async_trait]
impl Handler<MemoryTx> for Events {
    type Input = String;

    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<String>, RejectReason> {
        let id = headers
            .iter()
            .find(|(k, _)| k == EVENT_ID_HEADER)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| RejectReason::new("missing_event_id", "no event id header"))?;
        let key: IdempotencyKey = id.parse().map_err(RejectReason::from)?;
        let event: serde_json::Value = serde_json::from_slice(payload)
            .map_err(|_| RejectReason::new("not_json", "the event is not JSON"))?;
        let order_id = event["order_id"].as_str().unwrap_or_default().to_owned();
        Ok(Submission {
            key,
            subject: order_id.clone(),
            input: order_id,
        })
    }

    async fn handle(
        &self,
        tx: &mut MemoryTx,
        sub: &Submission<String>,
    ) -> Result<(), HandlerError> {
        let row = [
            ("event_id".to_owned(), sub.key.to_hex()),
            ("order_id".to_owned(), sub.input.clone()),
        ];
        tx.insert("events", row.into_iter().collect());
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_is_recorded_and_relayed_once() {
    let tag = format!(
        "{}-{:08x}",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        rand::random::<u32>()
    );
    let settings = Settings {
        broker: amqp_url(),
        source: format!("orders-test-{tag}"),
        events: format!("orders-test-{tag}.recorded"),
        store: postgres_url(),
        schema: format!("orders_t_{}", tag.replace('-', "_")),
        concurrency: 2,
        batch_size: 8,
        exit_when_idle: Some(Duration::from_secs(2)),
        reconnect_timeout: Duration::from_secs(30),
    };
    let url = BrokerUrl::parse(&settings.broker).expect("the AMQP URL");

    // Every order twice (a producer's retry, a broker's redelivery), interleaved, and
    // one order whose amount no retry makes good.
    let mut bodies: Vec<Vec<u8>> = (0..N).map(order).collect();
    bodies.extend((0..N).rev().map(order));
    bodies.push(
        br#"{"order_id":"O-bad","customer":"C-1","amount_cents":0,"created_at":"2026-07-01T10:00:00Z"}"#
            .to_vec(),
    );
    let producer = AnyPublisher::connect(&url, &settings.source)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach RabbitMQ at {}: {e}",
                idem::redact_url(&settings.broker)
            )
        });
    producer
        .publish_raw(&bodies)
        .await
        .expect("publish the orders");

    let report = tokio::time::timeout(
        Duration::from_secs(120),
        orders::run(&settings, std::future::pending()),
    )
    .await
    .expect("the run drains within two minutes")
    .unwrap_or_else(|e| panic!("the run failed: {e}"));

    let c = report.consumed;
    assert_eq!(c.processed, N as u64, "{c:?}");
    assert_eq!(c.duplicates, N as u64, "{c:?}");
    assert_eq!(c.rejected, 1, "the bad amount is dead-lettered: {c:?}");
    assert_eq!(report.relayed, N as u64, "one event per order: {report:?}");
    assert_eq!(
        pending_count(&url, &settings.source).await.expect("count"),
        0
    );
    assert_eq!(
        pending_count(&url, &idem::broker::dead_letter_name(&settings.source))
            .await
            .expect("count the dead letters"),
        1
    );

    // One row per order, with the amount sent.
    let store = PgStore::connect(
        &settings.store,
        PgConfig::new(settings.schema.clone()).expect("schema"),
    )
    .await
    .expect("the store");
    let rows = store.orders().await.expect("the orders");
    assert_eq!(rows.len(), N, "one row per order");
    let ids: BTreeSet<&str> = rows.iter().map(|r| r.order_id.as_str()).collect();
    assert_eq!(ids.len(), N, "no order twice");
    for r in &rows {
        let i: usize = r
            .order_id
            .trim_start_matches("O-")
            .parse()
            .expect("an order id");
        assert_eq!(r.amount_cents, 100 * (i as i64 + 1), "{r:?}");
    }

    // Downstream: the events queue holds one event per order, with the ids derived from
    // the orders' keys.
    let downstream = MemoryStore::new();
    let gate = Gate::new(downstream.clone(), Events);
    let events = AnyConsumer::connect(&url, &settings.events, 16)
        .await
        .expect("the events queue");
    let stats = consumer::run(
        &gate,
        idem::broker::until_idle(events, Duration::from_secs(2)),
        ConsumerConfig::new(1, 8),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("the downstream run");
    assert_eq!(stats.processed, N as u64, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "no event published twice: {stats:?}");
    let got: BTreeSet<String> = downstream
        .rows("events")
        .into_iter()
        .filter_map(|r| r.get("event_id").cloned())
        .collect();
    let expected: BTreeSet<String> = rows
        .iter()
        .map(|r| EventId::derive(&r.key, EVENT_ORDER_RECORDED).to_string())
        .collect();
    assert_eq!(got, expected, "each order's event, once");
    assert_eq!(
        pending_count(&url, &settings.events).await.expect("count"),
        0
    );

    let drop = idem::sql!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE",
        schema = store.schema_ident()
    );
    idem::postgres::sqlx::query(idem::postgres::sql::statement(drop))
        .execute(store.pool())
        .await
        .expect("drop the schema");
}
