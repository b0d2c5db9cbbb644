//! The ledger model: what should have happened, checked against what the store holds.

use std::collections::HashMap;

use idem_engine::IdempotencyKey;

use crate::harness::Effect;

/// A way in which a run was not exactly-once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A distinct submission has no effect.
    Lost {
        /// Its key.
        key: IdempotencyKey,
    },
    /// A submission took effect more than once.
    Duplicated {
        /// Its key.
        key: IdempotencyKey,
        /// How many effects it has.
        count: usize,
    },
    /// An effect that no valid submission explains.
    Unexpected {
        /// Its key.
        key: IdempotencyKey,
    },
    /// The effect's amount is not the submission's.
    WrongAmount {
        /// Its key.
        key: IdempotencyKey,
        /// The submission's amount.
        expected: i64,
        /// The effect's amount.
        actual: i64,
    },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lost { key } => write!(f, "lost: {} has no effect", key.short()),
            Self::Duplicated { key, count } => {
                write!(f, "duplicated: {} took effect {count} times", key.short())
            }
            Self::Unexpected { key } => write!(f, "unexpected effect {}", key.short()),
            Self::WrongAmount {
                key,
                expected,
                actual,
            } => {
                write!(
                    f,
                    "wrong amount for {}: expected {expected}, got {actual}",
                    key.short()
                )
            }
        }
    }
}

/// The expected effects: one per distinct valid submission.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    expected: HashMap<IdempotencyKey, (String, i64)>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Expects exactly one effect for `key` (recording it twice is the same expectation).
    pub fn expect(&mut self, key: IdempotencyKey, subject: impl Into<String>, amount: i64) {
        self.expected.insert(key, (subject.into(), amount));
    }

    /// How many distinct effects are expected.
    pub fn len(&self) -> usize {
        self.expected.len()
    }

    /// Whether nothing is expected.
    pub fn is_empty(&self) -> bool {
        self.expected.is_empty()
    }

    /// The sum of the expected amounts.
    pub fn expected_total(&self) -> i64 {
        self.expected.values().map(|(_, a)| a).sum()
    }

    /// Every way `effects` differs from exactly one effect per expected submission.
    pub fn violations(&self, effects: &[Effect]) -> Vec<Violation> {
        let mut seen: HashMap<IdempotencyKey, Vec<i64>> = HashMap::new();
        for e in effects {
            seen.entry(e.key).or_default().push(e.amount);
        }
        let mut out = Vec::new();
        for (key, (_, amount)) in &self.expected {
            match seen.get(key) {
                None => out.push(Violation::Lost { key: *key }),
                Some(v) if v.len() > 1 => out.push(Violation::Duplicated {
                    key: *key,
                    count: v.len(),
                }),
                Some(v) if v[0] != *amount => {
                    out.push(Violation::WrongAmount {
                        key: *key,
                        expected: *amount,
                        actual: v[0],
                    });
                }
                Some(_) => {}
            }
        }
        for key in seen.keys() {
            if !self.expected.contains_key(key) {
                out.push(Violation::Unexpected { key: *key });
            }
        }
        out
    }

    /// Panics with every violation unless `effects` is exactly one effect per expected
    /// submission.
    pub fn assert_exactly_once(&self, effects: &[Effect]) {
        let v = self.violations(effects);
        assert!(
            v.is_empty(),
            "exactly-once violated ({} problems): {}",
            v.len(),
            v.iter()
                .take(10)
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
}
