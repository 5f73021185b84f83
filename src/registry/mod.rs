//! The connection-server side of the registry, for connection servers written in Rust
//! (and for the demo, the benchmark and the tests, which play that part).
//!
//! The protocol is a set of Lua scripts in `protocol/` at the top of the repository, so
//! that a connection server in any language follows the same rules (the documentation gives
//! each call, with its keys and arguments, and a Python example):
//!
//! | operation    | script          | what it does                                          |
//! |--------------|-----------------|-------------------------------------------------------|
//! | register     | register.lua    | fence check, forward entry, reverse-set member        |
//! | heartbeat    | heartbeat.lua   | fence check, liveness key (PX), `servers` score        |
//! | (cluster)    | heartbeat_servers.lua | the `servers` score, after heartbeat.lua        |
//! | unregister   | unregister.lua  | forward entry if still ours, fence check, SREM        |
//! | route        | route.lua       | the owner, unless fenced or not alive (reads only)     |
//! | (cluster)    | release.lua     | forward entry deleted only if it names the server     |
//!
//! Layout `conns` (a user with several connections; docs/connections.md) has its own
//! scripts, with the same fence rules; see `conns.rs`:
//!
//! | operation           | script              | what it does                                |
//! |---------------------|---------------------|---------------------------------------------|
//! | register_connection | register_conn.lua   | fence check, the connection's field, member |
//! | unregister_connection | unregister_conn.lua | field if still ours, fence check, SREM    |
//! | route_user          | route_user.lua      | every live server of the user's connections |
//!
//! Once a worker takes `server.dead` for S, S is fenced (`server:{S}:fenced`, see
//! [`crate::fence`]): every register, heartbeat and unregister of S is refused with the
//! Redis error `FENCED`, which [`Registry`] returns as [`Error::Fenced`]. A connection
//! server that gets it must close its sockets, so that its clients reconnect elsewhere,
//! and start again under a new server id. A false positive (monitoring lost sight of a
//! live S) is found at S's next heartbeat.
//!
//! A user moving to another server is a `register` on the new server: the forward entry
//! now names it, and the old server's reverse set may still list the user (the janitor
//! leaves such entries alone).
//!
//! On a Redis Cluster the forward entry and the reverse set are in different slots, so no
//! one script can hold both: `register` writes the forward entry first, then the member
//! (with the fence check, atomic with the SADD). That order is what lets a cleanup promise
//! that no member added to S's set before its acknowledgement keeps an entry naming S:
//! the member is written last, so by the time it can be walked, the entry it stands for
//! is there to be checked. And since the fence is recorded before the cleanup's first
//! step, a member written after the walk began is refused, so no registration slower
//! than the cleanup can land after it. What remains is the forward entry of a
//! registration refused at its second step: `register` deletes it again (release.lua);
//! if the connection server dies in between, the entry names a fenced owner, which
//! `route` never returns, and which the drift sweep removes (and announces).
//!
//! `register_legacy`, `add_register` and `register_many` write as a plain writer does
//! (MULTI HSET/SADD, no fence check): the janitor still cleans
//! such late writes before it acknowledges, but the writer is never told it is dead.

use std::sync::{atomic::AtomicBool, Arc, LazyLock};

use crate::conn::RedisConn;

use crate::{
    config::Layout,
    error::{Error, Result},
    event::ServerId,
    keys::Keys,
};

static REGISTER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/register.lua")));
static HEARTBEAT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/heartbeat.lua")));
static HEARTBEAT_SERVERS: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/heartbeat_servers.lua")));
static UNREGISTER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/unregister.lua")));
mod conns;
mod route;

pub use conns::validate_connection_id;

pub use route::have_liveness_keys;

/// One forward entry as release.lua takes it: its key, the field (layout `hash` and a
/// user's connections Hash) or user it names, and the layout its script argument is.
struct Entry<'a> {
    key: Vec<u8>,
    field: &'a [u8],
    layout: Layout,
}

