//! `registry-janitor bench`: how fast a dead server is cleaned, what it costs Redis, and
//! what routing lookups feel meanwhile, against references measured in the same run.
//!
//! Every run seeds its own keys: one dead server with `users` users, `moved_percent` of
//! them reconnected to a live server (they must survive), and the live server's own users
//! (the lookup targets). Runs:
//! - `janitor`: the real worker path: a `registry-janitor worker` child process, one
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

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use crate::conn::RedisConn;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{Layout, Settings},
    conn,
    demo::local_redis,
    error::{Error, Result},
    event::{ServerDead, ServerId},
    keys::Keys,
    registry::Registry,
    status, stream,
};

/// Benchmark size and shape.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Users on the dead server.
    #[arg(long, default_value_t = 1_000_000)]
    pub users: usize,
    /// Percent of them reconnected to a live server before the cleanup (must survive).
    #[arg(long, default_value_t = 1.0)]
    pub moved_percent: f64,
    /// Users of the naive per-user loop (it is slow: a sample is enough for its rate).
    #[arg(long, default_value_t = 20_000)]
    pub naive_sample: usize,
    /// Users of the second janitor run, for the memory-growth ratio (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    pub baseline_users: usize,
    /// Times each of janitor, unconditional and careful is run (interleaved); the report
    /// gives the median run of each, so one noisy run cannot decide a ratio.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Run on a private local Redis Cluster of 3 masters (all on this machine) instead.
    #[arg(long)]
    pub local_cluster: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

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
}

/// Ratios the targets are stated in.
#[derive(Debug, Clone, Serialize)]
pub struct Ratios {
    /// janitor users/s over unconditional users/s (target >= 0.8).
    pub throughput_vs_ceiling: f64,
    /// janitor Redis CPU per user over careful's (target <= 0.75); none on a cluster,
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
    /// The median run of each kind (by users per second), then the single runs.
    pub runs: Vec<Run>,
    /// Every repetition of janitor, careful and unconditional, in the order run.
    pub repeats: Vec<Run>,
    pub ratios: Ratios,
}

impl Report {
    fn run(&self, name: &str) -> Option<&Run> {
        self.runs.iter().find(|r| r.name == name)
    }
}

/// Runs the benchmark; `worker_exe` is the `registry-janitor` binary to start workers from.
pub async fn run(settings: &Settings, options: &Options, worker_exe: &Path) -> Result<Report> {
    let (settings, _private) = bench_redis(settings, options).await?;
    let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
    // On a cluster INFO goes to every node: ask one master.
    let one_node = match conn::cluster_masters(&conn).await {
        Ok(masters) if conn.is_cluster() && !masters.is_empty() => {
            conn::shared(&conn::node_client(&settings, &masters[0].0, masters[0].1)?)?
        }
        _ => conn.clone(),
    };
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut one_node.clone())
        .await?;
    let redis_version = info_field(&info, "redis_version").unwrap_or_default();
    let root = format!(
        "{}janitor-bench:{}:",
        settings.key_prefix,
        ulid::Ulid::new()
    );

    let mut runs = Vec::new();
    let mut repeats: Vec<Run> = Vec::new();
    let result = async {
        let users = options.users;
        for _ in 0..options.repeat.max(1) {
            repeats.push(
                janitor_run(
                    &settings, &conn, &root, "janitor", users, options, worker_exe,
                )
                .await?,
            );
            if !settings.redis_cluster {
                repeats.push(
                    reference_run(&settings, &conn, &root, Reference::Careful, users, options)
                        .await?,
                );
            }
            repeats.push(
                reference_run(
                    &settings,
                    &conn,
                    &root,
                    Reference::Unconditional,
                    users,
                    options,
                )
                .await?,
            );
        }
        for name in ["janitor", "unconditional", "careful"] {
            if repeats.iter().any(|r| r.name == name) {
                runs.push(median(&repeats, name));
            }
        }
        if options.baseline_users > 0 {
            let users = options.baseline_users;
            runs.push(
                janitor_run(
                    &settings,
                    &conn,
                    &root,
                    "janitor_baseline",
                    users,
                    options,
                    worker_exe,
                )
                .await?,
            );
        }
        runs.push(
            reference_run(
                &settings,
                &conn,
                &root,
                Reference::Naive,
                options.naive_sample,
                options,
            )
            .await?,
        );
        Ok::<_, Error>(())
    }
    .await;
    conn::delete_prefixed(&settings, &conn, &root).await?;
    result?;

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
    let ratios = Ratios {
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
    };
    Ok(Report {
        redis_version,
        layout: layout_name(settings.layout).into(),
        chunk_size: settings.chunk_size,
        chunks_in_flight: settings.chunks_in_flight,
        runs,
        repeats,
        ratios,
    })
}

