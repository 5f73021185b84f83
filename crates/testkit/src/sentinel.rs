//! A local Redis Sentinel group: a primary, its replicas and sentinels, all private
//! `redis-server` processes on free ports (sentinels are `redis-server <conf>
//! --sentinel`), stopped when dropped.

use std::{
    collections::HashMap,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::{server::free_port, server_binary, RedisServer};
use crate::error::{Error, Result};

/// The name the sentinels monitor the primary under.
pub const MASTER_NAME: &str = "mymaster";

/// A primary with replicas, watched by sentinels that fail over within seconds
/// (`down-after-milliseconds` 1000 unless started with another).
pub struct RedisSentinels {
    /// `nodes[0]` is the first primary, the rest its replicas; a failover changes roles,
    /// not this order ([`RedisSentinels::primary`] says which is the primary now).
    pub nodes: Vec<RedisServer>,
    pub sentinels: Vec<SentinelProcess>,
}

/// One `redis-server --sentinel` process.
pub struct SentinelProcess {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl SentinelProcess {
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }

    /// `SENTINEL MASTER <name>` as field → value.
    fn master_info(&self) -> Option<HashMap<String, String>> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut c = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .ok()?;
        let fields: Vec<String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(MASTER_NAME)
            .query(&mut c)
            .ok()?;
        Some(
            fields
                .chunks(2)
                .filter_map(|kv| Some((kv.first()?.clone(), kv.get(1)?.clone())))
                .collect(),
        )
    }

    fn start(monitor_port: u16, quorum: usize, down_after: Duration) -> Result<Self> {
        let mut last_error = None;
        // A port found free can be taken by someone else before the sentinel binds it.
        for _ in 0..5 {
            let dir = tempfile::tempdir().map_err(|e| Error::io("creating a temporary dir", e))?;
            let port = free_port()?;
            let conf = dir.path().join("sentinel.conf");
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {monitor_port} {quorum}\n\
                 sentinel down-after-milliseconds {MASTER_NAME} {down_after}\n\
                 sentinel failover-timeout {MASTER_NAME} 10000\n\
                 sentinel parallel-syncs {MASTER_NAME} 1\n",
                dir = dir.path().display(),
                down_after = down_after.as_millis()
            );
            std::fs::write(&conf, text).map_err(|e| Error::io("writing sentinel.conf", e))?;
            let child = Command::new(server_binary())
                .arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| Error::io("starting redis-server --sentinel", e))?;
            let mut sentinel = SentinelProcess {
                child: Some(child),
                port,
                dir,
            };
            match sentinel.wait_answering() {
                Ok(()) => return Ok(sentinel),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    fn wait_answering(&mut self) -> Result<()> {
        let (url, log) = (self.url(), self.dir.path().join("sentinel.log"));
        super::server::wait_answering(&mut self.child, &url, "redis-server --sentinel", &log)
    }

    /// Kills the sentinel with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

impl RedisSentinels {
    /// True when `redis-server` can be run (every build can run as a sentinel).
    pub fn supported() -> bool {
        RedisServer::available()
    }

    /// Starts a primary with `replicas` replicas (each started with `node_args` too) and
    /// `sentinels` sentinels (quorum: a majority of them), and waits until every
    /// sentinel knows every replica and every other sentinel, so that a failover can
    /// happen at once.
    pub fn start(replicas: usize, sentinels: usize, node_args: &[&str]) -> Result<Self> {
        Self::start_with_down_after(replicas, sentinels, node_args, Duration::from_secs(1))
    }

    /// [`RedisSentinels::start`], with the sentinels' `down-after-milliseconds` at
    /// `down_after` (1 s there): how long a primary may go without answering before a
    /// sentinel finds it down.
    pub fn start_with_down_after(
        replicas: usize,
        sentinels: usize,
        node_args: &[&str],
        down_after: Duration,
    ) -> Result<Self> {
        // Replicas sync at once, not after the default 5 s.
        let mut args = vec!["--repl-diskless-sync-delay", "0"];
        args.extend_from_slice(node_args);
        let primary = RedisServer::start_with(&args)?;
        let port = primary.port().to_string();
        let mut nodes = vec![primary];
        for _ in 0..replicas {
            let mut replica_args = args.clone();
            replica_args.extend_from_slice(&["--replicaof", "127.0.0.1", &port]);
            nodes.push(RedisServer::start_with(&replica_args)?);
        }
        let quorum = sentinels / 2 + 1;
        let sentinels = (0..sentinels)
            .map(|_| SentinelProcess::start(nodes[0].port(), quorum, down_after))
            .collect::<Result<Vec<_>>>()?;
        let group = RedisSentinels { nodes, sentinels };
        group.wait_ready(replicas, Duration::from_secs(60))?;
        Ok(group)
    }

    /// The sentinels' URLs, for `redis_sentinels`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelProcess::url).collect()
    }

    /// The index in `nodes` of the node that a majority of the sentinels name as the
    /// primary and that says so itself (ROLE), if any.
    pub fn primary(&self) -> Option<usize> {
        let mut votes: HashMap<String, usize> = HashMap::new();
        for s in &self.sentinels {
            if let Some(port) = s.master_info().and_then(|m| m.get("port").cloned()) {
                *votes.entry(port).or_default() += 1;
            }
        }
        let (port, n) = votes.into_iter().max_by_key(|(_, n)| *n)?;
        if n <= self.sentinels.len() / 2 {
            return None;
        }
        let i = self
            .nodes
            .iter()
            .position(|node| node.port().to_string() == port)?;
        self.role(i).filter(|role| role == "master").map(|_| i)
    }

    /// The role a node reports (`master`, `slave`), if it answers.
    pub fn role(&self, node: usize) -> Option<String> {
        let client = redis::Client::open(self.nodes[node].url()).ok()?;
        let mut c = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .ok()?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut c).ok()?;
        match role.first()? {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// Waits until the sentinels name a primary other than `node`, and it says it is
    /// the primary; returns its index.
    pub fn wait_failover_from(&self, node: usize, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(p) = self.primary().filter(|p| *p != node) {
                return Ok(p);
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(format!(
                    "no failover within {timeout:?}; sentinel log:\n{}",
                    self.sentinels[0].log()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until `replica` has applied the replication stream up to `offset` (the
    /// primary's `master_repl_offset`, read before).
    pub fn wait_replicated(&self, replica: usize, offset: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let applied = self.nodes[replica]
                .query_text(redis::cmd("INFO").arg("replication"))
                .and_then(|info| {
                    info.lines()
                        .find_map(|l| l.strip_prefix("slave_repl_offset:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                });
            if applied.is_some_and(|a| a >= offset) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(format!(
                    "the replica did not catch up within {timeout:?} ({applied:?} < {offset})"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The `master_repl_offset` of `node`.
    pub fn repl_offset(&self, node: usize) -> Option<u64> {
        self.nodes[node]
            .query_text(redis::cmd("INFO").arg("replication"))?
            .lines()
            .find_map(|l| l.strip_prefix("master_repl_offset:"))?
            .trim()
            .parse()
            .ok()
    }

    /// The `run_id` of `node` (INFO server).
    pub fn run_id(&self, node: usize) -> Option<String> {
        Some(
            self.nodes[node]
                .query_text(redis::cmd("INFO").arg("server"))?
                .lines()
                .find_map(|l| l.strip_prefix("run_id:"))?
                .trim()
                .to_owned(),
        )
    }

    /// Every sentinel's log, for failure messages.
    pub fn logs(&self) -> String {
        self.sentinels
            .iter()
            .enumerate()
            .map(|(i, s)| format!("--- sentinel {i} (port {}) ---\n{}", s.port(), s.log()))
            .collect()
    }

    fn wait_ready(&self, replicas: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let others = (self.sentinels.len() - 1).to_string();
        let replicas = replicas.to_string();
        loop {
            let ready = self.sentinels.iter().all(|s| {
                s.master_info().is_some_and(|m| {
                    m.get("num-other-sentinels") == Some(&others)
                        && m.get("num-slaves") == Some(&replicas)
                        && m.get("flags").map(String::as_str) == Some("master")
                })
            });
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::LocalRedis(format!(
                    "the sentinels did not find each other and the replicas within {timeout:?}\n{}",
                    self.logs()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
