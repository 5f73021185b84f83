//! Where the run's Redis lives, and the faults done to Redis itself.
//!
//! - [`Node`]: a private `redis-server` on a free port with its append-only file fsynced
//!   on every write (a restart keeps every acknowledged write, so that a restart that
//!   loses data never passes for a janitor fault), and `busy-reply-threshold` at 100 ms
//!   (a long script makes every other client get BUSY soon). Where the run makes
//!   partitions it listens on the host ends of the janitor processes' network
//!   namespaces too, with `protected-mode no` (see [`super::netns`]).
//! - [`Group`]: a private Sentinel group, a primary, two replicas and three sentinels
//!   (`down-after-milliseconds` 5000). Its failover ([`Topology::failover`]) loses no
//!   write the primary acknowledged: the primary's clients are paused for writes
//!   (`CLIENT PAUSE WRITE`), the replicas catch up to its replication offset, and only
//!   then is it SIGKILLed. A write Redis acknowledged and lost on a failover would be
//!   Redis's doing (asynchronous replication), not the janitor's: with none lost, every
//!   invariant stays as strict as on one node. The old primary starts again as a replica
//!   of the new one, so that it never takes a write with its old data.
//!
//! - [`Cluster`]: a private Redis Cluster, three masters with a replica each; its
//!   failovers lose no write a master acknowledged either (see [`super::cluster`]).

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use registry_janitor::{
    config::Settings,
    error::{Error, Result},
};
use registry_janitor_testkit::{RedisSentinels, RedisServer, MASTER_NAME};

use tokio_util::sync::CancellationToken;

pub use super::cluster::Cluster;
use super::{schedule::Kind, verdicts::Verdicts};

/// The Redis of a run.
pub enum Topology {
    Node(Node),
    Sentinel(Group),
    Cluster(Cluster),
}

impl Topology {
    /// The faults this topology takes.
    pub fn kinds(&self) -> Vec<Kind> {
        match self {
            Topology::Node(_) => Kind::NODE.to_vec(),
            Topology::Sentinel(_) => Kind::SENTINEL.to_vec(),
            Topology::Cluster(_) => Kind::CLUSTER.to_vec(),
        }
    }

