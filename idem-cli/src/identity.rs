//! `--identity`: what identifies any message, and the key derived from it.
//!
//! A spec is one or two *sources*, separated by a comma:
//!
//! - `/a/b`: an RFC 6901 JSON pointer into the body (a JSON document);
//! - `header:NAME`: the first header named `NAME` (ASCII case-insensitive);
//! - `message-id`: the publisher's message id — the `message-id` header (RabbitMQ's
//!   `message_id` property) or `Nats-Msg-Id` (NATS), whichever comes first.
//!
//! The first source gives the *subject*, the second the *second part*; with one source
//! the second part is the fixed text [`SINGLE_PART`] (`-`). The key is the reference
//! derivation of the three: [`IdempotencyKey::derive`]`(subject, second, body)`, i.e.
//! `sha256_hex("{subject}|{second}|{sha256_hex(body)}")`. So `/award_id,/submission_timestamp`
//! gives a grant submission exactly the grant handler's key (the seed vectors).
//!
//! A source's value: a JSON string is its text; a JSON integer (no fraction, no exponent,
//! within 64 bits) is its decimal digits; a header is its text. Anything else is refused
//! with a [`RejectReason`] (dead-lettered, never retried): a missing, `null` or empty value
//! `missing_field`; `true`/`false`, an object, an array or a fractional number `wrong_type`;
//! a control character (U+0000 to U+001F, U+007F) `control_character`; a subject over 256
//! bytes or a second part over 64 `too_long`; a subject containing `|` `invalid_identity`.

use idem_engine::{Headers, IdempotencyKey, RejectReason};
use serde_json::Value;

/// The second part of the key when `--identity` names one source.
pub(crate) const SINGLE_PART: &str = "-";
/// The longest subject accepted, in bytes (as the grant handler's `award_id`).
pub(crate) const MAX_SUBJECT_BYTES: usize = idem_grant::MAX_AWARD_ID_BYTES;
/// The longest second part accepted, in bytes (as the grant handler's timestamp).
pub(crate) const MAX_SECOND_BYTES: usize = idem_grant::MAX_TIMESTAMP_BYTES;

/// Where one part of a message's identity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    /// An RFC 6901 JSON pointer into the body (it starts with `/`).
    Pointer(String),
    /// The first header of this name (ASCII case-insensitive).
    Header(String),
    /// The publisher's message id: the `message-id` or `Nats-Msg-Id` header.
    MessageId,
}

impl Source {
    fn parse(s: &str) -> Result<Self, String> {
        if s.starts_with('/') {
            Ok(Self::Pointer(s.to_owned()))
        } else if let Some(name) = s.strip_prefix("header:") {
            if name.is_empty() {
                return Err("`header:` needs a header name".into());
            }
            Ok(Self::Header(name.to_owned()))
        } else if s == "message-id" {
            Ok(Self::MessageId)
        } else {
            Err(format!(
                "{s:?} is not an identity source: use a JSON pointer (/order_id), \
                 header:NAME or message-id"
            ))
        }
    }

    /// How the source is named in a reason.
    fn name(&self) -> String {
        match self {
            Self::Pointer(p) => format!("`{p}`"),
            Self::Header(h) => format!("header `{h}`"),
            Self::MessageId => "the message id".to_owned(),
        }
    }

    /// The source's value in this message: never the value itself in the error.
    fn value<'a>(
        &self,
        body: Option<&'a Value>,
        headers: &'a Headers,
    ) -> Result<std::borrow::Cow<'a, str>, RejectReason> {
        let missing = || RejectReason::new("missing_field", format!("{} is missing", self.name()));
        let text = match self {
            Self::Pointer(p) => match body.and_then(|b| b.pointer(p)) {
                None | Some(Value::Null) => return Err(missing()),
                Some(Value::String(s)) => std::borrow::Cow::Borrowed(s.as_str()),
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                    std::borrow::Cow::Owned(n.to_string())
                }
                Some(other) => {
                    let kind = match other {
                        Value::Bool(_) => "a boolean",
                        Value::Number(_) => "a number that is not an integer",
                        Value::Array(_) => "an array",
                        _ => "an object",
                    };
                    return Err(RejectReason::new(
                        "wrong_type",
                        format!(
                            "{} is {kind}: it must be a string or an integer",
                            self.name()
                        ),
                    ));
                }
            },
            Self::Header(name) => header(headers, name)
                .map(std::borrow::Cow::Borrowed)
                .ok_or_else(missing)?,
            Self::MessageId => header(headers, "message-id")
                .or_else(|| header(headers, "Nats-Msg-Id"))
                .map(std::borrow::Cow::Borrowed)
                .ok_or_else(missing)?,
        };
        if text.is_empty() {
            return Err(RejectReason::new(
                "missing_field",
                format!("{} is empty", self.name()),
            ));
        }
        Ok(text)
    }
}

