//! Liveness on Redis's clock: connection servers whose clock runs an hour ahead or an
//! hour behind, alive and dead, on one node and on a local Redis Cluster, with a
//! reconciler (expiry hints and passes) and a worker running. The servers that keep
//! heartbeating (one missed stretch each, longer than their liveness TTL and well inside
//! the grace) are never declared dead, fenced or cleaned; those that stop are declared
//! dead no sooner than a grace after their last heartbeat, and within about the grace,
//! like a server whose clock is right. (A writer that scores with its own clock behind
//! Redis's is alive only while its liveness key stands, the documented exception: it is
//! run with a liveness key that never lapses, and dies without the lower bound.)
//!
//! Both kinds of writer are run: the protocol (`heartbeat.lua`, which scores with Redis's
//! time whatever the caller sends, and on a cluster `heartbeat_servers.lua`), and a
//! writer that scores with its own clock (the earlier `heartbeat.lua`, kept below, and
//! on a cluster a client's own `ZADD servers <its time>`), whose scores in the future the
//! reconciler lowers to Redis's time.

mod common;

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::*;
use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    event::{ServerDead, ServerId},
    keys::Keys,
    registry::Registry,
};
use registry_janitor_testkit::RedisCluster;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const HOUR_MS: i64 = 3_600_000;
const GRACE_MS: u64 = 4_000;
const TTL_MS: u64 = 500;
const BEAT: Duration = Duration::from_millis(150);
/// The one stretch without a heartbeat that each live server has: its liveness key
/// expires (TTL 500 ms) and stays gone for about 0.8 s, far inside the grace.
const MISSED: Duration = Duration::from_millis(1_300);
const USERS: usize = 20;

/// heartbeat.lua as it was before it scored with Redis's time: the score is the caller's
/// third argument, its own clock. Connection servers may still carry such a copy.
const EARLIER_HEARTBEAT: &str = r#"
local fence, refusals, alive, servers = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local server = ARGV[1]
if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', refusals, 'heartbeat', 1)
  redis.pcall('HSET', refusals, 'last_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  local ttl = redis.call('PTTL', fence)
  if ttl > 0 then redis.pcall('PEXPIRE', refusals, ttl) end
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
redis.call('SET', alive, '1', 'PX', ARGV[2])
if servers then redis.call('ZADD', servers, ARGV[3], server) end
return 1
"#;

/// How a connection server writes its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// The protocol's scripts, sending its own (skewed) time as heartbeat.lua's third
    /// argument.
    Protocol,
    /// Scores with its own clock: the earlier heartbeat.lua on one node; on a cluster,
    /// heartbeat.lua then `ZADD servers <its time> S`.
    OwnClock,
}

/// One connection server of the scenario.
#[derive(Debug, Clone)]
struct Member {
    server: ServerId,
    writer: Writer,
    /// How far its clock is from the right time (ms).
    skew_ms: i64,
    /// Stops heartbeating early on (dies).
    dies: bool,
}

fn members() -> Vec<Member> {
    let mut all = Vec::new();
    for (writer, w) in [(Writer::Protocol, "p"), (Writer::OwnClock, "own")] {
        for (skew_ms, s) in [(HOUR_MS, "ahead"), (-HOUR_MS, "behind"), (0, "right")] {
            for (dies, d) in [(false, "alive"), (true, "dead")] {
                all.push(Member {
                    server: server(&format!("gw-{w}-{s}-{d}#1")),
                    writer,
                    skew_ms,
                    dies,
                });
            }
        }
    }
    all
}

static HEARTBEAT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../protocol/heartbeat.lua")));
static HEARTBEAT_SERVERS: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(include_str!("../protocol/heartbeat_servers.lua"))
});
static EARLIER: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(EARLIER_HEARTBEAT));

/// Redis's time (unix ms), from the node that answers `conn`.
async fn redis_ms(conn: &RedisConn) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    s * 1000 + us / 1000
}

