//! The drift sweep on one node: the forward registry in paced steps from a stored
//! cursor (sweep_forward.lua deletes entries whose owner is dead), then the reverse sets
//! of live servers (sweep_reverse.lua sets aside members whose user moved).

use std::{
    sync::{Arc, LazyLock},
    time::Duration,
};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{pause_or_stop, Reconciler, SweepReport};
use crate::{
    error::{Error, Result},
    event::ServerId,
    reply::Fields,
};

static SWEEP_FORWARD: LazyLock<redis::Script> =
    LazyLock::new(|| crate::forward::with_prelude(include_str!("sweep_forward.lua")));
static SWEEP_REVERSE: LazyLock<redis::Script> =
    LazyLock::new(|| crate::forward::with_prelude(include_str!("sweep_reverse.lua")));

impl Reconciler {
    /// Whether silence proves death to the forward sweep now: an owner with no liveness
    /// key and no heartbeat within the grace (by Redis's time) is dead. While the guard
    /// holds a verdict of a mass silence or sees one (see [`crate::guard`]), silence
    /// proves nothing (false): only entries of fenced owners and of owners unknown to
    /// `servers` go. (A disputed hold needs nothing here: its server has a liveness key.)
    pub(super) async fn silence_proves_death(&self) -> Result<bool> {
        Ok(!(self.settings.guard
            && (self.guard.holds_mass_silence(&self.conn).await?
                || self
                    .guard
                    .is_mass_silence(self.guard.census(&self.conn).await?))))
    }

    /// One step of the forward sweep; `cursor` None resumes from the stored cursor.
    /// Returns (next cursor, entries scanned, entries removed). While Redis has not been
    /// reachable for a full grace since its last outage, only entries of fenced owners
    /// are deleted.
    pub async fn sweep_step(&self, cursor: Option<&str>) -> Result<(String, u64, u64)> {
        let silence = self.silence_proves_death().await?;
        // Read last, right before the step: an outage during the reads above holds it.
        let hold = self.hold().await?;
        let bound = self.reach.time_bound_ms();
        let pattern = match self.settings.layout {
            crate::config::Layout::Conns => self.keys.user_conns_pattern(),
            _ => crate::keys::pattern_under(&self.keys.user_key_prefix()),
        };
        let mut call = SWEEP_FORWARD.prepare_invoke();
        call.key(self.keys.registry())
            .key(self.keys.sweep())
            .key(self.keys.servers());
        if let Some(stream) = self.keys.evictions() {
            call.key(stream);
        }
        call.arg(self.settings.layout.as_str())
            .arg(self.settings.sweep_count)
            .arg(self.keys.prefix())
            .arg(if silence {
                self.settings.heartbeat_grace_ms.to_string()
            } else {
                "-1".to_owned()
            })
            .arg(pattern)
            .arg(cursor.unwrap_or(""))
            .arg(if hold.is_ready() { "0" } else { "1" })
            .arg(bound.map_or(String::new(), |b| b.to_string()));
        let step: ForwardStep = call.invoke_async(&mut self.conn.clone()).await?;
        if let Some(redis_ms) = step.past_bound {
            self.reach.verdict_past_bound(redis_ms);
        }
        self.metrics.drift_entries_removed.inc_by(step.removed);
        self.metrics.observe_evictions(step.announced, step.removed);
        Ok((step.next, step.scanned, step.removed))
    }

