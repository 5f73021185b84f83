//! A local Redis Cluster of private `redis-server` processes (for tests and for trying
//! cluster mode on one machine), stopped when dropped.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::RedisServer;
use crate::error::{Error, Result};

/// How long `redis-cli --cluster create` may take: it waits for the nodes to agree on the
/// configuration, and a node that never joins (a cluster bus it cannot reach) would make it
/// wait for ever.
const CREATE_WITHIN: Duration = Duration::from_secs(120);

/// Runs `cmd` (its standard output captured, its standard error discarded); kills it if it
/// has not exited within `within`. Returns whether it exited with success, and its output.
fn run_within(mut cmd: Command, within: Duration) -> Result<(bool, String)> {
    use std::io::Read;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::io("running redis-cli --cluster create", e))?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    // Read on a thread of its own, so that a full pipe never blocks the child.
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stdout.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    });
    let deadline = Instant::now() + within;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(Error::io("waiting for redis-cli --cluster create", e)),
        }
    };
    let output = reader.join().unwrap_or_default();
    match status {
        Some(status) => Ok((status.success(), output)),
        None => Ok((
            false,
            format!("did not finish within {}s: {output}", within.as_secs()),
        )),
    }
}

/// A local Redis Cluster of `redis-server` processes on free ports (for tests and for
/// trying cluster mode on one machine), stopped when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// True when `redis-server` can run in cluster mode and `redis-cli` can create one.
    pub fn supported() -> bool {
        let cli = Command::new(super::server::cli_binary())
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        cli && RedisServer::start_with(&["--cluster-enabled", "yes"]).is_ok()
    }

    /// Starts `masters` masters with `replicas` replicas each, and waits until the
    /// cluster reports `cluster_state:ok` on every node.
    pub fn start(masters: usize, replicas: usize) -> Result<Self> {
        Self::start_with(masters, replicas, Vec::new)
    }

    /// [`RedisCluster::start`] with more arguments for each node, from `per_node` (called
    /// once per node, in the order of `nodes`): for example a TLS port of its own and
    /// `--tls-cluster yes`. The cluster is created over the plain ports.
    pub fn start_with(
        masters: usize,
        replicas: usize,
        mut per_node: impl FnMut() -> Vec<String>,
    ) -> Result<Self> {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
            // A replica of a fresh cluster may look out of date (pings every 10 s) and
            // refuse to take over; on one test machine it never is.
            "--cluster-replica-validity-factor",
            "0",
            // Replicas sync at once (not after the default 5 s), so that a test can kill
            // a master soon after start and its replica has the data.
            "--repl-diskless-sync-delay",
            "0",
        ];
        let nodes = (0..masters * (1 + replicas))
            .map(|_| {
                let mut node_args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
                node_args.extend(per_node());
                let node_args: Vec<&str> = node_args.iter().map(String::as_str).collect();
                RedisServer::start_with(&node_args)
            })
            .collect::<Result<Vec<_>>>()?;
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut create = Command::new(super::server::cli_binary());
        create.arg("--cluster").arg("create").args(&addrs).args([
            "--cluster-replicas",
            &replicas.to_string(),
            "--cluster-yes",
        ]);
        let (success, output) = run_within(create, CREATE_WITHIN)?;
        if !success {
            return Err(Error::LocalRedis(format!(
                "redis-cli --cluster create failed: {output}"
            )));
        }
        let cluster = RedisCluster { nodes };
        cluster.wait_ok(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// The URL of the first node (a seed).
    pub fn url(&self) -> String {
        self.nodes[0].url()
    }

    /// URLs of all nodes, for `redis_cluster_seeds`.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Waits until every running node says the cluster is healthy and all slots are
    /// served.
    pub fn wait_ok(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let healthy = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let info = n.query_text(redis::cmd("CLUSTER").arg("INFO"));
                let nodes = n.query_text(redis::cmd("CLUSTER").arg("NODES"));
                // A failed node that still owns slots: its replica has not taken over yet.
                let failed_with_slots = nodes.is_none_or(|text| {
                    text.lines().any(|l| {
                        let fields: Vec<&str> = l.split(' ').collect();
                        fields.get(2).is_some_and(|flags| {
                            flags.split(',').any(|f| f == "fail" || f == "fail?")
                        }) && fields.len() > 8
                    })
                });
                let replication = n.query_text(redis::cmd("INFO").arg("replication"));
                // A replica counts once its link to its master is up (its data is there).
                let in_sync = replication.is_some_and(|r| {
                    r.contains("role:master") || r.contains("master_link_status:up")
                });
                in_sync
                    && !failed_with_slots
                    && info.is_some_and(|i| {
                        i.contains("cluster_state:ok") && i.contains("cluster_slots_ok:16384")
                    })
            });
            if healthy {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(
                    "the cluster did not become healthy in time".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until node `master` has a replica that is online and caught up (its last
    /// acknowledged offset within `max_lag_bytes` of the master's), so that a test that
    /// kills the master next knows its replica holds the data, but for the writes of the
    /// last moment. Under load a replica can be in the middle of a full resync, with an
    /// empty or old dataset: a failover to it loses far more than asynchronous
    /// replication ever promises, and no test of the janitor is about that.
    pub fn wait_replica_caught_up(
        &self,
        master: usize,
        max_lag_bytes: u64,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let info = self.nodes[master]
                .query_text(redis::cmd("INFO").arg("replication"))
                .unwrap_or_default();
            let field = |line: &str, name: &str| -> Option<u64> {
                line.split(',')
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?
                    .trim()
                    .parse()
                    .ok()
            };
            let master_offset: Option<u64> = info
                .lines()
                .find_map(|l| l.strip_prefix("master_repl_offset:"))
                .and_then(|v| v.trim().parse().ok());
            let caught_up = master_offset.is_some_and(|m| {
                info.lines()
                    .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                    .filter_map(|l| field(l.split_once(':')?.1, "offset"))
                    .any(|o| m.saturating_sub(o) <= max_lag_bytes)
            });
            if caught_up {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(format!(
                    "no replica of node {master} caught up in time:\n{info}"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until every running node's CLUSTER NODES lists node `replica` as a replica
    /// of node `master`: gossip has spread its role (right after the cluster is made,
    /// some nodes may still show it as a master without slots).
    pub fn wait_replica_known(
        &self,
        replica: usize,
        master: usize,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let ids = self.node_id(replica).zip(self.node_id(master));
            let known = ids.as_ref().is_some_and(|(replica_id, master_id)| {
                self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                    n.query_text(redis::cmd("CLUSTER").arg("NODES"))
                        .unwrap_or_default()
                        .lines()
                        .any(|line| {
                            let fields: Vec<&str> = line.split(' ').collect();
                            fields.len() > 3
                                && fields[0] == replica_id
                                && fields[2].split(',').any(|f| f == "slave" || f == "replica")
                                && fields[3] == master_id
                        })
                })
            });
            if known {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(format!(
                    "not every node knows node {replica} as a replica of node {master} in time"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node id of node `i` (CLUSTER MYID), if it answers.
    pub fn node_id(&self, i: usize) -> Option<String> {
        self.nodes[i].query_text(redis::cmd("CLUSTER").arg("MYID"))
    }

    /// Waits until `redis-cli --cluster check` finds nothing to say: every node agrees
    /// about the slots, none is open (migrating or importing), all are covered.
    pub fn wait_settled(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let out = Command::new(super::server::cli_binary())
                .args(["--cluster", "check", &self.seed_addr()])
                .output()
                .map_err(|e| Error::io("running redis-cli --cluster check", e))?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() && !text.contains("[ERR]") && !text.contains("[WARNING]") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(format!(
                    "the cluster did not settle in time:\n{text}"
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Moves `slots` hash slots, with their keys, from master `from` to master `to`
    /// (node indexes), as an operator does: `redis-cli --cluster reshard`. Returns when
    /// the move is done. Each slot is migrated while its keys are in use: MIGRATE moves
    /// its keys in batches, meanwhile the source answers ASK for a key already moved (and
    /// TRYAGAIN for a command on several keys of it), and at the end the slot is given
    /// to `to` (MOVED from then on).
    pub fn reshard(&self, from: usize, to: usize, slots: usize) -> Result<()> {
        let id = |i: usize| {
            self.node_id(i)
                .ok_or_else(|| Error::LocalRedis(format!("node {i} does not answer")))
        };
        let out = Command::new(super::server::cli_binary())
            .args(["--cluster", "reshard", &self.seed_addr()])
            .args(["--cluster-from", &id(from)?, "--cluster-to", &id(to)?])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .map_err(|e| Error::io("running redis-cli --cluster reshard", e))?;
        if !out.status.success() {
            return Err(Error::LocalRedis(format!(
                "redis-cli --cluster reshard failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    /// host:port of the first running node, for redis-cli --cluster.
    fn seed_addr(&self) -> String {
        let node = self
            .nodes
            .iter()
            .find(|n| n.child.is_some())
            .unwrap_or(&self.nodes[0]);
        format!("127.0.0.1:{}", node.port())
    }

    /// The node index of the master that serves `key`'s slot now.
    pub fn master_of(&self, key: &[u8]) -> Option<usize> {
        for (i, node) in self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.child.is_some())
        {
            let mut c = redis::Client::open(node.url())
                .ok()?
                .get_connection()
                .ok()?;
            let reply: redis::RedisResult<String> = redis::cmd("GET").arg(key).query(&mut c);
            match reply {
                Err(e) if e.code() == Some("MOVED") || e.code() == Some("ASK") => continue,
                // A replica answers MOVED too; a nil or value reply means this master serves it.
                _ => {
                    let role: String = redis::cmd("ROLE")
                        .query::<Vec<redis::Value>>(&mut c)
                        .ok()
                        .and_then(|r| match r.first() {
                        Some(redis::Value::BulkString(b)) => {
                            Some(String::from_utf8_lossy(b).into_owned())
                        }
                        _ => None,
                    })?;
                    if role == "master" {
                        return Some(i);
                    }
                }
            }
        }
        None
    }
}
