//! Layout `conns`: a user with several connections (docs/connections.md).
//!
//! Per user one Hash `user:{<user>}:conns` (field = connection id, value = server id);
//! per server the reverse set holds `<connection id> <user id>`. The protocol scripts are
//! register_conn.lua, unregister_conn.lua and route_user.lua (release.lua, with the
//! connection id as the field of layout `hash`, undoes a field on a cluster).
//!
//! On a Redis Cluster the user's Hash and the server's keys are in different slots, and
//! the steps follow the order of the other layouts: register checks the fence, writes
//! the connection's field, then the member with the fence check (register_conn.lua with
//! the server's keys only), and deletes the field again (release.lua) if that is refused;
//! unregister deletes the field if it still names the server (release.lua), then the
//! member (unregister_conn.lua with the server's keys only); route reads the Hash, then
//! each distinct server's fence and liveness keys (one slot each).

use std::sync::LazyLock;

use super::{unless_fenced, Entry, Registry};
use crate::{
    config::Layout,
    conn::RedisConn,
    error::{Error, Result},
    event::ServerId,
};

static REGISTER_CONN: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/register_conn.lua")));
static UNREGISTER_CONN: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/unregister_conn.lua")));
static ROUTE_USER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/route_user.lua")));

/// The connection id rule, the server id's: 1 to 200 bytes of printable ASCII, no
/// whitespace, no braces. The protocol scripts refuse a bad one too (error `BADCONN`).
pub fn validate_connection_id(connection: &str) -> Result<()> {
    ServerId::parse(connection)
        .map(drop)
        .map_err(|e| Error::Protocol(format!("connection id {connection:?}: {e}")))
}

/// A reverse-set member of layout `conns` as (connection id, user id), validated.
pub(super) fn member_parts(member: &[u8]) -> Result<(&str, &[u8])> {
    let at = member.iter().position(|&b| b == b' ').ok_or_else(|| {
        Error::Protocol(format!(
            "layout conns: {:?} is not `<connection id> <user id>`",
            String::from_utf8_lossy(member)
        ))
    })?;
    let connection = std::str::from_utf8(&member[..at])
        .map_err(|_| Error::Protocol("connection id: not printable ASCII".into()))?;
    validate_connection_id(connection)?;
    Ok((connection, &member[at + 1..]))
}

impl Registry {
    fn conns_only(&self, what: &str) -> Result<()> {
        if self.layout == Layout::Conns {
            return Ok(());
        }
        Err(Error::Protocol(format!(
            "{what} needs layout conns (this registry is layout {})",
            self.layout.as_str()
        )))
    }

