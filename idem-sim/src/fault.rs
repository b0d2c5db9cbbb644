//! Fault injection: wrappers that crash the pipeline at every step.
//!
//! A crash is a panic carrying [`InjectedCrash`]: unwinding drops the open transaction
//! (the database rolls it back) and the unsettled acker (the broker redelivers) — exactly
//! what a process death does. Run each delivery in its own task ([`crate::sim`] does) so
//! the panic ends only that task.
//!
//! Decisions come from a [`FaultPlan`]: deterministic ("crash at the 3rd commit") or
//! seeded random.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    AckError, AckProof, Acker, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, Handler,
    HandlerError, Headers, IdempotencyKey, OutboxEvent, OutboxWriter, RejectReason, StoreError,
    Submission,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::harness::{Effect, TestStore};

/// Where a crash can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CrashPoint {
    /// The transaction is open, nothing claimed yet.
    BeforeClaim,
    /// The key is claimed, the handler has not run.
    AfterClaim,
    /// The handler wrote its rows, the commit has not started.
    AfterHandler,
    /// The process dies during the commit: a coin decides whether it took effect.
    DuringCommit,
    /// Committed; the process dies before the ack is sent.
    AfterCommitBeforeAck,
    /// The ack is sent but lost: the broker never hears of it and redelivers.
    AckLost,
}

impl CrashPoint {
    /// Every point, in pipeline order.
    pub const ALL: [CrashPoint; 6] = [
        Self::BeforeClaim,
        Self::AfterClaim,
        Self::AfterHandler,
        Self::DuringCommit,
        Self::AfterCommitBeforeAck,
        Self::AckLost,
    ];
}

/// Where an error (not a crash) can be injected: the call returns an error and the task
/// goes on, as the gate must handle it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorPoint {
    /// The claim fails: the store is unreachable.
    Claim,
    /// The handler fails transiently (a retry can succeed).
    Handler,
    /// The commit fails and did not take effect.
    Commit,
    /// The commit took effect, but the connection broke before the answer: the caller sees
    /// an error and cannot know (the redelivery must find the claim).
    CommitUnknown,
}

impl ErrorPoint {
    /// Every point.
    pub const ALL: [ErrorPoint; 4] = [
        Self::Claim,
        Self::Handler,
        Self::Commit,
        Self::CommitUnknown,
    ];

    fn error(self) -> StoreError {
        StoreError::Unavailable {
            message: format!("injected {self:?} error"),
            source: None,
        }
    }
}

/// The panic payload of an injected crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedCrash(pub CrashPoint);

fn crash(point: CrashPoint) -> ! {
    std::panic::panic_any(InjectedCrash(point))
}

/// Installs a panic hook that stays silent for injected crashes and reports every other
/// panic as before. Idempotent enough to call once per process.
pub fn quiet_injected_crashes() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<InjectedCrash>().is_none() {
            previous(info);
        }
    }));
}

#[derive(Debug)]
enum Mode {
    Never,
    Scripted(HashMap<CrashPoint, Vec<u64>>),
    Random { rate: f64 },
}

#[derive(Debug)]
struct PlanState {
    mode: Mode,
    rng: StdRng,
    reached: HashMap<CrashPoint, u64>,
    crashed: HashMap<CrashPoint, u64>,
    errors: HashMap<ErrorPoint, Vec<u64>>,
    errors_reached: HashMap<ErrorPoint, u64>,
    errors_injected: HashMap<ErrorPoint, u64>,
}

/// Decides, each time a [`CrashPoint`] is reached, whether to crash there.
#[derive(Debug)]
pub struct FaultPlan {
    state: Mutex<PlanState>,
}

