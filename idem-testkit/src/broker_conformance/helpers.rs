//! What the scenarios share: names, submissions, streams taken or drained, handlers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::Stream;
use futures::StreamExt;
use idem_engine::{
    consumer, AckError, AckProof, Acker, ConsumerConfig, ConsumerStats, Delivery, Gate, Handler,
    HandlerError, Headers, IdempotencyKey, RejectReason, Submission,
};

use super::BrokerUnderTest;
use crate::harness::{encode_submission, Effect, EffectHandlerFor, TestStore};
use crate::ledger::Ledger;
use crate::memory::MemoryTx;

/// `stream`, ending once nothing came for `idle` while it was polled (time between polls
/// does not count).
pub(super) fn quiet_for<S, T>(stream: S, idle: Duration) -> BoxStream<'static, T>
where
    S: Stream<Item = T> + Send + Unpin + 'static,
    T: Send + 'static,
{
    futures::stream::unfold(stream, move |mut stream| async move {
        match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(item)) => Some((item, stream)),
            Ok(None) | Err(_) => None,
        }
    })
    .boxed()
}

// ---- Helpers ----

/// Runs a scenario, failing it (rather than hanging) after two minutes.
pub async fn within<F: std::future::Future>(scenario: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(120), scenario)
        .await
        .expect("the scenario did not finish within 2 minutes")
}

/// A fresh queue or stream name: `idem-test-PREFIX-` and eight random hex digits.
pub fn fresh_name(prefix: &str) -> String {
    format!("idem-test-{prefix}-{:08x}", rand::random::<u32>())
}

/// The relay source of `store`: `outbox(store)`. (A helper for
/// [`broker_conformance_tests!`](crate::broker_conformance_tests), so its `outbox`
/// closure needs no type annotation.)
pub fn outbox_of<S, O>(store: &S, outbox: impl FnOnce(&S) -> O) -> O {
    outbox(store)
}

/// `n` distinct submissions for [`EffectHandlerFor`] (`T-TAG-00000|…|amount`, see
/// [`encode_submission`]), and the ledger that expects one effect of each.
pub fn submissions(tag: &str, n: usize) -> (Vec<Vec<u8>>, Ledger) {
    let mut ledger = Ledger::new();
    let mut bodies = Vec::with_capacity(n);
    let ts = "2026-07-01T09:00:00Z";
    for i in 0..n {
        let subject = format!("T-{tag}-{i:05}");
        let amount = 1_000 + i as i64;
        let body = encode_submission(&subject, ts, amount);
        let key = IdempotencyKey::derive(&subject, ts, &body).expect("key");
        ledger.expect(key, subject, amount);
        bodies.push(body);
    }
    (bodies, ledger)
}

/// `n` distinct plain bodies `PREFIX-00000`, … (for [`Plain`]).
pub fn plain_bodies(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i:05}").into_bytes())
        .collect()
}

/// Waits (up to 10 s) until `name` has `want` left to settle; returns the last count.
pub async fn wait_pending<B: BrokerUnderTest>(broker: &B, name: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = broker.pending(name).await.expect("pending count");
        if n == want || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The next `n` deliveries of `stream`, failing the test if they do not come in 20 s.
pub async fn take<S, A, E>(stream: &mut S, n: usize) -> Vec<Delivery<A>>
where
    S: Stream<Item = Result<Delivery<A>, E>> + Unpin,
    E: std::fmt::Debug,
{
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {n} deliveries came", out.len()))
            .expect("the stream ended")
            .expect("delivery");
        out.push(d);
    }
    out
}

/// Every delivery of `stream` until it is quiet for `idle`.
pub async fn drain<S, A, E>(stream: &mut S, idle: Duration) -> Vec<Delivery<A>>
where
    S: Stream<Item = Result<Delivery<A>, E>> + Unpin,
    E: std::fmt::Debug,
{
    let mut out = Vec::new();
    while let Ok(Some(d)) = tokio::time::timeout(idle, stream.next()).await {
        out.push(d.expect("delivery"));
    }
    out
}

/// The bodies of `deliveries`, as text, sorted.
pub fn bodies_of<A>(deliveries: &[Delivery<A>]) -> Vec<String> {
    let mut v: Vec<String> = deliveries
        .iter()
        .map(|d| String::from_utf8_lossy(&d.payload).into_owned())
        .collect();
    v.sort();
    v
}

/// A handler over the in-memory store for plain bodies: each body is its own identity
/// (the subject is the body); `fail` makes every attempt a transient failure (the gate
/// nacks), `slow` makes each one take that long. Each run that succeeds adds a row
/// `{"body": …}` to the table `done`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain {
    /// Fail every attempt (transient).
    pub fail: bool,
    /// How long each handler call takes.
    pub slow: Duration,
}

#[async_trait]
impl Handler<MemoryTx> for Plain {
    type Input = ();

    fn identify(&self, payload: &[u8], _headers: &Headers) -> Result<Submission<()>, RejectReason> {
        let body = std::str::from_utf8(payload)
            .map_err(|_| RejectReason::new("not_utf8", "body is not UTF-8"))?;
        let key = IdempotencyKey::derive(body, "2026-07-01T09:00:00Z", payload)?;
        Ok(Submission {
            key,
            subject: body.to_owned(),
            input: (),
        })
    }

    async fn handle(&self, tx: &mut MemoryTx, sub: &Submission<()>) -> Result<(), HandlerError> {
        if !self.slow.is_zero() {
            tokio::time::sleep(self.slow).await;
        }
        if self.fail {
            return Err(HandlerError::Transient("injected failure".into()));
        }
        let mut row = BTreeMap::new();
        row.insert("body".to_owned(), sub.subject.clone());
        tx.insert("done", row);
        Ok(())
    }
}

/// An acker whose ack "leaves" and never arrives: the process died after the commit
/// and before the ack.
#[derive(Debug)]
pub(super) struct LostAck<A>(pub(super) A);

#[async_trait]
impl<A: Acker> Acker for LostAck<A> {
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        drop(self.0);
        Ok(())
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.0.nack(delay).await
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        self.0.dead_letter(payload, headers, reason).await
    }
}

/// The committed effects of `store`.
pub(super) async fn effects<S: TestStore>(store: &S) -> Vec<Effect> {
    store.effects().await.expect("read the effects")
}

/// Consumes `name` into `store` through [`EffectHandlerFor`] until the broker is quiet
/// for [`BrokerUnderTest::idle`].
pub async fn consume_all<B, S>(
    broker: &B,
    name: &str,
    store: &S,
    concurrency: usize,
    batch: usize,
) -> ConsumerStats
where
    B: BrokerUnderTest,
    S: TestStore,
{
    let deliveries = broker
        .consume(name, 2 * concurrency * batch)
        .await
        .expect("connect consumer");
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    consumer::run(
        &gate,
        broker.until_idle(deliveries, broker.idle()),
        ConsumerConfig::new(concurrency, batch),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("consumer run")
}
