//! Redis's own absence is never a server's silence: a live fleet of connection servers,
//! heartbeating through `protocol/heartbeat.lua`, keeps every server and every entry
//! through a Redis pause, a restart from disk and a Sentinel failover, each longer than
//! the grace; a server that really died is still found, once Redis has been reachable
//! for a full grace. The reachable-time logic itself (clock jumps, with injected times)
//! is unit-tested in `src/guard/reachable.rs`.

mod common;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::*;
use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    error::Error,
    event::ServerId,
    keys::Keys,
    registry::Registry,
};
use registry_janitor_testkit::{wait_for, RedisSentinels};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const GRACE_MS: u64 = 2_000;
const LIVE: usize = 20;
const USERS: usize = 50;
/// Heartbeat interval and liveness TTL of the connection servers: a few heartbeats.
const BEAT: Duration = Duration::from_millis(200);
const TTL_MS: u64 = 700;
/// After a failed heartbeat a connection server waits before it tries again: from a
/// quarter to a little under three fifths of the grace, by server. So after an outage the
/// fleet comes back over a while, as a real one does, and a reconciler that looks at
/// once finds servers that have not heartbeated yet; each is back well within a grace.
fn backoff(n: usize, grace_ms: u64) -> Duration {
    let spread = grace_ms / 3;
    Duration::from_millis(grace_ms / 4 + (n as u64 * 397) % spread)
}

/// Connection servers heartbeating through the protocol until stopped (or fenced).
struct Fleet {
    stop: CancellationToken,
    tasks: Vec<(ServerId, CancellationToken, JoinHandle<()>)>,
    /// Heartbeats refused as FENCED: each one is a live server declared dead.
    fenced: Arc<AtomicUsize>,
}

impl Fleet {
    /// `grace_ms` sets the backoff after a failed heartbeat ([`backoff`]).
    fn start(registry: &Registry, conn: &RedisConn, servers: &[ServerId], grace_ms: u64) -> Self {
        let stop = CancellationToken::new();
        let fenced = Arc::new(AtomicUsize::new(0));
        let tasks = servers
            .iter()
            .enumerate()
            .map(|(n, s)| {
                let own = stop.child_token();
                let (registry, conn, server, stop, fenced) = (
                    registry.clone(),
                    conn.clone(),
                    s.clone(),
                    own.clone(),
                    fenced.clone(),
                );
                let task = tokio::spawn(async move {
                    loop {
                        let beat = registry.heartbeat(&conn, &server, TTL_MS);
                        let result = tokio::select! {
                            r = beat => r,
                            _ = stop.cancelled() => return,
                        };
                        // Other errors: Redis is away; a connection server keeps trying.
                        let wait = match result {
                            Ok(()) => BEAT,
                            Err(Error::Fenced { .. }) => {
                                fenced.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                            Err(_) => backoff(n, grace_ms),
                        };
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = stop.cancelled() => return,
                        }
                    }
                });
                (s.clone(), own, task)
            })
            .collect();
        Fleet {
            stop,
            tasks,
            fenced,
        }
    }

    /// `server` crashes: its heartbeats stop.
    async fn crash(&mut self, server: &ServerId) {
        let at = self.tasks.iter().position(|(s, _, _)| s == server).unwrap();
        let (_, stop, task) = self.tasks.remove(at);
        stop.cancel();
        task.await.unwrap();
    }

    async fn stop(self) -> usize {
        self.stop.cancel();
        for (_, _, task) in self.tasks {
            task.await.unwrap();
        }
        self.fenced.load(Ordering::SeqCst)
    }
}

/// The reconciler's outage counter for `cause`.
fn outages(r: &RunningReconciler, cause: &str) -> u64 {
    r.metrics
        .reconcile_outages
        .with_label_values(&[cause])
        .get()
}

fn live_servers() -> Vec<ServerId> {
    (0..LIVE)
        .map(|n| server(&format!("gw-live-{n}#1")))
        .collect()
}

