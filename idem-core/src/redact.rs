//! One way to show a connection URL without its secrets: every line, error, report and
//! `Debug` of idem that shows a URL goes through [`redact_url`] (or its [`Redacted`]
//! wrapper).
//!
//! Hidden, each replaced by [`MASK`]:
//! - the password of the userinfo (`user:pass@` becomes `user:***@`; the user stays). A
//!   userinfo without a password stays too, except on `nats://` and `tls://`, where a
//!   lone user is a token (`nats://TOKEN@host`);
//! - the value of every query parameter that names a secret ([`is_secret_param`]:
//!   `password`, `token`, `sasl.password`, AWS keys, …), whatever its case or
//!   percent-encoding;
//! - the same parameters in a `key=value key=value` connection string.
//!
//! The function never fails: a string that is no URL (a bare path, `sqlite:file.db`, a
//! Kafka bootstrap list) comes back unchanged unless it holds something of the above.
//! It errs on the side of hiding: a path with `host:x@y` in it loses `x`. What it
//! returns is for people to read, never to connect with.
//!
//! ```
//! use idem_core::redact::{redact_url, Redacted};
//! assert_eq!(
//!     redact_url("postgres://app:s3cr%40t@db.internal:5432/grants?sslmode=require&password=x"),
//!     "postgres://app:***@db.internal:5432/grants?sslmode=require&password=***"
//! );
//! assert_eq!(redact_url("sqlite://grants.db"), "sqlite://grants.db");
//! assert_eq!(
//!     format!("{}", Redacted("amqp://guest:guest@127.0.0.1:5672/%2f")),
//!     "amqp://guest:***@127.0.0.1:5672/%2f"
//! );
//! ```

use std::borrow::Cow;
use std::fmt;

/// What a hidden secret is replaced with.
pub const MASK: &str = "***";

/// Parameter names that are secrets, compared without regard to case (after
/// percent-decoding). [`is_secret_param`] also takes any name containing `password`,
/// `passwd`, `secret`, `token`, `credential` or `access_key`.
pub const SECRET_PARAMS: &[&str] = &[
    "password",
    "pass",
    "passwd",
    "pwd",
    "token",
    "auth_token",
    "secret",
    "sasl.password",
    "sasl_password",
    "aws_secret_access_key",
    "secret_access_key",
    "access_key_id",
    "aws_access_key_id",
    "session_token",
    "aws_session_token",
    "sslpassword",
    "nkey",
    "seed",
    "creds",
    "credentials",
    "jwt",
    "api_key",
    "apikey",
];

/// Whether a URL query parameter (or connection-string key) named `name` holds a secret.
///
/// `name` may be percent-encoded and in any case.
///
/// ```
/// use idem_core::redact::is_secret_param;
/// assert!(is_secret_param("sasl.password"));
/// assert!(is_secret_param("AWS_Secret_Access_Key"));
/// assert!(is_secret_param("sasl%2Epassword"));
/// assert!(is_secret_param("ssl.key.password"));
/// assert!(!is_secret_param("sslmode"));
/// assert!(!is_secret_param("queue_type"));
/// ```
pub fn is_secret_param(name: &str) -> bool {
    let name = percent_decode(name).to_ascii_lowercase();
    let name = name.trim();
    SECRET_PARAMS.contains(&name)
        || [
            "password",
            "passwd",
            "secret",
            "token",
            "credential",
            "access_key",
            "accesskey",
        ]
        .iter()
        .any(|s| name.contains(s))
}

/// `url` with its secrets replaced by [`MASK`] (the module docs list what is hidden);
/// borrowed, unchanged, when it holds none. Never fails, whatever `url` is.
pub fn redact_url(url: &str) -> Cow<'_, str> {
    let pieces = pieces(url);
    if !pieces.iter().any(|p| matches!(p, Piece::Secret(_))) {
        return Cow::Borrowed(url);
    }
    let mut out = String::with_capacity(url.len());
    for p in pieces {
        out.push_str(match p {
            Piece::Keep(s) => s,
            Piece::Secret(_) => MASK,
        });
    }
    Cow::Owned(out)
}

/// The secrets of `url` that [`redact_url`] hides, each as written and percent-decoded
/// (without repeats or empty ones): for a log writer that masks them wherever a library
/// prints them (a driver's debug line with the parsed URL in it).
///
/// ```
/// use idem_core::redact::secrets_in;
/// assert_eq!(
///     secrets_in("postgres://app:s3cr%40t@db/grants?sslmode=require&token=abc"),
///     ["s3cr%40t", "s3cr@t", "abc"]
/// );
/// assert_eq!(secrets_in("nats://T0KEN@127.0.0.1:4222"), ["T0KEN"]);
/// assert!(secrets_in("amqp://guest@127.0.0.1").is_empty());
/// ```
pub fn secrets_in(url: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for p in pieces(url) {
        if let Piece::Secret(s) = p {
            for form in [s.to_owned(), percent_decode(s)] {
                if !form.is_empty() && !out.contains(&form) {
                    out.push(form);
                }
            }
        }
    }
    out
}

