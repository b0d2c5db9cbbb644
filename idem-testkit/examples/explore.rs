//! Explores the real `Gate` exhaustively within small bounds (see `idem_testkit::explore`).
//! Built only with the `mutants` feature: the gates it must catch are compiled in.
//!
//! ```text
//! cargo run --release -p idem-testkit --features mutants --example explore
//! cargo run --release -p idem-testkit --features mutants --example explore -- --mutant ack-before-commit
//! cargo run --release -p idem-testkit --features mutants --example explore -- --replay 0.3.1.0 [same flags]
//! ```
//!
//! `--help` lists the flags: the space's bounds (workers, keys, copies, …), the fault
//! budgets, the mode, a mutant to catch and a sequence to replay.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use idem_engine::ConflictPolicy;
use idem_testkit::explore::{explore, replay, Config, Mode, Mutant, Report};

/// Explores the real `Gate` exhaustively within small bounds: every interleaving, crash
/// and fault, checked for exactly one effect per submission; then shows that each mutant
/// (a deliberately broken gate) is caught. Exit status 1 on a violation or a missed mutant.
#[derive(Parser, Debug)]
#[command(name = "explore", after_help = mutants_help())]
struct Cli {
    /// Concurrent workers.
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Distinct submissions.
    #[arg(long, value_name = "N")]
    keys: Option<u8>,
    /// Deliveries of each submission.
    #[arg(long, value_name = "N")]
    copies: Option<usize>,
    /// Poison messages.
    #[arg(long, value_name = "N")]
    poison: Option<usize>,
    /// Submissions re-sent with a changed payload (conflicts).
    #[arg(long, value_name = "N")]
    conflicts: Option<u8>,
    /// What a conflict does.
    #[arg(long, value_enum)]
    on_conflict: Option<OnConflict>,
    /// Batch size (1: one delivery per transaction).
    #[arg(long, value_name = "N")]
    batch: Option<usize>,
    /// Which runs: the gate's `process` alone, the consumer loop, or both.
    #[arg(long, value_enum, default_value_t = ModeArg::Both)]
    mode: ModeArg,
    /// Crash budget.
    #[arg(long, value_name = "N")]
    crashes: Option<u32>,
    /// Error budget of each class: unavailable, conflict, rejected, config.
    #[arg(long, value_name = "N")]
    errors: Option<u32>,
    /// Lost-ack budget.
    #[arg(long, value_name = "N")]
    lost_acks: Option<u32>,
    /// Lease-expiry budget.
    #[arg(long, value_name = "N")]
    expiries: Option<u32>,
    /// Store-outage budget.
    #[arg(long, value_name = "N")]
    outages: Option<u32>,
    /// Store-restore budget.
    #[arg(long, value_name = "N")]
    restores: Option<u32>,
    /// Lock-timeout budget.
    #[arg(long, value_name = "N")]
    lock_timeouts: Option<u32>,
    /// Budget of commits that fail without an error (void commits).
    #[arg(long, value_name = "N")]
    void_commits: Option<u32>,
    /// Most faults in one run, whatever their class.
    #[arg(long, value_name = "N")]
    max_faults: Option<u32>,
    /// Workers killed mid-run.
    #[arg(long, value_name = "N")]
    killers: Option<usize>,
    /// Recurring failures.
    #[arg(long, value_name = "N")]
    recurring: Option<usize>,
    /// Attempts before a dead letter (at least 1).
    #[arg(long, value_name = "N")]
    max_attempts: Option<u32>,
    /// The broker's own delivery limit.
    #[arg(long, value_name = "N")]
    broker_limit: Option<u32>,
    /// What an attempt counts: the gate's runs or the broker's deliveries.
    #[arg(long, value_enum)]
    delivery_count: Option<DeliveryCount>,
    /// Longest sequence explored.
    #[arg(long, value_name = "N")]
    max_depth: Option<usize>,
    /// Time limit of each pass, in seconds.
    #[arg(long, value_name = "SECS")]
    time_limit: Option<u64>,
    /// Also check each state's neighbours.
    #[arg(long)]
    neighbour_check: bool,
    /// The handler checks the claim before it runs.
    #[arg(long)]
    check_before_handler: bool,
    /// Explore with this mutant switched on (it must be caught).
    #[arg(long, value_name = "NAME", value_parser = mutant)]
    mutant: Option<Mutant>,
    /// Replay this sequence, step by step (with the flags it was found with).
    #[arg(long, value_name = "SEQ")]
    replay: Option<String>,
    /// Skip the pass that shows every mutant caught.
    #[arg(long)]
    skip_mutants: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OnConflict {
    DeadLetter,
    Process,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    Process,
    Consumer,
    Both,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DeliveryCount {
    Runs,
    Deliveries,
}

fn mutants_help() -> String {
    let names: Vec<&str> = Mutant::ALL.iter().map(|(n, _)| *n).collect();
    format!("Mutants: {}", names.join(", "))
}

fn mutant(name: &str) -> Result<Mutant, String> {
    Mutant::by_name(name).ok_or_else(|| format!("no mutant {name:?}; {}", mutants_help()))
}

/// A value-enum's command-line name.
fn name<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_owned())
}

