//! An exhaustive explorer of the real [`Gate`](idem_engine::Gate): every interleaving,
//! crash and fault within small bounds, checked.
//!
//! The explorer runs the real `Gate::process`, `Gate::process_batch` and
//! [`consumer::run`](idem_engine::consumer::run) futures on one thread, over a store, a
//! broker and a front filter modelled in memory. Every call the gate makes through them —
//! begin, claim, the handler's write, commit, ack, a worker's receive — is a *choice
//! point*: it stays pending until the explorer grants it. At each step the explorer may
//! grant any pending call (to proceed, or to fail with an error of each class), crash a
//! worker by dropping its future (its transaction rolls back, its unsettled deliveries go
//! back to the broker), let a commit take effect and then crash, let a commit apply
//! nothing (a transaction aborted inside, which the store reports as a `Conflict`, as
//! `idem-store-postgres` does after SQLSTATE 25P02), lose an ack after it was sent,
//! expire a visibility timeout (one message in flight twice), take the front filter down
//! or up, restore the store from the snapshot before its latest commit (a database
//! restored from backup, followed by the runbook: rotate the store identity, restart the
//! consumers), and advance the logical clock to the next delayed redelivery.
//!
//! The broker counts runs ([`Config::counts_runs`], as the NATS, SQS and RabbitMQ
//! adapters do): each delivery's `attempt` is its delivery count, which a nack, a crash, a
//! lost ack and an expiry raise and a deferral (`Acker::defer`: a key held elsewhere, a
//! store outage) does not. The gates run with a small
//! [`max_attempts`](Config::max_attempts) (2), and the broker has a delivery limit of its
//! own ([`Config::broker_limit`], 4): it ends a message it would deliver more often, and
//! that is a violation — no broker limit may end a message before the gate does. Two
//! kinds of message always fail: a *killer* ([`Config::killers`]), whose handler kills
//! its process on every run (as a crash does), and a *recurring failure*
//! ([`Config::recurring`]), whose handler fails with a transient error on every attempt.
//!
//! The search is depth-first over choice sequences, replaying each prefix from the start
//! (futures cannot be copied), with a visited set over a hash of the state — the store,
//! the broker, the filter, each worker's position (a hash of what it was granted) and the
//! remaining fault budgets — so that interleavings reaching the same state are explored
//! once. A state that repeats on the current path, or a path longer than
//! [`Config::max_depth`], is a livelock.
//!
//! Checked at every step: at most one effect per key and one outbox row per effect; an ack
//! only for a key the store has committed, and (one delivery or batch per worker) never
//! while the worker's own transaction is open; a filter mark only for a committed claim of
//! the same store identity, and a filter "done" only for a key the store has; a permanent
//! failure is never handed back (it would loop); no two transactions wait on each other
//! (deadlock); no message is ended by the broker's limit; a killer runs at most
//! `max_attempts` times; a valid message is dead-lettered with `attempts_exhausted` only
//! once the deliveries that count against it reach `max_attempts` — its delivery count
//! less the deliveries a store outage cost it (a nack after an outage, tracked in process
//! mode) — or, on the gate's own count of store failures, after that many outages;
//! optionally ([`Config::neighbour_check`]) a killer costs each message held beside it
//! one run at most. At quiescence: every delivery settled, one effect per distinct valid
//! key (less what a restore took after its messages were settled, and less a key whose
//! every message ran out of attempts), dead letters exactly the poison, the conflicts and
//! the exhausted, every killer and recurring failure dead-lettered with
//! `attempts_exhausted` (or refused for good) and without an effect.
//!
//! ```
//! use idem_testkit::explore::{explore, Config};
//! let report = explore(&Config::tiny());
//! assert_eq!(report.violation, None);
//! assert!(report.exhaustive && report.states > 10);
//! ```

mod exec;
mod world;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

pub use exec::Mode;
pub use world::Fault;

use exec::Run;

/// A deliberately broken variant the explorer must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// A gate mutant compiled into `idem-core` (its `_mutants` feature).
    Core(idem_engine::mutant::Mutant),
    /// Filter marks that ignore the store identity.
    UnscopedFilterMarks,
    /// A store whose commit that applied nothing (a transaction aborted inside, Postgres's
    /// 25P02) reports success instead of an error: the gate acks a message it never
    /// wrote, which the explorer must see.
    VoidCommitReportedOk,
}

