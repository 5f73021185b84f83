//! Redis's clock, by which every liveness question is judged.
//!
//! A server's last heartbeat is its score in `servers`, and the protocol writes that
//! score with Redis's time: `heartbeat.lua` calls TIME (the caller's time, its third
//! argument, is not used), and on a Redis Cluster `heartbeat_servers.lua` does, in the
//! slot of `servers`. Every age of a score is measured against Redis's time too, read in
//! the slot of `servers` ([`now_ms`]; on a cluster, on the node that holds `servers`, the
//! clock the scores were written with): no comparison of a score with this process's
//! clock is made anywhere. So a connection server whose clock runs an hour ahead or
//! behind is declared dead as soon as, and no sooner than, one whose clock is right, and
//! so is a janitor whose own clock is off.
//!
//! Writers that score with their own clock remain possible (an older copy of
//! `heartbeat.lua`, a plain writer, a cluster client that runs `ZADD servers <its time>`
//! as the protocol asked before `heartbeat_servers.lua`). Their scores are judged as
//! follows:
//!
//! - A score later than Redis's time plus [`tolerance_ms`] was written with a clock that
//!   runs ahead. Left as it is, it would keep a dead server "recent" for as long as its
//!   clock is ahead (measured: an hour ahead, still not declared dead after 12 s, grace
//!   2 s). The reconciler lowers it to Redis's time ([`lower`]: every pass, and every
//!   check of a server), which is certain to be no earlier than the real last heartbeat:
//!   so the server is declared dead at most a grace after the reconciler first saw it
//!   past that time, never before a grace has passed since its last heartbeat. With the
//!   expiry hints that is the liveness key's expiry plus a grace (the liveness TTL plus
//!   the grace after the last heartbeat, where a score in Redis's time gives the longer
//!   of the two). A heartbeat that comes after writes its score again.
//! - A score earlier than it should be (a clock behind) cannot be told from an old
//!   heartbeat. While its liveness key stands the server is alive whatever its score
//!   says; once the key is gone it is dead at once rather than a grace later. The
//!   protocol's scripts do not write such scores.

use std::sync::LazyLock;

use crate::{conn::RedisConn, error::Result, keys::Keys, reply::Fields};

static LOWER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("lower.lua")));

/// Most scores lowered by one call of lower.lua, when it looks for every score ahead.
pub const LOWER_PAGE: usize = 1000;

/// How far a score may lie after Redis's time before it counts as written with a clock
/// that runs ahead: a quarter of the grace, at most a second (the tolerance of the
/// reconciler's clock-jump check, see `guard::reachable`). A score within it is taken
/// as it is: its server is declared dead at most that much later.
pub fn tolerance_ms(grace_ms: u64) -> u64 {
    (grace_ms / 4).min(1000)
}

/// Redis's time (unix ms), by TIME on the node that holds `servers` (on a cluster, the
/// master of its slot: the clock its scores are written with).
pub async fn now_ms(conn: &RedisConn, keys: &Keys) -> Result<u64> {
    let slot = crate::conn::key_slot(keys.servers().as_bytes());
    let reply = conn.on_master_of(slot, redis::cmd("TIME")).await?;
    let (secs, micros): (u64, u64) = redis::FromRedisValue::from_redis_value(reply)
        .map_err(|e| crate::error::Error::Protocol(format!("TIME: {e}")))?;
    Ok(secs * 1000 + micros / 1000)
}

/// What one call of lower.lua saw and did.
#[derive(Debug, Clone, PartialEq)]
pub struct Lowered {
    /// Redis's time (unix ms) in the slot of `servers`.
    pub now_ms: u64,
    /// Scores that lay in the future and were lowered to `now_ms`.
    pub lowered: u64,
    /// Scores that lay in the future and could not be lowered (ZADD refused: an ACL
    /// without it, or Redis out of memory).
    pub refused: u64,
    /// The scores of the servers asked for, after lowering (None: not in `servers`).
    pub scores: Vec<Option<f64>>,
}

/// Lowers the scores of `servers` that lie in the future (past Redis's time plus
/// `tolerance_ms`) to Redis's time: those of `members`, or, with none given, up to
/// [`LOWER_PAGE`] of any. Returns Redis's time and the scores of `members`.
pub async fn lower(
    conn: &RedisConn,
    keys: &Keys,
    tolerance_ms: u64,
    members: &[&str],
) -> Result<Lowered> {
    let mut call = LOWER.prepare_invoke();
    call.key(keys.servers()).arg(tolerance_ms).arg(LOWER_PAGE);
    for m in members {
        call.arg(*m);
    }
    Ok(call.invoke_async(&mut conn.clone()).await?)
}

impl redis::FromRedisValue for Lowered {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("clock/lower.lua", v, 4)?;
        let now_ms = f.next("now")?;
        let lowered = f.next("lowered")?;
        let refused = f.next("refused")?;
        let scores = match f.value() {
            redis::Value::Array(items) => items
                .into_iter()
                .map(|item| {
                    crate::reply::text_or_false("clock/lower.lua", item)?
                        .map(|s| {
                            s.parse::<f64>().map_err(|_| {
                                crate::reply::malformed(
                                    "clock/lower.lua",
                                    "a score",
                                    &redis::Value::SimpleString(s.clone()),
                                )
                            })
                        })
                        .transpose()
                })
                .collect::<std::result::Result<_, _>>()?,
            other => {
                return Err(crate::reply::malformed(
                    "clock/lower.lua",
                    "a table of scores",
                    &other,
                ))
            }
        };
        Ok(Lowered {
            now_ms,
            lowered,
            refused,
            scores,
        })
    }
}

/// Whether a score (unix ms, Redis time) is older than `grace_ms` at Redis's time
/// `now_ms`: the heartbeat half of "silent past the grace".
pub fn is_past_grace(score: f64, now_ms: u64, grace_ms: u64) -> bool {
    score <= now_ms.saturating_sub(grace_ms) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{FromRedisValue, Value};

    #[test]
    fn the_tolerance_is_a_quarter_of_the_grace_at_most_a_second() {
        assert_eq!(tolerance_ms(200), 50);
        assert_eq!(tolerance_ms(2_000), 500);
        assert_eq!(tolerance_ms(30_000), 1_000);
    }

    #[test]
    fn lower_lua_replies_decode() {
        let reply = Value::Array(vec![
            Value::Int(1_700_000_000_000),
            Value::Int(1),
            Value::Int(0),
            Value::Array(vec![
                Value::BulkString(b"1700000000000".to_vec()),
                Value::Nil,
                Value::Boolean(false),
            ]),
        ]);
        let l = Lowered::from_redis_value(reply).unwrap();
        assert_eq!(l.now_ms, 1_700_000_000_000);
        assert_eq!((l.lowered, l.refused), (1, 0));
        assert_eq!(l.scores, vec![Some(1_700_000_000_000.0), None, None]);
        let err = Lowered::from_redis_value(Value::Int(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("clock/lower.lua"), "{err}");
    }

    #[test]
    fn past_the_grace_is_measured_on_the_clock_given() {
        assert!(is_past_grace(1_000.0, 3_000, 2_000));
        assert!(!is_past_grace(1_001.0, 3_000, 2_000));
        assert!(is_past_grace(0.0, 1_000, 2_000));
    }
}
