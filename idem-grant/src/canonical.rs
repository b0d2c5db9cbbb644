//! The opt-in canonical-JSON key ([`KeyDerivation::CanonicalJson`]): the payload is
//! hashed in its RFC 8785 (JSON Canonicalization Scheme) form, so the same JSON value
//! gives the same key whatever its spacing, field order, escapes or number spelling.
//!
//! Not for a table shared with the reference consumer: it hashes the raw bytes
//! ([`KeyDerivation::Reference`], the default, byte-identical to it), so the two would
//! derive different keys for one body.

/// How a grant body's idempotency key is derived. Both hash
/// `award_id|submission_timestamp|sha256_hex(payload)`; they differ in the payload bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyDerivation {
    /// The body's bytes as received: byte-identical to the reference consumer's keys
    /// (`shared/vectors/seed-keys.json`). The default; required for a shared table.
    #[default]
    Reference,
    /// The body's RFC 8785 canonical form ([`canonical_json`]): a body re-serialised with
    /// other spacing or field order keeps its key (and so is a duplicate, not a conflict).
    CanonicalJson,
}

impl KeyDerivation {
    /// `reference` or `canonical-json`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reference => "reference",
            Self::CanonicalJson => "canonical-json",
        }
    }
}

impl std::fmt::Display for KeyDerivation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KeyDerivation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reference" => Ok(Self::Reference),
            "canonical-json" => Ok(Self::CanonicalJson),
            other => Err(format!(
                "unknown key derivation {other:?}: expected reference or canonical-json"
            )),
        }
    }
}

/// The RFC 8785 canonical form of the JSON text `json`: no whitespace, object members
/// sorted by the UTF-16 code units of their names, strings with only the required escapes
/// (`\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t`, other controls as `\u00xx`), numbers as
/// ECMAScript prints the nearest IEEE 754 double (so `4.50` is `4.5`, `1E30` is `1e+30`,
/// and integers beyond 2^53 round as in every I-JSON reader). A member name given twice
/// keeps its last value. `None` when `json` is not one JSON value.
///
/// The text is read by `serde_json` (numbers correctly rounded: its `float_roundtrip`
/// feature) and written by `serde_json_canonicalizer`, which prints numbers as ECMAScript
/// does.
///
/// ```
/// use idem_grant::canonical_json;
/// let a = canonical_json(r#"{ "b": 1.50, "a": "x" }"#);
/// assert_eq!(a.as_deref(), Some(r#"{"a":"x","b":1.5}"#));
/// assert_eq!(a, canonical_json(r#"{"a":"x","b":15e-1}"#));
/// ```
pub fn canonical_json(json: &str) -> Option<String> {
    let mut value: serde_json::Value = serde_json::from_str(json).ok()?;
    as_doubles(&mut value);
    serde_json_canonicalizer::to_string(&value).ok()
}

/// Every number as the IEEE 754 double an I-JSON reader takes it for: `serde_json` keeps
/// integers beyond 2^53 exact, RFC 8785 rounds them.
fn as_doubles(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Number(n) if !n.is_f64() => {
            if let Some(d) = n.as_f64().and_then(serde_json::Number::from_f64) {
                *n = d;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(as_doubles),
        Value::Object(members) => members.values_mut().for_each(as_doubles),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        canonical_json(text).expect("json")
    }

    #[test]
    fn the_rfc_8785_example_canonicalises_as_the_rfc_says() {
        // RFC 8785, section 3.2.2 (input) and 3.2.3 (output).
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        assert_eq!(
            canon(input),
            "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}"
        );
    }

    #[test]
    fn numbers_print_as_ecmascript_prints_them() {
        for (f, want) in [
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-1.5, "-1.5"),
            (125_000.0, "125000"),
            (1e21, "1e+21"),
            (1e20, "100000000000000000000"),
            (123_456_789_012_345_680_000.0, "123456789012345680000"),
            (0.000001, "0.000001"),
            (0.0000001, "1e-7"),
            (1.5e-7, "1.5e-7"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (9_007_199_254_740_993.0, "9007199254740992"),
        ] {
            assert_eq!(canon(&format!("{f:e}")), want, "{f:e}");
        }
    }

    #[test]
    fn members_sort_by_utf16_code_units() {
        // U+1F600 (the surrogate 0xD83D first) sorts before U+FB01 in UTF-16, after it
        // by code point or in UTF-8.
        assert_eq!(
            canon("{\"\u{FB01}\":2,\"\u{1F600}\":1,\"a\":3}"),
            "{\"a\":3,\"\u{1F600}\":1,\"\u{FB01}\":2}"
        );
        // Escaped names sort by their value, and a repeated name keeps its last value.
        assert_eq!(canon(r#"{"\u0062":1,"a":2,"a":3}"#), r#"{"a":3,"b":1}"#);
        assert_eq!(canon(r#"{"a":"\ud83d\ude00"}"#), "{\"a\":\"\u{1F600}\"}");
        // Integers beyond 2^53 round to the nearest double, as an I-JSON reader reads them.
        assert_eq!(
            canon("[9007199254740993,-9007199254740993,12]"),
            "[9007199254740992,-9007199254740992,12]"
        );
        assert_eq!(canonical_json(r#"{"a":1} x"#), None);
    }
}
