//! Connections to Redis.
//!
//! Two kinds, because a blocking command on a multiplexed connection stalls every other
//! command on it:
//! - [`shared`]: one auto-reconnecting multiplexed connection for all short commands
//!   (scripts, XACK, XADD...), cloned freely between tasks;
//! - [`blocking`]: a connection of its own for XREADGROUP BLOCK, whose response timeout
//!   is longer than the BLOCK time (redis-rs times out responses after 500 ms by default).
//!
//! Both are created lazily: a worker starts while Redis is down and its retry loops
//! connect when Redis comes back.
//!
//! With `redis_cluster = true` both are cluster connections instead ([`RedisConn`] is
//! either): commands are routed by slot, and the code that touches several keys at once
//! (scripts, MULTI, pipelines) takes the cluster's one-slot rule into account where
//! [`RedisConn::is_cluster`] says so.
//!
//! With `redis_sentinels` both are [`SentinelConn`]s: one node, the primary the sentinels
//! name, found again through them whenever it fails or answers READONLY (see
//! `sentinel.rs`).

use std::time::Duration;

use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    IntoConnectionInfo, RedisFuture,
};

use crate::{
    config::Settings,
    error::{Error, Result},
};

mod cluster;
mod cluster_conn;
mod commands;
mod sentinel;
pub use cluster::{
    cluster_epoch, cluster_masters, key_slot, node_client, wait_replicated, Replicated, SlotOwners,
};
pub use cluster_conn::{ClusterConn, REBUILD_AFTER};
pub use commands::{delete_prefixed, each_in_flight, each_reply_in_flight, scan_page, transaction};
pub use sentinel::{SentinelConn, SentinelTarget};

/// Longest a short command may take before it counts as failed (and is retried).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for `url` alone (no password override, no certificate files).
pub fn client(url: &str) -> Result<redis::Client> {
    install_crypto_provider();
    Ok(redis::Client::open(url)?)
}

/// The client the settings describe: `redis_url`, the password from `redis_password_file`
/// or `redis_password` if set, and the TLS files for a `rediss://` URL.
pub fn client_for(settings: &Settings) -> Result<redis::Client> {
    install_crypto_provider();
    client_with(connection_info(settings)?, tls_certificates(settings)?)
}

/// A client for `info`, with `certs` (the settings' TLS files) if any.
fn client_with(
    info: redis::ConnectionInfo,
    certs: Option<redis::TlsCertificates>,
) -> Result<redis::Client> {
    let Some(certs) = certs else {
        return Ok(redis::Client::open(info)?);
    };
    redis::Client::build_with_tls(info, certs).map_err(|e| Error::Setting {
        name: "tls_ca_file".into(),
        reason: format!("the TLS certificates could not be used: {e}"),
    })
}

/// The TLS files of the settings (CA, client certificate and key), if any is set.
fn tls_certificates(settings: &Settings) -> Result<Option<redis::TlsCertificates>> {
    let read = |name: &'static str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| Error::Setting {
            name: name.into(),
            reason: format!("cannot read {}: {e}", path.display()),
        })
    };
    let root_cert = settings
        .tls_ca_file
        .as_deref()
        .map(|p| read("tls_ca_file", p))
        .transpose()?;
    let client_tls = match (&settings.tls_cert_file, &settings.tls_key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("tls_cert_file", cert)?,
            client_key: read("tls_key_file", key)?,
        }),
        _ => None,
    };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(None);
    }
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// `redis_url` with the password from `redis_password_file` or `redis_password`, if set.
fn connection_info(settings: &Settings) -> Result<redis::ConnectionInfo> {
    let info = settings.redis_url.as_str().into_connection_info()?;
    Ok(match settings.redis_password()? {
        Some(password) => {
            let redis = info
                .redis_settings()
                .clone()
                .set_password(password.expose());
            info.set_redis_settings(redis)
        }
        None => info,
    })
}

/// rustls needs a process-wide crypto provider before the first `rediss://` connection.
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn config(response_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_response_timeout(Some(response_timeout))
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(2))
        .set_number_of_retries(2)
}

/// A connection to one Redis node, to a Redis Cluster, or to the primary that Redis
/// Sentinel names. Cheap to clone: clones share the underlying multiplexed connection.
///
/// On a cluster it also holds the slot map as this process last read it
/// ([`RedisConn::slot_owners`]), shared by the clones, and the connection is built again
/// when it stops answering ([`ClusterConn`]).
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(
        std::sync::Arc<ClusterConn>,
        std::sync::Arc<cluster::SlotCache>,
    ),
    Sentinel(SentinelConn),
}

