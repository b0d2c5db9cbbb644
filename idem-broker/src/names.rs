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
}
