//! `registry-janitor-lab nemesis`: a randomized fault schedule, drawn from a seed, with the
//! janitor's invariants checked while it runs, in the manner of a Jepsen nemesis.
//!
//! A run starts its own Redis ([`topology`]), worker processes and a reconciler
//! ([`procs`]), a fleet of connection servers simulated in this process through the
//! protocol, with users registering, moving, leaving and being looked up all along
//! ([`fleet`]), and an observer that checks the invariants every few hundred
//! milliseconds ([`observer`]). On one node, where the run is root, each janitor process
//! runs in a network namespace of its own, so that a partition can cut it off from Redis
//! ([`netns`]). The nemesis applies the faults of the schedule
//! ([`schedule`]), decided from the seed before the run and printed at its start. After
//! `--duration` the faults stop, everything is healed (paused processes resumed, killed
//! ones started again, memory limit lifted), the churn stops, and the run waits for every
//! event to settle; then the registry is checked whole. A violation stops the run at
//! once and prints the seed, the schedule up to it and the keys involved ([`report`]).

mod cluster;
mod fleet;
mod netns;
mod observer;
mod procs;
mod report;
mod schedule;
mod topology;
mod verdicts;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    error::{Error, Result},
    event::{ServerDead, ServerId},
    keys::Keys,
    stream,
};

use crate::cli::{NemesisOptions as Options, TopologyName};
use fleet::{Fleet, Params};
use netns::Net;
use observer::{Observer, NONCE};
use procs::{Janitors, Place, Role};
use schedule::{Fault, RunShape, Schedule, Shape};
use topology::{Cluster, Group, Node, Topology};
use verdicts::{invariant, Verdicts};

/// What a run ended with.
pub struct Outcome {
    pub seed: u64,
    pub violations: usize,
}

/// How the schedule's faults went, in order: (index in the schedule, when it was
/// applied, what happened).
type Applied = Arc<Mutex<Vec<(usize, Duration, String)>>>;

