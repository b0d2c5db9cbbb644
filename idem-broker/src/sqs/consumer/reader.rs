//! The reader the stream pulls from: parallel receives, and deliveries handed back.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use aws_sdk_sqs::Client;
use idem_core::{Delivery, Headers};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::acker::{Original, SqsAcker};
use super::{secs_i32, Shared, SQS_BATCH};
use crate::idle::IdleLink;
use crate::sqs::{sdk_err, BROKER};
use crate::BrokerError;

/// One receive's result: when it was sent, when it returned, what it brought.
type Received = (Instant, Instant, Result<Vec<Message>, BrokerError>);

pub(super) struct Reader {
    pub(super) shared: Arc<Shared>,
    /// The client for receives: its attempt timeout is the long poll plus the request
    /// timeout.
    pub(super) receiver: Client,
    /// Deferred deliveries, handed back when their delay is up.
    pub(super) back: mpsc::UnboundedReceiver<Delivery<SqsAcker>>,
    pub(super) buf: VecDeque<Delivery<SqsAcker>>,
    /// Receives in flight (spawned, so they progress while the buffer is drained;
    /// aborted when the stream is dropped).
    pub(super) receives: JoinSet<Received>,
    /// How many receives to keep in flight now (1..=`max_receives`).
    pub(super) target: usize,
    pub(super) max_receives: usize,
    pub(super) prefetch: usize,
    pub(super) wait: i32,
    /// The idle exit this stream runs under, if any (see [`crate::until_idle`]).
    pub(super) idle: Option<Arc<IdleLink>>,
    /// When the first of the receives that came back empty in a row was sent.
    pub(super) quiet_since: Option<Instant>,
    /// The idle time is up: start no receive, end once none is outstanding.
    pub(super) stopping: bool,
    /// One message at a time, long-polled: at the start, after a rerun and after an empty
    /// receive, until a first delivery.
    pub(super) solo: bool,
}

impl Reader {
    fn push(&mut self, sent: Instant, messages: Vec<Message>) {
        let visible_at = sent + self.shared.visibility;
        let (mut first, mut rerun) = (false, false);
        for m in messages {
            let Some(receipt) = m.receipt_handle else {
                continue;
            };
            let attempt = m
                .attributes
                .as_ref()
                .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                .and_then(|c| c.parse::<u32>().ok());
            let mut headers: Headers = m
                .message_attributes
                .unwrap_or_default()
                .into_iter()
                .filter_map(|(k, v)| v.string_value.map(|s| (k, s)))
                .collect();
            headers.sort();
            let lease = self.shared.lease(&receipt, visible_at);
            if attempt == Some(1) {
                first = true;
            } else {
                rerun = true;
                if attempt.is_some_and(|n| n > 1) {
                    self.shared
                        .reruns
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(lease);
                }
            }
            let original = Arc::new(Original {
                payload: m.body.unwrap_or_default().into_bytes(),
                headers,
                attempt,
            });
            self.buf.push_back(original.delivery(SqsAcker {
                receipt,
                message_id: m.message_id.unwrap_or_default(),
                lease,
                shared: Arc::clone(&self.shared),
                original: Some(Arc::clone(&original)),
            }));
        }
        self.solo = rerun || !first;
    }

