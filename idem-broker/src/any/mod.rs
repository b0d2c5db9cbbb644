//! One entry point over every broker compiled into this build, so a command parses a URL
//! and dispatches once.
//!
//! [`BrokerUrl::parse`] maps the scheme to a [`BrokerKind`] (the table in the
//! [crate docs](crate)), takes idem's settings out of the query and checks them with the
//! broker's own configuration (each `config` type documents its parameters:
//! [`RabbitConfig`](crate::rabbitmq::RabbitConfig),
//! [`NatsConfig`](crate::nats::NatsConfig),
//! [`RedisStreamsConfig`](crate::redis_streams::RedisStreamsConfig),
//! [`SqsConfig`](crate::sqs::SqsConfig), [`KafkaConfig`](crate::kafka::KafkaConfig)). A
//! parameter that is neither one of idem's nor one the broker's client reads is an
//! error, so a misspelt setting never falls back to its default. [`AnyConsumer`],
//! [`AnyAcker`] and [`AnyPublisher`] then wrap the broker's own types behind one (the
//! dispatch, in files `consumer` and `publisher` as in each broker's module).
//!
//! ```
//! # #[cfg(feature = "nats")]
//! # fn main() -> Result<(), idem_broker::BrokerError> {
//! use idem_broker::any::{BrokerKind, BrokerUrl};
//! use idem_broker::BrokerError;
//! let url = BrokerUrl::parse("nats://127.0.0.1:4222?ack_wait=5s")?;
//! assert_eq!(url.kind(), BrokerKind::Nats);
//! assert_eq!(url.param("ack_wait"), Some("5s"));
//! assert_eq!(url.client_url(), "nats://127.0.0.1:4222");
//! assert!(matches!(BrokerUrl::parse("ftp://queue"), Err(BrokerError::InvalidUrl(_))));
//! assert!(matches!(
//!     BrokerUrl::parse("nats://127.0.0.1:4222?ack_wiat=5s"),
//!     Err(BrokerError::InvalidParam { .. })
//! ));
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "nats"))]
//! # fn main() {}
//! ```

use std::collections::BTreeMap;
use std::fmt;

use crate::BrokerError;

/// Which broker a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BrokerKind {
    /// `amqp://`, `amqps://`: RabbitMQ.
    RabbitMq,
    /// `nats://`, `tls://`: NATS JetStream.
    Nats,
    /// `redis://`, `rediss://`: Redis Streams.
    RedisStreams,
    /// `sqs://`: Amazon SQS.
    Sqs,
    /// `kafka://`, `kafkas://` (TLS): Kafka.
    Kafka,
}

impl BrokerKind {
    /// The broker of URL scheme `scheme` (`amqp`, `amqps`, `nats`, `tls`, `redis`,
    /// `rediss`, `sqs`, `kafka`, `kafkas`), whether or not its feature is compiled in.
    pub fn from_scheme(scheme: &str) -> Option<Self> {
        Some(match scheme {
            "amqp" | "amqps" => Self::RabbitMq,
            "nats" | "tls" => Self::Nats,
            "redis" | "rediss" => Self::RedisStreams,
            "sqs" => Self::Sqs,
            "kafka" | "kafkas" => Self::Kafka,
            _ => return None,
        })
    }

