//! A driver that runs a whole schedule — deliveries, redeliveries, crashes at every
//! point — through a gate on any store, and checks the exactly-once property.
//!
//! - [`check_handler`] runs *your* handler on *your* store: the messages you publish
//!   (duplicates included, each with what it must come to, [`Message`]), one
//!   [`Schedule`] of broker behaviour and faults, and a closure that reads your effect
//!   rows back. It checks one effect per distinct submission, every bad message
//!   dead-lettered, every delivery settled.
//! - [`crash_suite`] runs [`check_handler`] over [`crash_schedules`] — a crash at every
//!   step, errors at every point, redeliveries and expired visibility timeouts, one at a
//!   time and concurrently — each on a fresh store, and checks that every crash point and
//!   every error point was reached.
//! - [`check_exactly_once`] is [`check_handler`] with the kit's own [`EffectHandler`](crate::EffectHandler) on
//!   a [`TestStore`], for a generated [`Case`] (what every store's property test runs).
//!
//! A handler of your own, on the in-memory store (a real store is used the same way;
//! `examples/orders` runs the suite on SQLite and Postgres):
//!
//! ```
//! use idem_sim::sim::{crash_suite, Message};
//! use idem_sim::{encode_submission, EffectHandlerFor, MemoryStore, TestStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), String> {
//! let order = encode_submission("O-1", "2026-07-01T09:00:00Z", 1250);
//! let messages = vec![
//!     Message::effect(order.clone(), 1250),
//!     Message::effect(order, 1250), // the broker delivers it twice: one effect
//!     Message::effect(encode_submission("O-2", "2026-07-01T09:05:00Z", 990), 990),
//!     Message::dead_letter(b"not an order".to_vec()), // rejected: no effect
//! ];
//! let report = crash_suite(
//!     &messages,
//!     || async { Ok::<_, String>((MemoryStore::new(), EffectHandlerFor::<MemoryStore>::new())) },
//!     |store: MemoryStore| async move { store.effects().await },
//! )
//! .await?;
//! assert!(report.total_crashes() > 0);
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use idem_engine::{
    ClaimStore, ConflictPolicy, Delivery, Gate, GateConfig, Handler, Headers, IdempotencyKey,
    Outcome, OutcomeKind,
};
use tokio::task::JoinSet;

use crate::broker::{BrokerStats, SimAcker, SimBroker};
use crate::fault::{
    CrashPoint, ErrorPoint, FaultPlan, FaultyAcker, FaultyHandler, FaultyStore, InjectedCrash,
};
use crate::harness::{encode_submission, Effect, EffectHandlerFor, TestStore};
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

/// How one schedule runs: the broker's at-least-once behaviour, the faults, the
/// concurrency — everything of a run but its messages.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Probability that the broker redelivers an acked message (once per message at
    /// most).
    pub redelivery_rate: f64,
    /// Crashes: the nth time (1-based) each point is reached.
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
    /// Seed of the broker and of the commit coin. Its parity picks the gate's
    /// [`ConflictPolicy`]: [`DeadLetter`](ConflictPolicy::DeadLetter) (the default of a
    /// real consumer) for even seeds, [`Process`](ConflictPolicy::Process) for odd ones.
    pub seed: u64,
}

impl Schedule {
    /// The conflict policy the gate runs with (see [`seed`](Self::seed)).
    pub fn policy(&self) -> ConflictPolicy {
        if self.seed.is_multiple_of(2) {
            ConflictPolicy::DeadLetter
        } else {
            ConflictPolicy::Process
        }
    }
}

/// What one published message must come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exactly one committed effect (however often the message is delivered), under the
    /// key and subject the handler's `identify` derives, carrying `amount` (the number
    /// your effect rows hold and [`Effect::amount`] reads back; any fixed value, such as
    /// 0, when they hold none).
    Effect {
        /// The amount the effect must carry.
        amount: i64,
    },
    /// Dead-lettered, with no effect: input the handler refuses, in `identify` (no
    /// identity) or in `handle` ([`HandlerError::Reject`](idem_engine::HandlerError)).
    DeadLetter,
}

/// One message to publish, with what it must come to. Publish the same body twice for
/// the at-least-once duplicate: it still has one effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The body, exactly as the broker delivers it.
    pub body: Vec<u8>,
    /// What it must come to.
    pub expect: Expect,
}

impl Message {
    /// A message that must take effect once, carrying `amount`.
    pub fn effect(body: impl Into<Vec<u8>>, amount: i64) -> Self {
        Self {
            body: body.into(),
            expect: Expect::Effect { amount },
        }
    }

    /// A message that must be dead-lettered with no effect.
    pub fn dead_letter(body: impl Into<Vec<u8>>) -> Self {
        Self {
            body: body.into(),
            expect: Expect::DeadLetter,
        }
    }
}

