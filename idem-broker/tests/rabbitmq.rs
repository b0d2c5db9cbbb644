//! RabbitMQ on the real broker (`IDEM_TEST_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing service fails the test.

mod common;

use std::time::Duration;

use common::Broker;

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "",
        // An unacked delivery is requeued as soon as its channel closes.
        Duration::from_secs(2),
        false,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_is_redelivered_and_skipped() {
    common::within(common::crash_after_commit_before_ack(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_goes_to_the_dead_letter_queue_with_its_reason() {
    common::within(common::poison_is_dead_lettered(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_delivers_each_event_once_downstream() {
    common::within(common::relay_delivers_each_event_once(broker())).await;
}
