//! The worker's side of the data format (see [`crate::format`]): its round (announce
//! itself, read the format in use, move it forward when it may), what it logs and counts,
//! and how a worker whose build does not work under the format in use hands back what it
//! holds.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Worker;
use crate::{
    error::Result,
    format::{self, Announced, Stance},
    retry::Episode,
    stream,
};

/// How often a worker that takes no work looks for entries of its own to hand back.
const GIVE_BACK_EVERY: Duration = Duration::from_millis(500);

impl Worker {
    /// The live bound: an announcement older than this is a worker gone.
    fn format_live_ms(&self) -> u64 {
        self.settings.claim_min_idle_ms
    }

    /// One round: announce, read the format in use, and move it forward unless the
    /// worker is `leaving`.
    async fn format_round(&self, leaving: bool) -> Result<Announced> {
        format::announce(
            &self.conn,
            &self.keys,
            &self.consumer,
            self.format.build(),
            self.format_live_ms(),
            self.settings.consumer_expiry_ms,
            !leaving,
        )
        .await
    }

    /// The first round, at start-up, retried through transient states: the worker takes
    /// no work before it knows the format in use.
    pub(super) async fn first_format_round(&self, shutdown: &CancellationToken) -> Result<()> {
        let build = self.format.build();
        if build.is_overridden() {
            warn!(
                variable = format::OVERRIDE_ENV,
                build = %build.describe(),
                "data format: this build's format number is overridden, which is for testing upgrades only"
            );
        }
        let announced = self
            .watch()
            .retrying("announcing the data format", shutdown, || {
                self.format_round(false)
            })
            .await?;
        self.observe_format(&announced);
        Ok(())
    }

