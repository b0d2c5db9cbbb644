//! The SQLite store passes the shared conformance suite.

use crate::common;

idem_testkit::conformance_tests!(common::fresh().await);

/// A consumer restarted after a kill gets again what the dead process committed and did
/// not ack: a rerun whose claim is a duplicate. It is acked at once; the run recorded for
/// it is taken back after its transaction ends (SQLite has one writer: taken back while
/// the transaction held the write lock, it waited the whole busy timeout, 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_rerun_does_not_wait_on_its_own_write_lock() {
    idem_testkit::conformance::a_rerun_of_a_committed_message_is_a_duplicate_at_once(
        common::fresh().await,
    )
    .await;
}
