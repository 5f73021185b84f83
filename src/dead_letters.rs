//! `registry-janitor dead-letters`: inspect, replay and purge the dead-letter stream.
//!
//! A dead letter is the original entry's fields plus `error` and `failed_at_ms` (an
//! original field already called so is kept as `original_<name>`). Replay strips the
//! janitor's fields, restores the originals and publishes the entry again on the events
//! stream, and deletes the dead letter only if that publish succeeded, in one script
//! (replay.lua), so an entry is never in both streams nor in neither (MULTI/EXEC would
//! not do: it runs the XDEL after a failed XADD). On a cluster, where the two streams are
//! in different slots, XADD then XDEL: a crash between them leaves it in both, never in
//! neither.

use crate::conn::RedisConn;
use serde::Serialize;

use crate::{
    error::{Error, Result},
    event::{Entry, ServerDead, FIELD_PAYLOAD},
    keys::Keys,
    stream,
};

/// One dead letter, as shown by `list`.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    pub id: String,
    pub error: String,
    pub failed_at_ms: Option<u64>,
    /// The original `type`, if any (lossy UTF-8).
    pub kind: Option<String>,
    /// The server id, when the payload still decodes.
    pub server_id: Option<String>,
    /// The original fields' names (lossy UTF-8).
    pub fields: Vec<String>,
}

impl DeadLetter {
    fn from_entry(e: &Entry) -> Self {
        let text = |name: &str| {
            e.field(name)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        DeadLetter {
            id: e.id.clone(),
            error: text("error").unwrap_or_default(),
            failed_at_ms: text("failed_at_ms").and_then(|t| t.parse().ok()),
            kind: text("type"),
            server_id: e
                .field(FIELD_PAYLOAD)
                .and_then(|p| rmp_serde::from_slice::<ServerDead>(p).ok())
                .map(|ev| ev.server_id),
            fields: original_fields(e)
                .iter()
                .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
                .collect(),
        }
    }
}

/// The entry as it was before it was dead-lettered.
pub fn original_fields(dead: &Entry) -> Vec<(Vec<u8>, Vec<u8>)> {
    dead.fields
        .iter()
        .filter(|(k, _)| k != b"error" && k != b"failed_at_ms")
        .map(|(k, v)| match k.strip_prefix(b"original_") {
            Some(name) if name == b"error" || name == b"failed_at_ms" => (name.to_vec(), v.clone()),
            _ => (k.clone(), v.clone()),
        })
        .collect()
}

/// The oldest `count` dead letters.
pub async fn list(conn: &RedisConn, keys: &Keys, count: usize) -> Result<Vec<DeadLetter>> {
    Ok(read(conn, keys, count, None)
        .await?
        .iter()
        .map(DeadLetter::from_entry)
        .collect())
}

async fn read(conn: &RedisConn, keys: &Keys, count: usize, id: Option<&str>) -> Result<Vec<Entry>> {
    let (start, end) = id.map_or(("-", "+"), |i| (i, i));
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(keys.dead_letters())
        .arg(start)
        .arg(end)
        .arg("COUNT")
        .arg(count)
        .query_async(&mut conn.clone())
        .await?;
    let redis::Value::Array(items) = reply else {
        return Err(Error::Protocol("XRANGE reply is not an array".into()));
    };
    let mut out = Vec::new();
    for item in items {
        out.extend(stream::parse_entry(item)?);
    }
    Ok(out)
}

static REPLAY: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("replay.lua")));

/// Publishes dead letters `ids` (all of them, oldest first, when empty) again on the
/// events stream. Returns (dead-letter id, new events id) pairs.
pub async fn replay(
    conn: &RedisConn,
    keys: &Keys,
    ids: &[String],
) -> Result<Vec<(String, String)>> {
    let entries = if ids.is_empty() {
        read(conn, keys, usize::MAX >> 1, None).await?
    } else {
        let mut found = Vec::new();
        for id in ids {
            let e = read(conn, keys, 1, Some(id)).await?;
            if e.is_empty() {
                return Err(Error::NotFound {
                    what: "dead letter",
                    id: id.clone(),
                });
            }
            found.extend(e);
        }
        found
    };
    let mut replayed = Vec::new();
    for dead in entries {
        let fields = original_fields(&dead);
        let new_id: String = if conn.is_cluster() || fields.len() > stream::MAX_SCRIPT_FIELDS {
            // Two slots, no script: a crash between the two leaves the dead letter in place
            // too; replaying it again is harmless, the cleanup is idempotent.
            let mut xadd = redis::cmd("XADD");
            xadd.arg(keys.events()).arg(crate::keys::ids::AUTO);
            for (k, v) in &fields {
                xadd.arg(k).arg(v);
            }
            let new_id = xadd.query_async(&mut conn.clone()).await?;
            let _: i64 = redis::cmd("XDEL")
                .arg(keys.dead_letters())
                .arg(&dead.id)
                .query_async(&mut conn.clone())
                .await?;
            new_id
        } else {
            let mut call = REPLAY.prepare_invoke();
            call.key(keys.events())
                .key(keys.dead_letters())
                .arg(&dead.id);
            for (k, v) in &fields {
                call.arg(k).arg(v);
            }
            call.invoke_async(&mut conn.clone()).await?
        };
        replayed.push((dead.id, new_id));
    }
    Ok(replayed)
}

/// Deletes dead letters `ids`, or the whole dead-letter stream when `ids` is empty.
/// Returns how many were deleted.
pub async fn purge(conn: &RedisConn, keys: &Keys, ids: &[String]) -> Result<u64> {
    let mut c = conn.clone();
    if ids.is_empty() {
        // MULTI does not stop at a failing command: were the key not a stream, XLEN would
        // fail and DEL still delete it. So its type is checked first (XLEN alone fails on
        // a key that is not a stream); the MULTI then counts exactly what it deletes. Not a
        // script, so that a role without DEL is refused with the command named.
        let _: u64 = redis::cmd("XLEN")
            .arg(keys.dead_letters())
            .query_async(&mut c)
            .await?;
        let (n, _): (u64, i64) = redis::pipe()
            .atomic()
            .xlen(keys.dead_letters())
            .del(keys.dead_letters())
            .query_async(&mut c)
            .await?;
        return Ok(n);
    }
    Ok(redis::cmd("XDEL")
        .arg(keys.dead_letters())
        .arg(ids)
        .query_async(&mut c)
        .await?)
}
