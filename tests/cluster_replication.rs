//! The end of a cluster walk and its replicas: the walk's deletes are on every replica
//! the cluster counts as up before the event is acknowledged, so a master killed right
//! after the walk's last step, with its replica behind, loses no delete for good. Real
//! processes: a local cluster of 3 masters and 3 replicas, a replica paused with SIGSTOP,
//! a master killed with SIGKILL. Skipped, with a message saying so, only when this
//! redis-server cannot run a cluster.

mod common;

use std::{sync::Arc, time::Duration};

use common::*;
use registry_janitor::{
    config::Layout,
    conn::{self, ClusterConn, RedisConn},
    keys::Keys,
    registry::Registry,
    status,
};
use registry_janitor_testkit::RedisCluster;

/// A local cluster of 3 masters with a replica each, at a node timeout of `node_timeout_ms`
/// (the default is 15 s), so that a replica paused for a few seconds is not flagged failed
/// meanwhile; `None`, with a message saying so, when this redis-server cannot run a cluster.
async fn cluster_of_slow_verdicts(node_timeout_ms: u64) -> Option<RedisCluster> {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return None;
    }
    let cluster = tokio::task::spawn_blocking(move || {
        RedisCluster::start_with(3, 1, || {
            vec![
                "--cluster-node-timeout".to_owned(),
                node_timeout_ms.to_string(),
            ]
        })
    })
    .await
    .unwrap()
    .expect("start a local cluster");
    Some(cluster)
}

/// Waits until every event on `keys` is acknowledged (nothing pending or unread).
async fn until_acknowledged(
    cluster: &RedisCluster,
    conn: &RedisConn,
    keys: &Keys,
    what: &str,
    timeout: Duration,
) {
    wait_until(&cluster.nodes[0], what, timeout, || async {
        status::collect_from(conn, keys)
            .await
            .is_ok_and(|s| s.is_idle())
    })
    .await;
}

/// The node that replicates `master` (INFO replication of each node).
fn replica_of(cluster: &RedisCluster, master: usize) -> usize {
    let port = cluster.nodes[master].port();
    (0..cluster.nodes.len())
        .find(|&i| {
            let Ok(client) = redis::Client::open(cluster.nodes[i].url()) else {
                return false;
            };
            let Ok(mut c) = client.get_connection() else {
                return false;
            };
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut c)
                .unwrap_or_default();
            info.contains("role:slave") && info.contains(&format!("master_port:{port}\r"))
        })
        .expect("the master has a replica")
}

/// Pauses (SIGSTOP) the replica of `master` once it has caught up and every node knows
/// it as the master's replica; returns it.
fn pause_its_replica(cluster: &RedisCluster, master: usize) -> usize {
    let replica = replica_of(cluster, master);
    cluster
        .wait_replica_known(replica, master, Duration::from_secs(30))
        .expect("the cluster knows the replica");
    cluster
        .wait_replica_caught_up(master, 256, Duration::from_secs(30))
        .expect("the replica catches up");
    cluster.nodes[replica]
        .signal("STOP")
        .expect("pause the replica");
    replica
}

