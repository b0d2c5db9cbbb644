//! Receiving from a queue: [`SqsConsumer`] and its [`SqsAcker`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, Message};
use aws_sdk_sqs::Client;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};

use super::config::SqsConfig;
use super::{attributes, body_text, client, ensure_queue, op_err, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// The most messages one `ReceiveMessage` or `DeleteMessageBatch` handles.
const SQS_BATCH: usize = 10;
/// The most receives in flight at once.
const MAX_PARALLEL_RECEIVES: usize = 8;
/// The longest visibility timeout SQS accepts (12 hours).
const MAX_VISIBILITY_SECS: u64 = 43_200;

struct Shared {
    client: Client,
    queue_url: String,
    dead_letter_url: String,
}

fn secs_i32(d: Duration) -> i32 {
    i32::try_from(d.as_secs().min(MAX_VISIBILITY_SECS)).unwrap_or(i32::MAX)
}

/// Messages of an SQS queue, as a stream of `Result<Delivery<SqsAcker>, BrokerError>`.
///
/// A message is invisible to other consumers for the visibility timeout after it is
/// received; settle it within that time or it is delivered again (and then skipped as a
/// duplicate if it had committed). Messages received but not yet yielded when the stream
/// is dropped come back after their visibility timeout.
pub struct SqsConsumer {
    inner: BoxStream<'static, Result<Delivery<SqsAcker>, BrokerError>>,
    name: String,
}

impl std::fmt::Debug for SqsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsConsumer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

struct Reader {
    shared: Arc<Shared>,
    buf: VecDeque<Delivery<SqsAcker>>,
    parallel: usize,
    wait: i32,
    visibility: i32,
}

impl Reader {
    fn push(&mut self, messages: Vec<Message>) {
        for m in messages {
            let Some(receipt) = m.receipt_handle else {
                continue;
            };
            let mut headers: Headers = m
                .message_attributes
                .unwrap_or_default()
                .into_iter()
                .filter_map(|(k, v)| v.string_value.map(|s| (k, s)))
                .collect();
            headers.sort();
            self.buf.push_back(Delivery {
                payload: m.body.unwrap_or_default().into_bytes(),
                headers,
                acker: SqsAcker {
                    receipt,
                    message_id: m.message_id.unwrap_or_default(),
                    shared: Arc::clone(&self.shared),
                },
            });
        }
    }

    async fn next(&mut self) -> Result<Delivery<SqsAcker>, BrokerError> {
        loop {
            if let Some(d) = self.buf.pop_front() {
                return Ok(d);
            }
            let receives = (0..self.parallel).map(|_| {
                self.shared
                    .client
                    .receive_message()
                    .queue_url(&self.shared.queue_url)
                    .max_number_of_messages(SQS_BATCH as i32)
                    .wait_time_seconds(self.wait)
                    .visibility_timeout(self.visibility)
                    .message_attribute_names("All")
                    .send()
            });
            let mut first_err = None;
            for r in futures::future::join_all(receives).await {
                match r {
                    Ok(out) => self.push(out.messages.unwrap_or_default()),
                    Err(e) => {
                        first_err.get_or_insert(op_err("ReceiveMessage", e));
                    }
                }
            }
            if self.buf.is_empty() {
                if let Some(e) = first_err {
                    return Err(e);
                }
            } else if let Some(e) = first_err {
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "one receive failed");
            }
        }
    }
}