/// Everything a fault may touch.
struct Ctx {
    seed: u64,
    topology: Arc<Topology>,
    janitors: Arc<Mutex<Janitors>>,
    fleet: Arc<Fleet>,
    observer: Arc<tokio::sync::Mutex<Observer>>,
    conn: RedisConn,
    keys: Keys,
    zones: usize,
    slots: usize,
    /// The janitor processes' network namespaces, where the run makes partitions.
    net: Option<Arc<Net>>,
    applied: Applied,
    start: Instant,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The janitor's settings for a run: short enough that faults meet cleanups in
/// progress, long enough for a busy 2-core machine.
fn run_settings(base: &Settings, topology: &Topology) -> Settings {
    let mut s = base.clone();
    topology.point(&mut s);
    s.chunk_size = 10;
    s.chunks_in_flight = 2;
    s.concurrency = 4;
    s.claim_min_idle_ms = 2000;
    // SIGKILLs and pauses are not the entries' fault: a valid event is never
    // dead-lettered for its deliveries here.
    s.max_deliveries = 1000;
    s.block_ms = 200;
    s.heartbeat_grace_ms = 3000;
    s.reconcile_interval_ms = 1000;
    s.keyspace_events_auto = true;
    s.guard_hold_grace_ms = 2 * s.heartbeat_grace_ms;
    s.drain_timeout_ms = 2000;
    s.maintenance_interval_ms = 5000;
    s.evictions = true;
    s
}

pub async fn run(base: &Settings, options: &Options) -> anyhow::Result<Outcome> {
    let seed = options.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 % 1_000_000_000)
            .unwrap_or(1)
    });
    if options.workers < 2 {
        anyhow::bail!("--workers must be at least 2 (worker-0 is never killed)");
    }
    if options.servers < options.zones + 5 || options.zones == 0 {
        anyhow::bail!("--servers must be at least --zones + 5, and --zones at least 1");
    }
    let (net, network) = network(options).await;
    let also_on = net.as_ref().map(|n| n.host_addrs()).unwrap_or_default();
    let topology = Arc::new(match options.topology {
        TopologyName::Node => Topology::Node(Node::start(&also_on).await?),
        TopologyName::Sentinel => Topology::Sentinel(Group::start().await?),
        TopologyName::Cluster => Topology::Cluster(Cluster::start().await?),
    });
    let settings = run_settings(base, &topology);
    settings.validate()?;
    let keys = Keys::for_settings(&settings);
    let shape = RunShape {
        duration: options.duration,
        workers: options.workers,
        slots: options.servers,
        zones: options.zones,
        kinds: topology.kinds(),
        partitions: net.is_some(),
    };
    let schedule = Schedule::draw(seed, &shape);
    let (log_dir, temp) = match &options.log_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating --log-dir", e))?;
            (dir.clone(), None)
        }
        None => {
            let temp = tempfile::Builder::new()
                .prefix("nemesis-")
                .tempdir()
                .map_err(|e| Error::io("creating a log directory", e))?;
            (temp.path().to_owned(), Some(temp))
        }
    };
    report::header(seed, options, &settings, &topology, &schedule, &network);

    // The janitor's own connections: to the one node, to the primary the sentinels
    // name, followed across failovers, or to the cluster, from its seeds.
    let target = conn::target_for(&settings)?;
    let conn = conn::shared_for(&target).await?;
    let verdicts = Arc::new(Verdicts::new(Instant::now()));
    let params = Params {
        layout: settings.layout,
        entries: options.entries,
        slots: options.servers,
        rate: options.rate,
        ttl: Duration::from_millis(settings.heartbeat_grace_ms),
        heartbeat_every: Duration::from_millis(300),
        settle: Duration::from_millis(500),
        deadline: options.deadline,
    };
    let fleet = Fleet::new(
        keys.clone(),
        params,
        conn::shared_for(&target).await?,
        conn::shared_for(&target).await?,
        verdicts.clone(),
        seed,
        verdicts.stop.clone(),
    );
    fleet.start(0.6).await;
    let exe = match &options.janitor_exe {
        Some(exe) => exe.clone(),
        None => std::env::current_exe().map_err(|e| Error::io("locating this binary", e))?,
    };
    let places = net
        .iter()
        .flat_map(|n| &n.links)
        .filter_map(|link| {
            Some(Place {
                netns: link.netns.clone(),
                redis_url: topology.url_at(link.host_addr)?,
            })
        })
        .collect();
    let janitors = Arc::new(Mutex::new(Janitors::start(
        &exe,
        procs::janitor_env(&settings),
        &log_dir,
        options.workers,
        places,
    )?));
    let observer = Arc::new(tokio::sync::Mutex::new(Observer::new(
        fleet.clone(),
        janitors.clone(),
        verdicts.clone(),
        conn.clone(),
        keys.clone(),
        settings.max_payload_bytes,
    )));
    wait_joined(&conn, &keys, options.workers).await;

    let start = Instant::now();
    verdicts.restart_clock(start);
    let ctx = Arc::new(Ctx {
        seed,
        topology: topology.clone(),
        janitors: janitors.clone(),
        fleet: fleet.clone(),
        observer: observer.clone(),
        conn: conn.clone(),
        keys: keys.clone(),
        zones: options.zones,
        slots: options.servers,
        net: net.clone(),
        applied: Arc::default(),
        start,
    });
    let load = tokio::spawn(fleet.clone().run_load());
    let watching = tokio_util::sync::CancellationToken::new();
    let watch = tokio::spawn(watch(observer.clone(), verdicts.clone(), watching.clone()));
    let sentinels = tokio::spawn({
        let (topology, verdicts, stop) = (topology.clone(), verdicts.clone(), watching.clone());
        async move {
            match &*topology {
                Topology::Sentinel(group) => group.watch(verdicts, stop).await,
                Topology::Cluster(cluster) => cluster.watch(verdicts, stop).await,
                Topology::Node(_) => {}
            }
        }
    });
    let faults = tokio::spawn(inject(ctx.clone(), schedule.clone(), verdicts.clone()));
    let progress = tokio::spawn(progress(
        ctx.clone(),
        verdicts.clone(),
        schedule.faults.len(),
    ));

    // The faults run their course, unless a violation stops the run.
    tokio::select! {
        _ = tokio::time::sleep(options.duration) => {}
        _ = verdicts.stop.cancelled() => {}
    }
    let in_flight = faults.await.unwrap_or_default();
    let mut settled_in = None;
    if !verdicts.failed() {
        // Faults already begun finish (a paused worker is resumed, a killed one started
        // again, Redis brought back); then everything is healed and the churn stops.
        for task in in_flight {
            let _ = task.await;
        }
        heal(&ctx).await;
        fleet
            .churn
            .store(false, std::sync::atomic::Ordering::Relaxed);
        settled_in = settle(&ctx, &verdicts, options.deadline).await;
    }
    watching.cancel();
    let _ = watch.await;
    let _ = sentinels.await;
    progress.abort();
    if !verdicts.failed() {
        final_checks(&ctx, &verdicts).await;
    }
    verdicts.stop.cancel();
    let _ = load.await;
    let exits = tokio::task::spawn_blocking({
        let janitors = janitors.clone();
        move || lock(&janitors).terminate(Duration::from_secs(15))
    })
    .await
    .unwrap_or_default();
    if let Some(net) = &net {
        let net = net.clone();
        let _ = tokio::task::spawn_blocking(move || net.teardown()).await;
    }
    let logs = lock(&janitors).logs.clone();
    for (name, log) in &logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("panicked at")) {
            verdicts.violation(
                invariant::PROCESSES_UP,
                format!("{name} panicked: {line}"),
                vec![format!("its log: {}", log.display())],
            );
        }
    }
    if settled_in.is_some() {
        for (name, code, log) in &exits {
            if *code != Some(0) {
                verdicts.violation(
                    invariant::PROCESSES_UP,
                    format!("{name} did not exit 0 on SIGTERM (exit code {code:?})"),
                    vec![format!(
                        "its log ({}):\n{}",
                        log.display(),
                        procs::tail(log, 20)
                    )],
                );
            }
        }
    }

    let observer = observer.lock().await;
    let violations = verdicts.violations();
    let kept_logs = if violations.is_empty() {
        None
    } else {
        std::fs::write(log_dir.join("redis.log"), topology.log()).ok();
        Some(match temp {
            Some(temp) => temp.keep(),
            None => log_dir.clone(),
        })
    };
    report::summary(&report::Inputs {
        seed,
        options,
        schedule: &schedule,
        applied: &lock(&ctx.applied),
        verdicts: &verdicts,
        fleet: &fleet,
        observer: &observer,
        janitors: &lock(&janitors),
        settled_in,
        logs: kept_logs.as_deref().or(options.log_dir.as_deref()),
        redis: topology.summary().as_deref(),
    });
    Ok(Outcome {
        seed,
        violations: violations.len(),
    })
}