    /// Starts receives up to the target, keeping at most `prefetch` messages (on hand,
    /// held deferrals, plus 10 per receive in flight) ahead; always one when nothing is
    /// on hand, unless deferrals fill the prefetch: then nothing is received until they
    /// come back (memory stays bounded however long the store makes them wait).
    fn start_receives(&mut self) {
        let held = self.shared.held.load(Ordering::Acquire);
        if self.shared.rerun_held() {
            return;
        }
        // Only a receive of one message waits for messages: one that takes a batch
        // (after a first delivery) takes what is visible now, so none stays open for the
        // messages of a dead process to come visible into, several at once.
        let (target, batch, wait) = if self.solo {
            (1, 1, self.wait)
        } else {
            (self.target, SQS_BATCH, 0)
        };
        while !self.stopping
            && self.receives.len() < target
            && held < self.prefetch
            && (self.receives.is_empty() && self.buf.is_empty()
                || self.buf.len() + held + SQS_BATCH * (self.receives.len() + 1) <= self.prefetch)
        {
            let receive = self
                .receiver
                .receive_message()
                .queue_url(&self.shared.queue_url)
                .max_number_of_messages(i32::try_from(batch).unwrap_or(10))
                .wait_time_seconds(wait)
                .visibility_timeout(secs_i32(self.shared.visibility).max(1))
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .message_attribute_names("All")
                .send();
            let receiver = self.receiver.clone();
            self.receives.spawn(async move {
                let sent = Instant::now();
                let r = receive
                    .await
                    .map(|out| out.messages.unwrap_or_default())
                    .map_err(|e| sdk_err(&receiver, "ReceiveMessage", e));
                (sent, Instant::now(), r)
            });
        }
    }

    /// A deferred delivery back from its hold.
    fn handed_back(
        &self,
        d: Option<Delivery<SqsAcker>>,
    ) -> Result<Delivery<SqsAcker>, BrokerError> {
        self.shared.held.fetch_sub(1, Ordering::AcqRel);
        // The channel's sender lives in `shared`, which this reader holds.
        d.ok_or_else(|| {
            BrokerError::op(
                BROKER,
                "defer",
                "the channel of deferred deliveries closed".to_owned(),
            )
        })
    }

    /// Notes an empty receive sent at `sent` that returned at `returned`; decides
    /// whether the idle time is up.
    fn quiet(&mut self, sent: Instant, returned: Instant) {
        let since = *self.quiet_since.get_or_insert(sent);
        if let Some(link) = &self.idle {
            if returned.saturating_duration_since(since) >= link.limit() {
                self.stopping = true;
            }
        }
    }
}

impl crate::pull::Pull for Reader {
    type Acker = SqsAcker;

    async fn next(&mut self) -> Result<Delivery<SqsAcker>, BrokerError> {
        if self.idle.is_none() {
            self.idle = crate::idle::adopt();
        }
        loop {
            self.start_receives();
            if let Some(d) = self.buf.pop_front() {
                return Ok(d);
            }
            let joined = if self.receives.is_empty() {
                if !self.stopping && self.shared.rerun_held() {
                    // A rerun is held: nothing is received until it settles.
                    tokio::select! {
                        () = self.shared.rerun_settled.notified() => continue,
                        d = self.back.recv() => return self.handed_back(d),
                    }
                }
                // Stopping, or deferrals fill the prefetch: nothing on hand, no receive
                // outstanding. A deferred delivery still held comes back (before the
                // stream ends).
                if self.shared.held.load(Ordering::Acquire) == 0 {
                    if let Some(link) = &self.idle {
                        link.stop();
                    }
                    return std::future::pending().await;
                }
                let d = self.back.recv().await;
                return self.handed_back(d);
            } else {
                tokio::select! {
                    joined = self.receives.join_next() => joined,
                    d = self.back.recv() => return self.handed_back(d),
                }
            };
            let Some(joined) = joined else {
                continue;
            };
            match joined {
                Ok((sent, returned, Ok(messages))) => {
                    if messages.is_empty() {
                        // The next receive is one that waits.
                        self.target = 1;
                        self.solo = true;
                        self.quiet(sent, returned);
                    } else {
                        if messages.len() >= SQS_BATCH {
                            self.target = (self.target + 1).min(self.max_receives);
                        }
                        self.quiet_since = None;
                        self.stopping = false;
                        self.push(sent, messages);
                    }
                }
                Ok((_, _, Err(e))) if self.receives.is_empty() && !self.stopping => return Err(e),
                Ok((_, _, Err(e))) => {
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
