//! The explorer's faults of delivery counting: a broker that counts runs, its own delivery
//! limit, a message that kills its process, a failure that recurs on one message, a commit
//! that applies nothing — each explored exhaustively in a small space with the real gate,
//! and the mutants they exist to catch caught.
//!
//! The active mutant is a process-wide switch, so the tests here run one at a time.

use std::sync::Mutex;

use idem_testkit::explore::{explore, Config, Report};

static SERIAL: Mutex<()> = Mutex::new(());

fn run(config: &Config) -> Report {
    let _one = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    explore(config)
}

/// The small space of these tests: two workers, batches of one, one crash and one lost
/// ack, at most two faults per run.
fn base() -> Config {
    Config::tiny()
}

fn clean(name: &str, r: &Report) {
    assert_eq!(r.violation, None, "{name}");
    assert!(r.exhaustive, "{name}: not exhaustive");
}

#[test]
fn killer_is_dead_lettered_by_the_gate_within_the_broker_limit() {
    let r = run(&Config::killer(&base()));
    clean("killer", &r);
    assert!(r.states > 100, "{r:?}");
}

#[test]
fn recurring_failure_is_dead_lettered_by_the_gate() {
    let r = run(&Config::recurring(&base()));
    clean("recurring", &r);
}

#[test]
fn a_void_commit_reported_as_a_conflict_loses_nothing() {
    let mut c = base();
    c.budgets.void_commits = 1;
    clean("void commit", &run(&c));
}

#[test]
fn a_broker_limit_at_max_attempts_ends_the_killer_before_the_gate() {
    // The gate needs the delivery past max_attempts to dead-letter the killer unrun.
    let mut c = Config::killer(&base());
    c.broker_limit = c.max_attempts;
    let r = run(&c);
    let (v, _) = r.violation.expect("the broker's limit ends the killer");
    assert!(v.contains("broker's delivery limit"), "{v}");
}

#[test]
fn a_broker_limit_one_past_max_attempts_is_not_enough_once_a_crash_hits() {
    // A crash on the delivery that would dead-letter the killer costs one more: the
    // default limit keeps two deliveries past max_attempts.
    let mut c = Config::killer(&base());
    c.broker_limit = c.max_attempts + 1;
    let r = run(&c);
    let (v, _) = r
        .violation
        .expect("a crash on the last delivery reaches the limit");
    assert!(v.contains("broker's delivery limit"), "{v}");
    assert_eq!(Config::default().broker_limit, c.max_attempts + 2);
}

#[test]
fn a_broker_that_counts_deliveries_ends_the_killer() {
    // Without a count of runs the gate cannot tell a killer's runs from its deferrals,
    // so it never checks before the handler: the killer runs until the broker ends it.
    let mut c = Config::killer(&base());
    c.counts_runs = false;
    let r = run(&c);
    let (v, _) = r.violation.expect("the killer runs past the limit");
    assert!(
        v.contains("was run 3 times") || v.contains("broker's delivery limit"),
        "{v}"
    );
}

/// All but `void-commit-reported-ok` are gates compiled into idem-core only with the
/// `mutants` feature.
#[cfg(feature = "mutants")]
#[test]
fn the_new_mutants_are_caught_and_their_spaces_pass_without_them() {
    use idem_testkit::explore::Mutant;

    for name in [
        "no-attempt-check-before-handler",
        "outage-nacked",
        "void-commit-reported-ok",
        "store-fault-charged",
        "later-payload-not-held",
    ] {
        let m = Mutant::by_name(name).expect("a mutant of that name");
        let config = m.config(&base());
        let caught = run(&config);
        assert!(caught.violation.is_some(), "mutant {name} not caught");
        let real = Config {
            mutant: None,
            ..config
        };
        clean(&format!("{name}'s space without it"), &run(&real));
    }
}

/// A message that kills its process costs each message held beside it (received into the
/// same process, here in its batch) one broker delivery per run of the killer. Those
/// deliveries are not charged as runs (the store records only the runs that start,
/// `ClaimStore::note_run`), so no neighbour is dead-lettered for them by the gate; but
/// the broker's own limit counts them. With the margin that suffices for a killer alone
/// (`max_attempts + 2`, `Config::default().broker_limit`), a neighbour is ended by the
/// broker's limit; one delivery more (`max_attempts + 3`) and the space is clean. The
/// explorer's neighbour check (`--neighbour-check`) names the cost: more than one run lost
/// per killer.
#[test]
fn a_killer_costs_its_neighbours_broker_deliveries_but_never_runs() {
    let mut c = Config::killer(&base());
    c.batch = 2;
    assert_eq!(c.broker_limit, c.max_attempts + 2);
    let (v, _) = run(&c)
        .violation
        .expect("a neighbour is ended by the broker's limit");
    assert!(v.contains("broker's delivery limit"), "{v}");
    c.broker_limit = c.max_attempts + 3;
    clean(
        "killer in batches of two, one delivery of margin more",
        &run(&c),
    );
    c.neighbour_check = true;
    let (v, _) = run(&c)
        .violation
        .expect("a neighbour loses a delivery to each of the killer's runs");
    assert!(
        v.contains("runs to a message that kills its process"),
        "{v}"
    );
}
