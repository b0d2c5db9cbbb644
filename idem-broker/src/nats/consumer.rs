//! Consuming a stream through a durable pull consumer: [`NatsConsumer`] and its
//! [`NatsAcker`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy};
use async_nats::jetstream::message::{AckKind, Acker as JsAcker};
use async_nats::jetstream::{self, consumer::pull::MessagesErrorKind};
use async_trait::async_trait;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};

use super::config::NatsConfig;
use super::publisher::publish_confirmed;
use super::{check_name, connect, ensure_stream, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

struct Shared {
    client: async_nats::Client,
    js: jetstream::Context,
    dead_letter_subject: String,
}

impl Shared {
    async fn flush(&self, action: &'static str) -> Result<(), AckError> {
        self.client
            .flush()
            .await
            .map_err(|e| BrokerError::op(BROKER, action, e).into())
    }
}

/// Deliveries of a JetStream durable pull consumer, as a stream of
/// `Result<Delivery<NatsAcker>, BrokerError>`.
pub struct NatsConsumer {
    inner: pull::Stream,
    shared: Arc<Shared>,
    name: String,
}

impl std::fmt::Debug for NatsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The durable consumer's configuration.
pub(super) fn consumer_config(config: &NatsConfig) -> pull::Config {
    let prefetch = i64::try_from(config.prefetch).unwrap_or(i64::MAX);
    pull::Config {
        durable_name: Some(config.durable.clone()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_deliver: -1,
        max_ack_pending: prefetch.saturating_mul(2).max(1_000),
        ..Default::default()
    }
}

impl NatsConsumer {
    /// Connects, creates the stream and its dead-letter stream if missing, creates or
    /// updates the durable consumer, and starts pulling.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the server cannot be reached (or has no JetStream);
    /// an invalid name.
    pub async fn connect(config: &NatsConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let js = connect(&config.url).await?;
        let stream = ensure_stream(&js, &config.name, config.duplicate_window).await?;
        let dead_letter_subject = dead_letter_name(&config.name);
        ensure_stream(&js, &dead_letter_subject, config.duplicate_window).await?;
        let consumer: jetstream::consumer::PullConsumer = stream
            .create_consumer(consumer_config(config))
            .await
            .map_err(|e| BrokerError::op(BROKER, "consumer create", e))?;
        let inner = consumer
            .stream()
            .max_messages_per_batch(config.prefetch.max(1))
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| BrokerError::op(BROKER, "pull", e))?;
        Ok(Self {
            inner,
            shared: Arc::new(Shared {
                client: js.client(),
                js,
                dead_letter_subject,
            }),
            name: config.name.clone(),
        })
    }
}

impl Stream for NatsConsumer {
    type Item = Result<Delivery<NatsAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            return match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => {
                    if e.kind() == MessagesErrorKind::MissingHeartbeat {
                        // The pull request is renewed by the client; keep waiting.
                        tracing::warn!(target: "idem::broker", broker = BROKER, "missed a JetStream heartbeat");
                        continue;
                    }
                    Poll::Ready(Some(Err(BrokerError::op(BROKER, "pull", e))))
                }
                Poll::Ready(Some(Ok(m))) => {
                    let (msg, acker) = m.split();
                    let mut headers = Headers::new();
                    if let Some(h) = &msg.headers {
                        for (k, vs) in h.iter() {
                            for v in vs {
                                headers.push((k.to_string(), v.as_str().to_owned()));
                            }
                        }
                    }
                    Poll::Ready(Some(Ok(Delivery {
                        payload: msg.payload.to_vec(),
                        headers,
                        attempt: None,
                        acker: NatsAcker {
                            acker: Box::new(acker),
                            shared: Arc::clone(&self.shared),
                        },
                    })))
                }
            };
        }
    }
}

/// Settles one JetStream delivery.
pub struct NatsAcker {
    // Boxed: the client's acker is large, and every delivery carries one.
    acker: Box<JsAcker>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NatsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAcker").finish_non_exhaustive()
    }
}

fn op_err(action: &'static str, e: impl Into<idem_core::BoxError>) -> AckError {
    BrokerError::op(BROKER, action, e).into()
}

#[async_trait]
impl Acker for NatsAcker {
    /// `+ACK`, then a flush: when it returns, the server has the ack.
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.acker.ack().await.map_err(|e| op_err("ack", e))?;
        self.shared.flush("ack flush").await
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.acker
            .ack_with(AckKind::Nak(delay.filter(|d| !d.is_zero())))
            .await
            .map_err(|e| op_err("nak", e))?;
        self.shared.flush("nak flush").await
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut out: Vec<(String, String)> = headers
            .iter()
            .filter(|(k, _)| {
                !k.eq_ignore_ascii_case("Nats-Msg-Id") && k != DEAD_LETTER_REASON_HEADER
            })
            .cloned()
            .collect();
        out.push((DEAD_LETTER_REASON_HEADER.to_owned(), reason.to_string()));
        let published = publish_confirmed(
            &self.shared.js,
            &self.shared.dead_letter_subject,
            vec![(payload.to_vec(), out, None)],
        )
        .await;
        match published {
            Ok(()) => self
                .acker
                .double_ack_with(AckKind::Term)
                .await
                .map_err(|e| op_err("term", e)),
            Err(e) => {
                // Not dead-lettered: hand it back rather than lose it.
                let _ = self.acker.ack_with(AckKind::Nak(None)).await;
                Err(e.into())
            }
        }
    }

    /// Every `+ACK`, then one flush.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let mut out = Vec::with_capacity(items.len());
        let mut flushers: Vec<Arc<Shared>> = Vec::new();
        for (a, _proof) in items {
            out.push(a.acker.ack().await.map_err(|e| op_err("ack", e)));
            if !flushers.iter().any(|s| Arc::ptr_eq(s, &a.shared)) {
                flushers.push(Arc::clone(&a.shared));
            }
        }
        for s in flushers {
            if let Err(e) = s.flush("ack flush").await {
                // Unknown which acks arrived: report the batch as failed (harmless: a
                // redelivery is skipped as a duplicate).
                return out
                    .into_iter()
                    .map(|_| Err(AckError::new(e.message.clone(), true, None)))
                    .collect();
            }
        }
        out
    }
}
