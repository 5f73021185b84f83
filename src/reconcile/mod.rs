//! The reconciliation worker: finds dead servers and drifted entries whatever events
//! were missed (monitoring down, a deploy, a failover that lost the stream's tail).
//!
//! Three loops, all safe to run in several replicas at once (each check-and-act is one
//! atomic script; duplicate events cost the workers a no-op):
//! - the **pass**, every `reconcile_interval_ms`: servers in `servers` whose heartbeat is
//!   older than `heartbeat_grace_ms` and whose liveness key is gone get a `server.dead`
//!   event (`source` = `reconciler`); the workers clean them. `report_dead.lua` re-checks
//!   both conditions at the instant it publishes, so a live server is never declared dead;
//! - the **expiry hint**: keyspace notifications of liveness keys (`__keyevent@<db>__:
//!   expired`, on a connection of its own) trigger the same check at once. Pub/Sub loses
//!   messages and notifications may be off: the hint only makes cleanup faster;
//! - the **drift sweep**: HSCAN of `registry` (or SCAN of `user:*`) in small paced steps
//!   from a stored cursor; entries whose owner is dead are deleted (`sweep_forward.lua`),
//!   then the reverse sets of live servers lose members whose user moved elsewhere
//!   (`sweep_reverse.lua`).
//!
//! All three hold their verdicts on silent servers until Redis has been reachable for a
//! full `heartbeat_grace_ms` (`guard::reachable`): an outage of Redis is no
//! server's silence. Fenced servers stay dead meanwhile.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::conn::RedisConn;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    config::Settings,
    conn,
    error::{Error, Result},
    event::ServerId,
    guard::reachable::{Hold, Reachable},
    health::{Failing, Health, Readiness},
    keys::Keys,
    metrics::Metrics,
    retry::Watch,
};

mod hints;
mod pass;
mod sweep;
mod sweep_cluster;

pub use pass::count_dead;

/// Servers read from `servers` per round trip.
const PAGE: usize = 1000;

/// Expiry hints checked at once. A check may wait up to `heartbeat_grace_ms` for a
/// recent heartbeat to age; past this many, further hints are dropped (counted in the
/// debug log) and those servers are found by the next pass, as when a hint is lost.
pub const HINT_CHECKS: usize = 64;

/// What [`Reconciler::check`] found about one server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Dead: an event was published (its entry id).
    Published(String),
    /// Its liveness key exists.
    Alive,
    /// No liveness key, but its last heartbeat is within the grace period: its score
    /// (Redis time, unix ms), and how long until it is past the grace.
    TooRecent {
        heartbeat_ms: u64,
        remaining_ms: u64,
    },
    /// Dead, and already reported within the marker's window.
    AlreadyReported,
    /// Fenced, with nothing left to clean: not reported again (while the fence stands).
    FencedClean,
    /// No liveness key, but Redis has not been reachable for a full grace since its last
    /// outage: no verdict yet, for at least this long.
    Waiting { remaining_ms: u64 },
}

/// One pass over `servers`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PassReport {
    /// Servers checked: heartbeat older than the grace period, or fenced.
    pub candidates: u64,
    pub published: u64,
    pub alive: u64,
    pub too_recent: u64,
    pub already_reported: u64,
    /// Members of `servers` that are not valid server ids (left alone, logged).
    pub invalid: u64,
    /// Fenced servers with nothing left to clean (not reported again).
    pub fenced_clean: u64,
    /// Servers without a liveness key whose verdict waits: Redis has not been reachable
    /// for a full grace since its last outage.
    pub waiting: u64,
}

/// One complete drift sweep.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SweepReport {
    pub steps: u64,
    pub entries_scanned: u64,
    pub entries_removed: u64,
    pub live_servers: u64,
    pub members_scanned: u64,
    pub members_removed: u64,
}

/// What `reconcile --once` did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OnceReport {
    pub pass: PassReport,
    pub sweep: SweepReport,
    /// How long the run waited for Redis to be reachable for a full grace after an
    /// outage, before its last pass.
    pub waited_for_reachable_ms: u64,
    /// Servers whose verdict the first pass held (checked again by the last pass).
    pub waited_servers: u64,
}

