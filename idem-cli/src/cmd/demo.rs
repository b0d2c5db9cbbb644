//! `idem demo`: the grant pipeline over the simulated at-least-once broker, with
//! redeliveries, injected crashes and poison messages, then a verdict read back from the
//! database.

use std::sync::Arc;
use std::time::Instant;

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use hdrhistogram::Histogram;
use idem_engine::{ClaimStore, Gate, GateObserver, Handler, IdempotencyKey, OutcomeKind, Stage};
use idem_grant::{parse_submission, GrantDb, GrantHandler, DEFAULT_MAX_BODY};
use idem_sim::fault::{quiet_injected_crashes, CrashPoint, FaultPlan, FaultyHandler, FaultyStore};
use idem_sim::sim::{drive_fed, SimConfig};
use idem_sim::SimBroker;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::stores::{self, Extras, StoreSpec, StoreVisitor};
use crate::CliError;

/// Arguments of `idem demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The store (default: a new SQLite database in a temporary directory, kept
    /// afterwards). Never taken from IDEM_STORE or DATABASE_URL: the demo writes made-up
    /// grants.
    #[arg(long)]
    store: Option<String>,
    /// The Postgres schema (created if missing).
    #[arg(long)]
    schema: Option<String>,
    /// Distinct submissions to publish.
    #[arg(long, default_value_t = 10_000)]
    submissions: u64,
    /// Fraction of acked deliveries the broker redelivers anyway (0..=1).
    #[arg(long, default_value_t = 0.25, value_parser = fraction)]
    redeliveries: f64,
    /// Fraction of deliveries on which the worker crashes somewhere in the pipeline (0..=1).
    #[arg(long, default_value_t = 0.02, value_parser = fraction)]
    crash_rate: f64,
    /// Fraction of published messages that are malformed (0..=1).
    #[arg(long, default_value_t = 0.0, value_parser = fraction)]
    poison_rate: f64,
    /// Deliveries per transaction.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    batch_size: u64,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1024))]
    concurrency: u64,
    /// A Redis front filter in front of the store.
    #[arg(long, value_name = "URL")]
    front_filter: Option<String>,
    /// Seed of every random choice (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Show the logs too, a warning for each delivery an injected crash failed included
    /// (without it the report counts them; `RUST_LOG` chooses other logs either way).
    #[arg(long, short)]
    verbose: bool,
}

impl Args {
    /// Whether the logs are shown whole (`--verbose`).
    pub(crate) fn verbose(&self) -> bool {
        self.verbose
    }
}

/// The process's peak resident memory in MiB (`VmHWM` of /proc/self/status), where the
/// system reports it (Linux).
fn max_rss_mib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib.div_ceil(1024))
}

/// Claim-stage latencies (begin + claim, once per batch) in an HDR histogram of fixed
/// size: 1 µs to an hour at two significant digits (1 % resolution), so its memory does
/// not grow with the run.
struct ClaimLatency(Mutex<Histogram<u64>>);

impl ClaimLatency {
    fn new() -> Self {
        let h = Histogram::new_with_bounds(1, 3_600_000_000, 2)
            .expect("constant bounds of 1 µs to 1 h at two significant digits");
        Self(Mutex::new(h))
    }

    /// The `q` quantile (0..=1) in milliseconds, `None` before any sample.
    fn quantile_ms(&self, q: f64) -> Option<f64> {
        let h = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
    }
}

impl GateObserver for ClaimLatency {
    fn stage(&self, stage: Stage, elapsed: Duration) {
        if stage == Stage::Claim {
            let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .saturating_record(micros.max(1));
        }
    }
}

fn fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a fraction between 0 and 1"))
    }
}

/// One generated message.
enum Message {
    /// A valid submission: its body, key, award id and amount.
    Valid {
        body: Vec<u8>,
        key: IdempotencyKey,
        award_id: String,
        amount: i64,
    },
    Poison(Vec<u8>),
}

