//! Reads: where to route a message for a user (route.lua on one node, single-slot steps
//! on a cluster), the owners of forward entries, and servers' liveness keys.

use std::sync::{atomic::Ordering, LazyLock};

use super::Registry;
use crate::{
    config::Layout,
    conn::RedisConn,
    error::{Error, Result},
    event::ServerId,
    keys::Keys,
};

static ROUTE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/route.lua")));

/// route.lua's reply: the owner, or `false` (nil under RESP2, a boolean under RESP3)
/// when there is none to route to.
struct Routed(Option<String>);

impl redis::FromRedisValue for Routed {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        crate::reply::text_or_false("route.lua", v).map(Routed)
    }
}

/// Whether an error of EVALSHA_RO may be a refusal of the command itself (a server or a
/// proxy that does not know it, whatever its wording; an ACL user without it): an error
/// reply that is neither a state that passes, nor NOSCRIPT, nor a cluster's refusal of the
/// script. Plain EVALSHA is then tried once, and kept only if it answers.
fn may_refuse_command(e: &redis::RedisError) -> bool {
    e.code().is_some()
        && e.kind() != redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        && !crate::error::redis_error_is_retryable(e)
        && !refused_on_cluster(e)
}

/// A cluster's refusal of route.lua (`no-cluster`).
fn refused_on_cluster(e: &redis::RedisError) -> bool {
    e.detail().is_some_and(|d| d.contains("no-cluster"))
}

impl Registry {
    /// Where to route a message for `user` (route.lua): the owner, only if it is neither
    /// fenced nor past its liveness (its liveness key expired); otherwise `None`. It only
    /// reads: the janitor deletes (and announces) an entry whose owner is fenced. On one
    /// node, route.lua as a read-only script (EVALSHA_RO); on a cluster connection, in
    /// two single-slot steps: the owner, then its fence and liveness keys. A cluster
    /// reached through a plain connection refuses route.lua (`no-cluster`):
    /// [`Error::Protocol`], saying to connect as a cluster.
    ///
    /// Layout `conns`: `user` is a member `<connection id> <user id>` and this routes
    /// that one connection (two steps on every topology); see [`Registry::route_user`]
    /// for every connection of a user.
    pub async fn route(&self, conn: &RedisConn, user: &[u8]) -> Result<Option<String>> {
        if !conn.is_cluster() && self.layout != Layout::Conns {
            return self.route_on_node(conn, user).await;
        }
        let Some(owner) = self.owner(conn, user).await? else {
            return Ok(None);
        };
        let Ok(server) = ServerId::parse(&owner) else {
            return Ok(None);
        };
        let (fenced, alive): (bool, bool) = redis::pipe()
            .exists(self.keys.server_fence(&server))
            .exists(self.keys.server_alive(&server))
            .query_async(&mut conn.clone())
            .await?;
        Ok((alive && !fenced).then_some(owner))
    }

    /// [`Registry::route`] on one node: route.lua, read-only (see [`Registry::read_only`]).
    async fn route_on_node(&self, conn: &RedisConn, user: &[u8]) -> Result<Option<String>> {
        let Routed(owner) = self
            .read_only(
                conn,
                &ROUTE,
                "route.lua",
                &self.forward_key(user),
                &[
                    user,
                    self.layout.as_str().as_bytes(),
                    self.keys.prefix().as_bytes(),
                ],
            )
            .await?;
        Ok(owner)
    }

