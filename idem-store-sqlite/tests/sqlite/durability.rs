//! Durability and identity: every pooled connection commits with `synchronous=FULL`
//! (read back from SQLite), and the store's identity is created once by `migrate`,
//! kept, copied with the file, and rotated on demand.

use idem_engine::StoreError;
use idem_store_sqlite::{SqliteConfig, SqliteStore};

async fn open(path: &std::path::Path) -> SqliteStore {
    SqliteStore::connect(path.to_str().expect("utf-8 path"), SqliteConfig::default())
        .await
        .expect("open")
}

/// `PRAGMA synchronous` is per connection: read it on as many connections as the pool
/// holds at once. 2 is FULL (NORMAL, 1, could lose an acked commit on power loss).
#[tokio::test]
async fn every_connection_syncs_each_commit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join("idem.db")).await;
    let mut held = Vec::new();
    for _ in 0..SqliteConfig::default().max_connections {
        let mut conn = store.pool().acquire().await.expect("acquire");
        let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await
            .expect("pragma");
        assert_eq!(sync, 2, "synchronous must be FULL (2), got {sync}");
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await
            .expect("pragma");
        assert_eq!(mode, "wal");
        held.push(conn);
    }
}

#[tokio::test]
async fn migrate_creates_one_identity_and_keeps_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join("a.db")).await;
    assert!(
        matches!(store.store_identity().await, Err(StoreError::Config(_))),
        "no identity before migrate must be a configuration error"
    );
    assert!(matches!(
        store.begin_identity_session().await,
        Err(StoreError::Config(_))
    ));
    store.migrate().await.expect("migrate");
    let id = store.store_identity().await.expect("identity");
    assert_eq!(id.store_id.len(), 32);
    assert!(id.store_id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(id.session, 0);
    store.migrate().await.expect("migrate again");
    assert_eq!(store.store_identity().await.expect("identity"), id);

    let other = open(&dir.path().join("b.db")).await;
    other.migrate().await.expect("migrate");
    assert_ne!(
        other.store_identity().await.expect("identity").store_id,
        id.store_id,
        "two files, two identities"
    );
}

#[tokio::test]
async fn sessions_count_up_roll_back_and_rotate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join("a.db")).await;
    store.migrate().await.expect("migrate");
    let id = store.store_identity().await.expect("identity");

    let s = store.begin_identity_session().await.expect("session");
    assert_eq!(s.identity().session, 1);
    s.commit().await.expect("commit");
    let s = store.begin_identity_session().await.expect("session");
    assert_eq!(s.identity().session, 2);
    drop(s); // rolled back
    assert_eq!(store.store_identity().await.expect("identity").session, 1);

    let mut s = store.begin_identity_session().await.expect("session");
    let rotated = s.rotate().await.expect("rotate").clone();
    assert_ne!(rotated.store_id, id.store_id);
    assert_eq!(rotated.session, 1);
    s.commit().await.expect("commit");
    assert_eq!(store.store_identity().await.expect("identity"), rotated);

    let again = store.rotate_store_identity().await.expect("rotate");
    assert_ne!(again.store_id, rotated.store_id);
    assert_eq!(store.store_identity().await.expect("identity"), again);
}
