//! One entry, from the moment the worker holds it to its end: taken over from an idle
//! consumer, classified, cleaned (kept from looking idle meanwhile), then acknowledged,
//! dead-lettered, handed off at shutdown, or left pending after a failure.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{sync::OwnedSemaphorePermit, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

use super::Worker;
use crate::{
    error::{Error, Result},
    event::{classify, Classified, Entry, ServerDead, ServerId},
    metrics::outcome,
    stream,
};

impl Worker {
    /// Takes over entries idle longer than `claim_min_idle_ms` (their consumer crashed
    /// or stalled), as many as the permits in hand; returns the permits left over.
    pub(super) async fn take_over(
        self: &Arc<Self>,
        cursor: &mut String,
        mut held: Vec<OwnedSemaphorePermit>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
        abandon: &CancellationToken,
    ) -> Result<Vec<OwnedSemaphorePermit>> {
        let watch = self.watch();
        // Re-registers this worker if consumer expiry removed it while it sat idle. One
        // try, not a retry loop: XGROUP CREATECONSUMER is refused under OOM (even when the
        // consumer exists), and waiting on it here would stop this worker from reading
        // and taking over events while Redis is full; XAUTOCLAIM and XREADGROUP create the
        // consumer anyway.
        if let Err(e) = stream::register_consumer(&self.conn, &self.keys, &self.consumer).await {
            debug!(error = %e, "registering the consumer failed; the next read or claim does it");
        }
        let claimed = watch
            .retrying("taking over idle entries", shutdown, || {
                stream::autoclaim(
                    &self.conn,
                    &self.keys,
                    &self.consumer,
                    self.settings.claim_min_idle_ms,
                    cursor,
                    held.len(),
                )
            })
            .await?;
        *cursor = claimed.next_cursor;
        if claimed.deleted > 0 {
            self.metrics.entries_vanished.inc_by(claimed.deleted as u64);
            warn!(
                count = claimed.deleted,
                "pending entries had been deleted from the stream; dropped from the pending list"
            );
        }
        for (entry, deliveries) in claimed.entries {
            self.metrics.entries_claimed.inc();
            info!(id = %entry.id, deliveries, "taking over an idle entry");
            let permit = held
                .pop()
                .expect("entries are asked for with COUNT = the permits held, so each has one");
            tasks.spawn(
                self.clone()
                    .handle(entry, Some(deliveries), permit, abandon.clone()),
            );
        }
        Ok(held)
    }

    /// Handles one entry to its end: acknowledged, dead-lettered, or left pending.
    pub(super) async fn handle(
        self: Arc<Self>,
        entry: Entry,
        deliveries: Option<u64>,
        _permit: OwnedSemaphorePermit,
        abandon: CancellationToken,
    ) {
        // Falls when this function returns, whichever way.
        struct InHand(prometheus::IntGauge);
        impl Drop for InHand {
            fn drop(&mut self) {
                self.0.dec();
            }
        }
        self.metrics.entries_in_hand.inc();
        let _in_hand = InHand(self.metrics.entries_in_hand.clone());
        let classified = classify(&entry, self.settings.max_payload_bytes);
        if let Some(n) = deliveries.filter(|&n| n > self.settings.max_deliveries) {
            let mut reason = format!(
                "delivered {n} times, more than max_deliveries={}",
                self.settings.max_deliveries
            );
            if let Classified::ServerDead(_, server) = &classified {
                if let Some(last) = self.cleaner.last_failure(&self.conn, server).await {
                    reason.push_str("; last error: ");
                    reason.push_str(&last);
                }
            }
            return self.dead_letter(&entry, &reason, &abandon).await;
        }
        match classified {
            Classified::Foreign(kind) => {
                debug!(id = %entry.id, %kind, "not ours; acknowledging");
                if self.ack(&entry.id, &abandon).await {
                    self.metrics
                        .events
                        .with_label_values(&[outcome::IGNORED])
                        .inc();
                }
            }
            Classified::Malformed(e) => self.dead_letter(&entry, &e.to_string(), &abandon).await,
            Classified::ServerDead(event, server) => {
                let span = info_span!("server_dead", event_id = %event.event_id, server_id = %server, entry = %entry.id);
                self.guarded(&entry, &event, &server, &abandon)
                    .instrument(span)
                    .await
            }
        }
    }

