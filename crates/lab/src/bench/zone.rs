//! `bench --zone D`: a zone outage. D connection servers of `--zone-users` users each die
//! at once (one zone of three: 2 x D more servers stay alive, so the guard sees a zone
//! outage, not a mass silence), their D `server.dead` events are published together (one pipeline), and
//! `--workers` worker processes clean them, while a probe in its own process
//! (`registry-janitor-lab bench-probe`) issues one routing lookup per millisecond of live
//! users. Measured:
//! - lookups: p50, p99, max (the probe's own process, so the bench's work never delays it);
//! - per-event stale windows, from the event's XADD to its acknowledgement: the
//!   `server.cleaned` entry of the evictions stream is written by the very script that
//!   acknowledges, so its stream id is the acknowledgement's time (needs `evictions`);
//! - fleet throughput: users over first XADD to last acknowledgement;
//! - each worker's peak RSS (VmHWM) and CPU seconds (utime + stime), per million users;
//! - the same total as one server cleaned by one worker ("single"), for
//!   `throughput vs one server alone`.
//!
//! `--latency-targets` and `--step-orders` sweep settings (passed to the workers as
//! `JANITOR_LATENCY_TARGET_MS` and `JANITOR_STEP_ORDER`), `--repeat` repeats each, and
//! `--worker-exe` runs the workers from a given `registry-janitor` binary.

use std::{
    collections::HashMap,
    fmt,
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    error::{Error, Result},
    event::{ServerDead, ServerId},
    evictions::{self, Eviction},
    keys::Keys,
    registry::Registry,
    status, stream,
};
use serde::Serialize;
use tokio::{io::AsyncWriteExt, process::Child};

use super::probe::{peak_rss, percentile};
use crate::cli::{BenchOptions as Options, ProbeOptions};

/// The figures of one run (a zone outage, or the single server of the same size).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ZoneRun {
    /// `zone` or `single`.
    pub name: String,
    pub servers: usize,
    pub workers: usize,
    pub users: usize,
    /// First XADD to last acknowledgement.
    pub seconds: f64,
    pub users_per_second: f64,
    pub lookups: usize,
    pub lookup_p50_us: u64,
    pub lookup_p99_us: u64,
    pub lookup_max_us: u64,
    /// The same probe in the second before the events, Redis idle: the floor that the
    /// machine itself sets (on a loaded machine, scheduling delays dominate).
    pub idle_lookups: usize,
    pub idle_lookup_p50_us: u64,
    pub idle_lookup_p99_us: u64,
    pub idle_lookup_max_us: u64,
    /// Per event, XADD to acknowledgement, in ms.
    pub stale_window_p50_ms: f64,
    pub stale_window_p99_ms: f64,
    pub stale_window_mean_ms: f64,
    pub stale_window_max_ms: f64,
    /// The largest peak RSS of any worker.
    pub worker_peak_rss_bytes: u64,
    /// CPU seconds of all workers together, and per million users cleaned.
    pub worker_cpu_seconds: f64,
    pub worker_cpu_seconds_per_million_users: f64,
    /// Redis main-thread CPU seconds over the run.
    pub redis_cpu_seconds: f64,
    /// The slowest command that Redis itself ran while the zone was cleaned (its SLOWLOG,
    /// execution time only), and its name: a lookup max well above it was spent outside
    /// Redis's execution (queued behind other commands, or the machine's scheduling).
    pub redis_slowest_us: u64,
    pub redis_slowest_command: String,
    /// Commands that ran for more than 5 ms.
    pub redis_commands_over_5ms: u64,
    /// Events acknowledged (by their `server.cleaned`), of `servers`.
    pub acknowledged: usize,
    /// Forward entries still naming a dead server, and reverse-index keys left.
    pub stale_left: u64,
    /// Entries of moved or live users that are gone or wrong.
    pub live_lost: u64,
}

