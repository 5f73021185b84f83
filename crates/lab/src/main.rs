//! `registry-janitor-lab`: the demo, the benchmark and the nemesis of registry-janitor,
//! each on a private redis-server (or local cluster) when no Redis answers at
//! `redis_url`.
//!
//! - [`cli`]: the flags and subcommands.
//! - [`demo`](mod@demo): the whole story on one machine, verified.
//! - [`bench`](mod@bench): the benchmark (one dead server, or a zone outage with `--zone`).
//! - [`nemesis`](mod@nemesis): a randomized fault schedule with the invariants checked
//!   while it runs.
//! - [`private`]: the Redis they run on, private when none answers.
//!
//! The benchmark's and the nemesis's worker processes are this binary's hidden `worker`
//! command, which runs [`registry_janitor::service::worker`], the code of
//! `registry-janitor worker` (the nemesis's reconciler: the hidden `reconcile`, the code
//! of `registry-janitor reconcile`); with `--worker-exe` (`--janitor-exe`) they are a
//! given `registry-janitor` binary instead. The hidden `heartbeats` runs connection
//! servers that only heartbeat, for a test that pauses them ([`heartbeats`]).

mod bench;
mod cli;
mod demo;
mod heartbeats;
mod nemesis;
mod private;

use std::process::ExitCode;

use clap::Parser;
use cli::{BenchOptions, Cli, Command, DemoOptions, NemesisOptions};
use registry_janitor::{config::Settings, service};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match cli.settings.load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("registry-janitor-lab: {e}");
            return ExitCode::from(2);
        }
    };
    // The demo draws progress bars: its workers log warnings only, unless RUST_LOG says.
    // The nemesis prints its own report: its processes' logs go to files.
    let default_level = if matches!(cli.command, Command::Demo(_) | Command::Nemesis(_)) {
        "warn"
    } else {
        "info"
    };
    service::init_logging(&settings, default_level);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(run(cli.command, settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("registry-janitor-lab: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, settings: Settings) -> anyhow::Result<()> {
    match command {
        Command::Demo(options) => demo(&settings, &options).await,
        Command::Bench(options) => bench(&settings, &options).await,
        Command::BenchProbe(options) => Ok(bench::zone::probe(&settings, &options).await?),
        Command::Nemesis(options) => nemesis(&settings, &options).await,
        Command::Worker => service::worker(&settings, service::shutdown_on_signals()).await,
        Command::Reconcile => {
            service::reconcile(&settings, false, service::shutdown_on_signals()).await
        }
        Command::Heartbeats(options) => heartbeats::run(&settings, &options).await,
        Command::Busy => bench::zone::busy::spin(),
    }
}

/// `demo`: the whole story on one machine; fails unless the registry verified clean.
async fn demo(settings: &Settings, options: &DemoOptions) -> anyhow::Result<()> {
    let summary = demo::run(settings, options).await?;
    if !summary.verified() {
        anyhow::bail!(
            "verification failed: {} stale entries left, {} live entries lost",
            summary.stale,
            summary.lost
        );
    }
    Ok(())
}

/// `nemesis`: prints the report; fails on any violation.
async fn nemesis(settings: &Settings, options: &NemesisOptions) -> anyhow::Result<()> {
    let outcome = nemesis::run(settings, options).await?;
    if outcome.violations > 0 {
        anyhow::bail!(
            "the nemesis found {} violation(s) with seed {}",
            outcome.violations,
            outcome.seed
        );
    }
    Ok(())
}

/// `bench`: prints the report (text or JSON); fails if any run's verification failed.
async fn bench(settings: &Settings, options: &BenchOptions) -> anyhow::Result<()> {
    let worker_exe = bench::worker_exe(options)?;
    let failures = if options.zone.is_some() {
        let report = bench::zone::run(settings, options, &worker_exe).await?;
        print(&report, options.json)?;
        report
            .failures()
            .map(|f| format!("the zone benchmark's verification failed: {f}"))
    } else {
        let report = bench::run(settings, options, &worker_exe).await?;
        print(&report, options.json)?;
        report.failures()
    };
    match failures {
        Some(failures) => anyhow::bail!("{failures}"),
        None => Ok(()),
    }
}

/// A report as pretty JSON, or as its table.
fn print<R: serde::Serialize + std::fmt::Display>(report: &R, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