/// Which effects must be one: those of one identity (subject + submission timestamp,
/// [`ClaimMeta::identity`](idem_engine::ClaimMeta::identity)), or of one key when the
/// handler records no identity.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Group {
    Identity(String, String),
    Key(IdempotencyKey),
}

/// Runs `messages` through `handler` on `store` under `schedule`, then checks the
/// exactly-once property against the effects `read_effects` returns:
///
/// - every delivery is settled, and no ack carried another delivery's proof;
/// - every [`Expect::DeadLetter`] message is dead-lettered, and nothing else is but
///   conflicts (below);
/// - under [`ConflictPolicy::Process`] (odd seeds), or on a store that does not detect
///   conflicts: every distinct [`Expect::Effect`] submission (key) has exactly one
///   effect, with its amount, and there is no other effect;
/// - under [`ConflictPolicy::DeadLetter`] (even seeds) on a store that detects
///   conflicts: every identity has exactly one effect, of one of its payloads, and every
///   message with another payload of that identity is dead-lettered as a conflict.
///
/// The store and the handler are wrapped in [`FaultyStore`] and [`FaultyHandler`], and
/// the broker's ackers in [`FaultyAcker`]: the schedule's crashes strike before the
/// claim, after it, after the handler, during the commit, after the commit before the
/// ack, and on the ack's way; its errors at the claim, the handler and the commit. Each
/// message is published without headers.
///
/// `read_effects` is called once, after the run: it returns one [`Effect`] per
/// committed business row (your table's key column, subject and amount).
///
/// # Errors
/// A description of what was violated (no payload in it), or of a message expected to
/// take effect that the handler's `identify` refuses.
pub async fn check_handler<S, H, R, Fut, E>(
    store: S,
    handler: H,
    messages: &[Message],
    schedule: &Schedule,
    read_effects: R,
) -> Result<SimReport, String>
where
    S: ClaimStore + 'static,
    H: Handler<S::Tx> + 'static,
    R: FnOnce() -> Fut,
    Fut: Future<Output = Result<Vec<Effect>, E>>,
    E: Display,
{
    let broker = SimBroker::with_redelivery_rate(schedule.seed, schedule.redelivery_rate)
        .with_expiry_rate(schedule.expiry_rate);
    let policy = schedule.policy();
    let mut ledger = Ledger::new();
    // Per message expected to take effect: its group and key.
    let mut published: Vec<(Group, IdempotencyKey)> = Vec::new();
    // Each body's key, for the broker's check that an ack carries its own delivery's proof.
    let mut keys: HashMap<Vec<u8>, IdempotencyKey> = HashMap::new();
    let mut dead_expected = 0usize;
    let no_headers = Headers::new();
    for (i, m) in messages.iter().enumerate() {
        let identified = handler.identify(&m.body, &no_headers);
        if let Ok(sub) = &identified {
            keys.insert(m.body.clone(), sub.key);
        }
        match (m.expect, identified) {
            (Expect::Effect { amount }, Ok(sub)) => {
                let group = match handler.claim_meta(&sub).identity() {
                    Some((subject, ts)) => Group::Identity(subject.to_owned(), ts.to_owned()),
                    None => Group::Key(sub.key),
                };
                ledger.expect(sub.key, sub.subject.clone(), amount);
                published.push((group, sub.key));
            }
            (Expect::Effect { .. }, Err(reason)) => {
                return Err(format!(
                    "message {i} is expected to take effect, but the handler refuses it: \
                     {reason}"
                ));
            }
            (Expect::DeadLetter, _) => dead_expected += 1,
        }
        broker.publish(m.body.clone());
    }
    broker.expect_keys(keys);
    let detects_conflicts = store.capabilities().detects_conflicts;
    let plan = FaultPlan::scripted_with_errors(
        schedule.crashes.iter().copied(),
        schedule.errors.iter().copied(),
        schedule.seed,
    );
    let gate = Arc::new(Gate::with_config(
        FaultyStore::new(store, plan.clone()),
        FaultyHandler::new(handler, plan.clone()),
        GateConfig::default().with_on_conflict(policy),
    ));
    let config = SimConfig {
        concurrency: schedule.concurrency,
        batch_size: schedule.batch_size,
        max_deliveries: 200 + 50 * messages.len() as u64,
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
        .collect::<BTreeSet<_>>()
        .len();
    let effects = read_effects()
        .await
        .map_err(|e| format!("reading the effects back: {e}"))?;
    let by_identity = policy == ConflictPolicy::DeadLetter && detects_conflicts;
    let conflicts = if by_identity {
        conflicting_messages(&published, &effects)?
    } else {
        0
    };
    if dead != dead_expected + conflicts {
        return Err(format!(
            "{dead} dead letters for {dead_expected} messages to dead-letter and {conflicts} \
             conflicting ones ({policy})"
        ));
    }
    if report.broker.foreign_proofs > 0 {
        return Err(format!(
            "{} acks carried another delivery's proof",
            report.broker.foreign_proofs
        ));
    }
    if by_identity {
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

/// The schedules of the crash-at-every-step suite ([`crash_suite`]):
///
/// - each [`CrashPoint`] alone, at its 1st and 3rd occurrence, one delivery at a time,
///   with lost acks (dead-letter conflict policy);
/// - each crash point again with three tasks of batches of four, lost acks and expired
///   visibility timeouts (a message held twice at once; process conflict policy);
/// - each [`ErrorPoint`] at its 1st and 2nd occurrence, two tasks of batches of two;
/// - every crash point at once, at its 2nd occurrence, with lost acks and expiries.
pub fn crash_schedules() -> Vec<Schedule> {
    let mut out = Vec::new();
    for (i, &point) in CrashPoint::ALL.iter().enumerate() {
        out.push(Schedule {
            redelivery_rate: 0.3,
            crashes: vec![(point, 1), (point, 3)],
            errors: Vec::new(),
            expiry_rate: 0.0,
            concurrency: 1,
            batch_size: 1,
            seed: 2 * i as u64,
        });
    }
    for (i, &point) in CrashPoint::ALL.iter().enumerate() {
        out.push(Schedule {
            redelivery_rate: 0.3,
            crashes: vec![(point, 1), (point, 3)],
            errors: Vec::new(),
            expiry_rate: 0.2,
            concurrency: 3,
            batch_size: 4,
            seed: 2 * i as u64 + 1,
        });
    }
    for (i, &point) in ErrorPoint::ALL.iter().enumerate() {
        out.push(Schedule {
            redelivery_rate: 0.3,
            crashes: Vec::new(),
            errors: vec![(point, 1), (point, 2)],
            expiry_rate: 0.0,
            concurrency: 2,
            batch_size: 2,
            seed: 100 + i as u64,
        });
    }
    out.push(Schedule {
        redelivery_rate: 0.5,
        crashes: CrashPoint::ALL.iter().map(|&p| (p, 2)).collect(),
        errors: Vec::new(),
        expiry_rate: 0.3,
        concurrency: 3,
        batch_size: 3,
        seed: 200,
    });
    out
}

/// What a [`crash_suite`] did, over all its schedules.
#[derive(Debug, Clone, Default)]
pub struct SuiteReport {
    /// Schedules run (each on a fresh store).
    pub schedules: usize,
    /// Outcomes by kind.
    pub outcomes: BTreeMap<OutcomeKind, u64>,
    /// Injected crashes by point.
    pub crashes: BTreeMap<CrashPoint, u64>,
    /// Injected errors by point.
    pub errors: BTreeMap<ErrorPoint, u64>,
    /// Deliveries handed out, redeliveries included.
    pub deliveries: u64,
}

impl SuiteReport {
    /// All injected crashes.
    pub fn total_crashes(&self) -> u64 {
        self.crashes.values().sum()
    }

    fn add(&mut self, report: &SimReport) {
        self.schedules += 1;
        for (k, n) in &report.outcomes {
            *self.outcomes.entry(*k).or_insert(0) += n;
        }
        for (k, n) in &report.crashes {
            *self.crashes.entry(*k).or_insert(0) += n;
        }
        for (k, n) in &report.errors {
            *self.errors.entry(*k).or_insert(0) += n;
        }
        self.deliveries += report.broker.deliveries;
    }
}

/// The crash-at-every-step suite for your handler: [`check_handler`] with `messages` on
/// each of [`crash_schedules`], each on a fresh store and handler from `fresh`, the
/// effects read back by `read_effects` (given a clone of that schedule's store). Then
/// checks that every [`CrashPoint`] and every [`ErrorPoint`] was reached and struck
/// somewhere: a workload too small to reach one (no message that takes effect, say)
/// fails rather than proving nothing.
///
/// Injected crashes are panics; the suite silences the panic hook for them
/// ([`quiet_injected_crashes`](crate::fault::quiet_injected_crashes)).
///
/// # Errors
/// The first schedule's violation, with the schedule; `fresh` failing; a point never
/// struck.
pub async fn crash_suite<S, H, F, FFut, FE, R, RFut, RE>(
    messages: &[Message],
    mut fresh: F,
    read_effects: R,
) -> Result<SuiteReport, String>
where
    S: ClaimStore + Clone + 'static,
    H: Handler<S::Tx> + 'static,
    F: FnMut() -> FFut,
    FFut: Future<Output = Result<(S, H), FE>>,
    FE: Display,
    R: Fn(S) -> RFut,
    RFut: Future<Output = Result<Vec<Effect>, RE>>,
    RE: Display,
{
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(crate::fault::quiet_injected_crashes);
    let mut total = SuiteReport::default();
    for schedule in crash_schedules() {
        let (store, handler) = fresh().await.map_err(|e| format!("a fresh store: {e}"))?;
        let reader = store.clone();
        let report = check_handler(store, handler, messages, &schedule, || read_effects(reader))
            .await
            .map_err(|e| format!("{e}\nin schedule {schedule:?}"))?;
        total.add(&report);
    }
    if let Some(p) = CrashPoint::ALL
        .iter()
        .find(|p| !total.crashes.contains_key(p))
    {
        return Err(format!(
            "no crash struck at {p:?} in any schedule: publish more messages that take effect"
        ));
    }
    if let Some(p) = ErrorPoint::ALL
        .iter()
        .find(|p| !total.errors.contains_key(p))
    {
        return Err(format!(
            "no error struck at {p:?} in any schedule: publish more messages that take effect"
        ));
    }
    Ok(total)
}

/// One schedule of the exactly-once property for the kit's own
/// [`EffectHandler`](crate::EffectHandler): its submissions and poison, and its
/// [`Schedule`].
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

impl Case {
    /// The messages: each submission encoded ([`encode_submission`]), with a poison
    /// message after the 1st, 4th, 7th… submission until `poison` are published.
    pub fn messages(&self) -> Vec<Message> {
        let mut out = Vec::with_capacity(self.submissions.len() + self.poison);
        for (i, (subject, ts, amount)) in self.submissions.iter().enumerate() {
            out.push(Message::effect(
                encode_submission(subject, ts, *amount),
                *amount,
            ));
            if i % 3 == 0 && i / 3 < self.poison {
                out.push(Message::dead_letter(format!("poison-{i}").into_bytes()));
            }
        }
        out
    }

    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        Schedule {
            redelivery_rate: self.redelivery_rate,
            crashes: self.crashes.clone(),
            errors: self.errors.clone(),
            expiry_rate: self.expiry_rate,
            concurrency: self.concurrency,
            batch_size: self.batch_size,
            seed: self.seed,
        }
    }
}

/// Runs `case` against `store` with the kit's [`EffectHandler`](crate::EffectHandler):
/// [`check_handler`] with [`Case::messages`] and [`Case::schedule`], the effects read
/// back by [`TestStore::effects`]. Every delivery settled, every poison message
/// dead-lettered, and
/// - under [`ConflictPolicy::Process`] (odd seeds): every distinct valid submission has
///   exactly one effect;
/// - under [`ConflictPolicy::DeadLetter`] (even seeds): every identity (subject +
///   timestamp) has exactly one effect, of one of its payloads, and every message with
///   another payload of that identity is dead-lettered (a conflict), none lost.
///
/// # Errors
/// A description of what was violated.
pub async fn check_exactly_once<S: TestStore>(store: S, case: &Case) -> Result<SimReport, String> {
    let reader = store.clone();
    check_handler(
        store,
        EffectHandlerFor::<S>::new(),
        &case.messages(),
        &case.schedule(),
        || async move { reader.effects().await },
    )
    .await
}

/// Under [`ConflictPolicy::DeadLetter`]: checks that each group has exactly one effect,
/// of one of its keys, and returns how many published messages carry another key of their
/// group (each must have been dead-lettered as a conflict).
fn conflicting_messages(
    published: &[(Group, IdempotencyKey)],
    effects: &[Effect],
) -> Result<usize, String> {
    let mut per_key: BTreeMap<IdempotencyKey, usize> = BTreeMap::new();
    for e in effects {
        *per_key.entry(e.key).or_insert(0) += 1;
    }
    let mut winners: BTreeMap<&Group, IdempotencyKey> = BTreeMap::new();
    let mut keys: BTreeMap<&Group, BTreeSet<IdempotencyKey>> = BTreeMap::new();
    for (group, key) in published {
        keys.entry(group).or_default().insert(*key);
    }
    let known: BTreeSet<IdempotencyKey> = published.iter().map(|(_, k)| *k).collect();
    if let Some(k) = per_key.keys().find(|k| !known.contains(k)) {
        return Err(format!(
            "an effect for a key never published: {}",
            k.short()
        ));
    }
    for (group, ks) in keys {
        let with_effects: Vec<(IdempotencyKey, usize)> = ks
            .iter()
            .filter_map(|k| per_key.get(k).map(|n| (*k, *n)))
            .collect();
        match with_effects.as_slice() {
            [(k, 1)] => {
                winners.insert(group, *k);
            }
            other => {
                return Err(format!(
                    "{group:?} (dead-letter policy) has effects {:?}, not one",
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
        .filter(|(group, key)| winners.get(group) != Some(key))
        .count())
}
