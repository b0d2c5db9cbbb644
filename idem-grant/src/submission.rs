//! The submission wire format.

use crate::canonical::{canonical_json, KeyDerivation};
use idem_engine::{IdempotencyKey, RejectReason, Submission};
use serde_json::Value;

/// The default body size limit: 1 MiB.
pub const DEFAULT_MAX_BODY: usize = 1 << 20;

/// The longest `award_id` accepted, in bytes of UTF-8: 256.
///
/// Far below what any store can index (a Postgres btree entry holds at most about 2700
/// bytes; `processed_messages.award_id` is indexed for `idem inspect --award-id`), so a
/// submission that parses is one every store can hold. Longer ids are refused as bad
/// input (`too_long`) before the claim.
pub const MAX_AWARD_ID_BYTES: usize = 256;

/// The longest `submission_timestamp` accepted, in bytes: 64 (an RFC 3339 timestamp with
/// nanoseconds and an offset is 35).
pub const MAX_TIMESTAMP_BYTES: usize = 64;

/// A parsed grant submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The award id (the subject of the key).
    pub award_id: String,
    /// The submission timestamp, exactly as sent (part of the key).
    pub submission_timestamp: String,
    /// The amount to disburse, in cents (non-negative).
    pub amount_cents: i64,
}

fn field<'a>(obj: &'a serde_json::Map<String, Value>, name: &str) -> Result<&'a str, RejectReason> {
    match obj.get(name) {
        None | Some(Value::Null) => Err(RejectReason::new(
            "missing_field",
            format!("`{name}` is missing"),
        )),
        Some(Value::String(s)) if s.is_empty() => Err(RejectReason::new(
            "missing_field",
            format!("`{name}` is empty"),
        )),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(RejectReason::new(
            "wrong_type",
            format!("`{name}` must be a string"),
        )),
    }
}

/// Refuses an identity field that a store could not hold: control characters (the
/// position is given, never the value) and values over `max` bytes.
fn storable(name: &str, value: &str, max: usize) -> Result<(), RejectReason> {
    // U+0000..=U+001F and U+007F; C1 controls are valid text that every store holds.
    if let Some(at) = value.chars().position(|c| c.is_ascii_control()) {
        return Err(RejectReason::new(
            "control_character",
            format!("`{name}` contains a control character (at character {at})"),
        ));
    }
    if value.len() > max {
        return Err(RejectReason::new(
            "too_long",
            format!(
                "`{name}` is {} bytes, over the {max}-byte limit",
                value.len()
            ),
        ));
    }
    Ok(())
}

/// Parses a submission body and derives its key from `award_id`, `submission_timestamp`
/// and the SHA-256 of the *raw body bytes* (so a resubmission with a changed payload gets
/// a new key).
///
/// # Errors
/// A [`RejectReason`] whose `code` is one of `empty_body`, `too_large`, `not_utf8`,
/// `not_json`, `not_object`, `missing_field`, `wrong_type`, `not_integer`,
/// `negative_amount`, `invalid_identity` (an `award_id` containing `|`),
/// `control_character` (a NUL or another control character — U+0000 to U+001F, U+007F
/// — in `award_id` or `submission_timestamp`: Postgres refuses NUL in text, and no
/// identifier or timestamp needs the others), `too_long` (an `award_id` over
/// [`MAX_AWARD_ID_BYTES`] or a timestamp over [`MAX_TIMESTAMP_BYTES`]). The detail never
/// quotes the payload.
pub fn parse_submission(body: &[u8], max_body: usize) -> Result<Submission<Grant>, RejectReason> {
    parse_submission_with(body, max_body, KeyDerivation::Reference)
}

