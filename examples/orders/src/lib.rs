//! # orders: a team's own handler under idem
//!
//! An order service's consumer: each message is an order, as JSON,
//!
//! ```json
//! {"order_id": "O-1001", "customer": "C-42", "amount_cents": 1250, "created_at": "2026-07-01T09:00:00Z"}
//! ```
//!
//! and its effect is one row of an `orders` table plus one `order.recorded` event in the
//! outbox, written in the transaction that claims the order's idempotency key. The broker
//! delivers at least once; the table gets each order once.
//!
//! - [`OrderHandler`] is the [`Handler`]: `identify` derives the key from the order's
//!   identity (`order_id` + `created_at`) and the body's bytes, `handle` checks the
//!   amount and writes the row and the event. One implementation serves every store
//!   whose transaction is an [`OrderBook`]: Postgres ([`PgTx`]) and SQLite
//!   ([`SqliteTx`]) here.
//! - [`OrdersDb`] creates the table beside the store's own and reads it back.
//! - [`run`] consumes a RabbitMQ queue into the store and relays the outbox to another
//!   queue; `src/main.rs` calls it with [`Settings::from_env`].
//!
//! `tests/orders/crash_suite.rs` runs the test kit's crash-at-every-step suite against the
//! handler on SQLite and on Postgres, and `tests/orders/rabbitmq.rs` runs [`run`] end to
//! end on a real RabbitMQ and Postgres. The guide that walks through this crate is
//! `docs/own-handler.md`.

use std::future::Future;
use std::time::Duration;

use idem::broker::any::{AnyConsumer, AnyPublisher, BrokerUrl};
use idem::postgres::{PgConfig, PgOutboxSource, PgStore, PgTx};
use idem::runtime::supervise::{supervise, SourceCheck, SupervisorConfig};
use idem::runtime::{Attempt, ReconnectingPublisher};
use idem::sqlite::{SqliteConfig, SqliteOutboxSource, SqliteStore, SqliteTx};
use idem::{
    async_trait, sql, BoxError, ClaimMeta, ClaimStore, ClaimTx, ConsumerConfig, ConsumerStats,
    Gate, Handler, HandlerError, Headers, IdempotencyKey, OutboxEvent, OutboxSource, OutboxWriter,
    PublishError, RejectReason, Relay, StoreError, Submission,
};
use serde_json::{Map, Value};

/// The type of the outbox event each recorded order writes.
pub const EVENT_ORDER_RECORDED: &str = "order.recorded";

/// The largest body accepted, in bytes.
pub const MAX_BODY: usize = 64 * 1024;

/// An order, identified: what [`OrderHandler::identify`] hands to
/// [`OrderHandler::handle`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// The order's id (the key's subject).
    pub order_id: String,
    /// The customer.
    pub customer: String,
    /// The amount in cents, when the body's `amount_cents` is a whole number; `None`
    /// otherwise (a string, a fraction, out of range). The handler, not `identify`,
    /// decides whether it is acceptable: a business rule.
    pub amount_cents: Option<i64>,
    /// When the order was created, exactly as sent (part of the key).
    pub created_at: String,
}

/// A string field of the order: present, a string, not empty. The reason names the
/// field, never its value.
fn text(obj: &Map<String, Value>, name: &str) -> Result<String, RejectReason> {
    match obj.get(name) {
        None | Some(Value::Null) => Err(RejectReason::new(
            "missing_field",
            format!("`{name}` is missing"),
        )),
        Some(Value::String(s)) if s.is_empty() => Err(RejectReason::new(
            "missing_field",
            format!("`{name}` is empty"),
        )),
        Some(Value::String(s)) if s.chars().any(|c| c.is_ascii_control()) => {
            Err(RejectReason::new(
                "control_character",
                format!("`{name}` holds a control character"),
            ))
        }
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(RejectReason::new(
            "wrong_type",
            format!("`{name}` must be a string"),
        )),
    }
}