struct Args {
    config: Config,
    modes: Vec<Mode>,
    mutant: Option<Mutant>,
    replay: Option<String>,
    skip_mutants: bool,
    /// The space's flags as given, for the replay hint.
    flags: Vec<String>,
}

fn parse() -> Args {
    let cli = Cli::parse();
    let mut config = Config::default();
    let mut flags = Vec::new();
    // Each given flag: recorded for the replay hint, then applied.
    macro_rules! given {
        ($field:ident, $flag:literal, |$v:ident| $apply:expr) => {
            if let Some($v) = cli.$field {
                flags.push(format!("--{} {}", $flag, $v));
                $apply;
            }
        };
    }
    let b = &mut config.budgets;
    given!(crashes, "crashes", |n| b.crashes = n);
    given!(errors, "errors", |n| {
        b.unavailable = n;
        b.conflict = n;
        b.rejected = n;
        b.config = n;
    });
    given!(lost_acks, "lost-acks", |n| b.lost_acks = n);
    given!(expiries, "expiries", |n| b.expiries = n);
    given!(outages, "outages", |n| b.outages = n);
    given!(restores, "restores", |n| b.restores = n);
    given!(lock_timeouts, "lock-timeouts", |n| b.lock_timeouts = n);
    given!(void_commits, "void-commits", |n| b.void_commits = n);
    given!(max_faults, "max-faults", |n| b.total = n);
    given!(workers, "workers", |n| config.workers = n);
    given!(keys, "keys", |n| config.keys = n);
    given!(copies, "copies", |n| config.copies = n);
    given!(poison, "poison", |n| config.poison = n);
    given!(conflicts, "conflicts", |n| config.conflicts = n);
    given!(batch, "batch", |n| config.batch = n);
    given!(killers, "killers", |n| config.killers = n);
    given!(recurring, "recurring", |n| config.recurring = n);
    given!(max_attempts, "max-attempts", |n| config.max_attempts =
        n.max(1));
    given!(broker_limit, "broker-limit", |n| config.broker_limit = n);
    given!(max_depth, "max-depth", |n| config.max_depth = n);
    given!(time_limit, "time-limit", |n| config.time_limit =
        Duration::from_secs(n));
    if let Some(p) = cli.on_conflict {
        flags.push(format!("--on-conflict {}", name(&p)));
        config.on_conflict = match p {
            OnConflict::DeadLetter => ConflictPolicy::DeadLetter,
            OnConflict::Process => ConflictPolicy::Process,
        };
    }
    if let Some(c) = cli.delivery_count {
        flags.push(format!("--delivery-count {}", name(&c)));
        config.counts_runs = matches!(c, DeliveryCount::Runs);
    }
    if cli.neighbour_check {
        flags.push("--neighbour-check".to_owned());
        config.neighbour_check = true;
    }
    if cli.check_before_handler {
        flags.push("--check-before-handler".to_owned());
        config.check_before_handler = true;
    }
    let modes = match cli.mode {
        ModeArg::Process => vec![Mode::Process],
        ModeArg::Consumer => vec![Mode::Consumer],
        ModeArg::Both => vec![Mode::Process, Mode::Consumer],
    };
    Args {
        config,
        modes,
        mutant: cli.mutant,
        replay: cli.replay,
        skip_mutants: cli.skip_mutants,
        flags,
    }
}

