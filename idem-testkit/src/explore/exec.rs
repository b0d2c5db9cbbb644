//! One run of the explorer: a single-threaded executor over the workers' futures, the
//! choices enabled in the current state, and their application.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::Stream;
use idem_engine::gate::{ATTEMPTS_EXHAUSTED, CONFLICT};
use idem_engine::{
    consumer, ConflictPolicy, ConsumerConfig, Delivery, ErrorClass, Filtered, Gate, GateConfig,
    Outcome,
};

use super::world::{
    ident_of, is_killer, is_recurring, key_of, lock, payload_of, Decision, ExAcker, ExFilter,
    ExHandler, ExStore, Fault, Msg, MsgState, Op, Point, Shared, TaskId, World, WorldClock,
    BROKER_LIMIT, CONFLICT_BASE, KILLER_BASE, RECURRING_BASE,
};
use super::{Budgets, Config, Mutant};

/// Which futures drive the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Each worker is a process looping: receive up to `batch` deliveries, then
    /// `Gate::process` (one) or `Gate::process_batch` (several).
    Process,
    /// One process running `consumer::run` with `workers` batches in flight over a
    /// delivery stream.
    Consumer,
}

/// A choice the explorer can make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Choice {
    Grant { request: u64, decision: Decision },
    Crash { worker: usize },
    Expire { msg: usize },
    FilterDown,
    FilterUp,
    Restore,
    Tick,
}

struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

struct Task {
    id: TaskId,
    fut: Option<BoxFuture>,
    flag: Arc<Flag>,
}

pub(crate) struct Run {
    world: Shared,
    config: Config,
    budgets: Budgets,
    tasks: Vec<Task>,
    next_task: TaskId,
}

fn gate_for(world: &Shared) -> Gate<Filtered<ExStore, ExFilter>, ExHandler> {
    let scope = lock(world).durable.identity;
    let store = Filtered::with_clock(
        ExStore(world.clone()),
        ExFilter {
            world: world.clone(),
            scope,
        },
        Arc::new(WorldClock(world.clone())),
    );
    let on_conflict = if lock(world).conflicts_dead_letter {
        ConflictPolicy::DeadLetter
    } else {
        ConflictPolicy::Process
    };
    let (max_attempts, check) = {
        let w = lock(world);
        (w.max_attempts, w.check_before_handler)
    };
    let config = GateConfig::default()
        .with_on_conflict(on_conflict)
        .with_max_attempts(max_attempts)
        .with_check_attempts_before_handler(check);
    Gate::with_config(store, ExHandler(world.clone()), config)
        .with_clock(Arc::new(WorldClock(world.clone())))
}

/// Takes the deliveries a granted receive chose.
fn take(world: &Shared, d: Decision) -> Vec<Delivery<ExAcker>> {
    let Decision::Take { k, reverse } = d else {
        return Vec::new();
    };
    let mut w = lock(world);
    let mut ready: Vec<(u64, usize)> = w
        .msgs
        .iter()
        .enumerate()
        .filter_map(|(i, m)| match m.state {
            MsgState::Ready(seq) => Some((seq, i)),
            _ => None,
        })
        .collect();
    ready.sort_unstable();
    let mut chosen: Vec<usize> = ready.into_iter().take(k).map(|(_, i)| i).collect();
    if reverse {
        chosen.reverse();
    }
    let task = w.current_task;
    w.record(task, ("take", &chosen));
    let mut out = Vec::with_capacity(chosen.len());
    for idx in chosen {
        if w.msgs[idx].deliveries >= w.broker_limit {
            // The broker's own limit: the message goes to its dead-letter place, unrun
            // and without a reason, before the gate could end it.
            let limit = w.broker_limit;
            w.msgs[idx].state = MsgState::Dead(BROKER_LIMIT);
            w.violate(format!(
                "m{idx} was ended by the broker's delivery limit ({limit}) before the gate \
                 settled it"
            ));
            continue;
        }
        w.next_tag += 1;
        let tag = w.next_tag;
        w.tags.insert(tag, (idx, true));
        w.tag_task.insert(tag, task);
        w.msgs[idx].deliveries += 1;
        w.msgs[idx].state = MsgState::InFlight(tag);
        let payload = match w.msgs[idx].key {
            Some(k) => payload_of(k),
            None => b"poison".to_vec(),
        };
        let attempt = w.msgs[idx].deliveries;
        let key = w.msgs[idx].key;
        if let (Some(first), Some(k)) = (w.first_received.as_mut(), key) {
            first.entry(ident_of(k)).or_insert(k);
        }
        w.trace.push(format!(
            "t{task}: receives d{tag} = m{idx} (attempt {attempt})"
        ));
        out.push(
            Delivery::new(
                payload,
                ExAcker {
                    world: world.clone(),
                    tag,
                    settled: false,
                },
            )
            .with_attempt(attempt),
        );
    }
    out
}