/// Makes `master` drop the link of its paused replica: a `repl-timeout` of 1 s, then
/// waits until its INFO replication counts no replica.
async fn drop_replica_link(cluster: &RedisCluster, master: usize) {
    let url = cluster.nodes[master].url();
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("repl-timeout")
        .arg(1)
        .query_async(&mut c)
        .await
        .unwrap();
    wait_until(
        &cluster.nodes[master],
        "the master drops its paused replica's link",
        Duration::from_secs(30),
        || {
            let mut c = c.clone();
            async move {
                let info: String = redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut c)
                    .await
                    .unwrap_or_default();
                info.contains("connected_slaves:0\r")
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_after_the_walk_with_its_replica_behind_loses_no_delete() {
    killed_after_the_walk(false).await;
}

/// The same, the master having dropped the paused replica's link (its `repl-timeout`
/// passed: INFO replication no longer lists it, `connected_slaves:0`) while the cluster
/// still counts the replica as up: a failover may promote it, so it is waited for all
/// the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_its_master_dropped_but_the_cluster_counts_up_loses_no_delete() {
    killed_after_the_walk(true).await;
}

/// A master killed right after the walk's last step with its replica paused behind,
/// then failed over to that replica: no entry of the dead server back once its event is
/// acknowledged, none of the live server's lost. With `dropped`, the master has dropped
/// the replica's link before the walk.
async fn killed_after_the_walk(dropped: bool) {
    // The paused replica is not flagged failed (and so no longer waited for) while it is
    // paused: the link dropped, the walk and the 3 s after it take some 10 s on a busy
    // machine, well inside the node timeout.
    let Some(mut cluster) = cluster_of_slow_verdicts(25_000).await else {
        return;
    };
    let layout = Layout::Keys;
    let mut settings = cluster_settings(&cluster, layout);
    settings.chunk_size = 100;
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    // A key prefix that keeps the events stream off the victim (below): a failover to a
    // replica paused before the event was published loses the event itself (replication
    // is asynchronous), and this test is about the walk's deletes.
    let keys = loop {
        let keys = Keys::for_settings(&settings);
        if cluster.master_of(keys.events().as_bytes())
            != cluster.master_of(&keys.user(&user(&dead, 0)))
        {
            break keys;
        }
        settings.key_prefix = prefix();
    };
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let registry = Registry::new(keys.clone(), layout);

    const USERS: usize = 3_000;
    const LIVE: usize = 500;
    seed(&registry, &conn, &dead, USERS).await;
    seed(&registry, &conn, &live, LIVE).await;

    // The victim serves some of the dead server's entries; its replica holds them all
    // before it is paused, so that what it lacks is exactly the walk's deletes.
    let forward = |n: usize| keys.user(&user(&dead, n));
    let victim = cluster
        .master_of(&forward(0))
        .expect("a master serves the slot");
    let on_victim: Vec<Vec<u8>> = (0..USERS)
        .map(forward)
        .filter(|k| cluster.master_of(k) == Some(victim))
        .collect();
    assert!(!on_victim.is_empty());
    let replica = pause_its_replica(&cluster, victim);
    if dropped {
        drop_replica_link(&cluster, victim).await;
    }

    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &dead).await;

    // The walk's deletes reach the victim (read on the victim itself)...
    let victim_url = cluster.nodes[victim].url();
    wait_until(
        &cluster.nodes[victim],
        "the walk's deletes on the victim",
        Duration::from_secs(60),
        || {
            let (url, keys) = (victim_url.clone(), on_victim.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    let mut c = redis::Client::open(url).ok()?.get_connection().ok()?;
                    let mut left = 0;
                    for k in &keys {
                        let exists: bool = redis::cmd("EXISTS").arg(k).query(&mut c).ok()?;
                        left += usize::from(exists);
                    }
                    Some(left == 0)
                })
                .await
                .ok()
                .flatten()
                .unwrap_or(false)
            }
        },
    )
    .await;
    // ...and stay unacknowledged while the paused replica lacks them: longer than one
    // WAIT of the walk's end.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before_kill = status::collect_from(&conn, &keys)
        .await
        .expect("status before the kill");
    assert!(
        !before_kill.is_idle(),
        "the event was acknowledged while a replica lacked the walk's deletes: {before_kill:?}"
    );

    // The master dies right then; its replica, behind, takes over.
    cluster.nodes[victim].kill();
    cluster.nodes[replica]
        .signal("CONT")
        .expect("resume the replica");
    cluster
        .wait_ok(Duration::from_secs(90))
        .expect("the replica takes over");
    until_acknowledged(
        &cluster,
        &conn,
        &keys,
        "all events acknowledged",
        Duration::from_secs(120),
    )
    .await;

    // Checked over a new connection, which learns the new topology at once.
    let fresh = fresh_conn(&settings).await;
    assert_eq!(
        still_pointing(&registry, &fresh, &dead, USERS).await,
        0,
        "entries of the dead server back after the failover, its event acknowledged"
    );
    assert_eq!(
        still_pointing(&registry, &fresh, &live, LIVE).await,
        LIVE,
        "live entries lost in the failover"
    );
    // The wait shows in its metric: the walk waited at least the 3 s before the kill.
    // The event may have been acknowledged by a takeover of its entry while the first
    // cleanup was still retrying through the failover (the first cleanup then finishes
    // its wait a little later): give it the time to.
    let waited = &worker.metrics.replica_wait_seconds;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while waited.get_sample_sum() < 3.0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        waited.get_sample_sum() >= 3.0,
        "replica waits: {} in {:.1} s",
        waited.get_sample_count(),
        waited.get_sample_sum()
    );
    worker.stop().await;
}