    /// The cargo feature that compiles this broker's adapter.
    pub fn feature(self) -> &'static str {
        match self {
            Self::RabbitMq => "rabbitmq",
            Self::Nats => "nats",
            Self::RedisStreams => "redis-streams",
            Self::Sqs => "sqs",
            Self::Kafka => "kafka",
        }
    }

    /// Whether this build has the adapter.
    pub fn is_enabled(self) -> bool {
        match self {
            Self::RabbitMq => cfg!(feature = "rabbitmq"),
            Self::Nats => cfg!(feature = "nats"),
            Self::RedisStreams => cfg!(feature = "redis-streams"),
            Self::Sqs => cfg!(feature = "sqs"),
            Self::Kafka => cfg!(feature = "kafka"),
        }
    }

    /// idem's settings in this broker's URL query, then the parameters its client reads
    /// (handed on with the URL). Empty for a broker not compiled in.
    fn params(self) -> (&'static [&'static str], &'static [&'static str]) {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq => (
                crate::rabbitmq::RabbitConfig::URL_SETTINGS,
                crate::rabbitmq::RabbitConfig::CLIENT_PARAMS,
            ),
            #[cfg(feature = "nats")]
            Self::Nats => (
                crate::nats::NatsConfig::URL_SETTINGS,
                crate::nats::NatsConfig::CLIENT_PARAMS,
            ),
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams => (crate::redis_streams::RedisStreamsConfig::URL_SETTINGS, &[]),
            #[cfg(feature = "sqs")]
            Self::Sqs => (crate::sqs::SqsConfig::URL_SETTINGS, &[]),
            #[cfg(feature = "kafka")]
            Self::Kafka => (crate::kafka::KafkaConfig::URL_SETTINGS, &[]),
            #[allow(unreachable_patterns)]
            _ => (&[], &[]),
        }
    }
}

impl fmt::Display for BrokerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RabbitMq => "RabbitMQ",
            Self::Nats => "NATS JetStream",
            Self::RedisStreams => "Redis Streams",
            Self::Sqs => "SQS",
            Self::Kafka => "Kafka",
        })
    }
}

/// A parsed broker URL: which broker, the URL for its client, and idem's settings from
/// the query (read by each broker's `Config::from_url`).
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    kind: BrokerKind,
    client_url: String,
    params: BTreeMap<String, String>,
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerUrl")
            .field("kind", &self.kind)
            .field("url", &crate::names::redact(&self.client_url))
            .field(
                "params",
                &self
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let secret = idem_core::redact::is_secret_param(k);
                        (k, if secret { idem_core::redact::MASK } else { v })
                    })
                    .collect::<BTreeMap<_, _>>(),
            )
            .finish()
    }
}

impl fmt::Display for BrokerUrl {
    /// The URL with its password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::names::redact(&self.client_url))
    }
}

impl BrokerUrl {
    /// Parses `url` and checks idem's settings in its query with the broker's
    /// configuration, so a bad one is reported here rather than at connect.
    ///
    /// # Errors
    /// [`BrokerError::InvalidUrl`] for a malformed URL or an unknown scheme;
    /// [`BrokerError::InvalidParam`] for a query parameter the broker does not take, one
    /// given twice, or a bad value; [`BrokerError::Unsupported`] for a broker whose
    /// feature is not compiled in.
    pub fn parse(url: &str) -> Result<Self, BrokerError> {
        // A Kafka bootstrap list (`kafka://h1:9092,h2:9092`) is no URL authority: the
        // URL is read with its first host, and the list is put back into the client's URL.
        let hosts = bootstrap_list(url);
        let parsed_from = match hosts {
            Some((start, list)) => {
                for host in list.split(',') {
                    let ok = url::Url::parse(&format!("kafka://{host}"))
                        .is_ok_and(|u| u.host_str().is_some_and(|h| !h.is_empty()));
                    if !ok {
                        return Err(BrokerError::InvalidUrl(format!(
                            "{}: {host:?} in the bootstrap list is not host:port",
                            crate::names::redact(url)
                        )));
                    }
                }
                let first = list.split(',').next().unwrap_or_default();
                format!("{}{first}{}", &url[..start], &url[start + list.len()..])
            }
            None => url.to_owned(),
        };
        let mut parsed = url::Url::parse(&parsed_from)
            .map_err(|e| BrokerError::InvalidUrl(format!("{}: {e}", crate::names::redact(url))))?;
        let Some(kind) = BrokerKind::from_scheme(parsed.scheme()) else {
            return Err(BrokerError::InvalidUrl(format!(
                "unknown scheme {:?}: use amqp://, nats://, redis://, sqs:// or kafka://",
                parsed.scheme()
            )));
        };
        if !kind.is_enabled() {
            return Err(not_compiled(parsed.scheme(), kind));
        }
        let (settings, client_params) = kind.params();
        let mut params = BTreeMap::new();
        let mut rest: Vec<(String, String)> = Vec::new();
        for (k, v) in parsed.query_pairs() {
            let invalid = |reason: String| BrokerError::InvalidParam {
                param: k.to_string(),
                // A secret (`password`, `token`, …) is never repeated in an error.
                value: if idem_core::redact::is_secret_param(&k) {
                    idem_core::redact::MASK.to_owned()
                } else {
                    v.to_string()
                },
                reason,
            };
            if settings.contains(&k.as_ref()) {
                if params.insert(k.to_string(), v.to_string()).is_some() {
                    return Err(invalid("given more than once".to_owned()));
                }
            } else if client_params.contains(&k.as_ref()) {
                rest.push((k.into_owned(), v.into_owned()));
            } else {
                let mut reason = format!(
                    "unknown parameter: {}:// takes {}",
                    parsed.scheme(),
                    settings.join(", ")
                );
                if !client_params.is_empty() {
                    reason += &format!(" (idem's) and {} (the client's)", client_params.join(", "));
                }
                return Err(invalid(reason));
            }
        }
        // Hand the client exactly what was written unless a setting has to come out
        // (an AMQP URL's trailing "/" or "%2f" names the vhost).
        let client_url = if params.is_empty() {
            url.to_owned()
        } else {
            if rest.is_empty() {
                parsed.set_query(None);
            } else {
                parsed.query_pairs_mut().clear().extend_pairs(rest);
            }
            let mut client = parsed.to_string();
            if let Some((_, list)) = hosts {
                // Where the first host starts in the URL as `url` writes it again.
                let start = kafka_hosts(&client).map_or(0, |(start, _)| start);
                let first_len = list.split(',').next().unwrap_or_default().len();
                client.replace_range(start..start + first_len, list);
            }
            client
        };
        let url = Self {
            kind,
            client_url,
            params,
        };
        url.check()?;
        Ok(url)
    }