impl FaultPlan {
    fn with_mode(mode: Mode, seed: u64) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(PlanState {
                mode,
                rng: StdRng::seed_from_u64(seed),
                reached: HashMap::new(),
                crashed: HashMap::new(),
                errors: HashMap::new(),
                errors_reached: HashMap::new(),
                errors_injected: HashMap::new(),
            }),
        })
    }

    /// Never crashes.
    pub fn never() -> Arc<Self> {
        Self::with_mode(Mode::Never, 0)
    }

    /// Crashes the `nth` time (1-based) each listed point is reached.
    pub fn scripted(points: impl IntoIterator<Item = (CrashPoint, u64)>, seed: u64) -> Arc<Self> {
        let mut map: HashMap<CrashPoint, Vec<u64>> = HashMap::new();
        for (p, n) in points {
            map.entry(p).or_default().push(n);
        }
        Self::with_mode(Mode::Scripted(map), seed)
    }

    /// Crashes the `nth` time each listed crash point is reached, and returns an error the
    /// `nth` time each listed error point is reached.
    pub fn scripted_with_errors(
        crashes: impl IntoIterator<Item = (CrashPoint, u64)>,
        errors: impl IntoIterator<Item = (ErrorPoint, u64)>,
        seed: u64,
    ) -> Arc<Self> {
        let plan = Self::scripted(crashes, seed);
        {
            let mut st = plan.lock();
            for (p, n) in errors {
                st.errors.entry(p).or_default().push(n);
            }
        }
        plan
    }

    /// Records reaching error point `point` and answers whether to fail there.
    pub fn error_at(&self, point: ErrorPoint) -> bool {
        let mut st = self.lock();
        let n = {
            let c = st.errors_reached.entry(point).or_insert(0);
            *c += 1;
            *c
        };
        let fail = st.errors.get(&point).is_some_and(|v| v.contains(&n));
        if fail {
            *st.errors_injected.entry(point).or_insert(0) += 1;
        }
        fail
    }

    /// Errors injected so far, by point.
    pub fn errors(&self) -> HashMap<ErrorPoint, u64> {
        self.lock().errors_injected.clone()
    }

    /// Crashes with a per-delivery probability of about `rate`, spread evenly over the
    /// points (each point crashes with `1 - (1 - rate)^(1/6)`).
    pub fn random(rate: f64, seed: u64) -> Arc<Self> {
        let rate = rate.clamp(0.0, 1.0);
        let per_point = 1.0 - (1.0 - rate).powf(1.0 / CrashPoint::ALL.len() as f64);
        Self::with_mode(Mode::Random { rate: per_point }, seed)
    }

    fn lock(&self) -> MutexGuard<'_, PlanState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records reaching `point` and answers whether to crash there.
    pub fn hit(&self, point: CrashPoint) -> bool {
        let mut st = self.lock();
        let n = {
            let c = st.reached.entry(point).or_insert(0);
            *c += 1;
            *c
        };
        let crash = match &st.mode {
            Mode::Never => false,
            Mode::Scripted(map) => map.get(&point).is_some_and(|v| v.contains(&n)),
            Mode::Random { rate } => {
                let rate = *rate;
                rate > 0.0 && st.rng.random_bool(rate)
            }
        };
        if crash {
            *st.crashed.entry(point).or_insert(0) += 1;
        }
        crash
    }

    /// A seeded coin (whether a crash during the commit happened after it took effect).
    pub fn coin(&self) -> bool {
        self.lock().rng.random_bool(0.5)
    }

    /// Crashes injected so far, by point.
    pub fn crashes(&self) -> HashMap<CrashPoint, u64> {
        self.lock().crashed.clone()
    }

    /// Crashes injected so far.
    pub fn total_crashes(&self) -> u64 {
        self.lock().crashed.values().sum()
    }
}

/// A store whose transactions crash where the plan says.
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    plan: Arc<FaultPlan>,
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, plan: Arc<FaultPlan>) -> Self {
        Self { inner, plan }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The plan.
    pub fn plan(&self) -> &Arc<FaultPlan> {
        &self.plan
    }
}

/// A transaction of a [`FaultyStore`].
#[derive(Debug)]
pub struct FaultyTx<T> {
    inner: T,
    plan: Arc<FaultPlan>,
}

impl<T> FaultyTx<T> {
    /// The wrapped transaction (for business writes).
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

#[async_trait]
impl<S: ClaimStore> ClaimStore for FaultyStore<S> {
    type Tx = FaultyTx<S::Tx>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        Ok(FaultyTx {
            inner: self.inner.begin().await?,
            plan: self.plan.clone(),
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: idem_engine::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        self.inner.note_run(key, note).await
    }

    /// The wrapped store's probe: the plan's faults strike the claims and the commit.
    async fn probe(&self) -> Result<(), StoreError> {
        self.inner.probe().await
    }
}

#[async_trait]
impl<T: ClaimTx> ClaimTx for FaultyTx<T> {
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        if self.plan.hit(CrashPoint::BeforeClaim) {
            crash(CrashPoint::BeforeClaim);
        }
        if self.plan.error_at(ErrorPoint::Claim) {
            return Err(ErrorPoint::Claim.error());
        }
        let out = self.inner.claim(key, meta).await?;
        if out == ClaimOutcome::Claimed && self.plan.hit(CrashPoint::AfterClaim) {
            crash(CrashPoint::AfterClaim);
        }
        Ok(out)
    }

    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        if self.plan.hit(CrashPoint::BeforeClaim) {
            crash(CrashPoint::BeforeClaim);
        }
        if self.plan.error_at(ErrorPoint::Claim) {
            return Err(ErrorPoint::Claim.error());
        }
        let out = self.inner.claim_batch(items).await?;
        if out.contains(&ClaimOutcome::Claimed) && self.plan.hit(CrashPoint::AfterClaim) {
            crash(CrashPoint::AfterClaim);
        }
        Ok(out)
    }

