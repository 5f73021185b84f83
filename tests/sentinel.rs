//! Redis Sentinel with real processes: a primary, a replica and three sentinels
//! (`redis-server --sentinel`), all on free ports. The worker, the reconciler and the CLI
//! find the primary through the sentinels and follow it across a failover.

mod common;

use std::time::{Duration, Instant};

use common::*;
use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    keys::Keys,
    registry::Registry,
    status,
};
use registry_janitor_testkit::{RedisSentinels, MASTER_NAME};

/// A Sentinel group and settings that reach it through the sentinels only.
struct SentinelFixture {
    settings: Settings,
    /// Through the sentinels, like the janitor's own.
    conn: RedisConn,
    keys: Keys,
    registry: Registry,
    group: RedisSentinels,
}

impl SentinelFixture {
    async fn start(node_args: &'static [&'static str]) -> Option<Self> {
        init_logs();
        if !RedisSentinels::supported() {
            cannot_run("redis-server is not installed");
            return None;
        }
        let group = tokio::task::spawn_blocking(move || RedisSentinels::start(1, 3, node_args))
            .await
            .unwrap()
            .expect("start a primary, a replica and three sentinels");
        let mut settings = settings(&group.nodes[0], Layout::Hash);
        // Behind Sentinel, redis_url gives credentials and database only: a port where
        // nothing listens shows that its host and port are not used.
        settings.redis_url = "redis://127.0.0.1:1/0".into();
        settings.redis_sentinels = group.sentinel_urls();
        settings.redis_sentinel_master = Some(MASTER_NAME.into());
        settings.validate().unwrap();
        let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
            .await
            .unwrap();
        let keys = Keys::new(settings.key_prefix.clone());
        Some(SentinelFixture {
            registry: Registry::new(keys.clone(), settings.layout),
            keys,
            conn,
            settings,
            group,
        })
    }

    /// The `JANITOR_*` variables that point a process at the sentinels.
    fn env(&self) -> Vec<(&'static str, String)> {
        let urls: Vec<String> = self
            .settings
            .redis_sentinels
            .iter()
            .map(|u| format!("{u:?}"))
            .collect();
        vec![
            ("JANITOR_REDIS_SENTINELS", format!("[{}]", urls.join(","))),
            ("JANITOR_REDIS_SENTINEL_MASTER", MASTER_NAME.into()),
        ]
    }

    /// Polls `check` until true; on timeout fails with `what` and the sentinels' logs.
    async fn wait<F, Fut>(&self, what: &str, timeout: Duration, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        while !check().await {
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for: {what}\n{}",
                self.group.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_idle(&self, conn: &RedisConn, timeout: Duration) {
        self.wait("all events acknowledged", timeout, || async {
            status::collect_from(conn, &self.keys)
                .await
                .is_ok_and(|s| s.is_idle())
        })
        .await;
    }
}

fn env_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A counter of the worker's /metrics, or None while it does not answer.
fn counter(metrics_addr: &str, name: &str) -> Option<f64> {
    let (code, body) = http_get(metrics_addr, "/metrics");
    (code == 200).then(|| sample(&body, name)).flatten()
}

/// The primary is SIGKILLed in the middle of a cleanup; the sentinels promote the
/// replica; the worker (a real process, configured with the sentinels only) follows it
/// and finishes the cleanup there.
///
/// Replication is asynchronous, so the promoted replica may lack deletes that the old
/// primary acknowledged. They are reproduced exactly as they look in Redis: before the
/// kill, forward entries of users the walk had already deleted are written back on the
/// replica alone (made writable for that moment; a replica's own writes are not
/// replicated anywhere). The walk's SSCAN cursor is stored with the run_id of the Redis
/// that issued it; the promoted replica has another run_id, so the walk starts again
/// from 0 there, finds those entries and deletes them. The worker's count of entries
/// kept (users who moved to another server, met once per walk) shows the walk made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_mid_cleanup_fails_over_and_the_cleanup_finishes() {
    let Some(mut f) = SentinelFixture::start(&[]).await else {
        return;
    };
    let (dead, live, elsewhere) = (server("gw-dead#1"), server("gw-live#1"), server("gw-new#1"));
    const USERS: usize = 40_000;
    const LIVE: usize = 2_000;
    const MOVED: usize = 2_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    seed(&f.registry, &f.conn, &live, LIVE).await;
    // Users of the dead server who reconnected elsewhere before it was declared dead:
    // still members of its reverse set, kept by the cleanup.
    f.registry
        .heartbeat(&f.conn, &elsewhere, 60_000)
        .await
        .unwrap();
    let moved: Vec<Vec<u8>> = (0..USERS)
        .step_by(USERS / MOVED)
        .map(|n| user(&dead, n))
        .collect();
    assert_eq!(moved.len(), MOVED);
    for u in &moved {
        f.registry.register(&f.conn, u, &elsewhere).await.unwrap();
    }

    f.settings.chunk_size = 20;
    f.settings.metrics_addr = free_addr();
    let metrics = f.settings.metrics_addr.clone();
    let env = f.env();
    let worker = WorkerProcess::start_with(&f.settings, &env_refs(&env));
    let id = kill(&f.conn, &f.keys, &dead).await;
    wait_walked(&f.group.nodes[0], &f.conn, &f.keys, &dead, 3_000).await;
    f.wait(
        "some moved users met by the walk",
        Duration::from_secs(60),
        || async {
            counter(&metrics, "registry_janitor_entries_kept_total").is_some_and(|k| k >= 20.0)
        },
    )
    .await;
    let kept_before = counter(&metrics, "registry_janitor_entries_kept_total").unwrap();

    // Mid-cleanup: the worker is held still while the failover is prepared, so the kill
    // lands in the middle of its cleanup whatever the machine's speed.
    worker.signal("STOP");
    assert!(
        is_pending(&f.conn, &f.keys, &id).await,
        "the cleanup finished before the kill: the test proves nothing"
    );
    let (old, replica) = (0, 1);
    let ids: Vec<Vec<u8>> = (0..USERS).map(|n| user(&dead, n)).collect();
    let owners = f.registry.owners(&f.conn, &ids).await.unwrap();
    let lost: Vec<&Vec<u8>> = ids
        .iter()
        .zip(&owners)
        .filter(|(_, o)| o.is_none())
        .map(|(u, _)| u)
        .take(300)
        .collect();
    assert!(lost.len() >= 100, "too few users walked: {}", lost.len());
    let offset = f.group.repl_offset(old).expect("the primary's offset");
    tokio::task::block_in_place(|| {
        f.group
            .wait_replicated(replica, offset, Duration::from_secs(30))
            .expect("the replica catches up")
    });
    let on_replica = conn::shared(&conn::client(&f.group.nodes[replica].url()).unwrap()).unwrap();
    let set_read_only = |yes: &str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("replica-read-only")
            .arg(yes)
            .to_owned()
    };
    let _: () = set_read_only("no")
        .query_async(&mut on_replica.clone())
        .await
        .unwrap();
    for u in &lost {
        let _: () = redis::cmd("HSET")
            .arg(f.keys.registry())
            .arg(u.as_slice())
            .arg(dead.as_str())
            .query_async(&mut on_replica.clone())
            .await
            .unwrap();
    }
    let _: () = set_read_only("yes")
        .query_async(&mut on_replica.clone())
        .await
        .unwrap();
    // The replica's copy of the walk's cursor carries the old primary's run_id, which
    // the replica does not have: once promoted, it makes the walk start again.
    let stored: Option<String> = redis::cmd("HGET")
        .arg(f.keys.server_cleanup(&dead))
        .arg("walk_run_id")
        .query_async(&mut on_replica.clone())
        .await
        .unwrap();
    let (old_run_id, new_run_id) = (f.group.run_id(old), f.group.run_id(replica));
    assert_eq!(
        stored, old_run_id,
        "the cursor is tied to the primary's run_id"
    );
    assert_ne!(old_run_id, new_run_id);

    f.group.nodes[old].kill();
    worker.signal("CONT");
    let promoted = tokio::task::block_in_place(|| {
        f.group
            .wait_failover_from(old, Duration::from_secs(90))
            .expect("the sentinels promote the replica")
    });
    assert_eq!(promoted, replica);

    f.wait_idle(&f.conn, Duration::from_secs(120)).await;
    // A connection made after the failover, through the sentinels.
    let fresh = fresh_conn(&f.settings).await;
    assert_eq!(
        still_pointing(&f.registry, &fresh, &dead, USERS).await,
        0,
        "stale entries after the failover (deletes lost in it not made again?)"
    );
    assert_eq!(
        still_pointing(&f.registry, &fresh, &live, LIVE).await,
        LIVE,
        "live entries lost in the failover"
    );
    let owners = f.registry.owners(&fresh, &moved).await.unwrap();
    assert!(
        owners
            .iter()
            .all(|o| o.as_deref() == Some(elsewhere.as_str())),
        "a user who had moved elsewhere lost the entry"
    );
    assert!(!is_pending(&fresh, &f.keys, &id).await);
    let s = status::collect_from(&fresh, &f.keys).await.unwrap();
    assert!(s.is_idle() && s.dead_letters == 0, "{s:?}");
    // At least once: the event was acknowledged (by the step that found the server
    // clean, on the new primary), and the walk was made again there from cursor 0.
    f.wait("the worker's counts", Duration::from_secs(30), || async {
        counter(&metrics, "registry_janitor_entries_kept_total")
            .is_some_and(|k| k >= kept_before + MOVED as f64)
    })
    .await;

    // The CLI finds the new primary through the sentinels (redis_url points nowhere).
    let out = janitor(&f.settings)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["pending"], 0, "{report}");
    assert_eq!(report["lag"], 0, "{report}");

    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "worker: {log}");
    let new_port = f.group.nodes[replica].port().to_string();
    assert!(
        log.contains("lost the primary") && log.contains(&format!("127.0.0.1:{new_port}")),
        "the worker's log does not show it following the primary:\n{log}"
    );
}

