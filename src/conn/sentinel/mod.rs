//! Redis Sentinel: a connection to the primary that the sentinels name, found again
//! through them whenever it is lost.
//!
//! A [`SentinelConn`] holds a [`ConnectionManager`] for the primary it last resolved. A
//! command that fails in a way that says "this is not the primary any more" drops it:
//! - the connection failed (refused, reset, timed out): the primary died or is cut off;
//! - the node answered READONLY (or MASTERDOWN): it was demoted to replica by a failover,
//!   and a reconnect to the same address would only reach the replica again.
//!
//! The failing command returns its error (every caller retries transient errors, see
//! `crate::retry`); the next command asks the sentinels for the primary again
//! (redis-rs's `SentinelClient`: `SENTINEL MASTERS` on each sentinel, then `ROLE` on the
//! node named, which must say master). One lookup runs at a time per connection, and
//! lookups that fail are spaced by a capped backoff: during a failover the sentinels
//! still name the dead primary, or none, for a few seconds.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use redis::{
    aio::ConnectionManager, sentinel::SentinelClient, ConnectionAddr, RedisError, RedisFuture,
    RedisResult,
};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::error::{Error, Result};

mod target;

pub use target::SentinelTarget;

/// Longest one lookup through the sentinels may take (each sentinel asked, the primary
/// checked with ROLE) before it counts as failed.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Backoff between failed lookups: from this...
const LOOKUP_MIN_DELAY: Duration = Duration::from_millis(100);
/// ...doubling to at most this.
const LOOKUP_MAX_DELAY: Duration = Duration::from_secs(2);

/// The primary as last resolved.
#[derive(Clone)]
struct Primary {
    conn: ConnectionManager,
    client: redis::Client,
    /// `host:port`, for logs.
    addr: String,
    /// Which lookup found it: a failure drops the primary only if no newer lookup has
    /// replaced it meanwhile.
    generation: u64,
}

/// A connection to the primary that the sentinels name; see the module docs. Cheap to
/// clone: clones share the connection and the lookups.
#[derive(Clone)]
pub struct SentinelConn(Arc<ConnInner>);

struct ConnInner {
    target: SentinelTarget,
    response_timeout: Duration,
    current: Mutex<Option<Primary>>,
    /// Failed lookups so far; a caller that waited while a lookup failed gets its error
    /// instead of starting another one at once.
    failures: AtomicU64,
    lookup: tokio::sync::Mutex<Lookup>,
}

/// The state of the lookups (one at a time).
struct Lookup {
    client: Option<SentinelClient>,
    generation: u64,
    last_error: Option<RedisError>,
    next_attempt: Option<Instant>,
    delay: Duration,
    /// The address of the last primary found, to log a change once.
    last_addr: Option<String>,
}

impl SentinelConn {
    /// A connection whose commands may take up to `response_timeout`. Lazy: nothing is
    /// asked of the sentinels until the first command.
    pub fn new(target: SentinelTarget, response_timeout: Duration) -> Self {
        SentinelConn(Arc::new(ConnInner {
            target,
            response_timeout,
            current: Mutex::new(None),
            failures: AtomicU64::new(0),
            lookup: tokio::sync::Mutex::new(Lookup {
                client: None,
                generation: 0,
                last_error: None,
                next_attempt: None,
                delay: LOOKUP_MIN_DELAY,
                last_addr: None,
            }),
        }))
    }

    /// A connection that starts at `host:port` as if the sentinels had named it (for
    /// example a node demoted since), and looks the primary up again from there like any
    /// other.
    #[cfg(test)]
    fn starting_at(
        target: SentinelTarget,
        response_timeout: Duration,
        host: &str,
        port: u16,
    ) -> Result<Self> {
        let conn = Self::new(target, response_timeout);
        let client = conn.0.target.primary_client(host.to_owned(), port)?;
        *crate::lock::lock(&conn.0.current) = Some(Primary {
            conn: ConnectionManager::new_lazy_with_config(
                client.clone(),
                super::config(response_timeout),
            )?,
            client,
            addr: format!("{host}:{port}"),
            generation: 0,
        });
        Ok(conn)
    }

    /// The client of the primary (for a Pub/Sub connection of its own), after checking
    /// with ROLE that it still is the primary; if it is not, it is dropped and the next
    /// command looks the primary up again.
    pub async fn primary_client(&self) -> Result<redis::Client> {
        let mut primary = self.primary().await?;
        let role: RedisResult<redis::Value> =
            redis::cmd("ROLE").query_async(&mut primary.conn).await;
        let role = match role {
            Ok(role) => role,
            Err(e) => {
                self.failed(&e, primary.generation);
                return Err(e.into());
            }
        };
        let is_master = matches!(&role, redis::Value::Array(items)
            if matches!(items.first(), Some(redis::Value::BulkString(b)) if b == b"master"));
        if !is_master {
            self.drop_primary(primary.generation, "it is no longer the primary (ROLE)");
            return Err(Error::Redis(RedisError::from((
                redis::ErrorKind::Io,
                "the primary was demoted; asking the sentinels again",
            ))));
        }
        Ok(primary.client)
    }