fn main() -> ExitCode {
    let args = parse();
    let started = Instant::now();

    if let Some(seq) = &args.replay {
        let base = Config {
            mode: args.modes[0],
            ..args.config.clone()
        };
        let config = args.mutant.map_or(base.clone(), |m| m.config(&base));
        return match replay(&config, seq) {
            Err(e) => {
                eprintln!("explore: {e}");
                ExitCode::from(2)
            }
            Ok((steps, end)) => {
                for (i, s) in steps.iter().enumerate() {
                    println!("step {i}: {}", s.choice);
                    for e in &s.events {
                        println!("    {e}");
                    }
                }
                match end {
                    Some(v) => {
                        println!("violation: {v}");
                        ExitCode::from(1)
                    }
                    None => {
                        println!("violation: none");
                        ExitCode::SUCCESS
                    }
                }
            }
        };
    }

    if let Some(m) = args.mutant {
        for &mode in &args.modes {
            let config = m.config(&Config {
                mode,
                ..args.config.clone()
            });
            let r = explore(&config);
            println!("mutant: {} ({mode:?} mode)", m.name());
            println!("states: {}", r.states);
            println!("runs: {}", r.runs);
            if let Some((v, seq)) = r.violation {
                let mode_flag = match mode {
                    Mode::Process => "process",
                    Mode::Consumer => "consumer",
                };
                println!("violation: {v}");
                println!("sequence: {seq}");
                println!(
                    "replay: cargo run --release -p idem-testkit --features mutants --example explore -- --mutant {} --mode {mode_flag} {} --replay {seq}",
                    m.name(),
                    args.flags.join(" ")
                );
                return ExitCode::from(1);
            }
        }
        println!("violation: none found (the mutant was not caught)");
        return ExitCode::SUCCESS;
    }

    let mut total = Report::default();
    let mut exhaustive = true;
    let mut violations = 0;
    let mut passes: Vec<(String, Config)> = args
        .modes
        .iter()
        .map(|&mode| {
            let config = Config {
                mode,
                ..args.config.clone()
            };
            (format!("{mode:?} mode"), config)
        })
        .collect();
    // Conflicting resubmissions (unless --conflicts chose the space already): one
    // submission with two payloads under each policy, in the modes and budgets above; and
    // two submissions with two payloads each in crossing batches, every interleaving.
    if args.config.conflicts == 0 {
        let bases = passes.clone();
        for policy in [ConflictPolicy::DeadLetter, ConflictPolicy::Process] {
            for (name, base) in &bases {
                let name = format!("{name}, conflicts, {}", policy.as_str());
                passes.push((name, Config::conflicts(base, policy)));
            }
        }
        passes.push((
            "Process mode, crossing conflicts".into(),
            Config::crossing(&args.config),
        ));
        // The first delivered wins through failures of the store's side, in each mode.
        for (name, base) in &bases {
            passes.push((
                format!("{name}, first delivered wins"),
                Config::first_wins(base),
            ));
        }
    }
    // A message that kills its process on every run (where the broker counts runs: a
    // broker that counts deliveries cannot tell its runs from deferrals) and one whose
    // handler fails on every attempt, each beside a valid message, in the modes above.
    if args.config.killers == 0 && args.config.recurring == 0 && args.config.conflicts == 0 {
        let bases: Vec<(String, Config)> = passes
            .iter()
            .filter(|(_, c)| c.conflicts == 0)
            .cloned()
            .collect();
        for (name, base) in &bases {
            if base.counts_runs {
                passes.push((format!("{name}, killer"), Config::killer(base)));
            }
            passes.push((
                format!("{name}, recurring failure"),
                Config::recurring(base),
            ));
        }
    }
    for (name, config) in &passes {
        let r = explore(config);
        eprintln!(
            "{name}: {} states, {} runs, {:.1} s{}",
            r.states,
            r.runs,
            r.elapsed.as_secs_f64(),
            if r.exhaustive {
                ""
            } else {
                " (not exhaustive)"
            }
        );
        total.states += r.states;
        total.runs += r.runs;
        exhaustive &= r.exhaustive;
        if let Some((v, seq)) = r.violation {
            violations += 1;
            println!("violation ({name}): {v}");
            println!("sequence: {seq}");
        }
    }
    let mut caught = 0;
    let mutants = if args.skip_mutants {
        0
    } else {
        Mutant::ALL.len()
    };
    if !args.skip_mutants {
        for (name, m) in Mutant::ALL {
            let config = m.config(&Config {
                mode: Mode::Process,
                ..args.config.clone()
            });
            let r = explore(&config);
            match r.violation {
                Some((v, seq)) => {
                    caught += 1;
                    eprintln!(
                        "mutant {name}: caught after {} states: {v} [{seq}]",
                        r.states
                    );
                }
                None => eprintln!("mutant {name}: NOT caught ({} states)", r.states),
            }
        }
    }
    println!("states: {}", total.states);
    println!("runs: {}", total.runs);
    println!("violations: {violations}");
    println!("mutants: caught {caught} of {mutants}");
    println!("exhaustive: {}", if exhaustive { "yes" } else { "no" });
    eprintln!("seconds: {:.1}", started.elapsed().as_secs_f64());
    if violations == 0 && exhaustive && caught == mutants {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