fn poison(kind: u64, i: u64) -> Vec<u8> {
    match kind % 8 {
        0 => b"this is not json".to_vec(),
        1 => format!(r#"{{"submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":{i}}}"#).into_bytes(),
        2 => format!(r#"{{"award_id":"P-{i}","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":-{i}}}"#)
            .into_bytes(),
        3 => format!(r#"{{"award_id":"P|{i}","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":{i}}}"#)
            .into_bytes(),
        4 => vec![0xff, 0xfe, b'{', b'}'],
        5 => Vec::new(),
        6 => format!(r#"{{"award_id":"P-{i}","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":"{i}"}}"#)
            .into_bytes(),
        _ => {
            let mut body = format!(r#"{{"award_id":"P-{i}","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1,"pad":""#)
                .into_bytes();
            body.resize(DEFAULT_MAX_BODY + 16, b'x');
            body.extend_from_slice(b"\"}");
            body
        }
    }
}

/// A generated submission, its fields in this order (the body's bytes, and so its key,
/// are a pure function of the seed).
#[derive(serde::Serialize)]
struct Body<'a> {
    award_id: &'a str,
    submission_timestamp: &'a str,
    amount_cents: i64,
    program: &'static str,
}

/// The run's messages, generated one at a time from the seed: the same seed gives the
/// same sequence, so the verdict regenerates it instead of keeping it (memory does not
/// grow with `--submissions`). Award ids are `{prefix}{i}` with `i` zero-padded to one
/// width, so their byte order is the generation order.
struct Generator {
    rng: StdRng,
    next: u64,
    submissions: u64,
    poison_rate: f64,
    prefix: String,
    width: usize,
}

impl Generator {
    fn new(args: &Args, seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            next: 0,
            submissions: args.submissions,
            poison_rate: args.poison_rate,
            prefix: format!("A-{seed:016x}-"),
            width: args.submissions.saturating_sub(1).to_string().len().max(7),
        }
    }
}

impl Iterator for Generator {
    type Item = Message;

    fn next(&mut self) -> Option<Message> {
        if self.next >= self.submissions {
            return None;
        }
        let i = self.next;
        self.next += 1;
        if self.poison_rate > 0.0 && self.rng.random_bool(self.poison_rate) {
            return Some(Message::Poison(poison(self.rng.random(), i)));
        }
        let amount: i64 = self.rng.random_range(1..=500_000);
        let award_id = format!("{}{i:0width$}", self.prefix, width = self.width);
        let submission_timestamp = format!(
            "2026-07-01T{:02}:{:02}:{:02}Z",
            (i / 3600) % 24,
            (i / 60) % 60,
            i % 60
        );
        let body = serde_json::to_vec(&Body {
            award_id: &award_id,
            submission_timestamp: &submission_timestamp,
            amount_cents: amount,
            program: "demo",
        })
        .unwrap_or_default();
        match parse_submission(&body, DEFAULT_MAX_BODY) {
            Ok(sub) => Some(Message::Valid {
                body,
                key: sub.key,
                award_id,
                amount,
            }),
            // Not reached: the generated body is valid. Kept as poison so that the
            // verdict would see it rather than a silent gap.
            Err(_) => Some(Message::Poison(body)),
        }
    }
}

/// What the verdict found, at most `MAX_SHOWN` problems spelled out.
#[derive(Default)]
struct Verdict {
    problems: Vec<String>,
    more: u64,
    total_cents: i64,
    expected_total_cents: i64,
    poison: u64,
}

impl Verdict {
    const MAX_SHOWN: usize = 5;

    fn problem(&mut self, p: String) {
        if self.problems.len() < Self::MAX_SHOWN {
            self.problems.push(p);
        } else {
            self.more += 1;
        }
    }
}

/// Compares the run's `disbursements` rows with the regenerated messages, both in award
/// id order, a page at a time: every valid submission has exactly one row with its key
/// and amount, and there is no other row of this run.
async fn verify(
    db: &dyn GrantDb,
    args: &Args,
    seed: u64,
    page_size: usize,
) -> Result<Verdict, CliError> {
    let page_size = page_size.max(1);
    let mut verdict = Verdict::default();
    let mut expected = Generator::new(args, seed).filter_map(|m| match m {
        Message::Valid {
            key,
            award_id,
            amount,
            ..
        } => Some((award_id, key, amount)),
        Message::Poison(_) => None,
    });
    // Poison count and expected total: a first pass over the regenerated sequence.
    for m in Generator::new(args, seed) {
        match m {
            Message::Valid { amount, .. } => verdict.expected_total_cents += amount,
            Message::Poison(_) => verdict.poison += 1,
        }
    }
    let prefix = Generator::new(args, seed).prefix;
    let mut current = expected.next();
    // The award id of the last row matched, to name a second row of it a duplicate.
    let mut matched: Option<String> = None;
    let mut after = (String::new(), String::new());
    loop {
        let page = db
            .ledger_page(&prefix, (&after.0, &after.1), page_size)
            .await?;
        let Some(last) = page.last() else { break };
        after = (last.award_id.clone(), last.key.to_hex());
        let full = page.len() == page_size;
        for row in page {
            verdict.total_cents += row.amount_cents;
            // Expected submissions before this row's award id have no row: lost.
            while let Some((award, key, _)) = &current {
                if award.as_bytes() >= row.award_id.as_bytes() {
                    break;
                }
                if matched.as_deref() != Some(award.as_str()) {
                    verdict.problem(format!("lost: {} has no effect", key.short()));
                }
                current = expected.next();
            }
            match &current {
                Some((award, key, amount)) if *award == row.award_id => {
                    if matched.as_deref() == Some(award.as_str()) {
                        verdict
                            .problem(format!("duplicated: {} took effect again", row.key.short()));
                    } else if row.key != *key {
                        verdict.problem(format!("unexpected effect {}", row.key.short()));
                    } else if row.amount_cents != *amount {
                        verdict.problem(format!(
                            "wrong amount for {}: expected {amount}, got {}",
                            key.short(),
                            row.amount_cents
                        ));
                        matched = Some(award.clone());
                    } else {
                        matched = Some(award.clone());
                    }
                }
                _ if matched.as_deref() == Some(row.award_id.as_str()) => {
                    verdict.problem(format!("duplicated: {} took effect again", row.key.short()));
                }
                _ => verdict.problem(format!("unexpected effect {}", row.key.short())),
            }
        }
        if !full {
            break;
        }
    }
    while let Some((award, key, _)) = current {
        if matched.as_deref() != Some(award.as_str()) {
            verdict.problem(format!("lost: {} has no effect", key.short()));
        }
        current = expected.next();
    }
    Ok(verdict)
}

struct Demo {
    args: Args,
    seed: u64,
    /// The store's URL, redacted, for the commands the closing explanation suggests.
    url: String,
}

/// The name a crash point has in the closing explanation.
fn crash_point_name(point: CrashPoint) -> &'static str {
    match point {
        CrashPoint::BeforeClaim => "before the claim",
        CrashPoint::AfterClaim => "after the claim",
        CrashPoint::AfterHandler => "after the business write",
        CrashPoint::DuringCommit => "during the commit",
        CrashPoint::AfterCommitBeforeAck => "after the commit, before the ack",
        CrashPoint::AckLost => "with the ack lost",
    }
}

/// What a newcomer reads after the report: what the run did to the pipeline, what the
/// verdict proves, and the commands that show it in the database.
struct Explanation<'a> {
    args: &'a Args,
    url: &'a str,
    stats: &'a idem_sim::BrokerStats,
    crashes: &'a std::collections::BTreeMap<CrashPoint, u64>,
    duplicates: u64,
    rejected: usize,
    first_award: Option<&'a str>,
    seed: u64,
    ok: bool,
}

impl std::fmt::Display for Explanation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total: u64 = self.crashes.values().sum();
        let mut said = vec![format!(
            "What happened: {} submissions went through a simulated at-least-once broker \
             ({} deliveries, {} of them redeliveries, {} acks lost on purpose).",
            self.args.submissions,
            self.stats.deliveries,
            self.stats.redeliveries,
            self.stats.acks_lost
        )];
        said.push(if total > 0 {
            let by_point: Vec<String> = self
                .crashes
                .iter()
                .filter(|(_, n)| **n > 0)
                .map(|(p, n)| format!("{n} {}", crash_point_name(*p)))
                .collect();
            format!(
                "Simulated crashes: {total} ({}), each a worker dying there on purpose: its \
                 transaction rolled back, or its delivery came back.",
                by_point.join(", ")
            )
        } else {
            "Simulated crashes: none (--crash-rate 0).".to_owned()
        });
        said.push(format!(
            "{} redelivered submissions were recognised by their idempotency key and acked \
             without a second effect; {} malformed messages were dead-lettered.",
            self.duplicates, self.rejected
        ));
        said.push(if self.ok {
            "Proven, from the database read back: each submission has exactly one \
             disbursement with its amount, the ledger total is the expected one, and every \
             delivery is settled. That is exactly-once."
                .to_owned()
        } else {
            "Not proven: the database does not hold exactly one effect per submission (the \
             line above names what differs)."
                .to_owned()
        });
        writeln!(f)?;
        for paragraph in said {
            writeln!(f, "{}", wrap(&paragraph, 88))?;
        }
        writeln!(f, "See for yourself:")?;
        let store = match &self.args.schema {
            Some(schema) => format!("--store {} --schema {schema}", self.url),
            None => format!("--store {}", self.url),
        };
        if let Some(award) = self.first_award {
            writeln!(f, "  idem inspect {store} --award-id {award}")?;
        }
        let today = idem_engine::record::Timestamp::now().start_of_day();
        let tomorrow = idem_engine::record::Timestamp::from_unix_micros(
            today.unix_micros().saturating_add(86_400_000_000),
        );
        writeln!(
            f,
            "  idem audit export {store} --since {}T00:00:00Z --until {}T00:00:00Z | head -3",
            today.day(),
            tomorrow.day()
        )?;
        write!(
            f,
            "  idem demo --seed {} --verbose   (the same messages and crash plan, with the \
             logs: each crash as the gate saw it)",
            self.seed
        )
    }
}

