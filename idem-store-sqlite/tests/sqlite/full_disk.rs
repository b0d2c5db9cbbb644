//! SQLite on a full filesystem (a real one: a tmpfs mounted for the test, so this test
//! runs as root, as CI does): a commit that finds no space fails with `SQLITE_FULL` or
//! `SQLITE_IOERR`, the store's fault and not the message's. Nothing is dead-lettered
//! while the disk is full; once space returns, every message is processed once.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use idem_engine::{Gate, GateConfig};
use idem_testkit::{encode_submission, EffectHandlerFor, SimBroker, TestStore as _};

/// A tmpfs of `size` mounted on `dir`, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Self {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs needs root (CI runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self(dir.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Writes `path` until the filesystem has no space left.
fn fill(path: &Path) {
    use std::io::Write as _;
    let mut f = std::fs::File::create(path).expect("filler");
    let chunk = vec![0u8; 4096];
    loop {
        if f.write_all(&chunk).and_then(|()| f.flush()).is_err() {
            break;
        }
    }
    let _ = f.sync_all();
}

/// Receives and processes every ready delivery once; returns how many it processed.
async fn round<S, H>(gate: &Gate<S, H>, broker: &SimBroker) -> usize
where
    S: idem_engine::ClaimStore,
    H: idem_engine::Handler<S::Tx>,
{
    let ready = broker.receive_many(1000);
    let n = ready.len();
    for d in ready {
        gate.process(d).await;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_dead_letters_nothing_and_every_message_is_processed_once_after() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mount = Tmpfs::mount(dir.path(), "4m");
    let filler = dir.path().join("filler");
    let store = common::open_in(dir).await;
    // An empty WAL: every commit from here on must allocate space.
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(store.store.pool())
        .await
        .expect("checkpoint");
    fill(&filler);

    let broker = SimBroker::new(5);
    const N: i64 = 20;
    for i in 0..N {
        broker.publish(encode_submission(
            &format!("FULL-{i}"),
            "2026-07-01T09:00:00Z",
            i,
        ));
    }
    let gate = Gate::with_config(
        store.clone(),
        EffectHandlerFor::<common::TestSqlite>::new(),
        GateConfig::default().with_max_attempts(3),
    );
    // Ten rounds on a full disk: far more failures per message than max_attempts.
    for _ in 0..10 {
        round(&gate, &broker).await;
    }
    assert!(
        broker.dead_letters().is_empty(),
        "a full disk dead-lettered messages: {:?}",
        broker
            .dead_letters()
            .iter()
            .map(|(_, r)| r.to_string())
            .collect::<Vec<_>>()
    );
    let stats = broker.stats();
    assert!(
        !broker.is_settled(),
        "nothing may be settled while the disk is full ({stats:?})"
    );

    // Space returns.
    std::fs::remove_file(&filler).expect("free the disk");
    for _ in 0..10 {
        if broker.is_settled() {
            break;
        }
        round(&gate, &broker).await;
    }
    assert!(
        broker.is_settled(),
        "every message settled once space returned"
    );
    assert!(broker.dead_letters().is_empty(), "nothing dead-lettered");
    let mut effects: Vec<String> = store
        .effects()
        .await
        .expect("effects")
        .into_iter()
        .map(|e| e.subject)
        .collect();
    effects.sort();
    let mut want: Vec<String> = (0..N).map(|i| format!("FULL-{i}")).collect();
    want.sort();
    assert_eq!(effects, want, "each message took effect exactly once");
    drop(store);
    drop(mount);
}
