//! Periodic upkeep of the streams, run by every worker (duplicates are harmless:
//! each job is one atomic script):
//! - retention: trims acknowledged entries older than `retention_ms` off the events stream
//!   and the evictions stream, never an entry some group has not acknowledged or not yet
//!   read (plain MAXLEN trimming could drop those); an evictions stream that no group
//!   reads is trimmed by age alone;
//! - the hard bound: entries older than `stream_max_age_ms` go off the evictions stream,
//!   the dead-letter stream and the events stream even if a group has not read or
//!   acknowledged them (counted per stream and group), never an entry the workers' own
//!   group still needs on the events stream;
//! - group gauges: each group's lag, pending entries, oldest unacknowledged entry's age
//!   and idle time, on every stream trimmed;
//! - consumers: removes group consumers idle for `consumer_expiry_ms` with nothing pending.

use std::{sync::LazyLock, time::Duration};

use crate::conn::RedisConn;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    config::Settings,
    error::Result,
    keys::{Keys, GROUP},
    metrics::Metrics,
    retry::Episode,
};

static TRIM_STREAM: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("trim_stream.lua")));
static EXPIRE_CONSUMERS: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("expire_consumers.lua")));

/// One consumer group on a stream, as one upkeep round saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupReport {
    /// The stream's key.
    pub stream: String,
    pub group: String,
    /// Entries trimmed by the hard bound in this round that the group had not acknowledged
    /// (pending in it, or never delivered to it).
    pub unacked_trimmed: u64,
    /// Entries not yet delivered to the group, when Redis can tell (`lag`, Redis 7.0+).
    pub lag: Option<u64>,
    /// Entries delivered to the group and not acknowledged.
    pub pending: u64,
    /// Age of the oldest entry still in the stream the group has not acknowledged.
    pub oldest_unacked_age_ms: Option<u64>,
    /// Idle time of the group's most recently active consumer; `None` without consumers.
    pub idle_ms: Option<u64>,
}

/// What one upkeep round of trimming did.
#[derive(Debug, Clone, Default)]
pub struct TrimReport {
    /// Entries removed, over all streams.
    pub removed: u64,
    /// Dead letters removed by the hard bound.
    pub dead_letters_expired: u64,
    /// Every group of every stream trimmed.
    pub groups: Vec<GroupReport>,
}

/// Trims entries that every group has acknowledged and that are older than `retention`
/// off the events stream and the evictions stream. Returns how many were removed. No hard
/// bound: see [`trim_streams`].
pub async fn trim_acknowledged(conn: &RedisConn, keys: &Keys, retention: Duration) -> Result<u64> {
    Ok(trim_streams(conn, keys, retention, Duration::ZERO)
        .await?
        .removed)
}

/// One round of trimming: retention (`retention`) on the events stream and the evictions
/// stream, and the hard bound (`max_age`, zero for none) on those and on the dead-letter
/// stream, where entries go even if a group has not acknowledged them, except those the
/// workers' own group ([`GROUP`]) still needs on the events stream.
pub async fn trim_streams(
    conn: &RedisConn,
    keys: &Keys,
    retention: Duration,
    max_age: Duration,
) -> Result<TrimReport> {
    let cutoff = crate::now_ms().saturating_sub(retention.as_millis() as u64);
    let mut report = TrimReport::default();
    // (stream, a stream without groups: 'age' to trim it by retention, and the group
    // the hard bound never trims).
    let streams = [(keys.events(), "groups", GROUP)]
        .into_iter()
        .chain(keys.evictions().map(|s| (s.to_owned(), "age", "")))
        .chain([(keys.dead_letters(), "keep", "")]);
    for (stream, groupless, protected) in streams {
        let mut call = TRIM_STREAM.prepare_invoke();
        call.key(&stream)
            .arg(format!("{cutoff}-0"))
            .arg(groupless)
            .arg(max_age.as_millis() as u64)
            .arg(protected);
        type Group = (String, u64, i64, u64, i64, i64);
        let (removed, groups): (u64, Vec<Group>) = call.invoke_async(&mut conn.clone()).await?;
        report.removed += removed;
        if stream == keys.dead_letters() && !max_age.is_zero() {
            report.dead_letters_expired += removed;
        }
        let known = |v: i64| u64::try_from(v).ok();
        report.groups.extend(groups.into_iter().map(
            |(group, unacked_trimmed, lag, pending, age, idle)| GroupReport {
                stream: stream.clone(),
                group,
                unacked_trimmed,
                lag: known(lag),
                pending,
                oldest_unacked_age_ms: known(age),
                idle_ms: known(idle),
            },
        ));
    }
    Ok(report)
}

