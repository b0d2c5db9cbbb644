//! SQS on a real protocol server (moto; `IDEM_TEST_SQS_ENDPOINT`, default
//! `http://127.0.0.1:5000`, started by `scripts/ensure-sqs`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing server fails the test.

mod common;

use std::time::Duration;

use common::Broker;
use idem_broker::any::BrokerUrl;

fn broker() -> Broker {
    let endpoint = std::env::var("IDEM_TEST_SQS_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned());
    let host = endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/');
    // A received, unsettled message comes back after two seconds; short long polls.
    let url = format!("sqs://{host}?visibility_timeout=2s&wait=1s");
    Broker {
        url: BrokerUrl::parse(&url).unwrap_or_else(|e| panic!("IDEM_TEST_SQS_ENDPOINT: {e}")),
        // Longer than the visibility timeout plus a long poll.
        idle: Duration::from_secs(5),
        // A standard queue does not drop a republished event id.
        dedups_event_ids: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_is_redelivered_and_skipped() {
    common::crash_after_commit_before_ack(broker()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_goes_to_the_dead_letter_queue_with_its_reason() {
    common::poison_is_dead_lettered(broker()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_delivers_each_event_once_downstream() {
    common::relay_delivers_each_event_once(broker()).await;
}
