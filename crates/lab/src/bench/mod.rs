//! `registry-janitor-lab bench`: how fast a dead server is cleaned, what it costs Redis, and
//! what routing lookups feel meanwhile, against references measured in the same run.
//!
//! Every run seeds its own keys: one dead server with `users` users, `moved_percent` of
//! them reconnected to a live server (they must survive), and the live server's own users
//! (the lookup targets). Runs:
//! - `janitor`: the real worker path: a worker child process ([`worker_exe`]), one
//!   `server.dead` event in, its acknowledgement out. The child's peak RSS is the
//!   worker's memory. A second, smaller janitor run (`baseline_users`) checks that memory
//!   does not grow with the size of the dead server;
//! - `unconditional` (the ceiling; wrong on purpose): SSCAN chunks of 1000 and a pipeline
//!   of one HDEL (or DEL) per user, several chunks in flight, then UNLINK of the set;
//! - `careful` (the reference for Redis CPU): SSCAN plus one EVALSHA per 1000-user chunk
//!   (HMGET, compare, HDEL, SREM), one chunk at a time;
//! - `naive`: HGET then HDEL per user, one round trip each, on a sample.
//!
//! During each run a separate connection issues a routing lookup (HGET/GET of a live
//! user) every millisecond; Redis main-thread CPU comes from INFO cpu before and after.
//!
//! Fencing adds two measurements ([`route`]):
//! - route cost: `route_lookups` lookups of random users of a seeded registry whose
//!   owners are all alive, by `route` (route.lua) and by a plain HGET/GET, a few in
//!   flight: latency and Redis CPU per lookup of each;
//! - stale window: during each `janitor` run (not the baseline) the dead server looks
//!   alive (its liveness key set for an hour), and two probes look up its users who did
//!   not move, one per millisecond each, by `route` and by HGET/GET: how many lookups
//!   started after the fence was recorded still got the dead server.
//!
//! Here: the options' use, the runs' order and the ratios; [`runs`] the runs, [`scene`] the
//! registry each run seeds and verifies, [`probe`] the measurements beside the work
//! (lookup latencies, Redis CPU, peak RSS), [`route`] the routing measurements,
//! [`report`] the table.

pub mod calibration;
mod probe;
mod report;
mod route;
mod runs;
mod scene;
pub mod zone;

use std::path::{Path, PathBuf};

use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    error::{Error, Result},
};
use serde::Serialize;

use crate::{cli::BenchOptions as Options, private::redis_for};
use route::{RouteCost, StaleWindow};
use runs::Reference;

/// The figures of one run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Run {
    pub name: String,
    pub users: usize,
    pub seconds: f64,
    pub users_per_second: f64,
    pub redis_cpu_seconds: f64,
    pub redis_cpu_us_per_user: f64,
    pub lookups: usize,
    pub lookup_p50_us: u64,
    pub lookup_p99_us: u64,
    pub lookup_max_us: u64,
    /// Peak resident memory of the worker process (janitor runs only).
    pub worker_peak_rss_bytes: Option<u64>,
    /// Entries still pointing at the dead server afterwards (must be 0).
    pub stale_left: u64,
    /// Entries of moved or live users that are gone or wrong afterwards (must be 0).
    pub live_lost: u64,
    /// The stale-window probes of this run (`janitor` runs only; see [`route`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_window: Option<StaleWindow>,
}

/// Ratios the targets are stated in.
#[derive(Debug, Clone, Serialize)]
pub struct Ratios {
    /// janitor users/s over unconditional users/s (target >= 1.4).
    pub throughput_vs_ceiling: f64,
    /// janitor Redis CPU per user over careful's (target <= 0.6); none on a cluster,
    /// where the careful reference (one script over two slots) cannot run.
    pub redis_cpu_vs_careful: Option<f64>,
    /// janitor users/s over naive users/s (target >= 15).
    pub speedup_vs_naive: f64,
    /// janitor peak RSS at `users` over at `baseline_users` (target <= 1.2).
    pub memory_growth: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub redis_version: String,
    pub layout: String,
    pub chunk_size: usize,
    pub chunks_in_flight: usize,
    /// The janitor's step limiter (0: off).
    pub latency_target_ms: u64,
    /// The fixed workload timed before the runs ([`calibration`]), to compare invocations.
    pub calibration: calibration::Calibration,
    /// The median run of each kind (by users per second), then the single runs.
    pub runs: Vec<Run>,
    /// Every repetition of janitor, careful and unconditional, in the order run.
    pub repeats: Vec<Run>,
    pub ratios: Ratios,
    /// `route` against a plain HGET/GET (none with `--route-lookups 0`).
    pub route_cost: Option<RouteCost>,
    /// The stale-window probes of every `janitor` repetition, summed (none with
    /// `--no-stale-window`); each repetition's own are in `repeats`.
    pub stale_window: Option<StaleWindow>,
}

