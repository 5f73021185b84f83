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

//! Files: this one holds the [`Cleaner`] and what both topologies share; `single.rs` the
//! single-node walk (clean_step.lua), `cluster.rs` the cluster walk (cluster_scan.lua,
//! cluster_advance.lua). The check-and-delete of forward entries is [`crate::forward`].

mod cluster;
pub(crate) mod limiter;
mod single;

use std::sync::{Arc, LazyLock};

use tokio_util::sync::CancellationToken;

use crate::{
    config::Layout,
    conn::RedisConn,
    error::{Error, Result},
    event::ServerId,
    keys::Keys,
};

static RECORD_FAILURE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("record_failure.lua")));

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

/// Checks at start-up that this Redis runs Lua scripts: every delete is a script (the
/// atomic check-and-delete), so a service that disables or renames EVAL/EVALSHA (some
/// managed services and proxies can) would dead-letter every event. The worker stops with
/// this error instead, naming what is missing; on a cluster, also that scripts may
/// declare flags (Redis 7.0+). Transient states are returned as they are (the caller
/// waits them out). The probes name `key` (one of the janitor's keys; they do not touch
/// it), so that on a cluster they go to that key's master: a script without keys may be
/// sent to a replica, which refuses it as a write.
pub async fn check_scripting(conn: &RedisConn, key: &str) -> Result<()> {
    static PROBE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new("return 1"));
    match PROBE
        .prepare_invoke()
        .key(key)
        .invoke_async::<i64>(&mut conn.clone())
        .await
    {
        Ok(_) => {}
        Err(e) if crate::error::redis_error_is_retryable(&e) => return Err(e.into()),
        Err(e) => {
            return Err(Error::Protocol(format!(
                "this Redis refuses Lua scripts ({e}): the janitor needs EVAL and EVALSHA (and \
                 SCRIPT LOAD) under their own names, since every delete is an atomic script"
            )))
        }
    }
    if !conn.is_cluster() {
        return Ok(());
    }
    // The cluster walk's scripts declare flags (`#!lua flags=...`), which Redis before
    // 7.0 refuses to load: every cleanup would fail and be dead-lettered.
    static FLAGGED: LazyLock<redis::Script> =
        LazyLock::new(|| redis::Script::new("#!lua flags=allow-oom\nreturn 1"));
    match FLAGGED
        .prepare_invoke()
        .key(key)
        .invoke_async::<i64>(&mut conn.clone())
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if crate::error::redis_error_is_retryable(&e) => Err(e.into()),
        Err(e) => Err(Error::Protocol(format!(
            "this Redis Cluster refuses scripts with flags ({e}): the cleanup on a cluster \
             needs Redis 7.0 or later (or Valkey 7.2 or later)"
        ))),
    }
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
    /// `users.evicted` entries written to the evictions stream by this step.
    pub announced: u64,
    /// Users in those entries.
    pub announced_users: u64,
    /// Time the step's script ran inside Redis, in microseconds (on a cluster, the
    /// longest of the chunk's check-and-delete scripts).
    pub execution_us: u64,
    /// Users that a master's check-and-delete script did not check (their slot moved or
    /// is moving, or the script failed), checked by the per-slot scripts instead
    /// (cluster, layout `keys`; 0 otherwise).
    pub rechecked: u64,
}

/// The `server.dead` a cleanup answers: its stream entry, which the cleanup acknowledges,
/// and its `event_id`, which the evictions stream carries.
#[derive(Debug, Clone, Copy)]
pub struct EventRef<'a> {
    pub entry: &'a str,
    pub event_id: &'a str,
}

/// Totals of one cleanup, as seen by this worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    pub steps: u64,
    /// Members visited, over every walk of the set.
    pub scanned: u64,
    pub deleted: u64,
    pub kept: u64,
    /// `users.evicted` entries written.
    pub announced: u64,
    /// The event's entry was acknowledged by the cleanup itself (see [`Cleaner::clean_event`]).
    pub acknowledged: bool,
}

