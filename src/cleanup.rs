//! Cleaning one dead server: the algorithm behind a `server.dead` event.
//!
//! The work is a series of steps, each one call of `clean_step.lua` on Redis. A walk
//! starts by renaming S's reverse set `server:{S}:users` to `server:{S}:walking` (O(1));
//! each step SSCANs the next chunk of `walking` (cursor kept in `server:{S}:cleanup`) and
//! check-and-deletes each forward entry atomically. Members that arrive during the walk
//! (a zombie S, a false-positive death, a registration in two steps) land in a new
//! `users` set, which is walked next; S is clean when a step finds nothing left, and that
//! step acknowledges the event. No command ever loads the whole set, and one step costs
//! Redis about a millisecond per thousand users.
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
static RECORD_FAILURE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("record_failure.lua")));
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

/// Checks at start-up that cleanups can walk here. A cursor is trusted only with the
/// run_id of the Redis that issued it (INFO server): on a single node a Redis without one
/// (INFO refused or stripped, as by some proxies) is walked with SPOP instead, which is
/// logged; on a cluster, where the walk and the deletes cannot be one script, there is no
/// such fallback and the worker stops with this error.
pub async fn check_walkable(conn: &RedisConn) -> Result<()> {
    // On a cluster redis-rs sends INFO to every node and answers with a map of replies.
    let info: redis::RedisResult<redis::Value> = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn.clone())
        .await;
    fn texts(v: &redis::Value, out: &mut Vec<String>) {
        match v {
            redis::Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
            redis::Value::VerbatimString { text, .. } => out.push(text.clone()),
            redis::Value::Map(pairs) => pairs.iter().for_each(|(_, v)| texts(v, out)),
            redis::Value::Array(items) => items.iter().for_each(|v| texts(v, out)),
            _ => {}
        }
    }
    let has_run_id = match info {
        Ok(value) => {
            let mut replies = Vec::new();
            texts(&value, &mut replies);
            !replies.is_empty() && replies.iter().all(|t| t.contains("run_id:"))
        }
        Err(e) if crate::error::redis_error_is_retryable(&e) => return Err(e.into()),
        Err(_) => false,
    };
    match (has_run_id, conn.is_cluster()) {
        (true, _) => Ok(()),
        (false, false) => {
            tracing::warn!("INFO server is refused or gives no run_id: cleanups walk reverse sets with SPOP (no cursor to trust), which costs Redis a little more");
            Ok(())
        }
        (false, true) => Err(Error::Setting {
            name: "redis_cluster".into(),
            reason: "the cluster's nodes refuse INFO server or give no run_id; the cleanup on a \
                     cluster needs it to trust its stored cursor (allow INFO for the janitor's user)"
                .into(),
        }),
    }
}

/// Check-and-delete scripts (one per slot) of one chunk in flight at once on a cluster.
const CLUSTER_SLOTS_IN_FLIGHT: usize = 64;

/// One chunk of a cluster walk, as cluster_scan.lua returned it.
struct Chunk<'a> {
    /// The walk's number: an advance from an earlier walk is refused.
    walk: &'a str,
    /// The cursor the chunk was scanned at, and the next one.
    at: &'a str,
    next: &'a str,
    scanned: usize,
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Step {
    /// Nothing is left to walk and the server's bookkeeping is gone: clean.
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
    /// The event's entry was acknowledged by the cleanup itself (see [`Cleaner::clean_event`]).
    pub acknowledged: bool,
}

impl Report {
    fn add(&mut self, step: &Step) {
        self.steps += 1;
        self.scanned += step.scanned;
        self.deleted += step.deleted;
        self.kept += step.kept;
    }
}

