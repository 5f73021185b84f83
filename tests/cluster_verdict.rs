//! A stall of one master during a cluster verdict never declares a live server dead.
//!
//! On a cluster the reconciler's verdict on a server S is several round trips on two
//! masters: the fence and, last, the liveness key and the marker in the slot of `{S}`,
//! Redis's time and S's score in the slot of `servers`. While the master of `{S}` stalls,
//! S cannot heartbeat either: its liveness key expires meanwhile. The verdict times
//! itself from the moment it takes the guard's bound to its last reply, and waits when
//! that is longer than the bound's slack. Real processes: a local cluster of 3 masters,
//! the stall a `CLIENT PAUSE ... ALL` of the master of `{S}`. Skipped, with a message
//! saying so, only when this redis-server cannot run a cluster.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    config::Layout,
    conn,
    keys::Keys,
    metrics::Metrics,
    reconcile::{Reconciler, Verdict},
    registry::Registry,
};
use registry_janitor_testkit::RedisCluster;

const GRACE_MS: u64 = 2_000;
/// The liveness TTL: shorter than the stall, as a live server's key left unrefreshed.
const TTL_MS: u64 = 1_000;
const STALL_MS: u64 = 3_000;

/// A local cluster of 3 masters under a grace of [`GRACE_MS`], a connection, the key
/// names, the registry and a reconciler.
struct Setup {
    cluster: RedisCluster,
    conn: conn::RedisConn,
    keys: Keys,
    registry: Registry,
    reconciler: std::sync::Arc<Reconciler>,
}

