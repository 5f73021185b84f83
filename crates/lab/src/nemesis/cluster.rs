//! The `cluster` topology: a private Redis Cluster of the test harness, three masters
//! with a replica each (every node with its append-only file fsynced on every write and
//! `busy-reply-threshold` 100 ms), and the faults done to it.
//!
//! Its failovers lose no write a master acknowledged, as on Sentinel: a write Redis
//! acknowledged and lost on a failover would be Redis's doing (asynchronous
//! replication), and no check could tell it from the janitor's.
//! - `cluster-failover`: `CLIENT PAUSE WRITE` on the master, its replica catches up to
//!   its replication offset, SIGKILL; the cluster promotes the replica. The old master
//!   starts again with `min-replicas-to-write 1`, so that in the moment before it learns
//!   from the cluster that it is a replica now, it refuses every write (NOREPLICAS)
//!   rather than take one with its old slots; once it is a replica the setting is
//!   lifted.
//! - `cluster-manual-failover`: `CLUSTER FAILOVER` on the replica, which Redis makes
//!   lossless itself (the master stops its clients until the replica has its offset).
//!
//! The cluster's node timeout is 5 s rather than the test harness's usual 1 s, for the
//! reason the Sentinel group's `down-after-milliseconds` is: on a starved machine a
//! master silent for a second would be failed over by the cluster itself, and what it
//! acknowledged meanwhile lost. Such a failover is seen in the cluster's epoch (the
//! greatest config epoch in CLUSTER NODES) and noted ([`Cluster::watch`]).

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use registry_janitor::error::{Error, Result};
use registry_janitor_testkit::{RedisCluster, RedisServer};
use tokio_util::sync::CancellationToken;

use super::{
    topology::{
        connect, field, info, lock, master_offset, pause_until_caught_up, replica_holds, span, url,
        Epochs, CATCH_UP,
    },
    verdicts::Verdicts,
};

/// `INFO replication` of the node at `url`, from a blocking client (at the start).
fn info_now(url: &str) -> Option<String> {
    let client = redis::Client::open(url).ok()?;
    let mut c = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()?;
    redis::cmd("INFO").arg("replication").query(&mut c).ok()
}

/// Masters, and replicas of each.
const MASTERS: usize = 3;
const REPLICAS: usize = 1;
/// `cluster-node-timeout`.
pub const NODE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the cluster may take to promote the replica.
const FAILOVER: Duration = Duration::from_secs(60);
/// How long the old master, back as a replica, may take to sync.
const RESYNC: Duration = Duration::from_secs(30);
/// How long a manual failover may take.
const MANUAL: Duration = Duration::from_secs(30);

/// What the failovers of a run did, for the summary.
#[derive(Default)]
struct Failovers {
    paused: Vec<Duration>,
    promoted: Vec<Duration>,
    synced: Vec<Duration>,
    not_synced: usize,
    given_up: usize,
    no_promotion: usize,
    manual: Vec<Duration>,
    manual_not_done: usize,
    skipped: usize,
}

pub struct Cluster {
    cluster: Arc<Mutex<RedisCluster>>,
    pub ports: Vec<u16>,
    failovers: Mutex<Failovers>,
    epochs: Mutex<Epochs>,
}

impl Cluster {
    pub async fn start() -> Result<Cluster> {
        let supported = tokio::task::spawn_blocking(RedisCluster::supported).await?;
        if !supported {
            return Err(Error::LocalRedis(
                "the nemesis starts its own Redis Cluster, and this redis-server cannot run \
                 one (or redis-cli is not on PATH; Debian/Ubuntu: sudo apt-get install \
                 redis-server)"
                    .into(),
            ));
        }
        let cluster =
            tokio::task::spawn_blocking(|| -> registry_janitor_testkit::Result<RedisCluster> {
                let node_timeout = NODE_TIMEOUT.as_millis().to_string();
                let cluster = RedisCluster::start_with(MASTERS, REPLICAS, || {
                    super::topology::DURABLE
                        .iter()
                        // After the harness's own 1 s: the last one counts.
                        .chain(&["--cluster-node-timeout", node_timeout.as_str()])
                        .map(|a| a.to_string())
                        .collect()
                })?;
                // Every replica known as such by every node, and in sync.
                for i in 0..cluster.nodes.len() {
                    let Some(text) = info_now(&cluster.nodes[i].url()) else {
                        continue;
                    };
                    if let Some(port) = field(&text, "master_port") {
                        let master = cluster
                            .nodes
                            .iter()
                            .position(|n| n.port().to_string() == port);
                        if let Some(master) = master {
                            cluster.wait_replica_known(i, master, Duration::from_secs(60))?;
                            cluster.wait_replica_caught_up(master, 0, Duration::from_secs(60))?;
                        }
                    }
                }
                cluster.wait_ok(Duration::from_secs(60))?;
                Ok(cluster)
            })
            .await?
            .map_err(|e| Error::LocalRedis(format!("starting the Redis Cluster: {e}")))?;
        Ok(Cluster {
            ports: cluster.nodes.iter().map(RedisServer::port).collect(),
            cluster: Arc::new(Mutex::new(cluster)),
            failovers: Mutex::default(),
            epochs: Mutex::default(),
        })
    }

