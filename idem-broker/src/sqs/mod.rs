//! Amazon SQS through aws-sdk-sqs (feature `sqs`).
//!
//! - **Names**: a logical `NAME` is an SQS queue, created if missing. SQS allows only
//!   letters, digits, `-` and `_` (and a `.fifo` suffix), so [`queue_name`] maps every
//!   other `.` to `-`: the dead-letter place `NAME.dead-letter` is the queue
//!   `NAME-dead-letter`, and for a FIFO queue `NAME.fifo` it is `NAME-dead-letter.fifo`.
//! - **Creating** (by a consumer or a publisher, whichever comes first): the dead-letter
//!   queue keeps messages 14 days ([`DEAD_LETTER_RETENTION`], the most SQS allows); the
//!   source gets a redrive policy to it with `maxReceiveCount`
//!   [`SqsConfig::max_receive_count`] (default [`DEFAULT_MAX_RECEIVE_COUNT`] = 20, twice
//!   the core's default `max_attempts`: the gate dead-letters a failing message with its
//!   reason on its 10th delivery, the other 10 receives are the margin for messages held
//!   beside one that kills its consumer, and SQS moves one only when consumers kept
//!   crashing on it — such a dead letter has no reason attribute) and the retention
//!   [`SqsConfig::retention`] if set. An existing queue is read, never changed; a
//!   difference that matters is a [`Config`](crate::BrokerError::Config) error (a
//!   dead-letter queue keeping less than 14 days, another retention than the one asked
//!   for, a redrive policy to another queue or with a `maxReceiveCount` below
//!   [`SqsConfig::min_receive_count`]: 10, the core's default `max_attempts`, unless a
//!   count was asked for); a count from there up to `max_receive_count` is used with a
//!   warning.
//! - **Consuming** ([`SqsConsumer`]): long-poll `ReceiveMessage` (up to 10 a call, several
//!   calls in flight in the background to keep up to `prefetch` messages ahead; each
//!   call's messages are yielded as soon as it returns), with the configured visibility
//!   timeout, kept extended (`ChangeMessageVisibilityBatch`) for every delivery not yet
//!   settled, buffered ones included; each delivery's attempt is its
//!   `ApproximateReceiveCount`. [`SqsAcker`]: `ack` → `DeleteMessageBatch` with the
//!   other acks waiting at that moment (at most 4 calls in flight, up to 10 handles
//!   each; one call per 10 in [`ack_all`](idem_core::Acker::ack_all)); an entry SQS does
//!   not report deleted is an error, never an ack; `nack(delay)` →
//!   `ChangeMessageVisibility` to 0 or to the delay (the next receive counts towards
//!   `maxReceiveCount`); `defer(delay)` (a key held by another transaction, a store
//!   outage: not the message's fault) → no request at all: the delivery stays leased,
//!   its visibility kept extended, and comes out of the consumer's stream again after
//!   the delay with the same attempt, so no number of deferrals makes SQS move a message
//!   to the dead-letter queue (on a consumer whose stream is gone, a deferral is a
//!   nack); `dead_letter` → `SendMessage` to the dead-letter queue with the reason in the
//!   [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) message attribute,
//!   then `DeleteMessage`. An unsettled message dropped comes back after its visibility
//!   timeout.
//! - **Publishing** ([`SqsPublisher`]): `SendMessageBatch`, the event id in the
//!   [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) message attribute and, on a
//!   FIFO queue, as the deduplication id (the subject is the message group).
//! - **Counting** ([`pending_count`]): visible + in flight + delayed messages.
//! - **URL parameters** (`sqs://127.0.0.1:5000?visibility_timeout=10s`, read by
//!   [`SqsConfig::from_url`], whose table gives their defaults and ranges):
//!   `visibility_timeout` (default `30s`), `wait` (the long poll, default `1s`),
//!   `retention` (of a source queue created here, default SQS's 4 days) and
//!   `max_receive_count` (its redrive policy, default 20), those in whole seconds;
//!   `connect_timeout` (default `5s`) and `request_timeout` (default `10s`). Any other
//!   parameter is an error.
//! - **Timeouts**: connecting to the endpoint waits at most
//!   [`SqsConfig::connect_timeout`]; each attempt of a request waits at most
//!   [`SqsConfig::request_timeout`] for the answer, a `ReceiveMessage` its long poll
//!   more. The SDK makes up to three attempts; when they all time out the operation
//!   fails with [`BrokerError::Timeout`] (retryable): an
//!   endpoint that accepts connections and never answers fails a connect, ends the
//!   consumer's stream (a supervisor reconnects) and fails an ack, instead of hanging
//!   them.
//!
//! **Credentials and region** are aws-config's, as for any AWS tool: `sqs://` (and
//! `sqs://HOST` for a HOST that is not a loopback address) loads
//! `aws_config::defaults(BehaviorVersion::latest())` untouched: the standard credential
//! chain (environment, profile, SSO, `credential_process`, web identity / IRSA, ECS,
//! IMDS) and region chain (`AWS_REGION`, the profile's `region`, IMDS); `AWS_ENDPOINT_URL`
//! and `AWS_ENDPOINT_URL_SQS` are read by aws-config as well. A URL's `region=` wins over
//! the region chain; no region anywhere is a [`BrokerError::Config`]. Only a URL that
//! names a loopback host (`sqs://127.0.0.1:5000`, `sqs://localhost:4566`, `sqs://[::1]`:
//! moto, LocalStack, ElasticMQ) gets static test credentials, and a region from `region=`,
//! `AWS_REGION` or the profile, else `us-east-1` (no instance metadata is asked).
//! [`SqsConsumer::from_client`], [`SqsConsumer::from_sdk_config`] and their
//! [`SqsPublisher`] twins take an `aws_sdk_sqs::Client` or an `aws_config::SdkConfig` the
//! application made itself (its credentials, region, endpoint, HTTP client, interceptors);
//! the URL constructors load the configuration as above and call them. Either way the
//! connect and request timeouts of the [`SqsConfig`] apply to idem's requests.
//!
//! Message bodies are text on SQS: a body that is not UTF-8 cannot be published.

