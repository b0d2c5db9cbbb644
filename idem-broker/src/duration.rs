//! The one duration grammar of idem: every broker URL parameter and every `idem` flag
//! that takes a duration reads it with [`parse_duration`].

use std::fmt;
use std::time::Duration;

/// A duration that [`parse_duration`] cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError {
    input: String,
    reason: String,
}

impl DurationError {
    fn new(input: &str, reason: impl Into<String>) -> Self {
        Self {
            input: input.to_owned(),
            reason: reason.into(),
        }
    }

    /// The text that was given.
    pub fn input(&self) -> &str {
        &self.input
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid duration {:?} ({}): e.g. 500ms, 30s, 15m, 1h 30m, 90d, 3y",
            self.input, self.reason
        )
    }
}

impl std::error::Error for DurationError {}

/// Parses a duration, as every broker URL parameter and `idem` flag takes it: a
/// [`humantime`] duration (`250ms`, `30s`, `2m`, `1h 30m`, `1.5h`, `90d`, `2w`), where a
/// bare number is seconds (`5`, `0.5`) and a year (`y`, `yr`, `year`, `years`) is 365
/// days (humantime's own is 365.25). Surrounding whitespace is ignored; zero is allowed
/// here (a flag or parameter that needs more says so).
///
/// ```
/// use std::time::Duration;
/// use idem_broker::parse_duration;
/// assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
/// assert_eq!(parse_duration("0.5"), Ok(Duration::from_millis(500)));
/// assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5_400)));
/// assert_eq!(parse_duration("3y"), Ok(Duration::from_secs(3 * 365 * 86_400)));
/// let e = parse_duration("5 parsecs").unwrap_err();
/// assert!(e.to_string().contains("\"5 parsecs\""), "{e}");
/// ```
///
/// # Errors
/// [`DurationError`] naming the input and what is wrong with it: empty, negative, an
/// unknown unit, a missing unit after a number inside a longer duration, too large.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    if t.is_empty() {
        return Err(DurationError::new(t, "empty"));
    }
    if t.starts_with('-') {
        return Err(DurationError::new(t, "a duration cannot be negative"));
    }
    if t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return humantime::parse_duration(&format!("{t}s"))
            .map_err(|e| DurationError::new(t, e.to_string()));
    }
    // humantime's own error for the whole input says where it went wrong.
    let whole_error = |fallback: &str| {
        let reason = match humantime::parse_duration(t) {
            Err(e) => e.to_string(),
            Ok(_) => fallback.to_owned(),
        };
        DurationError::new(t, reason)
    };
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_end);
        let after = after.trim_start();
        let unit_end = after
            .find(|c: char| !(c.is_ascii_alphabetic() || c == 'µ'))
            .unwrap_or(after.len());
        let (unit, tail) = after.split_at(unit_end);
        if number.is_empty() || unit.is_empty() {
            return Err(whole_error("expected a number followed by a unit"));
        }
        let term = if matches!(unit, "y" | "yr" | "yrs" | "year" | "years") {
            humantime::parse_duration(&format!("{number}d"))
                .ok()
                .and_then(|days| days.checked_mul(365))
        } else {
            humantime::parse_duration(&format!("{number}{unit}")).ok()
        };
        total = match term.and_then(|d| total.checked_add(d)) {
            Some(total) => total,
            None => return Err(whole_error("too large")),
        };
        rest = tail.trim_start();
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn humantime_with_bare_seconds_and_365_day_years() {
        let ok = |s: &str| parse_duration(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok(" 7 "), Duration::from_secs(7));
        assert_eq!(ok("0"), Duration::ZERO);
        assert_eq!(ok("1.25"), Duration::from_millis(1_250));
        assert_eq!(ok("3d"), Duration::from_secs(3 * 86_400));
        assert_eq!(ok("2w"), Duration::from_secs(14 * 86_400));
        assert_eq!(ok("1h30m"), Duration::from_secs(5_400));
        assert_eq!(ok("1 hour 12min 5s"), Duration::from_secs(4_325));
        assert_eq!(ok("1.5h"), Duration::from_secs(5_400));
        assert_eq!(ok("250 ms"), Duration::from_millis(250));
        assert_eq!(ok("1y"), Duration::from_secs(365 * 86_400));
        assert_eq!(ok("2 years 1d"), Duration::from_secs(731 * 86_400));
        assert_eq!(ok("0.5y"), Duration::from_secs(365 * 43_200));
        // humantime's months are 30.44 days
        assert_eq!(ok("1M"), Duration::from_secs(2_630_016));
    }

    #[test]
    fn bad_input_is_named_with_the_reason() {
        for (input, reason) in [
            ("", "empty"),
            ("   ", "empty"),
            ("-1", "negative"),
            ("-5s", "negative"),
            ("soon", "expected number"),
            ("3 fortnights", "unknown time unit \"fortnights\""),
            ("5 parsecs", "unknown time unit"),
            ("1h 30", "time unit needed"),
            ("1.", "invalid character"),
            ("1,5s", "invalid character"),
            ("99999999999999999999", "too large"),
            ("99999999999999999y", "too large"),
        ] {
            let e = parse_duration(input).expect_err(input);
            assert_eq!(e.input(), input.trim());
            assert!(
                e.reason().contains(reason),
                "{input:?}: {:?} lacks {reason:?}",
                e.reason()
            );
            let shown = e.to_string();
            assert!(shown.contains(&format!("{:?}", input.trim())), "{shown}");
            assert!(shown.contains("e.g. 500ms"), "{shown}");
        }
    }
}