/// Parses an order body and derives its key: `IdempotencyKey::derive(order_id,
/// created_at, body)`, so the same body redelivered is the same key, and the same order
/// resent with another body (a changed amount) is a new key of the same identity — a
/// conflict, which the gate dead-letters by default.
///
/// ```
/// let body = br#"{"order_id":"O-1","customer":"C-1","amount_cents":1250,"created_at":"2026-07-01T09:00:00Z"}"#;
/// let sub = orders::parse_order(body)?;
/// assert_eq!(sub.subject, "O-1");
/// assert_eq!(sub.input.amount_cents, Some(1250));
/// assert_eq!(orders::parse_order(b"{not json").unwrap_err().code, "not_json");
/// # Ok::<(), idem::RejectReason>(())
/// ```
///
/// # Errors
/// A [`RejectReason`] (the delivery is dead-lettered with it): `too_large`, `not_json`,
/// `not_object`, `missing_field`, `wrong_type`, `control_character`, or a key error (an
/// `order_id` holding `|`). The detail never quotes the body.
pub fn parse_order(body: &[u8]) -> Result<Submission<Order>, RejectReason> {
    if body.len() > MAX_BODY {
        return Err(RejectReason::new(
            "too_large",
            format!("the body is {} bytes, over {MAX_BODY}", body.len()),
        ));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|_| RejectReason::new("not_json", "the body is not JSON"))?;
    let Value::Object(obj) = value else {
        return Err(RejectReason::new(
            "not_object",
            "the body is not a JSON object",
        ));
    };
    let order = Order {
        order_id: text(&obj, "order_id")?,
        customer: text(&obj, "customer")?,
        amount_cents: match obj.get("amount_cents") {
            None | Some(Value::Null) => {
                return Err(RejectReason::new(
                    "missing_field",
                    "`amount_cents` is missing",
                ))
            }
            Some(v) => v.as_i64(),
        },
        created_at: text(&obj, "created_at")?,
    };
    let key = IdempotencyKey::derive(&order.order_id, &order.created_at, body)?;
    Ok(Submission {
        key,
        subject: order.order_id.clone(),
        input: order,
    })
}

/// A transaction that can record an order: the one store-specific step of the handler,
/// in the claim's transaction.
///
/// # Contract
/// The row is written through the transaction (it commits and rolls back with the
/// claim), and every error is returned, never swallowed: a failed statement aborts a
/// Postgres transaction.
#[async_trait]
pub trait OrderBook: ClaimTx + OutboxWriter {
    /// Inserts one `orders` row.
    async fn insert_order(
        &mut self,
        order: &Order,
        amount_cents: i64,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError>;
}

#[async_trait]
impl OrderBook for PgTx {
    async fn insert_order(
        &mut self,
        order: &Order,
        amount_cents: i64,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        // The table lives in the store's schema: named by a validated identifier, never
        // by text from outside; the values are bound parameters.
        let insert = sql!(
            "INSERT INTO {schema}.orders \
             (idempotency_key, order_id, customer, amount_cents, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
            schema = self.schema_ident()
        );
        idem::postgres::sqlx::query(idem::postgres::sql::statement(insert))
            .bind(key.to_hex())
            .bind(&order.order_id)
            .bind(&order.customer)
            .bind(amount_cents)
            .bind(&order.created_at)
            .execute(self.conn())
            .await
            // By SQLSTATE, as the store's own statements: a lost connection is transient,
            // a value the table refuses is this message's fault (dead-lettered).
            .map_err(|e| idem::postgres::error::map_sqlx(e, "recording an order"))?;
        Ok(())
    }
}

#[async_trait]
impl OrderBook for SqliteTx {
    async fn insert_order(
        &mut self,
        order: &Order,
        amount_cents: i64,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        idem::sqlite::sqlx::query(
            "INSERT INTO orders (idempotency_key, order_id, customer, amount_cents, created_at) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(key.to_hex())
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(amount_cents)
        .bind(&order.created_at)
        .execute(self.conn())
        .await
        .map_err(|e| idem::sqlite::map_sqlx(e, "recording an order"))?;
        Ok(())
    }
}

/// The orders handler: one `orders` row and one [`EVENT_ORDER_RECORDED`] event per
/// order, on any store whose transaction is an [`OrderBook`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OrderHandler;

impl OrderHandler {
    /// The handler.
    pub fn new() -> Self {
        Self
    }

    /// The event an order writes: `{"order_id", "customer", "amount_cents"}`, its id
    /// derived from the order's key and the event type (a redelivered event has the same
    /// id, so the next consumer dedups it too).
    pub fn event(key: &IdempotencyKey, order: &Order, amount_cents: i64) -> OutboxEvent {
        let payload = serde_json::json!({
            "order_id": order.order_id,
            "customer": order.customer,
            "amount_cents": amount_cents,
        });
        OutboxEvent::new(
            *key,
            EVENT_ORDER_RECORDED,
            order.order_id.clone(),
            payload.to_string(),
        )
    }
}

#[async_trait]
impl<T: OrderBook> Handler<T> for OrderHandler {
    type Input = Order;