/// One heartbeat of `m` as its writer makes it; Err(true) when refused as FENCED.
async fn heartbeat(conn: &RedisConn, keys: &Keys, m: &Member, cluster: bool) -> Result<(), bool> {
    let own_ms = (registry_janitor::now_ms() as i64 + m.skew_ms).to_string();
    let script = match (m.writer, cluster) {
        (Writer::OwnClock, false) => &*EARLIER,
        _ => &*HEARTBEAT,
    };
    let mut call = script.prepare_invoke();
    call.key(keys.server_fence(&m.server))
        .key(keys.server_refusals(&m.server))
        .key(keys.server_alive(&m.server));
    if !cluster {
        call.key(keys.servers());
    }
    call.arg(m.server.as_str()).arg(ttl_ms(m)).arg(&own_ms);
    match call.invoke_async::<i64>(&mut conn.clone()).await {
        Ok(_) => {}
        Err(e) if e.code() == Some("FENCED") => return Err(true),
        Err(_) => return Err(false),
    }
    if cluster {
        let scored: redis::RedisResult<i64> = match m.writer {
            Writer::Protocol => {
                HEARTBEAT_SERVERS
                    .key(keys.servers())
                    .arg(m.server.as_str())
                    .invoke_async(&mut conn.clone())
                    .await
            }
            Writer::OwnClock => {
                redis::cmd("ZADD")
                    .arg(keys.servers())
                    .arg(&own_ms)
                    .arg(m.server.as_str())
                    .query_async(&mut conn.clone())
                    .await
            }
        };
        scored.map_err(|_| false)?;
    }
    Ok(())
}

/// The connection servers of the scenario, heartbeating until stopped: the dying ones
/// stop when `die` fires; the others, except those that score behind with their own
/// clock, miss one stretch of [`MISSED`] when `miss` fires.
struct Fleet {
    stop: CancellationToken,
    die: CancellationToken,
    miss: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    /// Heartbeats refused as FENCED, by server.
    fenced: Arc<std::sync::Mutex<BTreeMap<String, u64>>>,
    /// Redis's time (ms) read just before each server's last heartbeat taken was sent.
    last_beat: BTreeMap<String, Arc<AtomicU64>>,
    /// Whether each server stopped heartbeating.
    stopped: BTreeMap<String, Arc<AtomicBool>>,
}

/// Whether `m` scores with its own clock behind Redis's: its score looks old, so once
/// its liveness key is gone it is taken for dead at once (the documented exception).
/// While the key stands it is alive: its key is given a TTL that no stall of a loaded
/// machine outlasts, and it misses no stretch.
fn scores_behind(m: &Member) -> bool {
    m.writer == Writer::OwnClock && m.skew_ms < 0
}

/// Whether `m` misses a stretch: a live server, except one that [`scores_behind`].
fn misses(m: &Member) -> bool {
    !m.dies && !scores_behind(m)
}

/// The liveness TTL `m` heartbeats with.
fn ttl_ms(m: &Member) -> u64 {
    if !m.dies && scores_behind(m) {
        60_000
    } else {
        TTL_MS
    }
}