    /// Reads the settings with the broker's configuration (for a name they do not use).
    fn check(&self) -> Result<(), BrokerError> {
        match self.kind {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => crate::rabbitmq::RabbitConfig::from_url(self, "").map(drop),
            #[cfg(feature = "nats")]
            BrokerKind::Nats => crate::nats::NatsConfig::from_url(self, "").map(drop),
            #[cfg(feature = "redis-streams")]
            BrokerKind::RedisStreams => {
                crate::redis_streams::RedisStreamsConfig::from_url(self, "").map(drop)
            }
            #[cfg(feature = "sqs")]
            BrokerKind::Sqs => crate::sqs::SqsConfig::from_url(self, "").map(drop),
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => crate::kafka::KafkaConfig::from_url(self, "").map(drop),
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(other.feature(), other)),
        }
    }

    /// Which broker.
    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    /// The URL handed to the client (idem's settings removed). It may hold a password:
    /// print the `BrokerUrl` itself (`Display` masks it).
    pub fn client_url(&self) -> &str {
        &self.client_url
    }

    /// One of idem's settings from the query, as written.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params.get(key).map(String::as_str)
    }
}

/// Where a `kafka://` (or `kafkas://`) URL's comma-separated bootstrap list starts, and
/// the list; `None` for any other URL or a single host.
fn bootstrap_list(url: &str) -> Option<(usize, &str)> {
    kafka_hosts(url).filter(|(_, list)| list.contains(','))
}