    fn identify(
        &self,
        payload: &[u8],
        _headers: &Headers,
    ) -> Result<Submission<Order>, RejectReason> {
        parse_order(payload)
    }

    /// The claim records the order's identity too (`order_id` + `created_at`): the same
    /// order resent with another body is then a conflict, not a second order.
    fn claim_meta(&self, sub: &Submission<Order>) -> ClaimMeta {
        ClaimMeta::new(sub.subject.clone()).with_submission_timestamp(sub.input.created_at.clone())
    }

    async fn handle(&self, tx: &mut T, sub: &Submission<Order>) -> Result<(), HandlerError> {
        let order = &sub.input;
        // A business rule: no retry makes a bad amount good, so the order is refused
        // (rolled back and dead-lettered with this reason), never retried.
        let amount_cents = match order.amount_cents {
            Some(cents) if cents > 0 => cents,
            _ => {
                return Err(HandlerError::Reject(RejectReason::new(
                    "bad_amount",
                    "`amount_cents` must be a positive whole number of cents",
                )))
            }
        };
        // A store error (`?` makes it `HandlerError::Store`) keeps the store's class:
        // transient ones are retried, a refused value is dead-lettered.
        tx.insert_order(order, amount_cents, &sub.key).await?;
        tx.enqueue(&Self::event(&sub.key, order, amount_cents))
            .await?;
        Ok(())
    }
}

/// One `orders` row, read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderRow {
    /// The idempotency key the order was claimed under.
    pub key: IdempotencyKey,
    /// The order's id.
    pub order_id: String,
    /// The customer.
    pub customer: String,
    /// The amount in cents.
    pub amount_cents: i64,
}

/// A store that holds the orders table: create it beside the store's own tables, and read
/// it back.
#[async_trait]
pub trait OrdersDb: Send + Sync {
    /// Creates the store's tables (`processed_messages`, `outbox`, …) and `orders` if
    /// missing. Idempotent.
    async fn migrate_orders(&self) -> Result<(), StoreError>;

    /// Every `orders` row, by order id.
    async fn orders(&self) -> Result<Vec<OrderRow>, StoreError>;
}

/// `orders` rows as read: `(idempotency_key, order_id, customer, amount_cents)`.
type RowTuple = (String, String, String, i64);

fn order_rows(rows: Vec<RowTuple>) -> Result<Vec<OrderRow>, StoreError> {
    rows.into_iter()
        .map(|(key, order_id, customer, amount_cents)| {
            let key = key
                .parse()
                .map_err(|e| StoreError::other(format!("a corrupt key in orders: {e}"), false))?;
            Ok(OrderRow {
                key,
                order_id,
                customer,
                amount_cents,
            })
        })
        .collect()
}

#[async_trait]
impl OrdersDb for PgStore {
    async fn migrate_orders(&self) -> Result<(), StoreError> {
        self.migrate().await?;
        let create = sql!(
            "CREATE TABLE IF NOT EXISTS {schema}.orders (
                idempotency_key text PRIMARY KEY,
                order_id text NOT NULL,
                customer text NOT NULL,
                amount_cents bigint NOT NULL CHECK (amount_cents > 0),
                created_at text NOT NULL
            )",
            schema = self.schema_ident()
        );
        idem::postgres::sqlx::query(idem::postgres::sql::statement(create))
            .execute(self.pool())
            .await
            .map_err(|e| idem::postgres::error::map_sqlx(e, "creating the orders table"))?;
        Ok(())
    }

    async fn orders(&self) -> Result<Vec<OrderRow>, StoreError> {
        let select = sql!(
            "SELECT idempotency_key, order_id, customer, amount_cents \
             FROM {schema}.orders ORDER BY order_id, idempotency_key",
            schema = self.schema_ident()
        );
        let rows: Vec<RowTuple> =
            idem::postgres::sqlx::query_as(idem::postgres::sql::statement(select))
                .fetch_all(self.pool())
                .await
                .map_err(|e| idem::postgres::error::map_sqlx(e, "reading the orders"))?;
        order_rows(rows)
    }
}

