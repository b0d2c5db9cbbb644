//! Names shared by every adapter.

use std::time::Duration;

/// The header (RabbitMQ, JetStream) or stream field (Redis) that carries a dead letter's
/// reason, as `code: detail`.
pub const DEAD_LETTER_REASON_HEADER: &str = "idem-dead-letter-reason";

/// Where rejected deliveries of `name` go: `NAME.dead-letter`, of the same kind.
///
/// ```
/// assert_eq!(idem_broker::dead_letter_name("grants"), "grants.dead-letter");
/// ```
pub fn dead_letter_name(name: &str) -> String {
    format!("{name}.dead-letter")
}

/// Parses a broker URL parameter's duration: `250ms`, `5s`, `2m`, `1h`, or a bare number
/// of seconds.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(idem_broker::parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert_eq!(idem_broker::parse_duration("5"), Ok(Duration::from_secs(5)));
/// assert!(idem_broker::parse_duration("5 parsecs").is_err());
/// ```
///
/// # Errors
/// A message naming the bad input.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 250ms, 5s, 2m"))?;
    let ms = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("invalid duration unit in {s:?}: use ms, s, m or h")),
    };
    n.checked_mul(ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

/// `url` without its password, for messages.
#[allow(dead_code)] // used by the broker features
pub(crate) fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "<unparsable URL>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("3d").is_err());
    }
}