/// The checks every JSON body passes before it is read: not empty (`empty_body`), at most
/// `max_body` bytes (`too_large`), UTF-8 (`not_utf8`) and JSON (`not_json`). Returns the
/// text and the parsed value. [`parse_submission_with`] starts with it, and so does the
/// `idem` CLI's SQL handler.
///
/// ```
/// let (text, value) = idem_grant::json_body(br#"{"a":1}"#, 1 << 20).unwrap();
/// assert_eq!((text, value["a"].as_i64()), (r#"{"a":1}"#, Some(1)));
/// assert_eq!(idem_grant::json_body(b"{", 1 << 20).unwrap_err().code, "not_json");
/// ```
///
/// # Errors
/// A [`RejectReason`] with the codes above.
pub fn json_body(body: &[u8], max_body: usize) -> Result<(&str, Value), RejectReason> {
    if body.is_empty() {
        return Err(RejectReason::new("empty_body", "the body is empty"));
    }
    if body.len() > max_body {
        return Err(RejectReason::new(
            "too_large",
            format!(
                "the body is {} bytes, over the {max_body}-byte limit",
                body.len()
            ),
        ));
    }
    let text = std::str::from_utf8(body).map_err(|e| {
        RejectReason::new(
            "not_utf8",
            format!("the body is not UTF-8 (at byte {})", e.valid_up_to()),
        )
    })?;
    let value: Value = serde_json::from_str(text).map_err(|e| {
        RejectReason::new(
            "not_json",
            format!(
                "the body is not JSON (line {}, column {})",
                e.line(),
                e.column()
            ),
        )
    })?;
    Ok((text, value))
}

