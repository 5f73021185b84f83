//! What an observation reads from Redis (TIME, INFO of each node, the shared record)
//! and the storing of the record.

use std::{
    collections::HashMap,
    sync::{atomic::Ordering, LazyLock},
};

use tracing::warn;

use super::{Reachable, Record, Seen};
use crate::{
    conn::{self, RedisConn},
    error::{Error, Result},
};

/// Stores the record: `reachable_since_ms` is the greatest of the stored and the given
/// (a stored value from the future, after Redis's clock stepped back, is replaced).
static STORE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../guard_record.lua")));

/// A script Redis refuses or holds whenever it refuses or holds a heartbeat (see the
/// script).
static WRITE_PROBE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../write_probe.lua")));

/// What `janitor:{guard}:reachable` says now, for `status`: the start of the current stretch of
/// reachable time (Redis time, unix ms; 0 for no outage known), or `None` when no
/// reconciler has written it (or it may not be read).
pub async fn recorded_since(conn: &RedisConn, key: &str) -> Option<u64> {
    let record: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(key)
        .query_async(&mut conn.clone())
        .await
        .ok()?;
    record.get("reachable_since_ms")?.parse().ok()
}

/// Redis's TIME in unix ms.
pub(super) async fn time_ms(conn: &RedisConn) -> Result<u64> {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn.clone()).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// What the guard reads of INFO.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub run_id: Option<String>,
    pub uptime_ms: Option<u64>,
    /// Keys loaded from an RDB at start (`rdb_last_load_keys_loaded` > 0), or AOF on
    /// (`aof_enabled:1`: Redis 7.0 counts no keys loaded from an AOF, so a Redis with
    /// AOF on may have loaded data).
    pub loaded_from_disk: bool,
}

impl NodeInfo {
    pub fn parse(server: &str, persistence: &str) -> Self {
        let field = |text: &str, name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_owned())
        };
        let number = |text: &str, name: &str| field(text, name).and_then(|v| v.parse::<u64>().ok());
        NodeInfo {
            run_id: field(server, "run_id").filter(|id| !id.is_empty()),
            uptime_ms: number(server, "uptime_in_seconds").map(|s| s * 1000),
            loaded_from_disk: number(persistence, "rdb_last_load_keys_loaded").unwrap_or(0) > 0
                || number(persistence, "aof_enabled") == Some(1),
        }
    }
}

impl Reachable {
    /// One observation: TIME, INFO server and persistence, the record.
    pub(super) async fn read(&self, conn: &RedisConn) -> Result<Seen> {
        let sent_mono_ms = self.mono_ms();
        let (redis_ms, nodes) = if conn.is_cluster() {
            let masters = conn::cluster_masters(conn).await?;
            let mut nodes = Vec::with_capacity(masters.len());
            for (host, port) in masters {
                nodes.push(self.node(&host, port)?);
            }
            if nodes.is_empty() {
                return Err(Error::Redis(redis::RedisError::from((
                    redis::ErrorKind::ClusterConnectionNotFound,
                    "the cluster names no master",
                ))));
            }
            // The clock the scores are judged by: the master of `servers`' slot.
            let keys = crate::keys::Keys::for_settings(&self.settings);
            (crate::clock::now_ms(conn, &keys).await?, nodes)
        } else {
            (time_ms(conn).await?, vec![conn.clone()])
        };
        let record = self.read_record(conn).await?;
        let mut run_ids = Vec::with_capacity(nodes.len());
        let (mut uptime_ms, mut loaded_from_disk) = (None::<u64>, false);
        let mut info_known = true;
        for node in &nodes {
            if conn.is_cluster() {
                self.probe_writes(node).await?;
            }
            match self.info(node).await? {
                Some(info) => {
                    match info.run_id {
                        Some(id) => run_ids.push(id),
                        None => info_known = false,
                    }
                    if let Some(up) = info.uptime_ms {
                        uptime_ms = Some(uptime_ms.map_or(up, |u| u.min(up)));
                    }
                    loaded_from_disk |= info.loaded_from_disk;
                }
                None => info_known = false,
            }
        }
        run_ids.sort();
        Ok(Seen {
            redis_ms,
            sent_mono_ms,
            received_mono_ms: self.mono_ms(),
            local_ms: crate::now_ms(),
            run_ids: info_known.then(|| run_ids.join(",")),
            uptime_ms,
            loaded_from_disk,
            record,
        })
    }

