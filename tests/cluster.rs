//! The worker on a local Redis Cluster (redis-server processes on free ports, created
//! with redis-cli --cluster create): each layout end to end, the reconnect race, a master
//! killed mid-cleanup that fails over to its replica, a takeover after a failover,
//! fencing and a live reshard; in layout conns with users who hold several connections
//! on several servers ([`Devices`]). Skipped, with a message saying so, only when this
//! redis-server cannot run a cluster.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    keys::Keys,
    metrics::outcome,
    registry::Registry,
    status,
};
use registry_janitor_testkit::RedisCluster;

struct ClusterFixture {
    settings: Settings,
    conn: RedisConn,
    keys: Keys,
    registry: Registry,
    cluster: RedisCluster,
}

impl ClusterFixture {
    async fn start(
        masters: usize,
        replicas: usize,
        layout: Layout,
        chunk_size: usize,
    ) -> Option<Self> {
        init_logs();
        if !RedisCluster::supported() {
            cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
            return None;
        }
        let cluster = tokio::task::spawn_blocking(move || RedisCluster::start(masters, replicas))
            .await
            .unwrap()
            .expect("start a local cluster");
        let mut settings = cluster_settings(&cluster, layout);
        settings.chunk_size = chunk_size;
        let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
            .await
            .unwrap();
        let keys = Keys::for_settings(&settings);
        Some(ClusterFixture {
            registry: Registry::new(keys.clone(), layout),
            keys,
            conn,
            settings,
            cluster,
        })
    }

    async fn wait_idle(&self, timeout: Duration) {
        wait_until(
            &self.cluster.nodes[0],
            "all events acknowledged",
            timeout,
            || async {
                status::collect_from(&self.conn, &self.keys)
                    .await
                    .is_ok_and(|s| s.is_idle())
            },
        )
        .await;
    }

    async fn still_pointing(&self, s: &registry_janitor::event::ServerId, users: usize) -> usize {
        still_pointing(&self.registry, &self.conn, s, users).await
    }

    /// Layout conns: every connection on the masters (all of them, not only the users a
    /// test seeded) whose field names `s`.
    async fn connections_naming(
        &self,
        s: &registry_janitor::event::ServerId,
    ) -> Vec<(Vec<u8>, Vec<u8>)> {
        let urls: Vec<String> = masters(&self.cluster)
            .into_iter()
            .map(|i| self.cluster.nodes[i].url())
            .collect();
        connections_naming(&urls, &self.keys, s).await
    }
}

async fn cleans_dead_servers_on_a_cluster(layout: Layout) {
    let Some(f) = ClusterFixture::start(3, 0, layout, 200).await else {
        return;
    };
    let (a, b, live) = (server("gw-a#1"), server("gw-b#1"), server("gw-live#1"));
    for s in [&a, &b, &live] {
        seed(&f.registry, &f.conn, s, 2_000).await;
    }
    f.registry
        .register(&f.conn, &entry(layout, &a, 7), &live)
        .await
        .unwrap();
    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &a).await;
    kill(&f.conn, &f.keys, &b).await;
    f.wait_idle(Duration::from_secs(60)).await;
    assert_eq!(f.still_pointing(&a, 2_000).await, 0);
    assert_eq!(f.still_pointing(&b, 2_000).await, 0);
    assert_eq!(f.still_pointing(&live, 2_000).await, 2_000);
    assert_eq!(
        f.registry
            .owner(&f.conn, &entry(layout, &a, 7))
            .await
            .unwrap()
            .as_deref(),
        Some("gw-live#1")
    );
    let mut c = f.conn.clone();
    let gone: u64 = redis::cmd("EXISTS")
        .arg(&f.keys.server_members_left(&a))
        .query_async(&mut c)
        .await
        .unwrap();
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(f.keys.servers())
        .arg(a.as_str())
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(
        (gone, score),
        (0, None),
        "the reverse set and the `servers` entry are gone"
    );
    // At least once on a cluster: every deleted user is announced; the one who had
    // moved before (kept) never.
    let (announced, cleaned) = evictions_of(&f.conn, &f.keys).await;
    let announced: std::collections::HashSet<_> = announced.into_iter().collect();
    for (s, range) in [(&a, 0..2_000), (&b, 0..2_000)] {
        for n in range.filter(|n| (s, *n) != (&a, 7)) {
            assert!(
                announced.contains(&(s.as_str().to_owned(), entry(layout, s, n))),
                "{s}: user {n} deleted and never announced"
            );
        }
    }
    assert!(!announced.contains(&(a.as_str().to_owned(), entry(layout, &a, 7))));
    assert!(announced.iter().all(|(s, _)| s != live.as_str()));
    assert_eq!(cleaned.len(), 2, "{cleaned:?}");
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 2);
    assert!(
        counter_of(
            &worker.metrics,
            "registry_janitor_step_queue_delay_seconds_count"
        ) > 0,
        "the chunks' check-and-delete went through the step limiter (latency_target_ms 1)"
    );
    assert_eq!(worker.metrics.entries_deleted.get(), 3_999);
    assert_eq!(worker.metrics.entries_kept.get(), 1);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleans_dead_servers_on_a_cluster_hash_layout() {
    cleans_dead_servers_on_a_cluster(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleans_dead_servers_on_a_cluster_keys_layout() {
    cleans_dead_servers_on_a_cluster(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleans_dead_servers_on_a_cluster_conns_layout() {
    cleans_dead_servers_on_a_cluster(Layout::Conns).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_race_the_cleanup_on_a_cluster() {
    reconnects_race_the_cleanup(Layout::Keys).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]);
/// connections of the dead server reconnect to a live one while it is cleaned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_race_the_cleanup_on_a_cluster_conns_layout() {
    reconnects_race_the_cleanup(Layout::Conns).await;
}

async fn reconnects_race_the_cleanup(layout: Layout) {
    let Some(f) = ClusterFixture::start(3, 0, layout, 50).await else {
        return;
    };
    let (dead, live) = (server("gw-dead#1"), server("gw-new#1"));
    const USERS: usize = 6_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    let devices = match layout {
        Layout::Conns => {
            let laptops = server("gw-laptops#1");
            Some(Devices::add(&f.registry, &f.conn, &dead, [&live, &laptops], USERS, USERS).await)
        }
        _ => None,
    };
    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &dead).await;
    // A reconnect that reads what it replaced (one key: one slot), then joins the reverse
    // set: the oracle of which users were kept.
    let swap = match layout {
        Layout::Conns => redis::Script::new(
            "local old = redis.call('HGET', KEYS[1], ARGV[2]) \
             redis.call('HSET', KEYS[1], ARGV[2], ARGV[1]) return old",
        ),
        _ => redis::Script::new("return redis.call('SET', KEYS[1], ARGV[1], 'GET')"),
    };
    let (mut moved, mut kept, mut during) = (Vec::new(), Vec::new(), 0);
    for n in (0..USERS).rev().step_by(5) {
        let u = entry(layout, &dead, n);
        let (key, field) = f.keys.forward_of_member(layout, &u).unwrap();
        let mut call = swap.key(key);
        call.arg(live.as_str());
        if let Some(field) = field {
            call.arg(field);
        }
        let was: Option<String> = call.invoke_async(&mut f.conn.clone()).await.unwrap();
        let _: () = redis::cmd("SADD")
            .arg(f.keys.server_users(&live))
            .arg(&u)
            .query_async(&mut f.conn.clone())
            .await
            .unwrap();
        if was.as_deref() == Some(dead.as_str()) {
            kept.push(u);
        }
        moved.push(n);
        let cleaner = registry_janitor::cleanup::Cleaner::new(f.keys.clone(), layout, 1, 1);
        let exists = u64::from(cleaner.progress(&f.conn, &dead).await.unwrap().is_some());
        during += exists;
    }
    f.wait_idle(Duration::from_secs(60)).await;
    assert!(
        during > 0,
        "no reconnect overlapped the cleanup; the test proves nothing"
    );
    for n in &moved {
        assert_eq!(
            f.registry
                .owner(&f.conn, &entry(layout, &dead, *n))
                .await
                .unwrap()
                .as_deref(),
            Some("gw-new#1"),
            "user {n} reconnected and must keep the new entry"
        );
    }
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    // Every user but the kept ones lost their entry to the janitor: each is announced at
    // least once, the kept ones never.
    let (announced, _) = evictions_of(&f.conn, &f.keys).await;
    let announced: std::collections::HashSet<Vec<u8>> =
        announced.into_iter().map(|(_, u)| u).collect();
    let kept: std::collections::HashSet<Vec<u8>> = kept.into_iter().collect();
    for n in 0..USERS {
        let u = entry(layout, &dead, n);
        assert_eq!(
            announced.contains(&u),
            !kept.contains(&u),
            "user {n}: announced {}, kept {}",
            announced.contains(&u),
            kept.contains(&u)
        );
    }
    if let Some(devices) = devices {
        // The connections that moved name the live server; every other connection of
        // the dead server is gone (and announced), the others untouched.
        let moved: Vec<_> = moved
            .iter()
            .map(|n| (entry(layout, &dead, *n), live.clone()))
            .collect();
        devices.assert_end_state(&f.registry, &f.conn, &moved).await;
        assert_eq!(f.connections_naming(&dead).await, vec![]);
        let never = devices
            .dead_members()
            .into_iter()
            .filter(|m| !kept.contains(m) && !announced.contains(m))
            .count();
        assert_eq!(never, 0, "connections deleted and never announced");
    }
    worker.stop().await;
}

/// A master (the one holding the dead server's reverse set and progress) is SIGKILLed
/// mid-cleanup; its replica takes over, and the worker carries on to a correct end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_cleanup_fails_over_and_the_cleanup_finishes() {
    a_master_killed_mid_cleanup(Layout::Keys).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_cleanup_fails_over_and_the_cleanup_finishes_conns_layout() {
    a_master_killed_mid_cleanup(Layout::Conns).await;
}

async fn a_master_killed_mid_cleanup(layout: Layout) {
    let Some(mut f) = ClusterFixture::start(3, 1, layout, 20).await else {
        return;
    };
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 15_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    seed(&f.registry, &f.conn, &live, 1_000).await;
    let devices = match layout {
        Layout::Conns => {
            let laptops = server("gw-laptops#1");
            Some(Devices::add(&f.registry, &f.conn, &dead, [&live, &laptops], USERS, 4_000).await)
        }
        _ => None,
    };
    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &dead).await;
    let cleaner = registry_janitor::cleanup::Cleaner::new(f.keys.clone(), layout, 1, 1);
    wait_until(
        &f.cluster.nodes[0],
        "the cleanup under way",
        Duration::from_secs(30),
        || async {
            cleaner
                .progress(&f.conn, &dead)
                .await
                .ok()
                .flatten()
                .is_some_and(|n| n >= 1_000)
        },
    )
    .await;
    let victim = f
        .cluster
        .master_of(f.keys.server_users(&dead).as_bytes())
        .expect("a master serves the slot");
    // The replica holds the data but for the last moment's writes (which the failover
    // may lose, and the cleanup must redo), not an empty dataset of a resync in progress.
    f.cluster
        .wait_replica_caught_up(victim, 1 << 20, Duration::from_secs(30))
        .expect("the replica catches up");
    f.cluster.nodes[victim].kill();
    f.cluster
        .wait_ok(Duration::from_secs(30))
        .expect("the replica takes over");
    f.wait_idle(Duration::from_secs(90)).await;
    // Checked over a new connection, which learns the new topology at once (a long-lived
    // one may still hold a route to the dead master for a while under load).
    let fresh = fresh_conn(&f.settings).await;
    assert_eq!(
        still_pointing(&f.registry, &fresh, &dead, USERS).await,
        0,
        "stale entries after the failover"
    );
    assert_eq!(
        still_pointing(&f.registry, &fresh, &live, 1_000).await,
        1_000,
        "live entries lost in the failover"
    );
    // At least once across the failover: every user of the dead server is announced
    // (a lost announcement is made again by the walk that the epoch change repeats).
    let (announced, _) = evictions_of(&fresh, &f.keys).await;
    let announced: std::collections::HashSet<Vec<u8>> =
        announced.into_iter().map(|(_, u)| u).collect();
    let deleted: Vec<Vec<u8>> = match &devices {
        Some(devices) => devices.dead_members(),
        None => (0..USERS).map(|n| user(&dead, n)).collect(),
    };
    let missing = deleted.iter().filter(|u| !announced.contains(*u)).count();
    assert_eq!(
        missing, 0,
        "deleted users never announced after the failover"
    );
    if let Some(devices) = devices {
        // Every connection of the dead server gone, every other one of its users kept,
        // no key left of a user whose every connection was on it; and no connection
        // anywhere on the cluster names it.
        devices.assert_end_state(&f.registry, &fresh, &[]).await;
        assert_eq!(f.connections_naming(&dead).await, vec![]);
    }
    // No count of deletes or cleaned events is asserted: a delete that the failed master
    // executed and replicated but never answered is not counted, and a delivery the old
    // master did not pass on is made again. The registry's end state (above) and nothing
    // pending (wait_idle) are what a user relies on.
    worker.stop().await;
}

/// The reconciler's heartbeat pass on a cluster: a server whose heartbeat is old and
/// whose liveness key is gone is declared dead once (not again within the marker's
/// window), a live one never; the worker cleans the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_finds_dead_servers_on_a_cluster() {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let Some(f) = ClusterFixture::start(3, 0, Layout::Hash, 200).await else {
        return;
    };
    let (silent, live) = (server("gw-silent#1"), server("gw-live#1"));
    seed(&f.registry, &f.conn, &silent, 1_000).await;
    seed(&f.registry, &f.conn, &live, 1_000).await;
    let mut c = f.conn.clone();
    let _: () = redis::cmd("DEL")
        .arg(f.keys.server_alive(&silent))
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(f.keys.servers())
        .arg(1)
        .arg(silent.as_str())
        .query_async(&mut c)
        .await
        .unwrap();

    let reconciler = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let first = reconciler.run_once().await.unwrap();
    assert_eq!(
        (first.pass.published, first.pass.candidates),
        (1, 1),
        "{first}"
    );
    let again = reconciler.run_once().await.unwrap();
    assert_eq!(
        (again.pass.published, again.pass.already_reported),
        (0, 1),
        "{again}"
    );
    let worker = spawn_worker(&f.settings);
    f.wait_idle(Duration::from_secs(60)).await;
    assert_eq!(f.still_pointing(&silent, 1_000).await, 0);
    assert_eq!(
        f.still_pointing(&live, 1_000).await,
        1_000,
        "the live server is untouched"
    );
    let after = reconciler.run_once().await.unwrap();
    // Its fence keeps it a candidate, found clean, and not reported again.
    assert_eq!(
        (after.pass.published, after.pass.fenced_clean),
        (0, 1),
        "{after}"
    );
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(f.keys.servers())
        .arg(silent.as_str())
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    assert_eq!(score, None, "the cleaned server left `servers`");
    worker.stop().await;
}

