//! Amazon SQS through aws-sdk-sqs (feature `sqs`).
//!
//! - **Names**: a logical `NAME` is an SQS queue, created if missing. SQS allows only
//!   letters, digits, `-` and `_` (and a `.fifo` suffix), so [`queue_name`] maps every
//!   other `.` to `-`: the dead-letter place `NAME.dead-letter` is the queue
//!   `NAME-dead-letter`, and for a FIFO queue `NAME.fifo` it is `NAME-dead-letter.fifo`.
//! - **Consuming** ([`SqsConsumer`]): long-poll `ReceiveMessage` (up to 10 a call, several
//!   calls in flight in the background to keep up to `prefetch` messages ahead; each
//!   call's messages are yielded as soon as it returns), with the configured visibility
//!   timeout. [`SqsAcker`]: `ack` → `DeleteMessageBatch` with the other acks waiting at
//!   that moment (at most 4 calls in flight, up to 10 handles each; one call per 10 in
//!   [`ack_all`](idem_core::Acker::ack_all)); `nack(delay)` → `ChangeMessageVisibility`
//!   to 0 (or to the delay: a deferred delivery); `dead_letter` → `SendMessage` to the
//!   dead-letter queue with the reason in the
//!   [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) message attribute,
//!   then `DeleteMessage`. An unsettled message comes back after its visibility timeout.
//! - **Publishing** ([`SqsPublisher`]): `SendMessageBatch`, the event id in the
//!   [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) message attribute and, on a
//!   FIFO queue, as the deduplication id (the subject is the message group).
//! - **Counting** ([`pending_count`]): visible + in flight + delayed messages.
//!
//! The endpoint, region and credentials come from the usual AWS variables
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, …); an `sqs://HOST:PORT` URL
//! names a local endpoint (`http://HOST:PORT`, such as moto). With an explicit endpoint
//! and no key in the environment, dummy static credentials are used; the region defaults
//! to `us-east-1`.
//!
//! Message bodies are text on SQS: a body that is not UTF-8 cannot be published.

mod config;
mod consumer;
mod publisher;

pub use config::SqsConfig;
pub use consumer::{SqsAcker, SqsConsumer};
pub use publisher::{pending_count, publish_raw, SqsPublisher};

use std::collections::HashMap;

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;

use crate::BrokerError;

pub(crate) const BROKER: &str = "sqs";

/// The SQS queue name of logical name `name`: every `.` but that of a `.fifo` suffix
/// becomes `-`; a `.fifo` inside the name (as in `q.fifo.dead-letter`) moves to the end.
///
/// ```
/// use idem_broker::sqs::queue_name;
/// assert_eq!(queue_name("grants"), "grants");
/// assert_eq!(queue_name("grants.dead-letter"), "grants-dead-letter");
/// assert_eq!(queue_name("grants.fifo"), "grants.fifo");
/// assert_eq!(queue_name("grants.fifo.dead-letter"), "grants-dead-letter.fifo");
/// ```
pub fn queue_name(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    let fifo = parts.len() > 1 && parts[1..].contains(&"fifo");
    let base: Vec<&str> = parts
        .iter()
        .enumerate()
        .filter(|(i, p)| !(fifo && *i > 0 && **p == "fifo"))
        .map(|(_, p)| *p)
        .collect();
    let mut q = base.join("-");
    if fifo {
        q.push_str(".fifo");
    }
    q
}

/// Whether the queue of `name` is a FIFO queue.
pub(crate) fn is_fifo(name: &str) -> bool {
    queue_name(name).ends_with(".fifo")
}

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    let q = queue_name(name);
    let base = q.strip_suffix(".fifo").unwrap_or(&q);
    let reason = if base.is_empty() {
        Some("empty")
    } else if q.len() > 80 {
        Some("an SQS queue name has at most 80 characters")
    } else if !base
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        Some("an SQS queue name has only letters, digits, '-', '_' (and '.' mapped to '-')")
    } else {
        None
    };
    match reason {
        Some(r) => Err(BrokerError::InvalidName {
            name: name.to_owned(),
            reason: r.into(),
        }),
        None => Ok(()),
    }
}