/// The median of the runs called `name`, field by field (each figure its own median;
/// correctness figures are the worst seen, so a failure in any repetition shows).
fn median(runs: &[Run], name: &str) -> Run {
    let of: Vec<&Run> = runs.iter().filter(|r| r.name == name).collect();
    let mid_f = |f: fn(&Run) -> f64| {
        let mut v: Vec<f64> = of.iter().map(|r| f(r)).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let mid_u = |f: fn(&Run) -> u64| {
        let mut v: Vec<u64> = of.iter().map(|r| f(r)).collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
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
    }
}

/// Keeps a private Redis (node or cluster) alive for the benchmark's duration.
#[allow(dead_code)] // the fields are held for their Drop (which stops the servers)
enum Private {
    Node(Option<crate::redis_server::RedisServer>),
    Cluster(crate::redis_server::RedisCluster),
}

/// The Redis the benchmark runs on: a private local cluster with `--local-cluster`, the
/// configured cluster with `redis_cluster`, else the configured node or a private one.
async fn bench_redis(settings: &Settings, options: &Options) -> Result<(Settings, Private)> {
    if options.local_cluster {
        let cluster =
            tokio::task::spawn_blocking(|| crate::redis_server::RedisCluster::start(3, 0))
                .await
                .map_err(|e| Error::Protocol(e.to_string()))??;
        eprintln!(
            "started a private Redis Cluster of 3 masters on this machine: {:?}",
            cluster.seeds()
        );
        let mut settings = settings.clone();
        settings.redis_cluster = true;
        settings.redis_url = cluster.url();
        settings.redis_cluster_seeds = cluster.seeds();
        return Ok((settings, Private::Cluster(cluster)));
    }
    if settings.redis_cluster {
        return Ok((settings.clone(), Private::Node(None)));
    }
    let (settings, private) = local_redis(settings).await?;
    Ok((settings, Private::Node(private)))
}

fn layout_name(layout: Layout) -> &'static str {
    match layout {
        Layout::Hash => "hash",
        Layout::Keys => "keys",
    }
}

/// The registry of one run: a dead server, a live one, who moved.
struct Scene {
    keys: Keys,
    registry: Registry,
    dead: ServerId,
    live: ServerId,
    users: usize,
    /// Every `moved_every`-th user of the dead server reconnected to the live one.
    moved_every: usize,
    live_users: usize,
}

impl Scene {
    fn dead_user(&self, n: usize) -> Vec<u8> {
        format!("u{n}").into_bytes()
    }

    fn live_user(&self, n: usize) -> Vec<u8> {
        format!("live{n}").into_bytes()
    }

    fn moved(&self, n: usize) -> bool {
        self.moved_every > 0 && n % self.moved_every == 0
    }

    async fn seed(&self, conn: &RedisConn) -> Result<()> {
        self.registry.heartbeat(conn, &self.live, 600_000).await?;
        let _: () = redis::cmd("ZADD")
            .arg(self.keys.servers())
            .arg(1)
            .arg(self.dead.as_str())
            .query_async(&mut conn.clone())
            .await?;
        for start in (0..self.users).step_by(10_000) {
            let ids: Vec<Vec<u8>> = (start..self.users.min(start + 10_000))
                .map(|n| self.dead_user(n))
                .collect();
            self.registry
                .register_many(conn, ids.iter().map(Vec::as_slice), &self.dead, 1000)
                .await?;
            let moved: Vec<&Vec<u8>> = (start..self.users.min(start + 10_000))
                .filter(|&n| self.moved(n))
                .map(|n| &ids[n - start])
                .collect();
            self.registry
                .register_many(conn, moved.into_iter().map(Vec::as_slice), &self.live, 1000)
                .await?;
        }
        let live: Vec<Vec<u8>> = (0..self.live_users).map(|n| self.live_user(n)).collect();
        self.registry
            .register_many(conn, live.iter().map(Vec::as_slice), &self.live, 1000)
            .await
    }

