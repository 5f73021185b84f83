//! The worker: a consumer in the group that cleans dead servers.
//!
//! ```text
//!  registry:events ──XREADGROUP (own connection, BLOCK)──► read loop ──spawn──► handle()
//!        ▲                                                   │ permits          │
//!        │              XAUTOCLAIM (idle > claim_min_idle) ──┘ (concurrency)    │
//!        └──────── XACK / dead letter then XACK (one script) ◄───────────────────┘
//! ```
//!
//! - At most `concurrency` entries are in hand at once: a semaphore permit moves into
//!   each spawned task, and the read asks for no more entries than there are permits.
//! - An entry is acknowledged only when its work is done: cleaned, dead-lettered, or not
//!   ours. A cleanup that fails or is abandoned stays pending; the claim loop of some
//!   worker takes it over after `claim_min_idle_ms` and resumes from the stored cursor.
//!   Past `max_deliveries`, it is dead-lettered with the delivery count.
//! - Redis outages are retried with capped backoff in every loop; nothing is acknowledged
//!   on the way.
//! - Shutdown: the read loop stops at once (a blocked read returns within `block_ms`);
//!   cleanups in hand run on for up to `drain_timeout_ms`, then stop between two steps.
//! - The data format (`format.rs`, [`crate::format`]): the worker announces its build's
//!   format every `claim_min_idle_ms / 3` and reads the format in use; while its build
//!   does not work under it, it takes no new events and no takeovers, hands back what it
//!   holds and is not ready. It moves the format forward to its own once no worker of an
//!   older format is announced.

mod entry;
mod format;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::conn::RedisConn;
use backon::BackoffBuilder;
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::{
    cleanup::Cleaner,
    config::Settings,
    conn,
    error::{Error, Result},
    health::{Failing, Health, Readiness},
    keys::Keys,
    maintenance,
    metrics::Metrics,
    retry::{policy, Episode, Watch},
    stream,
};

/// One worker process's state, shared by its tasks.
pub struct Worker {
    keys: Keys,
    consumer: String,
    cleaner: Cleaner,
    /// Decides on each verdict before any fence: doubtful ones beyond its limits are held.
    guard: crate::guard::Guard,
    settings: Settings,
    /// Where the blocking reader connects (one node or a cluster).
    target: conn::Target,
    conn: RedisConn,
    metrics: Metrics,
    /// Beaten by the read loop; read by `/healthz`.
    health: Arc<Health>,
    /// Work failing on a transient Redis state right now; read by `/readyz`.
    failing: Arc<Failing>,
    /// The data format in use as this worker knows it: it takes no work while its build
    /// does not work under it (see [`crate::format`] and `format.rs`).
    format: Arc<crate::format::Gate>,
    /// The older worker that last kept the format from moving forward, for the log.
    format_older: std::sync::Mutex<Option<(String, u32)>>,
}