impl Mutant {
    /// Every mutant, with its command-line name.
    pub const ALL: [(&'static str, Mutant); 12] = [
        (
            "ack-before-commit",
            Mutant::Core(idem_engine::mutant::Mutant::AckBeforeCommit),
        ),
        (
            "filter-mark-before-commit",
            Mutant::Core(idem_engine::mutant::Mutant::FilterMarkBeforeCommit),
        ),
        ("unscoped-filter-marks", Mutant::UnscopedFilterMarks),
        (
            "unsorted-batch-claims",
            Mutant::Core(idem_engine::mutant::Mutant::UnsortedBatchClaims),
        ),
        (
            "permanent-error-nacked",
            Mutant::Core(idem_engine::mutant::Mutant::PermanentErrorNacked),
        ),
        (
            "duplicate-ack-before-rollback",
            Mutant::Core(idem_engine::mutant::Mutant::DuplicateAckBeforeRollback),
        ),
        (
            "key-order-batch-claims",
            Mutant::Core(idem_engine::mutant::Mutant::KeyOrderBatchClaims),
        ),
        (
            "no-attempt-check-before-handler",
            Mutant::Core(idem_engine::mutant::Mutant::NoAttemptCheckBeforeHandler),
        ),
        (
            "outage-nacked",
            Mutant::Core(idem_engine::mutant::Mutant::OutageNacked),
        ),
        ("void-commit-reported-ok", Mutant::VoidCommitReportedOk),
        (
            "store-fault-charged",
            Mutant::Core(idem_engine::mutant::Mutant::StoreFaultCharged),
        ),
        (
            "later-payload-not-held",
            Mutant::Core(idem_engine::mutant::Mutant::LaterPayloadNotHeld),
        ),
    ];

    /// The configuration this mutant is searched in, from `base`: up to two faults per
    /// run (a deadlock of unsorted batch claims needs a visibility expiry and a reversed
    /// batch, for example); for `key-order-batch-claims`, [`Config::crossing`] (its
    /// deadlock needs two identities held crosswise, and no fault); for
    /// `no-attempt-check-before-handler`, [`Config::killer`] (the killer is run again
    /// past the limit); for `outage-nacked` and `store-fault-charged`,
    /// [`Config::outages`] (a message meets `max_attempts` store outages); for
    /// `later-payload-not-held`, [`Config::first_wins`]; for `void-commit-reported-ok`, at
    /// least one void commit.
    pub fn config(self, base: &Config) -> Config {
        use idem_engine::mutant::Mutant as M;
        let mut config = match self {
            Mutant::Core(M::KeyOrderBatchClaims) => Config::crossing(base),
            Mutant::Core(M::NoAttemptCheckBeforeHandler) => Config::killer(base),
            Mutant::Core(M::OutageNacked | M::StoreFaultCharged) => Config::outages(base),
            Mutant::Core(M::LaterPayloadNotHeld) => Config::first_wins(base),
            _ => {
                let mut c = base.clone();
                c.budgets.total = c.budgets.total.max(2);
                // Only its own mutant needs a void commit: with two faults per run it
                // multiplies the space the others are searched in, and none needs it.
                c.budgets.void_commits = if self == Mutant::VoidCommitReportedOk {
                    c.budgets.void_commits.max(1)
                } else {
                    0
                };
                c
            }
        };
        config.mutant = Some(self);
        config
    }

    /// The mutant called `name`.
    pub fn by_name(name: &str) -> Option<Mutant> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, m)| *m)
    }

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, m)| *m == self)
            .map_or("?", |(n, _)| n)
    }
}

/// Fault budgets: how many of each the explorer may inject in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Budgets {
    /// Workers killed at a choice point (a commit that takes effect and then crashes counts).
    pub crashes: u32,
    /// Transient `Unavailable` errors (an unknown commit outcome counts).
    pub unavailable: u32,
    /// Transient `Conflict` errors (serialization failure).
    pub conflict: u32,
    /// Permanent `Rejected` errors (the key stays refused).
    pub rejected: u32,
    /// `Config` errors (the consumer must stop).
    pub config: u32,
    /// Acks sent and lost.
    pub lost_acks: u32,
    /// Visibility timeouts that expire while a message is in flight.
    pub expiries: u32,
    /// Front-filter outages.
    pub outages: u32,
    /// Restores of the store from the snapshot before its latest commit.
    pub restores: u32,
    /// Claims that give up waiting on a lock (`InProgress`).
    pub lock_timeouts: u32,
    /// Commits that apply nothing (the transaction was aborted inside, Postgres's 25P02),
    /// which the store reports as a `Conflict` (as `idem-store-postgres` does).
    pub void_commits: u32,
    /// Faults of any kind in one run, at most (the kinds' own budgets still apply).
    pub total: u32,
}

