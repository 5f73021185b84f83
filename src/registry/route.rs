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

/// A refusal of the command itself: unknown (a server or proxy that does not know it),
/// or not allowed to this user (an ACL without it).
pub(super) fn refuses_command(e: &redis::RedisError) -> bool {
    let detail = e.detail().unwrap_or_default().to_ascii_lowercase();
    match e.code() {
        Some("NOPERM") => detail.contains("evalsha_ro"),
        Some("ERR") => detail.contains("unknown command"),
        _ => false,
    }
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

    /// [`Registry::route`] on one node: route.lua as EVALSHA_RO (loaded first if Redis
    /// does not have it). Where EVALSHA_RO is refused (a proxy that does not know it, an
    /// ACL user without it), as EVALSHA from then on.
    async fn route_on_node(&self, conn: &RedisConn, user: &[u8]) -> Result<Option<String>> {
        let forward = self.forward_key(user);
        let call = |command: &str| {
            redis::cmd(command)
                .arg(ROUTE.get_hash())
                .arg(1)
                .arg(&forward)
                .arg(user)
                .arg(self.layout.as_str())
                .arg(self.keys.prefix())
                .to_owned()
        };
        let read_only = !self.read_only_refused.load(Ordering::Relaxed);
        let command = if read_only { "EVALSHA_RO" } else { "EVALSHA" };
        let routed = match call(command).query_async::<Routed>(&mut conn.clone()).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                ROUTE.load_async(&mut conn.clone()).await?;
                call(command).query_async(&mut conn.clone()).await
            }
            Err(e) if read_only && refuses_command(&e) => {
                self.read_only_refused.store(true, Ordering::Relaxed);
                let mut call = ROUTE.prepare_invoke();
                call.key(&forward)
                    .arg(user)
                    .arg(self.layout.as_str())
                    .arg(self.keys.prefix());
                call.invoke_async(&mut conn.clone()).await
            }
            other => other,
        };
        match routed {
            Ok(Routed(owner)) => Ok(owner),
            Err(e) if e.detail().is_some_and(|d| d.contains("no-cluster")) => {
                Err(Error::Protocol(format!(
                    "route.lua runs on one Redis node only ({e}): this Redis is a cluster; \
                     connect to it as a cluster (setting `redis_cluster`), where route reads the owner, then its fence and \
                     liveness keys, in single-slot steps"
                )))
            }
            Err(e) => Err(e.into()),
        }
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
    /// in order.
    pub async fn owners(&self, conn: &RedisConn, users: &[Vec<u8>]) -> Result<Vec<Option<String>>> {
        self.owners_as(conn, users).await
    }

    /// [`Registry::owners`] as `T`: `Option<Vec<u8>>` where an owner written by something
    /// else than a connection server may be any bytes.
    pub async fn owners_as<T: redis::FromRedisValue + Send + 'static>(
        &self,
        conn: &RedisConn,
        users: &[Vec<u8>],
    ) -> Result<Vec<T>> {
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
                crate::conn::each_in_flight(conn, gets).await?
            }
            Layout::Keys if conn.is_cluster() => {
                // No MGET across slots: one GET per user, many in flight, in order.
                let gets = users
                    .iter()
                    .map(|u| redis::cmd("GET").arg(self.keys.user(u)).to_owned())
                    .collect();
                crate::conn::each_in_flight(conn, gets).await?
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
