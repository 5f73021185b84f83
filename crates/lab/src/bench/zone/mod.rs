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
//! `--latency-targets`, `--step-orders` and `--replica-waits` sweep settings (passed to
//! the workers as `JANITOR_LATENCY_TARGET_MS`, `JANITOR_STEP_ORDER` and
//! `JANITOR_CLUSTER_REPLICA_WAIT`), `--busy-cores` sweeps other load on the machine
//! (processes that each keep a core busy), `--repeat` repeats each, and
//! `--worker-exe` runs the workers from a given `registry-janitor` binary.

pub mod busy;
mod measure;
mod once;
mod scene;
mod table;

use std::path::Path;

use registry_janitor::{config::Settings, conn, error::Result};
use serde::Serialize;

use crate::cli::BenchOptions as Options;
pub use measure::probe;
use once::ZoneBench;

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
    /// Over the workers' metrics: seconds the ends of cluster walks waited for replicas
    /// (`registry_janitor_cluster_replica_wait_seconds`), seconds of whole cleanups
    /// (`registry_janitor_cleanup_duration_seconds`), and the first over the second: the
    /// share of the cleanups' time spent in the replica wait.
    pub replica_wait_seconds: f64,
    pub cleanup_seconds: f64,
    pub replica_wait_share: f64,
}

/// The settings a run passes to its workers.
#[derive(Debug, Clone, Serialize)]
pub struct Knobs {
    pub latency_target_ms: u64,
    pub step_order: String,
    /// `cluster_replica_wait`.
    pub replica_wait: bool,
    /// Cores kept busy by other processes through the run (`--busy-cores`).
    pub busy_cores: usize,
}

/// One setting of the sweep: the zone and the single server, medians of `--repeat`.
#[derive(Debug, Clone, Serialize)]
pub struct ZoneSetting {
    #[serde(flatten)]
    pub knobs: Knobs,
    pub zone: ZoneRun,
    pub single: ZoneRun,
    /// Zone users/s over single users/s.
    pub throughput_vs_single: f64,
    pub repeats: Vec<ZoneRun>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ZoneReport {
    pub redis_version: String,
    /// The fixed workload timed before the runs, to compare invocations.
    pub calibration: crate::bench::calibration::Calibration,
    pub servers: usize,
    pub users_per_server: usize,
    pub workers: usize,
    pub concurrency: usize,
    pub chunk_size: usize,
    pub chunks_in_flight: usize,
    pub worker_exe: String,
    /// Masters of the private local cluster the runs were on; 0: one redis-server.
    pub cluster_masters: usize,
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

/// Runs the zone benchmark on a private redis-server, or with `--local-cluster` on a
/// private local cluster of 3 masters.
pub async fn run(settings: &Settings, options: &Options, worker_exe: &Path) -> Result<ZoneReport> {
    let zone = options.zone.unwrap_or(1).max(1);
    let (settings, _private) = if options.local_cluster {
        crate::private::redis_for(settings, options.cluster_shape()).await?
    } else {
        let redis = crate::private::start_server().await?;
        eprintln!(
            "started a private redis-server on port {} for the zone benchmark",
            redis.port()
        );
        let mut settings = settings.clone();
        settings.redis_url = redis.url();
        (settings, crate::private::Private::Node(Some(redis)))
    };
    let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
    let redis_version = crate::bench::probe::redis_version(&settings, &conn).await?;
    let calibration =
        crate::bench::calibration::calibrate(&settings, &conn, &settings.key_prefix).await?;
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
    let waits = if options.replica_waits.is_empty() {
        vec![settings.cluster_replica_wait]
    } else {
        options.replica_waits.clone()
    };
    let busy = if options.busy_cores.is_empty() {
        vec![0]
    } else {
        options.busy_cores.clone()
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
    let mut combos = Vec::new();
    for &latency_target_ms in &targets {
        for step_order in &orders {
            for &replica_wait in &waits {
                for &busy_cores in &busy {
                    combos.push(Knobs {
                        latency_target_ms,
                        step_order: step_order.clone(),
                        replica_wait,
                        busy_cores,
                    });
                }
            }
        }
    }
    let mut repeats: Vec<Vec<ZoneRun>> = vec![Vec::new(); combos.len()];
    for _ in 0..options.repeat.max(1) {
        for (i, knobs) in combos.iter().enumerate() {
            let _busy = busy::Busy::start(knobs.busy_cores)?;
            repeats[i].push(b.run_once("zone", zone, options.workers, knobs).await?);
            repeats[i].push(b.run_once("single", 1, 1, knobs).await?);
        }
    }
    let out = combos
        .into_iter()
        .zip(repeats)
        .map(|(knobs, repeats)| setting(knobs, repeats))
        .collect();
    Ok(ZoneReport {
        redis_version,
        calibration,
        servers: zone,
        users_per_server: options.zone_users,
        workers: options.workers,
        concurrency: settings.concurrency,
        chunk_size: settings.chunk_size,
        chunks_in_flight: settings.chunks_in_flight,
        worker_exe: worker_exe.display().to_string(),
        cluster_masters: if options.local_cluster {
            options.cluster_masters
        } else {
            0
        },
        settings: out,
    })
}

/// One setting of the sweep, from its runs: the median zone and single runs.
fn setting(knobs: Knobs, repeats: Vec<ZoneRun>) -> ZoneSetting {
    let zone = median(&repeats, "zone");
    let single = median(&repeats, "single");
    eprintln!(
        "latency_target_ms {}, step_order {}, cluster_replica_wait {}, busy cores {}: zone {:.0} users/s, lookup p99 {} us, max {} us; single {:.0} users/s",
        knobs.latency_target_ms,
        knobs.step_order,
        knobs.replica_wait,
        knobs.busy_cores,
        zone.users_per_second,
        zone.lookup_p99_us,
        zone.lookup_max_us,
        single.users_per_second
    );
    ZoneSetting {
        knobs,
        throughput_vs_single: zone.users_per_second / single.users_per_second.max(1e-9),
        zone,
        single,
        repeats,
    }
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
