//! A driver that runs a whole schedule — deliveries, redeliveries, crashes at every
//! point — through a gate on any store, and checks the exactly-once property.

use std::collections::BTreeMap;
use std::sync::Arc;

use idem_core::{
    ClaimStore, ConflictPolicy, Delivery, Gate, GateConfig, Handler, IdempotencyKey, Outcome,
    OutcomeKind,
};
use tokio::task::JoinSet;

use crate::broker::{BrokerStats, SimAcker, SimBroker};
use crate::fault::{
    CrashPoint, ErrorPoint, FaultPlan, FaultyAcker, FaultyHandler, FaultyStore, InjectedCrash,
};
use crate::harness::{encode_submission, EffectHandler, EffectHandlerFor, TestStore};
use crate::ledger::Ledger;

/// How the driver takes deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Tasks in flight at once.
    pub concurrency: usize,
    /// Deliveries per task (a batch transaction above one).
    pub batch_size: usize,
    /// Gives up (an error) after this many deliveries: a schedule that never settles.
    pub max_deliveries: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            concurrency: 4,
            batch_size: 1,
            max_deliveries: 1_000_000,
        }
    }
}

/// What a driven run did.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Outcomes by kind (a crashed task's deliveries have none).
    pub outcomes: BTreeMap<OutcomeKind, u64>,
    /// Tasks that crashed.
    pub crashed_tasks: u64,
    /// Injected crashes by point.
    pub crashes: BTreeMap<CrashPoint, u64>,
    /// Injected errors by point.
    pub errors: BTreeMap<ErrorPoint, u64>,
    /// The broker's counters.
    pub broker: BrokerStats,
    /// Settlements that returned an error.
    pub settle_failures: u64,
}

impl SimReport {
    /// The count of one outcome kind.
    pub fn count(&self, kind: OutcomeKind) -> u64 {
        self.outcomes.get(&kind).copied().unwrap_or(0)
    }

    /// All injected crashes.
    pub fn total_crashes(&self) -> u64 {
        self.crashes.values().sum()
    }
}

/// Runs `gate` over `broker` until every delivery is settled.
///
/// Each batch runs in its own task with its ackers wrapped in [`FaultyAcker`]s of `plan`;
/// an injected crash ends only that task (its transaction rolls back and its deliveries
/// come back). Other panics propagate.
///
/// # Errors
/// When the run passes `config.max_deliveries` without settling.
pub async fn drive<S, H>(
    gate: Arc<Gate<S, H>>,
    broker: &SimBroker,
    plan: &Arc<FaultPlan>,
    config: &SimConfig,
    observe: impl Fn(&Outcome),
) -> Result<SimReport, String>
where
    S: ClaimStore + 'static,
    H: Handler<S::Tx> + 'static,
{
    drive_fed(gate, broker, plan, config, |_| {}, observe).await
}