    pub fn seeds(&self) -> Vec<String> {
        self.ports.iter().map(|&p| url(p)).collect()
    }

    pub fn describe(&self) -> String {
        format!(
            "a Redis Cluster of {MASTERS} masters with {REPLICAS} replica each on 127.0.0.1 \
             ports {} (appendonly, fsync always), node timeout {} s",
            self.ports
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            NODE_TIMEOUT.as_secs()
        )
    }

    pub fn log(&self) -> String {
        let c = lock(&self.cluster);
        let mut out = String::new();
        for (i, node) in c.nodes.iter().enumerate() {
            out.push_str(&format!(
                "--- redis-server node-{i} (port {}) ---\n{}",
                node.port(),
                node.log()
            ));
        }
        out
    }

    pub fn summary(&self) -> String {
        let f = lock(&self.failovers);
        format!(
            "{} failovers: writes paused {} until the replica held them all, the replica \
             promoted {} after the SIGKILL, the old master in sync as a replica {} after its \
             start ({} not in sync within {} s); {} given up (replica behind), {} with no \
             promotion within {} s; {} manual failovers ({}), {} not done within {} s; {} \
             skipped (no replica in sync)",
            f.promoted.len(),
            span(&f.paused),
            span(&f.promoted),
            span(&f.synced),
            f.not_synced,
            RESYNC.as_secs(),
            f.given_up,
            f.no_promotion,
            FAILOVER.as_secs(),
            f.manual.len(),
            span(&f.manual),
            f.manual_not_done,
            MANUAL.as_secs(),
            f.skipped
        )
    }

    fn node_url(&self, i: usize) -> String {
        url(self.ports[i])
    }

    fn running(&self, i: usize) -> bool {
        lock(&self.cluster).nodes[i].pid().is_some()
    }

    /// CLUSTER NODES as a running node sees it (the first that answers).
    async fn nodes_view(&self) -> Option<String> {
        for i in 0..self.ports.len() {
            if !self.running(i) {
                continue;
            }
            let Ok(mut c) = connect(&self.node_url(i)).await else {
                continue;
            };
            let text: redis::RedisResult<String> =
                redis::cmd("CLUSTER").arg("NODES").query_async(&mut c).await;
            if let Ok(text) = text {
                return Some(text);
            }
        }
        None
    }