impl SqsConsumer {
    /// Connects, creates the queue and its dead-letter queue if missing, and starts
    /// receiving.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the endpoint cannot be reached; an invalid name.
    pub async fn connect(config: &SqsConfig) -> Result<Self, BrokerError> {
        let client = client(config.endpoint.as_deref()).await;
        let queue_url = ensure_queue(&client, &config.name).await?;
        let dead_letter_url = ensure_queue(&client, &dead_letter_name(&config.name)).await?;
        let shared = Arc::new(Shared {
            client,
            queue_url,
            dead_letter_url,
        });
        let state = Reader {
            shared,
            buf: VecDeque::new(),
            parallel: config
                .prefetch
                .div_ceil(SQS_BATCH)
                .clamp(1, MAX_PARALLEL_RECEIVES),
            wait: secs_i32(config.wait.min(Duration::from_secs(20))),
            visibility: secs_i32(config.visibility_timeout).max(1),
        };
        let inner = futures::stream::unfold(Some(state), |state| async move {
            let mut st = state?;
            match st.next().await {
                Ok(d) => Some((Ok(d), Some(st))),
                // An error ends the stream after it is yielded.
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(Self {
            inner: Box::pin(inner),
            name: config.name.clone(),
        })
    }
}

impl Stream for SqsConsumer {
    type Item = Result<Delivery<SqsAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// Settles one received SQS message through its receipt handle.
pub struct SqsAcker {
    receipt: String,
    message_id: String,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SqsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsAcker")
            .field("message_id", &self.message_id)
            .finish_non_exhaustive()
    }
}

impl SqsAcker {
    /// The message's id.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    async fn delete(&self) -> Result<(), AckError> {
        self.shared
            .client
            .delete_message()
            .queue_url(&self.shared.queue_url)
            .receipt_handle(&self.receipt)
            .send()
            .await
            .map_err(|e| AckError::from(op_err("DeleteMessage", e)))?;
        Ok(())
    }
}

fn batch_error(message: &str, retryable: bool) -> AckError {
    AckError::new(message.to_owned(), retryable, None)
}

#[async_trait]
impl Acker for SqsAcker {
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.delete().await
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.shared
            .client
            .change_message_visibility()
            .queue_url(&self.shared.queue_url)
            .receipt_handle(&self.receipt)
            .visibility_timeout(secs_i32(delay.unwrap_or(Duration::ZERO)))
            .send()
            .await
            .map_err(|e| AckError::from(op_err("ChangeMessageVisibility", e)))?;
        Ok(())
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut kept: Headers = headers
            .iter()
            .filter(|(k, _)| k != DEAD_LETTER_REASON_HEADER)
            .take(9)
            .cloned()
            .collect();
        kept.push((DEAD_LETTER_REASON_HEADER.to_owned(), reason.to_string()));
        let attrs = attributes(&kept)?;
        // SQS bodies are text: a body that is not UTF-8 is kept as lossy text (the
        // reason says what was wrong with it).
        let body =
            body_text(payload).unwrap_or_else(|_| String::from_utf8_lossy(payload).into_owned());
        let mut send = self
            .shared
            .client
            .send_message()
            .queue_url(&self.shared.dead_letter_url)
            .message_body(body)
            .set_message_attributes(Some(attrs));
        if self.shared.dead_letter_url.ends_with(".fifo") {
            send = send
                .message_group_id("idem-dead-letter")
                .message_deduplication_id(&self.message_id);
        }
        match send.send().await {
            Ok(_) => self.delete().await,
            // Not dead-lettered: the message stays in the source and comes back.
            Err(e) => Err(op_err("SendMessage dead-letter", e).into()),
        }
    }

    /// One `DeleteMessageBatch` per 10 messages.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let n = items.len();
        let Some((first, _)) = items.first() else {
            return Vec::new();
        };
        let shared = Arc::clone(&first.shared);
        if !items.iter().all(|(a, _)| Arc::ptr_eq(&a.shared, &shared)) {
            let mut out = Vec::with_capacity(n);
            for (a, proof) in items {
                out.push(a.ack(proof).await);
            }
            return out;
        }
        let ackers: Vec<SqsAcker> = items.into_iter().map(|(a, _)| a).collect();
        let mut out: Vec<Result<(), AckError>> = Vec::with_capacity(n);
        let chunks = ackers.chunks(SQS_BATCH).map(|chunk| {
            let entries: Vec<DeleteMessageBatchRequestEntry> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, a)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(&a.receipt)
                        .build()
                        .ok()
                })
                .collect();
            let shared = Arc::clone(&shared);
            let len = chunk.len();
            async move {
                let r = shared
                    .client
                    .delete_message_batch()
                    .queue_url(&shared.queue_url)
                    .set_entries(Some(entries))
                    .send()
                    .await;
                match r {
                    Ok(o) => {
                        let mut res: Vec<Result<(), AckError>> = (0..len).map(|_| Ok(())).collect();
                        for f in o.failed {
                            if let Some(slot) =
                                f.id.parse::<usize>().ok().and_then(|i| res.get_mut(i))
                            {
                                *slot = Err(batch_error(
                                    &format!(
                                        "sqs: DeleteMessageBatch entry failed: {} {}",
                                        f.code,
                                        f.message.unwrap_or_default()
                                    ),
                                    !f.sender_fault,
                                ));
                            }
                        }
                        res
                    }
                    Err(e) => {
                        let e = op_err("DeleteMessageBatch", e).to_string();
                        (0..len).map(|_| Err(batch_error(&e, true))).collect()
                    }
                }
            }
        });
        for r in futures::future::join_all(chunks).await {
            out.extend(r);
        }
        out
    }
}