    /// (stale left, live lost)
    async fn verify(&self, conn: &RedisConn) -> Result<(u64, u64)> {
        let (mut stale, mut lost) = (0, 0);
        for start in (0..self.users).step_by(1000) {
            let ids: Vec<Vec<u8>> = (start..self.users.min(start + 1000))
                .map(|n| self.dead_user(n))
                .collect();
            for (i, owner) in self
                .registry
                .owners(conn, &ids)
                .await?
                .into_iter()
                .enumerate()
            {
                match owner.as_deref() {
                    Some(o) if o == self.dead.as_str() => stale += 1,
                    Some(o) if self.moved(start + i) && o == self.live.as_str() => {}
                    None if !self.moved(start + i) => {}
                    _ => lost += 1,
                }
            }
        }
        let live: Vec<Vec<u8>> = (0..self.live_users).map(|n| self.live_user(n)).collect();
        for chunk in live.chunks(1000) {
            let owners = self.registry.owners(conn, chunk).await?;
            lost += owners
                .iter()
                .filter(|o| o.as_deref() != Some(self.live.as_str()))
                .count() as u64;
        }
        Ok((stale, lost))
    }
}

fn scene(settings: &Settings, root: &str, name: &str, users: usize, options: &Options) -> Scene {
    let keys = Keys::new(format!("{root}{name}:"));
    let moved_every = if options.moved_percent > 0.0 {
        (100.0 / options.moved_percent).round().max(1.0) as usize
    } else {
        0
    };
    Scene {
        registry: Registry::new(keys.clone(), settings.layout),
        keys,
        dead: ServerId::parse("bench-dead#1").expect("valid"),
        live: ServerId::parse("bench-live#1").expect("valid"),
        users,
        moved_every,
        live_users: 10_000,
    }
}

/// Redis main-thread CPU seconds so far.
async fn redis_cpu(settings: &Settings, conn: &RedisConn) -> Result<f64> {
    if !conn.is_cluster() {
        return node_cpu(conn).await;
    }
    // Every master's main thread: the cleanup spreads over all of them.
    let mut total = 0.0;
    for (host, port) in conn::cluster_masters(conn).await? {
        total += node_cpu(&conn::shared(&conn::node_client(settings, &host, port)?)?).await?;
    }
    Ok(total)
}

/// Main-thread CPU seconds of one Redis node so far.
async fn node_cpu(node: &RedisConn) -> Result<f64> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut node.clone())
        .await?;
    let field = |name: &str| info_field(&info, name).and_then(|v| v.parse::<f64>().ok());
    Ok(
        match (
            field("used_cpu_user_main_thread"),
            field("used_cpu_sys_main_thread"),
        ) {
            (Some(u), Some(s)) => u + s,
            _ => field("used_cpu_user").unwrap_or(0.0) + field("used_cpu_sys").unwrap_or(0.0),
        },
    )
}

fn info_field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// Issues one routing lookup per millisecond on its own connection until stopped;
/// returns the latencies in microseconds.
async fn probe_lookups(
    target: conn::Target,
    scene_keys: Keys,
    layout: Layout,
    targets: Vec<Vec<u8>>,
    stop: CancellationToken,
) -> Result<Vec<u64>> {
    // A connection of its own (a new one, of the same kind as the janitor's).
    let mut c = conn::shared_for(&target).await?;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut latencies = Vec::with_capacity(16_384);
    let mut i = 0;
    while !stop.is_cancelled() {
        tick.tick().await;
        let user = &targets[i % targets.len()];
        i += 1;
        let started = Instant::now();
        let _: Option<String> = match layout {
            Layout::Hash => {
                redis::cmd("HGET")
                    .arg(scene_keys.registry())
                    .arg(user)
                    .query_async(&mut c)
                    .await?
            }
            Layout::Keys => {
                redis::cmd("GET")
                    .arg(scene_keys.user(user))
                    .query_async(&mut c)
                    .await?
            }
        };
        latencies.push(started.elapsed().as_micros() as u64);
    }
    Ok(latencies)
}

