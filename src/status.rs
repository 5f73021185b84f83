//! `registry-janitor status`: what an on-call engineer asks first. Is the group keeping
//! up (lag, pending), who holds what (consumers), and did anything fail (dead letters)?
//! The data only: the binary prints it (as text or JSON).

use std::collections::HashMap;

use redis::Value;

use crate::conn::RedisConn;
use serde::Serialize;

use crate::{
    config::Settings,
    conn,
    error::Result,
    keys::{Keys, GROUP},
};

#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub stream: String,
    /// Entries in the events stream (acknowledged ones included, until trimmed).
    pub stream_length: u64,
    /// False until a worker has created the consumer group.
    pub group_exists: bool,
    /// Entries not yet delivered to any consumer of the group (Redis 7 `lag`; where the
    /// server gives none, 0 if no entry is after the last delivered one, else unknown).
    pub lag: Option<u64>,
    /// Entries delivered but not acknowledged.
    pub pending: u64,
    pub consumers: Vec<Consumer>,
    /// Entries in the dead-letter stream.
    pub dead_letters: u64,
    /// Servers in `servers` (live, or dead but not yet cleaned).
    pub servers_known: u64,
    /// Of those, dead now: heartbeat older than `heartbeat_grace_ms` and no liveness key.
    pub servers_dead: Option<u64>,
    /// Fences standing now (servers declared dead within `fence_ttl_ms`).
    pub fenced: Option<u64>,
    /// Fenced servers that tried to write after their verdict (a false positive, or a
    /// zombie), the most recent first.
    pub fenced_still_writing: Vec<crate::fence::Fence>,
    /// The window, in ms, within which a refused write counts as "writing now" (the
    /// `heartbeat_grace_ms`).
    pub writing_window_ms: u64,
    /// The evictions stream, unless switched off.
    pub evictions: Option<EvictionsStatus>,
    /// Verdicts the guard holds (not fenced, not cleaned, not acknowledged), oldest
    /// first; see `registry-janitor held`.
    pub held: Vec<crate::guard::Hold>,
    /// The reconciler's outage guard, from `janitor:{guard}:reachable`; `None` until a reconciler
    /// has run (or where it may not be read).
    pub reachable: Option<ReachableStatus>,
    /// The data format in use and the workers' announcements (`registry-janitor format
    /// status` tells more); `None` where they may not be read.
    pub format: Option<crate::format::FormatStatus>,
}

/// The reconciler's outage guard (see `guard::reachable`).
#[derive(Debug, Clone, Serialize)]
pub struct ReachableStatus {
    /// When the current stretch of reachable time began (Redis time, unix ms): the last
    /// Redis outage a reconciler saw; 0 for none.
    pub reachable_since_ms: u64,
    /// How much longer verdicts on silent servers wait, by Redis's clock (0: they are
    /// taken).
    pub verdicts_wait_ms: u64,
}

