//! The evictions stream: who lost their forward entry, for the rest of the stack.
//!
//! Presence, room membership, per-node session sets and the like also hold the users of a
//! dead server. The janitor knows, at each atomic delete, exactly which users lost their
//! entry, and publishes that on `registry:evictions` (under `key_prefix`; the name and
//! the switch are the settings `evictions_stream` and `evictions`), so that those systems
//! react without a scan of their own:
//!
//! - `users.evicted`: the users one cleanup step (or one drift-sweep step) deleted, at
//!   most [`MAX_USERS_PER_ENTRY`] per entry, with the server, the `server.dead`'s
//!   `event_id` and a `source` (`cleanup` or `sweep`);
//! - `connections.evicted` (layout `conns`): the (user, connection) pairs one step
//!   deleted, at most [`MAX_USERS_PER_ENTRY`] pairs per entry, with the same fields
//!   otherwise (`connections` instead of `users`);
//! - `server.cleaned`: once per acknowledged `server.dead`, with the cleanup's totals.
//!
//! Each entry has the fields `type` and `payload`, a MessagePack map with named keys
//! (user ids as binary strings: they may be any bytes), like the events stream. On one
//! node the entry is written by the very script that deletes (announce.lua, the Lua
//! prelude of the cleanup and sweep scripts): a user is announced exactly once, exactly
//! when their entry is deleted. On a cluster the stream is in another slot than the
//! entries, so the announcement follows the deletes ([`announce_evicted`]) and the
//! guarantee is at least once: a repeated chunk announces again the members whose entry
//! is already gone (see `cleanup/cluster.rs`).
//!
//! Retention is the events stream's (maintenance/trim_stream.lua): entries older than
//! `retention_ms` go, never one that a consumer group has not read or acknowledged up to
//! `stream_max_age_ms`, past which every entry goes; a stream no group reads is trimmed
//! by age alone.

use serde::Serialize;

use crate::{conn::RedisConn, error::Result, event::ServerId, keys::Keys};

/// Users in one `users.evicted` entry at most (a bigger step writes several entries).
pub const MAX_USERS_PER_ENTRY: usize = 1000;
/// The payloads' schema version.
pub const VERSION: u64 = 1;

/// Who deleted the entries of a `users.evicted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The cleanup of a `server.dead`.
    Cleanup,
    /// The reconciler's drift sweep (entries of a dead owner that no index listed).
    Sweep,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Cleanup => "cleanup",
            Source::Sweep => "sweep",
        }
    }
}

/// One entry of the evictions stream, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Eviction {
    Evicted {
        source: Option<String>,
        server_id: String,
        event_id: String,
        users: Vec<Vec<u8>>,
        evicted_at_ms: u64,
    },
    /// Layout `conns`: the (user id, connection id) pairs whose entry was deleted.
    ConnectionsEvicted {
        source: Option<String>,
        server_id: String,
        event_id: String,
        connections: Vec<(Vec<u8>, String)>,
        evicted_at_ms: u64,
    },
    Cleaned {
        server_id: String,
        event_id: String,
        deleted: u64,
        kept: u64,
        cleaned_at_ms: u64,
    },
}

/// What the payloads' `expect` relies on: rmp's writers fail only when their writer does,
/// and a `Vec<u8>` takes every byte.
const WRITING_TO_A_VEC: &str = "writing MessagePack to a Vec<u8> cannot fail";

/// A `users.evicted` payload (MessagePack map with named keys, users as binary).
pub fn evicted_payload(
    server: &ServerId,
    event_id: &str,
    source: Source,
    users: &[Vec<u8>],
    at_ms: u64,
) -> Vec<u8> {
    let size = users.iter().map(|u| u.len() + 3).sum::<usize>();
    evictions_payload(
        server,
        event_id,
        source,
        at_ms,
        "users",
        users.len(),
        size,
        |w| {
            for u in users {
                rmp::encode::write_bin(w, u)?;
            }
            Ok(())
        },
    )
}

/// A `connections.evicted` payload (layout `conns`): like `users.evicted`, with
/// `connections`, an array of [user id (binary), connection id (string)], for `users`.
pub fn connections_evicted_payload(
    server: &ServerId,
    event_id: &str,
    source: Source,
    connections: &[(&[u8], &str)],
    at_ms: u64,
) -> Vec<u8> {
    let size = connections
        .iter()
        .map(|(u, c)| u.len() + c.len() + 5)
        .sum::<usize>();
    let count = connections.len();
    evictions_payload(
        server,
        event_id,
        source,
        at_ms,
        "connections",
        count,
        size,
        |w| {
            for (user, connection) in connections {
                rmp::encode::write_array_len(w, 2)?;
                rmp::encode::write_bin(w, user)?;
                rmp::encode::write_str(w, connection)?;
            }
            Ok(())
        },
    )
}