/// A part of a URL: kept as it is, or a secret.
enum Piece<'a> {
    Keep(&'a str),
    Secret(&'a str),
}

/// `url` cut into what is kept and what is secret, in order (the module docs list what
/// is secret).
fn pieces(url: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    // Where the authority starts: after `scheme://`, else at the start.
    let (scheme, start) = match url.find("://") {
        Some(i) => (&url[..i], i + 3),
        None => ("", 0),
    };
    let rest = &url[start..];
    let token_user = matches!(scheme.to_ascii_lowercase().as_str(), "nats" | "tls");
    // The userinfo ends at the last `@` before the query; failing that, at the last `@`
    // of a prefix that reads as no query (no `=` or `&`: a password with a raw `?` or `#`).
    let query_at = rest.find(['?', '#']).unwrap_or(rest.len());
    let at = rest[..query_at].rfind('@').or_else(|| {
        rest.rfind('@')
            .filter(|&i| !rest[..i].contains(['=', '&', ' ']))
    });
    let mut tail_from = 0;
    if let Some(at) = at {
        let userinfo = &rest[..at];
        match userinfo.find(':') {
            Some(colon) => {
                out.push(Piece::Keep(&url[..start + colon + 1]));
                out.push(Piece::Secret(&userinfo[colon + 1..]));
                tail_from = start + at;
            }
            None if token_user && !userinfo.is_empty() => {
                out.push(Piece::Keep(&url[..start]));
                out.push(Piece::Secret(userinfo));
                tail_from = start + at;
            }
            None => {}
        }
    }
    let tail = &url[tail_from..];
    // The parameters: the query of a URL, or the whole of a `key=value …` string.
    let params_from = if start > 0 || tail.contains('?') {
        tail.find('?').map(|i| i + 1)
    } else if tail.contains('=') {
        Some(0)
    } else {
        None
    };
    match params_from {
        Some(p) => {
            out.push(Piece::Keep(&tail[..p]));
            param_pieces(&tail[p..], &mut out);
        }
        None => out.push(Piece::Keep(tail)),
    }
    out
}

/// `params` (`k=v` separated by `&`, `;` or whitespace, up to a `#`) cut into pieces, each
/// secret value a [`Piece::Secret`].
fn param_pieces<'a>(params: &'a str, out: &mut Vec<Piece<'a>>) {
    let mut rest = params;
    while !rest.is_empty() {
        // Separators and a fragment are kept as they are.
        if let Some(c) = rest.chars().next() {
            if c == '&' || c == ';' || c.is_whitespace() {
                out.push(Piece::Keep(&rest[..c.len_utf8()]));
                rest = &rest[c.len_utf8()..];
                continue;
            }
            if c == '#' {
                out.push(Piece::Keep(rest));
                break;
            }
        }
        let end = rest
            .find(|c: char| c == '&' || c == ';' || c == '#' || c.is_whitespace())
            .unwrap_or(rest.len());
        let pair = &rest[..end];
        match pair.split_once('=') {
            Some((k, v)) if is_secret_param(k) && !v.is_empty() => {
                out.push(Piece::Keep(&pair[..k.len() + 1]));
                out.push(Piece::Secret(v));
            }
            _ => out.push(Piece::Keep(pair)),
        }
        rest = &rest[end..];
    }
}

/// `s` with `%XX` escapes decoded (invalid ones kept as written, `+` as a space, as in
/// a query string; bytes that are no UTF-8 replaced).
fn percent_decode(s: &str) -> String {
    let plus_as_space = s.replace('+', " ");
    percent_encoding::percent_decode_str(&plus_as_space)
        .decode_utf8_lossy()
        .into_owned()
}

