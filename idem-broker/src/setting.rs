//! Reading idem's settings from a [`BrokerUrl`], for each broker's `Config::from_url`:
//! [`BrokerUrl::setting`] with one of the readers here, each returning the reason a value
//! is refused, never a default in its place.

#![allow(dead_code)] // used by the broker features

use std::fmt::Display;
use std::ops::RangeInclusive;
use std::str::FromStr;
use std::time::Duration;

use crate::any::{BrokerKind, BrokerUrl};
use crate::BrokerError;

impl BrokerUrl {
    /// Setting `key` read by `read`, `None` when the URL does not set it; a bad value is
    /// a [`BrokerError::InvalidParam`] naming `key` with `read`'s reason.
    pub(crate) fn setting<T>(
        &self,
        key: &str,
        read: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, BrokerError> {
        self.param(key)
            .map(|v| {
                read(v).map_err(|reason| BrokerError::InvalidParam {
                    param: key.to_owned(),
                    value: v.to_owned(),
                    reason,
                })
            })
            .transpose()
    }

    /// An error unless this URL names `kind` (a config read from another broker's URL).
    pub(crate) fn expect_kind(&self, kind: BrokerKind) -> Result<(), BrokerError> {
        if self.kind() == kind {
            Ok(())
        } else {
            Err(BrokerError::InvalidUrl(format!(
                "{self} is a {} URL, not a {kind} one",
                self.kind()
            )))
        }
    }
}

/// A duration ([`parse_duration`](crate::parse_duration)) within `range`.
pub(crate) fn duration_in(
    range: RangeInclusive<Duration>,
) -> impl FnOnce(&str) -> Result<Duration, String> {
    move |s| {
        let d = crate::parse_duration(s).map_err(|e| e.to_string())?;
        if range.contains(&d) {
            Ok(d)
        } else if *range.end() == Duration::MAX {
            Err(format!("must be at least {}", show(*range.start())))
        } else {
            Err(format!(
                "must be from {} to {}",
                show(*range.start()),
                show(*range.end())
            ))
        }
    }
}

/// A whole number of seconds within `range` (SQS counts in seconds).
pub(crate) fn whole_seconds_in(
    range: RangeInclusive<Duration>,
) -> impl FnOnce(&str) -> Result<Duration, String> {
    move |s| {
        let d = duration_in(range)(s)?;
        if d.subsec_nanos() == 0 {
            Ok(d)
        } else {
            Err(format!("{} is not a whole number of seconds", show(d)))
        }
    }
}

/// A whole number within `range`.
pub(crate) fn number_in<T>(range: RangeInclusive<T>) -> impl FnOnce(&str) -> Result<T, String>
where
    T: FromStr + PartialOrd + Display,
{
    move |s| match s.trim().parse::<T>() {
        Ok(n) if range.contains(&n) => Ok(n),
        _ => Err(format!(
            "must be a whole number from {} to {}",
            range.start(),
            range.end()
        )),
    }
}

/// A name (a group, a consumer): not empty, no surrounding whitespace.
pub(crate) fn name(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("must not be empty".to_owned())
    } else if s.trim() != s {
        Err("must not begin or end with whitespace".to_owned())
    } else {
        Ok(s.to_owned())
    }
}

/// `url` without the query parameters named in `names` (client settings that the
/// broker's own client library must not see: TLS files, credential files), and their
/// values, percent-decoded, in the order of `names` (`None`: not given). Every other
/// parameter stays in the URL, in its order.
///
/// # Errors
/// [`BrokerError::InvalidParam`] for one given twice.
pub(crate) fn take_params<const N: usize>(
    url: &str,
    names: [&str; N],
) -> Result<(String, [Option<String>; N]), BrokerError> {
    let mut found: [Option<String>; N] = std::array::from_fn(|_| None);
    let Some((head, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), found));
    };
    let mut rest = Vec::new();
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let Some(i) = names.iter().position(|n| *n == k) else {
            rest.push(pair);
            continue;
        };
        let value = url::form_urlencoded::parse(format!("v={v}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
        if found[i].replace(value).is_some() {
            return Err(BrokerError::InvalidParam {
                param: k.to_owned(),
                value: v.to_owned(),
                reason: "given more than once".to_owned(),
            });
        }
    }
    let url = if rest.is_empty() {
        head.to_owned()
    } else {
        format!("{head}?{}", rest.join("&"))
    };
    Ok((url, found))
}

fn show(d: Duration) -> String {
    crate::show_duration(d)
}

/// Test helper: `result` is a [`BrokerError::InvalidParam`] naming `param`, whose reason
/// contains `reason` (`what` names the case in a failure).
#[cfg(test)]
#[track_caller]
pub(crate) fn assert_refused<T: std::fmt::Debug>(
    result: Result<T, BrokerError>,
    what: &str,
    param: &str,
    reason: &str,
) {
    match result {
        Err(BrokerError::InvalidParam {
            param: p,
            reason: r,
            ..
        }) => {
            assert_eq!(p, param, "{what}");
            assert!(r.contains(reason), "{what}: {r}");
        }
        other => panic!("{what}: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_outside_their_range_are_refused_with_the_range() {
        let secs = Duration::from_secs;
        assert_eq!(duration_in(secs(1)..=secs(20))("5s"), Ok(secs(5)));
        assert_eq!(
            duration_in(secs(1)..=secs(20))("21s"),
            Err("must be from 1s to 20s".to_owned())
        );
        assert_eq!(
            duration_in(Duration::from_millis(1)..=Duration::MAX)("0s"),
            Err("must be at least 1ms".to_owned())
        );
        assert!(duration_in(secs(0)..=secs(1))("soon")
            .unwrap_err()
            .contains("invalid duration \"soon\""));
        assert_eq!(whole_seconds_in(secs(0)..=secs(20))("2"), Ok(secs(2)));
        assert_eq!(
            whole_seconds_in(secs(0)..=secs(20))("1500ms"),
            Err("1s 500ms is not a whole number of seconds".to_owned())
        );
        assert_eq!(number_in(1..=1000)("10"), Ok(10_u32));
        for bad in ["0", "1001", "-1", "ten", "", "1.5"] {
            assert_eq!(
                number_in(1..=1000_u32)(bad),
                Err("must be a whole number from 1 to 1000".to_owned()),
                "{bad}"
            );
        }
        assert_eq!(name("g"), Ok("g".to_owned()));
        assert!(name("").is_err() && name(" g").is_err());
    }

    #[cfg(all(feature = "rabbitmq", feature = "nats"))]
    #[test]
    fn a_config_is_read_from_its_own_brokers_url_only() {
        let nats = BrokerUrl::parse("nats://127.0.0.1:4222").unwrap();
        let e = crate::rabbitmq::RabbitConfig::from_url(&nats, "q").unwrap_err();
        assert!(matches!(e, BrokerError::InvalidUrl(_)), "{e}");
        assert!(e.to_string().contains("not a RabbitMQ"), "{e}");
    }
}
