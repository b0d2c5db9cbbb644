//! [`AnyPublisher`], [`publish_raw`] and [`pending_count`] over every compiled-in broker.

use async_trait::async_trait;
use idem_core::{OutboxEvent, PublishError, Publisher};

use super::{not_compiled, BrokerKind, BrokerUrl};
use crate::BrokerError;

broker_enum! {
    /// A publisher to any compiled-in broker (for the relay and `idem publish`).
    #[derive(Debug)]
    #[non_exhaustive]
    pub enum AnyPublisher(
        RabbitPublisher,
        NatsPublisher,
        RedisStreamsPublisher,
        SqsPublisher,
        KafkaPublisher
    );
}

impl AnyPublisher {
    /// Connects to the broker of `url` for publishing to `name` (created if missing).
    ///
    /// # Errors
    /// The broker cannot be reached; an invalid name.
    #[allow(unused_variables)] // with no broker feature
    pub async fn connect(url: &BrokerUrl, name: &str) -> Result<Self, BrokerError> {
        match url.kind() {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => {
                let c = crate::rabbitmq::RabbitConfig::from_url(url, name)?;
                Ok(Self::RabbitMq(
                    crate::rabbitmq::RabbitPublisher::connect_with(&c).await?,
                ))
            }
            #[cfg(feature = "nats")]
            BrokerKind::Nats => Ok(Self::Nats(
                crate::nats::NatsPublisher::connect(url.client_url(), name).await?,
            )),
            #[cfg(feature = "redis-streams")]
            BrokerKind::RedisStreams => Ok(Self::RedisStreams(
                crate::redis_streams::RedisStreamsPublisher::connect(url.client_url(), name)
                    .await?,
            )),
            #[cfg(feature = "sqs")]
            BrokerKind::Sqs => {
                let c = crate::sqs::SqsConfig::from_url(url, name)?;
                Ok(Self::Sqs(
                    crate::sqs::SqsPublisher::connect_config(&c).await?,
                ))
            }
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                let c = crate::kafka::KafkaConfig::from_url(url, name)?;
                Ok(Self::Kafka(
                    crate::kafka::KafkaPublisher::connect_config(&c).await?,
                ))
            }
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(other.feature(), other)),
        }
    }

    /// As [`publish_raw`](Self::publish_raw), each message with `headers` (AMQP
    /// headers, NATS headers, Redis stream fields, SQS string attributes, Kafka
    /// headers), for example a W3C `traceparent`.
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    #[allow(unused_variables)] // with no broker feature
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        each_broker!(self, Self, p => p.publish_raw_with_headers(bodies, headers).await)
    }

    /// As [`publish_raw_with_headers`](Self::publish_raw_with_headers), the body at `i`
    /// with the key `keys[i]` where the broker has keys: on Kafka the record key, so the
    /// bodies of one key go to one partition in the order given (and are consumed in
    /// it); the other brokers keep one queue or stream in publish order and have no use
    /// for it.
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    #[allow(unused_variables)] // with no broker feature
    pub async fn publish_keyed(
        &self,
        bodies: &[Vec<u8>],
        keys: &[Option<Vec<u8>>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        match self {
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => p.publish_keyed(bodies, keys, headers).await,
            #[allow(unreachable_patterns)]
            _ => self.publish_raw_with_headers(bodies, headers).await,
        }
    }
}

#[async_trait]
impl Publisher for AnyPublisher {
    #[allow(unused_variables)] // with no broker feature
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        each_broker!(self, Self, p => p.publish(events).await)
    }
}

crate::raw::raw_publishing! {
    /// Publishes each body as it is, durably, in order, waiting for the broker's
    /// confirmation. Equal bodies stay separate messages.
    ///
    /// # Errors
    /// A failed or unconfirmed publish; bodies before it may have been published.
    method of AnyPublisher;
    /// Publishes each body to `name` as it is (see [`AnyPublisher::publish_raw`]).
    ///
    /// # Errors
    /// As [`AnyPublisher::connect`] and [`AnyPublisher::publish_raw`].
    fn publish_raw(url: &BrokerUrl, name: &str);
}

/// What is left to settle in `name`, for tests and scripts:
///
/// - RabbitMQ: ready messages (unacked ones count again once their channel closes);
/// - NATS: the durable consumer's pending plus ack-pending messages;
/// - Redis Streams: the group's lag plus its pending entries;
/// - SQS: visible, in-flight and delayed messages (approximate, as SQS reports them);
/// - Kafka: the group's lag (high watermark minus committed offset) over all partitions.
///
/// # Errors
/// The broker cannot be reached.
#[allow(unused_variables)] // with no broker feature
pub async fn pending_count(url: &BrokerUrl, name: &str) -> Result<u64, BrokerError> {
    match url.kind() {
        #[cfg(feature = "rabbitmq")]
        BrokerKind::RabbitMq => crate::rabbitmq::pending_count(url.client_url(), name).await,
        #[cfg(feature = "nats")]
        BrokerKind::Nats => {
            let c = crate::nats::NatsConfig::from_url(url, name)?;
            crate::nats::pending_count(&c.url, name, &c.durable).await
        }
        #[cfg(feature = "redis-streams")]
        BrokerKind::RedisStreams => {
            let c = crate::redis_streams::RedisStreamsConfig::from_url(url, name)?;
            crate::redis_streams::pending_count(&c.url, name, &c.group).await
        }
        #[cfg(feature = "sqs")]
        BrokerKind::Sqs => {
            let c = crate::sqs::SqsConfig::from_url(url, name)?;
            crate::sqs::pending_count(c.endpoint.as_deref(), name).await
        }
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => {
            let c = crate::kafka::KafkaConfig::from_url(url, name)?;
            crate::kafka::pending_count_with(&c).await
        }
        #[allow(unreachable_patterns)]
        other => Err(not_compiled(other.feature(), other)),
    }
}