/// The servers of `server.dead` events on the stream, and the Redis time (ms) of each. A
/// server still being cleaned when its report marker expires is reported again.
async fn published(conn: &RedisConn, keys: &Keys) -> Vec<(String, u64)> {
    read_stream(conn, &keys.events())
        .await
        .iter()
        .map(|e| {
            let payload = e.field("payload").unwrap();
            let event = registry_janitor::event::ServerDead::decode(payload, 65536)
                .unwrap()
                .0;
            let ms = e.id.split('-').next().unwrap().parse().unwrap();
            (event.server_id, ms)
        })
        .collect()
}

/// Live servers with a fence, and live users whose entry no longer names their server.
async fn damage(registry: &Registry, conn: &RedisConn, keys: &Keys) -> (usize, usize) {
    let mut fenced = 0;
    let mut lost = 0;
    for s in live_servers() {
        let fence: bool = redis::cmd("EXISTS")
            .arg(keys.server_fence(&s))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        fenced += usize::from(fence);
        lost += USERS - still_pointing(registry, conn, &s, USERS).await;
    }
    (fenced, lost)
}

/// Waits until `conn` answers again (its first command after an outage may fail while
/// it reconnects).
async fn answering(conn: &RedisConn) {
    wait_for(
        "the test's connection to answer",
        Duration::from_secs(60),
        || async {
            redis::cmd("PING")
                .query_async::<String>(&mut conn.clone())
                .await
                .is_ok()
        },
    )
    .await;
}

/// Waits until every live server has a liveness key (the fleet is up).
async fn fleet_alive(conn: &RedisConn, keys: &Keys) {
    wait_for(
        "every live server heartbeating",
        Duration::from_secs(30),
        || async {
            let mut all = true;
            for s in live_servers() {
                let alive: redis::RedisResult<bool> = redis::cmd("EXISTS")
                    .arg(keys.server_alive(&s))
                    .query_async(&mut conn.clone())
                    .await;
                all &= alive.unwrap_or(false);
            }
            all
        },
    )
    .await;
}

/// The crashed server was published once, cleaned, and nothing else was published.
async fn only_the_crashed_server_found(
    registry: &Registry,
    conn: &RedisConn,
    keys: &Keys,
    crashed: &ServerId,
) -> u64 {
    wait_for(
        "the crashed server published and cleaned",
        Duration::from_secs(60),
        || async {
            !published(conn, keys).await.is_empty()
                && still_pointing(registry, conn, crashed, USERS).await == 0
        },
    )
    .await;
    let events = published(conn, keys).await;
    assert_eq!(dead_names(&events), vec![crashed.as_str()]);
    events[0].1
}

/// The distinct servers declared dead.
fn dead_names(events: &[(String, u64)]) -> Vec<&str> {
    let names: std::collections::BTreeSet<&str> = events.iter().map(|(s, _)| s.as_str()).collect();
    names.into_iter().collect()
}

fn grace_settings(s: &mut Settings) {
    s.heartbeat_grace_ms = GRACE_MS;
    s.reconcile_interval_ms = 500;
    s.sweep_pause_ms = 20;
}