/// Measures `work` on a seeded scene: wall time, Redis CPU, lookup latencies, then
/// verifies the registry.
async fn measure<F, Fut>(
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
    let mut latencies = prober.await.map_err(|e| Error::Protocol(e.to_string()))??;
    latencies.sort_unstable();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
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
    })
}

async fn janitor_run(
    settings: &Settings,
    conn: &RedisConn,
    root: &str,
    name: &str,
    users: usize,
    options: &Options,
    worker_exe: &Path,
) -> Result<Run> {
    let scene = scene(settings, root, name, users, options);
    scene.seed(conn).await?;
    stream::ensure_group(conn, &scene.keys).await?;
    let mut child = tokio::process::Command::new(worker_exe)
        .arg("worker")
        .env("JANITOR_REDIS_URL", &settings.redis_url)
        .env("JANITOR_KEY_PREFIX", scene.keys.prefix())
        .env("JANITOR_LAYOUT", layout_name(settings.layout))
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
        .env("JANITOR_METRICS_ADDR", "off")
        .env("JANITOR_BLOCK_MS", "100")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::io(format!("starting {}", worker_exe.display()), e))?;
    let pid = child.id().unwrap_or(0);
    // Start timing only once the worker is reading.
    let deadline = Instant::now() + Duration::from_secs(30);
    while status::collect_from(conn, &scene.keys)
        .await?
        .consumers
        .is_empty()
    {
        if Instant::now() > deadline {
            return Err(Error::Protocol(
                "the bench worker did not join the group within 30 s".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
        Ok(peak_rss(pid))
    })
    .await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    conn::delete_prefixed(settings, conn, scene.keys.prefix()).await?;
    run
}

/// VmHWM of a process, in bytes (Linux).
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

#[derive(Clone, Copy)]
enum Reference {
    Unconditional,
    Careful,
    Naive,
}

static CAREFUL_CHUNK: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        -- KEYS[1] registry or '' (layout keys), KEYS[2] reverse set; ARGV[1] server,
        -- ARGV[2] layout, ARGV[3] user key prefix, ARGV[4..] users
        local users = {}
        for i = 4, #ARGV do users[#users + 1] = ARGV[i] end
        local owners, doomed = nil, {}
        if ARGV[2] == 'hash' then owners = redis.call('HMGET', KEYS[1], unpack(users))
        else
          local ks = {}
          for i = 1, #users do ks[i] = ARGV[3] .. users[i] end
          owners = redis.call('MGET', unpack(ks))
        end
        for i = 1, #users do
          if owners[i] == ARGV[1] then
            doomed[#doomed + 1] = (ARGV[2] == 'hash') and users[i] or (ARGV[3] .. users[i])
          end
        end
        if #doomed > 0 then
          if ARGV[2] == 'hash' then redis.call('HDEL', KEYS[1], unpack(doomed))
          else redis.call('DEL', unpack(doomed)) end
        end
        redis.call('SREM', KEYS[2], unpack(users))
        return #doomed
        ",
    )
});

