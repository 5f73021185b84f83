//! Publishing one alert's `server.dead` exactly once (publish_alert.lua): the check of
//! the alert's record and the XADD are one script, so two receivers given the same alert
//! at the same instant publish it once, and a receiver restarted meanwhile finds the record.
//!
//! On a Redis Cluster the record's key carries the events stream's name as its hash tag
//! (see [`Keys::alert_published`]), so the script's two keys share a slot and the guarantee
//! is the same as on one node: no second path with a weaker one. A `key_prefix` that breaks
//! the tag is refused at start-up (see [`check_slot`]).

use std::sync::LazyLock;

use redis::Value;

use crate::{
    conn::RedisConn,
    error::{Error, Result},
    keys::Keys,
};

static PUBLISH_ALERT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("publish_alert.lua")));

/// What publishing one alert did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Published now: the entry id.
    New(String),
    /// Published before (the record stands): the first entry's id.
    Before(String),
}

/// Publishes `payload` for alert `alert_id` unless its record says it was published;
/// the record lasts `ttl_ms`. [`redis::Script`] loads the script again after a NOSCRIPT
/// (a restart, a failover, SCRIPT FLUSH).
pub async fn publish_once(
    conn: &RedisConn,
    keys: &Keys,
    alert_id: &str,
    payload: &[u8],
    ttl_ms: u64,
) -> Result<Published> {
    let mut call = PUBLISH_ALERT.prepare_invoke();
    call.key(keys.alert_published(alert_id))
        .key(keys.events())
        .arg(payload)
        .arg(ttl_ms);
    Ok(call.invoke_async(&mut conn.clone()).await?)
}

/// publish_alert.lua's reply: {1, the new entry id} or {0, the first entry's id}.
impl redis::FromRedisValue for Published {
    fn from_redis_value(v: Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = crate::reply::Fields::new("publish_alert.lua", v, 2)?;
        let new: bool = f.next("published now")?;
        let id = f.value();
        let Some(id) = crate::reply::text(&id) else {
            return Err(crate::reply::malformed(f.script(), "an entry id", &id));
        };
        Ok(if new {
            Published::New(id)
        } else {
            Published::Before(id)
        })
    }
}

/// On a cluster, refuses a `key_prefix` with which the alerts' records would not hash to
/// the events stream's slot (an unbalanced brace).
pub fn check_slot(conn: &RedisConn, keys: &Keys) -> Result<()> {
    if conn.is_cluster() && !keys.alert_in_events_slot() {
        return Err(Error::Setting {
            name: "key_prefix".into(),
            reason: format!(
                "on a Redis Cluster the alert receiver needs a key_prefix without an \
                 unbalanced brace (its records must share the events stream's slot), got {:?}",
                keys.prefix()
            ),
        });
    }
    Ok(())
}