/// Runs the benchmark; `worker_exe` is the binary whose `worker` command the janitor runs
/// start ([`worker_exe`]).
pub async fn run(settings: &Settings, options: &Options, worker_exe: &Path) -> Result<Report> {
    if settings.uses_sentinel() {
        return Err(Error::Setting {
            name: "redis_sentinels".into(),
            reason: "the benchmark runs on a node or a cluster, not through Sentinel".into(),
        });
    }
    let (settings, _private) = redis_for(settings, options.cluster_shape()).await?;
    let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
    let redis_version = probe::redis_version(&settings, &conn).await?;
    let root = format!(
        "{}janitor-bench:{}:",
        settings.key_prefix,
        ulid::Ulid::new()
    );
    let bench = Bench {
        settings: &settings,
        conn: &conn,
        root: &root,
        options,
        worker_exe,
    };
    let calibration = calibration::calibrate(&settings, &conn, &root).await;
    let result = match calibration {
        Ok(calibration) => all_runs(&bench).await.map(|r| (calibration, r)),
        Err(e) => Err(e),
    };
    conn::delete_prefixed(&settings, &conn, &root).await?;
    let (calibration, (runs, repeats, route_cost)) = result?;
    Ok(Report {
        redis_version,
        layout: settings.layout.as_str().into(),
        chunk_size: settings.chunk_size,
        chunks_in_flight: settings.chunks_in_flight,
        latency_target_ms: settings.latency_target_ms,
        calibration,
        ratios: ratios(&runs),
        stale_window: StaleWindow::total(repeats.iter().filter_map(|r| r.stale_window.as_ref())),
        runs,
        repeats,
        route_cost,
    })
}

/// What every run of one benchmark shares.
struct Bench<'a> {
    settings: &'a Settings,
    conn: &'a RedisConn,
    /// The key prefix under which every run seeds its own keys.
    root: &'a str,
    options: &'a Options,
    worker_exe: &'a Path,
}

/// Every run, in order: janitor, careful (single node) and unconditional interleaved
/// `repeat` times, then the janitor baseline, the naive sample and the route cost.
/// Returns the runs of the report (medians first), every repetition and the route cost.
async fn all_runs(b: &Bench<'_>) -> Result<(Vec<Run>, Vec<Run>, Option<RouteCost>)> {
    let (mut runs, mut repeats) = (Vec::new(), Vec::new());
    let users = b.options.users;
    let stale = !b.options.no_stale_window;
    for _ in 0..b.options.repeat.max(1) {
        repeats.push(runs::janitor_run(b, "janitor", users, stale).await?);
        if !b.settings.redis_cluster {
            repeats.push(runs::reference_run(b, Reference::Careful, users).await?);
        }
        repeats.push(runs::reference_run(b, Reference::Unconditional, users).await?);
    }
    for name in ["janitor", "unconditional", "careful"] {
        if repeats.iter().any(|r| r.name == name) {
            runs.push(median(&repeats, name));
        }
    }
    if b.options.baseline_users > 0 {
        let users = b.options.baseline_users;
        runs.push(runs::janitor_run(b, "janitor_baseline", users, false).await?);
    }
    let naive = b.options.naive_sample;
    runs.push(runs::reference_run(b, Reference::Naive, naive).await?);
    let route_cost = match b.options.route_lookups {
        0 => None,
        n => Some(route::route_cost(b, n).await?),
    };
    Ok((runs, repeats, route_cost))
}

