//! The exactly-once property on SQLite: any schedule of deliveries, redeliveries and
//! crashes at any point leaves one effect per distinct submission.

use crate::common;

use idem_testkit::sim::check_exactly_once;
use idem_testkit::strategies;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_is_exactly_once(case in strategies::case()) {
        idem_testkit::fault::quiet_injected_crashes();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let result = rt.block_on(async { check_exactly_once(common::fresh().await, &case).await });
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}