/// The first header named `name`, ASCII case-insensitive.
fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// A parsed `--identity`: a subject source and an optional second one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IdentitySpec {
    subject: Source,
    second: Option<Source>,
}

/// A message's identity and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identified {
    /// The idempotency key.
    pub(crate) key: IdempotencyKey,
    /// The subject (stored with the claim; `idem inspect --subject`).
    pub(crate) subject: String,
    /// The second part ([`SINGLE_PART`] with one source).
    pub(crate) second: String,
}

impl std::str::FromStr for IdentitySpec {
    type Err = String;

    /// `SOURCE[,SOURCE]`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let subject = Source::parse(parts.next().unwrap_or(""))?;
        let second = parts.next().map(Source::parse).transpose()?;
        if parts.next().is_some() {
            return Err("--identity takes one or two sources (SUBJECT[,SECOND])".into());
        }
        Ok(Self { subject, second })
    }
}

impl IdentitySpec {
    /// The identity and key of a message whose body is `raw` (`body`: `raw` parsed as
    /// JSON, when it is JSON).
    ///
    /// # Errors
    /// A [`RejectReason`] as the module docs list; it never quotes a value.
    pub(crate) fn identify(
        &self,
        raw: &[u8],
        body: Option<&Value>,
        headers: &Headers,
    ) -> Result<Identified, RejectReason> {
        let subject = self.subject.value(body, headers)?;
        storable(&self.subject, &subject, MAX_SUBJECT_BYTES)?;
        let second = match &self.second {
            Some(source) => {
                let v = source.value(body, headers)?;
                storable(source, &v, MAX_SECOND_BYTES)?;
                v
            }
            None => std::borrow::Cow::Borrowed(SINGLE_PART),
        };
        let key = IdempotencyKey::derive(&subject, &second, raw)?;
        Ok(Identified {
            key,
            subject: subject.into_owned(),
            second: second.into_owned(),
        })
    }
}

