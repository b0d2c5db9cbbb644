//! TLS for the adapters: a URL that asks for TLS (`amqps://`, `rediss://`, NATS `tls://`)
//! gets TLS or an error, never plain TCP.
//!
//! With the `tls` feature, RabbitMQ (lapin) and Redis Streams (fred) speak TLS through
//! rustls with the `ring` provider, verifying the server's certificate against the
//! system's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` name other ones) or, for RabbitMQ,
//! the URL's `cacertfile`. NATS always has TLS (async-nats is built with rustls). Without
//! the feature, an `amqps://` or `rediss://` URL is refused with
//! [`BrokerError::Unsupported`].

use crate::BrokerError;

/// Installs rustls's `ring` provider as the process default, unless one is installed.
///
/// fred, async-nats and lapin build their TLS configurations from the process default;
/// rustls picks one by itself only when exactly one provider is compiled in, and an
/// application may compile aws-lc-rs in beside ring (the AWS SDK's default HTTP client
/// does; idem's SQS client names ring in its own configuration). An application that
/// installs its own provider first keeps it.
#[cfg(any(feature = "tls", feature = "nats"))]
#[allow(dead_code)] // used by the broker features
pub(crate) fn install_default_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one in between: either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The refusal of a TLS URL on a build without TLS.
#[allow(dead_code)] // used by the broker features
pub(crate) fn not_compiled(scheme: &str) -> BrokerError {
    BrokerError::Unsupported {
        scheme: scheme.to_owned(),
        hint: "it asks for TLS, which needs idem-broker's \"tls\" feature; \
               it is never downgraded to plain TCP"
            .to_owned(),
    }
}

/// Whether `url`'s scheme asks for TLS (`amqps`, `rediss`, `rediss-cluster`, …).
#[allow(dead_code)] // used by the broker features
pub(crate) fn scheme_asks_for_tls(url: &str) -> Option<&str> {
    let scheme = url.split_once("://")?.0;
    let s = scheme.to_ascii_lowercase();
    (s == "amqps" || s.starts_with("rediss") || s.starts_with("valkeys")).then_some(scheme)
}

/// Refuses a TLS URL when TLS is not compiled in.
#[allow(dead_code)] // used by the broker features
pub(crate) fn check_compiled(url: &str) -> Result<(), BrokerError> {
    match scheme_asks_for_tls(url) {
        Some(scheme) if !cfg!(feature = "tls") => Err(not_compiled(scheme)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_schemes_are_recognised() {
        for (url, tls) in [
            ("amqps://h:5671/%2f", true),
            ("AMQPS://h", true),
            ("amqp://h:5672", false),
            ("rediss://h:6379", true),
            ("rediss-cluster://h:1,h:2", true),
            ("redis://h:6379", false),
            ("nats://h:4222", false),
        ] {
            assert_eq!(scheme_asks_for_tls(url).is_some(), tls, "{url}");
        }
        let refused = check_compiled("amqps://h");
        assert_eq!(refused.is_err(), !cfg!(feature = "tls"));
        if let Err(e) = refused {
            assert!(e.to_string().contains("\"tls\" feature"), "{e}");
        }
    }
}