impl Fleet {
    fn start(conn: &RedisConn, keys: &Keys, all: &[Member], cluster: bool) -> Self {
        let (stop, die, miss) = (
            CancellationToken::new(),
            CancellationToken::new(),
            CancellationToken::new(),
        );
        let fenced = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let mut last_beat = BTreeMap::new();
        let mut stopped = BTreeMap::new();
        let mut tasks = Vec::new();
        for m in all {
            let last = Arc::new(AtomicU64::new(0));
            let done = Arc::new(AtomicBool::new(false));
            last_beat.insert(m.server.as_str().to_owned(), last.clone());
            stopped.insert(m.server.as_str().to_owned(), done.clone());
            let (conn, keys, m, stop, die, miss, fenced) = (
                conn.clone(),
                keys.clone(),
                m.clone(),
                stop.clone(),
                die.clone(),
                miss.clone(),
                fenced.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut missed = false;
                loop {
                    if stop.is_cancelled() {
                        return;
                    }
                    if m.dies && die.is_cancelled() {
                        done.store(true, Ordering::SeqCst);
                        return;
                    }
                    if misses(&m) && !missed && miss.is_cancelled() {
                        missed = true;
                        tokio::select! {
                            _ = tokio::time::sleep(MISSED) => {}
                            _ = stop.cancelled() => return,
                        }
                    }
                    let before = redis_ms(&conn).await;
                    match heartbeat(&conn, &keys, &m, cluster).await {
                        Ok(()) => last.store(before, Ordering::SeqCst),
                        Err(true) => {
                            *fenced
                                .lock()
                                .unwrap()
                                .entry(m.server.as_str().to_owned())
                                .or_insert(0) += 1;
                            return;
                        }
                        Err(false) => {}
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(BEAT) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            }));
        }
        Fleet {
            stop,
            die,
            miss,
            tasks,
            fenced,
            last_beat,
            stopped,
        }
    }

    async fn stop(self) -> BTreeMap<String, u64> {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap();
        }
        self.fenced.lock().unwrap().clone()
    }
}

/// The first `server.dead` of each server on the stream, with its entry's Redis time.
async fn first_verdicts(conn: &RedisConn, keys: &Keys) -> BTreeMap<String, u64> {
    let mut first = BTreeMap::new();
    for e in read_stream(conn, &keys.events()).await {
        let (event, _) = ServerDead::decode(e.field("payload").unwrap(), 65536).unwrap();
        let ms: u64 = e.id.split('-').next().unwrap().parse().unwrap();
        first.entry(event.server_id).or_insert(ms);
    }
    first
}

/// Registers [`USERS`] users on `server` as a plain writer (their entries are what the
/// cleanup of a dead server deletes and what a live one keeps).
async fn users_of(registry: &Registry, conn: &RedisConn, server: &ServerId) {
    let ids: Vec<Vec<u8>> = (0..USERS).map(|n| user(server, n)).collect();
    registry
        .register_many(conn, ids.iter().map(Vec::as_slice), server, 1000)
        .await
        .unwrap();
}

