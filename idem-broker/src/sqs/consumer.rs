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
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;

use super::config::SqsConfig;
use super::{attributes, body_text, client, ensure_queue, op_err, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// The most messages one `ReceiveMessage` or `DeleteMessageBatch` handles.
const SQS_BATCH: usize = 10;
/// The most receives in flight at once.
const MAX_PARALLEL_RECEIVES: usize = 8;
/// The most `DeleteMessageBatch` calls in flight at once for single acks; more acks
/// wait and go together in the next call.
const MAX_PARALLEL_DELETES: usize = 4;
/// The longest visibility timeout SQS accepts (12 hours).
const MAX_VISIBILITY_SECS: u64 = 43_200;

/// A single ack waiting for its `DeleteMessageBatch`: the receipt handle and where the
/// result goes.
type DeleteRequest = (String, oneshot::Sender<Result<(), AckError>>);

struct Shared {
    client: Client,
    queue_url: String,
    dead_letter_url: String,
    /// Single acks, gathered into `DeleteMessageBatch` calls by [`delete_loop`].
    deletes: mpsc::UnboundedSender<DeleteRequest>,
}

fn secs_i32(d: Duration) -> i32 {
    i32::try_from(d.as_secs().min(MAX_VISIBILITY_SECS)).unwrap_or(i32::MAX)
}

/// Messages of an SQS queue, as a stream of `Result<Delivery<SqsAcker>, BrokerError>`.
///
/// Receives run in the background, up to `prefetch` messages ahead, and each one's
/// messages are yielded as soon as it returns: the first delivery waits for one
/// `ReceiveMessage`, not for a round of them. The number of receives in flight starts at
/// one, grows by one after each full receive (10 messages) up to the most `prefetch`
/// allows (at most 8), and falls back to one after an empty receive.
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
    /// Receives in flight (spawned, so they progress while the buffer is drained;
    /// aborted when the stream is dropped).
    receives: JoinSet<Result<Vec<Message>, BrokerError>>,
    /// How many receives to keep in flight now (1..=`max_receives`).
    target: usize,
    max_receives: usize,
    prefetch: usize,
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
                attempt: None,
                acker: SqsAcker {
                    receipt,
                    message_id: m.message_id.unwrap_or_default(),
                    shared: Arc::clone(&self.shared),
                },
            });
        }
    }

    /// Starts receives up to the target, keeping at most `prefetch` messages (on hand
    /// plus 10 per receive in flight) ahead; always one when nothing is on hand.
    fn start_receives(&mut self) {
        while self.receives.len() < self.target
            && (self.receives.is_empty() && self.buf.is_empty()
                || self.buf.len() + SQS_BATCH * (self.receives.len() + 1) <= self.prefetch)
        {
            let receive = self
                .shared
                .client
                .receive_message()
                .queue_url(&self.shared.queue_url)
                .max_number_of_messages(SQS_BATCH as i32)
                .wait_time_seconds(self.wait)
                .visibility_timeout(self.visibility)
                .message_attribute_names("All")
                .send();
            self.receives.spawn(async move {
                receive
                    .await
                    .map(|out| out.messages.unwrap_or_default())
                    .map_err(|e| op_err("ReceiveMessage", e))
            });
        }
    }
}

impl crate::pull::Pull for Reader {
    type Acker = SqsAcker;

    async fn next(&mut self) -> Result<Delivery<SqsAcker>, BrokerError> {
        loop {
            self.start_receives();
            if let Some(d) = self.buf.pop_front() {
                return Ok(d);
            }
            let Some(joined) = self.receives.join_next().await else {
                continue;
            };
            match joined {
                Ok(Ok(messages)) => {
                    if messages.len() >= SQS_BATCH {
                        self.target = (self.target + 1).min(self.max_receives);
                    } else if messages.is_empty() {
                        self.target = 1;
                    }
                    self.push(messages);
                }
                Ok(Err(e)) if self.receives.is_empty() => return Err(e),
                Ok(Err(e)) => {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "one receive failed");
                }
                Err(e) => {
                    return Err(BrokerError::op(
                        BROKER,
                        "ReceiveMessage",
                        format!("the receive task ended: {e}"),
                    ))
                }
            }
        }
    }
}