    /// The current primary, looked up through the sentinels if there is none.
    async fn primary(&self) -> RedisResult<Primary> {
        if let Some(p) = self.current() {
            return Ok(p);
        }
        let failures_seen = self.0.failures.load(Ordering::Acquire);
        let mut lookup = self.0.lookup.lock().await;
        if let Some(p) = self.current() {
            return Ok(p);
        }
        if self.0.failures.load(Ordering::Acquire) != failures_seen {
            if let Some(e) = &lookup.last_error {
                return Err(e.clone());
            }
        }
        if let Some(at) = lookup.next_attempt {
            tokio::time::sleep_until(at).await;
        }
        let found = tokio::time::timeout(LOOKUP_TIMEOUT, self.look_up(&mut lookup))
            .await
            .unwrap_or_else(|_| {
                Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer from the sentinels in time",
                )))
            });
        match found {
            Ok((client, host, port)) => {
                let addr = format!("{host}:{port}");
                let conn = ConnectionManager::new_lazy_with_config(
                    client.clone(),
                    super::config(self.0.response_timeout),
                )?;
                lookup.generation += 1;
                let primary = Primary {
                    conn,
                    client,
                    addr: addr.clone(),
                    generation: lookup.generation,
                };
                if lookup.last_addr.as_deref() != Some(addr.as_str()) {
                    info!(master = %self.0.target.master(), primary = %addr, "the sentinels name the primary");
                    lookup.last_addr = Some(addr);
                }
                lookup.next_attempt = None;
                lookup.delay = LOOKUP_MIN_DELAY;
                lookup.last_error = None;
                *crate::lock::lock(&self.0.current) = Some(primary.clone());
                Ok(primary)
            }
            Err(e) => {
                // A lookup that failed may have left a sentinel connection half used.
                lookup.client = None;
                lookup.next_attempt = Some(Instant::now() + lookup.delay);
                lookup.delay = (lookup.delay * 2).min(LOOKUP_MAX_DELAY);
                lookup.last_error = Some(e.clone());
                self.0.failures.fetch_add(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// One lookup: the primary's client, host and port.
    async fn look_up(&self, lookup: &mut Lookup) -> RedisResult<(redis::Client, String, u16)> {
        let client = match &mut lookup.client {
            Some(client) => client,
            none => none.insert(self.0.target.sentinel_client()?),
        };
        let found = client.async_get_client().await?;
        let (host, port) = match found.get_connection_info().addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                (host.clone(), *port)
            }
            other => {
                return Err(RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "the sentinels named a primary that is not a TCP address",
                    format!("{other:?}"),
                )))
            }
        };
        let client = self
            .0
            .target
            .primary_client(host.clone(), port)
            .map_err(|e| match e {
                Error::Redis(e) => e,
                other => RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "the primary's client",
                    other.to_string(),
                )),
            })?;
        Ok((client, host, port))
    }

    fn current(&self) -> Option<Primary> {
        crate::lock::lock(&self.0.current).clone()
    }

    /// After `e` from the primary of `generation`: drops that primary if `e` says it is
    /// not (or no longer reachable as) the primary.
    fn failed(&self, e: &RedisError, generation: u64) {
        if points_elsewhere(e) {
            self.drop_primary(generation, &e.to_string());
        }
    }

    fn drop_primary(&self, generation: u64, why: &str) {
        let mut current = crate::lock::lock(&self.0.current);
        if let Some(p) = current.as_ref().filter(|p| p.generation == generation) {
            warn!(primary = %p.addr, reason = %why, "lost the primary; asking the sentinels again");
            *current = None;
        }
    }

    pub(super) fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let mut primary = self.primary().await?;
            let reply =
                redis::aio::ConnectionLike::req_packed_command(&mut primary.conn, cmd).await;
            match &reply {
                Err(e) => self.failed(e, primary.generation),
                Ok(v) if answered_by_replica(v) => {
                    self.drop_primary(primary.generation, "it answered READONLY or MASTERDOWN")
                }
                Ok(_) => {}
            }
            reply
        })
    }

    pub(super) fn req_packed_commands<'a>(
        &'a mut self,
        pipe: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let mut primary = self.primary().await?;
            let reply = redis::aio::ConnectionLike::req_packed_commands(
                &mut primary.conn,
                pipe,
                offset,
                count,
            )
            .await;
            match &reply {
                Err(e) => self.failed(e, primary.generation),
                Ok(values) if values.iter().any(answered_by_replica) => {
                    self.drop_primary(primary.generation, "it answered READONLY or MASTERDOWN")
                }
                Ok(_) => {}
            }
            reply
        })
    }

    pub(super) fn get_db(&self) -> i64 {
        self.0.target.0.primary.redis_settings().db()
    }
}

