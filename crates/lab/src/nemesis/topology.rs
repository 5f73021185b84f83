//! Where the run's Redis lives, and the faults done to Redis itself.
//!
//! One node today: a private `redis-server` on a free port with its append-only file
//! fsynced on every write (a restart keeps every acknowledged write, so that a restart
//! that loses data never passes for a janitor fault), and `busy-reply-threshold` at 100 ms
//! (a long script makes every other client get BUSY soon). A Sentinel group or a cluster
//! slots in as another variant of [`Topology`], with its own faults (failovers).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use registry_janitor::{
    config::Settings,
    error::{Error, Result},
};
use registry_janitor_testkit::RedisServer;

use super::schedule::Kind;

/// The Redis of a run.
pub enum Topology {
    Node(Node),
}

impl Topology {
    /// The faults this topology takes.
    pub fn kinds(&self) -> Vec<Kind> {
        match self {
            Topology::Node(_) => Kind::NODE.to_vec(),
        }
    }

    /// `settings` pointed at this Redis.
    pub fn point(&self, settings: &mut Settings) {
        match self {
            Topology::Node(node) => {
                settings.redis_url = node.url.clone();
                settings.redis_cluster = false;
                settings.redis_cluster_seeds.clear();
                settings.redis_sentinels.clear();
                settings.redis_sentinel_master = None;
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Topology::Node(node) => format!(
                "one redis-server on 127.0.0.1:{} (appendonly, fsync always)",
                node.port
            ),
        }
    }

    /// Redis's log so far (for a violation's report).
    pub fn log(&self) -> String {
        match self {
            Topology::Node(node) => lock(&node.server).log(),
        }
    }

    /// A plain connection to the node that takes writes, for the faults' own commands.
    fn admin(&self) -> Result<redis::Client> {
        match self {
            Topology::Node(node) => Ok(redis::Client::open(node.url.as_str())?),
        }
    }

    /// SIGKILL.
    pub async fn kill_redis(&self) -> Result<()> {
        match self {
            Topology::Node(node) => {
                let server = node.server.clone();
                tokio::task::spawn_blocking(move || lock(&server).kill()).await?;
                Ok(())
            }
        }
    }

    /// Starts Redis again after [`Topology::kill_redis`], with its data.
    pub async fn restart_redis(&self) -> Result<()> {
        match self {
            Topology::Node(node) => {
                let server = node.server.clone();
                tokio::task::spawn_blocking(move || lock(&server).restart())
                    .await?
                    .map_err(|e| Error::LocalRedis(format!("restarting redis-server: {e}")))
            }
        }
    }

    /// Runs a read-only Lua busy loop for `busy`, from a client of its own: once it has
    /// run for `busy-reply-threshold`, every other command gets BUSY until it returns.
    pub async fn busy(&self, busy: Duration) -> Result<()> {
        let client = self.admin()?;
        tokio::task::spawn_blocking(move || -> Result<()> {
            let mut c = client.get_connection_with_timeout(Duration::from_secs(2))?;
            c.set_read_timeout(Some(busy + Duration::from_secs(30)))?;
            let _: i64 = redis::cmd("EVAL")
                .arg(BUSY_LOOP)
                .arg(0)
                .arg(busy.as_millis() as u64)
                .query(&mut c)?;
            Ok(())
        })
        .await?
    }

    /// Sets `maxmemory` below what Redis uses (`hard`: half of it) or just above it (64
    /// KiB of room): writes that need memory get OOM. Returns the limit set.
    pub async fn squeeze(&self, hard: bool) -> Result<u64> {
        let mut c = self.admin()?.get_multiplexed_async_connection().await?;
        let info: String = redis::cmd("INFO").arg("memory").query_async(&mut c).await?;
        let used: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(2 << 20);
        let limit = if hard {
            (used / 2).max(1)
        } else {
            used + (64 << 10)
        };
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(limit)
            .query_async(&mut c)
            .await?;
        Ok(limit)
    }

    /// No memory limit again.
    pub async fn release(&self) -> Result<()> {
        let mut c = self.admin()?.get_multiplexed_async_connection().await?;
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(0)
            .query_async(&mut c)
            .await?;
        Ok(())
    }
}

/// A busy loop on Redis's clock for `ARGV[1]` ms; reads only, so that nothing is left half
/// done if it were killed.
const BUSY_LOOP: &str = r"
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
local n = 0
while true do
  t = redis.call('TIME')
  if t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1]) * 1000 then return n end
  n = n + 1
end";

/// A private redis-server for the run.
pub struct Node {
    server: Arc<Mutex<RedisServer>>,
    url: String,
    port: u16,
}

impl Node {
    pub async fn start() -> Result<Node> {
        if !RedisServer::available() {
            return Err(Error::LocalRedis(
                "the nemesis starts its own redis-server, and redis-server is not on PATH \
                 (Debian/Ubuntu: sudo apt-get install redis-server)"
                    .into(),
            ));
        }
        let server = tokio::task::spawn_blocking(|| {
            RedisServer::start_with(&[
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--busy-reply-threshold",
                "100",
            ])
        })
        .await?
        .map_err(|e| Error::LocalRedis(format!("starting redis-server: {e}")))?;
        Ok(Node {
            url: server.url(),
            port: server.port(),
            server: Arc::new(Mutex::new(server)),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
