//! One function per subcommand. Each loads what it needs from the library, runs it, and
//! hands what it prints to [`crate::output`].

use std::sync::Arc;

use anyhow::Context;
use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    dead_letters,
    event::{ServerDead, ServerId},
    http,
    keys::Keys,
    metrics::Metrics,
    receiver::{self, Receiver},
    reconcile::Reconciler,
    retry::retrying,
    status, stream,
    worker::Worker,
};
use tokio_util::sync::CancellationToken;

use crate::{
    cli::{BenchOptions, DeadLettersAction, DemoOptions, EmitEvent, HeldAction, ProbeOptions},
    output,
};

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
        Err(registry_janitor::Error::Cancelled) => return Ok(()),
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

/// `reconcile [--once]`: the reconciler, until `shutdown` or for one pass.
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
        Err(registry_janitor::Error::Cancelled) if !once => return Ok(()),
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
/// [`receiver::REDIS_DEADLINE`]). The token and TLS files are read, and
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
        Err(registry_janitor::Error::Cancelled) => return Ok(()),
        other => other?,
    };
    let receiver = Receiver::new(settings, conn.clone(), metrics.clone())?;
    let _redis_up =
        registry_janitor::health::spawn_redis_watch(conn, metrics.redis_up.clone(), &shutdown);
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

/// `emit server-dead`: publishes one event and prints its entry id.
pub async fn emit(settings: &Settings, event: EmitEvent) -> anyhow::Result<()> {
    let EmitEvent::ServerDead {
        server_id,
        reason,
        source,
    } = event;
    let server = ServerId::parse(&server_id).context("SERVER_ID")?;
    let event = ServerDead::new(&server, reason, Some(source));
    event.validate().context("the event")?;
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    let id = stream::publish_event(&conn, &keys, &event.encode())
        .await
        .with_context(|| format!("publishing to {}", conn::redact_url(&settings.redis_url)))?;
    output::emitted(&id);
    Ok(())
}

/// `status [--json]`.
pub async fn status(settings: &Settings, json: bool) -> anyhow::Result<()> {
    let report = status::collect(settings).await?;
    output::status(&report, json)
}

/// `dead-letters list|replay|purge`.
pub async fn dead_letters(settings: &Settings, action: DeadLettersAction) -> anyhow::Result<()> {
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    match action {
        DeadLettersAction::List { count, json } => {
            let letters = dead_letters::list(&conn, &keys, count).await?;
            output::dead_letters(&letters, json)?;
        }
        DeadLettersAction::Replay { ids, all } => {
            anyhow::ensure!(
                all || !ids.is_empty(),
                "name the dead-letter ids to replay, or --all"
            );
            output::replayed(&dead_letters::replay(&conn, &keys, &ids).await?);
        }
        DeadLettersAction::Purge { ids, all, yes } => purge(&conn, &keys, ids, all, yes).await?,
    }
    Ok(())
}

/// `held list|release|discard`: the guard's held verdicts.
pub async fn held(settings: &Settings, action: HeldAction) -> anyhow::Result<()> {
    use registry_janitor::guard::hold;
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    let holds = hold::list(&conn, &keys).await?;
    let chosen = |servers: &[String], all: bool| -> anyhow::Result<Vec<_>> {
        anyhow::ensure!(
            all || !servers.is_empty(),
            "name the servers whose held verdict to act on, or --all"
        );
        for s in servers {
            anyhow::ensure!(
                holds.iter().any(|h| &h.server_id == s),
                "no verdict is held for server {s}"
            );
        }
        Ok(holds
            .iter()
            .filter(|h| all || servers.contains(&h.server_id))
            .cloned()
            .collect())
    };
    match action {
        HeldAction::List { json } => output::holds(&holds, json)?,
        HeldAction::Release { servers, all } => {
            for h in chosen(&servers, all)? {
                if hold::release(&conn, &keys, &h, settings.claim_min_idle_ms).await? {
                    println!("{}: released; a worker fences and cleans it", h.server_id);
                } else {
                    println!(
                        "{}: its hold had ended meanwhile; nothing done",
                        h.server_id
                    );
                }
            }
        }
        HeldAction::Discard { servers, all } => {
            for h in chosen(&servers, all)? {
                let why = format!(
                    "discarded from the guard's hold by an operator (it was held as {}: {})",
                    h.doubt.as_str(),
                    h.detail
                );
                if hold::discard(&conn, &keys, &h, &why).await? {
                    println!(
                        "{}: discarded; its event is in the dead-letter stream",
                        h.server_id
                    );
                } else {
                    println!(
                        "{}: its hold had ended meanwhile; nothing done",
                        h.server_id
                    );
                }
            }
        }
    }
    Ok(())
}