/// True when a reply is (or holds, as the reply of EXEC does) a server error that only
/// a replica gives. redis-rs passes server errors up as values: they become errors only
/// where the reply is read.
fn answered_by_replica(v: &redis::Value) -> bool {
    match v {
        redis::Value::ServerError(e) => matches!(e.code(), "READONLY" | "MASTERDOWN"),
        redis::Value::Array(items) => items.iter().any(answered_by_replica),
        _ => false,
    }
}

/// True when `e` says the node is not the primary any more, or cannot be reached: the
/// connection failed, or the node (or a command of a pipeline or script) answered
/// READONLY or MASTERDOWN, which only a replica does. Retrying at the same address would
/// not help: the primary must be looked up again.
pub fn points_elsewhere(e: &RedisError) -> bool {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return true;
    }
    let replica = |code: &str| matches!(code, "READONLY" | "MASTERDOWN");
    if let Some(inner) = e.clone().into_server_errors() {
        return inner.iter().any(|(_, s)| replica(s.code()));
    }
    e.code().is_some_and(replica)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn reply(line: &str) -> RedisError {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .unwrap()
            .extract_error()
            .unwrap_err()
    }

    #[test]
    fn a_demoted_or_lost_primary_is_looked_up_again() {
        for line in [
            "READONLY You can't write against a read only replica.",
            "READONLY You can't write against a read only replica. script: a9c3, on @user_script:1.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        ] {
            assert!(points_elsewhere(&reply(line)), "{line}");
        }
        let refused: RedisError =
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(points_elsewhere(&refused));
        let as_value =
            |line: &str| redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
        let readonly = "READONLY You can't write against a read only replica.";
        assert!(answered_by_replica(&as_value(readonly)));
        assert!(answered_by_replica(&redis::Value::Array(vec![
            redis::Value::Okay,
            as_value(readonly),
        ])));
        assert!(!answered_by_replica(&as_value(
            "BUSY Redis is busy running a script."
        )));
        // States of a primary that pass: retried at the same address.
        for line in [
            "BUSY Redis is busy running a script.",
            "LOADING Redis is loading the dataset in memory",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "NOSCRIPT No matching script. Please use EVAL.",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ] {
            assert!(!points_elsewhere(&reply(line)), "{line}");
        }
    }

    /// A planned failover (`SENTINEL FAILOVER`) demotes the primary: a connection still
    /// pointing at the demoted node is answered READONLY once, and finds the new primary
    /// through the sentinels at the next command instead of retrying the old address.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_at_a_demoted_node_finds_the_new_primary() {
        use registry_janitor_testkit::{RedisSentinels, MASTER_NAME};
        if !RedisSentinels::supported() {
            registry_janitor_testkit::cannot_run("this redis-server cannot run Sentinel");
            return;
        }
        let group = tokio::task::spawn_blocking(|| RedisSentinels::start(1, 3, &[]))
            .await
            .unwrap()
            .expect("start a primary, a replica and three sentinels");
        let mut settings = Settings::defaults();
        settings.redis_url = "redis://127.0.0.1:1/0".into();
        settings.redis_sentinels = group.sentinel_urls();
        settings.redis_sentinel_master = Some(MASTER_NAME.into());
        settings.validate().unwrap();
        let (old, replica) = (0, 1);
        let old_port = group.nodes[old].port();
        let mut sentinel = redis::Client::open(group.sentinels[0].url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(MASTER_NAME)
            .query_async(&mut sentinel)
            .await
            .unwrap();
        let promoted = tokio::task::block_in_place(|| {
            group
                .wait_failover_from(old, Duration::from_secs(90))
                .expect("the sentinels promote the replica")
        });
        assert_eq!(promoted, replica);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while group.role(old).as_deref() != Some("slave") {
            assert!(
                std::time::Instant::now() < deadline,
                "the old primary did not become a replica:\n{}",
                group.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let crate::conn::Target::Sentinel(target) = crate::conn::target_for(&settings).unwrap()
        else {
            panic!("a Sentinel target");
        };
        let mut at_old = crate::conn::RedisConn::Sentinel(
            SentinelConn::starting_at(target, Duration::from_secs(5), "127.0.0.1", old_port)
                .unwrap(),
        );
        let key = format!("{}probe", settings.key_prefix);
        let first: RedisResult<()> = redis::cmd("SET")
            .arg(&key)
            .arg("1")
            .query_async(&mut at_old)
            .await;
        assert_eq!(
            first.as_ref().err().and_then(|e| e.code()),
            Some("READONLY"),
            "{first:?}"
        );
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("2")
            .query_async(&mut at_old)
            .await
            .expect("the next command goes to the new primary");
        let mut on_new = redis::Client::open(group.nodes[replica].url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let value: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut on_new)
            .await
            .unwrap();
        assert_eq!(value.as_deref(), Some("2"));
    }
}
