//! The one duration grammar of idem: every broker URL parameter and every `idem` flag that
//! takes a duration reads it here, with jiff's "friendly" format (`250ms`, `30s`, `2m`,
//! `1h 30m`, `1.5h`, `90d`, `2w`, `3 days`), and a year means one thing everywhere:
//!
//! - a **timer** or a **window** ([`parse_duration`]: a broker's ack wait, a margin, a
//!   reconnect timeout) is a fixed length, so a day is 24 hours and a week 7 days; a year
//!   or a month has no fixed length and is refused, naming the days to give instead;
//! - an **age** ([`parse_age`]: a purge cutoff, a retention floor) is counted back from
//!   now on the calendar, so `3y` is three calendar years, leap days included, as the
//!   servers count `interval '3 years'`.
//!
//! [`show`] writes a duration back in the same grammar.

use std::fmt;
use std::time::Duration;

use jiff::fmt::friendly::SpanPrinter;
use jiff::{SignedDuration, Span, SpanRelativeTo, SpanRound, Unit};

use crate::retention::RetentionFloor;

/// A duration that [`parse_duration`] or [`parse_age`] cannot read.
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

    /// The text that was given (trimmed).
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
            "invalid duration {:?} ({}): e.g. 500ms, 30s, 15m, 1h 30m, 90d",
            self.input, self.reason
        )
    }
}

impl std::error::Error for DurationError {}

/// Reads `t` (trimmed, not empty) as a span: a bare number is seconds (`5`, `0.5`).
fn span(t: &str) -> Result<Span, DurationError> {
    if t.is_empty() {
        return Err(DurationError::new(t, "empty"));
    }
    if t.starts_with('-') {
        return Err(DurationError::new(t, "a duration cannot be negative"));
    }
    let text = if t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        format!("{t}s")
    } else {
        t.to_owned()
    };
    let span: Span = text
        .parse()
        .map_err(|e: jiff::Error| DurationError::new(t, e.to_string()))?;
    if span.is_negative() {
        return Err(DurationError::new(t, "a duration cannot be negative"));
    }
    Ok(span)
}

/// A span without years or months, as a fixed length: days of 24 hours, weeks of 7 days.
fn fixed(t: &str, span: Span) -> Result<Duration, DurationError> {
    if span.get_years() != 0 || span.get_months() != 0 {
        return Err(DurationError::new(
            t,
            "a year or a month has no fixed length: give days (365d), or give the year \
             where a calendar counts it (a purge's --older-than, a retention floor)",
        ));
    }
    let d = span
        .to_duration(SpanRelativeTo::days_are_24_hours())
        .map_err(|e| DurationError::new(t, e.to_string()))?;
    Duration::try_from(d).map_err(|_| DurationError::new(t, "a duration cannot be negative"))
}

/// Parses a fixed duration, as every broker URL parameter and `idem` flag takes it: jiff's
/// friendly format (`250ms`, `30s`, `2m`, `1h 30m`, `1.5h`, `90d`, `2w`), where a bare
/// number is seconds (`5`, `0.5`), a day is 24 hours and a week 7 days. Surrounding
/// whitespace is ignored; zero is allowed here (a flag or parameter that needs more says
/// so). Years and months are refused: they have no fixed length ([`parse_age`] reads them
/// on the calendar).
///
/// ```
/// use std::time::Duration;
/// use idem_core::duration::parse_duration;
/// assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
/// assert_eq!(parse_duration("0.5"), Ok(Duration::from_millis(500)));
/// assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5_400)));
/// assert_eq!(parse_duration("2w"), Ok(Duration::from_secs(14 * 86_400)));
/// assert!(parse_duration("3y").unwrap_err().reason().contains("no fixed length"));
/// let e = parse_duration("5 parsecs").unwrap_err();
/// assert!(e.to_string().contains("\"5 parsecs\""), "{e}");
/// ```
///
/// # Errors
/// [`DurationError`] naming the input and what is wrong with it: empty, negative, a year
/// or a month, an unknown unit, a number without a unit inside a longer duration, too
/// large.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    fixed(t, span(t)?)
}

