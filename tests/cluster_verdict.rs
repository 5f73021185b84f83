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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_of_the_master_of_the_server_during_a_verdict_declares_no_live_server_dead() {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    // A node timeout far longer than the stall: no node is flagged failing.
    let cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_with(3, 0, || {
            vec!["--cluster-node-timeout".to_owned(), "60000".to_owned()]
        })
    })
    .await
    .unwrap()
    .expect("start a local cluster");
    let mut settings = settings(&cluster.nodes[0], Layout::Keys);
    settings.redis_cluster = true;
    settings.redis_cluster_seeds = cluster.seeds();
    settings.heartbeat_grace_ms = GRACE_MS;
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&settings);
    let registry = Registry::new(keys.clone(), Layout::Keys);
    let reconciler = Reconciler::new(&settings, Metrics::new()).await.unwrap();

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