/// The scenario on `conn` (one node or a cluster): see the module docs.
async fn scenario(
    settings: &Settings,
    conn: &RedisConn,
    wait_log: &registry_janitor_testkit::RedisServer,
) {
    let keys = Keys::for_settings(settings);
    let registry = Registry::new(keys.clone(), settings.layout);
    let cluster = conn.is_cluster();
    let all = members();
    let reconciler = RunningReconciler::start(settings);
    let worker = spawn_worker(settings);
    // Let the expiry subscriptions settle before anything can expire.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let fleet = Fleet::start(conn, &keys, &all, cluster);
    wait_until(
        wait_log,
        "every server heartbeating",
        Duration::from_secs(20),
        || async {
            let ids: Vec<ServerId> = all.iter().map(|m| m.server.clone()).collect();
            registry_janitor::registry::have_liveness_keys(conn, &keys, &ids)
                .await
                .is_ok_and(|a| a.iter().all(|x| *x))
        },
    )
    .await;
    for m in &all {
        users_of(&registry, conn, &m.server).await;
    }
    // The protocol scores with Redis's time, whatever the caller's clock says.
    let now = redis_ms(conn).await;
    for m in all.iter().filter(|m| m.writer == Writer::Protocol) {
        let score: f64 = redis::cmd("ZSCORE")
            .arg(keys.servers())
            .arg(m.server.as_str())
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert!(
            (score - now as f64).abs() < 60_000.0,
            "{}: score {score}, Redis's time {now}",
            m.server
        );
    }
    let dying: Vec<&Member> = all.iter().filter(|m| m.dies).collect();
    fleet.die.cancel();
    tokio::time::sleep(Duration::from_secs(1)).await;
    fleet.miss.cancel();
    wait_until(
        wait_log,
        "every dead server declared dead",
        Duration::from_secs(60),
        || async {
            let first = first_verdicts(conn, &keys).await;
            dying.iter().all(|m| first.contains_key(m.server.as_str()))
        },
    )
    .await;
    // Live servers keep heartbeating for two graces after their missed stretch, long
    // enough for any verdict that stretch could bring.
    let settle_until = Instant::now() + Duration::from_millis(2 * GRACE_MS);
    tokio::time::sleep_until(settle_until.into()).await;
    let first = first_verdicts(conn, &keys).await;
    let stopped = fleet.stopped.clone();
    let last_beat: BTreeMap<String, u64> = fleet
        .last_beat
        .iter()
        .map(|(s, t)| (s.clone(), t.load(Ordering::SeqCst)))
        .collect();
    let refused = fleet.stop().await;
    for (name, done) in &stopped {
        let m = all.iter().find(|m| m.server.as_str() == name).unwrap();
        assert_eq!(done.load(Ordering::SeqCst), m.dies, "{name} stopped");
    }

    let mut report = Vec::new();
    for m in &all {
        let name = m.server.as_str();
        if !m.dies {
            assert!(
                !first.contains_key(name),
                "{name}: a live server was declared dead"
            );
            assert!(
                !refused.contains_key(name),
                "{name}: a live server was told FENCED"
            );
            assert_eq!(
                still_pointing(&registry, conn, &m.server, USERS).await,
                USERS,
                "{name}: a live server's entries were deleted"
            );
            continue;
        }
        let after = first[name].saturating_sub(last_beat[name]);
        report.push(format!("{name} {after} ms"));
        // The protocol's scores are Redis's time, and an own-clock score ahead is lowered
        // to a time no earlier than the last heartbeat: never declared dead before a
        // grace has passed. (An own-clock score behind looks old: such a server is dead
        // once its liveness key is gone, the documented exception.)
        if !(m.writer == Writer::OwnClock && m.skew_ms < 0) {
            assert!(
                after >= GRACE_MS,
                "{name}: declared dead {after} ms after its last heartbeat, before the grace"
            );
        }
        // About the grace, as a server whose clock is right: at most the liveness TTL
        // more (a score lowered at the key's expiry), with room for a loaded machine.
        assert!(
            after <= GRACE_MS + TTL_MS + 4_000,
            "{name}: declared dead only {after} ms after its last heartbeat"
        );
    }
    eprintln!(
        "grace {GRACE_MS} ms, TTL {TTL_MS} ms; declared dead after the last heartbeat: {}",
        report.join(", ")
    );
    // The dead servers are cleaned by the worker.
    wait_until(
        wait_log,
        "the dead servers cleaned",
        Duration::from_secs(30),
        || async {
            let mut left = 0;
            for m in &dying {
                left += still_pointing(&registry, conn, &m.server, USERS).await;
            }
            left == 0
        },
    )
    .await;
    reconciler.stop().await;
    worker.stop().await;
}