/// How a single-node step walks the set (see clean_step.lua).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkMode {
    /// SSCAN from a stored cursor tied to the Redis run_id; the set is not modified.
    Scan,
    /// SPOP: no cursor and no write that takes memory (for OOM, and for a Redis whose
    /// INFO gives no run_id).
    Pop,
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

    /// Cleans `server` until nothing of it is left to walk (see [`Cleaner::clean_event`]).
    pub async fn clean(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        stop: &CancellationToken,
        on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        self.clean_event(conn, server, None, stop, on_step).await
    }

    /// Cleans `server` until its reverse set, and every member added to it meanwhile, is
    /// walked; retries through Redis outages. With `entry`, the event's stream entry is
    /// acknowledged by the cleanup itself: on one node inside the very step that finds
    /// nothing left (so no member added before the acknowledgement can be missed); on a
    /// cluster, where the stream is in another slot, right after that step, and the set is
    /// checked once more after the acknowledgement (a member that raced it is walked then).
    /// Returns [`Error::Cancelled`] if `stop` fires first (the state stays consistent and
    /// resumable); `on_step` sees every step as it completes.
    pub async fn clean_event(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        entry: Option<&str>,
        stop: &CancellationToken,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        if conn.is_cluster() {
            return self
                .clean_on_cluster(conn, server, entry, stop, on_step)
                .await;
        }
        // Once Redis says OOM, the rest of this cleanup walks in the mode that takes no
        // memory: the cleanup is what frees it.
        let oom = std::sync::atomic::AtomicBool::new(false);
        let step = || {
            retrying_counted("cleanup step", stop, self.errors.as_ref(), || async {
                let mode = if oom.load(std::sync::atomic::Ordering::Relaxed) {
                    WalkMode::Pop
                } else {
                    WalkMode::Scan
                };
                let result = self.step_with(conn, server, mode, entry).await;
                match result {
                    Err(Error::Redis(e)) if e.code() == Some("OOM") && mode == WalkMode::Scan => {
                        if !oom.swap(true, std::sync::atomic::Ordering::Relaxed) {
                            tracing::warn!(server_id = %server, "Redis is out of memory: walking on with SPOP, which needs none");
                        }
                        self.step_with(conn, server, WalkMode::Pop, entry).await
                    }
                    other => other,
                }
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

    /// How far the cleanup of `server` has got: `Some(members scanned)` while under
    /// way (0 before the first step), `None` once the server is clean (nothing of its
    /// reverse set left to walk).
    pub async fn progress(&self, conn: &RedisConn, server: &ServerId) -> Result<Option<u64>> {
        let mut left = self.keys.server_members_left(server).to_vec();
        if conn.is_cluster() {
            // The reverse-index sweep, which sets members aside, is single-node only, and
            // the cluster walk does not read `moved`.
            left.pop();
        }
        let (exists, scanned): (u64, Option<u64>) = redis::pipe()
            .exists(&left)
            .hget(self.keys.server_cleanup(server), "scanned")
            .query_async(&mut conn.clone())
            .await?;
        Ok((exists > 0).then_some(scanned.unwrap_or(0)))
    }

    /// Notes why cleaning `server` failed, in its progress record, so that the worker
    /// that finally dead-letters the event can say why (best effort). Only while the
    /// cleanup is unfinished: a note written after another worker finished would
    /// re-create the record, and nothing would ever remove it.
    pub async fn record_failure(&self, conn: &RedisConn, server: &ServerId, error: &str) {
        let mut call = RECORD_FAILURE.prepare_invoke();
        for key in self.keys.server_members_left(server) {
            call.key(key);
        }
        call.key(self.keys.server_cleanup(server)).arg(error);
        let _: redis::RedisResult<i64> = call.invoke_async(&mut conn.clone()).await;
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
    /// reaching this code: the cluster's `current_epoch` at the start of each walk is
    /// stored with the cursor, and a walk at whose end the epoch differs (every failover
    /// bumps it), or during which this worker saw errors, is made again (up to 3 times),
    /// by whichever worker holds the cleanup by then.
    async fn clean_on_cluster(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        entry: Option<&str>,
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
        let mut epoch =
            retrying_counted("cluster epoch", stop, Some(&errors), || cluster_epoch(conn)).await?;
        loop {
            if stop.is_cancelled() {
                count_globally(errors.get());
                return Err(Error::Cancelled);
            }
            let (walk, at, next, members) =
                retrying_counted("cleanup scan", stop, Some(&errors), || {
                    self.cluster_scan(conn, server, epoch)
                })
                .await?;
            let (deleted, kept) = retrying_counted("cleanup delete", stop, Some(&errors), || {
                self.check_delete(conn, server, &members)
            })
            .await?;
            if next == "0" {
                epoch =
                    retrying_counted("cluster epoch", stop, Some(&errors), || cluster_epoch(conn))
                        .await?;
            }
            let saw_errors = errors.get() > 0;
            let chunk = Chunk {
                walk: &walk,
                at: &at,
                next: &next,
                scanned: members.len(),
            };
            let advanced = retrying_counted("cleanup advance", stop, Some(&errors), || {
                self.cluster_advance(conn, server, &chunk, epoch, saw_errors)
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
                    count_globally(errors.get());
                    errors.reset();
                    // The stream is in another slot: the acknowledgement follows the step.
                    if let (Some(id), false) = (entry, report.acknowledged) {
                        retrying_counted("acknowledging", stop, self.errors.as_ref(), || {
                            crate::stream::ack(conn, &self.keys, id)
                        })
                        .await?;
                        report.acknowledged = true;
                    }
                    // A member added between the last step and the acknowledgement (a
                    // zombie, a registration in two steps) is walked now. S leaves
                    // `servers` only after that: should this worker die before, the
                    // reconciler still sees S and reports it again.
                    let left = retrying_counted("cleanup check", stop, None, || {
                        self.progress(conn, server)
                    })
                    .await?;
                    if left.is_none() {
                        self.leave_servers(conn, server, stop).await?;
                        return Ok(report);
                    }
                    tracing::info!(server_id = %server, "members were added to the reverse set as the cleanup finished: walking them");
                }
                "again" => {
                    count_globally(errors.get());
                    errors.reset();
                    tracing::info!(server_id = %server, "the cluster failed over (or errors were seen) during the walk: walking the set once more");
                }
                _ => {}
            }
        }
    }

    /// Once a cluster cleanup is done and acknowledged: S leaves `servers`.
    async fn leave_servers(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        stop: &CancellationToken,
    ) -> Result<()> {
        retrying_counted("cleanup finish", stop, self.errors.as_ref(), || async {
            let _: i64 = redis::cmd("ZREM")
                .arg(self.keys.servers())
                .arg(server.as_str())
                .query_async(&mut conn.clone())
                .await?;
            Ok(())
        })
        .await
    }

    async fn cluster_scan(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        epoch: u64,
    ) -> Result<(String, String, String, Vec<Vec<u8>>)> {
        let mut call = CLUSTER_SCAN.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_cleanup(server))
            .arg(self.chunk_size)
            .arg(epoch);
        Ok(call.invoke_async(&mut conn.clone()).await?)
    }

    async fn cluster_advance(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        chunk: &Chunk<'_>,
        epoch: u64,
        saw_errors: bool,
    ) -> Result<String> {
        let mut call = CLUSTER_ADVANCE.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_cleanup(server))
            .arg(chunk.walk)
            .arg(chunk.at)
            .arg(chunk.next)
            .arg(chunk.scanned)
            .arg(epoch)
            .arg(if saw_errors { "1" } else { "0" });
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

    /// One call of the step script, walking with SSCAN (see [`Cleaner::step_with`]).
    pub async fn step(&self, conn: &RedisConn, server: &ServerId) -> Result<Step> {
        self.step_with(conn, server, WalkMode::Scan, None).await
    }

    /// One call of the step script (clean_step.lua) in `mode`; with `entry`, the step that
    /// finds nothing left acknowledges that entry.
    pub async fn step_with(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        mode: WalkMode,
        entry: Option<&str>,
    ) -> Result<Step> {
        let layout = match self.layout {
            Layout::Hash => "hash",
            Layout::Keys => "keys",
        };
        let mut call = CLEAN_STEP.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_moved(server))
            .key(self.keys.server_cleanup(server))
            .key(self.keys.servers())
            .key(self.keys.registry())
            .key(self.keys.events())
            .arg(server.as_str())
            .arg(self.chunk_size)
            .arg(layout)
            .arg(self.keys.user_key_prefix())
            .arg(match mode {
                WalkMode::Scan => "scan",
                WalkMode::Pop => "pop",
            })
            .arg(crate::keys::GROUP)
            .arg(entry.unwrap_or(""));
        let (done, scanned, deleted, kept, _mode): (i64, u64, u64, u64, String) =
            call.invoke_async(&mut conn.clone()).await?;
        Ok(Step {
            done: done == 1,
            scanned,
            deleted,
            kept,
        })
    }
}
