//! Periodic upkeep of the streams, run by every worker (duplicates are harmless:
//! each job is one atomic script):
//! - retention: trims acknowledged entries older than `retention_ms` off the events stream
//!   and the evictions stream, never an entry some group has not acknowledged or not yet
//!   read (plain MAXLEN trimming could drop those); an evictions stream that no group
//!   reads is trimmed by age alone;
//! - consumers: removes group consumers idle for `consumer_expiry_ms` with nothing pending.

use std::{sync::LazyLock, time::Duration};

use crate::conn::RedisConn;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::{
    config::Settings,
    error::Result,
    keys::{Keys, GROUP},
    retry::Episode,
};

static TRIM_STREAM: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("trim_stream.lua")));
static EXPIRE_CONSUMERS: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("expire_consumers.lua")));

/// Trims entries that every group has acknowledged and that are older than `retention`
/// off the events stream and the evictions stream. Returns how many were removed.
pub async fn trim_acknowledged(conn: &RedisConn, keys: &Keys, retention: Duration) -> Result<u64> {
    let cutoff = crate::now_ms().saturating_sub(retention.as_millis() as u64);
    let mut removed = 0;
    let streams = [(keys.events(), "groups")]
        .into_iter()
        .chain(keys.evictions().map(|s| (s.to_owned(), "age")));
    for (stream, groupless) in streams {
        let mut call = TRIM_STREAM.prepare_invoke();
        call.key(stream).arg(format!("{cutoff}-0")).arg(groupless);
        removed += call.invoke_async::<u64>(&mut conn.clone()).await?;
    }
    Ok(removed)
}

/// Removes consumers idle for at least `idle` with nothing pending; returns their names.
pub async fn expire_consumers(
    conn: &RedisConn,
    keys: &Keys,
    idle: Duration,
) -> Result<Vec<String>> {
    let mut call = EXPIRE_CONSUMERS.prepare_invoke();
    call.key(keys.events())
        .arg(GROUP)
        .arg(idle.as_millis() as u64);
    Ok(call.invoke_async(&mut conn.clone()).await?)
}

/// Runs both jobs every `maintenance_interval_ms` until `shutdown`; skips a round while
/// the worker's build does not work under the data format in use (it writes nothing).
pub async fn run(
    conn: RedisConn,
    keys: Keys,
    settings: Settings,
    format: std::sync::Arc<crate::format::Gate>,
    shutdown: CancellationToken,
) {
    let every = Duration::from_millis(settings.maintenance_interval_ms);
    let retention = Duration::from_millis(settings.retention_ms);
    let expiry = Duration::from_millis(settings.consumer_expiry_ms);
    // One line when a job starts failing and one when it works again, not one per
    // interval. Upkeep can wait: its failures do not make the worker unready.
    let mut trimming = Episode::new("trimming the streams", None);
    let mut expiring = Episode::new("removing gone consumers", None);
    loop {
        // Jitter, so that many workers started together do not run in step.
        let jitter = every.mul_f64(rand::random::<f64>() * 0.2);
        tokio::select! {
            _ = tokio::time::sleep(every + jitter) => {}
            _ = shutdown.cancelled() => return,
        }
        if !format.works() {
            continue;
        }
        match trim_acknowledged(&conn, &keys, retention).await {
            Ok(n) => {
                trimming.recovered();
                if n > 0 {
                    info!(
                        removed = n,
                        "trimmed acknowledged entries off the events and evictions streams"
                    );
                }
            }
            Err(e) => trimming.failed(&e, every),
        }
        match expire_consumers(&conn, &keys, expiry).await {
            Ok(gone) => {
                expiring.recovered();
                if !gone.is_empty() {
                    info!(consumers = ?gone, "removed consumers that were gone (nothing pending)")
                }
            }
            Err(e) => expiring.failed(&e, every),
        }
    }
}