/// Refuses a value no store holds as an identity: control characters (the position is
/// named, never the value) and values over `max` bytes.
fn storable(source: &Source, value: &str, max: usize) -> Result<(), RejectReason> {
    if let Some(at) = value.chars().position(|c| c.is_ascii_control()) {
        return Err(RejectReason::new(
            "control_character",
            format!(
                "{} contains a control character (at character {at})",
                source.name()
            ),
        ));
    }
    if value.len() > max {
        return Err(RejectReason::new(
            "too_long",
            format!(
                "{} is {} bytes, over the {max}-byte limit",
                source.name(),
                value.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> IdentitySpec {
        s.parse().expect("a valid spec")
    }

    fn id(
        spec_text: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> Result<Identified, RejectReason> {
        let value: Option<Value> = serde_json::from_str(body).ok();
        let headers: Headers = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        spec(spec_text).identify(body.as_bytes(), value.as_ref(), &headers)
    }

    fn code(spec_text: &str, body: &str) -> &'static str {
        id(spec_text, body, &[]).expect_err("refused").code
    }

    #[test]
    fn specs_parse_and_bad_ones_are_refused() {
        assert_eq!(
            spec("/order_id,/created_at"),
            IdentitySpec {
                subject: Source::Pointer("/order_id".into()),
                second: Some(Source::Pointer("/created_at".into())),
            }
        );
        assert_eq!(
            spec("header:X-Order,message-id"),
            IdentitySpec {
                subject: Source::Header("X-Order".into()),
                second: Some(Source::MessageId),
            }
        );
        for bad in ["", "order_id", "/a,/b,/c", "header:", "/a,", "message_id"] {
            assert!(bad.parse::<IdentitySpec>().is_err(), "{bad:?} accepted");
        }
    }

    /// The general rule gives a grant submission the grant handler's key: the seed
    /// vector of `IdempotencyKey::derive`, byte for byte.
    #[test]
    fn the_grant_identity_gives_the_reference_key() {
        let body = r#"{"award_id":"A-2026-014","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":100}"#;
        let got = id("/award_id,/submission_timestamp", body, &[]).expect("identified");
        let grant = idem_grant::parse_submission(body.as_bytes(), 1 << 20).expect("a grant");
        assert_eq!(got.key, grant.key);
        assert_eq!(got.subject, "A-2026-014");
        // And the seed vector itself ("{...}" is its payload).
        let got = id(
            "header:a,header:t",
            "{...}",
            &[("A", "A-2026-014"), ("t", "2026-07-01T09:00:00Z")],
        )
        .expect("identified");
        assert_eq!(
            got.key.to_hex(),
            "d3ed6c4d8acb11aa58dcdb03e400559b1e415626580e4a00466ae631bea74acd"
        );
    }

    /// One source: the second part is `-`; an integer is its decimal digits. The vector
    /// is the one docs/architecture.md shows.
    #[test]
    fn one_source_pins_its_vector() {
        let body = r#"{"order_id":7,"amount":"12.50"}"#;
        let got = id("/order_id", body, &[]).expect("identified");
        assert_eq!((got.subject.as_str(), got.second.as_str()), ("7", "-"));
        assert_eq!(
            got.key,
            IdempotencyKey::derive("7", "-", body.as_bytes()).expect("key")
        );
        assert_eq!(
            got.key.to_hex(),
            "f7ecd3487e0ea3d8e12e0c6f5a4b478708012009bfd52e114e3eb9505a7ef545"
        );
        // A string "7" is the same subject as the integer 7, and nested pointers work.
        let nested = id("/o/id", r#"{"o":{"id":"7"}}"#, &[]).expect("identified");
        assert_eq!(nested.subject, "7");
    }

    #[test]
    fn headers_and_the_message_id() {
        let h = [("Nats-Msg-Id", "m-1"), ("x-tenant", "t9")];
        let got = id("message-id,header:X-Tenant", "{}", &h).expect("identified");
        assert_eq!((got.subject.as_str(), got.second.as_str()), ("m-1", "t9"));
        let rabbit = id("message-id", "not json at all", &[("message-id", "r-1")]);
        assert_eq!(rabbit.expect("identified").subject, "r-1");
        assert_eq!(
            id("message-id", "{}", &[]).unwrap_err().code,
            "missing_field"
        );
    }

    #[test]
    fn every_bad_value_has_its_code() {
        assert_eq!(code("/order_id", r#"{"other":1}"#), "missing_field");
        assert_eq!(code("/order_id", r#"{"order_id":null}"#), "missing_field");
        assert_eq!(code("/order_id", r#"{"order_id":""}"#), "missing_field");
        assert_eq!(code("/order_id", "not json"), "missing_field");
        assert_eq!(code("/order_id", r#"{"order_id":true}"#), "wrong_type");
        assert_eq!(code("/order_id", r#"{"order_id":1.5}"#), "wrong_type");
        assert_eq!(code("/order_id", r#"{"order_id":1e3}"#), "wrong_type");
        assert_eq!(code("/order_id", r#"{"order_id":[1]}"#), "wrong_type");
        assert_eq!(code("/order_id", r#"{"order_id":{"a":1}}"#), "wrong_type");
        assert_eq!(
            code("/order_id", r#"{"order_id":"A|B"}"#),
            "invalid_identity"
        );
        assert_eq!(
            code("/order_id", r#"{"order_id":"A\u0000"}"#),
            "control_character"
        );
        let long = format!(r#"{{"order_id":"{}"}}"#, "x".repeat(MAX_SUBJECT_BYTES + 1));
        assert_eq!(code("/order_id", &long), "too_long");
        // `|` is allowed in the second part, as in the reference derivation.
        assert!(id("/a,/b", r#"{"a":"x","b":"p|q"}"#, &[]).is_ok());
        assert_eq!(code("/a,/b", r#"{"a":"x","b":""}"#), "missing_field");
        // No reason quotes the value.
        let r = id("/order_id", r#"{"order_id":"secret|value"}"#, &[]).unwrap_err();
        assert!(!r.detail.contains("secret"), "{r}");
    }
}