    /// The URL of this Redis at `addr` instead of 127.0.0.1 (one node only).
    pub fn url_at(&self, addr: std::net::Ipv4Addr) -> Option<String> {
        match self {
            Topology::Node(node) => Some(format!("redis://{addr}:{}", node.port)),
            _ => None,
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
            Topology::Sentinel(group) => {
                // Behind Sentinel, `redis_url` gives credentials and database only: a
                // port where nothing listens shows that its host and port are not used.
                settings.redis_url = "redis://127.0.0.1:1/0".into();
                settings.redis_cluster = false;
                settings.redis_cluster_seeds.clear();
                settings.redis_sentinels = group.sentinel_urls.clone();
                settings.redis_sentinel_master = Some(MASTER_NAME.into());
            }
            Topology::Cluster(cluster) => {
                let seeds = cluster.seeds();
                settings.redis_url = seeds[0].clone();
                settings.redis_cluster = true;
                settings.redis_cluster_seeds = seeds[1..].to_vec();
                settings.redis_sentinels.clear();
                settings.redis_sentinel_master = None;
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Topology::Node(node) if node.also_on.is_empty() => format!(
                "one redis-server on 127.0.0.1:{} (appendonly, fsync always)",
                node.port
            ),
            Topology::Node(node) => format!(
                "one redis-server on 127.0.0.1:{} and {} more addresses (appendonly, fsync \
                 always)",
                node.port,
                node.also_on.len()
            ),
            Topology::Sentinel(group) => {
                let ports = |p: &[u16]| {
                    p.iter()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                format!(
                    "a Sentinel group: redis-servers on 127.0.0.1 ports {} (the first the \
                     primary at the start), sentinels on {}, down-after {} s",
                    ports(&group.node_ports),
                    ports(&group.sentinel_ports),
                    DOWN_AFTER.as_secs()
                )
            }
            Topology::Cluster(cluster) => cluster.describe(),
        }
    }

    /// Redis's log so far (for a violation's report).
    pub fn log(&self) -> String {
        match self {
            Topology::Node(node) => lock(&node.server).log(),
            Topology::Sentinel(group) => {
                let g = lock(&group.group);
                let mut out = String::new();
                for (i, node) in g.nodes.iter().enumerate() {
                    out.push_str(&format!(
                        "--- redis-server node-{i} (port {}) ---\n{}",
                        node.port(),
                        node.log()
                    ));
                }
                out.push_str(&g.logs());
                out
            }
            Topology::Cluster(cluster) => cluster.log(),
        }
    }

    /// A line on what was done to Redis, for the summary (None on one node: the
    /// faults' own counts say it all).
    pub fn summary(&self) -> Option<String> {
        match self {
            Topology::Node(_) => None,
            Topology::Cluster(cluster) => Some(cluster.summary()),
            Topology::Sentinel(group) => {
                let f = lock(&group.failovers);
                if f.promoted.is_empty() && f.given_up == 0 && f.no_promotion == 0 {
                    return Some("0 failovers".into());
                }
                Some(format!(
                    "{} failovers: writes paused {} until the replicas held them all, a \
                     replica promoted {} after the SIGKILL, the old primary in sync as a \
                     replica {} after its start ({} not in sync within {} s); {} given up \
                     (replicas behind), {} with no promotion within {} s",
                    f.promoted.len(),
                    span(&f.paused),
                    span(&f.promoted),
                    span(&f.synced),
                    f.not_synced,
                    RESYNC.as_secs(),
                    f.given_up,
                    f.no_promotion,
                    FAILOVER.as_secs()
                ))
            }
        }
    }

    /// A plain connection to the node that takes writes, for the faults' own commands
    /// (on a cluster, to the `master`-th master: see [`Cluster::pick_master`]); and its
    /// name, for the schedule's notes.
    async fn admin(&self, master: Option<u32>) -> Result<(redis::Client, String)> {
        if let Topology::Cluster(cluster) = self {
            let i = cluster
                .pick_master(master.unwrap_or(0))
                .await
                .ok_or_else(|| Error::LocalRedis("no master answers now".into()))?;
            return Ok((cluster.client(i)?, format!("node-{i}")));
        }
        let client = match self {
            Topology::Node(node) => redis::Client::open(node.url.as_str())?,
            Topology::Sentinel(group) => {
                let i = group
                    .primary()
                    .await
                    .ok_or_else(|| Error::LocalRedis("the sentinels name no primary now".into()))?;
                redis::Client::open(group.node_url(i))?
            }
            Topology::Cluster(_) => unreachable!("handled above"),
        };
        Ok((client, "redis".into()))
    }

    /// SIGKILL.
    pub async fn kill_redis(&self) -> Result<()> {
        match self {
            Topology::Node(node) => {
                let server = node.server.clone();
                tokio::task::spawn_blocking(move || lock(&server).kill()).await?;
                Ok(())
            }
            Topology::Sentinel(_) | Topology::Cluster(_) => Err(no_such_fault("redis-restart")),
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
            Topology::Sentinel(_) | Topology::Cluster(_) => Err(no_such_fault("redis-restart")),
        }
    }

    /// A failover that loses no acknowledged write: see [`Group::failover`]. Says what
    /// happened.
    pub async fn failover(&self, down: Duration) -> Result<String> {
        match self {
            Topology::Sentinel(group) => group.failover(down).await,
            _ => Err(no_such_fault("sentinel-failover")),
        }
    }

    /// A cluster failover of the `master`-th master that loses no acknowledged write: by
    /// SIGKILL, the old master back after `down` ([`Cluster::failover`]), or with `down`
    /// None by `CLUSTER FAILOVER` on its replica ([`Cluster::manual_failover`]). Says
    /// what happened.
    pub async fn cluster_failover(&self, master: u32, down: Option<Duration>) -> Result<String> {
        match (self, down) {
            (Topology::Cluster(cluster), Some(down)) => cluster.failover(master, down).await,
            (Topology::Cluster(cluster), None) => cluster.manual_failover(master).await,
            _ => Err(no_such_fault("cluster-failover")),
        }
    }

    /// Runs a read-only Lua busy loop for `busy`, from a client of its own: once it has
    /// run for `busy-reply-threshold`, every other command gets BUSY until it returns.
    /// Says where it ran.
    pub async fn busy(&self, busy: Duration, master: Option<u32>) -> Result<String> {
        let (client, name) = self.admin(master).await?;
        tokio::task::spawn_blocking(move || -> Result<String> {
            let mut c = client.get_connection_with_timeout(Duration::from_secs(2))?;
            c.set_read_timeout(Some(busy + Duration::from_secs(30)))?;
            let _: i64 = redis::cmd("EVAL")
                .arg(BUSY_LOOP)
                .arg(0)
                .arg(busy.as_millis() as u64)
                .query(&mut c)?;
            Ok(name)
        })
        .await?
    }

    /// Sets `maxmemory` below what Redis uses (`hard`: half of it) or just above it (64
    /// KiB of room): writes that need memory get OOM. Returns the limit set, and where.
    pub async fn squeeze(&self, hard: bool, master: Option<u32>) -> Result<(u64, String)> {
        let (client, name) = self.admin(master).await?;
        let mut c = client.get_multiplexed_async_connection().await?;
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
        Ok((limit, name))
    }

    /// No memory limit again (on every node of a Sentinel group: a limit must not
    /// outlive a change of primary; a node that is down comes back with none).
    pub async fn release(&self) -> Result<()> {
        if let Topology::Cluster(cluster) = self {
            return cluster.release().await;
        }
        if let Topology::Sentinel(group) = self {
            for &port in &group.node_ports {
                let _ = no_limit(redis::Client::open(url(port))?).await;
            }
        }
        no_limit(self.admin(None).await?.0).await
    }
}

pub(super) async fn no_limit(client: redis::Client) -> Result<()> {
    let mut c = client.get_multiplexed_async_connection().await?;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query_async(&mut c)
        .await?;
    Ok(())
}

fn no_such_fault(name: &str) -> Error {
    Error::LocalRedis(format!("this topology takes no {name}"))
}

pub(super) fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

/// A busy loop on Redis's clock for `ARGV[1]` ms; reads only, so that nothing is left half
/// done if it were killed.
/// Every Redis of the nemesis: its append-only file fsynced at every write (a restart
/// loses nothing acknowledged), and BUSY replies to other clients 100 ms into a script.
pub(super) const DURABLE: [&str; 6] = [
    "--appendonly",
    "yes",
    "--appendfsync",
    "always",
    "--busy-reply-threshold",
    "100",
];

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
    /// The addresses it listens on besides 127.0.0.1.
    also_on: Vec<std::net::Ipv4Addr>,
}

impl Node {
    /// Starts the node, listening on 127.0.0.1 and on `also_on` (kept across restarts).
    pub async fn start(also_on: &[std::net::Ipv4Addr]) -> Result<Node> {
        if !RedisServer::available() {
            return Err(Error::LocalRedis(
                "the nemesis starts its own redis-server, and redis-server is not on PATH \
                 (Debian/Ubuntu: sudo apt-get install redis-server)"
                    .into(),
            ));
        }
        let mut args: Vec<String> = DURABLE.map(String::from).to_vec();
        if !also_on.is_empty() {
            // The last `--bind` is the one Redis takes; clients from the namespaces come
            // from addresses other than the loopback, which protected mode would refuse.
            args.extend(["--protected-mode".into(), "no".into(), "--bind".into()]);
            args.push("127.0.0.1".into());
            args.extend(also_on.iter().map(|a| a.to_string()));
        }
        let server = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            RedisServer::start_with(&args)
        })
        .await?
        .map_err(|e| Error::LocalRedis(format!("starting redis-server: {e}")))?;
        Ok(Node {
            url: server.url(),
            port: server.port(),
            server: Arc::new(Mutex::new(server)),
            also_on: also_on.to_vec(),
        })
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A private Sentinel group for the run: a primary and two replicas (each with its
/// append-only file fsynced on every write, `busy-reply-threshold` 100 ms), and three
/// sentinels.
pub struct Group {
    group: Arc<Mutex<RedisSentinels>>,
    sentinel_urls: Vec<String>,
    node_ports: Vec<u16>,
    sentinel_ports: Vec<u16>,
    failovers: Mutex<Failovers>,
    /// The sentinels' configuration epoch as last seen, and the nemesis's own failover
    /// under way: [`Group::watch`] tells a failover the sentinels decided by themselves.
    epochs: Mutex<Epochs>,
}

/// Every failover the sentinels make moves the master's `config-epoch`; one of the
/// nemesis's failovers moves it once.
#[derive(Default)]
pub(super) struct Epochs {
    /// The last `config-epoch` seen.
    pub(super) seen: u64,
    /// While a failover of the nemesis is under way: whether the change it makes was
    /// seen already.
    pub(super) ours: Option<bool>,
}

impl Epochs {
    /// `epoch` was read now; true if it is a change that no failover of the nemesis
    /// explains.
    pub(super) fn saw(&mut self, epoch: u64) -> bool {
        if epoch == self.seen {
            return false;
        }
        self.seen = epoch;
        match &mut self.ours {
            Some(seen @ false) => {
                *seen = true;
                false
            }
            _ => true,
        }
    }
}

/// What the failovers of a run did, for the summary.
#[derive(Default)]
struct Failovers {
    /// How long the primary's writes were paused until its replicas held them all.
    paused: Vec<Duration>,
    /// From the SIGKILL to a promoted replica that says it is the primary.
    promoted: Vec<Duration>,
    /// From the old primary's start as a replica to its link up.
    synced: Vec<Duration>,
    not_synced: usize,
    /// Given up: the replicas did not catch up in time (nothing was killed).
    given_up: usize,
    /// The sentinels promoted no replica in time.
    no_promotion: usize,
}

pub(super) fn span(d: &[Duration]) -> String {
    let min = d.iter().min().copied().unwrap_or_default();
    let max = d.iter().max().copied().unwrap_or_default();
    format!("{:.2}-{:.2}s", min.as_secs_f64(), max.as_secs_f64())
}

/// The sentinels' `down-after-milliseconds`: long enough that a sentinel starved for a
/// second does not take a primary for down and fail it over by itself (at 1 s, one
/// starved right after a failover fails the newly promoted primary over too, and the
/// writes that primary takes until its demotion are lost), short enough for a failover
/// every few seconds.
const DOWN_AFTER: Duration = Duration::from_secs(5);
/// How long the replicas may take to catch up with a paused primary (or master) before
/// the failover is given up (and its clients resumed).
pub(super) const CATCH_UP: Duration = Duration::from_secs(15);
/// How long the sentinels may take to promote a replica.
const FAILOVER: Duration = Duration::from_secs(60);
/// How long the old primary, back as a replica, may take to sync.
const RESYNC: Duration = Duration::from_secs(30);

impl Group {
    pub async fn start() -> Result<Group> {
        if !RedisSentinels::supported() {
            return Err(Error::LocalRedis(
                "the nemesis starts its own Sentinel group, and redis-server is not on PATH \
                 (Debian/Ubuntu: sudo apt-get install redis-server)"
                    .into(),
            ));
        }
        let group = tokio::task::spawn_blocking(|| {
            RedisSentinels::start_with_down_after(2, 3, &DURABLE, DOWN_AFTER)
        })
        .await?
        .map_err(|e| Error::LocalRedis(format!("starting the Sentinel group: {e}")))?;
        Ok(Group {
            sentinel_urls: group.sentinel_urls(),
            node_ports: group.nodes.iter().map(RedisServer::port).collect(),
            sentinel_ports: group.sentinels.iter().map(|s| s.port()).collect(),
            group: Arc::new(Mutex::new(group)),
            failovers: Mutex::default(),
            epochs: Mutex::default(),
        })
    }

    fn node_url(&self, i: usize) -> String {
        url(self.node_ports[i])
    }

    /// The node a majority of the sentinels name as the primary, and that says so.
    async fn primary(&self) -> Option<usize> {
        let group = self.group.clone();
        tokio::task::spawn_blocking(move || lock(&group).primary())
            .await
            .ok()
            .flatten()
    }

    /// Fails the primary over, losing no write it acknowledged:
    /// 1. `CLIENT PAUSE WRITE` on the primary: it takes no write from now on (the
    ///    clients' writes wait, and fail when it dies: never acknowledged);
    /// 2. every replica has applied the primary's replication stream up to its
    ///    `master_repl_offset` (otherwise, after [`CATCH_UP`], the primary's clients are
    ///    resumed and the fault is skipped);
    /// 3. SIGKILL the primary; the sentinels promote a replica (which holds every
    ///    acknowledged write, whichever they pick);
    /// 4. `down` after the kill, and not before the failover is done, the old primary
    ///    starts again as a replica of the new one (with `--replicaof`: it never takes a
    ///    write with its old data).
    async fn failover(&self, down: Duration) -> Result<String> {
        lock(&self.epochs).ours = Some(false);
        let done = self.failover_steps(down).await;
        // The change this failover made, if the watch has not seen it yet.
        let now = self.epoch().await;
        let mut epochs = lock(&self.epochs);
        if let Some(epoch) = now {
            epochs.saw(epoch);
        }
        epochs.ours = None;
        done
    }

    /// The master's `config-epoch` as a sentinel has it, and the port of the primary it
    /// names.
    async fn epoch(&self) -> Option<u64> {
        Some(self.sentinel_view().await?.0)
    }

    async fn sentinel_view(&self) -> Option<(u64, u16)> {
        for url in &self.sentinel_urls {
            let Ok(mut c) = connect(url).await else {
                continue;
            };
            let fields: redis::RedisResult<Vec<String>> = redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(MASTER_NAME)
                .query_async(&mut c)
                .await;
            let Ok(fields) = fields else {
                continue;
            };
            let get = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv[0] == name)
                    .and_then(|kv| kv.get(1))
                    .and_then(|v| v.parse().ok())
            };
            if let (Some(epoch), Some(port)) = (get("config-epoch"), get("port")) {
                return Some((epoch, port as u16));
            }
        }
        None
    }

