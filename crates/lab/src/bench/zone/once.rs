//! One run of the zone benchmark: seed, start the workers and the probe, publish every
//! event at once, wait for every acknowledgement, measure, verify.

use std::{
    collections::HashMap,
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    error::{Error, Result},
    event::ServerDead,
    evictions::{self, Eviction},
    keys::Keys,
    status, stream,
};
use tokio::process::Child;

use super::{
    measure::{cpu_seconds, slowlog_nodes, slowlogs_read, slowlogs_reset, worker_times, Probe},
    scene::{ZoneScene, LIVE_USERS},
    Knobs, ZoneRun,
};
use crate::{
    bench::probe::{peak_rss, percentile, redis_cpu},
    cli::BenchOptions as Options,
};

pub(super) struct ZoneBench<'a> {
    pub(super) settings: &'a Settings,
    pub(super) conn: &'a RedisConn,
    pub(super) options: &'a Options,
    pub(super) worker_exe: &'a Path,
    pub(super) zone: usize,
}

impl ZoneBench<'_> {
    /// One run: seed `servers` dead servers sharing `self.zone * zone_users` users, start
    /// `workers` workers and the probe, publish every event at once, wait for every
    /// acknowledgement, verify.
    pub(super) async fn run_once(
        &self,
        name: &str,
        servers: usize,
        workers: usize,
        knobs: &Knobs,
    ) -> Result<ZoneRun> {
        let users_per_server = self.zone * self.options.zone_users / servers;
        let prefix = format!(
            "{}zone-bench:{}:",
            self.settings.key_prefix,
            ulid::Ulid::new()
        );
        let keys = Keys::new(prefix.clone()).evictions_stream(
            self.settings
                .evictions
                .then_some(self.settings.evictions_stream.as_str()),
        );
        let scene = ZoneScene::new(
            keys,
            self.settings.layout,
            servers,
            users_per_server,
            self.options.moved_percent,
        );
        scene.seed(self.conn).await?;
        stream::ensure_group(self.conn, &scene.keys).await?;
        let (children, metrics) = self.start_workers(&scene.keys, workers, knobs).await?;
        let probe = self.spawn_probe(&scene.keys)?;
        // A second of lookups with Redis idle first: the machine's own floor.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let cpu_before = redis_cpu(self.settings, self.conn).await?;
        let slowlogs = slowlog_nodes(self.settings, self.conn).await?;
        slowlogs_reset(&slowlogs).await?;
        let added = publish_all(self.conn, &scene).await?;
        wait_cleaned(self.conn, &scene.keys).await?;
        let redis_cpu_seconds = redis_cpu(self.settings, self.conn).await? - cpu_before;
        let slowest = slowlogs_read(&slowlogs).await?;
        let lookups = probe.finish().await?;
        let times = worker_times(&metrics, servers).await;
        let (worker_peak_rss_bytes, worker_cpu_seconds) = stop_workers(children).await;
        let acks = Acks::read(self.conn, &scene.keys, &added).await?;
        let (stale_left, live_lost) = scene.verify(self.conn).await?;
        conn::delete_prefixed(self.settings, self.conn, &prefix).await?;
        let users = servers * users_per_server;
        let mut run = acks.figures(&lookups, users);
        run.name = name.into();
        run.servers = servers;
        run.workers = workers;
        run.worker_peak_rss_bytes = worker_peak_rss_bytes;
        run.worker_cpu_seconds = worker_cpu_seconds;
        run.worker_cpu_seconds_per_million_users = worker_cpu_seconds * 1e6 / users.max(1) as f64;
        run.redis_cpu_seconds = redis_cpu_seconds;
        run.replica_wait_seconds = times.replica_wait_seconds;
        run.cleanup_seconds = times.cleanup_seconds;
        run.replica_wait_share = times.replica_wait_seconds / times.cleanup_seconds.max(1e-9);
        run.redis_slowest_us = slowest.max_us;
        run.redis_slowest_command = slowest.command;
        run.redis_commands_over_5ms = slowest.over_5ms;
        run.stale_left = stale_left;
        run.live_lost = live_lost;
        Ok(run)
    }

    /// `workers` worker processes on `keys`, once each has joined the group, and the
    /// addresses of their metrics.
    async fn start_workers(
        &self,
        keys: &Keys,
        workers: usize,
        knobs: &Knobs,
    ) -> Result<(Vec<Child>, Vec<String>)> {
        let (mut children, mut metrics) = (Vec::new(), Vec::new());
        for _ in 0..workers {
            let port = registry_janitor_testkit::free_port()
                .map_err(|e| Error::LocalRedis(format!("a port for a worker's metrics: {e}")))?;
            let addr = format!("127.0.0.1:{port}");
            children.push(self.spawn_worker(keys, knobs, &addr)?);
            metrics.push(addr);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while status::collect_from(self.conn, keys).await?.consumers.len() < workers {
            if Instant::now() > deadline {
                return Err(timed_out("the zone workers did not join the group"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok((children, metrics))
    }

    /// A worker process on `keys`, configured by `JANITOR_*`, serving its metrics on
    /// `metrics_addr`.
    fn spawn_worker(&self, keys: &Keys, knobs: &Knobs, metrics_addr: &str) -> Result<Child> {
        let s = self.settings;
        crate::bench::runs::worker_command(s, keys.prefix(), self.worker_exe)
            .env("JANITOR_CONCURRENCY", s.concurrency.to_string())
            .env(
                "JANITOR_LATENCY_TARGET_MS",
                knobs.latency_target_ms.to_string(),
            )
            .env("JANITOR_STEP_ORDER", &knobs.step_order)
            .env(
                "JANITOR_CLUSTER_REPLICA_WAIT",
                knobs.replica_wait.to_string(),
            )
            .env("JANITOR_EVICTIONS", s.evictions.to_string())
            .env("JANITOR_METRICS_ADDR", metrics_addr)
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", self.worker_exe.display()), e))
    }

    /// The lookup probe, in a process of its own (`bench-probe`), always of this build.
    fn spawn_probe(&self, keys: &Keys) -> Result<Probe> {
        let exe = crate::bench::current_exe()?;
        let child = tokio::process::Command::new(&exe)
            .arg("bench-probe")
            .arg("--users")
            .arg(LIVE_USERS.to_string())
            .env("JANITOR_REDIS_URL", &self.settings.redis_url)
            .env(
                "JANITOR_REDIS_CLUSTER",
                self.settings.redis_cluster.to_string(),
            )
            .env(
                "JANITOR_REDIS_CLUSTER_SEEDS",
                serde_json::to_string(&self.settings.redis_cluster_seeds)
                    .expect("strings serialize"),
            )
            .env("JANITOR_KEY_PREFIX", keys.prefix())
            .env("JANITOR_LAYOUT", self.settings.layout.as_str())
            .env("JANITOR_METRICS_ADDR", "off")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", exe.display()), e))?;
        Ok(Probe { child })
    }
}

fn timed_out(what: &str) -> Error {
    Error::io(
        "zone benchmark",
        std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_owned()),
    )
}

/// The unix ms of a stream entry id.
fn id_ms(id: &str) -> u64 {
    id.split('-')
        .next()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0)
}

/// Every event at once: one pipeline of XADDs. Returns each server's event entry, by the
/// time Redis gave it (unix ms).
async fn publish_all(conn: &RedisConn, scene: &ZoneScene) -> Result<HashMap<String, u64>> {
    let mut pipe = redis::pipe();
    for server in &scene.dead {
        let event = ServerDead::new(server, Some("zone outage".into()), Some("bench".into()));
        pipe.cmd("XADD")
            .arg(scene.keys.events())
            .arg("*")
            .arg("type")
            .arg(registry_janitor::event::EVENT_TYPE)
            .arg("payload")
            .arg(event.encode());
    }
    let ids: Vec<String> = pipe.query_async(&mut conn.clone()).await?;
    Ok(scene
        .dead
        .iter()
        .zip(&ids)
        .map(|(server, id)| (server.as_str().to_owned(), id_ms(id)))
        .collect())
}

/// Waits until every event is acknowledged (at most 30 minutes).
async fn wait_cleaned(conn: &RedisConn, keys: &Keys) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(1800);
    while !status::collect_from(conn, keys).await?.is_idle() {
        if Instant::now() > deadline {
            return Err(timed_out("the zone was not cleaned within 30 minutes"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Stops the workers; returns the largest peak RSS of any and their CPU seconds together.
async fn stop_workers(children: Vec<Child>) -> (u64, f64) {
    let (mut rss, mut cpu) = (0, 0.0);
    for child in &children {
        let pid = child.id().unwrap_or(0);
        rss = rss.max(peak_rss(pid).unwrap_or(0));
        cpu += cpu_seconds(pid).unwrap_or(0.0);
    }
    for mut child in children {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    (rss, cpu)
}

/// The acknowledgements of one run, from the `server.cleaned` entries that the
/// acknowledging steps wrote to the evictions stream.
struct Acks {
    /// Per event, XADD to acknowledgement in ms, sorted.
    windows: Vec<f64>,
    /// The first XADD and the last acknowledgement (unix ms).
    first_add: u64,
    last_ack: u64,
}

impl Acks {
    async fn read(conn: &RedisConn, keys: &Keys, added: &HashMap<String, u64>) -> Result<Self> {
        let mut windows = Vec::new();
        let mut last_ack = 0;
        for (id, eviction) in evictions::read_all(conn, keys).await? {
            if let Some(Eviction::Cleaned { server_id, .. }) = eviction {
                if let Some(&xadd) = added.get(&server_id) {
                    let acked = id_ms(&id);
                    last_ack = last_ack.max(acked);
                    windows.push(acked.saturating_sub(xadd) as f64);
                }
            }
        }
        windows.sort_by(|a, b| a.total_cmp(b));
        Ok(Acks {
            windows,
            first_add: added.values().copied().min().unwrap_or(0),
            last_ack,
        })
    }

    fn window_at(&self, p: f64) -> f64 {
        let w = &self.windows;
        w.get(((w.len() as f64 * p) as usize).min(w.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    }

    /// The run's timing figures: throughput, stale windows, and the probe's lookups
    /// (`lookups`: unix ms when sent, latency in us) while the zone was cleaned and in
    /// the idle second before.
    fn figures(&self, lookups: &[(u64, u64)], users: usize) -> ZoneRun {
        let (first_add, last_ack) = (self.first_add, self.last_ack);
        let seconds = (last_ack.saturating_sub(first_add) as f64 / 1000.0).max(1e-3);
        let sorted = |keep: &dyn Fn(u64) -> bool| {
            let mut us: Vec<u64> = lookups
                .iter()
                .filter(|(at_ms, _)| keep(*at_ms))
                .map(|&(_, us)| us)
                .collect();
            us.sort_unstable();
            us
        };
        // The lookups issued while the zone was being cleaned, and in the idle second.
        let latencies = sorted(&|at_ms| (first_add..=last_ack).contains(&at_ms));
        let idle = sorted(&|at_ms| at_ms + 900 >= first_add && at_ms < first_add);
        ZoneRun {
            users,
            seconds,
            users_per_second: users as f64 / seconds,
            lookups: latencies.len(),
            lookup_p50_us: percentile(&latencies, 0.50),
            lookup_p99_us: percentile(&latencies, 0.99),
            lookup_max_us: latencies.last().copied().unwrap_or(0),
            idle_lookups: idle.len(),
            idle_lookup_p50_us: percentile(&idle, 0.50),
            idle_lookup_p99_us: percentile(&idle, 0.99),
            idle_lookup_max_us: idle.last().copied().unwrap_or(0),
            stale_window_p50_ms: self.window_at(0.50),
            stale_window_p99_ms: self.window_at(0.99),
            stale_window_mean_ms: self.windows.iter().sum::<f64>()
                / self.windows.len().max(1) as f64,
            stale_window_max_ms: self.windows.last().copied().unwrap_or(0.0),
            acknowledged: self.windows.len(),
            ..ZoneRun::default()
        }
    }
}
