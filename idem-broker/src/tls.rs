//! TLS for the adapters: a URL that asks for TLS (`amqps://`, `rediss://`, NATS `tls://`)
//! gets TLS or an error, never plain TCP.
//!
//! With the `tls` feature, RabbitMQ (lapin) and Redis Streams (fred) speak TLS through
//! rustls, verifying the server's certificate against the system's roots
//! (`SSL_CERT_FILE` / `SSL_CERT_DIR` name other ones) or, for RabbitMQ, the URL's
//! `cacertfile` too. NATS always has TLS (async-nats is built with rustls). Without the
//! feature, an `amqps://` or `rediss://` URL is refused with
//! [`BrokerError::Unsupported`].
//!
//! Every client is handed a `rustls::ClientConfig` built here with the `ring` provider
//! named in it ([`client_config`]): nothing is installed as rustls's process-wide
//! default, so an application may install its own provider before or after idem
//! connects, and may compile aws-lc-rs in beside ring.

use crate::BrokerError;

// Each helper is compiled where a client uses it: NATS always (async-nats speaks TLS
// without the feature), RabbitMQ and Redis Streams with `tls` (Redis Streams presents no
// client certificate).

/// A client certificate chain and its private key.
#[cfg(any(
    feature = "nats",
    all(feature = "tls", any(feature = "rabbitmq", feature = "redis-streams"))
))]
pub(crate) type Identity = (
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
);

/// A rustls client configuration with the `ring` provider named in it (not taken from,
/// nor installed as, the process default), rustls's safe default protocol versions,
/// verifying servers against `roots`, and presenting `identity` when given.
#[cfg(any(
    feature = "nats",
    all(feature = "tls", any(feature = "rabbitmq", feature = "redis-streams"))
))]
pub(crate) fn client_config(
    roots: rustls::RootCertStore,
    identity: Option<Identity>,
) -> Result<rustls::ClientConfig, rustls::Error> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    match identity {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key),
        None => Ok(builder.with_no_client_auth()),
    }
}

/// The system's root certificates, as rustls-native-certs finds them (`SSL_CERT_FILE` /
/// `SSL_CERT_DIR` name others), read again at each call, with the errors met on the way.
#[cfg(any(
    feature = "nats",
    all(feature = "tls", any(feature = "rabbitmq", feature = "redis-streams"))
))]
pub(crate) fn system_roots() -> rustls_native_certs::CertificateResult {
    rustls_native_certs::load_native_certs()
}

/// The certificates of a PEM file's contents (none is not an error).
#[cfg(any(feature = "nats", all(feature = "tls", feature = "rabbitmq")))]
pub(crate) fn pem_certificates(
    pem: &[u8],
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM file of certificates: {e}"))
}

/// The private key of a PEM file's contents (PKCS#8, PKCS#1 or SEC1).
#[cfg(any(feature = "nats", all(feature = "tls", feature = "rabbitmq")))]
pub(crate) fn pem_private_key(
    pem: &[u8],
) -> Result<rustls::pki_types::PrivateKeyDer<'static>, String> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| format!("holds no PEM private key: {e}"))
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

/// The plain-TCP twin of a Redis TLS URL (`idem_core::scheme::plain_twin`).
#[allow(unused_imports)] // used by the Redis Streams feature
pub(crate) use idem_core::scheme::plain_twin;

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
        for (url, twin) in [
            ("rediss://u:p@h:6379/2", Some("redis://u:p@h:6379/2")),
            (
                "REDISS-cluster://h:1?node=h:2",
                Some("redis-cluster://h:1?node=h:2"),
            ),
            ("valkeys-sentinel://h", Some("valkey-sentinel://h")),
            ("redis://h:6379", None),
            ("amqps://h", None),
        ] {
            assert_eq!(plain_twin(url).as_deref(), twin, "{url}");
        }
        let refused = check_compiled("amqps://h");
        assert_eq!(refused.is_err(), !cfg!(feature = "tls"));
        if let Err(e) = refused {
            assert!(e.to_string().contains("\"tls\" feature"), "{e}");
        }
    }
}
