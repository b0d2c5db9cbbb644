//! A simulated at-least-once broker: unacked deliveries come back, nack requeues, acks can
//! be "lost" (the broker redelivers anyway), a dead-letter queue, deterministic from a seed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    AckError, AckProof, Acker, Delivery, Headers, IdempotencyKey, OutboxEvent, PublishError,
    Publisher, RejectReason,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// A message held by the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimMessage {
    /// The broker's own id (not the idempotency key: a republish gets a new one).
    pub id: u64,
    /// The body.
    pub payload: Vec<u8>,
    /// The headers.
    pub headers: Headers,
    /// How many times it has been delivered.
    pub deliveries: u32,
    /// How many of those deliveries were runs: every delivery but those handed back by
    /// [`Acker::defer`] (see [`SimBroker::counting_runs`]).
    pub runs: u32,
    /// Whether the broker has already redelivered it after an ack (it does so once at
    /// most, so a redelivery rate of 1.0 still terminates).
    pub echoed: bool,
    /// Whether its visibility timeout has already expired once while it was in flight
    /// (once at most, for the same reason).
    pub expired: bool,
}

/// Counters of a [`SimBroker`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BrokerStats {
    /// Messages published.
    pub published: u64,
    /// Deliveries handed out (first deliveries and redeliveries).
    pub deliveries: u64,
    /// Deliveries that were redeliveries.
    pub redeliveries: u64,
    /// Acks received.
    pub acks: u64,
    /// Acks the broker "lost" on purpose (the message was redelivered anyway).
    pub acks_lost: u64,
    /// Nacks received.
    pub nacks: u64,
    /// Deferrals kept without counting a run (under [`SimBroker::counting_runs`]).
    pub deferrals: u64,
    /// Deliveries dropped unsettled (a crashed consumer) and requeued.
    pub abandoned: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries whose visibility timeout expired while they were in flight: the message
    /// was handed out again, so two consumers held it at once.
    pub expired: u64,
    /// Acks whose [`AckProof`] named another key than the delivery's own payload: a gate
    /// that acked one delivery with another's proof. Always 0 for a correct gate.
    pub foreign_proofs: u64,
}

#[derive(Debug)]
struct State {
    ready: VecDeque<SimMessage>,
    in_flight: HashMap<u64, SimMessage>,
    dead: Vec<(SimMessage, RejectReason)>,
    published_events: Vec<OutboxEvent>,
    /// Each payload's key, when the run said ([`SimBroker::expect_keys`]).
    keys: Option<HashMap<Vec<u8>, IdempotencyKey>>,
    rng: StdRng,
    redelivery_rate: f64,
    expiry_rate: f64,
    count_runs: bool,
    next_id: u64,
    next_tag: u64,
    stats: BrokerStats,
}

/// The simulated broker. Clones share one queue.
///
/// - [`receive`](SimBroker::receive) hands out the next ready message as a [`Delivery`]
///   whose [`SimAcker`] settles it.
/// - An ack removes the message — except that with probability `redelivery_rate` the ack
///   is "lost" and the message is redelivered once more (the at-least-once duplicate).
/// - A nack, or an acker dropped unsettled (a crash), puts the message back at the end
///   of the queue: a visibility timeout that elapses at once.
/// - A dead-letter moves it to [`dead_letters`](SimBroker::dead_letters) with the reason.
#[derive(Debug, Clone)]
pub struct SimBroker {
    state: Arc<Mutex<State>>,
}

impl SimBroker {
    /// A broker whose random choices come from `seed`; no acks are lost.
    pub fn new(seed: u64) -> Self {
        Self::with_redelivery_rate(seed, 0.0)
    }

