//! Consuming a stream through a durable pull consumer: [`NatsConsumer`] and its
//! [`NatsAcker`].
//!
//! Every settlement is confirmed: the ack (`+ACK`, `-NAK`, `+TERM`) is sent as a request
//! and the server's reply awaited, so `Ok` means the server has it. While a delivery is
//! taken and not settled, a keep-alive task sends `+WPI` (work in progress) for it every
//! third of the ack wait, so a slow handler is not redelivered mid-work.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::{self, consumer::pull::MessagesErrorKind};
use async_nats::Subject;
use async_trait::async_trait;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};

use super::config::NatsConfig;
use super::publisher::publish_confirmed;
use super::{check_name, connect, ensure_stream, stream_name, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// How long a settlement waits for the server's confirmation.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

struct Shared {
    client: async_nats::Client,
    js: jetstream::Context,
    dead_letter_subject: String,
    /// Deliveries taken and not settled: their ack subjects, kept alive with `+WPI`.
    live: Mutex<HashMap<u64, Subject>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn register(&self, reply: Subject) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.live).insert(id, reply);
        id
    }

    fn forget(&self, id: u64) {
        lock(&self.live).remove(&id);
    }

    /// Sends `kind` to the delivery's ack subject and waits for the server's reply.
    async fn confirmed(
        &self,
        reply: &Subject,
        kind: AckKind,
        action: &'static str,
    ) -> Result<(), AckError> {
        let request = async_nats::Request::new()
            .payload(kind.into())
            .timeout(Some(CONFIRM_TIMEOUT));
        self.client
            .send_request(reply.clone(), request)
            .await
            .map(|_| ())
            .map_err(|e| op_err(action, e))
    }
}

/// Sends `+WPI` for every live delivery every `every`, until the consumer and all its
/// ackers are gone.
fn spawn_keep_alive(shared: Weak<Shared>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let replies: Vec<Subject> = lock(&shared.live).values().cloned().collect();
            for reply in replies {
                if let Err(e) = shared.client.publish(reply, AckKind::Progress.into()).await {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "keep-alive (+WPI) not sent");
                    break;
                }
            }
        }
    });
}

/// Deliveries of a JetStream durable pull consumer, as a stream of
/// `Result<Delivery<NatsAcker>, BrokerError>`. The stream ends after its first error
/// (a missed heartbeat included: a server that stays down is reported, not waited for
/// silently), so a supervisor reconnects it.
pub struct NatsConsumer {
    inner: pull::Stream,
    shared: Arc<Shared>,
    name: String,
    done: bool,
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
        max_deliver: config.max_deliver,
        max_ack_pending: prefetch.saturating_mul(2).max(1_000),
        ..Default::default()
    }
}

/// What of an existing durable's configuration must match this one: the ack policy, the
/// ack wait (the keep-alive is paced by it) and `max_deliver`. Others (`max_ack_pending`)
/// are left as the durable has them.
fn mismatch(
    durable: &str,
    have: &jetstream::consumer::Config,
    want: &pull::Config,
) -> Option<String> {
    let what = if have.ack_policy != want.ack_policy {
        format!(
            "ack_policy is {:?}, idem needs {:?}",
            have.ack_policy, want.ack_policy
        )
    } else if have.ack_wait != want.ack_wait {
        format!(
            "ack_wait is {:?}, this consumer asks {:?} (URL option ack_wait)",
            have.ack_wait, want.ack_wait
        )
    } else if have.max_deliver != want.max_deliver {
        format!(
            "max_deliver is {}, this consumer asks {} (URL option max_deliver)",
            have.max_deliver, want.max_deliver
        )
    } else {
        return None;
    };
    Some(format!(
        "the durable consumer {durable:?} exists with other settings: {what}; use its \
         settings, another durable name, or delete it (idem does not rewrite a shared durable)"
    ))
}