mod config;
mod consumer;
mod publisher;

pub use config::{
    SqsConfig, DEAD_LETTER_RETENTION, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_RECEIVE_COUNT,
    DEFAULT_MIN_RECEIVE_COUNT, DEFAULT_REQUEST_TIMEOUT,
};
pub use consumer::{SqsAcker, SqsConsumer};
pub use publisher::{pending_count, publish_raw, SqsPublisher};

use std::collections::HashMap;

use aws_config::meta::region::RegionProviderChain;
use aws_config::SdkConfig;
use aws_sdk_sqs::config::timeout::TimeoutConfig;
use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
use aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError;
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
    BrokerError::refuse_name(name, reason)
}

/// An operation error with the SDK's full context (its `Display` alone says little).
pub(crate) fn op_err<E>(action: &'static str, e: E) -> BrokerError
where
    E: std::error::Error + Send + Sync + 'static,
{
    BrokerError::op(BROKER, action, DisplayErrorContext(e).to_string())
}

/// An SDK error as a [`BrokerError`]: [`BrokerError::Timeout`] when the request went
/// unanswered for `client`'s attempt timeout (on every attempt the SDK made), otherwise
/// as [`op_err`].
pub(crate) fn sdk_err<E, R>(client: &Client, action: &'static str, e: SdkError<E, R>) -> BrokerError
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match e {
        SdkError::TimeoutError(_) => timed_out(client, action),
        e => op_err(action, e),
    }
}

/// [`BrokerError::Timeout`] for `action` on `client`, with its attempt timeout.
fn timed_out(client: &Client, action: &'static str) -> BrokerError {
    BrokerError::Timeout {
        broker: BROKER,
        action,
        after: client
            .config()
            .timeout_config()
            .and_then(TimeoutConfig::operation_attempt_timeout)
            .unwrap_or_default(),
    }
}

/// The timeouts of `config`, with `attempt` for each attempt of a request.
fn timeouts(config: &SqsConfig, attempt: std::time::Duration) -> TimeoutConfig {
    TimeoutConfig::builder()
        .connect_timeout(config.connect_timeout)
        .operation_attempt_timeout(attempt)
        .build()
}

/// `client` with the attempt timeout of a `ReceiveMessage` of `config` (its long poll
/// plus the request timeout).
pub(crate) fn receive_client(client: &Client, config: &SqsConfig) -> Client {
    Client::from_conf(
        builder_of(client)
            .timeout_config(timeouts(config, config.receive_timeout()))
            .build(),
    )
}

/// `client`'s configuration, with [`http_client`] where it names no HTTP client (one
/// built without the SDK's default client).
fn builder_of(client: &Client) -> aws_sdk_sqs::config::Builder {
    let builder = client.config().to_builder();
    if client.config().http_client().is_some() {
        builder
    } else {
        builder.http_client(http_client())
    }
}

/// `client` with the connect and request timeouts of `config`; everything else
/// (credentials, region, endpoint, HTTP client, interceptors, retries) as it is.
pub(crate) fn with_timeouts(client: &Client, config: &SqsConfig) -> Client {
    Client::from_conf(
        builder_of(client)
            .timeout_config(timeouts(config, config.request_timeout))
            .build(),
    )
}

/// The region of a loopback endpoint when neither the URL nor `AWS_REGION` nor the
/// profile names one.
pub(crate) const LOCAL_REGION: &str = "us-east-1";

/// Where the credentials of a client built from an [`SqsConfig`] come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CredentialSource {
    /// aws-config's standard chain: environment, profile, SSO, `credential_process`,
    /// web identity, ECS, IMDS.
    Chain,
    /// Static test credentials (`idem-local`), for a loopback endpoint.
    LocalTest,
}

