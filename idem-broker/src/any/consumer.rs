//! [`AnyConsumer`] and its [`AnyAcker`]: each broker's consumer and acker behind one type.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};

use super::{not_compiled, BrokerKind, BrokerUrl};
use crate::BrokerError;

/// Deliveries from any compiled-in broker, as a stream of
/// `Result<Delivery<AnyAcker>, BrokerError>`.
pub struct AnyConsumer {
    inner: BoxStream<'static, Result<Delivery<AnyAcker>, BrokerError>>,
    kind: BrokerKind,
}

impl fmt::Debug for AnyConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyConsumer")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

#[allow(dead_code)] // used by the broker features
fn wrap<S, A>(
    stream: S,
    f: fn(A) -> AnyAcker,
) -> BoxStream<'static, Result<Delivery<AnyAcker>, BrokerError>>
where
    S: Stream<Item = Result<Delivery<A>, BrokerError>> + Send + 'static,
    A: Acker,
{
    use futures::StreamExt;
    stream
        .map(move |r| {
            r.map(|d| Delivery {
                payload: d.payload,
                headers: d.headers,
                attempt: d.attempt,
                acker: f(d.acker),
            })
        })
        .boxed()
}

impl AnyConsumer {
    /// Connects to the broker of `url` and starts consuming `name` (created if missing),
    /// with up to `prefetch` unsettled deliveries on hand (for a consumer running
    /// `concurrency` batches of `batch_size`, `2 × concurrency × batch_size` keeps the
    /// next batches waiting).
    ///
    /// # Errors
    /// The broker cannot be reached; an invalid name.
    pub async fn connect(
        url: &BrokerUrl,
        name: &str,
        prefetch: usize,
    ) -> Result<Self, BrokerError> {
        Self::connect_with(url, name, prefetch, None).await
    }

    /// [`connect`](Self::connect), with the store that keeps a log broker's positions
    /// when its URL asks for it (Kafka's `?positions=store`,
    /// [`Positions`](crate::kafka::Positions)); ignored by the other brokers, and by a
    /// URL that does not ask.
    ///
    /// # Errors
    /// As [`connect`](Self::connect); `?positions=store` without a position store.
    #[allow(unused_variables)] // with no broker feature
    pub async fn connect_with(
        url: &BrokerUrl,
        name: &str,
        prefetch: usize,
        positions: Option<std::sync::Arc<dyn idem_core::PositionStore>>,
    ) -> Result<Self, BrokerError> {
        let inner = match url.kind() {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => {
                let c = crate::rabbitmq::RabbitConfig::from_url(url, name)?.with_prefetch(prefetch);
                wrap(
                    crate::rabbitmq::RabbitConsumer::connect(&c).await?,
                    AnyAcker::RabbitMq,
                )
            }
            #[cfg(feature = "nats")]
            BrokerKind::Nats => {
                let c = crate::nats::NatsConfig::from_url(url, name)?.with_prefetch(prefetch);
                wrap(
                    crate::nats::NatsConsumer::connect(&c).await?,
                    AnyAcker::Nats,
                )
            }
            #[cfg(feature = "redis-streams")]
            BrokerKind::RedisStreams => {
                let c = crate::redis_streams::RedisStreamsConfig::from_url(url, name)?
                    .with_prefetch(prefetch);
                let consumer = crate::redis_streams::RedisStreamsConsumer::connect(&c).await?;
                wrap(consumer, AnyAcker::RedisStreams)
            }
            #[cfg(feature = "sqs")]
            BrokerKind::Sqs => {
                let c = crate::sqs::SqsConfig::from_url(url, name)?.with_prefetch(prefetch);
                wrap(crate::sqs::SqsConsumer::connect(&c).await?, AnyAcker::Sqs)
            }
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                let mut c = crate::kafka::KafkaConfig::from_url(url, name)?.with_prefetch(prefetch);
                if let (crate::kafka::Positions::Store(None), Some(store)) =
                    (&c.positions, positions)
                {
                    c = c.with_position_store(store);
                }
                wrap(
                    crate::kafka::KafkaConsumer::connect(&c).await?,
                    AnyAcker::Kafka,
                )
            }
            #[allow(unreachable_patterns)]
            other => return Err(not_compiled(other.feature(), other)),
        };
        Ok(Self {
            inner,
            kind: url.kind(),
        })
    }

    /// Which broker.
    pub fn kind(&self) -> BrokerKind {
        self.kind
    }
}