/// Sets the group gauges from one round's report and counts what the hard bound trimmed.
/// `shown` holds the (stream, group) pairs the gauges showed after the last round: a pair
/// gone since (a group destroyed) is removed from them, and only it, so that a scrape
/// never finds a standing group's gauges missing.
pub fn observe(
    metrics: &Metrics,
    report: &TrimReport,
    shown: &mut std::collections::HashSet<(String, String)>,
) {
    metrics
        .dead_letters_expired
        .inc_by(report.dead_letters_expired);
    let mut now = std::collections::HashSet::new();
    for g in &report.groups {
        let labels = [g.stream.as_str(), g.group.as_str()];
        metrics
            .stream_unacked_trimmed
            .with_label_values(&labels)
            .inc_by(g.unacked_trimmed);
        match g.lag {
            Some(lag) => metrics
                .stream_group_lag
                .with_label_values(&labels)
                .set(lag as i64),
            None => {
                let _ = metrics.stream_group_lag.remove_label_values(&labels);
            }
        }
        metrics
            .stream_group_pending
            .with_label_values(&labels)
            .set(g.pending as i64);
        metrics
            .stream_group_oldest_unacked_age
            .with_label_values(&labels)
            .set(g.oldest_unacked_age_ms.unwrap_or(0) as f64 / 1000.0);
        match g.idle_ms {
            Some(idle) => metrics
                .stream_group_idle
                .with_label_values(&labels)
                .set(idle as f64 / 1000.0),
            None => {
                let _ = metrics.stream_group_idle.remove_label_values(&labels);
            }
        }
        now.insert((g.stream.clone(), g.group.clone()));
    }
    for (stream, group) in shown.difference(&now) {
        let labels = [stream.as_str(), group.as_str()];
        let _ = metrics.stream_group_lag.remove_label_values(&labels);
        let _ = metrics.stream_group_pending.remove_label_values(&labels);
        let _ = metrics
            .stream_group_oldest_unacked_age
            .remove_label_values(&labels);
        let _ = metrics.stream_group_idle.remove_label_values(&labels);
    }
    *shown = now;
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
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let every = Duration::from_millis(settings.maintenance_interval_ms);
    let retention = Duration::from_millis(settings.retention_ms);
    let max_age = Duration::from_millis(settings.stream_max_age_ms);
    metrics.stream_max_age.set(max_age.as_secs_f64());
    let expiry = Duration::from_millis(settings.consumer_expiry_ms);
    // One line when a job starts failing and one when it works again, not one per
    // interval. Upkeep can wait: its failures do not make the worker unready.
    let mut trimming = Episode::new("trimming the streams", None);
    let mut expiring = Episode::new("removing gone consumers", None);
    let mut shown = std::collections::HashSet::new();
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
        match trim_streams(&conn, &keys, retention, max_age).await {
            Ok(report) => {
                trimming.recovered();
                observe(&metrics, &report, &mut shown);
                if report.removed > 0 {
                    info!(removed = report.removed, "trimmed the streams");
                }
                for g in report.groups.iter().filter(|g| g.unacked_trimmed > 0) {
                    warn!(
                        stream = %g.stream,
                        group = %g.group,
                        trimmed = g.unacked_trimmed,
                        max_age_ms = settings.stream_max_age_ms,
                        "entries the group had not acknowledged were older than stream_max_age_ms and trimmed"
                    );
                }
                if report.dead_letters_expired > 0 {
                    warn!(
                        trimmed = report.dead_letters_expired,
                        max_age_ms = settings.stream_max_age_ms,
                        "dead letters older than stream_max_age_ms were trimmed, never replayed nor purged"
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