impl Report {
    fn merge(&mut self, other: &Report) {
        self.steps += other.steps;
        self.scanned += other.scanned;
        self.deleted += other.deleted;
        self.kept += other.kept;
        self.announced += other.announced;
        self.acknowledged |= other.acknowledged;
    }

    fn add(&mut self, step: &Step) {
        self.steps += 1;
        self.scanned += step.scanned;
        self.deleted += step.deleted;
        self.kept += step.kept;
        self.announced += step.announced;
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
    /// Lifetime of the fence each cleanup records first (see [`crate::fence`]).
    fence_ttl_ms: u64,
    /// Lifetime of the fence of a server the registry does not know, and the counter of
    /// such verdicts, when set (see [`crate::fence`]).
    fence_unknown_ttl_ms: u64,
    unknown_verdicts: Option<prometheus::IntCounter>,
    /// Counts failed step attempts (Redis errors), when set.
    errors: Option<prometheus::IntCounter>,
    /// The process's window of steps in flight, shared by its cleanups (none when
    /// `latency_target_ms` is 0). See [`limiter`].
    limiter: Option<Arc<limiter::Limiter>>,
    /// The data formats this cleaner works under: each step is refused (error
    /// [`Error::Format`]) when the format in use, or the one its progress record was
    /// written under, is not one of them. See [`crate::format`].
    build: crate::format::Build,
    /// On a cluster, does the end of a walk wait until the replicas hold its deletes (the
    /// `cluster_replica_wait` setting)?
    replica_wait: bool,
    /// Observes how long each such wait took, when set.
    replica_wait_seconds: Option<prometheus::Histogram>,
}

/// The fence's lifetime when none is set: the `fence_ttl_ms` default, 7 days.
pub const DEFAULT_FENCE_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// The lifetime of the fence of a server the registry does not know, when none is set:
/// the `fence_unknown_ttl_ms` default, 10 minutes.
pub const DEFAULT_FENCE_UNKNOWN_TTL_MS: u64 = 10 * 60 * 1000;

impl Cleaner {
    pub fn new(keys: Keys, layout: Layout, chunk_size: usize, chunks_in_flight: usize) -> Self {
        Cleaner {
            keys,
            layout,
            chunk_size,
            chunks_in_flight: chunks_in_flight.max(1),
            fence_ttl_ms: DEFAULT_FENCE_TTL_MS,
            fence_unknown_ttl_ms: DEFAULT_FENCE_UNKNOWN_TTL_MS,
            unknown_verdicts: None,
            errors: None,
            limiter: None,
            build: crate::format::Build::compiled(),
            replica_wait: true,
            replica_wait_seconds: None,
        }
    }

    /// On a cluster, the end of a walk waits until the replicas hold its deletes (`true`,
    /// the default) or ends without waiting (the `cluster_replica_wait` setting).
    pub fn replica_wait(mut self, wait: bool) -> Self {
        self.replica_wait = wait;
        self
    }

    /// Works under the formats of `build` (default: this build as compiled).
    pub fn format(mut self, build: crate::format::Build) -> Self {
        self.build = build;
        self
    }

    /// Sends steps through `limiter` (shared by every clone of this cleaner, so by every
    /// cleanup of the process): single-node steps, and on a cluster each chunk's
    /// check-and-delete; `None` sends them as they come.
    pub fn limited(mut self, limiter: Option<Arc<limiter::Limiter>>) -> Self {
        self.limiter = limiter;
        self
    }

    /// Fences live `ttl_ms` (the `fence_ttl_ms` setting).
    pub fn fence_ttl(mut self, ttl_ms: u64) -> Self {
        self.fence_ttl_ms = ttl_ms;
        self
    }

    /// Fences of servers the registry does not know live `ttl_ms` (the
    /// `fence_unknown_ttl_ms` setting; 0: `fence_ttl_ms`, as any other), and each such
    /// verdict is counted in `counter`.
    pub fn fence_unknown(mut self, ttl_ms: u64, counter: prometheus::IntCounter) -> Self {
        self.fence_unknown_ttl_ms = ttl_ms;
        self.unknown_verdicts = Some(counter);
        self
    }