/// Keyspace notifications are per node: the reconciler listens on every master, so a
/// server whose liveness key expires (on whichever master) is cleaned long before the
/// next pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_hints_arrive_from_every_master() {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let Some(mut f) = ClusterFixture::start(3, 0, Layout::Keys, 200).await else {
        return;
    };
    f.settings.reconcile_interval_ms = 120_000;
    f.settings.heartbeat_grace_ms = 200;
    f.settings.keyspace_events_auto = true;
    let metrics = Metrics::new();
    let reconciler = Reconciler::new(&f.settings, metrics.clone()).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(reconciler.run(stop.clone()));
    // Three servers whose liveness keys land on different masters (checked below).
    let crashed: Vec<_> = (0..3).map(|i| server(&format!("gw-crash-{i}#1"))).collect();
    tokio::time::sleep(Duration::from_millis(500)).await; // subscriptions in place
    for s in &crashed {
        seed(&f.registry, &f.conn, s, 300).await;
        f.registry.heartbeat(&f.conn, s, 700).await.unwrap();
    }
    let mut masters: Vec<usize> = crashed
        .iter()
        .filter_map(|s| f.cluster.master_of(f.keys.server_alive(s).as_bytes()))
        .collect();
    masters.sort();
    masters.dedup();
    assert!(
        masters.len() >= 2,
        "the liveness keys should spread over masters: {masters:?}"
    );
    let worker = spawn_worker(&f.settings);
    wait_until(
        &f.cluster.nodes[0],
        "the crashed servers cleaned",
        Duration::from_secs(20),
        || async {
            let mut left = 0;
            for s in &crashed {
                left += f.still_pointing(s, 300).await;
            }
            left == 0
        },
    )
    .await;
    assert!(
        metrics.expiry_hints.get() >= 3,
        "hints from the masters: {}",
        metrics.expiry_hints.get()
    );
    stop.cancel();
    running.await.unwrap().unwrap();
    worker.stop().await;
}