/// One setting of the sweep: the zone and the single server, medians of `--repeat`.
#[derive(Debug, Clone, Serialize)]
pub struct ZoneSetting {
    pub latency_target_ms: u64,
    pub step_order: String,
    pub zone: ZoneRun,
    pub single: ZoneRun,
    /// Zone users/s over single users/s.
    pub throughput_vs_single: f64,
    pub repeats: Vec<ZoneRun>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ZoneReport {
    pub redis_version: String,
    pub servers: usize,
    pub users_per_server: usize,
    pub workers: usize,
    pub concurrency: usize,
    pub chunk_size: usize,
    pub chunks_in_flight: usize,
    pub worker_exe: String,
    pub settings: Vec<ZoneSetting>,
}

impl ZoneReport {
    /// The worst correctness figures of any run.
    pub fn failures(&self) -> Option<String> {
        let runs = self
            .settings
            .iter()
            .flat_map(|s| s.repeats.iter())
            .filter(|r| r.stale_left > 0 || r.live_lost > 0 || r.acknowledged < r.servers);
        let bad: Vec<String> = runs
            .map(|r| {
                format!(
                    "{} run: {} stale left, {} live lost, {} of {} events acknowledged",
                    r.name, r.stale_left, r.live_lost, r.acknowledged, r.servers
                )
            })
            .collect();
        (!bad.is_empty()).then(|| bad.join("; "))
    }
}

/// Runs the zone benchmark on a private redis-server.
pub async fn run(settings: &Settings, options: &Options, worker_exe: &Path) -> Result<ZoneReport> {
    let zone = options.zone.unwrap_or(1).max(1);
    let redis = crate::private::start_server().await?;
    eprintln!(
        "started a private redis-server on port {} for the zone benchmark",
        redis.port()
    );
    let mut settings = settings.clone();
    settings.redis_url = redis.url();
    let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn.clone())
        .await?;
    let redis_version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("")
        .trim()
        .to_owned();
    let targets = if options.latency_targets.is_empty() {
        vec![settings.latency_target_ms]
    } else {
        options.latency_targets.clone()
    };
    let orders = if options.step_orders.is_empty() {
        vec![settings.step_order.as_str().to_owned()]
    } else {
        options.step_orders.clone()
    };
    let b = ZoneBench {
        settings: &settings,
        conn: &conn,
        options,
        worker_exe,
        zone,
    };
    // Repetitions outermost, so that every setting sees the same load conditions in turn
    // (on a shared machine the load drifts).
    let combos: Vec<(u64, String)> = targets
        .iter()
        .flat_map(|&t| orders.iter().map(move |o| (t, o.clone())))
        .collect();
    let mut repeats: Vec<Vec<ZoneRun>> = vec![Vec::new(); combos.len()];
    for _ in 0..options.repeat.max(1) {
        for (i, (target, order)) in combos.iter().enumerate() {
            repeats[i].push(
                b.run_once("zone", zone, options.workers, *target, order)
                    .await?,
            );
            repeats[i].push(b.run_once("single", 1, 1, *target, order).await?);
        }
    }
    let mut out = Vec::new();
    for ((target, order), repeats) in combos.into_iter().zip(repeats) {
        let zone_run = median(&repeats, "zone");
        let single = median(&repeats, "single");
        eprintln!(
            "latency_target_ms {target}, step_order {order}: zone {:.0} users/s, lookup p99 {} us, max {} us; single {:.0} users/s",
            zone_run.users_per_second, zone_run.lookup_p99_us, zone_run.lookup_max_us, single.users_per_second
        );
        out.push(ZoneSetting {
            latency_target_ms: target,
            step_order: order,
            throughput_vs_single: zone_run.users_per_second / single.users_per_second.max(1e-9),
            zone: zone_run,
            single,
            repeats,
        });
    }
    Ok(ZoneReport {
        redis_version,
        servers: zone,
        users_per_server: options.zone_users,
        workers: options.workers,
        concurrency: settings.concurrency,
        chunk_size: settings.chunk_size,
        chunks_in_flight: settings.chunks_in_flight,
        worker_exe: worker_exe.display().to_string(),
        settings: out,
    })
}

struct ZoneBench<'a> {
    settings: &'a Settings,
    conn: &'a RedisConn,
    options: &'a Options,
    worker_exe: &'a Path,
    zone: usize,
}

/// Live users the probe looks up (and who must survive).
const LIVE_USERS: usize = 10_000;

