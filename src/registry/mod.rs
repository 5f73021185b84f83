//! The connection-server side of the registry, for connection servers written in Rust
//! (and for the demo, the benchmark and the tests, which play that part).
//!
//! | operation    | Redis commands (layout `hash`; `keys` uses SET/GET user:<user>) |
//! |--------------|-------------------------------------------------------------------|
//! | register     | MULTI; HSET registry <user> <server>; SADD server:{<server>}:users <user>; EXEC |
//! | unregister   | the forward entry deleted only if it still names <server>; SREM   |
//! | heartbeat    | SET server:{<server>}:alive 1 PX <ttl>; ZADD servers <now_ms> <server> |
//!
//! A user moving to another server is a `register` on the new server: the forward entry
//! now names it, and the old server's reverse set may still list the user (the janitor
//! leaves such entries alone).
//!
//! On a Redis Cluster the forward entry and the reverse set are in different slots, so no
//! MULTI can hold both: `register` writes the forward entry first, then the reverse set.
//! That order is what lets a cleanup promise that no member added to S's set before its
//! acknowledgement keeps an entry naming S: the member is written last, so by the time
//! it can be walked, the entry it stands for is there to be checked. (The other order
//! lets a cleanup walk the member before its entry exists, and acknowledge while the
//! entry is still to be written.) A crash between the two writes leaves an entry that no
//! index knows: the connection server is gone, so its owner soon has no liveness key, and
//! the drift sweep deletes such an entry.

use std::sync::LazyLock;

use crate::conn::RedisConn;

use crate::{config::Layout, error::Result, event::ServerId, keys::Keys};

static UNREGISTER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("unregister.lua")));

/// Writes and reads the registry as a connection server does.
#[derive(Debug, Clone)]
pub struct Registry {
    keys: Keys,
    layout: Layout,
}

impl Registry {
    pub fn new(keys: Keys, layout: Layout) -> Self {
        Registry { keys, layout }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Adds the commands that register `user` on `server` to `pipe` (for bulk loads).
    pub fn add_register(&self, pipe: &mut redis::Pipeline, user: &[u8], server: &ServerId) {
        match self.layout {
            Layout::Hash => pipe.hset(self.keys.registry(), user, server.as_str()),
            Layout::Keys => pipe.set(self.keys.user(user), server.as_str()),
        }
        .ignore()
        .sadd(self.keys.server_users(server), user)
        .ignore();
    }

    /// Registers `user` on `server` (reverse set and forward entry in one MULTI; on a
    /// cluster, one after the other).
    pub async fn register(&self, conn: &RedisConn, user: &[u8], server: &ServerId) -> Result<()> {
        let mut reverse = redis::cmd("SADD");
        reverse.arg(self.keys.server_users(server)).arg(user);
        let forward = match self.layout {
            Layout::Hash => redis::cmd("HSET")
                .arg(self.keys.registry())
                .arg(user)
                .arg(server.as_str())
                .to_owned(),
            Layout::Keys => redis::cmd("SET")
                .arg(self.keys.user(user))
                .arg(server.as_str())
                .to_owned(),
        };
        // Forward entry first: the order that matters on a cluster (see the module docs).
        // One of the two may fail at EXEC time while the other is done (MULTI does not roll
        // back); the error is returned, and either partial state is one the janitor already
        // handles: a member without its forward entry is dropped by the cleanup, a forward
        // entry without its member is found by the reconciler's sweep once its server dies.
        crate::conn::transaction(conn, vec![forward, reverse]).await?;
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
            Layout::Keys => {
                let sets = users
                    .iter()
                    .map(|u| {
                        redis::cmd("SET")
                            .arg(self.keys.user(u))
                            .arg(server.as_str())
                            .to_owned()
                    })
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

    /// A clean disconnect: drops the forward entry if it still names `server`, then
    /// removes the user from the server's reverse set.
    pub async fn unregister(&self, conn: &RedisConn, user: &[u8], server: &ServerId) -> Result<()> {
        let (forward, layout) = match self.layout {
            Layout::Hash => (self.keys.registry().into_bytes(), "hash"),
            Layout::Keys => (self.keys.user(user), "keys"),
        };
        let mut call = UNREGISTER.prepare_invoke();
        call.key(forward).arg(user).arg(server.as_str()).arg(layout);
        let _: i64 = call.invoke_async(&mut conn.clone()).await?;
        let _: i64 = redis::cmd("SREM")
            .arg(self.keys.server_users(server))
            .arg(user)
            .query_async(&mut conn.clone())
            .await?;
        Ok(())
    }

    /// Refreshes the server's liveness key (TTL `ttl_ms`) and its `servers` score.
    pub async fn heartbeat(&self, conn: &RedisConn, server: &ServerId, ttl_ms: u64) -> Result<()> {
        let mut alive = redis::cmd("SET");
        alive
            .arg(self.keys.server_alive(server))
            .arg(1)
            .arg("PX")
            .arg(ttl_ms);
        let mut seen = redis::cmd("ZADD");
        seen.arg(self.keys.servers())
            .arg(crate::now_ms())
            .arg(server.as_str());
        // Either write alone is a fresher sign of life, never a false death; an error in
        // one (EXEC does not roll back) is returned and the next heartbeat writes both.
        crate::conn::transaction(conn, vec![alive, seen]).await?;
        Ok(())
    }

    /// The server a user's forward entry names, if any.
    pub async fn owner(&self, conn: &RedisConn, user: &[u8]) -> Result<Option<String>> {
        let owner: Option<String> = match self.layout {
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

    /// Owners of many users at once (HMGET or MGET), in order.
    pub async fn owners(&self, conn: &RedisConn, users: &[Vec<u8>]) -> Result<Vec<Option<String>>> {
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