/// The drift sweep on a cluster (HSCAN of the registry, or SCAN on every master): the
/// entries of an owner no index knows are removed; live entries and an entry whose owner
/// is not a valid id stay.
async fn drift_is_repaired_on_a_cluster(layout: Layout) {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let Some(f) = ClusterFixture::start(3, 0, layout, 200).await else {
        return;
    };
    let (live, ghost) = (server("gw-live#1"), server("gw-ghost#1"));
    seed(&f.registry, &f.conn, &live, 1_000).await;
    let mut c = f.conn.clone();
    let write_entry = |user: &[u8], owner: &str| forward_write(&f.keys, layout, user, owner);
    for n in 0..500 {
        let _: () = write_entry(&entry(layout, &ghost, n), ghost.as_str())
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let _: () = write_entry(&as_entry(layout, b"odd-user"), "bad{owner}")
        .query_async(&mut c)
        .await
        .unwrap();
    let reconciler = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let report = reconciler.run_once().await.unwrap();
    assert_eq!(report.sweep.entries_removed, 500, "{report}");
    assert_eq!(f.still_pointing(&ghost, 500).await, 0);
    assert_eq!(f.still_pointing(&live, 1_000).await, 1_000);
    assert_eq!(
        f.registry
            .owner(&f.conn, &as_entry(layout, b"odd-user"))
            .await
            .unwrap()
            .as_deref(),
        Some("bad{owner}")
    );
    let again = reconciler.run_once().await.unwrap();
    assert_eq!(again.sweep.entries_removed, 0, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_on_a_cluster_hash_layout() {
    drift_is_repaired_on_a_cluster(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_on_a_cluster_keys_layout() {
    drift_is_repaired_on_a_cluster(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_on_a_cluster_conns_layout() {
    drift_is_repaired_on_a_cluster(Layout::Conns).await;
}

/// The reverse-index part of the drift sweep on a cluster: members of a live server's set
/// whose user moved elsewhere are set aside, then settled after the grace period (put
/// back where a registration on that server was in flight, dropped otherwise); and a
/// server that dies with members set aside has them walked by its cleanup, so an entry
/// written back to it meanwhile is deleted and the users who moved keep theirs.
async fn reverse_index_drift_is_repaired_on_a_cluster(layout: Layout) {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let Some(mut f) = ClusterFixture::start(3, 0, layout, 200).await else {
        return;
    };
    f.settings.heartbeat_grace_ms = 500;
    let (home, elsewhere) = (server("gw-home#1"), server("gw-elsewhere#1"));
    seed(&f.registry, &f.conn, &home, 1_000).await;
    seed(&f.registry, &f.conn, &elsewhere, 10).await;
    // 300 users reconnect elsewhere; `home` misses their SREM.
    for n in 0..300 {
        f.registry
            .register(&f.conn, &entry(layout, &home, n), &elsewhere)
            .await
            .unwrap();
    }
    let c = f.conn.clone();
    let (users_key, moved_key) = (f.keys.server_users(&home), f.keys.server_moved(&home));
    let count = |key: String, cmd: &'static str| {
        let mut c = c.clone();
        async move {
            redis::cmd(cmd)
                .arg(key)
                .query_async::<u64>(&mut c)
                .await
                .unwrap()
        }
    };
    // A registration on `home` in flight: its forward entry written, its SADD not counted
    // (the member is there already, so it changes nothing).
    let write_back = |n: usize| {
        let mut c = c.clone();
        let (keys, home) = (f.keys.clone(), home.clone());
        async move {
            let u = entry(layout, &home, n);
            let cmd = forward_write(&keys, layout, &u, home.as_str());
            let _: () = cmd.query_async(&mut c).await.unwrap();
        }
    };
    let reconciler = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();

    let report = reconciler.run_once().await.unwrap();
    assert_eq!(report.sweep.members_removed, 300, "{report}");
    let ttl = count(moved_key.clone(), "PTTL").await;
    assert!(
        ttl > 0 && ttl <= 7 * 24 * 3_600_000,
        "members set aside without an expiry: PTTL {ttl}"
    );
    assert_eq!(count(users_key.clone(), "SCARD").await, 700);
    assert_eq!(count(moved_key.clone(), "ZCARD").await, 300);

    // User 0's registration on `home` lands while it is set aside; after the grace period
    // it is put back, the other 299 are dropped.
    write_back(0).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let report = reconciler.run_once().await.unwrap();
    // User 0 now also leaves the set of `elsewhere`, whose entry it no longer is.
    assert_eq!(report.sweep.members_removed, 1, "{report}");
    assert_eq!(count(moved_key.clone(), "ZCARD").await, 0);
    assert_eq!(count(users_key.clone(), "SCARD").await, 701);
    let back: bool = redis::cmd("SISMEMBER")
        .arg(&users_key)
        .arg(entry(layout, &home, 0))
        .query_async(&mut c.clone())
        .await
        .unwrap();
    assert!(
        back,
        "the member of a registration in flight was not put back"
    );

    // Users 300..700 move and are set aside (more than two chunks of the walk); the
    // registrations on `home` of 300..310 land meanwhile; then `home` dies before they are
    // settled. The cleanup takes the members set aside into its walk, in batches.
    for n in 300..700 {
        f.registry
            .register(&f.conn, &entry(layout, &home, n), &elsewhere)
            .await
            .unwrap();
    }
    let report = reconciler.run_once().await.unwrap();
    assert_eq!(report.sweep.members_removed, 400, "{report}");
    assert_eq!(count(moved_key.clone(), "ZCARD").await, 400);
    for n in 300..310 {
        write_back(n).await;
    }
    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &home).await;
    f.wait_idle(Duration::from_secs(60)).await;
    worker.stop().await;
    assert_eq!(
        f.still_pointing(&home, 1_000).await,
        0,
        "stale entries left"
    );
    for n in (1..300).chain(310..700) {
        assert_eq!(
            f.registry
                .owner(&f.conn, &entry(layout, &home, n))
                .await
                .unwrap()
                .as_deref(),
            Some(elsewhere.as_str()),
            "user {n} moved and lost their entry"
        );
    }
    let left: u64 = redis::cmd("EXISTS")
        .arg(&f.keys.server_members_left(&home)[..])
        .query_async(&mut c.clone())
        .await
        .unwrap();
    assert_eq!(left, 0, "the dead server's sets are not all gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reverse_index_drift_is_repaired_on_a_cluster_hash_layout() {
    reverse_index_drift_is_repaired_on_a_cluster(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reverse_index_drift_is_repaired_on_a_cluster_keys_layout() {
    reverse_index_drift_is_repaired_on_a_cluster(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reverse_index_drift_is_repaired_on_a_cluster_conns_layout() {
    reverse_index_drift_is_repaired_on_a_cluster(Layout::Conns).await;
}

/// A forward key of another type (a List written by something else) is no entry of the
/// layout, as on one node: the reverse sweep on a cluster leaves it and its member in the
/// set, drops that member once it is due in `moved` (its entry names no server), and goes
/// on with the other members and the other live servers. Server `gw-a#1` is swept before
/// `gw-b#1` (live servers are listed by name), so `gw-b#1`'s set is swept after the
/// member of another type.
async fn a_forward_key_of_another_type_leaves_the_reverse_sweep_going(layout: Layout) {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let Some(f) = ClusterFixture::start(3, 0, layout, 200).await else {
        return;
    };
    let (a, b) = (server("gw-a#1"), server("gw-b#1"));
    seed(&f.registry, &f.conn, &a, 10).await;
    seed(&f.registry, &f.conn, &b, 10).await;
    // User 1 of `a` reconnects on `b`, user 2 of `b` on `a`; neither old server removes
    // its member.
    let (left_a, left_b) = (entry(layout, &a, 1), entry(layout, &b, 2));
    f.registry.register(&f.conn, &left_a, &b).await.unwrap();
    f.registry.register(&f.conn, &left_b, &a).await.unwrap();
    // Two members of `a` whose forward keys are Lists: one in its set, one set aside long
    // ago (due for settling).
    let (listed, aside) = (entry(layout, &a, 900), entry(layout, &a, 901));
    let list_key = |member: &[u8]| f.keys.forward_of_member(layout, member).unwrap().0;
    let mut c = f.conn.clone();
    for member in [&listed, &aside] {
        let _: () = redis::cmd("RPUSH")
            .arg(list_key(member))
            .arg("not-an-owner")
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let _: () = redis::cmd("SADD")
        .arg(f.keys.server_users(&a))
        .arg(&listed)
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(f.keys.server_moved(&a))
        .arg(1)
        .arg(&aside)
        .query_async(&mut c)
        .await
        .unwrap();

    let reconciler = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let report = reconciler.run_once().await;

    let c = f.conn.clone();
    let in_set = |s: &registry_janitor::event::ServerId, member: &[u8]| {
        let (key, member, mut c) = (f.keys.server_users(s), member.to_vec(), c.clone());
        async move {
            redis::cmd("SISMEMBER")
                .arg(key)
                .arg(member)
                .query_async::<bool>(&mut c)
                .await
                .unwrap()
        }
    };
    let set_aside = |s: &registry_janitor::event::ServerId, member: &[u8]| {
        let (key, member, mut c) = (f.keys.server_moved(s), member.to_vec(), c.clone());
        async move {
            redis::cmd("ZSCORE")
                .arg(key)
                .arg(member)
                .query_async::<Option<f64>>(&mut c)
                .await
                .unwrap()
                .is_some()
        }
    };
    assert!(
        !in_set(&a, &left_a).await,
        "the moved user left in gw-a#1's set"
    );
    assert!(set_aside(&a, &left_a).await, "the moved user not set aside");
    assert!(
        !in_set(&b, &left_b).await,
        "the moved user left in gw-b#1's set"
    );
    assert!(set_aside(&b, &left_b).await, "the moved user not set aside");
    assert!(
        in_set(&a, &listed).await,
        "the member of a List left the set"
    );
    assert!(
        !set_aside(&a, &listed).await,
        "the member of a List set aside"
    );
    assert!(
        !set_aside(&a, &aside).await && !in_set(&a, &aside).await,
        "the due member of a List not dropped"
    );
    for member in [&listed, &aside] {
        let (kind, items): (String, Vec<String>) = redis::pipe()
            .cmd("TYPE")
            .arg(list_key(member))
            .cmd("LRANGE")
            .arg(list_key(member))
            .arg(0)
            .arg(-1)
            .query_async(&mut c.clone())
            .await
            .unwrap();
        assert_eq!(
            (kind.as_str(), items),
            ("list", vec!["not-an-owner".to_owned()])
        );
    }
    let owners = f
        .registry
        .owners(&f.conn, &[left_a.clone(), left_b.clone()])
        .await
        .unwrap();
    assert_eq!(
        owners,
        [Some(b.as_str().to_owned()), Some(a.as_str().to_owned())],
        "the moved users' entries"
    );
    let report = report.expect("the reconcile cycle");
    assert_eq!(
        (report.sweep.live_servers, report.sweep.members_removed),
        (2, 2),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_key_of_another_type_leaves_the_reverse_sweep_going_keys_layout() {
    a_forward_key_of_another_type_leaves_the_reverse_sweep_going(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_key_of_another_type_leaves_the_reverse_sweep_going_conns_layout() {
    a_forward_key_of_another_type_leaves_the_reverse_sweep_going(Layout::Conns).await;
}

/// Dead letters on a cluster: written (XADD, then XACK), listed, replayed (XADD, then
/// XDEL: the two streams are in different slots) and purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_written_and_replayed_on_a_cluster() {
    use registry_janitor::dead_letters;
    let Some(f) = ClusterFixture::start(3, 0, Layout::Hash, 200).await else {
        return;
    };
    registry_janitor::stream::publish(
        &f.conn,
        &f.keys.events(),
        &[(b"type", b"server.dead"), (b"payload", b"junk")],
    )
    .await
    .unwrap();
    let worker = spawn_worker(&f.settings);
    f.wait_idle(Duration::from_secs(30)).await;
    let letters = dead_letters::list(&f.conn, &f.keys, 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert!(
        letters[0].error.contains("MessagePack"),
        "{}",
        letters[0].error
    );
    let replayed = dead_letters::replay(&f.conn, &f.keys, &[letters[0].id.clone()])
        .await
        .unwrap();
    assert_eq!(replayed.len(), 1);
    f.wait_idle(Duration::from_secs(30)).await; // dead-lettered again, by the worker
    assert_eq!(
        dead_letters::list(&f.conn, &f.keys, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(dead_letters::purge(&f.conn, &f.keys, &[]).await.unwrap(), 1);
    assert!(dead_letters::list(&f.conn, &f.keys, 10)
        .await
        .unwrap()
        .is_empty());
    worker.stop().await;
}

/// Users registered on a dead server while a worker walks its reverse set on a cluster
/// (a zombie writing in two steps: the forward entry, then SADD): every one whose
/// registration finished while the event was unacknowledged is gone once it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_during_the_walk_are_cleaned_on_a_cluster() {
    registrations_during_the_walk_on_a_cluster(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_during_the_walk_are_cleaned_on_a_cluster_conns_layout() {
    registrations_during_the_walk_on_a_cluster(Layout::Conns).await;
}

async fn registrations_during_the_walk_on_a_cluster(layout: Layout) {
    let Some(f) = ClusterFixture::start(3, 0, layout, 10).await else {
        return;
    };
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 6_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    seed(&f.registry, &f.conn, &live, 100).await;
    let worker = spawn_worker(&f.settings);
    let id = kill(&f.conn, &f.keys, &dead).await;
    wait_walked(&f.cluster.nodes[0], &f.conn, &f.keys, &dead, 1).await;
    let before_ack = register_until_acked(&f.registry, &f.conn, &f.keys, &dead, &id).await;
    f.wait_idle(Duration::from_secs(60)).await;
    assert_none_point_at(&f.registry, &f.conn, &before_ack, &dead, 20).await;
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    assert_eq!(f.still_pointing(&live, 100).await, 100);
    worker.stop().await;
}

/// The node indexes of the masters now.
fn masters(cluster: &RedisCluster) -> Vec<usize> {
    (0..cluster.nodes.len())
        .filter(|&i| {
            let Ok(client) = redis::Client::open(cluster.nodes[i].url()) else {
                return false;
            };
            let Ok(mut c) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
                return false;
            };
            let role: redis::RedisResult<Vec<redis::Value>> = redis::cmd("ROLE").query(&mut c);
            matches!(role.ok().as_deref().and_then(|r| r.first()),
                Some(redis::Value::BulkString(b)) if b == b"master")
        })
        .collect()
}

/// A worker is SIGKILLed mid-walk; then a master fails over (not the one holding the dead
/// server's set and cursor, so the walk is not restarted by a new run_id), and a failover
/// may lose deletes its old master acknowledged. The worker that takes the cleanup over
/// started after the failover: the walk's starting epoch, stored with the cursor, still
/// tells it to walk again. Lost deletes are reproduced exactly as they look in Redis:
/// forward entries of users already walked point at the dead server again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_a_failover_walks_the_set_again() {
    a_takeover_after_a_failover(Layout::Keys).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]);
/// the lost deletes are connections' fields naming the dead server again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_a_failover_walks_the_set_again_conns_layout() {
    a_takeover_after_a_failover(Layout::Conns).await;
}

async fn a_takeover_after_a_failover(layout: Layout) {
    let Some(mut f) = ClusterFixture::start(3, 1, layout, 20).await else {
        return;
    };
    let dead = server("gw-dead#1");
    const USERS: usize = 10_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    let devices = match layout {
        Layout::Conns => {
            let (phones, laptops) = (server("gw-phones#1"), server("gw-laptops#1"));
            Some(
                Devices::add(
                    &f.registry,
                    &f.conn,
                    &dead,
                    [&phones, &laptops],
                    USERS,
                    4_000,
                )
                .await,
            )
        }
        _ => None,
    };
    let first = WorkerProcess::start_with(&f.settings, &[("JANITOR_REDIS_CLUSTER", "true")]);
    kill(&f.conn, &f.keys, &dead).await;
    wait_walked(&f.cluster.nodes[0], &f.conn, &f.keys, &dead, 2_000).await;
    first.signal("KILL");
    let (status, _) = first.wait(Duration::from_secs(10));
    assert!(status.is_some(), "the worker did not die");
    // Users the first worker already deleted: their entries come back, as lost deletes.
    let ids: Vec<Vec<u8>> = (0..USERS).map(|n| entry(layout, &dead, n)).collect();
    let owners = f.registry.owners(&f.conn, &ids).await.unwrap();
    let walked: Vec<&Vec<u8>> = ids
        .iter()
        .zip(&owners)
        .filter(|(_, o)| o.is_none())
        .map(|(u, _)| u)
        .take(300)
        .collect();
    assert!(
        walked.len() >= 100,
        "too few users walked: {}",
        walked.len()
    );
    for u in &walked {
        let _: () = forward_write(&f.keys, layout, u, dead.as_str())
            .query_async(&mut f.conn.clone())
            .await
            .unwrap();
    }
    let keep = [
        f.cluster.master_of(f.keys.server_users(&dead).as_bytes()),
        f.cluster.master_of(f.keys.events().as_bytes()),
    ];
    let victim = masters(&f.cluster)
        .into_iter()
        .find(|m| !keep.contains(&Some(*m)))
        .expect("a master that holds neither the set nor the stream");
    f.cluster
        .wait_replica_caught_up(victim, 1 << 20, Duration::from_secs(30))
        .expect("the replica catches up");
    f.cluster.nodes[victim].kill();
    f.cluster
        .wait_ok(Duration::from_secs(30))
        .expect("the replica takes over");
    let fresh = fresh_conn(&f.settings).await;
    let second = spawn_worker(&f.settings);
    wait_until(
        &f.cluster.nodes[keep[0].unwrap()],
        "the cleanup finished",
        Duration::from_secs(90),
        || async {
            status::collect_from(&fresh, &f.keys)
                .await
                .is_ok_and(|s| s.is_idle())
        },
    )
    .await;
    assert_eq!(
        still_pointing(&f.registry, &fresh, &dead, USERS).await,
        0,
        "deletes lost in the failover were not made again"
    );
    if let Some(devices) = devices {
        devices.assert_end_state(&f.registry, &fresh, &[]).await;
        assert_eq!(f.connections_naming(&dead).await, vec![]);
    }
    second.stop().await;
}

/// Fencing on a cluster, where a registration is two steps in two slots: a server that
/// keeps heartbeating through its verdict is refused from its first heartbeat after it; a
/// zombie registering all the while gets every write refused or cleaned before the
/// acknowledgement; route never returns the fenced owner, whose liveness key still
/// stands; nothing names it afterwards and the live server loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_holds_on_a_cluster() {
    fencing_holds(Layout::Keys).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]);
/// the zombie registers connections; `route_user` (single-slot steps on a cluster)
/// returns exactly the live servers of a user's connections all the while.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_holds_on_a_cluster_conns_layout() {
    fencing_holds(Layout::Conns).await;
}

async fn fencing_holds(layout: Layout) {
    use registry_janitor::{error::Error, fence};
    let Some(f) = ClusterFixture::start(3, 0, layout, 10).await else {
        return;
    };
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 4_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    seed(&f.registry, &f.conn, &live, 100).await;
    let devices = match layout {
        Layout::Conns => {
            let laptops = server("gw-laptops#1");
            Some(Devices::add(&f.registry, &f.conn, &dead, [&live, &laptops], USERS, USERS).await)
        }
        _ => None,
    };
    let heartbeats =
        heartbeat_until_fenced(&f.registry, &f.conn, &dead, Duration::from_millis(100));
    let zombie = {
        let (registry, conn, dead) = (f.registry.clone(), f.conn.clone(), dead.clone());
        tokio::spawn(async move {
            let (mut tried, mut refused) = (Vec::new(), 0);
            for n in 0.. {
                let u = as_entry(layout, format!("zombie-{n}").as_bytes());
                tried.push(u.clone());
                match registry.register(&conn, &u, &dead).await {
                    Ok(()) => assert_eq!(refused, 0, "a write was taken after a refusal"),
                    Err(Error::Fenced { .. }) => refused += 1,
                    Err(e) => panic!("register: {e}"),
                }
                if refused == 300 {
                    return tried;
                }
            }
            unreachable!()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let worker = spawn_worker(&f.settings);
    let id = kill(&f.conn, &f.keys, &dead).await;
    wait_until(
        &f.cluster.nodes[0],
        "the fence",
        Duration::from_secs(30),
        || async { fence::is_fenced(&f.conn, &f.keys, &dead).await.unwrap() },
    )
    .await;
    let (mut routed_dead, mut misrouted, mut lookups, mut n) = (0, 0, 0, 0);
    while is_pending(&f.conn, &f.keys, &id).await {
        let routed = f
            .registry
            .route(&f.conn, &entry(layout, &dead, n))
            .await
            .unwrap();
        routed_dead += usize::from(routed.as_deref() == Some(dead.as_str()));
        if let Some(devices) = &devices {
            // The user lookup of the layout: the live servers of the user's connections,
            // never the dead one, whichever of its connections the cleanup reached.
            let u = user(&dead, n);
            let servers = f.registry.route_user(&f.conn, &u).await.unwrap();
            routed_dead += usize::from(servers.iter().any(|s| s == dead.as_str()));
            misrouted += usize::from(servers != devices.live_servers_of(&u));
        }
        lookups += 1;
        n = (n + 13) % USERS;
    }
    assert_eq!(
        routed_dead, 0,
        "route returned the fenced owner ({lookups} lookups)"
    );
    assert_eq!(
        misrouted, 0,
        "route_user did not return a user's live servers ({lookups} lookups)"
    );
    let beats = tokio::time::timeout(Duration::from_secs(30), heartbeats)
        .await
        .expect("never told")
        .unwrap();
    let tried = tokio::time::timeout(Duration::from_secs(60), zombie)
        .await
        .expect("the zombie was never refused")
        .unwrap();
    f.wait_idle(Duration::from_secs(60)).await;
    let verdict: u64 = redis::cmd("HGET")
        .arg(f.keys.server_fence(&dead))
        .arg("fenced_at_ms")
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    beats.assert_told_at_the_first_after(verdict);
    assert_none_point_at(&f.registry, &f.conn, &tried, &dead, 200).await;
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    assert_eq!(f.still_pointing(&live, 100).await, 100, "live entries lost");
    if let Some(devices) = devices {
        devices.assert_end_state(&f.registry, &f.conn, &[]).await;
        assert_eq!(f.connections_naming(&dead).await, vec![]);
    }
    worker.stop().await;
}

/// A fenced server's `register` on a cluster must not take away the entry of a user who
/// is registered on a live server: on one node register.lua writes nothing when fenced,
/// and docs/specification.md says "`FENCED` (nothing written)". On a cluster the forward entry is
/// written before the fence check and released after, which deletes the live entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_register_on_a_cluster_leaves_a_live_servers_entry() {
    use registry_janitor::{error::Error, fence};
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let Some(f) = ClusterFixture::start(3, 0, layout, 10).await else {
            return;
        };
        let (fenced, live) = (server("gw-fenced#1"), server("gw-live#1"));
        f.registry.heartbeat(&f.conn, &live, 60_000).await.unwrap();
        f.registry
            .heartbeat(&f.conn, &fenced, 60_000)
            .await
            .unwrap();
        fence::record(&f.conn, &f.keys, &fenced, None, 600_000)
            .await
            .unwrap();
        let u = as_entry(layout, b"reconnected-user");
        f.registry.register(&f.conn, &u, &live).await.unwrap();
        // A late write of the zombie for the same user (e.g. a retried connect).
        let refused = f.registry.register(&f.conn, &u, &fenced).await;
        assert!(matches!(refused, Err(Error::Fenced { .. })), "{layout:?}");
        assert_eq!(
            f.registry.owner(&f.conn, &u).await.unwrap().as_deref(),
            Some(live.as_str()),
            "{layout:?}: the live entry was lost to a refused registration"
        );
        assert_eq!(
            f.registry.route(&f.conn, &u).await.unwrap().as_deref(),
            Some(live.as_str()),
            "{layout:?}"
        );
    }
}

/// A fence that expires between the registration's fence read and its script: the
/// script takes the member, and the registration is made whole (its forward entry
/// written, the script run again) rather than reported done without an entry. The fence
/// is made to expire in between: its master holds writes (CLIENT PAUSE WRITE, reads go
/// on) for longer than the fence's TTL, so the fence read sees it and the script runs
/// once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_expiring_during_a_registration_leaves_a_whole_entry_on_a_cluster() {
    for layout in [Layout::Keys, Layout::Conns] {
        let Some(f) = ClusterFixture::start(3, 0, layout, 10).await else {
            return;
        };
        let s = server("gw-back#1");
        let fence = f.keys.server_fence(&s);
        let node = f.cluster.master_of(fence.as_bytes()).expect("a master");
        let mut c = f.conn.clone();
        let _: () = redis::cmd("HSET")
            .arg(&fence)
            .arg("fenced_at_ms")
            .arg(1)
            .query_async(&mut c)
            .await
            .unwrap();
        let _: () = redis::cmd("PEXPIRE")
            .arg(&fence)
            .arg(300)
            .query_async(&mut c)
            .await
            .unwrap();
        let mut on_node = redis::Client::open(f.cluster.nodes[node].url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(1500)
            .arg("WRITE")
            .query_async(&mut on_node)
            .await
            .unwrap();
        let u = as_entry(layout, b"came-back-user");
        f.registry.register(&f.conn, &u, &s).await.unwrap();
        let fence_left: bool = redis::cmd("EXISTS")
            .arg(&fence)
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(
            !fence_left,
            "{layout:?}: the fence expired during the registration"
        );
        assert_eq!(
            f.registry.owner(&f.conn, &u).await.unwrap().as_deref(),
            Some(s.as_str()),
            "{layout:?}: the registration was reported done without its forward entry"
        );
        let member: bool = redis::cmd("SISMEMBER")
            .arg(f.keys.server_users(&s))
            .arg(&u)
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(member, "{layout:?}");
    }
}

/// A key of another type where the evictions stream should be: on a cluster, where the
/// deletes and the stream are in different slots, the cleanup is refused before any
/// delete (an XADD failing after them would leave them unannounced). Once the key is
/// fixed, the cleanup finishes and announces every user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_type_at_the_stream_name_refuses_the_cleanup_on_a_cluster() {
    let Some(f) = ClusterFixture::start(3, 0, Layout::Keys, 100).await else {
        return;
    };
    let stream = f.keys.evictions().unwrap().to_owned();
    let mut c = f.conn.clone();
    let _: () = redis::cmd("SET")
        .arg(&stream)
        .arg("oops")
        .query_async(&mut c)
        .await
        .unwrap();
    let dead = server("gw-dead#1");
    seed(&f.registry, &f.conn, &dead, 500).await;
    let cleaner = registry_janitor::cleanup::Cleaner::new(f.keys.clone(), Layout::Keys, 100, 1);
    let stop = tokio_util::sync::CancellationToken::new();
    let refused = cleaner.clean(&f.conn, &dead, &stop, |_| {}).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("evictions stream")),
        "{refused:?}"
    );
    assert_eq!(f.still_pointing(&dead, 500).await, 500, "nothing deleted");
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut c)
        .await
        .unwrap();
    cleaner.clean(&f.conn, &dead, &stop, |_| {}).await.unwrap();
    assert_eq!(f.still_pointing(&dead, 500).await, 0);
    let (announced, _) = evictions_of(&f.conn, &f.keys).await;
    let announced: std::collections::HashSet<_> = announced.into_iter().map(|(_, u)| u).collect();
    assert!((0..500).all(|n| announced.contains(&user(&dead, n))));
}

/// A dead server's reverse set names a user whose entry's key holds a List: no entry of
/// the layout. The cleanup on a cluster leaves that key as it is and never announces
/// that user; it deletes and announces the others.
async fn a_user_key_of_another_type_on_a_cluster(layout: Layout) {
    let Some(f) = ClusterFixture::start(3, 0, layout, 100).await else {
        return;
    };
    let dead = server("gw-dead#1");
    seed(&f.registry, &f.conn, &dead, 60).await;
    let odd = entry(layout, &dead, 7);
    let (key, _) = f.keys.forward_of_member(layout, &odd).unwrap();
    let mut c = f.conn.clone();
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("RPUSH")
        .arg(&key)
        .arg("not an entry")
        .query_async(&mut c)
        .await
        .unwrap();
    let cleaner = registry_janitor::cleanup::Cleaner::new(f.keys.clone(), layout, 100, 1);
    let stop = tokio_util::sync::CancellationToken::new();
    let report = cleaner.clean(&f.conn, &dead, &stop, |_| {}).await.unwrap();
    let left: Vec<String> = redis::cmd("LRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(left, ["not an entry"], "the List is untouched");
    let others: Vec<Vec<u8>> = (0..60)
        .filter(|n| *n != 7)
        .map(|n| entry(layout, &dead, n))
        .collect();
    let owners = f.registry.owners(&f.conn, &others).await.unwrap();
    assert!(owners.iter().all(Option::is_none), "{owners:?}");
    assert_eq!(report.deleted, 59, "{report:?}");
    let (announced, _) = evictions_of(&f.conn, &f.keys).await;
    let announced: std::collections::HashSet<_> = announced.into_iter().map(|(_, u)| u).collect();
    assert!(
        !announced.contains(&odd),
        "the user whose key is a List is announced as evicted"
    );
    for u in &others {
        assert!(announced.contains(u), "{u:?} deleted and never announced");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_key_of_another_type_is_not_announced_on_a_cluster_keys_layout() {
    a_user_key_of_another_type_on_a_cluster(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_key_of_another_type_is_not_announced_on_a_cluster_conns_layout() {
    a_user_key_of_another_type_on_a_cluster(Layout::Conns).await;
}

/// The per-slot check-and-delete (check_delete.lua, which takes the keys of a moving
/// slot on a cluster; on one node here): a key of another type is neither deleted nor
/// reported absent.
async fn the_per_slot_check_delete_skips_a_key_of_another_type(layout: Layout) {
    let f = Fixture::new(layout);
    let dead = server("gw-dead#1");
    seed(&f.registry, &f.conn, &dead, 5).await;
    let odd = entry(layout, &dead, 2);
    let (key, _) = f.keys.forward_of_member(layout, &odd).unwrap();
    let _: () = f.query(redis::cmd("DEL").arg(&key)).await;
    let _: () = f.query(redis::cmd("RPUSH").arg(&key).arg("x")).await;
    let gone = entry(layout, &dead, 3);
    let (gone_key, _) = f.keys.forward_of_member(layout, &gone).unwrap();
    let _: () = f.query(redis::cmd("DEL").arg(&gone_key)).await;
    let members: Vec<Vec<u8>> = (0..5).map(|n| entry(layout, &dead, n)).collect();
    let checked =
        registry_janitor::forward::check_delete(&f.conn, &f.keys, layout, &dead, &members)
            .await
            .unwrap();
    assert_eq!((checked.deleted, checked.kept), (3, 0));
    assert_eq!(
        checked.absent_users,
        vec![gone],
        "only the missing key is absent"
    );
    let len: u64 = f.query(redis::cmd("LLEN").arg(&key)).await;
    assert_eq!(len, 1, "the List is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_slot_check_delete_skips_a_key_of_another_type_keys_layout() {
    the_per_slot_check_delete_skips_a_key_of_another_type(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_slot_check_delete_skips_a_key_of_another_type_conns_layout() {
    the_per_slot_check_delete_skips_a_key_of_another_type(Layout::Conns).await;
}

/// The EVALSHA calls (check-and-delete scripts) the masters ran to completion since
/// their stats were reset (a NOSCRIPT reply counts as a failed call).
fn evalsha_calls(cluster: &RedisCluster) -> u64 {
    masters(cluster)
        .into_iter()
        .map(|i| {
            let client = redis::Client::open(cluster.nodes[i].url()).unwrap();
            let mut c = client.get_connection().unwrap();
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query(&mut c)
                .unwrap();
            let Some(stats) = info
                .lines()
                .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
            else {
                return 0;
            };
            let field = |name: &str| -> u64 {
                stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0)
            };
            field("calls") - field("failed_calls")
        })
        .sum()
}

/// Layout `keys` on a cluster: a chunk of users, whose keys fall in hundreds of slots,
/// is checked and deleted by one script per master, with the per-slot script's answer:
/// deleted only where the entry still names the dead server, the others kept, and the
/// users deleted and those without an entry named (a key of another type is in neither,
/// and never deleted); also on a master over maxmemory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_of_keys_is_one_script_per_master() {
    use std::collections::HashSet;
    let Some(f) = ClusterFixture::start(3, 0, Layout::Keys, 1000).await else {
        return;
    };
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    seed(&f.registry, &f.conn, &dead, 1_000).await;
    let ids: Vec<Vec<u8>> = (0..1_000).map(|n| user(&dead, n)).collect();
    for u in &ids[..10] {
        f.registry.register(&f.conn, u, &live).await.unwrap();
    }
    for u in &ids[10..15] {
        let _: i64 = redis::cmd("DEL")
            .arg(f.keys.user(u))
            .query_async(&mut f.conn.clone())
            .await
            .unwrap();
    }
    // Not a forward entry: neither deleted nor absent, as in the per-slot script.
    let _: () = redis::cmd("DEL")
        .arg(f.keys.user(&ids[15]))
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(f.keys.user(&ids[15]))
        .arg("f")
        .arg("v")
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    for i in masters(&f.cluster) {
        let client = redis::Client::open(f.cluster.nodes[i].url()).unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut client.get_connection().unwrap())
            .unwrap();
    }
    let checked =
        registry_janitor::forward::check_delete(&f.conn, &f.keys, Layout::Keys, &dead, &ids)
            .await
            .unwrap();
    let calls = evalsha_calls(&f.cluster);
    assert!(
        calls <= 3,
        "{calls} scripts for 1,000 users on 3 masters (one per slot would be hundreds)"
    );
    assert_eq!((checked.deleted, checked.kept), (984, 10));
    let deleted: HashSet<_> = checked.deleted_users.into_iter().collect();
    assert_eq!(deleted, ids[16..].iter().cloned().collect());
    let absent: HashSet<_> = checked.absent_users.into_iter().collect();
    assert_eq!(absent, ids[10..15].iter().cloned().collect());
    let hash_left: u64 = redis::cmd("HLEN")
        .arg(f.keys.user(&ids[15]))
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    assert_eq!(hash_left, 1, "the key of another type is left as it is");
    let _: i64 = redis::cmd("DEL")
        .arg(f.keys.user(&ids[15]))
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    assert_eq!(f.still_pointing(&dead, 1_000).await, 0);
    for u in &ids[..10] {
        assert_eq!(
            f.registry.owner(&f.conn, u).await.unwrap().as_deref(),
            Some("gw-live#1")
        );
    }
    // Again: nothing left to delete, the users are named as absent.
    let again =
        registry_janitor::forward::check_delete(&f.conn, &f.keys, Layout::Keys, &dead, &ids)
            .await
            .unwrap();
    assert_eq!(
        (again.deleted, again.kept, again.absent_users.len()),
        (0, 10, 990)
    );

    // Seeded again (all 1,000 on the dead server). A master over maxmemory still runs
    // the script of its group (`allow-oom`: a script with a shebang and without it is
    // refused up front), as it runs the per-slot script, which only reads and deletes.
    seed(&f.registry, &f.conn, &dead, 1_000).await;
    let full = masters(&f.cluster)[0];
    let on_full = |maxmemory: &str| {
        let client = redis::Client::open(f.cluster.nodes[full].url()).unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(maxmemory)
            .query(&mut client.get_connection().unwrap())
            .unwrap();
    };
    on_full("1");
    for i in masters(&f.cluster) {
        let client = redis::Client::open(f.cluster.nodes[i].url()).unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut client.get_connection().unwrap())
            .unwrap();
    }
    let checked =
        registry_janitor::forward::check_delete(&f.conn, &f.keys, Layout::Keys, &dead, &ids).await;
    let calls = evalsha_calls(&f.cluster);
    on_full("0");
    let checked = checked.unwrap();
    assert_eq!((checked.deleted, checked.kept), (1_000, 0));
    assert!(
        calls <= 3,
        "{calls} scripts: the full master refused its script"
    );
    assert_eq!(f.still_pointing(&dead, 1_000).await, 0);
}

/// Resharding all the while: slots (with their keys) move between the masters with
/// `redis-cli --cluster reshard`, one after another, from before the cleanup starts
/// until it is acknowledged; meanwhile users of the dead server reconnect to a live one.
/// The scripts per master meet slots that moved since the slot map was read (MOVED), and
/// may meet slots being migrated (ASK), and leave those keys to the per-slot scripts
/// (the test asserts that some did).
/// Afterwards no entry names the dead server, no live entry is lost, and every user
/// deleted was announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_reshard_during_the_cleanup_loses_nothing() {
    a_live_reshard_during_the_cleanup(Layout::Keys).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]),
/// and their Hashes move with the slots; the connections that reconnect are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_reshard_during_the_cleanup_loses_nothing_conns_layout() {
    a_live_reshard_during_the_cleanup(Layout::Conns).await;
}

async fn a_live_reshard_during_the_cleanup(layout: Layout) {
    use std::{
        collections::HashSet,
        sync::{
            atomic::{AtomicBool, AtomicUsize, Ordering},
            Arc,
        },
    };
    let Some(f) = ClusterFixture::start(3, 0, layout, 100).await else {
        return;
    };
    let f = Arc::new(f);
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 20_000;
    const LIVE: usize = 3_000;
    seed(&f.registry, &f.conn, &dead, USERS).await;
    seed(&f.registry, &f.conn, &live, LIVE).await;
    let devices = match layout {
        Layout::Conns => {
            let laptops = server("gw-laptops#1");
            Some(Devices::add(&f.registry, &f.conn, &dead, [&live, &laptops], USERS, 4_000).await)
        }
        _ => None,
    };
    let ids: Vec<Vec<u8>> = (0..USERS).map(|n| entry(layout, &dead, n)).collect();
    // Moved before the event: never deleted, never announced.
    let moved_before = &ids[..200];
    for u in moved_before {
        f.registry.register(&f.conn, u, &live).await.unwrap();
    }

    // Reshards one after another until told to stop: 0 -> 1, 1 -> 2, 2 -> 0, ...
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicUsize::new(0));
    let reshards = {
        let (f, stop, started) = (f.clone(), stop.clone(), started.clone());
        std::thread::spawn(move || -> Result<usize, String> {
            let mut done = 0;
            while !stop.load(Ordering::SeqCst) {
                f.cluster
                    .wait_settled(Duration::from_secs(60))
                    .map_err(|e| e.to_string())?;
                let (from, to) = (done % 3, (done + 1) % 3);
                started.fetch_add(1, Ordering::SeqCst);
                f.cluster
                    .reshard(from, to, 1_000)
                    .map_err(|e| e.to_string())?;
                done += 1;
            }
            Ok(done)
        })
    };
    wait_until(
        &f.cluster.nodes[0],
        "the first reshard started",
        Duration::from_secs(60),
        || async { started.load(Ordering::SeqCst) > 0 },
    )
    .await;

    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &dead).await;
    // Reconnections racing the cleanup (and the reshard): whatever the order, they keep
    // their new entry.
    let moved_during = &ids[10_000..10_300];
    for u in moved_during {
        loop {
            match f.registry.register(&f.conn, u, &live).await {
                Ok(()) => break,
                Err(e) => eprintln!("register during the reshard, again: {e}"),
            }
        }
    }
    f.wait_idle(Duration::from_secs(300)).await;
    let reshards_at_ack = started.load(Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    let done = tokio::task::spawn_blocking(move || reshards.join().unwrap())
        .await
        .unwrap()
        .expect("the reshards succeed");
    f.cluster
        .wait_settled(Duration::from_secs(60))
        .expect("the cluster settles");
    let fallbacks = counter_of(
        &worker.metrics,
        "registry_janitor_cluster_users_rechecked_total",
    );
    eprintln!(
        "reshards started before the acknowledgement: {reshards_at_ack}, done: {done}; \
         users checked slot by slot after a master's script: {fallbacks}"
    );
    assert!(
        fallbacks > 0,
        "no master's script met a slot that moved: the reshard did not overlap the cleanup"
    );

    // A connection of its own for the checks: the test's own one met the reshards, and
    // redis-rs may time out a request or two while it catches up with the slot map.
    let conn = fresh_conn(&f.settings).await;
    assert_eq!(
        still_pointing(&f.registry, &conn, &dead, USERS).await,
        0,
        "stale entries"
    );
    assert_eq!(
        still_pointing(&f.registry, &conn, &live, LIVE).await,
        LIVE,
        "live entries lost"
    );
    let owners = f.registry.owners(&conn, &ids).await.unwrap();
    let moved: HashSet<&Vec<u8>> = moved_before.iter().chain(moved_during).collect();
    for (u, owner) in ids.iter().zip(&owners) {
        if moved.contains(u) {
            assert_eq!(
                owner.as_deref(),
                Some("gw-live#1"),
                "{}: a reconnected user lost its entry",
                String::from_utf8_lossy(u)
            );
        } else {
            assert_eq!(owner.as_deref(), None, "{}", String::from_utf8_lossy(u));
        }
    }
    let (announced, cleaned) = evictions_of(&conn, &f.keys).await;
    let announced: HashSet<_> = announced
        .into_iter()
        .filter(|(s, _)| s == dead.as_str())
        .map(|(_, u)| u)
        .collect();
    let never: Vec<_> = ids
        .iter()
        .filter(|u| !moved.contains(u) && !announced.contains(*u))
        .take(5)
        .map(|u| String::from_utf8_lossy(u).into_owned())
        .collect();
    assert!(never.is_empty(), "deleted and never announced: {never:?}");
    assert!(
        moved_before.iter().all(|u| !announced.contains(u)),
        "a user whose entry was kept was announced"
    );
    assert!(!cleaned.is_empty(), "server.cleaned was never announced");
    if let Some(devices) = devices {
        // Every connection that moved names the live server; every other connection of
        // the dead server is gone (and announced), its users' other connections kept,
        // no key left of a user whose every connection was on it; none names it anywhere.
        let never = devices
            .dead_members()
            .into_iter()
            .filter(|m| !moved.contains(m) && !announced.contains(m))
            .count();
        assert_eq!(never, 0, "connections deleted and never announced");
        let moved: Vec<_> = moved.iter().map(|u| ((*u).clone(), live.clone())).collect();
        devices.assert_end_state(&f.registry, &conn, &moved).await;
        assert_eq!(f.connections_naming(&dead).await, vec![]);
    }
    worker.stop().await;
}

/// A reshard gives a master a new first slot while nothing the worker does touches it:
/// the worker's slot map still names the old master for that slot, and the commands that
/// end a walk (CLUSTER MYID, INFO, WAIT, routed by that slot) carry no key that would get
/// MOVED. The walk still ends, and the event is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_ends_after_a_reshard_moved_a_masters_first_slot() {
    a_walk_ends_after_a_reshard("first-slot:").await;
}

/// The same with a key prefix that has a hash tag of its own: every key of the janitor's
/// is in the prefix's slot, none in the slot that moved, and the connection is built
/// again with a fresh slot map instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_ends_after_a_reshard_moved_a_masters_first_slot_tagged_prefix() {
    a_walk_ends_after_a_reshard("first-slot{app}:").await;
}

async fn a_walk_ends_after_a_reshard(prefix: &str) {
    let Some(mut f) = ClusterFixture::start(3, 0, Layout::Keys, 200).await else {
        return;
    };
    // Slot 0 moves; no key the worker touches may be in it, or the worker would learn of
    // the move by a redirect: a prefix of its own, so that the keys are always the same.
    f.settings.key_prefix = prefix.into();
    f.keys = Keys::for_settings(&f.settings);
    f.registry = Registry::new(f.keys.clone(), Layout::Keys);
    let (a, b, live) = (server("gw-a#1"), server("gw-b#1"), server("gw-live#1"));
    for s in [&a, &b, &live] {
        seed(&f.registry, &f.conn, s, 300).await;
    }
    let slot_zero = |key: &[u8]| conn::key_slot(key) == 0;
    for s in [&a, &b, &live] {
        assert!(!slot_zero(f.keys.server_users(s).as_bytes()));
        for n in 0..300 {
            assert!(!slot_zero(&f.keys.user(&entry(Layout::Keys, s, n))));
        }
    }
    let in_slot_zero = (0u32..)
        .map(|n| format!("slot-zero-{n}"))
        .find(|k| slot_zero(k.as_bytes()))
        .unwrap();
    assert_eq!(f.cluster.master_of(in_slot_zero.as_bytes()), Some(0));

    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &a).await;
    f.wait_idle(Duration::from_secs(60)).await;
    tokio::task::block_in_place(|| f.cluster.reshard(0, 1, 1)).expect("the reshard succeeds");
    assert_eq!(
        f.cluster.master_of(in_slot_zero.as_bytes()),
        Some(1),
        "slot 0 moved to the second master, as its first slot"
    );

    kill(&f.conn, &f.keys, &b).await;
    f.wait_idle(Duration::from_secs(60)).await;
    let conn = fresh_conn(&f.settings).await;
    assert_eq!(still_pointing(&f.registry, &conn, &b, 300).await, 0);
    assert_eq!(still_pointing(&f.registry, &conn, &live, 300).await, 300);
    worker.stop().await;
}

/// route.lua declares `no-cluster`: a Redis Cluster refuses it whatever the owner's slot,
/// and the Registry, given a plain connection to a cluster node, says why and what to do
/// (on a cluster connection it routes in single-slot steps, without the script).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_lua_is_refused_on_a_cluster_whatever_the_owner() {
    let Some(f) = ClusterFixture::start(3, 0, Layout::Hash, 10).await else {
        return;
    };
    let live = server("gw-live#1");
    f.registry.register(&f.conn, b"u1", &live).await.unwrap();
    f.registry.heartbeat(&f.conn, &live, 60_000).await.unwrap();
    assert_eq!(
        f.registry.route(&f.conn, b"u1").await.unwrap().as_deref(),
        Some("gw-live#1")
    );
    // A plain (not cluster) connection to the node that serves `registry`.
    let registry_key = f.keys.registry();
    let node = f
        .cluster
        .nodes
        .iter()
        .find(|n| {
            let mut c = redis::Client::open(n.url())
                .unwrap()
                .get_connection()
                .unwrap();
            redis::cmd("HGET")
                .arg(&registry_key)
                .arg("u1")
                .query::<Option<String>>(&mut c)
                .is_ok()
        })
        .expect("a node serves the registry's slot");
    let plain = connect(&settings(node, Layout::Hash));
    let err = f
        .registry
        .route(&plain, b"u1")
        .await
        .expect_err("route.lua is refused on a cluster");
    let message = err.to_string();
    assert!(
        message.contains("no-cluster") && message.contains("redis_cluster"),
        "{message}"
    );
}

/// Layout conns on a cluster: a user with three connections on three servers; one server
/// dies: its connection goes, the two others stay and route (route_user in single-slot
/// steps); a user whose every connection was on it has no key left; a chunk is one
/// check-and-delete script per master; a fenced server's register_connection writes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_on_a_cluster() {
    use registry_janitor::{error::Error, fence};
    let Some(f) = ClusterFixture::start(3, 0, Layout::Conns, 1000).await else {
        return;
    };
    let (a, b, dead) = (server("gw-a#1"), server("gw-b#1"), server("gw-dead#1"));
    for s in [&a, &b, &dead] {
        f.registry.heartbeat(&f.conn, s, 60_000).await.unwrap();
    }
    let r = &f.registry;
    for (connection, s) in [("phone", &a), ("laptop", &b), ("tab", &dead)] {
        r.register_connection(&f.conn, b"alice", connection, s)
            .await
            .unwrap();
    }
    seed(r, &f.conn, &dead, 1_000).await;
    assert_eq!(
        r.route_user(&f.conn, b"alice").await.unwrap(),
        vec!["gw-a#1", "gw-b#1", "gw-dead#1"]
    );
    for i in masters(&f.cluster) {
        let client = redis::Client::open(f.cluster.nodes[i].url()).unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut client.get_connection().unwrap())
            .unwrap();
    }
    let ids: Vec<Vec<u8>> = (0..1_000).map(|n| entry(Layout::Conns, &dead, n)).collect();
    let checked =
        registry_janitor::forward::check_delete(&f.conn, &f.keys, Layout::Conns, &dead, &ids)
            .await
            .unwrap();
    assert!(evalsha_calls(&f.cluster) <= 3, "one script per master");
    assert_eq!(checked.deleted, 1_000);
    let worker = spawn_worker(&f.settings);
    kill(&f.conn, &f.keys, &dead).await;
    f.wait_idle(Duration::from_secs(60)).await;
    worker.stop().await;
    assert_eq!(
        r.connections(&f.conn, b"alice").await.unwrap(),
        vec![
            ("laptop".to_owned(), "gw-b#1".to_owned()),
            ("phone".to_owned(), "gw-a#1".to_owned()),
        ]
    );
    assert_eq!(
        r.route_user(&f.conn, b"alice").await.unwrap(),
        vec!["gw-a#1", "gw-b#1"]
    );
    for n in [0, 999] {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(f.keys.user_conns(&user(&dead, n)))
            .query_async(&mut f.conn.clone())
            .await
            .unwrap();
        assert_eq!(exists, 0, "an empty user Hash is left");
    }
    let (announced, _) = evictions_of(&f.conn, &f.keys).await;
    assert!(announced
        .iter()
        .any(|(s, m)| s == dead.as_str() && m == b"tab alice"));
    // Fenced (the verdict stands): refused, nothing written, alice's entries untouched.
    assert!(fence::is_fenced(&f.conn, &f.keys, &dead).await.unwrap());
    let refused = r
        .register_connection(&f.conn, b"alice", "phone", &dead)
        .await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    assert_eq!(
        r.route_user(&f.conn, b"alice").await.unwrap(),
        vec!["gw-a#1", "gw-b#1"]
    );
    r.unregister_connection(&f.conn, b"alice", "phone", &a)
        .await
        .unwrap();
    r.unregister_connection(&f.conn, b"alice", "laptop", &b)
        .await
        .unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(f.keys.user_conns(b"alice"))
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    assert_eq!(exists, 0);
}

/// The cluster connection is built again, from the same seeds, after a stretch in which
/// no command sent on it had an answer, and the new one answers. An answer within the
/// stretch starts it again; a failure met on a connection already replaced says nothing
/// of the current one. (The results observed here are made up: a connection that stops
/// answering while every node answers others cannot be caused on purpose.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_connection_without_answers_is_built_again() {
    use registry_janitor::conn::ClusterConn;
    let Some(f) = ClusterFixture::start(3, 0, Layout::Keys, 1000).await else {
        return;
    };
    let client = redis::cluster::ClusterClientBuilder::new(f.cluster.seeds())
        .response_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let stretch = Duration::from_millis(300);
    let conn = ClusterConn::connect(
        client,
        redis::cluster::ClusterConfig::new().set_response_timeout(Duration::from_secs(5)),
    )
    .await
    .unwrap()
    .rebuild_after(stretch);
    let timed_out: redis::RedisResult<()> =
        Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
    let answered: redis::RedisResult<()> = Ok(());

    // Failures with an answer in between: never a whole stretch without one.
    let (_, generation) = conn.current();
    for _ in 0..4 {
        conn.observe(generation, &timed_out).await;
        tokio::time::sleep(stretch / 2).await;
        conn.observe(generation, &answered).await;
    }
    assert_eq!(conn.rebuilds(), 0);

    // A whole stretch without an answer: built again, and the new connection answers.
    conn.observe(generation, &timed_out).await;
    tokio::time::sleep(stretch + Duration::from_millis(50)).await;
    conn.observe(generation, &timed_out).await;
    assert_eq!(conn.rebuilds(), 1);
    let (mut new, now) = conn.current();
    assert_eq!(now, generation + 1);
    let key = "rebuilt:probe";
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("1")
        .query_async(&mut new)
        .await
        .unwrap();
    let read: Option<String> = redis::cmd("GET")
        .arg(key)
        .query_async(&mut new)
        .await
        .unwrap();
    assert_eq!(read.as_deref(), Some("1"));

    // Failures on the replaced connection, however long: not the current one's.
    conn.observe(generation, &timed_out).await;
    tokio::time::sleep(stretch + Duration::from_millis(50)).await;
    conn.observe(generation, &timed_out).await;
    assert_eq!(conn.rebuilds(), 1);
}

/// The blocking read's connection waits out its whole BLOCK, however long `block_ms`
/// is: a read that finds nothing for 6 s answers nil, not a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_read_longer_than_the_command_timeout_answers() {
    let Some(f) = ClusterFixture::start(3, 0, Layout::Keys, 1000).await else {
        return;
    };
    let block = Duration::from_secs(6);
    let mut reader = conn::blocking_for(&conn::target_for(&f.settings).unwrap(), block)
        .await
        .unwrap();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("{probe}:events")
        .arg("g")
        .arg("$")
        .arg("MKSTREAM")
        .query_async(&mut f.conn.clone())
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let read: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("c")
        .arg("BLOCK")
        .arg(block.as_millis() as u64)
        .arg("STREAMS")
        .arg("{probe}:events")
        .arg(">")
        .query_async(&mut reader)
        .await
        .expect("a read that blocks 6 s answers");
    assert_eq!(read, redis::Value::Nil);
    assert!(started.elapsed() >= Duration::from_millis(5_900));
}

