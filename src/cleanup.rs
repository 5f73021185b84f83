//! Cleaning one dead server: the algorithm behind a `server.dead` event.
//!
//! The work is a series of steps, each one call of `clean_step.lua` on Redis: SSCAN the
//! next chunk of the reverse set (cursor kept in `server:{S}:cleanup`), check-and-delete
//! each forward entry atomically, SREM the chunk. No command ever loads the whole set,
//! and one step costs Redis about a millisecond per thousand users.
//!
//! `chunks_in_flight` steps are kept outstanding on the multiplexed connection, so Redis
//! always has the next step queued while the worker reads the previous answer. Steps
//! share the stored cursor, so concurrent steps (of this worker, or of another worker on
//! a duplicate event) each take a different chunk.
//!
//! Between steps the worker checks its stop token: a cleanup abandoned there leaves a
//! consistent state that any worker resumes from.

use std::sync::LazyLock;

use crate::conn::RedisConn;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use crate::{
    config::Layout,
    error::{Error, Result},
    event::ServerId,
    keys::Keys,
    retry::retrying_counted,
};

static CLEAN_STEP: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(concat!(
        include_str!("owners.lua"),
        include_str!("clean_step.lua")
    ))
});

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Step {
    /// The reverse set is empty and the server's bookkeeping is gone: clean.
    pub done: bool,
    /// Reverse-set members handled by this step.
    pub scanned: u64,
    /// Forward entries deleted (they still pointed at the dead server).
    pub deleted: u64,
    /// Forward entries left alone because they point at another server now.
    pub kept: u64,
}

/// Totals of one cleanup, as seen by this worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    pub steps: u64,
    pub scanned: u64,
    pub deleted: u64,
    pub kept: u64,
}

impl Report {
    fn add(&mut self, step: &Step) {
        self.steps += 1;
        self.scanned += step.scanned;
        self.deleted += step.deleted;
        self.kept += step.kept;
    }
}

/// Cleans dead servers of one registry.
#[derive(Debug, Clone)]
pub struct Cleaner {
    keys: Keys,
    layout: Layout,
    chunk_size: usize,
    chunks_in_flight: usize,
    /// Counts failed step attempts (Redis errors), when set.
    errors: Option<prometheus::IntCounter>,
}

impl Cleaner {
    pub fn new(keys: Keys, layout: Layout, chunk_size: usize, chunks_in_flight: usize) -> Self {
        Cleaner {
            keys,
            layout,
            chunk_size,
            chunks_in_flight: chunks_in_flight.max(1),
            errors: None,
        }
    }

    /// Counts every failed step attempt in `errors`.
    pub fn counting_errors(mut self, errors: prometheus::IntCounter) -> Self {
        self.errors = Some(errors);
        self
    }

    /// Cleans `server` until its reverse set is gone. Retries through Redis outages.
    /// Returns [`Error::Cancelled`] if `stop` fires first (the state stays consistent and
    /// resumable); `on_step` sees every step as it completes.
    pub async fn clean(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        stop: &CancellationToken,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        let step = || {
            retrying_counted("cleanup step", stop, self.errors.as_ref(), || {
                self.step(conn, server)
            })
        };
        let mut report = Report::default();
        let mut in_flight: FuturesUnordered<_> =
            (0..self.chunks_in_flight).map(|_| step()).collect();
        let mut done = false;
        while let Some(result) = in_flight.next().await {
            let outcome = match result {
                Err(Error::Cancelled) => continue,
                other => other?,
            };
            report.add(&outcome);
            on_step(&outcome);
            done |= outcome.done;
            if !done && !stop.is_cancelled() {
                in_flight.push(step());
            }
        }
        if done {
            Ok(report)
        } else {
            Err(Error::Cancelled)
        }
    }

    /// How far the cleanup of `server` has got: `Some(members scanned)` while under
    /// way (0 before the first step), `None` once the server is clean (no reverse set).
    pub async fn progress(&self, conn: &RedisConn, server: &ServerId) -> Result<Option<u64>> {
        let (exists, scanned): (bool, Option<u64>) = redis::pipe()
            .exists(self.keys.server_users(server))
            .hget(self.keys.server_cleanup(server), "scanned")
            .query_async(&mut conn.clone())
            .await?;
        Ok(exists.then_some(scanned.unwrap_or(0)))
    }

    /// Notes why cleaning `server` failed, in its progress record, so that the worker
    /// that finally dead-letters the event can say why (best effort).
    pub async fn record_failure(&self, conn: &RedisConn, server: &ServerId, error: &str) {
        let _: redis::RedisResult<()> = redis::cmd("HSET")
            .arg(self.keys.server_cleanup(server))
            .arg("last_error")
            .arg(error)
            .query_async(&mut conn.clone())
            .await;
    }

    /// The last failure noted for `server`, if any.
    pub async fn last_failure(&self, conn: &RedisConn, server: &ServerId) -> Option<String> {
        redis::cmd("HGET")
            .arg(self.keys.server_cleanup(server))
            .arg("last_error")
            .query_async(&mut conn.clone())
            .await
            .ok()
            .flatten()
    }

    /// One call of the step script.
    pub async fn step(&self, conn: &RedisConn, server: &ServerId) -> Result<Step> {
        let layout = match self.layout {
            Layout::Hash => "hash",
            Layout::Keys => "keys",
        };
        let mut call = CLEAN_STEP.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_cleanup(server))
            .key(self.keys.servers())
            .key(self.keys.registry())
            .arg(server.as_str())
            .arg(self.chunk_size)
            .arg(layout)
            .arg(self.keys.user_key_prefix());
        let (done, scanned, deleted, kept): (i64, u64, u64, u64) =
            call.invoke_async(&mut conn.clone()).await?;
        Ok(Step {
            done: done == 1,
            scanned,
            deleted,
            kept,
        })
    }
}