/// The janitor processes' network namespaces, where partitions can be made (one node,
/// root, `ip netns`, and no `--no-partitions`), and the header's line on it. Leftovers of
/// dead runs are removed wherever the run is root.
async fn network(options: &Options) -> (Option<Arc<Net>>, String) {
    let why_not = match options.topology {
        TopologyName::Node if options.no_partitions => Some("--no-partitions".to_owned()),
        TopologyName::Node => None,
        _ => Some("on one node only".to_owned()),
    };
    let count = options.workers + 1;
    let made = tokio::task::spawn_blocking(move || match why_not {
        Some(why) => {
            if netns::unavailable().is_none() {
                netns::clean_leftovers();
            }
            Err(why)
        }
        None => Net::setup(count),
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    match made {
        Ok(net) => {
            let (first, last) = (&net.links[0], &net.links[count - 1]);
            let line = format!(
                "network: each worker and the reconciler in a network namespace of its own \
                 ({}..{}), reaching Redis at the host end of its veth pair ({}..{}); \
                 partitions drawn",
                first.netns, last.netns, first.host_addr, last.host_addr
            );
            (Some(Arc::new(net)), line)
        }
        Err(why) => (
            None,
            format!("network: the host's; no partitions drawn ({why})"),
        ),
    }
}

/// Waits (up to 30 s) until `workers` consumers have joined the group.
async fn wait_joined(conn: &RedisConn, keys: &Keys, workers: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let joined = registry_janitor::status::collect_from(conn, keys)
            .await
            .map(|s| s.consumers.len())
            .unwrap_or(0);
        if joined >= workers {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The observer's rounds, every 400 ms, until `until` (or a violation).
async fn watch(
    observer: Arc<tokio::sync::Mutex<Observer>>,
    verdicts: Arc<Verdicts>,
    until: tokio_util::sync::CancellationToken,
) {
    loop {
        observer.lock().await.round().await;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(400)) => {}
            _ = until.cancelled() => return,
            _ = verdicts.stop.cancelled() => return,
        }
    }
}

/// Applies the schedule; returns the faults still running when it ends (or a violation
/// stopped it).
async fn inject(
    ctx: Arc<Ctx>,
    schedule: Schedule,
    verdicts: Arc<Verdicts>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut running = Vec::new();
    for (i, planned) in schedule.faults.into_iter().enumerate() {
        tokio::select! {
            _ = tokio::time::sleep_until((ctx.start + planned.at).into()) => {}
            _ = verdicts.stop.cancelled() => break,
        }
        let ctx = ctx.clone();
        running.push(tokio::spawn(async move {
            let note = apply(&ctx, i, planned.fault).await;
            lock(&ctx.applied).push((i, ctx.start.elapsed(), note));
        }));
        running.retain(|t| !t.is_finished());
    }
    running
}

/// Applies one fault to its end; says what happened.
async fn apply(ctx: &Ctx, index: usize, fault: Fault) -> String {
    match fault {
        Fault::WorkerKill { worker, back_after } => {
            let i = lock(&ctx.janitors).worker_index(worker).expect("a worker");
            let pid = lock(&ctx.janitors).pid(i);
            if !lock(&ctx.janitors).kill(i) {
                return "skipped: no process".into();
            }
            lock(&ctx.fleet.worker_kills).push(Instant::now());
            tokio::time::sleep(back_after).await;
            match lock(&ctx.janitors).respawn(i) {
                Ok(()) => format!("killed pid {}, a new one started", pid.unwrap_or(0)),
                Err(e) => format!(
                    "killed pid {}, the new one did not start: {e}",
                    pid.unwrap_or(0)
                ),
            }
        }
        Fault::WorkerPause { worker, pause } => {
            let i = lock(&ctx.janitors).worker_index(worker).expect("a worker");
            let Some(pid) = lock(&ctx.janitors).signal(i, "STOP") else {
                return "skipped: no process".into();
            };
            tokio::time::sleep(pause).await;
            if lock(&ctx.janitors).pid(i) == Some(pid) {
                lock(&ctx.janitors).signal(i, "CONT");
            }
            format!("paused pid {pid}")
        }
        Fault::RedisRestart { down } => {
            if let Err(e) = ctx.topology.kill_redis().await {
                return format!("the kill failed: {e}");
            }
            tokio::time::sleep(down).await;
            restart_redis(ctx).await
        }
        Fault::SentinelFailover { down } => match ctx.topology.failover(down).await {
            Ok(note) => note,
            Err(e) => format!("the failover failed: {e}"),
        },
        Fault::ClusterFailover { master, down } => {
            match ctx.topology.cluster_failover(master, Some(down)).await {
                Ok(note) => note,
                Err(e) => format!("the failover failed: {e}"),
            }
        }
        Fault::ClusterManualFailover { master } => {
            match ctx.topology.cluster_failover(master, None).await {
                Ok(note) => note,
                Err(e) => format!("the failover failed: {e}"),
            }
        }
        Fault::Busy { busy, master } => match ctx.topology.busy(busy, master).await {
            Ok(node) if master.is_some() => format!("ran on {node}"),
            Ok(_) => "ran".into(),
            Err(e) => format!("the script failed: {e}"),
        },
        Fault::OomSqueeze {
            squeeze,
            hard,
            master,
        } => {
            let (limit, node) = match ctx.topology.squeeze(hard, master).await {
                Ok(set) => set,
                Err(e) => return format!("skipped: {e}"),
            };
            tokio::time::sleep(squeeze).await;
            release_memory(ctx).await;
            let on = if master.is_some() {
                format!(" on {node}")
            } else {
                String::new()
            };
            format!("maxmemory {limit}{on} for {:.1}s", squeeze.as_secs_f64())
        }
        Fault::Zombie { slot } => match ctx.fleet.zombie(slot) {
            Some(z) => format!("{z} hangs"),
            None => "skipped: the slot's server is not live".into(),
        },
        Fault::ServerCrash {
            slot,
            back_after,
            monitoring,
        } => crash(ctx, &[slot], back_after, monitoring, "crash"),
        Fault::ZoneOutage {
            zone,
            back_after,
            monitoring,
        } => {
            let slots: Vec<usize> = (0..ctx.slots).filter(|s| s % ctx.zones == zone).collect();
            crash(ctx, &slots, back_after, monitoring, "zone")
        }
        Fault::DeadUnknown { count } => {
            let mut published = Vec::new();
            for k in 0..count {
                let ghost =
                    ServerId::parse(&format!("ghost-{}-{index}-{k}", ctx.seed)).expect("valid");
                let event =
                    ServerDead::new(&ghost, Some("never existed".into()), Some("nemesis".into()));
                if publish(
                    ctx,
                    &[(b"type", b"server.dead"), (b"payload", &event.encode())],
                )
                .await
                {
                    published.push(ghost.to_string());
                }
            }
            format!("published for {}", published.join(", "))
        }
        Fault::DeadAgain { pick } => {
            let acked = ctx.observer.lock().await.acked.clone();
            if acked.is_empty() {
                return "skipped: no server cleaned yet".into();
            }
            let server = &acked[pick as usize % acked.len()];
            let event = ServerDead::new(server, Some("again".into()), Some("nemesis".into()));
            if publish(
                ctx,
                &[(b"type", b"server.dead"), (b"payload", &event.encode())],
            )
            .await
            {
                format!("published again for {server}")
            } else {
                "Redis refused the event".into()
            }
        }
        Fault::Partition { worker, cut } => partition(ctx, worker, cut).await,
        Fault::Malformed { shapes } => {
            let mut out = Vec::new();
            for (k, shape) in shapes.iter().enumerate() {
                let nonce = format!("{}-{index}-{k}", ctx.seed);
                let fields = malformed(*shape, &nonce);
                let pairs: Vec<(&[u8], &[u8])> = fields
                    .iter()
                    .map(|(k, v)| (k.as_slice(), v.as_slice()))
                    .collect();
                let ok = publish(ctx, &pairs).await;
                out.push(format!(
                    "{}{}",
                    shape.name(),
                    if ok { "" } else { " (refused)" }
                ));
            }
            format!("published {}", out.join(", "))
        }
    }
}

/// Cuts a worker (or the reconciler, `None`) off from Redis for `cut`, then joins it
/// again (the link up, tried for up to 5 s).
async fn partition(ctx: &Ctx, worker: Option<usize>, cut: Duration) -> String {
    let Some(net) = ctx.net.clone() else {
        return "skipped: no network namespaces".into();
    };
    let role = worker.map_or(Role::Reconciler, Role::Worker);
    let Some(k) = lock(&ctx.janitors).index(role) else {
        return format!("skipped: no {}", role.name());
    };
    let pid = lock(&ctx.janitors).pid(k).unwrap_or(0);
    let link = net.clone();
    match tokio::task::spawn_blocking(move || link.cut(k)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return format!("skipped: the cut failed: {e}"),
        Err(e) => return format!("skipped: the cut failed: {e}"),
    }
    tokio::time::sleep(cut).await;
    let mut healed = Err(String::new());
    for _ in 0..25 {
        let link = net.clone();
        healed = tokio::task::spawn_blocking(move || link.heal(k))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        if healed.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let name = role.name();
    match healed {
        Ok(()) => format!(
            "{name} (pid {pid}) cut off for {:.1}s, then joined again",
            cut.as_secs_f64()
        ),
        Err(e) => format!("{name} (pid {pid}) cut off; joining it again failed: {e}"),
    }
}

/// Publishes an entry on the events stream, retried for up to 10 s (Redis may be away).
async fn publish(ctx: &Ctx, fields: &[(&[u8], &[u8])]) -> bool {
    for _ in 0..20 {
        if stream::publish(&ctx.conn, &ctx.keys.events(), fields)
            .await
            .is_ok()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

fn crash(
    ctx: &Ctx,
    slots: &[usize],
    back_after: Duration,
    monitoring: bool,
    how: &'static str,
) -> String {
    let crashed = ctx.fleet.crash(slots, back_after, how);
    if crashed.is_empty() {
        return "skipped: no live server there".into();
    }
    let names: Vec<String> = crashed.iter().map(|s| s.to_string()).collect();
    if monitoring {
        ctx.fleet.report_dead_later(crashed);
    }
    format!("{} crashed", names.join(", "))
}

/// The entry of a malformed shape, marked with `nonce`.
fn malformed(shape: Shape, nonce: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let server = ServerId::parse(&format!("gw-malformed#{nonce}")).expect("valid");
    let valid = ServerDead::new(&server, None, Some("nemesis".into()));
    let mut fields: Vec<(Vec<u8>, Vec<u8>)> = match shape {
        Shape::JunkPayload => vec![
            (b"type".to_vec(), b"server.dead".to_vec()),
            (b"payload".to_vec(), b"\x00junk\xff".to_vec()),
        ],
        Shape::NoPayload => vec![(b"type".to_vec(), b"server.dead".to_vec())],
        Shape::NoType => vec![(b"payload".to_vec(), valid.encode())],
        Shape::BadServerId => {
            let mut bad = valid.clone();
            bad.server_id = "gw bad{slot}".into();
            vec![
                (b"type".to_vec(), b"server.dead".to_vec()),
                (b"payload".to_vec(), bad.encode()),
            ]
        }
        Shape::Truncated => {
            let bytes = valid.encode();
            vec![
                (b"type".to_vec(), b"server.dead".to_vec()),
                (b"payload".to_vec(), bytes[..bytes.len() / 2].to_vec()),
            ]
        }
        Shape::FutureVersion => {
            let mut future = valid.clone();
            future.v = 9;
            vec![
                (b"type".to_vec(), b"server.dead".to_vec()),
                (b"payload".to_vec(), future.encode()),
            ]
        }
        Shape::Foreign => vec![
            (b"type".to_vec(), b"user.left".to_vec()),
            (b"payload".to_vec(), valid.encode()),
        ],
    };
    fields.push((NONCE.as_bytes().to_vec(), nonce.as_bytes().to_vec()));
    fields
}

async fn restart_redis(ctx: &Ctx) -> String {
    for attempt in 1..=5 {
        match ctx.topology.restart_redis().await {
            Ok(()) => return "restarted from its append-only file".into(),
            Err(e) if attempt == 5 => return format!("did not restart: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
    unreachable!()
}

async fn release_memory(ctx: &Ctx) {
    for _ in 0..30 {
        if ctx.topology.release().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Every process running, resumed and joined to Redis, no memory limit.
async fn heal(ctx: &Ctx) {
    if let Some(net) = ctx.net.clone() {
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || net.heal_all()).await {
            eprintln!("nemesis: a link did not come up again: {e}");
        }
    }
    if let Err(e) = lock(&ctx.janitors).heal() {
        eprintln!("nemesis: a process did not start again: {e}");
    }
    release_memory(ctx).await;
}

/// The quiet end: the observer runs until every event is settled and every dead server
/// acknowledged; returns how long that took, or None (a violation) after `deadline`.
async fn settle(ctx: &Ctx, verdicts: &Verdicts, deadline: Duration) -> Option<Duration> {
    let began = Instant::now();
    eprintln!(
        "nemesis: faults over at +{:.1}s; waiting for every event to settle",
        ctx.start.elapsed().as_secs_f64()
    );
    loop {
        if verdicts.failed() {
            return None;
        }
        {
            let o = ctx.observer.lock().await;
            let busy = ctx.fleet.truth().members.iter().any(|m| m.busy);
            if o.settled() && !busy && o.unsettled_malformed().is_empty() {
                return Some(began.elapsed());
            }
            if began.elapsed() > deadline {
                let waiting = o.waiting();
                drop(o);
                verdicts.violation(
                    invariant::EVENTS_SETTLED,
                    format!(
                        "not settled {} s after the faults stopped ({} things wait)",
                        deadline.as_secs(),
                        waiting.len()
                    ),
                    waiting,
                );
                return None;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The registry whole, once settled: every entry's owner is what the load last wrote,
/// no entry names a dead server, every deletion announced exactly once, and no janitor
/// key of a cleaned server left.
async fn final_checks(ctx: &Ctx, verdicts: &Verdicts) {
    let mut observer = ctx.observer.lock().await;
    observer.round().await;
    if verdicts.failed() {
        return;
    }
    let mut entries = match scan_entries(ctx).await {
        Ok(entries) => entries,
        Err(e) => {
            verdicts.violation(
                invariant::ACKED_CLEAN,
                format!("the final scan failed: {e}"),
                vec![],
            );
            return;
        }
    };
    if ctx.fleet.cluster {
        // On a cluster an entry may name a cleaned server until the drift sweep's next
        // pass: scanned again for up to `SWEPT_WITHIN` while one does.
        let began = Instant::now();
        while began.elapsed() < observer::SWEPT_WITHIN
            && entries
                .iter()
                .any(|(_, owner)| ServerId::parse(owner).is_ok_and(|o| observer.acked.contains(&o)))
        {
            tokio::time::sleep(Duration::from_secs(2)).await;
            match scan_entries(ctx).await {
                Ok(again) => entries = again,
                Err(e) => {
                    verdicts.violation(
                        invariant::ACKED_CLEAN,
                        format!("the final scan failed: {e}"),
                        vec![],
                    );
                    return;
                }
            }
        }
    }
    let announced_inv = observer.announced_invariant();
    let kills = lock(&ctx.fleet.worker_kills).clone();
    let (stale, bad, announced_wrong) = {
        let t = ctx.fleet.truth();
        let acked_set: std::collections::HashSet<&ServerId> = observer.acked.iter().collect();
        let mut seen = std::collections::HashSet::new();
        let (mut bad, mut stale) = (Vec::new(), Vec::new());
        for (member, owner) in &entries {
            let Some(&m) = t.by_bytes.get(member) else {
                bad.push(format!(
                    "an entry the load never wrote: {} -> {owner}",
                    fleet::show(member)
                ));
                continue;
            };
            seen.insert(m);
            let owner_id = ServerId::parse(owner).ok();
            if owner_id.as_ref().is_some_and(|o| acked_set.contains(o)) {
                stale.push(format!(
                    "{} names cleaned server {owner}; {}",
                    fleet::show(member),
                    t.describe(m)
                ));
                continue;
            }
            let fine = match &t.members[m].owner {
                fleet::Owner::Known(Some(s)) => t.is_live(s) && s.as_str() == owner,
                fleet::Owner::Known(None) => false,
                fleet::Owner::Uncertain(possible) => possible.contains(&owner_id),
            };
            if !fine {
                bad.push(format!(
                    "{} names {owner}; {}",
                    fleet::show(member),
                    t.describe(m)
                ));
            }
        }
        verdicts.checked(invariant::ACKED_CLEAN, entries.len() as u64);
        // Live entries that are gone, and deletions not announced exactly once.
        let mut announced_wrong = Vec::new();
        for (m, member) in t.members.iter().enumerate() {
            match &member.owner {
                fleet::Owner::Known(Some(s)) if t.is_live(s) && !seen.contains(&m) => {
                    bad.push(format!(
                        "{} of live {s} is gone; {}",
                        fleet::show(&member.bytes),
                        t.describe(m)
                    ));
                }
                fleet::Owner::Known(Some(s)) if !t.is_live(s) => {
                    let n = observer.announced_count(s, &member.bytes);
                    if n != 1 && !(ctx.fleet.cluster && n > 1) {
                        announced_wrong.push(format!(
                            "{} of dead {s} deleted and announced {n} times; {}",
                            fleet::show(&member.bytes),
                            t.describe(m)
                        ));
                    }
                }
                _ => {}
            }
        }
        for e in &t.expected {
            let n = observer.announced_count(&e.server, &t.members[e.member].bytes);
            // On a cluster: at least once, unless a worker was killed between the
            // server's death and the find (see the observer).
            let fine = if ctx.fleet.cluster {
                n >= 1 || observer::killed_between(&t, &kills, &e.server, e.at)
            } else {
                n == 1
            };
            if !fine {
                announced_wrong.push(format!(
                    "{} of dead {} deleted and announced {n} times",
                    fleet::show(&t.members[e.member].bytes),
                    e.server
                ));
            }
        }
        verdicts.checked(announced_inv, t.expected.len() as u64);
        (stale, bad, announced_wrong)
    };
    if let Some(first) = stale.first() {
        verdicts.violation(
            invariant::ACKED_CLEAN,
            format!(
                "the final scan found {} entries naming cleaned servers: {first}",
                stale.len()
            ),
            stale.iter().skip(1).take(10).cloned().collect(),
        );
        return;
    }
    let acked = observer.acked.clone();
    if let Some(first) = bad.first() {
        verdicts.violation(
            invariant::LIVE_KEPT,
            format!(
                "the final scan found {} entries not as the load left them: {first}",
                bad.len()
            ),
            bad.iter().skip(1).take(10).cloned().collect(),
        );
        return;
    }
    if let Some(first) = announced_wrong.first() {
        verdicts.violation(
            announced_inv,
            format!(
                "{} deletions not announced {}: {first}",
                announced_wrong.len(),
                if ctx.fleet.cluster {
                    "at least once"
                } else {
                    "exactly once"
                }
            ),
            announced_wrong.iter().skip(1).take(10).cloned().collect(),
        );
        return;
    }
    // The janitor's keys of every cleaned server are gone.
    let mut left = Vec::new();
    for server in acked.iter().filter(|s| !s.as_str().starts_with("ghost-")) {
        let keys = [
            ctx.keys.server_users(server),
            ctx.keys.server_walking(server),
            ctx.keys.server_cleanup(server),
        ];
        let exists = keys
            .iter()
            .map(|k| redis::cmd("EXISTS").arg(k).to_owned())
            .collect();
        let exist: Vec<bool> = conn::each_in_flight(&ctx.conn, exists)
            .await
            .unwrap_or_default();
        for (k, e) in keys.iter().zip(exist) {
            if e {
                left.push(k.clone());
            }
        }
    }
    verdicts.checked(invariant::ACKED_CLEAN, acked.len() as u64);
    if !left.is_empty() {
        verdicts.violation(
            invariant::ACKED_CLEAN,
            format!(
                "{} keys of cleaned servers are left: {}",
                left.len(),
                left.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
            ),
            left,
        );
    }
}

/// Every forward entry in Redis: (entry, owner).
async fn scan_entries(ctx: &Ctx) -> Result<Vec<(Vec<u8>, String)>> {
    use registry_janitor::config::Layout;
    let mut c = ctx.conn.clone();
    let mut out = Vec::new();
    match ctx.fleet.params.layout {
        Layout::Hash => {
            let mut cursor = 0u64;
            loop {
                let (next, pairs): (u64, Vec<(Vec<u8>, String)>) = redis::cmd("HSCAN")
                    .arg(ctx.keys.registry())
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut c)
                    .await?;
                out.extend(pairs);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        layout => {
            let pattern = match layout {
                Layout::Conns => ctx.keys.user_conns_pattern(),
                _ => registry_janitor::keys::pattern_under(&ctx.keys.user_key_prefix()),
            };
            // SCAN is per node: on a cluster, every master's keys.
            let mut found = Vec::new();
            if ctx.fleet.cluster {
                for (host, port) in conn::cluster_masters(&ctx.conn).await? {
                    let node = conn::shared(&conn::client(&format!("redis://{host}:{port}"))?)?;
                    scan_all(&node, &pattern, &mut found).await?;
                }
            } else {
                scan_all(&ctx.conn, &pattern, &mut found).await?;
            }
            {
                for key in found {
                    if layout == Layout::Conns {
                        let fields: Vec<(Vec<u8>, String)> =
                            redis::cmd("HGETALL").arg(&key).query_async(&mut c).await?;
                        let prefix = ctx.keys.user_key_prefix().len() + 1;
                        let user = &key[prefix..key.len() - b"}:conns".len()];
                        for (connection, owner) in fields {
                            let connection = String::from_utf8_lossy(&connection).into_owned();
                            out.push((
                                registry_janitor::keys::conn_member(&connection, user),
                                owner,
                            ));
                        }
                    } else {
                        let owner: Option<String> =
                            redis::cmd("GET").arg(&key).query_async(&mut c).await?;
                        let user = key[ctx.keys.user_key_prefix().len()..].to_vec();
                        out.extend(owner.map(|o| (user, o)));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Every key matching `pattern` on the node of `conn`.
async fn scan_all(conn: &RedisConn, pattern: &str, out: &mut Vec<Vec<u8>>) -> Result<()> {
    let mut cursor = 0u64;
    loop {
        let (next, found) = conn::scan_page(conn, cursor, pattern, 1000, None).await?;
        out.extend(found);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// A line every 15 s on stderr: where the run is.
async fn progress(ctx: Arc<Ctx>, verdicts: Arc<Verdicts>, planned: usize) {
    let mut last: BTreeMap<&'static str, u64> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_secs(15)).await;
        let applied = lock(&ctx.applied).len();
        let s = &ctx.fleet.stats;
        use std::sync::atomic::Ordering::Relaxed;
        let checks = verdicts.checks();
        let total: u64 = checks.values().sum();
        let before: u64 = last.values().sum();
        last = checks;
        eprintln!(
            "nemesis: +{:>5.0}s  faults {applied}/{planned}  ops {}  died {}  checks +{}  violations {}",
            ctx.start.elapsed().as_secs_f64(),
            s.registers.load(Relaxed) + s.moves.load(Relaxed) + s.unregisters.load(Relaxed) + s.routes.load(Relaxed),
            s.servers_died.load(Relaxed),
            total - before,
            verdicts.violations().len()
        );
    }
}