impl std::fmt::Display for OnceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (p, s) = (&self.pass, &self.sweep);
        write!(
            f,
            "dead servers: {} published, {} already reported, {} alive, {} heartbeat within grace, \
             {} fenced and clean, {} waiting for Redis to be reachable for a full grace \
             ({} candidates, {} invalid ids; {} waited {} ms for reachable time); drift: {} of {} forward entries removed, \
             {} of {} reverse-index members of {} live servers removed",
            p.published,
            p.already_reported,
            p.alive,
            p.too_recent,
            p.fenced_clean,
            p.waiting,
            p.candidates,
            p.invalid,
            self.waited_servers,
            self.waited_for_reachable_ms,
            s.entries_removed,
            s.entries_scanned,
            s.members_removed,
            s.members_scanned,
            s.live_servers
        )
    }
}

pub struct Reconciler {
    settings: Settings,
    keys: Keys,
    /// The single node's client, for the expiry-hint subscription; None on a cluster and
    /// behind Sentinel (the subscription follows the primary there).
    client: Option<redis::Client>,
    conn: RedisConn,
    metrics: Metrics,
    health: Arc<Health>,
    /// Work failing on a transient Redis state right now; read by `/readyz`.
    failing: Arc<Failing>,
    /// Bounds the checks started by expiry hints ([`HINT_CHECKS`]).
    hint_permits: Arc<tokio::sync::Semaphore>,
    /// Servers being checked because of a hint: a second hint for one is dropped.
    hinted: Mutex<BTreeSet<ServerId>>,
    /// The guard's view of the fleet: the drift sweep deletes nothing on silence while a
    /// verdict is held or a mass silence lasts.
    guard: crate::guard::Guard,
    /// Holds verdicts on silent servers until Redis has been reachable for a full grace
    /// after an outage; told of every failed call.
    reach: Arc<Reachable>,
    /// A score in the future could not be lowered (said once; see [`crate::clock`]).
    lowering_refused: std::sync::atomic::AtomicBool,
}

impl Reconciler {
    /// A reconciler from validated settings. On a cluster it connects at once (to learn
    /// the slot map); there it runs the heartbeat pass only (see `run`).
    pub async fn new(settings: &Settings, metrics: Metrics) -> Result<Self> {
        // The pass loop sleeps a whole interval between beats.
        let stall_after = Duration::from_millis(settings.reconcile_interval_ms.saturating_mul(3))
            .max(Duration::from_secs(60));
        let (client, conn) = match conn::target_for(settings)? {
            conn::Target::Single(client) => {
                let shared = conn::shared(&client)?;
                (Some(client), shared)
            }
            target => (None, conn::shared_for(&target).await?),
        };
        Ok(Reconciler {
            keys: Keys::for_settings(settings),
            conn,
            client,
            settings: settings.clone(),
            health: Health::new(stall_after),
            failing: Failing::new(),
            hint_permits: Arc::new(tokio::sync::Semaphore::new(HINT_CHECKS)),
            hinted: Mutex::default(),
            guard: crate::guard::Guard::new(Keys::for_settings(settings), settings),
            reach: Arc::new(Reachable::new(settings, metrics.clone())),
            lowering_refused: Default::default(),
            metrics,
        })
    }

    /// Where retries report: the error counter, the liveness, the readiness, and the
    /// reachable-time guard.
    fn watch(&self) -> Watch {
        let reach = self.reach.clone();
        Watch {
            errors: self.metrics.redis_errors.clone(),
            health: self.health.clone(),
            failing: self.failing.clone(),
            on_failure: Some(Arc::new(move |e| reach.failed(e))),
        }
    }

    /// The reachable-time guard: may verdicts on silent servers be taken now?
    pub fn reachable(&self) -> Arc<Reachable> {
        self.reach.clone()
    }

    /// The guard's hold now (observing Redis first if needed).
    pub(super) async fn hold(&self) -> Result<Hold> {
        self.reach.hold(&self.conn).await
    }

    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    pub fn readiness(&self) -> Readiness {
        Readiness {
            conn: self.conn.clone(),
            keys: self.keys.clone(),
            consumer: None,
            failing: self.failing.clone(),
            format: None,
        }
    }

