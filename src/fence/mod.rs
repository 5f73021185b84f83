//! Fences: the verdict against a dead server's incarnation, kept in Redis.
//!
//! When a worker takes `server.dead` for S, the first thing it does, before any delete,
//! is record S's fence: `server:{S}:fenced`, a Hash under S's hash tag (so in the slot of
//! S's other keys on a cluster) with a lifetime of `fence_ttl_ms` (days). From then on,
//! the connection-server protocol (`protocol/*.lua`, [`crate::registry`]) refuses every
//! register, heartbeat and unregister of S with the error `FENCED`, and a routing lookup
//! never returns S. The protocol scripts note each refusal in `server:{S}:refused` (one
//! count per operation, `last_ms`; a key apart from the fence, so that a connection
//! server's ACL user can note refusals without being able to create a fence), which is
//! how `status` and the metrics show a fenced server that still tries to write: a false
//! positive, or a zombie.
//!
//! Fields of the fence: `fenced_at_ms` (unix ms of the first verdict), `entry` (the
//! stream entry id of that `server.dead`), and `unknown` = `1` on the fence of a server
//! the registry did not know (below). `janitor:fenced`
//! indexes the fences (member = S, score = unix ms of the latest verdict), so that no
//! SCAN is needed to find them; entries older than `fence_ttl_ms` are pruned as read.
//!
//! **Servers the registry does not know.** A verdict on a server with nothing in the
//! registry (no liveness key, no reverse set, no set being walked or set aside, not in
//! `servers`) protects no entry: its fence lives `fence_unknown_ttl_ms` (minutes, not
//! days), carries `unknown` = `1`, and is not indexed, and the verdict is counted
//! (`registry_janitor_unknown_server_verdicts_total`). A monitoring that names servers
//! the registry never saw (a wrong id, another fleet's) thus costs Redis a little for a
//! short while, where each of its verdicts used to leave a fence and an index entry for
//! `fence_ttl_ms`. Why that stays safe:
//!
//! - whether S is known and the fence are decided in one script, in S's slot
//!   (record.lua): a registration or heartbeat of S lands before it (S is known: the full
//!   fence) or after it (refused as FENCED, for as long as the short fence stands). On a
//!   cluster, `servers` is in another slot: it is read after the script, and a server
//!   found there gets the full fence then (a protocol heartbeat cannot slip in between:
//!   the fence refuses it, and the client writes `servers` only after a heartbeat taken);
//! - server ids name one incarnation (the specification's identifier rule), so an S that
//!   writes after its short fence expired is the very incarnation the verdict named,
//!   which had written nothing when it was given: nothing of it was cleaned, nothing it
//!   writes afterwards is left behind by a cleanup. It must heartbeat before its first
//!   user, so it is in `servers` and judged by its heartbeats like any server: if it is
//!   dead, the reconciler (or a new verdict, now on a known server: the full fence)
//!   cleans it; entries without a live owner are never returned by `route`, and the drift
//!   sweep deletes them;
//! - a fence standing with the full lifetime is never shortened, and a short one becomes
//!   full as soon as a verdict finds S known.

use std::sync::LazyLock;

use serde::Serialize;

use crate::{conn::RedisConn, error::Result, event::ServerId, keys::Keys};

static RECORD: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("record.lua")));

/// The operations of the protocol that a fence refuses, as named in the fields of
/// `server:{S}:refused` and in the metric's `op` label.
pub const OPERATIONS: [&str; 3] = ["register", "heartbeat", "unregister"];

/// The lifetimes of fences: `fence_ttl_ms`, and `fence_unknown_ttl_ms` for a server the
/// registry does not know (0: such a server gets `fence_ttl_ms` too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetimes {
    pub ttl_ms: u64,
    pub unknown_ttl_ms: u64,
}

/// What [`record`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// Unix ms (Redis time) of the first verdict.
    pub fenced_at_ms: u64,
    /// The registry did not know the server: its fence lives `unknown_ttl_ms` and is not
    /// indexed.
    pub unknown: bool,
}

/// Records the fence of `server` (idempotent) with the lifetime `ttl_ms`, known to the
/// registry or not, then indexes it. Returns the unix ms of the first verdict.
pub async fn record(
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    entry: Option<&str>,
    ttl_ms: u64,
) -> Result<u64> {
    let lifetimes = Lifetimes {
        ttl_ms,
        unknown_ttl_ms: 0,
    };
    Ok(record_verdict(conn, keys, server, entry, lifetimes)
        .await?
        .fenced_at_ms)
}

/// Records the fence of a verdict on `server` (idempotent), then indexes it, unless the
/// registry does not know the server (see the module docs): then the fence lives
/// `lifetimes.unknown_ttl_ms` and is not indexed.
pub async fn record_verdict(
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    entry: Option<&str>,
    lifetimes: Lifetimes,
) -> Result<Recorded> {
    let mut reply = record_once(conn, keys, server, entry, lifetimes).await?;
    if reply.unknown && conn.is_cluster() {
        // `servers` is in another slot: read after the fence, so that a server known
        // there gets the full lifetime.
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(keys.servers())
            .arg(server.as_str())
            .query_async(&mut conn.clone())
            .await?;
        if score.is_some() {
            let full = Lifetimes {
                unknown_ttl_ms: 0,
                ..lifetimes
            };
            reply = record_once(conn, keys, server, entry, full).await?;
        }
    }
    if reply.unknown {
        return Ok(Recorded {
            fenced_at_ms: reply.fenced_at,
            unknown: true,
        });
    }
    // The index is for status and metrics only, in another slot on a cluster: the fence
    // above is what the protocol checks.
    let _: i64 = redis::cmd("ZADD")
        .arg(keys.fences())
        .arg(reply.now)
        .arg(server.as_str())
        .query_async(&mut conn.clone())
        .await?;
    Ok(Recorded {
        fenced_at_ms: reply.fenced_at,
        unknown: false,
    })
}

