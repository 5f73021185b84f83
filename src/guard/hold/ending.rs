//! The ways a hold ends (dropped, released, discarded), the operator's list, and the
//! reads of stored holds that the upkeep makes.

use std::sync::LazyLock;

use tracing::warn;

use super::{Hold, HoldState, HELD_CONSUMER};
use crate::{
    conn::RedisConn,
    error::{Error, Result},
    event::ServerDead,
    keys::{Keys, GROUP},
    reply::Fields,
    stream,
};

static FORGET: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../forget.lua")));

static PARK: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../park.lua")));

/// The holds standing now, oldest first.
pub async fn list(conn: &RedisConn, keys: &Keys) -> Result<Vec<Hold>> {
    let raw: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.guard_held())
        .query_async(&mut conn.clone())
        .await?;
    let mut holds = Vec::with_capacity(raw.len());
    for (server, json) in raw {
        match parse_hold(&json) {
            Ok(hold) => holds.push(hold),
            Err(e) => warn!(server_id = %server, error = %e, "guard: unreadable hold left alone"),
        }
    }
    holds.sort_by_key(|h| (h.since_ms, h.server_id.clone()));
    Ok(holds)
}

/// Lets a held verdict go: the next worker to take its entry proceeds. False if the hold
/// is no longer the one of this entry.
pub async fn release(
    conn: &RedisConn,
    keys: &Keys,
    hold: &Hold,
    claim_min_idle_ms: u64,
) -> Result<bool> {
    let forgot: Forgot = FORGET
        .key(keys.guard_held())
        .arg(&hold.server_id)
        .arg(&hold.entry)
        .arg("released")
        .arg("held")
        .invoke_async(&mut conn.clone())
        .await?;
    if forgot.changed {
        park(conn, keys, &hold.entry, claim_min_idle_ms).await?;
    }
    Ok(forgot.changed)
}

/// Discards a held verdict on an operator's word: its entry goes to the dead-letter
/// stream with `why` (replayable), and the hold is forgotten. False if the hold is no
/// longer the one of this entry.
pub async fn discard(conn: &RedisConn, keys: &Keys, hold: &Hold, why: &str) -> Result<bool> {
    // Held -> discarding, atomically: a hold released meanwhile (a worker may be fencing
    // its server now) is not discarded. A discard that stopped half-way is finished by
    // the next one.
    if hold.state != HoldState::Discarding {
        let forgot: Forgot = FORGET
            .key(keys.guard_held())
            .arg(&hold.server_id)
            .arg(&hold.entry)
            .arg("discarding")
            .arg("held")
            .invoke_async(&mut conn.clone())
            .await?;
        if !forgot.changed {
            return Ok(false);
        }
    }
    let entries: redis::Value = redis::cmd("XRANGE")
        .arg(keys.events())
        .arg(&hold.entry)
        .arg(&hold.entry)
        .query_async(&mut conn.clone())
        .await?;
    let found = match entries {
        redis::Value::Array(mut items) if !items.is_empty() => {
            stream::parse_entry(items.swap_remove(0))?
        }
        _ => None,
    };
    match found {
        Some(entry) => stream::dead_letter(conn, keys, &entry, why).await?,
        None => {
            stream::ack(conn, keys, &hold.entry).await?;
        }
    }
    forget(conn, keys, &hold.server_id, &hold.entry).await?;
    Ok(true)
}

/// Forgets the hold of `entry` against `server`; the holds left, or None if the hold
/// was not (or no longer) the one of this entry.
pub(super) async fn forget(
    conn: &RedisConn,
    keys: &Keys,
    server: &str,
    entry: &str,
) -> Result<Option<i64>> {
    let forgot: Forgot = FORGET
        .key(keys.guard_held())
        .arg(server)
        .arg(entry)
        .arg("")
        .arg("")
        .invoke_async(&mut conn.clone())
        .await?;
    if forgot.changed && forgot.holds_left == 0 {
        warn!("guard: the hold ended, no verdict is held");
    }
    Ok(forgot.changed.then_some(forgot.holds_left))
}

pub(super) async fn park(conn: &RedisConn, keys: &Keys, entry: &str, idle_ms: u64) -> Result<bool> {
    let parked: bool = PARK
        .key(keys.events())
        .arg(GROUP)
        .arg(HELD_CONSUMER)
        .arg(entry)
        .arg(idle_ms)
        .invoke_async(&mut conn.clone())
        .await?;
    Ok(parked)
}

/// forget.lua's reply, {changed (0/1), holds left}.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Forgot {
    /// The hold was the one of the entry, and was changed (or forgotten).
    changed: bool,
    holds_left: i64,
}

impl redis::FromRedisValue for Forgot {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("forget.lua", v, 2)?;
        Ok(Forgot {
            changed: f.next("changed")?,
            holds_left: f.next("holds left")?,
        })
    }
}

/// Whether the stream still holds `entry`.
pub(super) async fn entry_exists(conn: &RedisConn, keys: &Keys, entry: &str) -> Result<bool> {
    let found: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg(keys.events())
        .arg(entry)
        .arg(entry)
        .query_async(&mut conn.clone())
        .await?;
    Ok(!found.is_empty())
}

/// A held verdict whose stream entry was deleted: written to the dead-letter stream from
/// what the hold recorded, so that it can be replayed.
pub(super) async fn dead_letter_lost(conn: &RedisConn, keys: &Keys, hold: &Hold) -> Result<()> {
    let event = ServerDead {
        v: crate::event::SCHEMA_VERSION as i64,
        event_id: hold.event_id.clone(),
        server_id: hold.server_id.clone(),
        detected_at_ms: hold.since_ms,
        reason: hold.reason.clone(),
        source: hold.source.clone(),
    };
    let entry = crate::event::Entry {
        id: hold.entry.clone(),
        fields: vec![
            (b"type".to_vec(), b"server.dead".to_vec()),
            (b"payload".to_vec(), event.encode()),
        ],
    };
    let why = format!(
        "held by the guard ({}: {}), and its entry was deleted from the stream meanwhile",
        hold.doubt.as_str(),
        hold.detail
    );
    stream::dead_letter(conn, keys, &entry, &why).await?;
    warn!(server_id = %hold.server_id, entry = %hold.entry, "guard: a held verdict's entry was deleted from the stream; dead-lettered from the hold");
    Ok(())
}

/// The consumer holding `entry` and its idle time (ms), or None if it is not pending.
pub(super) async fn pending(
    conn: &RedisConn,
    keys: &Keys,
    entry: &str,
) -> Result<Option<(String, u64)>> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(keys.events())
        .arg(GROUP)
        .arg(entry)
        .arg(entry)
        .arg(1)
        .query_async(&mut conn.clone())
        .await?;
    Ok(rows
        .into_iter()
        .next()
        .map(|(_, owner, idle, _)| (owner, idle)))
}

pub(super) fn parse_hold(json: &str) -> Result<Hold> {
    serde_json::from_str(json)
        .map_err(|e| Error::Protocol(format!("unreadable hold {json:?}: {e}")))
}