/// Like [`drive`], with `feed` called before each round of receives so that it can
/// publish more messages: a run of millions of messages then holds only what `feed`
/// keeps ready (for example: publish while [`SimBroker::ready_len`] is below a window).
/// The run ends when nothing is in flight and nothing is ready after a `feed`.
///
/// # Errors
/// When the run passes `config.max_deliveries` without settling.
pub async fn drive_fed<S, H>(
    gate: Arc<Gate<S, H>>,
    broker: &SimBroker,
    plan: &Arc<FaultPlan>,
    config: &SimConfig,
    mut feed: impl FnMut(&SimBroker),
    observe: impl Fn(&Outcome),
) -> Result<SimReport, String>
where
    S: ClaimStore + 'static,
    H: Handler<S::Tx> + 'static,
{
    let mut report = SimReport::default();
    let mut deferred = 0u64;
    let mut tasks: JoinSet<Vec<Outcome>> = JoinSet::new();
    let concurrency = config.concurrency.max(1);
    let batch_size = config.batch_size.max(1);
    loop {
        feed(broker);
        while tasks.len() < concurrency {
            let batch: Vec<Delivery<FaultyAcker<SimAcker>>> = broker
                .receive_many(batch_size)
                .into_iter()
                .map(|d| Delivery {
                    payload: d.payload,
                    headers: d.headers,
                    attempt: d.attempt,
                    acker: FaultyAcker::new(d.acker, plan.clone()),
                })
                .collect();
            if batch.is_empty() {
                break;
            }
            let gate = gate.clone();
            tasks.spawn(async move {
                let outcomes = if batch.len() == 1 {
                    let mut batch = batch;
                    match batch.pop() {
                        Some(d) => vec![gate.process(d).await],
                        None => Vec::new(),
                    }
                } else {
                    gate.process_batch(batch).await
                };
                // A deferral comes back after a delay on a real broker (the simulated one
                // hands it back at once): a short pause keeps a delivery deferred behind
                // another (held behind its identity's earlier payload, a key held by a
                // stuck transaction) from spinning.
                if !outcomes.is_empty()
                    && outcomes.iter().all(|o| o.kind() == OutcomeKind::Deferred)
                {
                    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                }
                outcomes
            });
        }
        let Some(joined) = tasks.join_next().await else {
            if broker.ready_len() == 0 {
                break;
            }
            continue;
        };
        match joined {
            Ok(outcomes) => {
                for o in &outcomes {
                    if o.kind() == OutcomeKind::Deferred {
                        deferred += 1;
                    }
                    *report.outcomes.entry(o.kind()).or_insert(0) += 1;
                    if o.settle_error().is_some() {
                        report.settle_failures += 1;
                    }
                    observe(o);
                }
            }
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                if payload.downcast_ref::<InjectedCrash>().is_some() {
                    report.crashed_tasks += 1;
                } else {
                    std::panic::resume_unwind(payload);
                }
            }
            Err(e) => return Err(format!("task failed: {e}")),
        }
        // Deferrals are not progress, nor a livelock of their own: what defers them ends
        // (a transaction's lock timeout, an earlier payload's retry), and they are bounded
        // by it; the bound counts the other deliveries.
        let deliveries = broker.stats().deliveries;
        if deliveries.saturating_sub(deferred) > config.max_deliveries
            || deliveries > config.max_deliveries.saturating_mul(20)
        {
            tasks.abort_all();
            return Err(format!(
                "no convergence after {} deliveries ({} ready)",
                config.max_deliveries,
                broker.ready_len()
            ));
        }
    }
    report.broker = broker.stats();
    report.crashes = plan.crashes().into_iter().collect();
    report.errors = plan.errors().into_iter().collect();
    Ok(report)
}

/// One schedule of the exactly-once property.
#[derive(Debug, Clone)]
pub struct Case {
    /// Submissions as (subject, timestamp, amount); repeats are duplicate submissions.
    pub submissions: Vec<(String, String, i64)>,
    /// Poison messages to mix in.
    pub poison: usize,
    /// Probability that the broker redelivers an acked message.
    pub redelivery_rate: f64,
    /// Crashes: the nth time each point is reached.
    pub crashes: Vec<(CrashPoint, u64)>,
    /// Errors: the nth time each point is reached.
    pub errors: Vec<(ErrorPoint, u64)>,
    /// Probability that a delivery's visibility timeout expires while it is in flight, so
    /// that the same message is held twice at once.
    pub expiry_rate: f64,
    /// Tasks in flight.
    pub concurrency: usize,
    /// Deliveries per transaction.
    pub batch_size: usize,
    /// Seed of the broker and of the commit coin.
    pub seed: u64,
}