/// Where the region of a client built from an [`SqsConfig`] comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RegionSource {
    /// The URL's `region=`.
    Url(String),
    /// aws-config's standard chain: `AWS_REGION`, the profile's `region`, IMDS.
    Chain,
    /// For a loopback endpoint: `AWS_REGION`, the profile's `region`, else
    /// [`LOCAL_REGION`] (no instance metadata).
    Local,
}

/// The credential and region sources of a client for `endpoint` (an `SqsConfig`'s, not
/// the environment's) with the URL's `region`: the one decision, from the URL alone.
///
/// - a loopback endpoint (`127.0.0.0/8`, `::1`, `localhost`): static test credentials,
///   the URL's region, else [`RegionSource::Local`];
/// - any other endpoint, or none (`AWS_ENDPOINT_URL`, or AWS): the standard credential
///   chain, the URL's region, else the standard region chain.
pub(crate) fn sources(
    endpoint: Option<&str>,
    region: Option<&str>,
) -> (CredentialSource, RegionSource) {
    let local = endpoint.is_some_and(is_loopback);
    let credentials = if local {
        CredentialSource::LocalTest
    } else {
        CredentialSource::Chain
    };
    let region = match region {
        Some(r) => RegionSource::Url(r.to_owned()),
        None if local => RegionSource::Local,
        None => RegionSource::Chain,
    };
    (credentials, region)
}

/// Whether `endpoint` (`http://HOST[:PORT]`) names a loopback host.
pub(crate) fn is_loopback(endpoint: &str) -> bool {
    match url::Url::parse(endpoint)
        .ok()
        .and_then(|u| u.host().map(|h| h.to_owned()))
    {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            d == "localhost" || d.ends_with(".localhost")
        }
        None => false,
    }
}

/// The AWS configuration of `config`, as [`load`] makes it.
///
/// # Errors
/// [`BrokerError::Config`] when no region is named anywhere.
pub(crate) async fn sdk_config_for(config: &SqsConfig) -> Result<SdkConfig, BrokerError> {
    let sdk = load(config).await;
    if sdk.region().is_none() {
        return Err(config_error(
            "no AWS region: name one with region= in the URL, AWS_REGION, or the profile's \
             region"
                .to_owned(),
        ));
    }
    Ok(sdk)
}

