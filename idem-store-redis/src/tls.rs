//! TLS for `rediss://` URLs (feature `tls`): rustls with the `ring` provider, for either
//! client. Without the feature such a URL is refused ([`RedisConfig::validate`]), never
//! downgraded to plain TCP.
//!
//! The fred client is handed a rustls configuration built here with the `ring` provider
//! named in it (`rustls_config`): nothing is installed process-wide. redis-rs takes no
//! configuration, and builds its own from the process default: see
//! `install_default_provider_for_redis_rs`.
//!
//! [`RedisConfig::validate`]: crate::RedisConfig::validate

#[cfg(all(feature = "tls", feature = "fred"))]
use std::path::Path;

use crate::error::RedisError;

/// The TLS files named in a Redis URL's query, as written.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TlsFiles {
    /// `cacertfile`: the CA certificates trusted instead of the system's roots.
    pub(crate) ca: Option<String>,
    /// `certfile`: a client certificate (chain).
    pub(crate) cert: Option<String>,
    /// `keyfile`: the client certificate's private key.
    pub(crate) key: Option<String>,
}

impl TlsFiles {
    /// The query parameters that name them.
    pub(crate) const PARAMS: &'static [&'static str] = &["cacertfile", "certfile", "keyfile"];

    pub(crate) fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    pub(crate) fn slot(&mut self, param: &str) -> Option<&mut Option<String>> {
        match param {
            "cacertfile" => Some(&mut self.ca),
            "certfile" => Some(&mut self.cert),
            "keyfile" => Some(&mut self.key),
            _ => None,
        }
    }
}

/// Whether the URL's scheme asks for TLS (`rediss://`, `rediss-cluster://`, …).
pub(crate) fn scheme_asks_for_tls(url: &str) -> bool {
    let scheme = url
        .split_once("://")
        .map_or("", |(s, _)| s)
        .to_ascii_lowercase();
    scheme.starts_with("rediss") || scheme.starts_with("valkeys")
}

/// Refuses a TLS URL when TLS is not compiled in.
pub(crate) fn check_compiled(url: &str) -> Result<(), RedisError> {
    if scheme_asks_for_tls(url) && !cfg!(feature = "tls") {
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        return Err(RedisError::Config(format!(
            "{scheme}:// asks for TLS, which needs idem-store-redis's \"tls\" feature; \
             it is never downgraded to plain TCP"
        )));
    }
    Ok(())
}

// For a URL whose scheme asks for TLS (`rediss`, `rediss-cluster`, `valkeys`, …), the
// same URL with the scheme's plain-TCP twin (`redis`, `redis-cluster`, `valkey`, …),
// `idem-core`'s; `None` for any other. fred reads a TLS URL into a configuration whose
// TLS connector it builds with `rustls::ClientConfig::builder()`, which takes rustls's
// process-wide default provider and, with one provider compiled in, installs it: the URL
// is read with this twin instead (the scheme chooses only the deployment and whether to
// use TLS), and the connector is `rustls_config`'s.
#[cfg(all(feature = "tls", feature = "fred"))]
pub(crate) use idem_core::scheme::plain_twin;

/// Installs rustls's `ring` provider as the process default, unless one is installed:
/// called just before redis-rs opens a connection that may speak TLS, and only then.
///
/// redis-rs takes no rustls configuration: at every TLS connection it builds its own
/// with `rustls::ClientConfig::builder()` (its `create_rustls_config`, from
/// `Client`, `ClusterClient` and the `ConnectionManager` alike), which takes the process
/// default, installs the one provider compiled in when there is none, and panics when
/// several are compiled in (an application's AWS SDK brings aws-lc-rs) and none is
/// installed. An application that installs its own provider before the first such
/// connection keeps it, and redis-rs uses it; the fred client takes idem's configuration
/// and installs nothing.
#[cfg(all(feature = "tls", feature = "redis-rs"))]
pub(crate) fn install_default_provider_for_redis_rs() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one in between: either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(feature = "tls")]
fn unreadable(param: &str, path: &str, e: impl std::fmt::Display) -> RedisError {
    RedisError::Config(format!("{param}={path:?}: {e}"))
}

/// The files' contents, for redis-rs's `TlsCertificates`.
#[cfg(all(feature = "tls", feature = "redis-rs"))]
pub(crate) fn redis_rs_certificates(
    files: &TlsFiles,
) -> Result<redis::TlsCertificates, RedisError> {
    let read =
        |param: &str, path: &str| std::fs::read(path).map_err(|e| unreadable(param, path, e));
    let client_tls = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("certfile", cert)?,
            client_key: read("keyfile", key)?,
        }),
        _ => None,
    };
    let root_cert = files
        .ca
        .as_deref()
        .map(|ca| read("cacertfile", ca))
        .transpose()?;
    Ok(redis::TlsCertificates {
        client_tls,
        root_cert,
    })
}

/// A rustls client configuration with the `ring` provider named in it (not taken from, nor
/// installed as, the process default): the `cacertfile`'s roots, else the system's
/// (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others; an error loading them is an error, as in
/// fred's own configuration); a client certificate from `certfile` and `keyfile`.
#[cfg(all(feature = "tls", feature = "fred"))]
pub(crate) fn rustls_config(files: &TlsFiles) -> Result<rustls::ClientConfig, RedisError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let certs = |param: &str, path: &str| {
        CertificateDer::pem_file_iter(Path::new(path))
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| unreadable(param, path, e))
    };
    let mut roots = rustls::RootCertStore::empty();
    match &files.ca {
        Some(ca) => {
            for cert in certs("cacertfile", ca)? {
                roots
                    .add(cert)
                    .map_err(|e| unreadable("cacertfile", ca, e))?;
            }
        }
        None => {
            let loaded = rustls_native_certs::load_native_certs();
            if let Some(e) = loaded.errors.first() {
                return Err(RedisError::Config(format!(
                    "the system's root certificates: {e}"
                )));
            }
            roots.add_parsable_certificates(loaded.certs);
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| RedisError::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            let chain = certs("certfile", cert)?;
            let key_der = PrivateKeyDer::from_pem_file(Path::new(key))
                .map_err(|e| unreadable("keyfile", key, e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| RedisError::Config(format!("certfile/keyfile: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}
