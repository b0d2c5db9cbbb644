//! `idem publish`: each line of a file as one message, its bytes as they are (not
//! validated: bad input is the consumer's to dead-letter), published durably and
//! confirmed by the broker. `--header NAME=VALUE` (repeatable) puts the same headers on
//! every message, for example a W3C `traceparent` to follow through consume and relay.
//! On Kafka each record is keyed by its subject (`--key-field`), so the lines of one
//! subject reach one partition in file order.

use std::time::Instant;

use idem_broker::any::{AnyPublisher, BrokerUrl};

use super::broker_error;
use crate::CliError;

/// Lines per confirmed chunk.
const CHUNK: usize = 1_000;

/// Arguments of `idem publish`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[arg(long, value_name = "URL", env = "IDEM_BROKER", hide_env_values = true, help = super::BROKER_HELP)]
    broker: String,
    /// The queue / stream to publish to (created if missing).
    #[arg(long, value_name = "NAME")]
    destination: String,
    /// The file: one message body per line (`-` for stdin).
    #[arg(long, value_name = "FILE")]
    file: String,
    /// A header on every message, `NAME=VALUE` (repeatable), for example
    /// `traceparent=00-<32 hex>-<16 hex>-01`: AMQP headers, NATS headers, Redis stream
    /// fields, SQS string attributes, Kafka headers.
    #[arg(long = "header", value_name = "NAME=VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Kafka only: each record's key is the value at this JSON pointer in its line (the
    /// subject: by default `/award_id`, a grant submission's). The lines of one subject
    /// then go to one partition in file order, and a consumer group delivers them in that
    /// order, so the first published is the first delivered. A line that is not JSON or
    /// lacks the field has no key; `--key-field ''` publishes every record without one.
    #[arg(long, value_name = "POINTER", default_value = "/award_id")]
    key_field: String,
}

/// The Kafka record key of `line`: the value at `pointer` (a string's text, any other
/// value's JSON), or `None` (not JSON, no such field, or no pointer).
fn record_key(line: &[u8], pointer: &str) -> Option<Vec<u8>> {
    if pointer.is_empty() {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    match value.pointer(pointer)? {
        serde_json::Value::String(s) => Some(s.clone().into_bytes()),
        serde_json::Value::Null => None,
        other => Some(other.to_string().into_bytes()),
    }
}

/// `NAME=VALUE`: a non-empty name without spaces, `=` or control characters, and a value
/// without control characters (split at the first `=`).
fn parse_header(s: &str) -> Result<(String, String), String> {
    let Some((name, value)) = s.split_once('=') else {
        return Err(format!("{s:?} is not NAME=VALUE"));
    };
    if name.is_empty() {
        return Err(format!(
            "{s:?} has an empty header name (expected NAME=VALUE)"
        ));
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "header name {name:?} has a space or a control character"
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(format!(
            "the value of header {name:?} has a control character"
        ));
    }
    Ok((name.to_owned(), value.to_owned()))
}

/// The file's lines, split on `\n` only: every other byte (a `\r` included) belongs to
/// the body. A final newline does not make an empty last message.
fn split_lines(data: &[u8]) -> Vec<Vec<u8>> {
    if data.is_empty() {
        return Vec::new();
    }
    let data = data.strip_suffix(b"\n").unwrap_or(data);
    data.split(|b| *b == b'\n').map(<[u8]>::to_vec).collect()
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let broker = BrokerUrl::parse(&args.broker).map_err(|e| broker_error("--broker", &e))?;
    let data = if args.file == "-" {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)
            .map_err(|e| CliError::usage(format!("reading stdin: {e}")))?;
        buf
    } else {
        std::fs::read(&args.file)
            .map_err(|e| CliError::usage(format!("--file {}: {e}", args.file)))?
    };
    let bodies = split_lines(&data);
    drop(data);
    if !args.key_field.is_empty() && !args.key_field.starts_with('/') {
        return Err(CliError::usage(format!(
            "--key-field {:?}: a JSON pointer starts with '/' (for example /award_id)",
            args.key_field
        )));
    }
    let keys: Vec<Option<Vec<u8>>> = if broker.kind() == idem_broker::any::BrokerKind::Kafka {
        bodies
            .iter()
            .map(|b| record_key(b, &args.key_field))
            .collect()
    } else {
        Vec::new()
    };
    for (name, value) in &args.headers {
        if name.eq_ignore_ascii_case(idem_engine::TRACEPARENT_HEADER)
            && idem_engine::TraceParent::parse(value).is_err()
        {
            eprintln!(
                "idem: note: {value:?} is not a valid W3C traceparent; consumers will ignore it"
            );
        }
    }
    let publisher = AnyPublisher::connect(&broker, &args.destination)
        .await
        .map_err(|e| broker_error(&format!("{} {}", broker.kind(), broker), &e))?;
    let started = Instant::now();
    let mut published = 0usize;
    for (i, chunk) in bodies.chunks(CHUNK).enumerate() {
        let from = (i * CHUNK).min(keys.len());
        let to = (from + chunk.len()).min(keys.len());
        publisher
            .publish_keyed(chunk, &keys[from..to], &args.headers)
            .await
            .map_err(|e| {
                broker_error(
                    &format!(
                        "publishing to {} (after {published} confirmed)",
                        args.destination
                    ),
                    &e,
                )
            })?;
        published += chunk.len();
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("destination: {}", args.destination);
    println!("published: {published}");
    println!("seconds: {seconds:.3}");
    if seconds > 0.0 {
        println!("throughput_msgs_per_s: {:.0}", published as f64 / seconds);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::split_lines;

    #[test]
    fn headers_are_name_equals_value() {
        use super::parse_header;
        let ok = |n: &str, v: &str| Ok((n.to_owned(), v.to_owned()));
        assert_eq!(
            parse_header("traceparent=00-ab"),
            ok("traceparent", "00-ab")
        );
        assert_eq!(parse_header("a=b=c"), ok("a", "b=c"));
        assert_eq!(parse_header("a="), ok("a", ""));
        for bad in ["traceparent", "=x", "a b=c", "a\tb=c", "a=b\nc", ""] {
            assert!(parse_header(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn records_are_keyed_by_the_field() {
        use super::record_key;
        let line = br#"{"award_id": "A-1", "n": 7, "none": null}"#;
        assert_eq!(record_key(line, "/award_id"), Some(b"A-1".to_vec()));
        assert_eq!(record_key(line, "/n"), Some(b"7".to_vec()));
        assert_eq!(record_key(line, "/none"), None);
        assert_eq!(record_key(line, "/missing"), None);
        assert_eq!(record_key(line, ""), None);
        assert_eq!(record_key(b"not json", "/award_id"), None);
    }

    #[test]
    fn lines_keep_their_bytes() {
        assert!(split_lines(b"").is_empty());
        assert_eq!(split_lines(b"a\n"), vec![b"a".to_vec()]);
        assert_eq!(split_lines(b"a\nb"), vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(
            split_lines(b"a\r\n\nb\n"),
            vec![b"a\r".to_vec(), Vec::new(), b"b".to_vec()]
        );
    }
}