    /// Every `claim_min_idle_ms / 3` (or at once when a step was refused), until `stop`:
    /// one round. Once `leaving` (shutdown), the worker still announces itself, while its
    /// cleanups drain, but does not move the format forward.
    pub(super) async fn format_upkeep(
        self: Arc<Self>,
        stop: CancellationToken,
        leaving: CancellationToken,
    ) {
        let every = Duration::from_millis((self.format_live_ms() / 3).max(100));
        let mut failing = Episode::new("announcing the data format", None);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.format.woken() => {}
                _ = stop.cancelled() => return,
            }
            match self.format_round(leaving.is_cancelled()).await {
                Ok(announced) => {
                    failing.recovered();
                    self.observe_format(&announced);
                }
                Err(e) if e.is_retryable() => {
                    self.metrics.redis_errors.inc();
                    failing.failed(&e, every);
                }
                Err(e) => warn!(error = %e, "data format: announcing this worker failed"),
            }
        }
    }

    /// Takes in what a round found: the gate, the gauges, and a log line for each change.
    fn observe_format(&self, announced: &Announced) {
        let build = self.format.build();
        let before = self.format.stance();
        let in_use = announced.in_use;
        let after = build.stance(in_use);
        // The gauges first: once `/readyz` tells the new stance, they tell it too.
        self.metrics.format_in_use.set(i64::from(in_use));
        self.metrics
            .format_behind
            .set(i64::from(matches!(after, Stance::Behind { .. })));
        self.format.set_in_use(in_use);
        if announced.moved {
            info!(
                format = in_use,
                "data format: moved the format in use forward to this build's, no worker of an older format being announced"
            );
        }
        if before != after {
            match after {
                Stance::Works if before == Stance::Unknown => info!(
                    format = in_use,
                    build = %build.describe(),
                    "data format: working under the format in use"
                ),
                Stance::Works => info!(
                    format = in_use,
                    build = %build.describe(),
                    "data format: the format in use is one this build works under again: taking work"
                ),
                Stance::Behind { .. } => warn!(
                    format = in_use,
                    build = %build.describe(),
                    "data format: the format in use is newer than this build's: taking no new work, handing entries back; this worker stays up until it is replaced (/readyz says why)"
                ),
                Stance::Ahead { .. } => warn!(
                    format = in_use,
                    build = %build.describe(),
                    "data format: the format in use is older than this build works under: taking no work until it moves forward, which this worker does once no worker of an older format is announced"
                ),
                Stance::Unknown => {}
            }
        }
        let mut older = crate::lock::lock(&self.format_older);
        if announced.older != *older {
            if let (Some((consumer, format)), true) = (&announced.older, in_use < build.format) {
                info!(
                    in_use,
                    older_consumer = %consumer,
                    older_format = format,
                    "data format: the format in use stays where it is while a worker of an older format is announced"
                );
            }
            older.clone_from(&announced.older);
        }
    }

    /// After a step refused by the data format: whether this build works under the
    /// format in use, read now (and the worker's round woken, to take it in). False: the
    /// worker is behind (or too new), and hands the cleanup over. True: the step was
    /// refused for the format its progress record was written in, which this build does
    /// not read (a newer worker wrote it, before a rollback): a failed delivery like any
    /// other, retried by whichever worker takes the entry, a newer one writing the record
    /// back in the format in use, and dead-lettered with the reason after
    /// `max_deliveries`.
    pub(super) async fn works_under_format_now(&self) -> bool {
        match format::in_use(&self.conn, &self.keys).await {
            Ok(in_use) => {
                if self.format.in_use() != Some(in_use) {
                    self.format.wake();
                }
                self.format.build().works_under(in_use)
            }
            Err(e) => {
                debug!(error = %e, "data format: reading the format in use failed");
                self.format.wake();
                false
            }
        }
    }

    /// While the build does not work under the format in use: with nothing in hand, hands
    /// back every entry still pending to this consumer, then waits a little. False at
    /// shutdown.
    pub(super) async fn without_format(&self, shutdown: &CancellationToken) -> bool {
        if self.metrics.entries_in_hand.get() == 0 {
            self.give_back().await;
        }
        tokio::select! {
            _ = tokio::time::sleep(GIVE_BACK_EVERY) => true,
            _ = shutdown.cancelled() => false,
        }
    }

    /// Hands back every entry pending to this consumer (none is in hand) that is not
    /// claimable yet: each is made claimable at once, its delivery given back, for a
    /// worker that works under the format in use. (One handed back already is idle for
    /// `claim_min_idle_ms` or longer, and left so: its delivery is given back once.)
    async fn give_back(&self) {
        let ids = match stream::pending_of(&self.conn, &self.keys, &self.consumer, 100).await {
            Ok(ids) => ids,
            Err(e) => {
                debug!(error = %e, "data format: listing this worker's pending entries failed; trying again");
                return;
            }
        };
        for (id, idle_ms) in ids {
            if idle_ms < self.settings.claim_min_idle_ms {
                self.hand_back(&id).await;
            }
        }
    }

    /// Hands entry `id` over to a worker that works under the format in use: its delivery
    /// is given back and it is made claimable at once. One attempt: if it fails, the entry
    /// is taken over after `claim_min_idle_ms`, or handed back at the next round.
    pub(super) async fn hand_back(&self, id: &str) {
        match stream::hand_off(
            &self.conn,
            &self.keys,
            &self.consumer,
            id,
            self.settings.claim_min_idle_ms,
        )
        .await
        {
            Ok(Some(_)) => info!(
                id,
                "data format: entry handed back for a worker that works under the format in use"
            ),
            Ok(None) => {}
            Err(e) => debug!(id, error = %e, "data format: handing an entry back failed"),
        }
    }

    /// At exit: the announcement goes, so that a newer worker need not wait out the live
    /// bound to move the format forward. One attempt.
    pub(super) async fn withdraw_format(&self) {
        if let Err(e) = format::withdraw(&self.conn, &self.keys, &self.consumer).await {
            debug!(error = %e, "data format: removing this worker's announcement failed; it is ignored once past claim_min_idle_ms");
        }
    }
}