/// Gathers single acks into `DeleteMessageBatch` calls: at most
/// [`MAX_PARALLEL_DELETES`] calls in flight; acks arriving meanwhile wait and go
/// together (up to 10 a call). Ends when every acker and the consumer are gone.
async fn delete_loop(
    client: Client,
    queue_url: String,
    mut requests: mpsc::UnboundedReceiver<DeleteRequest>,
) {
    let permits = Arc::new(Semaphore::new(MAX_PARALLEL_DELETES));
    let mut batch: Vec<DeleteRequest> = Vec::with_capacity(SQS_BATCH);
    loop {
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        if requests.recv_many(&mut batch, SQS_BATCH).await == 0 {
            return;
        }
        let taken = std::mem::take(&mut batch);
        let client = client.clone();
        let queue_url = queue_url.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let (receipts, replies): (Vec<String>, Vec<_>) = taken.into_iter().unzip();
            let results = delete_batch(&client, &queue_url, &receipts).await;
            for (reply, r) in replies.into_iter().zip(results) {
                // The acker may have given up waiting; nothing to tell then.
                let _ = reply.send(r);
            }
        });
    }
}

/// One `DeleteMessageBatch` of at most 10 receipt handles: a result per handle.
async fn delete_batch(
    client: &Client,
    queue_url: &str,
    receipts: &[String],
) -> Vec<Result<(), AckError>> {
    let len = receipts.len();
    let entries: Vec<DeleteMessageBatchRequestEntry> = receipts
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(r)
                .build()
                .ok()
        })
        .collect();
    let r = client
        .delete_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries))
        .send()
        .await;
    match r {
        Ok(o) => {
            let mut res: Vec<Result<(), AckError>> = (0..len).map(|_| Ok(())).collect();
            for f in o.failed {
                if let Some(slot) = f.id.parse::<usize>().ok().and_then(|i| res.get_mut(i)) {
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
        let (deletes, requests) = mpsc::unbounded_channel();
        tokio::spawn(delete_loop(client.clone(), queue_url.clone(), requests));
        let shared = Arc::new(Shared {
            client,
            queue_url,
            dead_letter_url,
            deletes,
        });
        let prefetch = config.prefetch.max(1);
        let state = Reader {
            shared,
            buf: VecDeque::new(),
            receives: JoinSet::new(),
            target: 1,
            max_receives: prefetch.div_ceil(SQS_BATCH).clamp(1, MAX_PARALLEL_RECEIVES),
            prefetch,
            wait: secs_i32(config.wait.min(Duration::from_secs(20))),
            visibility: secs_i32(config.visibility_timeout).max(1),
        };
        Ok(Self {
            inner: crate::pull::deliveries(state),
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
    /// Goes into a `DeleteMessageBatch` with the acks that arrive meanwhile.
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        let (reply, result) = oneshot::channel();
        if self
            .shared
            .deletes
            .send((self.receipt.clone(), reply))
            .is_err()
        {
            return self.delete().await;
        }
        match result.await {
            Ok(r) => r,
            Err(_) => Err(batch_error(
                "sqs: the batch delete ended without a result",
                true,
            )),
        }
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
        let receipts: Vec<String> = items.into_iter().map(|(a, _)| a.receipt).collect();
        let mut out: Vec<Result<(), AckError>> = Vec::with_capacity(n);
        let chunks = receipts
            .chunks(SQS_BATCH)
            .map(|chunk| delete_batch(&shared.client, &shared.queue_url, chunk));
        for r in futures::future::join_all(chunks).await {
            out.extend(r);
        }
        out
    }
}