impl Budgets {
    /// No fault of any kind.
    pub const NONE: Self = Self {
        crashes: 0,
        unavailable: 0,
        conflict: 0,
        rejected: 0,
        config: 0,
        lost_acks: 0,
        expiries: 0,
        outages: 0,
        restores: 0,
        lock_timeouts: 0,
        void_commits: 0,
        total: 0,
    };
}

/// What to explore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Concurrent workers (processes in `process` mode; batches in flight in `consumer`).
    pub workers: usize,
    /// Distinct valid keys.
    pub keys: u8,
    /// How many times the first key is delivered (published copies).
    pub copies: usize,
    /// Bad-input messages.
    pub poison: usize,
    /// Conflicting resubmissions: for each of the first `conflicts` keys, one message with
    /// another payload of the same submission (the same subject and timestamp: the same
    /// identity, another key).
    pub conflicts: u8,
    /// What the gate does with a conflicting resubmission. Under the default
    /// (dead-letter), each submission has at most one effect at every step and exactly one
    /// at quiescence, and a conflict's dead letters are its only ones; under `Process`,
    /// one effect per key.
    pub on_conflict: idem_engine::ConflictPolicy,
    /// The most deliveries a worker takes at once.
    pub batch: usize,
    /// Which futures drive the gate.
    pub mode: Mode,
    /// Fault budgets.
    pub budgets: Budgets,
    /// A longer path is a livelock.
    pub max_depth: usize,
    /// Messages whose handler kills its process on every run (as a crash does): each
    /// must end dead-lettered by the gate with `attempts_exhausted`, after at most
    /// `max_attempts` runs.
    pub killers: usize,
    /// Messages whose handler fails with a transient error on every attempt: each must
    /// end dead-lettered by the gate with `attempts_exhausted`.
    pub recurring: usize,
    /// The gates' [`GateConfig::max_attempts`](idem_engine::GateConfig::max_attempts).
    pub max_attempts: u32,
    /// The broker ends (to its own dead-letter place, with no reason) a message it would
    /// deliver more than this many times: a violation, since no broker limit may end a
    /// message before the gate does.
    pub broker_limit: u32,
    /// Whether the broker counts runs only ([`idem_engine::Acker::attempt_counts_runs`]): a
    /// deferral hands the message back without raising its delivery count (a nack, a
    /// crash, a lost ack and an expiry raise it). Otherwise a deferral is a nack.
    pub counts_runs: bool,
    /// Whether the gates check the attempt before the handler
    /// ([`GateConfig::check_attempts_before_handler`](idem_engine::GateConfig::check_attempts_before_handler)).
    /// On in [`Config::killer`] and [`Config::outages`], as a user gets it (the gate's
    /// default). Off in the default passes: there a rerun is batched with its neighbours,
    /// which the batch mutants need (with the check on, a rerun is processed alone and
    /// `unsorted-batch-claims` was not caught in ten minutes).
    pub check_before_handler: bool,
    /// Whether a message that kills its process may cost each message held beside it one
    /// broker delivery at most. Off by default: a process holds more deliveries than it
    /// runs, so a killer's every run costs the deliveries held beside it one delivery
    /// each. Those are not charged as runs (the store records only the runs that start,
    /// `ClaimStore::note_run`), so no neighbour is dead-lettered for them; the broker's
    /// own limit, which counts them, needs its margin.
    pub neighbour_check: bool,
    /// Whether of two payloads of one submission the first a worker received must be the
    /// one that takes effect ([`Config::first_wins`]): checked at every commit. Off by
    /// default: across processes, or after a crash or an expiry, arrival order is the
    /// broker's to keep.
    pub first_wins: bool,
    /// The mutant to run instead of the real protocol.
    pub mutant: Option<Mutant>,
    /// Give up (not exhaustive) after this long.
    pub time_limit: Duration,
}

