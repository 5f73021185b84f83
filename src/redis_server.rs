//! A private `redis-server` on a free loopback port, stopped when dropped.
//!
//! The demo and the benchmark start one when no Redis answers at `redis_url`; the tests
//! start one each, so they never depend on a Redis of the machine or on a fixed port.
//! Persistence is off and the log goes to a file in a temporary directory, so a failing
//! test can show it.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::error::{Error, Result};

/// A running `redis-server` child process.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    /// Holds the log file (and nothing else: no persistence); removed on drop.
    dir: tempfile::TempDir,
    /// Extra `redis-server` arguments, kept so a restart brings back the same server.
    args: Vec<String>,
}

impl RedisServer {
    /// True when `redis-server` can be run from PATH.
    pub fn available() -> bool {
        Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts a server with default options.
    pub fn start() -> Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a server with extra arguments, e.g. `["--notify-keyspace-events", "Ex"]`.
    pub fn start_with(args: &[&str]) -> Result<Self> {
        let mut dir = tempfile::tempdir().map_err(|e| Error::io("creating a temporary dir", e))?;
        let mut last_error = None;
        // A port found free can be taken by someone else before redis-server binds it.
        for _ in 0..5 {
            let port = free_port()?;
            let mut server = RedisServer {
                child: None,
                port,
                dir,
                args: args.iter().map(|s| s.to_string()).collect(),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(e) => {
                    last_error = Some(e);
                    dir = std::mem::replace(
                        &mut server.dir,
                        tempfile::tempdir()
                            .map_err(|e| Error::io("creating a temporary dir", e))?,
                    );
                }
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Kills the server with SIGKILL, like a crash. Its data is gone (no persistence).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, after [`RedisServer::kill`].
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// A command's text reply from this server over a fresh connection, or None.
    fn query_text(&self, cmd: &redis::Cmd) -> Option<String> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut c = client
            .get_connection_with_timeout(Duration::from_millis(200))
            .ok()?;
        cmd.query(&mut c).ok()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    fn spawn(&mut self) -> Result<()> {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log_path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting redis-server (is it installed?)", e))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = redis::Client::open(self.url())?;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(Error::Protocol(format!(
                    "redis-server exited with {status} at start; log:\n{}",
                    self.log()
                )));
            }
            let pong = client
                .get_connection_with_timeout(Duration::from_millis(200))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            // A server started with --requirepass answers, with NOAUTH: it is up.
            if pong.is_ok() || pong.as_ref().is_err_and(|e| e.code() == Some("NOAUTH")) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(Error::Protocol(format!(
                    "redis-server did not answer within 10 s; log:\n{}",
                    self.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> Result<u16> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("finding a free port", e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("finding a free port", e))
}

/// A local Redis Cluster of `redis-server` processes on free ports (for tests and for
/// trying cluster mode on one machine), stopped when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// True when `redis-server` can run in cluster mode and `redis-cli` can create one.
    pub fn supported() -> bool {
        let cli = Command::new("redis-cli")
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
            .map(|_| RedisServer::start_with(&args))
            .collect::<Result<Vec<_>>>()?;
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .map_err(|e| Error::io("running redis-cli --cluster create", e))?;
        if !out.status.success() {
            return Err(Error::Protocol(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
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
                        fields.get(2).is_some_and(|flags| flags.contains("fail"))
                            && fields.len() > 8
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
                return Err(Error::Protocol(
                    "the cluster did not become healthy in time".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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