/// A planned failover (`SENTINEL FAILOVER`): both nodes stay up, the old primary becomes
/// a replica. The reconciler moves its expiry-hint subscription to the new primary (a
/// subscription left on a replica hears no expiries), and a server whose liveness key
/// expires there is declared dead by that hint, long before the next periodic pass, and
/// cleaned by the worker. (A connection still pointing at the demoted node: the unit
/// tests of `conn::sentinel`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_follows_a_planned_failover() {
    let Some(f) = SentinelFixture::start(&["--notify-keyspace-events", "Ex"]).await else {
        return;
    };
    let env = f.env();
    let reconciler_metrics = free_addr();
    let mut reconciler_env = env_refs(&env);
    reconciler_env.extend([
        // No periodic pass within the test: only an expiry hint can find the server.
        ("JANITOR_RECONCILE_INTERVAL_MS", "600000"),
        ("JANITOR_HEARTBEAT_GRACE_MS", "500"),
        ("JANITOR_METRICS_ADDR", &reconciler_metrics),
    ]);
    let reconciler = WorkerProcess::start_command(&f.settings, &reconciler_env, &["reconcile"]);
    let worker = WorkerProcess::start_with(&f.settings, &env_refs(&env));
    let listening_on = |port: u16, log: &str| {
        log.lines().any(|l| {
            l.contains("listening for liveness-key expiries on the primary")
                && l.contains(&format!("127.0.0.1:{port}"))
        })
    };
    let (old, replica) = (0, 1);
    let old_port = f.group.nodes[old].port();
    f.wait(
        "the reconciler subscribed on the primary",
        Duration::from_secs(60),
        || async { listening_on(old_port, &reconciler.log()) },
    )
    .await;

    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER_NAME)
        .query_async(
            &mut conn::shared(&conn::client(&f.group.sentinels[0].url()).unwrap()).unwrap(),
        )
        .await
        .unwrap();
    let promoted = tokio::task::block_in_place(|| {
        f.group
            .wait_failover_from(old, Duration::from_secs(90))
            .expect("the sentinels promote the replica")
    });
    assert_eq!(promoted, replica);
    f.wait(
        "the old primary is a replica",
        Duration::from_secs(60),
        || async { f.group.role(old).as_deref() == Some("slave") },
    )
    .await;
    let new_port = f.group.nodes[replica].port();
    f.wait(
        "the reconciler subscribed on the new primary",
        Duration::from_secs(60),
        || async { listening_on(new_port, &reconciler.log()) },
    )
    .await;

    // A server whose liveness key expires on the new primary.
    let dead = server("gw-expired#1");
    seed(&f.registry, &f.conn, &dead, 500).await;
    f.registry.heartbeat(&f.conn, &dead, 1_000).await.unwrap();
    f.wait(
        "the expiry hint found the server and the worker cleaned it",
        Duration::from_secs(90),
        || async { still_pointing(&f.registry, &f.conn, &dead, 500).await == 0 },
    )
    .await;
    f.wait_idle(&f.conn, Duration::from_secs(60)).await;
    assert!(
        counter(&reconciler_metrics, "registry_janitor_expiry_hints_total")
            .is_some_and(|n| n >= 1.0),
        "no expiry hint reached the reconciler; its log:\n{}",
        reconciler.log()
    );

    for p in [&reconciler, &worker] {
        p.signal("TERM");
    }
    let (status, log) = worker.wait(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "worker: {log}");
    let (status, log) = reconciler.wait(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "reconciler: {log}");
}