    /// Puts a verdict to the guard (see [`crate::guard`]), then cleans, holds, parks or
    /// acknowledges it as the guard says.
    async fn guarded(
        &self,
        entry: &Entry,
        event: &ServerDead,
        server: &ServerId,
        abandon: &CancellationToken,
    ) {
        use crate::guard::Decision;
        use crate::metrics::guard_decision;
        let decided = self
            .watch()
            .retrying("putting a verdict to the guard", abandon, || {
                self.guard.decide(&self.conn, &entry.id, event, server)
            })
            .await;
        let verdicts = &self.metrics.guard_verdicts;
        match decided {
            Ok(Decision::Proceed {
                released,
                let_through,
            }) => {
                if let_through {
                    verdicts
                        .with_label_values(&[guard_decision::LET_THROUGH])
                        .inc();
                    warn!("guard: disputed verdict (its server still heartbeats) let through, within guard_disputed_limit");
                }
                self.clean(entry, event, server, abandon).await;
                if released {
                    // Once acknowledged, the hold is over; if the cleanup failed, the entry
                    // is still pending and the hold (released) stays until it is done.
                    if let Err(e) = self
                        .guard
                        .forget(&self.conn, server.as_str(), &entry.id)
                        .await
                    {
                        debug!(error = %e, "forgetting a released hold failed; the guard's upkeep does it");
                    }
                }
            }
            Ok(Decision::Hold { hold, first }) => {
                verdicts.with_label_values(&[guard_decision::HELD]).inc();
                if first {
                    warn!(doubt = hold.doubt.as_str(), detail = %hold.detail, "guard: a hold started; verdicts are held, not executed (see `registry-janitor held list`)");
                }
                warn!(doubt = hold.doubt.as_str(), detail = %hold.detail, source = hold.source.as_deref().unwrap_or(""), "guard: verdict held: not fenced, not cleaned, not acknowledged");
                self.park(entry, abandon).await;
            }
            Ok(Decision::Park) => {
                info!("guard: verdict already held; parked again");
                self.park(entry, abandon).await;
            }
            Ok(Decision::Duplicate { held_entry }) => {
                info!(%held_entry, "guard: a verdict for this server is held already; this one acknowledged as its duplicate");
                if self.ack(&entry.id, abandon).await {
                    verdicts
                        .with_label_values(&[guard_decision::DUPLICATE])
                        .inc();
                }
            }
            Err(Error::Cancelled) => self.hand_off(&entry.id).await,
            Err(e) => {
                self.metrics
                    .events
                    .with_label_values(&[outcome::FAILED])
                    .inc();
                error!(error = %e, "the guard could not decide; the entry stays pending and is retried after claim_min_idle_ms");
            }
        }
    }

    /// Parks a held verdict's entry with the guard's consumer, retrying through outages.
    async fn park(&self, entry: &Entry, abandon: &CancellationToken) {
        let parked = self
            .watch()
            .retrying("parking a held verdict", abandon, || {
                self.guard.park(&self.conn, &entry.id)
            })
            .await;
        if let Err(e) = parked {
            warn!(error = %e, "parking a held verdict failed; the hold stands, the guard's upkeep parks it");
        }
    }

    /// Cleans the server of a `server.dead` entry, keeping the entry's idle time low while
    /// it runs; counts and logs the outcome. The entry is acknowledged by the cleanup
    /// itself (see [`crate::cleanup::Cleaner::clean_event`]), handed off at shutdown or
    /// when a step is refused by the data format, or left pending after a failure (with
    /// the error noted for its dead letter, should it come to that).
    pub(super) async fn clean(
        &self,
        entry: &Entry,
        event: &ServerDead,
        server: &ServerId,
        abandon: &CancellationToken,
    ) {
        let started = Instant::now();
        let metrics = &self.metrics;
        let origin = crate::cleanup::EventRef {
            entry: &entry.id,
            event_id: &event.event_id,
        };
        let cleaning =
            self.cleaner
                .clean_event(&self.conn, server, Some(origin), abandon, |step| {
                    metrics.entries_deleted.inc_by(step.deleted);
                    metrics.entries_kept.inc_by(step.kept);
                    metrics.cluster_users_rechecked.inc_by(step.rechecked);
                    metrics.observe_evictions(step.announced, step.announced_users);
                });
        let cleaned = tokio::select! {
            r = cleaning => r,
            never = self.keep_alive(&entry.id) => match never {},
        };
        match cleaned {
            Ok(report) => {
                // The cleanup acknowledges the entry itself, in (one node) or right after
                // (cluster) the step that finds nothing left.
                if report.acknowledged || self.ack(&entry.id, abandon).await {
                    let elapsed = started.elapsed();
                    metrics.events.with_label_values(&[outcome::CLEANED]).inc();
                    metrics.cleanup_seconds.observe(elapsed.as_secs_f64());
                    let stale = crate::now_ms().saturating_sub(event.detected_at_ms);
                    metrics.stale_window_seconds.observe(stale as f64 / 1000.0);
                    info!(
                        deleted = report.deleted,
                        kept = report.kept,
                        scanned = report.scanned,
                        elapsed_ms = elapsed.as_millis() as u64,
                        "server cleaned"
                    );
                }
            }
            Err(Error::Cancelled) => {
                metrics
                    .events
                    .with_label_values(&[outcome::ABANDONED])
                    .inc();
                self.hand_off(&entry.id).await;
            }
            Err(e @ Error::Format(_)) if !self.works_under_format_now().await => {
                // Not a failure: a worker that works under the format in use takes over
                // at once, from the stored progress.
                metrics
                    .events
                    .with_label_values(&[outcome::ABANDONED])
                    .inc();
                warn!(error = %e, "cleanup stopped: this worker's build does not work under the data format in use; handing it over");
                self.hand_back(&entry.id).await;
            }
            Err(e) => {
                metrics.events.with_label_values(&[outcome::FAILED]).inc();
                error!(error = %e, "cleanup failed; the entry stays pending and is retried after claim_min_idle_ms");
                self.cleaner
                    .record_failure(&self.conn, server, &e.to_string())
                    .await;
            }
        }
    }