    /// The nodes that serve slots as masters now (not failed), in the order of the nodes.
    pub async fn masters(&self) -> Vec<usize> {
        let Some(text) = self.nodes_view().await else {
            return Vec::new();
        };
        let mut masters: Vec<usize> = text
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                let flags = fields.get(2)?;
                let serving = fields.len() > 8
                    && flags.split(',').any(|f| f == "master")
                    && !flags.split(',').any(|f| f == "fail" || f == "fail?");
                if !serving {
                    return None;
                }
                let port: u16 = fields[1]
                    .split(['@', ','])
                    .next()?
                    .rsplit_once(':')?
                    .1
                    .parse()
                    .ok()?;
                self.ports.iter().position(|&p| p == port)
            })
            .collect();
        masters.sort_unstable();
        masters
    }

    /// The master the `pick`-th of the masters now is (modulo), as a node index.
    pub async fn pick_master(&self, pick: u32) -> Option<usize> {
        let masters = self.masters().await;
        (!masters.is_empty()).then(|| masters[pick as usize % masters.len()])
    }

    /// A plain client of node `i`.
    pub fn client(&self, i: usize) -> Result<redis::Client> {
        Ok(redis::Client::open(self.node_url(i))?)
    }

    /// The greatest config epoch in CLUSTER NODES, as a running node sees it.
    async fn epoch(&self) -> Option<u64> {
        let text = self.nodes_view().await?;
        text.lines()
            .filter_map(|l| l.split(' ').nth(6)?.parse::<u64>().ok())
            .max()
    }

    /// A replica of master `master` whose link to it is up.
    async fn replica_of(&self, master: usize) -> Option<usize> {
        let port = self.ports[master].to_string();
        for i in (0..self.ports.len()).filter(|&i| i != master && self.running(i)) {
            let Some(text) = info(&self.node_url(i), "replication").await else {
                continue;
            };
            if field(&text, "role") == Some("slave")
                && field(&text, "master_port") == Some(port.as_str())
                && field(&text, "master_link_status") == Some("up")
            {
                return Some(i);
            }
        }
        None
    }

    /// `master`'s replication offset once `replica` is linked to it and has applied its
    /// stream up to it; None while not.
    async fn caught_up(
        &self,
        master: usize,
        replica: usize,
        conn: &redis::aio::MultiplexedConnection,
    ) -> Option<u64> {
        let offset = master_offset(conn).await?;
        replica_holds(&self.node_url(replica), self.ports[master], offset)
            .await?
            .then_some(offset)
    }

    /// Whether node `i` says it is a master and the cluster is ok for it.
    async fn serves_as_master(&self, i: usize) -> bool {
        let Some(repl) = info(&self.node_url(i), "replication").await else {
            return false;
        };
        if field(&repl, "role") != Some("master") {
            return false;
        }
        let Ok(mut c) = connect(&self.node_url(i)).await else {
            return false;
        };
        let text: redis::RedisResult<String> =
            redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await;
        text.is_ok_and(|t| field(&t, "cluster_state") == Some("ok"))
    }

    /// A failover of the nemesis, its change of the epoch told apart from the cluster's
    /// own ([`Cluster::watch`]).
    async fn ours<F: std::future::Future<Output = Result<String>>>(&self, f: F) -> Result<String> {
        lock(&self.epochs).ours = Some(false);
        let done = f.await;
        let now = self.epoch().await;
        let mut epochs = lock(&self.epochs);
        if let Some(epoch) = now.filter(|&e| e > epochs.seen) {
            epochs.saw(epoch);
        }
        epochs.ours = None;
        done
    }

    /// SIGKILLs the `pick`-th master once its replica holds every write it acknowledged;
    /// says what happened. See the module's documentation.
    pub async fn failover(&self, pick: u32, down: Duration) -> Result<String> {
        self.ours(self.failover_steps(pick, down)).await
    }

    /// The `pick`-th master and its replica now; else why the failover is skipped (and
    /// counted so).
    async fn master_and_replica(&self, pick: u32) -> std::result::Result<(usize, usize), String> {
        let found = match self.pick_master(pick).await {
            None => Err("skipped: no master answers".to_owned()),
            Some(old) => match self.replica_of(old).await {
                None => Err(format!(
                    "skipped: node-{old} has no replica linked to it now"
                )),
                Some(replica) => Ok((old, replica)),
            },
        };
        if found.is_err() {
            lock(&self.failovers).skipped += 1;
        }
        found
    }

    async fn failover_steps(&self, pick: u32, down: Duration) -> Result<String> {
        let (old, replica) = match self.master_and_replica(pick).await {
            Ok(found) => found,
            Err(skipped) => return Ok(skipped),
        };
        let master = connect(&self.node_url(old)).await?;
        let Some((offset, waited)) =
            pause_until_caught_up(&master, || self.caught_up(old, replica, &master)).await?
        else {
            lock(&self.failovers).given_up += 1;
            return Ok(format!(
                "skipped: node-{replica} did not catch up with node-{old} within {} s",
                CATCH_UP.as_secs()
            ));
        };
        let cluster = self.cluster.clone();
        tokio::task::spawn_blocking(move || lock(&cluster).nodes[old].kill()).await?;
        let killed = Instant::now();
        let promoted = loop {
            if self.serves_as_master(replica).await {
                break true;
            }
            if killed.elapsed() > FAILOVER {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let promoted_after = killed.elapsed();
        lock(&self.failovers).paused.push(waited);
        tokio::time::sleep(down.saturating_sub(killed.elapsed())).await;
        let cluster = self.cluster.clone();
        if !promoted {
            // No failover: the old master comes back with its slots and its append-only
            // file (every write it acknowledged).
            tokio::task::spawn_blocking(move || lock(&cluster).nodes[old].restart())
                .await?
                .map_err(|e| Error::LocalRedis(format!("restarting node-{old}: {e}")))?;
            lock(&self.failovers).no_promotion += 1;
            return Ok(format!(
                "node-{old} (master) SIGKILLed with node-{replica} at offset {offset}; no \
                 promotion within {} s: it started again as the master",
                FAILOVER.as_secs()
            ));
        }
        // Until the cluster tells it that it is a replica now, the old master has its
        // old slots: with `min-replicas-to-write 1` and no replica it refuses writes.
        tokio::task::spawn_blocking(move || {
            lock(&cluster).nodes[old].restart_with(&["--min-replicas-to-write", "1"])
        })
        .await?
        .map_err(|e| Error::LocalRedis(format!("restarting node-{old}: {e}")))?;
        let restarted = Instant::now();
        let mut synced = None;
        let mut replica_now = false;
        while restarted.elapsed() < RESYNC {
            if let Some(text) = info(&self.node_url(old), "replication").await {
                replica_now = field(&text, "role") == Some("slave");
                if replica_now && field(&text, "master_link_status") == Some("up") {
                    synced = Some(restarted.elapsed());
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if replica_now {
            // A replica takes no writes anyway; should it be promoted again later, it
            // must take them.
            let mut c = connect(&self.node_url(old)).await?;
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("min-replicas-to-write")
                .arg(0)
                .query_async(&mut c)
                .await?;
        }
        {
            let mut f = lock(&self.failovers);
            f.promoted.push(promoted_after);
            match synced {
                Some(t) => f.synced.push(t),
                None => f.not_synced += 1,
            }
        }
        Ok(format!(
            "node-{old} (master) SIGKILLed once node-{replica} held offset {offset} ({} ms \
             paused); node-{replica} promoted {:.1}s later; node-{old} back as its replica, {}",
            waited.as_millis(),
            promoted_after.as_secs_f64(),
            match synced {
                Some(t) => format!("in sync {:.1}s after its start", t.as_secs_f64()),
                None if replica_now => {
                    format!("not in sync {} s after its start", RESYNC.as_secs())
                }
                None => format!(
                    "not a replica {} s after its start (it refuses writes: \
                     min-replicas-to-write 1)",
                    RESYNC.as_secs()
                ),
            }
        ))
    }

    /// `CLUSTER FAILOVER` on the replica of the `pick`-th master.
    pub async fn manual_failover(&self, pick: u32) -> Result<String> {
        self.ours(self.manual_steps(pick)).await
    }

    async fn manual_steps(&self, pick: u32) -> Result<String> {
        let (old, replica) = match self.master_and_replica(pick).await {
            Ok(found) => found,
            Err(skipped) => return Ok(skipped),
        };
        let mut c = connect(&self.node_url(replica)).await?;
        let _: () = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query_async(&mut c)
            .await?;
        let began = Instant::now();
        while began.elapsed() < MANUAL {
            let old_role = info(&self.node_url(old), "replication").await;
            if self.serves_as_master(replica).await
                && old_role.is_some_and(|t| field(&t, "role") == Some("slave"))
            {
                lock(&self.failovers).manual.push(began.elapsed());
                return Ok(format!(
                    "node-{replica} took over from node-{old} in {:.1}s; node-{old} is its \
                     replica",
                    began.elapsed().as_secs_f64()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        lock(&self.failovers).manual_not_done += 1;
        Ok(format!(
            "CLUSTER FAILOVER on node-{replica} (replica of node-{old}) not done within {} s",
            MANUAL.as_secs()
        ))
    }

    /// No memory limit on any running node.
    pub async fn release(&self) -> Result<()> {
        for i in 0..self.ports.len() {
            if !self.running(i) {
                continue;
            }
            super::topology::no_limit(self.client(i)?).await?;
        }
        Ok(())
    }

    /// Until `stop`: every 500 ms, reads the cluster's epoch; a rise that no failover of
    /// the nemesis made is a note: the cluster failed a master over by itself (a master
    /// silent for the node timeout on a starved machine), which loses what that master
    /// acknowledged and had not replicated. A violation that follows may be that loss,
    /// Redis's doing.
    pub async fn watch(&self, verdicts: Arc<Verdicts>, stop: CancellationToken) {
        if let Some(epoch) = self.epoch().await {
            lock(&self.epochs).seen = epoch;
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.cancelled() => return,
            }
            let Some(epoch) = self.epoch().await else {
                continue;
            };
            let mut epochs = lock(&self.epochs);
            let before = epochs.seen;
            // A node behind (one just restarted) may show an older epoch: only a rise
            // counts.
            if epoch > before && epochs.saw(epoch) {
                drop(epochs);
                verdicts.note(format!(
                    "the cluster failed over by itself (epoch {before} -> {epoch}): the \
                     writes the old master acknowledged and had not replicated are lost by \
                     Redis, and a violation that follows may be that loss"
                ));
            }
        }
    }
}
