//! The runs: `janitor` (a real worker process), and the references `unconditional` (the
//! ceiling, wrong on purpose), `careful` (one script per chunk) and `naive` (one round
//! trip per command), each measured the same way ([`measure`]).

use std::{
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use futures_util::stream::{FuturesUnordered, StreamExt};
use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    error::{Error, Result},
    event::ServerDead,
    status, stream,
};
use tokio::process::Child;
use tokio_util::sync::CancellationToken;

use super::{
    probe::{peak_rss, probe_lookups, redis_cpu},
    route::StaleProbes,
    scene::{scene, Scene},
    Bench, Run,
};

/// Measures `work` on a seeded scene: wall time, Redis CPU, lookup latencies, then
/// verifies the registry.
pub(super) async fn measure<F, Fut>(
    settings: &Settings,
    conn: &RedisConn,
    scene: &Scene,
    name: &str,
    work: F,
) -> Result<Run>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<Option<u64>>>,
{
    let stop = CancellationToken::new();
    let targets: Vec<Vec<u8>> = (0..scene.live_users).map(|n| scene.live_user(n)).collect();
    let prober = tokio::spawn(probe_lookups(
        conn::target_for(settings)?,
        scene.keys.clone(),
        settings.layout,
        targets,
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let cpu_before = redis_cpu(settings, conn).await?;
    let started = Instant::now();
    let peak_rss = work().await?;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = redis_cpu(settings, conn).await? - cpu_before;
    stop.cancel();
    let mut latencies: Vec<u64> = prober.await??.into_iter().map(|(_, us)| us).collect();
    latencies.sort_unstable();
    let pct = |p: f64| super::probe::percentile(&latencies, p);
    let (stale_left, live_lost) = scene.verify(conn).await?;
    Ok(Run {
        name: name.into(),
        users: scene.users,
        seconds,
        users_per_second: scene.users as f64 / seconds,
        redis_cpu_seconds: cpu,
        redis_cpu_us_per_user: cpu * 1e6 / scene.users as f64,
        lookups: latencies.len(),
        lookup_p50_us: pct(0.50),
        lookup_p99_us: pct(0.99),
        lookup_max_us: latencies.last().copied().unwrap_or(0),
        worker_peak_rss_bytes: peak_rss,
        stale_left,
        live_lost,
        stale_window: None,
    })
}

/// The real worker path: a worker child process (`worker_exe worker`), one `server.dead`
/// event in, its acknowledgement out. With `stale`, the dead server looks alive and the
/// stale-window probes run from before the event to its acknowledgement (see
/// [`StaleProbes`]).
pub(super) async fn janitor_run(
    b: &Bench<'_>,
    name: &str,
    users: usize,
    stale: bool,
) -> Result<Run> {
    let Bench { settings, conn, .. } = *b;
    let scene = scene(settings, b.root, name, users, b.options);
    scene.seed(conn).await?;
    stream::ensure_group(conn, &scene.keys).await?;
    let mut child = spawn_worker(settings, &scene, b.worker_exe)?;
    let pid = child.id().unwrap_or(0);
    // Start timing only once the worker is reading.
    let deadline = Instant::now() + Duration::from_secs(30);
    while status::collect_from(conn, &scene.keys)
        .await?
        .consumers
        .is_empty()
    {
        if Instant::now() > deadline {
            return Err(Error::io(
                "waiting for the bench worker",
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "it did not join the group within 30 s",
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let probes = match stale {
        true => Some(StaleProbes::start(b, &scene).await?),
        false => None,
    };
    let run = measure(settings, conn, &scene, name, || async {
        let event = ServerDead::new(&scene.dead, Some("bench".into()), Some("bench".into()));
        stream::publish_event(conn, &scene.keys, &event.encode()).await?;
        // Cheap polls, so the bench itself costs Redis next to nothing: the last step
        // unlinks what is left of the reverse set and acknowledges in the same script.
        let left = scene.keys.server_members_left(&scene.dead);
        loop {
            let exists: bool = redis::cmd("EXISTS")
                .arg(&left)
                .query_async(&mut conn.clone())
                .await?;
            if !exists {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        while !status::collect_from(conn, &scene.keys).await?.is_idle() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if let Some(probes) = &probes {
            probes.stop();
        }
        Ok(peak_rss(pid))
    })
    .await;
    let run = match probes {
        Some(probes) => {
            let window = probes.finish().await;
            run.and_then(|mut run| {
                run.stale_window = Some(window?);
                Ok(run)
            })
        }
        None => run,
    };
    let _ = child.start_kill();
    let _ = child.wait().await;
    conn::delete_prefixed(settings, conn, scene.keys.prefix()).await?;
    run
}

/// A worker process on the scene's keys, configured by `JANITOR_*`.
fn spawn_worker(settings: &Settings, scene: &Scene, worker_exe: &Path) -> Result<Child> {
    worker_command(settings, scene.keys.prefix(), worker_exe)
        .spawn()
        .map_err(|e| Error::io(format!("starting {}", worker_exe.display()), e))
}

/// The command of a worker (`worker_exe worker`) on the keys under `prefix`,
/// configured by `JANITOR_*` from `settings` (no metrics, short reads, warnings only),
/// killed when dropped. The zone benchmark adds its own settings.
pub(super) fn worker_command(
    settings: &Settings,
    prefix: &str,
    worker_exe: &Path,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(worker_exe);
    cmd.arg("worker")
        .env("JANITOR_REDIS_URL", &settings.redis_url)
        .env("JANITOR_KEY_PREFIX", prefix)
        .env("JANITOR_LAYOUT", settings.layout.as_str())
        .env("JANITOR_REDIS_CLUSTER", settings.redis_cluster.to_string())
        .env(
            "JANITOR_REDIS_CLUSTER_SEEDS",
            serde_json::to_string(&settings.redis_cluster_seeds).expect("strings serialize"),
        )
        .env("JANITOR_CHUNK_SIZE", settings.chunk_size.to_string())
        .env(
            "JANITOR_CHUNKS_IN_FLIGHT",
            settings.chunks_in_flight.to_string(),
        )
        .env(
            "JANITOR_LATENCY_TARGET_MS",
            settings.latency_target_ms.to_string(),
        )
        .env("JANITOR_STEP_ORDER", settings.step_order.as_str())
        .env(
            "JANITOR_CLUSTER_REPLICA_WAIT",
            settings.cluster_replica_wait.to_string(),
        )
        .env("JANITOR_METRICS_ADDR", "off")
        .env("JANITOR_BLOCK_MS", "100")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    cmd
}

#[derive(Clone, Copy)]
pub(super) enum Reference {
    Unconditional,
    Careful,
    Naive,
}

static CAREFUL_CHUNK: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("careful_chunk.lua")));

/// A reference measured in the same run: what the janitor is compared with.
pub(super) async fn reference_run(b: &Bench<'_>, which: Reference, users: usize) -> Result<Run> {
    let Bench { settings, conn, .. } = *b;
    let name = match which {
        Reference::Unconditional => "unconditional",
        Reference::Careful => "careful",
        Reference::Naive => "naive",
    };
    let scene = scene(settings, b.root, name, users, b.options);
    scene.seed(conn).await?;
    let run = measure(settings, conn, &scene, name, || async {
        match which {
            Reference::Unconditional => unconditional(conn, &scene, settings.layout).await?,
            Reference::Careful => careful(conn, &scene, settings.layout).await?,
            Reference::Naive => naive(conn, &scene, settings.layout).await?,
        }
        Ok(None)
    })
    .await;
    conn::delete_prefixed(settings, conn, scene.keys.prefix()).await?;
    run
}

async fn sscan(conn: &RedisConn, key: &str, cursor: u64) -> Result<(u64, Vec<Vec<u8>>)> {
    Ok(redis::cmd("SSCAN")
        .arg(key)
        .arg(cursor)
        .arg("COUNT")
        .arg(1000)
        .query_async(&mut conn.clone())
        .await?)
}

/// `on_field` (HGET, HDEL) on the Hash field that holds member `m`'s entry (layouts
/// `hash`, `conns`), or `on_key` (GET, DEL) on its key (layout `keys`).
pub(crate) fn forward_cmd(
    keys: &registry_janitor::keys::Keys,
    layout: Layout,
    m: &[u8],
    on_field: &str,
    on_key: &str,
) -> redis::Cmd {
    match keys.forward_of_member(layout, m) {
        Some((key, Some(field))) => redis::cmd(on_field).arg(key).arg(field).to_owned(),
        Some((key, None)) => redis::cmd(on_key).arg(key).to_owned(),
        None => redis::cmd(on_field)
            .arg(keys.user_conns(m))
            .arg("")
            .to_owned(),
    }
}

async fn unconditional(conn: &RedisConn, scene: &Scene, layout: Layout) -> Result<()> {
    let set = scene.keys.server_users(&scene.dead);
    let mut in_flight = FuturesUnordered::new();
    let mut cursor = 0;
    loop {
        let (next, members) = sscan(conn, &set, cursor).await?;
        // One delete per user: a pipeline on one node, many in flight on a cluster.
        let deletes: Vec<redis::Cmd> = members
            .iter()
            .map(|m| forward_cmd(&scene.keys, layout, m, "HDEL", "DEL"))
            .collect();
        let c = conn.clone();
        in_flight.push(async move { conn::each_in_flight::<i64>(&c, deletes).await });
        while in_flight.len() >= 4 {
            in_flight.next().await.transpose()?;
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    while let Some(r) = in_flight.next().await {
        r?;
    }
    let _: i64 = redis::cmd("UNLINK")
        .arg(&set)
        .query_async(&mut conn.clone())
        .await?;
    Ok(())
}

async fn careful(conn: &RedisConn, scene: &Scene, layout: Layout) -> Result<()> {
    let set = scene.keys.server_users(&scene.dead);
    let mut cursor = 0;
    loop {
        let (next, members) = sscan(conn, &set, cursor).await?;
        if !members.is_empty() {
            let mut call = CAREFUL_CHUNK.prepare_invoke();
            call.key(scene.keys.registry())
                .key(&set)
                .arg(scene.dead.as_str())
                .arg(layout.as_str())
                .arg(scene.keys.user_key_prefix());
            for m in &members {
                call.arg(m);
            }
            let _: i64 = call.invoke_async(&mut conn.clone()).await?;
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    Ok(())
}

async fn naive(conn: &RedisConn, scene: &Scene, layout: Layout) -> Result<()> {
    let set = scene.keys.server_users(&scene.dead);
    let mut c = conn.clone();
    let mut cursor = 0;
    loop {
        let (next, members) = sscan(conn, &set, cursor).await?;
        for m in members {
            let owner: Option<String> = forward_cmd(&scene.keys, layout, &m, "HGET", "GET")
                .query_async(&mut c)
                .await?;
            if owner.as_deref() == Some(scene.dead.as_str()) {
                let _: i64 = forward_cmd(&scene.keys, layout, &m, "HDEL", "DEL")
                    .query_async(&mut c)
                    .await?;
            }
            let _: i64 = redis::cmd("SREM")
                .arg(&set)
                .arg(&m)
                .query_async(&mut c)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