/// [`parse_submission`] with the key derived as `derivation` says: from the body's bytes
/// ([`KeyDerivation::Reference`], the reference consumer's key) or from its RFC 8785
/// canonical form ([`KeyDerivation::CanonicalJson`]: the same JSON value, whatever its
/// spacing or field order, has one key).
///
/// ```
/// use idem_grant::{parse_submission_with, KeyDerivation::*};
/// let a = br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":100}"#;
/// let b = br#"{ "amount_cents": 100, "submission_timestamp": "2026-07-01T09:00:00Z", "award_id": "A-1" }"#;
/// let key = |body: &[u8], d| parse_submission_with(body, 1 << 20, d).unwrap().key;
/// assert_ne!(key(a, Reference), key(b, Reference));
/// assert_eq!(key(a, CanonicalJson), key(b, CanonicalJson));
/// ```
///
/// # Errors
/// As [`parse_submission`].
pub fn parse_submission_with(
    body: &[u8],
    max_body: usize,
    derivation: KeyDerivation,
) -> Result<Submission<Grant>, RejectReason> {
    let (text, value) = json_body(body, max_body)?;
    let Value::Object(obj) = &value else {
        return Err(RejectReason::new(
            "not_object",
            "the body is not a JSON object",
        ));
    };
    let award_id = field(obj, "award_id")?;
    let timestamp = field(obj, "submission_timestamp")?;
    storable("award_id", award_id, MAX_AWARD_ID_BYTES)?;
    storable("submission_timestamp", timestamp, MAX_TIMESTAMP_BYTES)?;
    let amount_cents = match obj.get("amount_cents") {
        None | Some(Value::Null) => {
            return Err(RejectReason::new(
                "missing_field",
                "`amount_cents` is missing",
            ));
        }
        Some(Value::Number(n)) => match n.as_i64() {
            Some(a) if a < 0 => {
                return Err(RejectReason::new(
                    "negative_amount",
                    "`amount_cents` is negative",
                ));
            }
            Some(a) => a,
            None if n.is_u64() => {
                return Err(RejectReason::new(
                    "not_integer",
                    "`amount_cents` is out of range",
                ));
            }
            None => {
                return Err(RejectReason::new(
                    "not_integer",
                    "`amount_cents` is not an integer",
                ))
            }
        },
        Some(_) => {
            return Err(RejectReason::new(
                "wrong_type",
                "`amount_cents` must be a number",
            ))
        }
    };
    let key = match derivation {
        KeyDerivation::Reference => IdempotencyKey::derive(award_id, timestamp, body)?,
        KeyDerivation::CanonicalJson => {
            let canonical = canonical_json(text).ok_or_else(|| {
                RejectReason::new("not_json", "the body has no RFC 8785 canonical form")
            })?;
            IdempotencyKey::derive(award_id, timestamp, canonical.as_bytes())?
        }
    };
    Ok(Submission {
        key,
        subject: award_id.to_owned(),
        input: Grant {
            award_id: award_id.to_owned(),
            submission_timestamp: timestamp.to_owned(),
            amount_cents,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(body: &[u8]) -> &'static str {
        parse_submission(body, 64).unwrap_err().code
    }

    #[test]
    fn every_kind_of_bad_input_has_its_code() {
        assert_eq!(code(b""), "empty_body");
        assert_eq!(code(&[b' '; 65]), "too_large");
        assert_eq!(code(&[0xff, 0xfe]), "not_utf8");
        assert_eq!(code(b"{not json"), "not_json");
        assert_eq!(code(b"[1,2]"), "not_object");
        assert_eq!(
            code(br#"{"submission_timestamp":"t","amount_cents":1}"#),
            "missing_field"
        );
        assert_eq!(
            code(br#"{"award_id":"","submission_timestamp":"t","amount_cents":1}"#),
            "missing_field"
        );
        assert_eq!(
            code(br#"{"award_id":7,"submission_timestamp":"t","amount_cents":1}"#),
            "wrong_type"
        );
        assert_eq!(
            code(br#"{"award_id":"A","submission_timestamp":"t"}"#),
            "missing_field"
        );
        assert_eq!(
            code(br#"{"award_id":"A","submission_timestamp":"t","amount_cents":"1"}"#),
            "wrong_type"
        );
        assert_eq!(
            code(br#"{"award_id":"A","submission_timestamp":"t","amount_cents":1.5}"#),
            "not_integer"
        );
        assert_eq!(
            code(br#"{"award_id":"A","submission_timestamp":"t","amount_cents":-1}"#),
            "negative_amount"
        );
        assert_eq!(
            code(br#"{"award_id":"A|B","submission_timestamp":"t","amount_cents":1}"#),
            "invalid_identity"
        );
    }

    #[test]
    fn identity_fields_a_store_cannot_hold_are_refused() {
        let body = |a: &str, t: &str| {
            serde_json::json!({"award_id": a, "submission_timestamp": t, "amount_cents": 1})
                .to_string()
        };
        let code = |a: &str, t: &str| parse_submission(body(a, t).as_bytes(), 1 << 20).map(|_| ());
        for bad in ["A\u{0}1", "A\t1", "A\n", "\u{1f}", "A\u{7f}"] {
            assert_eq!(
                code(bad, "t").unwrap_err().code,
                "control_character",
                "{bad:?}"
            );
            assert_eq!(
                code("A", bad).unwrap_err().code,
                "control_character",
                "{bad:?}"
            );
        }
        let max_id = "a".repeat(MAX_AWARD_ID_BYTES);
        assert!(code(&max_id, "t").is_ok(), "an id at the limit passes");
        assert_eq!(
            code(&format!("{max_id}a"), "t").unwrap_err().code,
            "too_long"
        );
        // The limit is in bytes: 129 two-byte characters are 258 bytes.
        assert_eq!(code(&"é".repeat(129), "t").unwrap_err().code, "too_long");
        let max_ts = "1".repeat(MAX_TIMESTAMP_BYTES);
        assert!(code("A", &max_ts).is_ok());
        assert_eq!(
            code("A", &format!("{max_ts}1")).unwrap_err().code,
            "too_long"
        );
        // Other Unicode is fine, C1 controls included (Postgres stores them).
        assert!(code("Å-\u{85}-\u{2028}-日本", "2026-07-01T09:00:00+02:00").is_ok());
        // The reason never quotes the value.
        let r = parse_submission(body("SECRET\u{0}", "t").as_bytes(), 1 << 20).unwrap_err();
        assert!(!r.detail.contains("SECRET"), "{r}");
    }

    #[test]
    fn the_key_covers_the_raw_bytes() {
        let a = br#"{"award_id":"A","submission_timestamp":"t","amount_cents":1}"#;
        let b = br#"{"award_id": "A","submission_timestamp":"t","amount_cents":1}"#;
        let ka = parse_submission(a, 1024).unwrap().key;
        let kb = parse_submission(b, 1024).unwrap().key;
        assert_ne!(ka, kb, "a changed payload is a new submission");
        assert_eq!(ka, IdempotencyKey::derive("A", "t", a).unwrap());
    }

    #[test]
    fn a_reason_never_quotes_the_payload() {
        let secret =
            br#"{"award_id":"SECRET-PAYLOAD","submission_timestamp":"t","amount_cents":-5}"#;
        let r = parse_submission(secret, 1024).unwrap_err();
        assert!(!r.detail.contains("SECRET"));
    }
}
