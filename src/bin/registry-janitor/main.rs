//! The `registry-janitor` binary: parses the command line, loads the settings, sets up
//! logging and signals, and calls one function per command ([`commands`]). The service
//! itself is the library, `registry_janitor`.
//!
//! - [`cli`]: the flags and subcommands.
//! - [`commands`]: one function per subcommand.
//! - [`output`]: what `status`, `dead-letters` and `emit` print (text or JSON).
//! - `demo`, `bench` (with the `testkit` feature): the end-to-end demonstration and the
//!   benchmark, each on a private redis-server when no Redis answers.

mod cli;
mod commands;
mod output;

#[cfg(feature = "testkit")]
mod bench;
#[cfg(feature = "testkit")]
mod demo;

use std::process::ExitCode;

use clap::Parser;
use cli::{Cli, Command};
use registry_janitor::config::{LogFormat, Settings};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref(), &cli.overrides()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("registry-janitor: {e}");
            return ExitCode::from(2);
        }
    };
    // The demo draws progress bars: its workers log warnings only, unless RUST_LOG says.
    let default_level = if matches!(cli.command, Command::Demo(_)) {
        "warn"
    } else {
        "info"
    };
    init_logging(&settings, default_level);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(run(cli.command, settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("registry-janitor: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, settings: Settings) -> anyhow::Result<()> {
    match command {
        Command::Worker => commands::worker(&settings, shutdown_on_signals()).await,
        Command::Reconcile { once } => {
            commands::reconcile(&settings, once, shutdown_on_signals()).await
        }
        Command::AlertReceiver => commands::alert_receiver(&settings, shutdown_on_signals()).await,
        Command::Emit { event } => commands::emit(&settings, event).await,
        Command::Status { json } => commands::status(&settings, json).await,
        Command::DeadLetters { action } => commands::dead_letters(&settings, action).await,
        Command::Held { action } => commands::held(&settings, action).await,
        Command::Demo(options) => commands::demo(&settings, &options).await,
        Command::Bench(options) => commands::bench(&settings, &options).await,
        Command::BenchProbe(options) => commands::bench_probe(&settings, &options).await,
    }
}

fn init_logging(settings: &Settings, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colours only on a terminal: a file or a pipe (Kubernetes' log collector) gets text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match settings.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// A token cancelled on the first SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        let which = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{which} received; stopping");
        cancel.cancel();
    });
    token
}