#[async_trait]
impl OrdersDb for SqliteStore {
    async fn migrate_orders(&self) -> Result<(), StoreError> {
        self.migrate().await?;
        idem::sqlite::sqlx::query(
            "CREATE TABLE IF NOT EXISTS orders (
                idempotency_key TEXT PRIMARY KEY,
                order_id TEXT NOT NULL,
                customer TEXT NOT NULL,
                amount_cents INTEGER NOT NULL CHECK (amount_cents > 0),
                created_at TEXT NOT NULL
            )",
        )
        .execute(self.pool())
        .await
        .map_err(|e| idem::sqlite::map_sqlx(e, "creating the orders table"))?;
        Ok(())
    }

    async fn orders(&self) -> Result<Vec<OrderRow>, StoreError> {
        let rows: Vec<RowTuple> = idem::sqlite::sqlx::query_as(
            "SELECT idempotency_key, order_id, customer, amount_cents \
             FROM orders ORDER BY order_id, idempotency_key",
        )
        .fetch_all(self.pool())
        .await
        .map_err(|e| idem::sqlite::map_sqlx(e, "reading the orders"))?;
        order_rows(rows)
    }
}

/// Where [`run`] consumes from, writes to and relays to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The broker URL (`amqp://…`; any URL of `idem::broker::any` whose feature is on).
    pub broker: String,
    /// The queue the orders arrive on (created if missing).
    pub source: String,
    /// The queue the relay publishes `order.recorded` events to (created if missing).
    pub events: String,
    /// The store: `postgres://…` (or `postgresql://…`), or `sqlite://PATH`.
    pub store: String,
    /// The Postgres schema of the tables.
    pub schema: String,
    /// Batches in flight at once.
    pub concurrency: usize,
    /// Deliveries per batch (one transaction).
    pub batch_size: usize,
    /// End once nothing arrived for this long and everything is settled and relayed
    /// (`None`: run until the shutdown future completes).
    pub exit_when_idle: Option<Duration>,
    /// How long the broker or the store may stay unreachable before the run fails.
    pub reconnect_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            broker: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            source: "orders".into(),
            events: "orders.recorded".into(),
            store: "sqlite://orders.db".into(),
            schema: "public".into(),
            concurrency: 4,
            batch_size: 50,
            exit_when_idle: None,
            reconnect_timeout: Duration::from_secs(60),
        }
    }
}

impl Settings {
    /// The defaults, each overridden by its environment variable when set:
    /// `ORDERS_BROKER` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `ORDERS_SOURCE`
    /// (`orders`), `ORDERS_EVENTS` (`orders.recorded`), `ORDERS_STORE`
    /// (`sqlite://orders.db`), `ORDERS_SCHEMA` (`public`), `ORDERS_EXIT_WHEN_IDLE`
    /// (seconds; unset: run until Ctrl-C).
    ///
    /// # Errors
    /// `ORDERS_EXIT_WHEN_IDLE` is not a number of seconds.
    pub fn from_env() -> Result<Self, BoxError> {
        let mut s = Self::default();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        if let Some(v) = var("ORDERS_BROKER") {
            s.broker = v;
        }
        if let Some(v) = var("ORDERS_SOURCE") {
            s.source = v;
        }
        if let Some(v) = var("ORDERS_EVENTS") {
            s.events = v;
        }
        if let Some(v) = var("ORDERS_STORE") {
            s.store = v;
        }
        if let Some(v) = var("ORDERS_SCHEMA") {
            s.schema = v;
        }
        if let Some(v) = var("ORDERS_EXIT_WHEN_IDLE") {
            let secs: f64 = v
                .parse()
                .map_err(|_| "ORDERS_EXIT_WHEN_IDLE must be a number of seconds")?;
            s.exit_when_idle = Some(Duration::try_from_secs_f64(secs)?);
        }
        Ok(s)
    }
}

/// What a [`run`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Every delivery's outcome, counted across reconnects.
    pub consumed: ConsumerStats,
    /// Events the relay published.
    pub relayed: u64,
}

/// How often an idle relay looks for new events where the store does not notify it
/// (SQLite; Postgres wakes it with NOTIFY).
const POLL: Duration = Duration::from_millis(200);

