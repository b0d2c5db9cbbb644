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
/// The numbers are read from the text itself (correctly rounded), not through
/// `serde_json`'s default float parser, which may be one unit in the last place off.
///
/// ```
/// use idem_grant::canonical_json;
/// let a = canonical_json(r#"{ "b": 1.50, "a": "x" }"#);
/// assert_eq!(a.as_deref(), Some(r#"{"a":"x","b":1.5}"#));
/// assert_eq!(a, canonical_json(r#"{"a":"x","b":15e-1}"#));
/// ```
pub fn canonical_json(json: &str) -> Option<String> {
    let mut p = Parser {
        s: json.as_bytes(),
        i: 0,
    };
    let mut out = String::with_capacity(json.len());
    p.ws();
    p.value(&mut out)?;
    p.ws();
    (p.i == p.s.len()).then_some(out)
}

/// A recursive-descent reader of one JSON text that writes its canonical form.
struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while matches!(self.s.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.s.get(self.i) == Some(&b)).then(|| self.i += 1)
    }

    fn value(&mut self, out: &mut String) -> Option<()> {
        match *self.s.get(self.i)? {
            b'{' => self.object(out),
            b'[' => {
                self.i += 1;
                out.push('[');
                self.ws();
                if self.eat(b']').is_none() {
                    loop {
                        self.ws();
                        self.value(out)?;
                        self.ws();
                        if self.eat(b',').is_some() {
                            out.push(',');
                            continue;
                        }
                        self.eat(b']')?;
                        break;
                    }
                }
                out.push(']');
                Some(())
            }
            b'"' => {
                let s = self.string()?;
                write_string(out, &s);
                Some(())
            }
            b't' => self.literal("true", out),
            b'f' => self.literal("false", out),
            b'n' => self.literal("null", out),
            _ => self.number(out),
        }
    }

    fn literal(&mut self, word: &str, out: &mut String) -> Option<()> {
        let end = self.i + word.len();
        (self.s.get(self.i..end)? == word.as_bytes()).then_some(())?;
        self.i = end;
        out.push_str(word);
        Some(())
    }

    fn object(&mut self, out: &mut String) -> Option<()> {
        self.i += 1;
        let mut members: Vec<(String, String)> = Vec::new();
        self.ws();
        if self.eat(b'}').is_none() {
            loop {
                self.ws();
                let name = self.string()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
                let mut v = String::new();
                self.value(&mut v)?;
                members.retain(|(n, _)| *n != name);
                members.push((name, v));
                self.ws();
                if self.eat(b',').is_some() {
                    continue;
                }
                self.eat(b'}')?;
                break;
            }
        }
        members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
        out.push('{');
        for (i, (name, v)) in members.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_string(out, name);
            out.push(':');
            out.push_str(v);
        }
        out.push('}');
        Some(())
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = std::str::from_utf8(self.s.get(self.i..self.i + 4)?).ok()?;
        self.i += 4;
        u32::from_str_radix(h, 16).ok()
    }

    /// A string's value (the cursor on its opening quote).
    fn string(&mut self) -> Option<String> {
        self.eat(b'"')?;
        let mut bytes = Vec::new();
        loop {
            let b = *self.s.get(self.i)?;
            self.i += 1;
            match b {
                b'"' => break,
                b'\\' => {
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    let c = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&hi)
                                && self.s.get(self.i..self.i + 2) == Some(b"\\u")
                            {
                                self.i += 2;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return None;
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            // A lone surrogate is no character: I-JSON refuses it.
                            char::from_u32(code)?
                        }
                        _ => return None,
                    };
                    let mut buf = [0u8; 4];
                    bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                b => bytes.push(b),
            }
        }
        String::from_utf8(bytes).ok()
    }

    fn number(&mut self, out: &mut String) -> Option<()> {
        let start = self.i;
        while matches!(
            self.s.get(self.i),
            Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
        ) {
            self.i += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        // JSON's number grammar is a subset of what `f64::from_str` takes (the body was
        // validated as JSON already), and `from_str` rounds correctly.
        let f: f64 = text.parse().ok()?;
        if !f.is_finite() {
            return None;
        }
        out.push_str(&es_number(f));
        Some(())
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// ECMAScript's `Number.prototype.toString` of a finite double (ECMA-262, 7.1.12.1):
/// the shortest digits that round-trip (Rust's `{:e}` gives them), placed by the
/// decimal exponent.
fn es_number(f: f64) -> String {
    if f == 0.0 || !f.is_finite() {
        // -0 prints as 0; JSON has no NaN or infinity.
        return "0".to_owned();
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let k = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    // The value is 0.d1d2…dk × 10^n.
    let n = exp + 1;
    let body = if k <= n && n <= 21 {
        format!(
            "{digits}{}",
            "0".repeat(usize::try_from(n - k).unwrap_or(0))
        )
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(usize::try_from(n).unwrap_or(0));
        format!("{int}.{frac}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat(usize::try_from(-n).unwrap_or(0)))
    } else {
        let e = n - 1;
        let sign = if e >= 0 { '+' } else { '-' };
        let (first, rest) = digits.split_at(1);
        if rest.is_empty() {
            format!("{first}e{sign}{}", e.abs())
        } else {
            format!("{first}.{rest}e{sign}{}", e.abs())
        }
    };
    if f < 0.0 {
        format!("-{body}")
    } else {
        body
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
            assert_eq!(es_number(f), want, "{f:e}");
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
        assert_eq!(canonical_json(r#"{"a":1} x"#), None);
    }
}