impl ZoneBench<'_> {
    /// One run: seed `servers` dead servers sharing `self.zone * zone_users` users, start
    /// `workers` workers and the probe, publish every event at once, wait for every
    /// acknowledgement, verify.
    async fn run_once(
        &self,
        name: &str,
        servers: usize,
        workers: usize,
        target: u64,
        order: &str,
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
        let scene = ZoneScene {
            registry: Registry::new(keys.clone(), self.settings.layout),
            keys,
            dead: (0..servers)
                .map(|i| ServerId::parse(&format!("zone-dead-{i}#1")).expect("valid"))
                .collect(),
            live: ServerId::parse("zone-live#1").expect("valid"),
            users_per_server,
            moved_every: if self.options.moved_percent > 0.0 {
                (100.0 / self.options.moved_percent).round().max(1.0) as usize
            } else {
                0
            },
        };
        scene.seed(self.conn).await?;
        stream::ensure_group(self.conn, &scene.keys).await?;
        let mut children = Vec::new();
        for _ in 0..workers {
            children.push(self.spawn_worker(&scene.keys, target, order)?);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while status::collect_from(self.conn, &scene.keys)
            .await?
            .consumers
            .len()
            < workers
        {
            if Instant::now() > deadline {
                return Err(timed_out("the zone workers did not join the group"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let probe = self.spawn_probe(&scene.keys)?;
        // A second of lookups with Redis idle first: the machine's own floor.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let cpu_before = super::probe::redis_cpu(self.settings, self.conn).await?;
        slowlog_reset(self.conn).await?;
        // Every event at once: one pipeline of XADDs.
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
        let ids: Vec<String> = pipe.query_async(&mut self.conn.clone()).await?;
        // Each server's event entry, by the time Redis gave it.
        let added: HashMap<String, u64> = scene
            .dead
            .iter()
            .zip(&ids)
            .map(|(server, id)| (server.as_str().to_owned(), id_ms(id)))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            let s = status::collect_from(self.conn, &scene.keys).await?;
            if s.is_idle() {
                break;
            }
            if Instant::now() > deadline {
                return Err(timed_out("the zone was not cleaned within 30 minutes"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let redis_cpu_seconds =
            super::probe::redis_cpu(self.settings, self.conn).await? - cpu_before;
        let slowest = slowlog_read(self.conn).await?;
        let lookups = probe.finish().await?;
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
        // Stale windows: XADD to the `server.cleaned` written by the acknowledging step.
        let mut windows = Vec::new();
        let mut last_ack = 0;
        for (id, eviction) in evictions::read_all(self.conn, &scene.keys).await? {
            if let Some(Eviction::Cleaned { server_id, .. }) = eviction {
                if let Some(&xadd) = added.get(&server_id) {
                    let acked = id_ms(&id);
                    last_ack = last_ack.max(acked);
                    windows.push(acked.saturating_sub(xadd) as f64);
                }
            }
        }
        windows.sort_by(|a, b| a.total_cmp(b));
        let first_add = added.values().copied().min().unwrap_or(0);
        let seconds = (last_ack.saturating_sub(first_add) as f64 / 1000.0).max(1e-3);
        // The lookups issued while the zone was being cleaned.
        let mut latencies: Vec<u64> = lookups
            .iter()
            .filter(|(at_ms, _)| (first_add..=last_ack).contains(at_ms))
            .map(|&(_, us)| us)
            .collect();
        latencies.sort_unstable();
        let mut idle: Vec<u64> = lookups
            .iter()
            .filter(|(at_ms, _)| *at_ms + 900 >= first_add && *at_ms < first_add)
            .map(|&(_, us)| us)
            .collect();
        idle.sort_unstable();
        let (stale_left, live_lost) = scene.verify(self.conn).await?;
        conn::delete_prefixed(self.settings, self.conn, &prefix).await?;
        let users = servers * users_per_server;
        let fpct = |p: f64| {
            windows
                .get(((windows.len() as f64 * p) as usize).min(windows.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        Ok(ZoneRun {
            name: name.into(),
            servers,
            workers,
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
            stale_window_p50_ms: fpct(0.50),
            stale_window_p99_ms: fpct(0.99),
            stale_window_mean_ms: windows.iter().sum::<f64>() / windows.len().max(1) as f64,
            stale_window_max_ms: windows.last().copied().unwrap_or(0.0),
            worker_peak_rss_bytes: rss,
            worker_cpu_seconds: cpu,
            worker_cpu_seconds_per_million_users: cpu * 1e6 / users.max(1) as f64,
            redis_cpu_seconds,
            redis_slowest_us: slowest.max_us,
            redis_slowest_command: slowest.command,
            redis_commands_over_5ms: slowest.over_5ms,
            acknowledged: windows.len(),
            stale_left,
            live_lost,
        })
    }

    /// A worker process on `keys`, configured by `JANITOR_*`.
    fn spawn_worker(&self, keys: &Keys, target: u64, order: &str) -> Result<Child> {
        let s = self.settings;
        super::runs::worker_command(s, keys.prefix(), self.worker_exe)
            .env("JANITOR_CONCURRENCY", s.concurrency.to_string())
            .env("JANITOR_LATENCY_TARGET_MS", target.to_string())
            .env("JANITOR_STEP_ORDER", order)
            .env("JANITOR_EVICTIONS", s.evictions.to_string())
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", self.worker_exe.display()), e))
    }

    /// The lookup probe, in a process of its own (`bench-probe`), always of this build.
    fn spawn_probe(&self, keys: &Keys) -> Result<Probe> {
        let exe = super::current_exe()?;
        let child = tokio::process::Command::new(&exe)
            .arg("bench-probe")
            .arg("--users")
            .arg(LIVE_USERS.to_string())
            .env("JANITOR_REDIS_URL", &self.settings.redis_url)
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

/// Redis's SLOWLOG over a run: every command of 1 ms or more is kept (up to 4,096).
struct Slowest {
    max_us: u64,
    command: String,
    over_5ms: u64,
}

async fn slowlog_reset(conn: &RedisConn) -> Result<()> {
    redis::pipe()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(1000)
        .ignore()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-max-len")
        .arg(4096)
        .ignore()
        .cmd("SLOWLOG")
        .arg("RESET")
        .ignore()
        .query_async::<()>(&mut conn.clone())
        .await?;
    Ok(())
}

async fn slowlog_read(conn: &RedisConn) -> Result<Slowest> {
    // Each entry: id, unix time, duration in us, [command, args...], client addr, name.
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(4096)
        .query_async(&mut conn.clone())
        .await?;
    let mut out = Slowest {
        max_us: 0,
        command: String::new(),
        over_5ms: 0,
    };
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let us: u64 = fields
            .get(2)
            .and_then(|v| redis::from_redis_value_ref(v).ok())
            .unwrap_or(0);
        let argv: Vec<Vec<u8>> = fields
            .get(3)
            .and_then(|v| redis::from_redis_value_ref(v).ok())
            .unwrap_or_default();
        // The benchmark's own SLOWLOG RESET (it frees the previous run's entries).
        if argv
            .first()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"slowlog"))
        {
            continue;
        }
        if us > 5000 {
            out.over_5ms += 1;
        }
        if us > out.max_us {
            out.max_us = us;
            out.command = argv
                .iter()
                .take(2)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ");
        }
    }
    Ok(out)
}

/// utime + stime of a process, in seconds (Linux /proc; 100 ticks a second).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// The probe process: closing its stdin stops it; it prints its latencies.
struct Probe {
    child: Child,
}

impl Probe {
    /// (unix ms when sent, latency in us) of every lookup.
    async fn finish(mut self) -> Result<Vec<(u64, u64)>> {
        drop(self.child.stdin.take());
        let out = self
            .child
            .wait_with_output()
            .await
            .map_err(|e| Error::io("waiting for the lookup probe", e))?;
        if !out.status.success() {
            return Err(Error::io(
                "the lookup probe",
                std::io::Error::other(format!("exited with {}", out.status)),
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| {
            Error::io(
                "reading the lookup probe's latencies",
                std::io::Error::other(e),
            )
        })
    }
}

/// The registry of one run: dead servers (1% of whose users moved to the live server) and
/// the live server's own users.
struct ZoneScene {
    keys: Keys,
    registry: Registry,
    dead: Vec<ServerId>,
    live: ServerId,
    users_per_server: usize,
    moved_every: usize,
}

impl ZoneScene {
    fn user(&self, server: usize, n: usize) -> Vec<u8> {
        format!("z{server}u{n}").into_bytes()
    }

    fn moved(&self, n: usize) -> bool {
        self.moved_every > 0 && n % self.moved_every == 0
    }

    async fn seed(&self, conn: &RedisConn) -> Result<()> {
        self.registry.heartbeat(conn, &self.live, 3_600_000).await?;
        // The rest of the fleet, alive: the zone is one third of it, as the guard sees a
        // zone outage (every dead server heartbeated until now, none has a liveness key).
        for i in 0..2 * self.dead.len() {
            let peer = ServerId::parse(&format!("zone-peer-{i}#1")).expect("valid");
            self.registry.heartbeat(conn, &peer, 3_600_000).await?;
        }
        let now = registry_janitor::now_ms();
        for (i, dead) in self.dead.iter().enumerate() {
            let _: () = redis::cmd("ZADD")
                .arg(self.keys.servers())
                .arg(now)
                .arg(dead.as_str())
                .query_async(&mut conn.clone())
                .await?;
            for start in (0..self.users_per_server).step_by(10_000) {
                let end = self.users_per_server.min(start + 10_000);
                let ids: Vec<Vec<u8>> = (start..end).map(|n| self.user(i, n)).collect();
                self.registry
                    .register_many(conn, ids.iter().map(Vec::as_slice), dead, 1000)
                    .await?;
                let moved = (start..end)
                    .filter(|&n| self.moved(n))
                    .map(|n| ids[n - start].as_slice());
                self.registry
                    .register_many(conn, moved, &self.live, 1000)
                    .await?;
            }
        }
        let live: Vec<Vec<u8>> = (0..LIVE_USERS).map(live_user).collect();
        self.registry
            .register_many(conn, live.iter().map(Vec::as_slice), &self.live, 1000)
            .await
    }

    /// (stale left, live lost)
    async fn verify(&self, conn: &RedisConn) -> Result<(u64, u64)> {
        let (mut stale, mut lost) = (0, 0);
        for (i, dead) in self.dead.iter().enumerate() {
            let left: u64 = redis::cmd("EXISTS")
                .arg(&self.keys.server_members_left(dead))
                .query_async(&mut conn.clone())
                .await?;
            stale += left;
            for start in (0..self.users_per_server).step_by(1000) {
                let end = self.users_per_server.min(start + 1000);
                let ids: Vec<Vec<u8>> = (start..end).map(|n| self.user(i, n)).collect();
                for (k, owner) in self.registry.owners(conn, &ids).await?.iter().enumerate() {
                    match owner.as_deref() {
                        Some(o) if o == dead.as_str() => stale += 1,
                        Some(o) if self.moved(start + k) && o == self.live.as_str() => {}
                        None if !self.moved(start + k) => {}
                        _ => lost += 1,
                    }
                }
            }
        }
        let live: Vec<Vec<u8>> = (0..LIVE_USERS).map(live_user).collect();
        for chunk in live.chunks(1000) {
            lost += self
                .registry
                .owners(conn, chunk)
                .await?
                .iter()
                .filter(|o| o.as_deref() != Some(self.live.as_str()))
                .count() as u64;
        }
        Ok((stale, lost))
    }
}

fn live_user(n: usize) -> Vec<u8> {
    format!("live{n}").into_bytes()
}

/// The median of the runs called `name`, figure by figure; correctness figures are the
/// worst seen and the lookup max the largest.
fn median(runs: &[ZoneRun], name: &str) -> ZoneRun {
    let of: Vec<&ZoneRun> = runs.iter().filter(|r| r.name == name).collect();
    let f = |g: fn(&ZoneRun) -> f64| super::probe::median_by(&of, g);
    let u = |g: fn(&ZoneRun) -> u64| super::probe::median_by(&of, g);
    let first = of.first().copied().cloned().unwrap_or_default();
    ZoneRun {
        seconds: f(|r| r.seconds),
        users_per_second: f(|r| r.users_per_second),
        lookups: u(|r| r.lookups as u64) as usize,
        lookup_p50_us: u(|r| r.lookup_p50_us),
        lookup_p99_us: u(|r| r.lookup_p99_us),
        lookup_max_us: of.iter().map(|r| r.lookup_max_us).max().unwrap_or(0),
        idle_lookups: u(|r| r.idle_lookups as u64) as usize,
        idle_lookup_p50_us: u(|r| r.idle_lookup_p50_us),
        idle_lookup_p99_us: u(|r| r.idle_lookup_p99_us),
        idle_lookup_max_us: of.iter().map(|r| r.idle_lookup_max_us).max().unwrap_or(0),
        stale_window_p50_ms: f(|r| r.stale_window_p50_ms),
        stale_window_p99_ms: f(|r| r.stale_window_p99_ms),
        stale_window_mean_ms: f(|r| r.stale_window_mean_ms),
        stale_window_max_ms: f(|r| r.stale_window_max_ms),
        worker_peak_rss_bytes: of
            .iter()
            .map(|r| r.worker_peak_rss_bytes)
            .max()
            .unwrap_or(0),
        worker_cpu_seconds: f(|r| r.worker_cpu_seconds),
        worker_cpu_seconds_per_million_users: f(|r| r.worker_cpu_seconds_per_million_users),
        redis_cpu_seconds: f(|r| r.redis_cpu_seconds),
        redis_slowest_us: of.iter().map(|r| r.redis_slowest_us).max().unwrap_or(0),
        redis_slowest_command: of
            .iter()
            .max_by_key(|r| r.redis_slowest_us)
            .map(|r| r.redis_slowest_command.clone())
            .unwrap_or_default(),
        redis_commands_over_5ms: of
            .iter()
            .map(|r| r.redis_commands_over_5ms)
            .max()
            .unwrap_or(0),
        acknowledged: of.iter().map(|r| r.acknowledged).min().unwrap_or(0),
        stale_left: of.iter().map(|r| r.stale_left).max().unwrap_or(0),
        live_lost: of.iter().map(|r| r.live_lost).max().unwrap_or(0),
        ..first
    }
}

impl fmt::Display for ZoneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "redis {} | zone of {} servers x {} users | {} workers x concurrency {} x chunks_in_flight {} | chunk_size {}",
            self.redis_version,
            self.servers,
            self.users_per_server,
            self.workers,
            self.concurrency,
            self.chunks_in_flight,
            self.chunk_size
        )?;
        writeln!(f, "workers: {}", self.worker_exe)?;
        writeln!(
            f,
            "{:>6} {:<14} {:<6} {:>9} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>6} {:>5} {:>5}",
            "target", "order", "run", "users", "users/s", "p50 us", "p99 us", "max us",
            "win p50", "win p99", "win mean", "rss MiB", "cpu s/M", "acked", "stale", "lost"
        )?;
        for s in &self.settings {
            for r in [&s.zone, &s.single] {
                writeln!(
                    f,
                    "{:>6} {:<14} {:<6} {:>9} {:>10.0} {:>8} {:>8} {:>8} {:>8.0}ms {:>7.0}ms {:>7.0}ms {:>8.1} {:>8.2} {:>6} {:>5} {:>5}",
                    s.latency_target_ms,
                    s.step_order,
                    r.name,
                    r.users,
                    r.users_per_second,
                    r.lookup_p50_us,
                    r.lookup_p99_us,
                    r.lookup_max_us,
                    r.stale_window_p50_ms,
                    r.stale_window_p99_ms,
                    r.stale_window_mean_ms,
                    r.worker_peak_rss_bytes as f64 / (1 << 20) as f64,
                    r.worker_cpu_seconds_per_million_users,
                    format!("{}/{}", r.acknowledged, r.servers),
                    r.stale_left,
                    r.live_lost
                )?;
            }
            writeln!(
                f,
                "{:>6} {:<14} throughput vs one server alone: {:.2}x; lookups with Redis idle (the machine's floor): p50 {} us, p99 {} us, max {} us",
                s.latency_target_ms,
                s.step_order,
                s.throughput_vs_single,
                s.zone.idle_lookup_p50_us,
                s.zone.idle_lookup_p99_us,
                s.zone.idle_lookup_max_us
            )?;
            writeln!(
                f,
                "{:>6} {:<14} slowest command in Redis while the zone was cleaned: {} us ({}), {} over 5 ms",
                s.latency_target_ms,
                s.step_order,
                s.zone.redis_slowest_us,
                s.zone.redis_slowest_command,
                s.zone.redis_commands_over_5ms
            )?;
        }
        Ok(())
    }
}

/// `registry-janitor-lab bench-probe`: one routing lookup (HGET/GET of a live user) per
/// millisecond until stdin closes, then each lookup's (unix ms when sent, latency in
/// microseconds), as a JSON array on stdout.
pub async fn probe(settings: &Settings, options: &ProbeOptions) -> Result<()> {
    let keys = Keys::new(settings.key_prefix.clone());
    let target = conn::target_for(settings)?;
    let stop = tokio_util::sync::CancellationToken::new();
    let watch = stop.clone();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        watch.cancel();
    });
    let users: Vec<Vec<u8>> = (0..options.users.max(1)).map(live_user).collect();
    let latencies = super::probe::probe_lookups(target, keys, settings.layout, users, stop).await?;
    let mut out = tokio::io::stdout();
    let json = serde_json::to_vec(&latencies).expect("numbers serialize");
    out.write_all(&json)
        .await
        .map_err(|e| Error::io("writing the latencies", e))?;
    out.flush()
        .await
        .map_err(|e| Error::io("writing the latencies", e))?;
    Ok(())
}
