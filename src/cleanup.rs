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
static CLUSTER_SCAN: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("cluster_scan.lua")));
static CLUSTER_ADVANCE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("cluster_advance.lua")));
static CHECK_DELETE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(concat!(
        include_str!("owners.lua"),
        include_str!("check_delete.lua")
    ))
});

/// The cluster's `current_epoch` (CLUSTER INFO): it grows with every failover.
async fn cluster_epoch(conn: &RedisConn) -> Result<u64> {
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut conn.clone())
        .await?;
    info.lines()
        .find_map(|l| l.strip_prefix("cluster_current_epoch:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::Protocol("CLUSTER INFO without cluster_current_epoch".into()))
}

/// Check-and-delete scripts (one per slot) of one chunk in flight at once on a cluster.
const CLUSTER_SLOTS_IN_FLIGHT: usize = 64;

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
    /// Members visited, over every walk of the set.
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
        if conn.is_cluster() {
            return self.clean_on_cluster(conn, server, stop, on_step).await;
        }
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

    /// The cleanup on a Redis Cluster, where one script cannot touch the reverse set
    /// (slot of `{S}`) and the forward entries (other slots) together. Each chunk is three
    /// single-slot operations: scan (cluster_scan.lua), check-and-delete per slot
    /// (check_delete.lua, many slots in flight), advance the cursor (cluster_advance.lua).
    /// The cursor moves only after the chunk's deletes, so a crash repeats a chunk and
    /// never skips one. Replication is asynchronous, so a failover can lose deletes the
    /// old master acknowledged, and redis-rs rides out a failover without an error ever
    /// reaching this code: a cleanup during which the cluster's `current_epoch` changed
    /// (every failover bumps it) or Redis errors were seen walks the set once more (up
    /// to 3 walks) before it finishes.
    async fn clean_on_cluster(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        stop: &CancellationToken,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        let errors =
            prometheus::IntCounter::new("cleanup_errors", "this cleanup's failed attempts")
                .expect("valid counter");
        let count_globally = |n: u64| {
            if let Some(global) = &self.errors {
                global.inc_by(n);
            }
        };
        let mut report = Report::default();
        let mut walks = 1;
        let mut epoch =
            retrying_counted("cluster epoch", stop, Some(&errors), || cluster_epoch(conn)).await?;
        loop {
            if stop.is_cancelled() {
                count_globally(errors.get());
                return Err(Error::Cancelled);
            }
            let (at, next, members) = retrying_counted("cleanup scan", stop, Some(&errors), || {
                self.cluster_scan(conn, server)
            })
            .await?;
            let (deleted, kept) = retrying_counted("cleanup delete", stop, Some(&errors), || {
                self.check_delete(conn, server, &members)
            })
            .await?;
            let mut walk_again = false;
            if next == "0" && walks < 3 {
                let now =
                    retrying_counted("cluster epoch", stop, Some(&errors), || cluster_epoch(conn))
                        .await?;
                walk_again = now != epoch || errors.get() > 0;
                epoch = now;
            }
            let advanced = retrying_counted("cleanup advance", stop, Some(&errors), || {
                self.cluster_advance(conn, server, &at, &next, members.len(), walk_again)
            })
            .await?;
            let step = Step {
                done: advanced == "done",
                scanned: members.len() as u64,
                deleted,
                kept,
            };
            report.add(&step);
            on_step(&step);
            match advanced.as_str() {
                "done" => {
                    retrying_counted("cleanup finish", stop, Some(&errors), || async {
                        let _: i64 = redis::cmd("ZREM")
                            .arg(self.keys.servers())
                            .arg(server.as_str())
                            .query_async(&mut conn.clone())
                            .await?;
                        Ok(())
                    })
                    .await?;
                    count_globally(errors.get());
                    return Ok(report);
                }
                "again" => {
                    walks += 1;
                    count_globally(errors.get());
                    errors.reset();
                    tracing::info!(server_id = %server, walks, "the cluster failed over (or errors were seen) during the cleanup: walking the set once more");
                }
                _ => {}
            }
        }
    }

    async fn cluster_scan(
        &self,
        conn: &RedisConn,
        server: &ServerId,
    ) -> Result<(String, String, Vec<Vec<u8>>)> {
        let mut call = CLUSTER_SCAN.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_cleanup(server))
            .arg(self.chunk_size);
        Ok(call.invoke_async(&mut conn.clone()).await?)
    }

    async fn cluster_advance(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        at: &str,
        next: &str,
        scanned: usize,
        walk_again: bool,
    ) -> Result<String> {
        let mut call = CLUSTER_ADVANCE.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_cleanup(server))
            .arg(at)
            .arg(next)
            .arg(scanned)
            .arg(if walk_again { "1" } else { "0" });
        Ok(call.invoke_async(&mut conn.clone()).await?)
    }

    /// Check-and-delete of `users`' forward entries, one script per slot. Returns
    /// (deleted, kept).
    pub(crate) async fn check_delete(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        users: &[Vec<u8>],
    ) -> Result<(u64, u64)> {
        if users.is_empty() {
            return Ok((0, 0));
        }
        let mut calls = Vec::new();
        match self.layout {
            Layout::Hash => {
                let mut call = CHECK_DELETE.prepare_invoke();
                call.key(self.keys.registry())
                    .arg(server.as_str())
                    .arg("hash");
                for u in users {
                    call.arg(u);
                }
                calls.push(call);
            }
            Layout::Keys => {
                let mut by_slot: std::collections::HashMap<
                    redis::cluster_routing::Slot,
                    Vec<Vec<u8>>,
                > = std::collections::HashMap::new();
                for u in users {
                    let key = self.keys.user(u);
                    by_slot
                        .entry(redis::cluster_routing::Slot::for_key(&key))
                        .or_default()
                        .push(key);
                }
                for keys in by_slot.into_values() {
                    let mut call = CHECK_DELETE.prepare_invoke();
                    call.arg(server.as_str()).arg("keys");
                    for k in keys {
                        call.key(k);
                    }
                    calls.push(call);
                }
            }
        }
        // A plain loop rather than an iterator of closures: the latter trips rustc's
        // higher-ranked `Send` inference when the worker spawns this future.
        let mut totals = (0, 0);
        let mut queued = calls.iter();
        let mut in_flight = FuturesUnordered::new();
        loop {
            while in_flight.len() < CLUSTER_SLOTS_IN_FLIGHT {
                let Some(call) = queued.next() else { break };
                let mut c = conn.clone();
                in_flight.push(async move { call.invoke_async::<(u64, u64)>(&mut c).await });
            }
            let Some(reply) = in_flight.next().await else {
                break;
            };
            let (deleted, kept) = reply?;
            totals.0 += deleted;
            totals.1 += kept;
        }
        Ok(totals)
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