/// A pause of Redis (SIGSTOP, then SIGCONT) longer than the grace: liveness keys expire
/// and scores age while nobody can reach Redis. No live server is declared dead, fenced
/// or loses an entry; the server that crashed just before the pause is found, no sooner
/// than a full grace after Redis answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_pause_longer_than_the_grace_fences_no_live_server() {
    let redis = redis_with(&["--notify-keyspace-events", "Ex"]);
    let f = Fixture::on(redis, Layout::Hash, grace_settings);
    let crashed = server("gw-crashed#1");
    let mut servers = live_servers();
    servers.push(crashed.clone());
    for s in &servers {
        f.seed(s, USERS).await;
    }
    let beats = connect(&f.settings);
    let mut fleet = Fleet::start(&f.registry, &beats, &servers, GRACE_MS);
    fleet_alive(&f.conn, &f.keys).await;
    let reconciler = RunningReconciler::start(&f.settings);
    let worker = spawn_worker(&f.settings);
    // Steady state first: a few passes, nothing dead.
    wait_for("three passes", Duration::from_secs(30), || async {
        reconciler.metrics.reconcile_passes.get() >= 3
    })
    .await;
    assert!(published(&f.conn, &f.keys).await.is_empty());

    fleet.crash(&crashed).await;
    f.redis.signal("STOP").unwrap();
    let paused = Instant::now();
    tokio::time::sleep(Duration::from_millis(5_000)).await; // the outage, not a wait for a result
    f.redis.signal("CONT").unwrap();
    let resumed_ms = registry_janitor::now_ms();
    answering(&f.conn).await;
    eprintln!("paused for {:?}", paused.elapsed());

    let found_ms = only_the_crashed_server_found(&f.registry, &f.conn, &f.keys, &crashed).await;
    // Later passes, with the whole fleet back, change nothing.
    let passes = reconciler.metrics.reconcile_passes.get();
    wait_for("three more passes", Duration::from_secs(30), || async {
        reconciler.metrics.reconcile_passes.get() >= passes + 3
    })
    .await;
    assert_eq!(
        dead_names(&published(&f.conn, &f.keys).await),
        vec![crashed.as_str()]
    );
    assert_eq!(damage(&f.registry, &f.conn, &f.keys).await, (0, 0));
    assert!(
        found_ms >= resumed_ms + GRACE_MS,
        "the crashed server was declared dead {} ms after Redis came back, before a full grace",
        found_ms as i64 - resumed_ms as i64
    );
    assert!(outages(&reconciler, "failed_calls") >= 1);
    eprintln!(
        "crashed server found {} ms after Redis came back (grace {GRACE_MS} ms); outages: failed_calls {}",
        found_ms - resumed_ms,
        outages(&reconciler, "failed_calls")
    );
    reconciler.stop().await;
    worker.stop().await;
    assert_eq!(fleet.stop().await, 0, "a live server was told it is fenced");
}

/// Redis killed and restarted from its AOF (same port and directory) after a downtime
/// longer than the grace, with the reconciler as a real process, and a second replica
/// started right after the restart: no live server is declared dead; the crashed one is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_disk_fences_no_live_server() {
    let redis = redis_with(&["--appendonly", "yes", "--notify-keyspace-events", "Ex"]);
    let mut f = Fixture::on(redis, Layout::Hash, grace_settings);
    let crashed = server("gw-crashed#1");
    let mut servers = live_servers();
    servers.push(crashed.clone());
    for s in &servers {
        f.seed(s, USERS).await;
    }
    let beats = connect(&f.settings);
    let mut fleet = Fleet::start(&f.registry, &beats, &servers, GRACE_MS);
    fleet_alive(&f.conn, &f.keys).await;
    let reconciler = WorkerProcess::start_command(
        &f.settings,
        &[
            ("JANITOR_HEARTBEAT_GRACE_MS", "2000"),
            ("JANITOR_RECONCILE_INTERVAL_MS", "500"),
        ],
        &["reconcile"],
    );
    let worker = spawn_worker(&f.settings);
    wait_for("the guard record", Duration::from_secs(30), || async {
        let run_ids: redis::RedisResult<Option<String>> = redis::cmd("HGET")
            .arg(f.keys.guard_reachable())
            .arg("run_ids")
            .query_async(&mut f.conn.clone())
            .await;
        run_ids.is_ok_and(|r| r.is_some())
    })
    .await;

    fleet.crash(&crashed).await;
    f.redis.kill();
    tokio::time::sleep(Duration::from_millis(4_000)).await; // the downtime
    f.redis.restart().unwrap();
    let restarted_ms = registry_janitor::now_ms();
    // A replica that starts now passes at once, before part of the fleet is back: the
    // record in the AOF names the old run_id.
    let replica = WorkerProcess::start_command(
        &f.settings,
        &[
            ("JANITOR_HEARTBEAT_GRACE_MS", "2000"),
            ("JANITOR_RECONCILE_INTERVAL_MS", "500"),
        ],
        &["reconcile"],
    );
    answering(&f.conn).await;

    let found_ms = only_the_crashed_server_found(&f.registry, &f.conn, &f.keys, &crashed).await;
    assert!(
        found_ms >= restarted_ms + GRACE_MS,
        "declared dead {} ms after the restart",
        found_ms as i64 - restarted_ms as i64
    );
    tokio::time::sleep(Duration::from_millis(2 * GRACE_MS)).await; // more passes, to be sure
    assert_eq!(
        dead_names(&published(&f.conn, &f.keys).await),
        vec![crashed.as_str()]
    );
    assert_eq!(damage(&f.registry, &f.conn, &f.keys).await, (0, 0));
    worker.stop().await;
    for log in [reconciler.log(), replica.log()] {
        assert!(log.contains("Redis outage"), "{log}");
        assert!(log.contains("verdicts on silent servers resume"), "{log}");
    }
    // The replica saw the old run_id in the record, or the record the first reconciler
    // had updated by then.
    let log = replica.log();
    assert!(
        log.contains("another run_id") || log.contains("another reconciler recorded"),
        "{log}"
    );
    assert_eq!(fleet.stop().await, 0, "a live server was told it is fenced");
}

