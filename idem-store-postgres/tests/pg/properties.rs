//! The exactly-once property (any schedule of deliveries, redeliveries and crashes at
//! every point) against the real server, each case in its own schema, on each layout.

use crate::common;

use std::sync::OnceLock;

use idem_testkit::sim::check_exactly_once;
use idem_testkit::strategies;
use proptest::prelude::*;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fn cases() -> u32 {
    std::env::var("IDEM_PG_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_is_exactly_once_on_postgres(case in strategies::case()) {
        static QUIET: std::sync::Once = std::sync::Once::new();
        QUIET.call_once(idem_testkit::fault::quiet_injected_crashes);
        let result = runtime().block_on(async {
            let store = common::fresh_store().await;
            let result = check_exactly_once(store.clone(), &case).await;
            if result.is_ok() {
                common::drop_schema(&store.0).await;
            }
            store.0.pool().close().await;
            result
        });
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }

    /// The same property on the partitioned layout (claims filed by submission month).
    #[test]
    fn any_schedule_is_exactly_once_on_partitioned_postgres(case in strategies::case()) {
        static QUIET: std::sync::Once = std::sync::Once::new();
        QUIET.call_once(idem_testkit::fault::quiet_injected_crashes);
        let result = runtime().block_on(async {
            let store = common::fresh_partitioned_store().await;
            let result = check_exactly_once(store.clone(), &case).await;
            if result.is_ok() {
                // Every claim was filed under a month partition, none in the default one.
                let in_default: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM {}",
                    store.0.table("processed_messages_default")
                )))
                .fetch_one(store.0.pool())
                .await
                .expect("count the default partition");
                assert_eq!(in_default, 0, "claims fell into the default partition");
                common::drop_schema(&store.0).await;
            }
            store.0.pool().close().await;
            result
        });
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }

    /// The same property on the distributed layout (claims keyed `(award_id,
    /// idempotency_key)`, outbox events `(subject, event_id)`; plain Postgres).
    #[test]
    fn any_schedule_is_exactly_once_on_distributed_postgres(case in strategies::case()) {
        static QUIET: std::sync::Once = std::sync::Once::new();
        QUIET.call_once(idem_testkit::fault::quiet_injected_crashes);
        let result = runtime().block_on(async {
            let store = common::fresh_distributed_store().await;
            assert_eq!(store.0.layout(), idem_store_postgres::PgLayout::Distributed);
            let result = check_exactly_once(store.clone(), &case).await;
            if result.is_ok() {
                common::drop_schema(&store.0).await;
            }
            store.0.pool().close().await;
            result
        });
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}