impl Worker {
    /// Builds a worker from validated settings. On one node this does not touch Redis
    /// yet; on a cluster it connects to learn the slot map.
    pub async fn new(settings: &Settings, metrics: Metrics) -> Result<Self> {
        let target = conn::target_for(settings)?;
        let keys = Keys::for_settings(settings);
        let build = crate::format::Build::current()?;
        Ok(Worker {
            cleaner: Cleaner::new(
                keys.clone(),
                settings.layout,
                settings.chunk_size,
                settings.chunks_in_flight,
            )
            .fence_ttl(settings.fence_ttl_ms)
            .fence_unknown(
                settings.fence_unknown_ttl_ms,
                metrics.unknown_server_verdicts.clone(),
            )
            .format(build)
            .replica_wait(settings.cluster_replica_wait)
            .timing_replica_waits(metrics.replica_wait_seconds.clone())
            .counting_errors(metrics.redis_errors.clone())
            // One window for the whole process: every cleanup it runs shares it.
            .limited(crate::cleanup::limiter::Limiter::for_target(
                settings.latency_target_ms,
                settings.concurrency * settings.chunks_in_flight,
                settings.step_order,
                // A chunk's step spans the masters, unless the registry is one hash.
                settings.redis_cluster && settings.layout != crate::config::Layout::Hash,
                Some(metrics.steps.clone()),
            )),
            health: Health::new(Duration::from_secs(60)),
            failing: Failing::new(),
            format: crate::format::Gate::new(build),
            format_older: Default::default(),
            guard: crate::guard::Guard::new(keys.clone(), settings),
            keys,
            consumer: settings.consumer_name(),
            conn: conn::shared_for(&target).await?,
            target,
            settings: settings.clone(),
            metrics,
        })
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Liveness of this worker's main loop, for `/healthz`.
    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    /// Readiness of this worker (Redis answers, the group exists), for `/readyz`.
    pub fn readiness(&self) -> Readiness {
        Readiness {
            conn: self.conn.clone(),
            keys: self.keys.clone(),
            consumer: Some(self.consumer.clone()),
            failing: self.failing.clone(),
            format: Some(self.format.clone()),
        }
    }

    /// Where retries report: the error counter, the liveness, the readiness.
    fn watch(&self) -> Watch {
        Watch {
            errors: self.metrics.redis_errors.clone(),
            health: self.health.clone(),
            failing: self.failing.clone(),
            on_failure: None,
        }
    }

    /// Runs until `shutdown` fires, then drains. Returns an error only for a failure that
    /// retrying cannot fix (for example a permission error on the stream).
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let this = Arc::new(self);
        let abandon = CancellationToken::new();
        let permits = Arc::new(Semaphore::new(this.settings.concurrency));
        let mut tasks = JoinSet::new();
        info!(
            consumer = %this.consumer,
            stream = %this.keys.events(),
            redis = %conn::describe(&this.settings),
            "worker starting"
        );
        let _stop_ping = crate::health::spawn_redis_watch(
            this.conn.clone(),
            this.metrics.redis_up.clone(),
            &shutdown,
        );

        // Retried through every transient state (BUSY, OOM, NOREPLICAS, a refused
        // connection...): a deployment whose workers all start in one must not crash-loop.
        match this
            .watch()
            .retrying("creating the consumer group", &shutdown, || {
                stream::join_group(&this.conn, &this.keys, &this.consumer)
            })
            .await
        {
            Err(Error::Cancelled) => return Ok(()),
            other => other?,
        }

        match this
            .watch()
            .retrying("checking INFO and Lua scripting", &shutdown, || async {
                crate::cleanup::check_walkable(&this.conn).await?;
                crate::cleanup::check_scripting(&this.conn, &this.keys.events()).await
            })
            .await
        {
            Err(Error::Cancelled) => return Ok(()),
            other => other?,
        }

        match this.first_format_round(&shutdown).await {
            Err(Error::Cancelled) => return Ok(()),
            other => other?,
        }
        // The format round runs until the cleanups in hand are drained: their steps are
        // this worker's, and its announcement must stand while any is made.
        let stop_format = CancellationToken::new();
        let format_rounds = tokio::spawn(
            this.clone()
                .format_upkeep(stop_format.clone(), shutdown.clone()),
        );

        let stop_upkeep = shutdown.child_token();
        let upkeep = tokio::spawn(maintenance::run(
            this.conn.clone(),
            this.keys.clone(),
            this.settings.clone(),
            this.format.clone(),
            this.metrics.clone(),
            stop_upkeep.clone(),
        ));
        let sampler = tokio::spawn(this.clone().sample_gauges(stop_upkeep.clone()));
        let guard = tokio::spawn(this.clone().guard_upkeep(stop_upkeep.clone()));
        let result = this
            .clone()
            .read_loop(&permits, &mut tasks, &shutdown, &abandon)
            .await;
        stop_upkeep.cancel();
        let _ = upkeep.await;
        let _ = sampler.await;
        let _ = guard.await;
        this.drain(tasks, abandon).await;
        stop_format.cancel();
        let _ = format_rounds.await;
        this.withdraw_format().await;
        info!(consumer = %this.consumer, "worker stopped");
        result
    }

    async fn read_loop(
        self: Arc<Self>,
        permits: &Arc<Semaphore>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
        abandon: &CancellationToken,
    ) -> Result<()> {
        let watch = self.watch();
        let Some(reader) = self.connect_reader(&watch, shutdown).await? else {
            return Ok(());
        };
        let mut backoff = policy().build();
        let mut reading = watch.episode("reading events");
        // Takeover runs in this loop, between reads, with the permits in hand: a separate
        // loop would starve, as the read holds every free permit while it blocks.
        let claim_every =
            Duration::from_millis((self.settings.claim_min_idle_ms / 4).clamp(250, 10_000));
        let mut last_claim = Instant::now();
        let mut claim_cursor = crate::keys::ids::CLAIM_START.to_owned();
        loop {
            self.health.beat();
            while tasks.try_join_next().is_some() {}
            // A build that does not work under the format in use takes no new events and
            // no takeovers; what it holds goes back (see format.rs).
            if !self.format.works() {
                if !self.without_format(shutdown).await {
                    return Ok(());
                }
                continue;
            }
            let Some(mut held) = self.free_permits(permits, shutdown).await else {
                return Ok(());
            };
            if last_claim.elapsed() >= claim_every {
                last_claim = Instant::now();
                held = match self
                    .take_over(&mut claim_cursor, held, tasks, shutdown, abandon)
                    .await
                {
                    Ok(held) => held,
                    Err(Error::Cancelled) => return Ok(()),
                    Err(e) => {
                        error!(error = %e, "taking over idle entries failed");
                        continue;
                    }
                };
                if held.is_empty() {
                    continue;
                }
            }
            // The read is not raced against shutdown: dropping it mid-flight could leave
            // entries delivered to us that nobody handles until a takeover.
            let read = stream::read_new(
                &reader,
                &self.keys,
                &self.consumer,
                held.len(),
                self.settings.block_ms,
            )
            .await;
            let entries = match read {
                Ok(entries) => {
                    reading.recovered();
                    backoff = policy().build();
                    entries
                }
                Err(e) => {
                    if self
                        .after_failed_read(e, &mut backoff, &mut reading, shutdown)
                        .await?
                    {
                        continue;
                    }
                    return Ok(());
                }
            };
            for entry in entries {
                let permit = held
                    .pop()
                    .expect("entries are asked for with COUNT = the permits held, so each has one");
                tasks.spawn(self.clone().handle(entry, None, permit, abandon.clone()));
            }
        }
    }