/// An operation error with the SDK's full context (its `Display` alone says little).
pub(crate) fn op_err<E>(action: &'static str, e: E) -> BrokerError
where
    E: std::error::Error + Send + Sync + 'static,
{
    BrokerError::op(BROKER, action, DisplayErrorContext(e).to_string())
}

/// A client for `endpoint` (or the environment's), see the module docs.
pub(crate) async fn client(endpoint: Option<&str>) -> Client {
    let env_endpoint = std::env::var("AWS_ENDPOINT_URL_SQS")
        .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
        .ok();
    let mut loader = aws_config::defaults(BehaviorVersion::latest());
    let region = std::env::var("AWS_REGION")
        .or_else(|_| std::env::var("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|_| "us-east-1".to_owned());
    loader = loader.region(Region::new(region));
    if let Some(e) = endpoint {
        loader = loader.endpoint_url(e);
    }
    let local = endpoint.is_some() || env_endpoint.is_some();
    if local && std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
        loader = loader.credentials_provider(Credentials::new(
            "idem-local",
            "idem-local",
            None,
            None,
            "idem-static",
        ));
    }
    let shared = loader.load().await;
    Client::new(&shared)
}

/// The URL of the queue of `name`, created (standard or FIFO) if missing.
pub(crate) async fn ensure_queue(client: &Client, name: &str) -> Result<String, BrokerError> {
    check_name(name)?;
    let q = queue_name(name);
    if let Ok(out) = client.get_queue_url().queue_name(&q).send().await {
        if let Some(url) = out.queue_url {
            return Ok(url);
        }
    }
    let mut create = client.create_queue().queue_name(&q);
    if q.ends_with(".fifo") {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    match create.send().await {
        Ok(out) => out.queue_url.ok_or_else(|| {
            BrokerError::op(
                BROKER,
                "CreateQueue",
                "no queue URL in the reply".to_owned(),
            )
        }),
        Err(e) => {
            // Created by someone else in between: look it up again.
            match client.get_queue_url().queue_name(&q).send().await {
                Ok(out) if out.queue_url.is_some() => Ok(out.queue_url.unwrap_or_default()),
                _ => Err(match e {
                    aws_sdk_sqs::error::SdkError::DispatchFailure(_)
                    | aws_sdk_sqs::error::SdkError::TimeoutError(_) => {
                        BrokerError::connect(BROKER, DisplayErrorContext(e).to_string())
                    }
                    e => op_err("CreateQueue", e),
                }),
            }
        }
    }
}

/// A string message attribute.
pub(crate) fn attribute(value: &str) -> Result<MessageAttributeValue, BrokerError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| BrokerError::op(BROKER, "message attribute", e))
}

/// Whether `name` can be an SQS message attribute name.
pub(crate) fn attribute_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !name.to_ascii_lowercase().starts_with("aws.")
        && !name.to_ascii_lowercase().starts_with("amazon.")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Message attributes from headers, keeping those SQS can carry (at most 10).
pub(crate) fn attributes(
    headers: &[(String, String)],
) -> Result<HashMap<String, MessageAttributeValue>, BrokerError> {
    let mut out = HashMap::new();
    for (k, v) in headers {
        if out.len() == 10 {
            break;
        }
        if attribute_name_ok(k) && !v.is_empty() {
            out.insert(k.clone(), attribute(v)?);
        }
    }
    Ok(out)
}

/// A body as SQS text.
pub(crate) fn body_text(body: &[u8]) -> Result<String, BrokerError> {
    String::from_utf8(body.to_vec()).map_err(|_| BrokerError::Operation {
        broker: BROKER,
        action: "SendMessage",
        retryable: false,
        source: "an SQS message body must be UTF-8 text".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_valid_queue_names() {
        assert_eq!(queue_name("a.b.c"), "a-b-c");
        assert!(check_name("grants.dead-letter").is_ok());
        assert!(check_name("grants.fifo.dead-letter").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("has space").is_err());
        assert!(check_name(&"x".repeat(81)).is_err());
        assert!(is_fifo("q.fifo"));
        assert!(!is_fifo("q"));
    }

    #[test]
    fn attribute_names() {
        assert!(attribute_name_ok("idem-event-id"));
        assert!(!attribute_name_ok("AWS.x"));
        assert!(!attribute_name_ok("a b"));
        let h = vec![
            ("idem-event-id".to_owned(), "x".to_owned()),
            ("bad name".to_owned(), "y".to_owned()),
        ];
        assert_eq!(attributes(&h).map(|m| m.len()).ok(), Some(1));
    }
}