impl Stream for AnyConsumer {
    type Item = Result<Delivery<AnyAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

broker_enum! {
    /// The acker of an [`AnyConsumer`]'s deliveries: the broker's own, behind one type.
    #[derive(Debug)]
    #[non_exhaustive]
    pub enum AnyAcker(RabbitAcker, NatsAcker, RedisStreamsAcker, SqsAcker, KafkaAcker);
}

/// One ack result per position of a batch, filled in broker by broker.
type AckResults = Vec<Option<Result<(), AckError>>>;

/// Acks, with broker `A`'s batch form, the items of `items` that `take` unwraps to an
/// `A`, putting each result at its item's position in `out`; returns the other items.
#[allow(dead_code)] // used by the broker features
async fn ack_group<A: Acker>(
    items: Vec<(usize, AnyAcker, AckProof)>,
    out: &mut AckResults,
    take: fn(AnyAcker) -> Result<A, AnyAcker>,
) -> Vec<(usize, AnyAcker, AckProof)> {
    let (mut index, mut batch, mut others) = (Vec::new(), Vec::new(), Vec::new());
    for (i, acker, proof) in items {
        match take(acker) {
            Ok(a) => {
                index.push(i);
                batch.push((a, proof));
            }
            Err(acker) => others.push((i, acker, proof)),
        }
    }
    if !batch.is_empty() {
        for (i, r) in index.into_iter().zip(A::ack_all(batch).await) {
            out[i] = Some(r);
        }
    }
    others
}

/// `ack_group` for variant `$variant`, when its feature is compiled in.
macro_rules! ack_variant {
    ($items:ident, $out:ident, $feature:literal, $variant:ident) => {
        #[cfg(feature = $feature)]
        let $items = ack_group($items, &mut $out, |a| match a {
            AnyAcker::$variant(a) => Ok(a),
            #[allow(unreachable_patterns)]
            other => Err(other),
        })
        .await;
    };
}

#[async_trait]
impl Acker for AnyAcker {
    async fn ack(self, proof: AckProof) -> Result<(), AckError> {
        each_broker!(self, Self, a => a.ack(proof).await)
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        each_broker!(self, Self, a => a.nack(delay).await)
    }

    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        each_broker!(self, Self, a => a.defer(delay).await)
    }

    fn attempt_counts_runs(&self) -> bool {
        each_broker!(self, Self, a => a.attempt_counts_runs())
    }

    fn position(&self) -> Option<idem_core::PositionMove> {
        each_broker!(self, Self, a => a.position())
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        each_broker!(self, Self, a => a.dead_letter(payload, headers, reason).await)
    }

    /// Groups the batch by broker and uses each broker's batch ack, keeping the order of
    /// the results.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let mut out: AckResults = items.iter().map(|_| None).collect();
        let items: Vec<(usize, Self, AckProof)> = items
            .into_iter()
            .enumerate()
            .map(|(i, (a, p))| (i, a, p))
            .collect();
        ack_variant!(items, out, "rabbitmq", RabbitMq);
        ack_variant!(items, out, "nats", Nats);
        ack_variant!(items, out, "redis-streams", RedisStreams);
        ack_variant!(items, out, "sqs", Sqs);
        ack_variant!(items, out, "kafka", Kafka);
        drop(items);
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(AckError::new("ack result missing", false, None))))
            .collect()
    }
}
