//! TLS and SASL: how the clients reach the brokers ([`KafkaSecurity`]).

use rdkafka::config::ClientConfig;

use super::keyword;

/// How the clients talk to the brokers (librdkafka's `security.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SecurityProtocol {
    /// `plaintext`: no TLS, no authentication (the default of `kafka://`).
    #[default]
    Plaintext,
    /// `ssl`: TLS (the default of `kafkas://`), with a client certificate if given.
    Ssl,
    /// `sasl_plaintext`: SASL authentication over plain TCP: the credentials (and, with
    /// `PLAIN`, the password itself) cross the network unencrypted.
    SaslPlaintext,
    /// `sasl_ssl`: SASL authentication over TLS.
    SaslSsl,
}

keywords!(SecurityProtocol, "protocol":
    Plaintext => "plaintext",
    Ssl => "ssl",
    SaslPlaintext => "sasl_plaintext",
    SaslSsl => "sasl_ssl",
);

impl SecurityProtocol {
    /// Whether the connection is TLS.
    pub fn is_tls(self) -> bool {
        matches!(self, Self::Ssl | Self::SaslSsl)
    }

    /// Whether the client authenticates with SASL.
    pub fn is_sasl(self) -> bool {
        matches!(self, Self::SaslPlaintext | Self::SaslSsl)
    }
}

/// The SASL mechanism (librdkafka's `sasl.mechanism`). GSSAPI (Kerberos) and
/// OAUTHBEARER are not offered: this build of librdkafka has no Cyrus SASL, and idem
/// has no token source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SaslMechanism {
    /// `PLAIN`: the password itself is sent (use it over TLS only).
    #[default]
    Plain,
    /// `SCRAM-SHA-256`.
    ScramSha256,
    /// `SCRAM-SHA-512`.
    ScramSha512,
}

keywords!(SaslMechanism, "mechanism":
    Plain => "PLAIN",
    ScramSha256 => "SCRAM-SHA-256",
    ScramSha512 => "SCRAM-SHA-512",
);

/// Whether the client checks that the broker's certificate names the host it dialled
/// (librdkafka's `ssl.endpoint.identification.algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointIdentification {
    /// `https`: the certificate must name the host (librdkafka's default).
    Https,
    /// `none`: any certificate the CA signed is taken, whatever host it names.
    None,
}

keywords!(EndpointIdentification, "check":
    Https => "https",
    None => "none",
);

/// How every client of the adapter (consumer, producers, metadata and admin clients)
/// reaches the brokers: TLS and SASL. The default is plain TCP without authentication.
///
/// `Debug` shows the passwords as `***`.
#[derive(Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct KafkaSecurity {
    /// `security.protocol`.
    pub protocol: SecurityProtocol,
    /// `sasl.mechanism`, used with a SASL protocol.
    pub sasl_mechanism: SaslMechanism,
    /// `sasl.username`.
    pub sasl_username: Option<String>,
    /// `sasl.password`.
    pub sasl_password: Option<String>,
    /// `ssl.ca.location`: a PEM file (or directory) of the CAs the broker's certificate
    /// must chain to; without it, the system's.
    pub ssl_ca_location: Option<String>,
    /// `ssl.certificate.location`: the client's certificate (PEM), for brokers that
    /// require one.
    pub ssl_certificate_location: Option<String>,
    /// `ssl.key.location`: the client certificate's private key (PEM).
    pub ssl_key_location: Option<String>,
    /// `ssl.key.password`: the passphrase of an encrypted `ssl.key.location`.
    pub ssl_key_password: Option<String>,
    /// `ssl.endpoint.identification.algorithm` (`None`: librdkafka's default, `https`).
    pub ssl_endpoint_identification: Option<EndpointIdentification>,
}

impl std::fmt::Debug for KafkaSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mask = |s: &Option<String>| s.as_ref().map(|_| idem_core::redact::MASK);
        f.debug_struct("KafkaSecurity")
            .field("protocol", &self.protocol)
            .field("sasl_mechanism", &self.sasl_mechanism)
            .field("sasl_username", &self.sasl_username)
            .field("sasl_password", &mask(&self.sasl_password))
            .field("ssl_ca_location", &self.ssl_ca_location)
            .field("ssl_certificate_location", &self.ssl_certificate_location)
            .field("ssl_key_location", &self.ssl_key_location)
            .field("ssl_key_password", &mask(&self.ssl_key_password))
            .field(
                "ssl_endpoint_identification",
                &self.ssl_endpoint_identification,
            )
            .finish()
    }
}

impl KafkaSecurity {
    /// TLS with the system's CAs (`security.protocol=ssl`).
    pub fn ssl() -> Self {
        Self {
            protocol: SecurityProtocol::Ssl,
            ..Self::default()
        }
    }

    /// SASL with `mechanism`, `username` and `password`, over TLS when `tls`
    /// (`sasl_ssl`), else over plain TCP (`sasl_plaintext`).
    pub fn sasl(
        tls: bool,
        mechanism: SaslMechanism,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        Self {
            protocol: if tls {
                SecurityProtocol::SaslSsl
            } else {
                SecurityProtocol::SaslPlaintext
            },
            sasl_mechanism: mechanism,
            sasl_username: Some(username.into()),
            sasl_password: Some(password.into()),
            ..Self::default()
        }
    }

    /// Sets `ssl.ca.location`.
    #[must_use]
    pub fn with_ca_location(mut self, path: impl Into<String>) -> Self {
        self.ssl_ca_location = Some(path.into());
        self
    }

    /// Sets the client certificate and its key (`ssl.certificate.location`,
    /// `ssl.key.location`), and the key's passphrase if it has one.
    #[must_use]
    pub fn with_client_certificate(
        mut self,
        certificate: impl Into<String>,
        key: impl Into<String>,
        key_password: Option<String>,
    ) -> Self {
        self.ssl_certificate_location = Some(certificate.into());
        self.ssl_key_location = Some(key.into());
        self.ssl_key_password = key_password;
        self
    }

    /// Sets `ssl.endpoint.identification.algorithm`.
    #[must_use]
    pub fn with_endpoint_identification(mut self, check: EndpointIdentification) -> Self {
        self.ssl_endpoint_identification = Some(check);
        self
    }

    /// Puts these settings into a librdkafka configuration, under librdkafka's names.
    /// The SASL settings go in only with a SASL protocol, the `ssl.` ones only with TLS.
    pub fn apply(&self, c: &mut ClientConfig) {
        c.set("security.protocol", self.protocol.as_str());
        if self.protocol.is_sasl() {
            c.set("sasl.mechanism", self.sasl_mechanism.as_str());
            for (key, value) in [
                ("sasl.username", &self.sasl_username),
                ("sasl.password", &self.sasl_password),
            ] {
                if let Some(v) = value {
                    c.set(key, v);
                }
            }
        }
        if self.protocol.is_tls() {
            for (key, value) in [
                ("ssl.ca.location", &self.ssl_ca_location),
                ("ssl.certificate.location", &self.ssl_certificate_location),
                ("ssl.key.location", &self.ssl_key_location),
                ("ssl.key.password", &self.ssl_key_password),
            ] {
                if let Some(v) = value {
                    c.set(key, v);
                }
            }
            if let Some(e) = self.ssl_endpoint_identification {
                c.set("ssl.endpoint.identification.algorithm", e.as_str());
            }
        }
    }
}