/// Opens the store of `settings.store`, creates the tables, consumes `settings.source`
/// through [`OrderHandler`] and relays the outbox to `settings.events`, until `shutdown`
/// completes — or, with [`Settings::exit_when_idle`], until the queue is drained and
/// every event relayed.
///
/// The consumer is supervised (`idem::runtime::supervise`: a closed connection is
/// reconnected with backoff, a store that keeps failing ends the run after
/// [`Settings::reconnect_timeout`]); the relay publishes each batch with the broker's
/// confirms and marks it published only then (at least once, with deterministic event
/// ids).
///
/// # Errors
/// The broker or the store unreachable for longer than the reconnect timeout; a
/// configuration error (a missing privilege, a bad URL).
pub async fn run(
    settings: &Settings,
    shutdown: impl Future<Output = ()>,
) -> Result<Report, BoxError> {
    let broker = BrokerUrl::parse(&settings.broker)?;
    if settings.store.starts_with("postgres://") || settings.store.starts_with("postgresql://") {
        let config = PgConfig::new(&settings.schema)?;
        let store = PgStore::connect(&settings.store, config).await?;
        store.migrate_orders().await?;
        let source = PgOutboxSource::new(store.clone(), POLL);
        consume_and_relay(settings, &broker, store, source, shutdown).await
    } else {
        let path = settings
            .store
            .strip_prefix("sqlite://")
            .ok_or("the store must be postgres://… or sqlite://PATH")?;
        let store = SqliteStore::connect(path, SqliteConfig::default()).await?;
        store.migrate_orders().await?;
        let source = SqliteOutboxSource::new(store.clone(), POLL);
        consume_and_relay(settings, &broker, store, source, shutdown).await
    }
}

/// The consumer and the relay side by side, on any store the handler can write to.
async fn consume_and_relay<S, Src>(
    settings: &Settings,
    broker: &BrokerUrl,
    store: S,
    source: Src,
    shutdown: impl Future<Output = ()>,
) -> Result<Report, BoxError>
where
    S: ClaimStore + 'static,
    OrderHandler: Handler<S::Tx>,
    Src: OutboxSource,
{
    let timeout = settings.reconnect_timeout;

    // The consumer: claim → OrderHandler → commit → ack, reconnected when the broker
    // closes the connection.
    let gate = Gate::new(store, OrderHandler::new());
    let prefetch = 2 * settings.concurrency * settings.batch_size;
    let connect = {
        let (url, name) = (broker.clone(), settings.source.clone());
        move || {
            let (url, name) = (url.clone(), name.clone());
            async move {
                AnyConsumer::connect(&url, &name, prefetch)
                    .await
                    .map_err(Attempt::Retry)
            }
        }
    };
    // A drain ends only once the queue holds nothing more for this consumer.
    let source_check = settings.exit_when_idle.map(|_| {
        let (url, name) = (broker.clone(), settings.source.clone());
        SourceCheck::new(move || {
            let (url, name) = (url.clone(), name.clone());
            async move {
                idem::broker::any::pending_count(&url, &name)
                    .await
                    .map_err(Into::into)
            }
        })
    });
    let config = SupervisorConfig::new(ConsumerConfig::new(
        settings.concurrency,
        settings.batch_size,
    ))
    .exit_when_idle(settings.exit_when_idle)
    .source_check(source_check)
    .reconnect_timeout(timeout);

    // The relay: committed events to the events queue, on a connection made again after
    // any failed publish.
    let publisher = {
        let (url, name) = (broker.clone(), settings.events.clone());
        let first = AnyPublisher::connect(&url, &name).await?;
        ReconnectingPublisher::new(Some(first), move || {
            let (url, name) = (url.clone(), name.clone());
            Box::pin(async move {
                AnyPublisher::connect(&url, &name)
                    .await
                    .map_err(|e| PublishError::new(format!("connecting: {e}"), true, None))
            })
        })
    };
    let options = idem::runtime::relay_options()
        .exit_when_idle(settings.exit_when_idle)
        .give_up_after(Some(timeout));
    let relay = Relay::with_options(source, publisher, options);

    // Side by side; the relay stops when the consumer does.
    let (consumer_done, stop_relay) = tokio::sync::oneshot::channel::<()>();
    let consuming = async {
        let run = supervise(&gate, None, connect, config, shutdown, |_| {}).await;
        let _ = consumer_done.send(());
        run
    };
    let relaying = relay.run(async {
        let _ = stop_relay.await;
    });
    let (consumed, relayed) = tokio::join!(consuming, relaying);
    let consumed = consumed?;
    let mut relayed = relayed?.published;
    if settings.exit_when_idle.is_some() {
        // Draining: what the last batches committed is relayed before the run ends.
        relayed += relay.run(std::future::pending()).await?.published;
    }
    Ok(Report {
        consumed: consumed.stats,
        relayed,
    })
}
