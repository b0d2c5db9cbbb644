//! NATS JetStream on the real server (`IDEM_TEST_NATS_URL`, default
//! `nats://127.0.0.1:4222`) and the real Postgres store (`IDEM_TEST_POSTGRES_URL`). A
//! missing service fails the test.

mod common;

use std::time::Duration;

use common::Broker;

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_NATS_URL",
        "nats://127.0.0.1:4222",
        // An unacked delivery comes back after the ack wait.
        "ack_wait=1s",
        Duration::from_secs(3),
        // The stream's duplicate window drops a republished Nats-Msg-Id.
        true,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_is_redelivered_and_skipped() {
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