    async fn advance_positions(
        &mut self,
        moves: &[idem_engine::PositionMove],
    ) -> Result<(), StoreError> {
        self.inner.advance_positions(moves).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        if self.plan.hit(CrashPoint::DuringCommit) {
            if self.plan.coin() {
                self.inner.commit().await?;
            } else {
                drop(self.inner);
            }
            crash(CrashPoint::DuringCommit);
        }
        if self.plan.error_at(ErrorPoint::Commit) {
            drop(self.inner); // rolled back
            return Err(ErrorPoint::Commit.error());
        }
        if self.plan.error_at(ErrorPoint::CommitUnknown) {
            self.inner.commit().await?;
            return Err(ErrorPoint::CommitUnknown.error());
        }
        self.inner.commit().await
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.inner.rollback().await
    }
}

#[async_trait]
impl<T: OutboxWriter> OutboxWriter for FaultyTx<T> {
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        self.inner.enqueue(event).await
    }
}

#[async_trait]
impl<S: TestStore> TestStore for FaultyStore<S> {
    async fn write_effect(
        tx: &mut Self::Tx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        S::write_effect(&mut tx.inner, key, subject, amount).await
    }

    async fn enqueue(tx: &mut Self::Tx, event: &OutboxEvent) -> Result<(), StoreError> {
        S::enqueue(&mut tx.inner, event).await
    }

    async fn enqueue_refused(tx: &mut Self::Tx, key: &IdempotencyKey) -> Result<(), StoreError> {
        S::enqueue_refused(&mut tx.inner, key).await
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        self.inner.effects().await
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        self.inner.claim_count(key).await
    }
}

/// A handler that crashes after the wrapped handler wrote its rows.
#[derive(Debug, Clone)]
pub struct FaultyHandler<H> {
    inner: H,
    plan: Arc<FaultPlan>,
}

impl<H> FaultyHandler<H> {
    /// Wraps `inner`.
    pub fn new(inner: H, plan: Arc<FaultPlan>) -> Self {
        Self { inner, plan }
    }

    /// The wrapped handler.
    pub fn inner(&self) -> &H {
        &self.inner
    }
}

#[async_trait]
impl<T, H> Handler<FaultyTx<T>> for FaultyHandler<H>
where
    T: ClaimTx,
    H: Handler<T>,
{
    type Input = H::Input;

    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<H::Input>, RejectReason> {
        self.inner.identify(payload, headers)
    }

    fn claim_meta(&self, sub: &Submission<H::Input>) -> ClaimMeta {
        self.inner.claim_meta(sub)
    }

    async fn handle(
        &self,
        tx: &mut FaultyTx<T>,
        sub: &Submission<H::Input>,
    ) -> Result<(), HandlerError> {
        if self.plan.error_at(ErrorPoint::Handler) {
            return Err(HandlerError::Transient("injected handler error".into()));
        }
        self.inner.handle(&mut tx.inner, sub).await?;
        if self.plan.hit(CrashPoint::AfterHandler) {
            crash(CrashPoint::AfterHandler);
        }
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut FaultyTx<T>,
        subs: &[&Submission<H::Input>],
    ) -> Result<(), HandlerError> {
        if self.plan.error_at(ErrorPoint::Handler) {
            return Err(HandlerError::Transient("injected handler error".into()));
        }
        self.inner.handle_batch(&mut tx.inner, subs).await?;
        if self.plan.hit(CrashPoint::AfterHandler) {
            crash(CrashPoint::AfterHandler);
        }
        Ok(())
    }
}

/// An acker that crashes before the ack, or "sends" it and loses it.
#[derive(Debug)]
pub struct FaultyAcker<A> {
    inner: A,
    plan: Arc<FaultPlan>,
}

impl<A> FaultyAcker<A> {
    /// Wraps `inner`.
    pub fn new(inner: A, plan: Arc<FaultPlan>) -> Self {
        Self { inner, plan }
    }
}

#[async_trait]
impl<A: Acker> Acker for FaultyAcker<A> {
    async fn ack(self, proof: AckProof) -> Result<(), AckError> {
        if self.plan.hit(CrashPoint::AfterCommitBeforeAck) {
            crash(CrashPoint::AfterCommitBeforeAck);
        }
        if self.plan.hit(CrashPoint::AckLost) {
            // The ack "left" but never arrived: the broker still holds the delivery.
            drop(self.inner);
            return Ok(());
        }
        self.inner.ack(proof).await
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.inner.nack(delay).await
    }

    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        self.inner.defer(delay).await
    }

    fn attempt_counts_runs(&self) -> bool {
        self.inner.attempt_counts_runs()
    }

    fn position(&self) -> Option<idem_engine::PositionMove> {
        self.inner.position()
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        self.inner.dead_letter(payload, headers, reason).await
    }
}