    /// The reader's connection of its own (XREADGROUP BLOCK), retried through transient
    /// states; None at shutdown.
    async fn connect_reader(
        &self,
        watch: &Watch,
        shutdown: &CancellationToken,
    ) -> Result<Option<RedisConn>> {
        let block = Duration::from_millis(self.settings.block_ms);
        match watch
            .retrying("connecting the reader", shutdown, || {
                conn::blocking_for(&self.target, block)
            })
            .await
        {
            Err(Error::Cancelled) => Ok(None),
            other => other.map(Some),
        }
    }

    /// Every free permit, at least one: waits for the first (waiting still counts as
    /// turning, since every permit may be busy with a long cleanup). None at shutdown.
    async fn free_permits(
        &self,
        permits: &Arc<Semaphore>,
        shutdown: &CancellationToken,
    ) -> Option<Vec<OwnedSemaphorePermit>> {
        let first = loop {
            tokio::select! {
                p = permits.clone().acquire_owned() => break p.expect("the permits semaphore is never closed"),
                _ = tokio::time::sleep(Duration::from_secs(1)) => self.health.beat(),
                _ = shutdown.cancelled() => return None,
            }
        };
        let mut held = vec![first];
        while let Ok(p) = permits.clone().try_acquire_owned() {
            held.push(p);
        }
        (!shutdown.is_cancelled()).then_some(held)
    }

    /// After a failed read: a vanished stream or group is created again, a transient
    /// state is waited out for the next `backoff` delay; anything else stops the worker
    /// (Err). Ok(true) to read again, Ok(false) at shutdown.
    async fn after_failed_read(
        &self,
        e: Error,
        backoff: &mut impl Iterator<Item = Duration>,
        reading: &mut Episode<'_>,
        shutdown: &CancellationToken,
    ) -> Result<bool> {
        if stream::is_no_group(&e) {
            warn!("the events stream or its group is gone; creating it again");
            let joined = self
                .watch()
                .retrying("creating the consumer group", shutdown, || {
                    stream::join_group(&self.conn, &self.keys, &self.consumer)
                })
                .await;
            return match joined {
                Err(Error::Cancelled) => Ok(false),
                other => other.map(|()| true),
            };
        }
        if !e.is_retryable() {
            return Err(e);
        }
        self.metrics.redis_errors.inc();
        let wait = backoff.next().unwrap_or(Duration::from_secs(5));
        reading.failed(&e, wait);
        tokio::select! {
            _ = tokio::time::sleep(wait) => Ok(true),
            _ = shutdown.cancelled() => Ok(false),
        }
    }

    /// Waits for cleanups in hand; past the drain timeout, tells them to stop between steps.
    async fn drain(&self, mut tasks: JoinSet<()>, abandon: CancellationToken) {
        if tasks.is_empty() {
            return;
        }
        info!(in_flight = tasks.len(), "draining cleanups in hand");
        let timeout = Duration::from_millis(self.settings.drain_timeout_ms);
        let all_done = async { while tasks.join_next().await.is_some() {} };
        tokio::pin!(all_done);
        tokio::select! {
            _ = &mut all_done => return,
            _ = tokio::time::sleep(timeout) => {}
        }
        warn!("drain timeout reached; abandoning cleanups between steps (they stay pending)");
        abandon.cancel();
        all_done.await;
    }

    /// Every second: the guard's upkeep of held verdicts (see [`crate::guard`]), and the
    /// held-verdicts gauge.
    async fn guard_upkeep(self: Arc<Self>, stop: CancellationToken) {
        use crate::metrics::guard_decision;
        loop {
            // A worker that does not work under the format in use writes nothing.
            if !self.format.works() {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.cancelled() => return,
                }
            }
            match self.guard.upkeep(&self.conn).await {
                Ok(round) => {
                    self.metrics.guard_held.set(round.held as i64);
                    let verdicts = &self.metrics.guard_verdicts;
                    verdicts
                        .with_label_values(&[guard_decision::DROPPED])
                        .inc_by(round.dropped);
                    verdicts
                        .with_label_values(&[guard_decision::RELEASED])
                        .inc_by(round.released);
                }
                Err(e) => debug!(error = %e, "guard upkeep failed; next round in a second"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Samples the stream's lag, pending entries and dead letters into gauges.
    async fn sample_gauges(self: Arc<Self>, stop: CancellationToken) {
        loop {
            match crate::status::collect_from(&self.conn, &self.keys).await {
                Ok(s) => {
                    self.metrics.stream_lag.set(s.lag.unwrap_or(0) as i64);
                    self.metrics.stream_pending.set(s.pending as i64);
                    self.metrics.dead_letters.set(s.dead_letters as i64);
                }
                Err(e) => debug!(error = %e, "sampling stream gauges failed"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}
