//! Explores the real `Gate` exhaustively within small bounds (see `idem_testkit::explore`).
//! Built only with the `mutants` feature: the gates it must catch are compiled in.
//!
//! ```text
//! cargo run --release -p idem-testkit --features mutants --example explore
//! cargo run --release -p idem-testkit --features mutants --example explore -- --mutant ack-before-commit
//! cargo run --release -p idem-testkit --features mutants --example explore -- --replay 0.3.1.0 [same flags]
//! ```
//!
//! Flags: `--workers N`, `--keys N`, `--copies N`, `--poison N`, `--conflicts N`,
//! `--on-conflict dead-letter|process`, `--batch N`,
//! `--mode process|consumer|both`, `--crashes N`, `--errors N` (of each class: unavailable,
//! conflict, rejected, config), `--lost-acks N`, `--expiries N`, `--outages N`,
//! `--restores N`, `--lock-timeouts N`, `--void-commits N`, `--max-faults N`,
//! `--killers N`, `--recurring N`, `--max-attempts N`, `--broker-limit N`,
//! `--delivery-count runs|deliveries`, `--max-depth N`, `--time-limit SECS`,
//! `--neighbour-check`, `--mutant NAME`, `--replay SEQ`, `--skip-mutants`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use idem_core::ConflictPolicy;
use idem_testkit::explore::{explore, replay, Config, Mode, Mutant, Report};

fn usage(msg: &str) -> ExitCode {
    eprintln!("explore: {msg}");
    let names: Vec<&str> = Mutant::ALL.iter().map(|(n, _)| *n).collect();
    eprintln!("mutants: {}", names.join(", "));
    ExitCode::from(2)
}

struct Args {
    config: Config,
    modes: Vec<Mode>,
    mutant: Option<Mutant>,
    replay: Option<String>,
    skip_mutants: bool,
    flags: Vec<String>,
}

fn parse() -> Result<Args, String> {
    let mut config = Config::default();
    let mut modes = vec![Mode::Process, Mode::Consumer];
    let mut mutant = None;
    let mut replay = None;
    let mut skip_mutants = false;
    let mut flags = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--skip-mutants" {
            skip_mutants = true;
            continue;
        }
        if flag == "--neighbour-check" {
            config.neighbour_check = true;
            flags.push(flag);
            continue;
        }
        if flag == "--check-before-handler" {
            config.check_before_handler = true;
            flags.push(flag);
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || -> Result<u32, String> {
            value
                .parse()
                .map_err(|_| format!("{flag} takes a whole number, not {value:?}"))
        };
        flags.push(format!("{flag} {value}"));
        let b = &mut config.budgets;
        match flag.as_str() {
            "--workers" => config.workers = num()? as usize,
            "--keys" => config.keys = u8::try_from(num()?).map_err(|_| "--keys: at most 255")?,
            "--copies" => config.copies = num()? as usize,
            "--poison" => config.poison = num()? as usize,
            "--conflicts" => {
                config.conflicts = u8::try_from(num()?).map_err(|_| "--conflicts: at most 255")?;
            }
            "--on-conflict" => {
                config.on_conflict = match value.as_str() {
                    "dead-letter" => ConflictPolicy::DeadLetter,
                    "process" => ConflictPolicy::Process,
                    other => {
                        return Err(format!(
                            "--on-conflict: dead-letter or process, not {other:?}"
                        ))
                    }
                };
            }
            "--batch" => config.batch = num()? as usize,
            "--crashes" => b.crashes = num()?,
            "--errors" => {
                let n = num()?;
                b.unavailable = n;
                b.conflict = n;
                b.rejected = n;
                b.config = n;
            }
            "--lost-acks" => b.lost_acks = num()?,
            "--expiries" => b.expiries = num()?,
            "--outages" => b.outages = num()?,
            "--restores" => b.restores = num()?,
            "--lock-timeouts" => b.lock_timeouts = num()?,
            "--void-commits" => b.void_commits = num()?,
            "--killers" => config.killers = num()? as usize,
            "--recurring" => config.recurring = num()? as usize,
            "--max-attempts" => config.max_attempts = num()?.max(1),
            "--broker-limit" => config.broker_limit = num()?,
            "--delivery-count" => {
                config.counts_runs = match value.as_str() {
                    "runs" => true,
                    "deliveries" => false,
                    other => {
                        return Err(format!(
                            "--delivery-count: runs or deliveries, not {other:?}"
                        ))
                    }
                };
            }
            "--max-faults" => b.total = num()?,
            "--max-depth" => config.max_depth = num()? as usize,
            "--time-limit" => config.time_limit = Duration::from_secs(u64::from(num()?)),
            "--mode" => {
                flags.pop();
                modes = match value.as_str() {
                    "process" => vec![Mode::Process],
                    "consumer" => vec![Mode::Consumer],
                    "both" => vec![Mode::Process, Mode::Consumer],
                    other => {
                        return Err(format!("--mode: process, consumer or both, not {other:?}"))
                    }
                };
            }
            "--mutant" => {
                flags.pop();
                mutant = Some(Mutant::by_name(&value).ok_or(format!("no mutant {value:?}"))?);
            }
            "--replay" => {
                replay = Some(value.clone());
                continue;
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(Args {
        config,
        modes,
        mutant,
        replay,
        skip_mutants,
        flags,
    })
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => return usage(&e),
    };
    let started = Instant::now();

    if let Some(seq) = &args.replay {
        let base = Config {
            mode: args.modes[0],
            ..args.config.clone()
        };
        let config = args.mutant.map_or(base.clone(), |m| m.config(&base));
        return match replay(&config, seq) {
            Err(e) => usage(&e),
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