impl Default for Config {
    /// The default configuration docs/testing.md and CI run: 2 workers, 2 keys (the first
    /// delivered twice), batches of up to 2, budgets of 2 crashes, 1 error of each class,
    /// 1 lost ack, 1 visibility expiry, 1 filter outage, 1 restore, 1 lock timeout, 1
    /// void commit — and at most one fault of any kind per run (`total`), which keeps the
    /// space exhaustive; `--max-faults 2` is the larger configuration. A broker that
    /// counts runs, `max_attempts` 2 and a broker limit of 4 (two deliveries to spare:
    /// the gate needs the one past `max_attempts` to dead-letter, and a crash may cost
    /// that one).
    fn default() -> Self {
        Self {
            workers: 2,
            keys: 2,
            copies: 2,
            poison: 0,
            conflicts: 0,
            on_conflict: idem_engine::ConflictPolicy::DeadLetter,
            batch: 2,
            mode: Mode::Process,
            budgets: Budgets {
                crashes: 2,
                unavailable: 1,
                conflict: 1,
                rejected: 1,
                config: 1,
                lost_acks: 1,
                expiries: 1,
                outages: 1,
                restores: 1,
                lock_timeouts: 1,
                void_commits: 1,
                total: 1,
            },
            max_depth: 400,
            killers: 0,
            recurring: 0,
            max_attempts: 2,
            broker_limit: 4,
            counts_runs: true,
            check_before_handler: false,
            neighbour_check: false,
            first_wins: false,
            mutant: None,
            time_limit: Duration::from_secs(3600),
        }
    }
}

impl Config {
    /// Conflicting resubmissions under `policy`, from `base` (its mode, workers, batch and
    /// budgets): one submission sent with two payloads (one key and one conflicting key),
    /// each once.
    pub fn conflicts(base: &Config, policy: idem_engine::ConflictPolicy) -> Self {
        Self {
            keys: 1,
            copies: 1,
            conflicts: 1,
            on_conflict: policy,
            ..base.clone()
        }
    }

    /// Two submissions each sent with two payloads, in batches of two, with every
    /// interleaving but no fault: two batches can then hold the two identities crosswise
    /// (the one deadlock that claiming in key order alone allows, see
    /// [`idem_engine::claim_order`]).
    pub fn crossing(base: &Config) -> Self {
        let mut c = Self {
            keys: 2,
            copies: 1,
            conflicts: 2,
            batch: base.batch.max(2),
            workers: base.workers.max(2),
            mode: Mode::Process,
            on_conflict: idem_engine::ConflictPolicy::DeadLetter,
            ..base.clone()
        };
        c.budgets.total = 0;
        c
    }

    /// A message that kills its process on every run, beside one valid key delivered
    /// once, in `base`'s mode, workers, batch and budgets — without restores: the runs a
    /// store records (`ClaimStore::note_run`) are lost with the rest of what its backup
    /// lacks, so after a restore a killer may run `max_attempts` times more, and reach a
    /// broker's own delivery limit (docs/operations.md says so).
    pub fn killer(base: &Config) -> Self {
        let mut c = Self {
            keys: 1,
            copies: 1,
            conflicts: 0,
            killers: 1,
            recurring: 0,
            check_before_handler: true,
            ..base.clone()
        };
        c.budgets.restores = 0;
        c
    }

    /// A message whose handler fails transiently on every attempt, beside one valid key
    /// delivered once, in `base`'s mode, batch and budgets, with one worker (one batch in
    /// flight): a second one multiplies the interleavings of its retries by eight and adds
    /// nothing the recurrence depends on.
    pub fn recurring(base: &Config) -> Self {
        Self {
            workers: 1,
            keys: 1,
            copies: 1,
            conflicts: 0,
            killers: 0,
            recurring: 1,
            ..base.clone()
        }
    }

    /// Store outages on one message: one valid key delivered once and one message whose
    /// handler fails on every attempt (its failures are counted by the broker's delivery
    /// count, which an outage must not raise), one worker, up to `max_attempts` store
    /// outages and as many faults per run (the other budgets as `base`'s).
    pub fn outages(base: &Config) -> Self {
        let mut c = Self {
            workers: 1,
            keys: 1,
            copies: 1,
            conflicts: 0,
            killers: 0,
            recurring: 1,
            check_before_handler: true,
            ..base.clone()
        };
        c.budgets.unavailable = c.budgets.unavailable.max(c.max_attempts);
        c.budgets.total = c.budgets.total.max(c.max_attempts);
        c
    }

