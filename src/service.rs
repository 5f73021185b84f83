//! Running the service: the settings flags, logging, signals, and the long-running
//! commands (`worker`, `reconcile`, `alert-receiver`), each with its /metrics, /healthz
//! and /readyz listener.
//!
//! The `registry-janitor` binary calls these; so does `registry-janitor-lab`, whose
//! benchmark workers run the very same worker code.

use std::{path::PathBuf, sync::Arc};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{LogFormat, Overrides, Settings},
    conn, health, http,
    metrics::Metrics,
    receiver::{self, Receiver},
    reconcile::Reconciler,
    retry::retrying,
    worker::Worker,
    Error,
};

/// The settings given as flags, which override the file and the environment; global to
/// every subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct SettingsFlags {
    /// TOML settings file (also JANITOR_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Setting `redis_url`.
    #[arg(long, global = true)]
    redis_url: Option<String>,
    /// Setting `key_prefix`.
    #[arg(long, global = true)]
    key_prefix: Option<String>,
    /// Setting `layout`: hash, keys or conns.
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
}

impl SettingsFlags {
    /// The settings: defaults, then the file, then `JANITOR_*`, then these flags.
    pub fn load(&self) -> crate::Result<Settings> {
        Settings::load(self.config.as_deref(), &self.overrides())
    }

    fn overrides(&self) -> Overrides {
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

/// Logs to stderr, at `default_level` unless `RUST_LOG` says otherwise, as text or JSON
/// (setting `log_format`).
pub fn init_logging(settings: &Settings, default_level: &str) {
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

/// A token cancelled on the first SIGTERM (Kubernetes) or SIGINT (Ctrl-C). Needs a tokio
/// runtime.
pub fn shutdown_on_signals() -> CancellationToken {
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

/// `worker`: joins the group and cleans dead servers until `shutdown`.
pub async fn worker(settings: &Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    // On a cluster, `new` connects (to learn the slot map): a cluster that refuses
    // or is down at start-up is waited out like any transient state.
    let worker = match retrying("connecting to redis", &shutdown, || {
        Worker::new(settings, metrics.clone())
    })
    .await
    {
        Err(Error::Cancelled) => return Ok(()),
        other => other?,
    };
    serve_metrics(
        settings,
        metrics,
        worker.health(),
        worker.readiness(),
        &shutdown,
    )
    .await;
    worker.run(shutdown).await?;
    Ok(())
}

/// `reconcile [--once]`: the reconciler, until `shutdown` or for one pass (whose report
/// it prints).
pub async fn reconcile(
    settings: &Settings,
    once: bool,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let reconciler = match retrying("connecting to redis", &shutdown, || {
        Reconciler::new(settings, metrics.clone())
    })
    .await
    {
        Err(Error::Cancelled) if !once => return Ok(()),
        other => other?,
    };
    if once {
        let report = reconciler.run_once_until(&shutdown).await?;
        println!("{report}");
    } else {
        serve_metrics(
            settings,
            metrics,
            reconciler.health(),
            reconciler.readiness(),
            &shutdown,
        )
        .await;
        reconciler.run(shutdown).await?;
    }
    Ok(())
}

/// `alert-receiver`: serves Alertmanager's webhook until `shutdown`, then drains the
/// requests in flight (at most `drain_timeout_ms`; each waits for Redis at most
/// `receiver::REDIS_DEADLINE`). The token and TLS files are read, and
/// the listener bound, before anything else: a wrong setting stops start-up at once.
pub async fn alert_receiver(
    settings: &Settings,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    receiver::read_token(settings)?;
    let tls = receiver::tls_acceptor(settings)?;
    let addr: std::net::SocketAddr = settings
        .alert_receiver_addr
        .parse()
        .context("alert_receiver_addr")?;
    let listener = http::bind(addr)
        .await
        .with_context(|| format!("cannot listen on alert_receiver_addr {addr}"))?;
    let metrics = Metrics::new();
    let conn = match retrying("connecting to redis", &shutdown, || async {
        conn::shared_for(&conn::target_for(settings)?).await
    })
    .await
    {
        Err(Error::Cancelled) => return Ok(()),
        other => other?,
    };
    let receiver = Receiver::new(settings, conn.clone(), metrics.clone())?;
    let _redis_up = health::spawn_redis_watch(conn, metrics.redis_up.clone(), &shutdown);
    serve_metrics(
        settings,
        metrics,
        receiver.health(),
        receiver.readiness(),
        &shutdown,
    )
    .await;
    let drain = std::time::Duration::from_millis(settings.drain_timeout_ms);
    receiver.serve(listener, tls, shutdown, drain).await;
    Ok(())
}

/// Starts the /metrics, /healthz, /readyz listener unless `metrics_addr` is `off`. A port
/// already in use is reported but does not stop the process: cleaning matters more than
/// being scraped, and the failing readiness probe makes it visible in Kubernetes.
async fn serve_metrics(
    settings: &Settings,
    metrics: Metrics,
    health: Arc<http::Health>,
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