static RELEASE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../protocol/release.lua")));
/// Turns the protocol's `FENCED` refusal into [`Error::Fenced`].
fn unless_fenced<T>(reply: redis::RedisResult<T>, server: &ServerId) -> Result<T> {
    match reply {
        Err(e) if e.code() == Some("FENCED") => Err(Error::Fenced {
            server: server.as_str().to_owned(),
        }),
        other => Ok(other?),
    }
}

/// Writes and reads the registry as a connection server does.
#[derive(Debug, Clone)]
pub struct Registry {
    keys: Keys,
    layout: Layout,
    /// Redis (or a proxy in front of it) refused EVALSHA_RO (unknown, or not allowed to
    /// this user): route.lua runs as EVALSHA.
    read_only_refused: Arc<AtomicBool>,
}

impl Registry {
    pub fn new(keys: Keys, layout: Layout) -> Self {
        Registry {
            keys,
            layout,
            read_only_refused: Arc::default(),
        }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The key that holds `user`'s forward entry: `registry` or `user:<user>`; in layout
    /// `conns`, `user` is a member `<connection id> <user id>` and this is the user's Hash.
    fn forward_key(&self, user: &[u8]) -> Vec<u8> {
        match self.layout {
            Layout::Hash => self.keys.registry().into_bytes(),
            Layout::Keys => self.keys.user(user),
            Layout::Conns => match crate::keys::split_conn_member(user) {
                Some((_, u)) => self.keys.user_conns(u),
                None => self.keys.user_conns(user),
            },
        }
    }

    /// Layout `conns`: `user` must be a member `<connection id> <user id>` with a valid
    /// connection id; other layouts take any user id.
    fn check_entry(&self, user: &[u8]) -> Result<()> {
        if self.layout == Layout::Conns {
            let (connection, _) = conns::member_parts(user)?;
            validate_connection_id(connection)?;
        }
        Ok(())
    }

    /// The plain write of `user`'s forward entry naming `server` (HSET or SET; layout
    /// `conns`: `user` is a member, HSET of its connection's field).
    fn forward_write(&self, user: &[u8], server: &ServerId) -> redis::Cmd {
        match self.layout {
            Layout::Conns => {
                let (connection, u) = crate::keys::split_conn_member(user).unwrap_or((b"", user));
                redis::cmd("HSET")
                    .arg(self.keys.user_conns(u))
                    .arg(connection)
                    .arg(server.as_str())
                    .to_owned()
            }
            Layout::Hash => redis::cmd("HSET")
                .arg(self.keys.registry())
                .arg(user)
                .arg(server.as_str())
                .to_owned(),
            Layout::Keys => redis::cmd("SET")
                .arg(self.keys.user(user))
                .arg(server.as_str())
                .to_owned(),
        }
    }

    /// A call of register.lua or unregister.lua, which take the same keys and arguments:
    /// S's fence, refusal notes and reverse set (the caller adds the forward entry's key
    /// on one node), then the user, S and the layout.
    fn member_call<'a>(
        &self,
        script: &'a redis::Script,
        user: &[u8],
        server: &ServerId,
    ) -> redis::ScriptInvocation<'a> {
        let mut call = script.prepare_invoke();
        call.key(self.keys.server_fence(server))
            .key(self.keys.server_refusals(server))
            .key(self.keys.server_users(server))
            .arg(user)
            .arg(server.as_str())
            .arg(self.layout.as_str());
        call
    }

    /// Adds the commands that register `user` on `server` to `pipe` (for bulk loads; the
    /// plain writes, without a fence check). The caller has checked `user`
    /// ([`Registry::check_entry`]: layout `conns` takes a member `<connection id> <user id>`).
    fn add_register(&self, pipe: &mut redis::Pipeline, user: &[u8], server: &ServerId) {
        pipe.add_command(self.forward_write(user, server))
            .ignore()
            .sadd(self.keys.server_users(server), user)
            .ignore();
    }

    /// Registers `user` on `server` (register.lua): refused with [`Error::Fenced`] once
    /// `server` is fenced. One atomic step on one node; on a cluster the forward entry
    /// first, then the member with the fence check (undone if refused; see the module docs).
    ///
    /// Layout `conns`: `user` is a member `<connection id> <user id>`, registered with
    /// [`Registry::register_connection`].
    pub async fn register(&self, conn: &RedisConn, user: &[u8], server: &ServerId) -> Result<()> {
        if self.layout == Layout::Conns {
            let (connection, user) = conns::member_parts(user)?;
            return self
                .register_connection(conn, user, connection, server)
                .await;
        }
        let call = self.member_call(&REGISTER, user, server);
        let entry = Entry {
            key: self.forward_key(user),
            field: user,
            layout: self.layout,
        };
        self.register_steps(conn, call, entry, self.forward_write(user, server), server)
            .await
    }

    /// The registration steps of the protocol for one forward entry: `call` (register.lua
    /// or register_conn.lua, given the server's keys) checks the fence and writes. On one
    /// node one atomic step, `entry`'s key added to `call`. On a cluster the forward
    /// entry first (`write`), then `call`, the entry released if `call` is refused (see
    /// the module docs).
    async fn register_steps(
        &self,
        conn: &RedisConn,
        mut call: redis::ScriptInvocation<'_>,
        entry: Entry<'_>,
        write: redis::Cmd,
        server: &ServerId,
    ) -> Result<()> {
        if conn.is_cluster() {
            // A server already fenced writes no forward entry: that write would replace
            // the entry of a user registered on a live server, and the release after the
            // refusal would then delete it. The script alone refuses (and notes it).
            if crate::fence::is_fenced(conn, &self.keys, server).await? {
                unless_fenced(call.invoke_async::<i64>(&mut conn.clone()).await, server)?;
                // The script took the member: the fence expired since it was read. The
                // forward entry is written now, before the script runs again (the order
                // of the steps), and the script checks the fence once more.
            }
            let _: redis::Value = write.query_async(&mut conn.clone()).await?;
        } else {
            call.key(&entry.key);
        }
        let refused = match unless_fenced(call.invoke_async::<i64>(&mut conn.clone()).await, server)
        {
            Err(refused @ Error::Fenced { .. }) => refused,
            other => return other.map(drop),
        };
        if conn.is_cluster() {
            self.release(conn, &entry, server).await?;
        }
        Err(refused)
    }

    /// Registers `user` on `server` as a plain writer does (no protocol script):
    /// MULTI HSET/SADD (on a cluster, the forward entry and then the member), no fence
    /// check. The janitor cleans such writes before it acknowledges; the writer is never
    /// told that it is dead.
    pub async fn register_legacy(
        &self,
        conn: &RedisConn,
        user: &[u8],
        server: &ServerId,
    ) -> Result<()> {
        self.check_entry(user)?;
        let mut reverse = redis::cmd("SADD");
        reverse.arg(self.keys.server_users(server)).arg(user);
        // Forward entry first: the order that matters on a cluster (see the module docs).
        // One of the two may fail at EXEC time while the other is done (MULTI does not roll
        // back); the error is returned, and either partial state is one the janitor already
        // handles: a member without its forward entry is dropped by the cleanup, a forward
        // entry without its member is found by the reconciler's sweep once its server dies.
        crate::conn::transaction(conn, vec![self.forward_write(user, server), reverse]).await?;
        Ok(())
    }

    /// Registers many users on one server, pipelined in batches of `batch`.
    pub async fn register_many<'a>(
        &self,
        conn: &RedisConn,
        users: impl IntoIterator<Item = &'a [u8]>,
        server: &ServerId,
        batch: usize,
    ) -> Result<()> {
        let users: Vec<&[u8]> = users.into_iter().collect();
        for user in &users {
            self.check_entry(user)?;
        }
        for chunk in users.chunks(batch.max(1)) {
            if conn.is_cluster() {
                self.register_chunk_on_cluster(conn, chunk, server).await?;
                continue;
            }
            let mut pipe = redis::pipe();
            for user in chunk {
                self.add_register(&mut pipe, user, server);
            }
            let () = pipe.query_async(&mut conn.clone()).await?;
        }
        Ok(())
    }

    /// One pipeline per slot: the registry hash's (layout hash) or one SET per user key,
    /// many in flight (layout keys), then the reverse set's (see the module docs).
    async fn register_chunk_on_cluster(
        &self,
        conn: &RedisConn,
        users: &[&[u8]],
        server: &ServerId,
    ) -> Result<()> {
        match self.layout {
            Layout::Hash => {
                let mut hset = redis::cmd("HSET");
                hset.arg(self.keys.registry());
                for user in users {
                    hset.arg(*user).arg(server.as_str());
                }
                let () = hset.query_async(&mut conn.clone()).await?;
            }
            Layout::Keys | Layout::Conns => {
                let sets = users
                    .iter()
                    .map(|u| self.forward_write(u, server))
                    .collect();
                let _: Vec<()> = crate::conn::each_in_flight(conn, sets).await?;
            }
        }
        let () = redis::cmd("SADD")
            .arg(self.keys.server_users(server))
            .arg(users)
            .query_async(&mut conn.clone())
            .await?;
        Ok(())
    }

    /// A clean disconnect (unregister.lua): drops the forward entry if it still names
    /// `server`, then removes the user from the server's reverse set. A fenced server
    /// still loses the forward entry, gets [`Error::Fenced`] and writes no member.
    /// Layout `conns`: `user` is a member, see [`Registry::unregister_connection`].
    pub async fn unregister(&self, conn: &RedisConn, user: &[u8], server: &ServerId) -> Result<()> {
        if self.layout == Layout::Conns {
            let (connection, user) = conns::member_parts(user)?;
            return self
                .unregister_connection(conn, user, connection, server)
                .await;
        }
        let mut call = self.member_call(&UNREGISTER, user, server);
        if conn.is_cluster() {
            let entry = Entry {
                key: self.forward_key(user),
                field: user,
                layout: self.layout,
            };
            self.release(conn, &entry, server).await?;
        } else {
            call.key(self.forward_key(user));
        }
        unless_fenced(call.invoke_async::<i64>(&mut conn.clone()).await, server).map(drop)
    }

    /// Deletes `user`'s forward entry if it still names `server` (release.lua).
    async fn release(&self, conn: &RedisConn, entry: &Entry<'_>, server: &ServerId) -> Result<()> {
        let mut call = RELEASE.prepare_invoke();
        call.key(&entry.key)
            .arg(entry.field)
            .arg(server.as_str())
            .arg(entry.layout.as_str());
        let _deleted: i64 = call.invoke_async(&mut conn.clone()).await?;
        Ok(())
    }

    /// Refreshes the server's liveness key (TTL `ttl_ms`) and its `servers` score
    /// (heartbeat.lua; on a cluster, then heartbeat_servers.lua in the slot of
    /// `servers`); [`Error::Fenced`] once the server is fenced, with nothing written. The
    /// score is Redis's time: this process's clock plays no part (it is still sent, as
    /// the script's third argument, which the script accepts and does not use).
    pub async fn heartbeat(&self, conn: &RedisConn, server: &ServerId, ttl_ms: u64) -> Result<()> {
        let mut call = HEARTBEAT.prepare_invoke();
        call.key(self.keys.server_fence(server))
            .key(self.keys.server_refusals(server))
            .key(self.keys.server_alive(server));
        if !conn.is_cluster() {
            call.key(self.keys.servers());
        }
        call.arg(server.as_str()).arg(ttl_ms).arg(crate::now_ms());
        unless_fenced(call.invoke_async::<i64>(&mut conn.clone()).await, server)?;
        if conn.is_cluster() {
            // `servers` is in another slot: its score follows a heartbeat that was taken.
            let _: i64 = HEARTBEAT_SERVERS
                .key(self.keys.servers())
                .arg(server.as_str())
                .invoke_async(&mut conn.clone())
                .await?;
        }
        Ok(())
    }
}
