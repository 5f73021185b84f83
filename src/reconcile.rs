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

use std::{
    collections::BTreeSet,
    sync::{Arc, LazyLock, Mutex},
    time::Duration,
};

use crate::conn::RedisConn;
use futures_util::StreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    config::{Layout, Settings},
    conn,
    error::{Error, Result},
    event::{ServerDead, ServerId},
    http::{Health, Readiness},
    keys::Keys,
    metrics::Metrics,
    retry::{policy, Failing, Watch},
};

static REPORT_DEAD: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("report_dead.lua")));
static REPORT_DEAD_CLUSTER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("report_dead_cluster.lua")));
static SWEEP_FORWARD: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(concat!(
        include_str!("owners.lua"),
        include_str!("sweep_forward.lua")
    ))
});
static SWEEP_REVERSE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(concat!(
        include_str!("owners.lua"),
        include_str!("sweep_reverse.lua")
    ))
});

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
    /// No liveness key, but its last heartbeat is within the grace period.
    TooRecent { heartbeat_ms: u64 },
    /// Dead, and already reported within the marker's window.
    AlreadyReported,
}

/// One pass over `servers`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PassReport {
    /// Servers whose heartbeat was older than the grace period.
    pub candidates: u64,
    pub published: u64,
    pub alive: u64,
    pub too_recent: u64,
    pub already_reported: u64,
    /// Members of `servers` that are not valid server ids (left alone, logged).
    pub invalid: u64,
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
}