/// The AWS configuration of `config` (see the module docs): aws-config's defaults, with
/// the URL's endpoint and region if it names them, static test credentials only for a
/// loopback endpoint ([`sources`]), and the config's timeouts.
async fn load(config: &SqsConfig) -> SdkConfig {
    let (credentials, region) = sources(config.endpoint.as_deref(), config.region.as_deref());
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .http_client(http_client())
        .timeout_config(timeouts(config, config.request_timeout));
    if let Some(e) = &config.endpoint {
        loader = loader.endpoint_url(e);
    }
    loader = match region {
        RegionSource::Url(r) => loader.region(Region::new(r)),
        RegionSource::Chain => loader,
        RegionSource::Local => loader.region(
            RegionProviderChain::first_try(
                aws_config::environment::EnvironmentVariableRegionProvider::new(),
            )
            .or_else(aws_config::profile::ProfileFileRegionProvider::new())
            .or_else(Region::from_static(LOCAL_REGION)),
        ),
    };
    if credentials == CredentialSource::LocalTest {
        loader = loader.credentials_provider(Credentials::new(
            "idem-local",
            "idem-local",
            None,
            None,
            "idem-static",
        ));
    }
    loader.load().await
}

/// The HTTP client of idem's SQS clients: the SDK's own (HTTP/1.1 and 2, `https://` and
/// `http://`) on rustls with the `ring` provider, named in its own configuration — the one
/// crypto provider of every client idem builds, nothing installed process-wide.
///
/// idem builds its SQS crate without the SDK's default HTTP client (which compiles
/// aws-lc from C), so a client or an `SdkConfig` an application builds in a program that
/// does not ask for that client itself has none; the constructors that take one
/// ([`SqsConsumer::from_client`], [`SqsConsumer::from_sdk_config`] and the publisher's)
/// give it this one. For a client of your own, beside idem's:
///
/// ```
/// use aws_sdk_sqs::config::{BehaviorVersion, Region};
/// let config = aws_sdk_sqs::Config::builder()
///     .behavior_version(BehaviorVersion::latest())
///     .region(Region::new("us-east-1"))
///     .http_client(idem_broker::sqs::http_client())
///     .build();
/// let client = aws_sdk_sqs::Client::from_conf(config);
/// # drop(client);
/// ```
pub fn http_client() -> aws_sdk_sqs::config::SharedHttpClient {
    use aws_smithy_http_client::tls;
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

/// An SQS client of `sdk` (the constructors that take it give it [`http_client`] where
/// `sdk` names none, through [`with_timeouts`]).
///
/// # Errors
/// [`BrokerError::Config`] when `sdk` has no behavior version (the SDK would panic).
pub(crate) fn client_of(sdk: &SdkConfig) -> Result<Client, BrokerError> {
    if sdk.behavior_version().is_none() {
        return Err(config_error(
            "the SdkConfig has no behavior version: load it with \
             aws_config::defaults(BehaviorVersion::latest())"
                .to_owned(),
        ));
    }
    Ok(Client::new(sdk))
}

/// A client of `config`'s AWS configuration ([`sdk_config_for`], [`client_of`]).
pub(crate) async fn client_for(config: &SqsConfig) -> Result<Client, BrokerError> {
    client_of(&sdk_config_for(config).await?)
}

/// A client for `endpoint` (or the AWS configuration's, see the module docs), with the
/// default timeouts. Without a region anywhere, its requests fail.
pub(crate) async fn client(endpoint: Option<&str>) -> Client {
    Client::new(&load(&SqsConfig::new(endpoint.map(str::to_owned), "")).await)
}

/// Whether `e` says the queue does not exist.
fn is_missing<R>(e: &aws_sdk_sqs::error::SdkError<GetQueueUrlError, R>) -> bool {
    e.as_service_error()
        .is_some_and(GetQueueUrlError::is_queue_does_not_exist)
}

/// [`BrokerError::Connect`] when the endpoint cannot be reached, otherwise as [`sdk_err`].
fn connect_or_op<E, R>(client: &Client, action: &'static str, e: SdkError<E, R>) -> BrokerError
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match e {
        SdkError::DispatchFailure(_) => {
            BrokerError::connect(BROKER, DisplayErrorContext(e).to_string())
        }
        e => sdk_err(client, action, e),
    }
}

/// The URL of the queue of `name`, or `None` when it does not exist.
pub(crate) async fn queue_url(client: &Client, name: &str) -> Result<Option<String>, BrokerError> {
    check_name(name)?;
    match client
        .get_queue_url()
        .queue_name(queue_name(name))
        .send()
        .await
    {
        Ok(out) => Ok(out.queue_url),
        Err(e) if is_missing(&e) => Ok(None),
        Err(e) => Err(connect_or_op(client, "GetQueueUrl", e)),
    }
}

/// A queue's attributes.
async fn queue_attributes(
    client: &Client,
    url: &str,
) -> Result<HashMap<QueueAttributeName, String>, BrokerError> {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .map_err(|e| connect_or_op(client, "GetQueueAttributes", e))?;
    Ok(out.attributes.unwrap_or_default())
}

/// A queue's redrive policy, the JSON its `RedrivePolicy` attribute holds.
#[derive(Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RedrivePolicy {
    /// The dead-letter queue's ARN.
    #[serde(default)]
    dead_letter_target_arn: String,
    /// Receives before SQS moves a message there (written as a number or a string).
    #[serde(default, deserialize_with = "receive_count")]
    max_receive_count: Option<u32>,
}

