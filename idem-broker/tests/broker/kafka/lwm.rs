//! The low-water-mark tracker against a model.

use idem_broker::kafka::LowWaterMark;
use proptest::prelude::*;

/// One step of a schedule: deliver the next offset, or settle one in flight.
#[derive(Debug, Clone)]
enum Step {
    Deliver,
    Settle(usize),
}

fn steps() -> impl Strategy<Value = (Vec<i64>, Vec<Step>)> {
    // Offsets with gaps (compacted or marker offsets), starting anywhere.
    (0i64..1_000, prop::collection::vec(1i64..4, 1..60)).prop_flat_map(|(start, gaps)| {
        let offsets: Vec<i64> = gaps
            .iter()
            .scan(start, |o, g| {
                *o += g;
                Some(*o)
            })
            .collect();
        let n = offsets.len();
        let schedule = prop::collection::vec(
            prop_oneof![Just(Step::Deliver), (0..n).prop_map(Step::Settle)],
            0..(4 * n),
        );
        (Just(offsets), schedule)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any delivery/settlement order: the mark (and every commit taken) is never past an
    /// unsettled offset, never goes back, and reaches one past the last offset once all
    /// settled.
    #[test]
    fn low_water_mark_matches_the_model((offsets, schedule) in steps()) {
        let mut lwm = LowWaterMark::new();
        // The model: each delivered offset and whether it settled.
        let mut delivered: Vec<(i64, bool)> = Vec::new();
        let mut last_commit: Option<i64> = None;
        let check = |lwm: &mut LowWaterMark, delivered: &[(i64, bool)], last: &mut Option<i64>| -> Result<(), TestCaseError> {
            let expected = delivered
                .iter()
                .find(|(_, s)| !s)
                .map(|(o, _)| *o)
                .or_else(|| delivered.last().map(|(o, _)| o + 1));
            prop_assert_eq!(lwm.mark(), expected);
            if let Some(c) = lwm.take_commit() {
                prop_assert_eq!(Some(c), expected);
                prop_assert!(last.is_none_or(|l| c > l), "commit went back: {:?} then {}", last, c);
                for (o, settled) in delivered {
                    prop_assert!(*settled || *o >= c, "commit {} passes unsettled {}", c, o);
                }
                *last = Some(c);
            }
            Ok(())
        };
        let settle = |lwm: &mut LowWaterMark, delivered: &mut Vec<(i64, bool)>, i: usize| {
            let open: Vec<usize> = (0..delivered.len()).filter(|&j| !delivered[j].1).collect();
            if !open.is_empty() {
                let j = open[i % open.len()];
                assert!(lwm.settle(delivered[j].0));
                delivered[j].1 = true;
            }
        };
        for step in schedule {
            match step {
                Step::Deliver if delivered.len() < offsets.len() => {
                    let o = offsets[delivered.len()];
                    prop_assert!(lwm.register(o));
                    delivered.push((o, false));
                }
                Step::Deliver => {}
                Step::Settle(i) => settle(&mut lwm, &mut delivered, i),
            }
            check(&mut lwm, &delivered, &mut last_commit)?;
        }
        // Then everything is delivered and settled, in whatever order remains.
        while delivered.len() < offsets.len() {
            let o = offsets[delivered.len()];
            prop_assert!(lwm.register(o));
            delivered.push((o, false));
            check(&mut lwm, &delivered, &mut last_commit)?;
        }
        let mut k = offsets.len();
        while delivered.iter().any(|(_, s)| !s) {
            k = k.wrapping_mul(31).wrapping_add(7);
            settle(&mut lwm, &mut delivered, k);
            check(&mut lwm, &delivered, &mut last_commit)?;
        }
        let end = offsets.last().map(|o| o + 1);
        prop_assert_eq!(lwm.mark(), end);
        prop_assert_eq!(lwm.committed(), end);
        prop_assert_eq!(lwm.in_flight(), 0);
        // A delivery that goes back is refused.
        prop_assert!(!lwm.register(offsets[0]));
    }
}