impl std::fmt::Display for OnceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (p, s) = (&self.pass, &self.sweep);
        write!(
            f,
            "dead servers: {} published, {} already reported, {} alive, {} heartbeat within grace \
             ({} stale heartbeats, {} invalid ids); drift: {} of {} forward entries removed, \
             {} of {} reverse-index members of {} live servers removed",
            p.published,
            p.already_reported,
            p.alive,
            p.too_recent,
            p.candidates,
            p.invalid,
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
    /// The single node's client, for the expiry-hint subscription; None on a cluster.
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
            keys: Keys::new(settings.key_prefix.clone()),
            conn,
            client,
            settings: settings.clone(),
            metrics,
            health: Health::new(stall_after),
            failing: Failing::new(),
            hint_permits: Arc::new(tokio::sync::Semaphore::new(HINT_CHECKS)),
            hinted: Mutex::default(),
        })
    }

    /// Where retries report: the error counter, the liveness, the readiness.
    fn watch(&self) -> Watch {
        Watch {
            errors: self.metrics.redis_errors.clone(),
            health: self.health.clone(),
            failing: self.failing.clone(),
        }
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
        }
    }

    fn cutoff_ms(&self) -> u64 {
        crate::now_ms().saturating_sub(self.settings.heartbeat_grace_ms)
    }

    fn layout(&self) -> &'static str {
        match self.settings.layout {
            Layout::Hash => "hash",
            Layout::Keys => "keys",
        }
    }

    /// Publishes `server.dead` for `server` if it is dead at this instant.
    pub async fn check(&self, server: &ServerId) -> Result<Verdict> {
        let event = ServerDead::new(
            server,
            Some("heartbeat timeout".into()),
            Some("reconciler".into()),
        );
        let marker_ttl = self
            .settings
            .reconcile_interval_ms
            .saturating_mul(2)
            .max(1000);
        if self.conn.is_cluster() {
            return self.check_on_cluster(server, &event, marker_ttl).await;
        }
        let mut call = REPORT_DEAD.prepare_invoke();
        call.key(self.keys.server_alive(server))
            .key(self.keys.servers())
            .key(self.keys.server_reported(server))
            .key(self.keys.events())
            .arg(server.as_str())
            .arg(self.cutoff_ms())
            .arg(event.encode())
            .arg(marker_ttl);
        let (verdict, detail): (i64, String) = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(match verdict {
            1 => {
                self.metrics.reconcile_dead_found.inc();
                info!(server_id = %server, entry = %detail, event_id = %event.event_id, "server is dead; published server.dead");
                Verdict::Published(detail)
            }
            0 => Verdict::Alive,
            2 => Verdict::TooRecent {
                heartbeat_ms: detail.parse::<f64>().map_or(0, |f| f as u64),
            },
            3 => Verdict::AlreadyReported,
            other => return Err(Error::Protocol(format!("report_dead.lua returned {other}"))),
        })
    }

    /// [`Reconciler::check`] on a cluster: the same checks, in single-slot steps (the
    /// heartbeat's age, then liveness and marker in the slot of `{S}`, then the event).
    async fn check_on_cluster(
        &self,
        server: &ServerId,
        event: &ServerDead,
        marker_ttl: u64,
    ) -> Result<Verdict> {
        let mut c = self.conn.clone();
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(self.keys.servers())
            .arg(server.as_str())
            .query_async(&mut c)
            .await?;
        if let Some(score) = score.filter(|&s| s as u64 > self.cutoff_ms()) {
            return Ok(Verdict::TooRecent {
                heartbeat_ms: score as u64,
            });
        }
        let mut call = REPORT_DEAD_CLUSTER.prepare_invoke();
        call.key(self.keys.server_alive(server))
            .key(self.keys.server_reported(server))
            .arg(marker_ttl);
        match call.invoke_async::<i64>(&mut c).await? {
            0 => Ok(Verdict::Alive),
            3 => Ok(Verdict::AlreadyReported),
            _ => {
                let id =
                    crate::stream::publish_event(&self.conn, &self.keys, &event.encode()).await?;
                self.metrics.reconcile_dead_found.inc();
                info!(server_id = %server, entry = %id, event_id = %event.event_id, "server is dead; published server.dead");
                Ok(Verdict::Published(id))
            }
        }
    }

    /// Every member of `servers` with its score (last heartbeat), by ZSCAN. Heartbeats move
    /// scores and cleanups remove members all the time, so paging by rank or by offset
    /// would skip members whose place shifted between two pages; ZSCAN returns every
    /// member present for the whole walk, whatever happens to the others (duplicates,
    /// which ZSCAN may give, are dropped).
    async fn known_servers(&self) -> Result<Vec<(String, f64)>> {
        let mut seen = std::collections::BTreeMap::new();
        let mut cursor = 0u64;
        loop {
            let (next, flat): (u64, Vec<(String, f64)>) = redis::cmd("ZSCAN")
                .arg(self.keys.servers())
                .arg(cursor)
                .arg("COUNT")
                .arg(PAGE)
                .query_async(&mut self.conn.clone())
                .await?;
            seen.extend(flat);
            if next == 0 {
                return Ok(seen.into_iter().collect());
            }
            cursor = next;
        }
    }

    /// One pass over `servers`: checks every server whose heartbeat is older than the
    /// grace period.
    pub async fn pass(&self) -> Result<PassReport> {
        let mut report = PassReport::default();
        let cutoff = self.cutoff_ms();
        let stale = self
            .known_servers()
            .await?
            .into_iter()
            .filter(|(_, score)| *score <= cutoff as f64);
        for (member, _) in stale {
            report.candidates += 1;
            let Ok(server) = ServerId::parse(&member) else {
                report.invalid += 1;
                warn!(member = %member.escape_debug(), "`servers` holds an invalid server id; left alone");
                continue;
            };
            match self.check(&server).await? {
                Verdict::Published(_) => report.published += 1,
                Verdict::Alive => report.alive += 1,
                Verdict::TooRecent { .. } => report.too_recent += 1,
                Verdict::AlreadyReported => report.already_reported += 1,
            }
        }
        self.metrics.reconcile_passes.inc();
        Ok(report)
    }

    /// Live servers: a liveness key, or a heartbeat within the grace period.
    pub async fn live_servers(&self) -> Result<Vec<ServerId>> {
        let cutoff = self.cutoff_ms();
        let mut live = Vec::new();
        let servers: Vec<(ServerId, f64)> = self
            .known_servers()
            .await?
            .into_iter()
            .filter_map(|(m, score)| ServerId::parse(&m).ok().map(|s| (s, score)))
            .collect();
        for page in servers.chunks(PAGE) {
            let exists = page
                .iter()
                .map(|(s, _)| {
                    redis::cmd("EXISTS")
                        .arg(self.keys.server_alive(s))
                        .to_owned()
                })
                .collect();
            let alive: Vec<bool> = conn::each_in_flight(&self.conn, exists).await?;
            for ((server, score), has_key) in page.iter().zip(alive) {
                if has_key || *score as u64 > cutoff {
                    live.push(server.clone());
                }
            }
        }
        Ok(live)
    }

    /// One step of the forward sweep; `cursor` None resumes from the stored cursor.
    /// Returns (next cursor, entries scanned, entries removed).
    pub async fn sweep_step(&self, cursor: Option<&str>) -> Result<(String, u64, u64)> {
        let pattern = crate::keys::pattern_under(&self.keys.user_key_prefix());
        let mut call = SWEEP_FORWARD.prepare_invoke();
        call.key(self.keys.registry())
            .key(self.keys.sweep())
            .key(self.keys.servers())
            .arg(self.layout())
            .arg(self.settings.sweep_count)
            .arg(self.keys.prefix())
            .arg(self.cutoff_ms())
            .arg(pattern)
            .arg(cursor.unwrap_or(""));
        let (next, scanned, removed): (String, u64, u64) =
            call.invoke_async(&mut self.conn.clone()).await?;
        self.metrics.drift_entries_removed.inc_by(removed);
        Ok((next, scanned, removed))
    }

    /// One step of the reverse sweep of `server`'s set from `cursor`.
    /// Returns (next cursor, members scanned, members removed).
    async fn sweep_reverse_step(
        &self,
        server: &ServerId,
        cursor: &str,
    ) -> Result<(String, u64, u64)> {
        let mut call = SWEEP_REVERSE.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.registry())
            .key(self.keys.server_moved(server))
            .arg(server.as_str())
            .arg(cursor)
            .arg(self.settings.sweep_count)
            .arg(self.layout())
            .arg(self.keys.user_key_prefix())
            .arg(self.settings.heartbeat_grace_ms);
        Ok(call.invoke_async(&mut self.conn.clone()).await?)
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

    /// The forward sweep on a cluster: HSCAN of `registry` through the cluster connection
    /// (layout hash), or SCAN of `user:*` on every master over a connection of its own
    /// (layout keys); owners checked with single-key commands; entries of dead owners
    /// deleted by the same per-slot check-and-delete as the cleanup (`check_delete.lua`).
    /// The reverse-index part of the sweep is single-node only: on a cluster its read and
    /// its SREM cannot be one atomic step. A cycle always starts at the beginning. Each
    /// step (a page read, then its check-and-deletes, both idempotent) is retried through
    /// transient states; [`Error::Cancelled`] as soon as `stop` fires.
    async fn sweep_on_cluster(
        &self,
        pause: Duration,
        stop: &CancellationToken,
    ) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        let watch = self.watch();
        let pattern = crate::keys::pattern_under(&self.keys.user_key_prefix());
        match self.settings.layout {
            Layout::Hash => {
                let mut cursor = 0u64;
                loop {
                    let (next, flat): (u64, Vec<Vec<u8>>) = watch
                        .retrying("drift sweep", stop, || async {
                            Ok(redis::cmd("HSCAN")
                                .arg(self.keys.registry())
                                .arg(cursor)
                                .arg("COUNT")
                                .arg(self.settings.sweep_count)
                                .query_async(&mut self.conn.clone())
                                .await?)
                        })
                        .await?;
                    let pairs: Vec<(Vec<u8>, Vec<u8>)> = flat
                        .chunks_exact(2)
                        .map(|p| (p[0].clone(), p[1].clone()))
                        .collect();
                    self.remove_entries_of_dead_owners(&pairs, &mut report, stop)
                        .await?;
                    if next == 0 {
                        return Ok(report);
                    }
                    cursor = next;
                    pause_or_stop(pause, stop).await?;
                }
            }
            Layout::Keys => {
                let user_prefix = self.keys.user_key_prefix().into_bytes();
                let masters = watch
                    .retrying("listing the cluster's masters", stop, || {
                        conn::cluster_masters(&self.conn)
                    })
                    .await?;
                for (host, port) in masters {
                    let node = conn::shared(&conn::node_client(&self.settings, &host, port)?)?;
                    let mut cursor = 0u64;
                    loop {
                        let (next, pairs) = watch
                            .retrying("drift sweep", stop, || async {
                                let (next, found) = crate::conn::scan_page(
                                    &node,
                                    cursor,
                                    &pattern,
                                    self.settings.sweep_count,
                                    Some("string"),
                                )
                                .await?;
                                // One GET per key, pipelined on this node's own connection.
                                let gets = found
                                    .iter()
                                    .map(|k| redis::cmd("GET").arg(k).to_owned())
                                    .collect();
                                let owners: Vec<Option<Vec<u8>>> =
                                    conn::each_in_flight(&node, gets).await?;
                                let pairs: Vec<(Vec<u8>, Vec<u8>)> = found
                                    .iter()
                                    .zip(owners)
                                    .filter_map(|(k, o)| {
                                        Some((k.strip_prefix(user_prefix.as_slice())?.to_vec(), o?))
                                    })
                                    .collect();
                                Ok((next, pairs))
                            })
                            .await?;
                        self.remove_entries_of_dead_owners(&pairs, &mut report, stop)
                            .await?;
                        if next == 0 {
                            break;
                        }
                        cursor = next;
                        pause_or_stop(pause, stop).await?;
                    }
                }
                Ok(report)
            }
        }
    }

    /// Of (user, owner) pairs read by a sweep step, deletes (atomically re-checked) the
    /// entries whose owner is dead now; retried through transient states (idempotent).
    async fn remove_entries_of_dead_owners(
        &self,
        pairs: &[(Vec<u8>, Vec<u8>)],
        report: &mut SweepReport,
        stop: &CancellationToken,
    ) -> Result<()> {
        let removed = self
            .watch()
            .retrying("drift sweep", stop, || {
                self.entries_of_dead_owners_removed(pairs)
            })
            .await?;
        report.steps += 1;
        report.entries_scanned += pairs.len() as u64;
        report.entries_removed += removed;
        self.metrics.drift_entries_removed.inc_by(removed);
        self.health.beat();
        Ok(())
    }

    /// One attempt of [`Reconciler::remove_entries_of_dead_owners`]; returns how many
    /// entries it deleted.
    async fn entries_of_dead_owners_removed(&self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<u64> {
        let mut by_owner: std::collections::BTreeMap<ServerId, Vec<Vec<u8>>> = Default::default();
        for (user, owner) in pairs {
            // An owner that is not a valid server id never goes into a key name.
            if let Some(owner) = std::str::from_utf8(owner)
                .ok()
                .and_then(|o| ServerId::parse(o).ok())
            {
                by_owner.entry(owner).or_default().push(user.clone());
            }
        }
        let owners: Vec<&ServerId> = by_owner.keys().collect();
        let exists = owners
            .iter()
            .map(|s| {
                redis::cmd("EXISTS")
                    .arg(self.keys.server_alive(s))
                    .to_owned()
            })
            .collect();
        let scores = owners
            .iter()
            .map(|s| {
                redis::cmd("ZSCORE")
                    .arg(self.keys.servers())
                    .arg(s.as_str())
                    .to_owned()
            })
            .collect();
        let alive: Vec<bool> = conn::each_in_flight(&self.conn, exists).await?;
        let scores: Vec<Option<f64>> = conn::each_in_flight(&self.conn, scores).await?;
        let cutoff = self.cutoff_ms();
        let cleaner = crate::cleanup::Cleaner::new(self.keys.clone(), self.settings.layout, 1, 1);
        let mut removed = 0;
        for ((owner, users), (has_key, score)) in by_owner.iter().zip(alive.into_iter().zip(scores))
        {
            let dead = !has_key && score.is_none_or(|s| s as u64 <= cutoff);
            if dead {
                let (n, _) = cleaner.check_delete(&self.conn, owner, users).await?;
                removed += n;
            }
        }
        Ok(removed)
    }

    async fn sweep_reverse_sets(
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

    /// `reconcile --once`: one pass and one complete sweep, each step retried through
    /// transient states, until done.
    pub async fn run_once(&self) -> Result<OnceReport> {
        self.run_once_until(&CancellationToken::new()).await
    }

    /// [`Reconciler::run_once`], stopped with [`Error::Cancelled`] when `stop` fires.
    pub async fn run_once_until(&self, stop: &CancellationToken) -> Result<OnceReport> {
        let pass = self
            .watch()
            .retrying("reconcile pass", stop, || self.pass())
            .await?;
        let sweep = self
            .sweep(Duration::from_millis(self.settings.sweep_pause_ms), stop)
            .await?;
        Ok(OnceReport { pass, sweep })
    }

    /// Runs the pass, the expiry hint listener and the sweep until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let this = Arc::new(self);
        info!(
            redis = %conn::redact_url(&this.settings.redis_url),
            interval_ms = this.settings.reconcile_interval_ms,
            grace_ms = this.settings.heartbeat_grace_ms,
            "reconciler starting"
        );
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
                Ok(r) if r.published > 0 || r.invalid > 0 => info!(?r, "reconcile pass"),
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
        info!("reconciler stopped");
        Ok(())
    }

    /// The continuous sweep: paced steps from the stored cursor; after each complete
    /// cycle, the reverse sets, then a rest of one interval.
    async fn sweep_loop(self: Arc<Self>, shutdown: CancellationToken) {
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

    /// Listens for liveness-key expiries and checks those servers at once: on one node,
    /// or on every master of a cluster (notifications are per node).
    async fn hint_loop(self: Arc<Self>, shutdown: CancellationToken) {
        if let Some(client) = self.client.clone() {
            let db = client.get_connection_info().redis_settings().db();
            return self.subscribe_hints(client, db, shutdown).await;
        }
        self.hint_loop_on_cluster(shutdown).await
    }

    /// One subscription per master; when the set of masters changes (a failover, a
    /// reshard), the subscriptions are made again.
    async fn hint_loop_on_cluster(self: Arc<Self>, shutdown: CancellationToken) {
        let mut known: Vec<(String, u16)> = Vec::new();
        let mut subscriptions = CancellationToken::new();
        loop {
            match conn::cluster_masters(&self.conn).await {
                Ok(masters) if masters != known => {
                    subscriptions.cancel();
                    subscriptions = shutdown.child_token();
                    for (host, port) in &masters {
                        let client = match conn::node_client(&self.settings, host, *port) {
                            Ok(c) => c,
                            Err(e) => {
                                warn!(%host, port, error = %e, "no client for a master; its expiry hints are missed");
                                continue;
                            }
                        };
                        tokio::spawn(self.clone().subscribe_hints(
                            client,
                            0,
                            subscriptions.clone(),
                        ));
                    }
                    info!(
                        masters = masters.len(),
                        "listening for liveness-key expiries on every master"
                    );
                    known = masters;
                }
                Ok(_) => {}
                Err(e) => debug!(error = %e, "listing the cluster's masters failed"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Subscribes `client` to `__keyevent@<db>__:expired` and checks the servers whose
    /// liveness keys expire. Reconnects with backoff; after each (re)subscription a pass
    /// covers what was missed.
    async fn subscribe_hints(
        self: Arc<Self>,
        client: redis::Client,
        db: i64,
        shutdown: CancellationToken,
    ) {
        let channel = format!("__keyevent@{db}__:expired");
        let mut backoff = backon::BackoffBuilder::build(policy());
        loop {
            let subscribed = async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            let pubsub = tokio::select! {
                p = subscribed => p,
                _ = shutdown.cancelled() => return,
            };
            let mut messages = match pubsub {
                Ok(p) => {
                    backoff = backon::BackoffBuilder::build(policy());
                    info!(%channel, "listening for liveness-key expiries");
                    // Checked on every (re)subscription, not once at start: Redis may have
                    // been down or busy then, and a restart forgets a CONFIG SET.
                    if let Ok(node) = conn::shared(&client) {
                        self.ensure_notifications(&node).await;
                    }
                    p.into_on_message()
                }
                Err(e) => {
                    debug!(error = %e, "subscribing to expiry notifications failed");
                    let wait = backoff.next().unwrap_or(Duration::from_secs(5));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = shutdown.cancelled() => return,
                    }
                }
            };
            // Hints may have been lost while not subscribed.
            let (catch_up, stop) = (self.clone(), shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    r = catch_up.pass() => if let Err(e) = r {
                        debug!(error = %e, "catch-up pass failed");
                    },
                    _ = stop.cancelled() => {}
                }
            });
            loop {
                let msg = tokio::select! {
                    m = messages.next() => m,
                    _ = shutdown.cancelled() => return,
                };
                let Some(msg) = msg else { break };
                let Ok(key) = std::str::from_utf8(msg.get_payload_bytes()) else {
                    continue;
                };
                if let Some(server) = self
                    .keys
                    .server_of_alive_key(key)
                    .and_then(|s| ServerId::parse(s).ok())
                {
                    self.metrics.expiry_hints.inc();
                    self.clone().spawn_hint_check(server, &shutdown);
                }
            }
            warn!("expiry notification subscription lost; subscribing again");
        }
    }

    /// Starts [`Reconciler::on_expiry`] for `server`, unless it is being checked already
    /// or [`HINT_CHECKS`] checks are under way: then the hint is dropped, and the server
    /// is found by the pass, as when a notification is lost.
    fn spawn_hint_check(self: Arc<Self>, server: ServerId, stop: &CancellationToken) {
        let Ok(permit) = self.hint_permits.clone().try_acquire_owned() else {
            debug!(server_id = %server, limit = HINT_CHECKS, "too many expiry hints being checked; this one is left to the pass");
            return;
        };
        if !self
            .hinted
            .lock()
            .expect("not poisoned")
            .insert(server.clone())
        {
            return;
        }
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = self.on_expiry(&server) => {}
                _ = stop.cancelled() => {}
            }
            self.hinted.lock().expect("not poisoned").remove(&server);
            drop(permit);
        });
    }

    /// Checks a server whose liveness key just expired; if its heartbeat is still within
    /// the grace period, checks again when the grace period ends.
    async fn on_expiry(&self, server: &ServerId) {
        for _ in 0..2 {
            match self.check(server).await {
                Ok(Verdict::TooRecent { heartbeat_ms }) => {
                    let due = heartbeat_ms + self.settings.heartbeat_grace_ms + 50;
                    tokio::time::sleep(Duration::from_millis(due.saturating_sub(crate::now_ms())))
                        .await;
                }
                Ok(verdict) => {
                    debug!(server_id = %server, ?verdict, "expiry hint checked");
                    return;
                }
                Err(e) => {
                    debug!(server_id = %server, error = %e, "expiry hint check failed; the periodic pass will see it");
                    return;
                }
            }
        }
    }

    /// Makes sure expiry notifications are on, or says how to turn them on.
    async fn ensure_notifications(&self, node: &RedisConn) {
        let mut c = node.clone();
        let current: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("notify-keyspace-events")
            .query_async(&mut c)
            .await;
        let flags = match current {
            Ok(v) => v.get(1).cloned().unwrap_or_default(),
            Err(e) => {
                warn!(error = %e, "cannot read notify-keyspace-events; expiry hints may not arrive (the periodic pass still finds dead servers)");
                return;
            }
        };
        let has = |c: char| flags.contains(c);
        if has('E') && (has('x') || has('A')) {
            return;
        }
        if !self.settings.keyspace_events_auto {
            warn!(
                current = %flags,
                "keyspace expiry notifications are off: dead servers are found by the periodic pass only. \
                 To find them within a second: CONFIG SET notify-keyspace-events Ex (keeping other flags), \
                 or set keyspace_events_auto = true"
            );
            return;
        }
        let wanted = format!("{flags}Ex");
        match redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg(&wanted)
            .query_async::<()>(&mut c)
            .await
        {
            Ok(()) => info!(flags = %wanted, "turned on keyspace expiry notifications"),
            Err(e) => warn!(error = %e, "could not turn on keyspace expiry notifications"),
        }
    }
}

