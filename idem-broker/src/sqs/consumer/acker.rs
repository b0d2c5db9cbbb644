//! [`SqsAcker`]: settling one message.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use tokio::sync::oneshot;

use super::tasks::delete_batch;
use super::{secs_i32, sqs_text, Shared, SQS_BATCH};
use crate::names::carried_to_dead_letter;
use crate::sqs::{attributes, body_text, sdk_err};
use crate::DEAD_LETTER_REASON_HEADER;

/// A received message as it was yielded, to yield it again after a deferral.
pub(super) struct Original {
    pub(super) payload: Vec<u8>,
    pub(super) headers: Headers,
    pub(super) attempt: Option<u32>,
}

impl Original {
    pub(super) fn delivery(&self, acker: SqsAcker) -> Delivery<SqsAcker> {
        Delivery {
            payload: self.payload.clone(),
            headers: self.headers.clone(),
            attempt: self.attempt,
            acker,
        }
    }
}

/// Settles one received SQS message through its receipt handle. While it lives
/// unsettled, the consumer's keeper extends the message's visibility; dropping it
/// unsettled stops that, and SQS delivers the message again after the timeout.
pub struct SqsAcker {
    pub(super) receipt: String,
    pub(super) message_id: String,
    pub(super) lease: u64,
    pub(super) shared: Arc<Shared>,
    /// The delivery as received; `None` once handed on to the acker of its deferred
    /// delivery, which then owns the lease.
    pub(super) original: Option<Arc<Original>>,
}

impl std::fmt::Debug for SqsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsAcker")
            .field("message_id", &self.message_id)
            .finish_non_exhaustive()
    }
}

impl Drop for SqsAcker {
    fn drop(&mut self) {
        // Deferred, the delivery keeps its lease under its new acker.
        if self.original.is_some() {
            self.shared.release(self.lease);
        }
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
            .map_err(|e| AckError::from(sdk_err(&self.shared.client, "DeleteMessage", e)))?;
        Ok(())
    }

    /// Defers the delivery without a new receive: it stays leased (its visibility kept
    /// extended) and comes back out of the consumer's stream after `delay`, with the same
    /// attempt. SQS counts no receive, so the redrive policy's `maxReceiveCount` never
    /// moves a message the gate only waited on to the dead-letter queue. For a delivery
    /// that could not run yet (its key held by another transaction, a store outage), not
    /// for one that failed.
    ///
    /// When the consumer's stream is gone, the delivery cannot be held: its visibility
    /// is set to `delay` as [`nack`](Acker::nack) does (a new receive then counts).
    ///
    /// # Errors
    /// Only in that case, as [`nack`](Acker::nack).
    pub async fn defer(mut self, delay: Duration) -> Result<(), AckError> {
        if self.shared.back.is_closed() {
            return self.nack(Some(delay)).await;
        }
        let Some(original) = self.original.take() else {
            return Ok(());
        };
        let acker = SqsAcker {
            receipt: std::mem::take(&mut self.receipt),
            message_id: std::mem::take(&mut self.message_id),
            lease: self.lease,
            shared: Arc::clone(&self.shared),
            original: Some(Arc::clone(&original)),
        };
        self.shared.held.fetch_add(1, Ordering::AcqRel);
        crate::hold::hand_back_after(
            self.shared.back.clone(),
            original.delivery(acker),
            delay,
            |d: Delivery<SqsAcker>| {
                // The stream is gone: dropping the acker ends the lease.
                d.acker.shared.held.fetch_sub(1, Ordering::AcqRel);
            },
        );
        Ok(())
    }
}

pub(super) fn batch_error(message: &str, retryable: bool) -> AckError {
    AckError::new(message.to_owned(), retryable, None)
}

#[async_trait]
impl Acker for SqsAcker {
    /// Goes into a `DeleteMessageBatch` with the acks that arrive meanwhile. The
    /// visibility is kept extended until the delete has answered.
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

    /// Stops the extensions, then sets the visibility to `delay` (0: at once): the next
    /// receive of the message counts towards the redrive policy's `maxReceiveCount`.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.shared.release(self.lease);
        // An extension round in flight may hold this receipt: let it land first.
        drop(self.shared.extending.lock().await);
        self.shared
            .client
            .change_message_visibility()
            .queue_url(&self.shared.queue_url)
            .receipt_handle(&self.receipt)
            .visibility_timeout(secs_i32(delay.unwrap_or(Duration::ZERO)))
            .send()
            .await
            .map_err(|e| {
                AckError::from(sdk_err(&self.shared.client, "ChangeMessageVisibility", e))
            })?;
        Ok(())
    }

    /// Held here, leased, and handed back after the delay with the same attempt: a
    /// deferral costs no receive (see [`SqsAcker::defer`]).
    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        SqsAcker::defer(self, delay).await
    }

    /// True: `ApproximateReceiveCount` rises on a nack or a lost delivery (a crash), not
    /// on a deferral, which is held here.
    fn attempt_counts_runs(&self) -> bool {
        true
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut kept: Headers = carried_to_dead_letter(headers, |_| false)
            .take(9)
            .cloned()
            .collect();
        kept.push((
            DEAD_LETTER_REASON_HEADER.to_owned(),
            sqs_text(&reason.to_string()),
        ));
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
            Err(e) => Err(sdk_err(&self.shared.client, "SendMessage dead-letter", e).into()),
        }
    }

    /// One `DeleteMessageBatch` per 10 messages.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let Some(shared) = crate::batch::one_connection(&items, |a| &a.shared) else {
            return Self::ack_each(items).await;
        };
        let receipts: Vec<String> = items.iter().map(|(a, _)| a.receipt.clone()).collect();
        let mut out: Vec<Result<(), AckError>> = Vec::with_capacity(items.len());
        let chunks = receipts
            .chunks(SQS_BATCH)
            .map(|chunk| delete_batch(&shared.client, &shared.queue_url, chunk));
        for r in futures::future::join_all(chunks).await {
            out.extend(r);
        }
        // The ackers (and their leases) live until every delete has answered.
        drop(items);
        out
    }
}