/// One call of record.lua.
async fn record_once(
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    entry: Option<&str>,
    lifetimes: Lifetimes,
) -> Result<RecordReply> {
    let mut call = RECORD.prepare_invoke();
    call.key(keys.server_fence(server))
        .key(keys.server_alive(server))
        .key(keys.server_users(server))
        .key(keys.server_walking(server))
        .key(keys.server_moved(server));
    if !conn.is_cluster() {
        call.key(keys.servers());
    }
    call.arg(lifetimes.ttl_ms)
        .arg(entry.unwrap_or(""))
        .arg(lifetimes.unknown_ttl_ms)
        .arg(server.as_str());
    Ok(call.invoke_async(&mut conn.clone()).await?)
}

/// record.lua's reply: {the unix ms of the first verdict, Redis's time now (unix ms),
/// whether the registry does not know the server}.
struct RecordReply {
    fenced_at: u64,
    now: u64,
    unknown: bool,
}

impl redis::FromRedisValue for RecordReply {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = crate::reply::Fields::new("fence/record.lua", v, 3)?;
        Ok(RecordReply {
            fenced_at: f.next("fenced_at_ms")?,
            now: f.next("now")?,
            unknown: f.next("unknown")?,
        })
    }
}

/// True if `server` is fenced now.
pub async fn is_fenced(conn: &RedisConn, keys: &Keys, server: &ServerId) -> Result<bool> {
    Ok(redis::cmd("EXISTS")
        .arg(keys.server_fence(server))
        .query_async(&mut conn.clone())
        .await?)
}

/// One standing fence, as `status` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Fence {
    pub server_id: String,
    pub fenced_at_ms: u64,
    /// The stream entry of the `server.dead` that fenced it.
    pub entry: Option<String>,
    /// Writes refused since, by operation (see [`OPERATIONS`]).
    pub refused_register: u64,
    pub refused_heartbeat: u64,
    pub refused_unregister: u64,
    /// The last refused write (unix ms), if any.
    pub last_refused_ms: Option<u64>,
}

impl Fence {
    /// Writes refused since the verdict, all operations.
    pub fn refused(&self) -> u64 {
        self.refused_register + self.refused_heartbeat + self.refused_unregister
    }

    /// Refused writes of one operation of [`OPERATIONS`].
    pub fn refused_of(&self, op: &str) -> u64 {
        match op {
            "register" => self.refused_register,
            "heartbeat" => self.refused_heartbeat,
            "unregister" => self.refused_unregister,
            _ => 0,
        }
    }

    /// Did the fenced server try to write within `window_ms` before `now_ms`?
    pub fn writing(&self, now_ms: u64, window_ms: u64) -> bool {
        self.last_refused_ms
            .is_some_and(|t| t.saturating_add(window_ms) >= now_ms)
    }
}

/// Fences read per round trip.
const PAGE: usize = 500;

/// Every standing fence, from the index (an entry whose fence has expired is skipped).
/// With `prune_after_ms`, index entries older than that (the `fence_ttl_ms`) are removed
/// first (the reconciler does it; `status` only reads).
pub async fn standing(
    conn: &RedisConn,
    keys: &Keys,
    prune_after_ms: Option<u64>,
) -> Result<Vec<Fence>> {
    if let Some(ttl_ms) = prune_after_ms {
        // By Redis's time, which the scores are.
        let oldest = crate::clock::now_ms(conn, keys)
            .await?
            .saturating_sub(ttl_ms);
        let _: i64 = redis::cmd("ZREMRANGEBYSCORE")
            .arg(keys.fences())
            .arg("-inf")
            .arg(format!("({oldest}"))
            .query_async(&mut conn.clone())
            .await?;
    }
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys.fences())
        .arg(0)
        .arg(-1)
        .query_async(&mut conn.clone())
        .await?;
    let servers: Vec<ServerId> = members
        .iter()
        .filter_map(|m| ServerId::parse(m).ok())
        .collect();
    let mut fences = Vec::new();
    for page in servers.chunks(PAGE) {
        let reads = |key: fn(&Keys, &ServerId) -> String| {
            page.iter()
                .map(|s| redis::cmd("HGETALL").arg(key(keys, s)).to_owned())
                .collect()
        };
        type Fields = std::collections::HashMap<String, String>;
        let records: Vec<Fields> =
            crate::conn::each_in_flight(conn, reads(Keys::server_fence)).await?;
        let notes: Vec<Fields> =
            crate::conn::each_in_flight(conn, reads(Keys::server_refusals)).await?;
        for ((server, fields), notes) in page.iter().zip(records).zip(notes) {
            if fields.is_empty() {
                continue;
            }
            let number = |name: &str| fields.get(name).and_then(|v| v.parse::<u64>().ok());
            let noted = |name: &str| notes.get(name).and_then(|v| v.parse::<u64>().ok());
            fences.push(Fence {
                server_id: server.as_str().to_owned(),
                fenced_at_ms: number("fenced_at_ms").unwrap_or(0),
                entry: fields.get("entry").cloned(),
                refused_register: noted("register").unwrap_or(0),
                refused_heartbeat: noted("heartbeat").unwrap_or(0),
                refused_unregister: noted("unregister").unwrap_or(0),
                last_refused_ms: noted("last_ms"),
            });
        }
    }
    Ok(fences)
}
