//! What `route` (route.lua) costs next to a plain HGET or GET of the forward entry:
//! latency and Redis CPU per lookup, runs of each kind interleaved.

use std::{sync::Arc, time::Instant};

use rand::{rngs::StdRng, Rng, SeedableRng};
use registry_janitor::{config::Layout, conn, error::Result};
use serde::Serialize;
use tokio::task::JoinHandle;

use super::Lookup;
use crate::bench::{
    probe::{command_usec, redis_cpu},
    scene::{scene, Scene},
    Bench,
};

/// Lookups in flight during the route-cost runs: each on a connection of its own, one
/// after the other (a few routers, each waiting for its answer).
pub const ROUTE_IN_FLIGHT: usize = 4;

/// One run of `lookups` lookups of one kind.
#[derive(Debug, Clone, Serialize)]
pub struct LookupCost {
    pub lookup: Lookup,
    pub lookups: usize,
    pub seconds: f64,
    pub lookups_per_second: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    /// Redis main-thread CPU over the run (INFO cpu; every master on a cluster).
    pub redis_cpu_seconds: f64,
    pub redis_cpu_us_per_lookup: f64,
    /// Of that, the execution of the lookup's command alone (EVALSHA, or HGET/GET), per
    /// lookup (INFO commandstats): without reading requests and writing replies, which
    /// cost both kinds the same. One node only (on a cluster, route is several commands).
    pub redis_exec_us_per_lookup: Option<f64>,
    /// Lookups that did not return the owner seeded (must be 0: every owner is alive).
    pub wrong: u64,
}

/// `route` against a plain HGET/GET: the same random users of the same registry, every
/// owner alive and unfenced, so that route does all its work and returns the owner.
#[derive(Debug, Clone, Serialize)]
pub struct RouteCost {
    /// Users in the registry (the dead server's scene, both servers alive here).
    pub registry_users: usize,
    pub in_flight: usize,
    /// How route ran: `EVALSHA` (one node) or `2 round trips` (a cluster: the owner, then
    /// its fence and liveness keys).
    pub route_path: String,
    /// The median run of each kind, field by field (`max_us`: the worst; `wrong`: the sum).
    pub route: LookupCost,
    pub plain: LookupCost,
    /// route over plain: Redis CPU per lookup, execution per lookup (one node), p50 and
    /// p99 latency.
    pub cpu_ratio: f64,
    pub exec_ratio: Option<f64>,
    pub p50_ratio: f64,
    pub p99_ratio: f64,
    /// Every run, plain then route, `repeat` times, in the order run.
    pub repeats: Vec<LookupCost>,
}

/// Seeds the dead server's scene with `users` users, makes both servers alive, then times
/// `lookups` plain lookups and as many routes, interleaved `repeat` times.
pub(in crate::bench) async fn route_cost(b: &Bench<'_>, lookups: usize) -> Result<RouteCost> {
    let Bench { settings, conn, .. } = *b;
    let scene = scene(settings, b.root, "route_cost", b.options.users, b.options);
    scene.seed(conn).await?;
    let result = async {
        // The dead server of this scene is alive: every owner is, so route returns it.
        scene
            .registry
            .heartbeat(conn, &scene.dead, 3_600_000)
            .await?;
        let mut rng = StdRng::seed_from_u64(13);
        let picks: Arc<Vec<(Vec<u8>, String)>> = Arc::new(
            (0..lookups)
                .map(|_| {
                    let n = rng.random_range(0..scene.users.max(1));
                    let owner = if scene.moved(n) {
                        &scene.live
                    } else {
                        &scene.dead
                    };
                    (scene.dead_user(n), owner.as_str().to_owned())
                })
                .collect(),
        );
        let mut repeats = Vec::new();
        for _ in 0..b.options.repeat.max(1) {
            for lookup in [Lookup::Plain, Lookup::Route] {
                repeats.push(lookup_run(b, &scene, lookup, &picks).await?);
            }
        }
        let route = median(&repeats, Lookup::Route);
        let plain = median(&repeats, Lookup::Plain);
        let ratio = |a: f64, b: f64| a / b.max(1e-9);
        Ok(RouteCost {
            registry_users: scene.users,
            in_flight: ROUTE_IN_FLIGHT,
            route_path: match conn.is_cluster() {
                false => "EVALSHA_RO".into(),
                true => "2 round trips".into(),
            },
            cpu_ratio: ratio(route.redis_cpu_us_per_lookup, plain.redis_cpu_us_per_lookup),
            exec_ratio: route
                .redis_exec_us_per_lookup
                .zip(plain.redis_exec_us_per_lookup)
                .map(|(r, p)| ratio(r, p)),
            p50_ratio: ratio(route.p50_us as f64, plain.p50_us as f64),
            p99_ratio: ratio(route.p99_us as f64, plain.p99_us as f64),
            route,
            plain,
            repeats,
        })
    }
    .await;
    conn::delete_prefixed(settings, conn, scene.keys.prefix()).await?;
    result
}