    /// A call of register_conn.lua or unregister_conn.lua on the server's keys (the
    /// caller adds the user's Hash on one node).
    fn conn_call<'a>(
        &self,
        script: &'a redis::Script,
        user: &[u8],
        connection: &str,
        server: &ServerId,
    ) -> redis::ScriptInvocation<'a> {
        let mut call = script.prepare_invoke();
        call.key(self.keys.server_fence(server))
            .key(self.keys.server_refusals(server))
            .key(self.keys.server_users(server))
            .arg(user)
            .arg(server.as_str())
            .arg(connection);
        call
    }

    /// Registers connection `connection` of `user` on `server` (register_conn.lua): the
    /// user's Hash gets the field, the server's reverse set the member `<connection>
    /// <user>`. Refused with [`Error::Fenced`] once `server` is fenced, with nothing
    /// written; a connection id that breaks the rule is refused before any write. One
    /// atomic step on one node; on a cluster in the order of the module docs.
    pub async fn register_connection(
        &self,
        conn: &RedisConn,
        user: &[u8],
        connection: &str,
        server: &ServerId,
    ) -> Result<()> {
        self.conns_only("register_connection")?;
        validate_connection_id(connection)?;
        let call = self.conn_call(&REGISTER_CONN, user, connection, server);
        let entry = self.connection_entry(user, connection);
        let write = redis::cmd("HSET")
            .arg(&entry.key)
            .arg(connection)
            .arg(server.as_str())
            .to_owned();
        self.register_steps(conn, call, entry, write, server).await
    }

    /// A clean disconnect of one connection (unregister_conn.lua): its field goes if it
    /// still names `server` (the user's Hash with its last field), then the member. A
    /// fenced server still loses the field, gets [`Error::Fenced`] and writes no member.
    pub async fn unregister_connection(
        &self,
        conn: &RedisConn,
        user: &[u8],
        connection: &str,
        server: &ServerId,
    ) -> Result<()> {
        self.conns_only("unregister_connection")?;
        validate_connection_id(connection)?;
        let mut call = self.conn_call(&UNREGISTER_CONN, user, connection, server);
        if conn.is_cluster() {
            self.release(conn, &self.connection_entry(user, connection), server)
                .await?;
        } else {
            call.key(self.keys.user_conns(user));
        }
        unless_fenced(call.invoke_async::<i64>(&mut conn.clone()).await, server).map(drop)
    }

    /// The forward entry of `connection` of `user`: a field of the user's Hash, released
    /// as layout `hash` releases a field of `registry`.
    fn connection_entry<'c>(&self, user: &[u8], connection: &'c str) -> Entry<'c> {
        Entry {
            key: self.keys.user_conns(user),
            field: connection.as_bytes(),
            layout: Layout::Hash,
        }
    }

    /// Every connection of `user` and the server it names, sorted by connection id.
    pub async fn connections(
        &self,
        conn: &RedisConn,
        user: &[u8],
    ) -> Result<Vec<(String, String)>> {
        let mut all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(self.keys.user_conns(user))
            .query_async(&mut conn.clone())
            .await?;
        all.sort();
        Ok(all)
    }

    /// Where to route a message for `user` in layout `conns` (route_user.lua): the
    /// distinct servers of its connections that are neither fenced nor past their
    /// liveness, sorted; empty when none. It only reads. On one node route_user.lua as a
    /// read-only script (EVALSHA_RO, or EVALSHA where that is refused); on a cluster
    /// connection in single-slot steps: the user's Hash, then the fence and liveness keys
    /// of each distinct server.
    pub async fn route_user(&self, conn: &RedisConn, user: &[u8]) -> Result<Vec<String>> {
        self.conns_only("route_user")?;
        if !conn.is_cluster() {
            return self.route_user_on_node(conn, user).await;
        }
        let mut servers: Vec<String> = self
            .connections(conn, user)
            .await?
            .into_iter()
            .map(|(_, server)| server)
            .collect();
        servers.sort();
        servers.dedup();
        let parsed: Vec<ServerId> = servers
            .iter()
            .filter_map(|s| ServerId::parse(s).ok())
            .collect();
        let checks = parsed
            .iter()
            .map(|s| {
                redis::pipe()
                    .exists(self.keys.server_fence(s))
                    .exists(self.keys.server_alive(s))
                    .to_owned()
            })
            .map(|pipe| async move { pipe.query_async::<(bool, bool)>(&mut conn.clone()).await });
        let states = futures_util::future::try_join_all(checks).await?;
        Ok(parsed
            .into_iter()
            .zip(states)
            .filter(|(_, (fenced, alive))| *alive && !fenced)
            .map(|(s, _)| s.as_str().to_owned())
            .collect())
    }

    /// [`Registry::route_user`] on one node: route_user.lua, read-only (see
    /// [`Registry::read_only`]).
    async fn route_user_on_node(&self, conn: &RedisConn, user: &[u8]) -> Result<Vec<String>> {
        self.read_only(
            conn,
            &ROUTE_USER,
            "route_user.lua",
            &self.keys.user_conns(user),
            &[self.keys.prefix().as_bytes()],
        )
        .await
    }
}