/// Runs `case` against `store` and checks the property: every delivery settled, every
/// poison message dead-lettered, and
/// - under [`ConflictPolicy::Process`] (odd seeds): every distinct valid submission has
///   exactly one effect;
/// - under [`ConflictPolicy::DeadLetter`] (even seeds): every identity (subject +
///   timestamp) has exactly one effect, of one of its payloads, and every message with
///   another payload of that identity is dead-lettered (a conflict), none lost.
///
/// # Errors
/// A description of what was violated.
pub async fn check_exactly_once<S: TestStore>(store: S, case: &Case) -> Result<SimReport, String> {
    let broker = SimBroker::with_redelivery_rate(case.seed, case.redelivery_rate)
        .with_expiry_rate(case.expiry_rate);
    let mut ledger = Ledger::new();
    let policy = if case.seed.is_multiple_of(2) {
        ConflictPolicy::DeadLetter
    } else {
        ConflictPolicy::Process
    };
    // Per published submission: its identity and key.
    let mut published: Vec<((String, String), IdempotencyKey)> = Vec::new();
    for (i, (subject, ts, amount)) in case.submissions.iter().enumerate() {
        let body = encode_submission(subject, ts, *amount);
        let sub = EffectHandler::parse(&body)
            .map_err(|e| format!("case generator made bad input: {e}"))?;
        ledger.expect(sub.key, subject.clone(), *amount);
        published.push(((subject.clone(), ts.clone()), sub.key));
        broker.publish(body);
        if i % 3 == 0 && i / 3 < case.poison {
            broker.publish(format!("poison-{i}").into_bytes());
        }
    }
    let poison_published = case.poison.min(case.submissions.len().div_ceil(3));
    let plan = FaultPlan::scripted_with_errors(
        case.crashes.iter().copied(),
        case.errors.iter().copied(),
        case.seed,
    );
    let gate = Arc::new(Gate::with_config(
        FaultyStore::new(store.clone(), plan.clone()),
        FaultyHandler::new(EffectHandlerFor::<S>::new(), plan.clone()),
        GateConfig::default().with_on_conflict(policy),
    ));
    let config = SimConfig {
        concurrency: case.concurrency,
        batch_size: case.batch_size,
        max_deliveries: 200 + 50 * case.submissions.len() as u64,
    };
    let report = drive(gate, &broker, &plan, &config, |_| {}).await?;
    if !broker.is_settled() {
        return Err(format!(
            "unsettled: {} ready, {} in flight",
            broker.ready_len(),
            broker.in_flight_len()
        ));
    }
    // A message held twice (an expired visibility timeout) may be dead-lettered by both
    // holders: count messages, not settlements.
    let dead = broker
        .dead_letters()
        .iter()
        .map(|(m, _)| m.id)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let effects = store.effects().await.map_err(|e| e.to_string())?;
    let conflicts =
        if policy == ConflictPolicy::DeadLetter && store.capabilities().detects_conflicts {
            conflicting_messages(&published, &effects)?
        } else {
            0
        };
    if dead != poison_published + conflicts {
        return Err(format!(
            "{dead} dead letters for {poison_published} poison messages and {conflicts} \
             conflicting ones ({policy})"
        ));
    }
    if report.broker.foreign_proofs > 0 {
        return Err(format!(
            "{} acks carried another delivery's proof",
            report.broker.foreign_proofs
        ));
    }
    if conflicts > 0
        || (policy == ConflictPolicy::DeadLetter && store.capabilities().detects_conflicts)
    {
        return Ok(report);
    }
    let violations = ledger.violations(&effects);
    if !violations.is_empty() {
        return Err(format!(
            "exactly-once violated: {}",
            violations
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Ok(report)
}

/// Under [`ConflictPolicy::DeadLetter`]: checks that each identity has exactly one effect,
/// of one of its keys, and returns how many published messages carry another key of their
/// identity (each must have been dead-lettered as a conflict).
fn conflicting_messages(
    published: &[((String, String), IdempotencyKey)],
    effects: &[crate::harness::Effect],
) -> Result<usize, String> {
    let mut per_key: BTreeMap<IdempotencyKey, usize> = BTreeMap::new();
    for e in effects {
        *per_key.entry(e.key).or_insert(0) += 1;
    }
    let mut winners: BTreeMap<&(String, String), IdempotencyKey> = BTreeMap::new();
    let mut keys: BTreeMap<&(String, String), std::collections::BTreeSet<IdempotencyKey>> =
        BTreeMap::new();
    for (ident, key) in published {
        keys.entry(ident).or_default().insert(*key);
    }
    let known: std::collections::BTreeSet<IdempotencyKey> =
        published.iter().map(|(_, k)| *k).collect();
    if let Some(k) = per_key.keys().find(|k| !known.contains(k)) {
        return Err(format!(
            "an effect for a key never published: {}",
            k.short()
        ));
    }
    for (ident, ks) in keys {
        let with_effects: Vec<(IdempotencyKey, usize)> = ks
            .iter()
            .filter_map(|k| per_key.get(k).map(|n| (*k, *n)))
            .collect();
        match with_effects.as_slice() {
            [(k, 1)] => {
                winners.insert(ident, *k);
            }
            other => {
                return Err(format!(
                    "identity {ident:?} (dead-letter policy) has effects {:?}, not one",
                    other
                        .iter()
                        .map(|(k, n)| (k.short(), *n))
                        .collect::<Vec<_>>()
                ))
            }
        }
    }
    Ok(published
        .iter()
        .filter(|(ident, key)| winners.get(ident) != Some(key))
        .count())
}