/// `text` in lines of at most `width` characters, broken at spaces (a longer word keeps
/// its own line).
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0;
    for word in text.split_whitespace() {
        let len = word.chars().count();
        if line > 0 && line + 1 + len > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += len;
    }
    out
}

impl StoreVisitor for Demo {
    type Output = bool;

    async fn visit<S>(
        self,
        store: S,
        db: Arc<dyn GrantDb>,
        extras: Extras,
    ) -> Result<bool, CliError>
    where
        S: ClaimStore + Clone + 'static,
        GrantHandler: Handler<S::Tx>,
        S::Tx: crate::sql_handler::SqlTx,
    {
        let Demo { args, seed, url } = self;
        let broker = SimBroker::with_redelivery_rate(seed, args.redeliveries);
        // Messages are published as the run drains them, a window at a time, so the
        // broker never holds the whole run.
        let mut messages = Generator::new(&args, seed);
        let window = usize::try_from(args.batch_size.saturating_mul(args.concurrency))
            .unwrap_or(usize::MAX)
            .saturating_mul(4)
            .max(1024);
        quiet_injected_crashes();
        let plan = FaultPlan::random(args.crash_rate, seed ^ 0x5eed);
        let handler = db.grant_handler();
        let latency = Arc::new(ClaimLatency::new());
        // Outcomes per day into the store's idem_outcome_counts (the audit report's
        // duplicates and dead letters), flushed every second and at the end.
        let (observer, flusher) =
            idem_runtime::tally::with_outcome_tally(latency.clone(), extras.outcome_counts.clone());
        let gate = Arc::new(
            Gate::new(
                FaultyStore::new(store, plan.clone()),
                FaultyHandler::new(handler, plan.clone()),
            )
            .with_observer(observer),
        );
        let config = SimConfig {
            concurrency: usize::try_from(args.concurrency).unwrap_or(4),
            batch_size: usize::try_from(args.batch_size).unwrap_or(1),
            max_deliveries: args.submissions.saturating_mul(20).saturating_add(1000),
        };
        let bar = ProgressBar::new(args.submissions);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {bar:40} {pos}/{len} settled  {per_sec}  eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let started = Instant::now();
        let report = drive_fed(
            gate,
            &broker,
            &plan,
            &config,
            |b| {
                while b.ready_len() < window {
                    match messages.next() {
                        Some(Message::Valid { body, .. } | Message::Poison(body)) => {
                            b.publish(body);
                        }
                        None => break,
                    }
                }
            },
            |o| {
                if matches!(o.kind(), OutcomeKind::Processed | OutcomeKind::Rejected) {
                    bar.inc(1);
                }
            },
        )
        .await;
        let seconds = started.elapsed().as_secs_f64();
        let counts_written = match flusher {
            Some(f) => Some(f.finish().await),
            None => None,
        };
        let report = report.map_err(CliError::failed)?;
        bar.finish_and_clear();

        // The verdict comes from the database, read back — not from counters kept beside
        // it — a page at a time against the regenerated messages.
        let prefix = Generator::new(&args, seed).prefix;
        // The tables' totals (other runs' rows included, as the report always gave them),
        // and this run's own claims and rows, which must agree one to one.
        let claims = db.claim_rows().await?;
        let (rows, distinct_rows) = db.ledger_counts("").await?;
        let our_claims = db.claim_rows_with_prefix(&prefix).await?;
        let (our_rows, our_distinct) = db.ledger_counts(&prefix).await?;
        let outbox = db.outbox_rows().await?;
        let verdict = verify(db.as_ref(), &args, seed, 10_000).await?;
        let total = verdict.total_cents;
        let dead = broker.dead_letters();
        let stats = broker.stats();

        println!("deliveries: {}", stats.deliveries);
        println!("processed: {claims}");
        println!("duplicates: {}", report.count(OutcomeKind::Duplicate));
        println!("crashes: {}", report.total_crashes());
        println!("rejected: {}", dead.len());
        println!("disbursements: {rows}");
        println!("ledger_total_cents: {total}");
        println!("expected_total_cents: {}", verdict.expected_total_cents);
        println!("outbox_rows: {outbox}");
        if let Some(f) = &extras.filter_stats {
            println!("front_filter_hits: {}", f.hits());
            println!("front_filter_errors: {}", f.errors());
            println!("front_filter_bypassed: {}", f.bypassed());
        }
        println!("seconds: {seconds:.3}");
        println!(
            "throughput_msgs_per_s: {:.0}",
            args.submissions as f64 / seconds.max(1e-9)
        );
        // Per claim transaction start + claim statement (per batch with --batch-size).
        if let (Some(p50), Some(p99)) = (latency.quantile_ms(0.5), latency.quantile_ms(0.99)) {
            println!("claim_p50_ms: {p50:.3}");
            println!("claim_p99_ms: {p99:.3}");
        }
        if let Some(mib) = max_rss_mib() {
            println!("max_rss_mib: {mib}");
        }
        if let Some(written) = counts_written {
            // Whether the outcome tally (the audit report's duplicates and dead letters)
            // reached the store's idem_outcome_counts.
            println!(
                "outcome_counts: {}",
                if written { "written" } else { "NOT written" }
            );
        }

        let poison_count = verdict.poison;
        let mut problems = verdict.problems;
        if verdict.more > 0 {
            problems.push(format!("… {} more", verdict.more));
        }
        if our_claims != our_rows || our_distinct != our_rows {
            problems.push(format!(
                "{our_claims} processed_messages rows of this run but {our_rows} disbursements \
                 ({our_distinct} distinct keys)"
            ));
        }
        if distinct_rows != rows {
            problems.push(format!(
                "{rows} disbursements but {distinct_rows} distinct keys"
            ));
        }
        if total != verdict.expected_total_cents {
            problems.push(format!(
                "ledger total {total} != expected {}",
                verdict.expected_total_cents
            ));
        }
        if dead.len() as u64 != poison_count {
            problems.push(format!(
                "{} dead letters for {poison_count} poison messages",
                dead.len()
            ));
        }
        if !broker.is_settled() {
            problems.push(format!(
                "{} deliveries unsettled",
                broker.ready_len() + broker.in_flight_len()
            ));
        }
        let ok = problems.is_empty();
        if ok {
            println!("exactly-once: OK");
        } else {
            println!("exactly-once: VIOLATED {}", problems.join("; "));
        }
        let first_award = Generator::new(&args, seed).find_map(|m| match m {
            Message::Valid { award_id, .. } => Some(award_id),
            Message::Poison(_) => None,
        });
        let explanation = Explanation {
            args: &args,
            url: &url,
            stats: &stats,
            crashes: &report.crashes,
            duplicates: report.count(OutcomeKind::Duplicate),
            rejected: dead.len(),
            first_award: first_award.as_deref(),
            seed,
            ok,
        };
        // After the report, on stderr: stdout stays `name: value` lines for scripts.
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        eprintln!("{explanation}");
        Ok(ok)
    }
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let url = match &args.store {
        Some(u) => u.clone(),
        None => {
            let dir = tempfile::Builder::new()
                .prefix("idem-demo-")
                .tempdir()
                .map_err(|e| CliError::failed(format!("cannot create a temporary directory: {e}")))?
                .keep();
            format!("sqlite://{}", dir.join("idem.db").display())
        }
    };
    let mut spec = StoreSpec::new(&url, args.schema.clone(), args.front_filter.clone())?;
    spec.grant_tables = true;
    spec.max_connections = Some(
        u32::try_from(args.concurrency)
            .unwrap_or(4)
            .saturating_add(2),
    );
    let shown = idem_engine::redact_url(&url);
    println!("store: {shown}");
    eprintln!(
        "idem demo: {} submissions, redeliveries {}, crash rate {}, poison rate {}, batch {}, concurrency {}, seed {seed}",
        args.submissions, args.redeliveries, args.crash_rate, args.poison_rate, args.batch_size, args.concurrency
    );
    let demo = Demo {
        args,
        seed,
        url: shown.into_owned(),
    };
    let ok = stores::open(&spec, true, demo).await?;
    if ok {
        Ok(())
    } else {
        Err(CliError::failed("exactly-once violated"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_body_keeps_its_bytes() {
        let mut g = Generator {
            rng: StdRng::seed_from_u64(7),
            next: 3661,
            submissions: 3662,
            poison_rate: 0.0,
            prefix: "A-x-".to_owned(),
            width: 7,
        };
        let Some(Message::Valid { body, amount, .. }) = g.next() else {
            panic!("not a valid message");
        };
        assert_eq!(
            String::from_utf8(body).expect("utf-8"),
            format!(
                r#"{{"award_id":"A-x-0003661","submission_timestamp":"2026-07-01T01:01:01Z","amount_cents":{amount},"program":"demo"}}"#
            )
        );
        assert!(g.next().is_none());
    }

    #[test]
    fn claim_latency_quantiles_are_within_one_percent() {
        let h = ClaimLatency::new();
        assert_eq!(h.quantile_ms(0.5), None);
        for ms in 1..=100_u64 {
            h.stage(Stage::Claim, Duration::from_millis(ms));
            h.stage(Stage::Commit, Duration::from_secs(9));
        }
        let p50 = h.quantile_ms(0.5).expect("p50");
        let p99 = h.quantile_ms(0.99).expect("p99");
        assert!((49.5..=50.5).contains(&p50), "p50 {p50}");
        assert!((98.0..=100.0).contains(&p99), "p99 {p99}");
    }

    async fn insert(store: &idem_store_sqlite::SqliteStore, award: &str, amount: i64, key: &str) {
        sqlx::query(
            "INSERT INTO disbursements (award_id, amount_cents, idempotency_key) VALUES (?, ?, ?)",
        )
        .bind(award)
        .bind(amount)
        .bind(key)
        .execute(store.pool())
        .await
        .expect("insert");
    }

    #[tokio::test]
    async fn the_verdict_reads_pages_and_names_lost_duplicated_and_wrong_rows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("verdict.db").display().to_string();
        let store = idem_store_sqlite::SqliteStore::connect(&path, Default::default())
            .await
            .expect("open");
        store.migrate_grants().await.expect("migrate");
        let args = Args {
            store: None,
            schema: None,
            submissions: 40,
            redeliveries: 0.0,
            crash_rate: 0.0,
            poison_rate: 0.2,
            batch_size: 1,
            concurrency: 1,
            front_filter: None,
            seed: None,
            verbose: false,
        };
        let seed = 42;
        let mut valid = Vec::new();
        for m in Generator::new(&args, seed) {
            if let Message::Valid {
                key,
                award_id,
                amount,
                ..
            } = m
            {
                insert(&store, &award_id, amount, &key.to_hex()).await;
                valid.push((award_id, key, amount));
            }
        }
        // Another run's row, outside this run's prefix, is none of its business.
        insert(&store, "A-other-run", 5, &"ab".repeat(32)).await;
        let v = verify(&store, &args, seed, 3).await.expect("verify");
        assert!(v.problems.is_empty(), "{:?}", v.problems);
        assert!(v.poison > 0 && valid.len() < 40, "poison was generated");
        assert_eq!(v.total_cents, v.expected_total_cents);

        // One row lost, one duplicated, one with the wrong amount.
        sqlx::query("DELETE FROM disbursements WHERE award_id = ?")
            .bind(&valid[0].0)
            .execute(store.pool())
            .await
            .expect("delete");
        insert(&store, &valid[5].0, valid[5].2, &valid[5].1.to_hex()).await;
        sqlx::query("UPDATE disbursements SET amount_cents = amount_cents + 1 WHERE award_id = ?")
            .bind(&valid[9].0)
            .execute(store.pool())
            .await
            .expect("update");
        let v = verify(&store, &args, seed, 3).await.expect("verify");
        let all = v.problems.join("\n");
        assert_eq!(v.problems.len(), 3, "{all}");
        assert!(
            all.contains(&format!("lost: {}", valid[0].1.short())),
            "{all}"
        );
        assert!(
            all.contains(&format!("duplicated: {}", valid[5].1.short())),
            "{all}"
        );
        assert!(
            all.contains(&format!("wrong amount for {}", valid[9].1.short())),
            "{all}"
        );
    }

    #[test]
    fn the_explanation_is_wrapped_at_spaces() {
        assert_eq!(wrap("aa bb cc", 5), "aa bb\ncc");
        assert_eq!(wrap("a verylongword b", 4), "a\nverylongword\nb");
        assert_eq!(wrap("  a  b ", 10), "a b");
        assert!(wrap(&"word ".repeat(100), 88)
            .lines()
            .all(|l| l.chars().count() <= 88));
    }

    #[test]
    fn peak_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(max_rss_mib().is_some_and(|m| m > 0));
        }
    }
}