/// [`Setup`], or `None` (said) where this redis-server cannot run a cluster.
async fn setup() -> Option<Setup> {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return None;
    }
    // A node timeout far longer than any stall here: no node is flagged failing.
    let cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_with(3, 0, || {
            vec!["--cluster-node-timeout".to_owned(), "60000".to_owned()]
        })
    })
    .await
    .unwrap()
    .expect("start a local cluster");
    let mut settings = cluster_settings(&cluster, Layout::Keys);
    settings.heartbeat_grace_ms = GRACE_MS;
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&settings);
    let registry = Registry::new(keys.clone(), Layout::Keys);
    let reconciler = std::sync::Arc::new(Reconciler::new(&settings, Metrics::new()).await.unwrap());
    Some(Setup {
        cluster,
        conn,
        keys,
        registry,
        reconciler,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_of_the_master_of_the_server_during_a_verdict_declares_no_live_server_dead() {
    let Some(Setup {
        cluster,
        conn,
        keys,
        registry,
        reconciler,
    }) = setup().await
    else {
        return;
    };

    // A server whose own slot is on another master than `servers`.
    let on_servers = cluster.master_of(keys.servers().as_bytes()).unwrap();
    let live = (0..)
        .map(|n| server(&format!("gw-live#{n}")))
        .find(|s| cluster.master_of(keys.server_alive(s).as_bytes()) != Some(on_servers))
        .unwrap();
    let stalled = cluster
        .master_of(keys.server_alive(&live).as_bytes())
        .unwrap();

    // It heartbeats and is seen alive, the guard observing meanwhile.
    for _ in 0..5 {
        registry.heartbeat(&conn, &live, TTL_MS).await.unwrap();
        let verdict = reconciler.check(&live).await.unwrap();
        assert!(
            matches!(verdict, Verdict::Alive | Verdict::TooRecent { .. }),
            "{verdict:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its score is older than the grace (its writes to the master of `servers` failed);
    // only its liveness key, just refreshed, says it lives. Right then its master
    // stalls: its heartbeats would block, and its key expires during the stall.
    let now_ms: Vec<u64> = redis::cmd("TIME")
        .query_async::<Vec<String>>(&mut conn.clone())
        .await
        .unwrap()
        .iter()
        .map(|p| p.parse().unwrap())
        .collect();
    let old = now_ms[0] * 1000 - 10 * GRACE_MS;
    let _: () = redis::cmd("ZADD")
        .arg(keys.servers())
        .arg(old)
        .arg(live.as_str())
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let mut node = redis::Client::open(cluster.nodes[stalled].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // Past the guard's step, so that the next verdict observes Redis first: the stall
    // starts right after that observation.
    tokio::time::sleep(Duration::from_millis(GRACE_MS / 2)).await;
    let _: () = redis::cmd("SET")
        .arg(keys.server_alive(&live))
        .arg("1")
        .arg("PX")
        .arg(TTL_MS)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(reconciler.check(&live).await.unwrap(), Verdict::Alive);
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(STALL_MS)
        .arg("ALL")
        .query_async(&mut node)
        .await
        .unwrap();
    let verdict = reconciler.check(&live).await;
    assert!(
        !matches!(verdict, Ok(Verdict::Published(_))),
        "a server whose master stalled {STALL_MS} ms during the verdict, its liveness key \
         expiring meanwhile, was declared dead: {verdict:?}"
    );
    let published = read_stream(&conn, &keys.events()).await;
    assert!(published.is_empty(), "server.dead published: {published:?}");

    // The server stays silent: once Redis has been reachable for a full grace again, it
    // is declared dead as usual.
    let dead = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Ok(Verdict::Published(_)) = reconciler.check(&live).await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        dead.is_ok(),
        "a server silent for a minute after the stall was never declared dead"
    );
}

/// A master that refuses writes for longer than the grace (NOREPLICAS: `min-replicas-to-write
/// 1` on a master without replicas) while it answers reads: the servers whose `{S}` slot
/// it serves cannot heartbeat, their liveness keys expire and their scores age, and their
/// entries on the other masters must stay. The guard's write probe on every master sees
/// the refusal as an outage, so the drift sweep, run throughout, deletes none of them;
/// once writes are taken again, the server heartbeats on and keeps every entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_refusing_writes_longer_than_the_grace_loses_no_live_entry() {
    let Some(Setup {
        cluster,
        conn,
        keys,
        registry,
        reconciler,
    }) = setup().await
    else {
        return;
    };

    // A live server whose own slot is on another master than `servers` and the
    // evictions stream, with entries only on the other masters: the sweep meets no
    // refusal of its own on them.
    let on_servers = cluster.master_of(keys.servers().as_bytes()).unwrap();
    let on_evictions = keys
        .evictions()
        .and_then(|k| cluster.master_of(k.as_bytes()));
    let live = (0..)
        .map(|n| server(&format!("gw-live#{n}")))
        .find(|s| {
            let on = cluster.master_of(keys.server_alive(s).as_bytes());
            on != Some(on_servers) && on != on_evictions
        })
        .unwrap();
    let refusing = cluster
        .master_of(keys.server_alive(&live).as_bytes())
        .unwrap();
    const USERS: usize = 300;
    let users: Vec<Vec<u8>> = (0..)
        .map(|n| user(&live, n))
        .filter(|u| cluster.master_of(&keys.user(u)) != Some(refusing))
        .take(USERS)
        .collect();
    registry.heartbeat(&conn, &live, TTL_MS).await.unwrap();
    registry
        .register_many(&conn, users.iter().map(Vec::as_slice), &live, 1000)
        .await
        .unwrap();
    let kept = || async {
        let owners = registry.owners(&conn, &users).await.unwrap();
        owners
            .iter()
            .filter(|o| o.as_deref() == Some(live.as_str()))
            .count()
    };

    // Four more live servers, on the other masters: most of the fleet still heartbeats,
    // so the guard against a mass silence does not hold the sweep by itself.
    let others: Vec<_> = (100..)
        .map(|n| server(&format!("gw-other#{n}")))
        .filter(|s| cluster.master_of(keys.server_alive(s).as_bytes()) != Some(refusing))
        .take(4)
        .collect();
    // Every server heartbeats every 200 ms throughout (a refused heartbeat is tried
    // again at the next beat), and the drift sweep runs throughout.
    let stop = tokio_util::sync::CancellationToken::new();
    let beats = {
        let (registry, conn, stop) = (registry.clone(), conn.clone(), stop.clone());
        let fleet: Vec<_> = others.iter().chain([&live]).cloned().collect();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for server in &fleet {
                    let _ = registry.heartbeat(&conn, server, TTL_MS).await;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(GRACE_MS)).await;
    let swept = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sweeps = {
        let (reconciler, stop, swept) = (reconciler.clone(), stop.clone(), swept.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                if reconciler.sweep(Duration::ZERO, &stop).await.is_ok() {
                    swept.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // A sweep completes before the refusal: the sweep runs, and keeps the live entries.
    let swept_once = tokio::time::timeout(Duration::from_secs(30), async {
        while swept.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(swept_once.is_ok(), "no drift sweep completed in 30 s");
    assert_eq!(kept().await, USERS, "entries of a live server lost");

    // The master refuses writes for three graces, then takes them again.
    let mut node = redis::Client::open(cluster.nodes[refusing].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let set_min_replicas = |n: u32| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg(n)
            .to_owned()
    };
    let _: () = set_min_replicas(1).query_async(&mut node).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3 * GRACE_MS)).await;
    let during = kept().await;
    let _: () = set_min_replicas(0).query_async(&mut node).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2 * GRACE_MS)).await;
    stop.cancel();
    sweeps.await.unwrap();
    beats.await.unwrap();

    assert_eq!(
        during, USERS,
        "entries of a live server lost while the master of its slot refused writes"
    );
    assert_eq!(
        kept().await,
        USERS,
        "entries of a live server lost after the master of its slot took writes again"
    );
}
