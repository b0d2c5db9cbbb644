//! The consumer's background tasks: the visibility keeper and the delete loop, and their
//! batch calls.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use futures::StreamExt as _;
use idem_core::AckError;
use tokio::sync::{mpsc, Semaphore};

use super::acker::batch_error;
use super::{
    secs_i32, DeleteRequest, Shared, MAX_PARALLEL_DELETES, MAX_PARALLEL_EXTENDS, SQS_BATCH,
};
use crate::sqs::{sdk_err, BROKER};

/// Extends the visibility of every unsettled delivery once a third of its timeout has
/// passed, until the consumer and all its ackers are gone.
pub(super) async fn keeper(shared: Weak<Shared>, visibility: Duration) {
    let tick = (visibility / 6).clamp(Duration::from_millis(100), Duration::from_secs(10));
    // Extend when less than two thirds of the timeout is left.
    let margin = visibility * 2 / 3;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let _round = shared.extending.lock().await;
        let now = Instant::now();
        let due: Vec<(u64, String)> = shared
            .leases()
            .iter()
            .filter(|(_, l)| l.visible_at.saturating_duration_since(now) < margin)
            .map(|(id, l)| (*id, l.receipt.clone()))
            .collect();
        if due.is_empty() {
            continue;
        }
        let chunks: Vec<Vec<(u64, String)>> = due.chunks(SQS_BATCH).map(<[_]>::to_vec).collect();
        futures::stream::iter(chunks)
            .map(|chunk| extend_batch(&shared, chunk))
            .buffer_unordered(MAX_PARALLEL_EXTENDS)
            .collect::<Vec<()>>()
            .await;
    }
}

/// One `ChangeMessageVisibilityBatch` for up to 10 leases.
async fn extend_batch(shared: &Shared, chunk: Vec<(u64, String)>) {
    let sent = Instant::now();
    let timeout = secs_i32(shared.visibility).max(1);
    let entries: Vec<ChangeMessageVisibilityBatchRequestEntry> = chunk
        .iter()
        .enumerate()
        .filter_map(|(i, (_, receipt))| {
            ChangeMessageVisibilityBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(receipt)
                .visibility_timeout(timeout)
                .build()
                .ok()
        })
        .collect();
    let r = shared
        .client
        .change_message_visibility_batch()
        .queue_url(&shared.queue_url)
        .set_entries(Some(entries))
        .send()
        .await;
    match r {
        Ok(out) => {
            let mut leases = shared.leases();
            for ok in &out.successful {
                let Some((id, _)) = ok.id.parse::<usize>().ok().and_then(|i| chunk.get(i)) else {
                    continue;
                };
                if let Some(l) = leases.get_mut(id) {
                    l.visible_at = sent + shared.visibility;
                }
            }
            for f in &out.failed {
                let Some((id, _)) = f.id.parse::<usize>().ok().and_then(|i| chunk.get(i)) else {
                    continue;
                };
                // Settled meanwhile, or no longer ours (its visibility ran out and it was
                // received again): extending cannot help; it is delivered again and
                // skipped as a duplicate if it had committed.
                if f.sender_fault && leases.contains_key(id) {
                    tracing::warn!(target: "idem::broker", broker = BROKER, code = %f.code, "cannot extend a delivery's visibility; it may be delivered again");
                    leases.remove(id);
                }
            }
        }
        Err(e) => {
            tracing::warn!(target: "idem::broker", broker = BROKER, error = %sdk_err(&shared.client, "ChangeMessageVisibilityBatch", e), "extending visibility failed; retried next round");
        }
    }
}

/// Gathers single acks into `DeleteMessageBatch` calls: at most
/// [`MAX_PARALLEL_DELETES`] calls in flight; acks arriving meanwhile wait and go
/// together (up to 10 a call). Ends when every acker and the consumer are gone.
pub(super) async fn delete_loop(
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

/// One `DeleteMessageBatch` of at most 10 receipt handles: a result per handle, in
/// order. A handle counts as deleted only when SQS lists its entry as successful: an
/// entry that could not be built, one SQS lists as failed, and one it does not mention
/// are errors (the message stays in the queue and comes back; never reported acked).
pub(crate) async fn delete_batch(
    client: &Client,
    queue_url: &str,
    receipts: &[String],
) -> Vec<Result<(), AckError>> {
    let mut res: Vec<Result<(), AckError>> = receipts
        .iter()
        .map(|_| {
            Err(batch_error(
                "sqs: DeleteMessageBatch did not report this entry as deleted",
                true,
            ))
        })
        .collect();
    let mut entries = Vec::with_capacity(receipts.len());
    for (i, r) in receipts.iter().enumerate() {
        match DeleteMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .receipt_handle(r)
            .build()
        {
            Ok(e) => entries.push(e),
            Err(e) => {
                res[i] = Err(batch_error(
                    &format!("sqs: DeleteMessageBatch entry not built: {e}"),
                    false,
                ));
            }
        }
    }
    if entries.is_empty() {
        return res;
    }
    let r = client
        .delete_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries))
        .send()
        .await;
    match r {
        Ok(o) => {
            for ok in o.successful {
                if let Some(slot) = ok.id.parse::<usize>().ok().and_then(|i| res.get_mut(i)) {
                    *slot = Ok(());
                }
            }
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
            let e = sdk_err(client, "DeleteMessageBatch", e);
            receipts
                .iter()
                .map(|_| Err(batch_error(&e.to_string(), e.is_retryable())))
                .collect()
        }
    }
}