/// `reconcile --once` (a cron job) right after a restart that reloaded an RDB: the
/// record in it names the old run_id, so the run waits for a full grace of reachable
/// time, then reports the crashed server and no live one. On a fresh Redis with no
/// record, `--once` publishes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_once_after_a_restart_waits_for_reachable_time() {
    let redis = redis_with(&["--notify-keyspace-events", "Ex"]);
    let mut f = Fixture::on(redis, Layout::Hash, grace_settings);
    let once = |f: &Fixture| {
        run_ok(
            janitor(&f.settings)
                .env("JANITOR_HEARTBEAT_GRACE_MS", GRACE_MS.to_string())
                .args(["reconcile", "--once"]),
        )
    };
    // A fresh Redis, no record: a long-dead server is published at once.
    let long_dead = server("gw-long-dead#1");
    f.seed(&long_dead, 10).await;
    let _: () = f
        .query(redis::cmd("DEL").arg(f.keys.server_alive(&long_dead)))
        .await;
    let _: () = f
        .query(
            redis::cmd("ZADD")
                .arg(f.keys.servers())
                .arg(1)
                .arg(long_dead.as_str()),
        )
        .await;
    let started = Instant::now();
    let first = once(&f);
    assert!(first.contains("1 published"), "{first}");
    assert!(first.contains("waited 0 ms"), "{first}");
    eprintln!("--once on a fresh Redis took {:?}", started.elapsed());
    let _: () = f.query(redis::cmd("DEL").arg(f.keys.events())).await;
    let _: () = f
        .query(
            redis::cmd("ZREM")
                .arg(f.keys.servers())
                .arg(long_dead.as_str()),
        )
        .await;

    let crashed = server("gw-crashed#1");
    let mut servers = live_servers();
    servers.push(crashed.clone());
    for s in &servers {
        f.seed(s, USERS).await;
    }
    let beats = connect(&f.settings);
    let mut fleet = Fleet::start(&f.registry, &beats, &servers, GRACE_MS);
    fleet_alive(&f.conn, &f.keys).await;
    fleet.crash(&crashed).await;
    let _: () = f.query(&redis::cmd("SAVE")).await;
    // The record the first run wrote is in the RDB, with this Redis's run_id.
    f.redis.kill();
    tokio::time::sleep(Duration::from_millis(3_000)).await; // the downtime
    f.redis.restart().unwrap();
    let restarted = Instant::now();
    let out = once(&f);
    answering(&f.conn).await;
    let waited: u64 = out
        .split("waited ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no wait in: {out}"));
    assert!(waited > 0, "{out}");
    assert!(
        !out.contains("; 0 waited"),
        "the first pass held no verdict: {out}"
    );
    assert!(
        restarted.elapsed() >= Duration::from_millis(GRACE_MS),
        "{out}"
    );
    let events = published(&f.conn, &f.keys).await;
    assert_eq!(dead_names(&events), vec![crashed.as_str()], "{out}");
    assert_eq!(damage(&f.registry, &f.conn, &f.keys).await, (0, 0), "{out}");
    eprintln!("--once after the restart: {out}");
    assert_eq!(fleet.stop().await, 0);
}