/// `maxReceiveCount`, a number or a numeric string (`None` when neither).
fn receive_count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    use serde::Deserialize as _;
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    })
}

impl RedrivePolicy {
    /// The policy an attribute holds; an unreadable one reads as empty (no target).
    fn parse(attribute: &str) -> Self {
        serde_json::from_str(attribute).unwrap_or_default()
    }

    /// The attribute's JSON text.
    fn to_attribute(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

fn config_error(detail: String) -> BrokerError {
    BrokerError::Config {
        broker: BROKER,
        detail,
    }
}

/// Creates the queue `name` with `attrs`, or returns the URL of the one that exists;
/// `Ok((url, true))` when this call created it.
async fn create_or_get(
    client: &Client,
    name: &str,
    attrs: Vec<(QueueAttributeName, String)>,
) -> Result<(String, bool), BrokerError> {
    if let Some(url) = queue_url(client, name).await? {
        return Ok((url, false));
    }
    let q = queue_name(name);
    let mut create = client.create_queue().queue_name(&q);
    if q.ends_with(".fifo") {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    for (k, v) in attrs {
        create = create.attributes(k, v);
    }
    match create.send().await {
        Ok(out) => out.queue_url.map(|u| (u, true)).ok_or_else(|| {
            BrokerError::op(
                BROKER,
                "CreateQueue",
                "no queue URL in the reply".to_owned(),
            )
        }),
        Err(e) => {
            // Created by someone else in between (with other attributes, SQS refuses the
            // create): look it up again, and check it as an existing queue.
            match queue_url(client, name).await {
                Ok(Some(url)) => Ok((url, false)),
                _ => Err(connect_or_op(client, "CreateQueue", e)),
            }
        }
    }
}

/// The source queue of `config` and its dead-letter queue, created as a careful
/// operator would if missing:
///
/// - `NAME.dead-letter`: `MessageRetentionPeriod` = 14 days
///   ([`DEAD_LETTER_RETENTION`](config::DEAD_LETTER_RETENTION));
/// - `NAME`: a redrive policy to it with `maxReceiveCount` =
///   [`SqsConfig::max_receive_count`], and [`SqsConfig::retention`] if set.
///
/// Existing queues are read, never changed; a setting that matters and differs is a
/// [`BrokerError::Config`] error: a dead-letter queue keeping messages less than 14 days,
/// a retention other than the one asked for, a redrive policy to another queue or with a
/// lower `maxReceiveCount`. A source with no redrive policy is accepted (with a warning):
/// the gate still dead-letters at `max_attempts`, only the crash-loop backstop is missing.
///
/// Returns the URLs of the source and of the dead-letter queue.
pub(crate) async fn ensure_queues(
    client: &Client,
    config: &SqsConfig,
) -> Result<(String, String), BrokerError> {
    let name = &config.name;
    check_name(name)?;
    let dead = crate::dead_letter_name(name);
    let keep = config::DEAD_LETTER_RETENTION.as_secs();
    let (dead_url, created) = create_or_get(
        client,
        &dead,
        vec![(QueueAttributeName::MessageRetentionPeriod, keep.to_string())],
    )
    .await?;
    let dead_attrs = queue_attributes(client, &dead_url).await?;
    if !created {
        let kept = dead_attrs
            .get(&QueueAttributeName::MessageRetentionPeriod)
            .and_then(|v| v.parse::<u64>().ok());
        if kept.is_some_and(|k| k < keep) {
            return Err(config_error(format!(
                "the dead-letter queue {} keeps messages {} s (MessageRetentionPeriod); idem needs \
                 {keep} s (14 days) so that dead letters are not dropped unseen: raise it with \
                 SetQueueAttributes",
                queue_name(&dead),
                kept.unwrap_or_default()
            )));
        }
    }
    let dead_arn = dead_attrs
        .get(&QueueAttributeName::QueueArn)
        .cloned()
        .ok_or_else(|| {
            BrokerError::op(
                BROKER,
                "GetQueueAttributes",
                format!("no QueueArn for {}", queue_name(&dead)),
            )
        })?;
    let mut attrs = vec![(
        QueueAttributeName::RedrivePolicy,
        RedrivePolicy {
            dead_letter_target_arn: dead_arn.clone(),
            max_receive_count: Some(config.max_receive_count),
        }
        .to_attribute(),
    )];
    if let Some(r) = config.retention {
        attrs.push((
            QueueAttributeName::MessageRetentionPeriod,
            r.as_secs().to_string(),
        ));
    }
    let (url, created) = create_or_get(client, name, attrs).await?;
    if !created {
        check_source(client, &url, config, &dead_arn).await?;
    }
    Ok((url, dead_url))
}

/// The application's `client` made ready for `config`'s queue: a copy with `config`'s
/// timeouts ([`with_timeouts`]), and the URLs of the queue and of its dead-letter queue
/// ([`ensure_queues`]).
pub(crate) async fn open_queues(
    client: &Client,
    config: &SqsConfig,
) -> Result<(Client, String, String), BrokerError> {
    let client = with_timeouts(client, config);
    let (url, dead_url) = ensure_queues(&client, config).await?;
    Ok((client, url, dead_url))
}

/// Checks an existing source queue against `config` (see [`ensure_queues`]).
async fn check_source(
    client: &Client,
    url: &str,
    config: &SqsConfig,
    dead_arn: &str,
) -> Result<(), BrokerError> {
    let q = queue_name(&config.name);
    let attrs = queue_attributes(client, url).await?;
    if let Some(want) = config.retention {
        let have = attrs
            .get(&QueueAttributeName::MessageRetentionPeriod)
            .and_then(|v| v.parse::<u64>().ok());
        if have != Some(want.as_secs()) {
            return Err(config_error(format!(
                "queue {q} keeps messages {} s (MessageRetentionPeriod), the configuration asks \
                 for {} s: change one of them",
                have.map_or_else(|| "?".to_owned(), |h| h.to_string()),
                want.as_secs()
            )));
        }
    }
    match attrs.get(&QueueAttributeName::RedrivePolicy) {
        None => {
            tracing::warn!(target: "idem::broker", broker = BROKER, queue = %q, "the queue has no redrive policy: a message its consumers keep crashing on is received again and again (the gate dead-letters only failures it sees)");
        }
        Some(policy) => {
            let policy = RedrivePolicy::parse(policy);
            let target = policy.dead_letter_target_arn;
            if target != dead_arn {
                return Err(config_error(format!(
                    "queue {q} redrives to {target:?}, not to idem's dead-letter queue {dead_arn:?}: \
                     dead letters would be split between two queues"
                )));
            }
            let count = policy.max_receive_count;
            let floor = config.min_receive_count.min(config.max_receive_count);
            match count {
                Some(c) if c >= config.max_receive_count => {}
                Some(c) if c >= floor => {
                    tracing::warn!(target: "idem::broker", broker = BROKER, queue = %q, max_receive_count = c, wanted = config.max_receive_count, "the queue moves a message to the dead-letter queue after fewer receives than idem gives a queue it creates: a message held beside one that kills its consumer loses a receive per run, and may be moved there unrun, without a reason; raise the queue's maxReceiveCount");
                }
                _ => {
                    return Err(config_error(format!(
                        "queue {q} moves a message to the dead-letter queue after {} receives \
                         (maxReceiveCount), fewer than the {floor} configured: SQS would \
                         dead-letter messages, without a reason, before the consumer had its \
                         attempts",
                        count.map_or_else(|| "?".to_owned(), |c| c.to_string()),
                    )));
                }
            }
        }
    }
    Ok(())
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
    fn only_a_loopback_endpoint_gets_test_credentials() {
        use CredentialSource::{Chain, LocalTest};
        for local in [
            "http://127.0.0.1:5000",
            "http://127.1.2.3",
            "http://localhost:4566",
            "http://LocalHost.:4566",
            "http://sqs.localhost",
            "http://[::1]:9324",
        ] {
            assert_eq!(
                sources(Some(local), None),
                (LocalTest, RegionSource::Local),
                "{local}"
            );
            assert_eq!(
                sources(Some(local), Some("eu-west-1")),
                (LocalTest, RegionSource::Url("eu-west-1".to_owned())),
                "{local}"
            );
        }
        for remote in [
            "http://sqs.eu-west-1.amazonaws.com",
            "https://sqs.internal:9324",
            "http://10.0.0.5:5000",
            "http://localhost.example.com",
            "http://[::2]",
            "not a url",
        ] {
            assert_eq!(
                sources(Some(remote), None),
                (Chain, RegionSource::Chain),
                "{remote}"
            );
            assert_eq!(
                sources(Some(remote), Some("ap-south-1")),
                (Chain, RegionSource::Url("ap-south-1".to_owned())),
                "{remote}"
            );
        }
        // No endpoint in the URL (`sqs://`): AWS, or AWS_ENDPOINT_URL, whatever it
        // names: the chain's credentials, never the test ones.
        assert_eq!(sources(None, None), (Chain, RegionSource::Chain));
        assert_eq!(
            sources(None, Some("us-west-2")),
            (Chain, RegionSource::Url("us-west-2".to_owned()))
        );
    }

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

    #[test]
    fn redrive_policy_fields() {
        let p = r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:q-dead-letter","maxReceiveCount":10}"#;
        let policy = RedrivePolicy::parse(p);
        assert_eq!(
            policy,
            RedrivePolicy {
                dead_letter_target_arn: "arn:aws:sqs:us-east-1:1:q-dead-letter".to_owned(),
                max_receive_count: Some(10),
            }
        );
        // Written back byte for byte, fields in this order.
        assert_eq!(policy.to_attribute(), p);
        let quoted =
            RedrivePolicy::parse(r#"{"maxReceiveCount": "5", "deadLetterTargetArn": "a"}"#);
        assert_eq!(quoted.max_receive_count, Some(5));
        assert_eq!(quoted.dead_letter_target_arn, "a");
        let odd = RedrivePolicy::parse(r#"{"maxReceiveCount": "many"}"#);
        assert_eq!(
            (odd.dead_letter_target_arn.as_str(), odd.max_receive_count),
            ("", None)
        );
        assert_eq!(RedrivePolicy::parse("not json"), RedrivePolicy::default());
        // An ARN with a quote would have broken the hand-written JSON.
        let q = RedrivePolicy {
            dead_letter_target_arn: "a\"b".to_owned(),
            max_receive_count: Some(3),
        };
        assert_eq!(RedrivePolicy::parse(&q.to_attribute()), q);
    }
}