/// Every `users.evicted` entry of a stream, as (entry id, user) pairs in stream order.
async fn announced(conn: &RedisConn, keys: &Keys) -> Vec<(String, Vec<u8>)> {
    use registry_janitor::evictions::{read_all, Eviction};
    let mut out = Vec::new();
    for (id, entry) in read_all(conn, keys).await.unwrap() {
        if let Some(Eviction::Evicted { users, .. }) = entry {
            out.extend(users.into_iter().map(|u| (id.clone(), u)));
        }
    }
    out
}

/// The evictions stream across a Sentinel failover mid-cleanup, with a real loss of the
/// primary's last writes: the replica is cut off (SIGSTOP, then the primary drops its
/// link, so that it cannot resynchronise) while the cleanup goes on on the primary, then
/// the primary is SIGKILLed and the replica promoted. Whatever the primary did after the
/// cut is lost, whole steps at a time: each step is one script (the deletes, its
/// `users.evicted` entry and the walk's progress), replicated as one MULTI/EXEC, so the
/// promoted replica has all of a step or none of it. The walk starts again from 0 there
/// (its cursor is tied to the old primary's run_id) and deletes, and announces, the
/// entries whose deletes were lost.
///
/// The guarantee asserted: in the end state every user of the dead server is deleted and
/// announced on the new primary's stream, exactly once there. A consumer that read the
/// old primary's stream before the failover saw the lost entries too, so it sees those
/// users twice (at least once). The figures are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_mid_cleanup_loses_no_eviction_announcement() {
    let Some(mut f) = SentinelFixture::start(&[]).await else {
        return;
    };
    let dead = server("gw-dead#1");
    const USERS: usize = 60_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    f.settings.chunk_size = 20;
    let env = f.env();
    let worker = WorkerProcess::start_with(&f.settings, &env_refs(&env));
    let id = kill(&f.conn, &f.keys, &dead).await;
    wait_walked(&f.group.nodes[0], &f.conn, &f.keys, &dead, 3_000).await;

    let (old, replica) = (0, 1);
    let on_old = conn::shared(&conn::client(&f.group.nodes[old].url()).unwrap()).unwrap();
    // Cut the replica off: stopped, it cannot reconnect and resynchronise from the
    // backlog once the primary drops its link.
    f.group.nodes[replica].signal("STOP").unwrap();
    let _: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut on_old.clone())
        .await
        .unwrap();
    let cut = announced(&on_old, &f.keys).await.len();
    // The cleanup goes on on the primary alone for a while.
    f.wait(
        "200 more users announced on the primary alone",
        Duration::from_secs(60),
        || async { announced(&on_old, &f.keys).await.len() >= cut + 200 },
    )
    .await;
    worker.signal("STOP");
    assert!(
        is_pending(&on_old, &f.keys, &id).await,
        "the cleanup finished before the kill: the test proves nothing"
    );
    let before_kill = announced(&on_old, &f.keys).await;
    f.group.nodes[old].kill();
    f.group.nodes[replica].signal("CONT").unwrap();
    worker.signal("CONT");
    let promoted = tokio::task::block_in_place(|| {
        f.group
            .wait_failover_from(old, Duration::from_secs(90))
            .expect("the sentinels promote the replica")
    });
    assert_eq!(promoted, replica);
    f.wait_idle(&f.conn, Duration::from_secs(180)).await;

    let fresh = fresh_conn(&f.settings).await;
    assert_eq!(
        still_pointing(&f.registry, &fresh, &dead, USERS).await,
        0,
        "stale entries after the failover"
    );
    let after = announced(&fresh, &f.keys).await;
    let mut times = std::collections::HashMap::<&[u8], usize>::new();
    for (_, u) in &after {
        *times.entry(u.as_slice()).or_default() += 1;
    }
    let missing = (0..USERS)
        .map(|n| user(&dead, n))
        .filter(|u| !times.contains_key(u.as_slice()))
        .count();
    let duplicated = times.values().filter(|&&n| n > 1).count();
    // What the old primary announced and the failover lost (its entry ids are not on the
    // new primary with those users).
    let kept: std::collections::HashSet<(&str, &[u8])> = after
        .iter()
        .map(|(id, u)| (id.as_str(), u.as_slice()))
        .collect();
    let lost: Vec<&Vec<u8>> = before_kill
        .iter()
        .filter(|(id, u)| !kept.contains(&(id.as_str(), u.as_slice())))
        .map(|(_, u)| u)
        .collect();
    let lost_entries = before_kill
        .iter()
        .filter(|(id, u)| !kept.contains(&(id.as_str(), u.as_slice())))
        .map(|(id, _)| id)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let reannounced = lost
        .iter()
        .filter(|u| times.contains_key(u.as_slice()))
        .count();
    eprintln!(
        "evictions across the failover: {USERS} users deleted; announced on the old primary \
         before the kill {}, of them lost in the failover {} users in {lost_entries} entries \
         (announced again on the new primary: {reannounced}); the new primary's stream: \
         {} announcements, {} distinct users, {missing} deleted users missing, \
         {duplicated} users announced more than once",
        before_kill.len(),
        lost.len(),
        after.len(),
        times.len(),
    );
    assert!(
        !lost.is_empty(),
        "no write was lost in the failover: the test proves nothing"
    );
    assert_eq!(
        missing, 0,
        "deleted users never announced on the new primary"
    );
    assert_eq!(
        duplicated, 0,
        "users announced twice on the new primary's stream"
    );
    assert_eq!(
        reannounced,
        lost.len(),
        "users announced only in entries the failover lost"
    );
    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "worker: {log}");
}