/// A URL shown through [`redact_url`]: `Display` writes it redacted, `Debug` as a quoted
/// string, redacted. For `Debug` impls and format strings:
///
/// ```
/// use idem_core::redact::Redacted;
/// let url = "redis://:hunter2@127.0.0.1:6379";
/// assert_eq!(format!("{:?}", Redacted(url)), r#""redis://:***@127.0.0.1:6379""#);
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Redacted<'a>(pub &'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(self.0))
    }
}

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*redact_url(self.0), f)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn redact_userinfo_password_keeps_the_user() {
        for (url, want) in [
            (
                "amqp://guest:secret@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            ("redis://:secret@h:6379/0", "redis://:***@h:6379/0"),
            ("postgres://u:p%40ss%3Aw@h/db", "postgres://u:***@h/db"),
            // raw `@`, `:`, `/`, `?` and `#` in the password
            ("postgres://u:p@ss:w@h/db", "postgres://u:***@h/db"),
            ("postgres://u:p/ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:p?ss#x@h/db", "postgres://u:***@h/db"),
            (
                "postgres://u:pw@[::1]:5432/db",
                "postgres://u:***@[::1]:5432/db",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("nats://s3cr3t@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
            ("tls://u:p@127.0.0.1:4222", "tls://u:***@127.0.0.1:4222"),
            ("user:pass@host:5432", "user:***@host:5432"),
            (
                "redis-cluster://u:pw@a:1,b:2?node=c:3",
                "redis-cluster://u:***@a:1,b:2?node=c:3",
            ),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }

    #[test]
    fn redact_secret_parameters_of_any_case() {
        for (url, want) in [
            (
                "postgres://h/db?password=x&sslmode=require",
                "postgres://h/db?password=***&sslmode=require",
            ),
            ("postgres://h/db?PassWord=x", "postgres://h/db?PassWord=***"),
            (
                "kafka://h:9092?sasl.password=x&sasl.username=u",
                "kafka://h:9092?sasl.password=***&sasl.username=u",
            ),
            ("kafka://h:9092?sasl%2Epassword=x", "kafka://h:9092?sasl%2Epassword=***"),
            ("nats://h?token=x#frag", "nats://h?token=***#frag"),
            (
                "sqs://q?aws_access_key_id=A&aws_secret_access_key=B&aws_session_token=C&region=r",
                "sqs://q?aws_access_key_id=***&aws_secret_access_key=***&aws_session_token=***&region=r",
            ),
            ("postgres://h/db?sslpassword=x", "postgres://h/db?sslpassword=***"),
            ("nats://h?nkey=SU&creds=/x", "nats://h?nkey=***&creds=***"),
            ("sqlite:file.db?password=x", "sqlite:file.db?password=***"),
            (
                "host=h password=x dbname=d",
                "host=h password=*** dbname=d",
            ),
            (
                "postgres://u:pw@h/db?options=a@b&password=x",
                "postgres://u:***@h/db?options=a@b&password=***",
            ),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }

    #[test]
    fn redact_leaves_what_holds_no_secret() {
        for s in [
            "",
            "sqlite://grants.db",
            "sqlite:file.db",
            "/var/lib/idem/grants.db",
            "memory://",
            "postgres://[::1]:5432/db?sslmode=disable",
            "kafka://h1:9092,h2:9092?group=g",
            "not a url at all",
            "a@b",
            "postgres:///db?host=/run/postgresql",
            "http://h/?password=",
        ] {
            assert!(matches!(redact_url(s), Cow::Borrowed(_)), "{s}");
            assert_eq!(redact_url(s), s);
        }
    }

    /// A password made of characters a URL holds raw or encoded, with a distinctive start.
    fn password() -> impl Strategy<Value = String> {
        "[A-Za-z0-9@:/?#%&=+!$~*._-]{0,24}".prop_map(|s| format!("Zq9{s}"))
    }

    fn encode(s: &str) -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn redact_never_panics_and_is_idempotent(s in ".{0,64}") {
            let once = redact_url(&s).into_owned();
            prop_assert_eq!(redact_url(&once), once.as_str());
        }

        #[test]
        fn redact_hides_a_userinfo_password(
            pw in password(),
            raw in any::<bool>(),
            host in prop::sample::select(vec!["db.internal", "127.0.0.1", "[::1]"]),
            tail in prop::sample::select(vec!["", "/db", "/db?sslmode=require", "?x=a@b"]),
            scheme in prop::sample::select(vec!["postgres", "amqp", "redis", "nats", "kafka"]),
        ) {
            let pw = if raw { pw.replace(['&', '=', '#', '?'], "") } else { encode(&pw) };
            prop_assume!(pw.len() > 3);
            let url = format!("{scheme}://app:{pw}@{host}:1234{tail}");
            let r = redact_url(&url);
            prop_assert!(!r.contains(&pw), "{} -> {}", url, r);
            let user = "app:***@".to_owned() + host;
            prop_assert!(r.contains(&user), "{} -> {}", url, r);
        }

        #[test]
        fn redact_hides_every_secret_parameter(
            pw in "Zq9[A-Za-z0-9%._~+-]{4,24}",
            i in 0..SECRET_PARAMS.len(),
            upper in proptest::collection::vec(any::<bool>(), 32),
            before in prop::sample::select(vec!["", "sslmode=require&", "group=g;"]),
            after in prop::sample::select(vec!["", "&queue_type=quorum", "#f"]),
        ) {
            let name: String = SECRET_PARAMS[i]
                .chars()
                .zip(upper.iter().cycle())
                .map(|(c, &u)| if u { c.to_ascii_uppercase() } else { c })
                .collect();
            let url = format!("scheme://h:1/p?{before}{name}={pw}{after}");
            let r = redact_url(&url);
            prop_assert!(!r.contains(&pw), "{} -> {}", url, r);
            let want = format!("{name}={MASK}");
            prop_assert!(r.contains(&want), "{} -> {}", url, r);
        }
    }
}