    /// Observes in `seconds` how long the end of each cluster walk waited for the
    /// replicas.
    pub fn timing_replica_waits(mut self, seconds: prometheus::Histogram) -> Self {
        self.replica_wait_seconds = Some(seconds);
        self
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

    /// Fences `server` (before any delete: see [`crate::fence`]), then cleans it until its
    /// reverse set, and every member added to it meanwhile, is walked; retries through
    /// Redis outages. With `entry`, the event's stream entry is
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
        event: Option<EventRef<'_>>,
        stop: &CancellationToken,
        on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        let entry = event.map(|e| e.entry);
        let event_id = event.map_or("", |e| e.event_id);
        // The verdict first: from here on the protocol refuses S's writes.
        if self.fence(conn, server, entry, stop, false).await? {
            return self
                .walk(conn, server, event_id, entry, stop, on_step)
                .await;
        }
        // Out of memory: no write can take memory, so S's writes through the protocol are
        // refused by Redis anyway. Clean first (the cleanup frees memory), then record the
        // fence, waiting out the OOM if need be, and acknowledge only after it stands,
        // walking once more what arrived meanwhile.
        tracing::warn!(server_id = %server, "Redis is out of memory: cleaning first, fencing as soon as memory allows; the event is acknowledged only once the fence stands");
        let mut on_step = on_step;
        let mut report = self
            .walk(conn, server, event_id, None, stop, &mut on_step)
            .await?;
        self.fence(conn, server, entry, stop, true).await?;
        let rest = self
            .walk(conn, server, event_id, entry, stop, on_step)
            .await?;
        report.merge(&rest);
        Ok(report)
    }

    /// Records the fence of `server` (see [`crate::fence`]), retrying through transient
    /// states. Ok(false) if Redis is out of memory and `wait_out_oom` is false. With
    /// `wait_out_oom` (the fence recorded after a walk under OOM), the fence always gets
    /// the full lifetime: the walk has emptied what would show that the registry knew
    /// the server.
    async fn fence(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        entry: Option<&str>,
        stop: &CancellationToken,
        wait_out_oom: bool,
    ) -> Result<bool> {
        let lifetimes = crate::fence::Lifetimes {
            ttl_ms: self.fence_ttl_ms,
            unknown_ttl_ms: if wait_out_oom {
                0
            } else {
                self.fence_unknown_ttl_ms
            },
        };
        let recorded = crate::retry::retrying_counted(
            "recording the fence",
            stop,
            self.errors.as_ref(),
            || async {
                match crate::fence::record_verdict(conn, &self.keys, server, entry, lifetimes).await
                {
                    Err(Error::Redis(e)) if !wait_out_oom && e.code() == Some("OOM") => Ok(None),
                    other => other.map(Some),
                }
            },
        )
        .await?;
        if recorded.is_some_and(|r| r.unknown) {
            if let Some(counter) = &self.unknown_verdicts {
                counter.inc();
            }
            tracing::info!(
                server_id = %server,
                fence_ms = lifetimes.unknown_ttl_ms,
                "verdict on a server the registry does not know (no liveness key, no users, not in `servers`): \
                 fenced for fence_unknown_ttl_ms only, not indexed; does monitoring name servers of another registry?"
            );
        }
        Ok(recorded.is_some())
    }

    /// The walk of [`Cleaner::clean_event`], once the fence is recorded. Evictions carry
    /// `event_id`; with `entry`, the walk's end acknowledges it.
    async fn walk(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        event_id: &str,
        entry: Option<&str>,
        stop: &CancellationToken,
        on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        if conn.is_cluster() {
            return self
                .clean_on_cluster(conn, server, event_id, entry, stop, on_step)
                .await;
        }
        self.clean_on_node(conn, server, event_id, entry, stop, on_step)
            .await
    }

    /// How far the cleanup of `server` has got: `Some(members scanned)` while under
    /// way (0 before the first step), `None` once the server is clean (nothing of its
    /// reverse set left to walk).
    pub async fn progress(&self, conn: &RedisConn, server: &ServerId) -> Result<Option<u64>> {
        let left = self.keys.server_members_left(server);
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
}