/// Where a `kafka://` (or `kafkas://`) URL's hosts start, after any `user:password@`,
/// and the hosts, up to the path, query or fragment; `None` for any other URL.
fn kafka_hosts(url: &str) -> Option<(usize, &str)> {
    let scheme = ["kafka://", "kafkas://"].into_iter().find(|s| {
        url.get(..s.len())
            .is_some_and(|u| u.eq_ignore_ascii_case(s))
    })?;
    let rest = &url[scheme.len()..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let start = scheme.len() + authority.rfind('@').map_or(0, |at| at + 1);
    Some((start, &url[start..scheme.len() + authority.len()]))
}

/// `scheme`'s broker `kind` is not compiled in.
fn not_compiled(scheme: &str, kind: BrokerKind) -> BrokerError {
    BrokerError::Unsupported {
        scheme: scheme.to_owned(),
        hint: format!("rebuild idem-broker with the {:?} feature", kind.feature()),
    }
}

/// `pub enum $name` with a variant for every compiled-in broker, holding that broker's
/// type of the kind (`RabbitAcker`, `NatsAcker`, …, in the order of [`BrokerKind`]).
macro_rules! broker_enum {
    (
        $(#[$attr:meta])*
        pub enum $name:ident($rabbitmq:ident, $nats:ident, $redis:ident, $sqs:ident, $kafka:ident);
    ) => {
        broker_enum!(@variants $(#[$attr])* $name:
            "rabbitmq" rabbitmq RabbitMq $rabbitmq,
            "nats" nats Nats $nats,
            "redis-streams" redis_streams RedisStreams $redis,
            "sqs" sqs Sqs $sqs,
            "kafka" kafka Kafka $kafka
        );
    };
    (
        @variants $(#[$attr:meta])* $name:ident:
        $($feature:literal $module:ident $variant:ident $ty:ident),+
    ) => {
        $(#[$attr])*
        pub enum $name {
            $(
                #[doc = concat!("See [`crate::", stringify!($module), "::", stringify!($ty), "`].")]
                #[cfg(feature = $feature)]
                #[cfg_attr(docsrs, doc(cfg(feature = $feature)))]
                $variant(crate::$module::$ty),
            )+
        }
    };
}

/// `match $value { $ty::Broker($inner) => $body, … }` over every compiled-in broker.
macro_rules! each_broker {
    ($value:expr, $ty:ident, $inner:ident => $body:expr) => {
        match $value {
            #[cfg(feature = "rabbitmq")]
            $ty::RabbitMq($inner) => $body,
            #[cfg(feature = "nats")]
            $ty::Nats($inner) => $body,
            #[cfg(feature = "redis-streams")]
            $ty::RedisStreams($inner) => $body,
            #[cfg(feature = "sqs")]
            $ty::Sqs($inner) => $body,
            #[cfg(feature = "kafka")]
            $ty::Kafka($inner) => $body,
            // With no broker compiled in the enum has no value, and a reference to it
            // still needs an arm (an owned value does not).
            #[cfg(not(any(
                feature = "rabbitmq",
                feature = "nats",
                feature = "redis-streams",
                feature = "sqs",
                feature = "kafka"
            )))]
            #[allow(unreachable_patterns)]
            _ => unreachable!("no broker is compiled in"),
        }
    };
}

/// The dispatch's modules: with no broker compiled in, the dispatch has no arm that uses
/// its arguments.
macro_rules! dispatch_modules {
    ($($module:ident),+) => {$(
        #[cfg_attr(
            not(any(
                feature = "rabbitmq",
                feature = "nats",
                feature = "redis-streams",
                feature = "sqs",
                feature = "kafka"
            )),
            allow(unused_variables, unused_mut, unused_imports, unreachable_code)
        )]
        mod $module;
    )+};
}

dispatch_modules!(consumer, publisher);

