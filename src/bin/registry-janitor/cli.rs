//! The command line: every flag and subcommand (clap derive lives here and only here).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use registry_janitor::config::Overrides;

#[derive(Parser)]
#[command(
    name = "registry-janitor",
    version,
    about = "Cleans a Redis connection registry after connection servers die"
)]
pub struct Cli {
    /// TOML settings file (also JANITOR_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Setting `redis_url`.
    #[arg(long, global = true)]
    redis_url: Option<String>,
    /// Setting `key_prefix`.
    #[arg(long, global = true)]
    key_prefix: Option<String>,
    /// Setting `layout`: hash or keys.
    #[arg(long, global = true)]
    layout: Option<String>,
    /// Setting `chunk_size`.
    #[arg(long, global = true)]
    chunk_size: Option<usize>,
    /// Setting `concurrency`.
    #[arg(long, global = true)]
    concurrency: Option<usize>,
    /// Setting `consumer_name`.
    #[arg(long, global = true)]
    consumer_name: Option<String>,
    /// Setting `metrics_addr` (host:port or off).
    #[arg(long, global = true)]
    metrics_addr: Option<String>,
    /// Setting `log_format`: text or json.
    #[arg(long, global = true)]
    log_format: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The settings given as flags, which override the file and the environment.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            redis_url: self.redis_url.clone(),
            key_prefix: self.key_prefix.clone(),
            layout: self.layout.clone(),
            chunk_size: self.chunk_size,
            concurrency: self.concurrency,
            consumer_name: self.consumer_name.clone(),
            metrics_addr: self.metrics_addr.clone(),
            log_format: self.log_format.clone(),
        }
    }
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
    /// The whole story on one machine: seed, kill servers, clean, verify.
    Demo(DemoOptions),
    /// The throughput and latency benchmark, with references measured in the same run.
    Bench(BenchOptions),
    /// The lookup probe of `bench --zone`, in a process of its own (internal).
    #[command(hide = true)]
    BenchProbe(ProbeOptions),
}

// Parsed in every build; run only in one with the `testkit` feature.
/// What the lookup probe of `bench --zone` looks up.
#[derive(Debug, Clone, clap::Args)]
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
pub struct ProbeOptions {
    /// Live users `live0` .. `live<N-1>` under `key_prefix`, looked up in turn.
    #[arg(long, default_value_t = 10_000)]
    pub users: usize,
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

// Parsed in every build; run only in one with the `testkit` feature.
/// Demo size and shape.
#[derive(Debug, Clone, clap::Args)]
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
pub struct DemoOptions {
    /// Connection servers to seed.
    #[arg(long, default_value_t = 10)]
    pub servers: usize,
    /// Users per server.
    #[arg(long, default_value_t = 100_000)]
    pub users: usize,
    /// Servers that die.
    #[arg(long, default_value_t = 3)]
    pub dead: usize,
    /// Workers run in this process, each its own consumer in the group.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Percent of a dead server's users that reconnect elsewhere: half before the event,
    /// half while the cleanup runs.
    #[arg(long, default_value_t = 1.0)]
    pub moved_percent: f64,
    /// Run on a private local Redis Cluster of 3 masters (all on this machine) instead.
    #[arg(long)]
    pub local_cluster: bool,
}

// Parsed in every build; run only in one with the `testkit` feature.
/// Benchmark size and shape.
#[derive(Debug, Clone, clap::Args)]
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
pub struct BenchOptions {
    /// Users on the dead server.
    #[arg(long, default_value_t = 1_000_000)]
    pub users: usize,
    /// Percent of them reconnected to a live server before the cleanup (must survive).
    #[arg(long, default_value_t = 1.0)]
    pub moved_percent: f64,
    /// Users of the naive per-user loop (it is slow: a sample is enough for its rate).
    #[arg(long, default_value_t = 20_000)]
    pub naive_sample: usize,
    /// Users of the second janitor run, for the memory-growth ratio (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    pub baseline_users: usize,
    /// Times each of janitor, unconditional and careful is run (interleaved); the report
    /// gives the median run of each, so one noisy run cannot decide a ratio.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Lookups of each kind in the route-cost runs (`route` against a plain HGET/GET,
    /// interleaved `repeat` times); 0 skips them.
    #[arg(long, default_value_t = 100_000)]
    pub route_lookups: usize,
    /// No stale-window probes during the janitor runs (the dead server is then not made
    /// to look alive, as before fencing was measured).
    #[arg(long)]
    pub no_stale_window: bool,
    /// Run on a private local Redis Cluster of 3 masters (all on this machine) instead.
    #[arg(long)]
    pub local_cluster: bool,
    /// A zone outage instead: this many servers die at once, their events are published
    /// together, `--workers` worker processes clean them while a probe process looks up
    /// live users every millisecond; then one server of the same total size, one worker.
    /// Always on a private redis-server.
    #[arg(long, value_name = "D")]
    pub zone: Option<usize>,
    /// Users of each server of the zone.
    #[arg(long, default_value_t = 10_000)]
    pub zone_users: usize,
    /// Worker processes of the zone run.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Start the zone's workers from this binary (an older build, for a before/after).
    #[arg(long, value_name = "FILE")]
    pub worker_exe: Option<PathBuf>,
    /// Zone: run once per `latency_target_ms` of this list (e.g. 0,1,2,5); default: the
    /// setting.
    #[arg(long, value_delimiter = ',')]
    pub latency_targets: Vec<u64>,
    /// Zone: run once per `step_order` of this list (smallest_first,round_robin); default:
    /// the setting.
    #[arg(long, value_delimiter = ',')]
    pub step_orders: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}