    /// The first delivered wins through failures: one submission sent with two payloads,
    /// one worker (one process: its gate keeps the order), in `base`'s mode and batch, with
    /// up to two failures of the store's side (unavailable, serialization) and a lock
    /// timeout, and no crash, expiry or restore (which hand a delivery to another
    /// process); the key received first must be the one that takes effect.
    pub fn first_wins(base: &Config) -> Self {
        let mut c = Self {
            workers: 1,
            keys: 1,
            copies: 1,
            conflicts: 1,
            killers: 0,
            recurring: 0,
            on_conflict: idem_engine::ConflictPolicy::DeadLetter,
            first_wins: true,
            ..base.clone()
        };
        c.budgets = Budgets {
            unavailable: 1,
            conflict: 1,
            lock_timeouts: 1,
            total: 2,
            ..Budgets::NONE
        };
        c
    }

    /// A small configuration for doc tests and quick checks: one fault of a few kinds.
    pub fn tiny() -> Self {
        Self {
            workers: 2,
            keys: 1,
            copies: 2,
            batch: 1,
            budgets: Budgets {
                crashes: 1,
                unavailable: 0,
                conflict: 0,
                rejected: 0,
                config: 0,
                lost_acks: 1,
                expiries: 0,
                outages: 0,
                restores: 0,
                lock_timeouts: 0,
                void_commits: 0,
                total: 2,
            },
            ..Self::default()
        }
    }
}

/// What an exploration found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Distinct states visited.
    pub states: u64,
    /// Runs (each replays a prefix and extends it to a leaf or a visited state).
    pub runs: u64,
    /// Whether the whole space was searched (no time limit hit, no violation stop).
    pub exhaustive: bool,
    /// The shortest violation found: the message and the choice sequence.
    pub violation: Option<(String, String)>,
    /// How long it took.
    pub elapsed: Duration,
}

/// A step of a replay, with what the world recorded while it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceStep {
    /// The choice taken.
    pub choice: String,
    /// What happened.
    pub events: Vec<String>,
}

fn encode(seq: &[usize]) -> String {
    if seq.is_empty() {
        return "-".to_owned();
    }
    seq.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(".")
}

/// Parses a sequence printed by the explorer.
///
/// # Errors
/// A message when the string is not dot-separated indices.
pub fn decode(s: &str) -> Result<Vec<usize>, String> {
    if s == "-" || s.is_empty() {
        return Ok(Vec::new());
    }
    s.split('.')
        .map(|p| p.parse().map_err(|_| format!("not a choice index: {p:?}")))
        .collect()
}

/// The search proper: depth-first over choice sequences with state caching.
struct Search<'a> {
    config: &'a Config,
    /// state hash → the shallowest depth it was seen at (depth-aware when shortening).
    visited: HashMap<u64, usize>,
    depth_aware: bool,
    runs: u64,
    started: Instant,
}

enum RunEnd {
    /// The path ended (quiescence, a visited state, or the prefix ran out on a leaf).
    Done,
    /// A violation at the end of the path.
    Violation(String),
}

impl Search<'_> {
    /// Runs `prefix`, then extends it with first choices until a leaf, a visited state or a
    /// violation; returns the frames (choice, options) of the whole path.
    fn run(&mut self, prefix: &[usize], limit: usize) -> (Vec<(usize, usize)>, RunEnd) {
        self.runs += 1;
        let mut run = Run::new(self.config);
        let mut frames: Vec<(usize, usize)> = Vec::new();
        let mut on_path: HashSet<u64> = HashSet::new();
        loop {
            let depth = frames.len();
            if let Some(v) = run.violation() {
                return (frames, RunEnd::Violation(v));
            }
            let choices = run.choices();
            let h = run.state_hash();
            if !on_path.insert(h) {
                return (
                    frames,
                    RunEnd::Violation("livelock: a state repeats without progress".into()),
                );
            }
            if depth >= prefix.len() {
                let seen_at = self.visited.get(&h).copied();
                let prune = match seen_at {
                    Some(d) => !self.depth_aware || d <= depth,
                    None => false,
                };
                if prune {
                    return (frames, RunEnd::Done);
                }
                self.visited.insert(h, depth);
            }
            if choices.is_empty() {
                return match run.quiescence() {
                    Some(v) => (frames, RunEnd::Violation(v)),
                    None => (frames, RunEnd::Done),
                };
            }
            if depth >= limit {
                if limit >= self.config.max_depth {
                    return (
                        frames,
                        RunEnd::Violation(format!(
                            "livelock: no quiescence within {} steps",
                            self.config.max_depth
                        )),
                    );
                }
                return (frames, RunEnd::Done);
            }
            let pick = prefix
                .get(depth)
                .copied()
                .unwrap_or(0)
                .min(choices.len() - 1);
            frames.push((pick, choices.len()));
            run.apply(&choices[pick]);
        }
    }

    /// Depth-first search from the root; stops at the first violation.
    fn search(&mut self, limit: usize) -> (bool, Option<(String, Vec<usize>)>) {
        let mut prefix: Vec<usize> = Vec::new();
        loop {
            if self.started.elapsed() > self.config.time_limit {
                return (false, None);
            }
            let (mut frames, end) = self.run(&prefix, limit);
            if let RunEnd::Violation(v) = end {
                return (false, Some((v, frames.iter().map(|f| f.0).collect())));
            }
            // Backtrack to the deepest frame with an untried option.
            loop {
                match frames.pop() {
                    None => return (true, None),
                    Some((c, n)) if c + 1 < n => {
                        frames.push((c + 1, n));
                        break;
                    }
                    Some(_) => {}
                }
            }
            prefix = frames.iter().map(|f| f.0).collect();
        }
    }
}