    /// A broker that redelivers an acked message with probability `rate`.
    pub fn with_redelivery_rate(seed: u64, rate: f64) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                ready: VecDeque::new(),
                in_flight: HashMap::new(),
                dead: Vec::new(),
                published_events: Vec::new(),
                keys: None,
                rng: StdRng::seed_from_u64(seed),
                redelivery_rate: rate.clamp(0.0, 1.0),
                expiry_rate: 0.0,
                count_runs: false,
                next_id: 0,
                next_tag: 0,
                stats: BrokerStats::default(),
            })),
        }
    }

    /// Makes a delivery's visibility timeout expire while it is in flight with
    /// probability `rate` (once per message at most): the message is handed out again at
    /// once, and the same message is held by two consumers — SQS and Redis Streams after a
    /// slow handler, RabbitMQ after a connection that only looks dead.
    #[must_use]
    pub fn with_expiry_rate(self, rate: f64) -> Self {
        self.lock().expiry_rate = rate.clamp(0.0, 1.0);
        self
    }

    /// Makes the broker keep a deferred delivery without counting it, as the NATS, SQS
    /// and RabbitMQ adapters do: each delivery then carries its count of runs as its
    /// [`attempt`](Delivery::attempt), and its acker says so
    /// ([`Acker::attempt_counts_runs`]), so the gate checks the attempt before the
    /// handler too. A nack and a crash (an acker dropped unsettled) count; a
    /// [`defer`](Acker::defer) does not.
    #[must_use]
    pub fn counting_runs(self) -> Self {
        self.lock().count_runs = true;
        self
    }

    /// The key each payload must be acked with (the handler's `identify` of it), for
    /// [`BrokerStats::foreign_proofs`]; without it, the key of a payload that is one of
    /// the test kit's submissions ([`crate::EffectHandler::parse`]).
    pub(crate) fn expect_keys(&self, keys: HashMap<Vec<u8>, IdempotencyKey>) {
        self.lock().keys = Some(keys);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Publishes a message; returns its broker id.
    pub fn publish(&self, payload: impl Into<Vec<u8>>) -> u64 {
        self.publish_with_headers(payload, Vec::new())
    }

    /// Publishes a message with headers.
    pub fn publish_with_headers(&self, payload: impl Into<Vec<u8>>, headers: Headers) -> u64 {
        let mut st = self.lock();
        st.next_id += 1;
        let id = st.next_id;
        st.ready.push_back(SimMessage {
            id,
            payload: payload.into(),
            headers,
            deliveries: 0,
            runs: 0,
            echoed: false,
            expired: false,
        });
        st.stats.published += 1;
        id
    }

    /// The next ready message, if any.
    pub fn receive(&self) -> Option<Delivery<SimAcker>> {
        let mut st = self.lock();
        let mut msg = st.ready.pop_front()?;
        msg.deliveries += 1;
        msg.runs += 1;
        st.stats.deliveries += 1;
        if msg.deliveries > 1 {
            st.stats.redeliveries += 1;
        }
        let rate = st.expiry_rate;
        if !msg.expired && rate > 0.0 && st.rng.random_bool(rate) {
            msg.expired = true;
            st.stats.expired += 1;
            st.ready.push_front(msg.clone());
        }
        st.next_tag += 1;
        let tag = st.next_tag;
        let delivery = Delivery {
            payload: msg.payload.clone(),
            headers: msg.headers.clone(),
            attempt: st.count_runs.then_some(msg.runs),
            acker: SimAcker {
                broker: self.clone(),
                tag,
                settled: false,
                counts_runs: st.count_runs,
            },
        };
        st.in_flight.insert(tag, msg);
        Some(delivery)
    }

    /// Up to `max` ready messages.
    pub fn receive_many(&self, max: usize) -> Vec<Delivery<SimAcker>> {
        std::iter::from_fn(|| self.receive()).take(max).collect()
    }

    /// Messages waiting to be delivered.
    pub fn ready_len(&self) -> usize {
        self.lock().ready.len()
    }

    /// Deliveries handed out and not settled.
    pub fn in_flight_len(&self) -> usize {
        self.lock().in_flight.len()
    }

    /// Nothing ready and nothing in flight: every delivery was settled.
    pub fn is_settled(&self) -> bool {
        let st = self.lock();
        st.ready.is_empty() && st.in_flight.is_empty()
    }

    /// The dead-lettered messages with their reasons.
    pub fn dead_letters(&self) -> Vec<(SimMessage, RejectReason)> {
        self.lock().dead.clone()
    }

    /// Counters so far.
    pub fn stats(&self) -> BrokerStats {
        self.lock().stats
    }

    /// Events received through the [`Publisher`] implementation.
    pub fn published_events(&self) -> Vec<OutboxEvent> {
        self.lock().published_events.clone()
    }

    fn settle(&self, tag: u64, how: Settlement) {
        let mut st = self.lock();
        let Some(msg) = st.in_flight.remove(&tag) else {
            return;
        };
        match how {
            Settlement::Ack(key) => {
                st.stats.acks += 1;
                // The proof must be for this delivery: its payload's own key, where it is
                // known (the run's keys, or one of the test kit's submissions).
                let own = match &st.keys {
                    Some(keys) => keys.get(&msg.payload).copied(),
                    None => crate::harness::EffectHandler::parse(&msg.payload)
                        .ok()
                        .map(|sub| sub.key),
                };
                if own.is_some_and(|own| own != key) {
                    st.stats.foreign_proofs += 1;
                }
                let rate = st.redelivery_rate;
                if !msg.echoed && rate > 0.0 && st.rng.random_bool(rate) {
                    st.stats.acks_lost += 1;
                    let mut msg = msg;
                    msg.echoed = true;
                    st.ready.push_back(msg);
                }
            }
            Settlement::Nack => {
                st.stats.nacks += 1;
                st.ready.push_back(msg);
            }
            Settlement::Defer => {
                st.stats.deferrals += 1;
                let mut msg = msg;
                msg.runs -= 1;
                st.ready.push_back(msg);
            }
            Settlement::Abandon => {
                st.stats.abandoned += 1;
                st.ready.push_back(msg);
            }
            Settlement::Dead(reason) => {
                st.stats.dead_lettered += 1;
                st.dead.push((msg, reason));
            }
        }
    }
}