/// What one connection of a [`lookup_run`] saw: latencies (us), wrong answers.
type Lane = (Vec<u64>, u64);

/// One timed run: [`ROUTE_IN_FLIGHT`] connections, each looking up its share of `picks`
/// one after the other. The connections are opened and warmed up (route.lua loaded)
/// before the clock and the CPU reading start.
async fn lookup_run(
    b: &Bench<'_>,
    scene: &Scene,
    lookup: Lookup,
    picks: &Arc<Vec<(Vec<u8>, String)>>,
) -> Result<LookupCost> {
    let target = conn::target_for(b.settings)?;
    let mut lanes = Vec::new();
    for _ in 0..ROUTE_IN_FLIGHT {
        let c = conn::shared_for(&target).await?;
        if let Some((user, _)) = picks.first() {
            lookup.owner(&scene.registry, &c, user).await?;
        }
        lanes.push(c);
    }
    let command = match (lookup, b.settings.layout) {
        (Lookup::Route, _) => "evalsha_ro",
        (Lookup::Plain, Layout::Hash | Layout::Conns) => "hget",
        (Lookup::Plain, Layout::Keys) => "get",
    };
    let single = !b.conn.is_cluster();
    let exec_before = match single {
        true => Some(command_usec(b.conn, command).await?),
        false => None,
    };
    let cpu_before = redis_cpu(b.settings, b.conn).await?;
    let started = Instant::now();
    let tasks: Vec<JoinHandle<Result<Lane>>> = lanes
        .into_iter()
        .enumerate()
        .map(|(lane, c)| {
            let (picks, registry) = (picks.clone(), scene.registry.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(picks.len() / ROUTE_IN_FLIGHT + 1);
                let mut wrong = 0;
                for (user, owner) in picks.iter().skip(lane).step_by(ROUTE_IN_FLIGHT) {
                    let t = Instant::now();
                    let got = lookup.owner(&registry, &c, user).await?;
                    latencies.push(t.elapsed().as_micros() as u64);
                    wrong += u64::from(got.as_deref() != Some(owner.as_str()));
                }
                Ok((latencies, wrong))
            })
        })
        .collect();
    let (mut latencies, mut wrong) = (Vec::with_capacity(picks.len()), 0);
    for task in tasks {
        let (l, w) = task.await??;
        latencies.extend(l);
        wrong += w;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = redis_cpu(b.settings, b.conn).await? - cpu_before;
    let redis_exec_us_per_lookup = match exec_before {
        Some((calls_before, usec_before)) => {
            let (calls, usec) = command_usec(b.conn, command).await?;
            // Every lookup is one call of `command` (route.lua was loaded in the warm-up).
            let calls = calls.saturating_sub(calls_before).max(1);
            Some(usec.saturating_sub(usec_before) as f64 / calls as f64)
        }
        None => None,
    };
    latencies.sort_unstable();
    let pct = |p: f64| crate::bench::probe::percentile(&latencies, p);
    Ok(LookupCost {
        lookup,
        lookups: latencies.len(),
        seconds,
        lookups_per_second: latencies.len() as f64 / seconds.max(1e-9),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        max_us: latencies.last().copied().unwrap_or(0),
        redis_cpu_seconds: cpu,
        redis_cpu_us_per_lookup: cpu * 1e6 / latencies.len().max(1) as f64,
        redis_exec_us_per_lookup,
        wrong,
    })
}

/// The median of the runs of `lookup`, field by field; `max_us` the worst of them and
/// `wrong` their sum, so that one bad run shows.
fn median(runs: &[LookupCost], lookup: Lookup) -> LookupCost {
    let of: Vec<&LookupCost> = runs.iter().filter(|r| r.lookup == lookup).collect();
    let mid_f = |f: fn(&LookupCost) -> f64| crate::bench::probe::median_by(&of, f);
    let mid_u = |f: fn(&LookupCost) -> u64| crate::bench::probe::median_by(&of, f);
    LookupCost {
        lookup,
        lookups: mid_u(|r| r.lookups as u64) as usize,
        seconds: mid_f(|r| r.seconds),
        lookups_per_second: mid_f(|r| r.lookups_per_second),
        p50_us: mid_u(|r| r.p50_us),
        p99_us: mid_u(|r| r.p99_us),
        max_us: of.iter().map(|r| r.max_us).max().unwrap_or(0),
        redis_cpu_seconds: mid_f(|r| r.redis_cpu_seconds),
        redis_cpu_us_per_lookup: mid_f(|r| r.redis_cpu_us_per_lookup),
        redis_exec_us_per_lookup: of
            .iter()
            .all(|r| r.redis_exec_us_per_lookup.is_some())
            .then(|| mid_f(|r| r.redis_exec_us_per_lookup.unwrap_or(0.0))),
        wrong: of.iter().map(|r| r.wrong).sum(),
    }
}