fn adjust(s: &mut Settings) {
    s.heartbeat_grace_ms = GRACE_MS;
    s.reconcile_interval_ms = 1_000;
    s.keyspace_events_auto = true;
    // The guard is not what this test is about: a handful of servers falling silent at
    // once on a loaded machine must not make a mass silence that holds their verdicts.
    s.guard_silence_min = 100;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_an_hour_ahead_or_behind_are_judged_on_redis_time() {
    let f = Fixture::with(Layout::Hash, adjust);
    scenario(&f.settings, &f.conn, &f.redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_an_hour_ahead_or_behind_are_judged_on_redis_time_on_a_cluster() {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 0))
        .await
        .unwrap()
        .expect("start a local cluster");
    let mut settings = cluster_settings(&cluster, Layout::Hash);
    adjust(&mut settings);
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    scenario(&settings, &conn, &cluster.nodes[0]).await;
}

/// A `servers` score an hour in the future is lowered to Redis's time by the next pass
/// (and by a check), once: the server is then judged like any other. The reconciler's
/// own clock plays no part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_score_in_the_future_is_lowered_to_redis_time() {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let f = Fixture::with(Layout::Hash, |s| s.heartbeat_grace_ms = 2_000);
    let (ahead, right) = (server("gw-ahead#1"), server("gw-right#1"));
    let now = redis_ms(&f.conn).await;
    let _: () = f
        .query(
            redis::cmd("ZADD")
                .arg(f.keys.servers())
                .arg(now + HOUR_MS as u64)
                .arg(ahead.as_str())
                .arg(now)
                .arg(right.as_str()),
        )
        .await;
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let report = r.pass().await.unwrap();
    assert_eq!(report.candidates, 0, "{report:?}");
    let score: f64 = f
        .query(
            redis::cmd("ZSCORE")
                .arg(f.keys.servers())
                .arg(ahead.as_str()),
        )
        .await;
    let after = redis_ms(&f.conn).await;
    assert!(
        score >= now as f64 && score <= after as f64,
        "lowered to Redis's time: {score} not in [{now}, {after}]"
    );
    let right_score: f64 = f
        .query(
            redis::cmd("ZSCORE")
                .arg(f.keys.servers())
                .arg(right.as_str()),
        )
        .await;
    assert_eq!(
        right_score, now as f64,
        "a score that is not ahead is left alone"
    );
    // A grace later (by Redis's time) both are past it, and both are declared dead.
    while (redis_ms(&f.conn).await as f64) < score + 2_050.0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = r.pass().await.unwrap();
    assert_eq!((report.candidates, report.published), (2, 2), "{report:?}");
}

/// A reconciler whose ACL user may not write `servers` (the reconciler's rules of
/// k8s/redis-acl.example.conf without `(~servers +zadd)`: an ACL left as it was):
/// a score in the future is not lowered, the check still answers (the server counts as
/// heard from now, for a grace), and the pass runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciler_that_may_not_lower_scores_runs_on() {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler, reconcile::Verdict};
    let f = Fixture::with(Layout::Hash, |s| {
        s.key_prefix = String::new(); // the shipped rules name the keys without a prefix
        s.heartbeat_grace_ms = 2_000;
    });
    let conf = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/k8s/redis-acl.example.conf"
    ))
    .unwrap();
    let line = conf
        .lines()
        .find(|l| l.starts_with("user janitor-reconciler "))
        .unwrap();
    assert!(line.contains(" (~servers +zadd)"), "{line}");
    let mut rules: Vec<String> = line
        .replace(" (~servers +zadd)", "")
        .split_whitespace()
        .skip(2)
        .map(str::to_owned)
        .collect();
    for r in rules.iter_mut().filter(|r| r.starts_with('#')) {
        *r = ">pw".to_owned();
    }
    let _: () = f
        .query(
            redis::cmd("ACL")
                .arg("SETUSER")
                .arg("no-lowering")
                .arg(&rules),
        )
        .await;
    let mut settings = f.settings.clone();
    settings.redis_url = f.redis.url().replace("redis://", "redis://no-lowering:pw@");
    let ahead = server("gw-ahead#1");
    let future = redis_ms(&f.conn).await + HOUR_MS as u64;
    let _: () = f
        .query(
            redis::cmd("ZADD")
                .arg(f.keys.servers())
                .arg(future)
                .arg(ahead.as_str()),
        )
        .await;
    let r = Reconciler::new(&settings, Metrics::new()).await.unwrap();
    let report = r.pass().await.unwrap();
    assert_eq!(report.candidates, 0, "{report:?}");
    match r.check(&ahead).await.unwrap() {
        Verdict::TooRecent { remaining_ms, .. } => assert!(remaining_ms <= 2_000),
        other => panic!("{other:?}"),
    }
    let score: f64 = f
        .query(
            redis::cmd("ZSCORE")
                .arg(f.keys.servers())
                .arg(ahead.as_str()),
        )
        .await;
    assert_eq!(score, future as f64, "not lowered: the ACL refuses it");
}
