//! The cleanup on a single Redis node: each step is one call of clean_step.lua, which
//! walks the chunk and deletes its entries atomically, and `chunks_in_flight` steps are
//! kept queued so Redis never waits for the worker.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        LazyLock,
    },
    time::Duration,
};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use super::{limiter::StepOrder, Cleaner, Report, Step, WalkMode};
use crate::{
    conn::RedisConn,
    error::{Error, Result},
    event::ServerId,
    retry::retrying_counted,
};

static CLEAN_STEP: LazyLock<redis::Script> =
    LazyLock::new(|| crate::forward::with_prelude(include_str!("clean_step.lua")));

impl Cleaner {
    /// [`Cleaner::clean_event`] on one node.
    pub(super) async fn clean_on_node(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        event_id: &str,
        entry: Option<&str>,
        stop: &CancellationToken,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        // Once Redis says OOM, the rest of this cleanup walks in the mode that takes no
        // memory: the cleanup is what frees it.
        let oom = std::sync::atomic::AtomicBool::new(false);
        // With a limiter, the members left (read once, then counted down by this
        // worker's steps) order the cleanups' steps when `step_order` is smallest_first.
        let left = AtomicU64::new(match &self.limiter {
            Some(limiter) if limiter.order() == StepOrder::SmallestFirst => {
                self.members_left(conn, server).await.unwrap_or(u64::MAX)
            }
            _ => 0,
        });
        let step = || {
            retrying_counted("cleanup step", stop, self.errors.as_ref(), || async {
                let mode = if oom.load(Ordering::Relaxed) {
                    WalkMode::Pop
                } else {
                    WalkMode::Scan
                };
                let mut permit = match &self.limiter {
                    Some(limiter) => Some(limiter.acquire(left.load(Ordering::Relaxed)).await),
                    None => None,
                };
                if let Some(permit) = permit.as_mut() {
                    permit.sent();
                }
                let size = match &self.limiter {
                    Some(limiter) => limiter.step_size(self.chunk_size),
                    None => self.chunk_size,
                };
                let result = self
                    .step_sized(conn, server, mode, event_id, entry, size)
                    .await;
                let result = match result {
                    Err(Error::Redis(e)) if e.code() == Some("OOM") && mode == WalkMode::Scan => {
                        if !oom.swap(true, Ordering::Relaxed) {
                            tracing::warn!(server_id = %server, "Redis is out of memory: walking on with SPOP, which needs none");
                        }
                        // The round trip measured is the retry's alone.
                        if let Some(permit) = permit.as_mut() {
                            permit.sent();
                        }
                        self.step_sized(conn, server, WalkMode::Pop, event_id, entry, size)
                            .await
                    }
                    other => other,
                };
                if let (Some(permit), Ok(step)) = (permit, &result) {
                    permit.complete(Duration::from_micros(step.execution_us), step.scanned);
                    let _ = left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                        Some(n.saturating_sub(step.scanned))
                    });
                }
                result
            })
        };
        let mut report = Report::default();
        let mut in_flight: FuturesUnordered<_> =
            (0..self.chunks_in_flight).map(|_| step()).collect();
        // Steps queued behind the one that found nothing left may have started a new walk
        // (members registered after it): the cleanup ends only when the last step to
        // complete found nothing left, so no such walk is left half done.
        let mut done = false;
        while let Some(result) = in_flight.next().await {
            let outcome = match result {
                Err(Error::Cancelled) => continue,
                other => other?,
            };
            report.add(&outcome);
            on_step(&outcome);
            done = outcome.done;
            if !done && !stop.is_cancelled() {
                in_flight.push(step());
            }
        }
        if done {
            report.acknowledged = entry.is_some();
            Ok(report)
        } else {
            Err(Error::Cancelled)
        }
    }

    /// Members of `server` left to walk: its reverse set, the set being walked and the
    /// members set aside (SCARD, SCARD, ZCARD).
    async fn members_left(&self, conn: &RedisConn, server: &ServerId) -> Result<u64> {
        let (users, walking, moved): (u64, u64, u64) = redis::pipe()
            .scard(self.keys.server_users(server))
            .scard(self.keys.server_walking(server))
            .zcard(self.keys.server_moved(server))
            .query_async(&mut conn.clone())
            .await?;
        Ok(users + walking + moved)
    }

    /// One call of the step script, walking `chunk_size` members with SSCAN (see
    /// [`Cleaner::step_sized`]).
    pub async fn step(&self, conn: &RedisConn, server: &ServerId) -> Result<Step> {
        self.step_sized(conn, server, WalkMode::Scan, "", None, self.chunk_size)
            .await
    }

    /// One call of the step script (clean_step.lua) in `mode`, walking `size` members (the
    /// limiter's step size, or `chunk_size`); with `entry`, the step that finds nothing
    /// left acknowledges that entry. The users it deletes are announced on the evictions
    /// stream, with `event_id`.
    async fn step_sized(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        mode: WalkMode,
        event_id: &str,
        entry: Option<&str>,
        size: usize,
    ) -> Result<Step> {
        let layout = self.layout.as_str();
        let mut call = CLEAN_STEP.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_moved(server))
            .key(self.keys.server_cleanup(server))
            .key(self.keys.servers())
            .key(self.keys.registry())
            .key(self.keys.events());
        if let Some(stream) = self.keys.evictions() {
            call.key(stream);
        }
        call.arg(server.as_str())
            .arg(size)
            .arg(layout)
            .arg(self.keys.user_key_prefix())
            .arg(match mode {
                WalkMode::Scan => "scan",
                WalkMode::Pop => "pop",
            })
            .arg(crate::keys::GROUP)
            .arg(entry.unwrap_or(""))
            .arg(event_id);
        let (done, scanned, deleted, kept, _mode, announced, execution_us): (
            i64,
            u64,
            u64,
            u64,
            String,
            u64,
            u64,
        ) = call.invoke_async(&mut conn.clone()).await?;
        Ok(Step {
            done: done == 1,
            scanned,
            deleted,
            kept,
            announced,
            // On one node exactly the users the step deleted.
            announced_users: if announced > 0 { deleted } else { 0 },
            execution_us,
        })
    }
}
