//! The `registry-janitor` binary: parses the command line, loads the settings, sets up
//! logging and signals, and calls one function per command. The service itself is the
//! library, `registry_janitor`; its long-running commands are
//! [`registry_janitor::service`].
//!
//! - [`cli`]: the flags and subcommands.
//! - [`commands`]: the commands that ask or tell the service something (`emit`, `status`,
//!   `dead-letters`, `held`, `format`).
//! - [`output`]: what `status`, `dead-letters`, `held`, `format` and `emit` print (text
//!   or JSON).

mod cli;
mod commands;
mod output;

use std::process::ExitCode;

use clap::Parser;
use cli::{Cli, Command};
use registry_janitor::{config::Settings, service};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match cli.settings.load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("registry-janitor: {e}");
            return ExitCode::from(2);
        }
    };
    service::init_logging(&settings, "info");
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
        Command::Worker => service::worker(&settings, service::shutdown_on_signals()).await,
        Command::Reconcile { once } => {
            service::reconcile(&settings, once, service::shutdown_on_signals()).await
        }
        Command::AlertReceiver => {
            service::alert_receiver(&settings, service::shutdown_on_signals()).await
        }
        Command::Emit { event } => commands::emit(&settings, event).await,
        Command::Status { json } => commands::status(&settings, json).await,
        Command::DeadLetters { action } => commands::dead_letters(&settings, action).await,
        Command::Held { action } => commands::held(&settings, action).await,
        Command::Format { action } => commands::format(&settings, action).await,
    }
}