/// The map both eviction payloads share: `v`, `source`, `server_id`, `event_id`, the
/// array `list` of `count` items that `items` writes (about `size` bytes), and
/// `evicted_at_ms`.
#[allow(clippy::too_many_arguments)]
fn evictions_payload(
    server: &ServerId,
    event_id: &str,
    source: Source,
    at_ms: u64,
    list: &str,
    count: usize,
    size: usize,
    items: impl Fn(&mut Vec<u8>) -> Result<(), rmp::encode::ValueWriteError>,
) -> Vec<u8> {
    use rmp::encode::*;
    let mut out = Vec::with_capacity(96 + size);
    let write = |w: &mut Vec<u8>| -> Result<(), ValueWriteError> {
        write_map_len(w, 6)?;
        write_str(w, "v")?;
        write_uint(w, VERSION)?;
        write_str(w, "source")?;
        write_str(w, source.as_str())?;
        write_str(w, "server_id")?;
        write_str(w, server.as_str())?;
        write_str(w, "event_id")?;
        write_str(w, event_id)?;
        write_str(w, list)?;
        write_array_len(w, count as u32)?;
        items(w)?;
        write_str(w, "evicted_at_ms")?;
        write_uint(w, at_ms)?;
        Ok(())
    };
    write(&mut out).expect(WRITING_TO_A_VEC);
    out
}

/// A `server.cleaned` payload.
pub fn cleaned_payload(
    server: &ServerId,
    event_id: &str,
    deleted: u64,
    kept: u64,
    at_ms: u64,
) -> Vec<u8> {
    use rmp::encode::*;
    let mut out = Vec::with_capacity(128);
    let write = |w: &mut Vec<u8>| -> Result<(), ValueWriteError> {
        write_map_len(w, 6)?;
        for (key, value) in [("v", None), ("server_id", Some(server.as_str()))] {
            write_str(w, key)?;
            match value {
                None => write_uint(w, VERSION).map(|_| ())?,
                Some(s) => write_str(w, s)?,
            }
        }
        write_str(w, "event_id")?;
        write_str(w, event_id)?;
        for (key, n) in [
            ("deleted", deleted),
            ("kept", kept),
            ("cleaned_at_ms", at_ms),
        ] {
            write_str(w, key)?;
            write_uint(w, n)?;
        }
        Ok(())
    };
    write(&mut out).expect(WRITING_TO_A_VEC);
    out
}

/// Where the deletes and the stream cannot be one script (a cluster): refuses the work
/// before any delete when the evictions stream's key holds another type, as
/// `check_evictions_stream` in announce.lua does on one node. An XADD failing after the
/// deletes would leave them unannounced. A no-op when the stream is off.
pub async fn check_stream(conn: &RedisConn, keys: &Keys) -> Result<()> {
    let Some(stream) = keys.evictions() else {
        return Ok(());
    };
    let kind: String = redis::cmd("TYPE")
        .arg(stream)
        .query_async(&mut conn.clone())
        .await?;
    match kind.as_str() {
        "none" | "stream" => Ok(()),
        other => Err(crate::error::Error::Protocol(format!(
            "WRONGTYPE the evictions stream {stream} holds a {other}, not a stream (setting `evictions_stream`)"
        ))),
    }
}

/// XADDs `users.evicted` entries for `users` (already deleted), [`MAX_USERS_PER_ENTRY`]
/// per entry; a no-op when the stream is off. Returns the entries written. Used where
/// the deletes and the stream cannot be one script (a cluster).
pub async fn announce_evicted(
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    event_id: &str,
    source: Source,
    users: &[Vec<u8>],
) -> Result<u64> {
    let Some(stream) = keys.evictions() else {
        return Ok(0);
    };
    if users.is_empty() {
        return Ok(0);
    }
    let at = crate::now_ms();
    let mut pipe = redis::pipe();
    let mut entries = 0;
    for chunk in users.chunks(MAX_USERS_PER_ENTRY) {
        pipe.cmd("XADD")
            .arg(stream)
            .arg(crate::keys::ids::AUTO)
            .arg("type")
            .arg("users.evicted")
            .arg("payload")
            .arg(evicted_payload(server, event_id, source, chunk, at))
            .ignore();
        entries += 1;
    }
    let () = pipe.query_async(&mut conn.clone()).await?;
    Ok(entries)
}

