//! One module per subcommand.

pub(crate) mod audit;
pub(crate) mod consume;
pub(crate) mod demo;
pub(crate) mod inspect;
pub(crate) mod key;
pub(crate) mod migrate;
pub(crate) mod publish;
pub(crate) mod purge;
pub(crate) mod relay;

use tracing_subscriber::EnvFilter;

/// How logs are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log shipping.
    Json,
}

/// Logs go to stderr, filtered by `RUST_LOG` (default: warnings, and the audit trail off
/// unless asked for with `RUST_LOG=idem::audit=info`).
pub(crate) fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Resolves when Ctrl-C or SIGTERM arrives.
#[allow(dead_code)] // used by consume and relay
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Seconds as a number (`3`, `0.5`) or a duration (`3s`, `2m`).
pub(crate) fn parse_secs(s: &str) -> Result<std::time::Duration, String> {
    if let Ok(secs) = s.parse::<f64>() {
        if secs.is_finite() && secs > 0.0 && secs < 1e9 {
            return Ok(std::time::Duration::from_secs_f64(secs));
        }
        return Err(format!("{s:?} is not a positive number of seconds"));
    }
    parse_duration(s)
}

/// Parses a duration such as `30s`, `15m`, `12h`, `90d`, `3y` (a year is 365 days).
#[allow(dead_code)] // used by consume, relay and purge
pub(crate) fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 15m, 12h, 90d, 3y"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        "y" => 365 * 86_400,
        _ => {
            return Err(format!(
                "invalid duration unit in {s:?}: use s, m, h, d, w or y"
            ))
        }
    };
    n.checked_mul(secs)
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}