/// The cluster walk's scripts declare flags (`#!lua flags=...`), which Redis before 7.0
/// refuses. On such a cluster the worker and the reconciler stop at start-up with an error
/// naming the reason and the version needed, instead of dead-lettering every event; on
/// 7.0 or later the same start-up check passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_older_than_redis_7_stops_the_worker_at_start_up() {
    let Some(f) = ClusterFixture::start(3, 0, Layout::Hash, 100).await else {
        return;
    };
    let version = f.cluster.nodes[0]
        .redis_version()
        .expect("INFO server gives redis_version");
    if version >= (7, 0, 0) {
        let checked = registry_janitor::cleanup::check_scripting(&f.conn, &f.keys.events()).await;
        assert!(checked.is_ok(), "redis_version {version:?}: {checked:?}");
        return;
    }
    for command in ["worker", "reconcile"] {
        let process = WorkerProcess::start_command(
            &f.settings,
            &[("JANITOR_REDIS_CLUSTER", "true")],
            &[command],
        );
        let (status, log) = process.wait(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| !s.success()),
            "{command} on a Redis {version:?} cluster did not stop with an error: {status:?}\n{log}"
        );
        assert!(
            log.contains("refuses scripts with flags") && log.contains("Redis 7.0 or later"),
            "{command}: {log}"
        );
    }
}

