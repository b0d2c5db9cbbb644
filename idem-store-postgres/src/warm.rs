//! Connections kept warm between claim transactions.
//!
//! sqlx tests every connection given back to its pool with a round trip (a `Sync` and the
//! server's `ReadyForQuery`) in a task of its own, whatever the pool's options say. For a
//! consumer that commits one message per transaction that was one round trip in five,
//! and a wake-up of another thread, per message. A claim transaction that ended cleanly
//! (its `COMMIT` or `ROLLBACK` answered, nothing left to read) has nothing such a test
//! could find, so its connection is kept here instead, and the next
//! [`begin`](idem_core::ClaimStore::begin) takes it back without a round trip.
//!
//! What keeps this from hurting anyone else on the pool:
//! - a connection is kept only while the pool could still hand out another one (an idle
//!   connection, or room to open one), so other users of the pool (the relay source, the
//!   tally, `inspect`) never wait on connections parked here;
//! - one idle for [`WARM_IDLE`] goes back to the pool (and its test);
//! - [`PgPool::close`](sqlx::Pool::close) gives every parked connection back at once (a
//!   task waits on the pool's close event), so closing never waits on them;
//! - a transaction dropped before its end is rolled back as sqlx's own `Transaction` does
//!   it (the `ROLLBACK` queued, sent by the pool's test): its connection never comes here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

/// How long a connection may stay parked before it goes back to the pool.
pub(crate) const WARM_IDLE: Duration = Duration::from_secs(5);

/// The parked connections of one store (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Warm {
    conns: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    janitor: AtomicBool,
}

impl Warm {
    /// The most recently parked connection that has not been idle too long. Older ones
    /// go back to the pool.
    pub(crate) fn take(&self) -> Option<PoolConnection<Postgres>> {
        let stale = self.take_stale();
        let conn = self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .map(|(c, _)| c);
        drop(stale);
        conn
    }

    /// Parks `conn`, whose transaction ended cleanly, if the pool can spare it; else it
    /// goes back to the pool. `owner` is the store's shared state, for the task that gives
    /// the connections back when the pool closes.
    pub(crate) fn park<T: AsRef<Warm> + Send + Sync + 'static>(
        &self,
        pool: &PgPool,
        owner: Weak<T>,
        conn: PoolConnection<Postgres>,
    ) {
        let spare = pool.num_idle() > 0 || pool.size() < pool.options().get_max_connections();
        if pool.is_closed() || !spare {
            return;
        }
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((conn, Instant::now()));
        // A close that came in since the check above: its janitor may be gone already.
        if pool.is_closed() {
            self.drain();
            return;
        }
        if !self.janitor.swap(true, Ordering::Relaxed) {
            tokio::spawn(janitor(pool.clone(), owner));
        }
    }

    /// Removes the connections idle for [`WARM_IDLE`] or more.
    fn take_stale(&self) -> Vec<(PoolConnection<Postgres>, Instant)> {
        let mut conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        let fresh = conns
            .iter()
            .position(|(_, at)| at.elapsed() < WARM_IDLE)
            .unwrap_or(conns.len());
        conns.drain(..fresh).collect()
    }

    /// Every parked connection, back to the pool.
    fn drain(&self) {
        let conns: Vec<_> =
            std::mem::take(&mut *self.conns.lock().unwrap_or_else(PoisonError::into_inner));
        drop(conns);
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        let conns = std::mem::take(self.conns.get_mut().unwrap_or_else(PoisonError::into_inner));
        // Giving a connection back to the pool spawns a task; without a runtime (the store
        // dropped after it) the connection is closed here instead.
        if tokio::runtime::Handle::try_current().is_err() {
            for (conn, _) in conns {
                drop(conn.detach());
            }
        }
    }
}

/// Gives the parked connections back when the pool closes, and those idle too long every
/// [`WARM_IDLE`]; ends with the store.
async fn janitor<T: AsRef<Warm>>(pool: PgPool, owner: Weak<T>) {
    let closed = pool.close_event();
    tokio::pin!(closed);
    loop {
        let closing = tokio::select! {
            () = &mut closed => true,
            () = tokio::time::sleep(WARM_IDLE) => false,
        };
        let Some(owner) = owner.upgrade() else { return };
        let warm = owner.as_ref().as_ref();
        if closing {
            warm.drain();
            return;
        }
        drop(warm.take_stale());
    }
}
