//! The testkit's conformance suite on the lease store, against the real Redis at
//! `IDEM_TEST_REDIS_URL`, once per client. The checks that need business writes in the
//! claim's transaction skip themselves (`transactional_writes` is false).

use crate::common;

#[cfg(feature = "fred")]
mod fred {
    idem_testkit::conformance_tests!(
        super::common::lease_store(idem_store_redis::ClientKind::Fred).await
    );
}

#[cfg(feature = "redis-rs")]
mod redis_rs {
    idem_testkit::conformance_tests!(
        super::common::lease_store(idem_store_redis::ClientKind::RedisRs).await
    );
}