/// The evictions stream: its length and how far each consumer group is behind.
#[derive(Debug, Clone, Serialize)]
pub struct EvictionsStatus {
    pub stream: String,
    pub length: u64,
    pub groups: Vec<EvictionsGroup>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvictionsGroup {
    pub name: String,
    /// Entries not yet delivered to the group (`None` where Redis cannot tell).
    pub lag: Option<u64>,
    /// Entries delivered and not acknowledged.
    pub pending: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Consumer {
    pub name: String,
    pub pending: u64,
    pub idle_ms: u64,
}

impl Status {
    /// Nothing waits: every event was delivered and acknowledged.
    pub fn is_idle(&self) -> bool {
        self.group_exists && self.pending == 0 && self.lag == Some(0)
    }
}

/// Collects the status from the Redis of `settings`.
pub async fn collect(settings: &Settings) -> Result<Status> {
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    let mut status = collect_from(&conn, &keys).await?;
    status.servers_dead =
        Some(crate::reconcile::count_dead(&conn, &keys, settings.heartbeat_grace_ms).await?);
    let fences = crate::fence::standing(&conn, &keys, None).await?;
    status.fenced = Some(fences.len() as u64);
    status.fenced_still_writing = fences.into_iter().filter(|f| f.refused() > 0).collect();
    status
        .fenced_still_writing
        .sort_by_key(|f| std::cmp::Reverse(f.last_refused_ms));
    status.writing_window_ms = settings.heartbeat_grace_ms;
    // Redis's time: `reachable_since_ms` is on it.
    let redis_now = crate::clock::now_ms(&conn, &keys).await?;
    status.reachable = crate::guard::reachable::recorded_since(&conn, &keys.guard_reachable())
        .await
        .map(|since| ReachableStatus {
            reachable_since_ms: since,
            verdicts_wait_ms: (since + settings.heartbeat_grace_ms).saturating_sub(redis_now),
        });
    if let Some(stream) = keys.evictions() {
        status.evictions = Some(evictions_status(&conn, stream).await?);
    }
    status.format = crate::format::status(
        &conn,
        &keys,
        crate::format::Build::current()?,
        settings.claim_min_idle_ms,
    )
    .await
    .ok();
    Ok(status)
}

/// The evictions stream's length and its groups' lag and pending entries.
pub async fn evictions_status(conn: &RedisConn, stream: &str) -> Result<EvictionsStatus> {
    let mut c = conn.clone();
    let length: u64 = redis::cmd("XLEN").arg(stream).query_async(&mut c).await?;
    let mut groups = Vec::new();
    if exists(&mut c, stream).await? {
        let infos: Vec<HashMap<String, Value>> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(stream)
            .query_async(&mut c)
            .await?;
        groups = infos
            .iter()
            .map(|g| EvictionsGroup {
                name: text(g.get("name")),
                lag: int(g.get("lag")),
                pending: int(g.get("pending")).unwrap_or(0),
            })
            .collect();
    }
    Ok(EvictionsStatus {
        stream: stream.to_owned(),
        length,
        groups,
    })
}

pub async fn collect_from(conn: &RedisConn, keys: &Keys) -> Result<Status> {
    let mut c = conn.clone();
    // One pipeline on a node; on a cluster the three keys are in different slots.
    let counts: Vec<u64> = crate::conn::each_in_flight(
        conn,
        vec![
            redis::cmd("XLEN").arg(keys.events()).to_owned(),
            redis::cmd("XLEN").arg(keys.dead_letters()).to_owned(),
            redis::cmd("ZCARD").arg(keys.servers()).to_owned(),
        ],
    )
    .await?;
    let (stream_length, dead_letters, servers_known) = (counts[0], counts[1], counts[2]);
    let mut status = Status {
        stream: keys.events(),
        stream_length,
        group_exists: false,
        lag: None,
        pending: 0,
        consumers: Vec::new(),
        dead_letters,
        servers_known,
        servers_dead: None,
        fenced: None,
        fenced_still_writing: Vec::new(),
        writing_window_ms: 0,
        evictions: None,
        held: crate::guard::hold::list(conn, keys).await?,
        reachable: None,
        format: None,
    };
    if stream_length == 0 && !exists(&mut c, &keys.events()).await? {
        return Ok(status);
    }
    let groups: Vec<HashMap<String, Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(keys.events())
        .query_async(&mut c)
        .await?;
    let Some(group) = groups.iter().find(|g| text(g.get("name")) == GROUP) else {
        return Ok(status);
    };
    status.group_exists = true;
    status.pending = int(group.get("pending")).unwrap_or(0);
    status.lag = int(group.get("lag"));
    if status.lag.is_none() {
        // Redis 6.2 gives no `lag` (and 7.0 none after some deletions): no entry is
        // undelivered when the newest one is not after the group's last delivered one.
        let newest: Vec<(String, Value)> = redis::cmd("XREVRANGE")
            .arg(keys.events())
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut c)
            .await?;
        status.lag = lag_from_ids(
            &text(group.get("last-delivered-id")),
            newest.first().map(|(id, _)| id.as_str()),
        );
    }
    let consumers: Vec<HashMap<String, Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(keys.events())
        .arg(GROUP)
        .query_async(&mut c)
        .await?;
    status.consumers = consumers
        .iter()
        .map(|m| Consumer {
            name: text(m.get("name")),
            pending: int(m.get("pending")).unwrap_or(0),
            idle_ms: int(m.get("idle")).unwrap_or(0),
        })
        .collect();
    Ok(status)
}

async fn exists(c: &mut RedisConn, key: &str) -> Result<bool> {
    Ok(redis::cmd("EXISTS").arg(key).query_async::<i64>(c).await? == 1)
}

/// The lag of a group whose server does not report it: 0 when the stream's newest entry
/// (`newest`, None for an empty stream) is not after `last_delivered`, else unknown.
fn lag_from_ids(last_delivered: &str, newest: Option<&str>) -> Option<u64> {
    fn parse(id: &str) -> Option<(u64, u64)> {
        let (ms, seq) = id.split_once('-')?;
        Some((ms.parse().ok()?, seq.parse().ok()?))
    }
    let Some(newest) = newest else {
        return Some(0);
    };
    (parse(newest)? <= parse(last_delivered)?).then_some(0)
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    }
}

fn int(v: Option<&Value>) -> Option<u64> {
    match v {
        Some(Value::Int(i)) => u64::try_from(*i).ok(),
        Some(Value::BulkString(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod lag_tests {
    use super::lag_from_ids;

    #[test]
    fn a_group_at_the_newest_entry_has_no_lag() {
        assert_eq!(
            lag_from_ids("1700000000000-3", Some("1700000000000-3")),
            Some(0)
        );
        assert_eq!(
            lag_from_ids("1700000000001-0", Some("1700000000000-9")),
            Some(0)
        );
        assert_eq!(lag_from_ids("0-0", None), Some(0));
        // Compared as numbers, not text.
        assert_eq!(lag_from_ids("10-0", Some("9-0")), Some(0));
        assert_eq!(lag_from_ids("9-0", Some("10-0")), None);
        assert_eq!(
            lag_from_ids("1700000000000-3", Some("1700000000000-4")),
            None
        );
        assert_eq!(lag_from_ids("", Some("1-0")), None);
    }
}