    /// While a cleanup runs, keeps its entry's idle time well under `claim_min_idle_ms`, so
    /// a healthy worker on a huge server is never raced by a takeover. Never returns.
    pub(super) async fn keep_alive(&self, id: &str) -> std::convert::Infallible {
        let every = Duration::from_millis(self.settings.claim_min_idle_ms / 3);
        let mut ours = true;
        loop {
            tokio::time::sleep(every).await;
            if !ours {
                continue;
            }
            match stream::touch(&self.conn, &self.keys, &self.consumer, id).await {
                Ok(true) => {}
                Ok(false) => {
                    ours = false;
                    warn!(id, "entry taken over by another consumer while still being cleaned; finishing anyway (the cleanup is idempotent)");
                }
                Err(e) => debug!(id, error = %e, "keep-alive failed; will try again"),
            }
        }
    }

    /// After a cleanup was abandoned at shutdown: a graceful hand-off is not a failed
    /// delivery, so the delivery is given back (a rolling deploy must not push a healthy
    /// cleanup toward `max_deliveries`), and the entry is made claimable at once. One
    /// attempt, as the process is stopping: if it fails, the entry keeps its count and is
    /// taken over after `claim_min_idle_ms`, as after a crash.
    pub(super) async fn hand_off(&self, id: &str) {
        match stream::hand_off(
            &self.conn,
            &self.keys,
            &self.consumer,
            id,
            self.settings.claim_min_idle_ms,
        )
        .await
        {
            Ok(Some(deliveries)) => info!(
                deliveries,
                "cleanup abandoned at shutdown; handed over for takeover at once, this delivery not counted"
            ),
            Ok(None) => info!("cleanup abandoned at shutdown; the entry was already taken over"),
            Err(e) => warn!(
                error = %e,
                "cleanup abandoned at shutdown; handing it over failed, the entry stays pending for takeover"
            ),
        }
    }

    /// Acknowledges, retrying through outages; false if abandoned first.
    pub(super) async fn ack(&self, id: &str, abandon: &CancellationToken) -> bool {
        match self
            .watch()
            .retrying("acknowledging", abandon, || {
                stream::ack(&self.conn, &self.keys, id)
            })
            .await
        {
            Ok(_) => true,
            Err(e) => {
                warn!(id, error = %e, "not acknowledged; the entry stays pending");
                false
            }
        }
    }

    pub(super) async fn dead_letter(
        &self,
        entry: &Entry,
        reason: &str,
        abandon: &CancellationToken,
    ) {
        let done = self
            .watch()
            .retrying("dead-lettering", abandon, || {
                stream::dead_letter(&self.conn, &self.keys, entry, reason)
            })
            .await;
        match done {
            Ok(()) => {
                self.metrics
                    .events
                    .with_label_values(&[outcome::DEAD_LETTERED])
                    .inc();
                warn!(id = %entry.id, error = reason, "entry dead-lettered");
            }
            Err(e) => {
                warn!(id = %entry.id, error = %e, "dead-lettering failed; the entry stays pending")
            }
        }
    }
}