async fn reference_run(
    settings: &Settings,
    conn: &RedisConn,
    root: &str,
    which: Reference,
    users: usize,
    options: &Options,
) -> Result<Run> {
    let name = match which {
        Reference::Unconditional => "unconditional",
        Reference::Careful => "careful",
        Reference::Naive => "naive",
    };
    let scene = scene(settings, root, name, users, options);
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

async fn unconditional(conn: &RedisConn, scene: &Scene, layout: Layout) -> Result<()> {
    let set = scene.keys.server_users(&scene.dead);
    let mut in_flight = FuturesUnordered::new();
    let mut cursor = 0;
    loop {
        let (next, members) = sscan(conn, &set, cursor).await?;
        // One delete per user: a pipeline on one node, many in flight on a cluster.
        let deletes: Vec<redis::Cmd> = members
            .iter()
            .map(|m| match layout {
                Layout::Hash => redis::cmd("HDEL")
                    .arg(scene.keys.registry())
                    .arg(m)
                    .to_owned(),
                Layout::Keys => redis::cmd("DEL").arg(scene.keys.user(m)).to_owned(),
            })
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
                .arg(layout_name(layout))
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
            let owner: Option<String> = match layout {
                Layout::Hash => {
                    redis::cmd("HGET")
                        .arg(scene.keys.registry())
                        .arg(&m)
                        .query_async(&mut c)
                        .await?
                }
                Layout::Keys => {
                    redis::cmd("GET")
                        .arg(scene.keys.user(&m))
                        .query_async(&mut c)
                        .await?
                }
            };
            if owner.as_deref() == Some(scene.dead.as_str()) {
                let _: i64 = match layout {
                    Layout::Hash => {
                        redis::cmd("HDEL")
                            .arg(scene.keys.registry())
                            .arg(&m)
                            .query_async(&mut c)
                            .await?
                    }
                    Layout::Keys => {
                        redis::cmd("DEL")
                            .arg(scene.keys.user(&m))
                            .query_async(&mut c)
                            .await?
                    }
                };
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

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "redis {} | layout {} | chunk_size {} | chunks_in_flight {}",
            self.redis_version, self.layout, self.chunk_size, self.chunks_in_flight
        )?;
        writeln!(
            f,
            "{:<17} {:>9} {:>8} {:>11} {:>9} {:>10} {:>8} {:>8} {:>8} {:>9} {:>6} {:>5}",
            "run",
            "users",
            "seconds",
            "users/s",
            "cpu s",
            "cpu us/u",
            "p50 us",
            "p99 us",
            "max us",
            "rss MiB",
            "stale",
            "lost"
        )?;
        for r in &self.runs {
            writeln!(
                f,
                "{:<17} {:>9} {:>8.2} {:>11.0} {:>9.2} {:>10.2} {:>8} {:>8} {:>8} {:>9} {:>6} {:>5}",
                r.name,
                r.users,
                r.seconds,
                r.users_per_second,
                r.redis_cpu_seconds,
                r.redis_cpu_us_per_user,
                r.lookup_p50_us,
                r.lookup_p99_us,
                r.lookup_max_us,
                r.worker_peak_rss_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1048576.0)),
                r.stale_left,
                r.live_lost
            )?;
        }
        let r = &self.ratios;
        let max_stall = self.run("janitor").map_or(0, |j| j.lookup_max_us);
        let rss = self
            .run("janitor")
            .and_then(|j| j.worker_peak_rss_bytes)
            .unwrap_or(0);
        writeln!(
            f,
            "(janitor, unconditional and careful: medians of {} interleaved repetitions; max us is the worst of them)",
            self.repeats.iter().filter(|r| r.name == "janitor").count()
        )?;
        writeln!(f, "targets:")?;
        writeln!(
            f,
            "  throughput vs unconditional ceiling {:>6.2}x  (target >= 0.8)",
            r.throughput_vs_ceiling
        )?;
        match r.redis_cpu_vs_careful {
            Some(x) => writeln!(f, "  Redis CPU per user vs careful        {x:>6.2}x  (target <= 0.75)")?,
            None => writeln!(f, "  Redis CPU per user vs careful             -  (no careful reference on a cluster)")?,
        }
        writeln!(
            f,
            "  max lookup stall                     {:>6.1} ms (target < 15)",
            max_stall as f64 / 1000.0
        )?;
        writeln!(
            f,
            "  worker peak memory                   {:>6.1} MB (target < 50)",
            rss as f64 / 1e6
        )?;
        match r.memory_growth {
            Some(g) => writeln!(
                f,
                "  memory growth vs baseline run        {g:>6.2}x  (target <= 1.2)"
            )?,
            None => writeln!(
                f,
                "  memory growth vs baseline run             -  (skipped)"
            )?,
        }
        writeln!(
            f,
            "  speed-up vs naive per-user loop      {:>6.1}x  (target >= 15)",
            r.speedup_vs_naive
        )
    }
}

/// The running binary, to start bench workers from.
pub fn current_exe() -> Result<PathBuf> {
    std::env::current_exe().map_err(|e| Error::io("locating the registry-janitor binary", e))
}