/// Waits `pause`, or returns [`Error::Cancelled`] at once when `stop` fires.
async fn pause_or_stop(pause: Duration, stop: &CancellationToken) -> Result<()> {
    tokio::select! {
        _ = tokio::time::sleep(pause) => Ok(()),
        _ = stop.cancelled() => Err(Error::Cancelled),
    }
}

/// Counts servers that are dead now (stale heartbeat and no liveness key), read-only.
pub async fn count_dead(conn: &RedisConn, keys: &Keys, grace_ms: u64) -> Result<u64> {
    let cutoff = crate::now_ms().saturating_sub(grace_ms);
    let stale: Vec<String> = redis::cmd("ZRANGEBYSCORE")
        .arg(keys.servers())
        .arg("-inf")
        .arg(cutoff)
        .query_async(&mut conn.clone())
        .await?;
    let servers: Vec<ServerId> = stale
        .iter()
        .filter_map(|s| ServerId::parse(s).ok())
        .collect();
    let mut dead = 0;
    for chunk in servers.chunks(PAGE) {
        let exists = chunk
            .iter()
            .map(|s| redis::cmd("EXISTS").arg(keys.server_alive(s)).to_owned())
            .collect();
        let alive: Vec<bool> = conn::each_in_flight(conn, exists).await?;
        dead += alive.iter().filter(|a| !**a).count() as u64;
    }
    Ok(dead)
}
