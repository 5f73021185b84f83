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

use std::sync::LazyLock;

use crate::conn::RedisConn;

use crate::{config::Layout, error::Result, event::ServerId, keys::Keys};

static UNREGISTER: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
        -- KEYS[1] forward hash or key, KEYS[2] reverse set; ARGV[1] user, ARGV[2] server,
        -- ARGV[3] layout. The forward entry goes only if it still names this server.
        local owner
        if ARGV[3] == 'hash' then owner = redis.call('HGET', KEYS[1], ARGV[1])
        else owner = redis.call('GET', KEYS[1]) end
        if owner == ARGV[2] then
          if ARGV[3] == 'hash' then redis.call('HDEL', KEYS[1], ARGV[1])
          else redis.call('DEL', KEYS[1]) end
        end
        return redis.call('SREM', KEYS[2], ARGV[1])
        ",
    )
});

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

    /// Registers `user` on `server` (forward entry and reverse set in one MULTI).
    pub async fn register(&self, conn: &RedisConn, user: &[u8], server: &ServerId) -> Result<()> {
        let mut pipe = redis::pipe();
        pipe.atomic();
        self.add_register(&mut pipe, user, server);
        let () = pipe.query_async(&mut conn.clone()).await?;
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
        let mut pipe = redis::pipe();
        let mut n = 0;
        for user in users {
            self.add_register(&mut pipe, user, server);
            n += 1;
            if n == batch {
                let () = pipe.query_async(&mut conn.clone()).await?;
                pipe.clear();
                n = 0;
            }
        }
        if n > 0 {
            let () = pipe.query_async(&mut conn.clone()).await?;
        }
        Ok(())
    }

    /// A clean disconnect: drops the forward entry if it still names `server`, and
    /// removes the user from the server's reverse set.
    pub async fn unregister(&self, conn: &RedisConn, user: &[u8], server: &ServerId) -> Result<()> {
        let forward = match self.layout {
            Layout::Hash => self.keys.registry().into_bytes(),
            Layout::Keys => self.keys.user(user),
        };
        let layout = match self.layout {
            Layout::Hash => "hash",
            Layout::Keys => "keys",
        };
        let mut call = UNREGISTER.prepare_invoke();
        call.key(forward)
            .key(self.keys.server_users(server))
            .arg(user)
            .arg(server.as_str())
            .arg(layout);
        let _: i64 = call.invoke_async(&mut conn.clone()).await?;
        Ok(())
    }

    /// Refreshes the server's liveness key (TTL `ttl_ms`) and its `servers` score.
    pub async fn heartbeat(&self, conn: &RedisConn, server: &ServerId, ttl_ms: u64) -> Result<()> {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("SET")
            .arg(self.keys.server_alive(server))
            .arg(1)
            .arg("PX")
            .arg(ttl_ms)
            .ignore()
            .zadd(self.keys.servers(), server.as_str(), crate::now_ms())
            .ignore();
        let () = pipe.query_async(&mut conn.clone()).await?;
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