fn config_stop(outcomes: &[Outcome]) -> bool {
    outcomes
        .iter()
        .any(|o| matches!(o, Outcome::Failed { error, .. } if error.class() == ErrorClass::Config))
}

async fn process_worker(world: Shared, batch: usize) {
    let gate = gate_for(&world);
    loop {
        let d = Point::new(&world, Op::Receive { max: batch }).await;
        let mut deliveries = take(&world, d);
        let outcomes = if deliveries.len() == 1 {
            match deliveries.pop() {
                Some(d) => vec![gate.process(d).await],
                None => Vec::new(),
            }
        } else {
            gate.process_batch(deliveries).await
        };
        if config_stop(&outcomes) {
            // The process stops (exit 2); the operator fixes the deployment and the
            // explorer starts it again.
            return;
        }
    }
}

/// The delivery stream of consumer mode: each receive is a choice point.
struct ExStream {
    world: Shared,
    max: usize,
    buf: VecDeque<Delivery<ExAcker>>,
    point: Option<Pin<Box<Point>>>,
}

impl Stream for ExStream {
    type Item = Result<Delivery<ExAcker>, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(d) = self.buf.pop_front() {
            return Poll::Ready(Some(Ok(d)));
        }
        if lock(&self.world).closed {
            return Poll::Ready(None);
        }
        let world = self.world.clone();
        let max = self.max;
        let point = self
            .point
            .get_or_insert_with(|| Box::pin(Point::new(&world, Op::Receive { max })));
        match point.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(d) => {
                self.point = None;
                let taken = take(&world, d);
                self.buf.extend(taken);
                match self.buf.pop_front() {
                    Some(d) => Poll::Ready(Some(Ok(d))),
                    None => {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                }
            }
        }
    }
}

async fn consumer_worker(world: Shared, workers: usize, batch: usize) {
    let gate = gate_for(&world);
    let stream = ExStream {
        world: world.clone(),
        max: batch,
        buf: VecDeque::new(),
        point: None,
    };
    let _ = consumer::run(
        &gate,
        stream,
        ConsumerConfig::new(workers, batch),
        std::future::pending::<()>(),
        |_| {},
    )
    .await;
}