    /// One step of the reverse sweep of `server`'s set from `cursor`.
    /// Returns (next cursor, members scanned, members removed).
    pub(super) async fn sweep_reverse_step(
        &self,
        server: &ServerId,
        cursor: &str,
    ) -> Result<(String, u64, u64)> {
        if self.conn.is_cluster() {
            return self.sweep_reverse_step_on_cluster(server, cursor).await;
        }
        let mut call = SWEEP_REVERSE.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.registry())
            .key(self.keys.server_moved(server))
            .arg(server.as_str())
            .arg(cursor)
            .arg(self.settings.sweep_count)
            .arg(self.settings.layout.as_str())
            .arg(self.keys.user_key_prefix())
            .arg(self.settings.heartbeat_grace_ms);
        let step: ReverseStep = call.invoke_async(&mut self.conn.clone()).await?;
        Ok((step.next, step.scanned, step.removed))
    }

    /// Sweeps one live server's reverse set completely, `pause` between steps. Each step
    /// is retried through transient states; [`Error::Cancelled`] as soon as `stop` fires.
    pub async fn sweep_reverse(
        &self,
        server: &ServerId,
        pause: Duration,
        stop: &CancellationToken,
    ) -> Result<(u64, u64)> {
        let (mut cursor, mut scanned, mut removed) = ("0".to_owned(), 0, 0);
        let watch = self.watch();
        loop {
            let (next, n, r) = watch
                .retrying("reverse-index sweep", stop, || {
                    self.sweep_reverse_step(server, &cursor)
                })
                .await?;
            scanned += n;
            removed += r;
            self.metrics.drift_members_removed.inc_by(r);
            self.health.beat();
            if next == "0" {
                return Ok((scanned, removed));
            }
            cursor = next;
            pause_or_stop(pause, stop).await?;
        }
    }

    /// One complete sweep: the forward registry from the start, then every live server's
    /// reverse set. Paced by `pause` between steps; each step is retried through
    /// transient states; [`Error::Cancelled`] as soon as `stop` fires.
    pub async fn sweep(&self, pause: Duration, stop: &CancellationToken) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        if self.conn.is_cluster() {
            return self.sweep_on_cluster(pause, stop).await;
        }
        let watch = self.watch();
        let mut cursor = "0".to_owned();
        loop {
            let (next, scanned, removed) = watch
                .retrying("drift sweep", stop, || self.sweep_step(Some(&cursor)))
                .await?;
            report.steps += 1;
            report.entries_scanned += scanned;
            report.entries_removed += removed;
            self.health.beat();
            if next == "0" {
                break;
            }
            cursor = next;
            pause_or_stop(pause, stop).await?;
        }
        self.sweep_reverse_sets(pause, &mut report, stop).await?;
        Ok(report)
    }

    pub(super) async fn sweep_reverse_sets(
        &self,
        pause: Duration,
        report: &mut SweepReport,
        stop: &CancellationToken,
    ) -> Result<()> {
        let live = self
            .watch()
            .retrying("listing live servers", stop, || self.live_servers())
            .await?;
        debug!(
            live_servers = live.len(),
            "sweeping the reverse sets of live servers"
        );
        for server in live {
            let (scanned, removed) = self.sweep_reverse(&server, pause, stop).await?;
            report.live_servers += 1;
            report.members_scanned += scanned;
            report.members_removed += removed;
            self.health.beat();
        }
        Ok(())
    }

    /// The continuous sweep: paced steps from the stored cursor; after each complete
    /// cycle, the reverse sets, then a rest of one interval.
    pub(super) async fn sweep_loop(self: Arc<Self>, shutdown: CancellationToken) {
        let pause = Duration::from_millis(self.settings.sweep_pause_ms);
        let interval = Duration::from_millis(self.settings.reconcile_interval_ms);
        if self.conn.is_cluster() {
            // On a cluster: one complete cycle per interval (see `sweep_on_cluster`).
            loop {
                self.health.beat();
                match self.sweep(pause, &shutdown).await {
                    Ok(r) if r.entries_removed > 0 => info!(?r, "drift sweep cycle done"),
                    Ok(r) => debug!(?r, "drift sweep cycle done"),
                    Err(Error::Cancelled) => return,
                    Err(e) => warn!(error = %e, "drift sweep failed; next cycle in an interval"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
        }
        let mut cycle = SweepReport::default();
        loop {
            self.health.beat();
            let step = self
                .watch()
                .retrying("drift sweep", &shutdown, || self.sweep_step(None))
                .await;
            let wait = match step {
                Err(Error::Cancelled) => return,
                Err(e) => {
                    warn!(error = %e, "drift sweep step failed");
                    interval
                }
                Ok((next, scanned, removed)) => {
                    cycle.steps += 1;
                    cycle.entries_scanned += scanned;
                    cycle.entries_removed += removed;
                    if next != "0" {
                        pause
                    } else {
                        match self.sweep_reverse_sets(pause, &mut cycle, &shutdown).await {
                            Ok(()) => {}
                            Err(Error::Cancelled) => return,
                            Err(e) => warn!(error = %e, "reverse-index sweep failed"),
                        }
                        if cycle.entries_removed + cycle.members_removed > 0 {
                            info!(?cycle, "drift sweep cycle done");
                        } else {
                            debug!(?cycle, "drift sweep cycle done");
                        }
                        cycle = SweepReport::default();
                        interval
                    }
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }
}

/// sweep_forward.lua's reply: {next cursor, entries scanned, entries removed, evictions
/// entries written}.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ForwardStep {
    next: String,
    scanned: u64,
    removed: u64,
    announced: u64,
    /// Redis's time, when it was past the guard's bound (the step then held).
    past_bound: Option<u64>,
}

impl redis::FromRedisValue for ForwardStep {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("sweep_forward.lua", v, 5)?;
        Ok(ForwardStep {
            next: f.next("next cursor")?,
            scanned: f.next("scanned")?,
            removed: f.next("removed")?,
            announced: f.next("announced")?,
            past_bound: match f.next::<u64>("past the bound")? {
                0 => None,
                redis_ms => Some(redis_ms),
            },
        })
    }
}

/// sweep_reverse.lua's reply: {next cursor, members scanned, members set aside}.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReverseStep {
    next: String,
    scanned: u64,
    removed: u64,
}

impl redis::FromRedisValue for ReverseStep {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("sweep_reverse.lua", v, 3)?;
        Ok(ReverseStep {
            next: f.next("next cursor")?,
            scanned: f.next("scanned")?,
            removed: f.next("removed")?,
        })
    }
}