/// The Sentinel primary is SIGKILLed; the failover takes longer than the grace. The
/// fleet follows the promoted replica; no live server is declared dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_longer_than_the_grace_fences_no_live_server() {
    init_logs();
    if !RedisSentinels::supported() {
        cannot_run("redis-server is not installed");
        return;
    }
    let mut group = tokio::task::spawn_blocking(|| {
        RedisSentinels::start(1, 3, &["--notify-keyspace-events", "Ex"])
    })
    .await
    .unwrap()
    .expect("start a primary, a replica and three sentinels");
    let grace = 1_000;
    let mut settings = settings(&group.nodes[0], Layout::Hash);
    settings.redis_url = "redis://127.0.0.1:1/0".into();
    settings.redis_sentinels = group.sentinel_urls();
    settings.redis_sentinel_master = Some("mymaster".into());
    settings.heartbeat_grace_ms = grace;
    settings.reconcile_interval_ms = 500;
    settings.sweep_pause_ms = 20;
    settings.validate().unwrap();
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), settings.layout);
    let crashed = server("gw-crashed#1");
    let mut servers = live_servers();
    servers.push(crashed.clone());
    for s in &servers {
        seed(&registry, &conn, s, USERS).await;
    }
    let beats = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let mut fleet = Fleet::start(&registry, &beats, &servers, grace);
    fleet_alive(&conn, &keys).await;
    let reconciler = RunningReconciler::start(&settings);
    let worker = spawn_worker(&settings);
    wait_for("three passes", Duration::from_secs(30), || async {
        reconciler.metrics.reconcile_passes.get() >= 3
    })
    .await;

    fleet.crash(&crashed).await;
    // Everything the primary has reaches the replica before the kill.
    let offset = group.repl_offset(0).expect("the primary's offset");
    tokio::task::block_in_place(|| {
        group
            .wait_replicated(1, offset, Duration::from_secs(30))
            .expect("the replica catches up")
    });
    let killed = Instant::now();
    group.nodes[0].kill();
    let promoted = tokio::task::block_in_place(|| {
        group
            .wait_failover_from(0, Duration::from_secs(90))
            .expect("the sentinels promote the replica")
    });
    let failover = killed.elapsed();
    assert_eq!(promoted, 1);
    assert!(
        failover > Duration::from_millis(grace),
        "the failover took {failover:?}, not longer than the grace: the test proves nothing"
    );
    answering(&conn).await;

    wait_for(
        "the crashed server published and cleaned",
        Duration::from_secs(90),
        || async {
            !published(&conn, &keys).await.is_empty()
                && still_pointing(&registry, &conn, &crashed, USERS).await == 0
        },
    )
    .await;
    let passes = reconciler.metrics.reconcile_passes.get();
    wait_for("three more passes", Duration::from_secs(30), || async {
        reconciler.metrics.reconcile_passes.get() >= passes + 3
    })
    .await;
    let events = published(&conn, &keys).await;
    assert_eq!(dead_names(&events), vec![crashed.as_str()]);
    assert_eq!(damage(&registry, &conn, &keys).await, (0, 0));
    eprintln!(
        "failover took {failover:?}; outages seen: failed_calls {}, restart {}",
        outages(&reconciler, "failed_calls"),
        outages(&reconciler, "restart")
    );
    assert!(outages(&reconciler, "failed_calls") + outages(&reconciler, "restart") >= 1);
    reconciler.stop().await;
    worker.stop().await;
    assert_eq!(fleet.stop().await, 0, "a live server was told it is fenced");
    drop(group);
}

