#![cfg(feature = "mutants")]
//! The exactly-once property can fail: with the gate's ack-before-commit mutant switched
//! on (a gate that acks, then commits), a crash during the commit that loses it leaves an
//! acked submission with no effect, and `check_exactly_once` reports it. (Its own test
//! binary: the mutant switch is process-wide.)

use idem_engine::mutant::{self, Mutant};
use idem_testkit::sim::{check_exactly_once, Case};
use idem_testkit::{CrashPoint, MemoryStore};

fn case(seed: u64) -> Case {
    Case {
        submissions: (0..10)
            .map(|i| (format!("M-{i}"), "2026-07-01T09:00:00Z".to_owned(), 100 + i))
            .collect(),
        poison: 0,
        redelivery_rate: 0.0,
        // Crashes during five commits: each takes effect or not by a coin.
        crashes: (1..=5).map(|n| (CrashPoint::DuringCommit, n)).collect(),
        errors: Vec::new(),
        expiry_rate: 0.0,
        concurrency: 1,
        batch_size: 1,
        seed,
    }
}

#[test]
fn an_ack_before_the_commit_loses_a_submission_and_the_property_says_so() {
    idem_testkit::fault::quiet_injected_crashes();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The real gate: exactly once whatever the coins say.
    for seed in 0..8 {
        let r = rt.block_on(check_exactly_once(MemoryStore::new(), &case(seed)));
        assert!(r.is_ok(), "seed {seed}: {}", r.unwrap_err());
    }
    // The mutant: some seed's coin loses a commit that was already acked.
    mutant::set(Some(Mutant::AckBeforeCommit));
    let caught = (0..8)
        .filter_map(|seed| {
            rt.block_on(check_exactly_once(MemoryStore::new(), &case(seed)))
                .err()
        })
        .collect::<Vec<_>>();
    mutant::set(None);
    assert!(
        caught.iter().any(|e| e.contains("exactly-once violated")),
        "the mutant went unnoticed: {caught:?}"
    );
}
