//! Names shared by every adapter.

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

/// The headers of a delivery that its dead letter carries over: all but an earlier dead
/// letter's reason (the new reason replaces it) and those the broker's own
/// (`broker_own`), which the dead letter's publish does not copy.
#[allow(dead_code)] // used by the broker features
pub(crate) fn carried_to_dead_letter<'a>(
    headers: &'a [(String, String)],
    broker_own: impl Fn(&str) -> bool + 'a,
) -> impl Iterator<Item = &'a (String, String)> + 'a {
    headers
        .iter()
        .filter(move |(k, _)| k != DEAD_LETTER_REASON_HEADER && !broker_own(k))
}

/// `url` without its secrets, for messages: [`idem_core::redact_url`].
#[allow(dead_code)] // used by the broker features
pub(crate) fn redact(url: &str) -> String {
    idem_core::redact_url(url).into_owned()
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
        assert_eq!(
            redact("kafka://h:9092?sasl.password=secret"),
            "kafka://h:9092?sasl.password=***"
        );
        assert_eq!(redact("not a url"), "not a url");
    }
}
