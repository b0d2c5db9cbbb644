//! Redis Streams on the real server (`IDEM_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`) and the real Postgres store (`IDEM_TEST_POSTGRES_URL`). A
//! missing service fails the test.

mod common;

use std::time::Duration;

use common::Broker;

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_REDIS_URL",
        "redis://127.0.0.1:6379",
        // A dead consumer's pending entries are taken over after half a second.
        "min_idle=500ms&block=200ms",
        Duration::from_secs(3),
        false,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_is_taken_over_and_skipped() {
    common::within(common::crash_after_commit_before_ack(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_goes_to_the_dead_letter_stream_with_its_reason() {
    common::within(common::poison_is_dead_lettered(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_delivers_each_event_once_downstream() {
    common::within(common::relay_delivers_each_event_once(broker())).await;
}