/// Gets the durable consumer, creating it if missing; an existing one whose settings
/// differ in a way that matters is a [`BrokerError::Config`].
pub(super) async fn ensure_consumer(
    stream: &jetstream::stream::Stream,
    config: &NatsConfig,
) -> Result<jetstream::consumer::PullConsumer, BrokerError> {
    let want = consumer_config(config);
    match stream.consumer_info(&config.durable).await {
        Ok(info) => {
            if let Some(detail) = mismatch(&config.durable, &info.config, &want) {
                return Err(BrokerError::Config {
                    broker: BROKER,
                    detail,
                });
            }
            stream
                .get_consumer(&config.durable)
                .await
                .map_err(|e| BrokerError::op(BROKER, "consumer get", e))
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => stream
            .create_consumer(want)
            .await
            .map_err(|e| BrokerError::op(BROKER, "consumer create", e)),
        Err(e) => Err(BrokerError::op(BROKER, "consumer info", e)),
    }
}

impl NatsConsumer {
    /// Connects, creates the stream and its dead-letter stream if missing, gets the
    /// durable consumer (created if missing; an existing one is never rewritten), and
    /// starts pulling and keeping taken deliveries alive.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the server cannot be reached (or has no JetStream);
    /// an invalid name; [`BrokerError::Config`] when the durable exists with other
    /// settings.
    pub async fn connect(config: &NatsConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let js = connect(&config.url).await?;
        let stream = ensure_stream(&js, &config.name, config.duplicate_window).await?;
        let dead_letter_subject = dead_letter_name(&config.name);
        ensure_stream(&js, &dead_letter_subject, config.duplicate_window).await?;
        let consumer = ensure_consumer(&stream, config).await?;
        let inner = consumer
            .stream()
            .max_messages_per_batch(config.prefetch.max(1))
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| BrokerError::op(BROKER, "pull", e))?;
        let shared = Arc::new(Shared {
            client: js.client(),
            js,
            dead_letter_subject,
            live: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        });
        spawn_keep_alive(Arc::downgrade(&shared), config.keep_alive_every());
        Ok(Self {
            inner,
            shared,
            name: config.name.clone(),
            done: false,
        })
    }

    /// Closes the connection (after flushing what is buffered): settling one of this
    /// consumer's deliveries from now on is an error, and the server redelivers them
    /// after the ack wait.
    ///
    /// # Errors
    /// The connection could not be drained.
    pub async fn close(&self) -> Result<(), BrokerError> {
        let client = &self.shared.client;
        client
            .drain()
            .await
            .map_err(|e| BrokerError::op(BROKER, "drain", e))?;
        // The drain completes in the background: wait until the connection is gone (a
        // flush then fails), so nothing settles through it after `close` returns.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while client.flush().await.is_ok() {
            if tokio::time::Instant::now() >= deadline {
                return Err(BrokerError::op(
                    BROKER,
                    "drain",
                    std::io::Error::other("the connection is still open 5 s after a drain"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// How many deliveries are taken and not settled (kept alive) right now.
    pub fn live(&self) -> usize {
        lock(&self.shared.live).len()
    }
}

impl Stream for NatsConsumer {
    type Item = Result<Delivery<NatsAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                let action = if e.kind() == MessagesErrorKind::MissingHeartbeat {
                    tracing::warn!(target: "idem::broker", broker = BROKER, stream = %stream_name(&self.name), "missed JetStream heartbeats: the server is unreachable; ending the stream");
                    "pull (missed heartbeats)"
                } else {
                    "pull"
                };
                Poll::Ready(Some(Err(BrokerError::op(BROKER, action, e))))
            }
            Poll::Ready(Some(Ok(m))) => {
                let attempt = m
                    .info()
                    .ok()
                    .and_then(|i| u32::try_from(i.delivered).ok())
                    .filter(|n| *n > 0);
                // `split` takes the reply subject into the client's acker: read it first.
                let reply = m.message.reply.clone();
                let (msg, _acker) = m.split();
                let Some(reply) = reply else {
                    self.done = true;
                    return Poll::Ready(Some(Err(BrokerError::op(
                        BROKER,
                        "pull",
                        std::io::Error::other("a delivery without an ack subject"),
                    ))));
                };
                let mut headers = Headers::new();
                if let Some(h) = &msg.headers {
                    for (k, vs) in h.iter() {
                        for v in vs {
                            headers.push((k.to_string(), v.as_str().to_owned()));
                        }
                    }
                }
                let id = self.shared.register(reply.clone());
                Poll::Ready(Some(Ok(Delivery {
                    payload: msg.payload.to_vec(),
                    headers,
                    attempt,
                    acker: NatsAcker {
                        id,
                        reply,
                        shared: Arc::clone(&self.shared),
                    },
                })))
            }
        }
    }
}

/// Settles one JetStream delivery, with the server's confirmation. While it lives
/// unsettled, the delivery is kept alive (`+WPI`); dropped unsettled, the keep-alive
/// stops and the server redelivers it after the ack wait.
pub struct NatsAcker {
    id: u64,
    reply: Subject,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NatsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAcker")
            .field("reply", &self.reply.as_str())
            .finish_non_exhaustive()
    }
}

impl Drop for NatsAcker {
    fn drop(&mut self) {
        self.shared.forget(self.id);
    }
}

fn op_err(action: &'static str, e: impl Into<idem_core::BoxError>) -> AckError {
    BrokerError::op(BROKER, action, e).into()
}

impl NatsAcker {
    /// Stops the keep-alive, then sends `kind` and waits for the server's reply.
    async fn settle(&self, kind: AckKind, action: &'static str) -> Result<(), AckError> {
        self.shared.forget(self.id);
        self.shared.confirmed(&self.reply, kind, action).await
    }
}

/// The headers of a dead letter — the delivery's own (`copied`) and the reason — cut so
/// that the message fits the server's `max_payload` (a message whose reason pushed it
/// over could never be dead-lettered: it came back every few seconds until `max_deliver`).
/// In order, while it does not fit: the copied headers are dropped, the reason is
/// shortened (at a character boundary), and at last no header is sent. The payload itself
/// fits (the server delivered it), and a message without headers goes as a plain `PUB`.
fn fit_dead_letter(
    copied: Vec<(String, String)>,
    reason: String,
    payload_len: usize,
    max_payload: usize,
) -> Vec<(String, String)> {
    // `HeaderMap::wire_len`: "NATS/1.0\r\n" + each "<name>: <value>\r\n" + "\r\n".
    let line = |k: &str, v: &str| k.len() + 2 + v.len() + 2;
    let block = |h: &[(String, String)]| 12 + h.iter().map(|(k, v)| line(k, v)).sum::<usize>();
    let mut out = copied;
    out.push((DEAD_LETTER_REASON_HEADER.to_owned(), reason));
    if payload_len + block(&out) <= max_payload {
        return out;
    }
    let mut reason = out.pop().map(|(_, v)| v).unwrap_or_default();
    let fixed = payload_len + 12 + line(DEAD_LETTER_REASON_HEADER, "");
    let room = max_payload.saturating_sub(fixed);
    if room == 0 {
        return Vec::new();
    }
    if reason.len() > room {
        let mut end = room;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    if reason.is_empty() {
        return Vec::new();
    }
    vec![(DEAD_LETTER_REASON_HEADER.to_owned(), reason)]
}

#[async_trait]
impl Acker for NatsAcker {
    /// A double ack: `+ACK` as a request; when it returns `Ok`, the server has the ack.
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.settle(AckKind::Ack, "ack").await
    }

    /// `-NAK` with the delay, confirmed.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.settle(AckKind::Nak(delay.filter(|d| !d.is_zero())), "nak")
            .await
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let copied: Vec<(String, String)> = headers
            .iter()
            .filter(|(k, _)| {
                !k.eq_ignore_ascii_case("Nats-Msg-Id") && k != DEAD_LETTER_REASON_HEADER
            })
            .cloned()
            .collect();
        // A header line ends at CR or LF (async-nats panics on either): a reason on several
        // lines (a handler's multi-line error) goes on one.
        let reason_line = reason.to_string().replace(['\r', '\n'], " ");
        let out = fit_dead_letter(
            copied,
            reason_line,
            payload.len(),
            self.shared.client.max_payload(),
        );
        if !out.iter().any(|(k, _)| k == DEAD_LETTER_REASON_HEADER) {
            tracing::warn!(target: "idem::broker", %reason, "dead letter too close to the server's max_payload for its reason header: the reason is only in this log");
        }
        let published = publish_confirmed(
            &self.shared.js,
            &self.shared.dead_letter_subject,
            vec![(payload.to_vec(), out, None)],
        )
        .await;
        match published {
            Ok(()) => self.settle(AckKind::Term, "term").await,
            Err(e) => {
                // Not dead-lettered: hand it back rather than lose it, after a pause (an
                // immediate redelivery would loop as fast as the server delivers).
                let _ = self
                    .settle(AckKind::Nak(Some(Duration::from_secs(5))), "nak")
                    .await;
                Err(e.into())
            }
        }
    }

    /// Every ack confirmed, concurrently.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        futures::future::join_all(
            items
                .into_iter()
                .map(|(a, _proof)| async move { a.settle(AckKind::Ack, "ack").await }),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes a message with `headers` and a payload of `payload` bytes counts against
    /// `max_payload` (async-nats's `HeaderMap::wire_len`; no header block when empty).
    fn size(headers: &[(String, String)], payload: usize) -> usize {
        if headers.is_empty() {
            return payload;
        }
        let lines: usize = headers.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        payload + "NATS/1.0\r\n\r\n".len() + lines
    }

    fn copied() -> Vec<(String, String)> {
        vec![("traceparent".to_owned(), "x".repeat(55))]
    }

    #[test]
    fn a_dead_letter_is_cut_to_fit_max_payload_headers_first_then_the_reason() {
        let reason = "not_json: é".repeat(10);
        let full = fit_dead_letter(copied(), reason.clone(), 1_000, 1 << 20);
        assert_eq!(full.len(), 2, "room for everything: {full:?}");
        let all = size(&full, 1_000);

        // One byte short: the copied header goes, the whole reason stays.
        let max = all - 1;
        let cut = fit_dead_letter(copied(), reason.clone(), 1_000, max);
        assert_eq!(
            cut,
            [(DEAD_LETTER_REASON_HEADER.to_owned(), reason.clone())]
        );
        assert!(size(&cut, 1_000) <= max);

        // Less room still: the reason is shortened, at a character boundary, to fit.
        for max in (1_000..all).step_by(7) {
            let cut = fit_dead_letter(copied(), reason.clone(), 1_000, max);
            assert!(size(&cut, 1_000) <= max, "{max}: {cut:?}");
            if let Some((_, r)) = cut.first() {
                assert!(reason.starts_with(r.as_str()) && !r.is_empty());
                // Not one more character would have fitted.
                let next = reason[r.len()..].chars().next().map_or(0, char::len_utf8);
                assert!(size(&cut, 1_000) + next > max || r.len() == reason.len());
            }
        }

        // No room for a header at all: the payload alone.
        assert!(fit_dead_letter(copied(), reason, 1_000, 1_010).is_empty());
    }
}
