//! On the real server (moto; `IDEM_TEST_SQS_ENDPOINT`, default
//! `http://127.0.0.1:5000`): a missing server fails the test.

use super::tasks::delete_batch;
use super::*;

#[test]
fn a_reason_keeps_only_what_sqs_takes() {
    let reason = "failed:\t\u{1b}[31mred\u{1b}[0m\r\nline \u{0}two \u{FFFF} é 🦀 \u{7f}";
    assert_eq!(
        sqs_text(reason),
        "failed:\t\u{FFFD}[31mred\u{FFFD}[0m\r\nline \u{FFFD}two \u{FFFD} é 🦀 \u{7f}"
    );
    assert_eq!(sqs_text("plain"), "plain");
}

fn endpoint() -> String {
    std::env::var("IDEM_TEST_SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned())
}

async fn queue_with(client: &Client, n: usize) -> (String, Vec<String>) {
    let name = format!("idem-test-batch-{:08x}", rand::random::<u32>());
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .expect("moto reachable (IDEM_TEST_SQS_ENDPOINT)")
        .queue_url
        .expect("url");
    for i in 0..n {
        client
            .send_message()
            .queue_url(&url)
            .message_body(format!("m{i}"))
            .send()
            .await
            .expect("send");
    }
    let mut receipts = Vec::new();
    while receipts.len() < n {
        let got = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .visibility_timeout(60)
            .send()
            .await
            .expect("receive")
            .messages
            .unwrap_or_default();
        receipts.extend(got.into_iter().filter_map(|m| m.receipt_handle));
    }
    (url, receipts)
}

async fn left(client: &Client, url: &str) -> u64 {
    let a = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::All)
        .send()
        .await
        .expect("attributes")
        .attributes
        .unwrap_or_default();
    [
        aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages,
        aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
    ]
    .iter()
    .filter_map(|k| a.get(k).and_then(|v| v.parse::<u64>().ok()))
    .sum()
}

/// One `DeleteMessageBatch` with two good receipt handles and, between them, one the
/// queue does not know (a handle of another queue's message) and one that is not a
/// handle at all: SQS fails those entries and deletes the others. The result is an
/// error exactly for the failed entries (an ack reported for them would be a lie:
/// their messages are still there), and the queues agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_delete_batch_failure_is_reported_per_entry() {
    let client = crate::sqs::client(Some(&endpoint())).await;
    let (url, mine) = queue_with(&client, 2).await;
    let (other_url, theirs) = queue_with(&client, 1).await;
    let batch = vec![
        mine[0].clone(),
        theirs[0].clone(),
        "not-a-receipt-handle".to_owned(),
        mine[1].clone(),
    ];
    let results = delete_batch(&client, &url, &batch).await;
    assert_eq!(results.len(), 4);
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(results[1].is_err(), "a stranger's handle reported deleted");
    assert!(results[2].is_err(), "a bad handle reported deleted");
    assert!(results[3].is_ok(), "{:?}", results[3]);
    assert!(!results[1].as_ref().unwrap_err().is_retryable());
    assert_eq!(left(&client, &url).await, 0, "both good ones deleted");
    assert_eq!(
        left(&client, &other_url).await,
        1,
        "the other queue's message stays"
    );
}
