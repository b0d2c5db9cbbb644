//! Reading a URL's settings: refused values, percent-decoding, and the security it asks for.

use super::security::{EndpointIdentification, KafkaSecurity, SaslMechanism, SecurityProtocol};
use crate::any::BrokerUrl;
use crate::BrokerError;

/// A refused setting; a secret's value is never kept, so neither `Display` nor `Debug`
/// of the error can show it.
pub(super) fn refuse(param: &str, value: &str, reason: impl Into<String>) -> BrokerError {
    BrokerError::InvalidParam {
        param: param.to_owned(),
        value: if idem_core::redact::is_secret_param(param) {
            idem_core::redact::MASK.to_owned()
        } else {
            value.to_owned()
        },
        reason: reason.into(),
    }
}

/// A setting that must not be empty.
fn not_empty(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("must not be empty".to_owned())
    } else {
        Ok(s.to_owned())
    }
}

/// `%XX` escapes decoded (a userinfo's user and password): a `%` without two hex digits
/// stays as written, bytes that are not UTF-8 become U+FFFD.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The user and password of a URL's `user:password@` (decoded; an empty one is none).
fn userinfo(url: &str) -> (Option<String>, Option<String>) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let Some((info, _)) = authority.rsplit_once('@') else {
        return (None, None);
    };
    let (user, password) = match info.split_once(':') {
        Some((u, p)) => (u, Some(p)),
        None => (info, None),
    };
    let some = |s: &str| Some(percent_decode(s)).filter(|s| !s.is_empty());
    (some(user), password.and_then(some))
}

/// The TLS and SASL settings of a `kafka://` or `kafkas://` URL (the second table of
/// [`KafkaConfig`]), checked against each other.
pub(super) fn security_of_url(url: &BrokerUrl) -> Result<KafkaSecurity, BrokerError> {
    let client = url.client_url();
    let tls_scheme = client
        .get(.."kafkas://".len())
        .is_some_and(|s| s.eq_ignore_ascii_case("kafkas://"));
    let given: Option<SecurityProtocol> = url.setting("security.protocol", str::parse)?;
    let mechanism: Option<SaslMechanism> = url.setting("sasl.mechanism", str::parse)?;
    let (info_user, info_password) = userinfo(client);
    let mut username = url.setting("sasl.username", not_empty)?;
    let mut password = url.setting("sasl.password", not_empty)?;
    for (param, from_info, from_query) in [
        ("sasl.username", info_user, &mut username),
        ("sasl.password", info_password, &mut password),
    ] {
        if let Some(v) = from_info {
            if let Some(q) = from_query {
                return Err(refuse(
                    param,
                    q,
                    "given twice: in the URL's user:password@ and as a parameter",
                ));
            }
            *from_query = Some(v);
        }
    }
    let mut s = KafkaSecurity {
        sasl_mechanism: mechanism.unwrap_or_default(),
        sasl_username: username,
        sasl_password: password,
        ssl_ca_location: url.setting("ssl.ca.location", not_empty)?,
        ssl_certificate_location: url.setting("ssl.certificate.location", not_empty)?,
        ssl_key_location: url.setting("ssl.key.location", not_empty)?,
        ssl_key_password: url.setting("ssl.key.password", not_empty)?,
        ssl_endpoint_identification: url
            .setting("ssl.endpoint.identification.algorithm", str::parse)?,
        ..KafkaSecurity::default()
    };
    // The first SASL and the first TLS setting given, by name and value as shown.
    let sasl_given = [
        ("sasl.mechanism", mechanism.map(SaslMechanism::as_str)),
        ("sasl.username", s.sasl_username.as_deref()),
        ("sasl.password", s.sasl_password.as_deref()),
    ]
    .into_iter()
    .find_map(|(k, v)| v.map(|v| (k, v)));
    let endpoint = s
        .ssl_endpoint_identification
        .map(EndpointIdentification::as_str);
    let ssl_given = [
        ("ssl.ca.location", s.ssl_ca_location.as_deref()),
        (
            "ssl.certificate.location",
            s.ssl_certificate_location.as_deref(),
        ),
        ("ssl.key.location", s.ssl_key_location.as_deref()),
        ("ssl.key.password", s.ssl_key_password.as_deref()),
        ("ssl.endpoint.identification.algorithm", endpoint),
    ]
    .into_iter()
    .find_map(|(k, v)| v.map(|v| (k, v)));
    s.protocol = match given {
        Some(p) if tls_scheme && !p.is_tls() => {
            return Err(refuse(
                "security.protocol",
                p.as_str(),
                "kafkas:// is TLS: ssl or sasl_ssl (or a kafka:// URL)",
            ))
        }
        Some(p) => p,
        None if tls_scheme && sasl_given.is_some() => SecurityProtocol::SaslSsl,
        None if tls_scheme => SecurityProtocol::Ssl,
        None if sasl_given.is_some() => {
            return Err(refuse(
                "security.protocol",
                "plaintext (the default of kafka://)",
                "SASL credentials are given: use kafkas:// or security.protocol=sasl_ssl, \
                 or security.protocol=sasl_plaintext to send them over plain TCP",
            ))
        }
        None => SecurityProtocol::Plaintext,
    };
    let p = s.protocol.as_str();
    if let Some((k, v)) = sasl_given.filter(|_| !s.protocol.is_sasl()) {
        return Err(refuse(
            k,
            v,
            format!("needs security.protocol sasl_plaintext or sasl_ssl, not {p}"),
        ));
    }
    if let Some((k, v)) = ssl_given.filter(|_| !s.protocol.is_tls()) {
        return Err(refuse(
            k,
            v,
            format!("needs security.protocol ssl or sasl_ssl (or kafkas://), not {p}"),
        ));
    }
    if s.protocol.is_sasl() {
        let m = s.sasl_mechanism.as_str();
        if s.sasl_username.is_none() {
            return Err(refuse(
                "sasl.username",
                "",
                format!("{p} with {m} needs a user: sasl.username, or user:password@ in the URL"),
            ));
        }
        if s.sasl_password.is_none() {
            return Err(refuse(
                "sasl.password",
                "",
                format!(
                    "{p} with {m} needs a password: sasl.password, or user:password@ in the URL"
                ),
            ));
        }
    }
    match (&s.ssl_certificate_location, &s.ssl_key_location) {
        (Some(c), None) => {
            return Err(refuse(
                "ssl.certificate.location",
                c,
                "a client certificate needs its key: ssl.key.location",
            ))
        }
        (None, Some(k)) => {
            return Err(refuse(
                "ssl.key.location",
                k,
                "a client key needs its certificate: ssl.certificate.location",
            ))
        }
        _ => {}
    }
    if s.ssl_key_password.is_some() && s.ssl_key_location.is_none() {
        return Err(refuse(
            "ssl.key.password",
            "",
            "a key passphrase needs the key: ssl.key.location",
        ));
    }
    Ok(s)
}