    /// Runs a protocol script that only reads (`no-writes,no-cluster`) on one node, with
    /// one key: as EVALSHA_RO (so that it runs on a replica too), loading it first if
    /// Redis does not have it. Where EVALSHA_RO is refused (a server or proxy that does
    /// not know it, an ACL user without it), as EVALSHA, from then on once EVALSHA
    /// answers. A cluster reached through a plain connection refuses the script:
    /// [`Error::Protocol`], saying to connect as a cluster.
    pub(super) async fn read_only<T: redis::FromRedisValue>(
        &self,
        conn: &RedisConn,
        script: &redis::Script,
        name: &str,
        key: &[u8],
        args: &[&[u8]],
    ) -> Result<T> {
        let run = |command: &'static str| async move {
            let mut call = redis::cmd(command);
            call.arg(script.get_hash()).arg(1).arg(key);
            for arg in args {
                call.arg(*arg);
            }
            match call.query_async::<T>(&mut conn.clone()).await {
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    script.load_async(&mut conn.clone()).await?;
                    call.query_async::<T>(&mut conn.clone()).await
                }
                other => other,
            }
        };
        let read_only = !self.read_only_refused.load(Ordering::Relaxed);
        let reply = match run(if read_only { "EVALSHA_RO" } else { "EVALSHA" }).await {
            Err(e) if read_only && may_refuse_command(&e) => {
                let reply = run("EVALSHA").await;
                if reply.is_ok() {
                    self.read_only_refused.store(true, Ordering::Relaxed);
                }
                reply
            }
            other => other,
        };
        reply.map_err(|e| match refused_on_cluster(&e) {
            true => Error::Protocol(format!(
                "{name} runs on one Redis node only ({e}): this Redis is a cluster; connect \
                 to it as a cluster (setting `redis_cluster`), where the lookup runs in \
                 single-slot steps: the forward entry, then each owner's fence and liveness \
                 keys"
            )),
            false => e.into(),
        })
    }

    /// The server a user's forward entry names, if any (layout `conns`: `user` is a
    /// member `<connection id> <user id>`, and this is its connection's server).
    pub async fn owner(&self, conn: &RedisConn, user: &[u8]) -> Result<Option<String>> {
        let owner: Option<String> = match self.layout {
            Layout::Conns => {
                let Some((key, field)) = self.keys.forward_of_member(self.layout, user) else {
                    return Ok(None);
                };
                redis::cmd("HGET")
                    .arg(key)
                    .arg(field)
                    .query_async(&mut conn.clone())
                    .await?
            }
            Layout::Hash => {
                redis::cmd("HGET")
                    .arg(self.keys.registry())
                    .arg(user)
                    .query_async(&mut conn.clone())
                    .await?
            }
            Layout::Keys => {
                redis::cmd("GET")
                    .arg(self.keys.user(user))
                    .query_async(&mut conn.clone())
                    .await?
            }
        };
        Ok(owner)
    }

    /// Owners of many users at once (HMGET or MGET; layout `conns`: one HGET per member),
    /// in order. A forward key of another type (layouts `keys` and `conns`) holds no entry
    /// of the layout: its owner is none, as MGET reads it and as the scripts on one node
    /// read it. Layout `hash`: a `registry` of another type is an error, as on one node.
    pub async fn owners(&self, conn: &RedisConn, users: &[Vec<u8>]) -> Result<Vec<Option<String>>> {
        self.owners_as(conn, users).await
    }

    /// [`Registry::owners`] as `T`: `Vec<u8>` where an owner written by something else than
    /// a connection server may be any bytes.
    pub async fn owners_as<T: redis::FromRedisValue + Send + 'static>(
        &self,
        conn: &RedisConn,
        users: &[Vec<u8>],
    ) -> Result<Vec<Option<T>>> {
        if users.is_empty() {
            return Ok(Vec::new());
        }
        let owners = match self.layout {
            Layout::Hash => {
                redis::cmd("HMGET")
                    .arg(self.keys.registry())
                    .arg(users)
                    .query_async(&mut conn.clone())
                    .await?
            }
            Layout::Conns => {
                // One HGET per member (a member that is no `<connection> <user>` reads the
                // Hash `user:{<member>}:conns`'s empty field: none).
                let gets = users
                    .iter()
                    .map(|m| {
                        let (key, field) = self
                            .keys
                            .forward_of_member(self.layout, m)
                            .unwrap_or_else(|| (self.keys.user_conns(m), Some(Vec::new())));
                        redis::cmd("HGET").arg(key).arg(field).to_owned()
                    })
                    .collect();
                entries_read(crate::conn::each_reply_in_flight(conn, gets).await?)?
            }
            Layout::Keys if conn.is_cluster() => {
                // No MGET across slots: one GET per user, many in flight, in order.
                let gets = users
                    .iter()
                    .map(|u| redis::cmd("GET").arg(self.keys.user(u)).to_owned())
                    .collect();
                entries_read(crate::conn::each_reply_in_flight(conn, gets).await?)?
            }
            Layout::Keys => {
                let keys: Vec<Vec<u8>> = users.iter().map(|u| self.keys.user(u)).collect();
                redis::cmd("MGET")
                    .arg(keys)
                    .query_async(&mut conn.clone())
                    .await?
            }
        };
        Ok(owners)
    }
}

/// The replies of single-key reads of forward entries (GET, HGET), in order: a key of
/// another type (WRONGTYPE) is no entry, so none; any other error fails the read.
fn entries_read<T>(replies: Vec<redis::RedisResult<Option<T>>>) -> Result<Vec<Option<T>>> {
    replies
        .into_iter()
        .map(|reply| match reply {
            Err(e) if e.code() == Some("WRONGTYPE") => Ok(None),
            reply => Ok(reply?),
        })
        .collect()
}

/// Servers whose liveness keys are read per round trip by [`have_liveness_keys`].
const LIVENESS_PAGE: usize = 1000;

/// Whether each of `servers` has its liveness key now (it heartbeated within its TTL), in
/// order: one pipeline per page on a node, many in flight on a cluster.
pub async fn have_liveness_keys(
    conn: &RedisConn,
    keys: &Keys,
    servers: &[ServerId],
) -> Result<Vec<bool>> {
    let mut alive = Vec::with_capacity(servers.len());
    for page in servers.chunks(LIVENESS_PAGE) {
        let exists = page
            .iter()
            .map(|s| redis::cmd("EXISTS").arg(keys.server_alive(s)).to_owned())
            .collect();
        alive.extend(crate::conn::each_in_flight::<bool>(conn, exists).await?);
    }
    Ok(alive)
}
