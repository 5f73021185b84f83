//! The Redis the demo and the benchmark run on: the configured one if it answers, or a
//! private one they start (a `redis-server`, or a local Redis Cluster) and stop at the end.

use std::time::Duration;

use registry_janitor::{
    config::Settings,
    conn,
    error::{Error, Result},
};
use registry_janitor_testkit::{RedisCluster, RedisServer};

/// Keeps a private Redis (node or cluster) alive for the demo's or the benchmark's
/// duration.
#[allow(dead_code)] // the fields are held for their Drop (which stops the servers)
pub(crate) enum Private {
    Node(Option<RedisServer>),
    Cluster(RedisCluster),
}

/// The shape of a private local cluster: masters, and replicas of each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClusterShape {
    pub masters: usize,
    pub replicas: usize,
}

impl ClusterShape {
    /// 3 masters, no replicas.
    pub const SMALL: ClusterShape = ClusterShape {
        masters: 3,
        replicas: 0,
    };
}

/// The Redis the demo or the benchmark runs on: a private local cluster of
/// `local_cluster`'s shape; the configured cluster or Sentinel group; else the configured
/// node if it answers, or a private `redis-server` (kept alive by the returned guard).
pub(crate) async fn redis_for(
    settings: &Settings,
    local_cluster: Option<ClusterShape>,
) -> Result<(Settings, Private)> {
    if let Some(shape) = local_cluster {
        if !RedisServer::available() {
            return Err(Error::LocalRedis(format!(
                "--local-cluster starts redis-server processes, and redis-server is not on PATH:\n{INSTALL_REDIS}"
            )));
        }
        // A node timeout long enough that a machine busy with the benchmark never makes
        // the cluster fail a node over.
        let cluster = tokio::task::spawn_blocking(move || {
            RedisCluster::start_with(shape.masters, shape.replicas, || {
                vec!["--cluster-node-timeout".to_owned(), "15000".to_owned()]
            })
        })
        .await?
        .map_err(local)?;
        eprintln!(
            "started a private Redis Cluster of {} masters with {} replicas each on this machine: {:?}",
            shape.masters,
            shape.replicas,
            cluster.seeds()
        );
        let mut settings = settings.clone();
        settings.redis_cluster = true;
        settings.redis_url = cluster.url();
        settings.redis_cluster_seeds = cluster.seeds();
        return Ok((settings, Private::Cluster(cluster)));
    }
    if settings.redis_cluster || settings.uses_sentinel() {
        eprintln!("using the Redis at {}", conn::describe(settings));
        return Ok((settings.clone(), Private::Node(None)));
    }
    let (url, private) = find_redis(&settings.redis_url).await?;
    let mut settings = settings.clone();
    settings.redis_url = url;
    Ok((settings, Private::Node(private)))
}

/// Uses the Redis at `url` if it answers; otherwise starts a private one.
async fn find_redis(url: &str) -> Result<(String, Option<RedisServer>)> {
    let client = conn::client(url)?;
    let ping = tokio::time::timeout(Duration::from_secs(2), async {
        let mut c = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut c).await
    })
    .await;
    if matches!(ping, Ok(Ok(_))) {
        eprintln!("using the Redis at {}", conn::redact_url(url));
        return Ok((url.to_owned(), None));
    }
    if !RedisServer::available() {
        return Err(Error::LocalRedis(format!(
            "no Redis answers at {} and redis-server is not on PATH. Point --redis-url \
             (or JANITOR_REDIS_URL) at a Redis, or install redis-server:\n{INSTALL_REDIS}",
            conn::redact_url(url)
        )));
    }
    let server = tokio::task::spawn_blocking(RedisServer::start)
        .await?
        .map_err(local)?;
    eprintln!(
        "no Redis answers at {}; started a private redis-server on 127.0.0.1:{} (stopped at the end)",
        conn::redact_url(url),
        server.port()
    );
    Ok((server.url(), Some(server)))
}

/// How to install redis-server on the common systems, for a user who has none.
const INSTALL_REDIS: &str = "  Debian/Ubuntu: sudo apt-get install redis-server
  Fedora/RHEL:   sudo dnf install redis
  macOS:         brew install redis
  Alpine:        apk add redis
  Arch:          pacman -S redis";

/// Starts a private `redis-server` on a free port.
pub(crate) async fn start_server() -> Result<RedisServer> {
    tokio::task::spawn_blocking(RedisServer::start)
        .await?
        .map_err(local)
}

/// A failure of a private Redis, as the library's error.
fn local(e: registry_janitor_testkit::Error) -> Error {
    use registry_janitor_testkit::Error as Local;
    match e {
        Local::LocalRedis(what) => Error::LocalRedis(what),
        Local::Io { context, source } => Error::io(context, source),
        Local::Redis(e) => Error::Redis(e),
    }
}