    async fn failover_steps(&self, down: Duration) -> Result<String> {
        let Some(old) = self.primary().await else {
            return Ok("skipped: the sentinels name no primary now".into());
        };
        let primary = connect(&self.node_url(old)).await?;
        let Some((offset, waited)) =
            pause_until_caught_up(&primary, || self.caught_up(old, &primary)).await?
        else {
            lock(&self.failovers).given_up += 1;
            return Ok(format!(
                "skipped: the replicas did not catch up with node-{old} within {} s",
                CATCH_UP.as_secs()
            ));
        };
        let group = self.group.clone();
        tokio::task::spawn_blocking(move || lock(&group).nodes[old].kill()).await?;
        let killed = Instant::now();
        let new = loop {
            if let Some(p) = self.primary().await.filter(|&p| p != old) {
                break Some(p);
            }
            if killed.elapsed() > FAILOVER {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let promoted_after = killed.elapsed();
        lock(&self.failovers).paused.push(waited);
        tokio::time::sleep(down.saturating_sub(killed.elapsed())).await;
        let group = self.group.clone();
        let Some(new) = new else {
            // No failover: the old primary comes back as the primary, with its
            // append-only file (every write it acknowledged).
            tokio::task::spawn_blocking(move || lock(&group).nodes[old].restart())
                .await?
                .map_err(|e| Error::LocalRedis(format!("restarting node-{old}: {e}")))?;
            lock(&self.failovers).no_promotion += 1;
            return Ok(format!(
                "node-{old} (primary) SIGKILLed with its replicas at offset {offset}; the \
                 sentinels promoted no replica within {} s: it started again as the primary",
                FAILOVER.as_secs()
            ));
        };
        let port = self.node_ports[new].to_string();
        tokio::task::spawn_blocking(move || {
            lock(&group).nodes[old].restart_with(&["--replicaof", "127.0.0.1", &port])
        })
        .await?
        .map_err(|e| Error::LocalRedis(format!("restarting node-{old} as a replica: {e}")))?;
        let restarted = Instant::now();
        let mut synced = None;
        while restarted.elapsed() < RESYNC {
            let link = info(&self.node_url(old), "replication").await;
            if link.is_some_and(|i| field(&i, "master_link_status") == Some("up")) {
                synced = Some(restarted.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
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
            "node-{old} (primary) SIGKILLed once its replicas held offset {offset} ({} ms \
             paused); node-{new} promoted {:.1}s later; node-{old} back as its replica, {}",
            waited.as_millis(),
            promoted_after.as_secs_f64(),
            match synced {
                Some(t) => format!("in sync {:.1}s after its start", t.as_secs_f64()),
                None => format!("not in sync {} s after its start", RESYNC.as_secs()),
            }
        ))
    }

    /// Until `stop`: every 500 ms, reads the sentinels' configuration epoch; a change
    /// that no failover of the nemesis made is a note: the sentinels found a primary
    /// silent for `down-after-milliseconds` on their own (a starved machine) and failed
    /// it over, and such a failover loses the writes that the old primary takes until
    /// it is demoted. A violation that follows may be that loss, Redis's doing.
    pub async fn watch(&self, verdicts: Arc<Verdicts>, stop: CancellationToken) {
        if let Some(epoch) = self.epoch().await {
            lock(&self.epochs).seen = epoch;
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.cancelled() => return,
            }
            let Some((epoch, port)) = self.sentinel_view().await else {
                continue;
            };
            let before = lock(&self.epochs).seen;
            if lock(&self.epochs).saw(epoch) {
                let node = self.node_ports.iter().position(|&n| n == port);
                verdicts.note(format!(
                    "the sentinels failed over by themselves (configuration epoch \
                     {before} -> {epoch}; a sentinel names node-{}): the writes the old \
                     primary took until its demotion are lost by Redis, and a violation \
                     that follows may be that loss",
                    node.map_or("?".into(), |n| n.to_string()),
                ));
            }
        }
    }

    /// The primary's replication offset once every other node is its replica, linked,
    /// and has applied the stream up to it; None while not.
    async fn caught_up(
        &self,
        primary: usize,
        conn: &redis::aio::MultiplexedConnection,
    ) -> Option<u64> {
        let offset = master_offset(conn).await?;
        let port = self.node_ports[primary];
        for i in (0..self.node_ports.len()).filter(|&i| i != primary) {
            if !replica_holds(&self.node_url(i), port, offset).await? {
                return None;
            }
        }
        Some(offset)
    }
}

/// Pauses the writes of the node `node` is connected to (CLIENT PAUSE WRITE) until
/// `caught_up` gives the offset its replicas hold (asked every 20 ms); returns it, with
/// how long the writes were paused. After [`CATCH_UP`] without it, the node's clients are
/// resumed and `None` is returned.
pub(super) async fn pause_until_caught_up<F, Fut>(
    node: &redis::aio::MultiplexedConnection,
    mut caught_up: F,
) -> Result<Option<(u64, Duration)>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<u64>>,
{
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg((CATCH_UP + Duration::from_secs(5)).as_millis() as u64)
        .arg("WRITE")
        .query_async(&mut node.clone())
        .await?;
    let paused = Instant::now();
    loop {
        if let Some(offset) = caught_up().await {
            return Ok(Some((offset, paused.elapsed())));
        }
        if paused.elapsed() > CATCH_UP {
            let _: redis::RedisResult<()> = redis::cmd("CLIENT")
                .arg("UNPAUSE")
                .query_async(&mut node.clone())
                .await;
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The replication offset of the node `conn` is connected to (`master_repl_offset`).
pub(super) async fn master_offset(conn: &redis::aio::MultiplexedConnection) -> Option<u64> {
    let text: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn.clone())
        .await
        .ok()?;
    field(&text, "master_repl_offset")?.parse().ok()
}

/// Whether the node at `url` replicates the node on port `master_port` over a link that
/// is up and has applied its writes up to `offset`; `None` if it does not answer.
pub(super) async fn replica_holds(url: &str, master_port: u16, offset: u64) -> Option<bool> {
    let replica = info(url, "replication").await?;
    let applied: u64 = field(&replica, "slave_repl_offset")?.parse().ok()?;
    let port = master_port.to_string();
    Some(
        field(&replica, "master_port") == Some(port.as_str())
            && field(&replica, "master_link_status") == Some("up")
            && applied >= offset,
    )
}

/// A connection for the faults' own commands: 2 s to connect, 10 s for a reply.
pub(super) async fn connect(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(10)));
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await?)
}

/// `INFO <section>` of the node at `url`, or None if it does not answer.
pub(super) async fn info(url: &str, section: &str) -> Option<String> {
    let mut c = connect(url).await.ok()?;
    redis::cmd("INFO")
        .arg(section)
        .query_async(&mut c)
        .await
        .ok()
}

/// The value of `name` in an INFO text.
pub(super) fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}