    /// `reconcile --once`: one pass and one complete sweep, each step retried through
    /// transient states, until done.
    pub async fn run_once(&self) -> Result<OnceReport> {
        self.run_once_until(&CancellationToken::new()).await
    }

    /// [`Reconciler::run_once`], stopped with [`Error::Cancelled`] when `stop` fires.
    ///
    /// A pass whose verdicts wait for reachable time (Redis had an outage, or restarted
    /// since a reconciler last looked) is run again once that time has passed: the run
    /// takes up to one grace longer, and a server that died is still reported.
    pub async fn run_once_until(&self, stop: &CancellationToken) -> Result<OnceReport> {
        let watch = self.watch();
        let mut pass = watch
            .retrying("reconcile pass", stop, || self.pass())
            .await?;
        let (mut waited_for_reachable_ms, waited_servers) = (0, pass.waiting);
        if pass.waiting > 0 {
            let hold = watch
                .retrying("reconcile pass", stop, || self.hold())
                .await?;
            let wait = hold
                .remaining_ms(self.settings.heartbeat_grace_ms)
                .min(self.settings.heartbeat_grace_ms)
                + 50;
            info!(
                waiting = pass.waiting,
                wait_ms = wait,
                "verdicts wait until Redis has been reachable for a full grace; passing again then"
            );
            pause_or_stop(Duration::from_millis(wait), stop).await?;
            waited_for_reachable_ms = wait;
            pass = watch
                .retrying("reconcile pass", stop, || self.pass())
                .await?;
        }
        let sweep = self
            .sweep(Duration::from_millis(self.settings.sweep_pause_ms), stop)
            .await?;
        Ok(OnceReport {
            pass,
            sweep,
            waited_for_reachable_ms,
            waited_servers,
        })
    }

    /// Runs the pass, the expiry hint listener and the sweep until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let this = Arc::new(self);
        info!(
            redis = %conn::describe(&this.settings),
            interval_ms = this.settings.reconcile_interval_ms,
            grace_ms = this.settings.heartbeat_grace_ms,
            "reconciler starting"
        );
        // The worker's start-up check: scripts run, and on a cluster they may declare flags
        // (the drift sweep deletes with the cluster walk's check-and-delete scripts).
        let events = this.keys.events();
        match this
            .watch()
            .retrying("checking Lua scripting", &shutdown, || {
                crate::cleanup::check_scripting(&this.conn, &events)
            })
            .await
        {
            Err(Error::Cancelled) => return Ok(()),
            other => other?,
        }
        let _stop_ping = crate::health::spawn_redis_watch(
            this.conn.clone(),
            this.metrics.redis_up.clone(),
            &shutdown,
        );
        let (reach, conn, stop) = (this.reach.clone(), this.conn.clone(), shutdown.clone());
        let guard = tokio::spawn(async move { reach.watch(conn, stop).await });
        let hints = tokio::spawn(this.clone().hint_loop(shutdown.clone()));
        let sweeper = tokio::spawn(this.clone().sweep_loop(shutdown.clone()));
        let interval = Duration::from_millis(this.settings.reconcile_interval_ms);
        loop {
            this.health.beat();
            match this
                .watch()
                .retrying("reconcile pass", &shutdown, || this.pass())
                .await
            {
                Ok(r) if r.published > 0 || r.invalid > 0 || r.waiting > 0 => {
                    info!(?r, "reconcile pass")
                }
                Ok(r) => debug!(?r, "reconcile pass"),
                Err(Error::Cancelled) => break,
                Err(e) => warn!(error = %e, "reconcile pass failed; next one in an interval"),
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.cancelled() => break,
            }
        }
        let _ = hints.await;
        let _ = sweeper.await;
        let _ = guard.await;
        info!("reconciler stopped");
        Ok(())
    }
}

/// Waits `pause`, or returns [`Error::Cancelled`] at once when `stop` fires.
async fn pause_or_stop(pause: Duration, stop: &CancellationToken) -> Result<()> {
    tokio::select! {
        _ = tokio::time::sleep(pause) => Ok(()),
        _ = stop.cancelled() => Err(Error::Cancelled),
    }
}