pub use consumer::{AnyAcker, AnyConsumer};
pub use publisher::{pending_count, publish_raw, AnyPublisher};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_map_to_brokers_and_missing_features_say_so() {
        for (scheme, kind) in [
            ("amqp", BrokerKind::RabbitMq),
            ("amqps", BrokerKind::RabbitMq),
            ("nats", BrokerKind::Nats),
            ("tls", BrokerKind::Nats),
            ("redis", BrokerKind::RedisStreams),
            ("rediss", BrokerKind::RedisStreams),
            ("sqs", BrokerKind::Sqs),
            ("kafka", BrokerKind::Kafka),
            ("kafkas", BrokerKind::Kafka),
        ] {
            assert_eq!(BrokerKind::from_scheme(scheme), Some(kind), "{scheme}");
        }
        assert_eq!(BrokerKind::from_scheme("http"), None);
        for (u, on) in [
            ("sqs://q", cfg!(feature = "sqs")),
            ("kafka://127.0.0.1:9092", cfg!(feature = "kafka")),
        ] {
            match BrokerUrl::parse(u) {
                Ok(_) => assert!(on, "{u} parsed without its feature"),
                Err(e) => {
                    assert!(!on, "{u}: {e}");
                    assert!(matches!(e, BrokerError::Unsupported { .. }), "{e}");
                    assert!(e.to_string().contains("not supported in this build"), "{e}");
                }
            }
        }
        for bad in ["ftp://x", "not a url"] {
            assert!(
                matches!(BrokerUrl::parse(bad), Err(BrokerError::InvalidUrl(_))),
                "{bad}"
            );
        }
    }

    #[cfg(feature = "rabbitmq")]
    #[test]
    fn amqp_urls_pass_through_and_passwords_are_masked() {
        let u = BrokerUrl::parse("amqp://guest:secret@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(u.kind(), BrokerKind::RabbitMq);
        assert_eq!(u.client_url(), "amqp://guest:secret@127.0.0.1:5672/%2f");
        assert!(!u.to_string().contains("secret"));
        assert!(!format!("{u:?}").contains("secret"));
        let bare = BrokerUrl::parse("amqp://127.0.0.1:5672").unwrap();
        assert_eq!(bare.client_url(), "amqp://127.0.0.1:5672");
        // idem's settings come out, the client's stay, the password stays masked
        let mixed =
            BrokerUrl::parse("amqp://u:secret@h:5672/%2f?heartbeat=10&queue_type=classic").unwrap();
        assert_eq!(
            mixed.client_url(),
            "amqp://u:secret@h:5672/%2f?heartbeat=10"
        );
        assert_eq!(mixed.param("queue_type"), Some("classic"));
        assert_eq!(mixed.param("heartbeat"), None);
        assert!(!mixed.to_string().contains("secret"), "{mixed}");
        assert!(!format!("{mixed:?}").contains("secret"), "{mixed:?}");
    }

    #[cfg(all(feature = "rabbitmq", feature = "nats", feature = "redis-streams"))]
    #[test]
    fn unknown_and_repeated_parameters_are_named() {
        for (url, param, reason) in [
            ("nats://h:4222?ack_wiat=5s", "ack_wiat", "unknown parameter"),
            ("redis://h?group=a&group=b", "group", "more than once"),
            ("amqp://h?queue_type=quorum&x=1", "x", "heartbeat"),
            ("redis://h?queue_type=classic", "queue_type", "min_idle"),
        ] {
            crate::setting::assert_refused(BrokerUrl::parse(url), url, param, reason);
        }
    }

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_bootstrap_lists_reach_the_client_whole() {
        let list = "kafka://10.0.0.1:9092,10.0.0.2:9092,kafka-3.internal:9093";
        let u = BrokerUrl::parse(list).unwrap();
        assert_eq!(u.client_url(), list);
        let with = BrokerUrl::parse(&format!("{list}?group=billing")).unwrap();
        assert_eq!(with.client_url(), list);
        assert_eq!(with.param("group"), Some("billing"));
        let c = crate::kafka::KafkaConfig::from_url(&with, "grants").unwrap();
        assert_eq!(
            c.brokers,
            "10.0.0.1:9092,10.0.0.2:9092,kafka-3.internal:9093"
        );
        // after a SASL user:password@, on kafkas:// too, with settings taken out
        let tls = "kafkas://u:p%40ss@10.0.0.1:9093,kafka-2.internal:9093";
        let with = BrokerUrl::parse(&format!("{tls}?group=billing&sasl.mechanism=PLAIN")).unwrap();
        assert_eq!(with.client_url(), tls);
        assert_eq!(with.param("sasl.mechanism"), Some("PLAIN"));
        assert!(!with.to_string().contains("p%40ss"), "{with}");
        let c = crate::kafka::KafkaConfig::from_url(&with, "grants").unwrap();
        assert_eq!(c.brokers, "10.0.0.1:9093,kafka-2.internal:9093");
        assert_eq!(c.security.sasl_password.as_deref(), Some("p@ss"));
        // a bad host in the list is still a bad URL
        for bad in [
            "kafka://h1:9092,h2:notaport?group=g",
            "kafka://h1:notaport,h2:9092",
            "kafka://h1:9092,,h2:9092",
            "kafkas://u:p@h1:9092,h2:notaport",
        ] {
            assert!(
                matches!(BrokerUrl::parse(bad), Err(BrokerError::InvalidUrl(_))),
                "{bad}"
            );
        }
    }
}
