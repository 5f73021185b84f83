//! The `registry-janitor` binary: parses the command line, loads the settings, sets up
//! logging and signals, and calls into the library.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::{Parser, Subcommand};
use registry_janitor::{
    bench,
    config::{LogFormat, Overrides, Settings},
    conn, dead_letters, demo,
    event::{ServerDead, ServerId},
    http,
    keys::Keys,
    metrics::Metrics,
    reconcile::Reconciler,
    retry::retrying,
    status, stream,
    worker::Worker,
};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "registry-janitor",
    version,
    about = "Cleans a Redis connection registry after connection servers die"
)]
struct Cli {
    /// TOML settings file (also JANITOR_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
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
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Join the consumer group and clean dead servers until SIGTERM or SIGINT.
    Worker,
    /// The reconciliation worker: heartbeat checks, expiry hints, drift repair.
    Reconcile {
        /// Run one pass and exit.
        #[arg(long)]
        once: bool,
    },
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
    /// The whole story on one machine: seed, kill servers, clean, verify.
    Demo(demo::Options),
    /// The throughput and latency benchmark, with references measured in the same run.
    Bench(bench::Options),
}

#[derive(Subcommand)]
enum DeadLettersAction {
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
enum EmitEvent {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let overrides = Overrides {
        redis_url: cli.redis_url.clone(),
        key_prefix: cli.key_prefix.clone(),
        layout: cli.layout.clone(),
        chunk_size: cli.chunk_size,
        concurrency: cli.concurrency,
        consumer_name: cli.consumer_name.clone(),
        metrics_addr: cli.metrics_addr.clone(),
        log_format: cli.log_format.clone(),
    };
    let settings = match Settings::load(cli.config.as_deref(), &overrides) {
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

fn init_logging(settings: &Settings, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match settings.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn run(command: Command, settings: Settings) -> anyhow::Result<()> {
    match command {
        Command::Worker => {
            let shutdown = shutdown_on_signals();
            let metrics = Metrics::new();
            // On a cluster, `new` connects (to learn the slot map): a cluster that refuses
            // or is down at start-up is waited out like any transient state.
            let worker = match retrying("connecting to redis", &shutdown, || {
                Worker::new(&settings, metrics.clone())
            })
            .await
            {
                Err(registry_janitor::Error::Cancelled) => return Ok(()),
                other => other?,
            };
            serve_metrics(
                &settings,
                metrics,
                worker.health(),
                worker.readiness(),
                &shutdown,
            )
            .await;
            worker.run(shutdown).await?;
        }
        Command::Emit {
            event:
                EmitEvent::ServerDead {
                    server_id,
                    reason,
                    source,
                },
        } => {
            let server = ServerId::parse(&server_id).context("SERVER_ID")?;
            let event = ServerDead::new(&server, reason, Some(source));
            event.validate().context("the event")?;
            let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
            let keys = Keys::new(settings.key_prefix.clone());
            let id = stream::publish_event(&conn, &keys, &event.encode())
                .await
                .with_context(|| {
                    format!("publishing to {}", conn::redact_url(&settings.redis_url))
                })?;
            println!("{id}");
        }
        Command::Status { json } => {
            let report = status::collect(&settings).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Demo(options) => {
            let summary = demo::run(&settings, &options).await?;
            if !summary.verified() {
                anyhow::bail!(
                    "verification failed: {} stale entries left, {} live entries lost",
                    summary.stale,
                    summary.lost
                );
            }
        }
        Command::Reconcile { once } => {
            let metrics = Metrics::new();
            let shutdown = shutdown_on_signals();
            let reconciler = match retrying("connecting to redis", &shutdown, || {
                Reconciler::new(&settings, metrics.clone())
            })
            .await
            {
                Err(registry_janitor::Error::Cancelled) if !once => return Ok(()),
                other => other?,
            };
            if once {
                let report = reconciler.run_once_until(&shutdown).await?;
                println!("{report}");
            } else {
                serve_metrics(
                    &settings,
                    metrics,
                    reconciler.health(),
                    reconciler.readiness(),
                    &shutdown,
                )
                .await;
                reconciler.run(shutdown).await?;
            }
        }
        Command::DeadLetters { action } => {
            let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
            let keys = Keys::new(settings.key_prefix.clone());
            dead_letters_command(action, &conn, &keys).await?;
        }
        Command::Bench(options) => {
            let report = bench::run(&settings, &options, &bench::current_exe()?).await?;
            if options.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
            let janitor = report.runs.iter().find(|r| r.name == "janitor");
            if janitor.is_some_and(|j| j.stale_left > 0 || j.live_lost > 0) {
                anyhow::bail!("the janitor run left stale entries or lost live ones");
            }
        }
    }
    Ok(())
}

async fn dead_letters_command(
    action: DeadLettersAction,
    conn: &conn::RedisConn,
    keys: &Keys,
) -> anyhow::Result<()> {
    match action {
        DeadLettersAction::List { count, json } => {
            let letters = dead_letters::list(conn, keys, count).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&letters)?);
                return Ok(());
            }
            for d in &letters {
                println!(
                    "{}  type={}  server_id={}  failed_at_ms={}\n    error: {}",
                    d.id,
                    d.kind.as_deref().unwrap_or("-"),
                    d.server_id.as_deref().unwrap_or("-"),
                    d.failed_at_ms.map_or("-".into(), |t| t.to_string()),
                    d.error
                );
            }
            println!("{} dead letter(s) shown", letters.len());
        }
        DeadLettersAction::Replay { ids, all } => {
            anyhow::ensure!(
                all || !ids.is_empty(),
                "name the dead-letter ids to replay, or --all"
            );
            for (old, new) in dead_letters::replay(conn, keys, &ids).await? {
                println!("{old} -> {new}");
            }
        }
        DeadLettersAction::Purge { ids, all, yes } => {
            anyhow::ensure!(
                all || !ids.is_empty(),
                "name the dead-letter ids to purge, or --all"
            );
            anyhow::ensure!(
                yes,
                "purging deletes dead letters for good: add --yes to confirm"
            );
            let n = dead_letters::purge(conn, keys, &ids).await?;
            println!("{n} dead letter(s) purged");
        }
    }
    Ok(())
}

/// Starts the /metrics, /healthz, /readyz listener unless `metrics_addr` is `off`. A port
/// already in use is reported but does not stop the worker: cleaning matters more than
/// being scraped, and the failing readiness probe makes it visible in Kubernetes.
async fn serve_metrics(
    settings: &Settings,
    metrics: Metrics,
    health: std::sync::Arc<http::Health>,
    ready: http::Readiness,
    shutdown: &CancellationToken,
) {
    let Ok(Some(addr)) = settings.metrics_listen_addr() else {
        return;
    };
    match http::bind(addr).await {
        Ok(listener) => {
            tokio::spawn(http::serve(
                listener,
                metrics,
                health,
                ready,
                shutdown.clone(),
            ));
        }
        Err(e) => {
            tracing::error!(%addr, error = %e, "cannot serve metrics_addr; running without /metrics, /healthz and /readyz")
        }
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