impl RedisConn {
    /// True on a Redis Cluster: multi-key commands, scripts and pipelines must stay in
    /// one slot there.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(..))
    }

    /// A connection to the cluster behind `conn`, with an empty slot map.
    fn cluster(conn: ClusterConn) -> Self {
        RedisConn::Cluster(std::sync::Arc::new(conn), Default::default())
    }

    /// On a cluster, how many times the connection was built again after it stopped
    /// answering ([`ClusterConn`]); 0 elsewhere.
    pub fn rebuilds(&self) -> u64 {
        match self {
            RedisConn::Cluster(c, _) => c.rebuilds(),
            _ => 0,
        }
    }

    /// On a cluster, builds the connection again now, with a fresh slot map, for `why`;
    /// nothing elsewhere.
    pub async fn rebuild_now(&self, why: &str) {
        if let RedisConn::Cluster(c, _) = self {
            c.rebuild_now(why).await;
        }
    }

    /// On a cluster, which master serves each slot: read with CLUSTER SLOTS when first
    /// asked for, or after [`RedisConn::forget_slot_owners`], and kept meanwhile. It
    /// may be out of date (a reshard, a failover), so it serves to group keys by node,
    /// never to decide where a key is: whoever uses it must cope with a node that no
    /// longer serves a key. `None` on one node.
    pub async fn slot_owners(&self) -> Result<Option<std::sync::Arc<SlotOwners>>> {
        let RedisConn::Cluster(_, cache) = self else {
            return Ok(None);
        };
        if let Some(owners) = cache.get() {
            return Ok(Some(owners));
        }
        let owners = std::sync::Arc::new(cluster::read_slot_owners(self).await?);
        cache.set(owners.clone());
        Ok(Some(owners))
    }

    /// The slot map is out of date (a node answered for keys it no longer serves): the
    /// next [`RedisConn::slot_owners`] reads it again.
    pub fn forget_slot_owners(&self) {
        if let RedisConn::Cluster(_, cache) = self {
            cache.forget();
        }
    }

    /// On a cluster, runs `pipe` (of `count` commands) on the master that serves `slot`
    /// (by redis-rs's own slot map), whatever keys it names; elsewhere, on the one node.
    /// The replies are returned as they came, server errors included.
    pub async fn pipeline_on_master_of(
        &self,
        slot: u16,
        pipe: redis::Pipeline,
        count: usize,
    ) -> Result<Vec<redis::Value>> {
        use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
        match self {
            RedisConn::Cluster(c, _) => {
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                let (mut conn, generation) = c.current();
                let result = conn.route_pipeline(pipe, 0, count, route).await;
                c.observe(generation, &result).await;
                Ok(result?)
            }
            _ => Ok(pipe.query_async(&mut self.clone()).await?),
        }
    }

    /// On a cluster, runs `cmd` on the master that serves `slot` (by redis-rs's own slot
    /// map), whatever keys `cmd` names; elsewhere, on the one node.
    pub async fn on_master_of(&self, slot: u16, cmd: redis::Cmd) -> Result<redis::Value> {
        use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
        match self {
            RedisConn::Cluster(c, _) => {
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::new(slot, SlotAddr::Master),
                ));
                let (mut conn, generation) = c.current();
                let result = conn.route_command(cmd, route).await;
                c.observe(generation, &result).await;
                // A server error comes back as a value here: made an error again.
                Ok(result?.extract_error()?)
            }
            _ => Ok(cmd.query_async(&mut self.clone()).await?),
        }
    }
}

impl redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, redis::Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c, _) => c.req_packed_command(cmd),
            RedisConn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<redis::Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(c, _) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c, _) => c.get_db(),
            RedisConn::Sentinel(c) => c.get_db(),
        }
    }
}

/// Where to connect: one node, the seed nodes of a cluster, or the sentinels.
#[derive(Clone)]
// Built once at start-up: the size difference of the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Target {
    Single(redis::Client),
    Cluster(ClusterTarget),
    Sentinel(SentinelTarget),
}

/// What a cluster connection is built from: the seed nodes, the password and the TLS
/// certificates. Each kind of connection gets a client of its own, with its own response
/// timeout ([`shared_for`], [`blocking_for`]).
#[derive(Clone)]
pub struct ClusterTarget {
    seeds: Vec<String>,
    password: Option<String>,
    certs: Option<redis::TlsCertificates>,
}