/// Parses an age counted back from now: a purge's cutoff or a retention floor. Whole
/// calendar years (`3y`, `3 years`) are [`RetentionFloor::Years`], counted on the
/// calendar (three years back from 2028-03-01 is 2025-03-01, 1,096 days); anything else
/// is a fixed duration in the grammar of [`parse_duration`] ([`RetentionFloor::Exactly`]).
///
/// ```
/// use std::time::Duration;
/// use idem_core::duration::parse_age;
/// use idem_core::retention::RetentionFloor;
/// assert_eq!(parse_age("3y"), Ok(RetentionFloor::Years(3)));
/// assert_eq!(parse_age("1 year"), Ok(RetentionFloor::Years(1)));
/// assert_eq!(parse_age("90d"), Ok(RetentionFloor::Exactly(Duration::from_secs(90 * 86_400))));
/// assert!(parse_age("1y 6mo").is_err());
/// ```
///
/// # Errors
/// [`DurationError`]: what [`parse_duration`] refuses, except whole years; years with
/// any other unit, and months.
pub fn parse_age(s: &str) -> Result<RetentionFloor, DurationError> {
    let t = s.trim();
    let span = span(t)?;
    let years = span.get_years();
    if years == 0 {
        return fixed(t, span).map(RetentionFloor::Exactly);
    }
    if span.fieldwise() != Span::new().years(years).fieldwise() {
        return Err(DurationError::new(
            t,
            "years combine with no other unit: give whole years (3y) or days (1200d)",
        ));
    }
    u32::try_from(years)
        .map(RetentionFloor::Years)
        .map_err(|_| DurationError::new(t, "a duration cannot be negative"))
}

/// Writes `d` in the grammar [`parse_duration`] reads, in days (of 24 hours) and smaller
/// units: `0s`, `250ms`, `1m 30s`, `2h`, `14d`.
///
/// ```
/// use std::time::Duration;
/// use idem_core::duration::{parse_duration, show};
/// assert_eq!(show(Duration::from_secs(90)), "1m 30s");
/// assert_eq!(show(Duration::from_secs(14 * 86_400)), "14d");
/// assert_eq!(parse_duration(&show(Duration::from_millis(1_250))), Ok(Duration::from_millis(1_250)));
/// ```
pub fn show(d: Duration) -> String {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    let printer = SpanPrinter::new();
    Span::try_from(d)
        .and_then(|span| span.round(SpanRound::new().largest(Unit::Day).days_are_24_hours()))
        .map_or_else(
            |_| printer.duration_to_string(&d),
            |span| printer.span_to_string(&span),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn friendly_durations_with_bare_seconds_and_fixed_days() {
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
        assert_eq!(ok("1095d"), Duration::from_secs(1_095 * 86_400));
    }

    #[test]
    fn a_year_is_a_calendar_year_or_nothing() {
        for timer in ["1y", "3 years", "2 years 1d", "1mo", "1 month"] {
            let e = parse_duration(timer).expect_err(timer);
            assert!(e.reason().contains("no fixed length"), "{timer}: {e}");
        }
        assert_eq!(parse_age("3y"), Ok(RetentionFloor::Years(3)));
        assert_eq!(parse_age(" 2 years "), Ok(RetentionFloor::Years(2)));
        assert_eq!(
            parse_age("36h"),
            Ok(RetentionFloor::Exactly(Duration::from_secs(36 * 3_600)))
        );
        for mixed in ["1y 6mo", "2y 1d", "1mo"] {
            assert!(parse_age(mixed).is_err(), "{mixed}");
        }
    }

    #[test]
    fn bad_input_is_named_with_the_reason() {
        for (input, reason) in [
            ("", "empty"),
            ("   ", "empty"),
            ("-1", "negative"),
            ("-5s", "negative"),
            ("soon", "no integer"),
            ("3 fortnights", "unit designator"),
            ("5 parsecs", "unit designator"),
            ("1h 30", "unit designator"),
            ("1.", "decimal"),
            ("1.5.5s", "unit designator"),
            ("99999999999999999999", "too big"),
            ("99999999999999999d", "range"),
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

    #[test]
    fn shown_durations_read_back() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(250),
            Duration::from_secs(90),
            Duration::from_secs(3 * 86_400 + 5),
            Duration::from_micros(1_500_001),
            Duration::from_secs(400 * 86_400 + 3_661),
        ] {
            assert_eq!(parse_duration(&show(d)), Ok(d), "{}", show(d));
        }
    }
}
