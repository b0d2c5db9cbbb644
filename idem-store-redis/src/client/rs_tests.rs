use std::time::Duration;

use super::rs::Lazy;
use crate::error::RedisError;

fn url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn fresh_key(tag: &str) -> String {
    format!("idem-test:rs-errors:{tag}:{:016x}", rand::random::<u64>())
}

#[tokio::test]
async fn a_wrong_type_inside_a_pipeline_is_refused() {
    let c = Lazy::new(&url(), &Default::default(), Duration::from_secs(3)).expect("url");
    let list = fresh_key("list");
    let free = fresh_key("free");
    // A list under the key: `SET … GET` answers WRONGTYPE for it.
    c.eval_each(
        "setup",
        "redis.call('RPUSH', KEYS[1], 'x'); redis.call('PEXPIRE', KEYS[1], 60000); return 1",
        std::slice::from_ref(&list),
        &[],
    )
    .await
    .expect("setup");
    let err = c
        .set_nx_get("claim", &[free, list], "token", 60_000)
        .await
        .expect_err("WRONGTYPE");
    assert!(
        matches!(
            err,
            RedisError::Refused {
                action: "claim",
                ..
            }
        ) && !err.is_retryable(),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_reply_of_the_wrong_type_is_unexpected() {
    let c = Lazy::new(&url(), &Default::default(), Duration::from_secs(3)).expect("url");
    let err = c
        .eval_each("check", "return 'not a number'", &[fresh_key("any")], &[])
        .await
        .expect_err("a string where an integer was expected");
    assert!(
        matches!(
            err,
            RedisError::UnexpectedReply {
                action: "check",
                ..
            }
        ),
        "{err:?}"
    );
}

/// A script the server has never cached: the `EVALSHA`s answer `NOSCRIPT` and go
/// again as `EVAL`, which caches it, so the next call's `EVALSHA`s run it at once.
#[tokio::test]
async fn a_script_the_server_has_not_cached_is_sent_again_whole() {
    let c = Lazy::new(&url(), &Default::default(), Duration::from_secs(3)).expect("url");
    let script: &'static str = Box::leak(
        format!(
            "-- {:032x}\nreturn tonumber(ARGV[1]) + redis.call('EXISTS', KEYS[1])",
            rand::random::<u128>()
        )
        .into_boxed_str(),
    );
    let sha = redis::Script::new(script).get_hash().to_owned();
    let mut direct = redis::Client::open(url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let cached = || redis::cmd("SCRIPT").arg("EXISTS").arg(&sha).clone();
    let before: Vec<i64> = cached().query_async(&mut direct).await.expect("exists");
    assert_eq!(before, [0]);
    let keys = [fresh_key("a"), fresh_key("b")];
    let args = ["41".to_owned()];
    assert_eq!(
        c.eval_each("run", script, &keys, &args).await.expect("run"),
        [41, 41]
    );
    let after: Vec<i64> = cached().query_async(&mut direct).await.expect("exists");
    assert_eq!(after, [1]);
    assert_eq!(
        c.eval_each("run", script, &keys, &args).await.expect("run"),
        [41, 41]
    );
}

#[tokio::test]
async fn a_closed_port_is_unavailable() {
    // Port 1 on loopback: nothing listens there, the connection is refused.
    let c = Lazy::new(
        "redis://127.0.0.1:1",
        &Default::default(),
        Duration::from_secs(1),
    )
    .expect("url");
    let err = c.ping("ping").await.expect_err("nothing listens");
    assert!(
        matches!(err, RedisError::Unavailable { action: "ping", .. }) && err.is_retryable(),
        "{err:?}"
    );
}