impl ClusterTarget {
    /// A client whose every attempt waits at most `response_timeout` for its reply, and
    /// whose every request, its redirections and retries included, at most that plus
    /// [`COMMAND_TIMEOUT`].
    fn client(
        &self,
        response_timeout: Duration,
    ) -> redis::RedisResult<redis::cluster::ClusterClient> {
        let mut builder = redis::cluster::ClusterClientBuilder::new(self.seeds.clone())
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(response_timeout)
            .overall_response_timeout(Some(response_timeout + COMMAND_TIMEOUT))
            .retries(6);
        if let Some(password) = &self.password {
            builder = builder.password(password);
        }
        if let Some(certs) = &self.certs {
            builder = builder.certs(certs.clone());
        }
        builder.build()
    }

    /// A connection whose commands wait at most `response_timeout` for a reply.
    async fn connect(&self, response_timeout: Duration) -> Result<ClusterConn> {
        let config = redis::cluster::ClusterConfig::new()
            .set_response_timeout(response_timeout)
            .set_connection_timeout(CONNECT_TIMEOUT);
        Ok(ClusterConn::connect(self.client(response_timeout)?, config).await?)
    }
}

/// The target the settings describe (see [`client_for`]; a cluster when `redis_cluster`,
/// the sentinels' primary when `redis_sentinels`).
pub fn target_for(settings: &Settings) -> Result<Target> {
    if settings.uses_sentinel() {
        install_crypto_provider();
        return Ok(Target::Sentinel(SentinelTarget::new(
            settings,
            connection_info(settings)?,
            tls_certificates(settings)?,
        )?));
    }
    if !settings.redis_cluster {
        return Ok(Target::Single(client_for(settings)?));
    }
    install_crypto_provider();
    let mut seeds = vec![settings.redis_url.clone()];
    seeds.extend(settings.redis_cluster_seeds.iter().cloned());
    let target = ClusterTarget {
        seeds,
        password: settings
            .redis_password()?
            .map(|password| password.expose().to_string()),
        certs: tls_certificates(settings)?,
    };
    // Built once here so that unusable settings stop start-up.
    target.client(COMMAND_TIMEOUT).map_err(|e| {
        if settings.tls_ca_file.is_some() || settings.tls_cert_file.is_some() {
            Error::Setting {
                name: "tls_ca_file".into(),
                reason: format!("the TLS certificates could not be used: {e}"),
            }
        } else {
            e.into()
        }
    })?;
    Ok(Target::Cluster(target))
}

/// The shared connection for short commands.
pub async fn shared_for(target: &Target) -> Result<RedisConn> {
    match target {
        Target::Single(client) => shared(client),
        Target::Cluster(target) => Ok(RedisConn::cluster(target.connect(COMMAND_TIMEOUT).await?)),
        Target::Sentinel(target) => Ok(RedisConn::Sentinel(SentinelConn::new(
            target.clone(),
            COMMAND_TIMEOUT,
        ))),
    }
}

/// A dedicated connection for commands that block up to `block`.
pub async fn blocking_for(target: &Target, block: Duration) -> Result<RedisConn> {
    match target {
        Target::Single(client) => blocking(client, block),
        Target::Cluster(target) => Ok(RedisConn::cluster(
            target.connect(block + COMMAND_TIMEOUT).await?,
        )),
        Target::Sentinel(target) => Ok(RedisConn::Sentinel(SentinelConn::new(
            target.clone(),
            block + COMMAND_TIMEOUT,
        ))),
    }
}

/// The shared connection for short commands (one node).
pub fn shared(client: &redis::Client) -> Result<RedisConn> {
    Ok(RedisConn::Single(ConnectionManager::new_lazy_with_config(
        client.clone(),
        config(COMMAND_TIMEOUT),
    )?))
}

/// A dedicated connection for commands that block up to `block` (one node).
pub fn blocking(client: &redis::Client, block: Duration) -> Result<RedisConn> {
    Ok(RedisConn::Single(ConnectionManager::new_lazy_with_config(
        client.clone(),
        config(block + COMMAND_TIMEOUT),
    )?))
}

pub use crate::config::redact_url;

/// Where the settings point, for logs: `redis_url` (password hidden), or the sentinels
/// and the master's name.
pub fn describe(settings: &Settings) -> String {
    if !settings.uses_sentinel() {
        return redact_url(&settings.redis_url);
    }
    let sentinels: Vec<String> = settings
        .redis_sentinels
        .iter()
        .map(|u| redact_url(u))
        .collect();
    format!(
        "master {} of sentinels {}",
        settings.redis_sentinel_master.as_deref().unwrap_or(""),
        sentinels.join(",")
    )
}