/// Sets `cluster-replica-no-failover yes` on node `i` and waits until its CLUSTER NODES
/// line shows the flag.
fn set_nofailover(cluster: &RedisCluster, i: usize) {
    let client = redis::Client::open(cluster.nodes[i].url()).unwrap();
    let mut c = client.get_connection().unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("cluster-replica-no-failover")
        .arg("yes")
        .query(&mut c)
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut c).unwrap();
        let mine = nodes.lines().find(|l| l.contains("myself")).unwrap();
        if mine.contains("master") && mine.contains("nofailover") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the flag never showed: {mine}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_flagged_nofailover_are_masters_and_clean() {
    init_logs();
    if !RedisCluster::supported() {
        registry_janitor_testkit::cannot_run(
            "this redis-server cannot run a cluster (or redis-cli is missing)",
        );
        return;
    }
    // `cluster-replica-no-failover yes` in every node's configuration, as one redis.conf
    // for all nodes has it: CLUSTER NODES then shows `nofailover` on the masters too.
    let cluster = tokio::task::spawn_blocking(|| {
        let cluster = RedisCluster::start(3, 0)?;
        // As an operator who sets it in every node's configuration.
        for i in 0..cluster.nodes.len() {
            set_nofailover(&cluster, i);
        }
        Ok::<_, registry_janitor_testkit::Error>(cluster)
    })
    .await
    .unwrap()
    .expect("start a local cluster");
    let layout = Layout::Keys;
    let settings = cluster_settings(&cluster, layout);
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&settings);
    let registry = Registry::new(keys.clone(), layout);
    let dead = server("gw-dead#1");
    seed(&registry, &conn, &dead, 300).await;
    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &dead).await;
    // Generous: the cleanup of 300 users takes well under a second here.
    wait_until(
        &cluster.nodes[1],
        "the event acknowledged",
        Duration::from_secs(45),
        || async {
            status::collect_from(&conn, &keys)
                .await
                .is_ok_and(|s| s.is_idle())
        },
    )
    .await;
    assert_eq!(still_pointing(&registry, &conn, &dead, 300).await, 0);
    worker.stop().await;
    // What the reconciler's guard, the keys-layout sweep and the expiry hints go by.
    let masters = conn::cluster_masters(&conn).await.unwrap();
    assert_eq!(
        masters.len(),
        3,
        "every master that serves slots: {masters:?}"
    );
}