async fn purge(
    conn: &RedisConn,
    keys: &Keys,
    ids: Vec<String>,
    all: bool,
    yes: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        all || !ids.is_empty(),
        "name the dead-letter ids to purge, or --all"
    );
    anyhow::ensure!(
        yes,
        "purging deletes dead letters for good: add --yes to confirm"
    );
    output::purged(dead_letters::purge(conn, keys, &ids).await?);
    Ok(())
}

/// `demo`: the whole story on one machine, verified.
#[cfg(feature = "testkit")]
pub async fn demo(settings: &Settings, options: &DemoOptions) -> anyhow::Result<()> {
    let summary = crate::demo::run(settings, options).await?;
    if !summary.verified() {
        anyhow::bail!(
            "verification failed: {} stale entries left, {} live entries lost",
            summary.stale,
            summary.lost
        );
    }
    Ok(())
}

/// `bench`: the benchmark; fails if the janitor run left stale entries or lost live ones.
#[cfg(feature = "testkit")]
pub async fn bench(settings: &Settings, options: &BenchOptions) -> anyhow::Result<()> {
    if options.zone.is_some() {
        let exe = crate::bench::current_exe()?;
        let report = crate::bench::zone::run(settings, options, &exe).await?;
        if options.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{report}");
        }
        if let Some(failures) = report.failures() {
            anyhow::bail!("the zone benchmark's verification failed: {failures}");
        }
        return Ok(());
    }
    let report = crate::bench::run(settings, options, &crate::bench::current_exe()?).await?;
    if options.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    let janitor = report.runs.iter().find(|r| r.name == "janitor");
    if janitor.is_some_and(|j| j.stale_left > 0 || j.live_lost > 0) {
        anyhow::bail!("the janitor run left stale entries or lost live ones");
    }
    if let Some(w) = report
        .stale_window
        .as_ref()
        .filter(|w| w.route.dead_after_verdict > 0)
    {
        anyhow::bail!(
            "route returned the dead server after its fence was recorded ({} of {} lookups)",
            w.route.dead_after_verdict,
            w.route.lookups_after_verdict
        );
    }
    if let Some(c) = report
        .route_cost
        .as_ref()
        .filter(|c| c.route.wrong + c.plain.wrong > 0)
    {
        anyhow::bail!(
            "a route-cost lookup did not return the live owner (route {}, plain {})",
            c.route.wrong,
            c.plain.wrong
        );
    }
    Ok(())
}

/// `bench-probe`: the lookup probe of `bench --zone` (internal).
#[cfg(feature = "testkit")]
pub async fn bench_probe(settings: &Settings, options: &ProbeOptions) -> anyhow::Result<()> {
    Ok(crate::bench::zone::probe(settings, options).await?)
}

/// `bench-probe` in a build without the test harness.
#[cfg(not(feature = "testkit"))]
pub async fn bench_probe(_: &Settings, _: &ProbeOptions) -> anyhow::Result<()> {
    Err(without_testkit("bench-probe"))
}

/// `demo` in a build without the test harness (the service image).
#[cfg(not(feature = "testkit"))]
pub async fn demo(_: &Settings, _: &DemoOptions) -> anyhow::Result<()> {
    Err(without_testkit("demo"))
}

/// `bench` in a build without the test harness (the service image).
#[cfg(not(feature = "testkit"))]
pub async fn bench(_: &Settings, _: &BenchOptions) -> anyhow::Result<()> {
    Err(without_testkit("bench"))
}

#[cfg(not(feature = "testkit"))]
fn without_testkit(command: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "`{command}` is not in this build: it was built without the `testkit` feature \
         (the service image is); run it from a default build, e.g. `cargo run --release -- {command}`"
    )
}

/// Starts the /metrics, /healthz, /readyz listener unless `metrics_addr` is `off`. A port
/// already in use is reported but does not stop the worker: cleaning matters more than
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