impl Run {
    pub(crate) fn new(config: &Config) -> Self {
        let mut world = World {
            filter_up: true,
            per_task_tx_check: config.mode == Mode::Process,
            unscoped_marks: config.mutant == Some(Mutant::UnscopedFilterMarks),
            conflicts_dead_letter: config.on_conflict == ConflictPolicy::DeadLetter,
            max_attempts: config.max_attempts.max(1),
            broker_limit: config.broker_limit,
            counts_runs: config.counts_runs,
            check_before_handler: config.check_before_handler,
            void_commit_ok: config.mutant == Some(Mutant::VoidCommitReportedOk),
            first_received: config.first_wins.then(BTreeMap::new),
            ..World::default()
        };
        world.durable.identity = 1;
        for k in 0..config.keys {
            let copies = if k == 0 { config.copies.max(1) } else { 1 };
            for _ in 0..copies {
                world.msgs.push(Msg::new(Some(k)));
            }
        }
        // Conflicting resubmissions: another payload of key j's submission, once each.
        for j in 0..config.conflicts.min(config.keys) {
            world.msgs.push(Msg::new(Some(CONFLICT_BASE + j)));
        }
        for j in 0..config
            .killers
            .min(usize::from(RECURRING_BASE - KILLER_BASE))
        {
            world.msgs.push(Msg::new(Some(KILLER_BASE + j as u8)));
        }
        for j in 0..config
            .recurring
            .min(usize::from(CONFLICT_BASE - RECURRING_BASE))
        {
            world.msgs.push(Msg::new(Some(RECURRING_BASE + j as u8)));
        }
        for _ in 0..config.poison {
            world.msgs.push(Msg::new(None));
        }
        for i in 0..world.msgs.len() {
            world.make_ready(i);
        }
        let _ = key_of(0);
        let mut run = Self {
            world: Arc::new(std::sync::Mutex::new(world)),
            config: config.clone(),
            budgets: config.budgets,
            tasks: Vec::new(),
            next_task: 0,
        };
        let n = match config.mode {
            Mode::Process => config.workers.max(1),
            Mode::Consumer => 1,
        };
        for w in 0..n {
            run.tasks.push(Task {
                id: 0,
                fut: None,
                flag: Arc::new(Flag(AtomicBool::new(false))),
            });
            run.start(w);
        }
        run.settle();
        run
    }

    fn start(&mut self, worker: usize) {
        self.next_task += 1;
        let id = self.next_task;
        let world = self.world.clone();
        let fut: BoxFuture = match self.config.mode {
            Mode::Process => Box::pin(process_worker(world, self.config.batch.max(1))),
            Mode::Consumer => Box::pin(consumer_worker(
                world,
                self.config.workers.max(1),
                self.config.batch.max(1),
            )),
        };
        let t = &mut self.tasks[worker];
        t.id = id;
        t.fut = Some(fut);
        t.flag.0.store(true, Ordering::SeqCst);
        lock(&self.world)
            .trace
            .push(format!("w{worker} starts as t{id}"));
    }

    /// Drops a worker's future (a process death) and starts it again.
    fn crash(&mut self, worker: usize) {
        let id = self.tasks[worker].id;
        lock(&self.world).current_task = id;
        let fut = self.tasks[worker].fut.take();
        drop(fut);
        {
            let mut w = lock(&self.world);
            w.history.remove(&id);
            w.trace.push(format!("w{worker} (t{id}) crashes"));
        }
        self.start(worker);
    }

