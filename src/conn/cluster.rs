//! The topology of a Redis Cluster, for what is per node rather than per slot: the masters
//! (keyspace notifications and SCAN are per node), a client for one node, and the
//! cluster's epoch (every failover bumps it).

use super::{client_with, connection_info, install_crypto_provider, tls_certificates, RedisConn};
use crate::{
    config::Settings,
    error::{Error, Result},
};

/// The masters of the cluster now, as (host, port), from CLUSTER NODES: nodes flagged
/// master, not failed, that serve slots.
pub async fn cluster_masters(conn: &RedisConn) -> Result<Vec<(String, u16)>> {
    let text: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn.clone())
        .await?;
    let mut masters: Vec<(String, u16)> = text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let flags = fields.get(2)?;
            if !flags.contains("master") || flags.contains("fail") || fields.len() <= 8 {
                return None;
            }
            let addr = fields.get(1)?.split(['@', ',']).next()?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect();
    masters.sort();
    Ok(masters)
}

/// The fewest replicas that a master serving slots has now (CLUSTER NODES: replicas
/// neither failed nor unlinked, per master). 0 when any master has none.
pub async fn cluster_min_replicas(conn: &RedisConn) -> Result<usize> {
    let text: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn.clone())
        .await?;
    let nodes: Vec<Vec<&str>> = text
        .lines()
        .map(|line| line.split(' ').collect::<Vec<_>>())
        .filter(|f| f.len() >= 8 && !f[2].contains("fail"))
        .collect();
    let fewest = nodes
        .iter()
        .filter(|f| f[2].contains("master") && f.len() > 8)
        .map(|master| {
            nodes
                .iter()
                .filter(|f| f[2].contains("slave") && f[3] == master[0] && f[7] == "connected")
                .count()
        })
        .min();
    Ok(fewest.unwrap_or(0))
}

/// WAIT on every master for the replicas it has (at most `timeout`): the writes this
/// connection made are then on the replicas too, so a failover after it cannot lose
/// them. Returns (replicas wanted, the fewest that acknowledged); (0, 0) without replicas,
/// where WAIT would only sit out its timeout. Replication stays asynchronous: a replica
/// that does not answer in time is not waited for longer (the caller says so).
pub async fn wait_replicated(
    conn: &RedisConn,
    timeout: std::time::Duration,
) -> Result<(usize, i64)> {
    let wanted = cluster_min_replicas(conn).await?;
    if wanted == 0 {
        return Ok((0, 0));
    }
    let acked: i64 = redis::cmd("WAIT")
        .arg(wanted)
        .arg(timeout.as_millis() as u64)
        .query_async(&mut conn.clone())
        .await?;
    Ok((wanted, acked))
}

/// A client for one node of the cluster, with the settings' credentials: for what is
/// per node (keyspace notifications, SCAN).
/// Over TLS (with the settings' certificate files) when `redis_url` is `rediss://`: the
/// cluster then names its nodes by their TLS ports (`tls-cluster yes`).
pub fn node_client(settings: &Settings, host: &str, port: u16) -> Result<redis::Client> {
    install_crypto_provider();
    let info = connection_info(settings)?;
    let addr = match info.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    };
    client_with(info.set_addr(addr), tls_certificates(settings)?)
}

/// The cluster's `current_epoch` (CLUSTER INFO): it grows with every failover.
pub async fn cluster_epoch(conn: &RedisConn) -> Result<u64> {
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut conn.clone())
        .await?;
    info.lines()
        .find_map(|l| l.strip_prefix("cluster_current_epoch:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::Protocol("CLUSTER INFO without cluster_current_epoch".into()))
}