/// The announcement of deleted reverse-set members in `layout`: `users.evicted`
/// ([`announce_evicted`]) for layouts `hash` and `keys`, `connections.evicted` for layout
/// `conns` (members `<connection id> <user id>`; one of another shape is left out).
pub async fn announce_members(
    conn: &RedisConn,
    keys: &Keys,
    layout: crate::config::Layout,
    server: &ServerId,
    event_id: &str,
    source: Source,
    members: &[Vec<u8>],
) -> Result<u64> {
    if layout != crate::config::Layout::Conns {
        return announce_evicted(conn, keys, server, event_id, source, members).await;
    }
    let Some(stream) = keys.evictions() else {
        return Ok(0);
    };
    let pairs: Vec<(&[u8], &str)> = members
        .iter()
        .filter_map(|m| {
            let (connection, user) = crate::keys::split_conn_member(m)?;
            Some((user, std::str::from_utf8(connection).ok()?))
        })
        .collect();
    if pairs.is_empty() {
        return Ok(0);
    }
    let at = crate::now_ms();
    let mut pipe = redis::pipe();
    let mut entries = 0;
    for chunk in pairs.chunks(MAX_USERS_PER_ENTRY) {
        pipe.cmd("XADD")
            .arg(stream)
            .arg(crate::keys::ids::AUTO)
            .arg("type")
            .arg("connections.evicted")
            .arg("payload")
            .arg(connections_evicted_payload(
                server, event_id, source, chunk, at,
            ))
            .ignore();
        entries += 1;
    }
    let () = pipe.query_async(&mut conn.clone()).await?;
    Ok(entries)
}

/// XADDs the `server.cleaned` entry of a finished cleanup (a no-op when the stream is off).
pub async fn announce_cleaned(
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    event_id: &str,
    deleted: u64,
    kept: u64,
) -> Result<()> {
    let Some(stream) = keys.evictions() else {
        return Ok(());
    };
    let () = redis::cmd("XADD")
        .arg(stream)
        .arg(crate::keys::ids::AUTO)
        .arg("type")
        .arg("server.cleaned")
        .arg("payload")
        .arg(cleaned_payload(
            server,
            event_id,
            deleted,
            kept,
            crate::now_ms(),
        ))
        .query_async(&mut conn.clone())
        .await?;
    Ok(())
}

/// Decodes one entry's `type` and `payload`; `None` for another type or a payload that is
/// not one of ours.
pub fn decode(kind: &str, payload: &[u8]) -> Option<Eviction> {
    let value = rmpv::decode::read_value(&mut &payload[..]).ok()?;
    let map = value.as_map()?;
    let get = |name: &str| {
        map.iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
    };
    let text = |name: &str| get(name).and_then(|v| v.as_str()).map(str::to_owned);
    let number = |name: &str| get(name).and_then(|v| v.as_u64());
    match kind {
        "users.evicted" => Some(Eviction::Evicted {
            source: text("source"),
            server_id: text("server_id")?,
            event_id: text("event_id")?,
            users: get("users")?
                .as_array()?
                .iter()
                .map(|u| match u {
                    rmpv::Value::Binary(b) => Some(b.clone()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?,
            evicted_at_ms: number("evicted_at_ms")?,
        }),
        "connections.evicted" => Some(Eviction::ConnectionsEvicted {
            source: text("source"),
            server_id: text("server_id")?,
            event_id: text("event_id")?,
            connections: get("connections")?
                .as_array()?
                .iter()
                .map(|pair| match pair.as_array()?.as_slice() {
                    [rmpv::Value::Binary(user), connection] => {
                        Some((user.clone(), connection.as_str()?.to_owned()))
                    }
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?,
            evicted_at_ms: number("evicted_at_ms")?,
        }),
        "server.cleaned" => Some(Eviction::Cleaned {
            server_id: text("server_id")?,
            event_id: text("event_id")?,
            deleted: number("deleted")?,
            kept: number("kept")?,
            cleaned_at_ms: number("cleaned_at_ms")?,
        }),
        _ => None,
    }
}

/// Every entry of the evictions stream, in order, decoded (`None` for entries that are
/// not ours). For the demo, status and tests: it reads the whole stream.
pub async fn read_all(conn: &RedisConn, keys: &Keys) -> Result<Vec<(String, Option<Eviction>)>> {
    let Some(stream) = keys.evictions() else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    let mut start = "-".to_owned();
    loop {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn.clone())
            .await?;
        let n = reply.ids.len();
        for entry in reply.ids {
            let field = |name: &str| match entry.map.get(name) {
                Some(redis::Value::BulkString(b)) => Some(b.clone()),
                _ => None,
            };
            let decoded = match (field("type"), field("payload")) {
                (Some(kind), Some(payload)) => decode(&String::from_utf8_lossy(&kind), &payload),
                _ => None,
            };
            start = format!("({}", entry.id);
            out.push((entry.id, decoded));
        }
        if n < 1000 {
            return Ok(out);
        }
    }
}
