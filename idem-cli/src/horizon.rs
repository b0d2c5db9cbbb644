//! `--broker URL --source NAME` for `idem purge` and `idem inspect`: the redelivery
//! horizons of the named sources (read by `idem_broker::horizon`), which bound how young a
//! purge cutoff may be whatever `--allow-below-floor` says.

use std::time::Duration;

use idem_broker::any::BrokerUrl;
use idem_broker::horizon::{self, RedeliveryHorizon};

use crate::error::error_chain;
use crate::CliError;

/// The variable that stands for `--broker` when `--source` is given without it.
pub(crate) const BROKER_ENV: &str = "IDEM_BROKER";

/// Pairs `--broker` with `--source`: one broker for every source, or one broker per
/// source in order. `--source` without `--broker` takes the broker from `IDEM_BROKER`
/// (only then: a broker in the environment of a purge without `--source` is not used).
pub(crate) fn pairs(
    brokers: &[String],
    sources: &[String],
) -> Result<Vec<(String, String)>, CliError> {
    let from_env: Vec<String>;
    let brokers = match std::env::var(BROKER_ENV) {
        Ok(b) if brokers.is_empty() && !sources.is_empty() && !b.is_empty() => {
            from_env = vec![b];
            &from_env[..]
        }
        _ => brokers,
    };
    match (brokers.len(), sources.len()) {
        (0, 0) => Ok(Vec::new()),
        (0, _) | (_, 0) => Err(CliError::usage(
            "--broker and --source go together (the source's redelivery horizon)",
        )),
        (1, _) => Ok(sources
            .iter()
            .map(|s| (brokers[0].clone(), s.clone()))
            .collect()),
        (b, s) if b == s => Ok(brokers
            .iter()
            .cloned()
            .zip(sources.iter().cloned())
            .collect()),
        (b, s) => Err(CliError::usage(format!(
            "{b} --broker and {s} --source: give one broker, or one per source"
        ))),
    }
}

/// Reads the horizon of every (broker, source) pair; a Kafka source whose URL keeps its
/// positions in the store (`?positions=store`) is read with `positions`, the store's
/// (see `idem_broker::horizon::redelivery_horizon_with`).
pub(crate) async fn read(
    pairs: &[(String, String)],
    positions: Option<&dyn idem_engine::PositionStore>,
) -> Result<Vec<RedeliveryHorizon>, CliError> {
    let mut out = Vec::with_capacity(pairs.len());
    for (broker, source) in pairs {
        let url = BrokerUrl::parse(broker).map_err(|e| crate::cmd::broker_error("--broker", &e))?;
        let h = horizon::redelivery_horizon_with(&url, source, positions)
            .await
            .map_err(|e| {
                let text = format!(
                    "redelivery horizon of {source:?} on {url}: {}",
                    error_chain(&e)
                );
                if e.is_retryable() {
                    CliError::failed(text)
                } else {
                    CliError::usage(text)
                }
            })?;
        out.push(h);
    }
    Ok(out)
}

/// Refuses `older_than` inside the longest horizon plus `margin` (exit 2).
pub(crate) fn check(
    older_than: Duration,
    horizons: &[RedeliveryHorizon],
    margin: Duration,
) -> Result<Duration, CliError> {
    horizon::check_cutoff(older_than, horizons, margin).map_err(|e| CliError::usage(e.to_string()))
}