/// The control: with Redis up all along, a server that stops heartbeating is declared
/// dead within about a grace and an interval, whatever the guard does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_outage_a_silent_server_is_found_within_a_grace() {
    let redis = redis_with(&[]);
    let f = Fixture::on(redis, Layout::Hash, grace_settings);
    let crashed = server("gw-crashed#1");
    let mut servers = live_servers();
    servers.push(crashed.clone());
    for s in &servers {
        f.seed(s, USERS).await;
    }
    let beats = connect(&f.settings);
    let mut fleet = Fleet::start(&f.registry, &beats, &servers, GRACE_MS);
    fleet_alive(&f.conn, &f.keys).await;
    let reconciler = RunningReconciler::start(&f.settings);
    let worker = spawn_worker(&f.settings);
    wait_for("three passes", Duration::from_secs(30), || async {
        reconciler.metrics.reconcile_passes.get() >= 3
    })
    .await;
    let crashed_ms = registry_janitor::now_ms();
    fleet.crash(&crashed).await;
    let found_ms = only_the_crashed_server_found(&f.registry, &f.conn, &f.keys, &crashed).await;
    eprintln!("found {} ms after the crash", found_ms - crashed_ms);
    assert!(
        found_ms < crashed_ms + GRACE_MS + 15_000,
        "found {} ms after the crash",
        found_ms - crashed_ms
    );
    assert_eq!(damage(&f.registry, &f.conn, &f.keys).await, (0, 0));
    assert_eq!(outages(&reconciler, "failed_calls"), 0);
    reconciler.stop().await;
    worker.stop().await;
    assert_eq!(fleet.stop().await, 0);
}

/// The reconciler's log of an outage: one warning when it starts, however many calls
/// fail during it, and one line when Redis answers again, with the outage's duration
/// (what the operator docs promise). A real reconciler process; Redis paused (SIGSTOP)
/// for 4 s, during which its passes, its sweep and its observations all fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_logged_once_when_it_starts_and_once_when_it_ends() {
    let f = Fixture::new(Layout::Hash);
    let reconciler = WorkerProcess::start_command(
        &f.settings,
        &[
            ("JANITOR_HEARTBEAT_GRACE_MS", "2000"),
            ("JANITOR_RECONCILE_INTERVAL_MS", "200"),
            ("JANITOR_SWEEP_PAUSE_MS", "20"),
        ],
        &["reconcile"],
    );
    wait_for(
        "the reconciler's first pass",
        Duration::from_secs(30),
        || async {
            reconciler
                .log()
                .contains("listening for liveness-key expiries")
        },
    )
    .await;
    f.redis.signal("STOP").unwrap();
    let paused = Instant::now();
    tokio::time::sleep(Duration::from_millis(4_000)).await; // the outage, not a wait for a result
    f.redis.signal("CONT").unwrap();
    let paused_for = paused.elapsed();
    let ended = "Redis reachable again after an outage of";
    wait_for(
        "the outage's end logged",
        Duration::from_secs(30),
        || async { reconciler.log().contains(ended) },
    )
    .await;
    let log = reconciler.log();
    // Up to the end of this outage. A later slow answer on a loaded machine is an outage
    // of its own, with its own warning, and is not counted here.
    let upto = log
        .lines()
        .take_while(|l| !l.contains(ended))
        .collect::<Vec<_>>();
    let warned = upto.iter().filter(|l| l.contains("Redis outage")).count();
    assert_eq!(warned, 1, "{log}");
    let end = log
        .lines()
        .filter(|l| l.contains(ended))
        .collect::<Vec<_>>();
    assert!(!end.is_empty(), "{log}");
    let outage_ms: u64 = end[0]
        .split("outage_ms=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no outage_ms in {}", end[0]));
    // The outage began at the first failed call (up to a step after the pause began) and
    // ended when Redis answered again.
    assert!(
        outage_ms >= 2_000 && outage_ms <= paused_for.as_millis() as u64 + 10_000,
        "outage_ms={outage_ms}, paused for {paused_for:?}\n{log}"
    );
    drop(reconciler);
}