fn with_mutant<T>(m: Option<Mutant>, f: impl FnOnce() -> T) -> T {
    let core = match m {
        Some(Mutant::Core(c)) => Some(c),
        _ => None,
    };
    idem_engine::mutant::set(core);
    let out = f();
    idem_engine::mutant::set(None);
    out
}

/// Explores `config`'s space: exhaustively, or until the first violation, which it then
/// shortens (searching again below its length) and reports as a replayable sequence.
pub fn explore(config: &Config) -> Report {
    with_mutant(config.mutant, || {
        let started = Instant::now();
        let mut s = Search {
            config,
            visited: HashMap::new(),
            depth_aware: false,
            runs: 0,
            started,
        };
        let (exhaustive, found) = s.search(config.max_depth);
        let mut states = s.visited.len() as u64;
        let mut runs = s.runs;
        let violation = found.map(|(msg, seq)| {
            let (msg, seq) = shorten(config, msg, seq, &mut states, &mut runs, started);
            (msg, encode(&seq))
        });
        Report {
            states,
            runs,
            exhaustive,
            violation,
            elapsed: started.elapsed(),
        }
    })
}

/// Searches for shorter failing sequences than `seq` (depth-aware, so a state reached by a
/// shorter path is explored again), within a third of the time limit.
fn shorten(
    config: &Config,
    mut msg: String,
    mut seq: Vec<usize>,
    states: &mut u64,
    runs: &mut u64,
    started: Instant,
) -> (String, Vec<usize>) {
    let budget = Instant::now();
    let cap = Duration::from_secs(20).min(config.time_limit / 3);
    while seq.len() > 1 && budget.elapsed() < cap {
        let limited = Config {
            time_limit: started.elapsed() + cap.saturating_sub(budget.elapsed()),
            ..config.clone()
        };
        let mut s = Search {
            config: &limited,
            visited: HashMap::new(),
            depth_aware: true,
            runs: 0,
            started,
        };
        let (_, found) = s.search(seq.len() - 1);
        *states += s.visited.len() as u64;
        *runs += s.runs;
        match found {
            Some((m, shorter)) if shorter.len() < seq.len() => {
                msg = m;
                seq = shorter;
            }
            _ => break,
        }
    }
    (msg, seq)
}

/// Reruns `seq` step by step and returns what happened at each step, and the violation
/// it ends in, if any.
///
/// # Errors
/// A message when `seq` is not a sequence of this configuration's choices.
pub fn replay(config: &Config, seq: &str) -> Result<(Vec<TraceStep>, Option<String>), String> {
    let seq = decode(seq)?;
    with_mutant(config.mutant, || {
        let mut run = Run::new(config);
        let mut steps = vec![TraceStep {
            choice: "start".into(),
            events: run.take_trace(),
        }];
        for (i, &c) in seq.iter().enumerate() {
            if let Some(v) = run.violation() {
                return Ok((steps, Some(v)));
            }
            let choices = run.choices();
            let Some(choice) = choices.get(c) else {
                return Err(format!(
                    "step {i}: choice {c} does not exist ({} options)",
                    choices.len()
                ));
            };
            let label = run.describe(choice);
            run.apply(choice);
            steps.push(TraceStep {
                choice: format!("{c}: {label}"),
                events: run.take_trace(),
            });
        }
        let end = run
            .violation()
            .or_else(|| run.choices().is_empty().then(|| run.quiescence()).flatten());
        Ok((steps, end))
    })
}