    /// Polls every woken task until none is.
    fn settle(&mut self) {
        loop {
            let mut progressed = false;
            for i in 0..self.tasks.len() {
                if !self.tasks[i].flag.0.swap(false, Ordering::SeqCst) {
                    continue;
                }
                let id = self.tasks[i].id;
                let waker = Waker::from(self.tasks[i].flag.clone());
                let mut cx = Context::from_waker(&waker);
                lock(&self.world).current_task = id;
                let done = match self.tasks[i].fut.as_mut() {
                    Some(f) => f.as_mut().poll(&mut cx).is_ready(),
                    None => false,
                };
                progressed = true;
                if done {
                    self.tasks[i].fut = None;
                    let closed = lock(&self.world).closed;
                    if !closed {
                        // A consumer that stopped on a configuration error: restarted.
                        lock(&self.world).trace.push(format!("w{i} stops"));
                        self.start(i);
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    fn worker_of(&self, task: TaskId) -> Option<usize> {
        self.tasks
            .iter()
            .position(|t| t.id == task && t.fut.is_some())
    }

    pub(crate) fn violation(&self) -> Option<String> {
        lock(&self.world).violations.first().cloned()
    }

    pub(crate) fn take_trace(&mut self) -> Vec<String> {
        std::mem::take(&mut lock(&self.world).trace)
    }

    /// Every choice enabled now, in a canonical order.
    pub(crate) fn choices(&self) -> Vec<Choice> {
        let w = lock(&self.world);
        let b = if self.budgets.total == 0 {
            &Budgets::NONE
        } else {
            &self.budgets
        };
        let mut out = Vec::new();
        let mut reqs: Vec<(usize, u64, &Op)> = w
            .requests
            .values()
            .filter(|r| r.decision.is_none())
            .filter_map(|r| self.worker_of(r.task).map(|wk| (wk, r.id, &r.op)))
            .collect();
        reqs.sort_by_key(|(wk, id, _)| (*wk, *id));
        let mut crashable: Vec<usize> = Vec::new();
        for (wk, id, op) in &reqs {
            let mut grant = |d: Decision| {
                out.push(Choice::Grant {
                    request: *id,
                    decision: d,
                })
            };
            match op {
                Op::Receive { max } => {
                    let ready = w.ready_count();
                    for k in 1..=ready.min(*max) {
                        grant(Decision::Take { k, reverse: false });
                        if k >= 2 {
                            grant(Decision::Take { k, reverse: true });
                        }
                    }
                    continue;
                }
                Op::Begin => {
                    grant(Decision::Proceed);
                    if b.unavailable > 0 {
                        grant(Decision::Fail(Fault::Unavailable));
                    }
                    if b.config > 0 {
                        grant(Decision::Fail(Fault::Config));
                    }
                }
                Op::Claim { tx, key, ident } => {
                    if w.claim_blocked(*tx, *key, *ident) {
                        if b.lock_timeouts > 0 {
                            grant(Decision::LockTimeout);
                        }
                    } else {
                        grant(Decision::Proceed);
                        let fresh = !w.durable.committed.contains(key) && !w.poisoned.contains(key);
                        if fresh {
                            if b.unavailable > 0 {
                                grant(Decision::Fail(Fault::Unavailable));
                            }
                            if b.conflict > 0 {
                                grant(Decision::Fail(Fault::Conflict));
                            }
                            if b.rejected > 0 {
                                grant(Decision::Fail(Fault::Rejected));
                            }
                        }
                    }
                }
                Op::Handle { key, .. } => {
                    grant(Decision::Proceed);
                    // A killer's or a recurring failure's handler does what it always does.
                    if !w.poisoned.contains(key) && !is_killer(*key) && !is_recurring(*key) {
                        if b.unavailable > 0 {
                            grant(Decision::Fail(Fault::Unavailable));
                        }
                        if b.rejected > 0 {
                            grant(Decision::Fail(Fault::Rejected));
                        }
                    }
                }
                Op::Commit { .. } => {
                    grant(Decision::Proceed);
                    if b.unavailable > 0 {
                        grant(Decision::Fail(Fault::Unavailable));
                        grant(Decision::CommitUnknown);
                    }
                    if b.conflict > 0 {
                        grant(Decision::Fail(Fault::Conflict));
                    }
                    if b.crashes > 0 {
                        grant(Decision::CommitThenCrash);
                    }
                    if b.void_commits > 0 {
                        grant(Decision::CommitVoid);
                    }
                }
                Op::Ack { .. } => {
                    grant(Decision::Proceed);
                    if b.lost_acks > 0 {
                        grant(Decision::AckLost);
                    }
                }
                Op::Probe => {
                    grant(Decision::Proceed);
                    if b.unavailable > 0 {
                        grant(Decision::Fail(Fault::Unavailable));
                    }
                }
            }
            if !crashable.contains(wk) {
                crashable.push(*wk);
            }
        }
        if b.crashes > 0 {
            for wk in crashable {
                out.push(Choice::Crash { worker: wk });
            }
        }
        if b.expiries > 0 {
            for (i, m) in w.msgs.iter().enumerate() {
                if matches!(m.state, MsgState::InFlight(_)) {
                    out.push(Choice::Expire { msg: i });
                }
            }
        }
        if w.filter_up {
            if b.outages > 0 {
                out.push(Choice::FilterDown);
            }
        } else {
            out.push(Choice::FilterUp);
        }
        if b.restores > 0 && !w.snapshots.is_empty() {
            out.push(Choice::Restore);
        }
        if w.msgs
            .iter()
            .any(|m| matches!(m.state, MsgState::Delayed(_)))
        {
            out.push(Choice::Tick);
        }
        out
    }

    pub(crate) fn describe(&self, c: &Choice) -> String {
        let w = lock(&self.world);
        match c {
            Choice::Grant { request, decision } => match w.requests.get(request) {
                Some(r) => format!("t{} {:?} → {decision:?}", r.task, r.op),
                None => format!("request {request} → {decision:?}"),
            },
            Choice::Crash { worker } => format!("crash w{worker}"),
            Choice::Expire { msg } => format!("visibility of m{msg} expires"),
            Choice::FilterDown => "front filter goes down".into(),
            Choice::FilterUp => "front filter comes back".into(),
            Choice::Restore => "store restored from the snapshot before its latest commit; identity rotated; consumers restarted".into(),
            Choice::Tick => "clock advances to the next delayed redelivery".into(),
        }
    }

    pub(crate) fn apply(&mut self, c: &Choice) {
        let b = &mut self.budgets;
        let fault = match c {
            Choice::Grant { decision, .. } => {
                !matches!(decision, Decision::Proceed | Decision::Take { .. })
            }
            Choice::FilterUp | Choice::Tick => false,
            _ => true,
        };
        if fault {
            b.total = b.total.saturating_sub(1);
        }
        match c {
            Choice::Grant { request, decision } => {
                match decision {
                    Decision::Fail(Fault::Unavailable) | Decision::CommitUnknown => {
                        b.unavailable -= 1;
                    }
                    Decision::Fail(Fault::Conflict) => b.conflict -= 1,
                    Decision::Fail(Fault::Rejected) => b.rejected -= 1,
                    Decision::Fail(Fault::Config) => b.config -= 1,
                    Decision::CommitThenCrash => b.crashes -= 1,
                    Decision::AckLost => b.lost_acks -= 1,
                    Decision::LockTimeout => b.lock_timeouts -= 1,
                    Decision::CommitVoid => b.void_commits -= 1,
                    _ => {}
                }
                if let Some(worker) = self.killed_by(*request) {
                    self.crash(worker);
                    self.settle();
                    self.detect_deadlock();
                    return;
                }
                let task = {
                    let mut w = lock(&self.world);
                    let Some(r) = w.requests.get_mut(request) else {
                        return;
                    };
                    r.decision = Some(*decision);
                    if let Some(waker) = r.waker.take() {
                        waker.wake();
                    }
                    r.task
                };
                self.settle();
                if *decision == Decision::CommitThenCrash {
                    if let Some(wk) = self.worker_of(task) {
                        self.crash(wk);
                    }
                }
            }
            Choice::Crash { worker } => {
                b.crashes -= 1;
                self.crash(*worker);
            }
            Choice::Expire { msg } => {
                b.expiries -= 1;
                let mut w = lock(&self.world);
                if let MsgState::InFlight(tag) = w.msgs[*msg].state {
                    w.tags.insert(tag, (*msg, false));
                    w.make_ready(*msg);
                    w.trace.push(format!(
                        "m{msg}'s visibility expires: in flight as d{tag} and ready again"
                    ));
                }
            }
            Choice::FilterDown => {
                b.outages -= 1;
                lock(&self.world).filter_up = false;
            }
            Choice::FilterUp => lock(&self.world).filter_up = true,
            Choice::Restore => {
                b.restores -= 1;
                // The runbook: the consumers are down while the database is restored.
                for i in 0..self.tasks.len() {
                    let id = self.tasks[i].id;
                    lock(&self.world).current_task = id;
                    drop(self.tasks[i].fut.take());
                    lock(&self.world).history.remove(&id);
                }
                {
                    let mut w = lock(&self.world);
                    if let Some(snap) = w.snapshots.pop() {
                        let gone: Vec<u8> = w
                            .durable
                            .committed
                            .difference(&snap.committed)
                            .copied()
                            .collect();
                        for k in gone {
                            let settled =
                                w.msgs.iter().filter(|m| m.key == Some(k)).all(|m| {
                                    matches!(m.state, MsgState::Acked | MsgState::Dead(_))
                                });
                            if settled {
                                w.lost_to_restore.insert(k);
                            }
                        }
                        let identity = w.durable.identity + 1;
                        w.durable = snap;
                        w.durable.identity = identity;
                        // The restored store lacks the runs recorded since its backup
                        // (ClaimStore::note_run): a killer's bound of max_attempts runs
                        // starts again from here, as it does for a real restore.
                        w.killer_runs.clear();
                        let line = format!(
                            "store restored to {:?}; identity rotated to {identity}",
                            w.durable.committed
                        );
                        w.trace.push(line);
                    }
                }
                for i in 0..self.tasks.len() {
                    self.start(i);
                }
            }
            Choice::Tick => {
                let mut w = lock(&self.world);
                let next = w
                    .msgs
                    .iter()
                    .filter_map(|m| match m.state {
                        MsgState::Delayed(due) => Some(due),
                        _ => None,
                    })
                    .min();
                if let Some(due) = next {
                    w.now_ms = w.now_ms.max(due);
                    for i in 0..w.msgs.len() {
                        if matches!(w.msgs[i].state, MsgState::Delayed(d) if d <= due) {
                            w.make_ready(i);
                        }
                    }
                    let line = format!("clock at {} ms", w.now_ms);
                    w.trace.push(line);
                }
            }
        }
        self.settle();
        // Wake every task: a released lock or a new ready message changes what is enabled,
        // but the futures themselves only wait on their own choice points.
        self.detect_deadlock();
    }

    /// If `request` is the handler of a killer message, the worker it kills (before the
    /// handler returns): the messages the worker holds besides the killer are counted as
    /// its collateral.
    fn killed_by(&mut self, request: u64) -> Option<usize> {
        let mut w = lock(&self.world);
        let r = w.requests.get(&request)?;
        let (Op::Handle { key, .. }, task) = (&r.op, r.task) else {
            return None;
        };
        let key = *key;
        if !is_killer(key) {
            return None;
        }
        let worker = self.worker_of(task)?;
        let killers = w
            .msgs
            .iter()
            .filter(|m| m.key.is_some_and(is_killer))
            .count();
        for idx in w.held_by(task) {
            if w.msgs[idx].key == Some(key) {
                continue;
            }
            w.msgs[idx].collateral += 1;
            let n = w.msgs[idx].collateral;
            if self.config.neighbour_check && n as usize > killers {
                w.violate(format!(
                    "m{idx} lost {n} runs to a message that kills its process (one at most \
                     per such message)"
                ));
            }
        }
        let runs = w.killer_runs.entry(key).or_insert(0);
        *runs += 1;
        let runs = *runs;
        w.trace.push(format!(
            "t{task}: the handler of k{key} kills its process (run {runs})"
        ));
        if runs > w.max_attempts {
            let max = w.max_attempts;
            w.violate(format!(
                "k{key}, which kills its process, was run {runs} times (max_attempts {max})"
            ));
        }
        Some(worker)
    }

    /// Two or more transactions waiting on each other's locks.
    fn detect_deadlock(&mut self) {
        let mut w = lock(&self.world);
        // waiting tx → holder tx
        let mut waits: Vec<(u64, u64)> = Vec::new();
        for r in w.requests.values() {
            if let Op::Claim { tx, key, ident } = r.op {
                if r.decision.is_none() {
                    if let Some(holder) = w.claim_waits_on(tx, key, ident) {
                        waits.push((tx, holder));
                    }
                }
            }
        }
        for &(start, _) in &waits {
            let mut cur = start;
            for _ in 0..=waits.len() {
                match waits.iter().find(|(t, _)| *t == cur) {
                    Some(&(_, next)) if next == start => {
                        w.violate(format!("deadlock: tx{start} waits on a cycle of locks"));
                        return;
                    }
                    Some(&(_, next)) => cur = next,
                    None => break,
                }
            }
        }
    }

    /// A hash of everything that decides what can happen next.
    pub(crate) fn state_hash(&self) -> u64 {
        let w = lock(&self.world);
        let mut h = DefaultHasher::new();
        w.now_ms.hash(&mut h);
        w.durable.hash(&mut h);
        w.snapshots.last().hash(&mut h);
        w.marks.hash(&mut h);
        w.filter_up.hash(&mut h);
        w.poisoned.hash(&mut h);
        w.killer_runs.hash(&mut h);
        w.first_received.hash(&mut h);
        w.lost_to_restore.hash(&mut h);
        for (t, k) in &w.refused {
            self.tasks.iter().position(|x| x.id == *t).hash(&mut h);
            k.hash(&mut h);
        }
        for t in &w.outage {
            self.tasks.iter().position(|x| x.id == *t).hash(&mut h);
        }
        self.budgets.hash(&mut h);
        // Workers: their position, their open transactions and the locks they hold.
        for t in &self.tasks {
            t.fut.is_some().hash(&mut h);
            w.history.get(&t.id).copied().unwrap_or(0).hash(&mut h);
            let mut pending: Vec<(u8, u8, bool)> = w
                .requests
                .values()
                .filter(|r| r.task == t.id && r.decision.is_none())
                .map(|r| match r.op {
                    Op::Receive { .. } => (0, 0, false),
                    Op::Begin => (1, 0, false),
                    Op::Claim { key, ident, .. } => (2, key, ident),
                    Op::Handle { key, .. } => (3, key, false),
                    Op::Commit { .. } => (4, 0, false),
                    Op::Ack { .. } => (5, 0, false),
                    Op::Probe => (6, 0, false),
                })
                .collect();
            pending.sort_unstable();
            pending.hash(&mut h);
            for (txid, tx) in w.txs.iter().filter(|(_, tx)| tx.task == t.id) {
                tx.claimed.hash(&mut h);
                tx.idents.hash(&mut h);
                tx.effects.hash(&mut h);
                let held: Vec<u8> = w
                    .locks
                    .iter()
                    .filter(|(_, holder)| *holder == txid)
                    .map(|(k, _)| *k)
                    .collect();
                held.hash(&mut h);
            }
        }
        // Messages: relative ready order, delays relative to now, deliveries.
        let mut ready: Vec<(u64, usize)> = Vec::new();
        for (i, m) in w.msgs.iter().enumerate() {
            m.key.hash(&mut h);
            m.deliveries.hash(&mut h);
            // What the checks read of the rest: compared with the limit only.
            m.charged().min(w.max_attempts).hash(&mut h);
            if self.config.neighbour_check {
                m.collateral.hash(&mut h);
            }
            m.outages_met.min(w.max_attempts).hash(&mut h);
            m.proven.min(w.max_attempts).hash(&mut h);
            match &m.state {
                MsgState::Ready(seq) => {
                    0u8.hash(&mut h);
                    ready.push((*seq, i));
                }
                MsgState::InFlight(tag) => {
                    1u8.hash(&mut h);
                    w.tags.get(tag).map(|t| t.1).hash(&mut h);
                }
                MsgState::Delayed(due) => {
                    2u8.hash(&mut h);
                    due.saturating_sub(w.now_ms).hash(&mut h);
                }
                MsgState::Acked => 3u8.hash(&mut h),
                MsgState::Dead(code) => {
                    4u8.hash(&mut h);
                    code.hash(&mut h);
                }
            }
        }
        ready.sort_unstable();
        ready.iter().map(|r| r.1).collect::<Vec<_>>().hash(&mut h);
        h.finish()
    }

    /// The checks at quiescence (no choice enabled).
    pub(crate) fn quiescence(&mut self) -> Option<String> {
        if self.config.mode == Mode::Consumer {
            lock(&self.world).closed = true;
            for t in &self.tasks {
                t.flag.0.store(true, Ordering::SeqCst);
            }
            self.settle();
            if self.tasks.iter().any(|t| t.fut.is_some()) {
                return Some("the consumer did not finish once its stream ended".into());
            }
        }
        let w = lock(&self.world);
        if let Some(v) = w.violations.first() {
            return Some(v.clone());
        }
        if !w.requests.is_empty() && self.config.mode == Mode::Consumer {
            return Some("a call is still pending after the consumer finished".into());
        }
        for (i, m) in w.msgs.iter().enumerate() {
            match &m.state {
                MsgState::Acked => {}
                MsgState::Dead(code) => {
                    let poison = match m.key {
                        None => true,
                        Some(k) => w.poisoned.contains(&k),
                    };
                    // A conflict: another key of the same submission committed (or did,
                    // before a restore took it).
                    let conflict = *code == CONFLICT
                        && w.conflicts_dead_letter
                        && m.key.is_some_and(|k| {
                            let i = ident_of(k);
                            w.durable.identities.get(&i).is_some_and(|&e| e != k)
                                || w.lost_to_restore
                                    .iter()
                                    .any(|&e| e != k && ident_of(e) == i)
                        });
                    // Attempts run out: lawful when it happened (checked then).
                    let exhausted = *code == ATTEMPTS_EXHAUSTED;
                    if !poison && !conflict && !exhausted {
                        return Some(format!(
                            "m{i} (k{}) was dead-lettered ({code}) though it is valid",
                            m.key.unwrap_or(0)
                        ));
                    }
                }
                other => return Some(format!("m{i} is unsettled at quiescence: {other:?}")),
            }
        }
        // Killers and recurring failures: dead-lettered by the gate, never an effect.
        for (i, m) in w.msgs.iter().enumerate() {
            let Some(k) = m.key.filter(|&k| is_killer(k) || is_recurring(k)) else {
                continue;
            };
            let by_gate = matches!(m.state, MsgState::Dead(ATTEMPTS_EXHAUSTED))
                || (w.poisoned.contains(&k) && matches!(m.state, MsgState::Dead(_)));
            if !by_gate {
                return Some(format!(
                    "m{i} (k{k}, which always fails) ended {:?}, not dead-lettered with {ATTEMPTS_EXHAUSTED}",
                    m.state
                ));
            }
            if let Some(n) = w.durable.effects.get(&k).filter(|&&n| n > 0) {
                return Some(format!("k{k}, which always fails, has {n} effects"));
            }
        }
        // A key none of whose messages is left to carry it: each ran out of attempts
        // (lawfully: checked when it happened) or was acked (after a commit, checked then,
        // which only a restore can have taken since), and one at least ran out.
        let exhausted = |k: u8| {
            let mut of_k = w.msgs.iter().filter(|m| m.key == Some(k));
            let dead = |m: &Msg| m.state == MsgState::Dead(ATTEMPTS_EXHAUSTED);
            of_k.clone().any(dead) && of_k.all(|m| dead(m) || m.state == MsgState::Acked)
        };
        let conflicting =
            (0..self.config.conflicts.min(self.config.keys)).map(|j| CONFLICT_BASE + j);
        let identity_effects = w.identity_effects();
        for k in (0..self.config.keys).chain(conflicting) {
            let n = w.durable.effects.get(&k).copied().unwrap_or(0);
            let outbox = w.durable.outbox.get(&k).copied().unwrap_or(0);
            if n != outbox {
                return Some(format!("k{k}: {n} effects but {outbox} outbox rows"));
            }
            if w.poisoned.contains(&k) {
                if n > 1 {
                    return Some(format!("k{k} (refused) has {n} effects"));
                }
                continue;
            }
            let expected_lost = w.lost_to_restore.contains(&k);
            let i = ident_of(k);
            let has_twin = k != i || self.config.conflicts > i;
            if w.conflicts_dead_letter && has_twin {
                // One effect per submission, whichever of its payloads won.
                let total = identity_effects.get(&i).copied().unwrap_or(0);
                let lost = w.lost_to_restore.iter().any(|&e| ident_of(e) == i);
                let gave_up = exhausted(i) && exhausted(CONFLICT_BASE + i);
                match total {
                    1 => continue,
                    0 if lost || gave_up => continue,
                    0 => return Some(format!("submission S-{i} was lost: no effect")),
                    t => return Some(format!("submission S-{i} has {t} effects")),
                }
            }
            match n {
                1 => {}
                0 if expected_lost || exhausted(k) => {}
                0 => return Some(format!("k{k} was lost: no effect")),
                n => return Some(format!("k{k} has {n} effects")),
            }
        }
        None
    }
}