    /// A connection to one master of the cluster, kept for the next observations.
    pub(super) fn node(&self, host: &str, port: u16) -> Result<RedisConn> {
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = nodes.get(&(host.to_owned(), port)) {
            return Ok(c.clone());
        }
        let c = conn::shared(&conn::node_client(&self.settings, host, port)?)?;
        nodes.insert((host.to_owned(), port), c.clone());
        Ok(c)
    }

    /// Whether a master of the cluster would take a heartbeat now ([`WRITE_PROBE`]): an
    /// error if it refuses writes (the observation fails: an outage), a slow answer if it
    /// holds them. One master that cannot take heartbeats silences the servers whose
    /// `{S}` slot it serves, while the others answer the verdicts' reads. A refusal that
    /// says nothing of Redis's state (the script may not be run: an ACL) is logged once
    /// and passed over.
    pub(super) async fn probe_writes(&self, node: &RedisConn) -> Result<()> {
        match WRITE_PROBE
            .prepare_invoke()
            .invoke_async::<i64>(&mut node.clone())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if crate::error::redis_error_is_retryable(&e) => Err(e.into()),
            Err(e) => {
                if !self.probe_refused.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "the guard's write probe is refused: a master that refuses or holds writes (and heartbeats) while it answers reads is not seen as an outage");
                }
                Ok(())
            }
        }
    }

    /// INFO server and persistence of one node; `None` where INFO is refused (logged
    /// once: restarts are then seen by failed calls only).
    pub(super) async fn info(&self, node: &RedisConn) -> Result<Option<NodeInfo>> {
        let mut pipe = redis::pipe();
        pipe.cmd("INFO")
            .arg("server")
            .cmd("INFO")
            .arg("persistence");
        match pipe
            .query_async::<(String, String)>(&mut node.clone())
            .await
        {
            Ok((server, persistence)) => Ok(Some(NodeInfo::parse(&server, &persistence))),
            Err(e) if crate::error::redis_error_is_retryable(&e) => Err(e.into()),
            Err(e) => {
                if !self.info_refused.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "INFO is refused: Redis restarts and failovers are seen only through failed calls");
                }
                Ok(None)
            }
        }
    }

    /// `janitor:{guard}:reachable`, or `None` if it does not exist (or may not be read: then this
    /// process's own view stands in for it, logged once).
    pub(super) async fn read_record(&self, conn: &RedisConn) -> Result<Option<Record>> {
        let mut pipe = redis::pipe();
        pipe.cmd("EXISTS")
            .arg(&self.key)
            .cmd("HGET")
            .arg(&self.key)
            .arg("run_ids")
            .cmd("HGET")
            .arg(&self.key)
            .arg("reachable_since_ms");
        match pipe
            .query_async::<(bool, Option<String>, Option<u64>)>(&mut conn.clone())
            .await
        {
            Ok((false, _, _)) => Ok(None),
            Ok((true, run_ids, since)) => Ok(Some(Record {
                run_ids,
                reachable_since_ms: since.unwrap_or(0),
            })),
            Err(e) if crate::error::redis_error_is_retryable(&e) => Err(e.into()),
            Err(e) => {
                self.refused(&e);
                let t = self.tracker();
                if t.last.is_none() {
                    // Nothing known yet: as with no record, a recent load from disk
                    // starts the grace (the first-run rule).
                    return Ok(None);
                }
                Ok(Some(Record {
                    run_ids: t.last.as_ref().and_then(|l| l.run_ids.clone()),
                    reachable_since_ms: t.reachable_since_ms,
                }))
            }
        }
    }

    pub(super) fn refused(&self, e: &redis::RedisError) {
        if !self.record_refused.swap(true, Ordering::Relaxed) {
            warn!(key = %self.key, error = %e, "the reconciler may not use its guard record: an outage it sees holds its own verdicts only, and a restart is seen through failed calls");
        }
    }

    pub(super) async fn store(&self, conn: &RedisConn, record: &Record) -> Result<()> {
        let stored = STORE
            .key(&self.key)
            .arg(record.run_ids.as_deref().unwrap_or(""))
            .arg(record.reachable_since_ms)
            .invoke_async::<u64>(&mut conn.clone())
            .await;
        match stored {
            Ok(since) => {
                self.tracker().stored(since);
                Ok(())
            }
            Err(e) if crate::error::redis_error_is_retryable(&e) => {
                let e = Error::from(e);
                self.failed(&e);
                Err(e)
            }
            Err(e) => {
                self.refused(&e);
                Ok(())
            }
        }
    }
}