enum Settlement {
    Ack(IdempotencyKey),
    Nack,
    Defer,
    Abandon,
    Dead(RejectReason),
}

/// Settles one [`SimBroker`] delivery. Dropping it unsettled is a crash: the message
/// comes back.
#[derive(Debug)]
pub struct SimAcker {
    broker: SimBroker,
    tag: u64,
    settled: bool,
    counts_runs: bool,
}

impl SimAcker {
    fn finish(mut self, how: Settlement) {
        self.settled = true;
        self.broker.settle(self.tag, how);
    }
}

impl Drop for SimAcker {
    fn drop(&mut self) {
        if !self.settled {
            self.broker.settle(self.tag, Settlement::Abandon);
        }
    }
}

#[async_trait]
impl Acker for SimAcker {
    async fn ack(self, proof: AckProof) -> Result<(), AckError> {
        self.finish(Settlement::Ack(*proof.key()));
        Ok(())
    }

    async fn nack(self, _delay: Option<Duration>) -> Result<(), AckError> {
        self.finish(Settlement::Nack);
        Ok(())
    }

    /// Under [`SimBroker::counting_runs`]: back in the queue without counting a run;
    /// otherwise a nack.
    async fn defer(self, _delay: Duration) -> Result<(), AckError> {
        let how = if self.counts_runs {
            Settlement::Defer
        } else {
            Settlement::Nack
        };
        self.finish(how);
        Ok(())
    }

    fn attempt_counts_runs(&self) -> bool {
        self.counts_runs
    }

    async fn dead_letter(
        self,
        _payload: &[u8],
        _headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        self.finish(Settlement::Dead(reason.clone()));
        Ok(())
    }
}

#[async_trait]
impl Publisher for SimBroker {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let mut st = self.lock();
        st.published_events.extend_from_slice(events);
        for ev in events {
            st.next_id += 1;
            let id = st.next_id;
            st.ready.push_back(SimMessage {
                id,
                payload: ev.payload.clone(),
                headers: ev.headers(),
                deliveries: 0,
                runs: 0,
                echoed: false,
                expired: false,
            });
            st.stats.published += 1;
        }
        Ok(())
    }
}
