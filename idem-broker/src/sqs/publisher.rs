//! Sending to a queue: [`SqsPublisher`] for the relay, [`publish_raw`] for bodies as they
//! are, and [`pending_count`].

use std::collections::HashMap;

use async_trait::async_trait;
use aws_config::SdkConfig;
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use futures::{StreamExt, TryStreamExt};
use idem_core::{OutboxEvent, PublishError, Publisher};

use super::{
    attributes, body_text, client, client_for, client_of, is_fifo, open_queues, queue_url, sdk_err,
    SqsConfig, BROKER,
};
use crate::BrokerError;

/// The error for a batch some of whose entries SQS did not store, if any. An entry
/// refused through the sender's fault (`SenderFault`: its content, its size, its
/// attributes) is refused for good — not retryable, so that a relay moves the event aside
/// instead of retrying the batch forever; anything else (the service's fault) may pass on
/// a retry.
fn refused(failed: &[BatchResultErrorEntry]) -> Option<BrokerError> {
    let first = failed.first()?;
    let detail = format!(
        "{} of the batch refused: {} {}",
        failed.len(),
        first.code,
        first.message.clone().unwrap_or_default()
    );
    Some(match failed.iter().find(|f| f.sender_fault) {
        Some(f) => BrokerError::Operation {
            broker: BROKER,
            action: "SendMessageBatch",
            retryable: false,
            source: format!(
                "{detail} (the sender's fault: {} {})",
                f.code,
                f.message.clone().unwrap_or_default()
            )
            .into(),
        },
        None => BrokerError::NotConfirmed {
            broker: BROKER,
            detail,
        },
    })
}

/// The most messages one `SendMessageBatch` carries.
const SQS_BATCH: usize = 10;
/// The most bytes of bodies one `SendMessageBatch` carries (SQS allows 256 KiB in all;
/// attributes take some of it).
const SQS_BATCH_BYTES: usize = 200 * 1024;
/// How many batches are sent at once to a standard queue (a FIFO queue gets one at a
/// time, to keep the order).
const PARALLEL_BATCHES: usize = 8;

/// One message to send.
struct Outgoing {
    body: String,
    attributes: HashMap<String, MessageAttributeValue>,
    group: Option<String>,
    dedup: Option<String>,
}

/// Sends outbox events to an SQS queue with `SendMessageBatch`: the event id and type
/// as message attributes; on a FIFO queue the subject is the message group (order per
/// award) and the event id the deduplication id (SQS drops a republish within five
/// minutes).
pub struct SqsPublisher {
    client: Client,
    queue_url: String,
    name: String,
    fifo: bool,
}

impl std::fmt::Debug for SqsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsPublisher")
            .field("name", &self.name)
            .field("fifo", &self.fifo)
            .finish_non_exhaustive()
    }
}

impl SqsPublisher {
    /// Connects for publishing to `name` at `endpoint`, or at the environment's endpoint
    /// when `None`; the queue and its dead-letter queue are created if missing, with the
    /// defaults of [`SqsConfig`].
    ///
    /// # Errors
    /// The endpoint cannot be reached; an invalid name; an existing queue set up
    /// differently ([`BrokerError::Config`]).
    pub async fn connect(endpoint: Option<&str>, name: &str) -> Result<Self, BrokerError> {
        Self::connect_config(&SqsConfig::new(endpoint.map(str::to_owned), name)).await
    }