/// The end of a cluster walk asks every master whether its replicas hold the walk's
/// deletes (`wait_for_replicas` in src/cleanup/cluster.rs). Once the cluster connection
/// has been built again (src/conn/cluster_conn.rs), the question goes out on a new
/// connection that made none of the deletes. WAIT counts from the offset of the
/// connection it is sent on, and on Redis 7.4 a new connection's WAIT is answered at once;
/// the answer must still be "not held" while a replica lacks the writes, as it is judged
/// by the replicas' acknowledged offsets against the master's. A replica paused
/// (SIGSTOP), a write it cannot hold, the connection built again (the trigger is made up,
/// as in tests/cluster.rs), and `wait_replicated` must still say the replica does not
/// hold the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_cluster_connection_still_waits_for_the_replicas() {
    // The paused replica is not flagged failed meanwhile.
    let Some(cluster) = cluster_of_slow_verdicts(15_000).await else {
        return;
    };
    let client = redis::cluster::ClusterClientBuilder::new(cluster.seeds())
        .response_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let cc = Arc::new(
        ClusterConn::connect(
            client,
            redis::cluster::ClusterConfig::new().set_response_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap()
        .rebuild_after(Duration::ZERO),
    );
    let conn = RedisConn::Cluster(cc.clone(), Default::default());

    let key = "rebuilt:wait:k";
    let victim = cluster
        .master_of(key.as_bytes())
        .expect("a master serves the key");
    let replica = pause_its_replica(&cluster, victim);

    // A write the paused replica cannot hold, made through the connection.
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("1")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let before = conn::wait_replicated(&conn, Duration::from_millis(1_000), &Keys::new(""))
        .await
        .unwrap();

    // The connection is built again (as after 15 s without an answer).
    let (_, generation) = cc.current();
    let timed_out: redis::RedisResult<()> =
        Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
    cc.observe(generation, &timed_out).await;
    let rebuilt = cc.rebuilds();
    let after = conn::wait_replicated(&conn, Duration::from_millis(1_000), &Keys::new(""))
        .await
        .unwrap();
    cluster.nodes[replica]
        .signal("CONT")
        .expect("resume the replica");

    assert!(
        !before.all_held(),
        "the paused replica was counted as holding the write: {before:?}"
    );
    assert_eq!(rebuilt, 1, "the connection was not built again");
    assert!(
        !after.all_held(),
        "after the cluster connection was built again, WAIT says every replica holds a \
         write that the paused replica cannot hold: {after:?}"
    );
}

/// A cluster whose nodes refuse WAIT to the janitor's user (an ACL without it, or a hosted
/// service that disables it): the end of a walk cannot wait for the replicas, says so,
/// and goes on; the event is acknowledged, the dead server's entries gone, the live ones
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_refusing_wait_still_ends_the_walk() {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 1))
        .await
        .unwrap()
        .expect("start a local cluster");
    for node in &cluster.nodes {
        let mut c = redis::Client::open(node.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg("-wait")
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let layout = Layout::Keys;
    let settings = cluster_settings(&cluster, layout);
    let keys = Keys::for_settings(&settings);
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let registry = Registry::new(keys.clone(), layout);
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    seed(&registry, &conn, &dead, 500).await;
    seed(&registry, &conn, &live, 200).await;

    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &dead).await;
    until_acknowledged(
        &cluster,
        &conn,
        &keys,
        "the event acknowledged",
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(still_pointing(&registry, &conn, &dead, 500).await, 0);
    assert_eq!(still_pointing(&registry, &conn, &live, 200).await, 200);
    worker.stop().await;
}

/// `cluster_replica_wait = false`: the end of a walk does not wait for the replicas. A
/// replica paused (SIGSTOP) under a master that holds some of the dead server's entries,
/// and counted up by the cluster throughout (a node timeout of 60 s): the event is
/// acknowledged while the replica still lacks the deletes and is not flagged failed,
/// which the wait (on by default) would never do. The registry's end state is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_replica_wait_off_a_walk_ends_while_a_replica_lags() {
    // No failover here: a node timeout of 60 s keeps the paused replica counted up for
    // the whole test, however slow the machine.
    let Some(cluster) = cluster_of_slow_verdicts(60_000).await else {
        return;
    };
    let layout = Layout::Keys;
    let mut settings = cluster_settings(&cluster, layout);
    settings.chunk_size = 100;
    settings.cluster_replica_wait = false;
    let keys = Keys::for_settings(&settings);
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let registry = Registry::new(keys.clone(), layout);
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 1_000;
    const LIVE: usize = 200;
    seed(&registry, &conn, &dead, USERS).await;
    seed(&registry, &conn, &live, LIVE).await;
    let victim = cluster
        .master_of(&keys.user(&user(&dead, 0)))
        .expect("a master serves the slot");
    let replica = pause_its_replica(&cluster, victim);

    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &dead).await;
    until_acknowledged(
        &cluster,
        &conn,
        &keys,
        "the event acknowledged with a replica paused",
        Duration::from_secs(60),
    )
    .await;
    // The paused replica was counted up all along: the victim does not flag it failed.
    let mut c = redis::Client::open(cluster.nodes[victim].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut c)
        .await
        .unwrap();
    let port = format!(":{}@", cluster.nodes[replica].port());
    let line = nodes
        .lines()
        .find(|l| l.contains(&port))
        .expect("the victim knows its replica");
    assert!(
        !line.contains("fail"),
        "the replica was flagged failed before the acknowledgement, so this run cannot tell a walk that waited: {line}"
    );
    assert_eq!(still_pointing(&registry, &conn, &dead, USERS).await, 0);
    assert_eq!(still_pointing(&registry, &conn, &live, LIVE).await, LIVE);
    assert_eq!(worker.metrics.replica_wait_seconds.get_sample_count(), 0);
    cluster.nodes[replica]
        .signal("CONT")
        .expect("resume the replica");
    worker.stop().await;
}
