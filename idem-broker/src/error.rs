//! The crate's one error type.

use idem_core::{AckError, BoxError, PublishError};

/// An [`BrokerError::InvalidParam`] value as shown: quoted, or masked for a secret.
fn shown_value(param: &str, value: &str) -> String {
    if idem_core::redact::is_secret_param(param) {
        idem_core::redact::MASK.to_owned()
    } else {
        format!("{value:?}")
    }
}

/// A broker adapter failed. Every variant says whether retrying can help
/// ([`BrokerError::is_retryable`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker URL cannot be used (bad syntax, unknown scheme, bad parameter).
    #[error("invalid broker URL: {0}")]
    InvalidUrl(String),
    /// A parameter in the broker URL's query that this broker does not take, one given
    /// twice, or a value it cannot use (each broker's `Config::from_url` lists its
    /// parameters).
    #[error("invalid broker URL parameter {param}={}: {reason}", shown_value(.param, .value))]
    InvalidParam {
        /// The parameter's name.
        param: String,
        /// The value given.
        value: String,
        /// What is wrong, and what would do.
        reason: String,
    },
    /// The scheme is known but its adapter is not compiled into this build.
    #[error("{scheme}:// brokers are not supported in this build ({hint})")]
    Unsupported {
        /// The URL scheme (`sqs`, `kafka`, or one whose feature is off).
        scheme: String,
        /// What would enable it.
        hint: String,
    },
    /// A queue, stream or subject name the broker cannot take.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: String,
    },
    /// The broker could not be reached, or refused the connection.
    #[error("cannot connect to {broker}")]
    Connect {
        /// Which broker (`rabbitmq`, `nats`, `redis`).
        broker: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// An operation on an open connection failed.
    #[error("{broker}: {action} failed")]
    Operation {
        /// Which broker.
        broker: &'static str,
        /// What was being done (`basic.ack`, `XREADGROUP`, …).
        action: &'static str,
        /// Whether a retry can help.
        retryable: bool,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The broker did not answer an operation in time: a hung endpoint, a frozen server,
    /// a network that drops packets. Retryable: a reconnect may reach a live server.
    #[error("{broker}: {action} got no answer within {}", crate::show_duration(*.after))]
    Timeout {
        /// Which broker.
        broker: &'static str,
        /// What was being done (`ReceiveMessage`, `XREADGROUP`, …).
        action: &'static str,
        /// How long it waited (on each attempt, where the client retries).
        after: std::time::Duration,
    },
    /// The broker's existing queue, stream or consumer is set up differently from what
    /// this configuration asks (a setting that matters for correctness): not retryable,
    /// an operator has to reconcile them.
    #[error("{broker}: {detail}")]
    Config {
        /// Which broker.
        broker: &'static str,
        /// What differs, naming the setting and both values.
        detail: String,
    },
    /// The broker answered a publish with a refusal (a nack, a returned message).
    #[error("{broker} did not confirm a publish: {detail}")]
    NotConfirmed {
        /// Which broker.
        broker: &'static str,
        /// What the broker said.
        detail: String,
    },
}

impl BrokerError {
    /// Whether running the same operation again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InvalidUrl(_)
            | Self::InvalidParam { .. }
            | Self::Unsupported { .. }
            | Self::InvalidName { .. }
            | Self::Config { .. } => false,
            Self::Connect { .. } | Self::NotConfirmed { .. } | Self::Timeout { .. } => true,
            Self::Operation { retryable, .. } => *retryable,
        }
    }

    /// A dead letter the broker refuses for good: a [`Config`](Self::Config) error (an
    /// [`AckError::config`], which stops the consumer) naming the destination, the
    /// broker's answer and what an operator must change. The acker that returns it leaves
    /// the delivery unsettled, as `unsettled` says.
    #[allow(dead_code)] // used by the broker features
    pub(crate) fn dead_letter_refused(
        broker: &'static str,
        destination: &str,
        cause: &str,
        unsettled: &str,
        fix: &str,
    ) -> Self {
        Self::Config {
            broker,
            detail: format!(
                "{destination} refuses the dead letter for good: {cause}; it is left \
                 {unsettled} and the consumer stops: {fix}, then start it again"
            ),
        }
    }

    #[allow(dead_code)] // used by the broker features
    pub(crate) fn connect(broker: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Connect {
            broker,
            source: source.into(),
        }
    }

    /// `name` refused for `reason`.
    #[allow(dead_code)] // used by the broker features
    pub(crate) fn invalid_name(name: &str, reason: impl Into<String>) -> Self {
        Self::InvalidName {
            name: name.to_owned(),
            reason: reason.into(),
        }
    }

    /// `name` refused for `reason` if there is one, else `Ok`.
    #[allow(dead_code)] // used by the broker features
    pub(crate) fn refuse_name(name: &str, reason: Option<&str>) -> Result<(), Self> {
        reason.map_or(Ok(()), |r| Err(Self::invalid_name(name, r)))
    }

    #[allow(dead_code)] // used by the broker features
    pub(crate) fn op(
        broker: &'static str,
        action: &'static str,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Operation {
            broker,
            action,
            retryable: true,
            source: source.into(),
        }
    }
}

/// [`BrokerError::Config`] is [`AckError::config`]: the consumer stops.
impl From<BrokerError> for AckError {
    fn from(e: BrokerError) -> Self {
        if matches!(e, BrokerError::Config { .. }) {
            return AckError::config(e.to_string(), Some(Box::new(e)));
        }
        let retryable = e.is_retryable();
        AckError::new(e.to_string(), retryable, Some(Box::new(e)))
    }
}

impl From<BrokerError> for PublishError {
    fn from(e: BrokerError) -> Self {
        let retryable = e.is_retryable();
        PublishError::new(e.to_string(), retryable, Some(Box::new(e)))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_secret_parameter_value_is_never_shown() {
        let e = super::BrokerError::InvalidParam {
            param: "sasl.password".into(),
            value: "hunter2".into(),
            reason: "unknown parameter".into(),
        };
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    use super::*;

    #[test]
    fn retryability_follows_the_variant() {
        assert!(!BrokerError::InvalidUrl("x".into()).is_retryable());
        let param = BrokerError::InvalidParam {
            param: "ack_wait".into(),
            value: "soon".into(),
            reason: "not a duration".into(),
        };
        assert!(!param.is_retryable());
        assert_eq!(
            param.to_string(),
            "invalid broker URL parameter ack_wait=\"soon\": not a duration"
        );
        assert!(!BrokerError::Unsupported {
            scheme: "sqs".into(),
            hint: "later".into()
        }
        .is_retryable());
        assert!(BrokerError::connect("nats", std::io::Error::other("refused")).is_retryable());
        let e: AckError = BrokerError::op("nats", "ack", std::io::Error::other("x")).into();
        assert!(e.is_retryable());
        let p: PublishError = BrokerError::NotConfirmed {
            broker: "rabbitmq",
            detail: "nack".into(),
        }
        .into();
        assert!(p.is_retryable());
    }
}