    /// As [`connect`](Self::connect), with `config`'s endpoint, queue name and the
    /// settings of a queue created here (retention, redrive policy).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_config(config: &SqsConfig) -> Result<Self, BrokerError> {
        Self::from_client(client_for(config).await?, config).await
    }

    /// As [`connect_config`](Self::connect_config), with an AWS configuration the
    /// application loaded itself (its credentials provider, region, endpoint, HTTP
    /// client, retries, interceptors). `config.endpoint` and `config.region` are not used
    /// (`sdk`'s are); its timeouts apply to idem's requests.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use aws_config::BehaviorVersion;
    /// use idem_broker::sqs::{SqsConfig, SqsPublisher};
    ///
    /// let sdk = aws_config::load_defaults(BehaviorVersion::latest()).await;
    /// let publisher = SqsPublisher::from_sdk_config(&sdk, &SqsConfig::new(None, "grants")).await?;
    /// publisher.publish_raw(&[b"{}".to_vec()]).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`BrokerError::Config`] for an `sdk` without a
    /// behavior version.
    pub async fn from_sdk_config(sdk: &SdkConfig, config: &SqsConfig) -> Result<Self, BrokerError> {
        Self::from_client(client_of(sdk)?, config).await
    }

    /// As [`connect_config`](Self::connect_config), through an SQS client the
    /// application built itself. idem's requests go through a copy of it with `config`'s
    /// connect and request timeouts (sharing its credentials, region, endpoint, HTTP
    /// client and interceptors); `config.endpoint` and `config.region` are not used.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use aws_config::BehaviorVersion;
    /// use idem_broker::sqs::{SqsConfig, SqsPublisher};
    ///
    /// let sdk = aws_config::load_defaults(BehaviorVersion::latest()).await;
    /// let client = aws_sdk_sqs::Client::new(&sdk);
    /// let publisher = SqsPublisher::from_client(client, &SqsConfig::new(None, "grants")).await?;
    /// publisher.publish_raw(&[b"{}".to_vec()]).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn from_client(client: Client, config: &SqsConfig) -> Result<Self, BrokerError> {
        let (client, queue_url, _) = open_queues(&client, config).await?;
        Ok(Self {
            client,
            queue_url,
            name: config.name.clone(),
            fifo: is_fifo(&config.name),
        })
    }

    async fn send_batch(&self, batch: Vec<Outgoing>) -> Result<(), BrokerError> {
        let entries: Vec<SendMessageBatchRequestEntry> = batch
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(m.body)
                    .set_message_attributes((!m.attributes.is_empty()).then_some(m.attributes))
                    .set_message_group_id(m.group)
                    .set_message_deduplication_id(m.dedup)
                    .build()
                    .map_err(|e| BrokerError::op(BROKER, "SendMessageBatch entry", e))
            })
            .collect::<Result<_, _>>()?;
        let out = self
            .client
            .send_message_batch()
            .queue_url(&self.queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| sdk_err(&self.client, "SendMessageBatch", e))?;
        refused(&out.failed).map_or(Ok(()), Err)
    }

    async fn send_all(&self, messages: Vec<Outgoing>) -> Result<(), BrokerError> {
        let mut batches: Vec<Vec<Outgoing>> = Vec::new();
        let mut bytes = 0;
        for m in messages {
            let len = m.body.len();
            match batches.last_mut() {
                Some(b) if b.len() < SQS_BATCH && bytes + len <= SQS_BATCH_BYTES => {
                    bytes += len;
                    b.push(m);
                }
                _ => {
                    bytes = len;
                    batches.push(vec![m]);
                }
            }
        }
        let parallel = if self.fifo { 1 } else { PARALLEL_BATCHES };
        futures::stream::iter(batches.into_iter().map(|b| self.send_batch(b)))
            .buffered(parallel)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// As [`publish_raw`](Self::publish_raw), each message with `headers` as string
    /// message attributes (those SQS can carry: a valid attribute name, a non-empty
    /// value, at most 10).
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        let attrs = attributes(headers)?;
        let messages = bodies
            .iter()
            .enumerate()
            .map(|(i, b)| {
                Ok(Outgoing {
                    body: body_text(b)?,
                    attributes: attrs.clone(),
                    group: self.fifo.then(|| "idem".to_owned()),
                    // Equal bodies stay separate messages.
                    dedup: self.fifo.then(|| {
                        format!(
                            "{}-{i}",
                            idem_core::sha256_hex(b).get(..40).unwrap_or_default()
                        )
                    }),
                })
            })
            .collect::<Result<Vec<_>, BrokerError>>()?;
        self.send_all(messages).await
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let messages = events
            .iter()
            .map(|e| {
                Ok(Outgoing {
                    body: body_text(&e.payload)?,
                    attributes: attributes(&e.headers())?,
                    group: self.fifo.then(|| e.subject.clone()),
                    dedup: self.fifo.then(|| e.event_id.to_string()),
                })
            })
            .collect::<Result<Vec<_>, BrokerError>>()?;
        self.send_all(messages).await.map_err(Into::into)
    }
}

crate::raw::raw_publishing! {
    /// Sends each body as it is (SQS bodies are text: each must be UTF-8). On a FIFO
    /// queue all go to one message group, in order, deduplicated by content.
    ///
    /// # Errors
    /// A body that is not UTF-8 (nothing is sent); a refused or failed send, after which
    /// some bodies may have been sent.
    method of SqsPublisher;
    /// Sends each body to queue `name` as it is (see [`SqsPublisher::publish_raw`]).
    ///
    /// # Errors
    /// As [`SqsPublisher::connect`] and [`SqsPublisher::publish_raw`].
    fn publish_raw(endpoint: Option<&str>, name: &str);
}

/// What queue `name` has not settled: messages visible, in flight (received, not
/// deleted) and delayed, as SQS approximates them; 0 for a queue that does not exist
/// (it is not created: a dead-letter queue must be created as one, by a consumer or a
/// publisher).
///
/// # Errors
/// The endpoint cannot be reached.
pub async fn pending_count(endpoint: Option<&str>, name: &str) -> Result<u64, BrokerError> {
    let client = client(endpoint).await;
    let Some(url) = queue_url(&client, name).await? else {
        return Ok(0);
    };
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .map_err(|e| sdk_err(&client, "GetQueueAttributes", e))?;
    Ok(out
        .attributes
        .unwrap_or_default()
        .values()
        .filter_map(|v| v.parse::<u64>().ok())
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(code: &str, sender_fault: bool) -> BatchResultErrorEntry {
        BatchResultErrorEntry::builder()
            .id("0")
            .code(code)
            .sender_fault(sender_fault)
            .message("refused")
            .build()
            .expect("entry")
    }

    #[test]
    fn an_entry_refused_through_the_senders_fault_is_not_retryable() {
        assert!(refused(&[]).is_none());
        let service = refused(&[entry("InternalError", false)]).expect("an error");
        assert!(service.is_retryable(), "{service}");
        let sender = refused(&[
            entry("InternalError", false),
            entry("InvalidMessageContents", true),
        ])
        .expect("an error");
        assert!(!sender.is_retryable(), "{sender}");
        let chain = std::error::Error::source(&sender).map(ToString::to_string);
        assert!(
            chain.is_some_and(|c| c.contains("InvalidMessageContents")),
            "{sender:?}"
        );
    }
}
