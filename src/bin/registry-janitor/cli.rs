//! The command line: the subcommands and their flags. The settings flags, global to every
//! subcommand and shared with `registry-janitor-lab`, are
//! [`registry_janitor::service::SettingsFlags`].

use clap::{Parser, Subcommand};
use registry_janitor::service::SettingsFlags;

#[derive(Parser)]
#[command(
    name = "registry-janitor",
    version,
    about = "Cleans a Redis connection registry after connection servers die"
)]
pub struct Cli {
    #[command(flatten)]
    pub settings: SettingsFlags,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Join the consumer group and clean dead servers until SIGTERM or SIGINT.
    Worker,
    /// The reconciliation worker: heartbeat checks, expiry hints, drift repair.
    Reconcile {
        /// Run one pass and exit.
        #[arg(long)]
        once: bool,
    },
    /// Take Alertmanager's webhook on POST /alerts (alert_receiver_addr) and publish one
    /// server.dead per firing alert, once per alert, until SIGTERM or SIGINT.
    AlertReceiver,
    /// Publish one event, as monitoring does; prints the entry id.
    Emit {
        #[command(subcommand)]
        event: EmitEvent,
    },
    /// Stream length, group lag, pending entries, consumers, dead letters.
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Inspect, replay and purge the dead-letter stream.
    DeadLetters {
        #[command(subcommand)]
        action: DeadLettersAction,
    },
    /// Verdicts the guard holds: list them, release them (they proceed: fence and
    /// clean), or discard them (to the dead-letter stream, nothing done).
    Held {
        #[command(subcommand)]
        action: HeldAction,
    },
    /// The data format: the format in use and the workers' announcements, or set the
    /// format in use back for a rollback.
    Format {
        #[command(subcommand)]
        action: FormatAction,
    },
}

#[derive(Subcommand)]
pub enum FormatAction {
    /// The format in use, this build's, and each worker's (live or gone).
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Set the format in use (a rollback). Refused while a live worker cannot work under
    /// it, or while live workers of a newer format would move it forward again at once
    /// (none of format N is announced).
    Set {
        /// The format to put in use.
        format: u32,
        /// Set it whatever the live workers.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
pub enum DeadLettersAction {
    /// List dead letters with the reason each failed, oldest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        count: usize,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Publish dead letters again on the events stream (after a fix), and remove them.
    Replay {
        /// Dead-letter ids to replay.
        ids: Vec<String>,
        /// Replay every dead letter.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
    },
    /// Delete dead letters for good.
    Purge {
        /// Dead-letter ids to delete.
        ids: Vec<String>,
        /// Delete every dead letter.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Confirms the deletion; nothing is deleted without it.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Subcommand)]
pub enum HeldAction {
    /// The held verdicts, oldest first: server, why it is doubtful, since when.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Let held verdicts proceed: their servers are fenced and cleaned by the workers.
    Release {
        /// Server ids whose held verdict is released.
        servers: Vec<String>,
        /// Release every held verdict.
        #[arg(long, conflicts_with = "servers")]
        all: bool,
    },
    /// Drop held verdicts: nothing is fenced or cleaned; each goes to the dead-letter
    /// stream with the reason (replayable with `dead-letters replay`).
    Discard {
        /// Server ids whose held verdict is discarded.
        servers: Vec<String>,
        /// Discard every held verdict.
        #[arg(long, conflicts_with = "servers")]
        all: bool,
    },
}

#[derive(Subcommand)]
pub enum EmitEvent {
    /// Publish `server.dead` for SERVER_ID.
    ServerDead {
        server_id: String,
        /// Free text, e.g. "heartbeat timeout".
        #[arg(long)]
        reason: Option<String>,
        /// Who emits it (default: cli).
        #[arg(long, default_value = "cli")]
        source: String,
    },
}