/// The ratios the targets are stated in, from the report's runs.
fn ratios(runs: &[Run]) -> Ratios {
    let get = |name: &str| {
        runs.iter()
            .find(|r| r.name == name)
            .cloned()
            .unwrap_or_default()
    };
    let (janitor, ceiling, careful, naive) = (
        get("janitor"),
        get("unconditional"),
        get("careful"),
        get("naive"),
    );
    Ratios {
        throughput_vs_ceiling: janitor.users_per_second / ceiling.users_per_second.max(1e-9),
        redis_cpu_vs_careful: (careful.users > 0)
            .then(|| janitor.redis_cpu_us_per_user / careful.redis_cpu_us_per_user.max(1e-9)),
        speedup_vs_naive: janitor.users_per_second / naive.users_per_second.max(1e-9),
        memory_growth: runs
            .iter()
            .find(|r| r.name == "janitor_baseline")
            .and_then(|b| {
                Some(janitor.worker_peak_rss_bytes? as f64 / b.worker_peak_rss_bytes? as f64)
            }),
    }
}

/// The median of the runs called `name`, field by field (each figure its own median;
/// correctness figures are the worst seen, so a failure in any repetition shows).
fn median(runs: &[Run], name: &str) -> Run {
    let of: Vec<&Run> = runs.iter().filter(|r| r.name == name).collect();
    let mid_f = |f: fn(&Run) -> f64| probe::median_by(&of, f);
    let mid_u = |f: fn(&Run) -> u64| probe::median_by(&of, f);
    Run {
        name: name.into(),
        users: of.first().map_or(0, |r| r.users),
        seconds: mid_f(|r| r.seconds),
        users_per_second: mid_f(|r| r.users_per_second),
        redis_cpu_seconds: mid_f(|r| r.redis_cpu_seconds),
        redis_cpu_us_per_user: mid_f(|r| r.redis_cpu_us_per_user),
        lookups: mid_u(|r| r.lookups as u64) as usize,
        lookup_p50_us: mid_u(|r| r.lookup_p50_us),
        lookup_p99_us: mid_u(|r| r.lookup_p99_us),
        // The worst stall of any repetition: a stall target is about the worst case.
        lookup_max_us: of.iter().map(|r| r.lookup_max_us).max().unwrap_or(0),
        worker_peak_rss_bytes: of.iter().filter_map(|r| r.worker_peak_rss_bytes).max(),
        stale_left: of.iter().map(|r| r.stale_left).max().unwrap_or(0),
        live_lost: of.iter().map(|r| r.live_lost).max().unwrap_or(0),
        // Summed over the repetitions in the report's `stale_window`.
        stale_window: None,
    }
}

/// The binary the workers are started from: `--worker-exe` (a `registry-janitor`), or
/// this one (its hidden `worker` command runs the same worker code).
pub fn worker_exe(options: &Options) -> Result<PathBuf> {
    match &options.worker_exe {
        Some(exe) => Ok(exe.clone()),
        None => current_exe(),
    }
}

/// The running binary (for the lookup probe, and the workers by default).
pub fn current_exe() -> Result<PathBuf> {
    std::env::current_exe().map_err(|e| Error::io("locating the registry-janitor-lab binary", e))
}

impl Report {
    /// Why the benchmark failed, if it did: the janitor run left stale entries or lost
    /// live ones, `route` returned the dead server after its fence was recorded, or a
    /// route-cost lookup did not return the live owner.
    pub fn failures(&self) -> Option<String> {
        let janitor = self.runs.iter().find(|r| r.name == "janitor");
        if janitor.is_some_and(|j| j.stale_left > 0 || j.live_lost > 0) {
            return Some("the janitor run left stale entries or lost live ones".into());
        }
        if let Some(w) = self
            .stale_window
            .as_ref()
            .filter(|w| w.route.dead_after_verdict > 0)
        {
            return Some(format!(
                "route returned the dead server after its fence was recorded ({} of {} lookups)",
                w.route.dead_after_verdict, w.route.lookups_after_verdict
            ));
        }
        self.route_cost
            .as_ref()
            .filter(|c| c.route.wrong + c.plain.wrong > 0)
            .map(|c| {
                format!(
                    "a route-cost lookup did not return the live owner (route {}, plain {})",
                    c.route.wrong, c.plain.wrong
                )
            })
    }
}
